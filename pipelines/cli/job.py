"""The training job: launch (torchrun on this machine, or the job on the cluster), and render-job and preflight,
which describe or check the job a cluster run creates, from the same flags or from a compiled pipeline."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from common.errors import InputError, StepFailed
from components.evaluate_checkpoint.resources import EvaluationResources
from pipelines import CLUSTER_DEFAULTS
from pipelines.cli.args import (
    add_cluster_args,
    add_deadline_args,
    add_platform_args,
    add_storage_args,
    command,
    key_value,
    note_given_flags,
    positive_int,
    use_defaults,
)
from pipelines.cli.run_settings import add_endpoint_arg, add_train_args, launch_config
from pipelines.package import Package, step_config

if TYPE_CHECKING:
    from components.launch_training.config import LaunchConfig

# The imports inside functions are heavy (boto3, kubernetes): only the command that runs takes them, and
# `hyperpod-pretrain --help` loads none.

EXAMPLES = {  # each command's example, ending its --help (a test parses each)
    "launch": "launch --storage-root local-runs --dataset stdlib-email --run-id try-1 --max-steps 50",
    "render-job": "render-job --image 123456789012.dkr.ecr.us-west-2.amazonaws.com/hyperpod-pretrain-trainer:v0.2.0 "
    "--nnodes 4",
    "preflight": "preflight --image 123456789012.dkr.ecr.us-west-2.amazonaws.com/hyperpod-pretrain-trainer:v0.2.0 "
    "--nnodes 4 --namespace ml-team",
}


def add_commands(sub: Any) -> None:
    """launch, render-job and preflight: one set of flags, in the groups a reader of each looks for first."""
    for name, func, backend, helptext in (  # the cluster commands default to what a cluster run of the pipeline uses
        ("launch", cmd_launch, "local", "train: torchrun locally, or a PyTorchJob or TrainJob on the cluster"),
        (
            "render-job",
            cmd_render_job,
            "kubernetes",
            "print the job (PyTorchJob or TrainJob) the kubernetes backend creates",
        ),
        ("preflight", cmd_preflight, "kubernetes", "check that the cluster can run the job: exit 1 on a failed check"),
    ):
        p = command(sub, name, helptext, EXAMPLES[name])
        # A platform engineer's flags first (argparse shows groups in the order they are made): with --pipeline-file,
        # the job is the compiled pipeline's, and the rest are not needed.
        first = (
            p.add_argument_group("the compiled pipeline", "the job a submission of it creates")
            if (backend == "kubernetes")
            else p
        )
        if backend == "kubernetes":
            add_package_args(first, "render" if name == "render-job" else "check")
        if name == "preflight":
            first.add_argument("--warn-only", action="store_true", help="report failed checks, but exit 0")
            first.add_argument(
                "--json", action="store_true", help="print one JSON object instead of the Markdown report"
            )
        without = " (without --pipeline-file)" if backend == "kubernetes" else ""
        add_cluster_args(p.add_argument_group("cluster" + without, "where the kubernetes backend runs the job"))
        platform = p.add_argument_group("platform" + without, "the platform team's settings, compiled in")
        add_platform_args(platform, mount_path="", mount_help="default: the storage root")
        run = p.add_argument_group("run" + without, "which run, on which data, on what")
        run.add_argument(
            "--backend",
            choices=["local", "kubernetes"],
            default=backend,
            help="local: torchrun on this machine; kubernetes: a job on the cluster",
        )
        add_storage_args(run, mixture=True)
        run.add_argument("--nnodes", type=positive_int, default=1, help="nodes (the minimum, when elastic)")
        run.add_argument("--snapshot", default="", help="the dataset snapshot to train on (default: the current one)")
        add_deadline_args(
            p.add_argument_group("deadlines" + without, "how long each phase may take before the step fails")
        )
        add_train_args(p.add_argument_group("training" + without, "the trainer's settings"))
        add_endpoint_arg(p.add_argument_group("S3" + without))
        p.set_defaults(func=func)
        if backend == "kubernetes":
            use_defaults(p, {**CLUSTER_DEFAULTS, "backend": "kubernetes"})
            note_given_flags(p)


def cmd_launch(args: argparse.Namespace) -> int:
    from components.launch_training.core import launch

    result = launch(launch_config(args))
    print(json.dumps(asdict(result), indent=2))
    return 0


def cmd_render_job(args: argparse.Namespace) -> int:
    _, job = job_config(args, "launch-pytorchjob").checked_job()
    print(yaml.safe_dump(job, sort_keys=False), end="")
    return 0


def cmd_preflight(args: argparse.Namespace) -> int:
    from components.preflight.core import preflight
    from components.preflight.result import failure_message

    config, warn_only, evaluation = preflight_settings(args)
    result = preflight(config, warn_only=warn_only, evaluation=evaluation)
    print(json.dumps(result.to_json(), indent=2) if args.json else result.markdown())
    if not result.passed:
        raise StepFailed(failure_message(result).removeprefix("preflight failed: "))  # the CLI says "failed: "
    return 0


# Beside --pipeline-file, the flags that do not set the job: the package and its --param values set it.
PACKAGE_FLAGS = frozenset({"--pipeline-file", "--param", "--pipeline-run-id", "--warn-only", "--json"})


def add_package_args(p: argparse.ArgumentParser, verb: str) -> None:
    """render-job's and preflight's job as a submission of a compiled pipeline would create it."""
    p.add_argument(
        "--pipeline-file",
        default="",
        metavar="PATH",
        help=f"{verb} the job a submission of this compiled pipeline creates: its defaults and compiled "
        "platform settings, overridden by --param, typed and checked as submit does. The flags that set "
        "the job are refused beside it (give them as --param: --param nnodes=4, not --nnodes 4); "
        "--pipeline-run-id stands for the KFP run's id (default: example). Staging's outputs are known "
        "only once it ran: the job trains on the dataset's current snapshot, with no warm "
        "start",
    )
    p.add_argument(
        "--param",
        type=key_value,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a parameter of --pipeline-file, as submit takes it (repeatable)",
    )


def job_config(args: argparse.Namespace, step: str) -> LaunchConfig:
    """render-job's and preflight's job: set by the flags (a cluster run's defaults), or with --pipeline-file, the
    config the package's `step` makes for a submission with the --param values."""
    inputs = submitted_inputs(args, step)
    return launch_config(args) if inputs is None else step_config(inputs)


def submitted_inputs(args: argparse.Namespace, step: str) -> dict[str, Any] | None:
    """With --pipeline-file, what its `step` is called with in a submission with the --param values; None without
    (the flags set the job)."""
    if not args.pipeline_file:
        if args.param:
            raise InputError(
                "--param sets a parameter of --pipeline-file: give the file too (without it, the flags set the job)"
            )
        return None
    mixed = sorted(args.given_flags - PACKAGE_FLAGS)
    if mixed:
        raise InputError(
            f"{mixed[0]}: with --pipeline-file, the package's defaults and --param values set the job "
            "(and its platform settings are compiled in): give pipeline parameters as --param "
            "KEY=VALUE"
        )
    run = args.pipeline_run_id or str(CLUSTER_DEFAULTS["run_id"])
    return Package.load(Path(args.pipeline_file)).submitted_inputs(args.param, step, run)


def preflight_settings(args: argparse.Namespace) -> tuple[LaunchConfig, bool, EvaluationResources | None]:
    """The preflight's job, whether it only warns (--warn-only, or with --pipeline-file the preflight step's own
    warn_only, the preflight_warn_only parameter, as a run would check) and the evaluate step's resources: with
    --pipeline-file those compiled into it, else None (the default compile's)."""
    inputs = submitted_inputs(args, "preflight")
    if inputs is None:
        return launch_config(args), args.warn_only, None
    evaluation = inputs.get("evaluation")  # a package compiled before the step had it: the default compile's
    return (
        step_config(inputs),
        args.warn_only or inputs.get("warn_only") is True,
        EvaluationResources.from_dict(evaluation) if isinstance(evaluation, dict) else None,
    )
