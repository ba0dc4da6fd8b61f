"""The run's settings as flags: the trainer's, generated from their declarations (trainer/config.py; a resume fills
those left out from the run's own record: fill_train_args), and what `launch`, `render-job`, `preflight` and
`run-local` make of them (launch_config, run_local_arguments)."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from common.errors import InputError
from components.run_summary.core import resolve_run_id
from components.stage_data.sources import DEFAULT_EXCLUDE
from pipelines.cli.args import DEMO_INCLUDE, SOURCE_INCLUDE, platform_from_args, positive_int
from pipelines.local_run import default_corpus, new_run_id
from trainer.config import (
    LAUNCHER,
    RESUMED_SETTINGS,
    SETTING,
    SPECS,
    TRAIN_DEFAULTS,
    flag_arguments,
    flag_of,
    run_settings,
)
from trainer.layout import RunPaths
from trainer.tracking import check_tracking_uri

if TYPE_CHECKING:
    from components.launch_training.config import LaunchConfig

# The imports inside functions are heavy (boto3, by the launcher's core): only the command that runs takes them, and
# `hyperpod-pretrain --help` loads none.

log = logging.getLogger("hyperpod-pretrain")

# The trainer's settings a run chooses, as trainer/config.py declares them: each one a flag here.
RUN_SETTINGS = run_settings(SETTING, LAUNCHER)


def add_train_args(p: argparse.ArgumentParser) -> None:
    """The trainer's settings a run chooses, each a flag parsed as the trainer parses it. Those a resume keeps
    (RESUMED_SETTINGS) default to None, filled by fill_train_args: the resumed run's recorded value, else the
    trainer's default (which the help shows)."""
    p.add_argument("--nproc-per-node", type=positive_int, default=2, help="processes (GPUs) per node")
    for name in RUN_SETTINGS:
        spec = SPECS[name]
        resumed = name in RESUMED_SETTINGS
        shown = "none" if spec.default == "" else spec.default
        said = f"default: {shown}; a resume: the run's own" if resumed else f"default: {shown}"
        arguments = flag_arguments(name, f"{spec.metadata['run_help']} ({said})".replace("%", "%%"))
        p.add_argument(flag_of(name), default=None if resumed else spec.default, **arguments)


def tracking_uri(text: str) -> str:
    try:
        return check_tracking_uri(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def fill_train_args(args: argparse.Namespace, resumed: RunPaths | None) -> None:
    """Each of RESUMED_SETTINGS the command line left out (None): the value the `resumed` run recorded in its
    config.json, else the trainer's default; so a resume trains on as the run did, not on the defaults, which
    the trainer would refuse (another architecture) or take for a schedule change. A run that holds a checkpoint
    (or a config.json) and whose config.json is missing or unreadable: InputError, one line. A run with neither
    (never ran here: the caller says so) is given the defaults."""
    recorded: dict[str, Any] = {}
    if resumed is not None and (resumed.config.exists() or resumed.has_checkpoint()):
        try:
            recorded = json.loads(resumed.config.read_text())["trainer"]
            if not isinstance(recorded, dict):
                raise TypeError(f"its 'trainer' is a {type(recorded).__name__}, not an object")
        except FileNotFoundError:
            raise InputError(
                f"run {resumed.root.name!r} holds a checkpoint to resume, but not {resumed.config}, "
                "which records its settings: the run directory is incomplete"
            ) from None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise InputError(
                f"run {resumed.root.name!r}: its settings in {resumed.config} are unreadable "
                f"({type(exc).__name__}: {exc})"
            ) from None
    if getattr(args, "init_from_model", None) and args.preset is not None:
        raise InputError(
            f"--preset {args.preset} and --init-from-model both choose the architecture: leave --preset "
            "out (the model's config.json gives it)"
        )
    taken = []
    for name in RESUMED_SETTINGS:
        if getattr(args, name) is None:
            setattr(args, name, recorded.get(name, TRAIN_DEFAULTS[name]))
            taken += [f"{name} {getattr(args, name)}"] if name in recorded else []
    if resumed is not None and recorded:
        log.info(
            "run %s resumes with its own settings where none are given: %s",
            resumed.root.name,
            ", ".join(taken) or "none taken",
        )


def resumed_run(storage_root: str, run_id: str) -> RunPaths:
    try:
        return RunPaths.of(storage_root, run_id)
    except ValueError as exc:
        raise InputError(str(exc)) from None


def add_endpoint_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--endpoint-url", default="", help="an S3-compatible endpoint (default: AWS_ENDPOINT_URL or AWS)")


def absolute(path: str) -> str:
    """A local path made absolute, as the steps (run from elsewhere) need it; a URI or "" as given."""
    return path if not path or "://" in path else str(Path(path).resolve())


def run_local_arguments(args: argparse.Namespace) -> dict[str, Any]:
    """The pipeline's arguments for `run-local`; a resume (--resume-run-id) takes the run's own settings where the
    command line gives none (fill_train_args)."""
    fill_train_args(args, resumed_run(args.storage_root, args.resume_run_id) if args.resume_run_id else None)
    include = args.include or (SOURCE_INCLUDE if args.source or args.mixture else DEMO_INCLUDE)
    sources, fields = dict(args.mixture_source), dict(args.mixture_text_field)
    for flag, given in (("--mixture-source", sources), ("--mixture-text-field", fields)):
        if unknown := sorted(set(given) - {e["dataset"] for e in args.mixture}):
            raise InputError(f"{flag} {unknown[0]}: not a dataset of --mixture")
    if args.mixture and args.source:
        raise InputError("--source stages one dataset, --mixture several: give each its --mixture-source instead")
    mixture = [dict(e, source=absolute(sources.get(e["dataset"], ""))) for e in args.mixture]
    for entry in mixture:  # the pipeline's own entry field; without it, the run's text_field (--text-field)
        if entry["dataset"] in fields and not entry["source"]:
            raise InputError(
                f"--mixture-text-field {entry['dataset']}: the dataset has no --mixture-source, so it is trained on "
                "as staged before, with the text field it was staged with"
            )
        if fields.get(entry["dataset"]):
            entry["text_field"] = fields[entry["dataset"]]
    return {
        "source": "" if mixture else args.source or default_corpus(),
        "dataset": mixture[0]["dataset"] if mixture else args.dataset,
        "mixture": mixture,
        "include": include,
        # the pipeline's default too, given so that the check before the start selects with staging's very filters
        "exclude": list(DEFAULT_EXCLUDE),
        "tokenizer_path": args.tokenizer_path,
        "vocab_size": args.vocab_size,
        "val_fraction": args.val_fraction,
        "text_field": args.text_field,
        "max_bad_records": args.max_bad_records,
        "tokenize_workers": args.tokenize_workers,
        "init_from_run_id": args.init_from_run_id,
        "run_id": resolve_run_id(args.run_id, args.resume_run_id, new_run_id()),
        "resume_run_id": args.resume_run_id,
        "skip_staging": args.skip_staging,
        "backend": "local",
        "nnodes": 1,
        "nproc_per_node": args.nproc_per_node,
        **{name: getattr(args, name) for name in RUN_SETTINGS},
        "init_from_model": absolute(args.init_from_model),
        "s3_endpoint_url": args.endpoint_url,
        "eval_max_tokens": 65536,
        "eval_checkpoints": args.eval_checkpoints,
        "benchmarks": args.benchmarks,
        "benchmark_data_uri": absolute(args.benchmark_data),
        "benchmark_limit": args.benchmark_limit,
        "benchmark_gate": args.benchmark_gate,
    }


def launch_config(args: argparse.Namespace) -> LaunchConfig:
    """The launch of `launch`, `render-job` and `preflight`. `launch` of a run that holds a checkpoint is a resume:
    the run's own settings where the command line gives none (fill_train_args); the cluster commands describe a
    job from its flags and the pipeline's defaults alone."""
    from components.launch_training.config import LaunchConfig

    run = resumed_run(args.storage_root, args.run_id) if args.command == "launch" else None
    fill_train_args(args, run if run is not None and run.has_checkpoint() else None)
    if not args.dataset and not args.mixture:
        raise InputError("give --dataset (one dataset) or --mixture (several)")
    if args.snapshot and args.mixture:
        raise InputError("--snapshot names one dataset's snapshot: a --mixture trains on each dataset's current one")
    return LaunchConfig.of(
        storage_root=args.storage_root,
        dataset=args.mixture[0]["dataset"] if args.mixture else args.dataset,
        mixture=args.mixture,
        snapshot=args.snapshot,
        run_id=args.run_id,
        backend=args.backend,
        nnodes=args.nnodes,
        nproc_per_node=args.nproc_per_node,
        s3_endpoint_url=args.endpoint_url,
        **{name: getattr(args, name) for name in RUN_SETTINGS},
        timeout_s=args.timeout_s,
        pending_timeout_s=args.pending_timeout_s,
        recovery_timeout_s=args.recovery_timeout_s,
        queue_timeout_s=args.queue_timeout_s,
        stall_timeout_s=args.stall_timeout_s,
        pipeline_run_id=args.pipeline_run_id,
        image=args.image,
        namespace=args.namespace,
        instance_type=args.instance_type,
        max_nodes=args.max_nodes,
        job_options=dict(args.job_option),
        stream_logs=args.stream_logs,
        owner_reference=not args.no_owner_reference,
        platform=platform_from_args(args, namespaces=[], registries=[]),
    )
