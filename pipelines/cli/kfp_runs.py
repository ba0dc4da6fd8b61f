"""Runs on KFP, through its API: submit (a run of the compiled pipeline) and schedule (a recurring run)."""

from __future__ import annotations

import argparse
import logging
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from common.errors import InputError, StepFailed
from pipelines import COMPILED_PIPELINE
from pipelines.cli.args import command, key_value, positive_int
from pipelines.package import Package

# The imports inside functions are heavy (kfp): only the command that runs takes them, and `hyperpod-pretrain --help`
# loads none.

log = logging.getLogger("hyperpod-pretrain")

EXAMPLES = {  # each command's example, ending its --help (a test parses each)
    "submit": "submit --host http://localhost:8080 --param source=s3://my-bucket/corpus/ --param nnodes=4 --wait",
    "schedule": "schedule --host http://localhost:8080 --name nightly --cron '0 0 2 * * *' "
    "--param source=s3://my-bucket/corpus/",
}


def add_commands(sub: Any) -> None:
    add_submit(sub)
    add_schedule(sub)


def add_kfp_args(p: argparse.ArgumentParser) -> None:
    """Where the KFP API is, and the pipeline to upload."""
    p.add_argument(
        "--host",
        default="",
        help="the KFP API, e.g. http://localhost:8080 (default: "
        "KF_PIPELINES_ENDPOINT, else in-cluster or the current kubeconfig context)",
    )
    p.add_argument(
        "--namespace",
        default="",
        help="the profile namespace of a multi-user KFP: its experiment, runs and recurring runs go there",
    )
    p.add_argument(
        "--token-file",
        default="",
        metavar="PATH",
        help="a bearer token for a multi-user KFP (a service account's, with the audience "
        "pipelines.kubeflow.org: kubectl create token SA -n NS --audience pipelines.kubeflow.org); "
        "default: KF_PIPELINES_SA_TOKEN_PATH, or the pod's projected token when there",
    )
    p.add_argument("--experiment", default="hyperpod-pretrain", help="created when missing")
    p.add_argument("--pipeline-file", default=str(COMPILED_PIPELINE), help="the compiled pipeline to upload")
    p.add_argument("--pipeline-name", default="hyperpod-pretrain", help="the pipeline's name in KFP")


def add_submit(sub: Any) -> None:
    """submit: a run of the compiled pipeline."""
    p = command(
        sub, "submit", "upload the compiled pipeline (once per content) and start a run on KFP", EXAMPLES["submit"]
    )
    add_kfp_args(p)
    p.add_argument("--run-name", default="", help="default: the pipeline's name and the UTC time")
    p.add_argument(
        "--param",
        type=key_value,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a pipeline parameter, typed by the pipeline (lists, dicts as JSON; repeatable); the steps' "
        "own checks of the run's values run here first",
    )
    p.add_argument("--wait", action="store_true", help="wait for the run to finish: exit 0 only if it succeeded")
    p.add_argument("--wait-timeout-s", type=positive_int, default=7 * 24 * 3600, help="with --wait: give up after this")
    p.add_argument("--poll-s", type=float, default=15.0, help="seconds between checks of the run's state")
    p.set_defaults(func=cmd_submit)


def cmd_submit(args: argparse.Namespace) -> int:
    from pipelines import remote

    package = Path(args.pipeline_file)
    parameters = Package.load(package).checked(args.param)  # typed, and taken by every step, before any call
    run_name = args.run_name or f"{args.pipeline_name} {datetime.now(UTC):%Y-%m-%d %H:%M:%S}"
    with remote.api_errors(f"submitting {package}", args.namespace, args.token_file):
        client, ui = remote.connect(args.host, args.namespace, args.token_file)
        version = remote.ensure_pipeline_version(client, package, args.pipeline_name)
        experiment = remote.experiment_id(client, args.experiment, args.namespace)
        run_id = remote.submit_run(client, version, experiment, run_name, parameters)
        print(
            f"run {run_name!r} created ({'new' if version.uploaded else 'existing'} version {version.name}): "
            f"{remote.run_link(ui, run_id)}",
            flush=True,
        )
        if not args.wait:
            return 0
        run = remote.wait_for_run(client, run_id, args.wait_timeout_s, args.poll_s)
    print(f"run {run_name!r} {run.state}: {remote.run_link(ui, run_id)}")
    if run.state == "FAILED":
        for line in remote.failure_lines(run, package):
            log.error("%s", line)
    if run.state != "SUCCEEDED":
        summary = remote.summary_path(package, parameters, run_id)
        raise StepFailed(f"run {run_id} ended {run.state}; its summary: {summary}")
    return 0


def add_schedule(sub: Any) -> None:
    """schedule: a recurring run, made, paused, resumed or deleted."""
    p = command(
        sub, "schedule", "create a recurring run on KFP, or disable, enable or delete one", EXAMPLES["schedule"]
    )
    add_kfp_args(p)
    p.add_argument("--name", required=True, help="the recurring run's name")
    p.add_argument("--cron", default="", help="6 fields, seconds first: '0 0 2 * * *' is 02:00 every day")
    p.add_argument(
        "--param",
        type=key_value,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a pipeline parameter, typed by the pipeline and checked as submit's (repeatable)",
    )
    action = p.add_mutually_exclusive_group()
    action.add_argument("--disable", action="store_true", help="pause the recurring run --name")
    action.add_argument("--enable", action="store_true", help="resume the recurring run --name")
    action.add_argument("--delete", action="store_true", help="delete the recurring run --name")
    p.set_defaults(func=cmd_schedule)


def cmd_schedule(args: argparse.Namespace) -> int:
    from pipelines import remote

    action = "disable" if args.disable else "enable" if args.enable else "delete" if args.delete else "create"
    if action == "create":
        if not args.cron:
            raise InputError("--cron is required to create a recurring run (or give --disable, --enable or --delete)")
        cron = remote.check_cron(args.cron)
        package = Path(args.pipeline_file)
        parameters = Package.load(package).checked(args.param)  # typed, and taken by every step, before any call
    elif args.cron or args.param:
        raise InputError(f"--{action} takes only --name (and --experiment): --cron and --param are for creating one")
    with remote.api_errors(f"{action} recurring run {args.name!r}", args.namespace, args.token_file):
        client, ui = remote.connect(args.host, args.namespace, args.token_file)
        experiment = remote.experiment_id(client, args.experiment, args.namespace, create=action == "create")
        existing = remote.find_recurring_run(client, args.name, experiment, args.namespace)
        if action == "create":
            if existing:
                link = remote.recurring_run_link(ui, existing)
                raise InputError(
                    f"--name {args.name!r}: a recurring run of that name exists ({link}): --delete it "
                    "first or pick another name"
                )
            version = remote.ensure_pipeline_version(client, package, args.pipeline_name)
            created = remote.create_recurring_run(client, version, experiment, args.name, cron, parameters)
            print(
                f"recurring run {args.name!r} created ({cron}, one run at a time, no catch-up): "
                f"{remote.recurring_run_link(ui, created)}"
            )
            return 0
        if existing is None:
            raise InputError(f"--name {args.name!r}: no recurring run of that name in experiment {args.experiment!r}")
        {
            "disable": client.disable_recurring_run,
            "enable": client.enable_recurring_run,
            "delete": client.delete_recurring_run,
        }[action](existing)
    print(f"recurring run {args.name!r} {action}d: {remote.recurring_run_link(ui, existing)}")
    return 0
