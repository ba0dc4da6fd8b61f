"""`hyperpod-pretrain`: compile the pipeline, run it locally, or run any one step's core by itself."""

from __future__ import annotations

import argparse
import difflib
import json
import logging
import re
import sys
import tempfile
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from common.errors import InputError, StepFailed
from common.version import tool_version
from components.kfp_support import setup_logging
from components.launch_pytorchjob.job_api import DEFAULT_JOB_API, JOB_APIS
from components.launch_pytorchjob.manifest import DEFAULT_RUNTIME, GPU_TOLERATION
from components.stage_data import SAMPLE_MB, SHARD_TOKENS, TEXT_FIELD, VAL_FRACTION, VOCAB_SIZE
from components.stage_data.sources import DEFAULT_EXCLUDE
from pipelines import CLUSTER_DEFAULTS, COMPILED_PIPELINE
from trainer.config import CONTINUE, EXTENSIONS, TRAIN_DEFAULTS
from trainer.layout import RunPaths
from trainer.model import PRESETS
from trainer.tracking import where_to_look

if TYPE_CHECKING:
    from components.launch_pytorchjob.core import LaunchConfig
    from components.launch_pytorchjob.platform import Platform

log = logging.getLogger("hyperpod-pretrain")


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or a positive integer, got {value}")
    return value


def dropout(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 0 and below 1, got {value}")
    return value


class Parser(argparse.ArgumentParser):
    """argparse as this command line wants it: no abbreviations (`--max-step 5` is not `--max-steps 5`), and an
    unknown flag answered with the command's closest one (`--text_field`: did you mean --text-field?)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_args(self, args: Any = None, namespace: Any = None) -> argparse.Namespace:  # type: ignore[override]
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            flags = list(self._option_string_actions)
            for action in self._actions:
                if isinstance(action, argparse._SubParsersAction) and getattr(parsed, action.dest, None):
                    flags += list(action.choices[getattr(parsed, action.dest)]._option_string_actions)
            given = [extra.split("=")[0] for extra in extras if extra.startswith("--")]
            guesses = {flag: difflib.get_close_matches(flag.replace("_", "-"), flags, 1, 0.8) for flag in given}
            hints = "".join(f"; {flag}: did you mean {close[0]}?" for flag, close in guesses.items() if close)
            self.error(f"unrecognized arguments: {' '.join(extras)}{hints}")
        return parsed


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Every flag's help ends with its default, unless the help already says it or there is nothing to say (an
    off switch, an empty list); examples (the epilog) keep their lines."""

    def _get_help_string(self, action: argparse.Action) -> str:  # the hook ArgumentDefaultsHelpFormatter uses
        text = action.help or ""
        quiet = action.default is None or action.default is False or action.default in ([], "", argparse.SUPPRESS)
        quiet = quiet or not action.option_strings
        if quiet or "default" in text:
            return text
        return f"{text} (default: %(default)s)".strip()


def use_defaults(p: argparse.ArgumentParser, defaults: dict[str, Any]) -> None:
    """Give `p`'s flags these defaults (required ones become optional), and say so in their help (in place of what
    it said of a default)."""
    for action in p._actions:  # argparse has no public way to change an added argument
        if action.dest in defaults:
            action.default, action.required = defaults[action.dest], False
            said = re.sub(r"\s*\(default: [^)]*\)$", "", action.help or "")
            action.help = f"{said} (default: {defaults[action.dest]})".strip().replace("%", "%%")


def add_storage_args(
    p: argparse.ArgumentParser,
    dataset: bool = True,
    run_id: bool = True,
    root_default: str | None = None,
    mixture: bool = False,
) -> None:
    p.add_argument(
        "--storage-root",
        required=root_default is None,
        default=root_default,
        help="root of the shared volume (/fsx on the cluster, any directory locally)",
    )
    if dataset:
        p.add_argument(
            "--dataset",
            required=not mixture,
            help="dataset name: <root>/datasets/<name>" + (" (or --mixture)" if mixture else ""),
        )
    if mixture:
        add_mixture_arg(p, staged=True)
    if run_id:
        p.add_argument("--run-id", required=True, help="run id: <root>/runs/<run_id>")


def add_mixture_arg(p: argparse._ActionsContainer, staged: bool) -> None:
    p.add_argument(
        "--mixture",
        type=mixture_weights,
        default=[],
        metavar="DATASET=WEIGHT,...",
        help="train on several datasets, each global batch drawn from them in proportion to the weights "
        "(e.g. web=0.8,code=0.2); all staged with one tokenizer"
        + (", staged before" if staged else "; each staged from its --mixture-source, or as staged before"),
    )


def mixture_weights(text: str) -> list[dict[str, Any]]:
    """--mixture's text as the pipeline's and the launcher's entries, checked as the trainer checks its own."""
    from trainer.mixture import parse_weights

    try:
        return [{"dataset": name, "weight": weight} for name, weight in parse_weights(text)]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--mixture: ")) from None


# The training settings a resume takes from the run's config.json when the command line does not give them (the
# trainer's names; --extend-schedule is not one: it is what this resume does, not a setting of the run).
RESUMED_SETTINGS = (
    "preset",
    "init_from_model",
    "max_steps",
    "seed",
    "batch_size",
    "seq_len",
    "lr",
    "warmup_steps",
    "dropout",
    "checkpoint_every",
    "log_every",
    "eval_every",
)


def add_train_args(p: argparse.ArgumentParser) -> None:
    """Training flags. Those of RESUMED_SETTINGS default to None, filled by fill_train_args: the resumed run's
    recorded value, else the trainer's default (which the help shows)."""
    d = TRAIN_DEFAULTS

    def default(name: str) -> str:
        return f"(default: {d[name]}; a resume: the run's own)"

    p.add_argument("--nproc-per-node", type=positive_int, default=2, help="processes (GPUs) per node")
    p.add_argument("--preset", choices=sorted(PRESETS), help=f"model preset {default('preset')}")
    p.add_argument(
        "--init-from-model",
        metavar="DIR",
        help="start from a published model (its architecture, weights and tokenizer): a directory "
        "save_pretrained wrote, or an s3:// prefix of one, copied once to <root>/models/; not with "
        "--preset",
    )
    p.add_argument("--max-steps", type=positive_int, help=f"optimizer steps {default('max_steps')}")
    p.add_argument("--seed", type=int, help=f"seeds the model and the data order {default('seed')}")
    p.add_argument("--batch-size", type=positive_int, help=f"sequences per process per step {default('batch_size')}")
    p.add_argument("--seq-len", type=positive_int, help=f"tokens per sequence {default('seq_len')}")
    p.add_argument("--lr", type=float, help=f"peak learning rate {default('lr')}")
    p.add_argument("--warmup-steps", type=positive_int, help=f"linear warm-up steps {default('warmup_steps')}")
    p.add_argument(
        "--extend-schedule",
        nargs="?",
        const=CONTINUE,
        default="",
        choices=EXTENSIONS,
        help="a resume goes on from the current learning rate to other settings: continue (given bare: the "
        "cosine from there down to the end learning rate at a new --max-steps, no re-warm; --lr and "
        "--warmup-steps stay the run's) or rewarm (linear to a new --lr over --warmup-steps, then a "
        "cosine to the new --max-steps); without it, other settings are refused",
    )
    p.add_argument("--dropout", type=dropout, help=f"dropout probability (0: none) {default('dropout')}")
    p.add_argument(
        "--checkpoint-every", type=positive_int, help=f"steps between checkpoints {default('checkpoint_every')}"
    )
    p.add_argument("--log-every", type=positive_int, help=f"steps between metrics rows {default('log_every')}")
    p.add_argument(
        "--eval-every",
        type=non_negative_int,
        help="every N steps the trainer measures the loss on the val split (its first "
        f"{d['eval_tokens']:,} tokens) into that step's metrics row (val_loss, val_bpb) and log; 0: never "
        f"{default('eval_every')}",
    )
    add_mlflow_args(p)


def add_mlflow_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--mlflow-tracking-uri",
        type=tracking_uri,
        default="",
        metavar="URI",
        help="also send the trainer's metrics to this MLflow tracking server, one MLflow run per run: an "
        "http(s):// URL or a SageMaker MLflow ARN; credentials from the environment, never in the URI "
        "(default: none; TensorBoard's files are always written under <run>/tensorboard/)",
    )
    p.add_argument(
        "--mlflow-experiment",
        default=TRAIN_DEFAULTS["mlflow_experiment"],
        help="the MLflow experiment (made if missing; default: %(default)s)",
    )


def tracking_uri(text: str) -> str:
    from trainer.tracking import check_tracking_uri

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


def add_checkpoint_s3_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--checkpoint-s3-uri",
        default="",
        metavar="s3://BUCKET/PREFIX",
        help="copy each committed checkpoint to PREFIX/<run id>/ in S3, and fetch the newest back when "
        "the volume lost it (default: no copies)",
    )
    p.add_argument("--endpoint-url", default="", help="an S3-compatible endpoint (default: AWS_ENDPOINT_URL or AWS)")


def cmd_compile(args: argparse.Namespace) -> int:
    from pipelines.pipeline import Images, PlatformOptions, compile_pipeline

    if args.tag and not args.image_registry:
        raise InputError("--tag names the images in --image-registry: give both")
    images = Images.in_registry(args.image_registry, args.tag) if args.image_registry else Images()
    registry = [args.image_registry.rstrip("/")] if args.image_registry else []
    job = platform_from_args(args, namespaces=["kubeflow"], registries=registry)
    platform = PlatformOptions(
        job=job,
        node_selector=dict(args.node_selector),
        tolerations=args.toleration,
        image_pull_secrets=args.image_pull_secret,
        images=images,
        mlflow_tracking_uri=args.mlflow_tracking_uri,
    )
    output = Path(args.output)
    if not args.check:
        compile_pipeline(output, platform)
        log.info("wrote %s, with the platform settings compiled in:\n  %s", output, "\n  ".join(platform.described()))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        fresh = Path(tmp) / output.name
        compile_pipeline(fresh, platform)
        current = output.read_text() if output.is_file() else ""
        if fresh.read_text() == current:
            log.info("%s is up to date", output)
            return 0
        diff = difflib.unified_diff(
            current.splitlines(), fresh.read_text().splitlines(), str(output), "fresh compile", lineterm="", n=1
        )
        sys.stderr.write("\n".join(list(diff)[:40]) + "\n")
    raise StepFailed(f"{output} differs from a fresh compile: run 'hyperpod-pretrain compile' and commit it")


def cmd_run_local(args: argparse.Namespace) -> int:
    from pipelines.local_run import run_local

    arguments = run_local_arguments(args)
    if not args.verbose:  # this command's own lines as kfp.local writes its lines beside them: one format
        for handler in logging.getLogger().handlers:
            handler.setFormatter(logging.Formatter("%(asctime)s.%(msecs)03d - %(levelname)s - %(message)s", "%H:%M:%S"))
    result = run_local(Path(args.pipeline_file), Path(args.storage_root), arguments, verbose=args.verbose)
    evaluation = json.loads(RunPaths(result.run_dir).eval_result.read_text())
    lines = [
        f"local pipeline run {arguments['run_id']} succeeded in {result.seconds:.0f}s: val loss "
        f"{evaluation['val_loss']:.3f} after {evaluation['step']} steps "
        f"({evaluation.get('start', 'untrained')} {evaluation['untrained_val_loss']:.3f})",
        "reports:",
    ]
    lines += [f"  {name:34s} {path}" for name, path in result.reports().items()]
    watch = where_to_look(result.run_dir)
    if watch:
        lines.append("watch:")
    if "tensorboard_command" in watch:
        lines.append(f"  {'TensorBoard':34s} {watch['tensorboard_command']}")
    if "mlflow_url" in watch:
        lines.append(f"  {'MLflow run':34s} {watch['mlflow_url']}")
    print("\n".join(lines))
    return 0


# The built-in demo corpus (the stdlib's email package) is Python source beside compiled and other files: only its
# .py files are staged. A corpus of one's own (--source) is staged whole, less DEFAULT_EXCLUDE, unless --include says.
DEMO_INCLUDE = ["*.py"]
SOURCE_INCLUDE = ["*"]


def add_corpus_args(p: argparse._ActionsContainer) -> None:
    """The corpus settings of stage-data and run-local (the pipeline's parameters of the same names)."""
    p.add_argument(
        "--tokenizer-path",
        default="",
        help="a Hugging Face tokenizer: a tokenizer.json file, or a directory as save_pretrained writes "
        "it, or s3://bucket/prefix/ of one (default: train a BPE tokenizer on the corpus)",
    )
    p.add_argument(
        "--vocab-size",
        type=positive_int,
        default=VOCAB_SIZE,
        help="the trained BPE tokenizer's vocabulary size (not used with --tokenizer-path)",
    )
    p.add_argument(
        "--val-fraction",
        type=float,
        default=VAL_FRACTION,
        help="share held out for the val split: of the documents of JSON Lines and Parquet files, and of "
        "plain-text files (each one document)",
    )
    p.add_argument(
        "--text-field",
        default="",
        metavar="FIELD",
        help=f"JSON Lines and Parquet: the field or column holding each record's text, a dotted path "
        f"for nested JSON (content.body) (default: {TEXT_FIELD}; refused for a corpus of plain "
        "text)",
    )
    p.add_argument(
        "--max-bad-records",
        type=int,
        default=0,
        metavar="N",
        help="JSON Lines: skip and count up to N malformed lines (not JSON, not an object) instead of "
        "failing on the first",
    )


def absolute(path: str) -> str:
    """A local path made absolute, as the steps (run from elsewhere) need it; a URI or "" as given."""
    return path if not path or "://" in path else str(Path(path).resolve())


def run_local_arguments(args: argparse.Namespace) -> dict[str, Any]:
    """The pipeline's arguments for `run-local`; a resume (--resume-run-id) takes the run's own settings where the
    command line gives none (fill_train_args)."""
    from components.run_summary.core import resolve_run_id
    from pipelines.local_run import default_corpus, new_run_id

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
        "init_from_model": absolute(args.init_from_model),
        "run_id": resolve_run_id(args.run_id, args.resume_run_id, new_run_id()),
        "resume_run_id": args.resume_run_id,
        "skip_staging": args.skip_staging,
        "backend": "local",
        "nnodes": 1,
        "nproc_per_node": args.nproc_per_node,
        "preset": args.preset,
        "max_steps": args.max_steps,
        "seed": args.seed,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "lr": args.lr,
        "warmup_steps": args.warmup_steps,
        "extend_schedule": args.extend_schedule,
        "dropout": args.dropout,
        "checkpoint_every": args.checkpoint_every,
        "log_every": args.log_every,
        "eval_every": args.eval_every,
        "checkpoint_s3_uri": args.checkpoint_s3_uri,
        "s3_endpoint_url": args.endpoint_url,
        "mlflow_tracking_uri": args.mlflow_tracking_uri,
        "mlflow_experiment": args.mlflow_experiment,
        "eval_max_tokens": 65536,
    }


def cmd_prune_snapshots(args: argparse.Namespace) -> int:
    from components.stage_data.snapshots import prune_snapshots

    result = prune_snapshots(args.storage_root, args.dataset, dry_run=args.dry_run)
    print(json.dumps(asdict(result), indent=2))
    return 0


def cmd_stage_data(args: argparse.Namespace) -> int:
    from components.stage_data.core import stage_data
    from components.stage_data.settings import StageSettings

    settings = StageSettings.of_step(
        source=args.source,
        storage_root=args.storage_root,
        dataset=args.dataset,
        include=args.include,
        exclude=args.exclude,
        vocab_size=args.vocab_size,
        val_fraction=args.val_fraction,
        tokenizer_path=args.tokenizer_path,
        text_field=args.text_field,
        max_bad_records=args.max_bad_records,
        endpoint_url=args.endpoint_url,
        workers=args.workers,
        chunk_size_mb=args.chunk_size_mb,
        keep_deleted=args.keep_deleted,
        shard_tokens=args.shard_tokens,
        tokenize_groups=args.tokenize_groups,
        tokenizer_sample_mb=args.tokenizer_sample_mb,
    )
    if args.dry_run:
        from components.stage_data.preview import dry_run

        print("\n".join(dry_run(settings).lines()))
        return 0
    result = stage_data(**{f: getattr(settings, f) for f in settings.__dataclass_fields__})
    print(json.dumps(asdict(result), indent=2))
    return 0


def launch_config(args: argparse.Namespace) -> LaunchConfig:
    """The launch of `launch`, `render-job` and `preflight`. `launch` of a run that holds a checkpoint is a resume:
    the run's own settings where the command line gives none (fill_train_args); the cluster commands describe a
    job from its flags and the pipeline's defaults alone."""
    from components.launch_pytorchjob.core import LaunchConfig

    run = resumed_run(args.storage_root, args.run_id) if args.command == "launch" else None
    fill_train_args(args, run if run is not None and run.has_checkpoint() else None)
    if not args.dataset and not args.mixture:
        raise InputError("give --dataset (one dataset) or --mixture (several)")
    if args.snapshot and args.mixture:
        raise InputError("--snapshot names one dataset's snapshot: a --mixture trains on each dataset's current one")
    return LaunchConfig(
        storage_root=args.storage_root,
        dataset=args.mixture[0]["dataset"] if args.mixture else args.dataset,
        mixture=args.mixture,
        snapshot=args.snapshot,
        run_id=args.run_id,
        backend=args.backend,
        nnodes=args.nnodes,
        nproc_per_node=args.nproc_per_node,
        preset=args.preset,
        init_from_model=args.init_from_model,
        max_steps=args.max_steps,
        seed=args.seed,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        lr=args.lr,
        warmup_steps=args.warmup_steps,
        extend_schedule=args.extend_schedule,
        dropout=args.dropout,
        checkpoint_every=args.checkpoint_every,
        log_every=args.log_every,
        eval_every=args.eval_every,
        checkpoint_s3_uri=args.checkpoint_s3_uri,
        s3_endpoint_url=args.endpoint_url,
        mlflow_tracking_uri=args.mlflow_tracking_uri,
        mlflow_experiment=args.mlflow_experiment,
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


def cmd_launch(args: argparse.Namespace) -> int:
    from components.launch_pytorchjob.core import launch

    result = launch(launch_config(args))
    print(json.dumps(asdict(result), indent=2))
    return 0


def cmd_render_job(args: argparse.Namespace) -> int:
    import yaml

    _, job = job_config(args, "launch-pytorchjob").checked_job()
    print(yaml.safe_dump(job, sort_keys=False), end="")
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


def note_given_flags(p: argparse.ArgumentParser) -> None:
    """Have `p` put on its namespace, as `given_flags`, the flags its command line gave: argparse keeps only values,
    and a flag given its default value looks like one not given. The line is parsed a second time with no defaults
    (so abbreviations and --flag=value count), once the first parse has taken it."""
    parse = p.parse_known_args  # argparse calls a subcommand's parser by this attribute

    def parse_noting_given(
        args: list[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        parsed, rest = parse(args, namespace)
        defaults = {action: action.default for action in p._actions}  # argparse has no public way to do this
        try:
            for action in defaults:
                action.default = argparse.SUPPRESS
            given = vars(parse(args, None)[0])
        finally:
            for action, default in defaults.items():
                action.default = default
        flags = [a for a in p._actions if a.option_strings and a.dest in given]
        parsed.given_flags = {max(a.option_strings, key=len) for a in flags}
        return parsed, rest

    p.parse_known_args = parse_noting_given  # type: ignore[method-assign]


def job_config(args: argparse.Namespace, step: str) -> LaunchConfig:
    """render-job's and preflight's job: set by the flags (a cluster run's defaults), or with --pipeline-file, the
    config the package's `step` makes for a submission with the --param values."""
    from pipelines.package import step_config

    inputs = submitted_inputs(args, step)
    return launch_config(args) if inputs is None else step_config(inputs)


def submitted_inputs(args: argparse.Namespace, step: str) -> dict[str, Any] | None:
    """With --pipeline-file, what its `step` is called with in a submission with the --param values; None without
    (the flags set the job)."""
    from pipelines.package import Package

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


def preflight_settings(args: argparse.Namespace) -> tuple[LaunchConfig, bool]:
    """The preflight's job and whether it only warns: --warn-only, or with --pipeline-file the preflight step's own
    warn_only (the preflight_warn_only parameter), as a run would check."""
    from pipelines.package import step_config

    inputs = submitted_inputs(args, "preflight")
    if inputs is None:
        return launch_config(args), args.warn_only
    return step_config(inputs), args.warn_only or inputs.get("warn_only") is True


def cmd_render_runtime(args: argparse.Namespace) -> int:
    """Our ClusterTrainingRuntime for the platform's settings, as the platform team applies it once (a cluster
    admin: ClusterTrainingRuntimes are cluster-scoped)."""
    import yaml

    from components.launch_pytorchjob.manifest import JobSpec
    from components.launch_pytorchjob.trainjob import render_runtime

    image, instance_type, grace_s, budget = args.image, args.instance_type, args.grace_period_s, args.restart_budget
    if args.pipeline_file:  # the settings a submission of it has: compiled in, its defaults and the --param values
        from components.launch_pytorchjob.platform import run_options
        from pipelines.package import step_config

        args.given_flags -= {"--restart-budget", "--grace-period-s"}  # the runtime's own, not the pipeline's
        inputs = submitted_inputs(args, "preflight")
        assert inputs is not None
        config = step_config(inputs)
        platform, image, instance_type = config.platform, config.image, config.instance_type
        if platform.job_api != "trainjob":
            raise InputError(
                f"--pipeline-file {args.pipeline_file}: compiled for --job-api {platform.job_api}; a "
                "ClusterTrainingRuntime is for a --job-api trainjob pipeline"
            )
        options = run_options(config.job_options, platform.job_api)
        grace_s, budget = options.get("grace_period_s", grace_s), options.get("restart_budget", budget)
    else:
        platform = platform_from_args(args, namespaces=[], registries=[])
        if image:
            platform.check_image(image)
    spec = JobSpec(
        name=platform.runtime_name,
        image=image,
        trainer_args=[],
        job_api="trainjob",
        runtime_name=platform.runtime_name,
        instance_type=instance_type,
        mount_path=platform.mount_path,
        pvc_name=platform.pvc_name,
        grace_period_s=grace_s,
        restart_budget=budget,
        service_account=platform.service_account,
        automount_service_account_token=platform.automount_service_account_token,
        tolerations=[GPU_TOLERATION, *platform.tolerations],
        health_affinity=platform.health_affinity,
        node_selector=dict(platform.node_selector),
        image_pull_secrets=list(platform.image_pull_secrets),
        env=dict(platform.env),
    )
    print(yaml.safe_dump(render_runtime(spec), sort_keys=False), end="")
    return 0


def cmd_render_rbac(args: argparse.Namespace) -> int:
    from pipelines.deploy.rbac import Subject, render, write_deploy

    subject = Subject(args.namespace, args.service_account, args.jobs_namespace)
    if args.split:
        if args.kubeflow_profile or args.cluster_read:
            raise InputError(
                "--split writes deploy/'s files, all of them in full: leave out --kubeflow-profile and --cluster-read"
            )
        if not Path(args.split).is_dir():
            raise InputError(f"--split {args.split}: not a directory")
        for path in write_deploy(Path(args.split), subject, args.runtime_name):
            log.info("wrote %s", path)
        return 0
    print(render(subject, args.job_api, args.runtime_name, args.cluster_read, args.kubeflow_profile), end="")
    return 0


def cmd_render_iam_policy(args: argparse.Namespace) -> int:
    from pipelines.deploy.iam import render_policy

    print(
        render_policy(
            source=args.source,
            tokenizer=args.tokenizer_path,
            checkpoints=args.checkpoint_s3_uri,
            export=args.export_s3_uri,
            partition=args.partition,
        ),
        end="",
    )
    return 0


def cmd_render_service_account(args: argparse.Namespace) -> int:
    from pipelines.deploy.iam import service_account

    print(
        service_account(
            args.namespace, args.name, args.role_arn, args.pod_identity, args.oidc_issuer, args.cluster_name
        ),
        end="",
    )
    return 0


def cmd_render_storage(args: argparse.Namespace) -> int:
    from pipelines.deploy.storage import FileSystem, render

    file_system = FileSystem(
        args.file_system_id,
        args.dns_name,
        args.mount_name,
        args.capacity,
        args.deployment_type,
        args.per_unit_storage_throughput,
    )
    print(render(file_system, args.namespace, args.pvc_name), end="")
    return 0


def key_value(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE")
    return key, value


def toleration(text: str) -> dict[str, str]:
    """KEY:EFFECT (operator Exists) or KEY=VALUE:EFFECT (operator Equal), as kubectl taint writes taints."""
    spec, sep, effect = text.rpartition(":")
    if not sep or effect not in ("NoSchedule", "PreferNoSchedule", "NoExecute") or not spec:
        raise argparse.ArgumentTypeError(
            f"{text!r}: write KEY:EFFECT or KEY=VALUE:EFFECT, EFFECT one of NoSchedule, PreferNoSchedule, NoExecute"
        )
    key, eq, value = spec.partition("=")
    if eq:
        return {"key": key, "operator": "Equal", "value": value, "effect": effect}
    return {"key": key, "operator": "Exists", "effect": effect}


def job_option(text: str) -> tuple[str, Any]:
    """KEY=VALUE, VALUE read as YAML: --job-option restart_budget=5 --job-option 'node_selector={a: b}'."""
    import yaml

    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE")
    try:
        return key.strip(), yaml.safe_load(value)
    except yaml.YAMLError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: the value is not YAML ({exc})") from None


def add_cluster_args(p: argparse.ArgumentParser) -> None:
    """Where the kubernetes backend runs the job (the local backend ignores these)."""
    p.add_argument("--image", default="", help="the trainer image (docker/build.sh builds and pushes it)")
    p.add_argument("--namespace", default="kubeflow", help="where the job is created")
    p.add_argument("--instance-type", default="p5.48xlarge", help="sets GPUs and EFA devices per node")
    p.add_argument("--max-nodes", type=int, default=0, help="elastic: up to this many nodes (0: --nnodes)")
    p.add_argument("--pipeline-run-id", default="", help="names the job, so that a retry re-attaches (default: run id)")
    p.add_argument(
        "--job-option",
        type=job_option,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any other JobSpec setting, e.g. memory=512Gi or auto_resume=false",
    )
    p.add_argument(
        "--stream-logs",
        choices=["worker-0", "all", "none"],
        default="worker-0",
        help="whose log the launcher prints as the job runs: node 0's pod, every pod's or none",
    )
    p.add_argument("--no-owner-reference", action="store_true", help="do not tie the job's life to the launcher pod")


def add_deadline_args(p: argparse.ArgumentParser) -> None:
    """How long each phase of a job may take before the launcher deletes it and fails the step."""
    p.add_argument("--timeout-s", type=int, default=0, help="deadline for training in seconds (0: none)")
    p.add_argument(
        "--pending-timeout-s",
        type=int,
        default=1800,
        help="a job that never started: pods Pending this long delete it and fail the step (0: never)",
    )
    p.add_argument(
        "--recovery-timeout-s",
        type=int,
        default=3600,
        help="after it ran: fewer than its minimum of pods this long (a lost node) fails it (0: never)",
    )
    p.add_argument(
        "--queue-timeout-s",
        type=int,
        default=0,
        help="queued (suspended by Kueue) this long fails it (0: wait as long as it takes)",
    )
    p.add_argument(
        "--stall-timeout-s",
        type=int,
        default=0,
        help="no training step completed this long deletes the job and fails it (0: derived from the step time, "
        "at least 900 s)",
    )


def add_platform_args(p: argparse.ArgumentParser, mount_path: str, mount_help: str) -> None:
    """The platform team's settings of the training job (components/launch_pytorchjob/platform.py), compiled into
    the pipeline: no run can change them."""
    p.add_argument(
        "--job-api",
        choices=JOB_APIS,
        default=DEFAULT_JOB_API,
        help="pytorchjob: a kubeflow.org/v1 PyTorchJob (Training Operator v1, what HyperPod runs and "
        "auto-resumes); trainjob: a trainer.kubeflow.org/v1alpha1 TrainJob (Kubeflow Trainer v2, what the "
        "Kubeflow distribution installs since July 2026). Default: %(default)s",
    )
    p.add_argument(
        "--runtime-name",
        default=DEFAULT_RUNTIME,
        help="trainjob: the ClusterTrainingRuntime every TrainJob names (render-runtime prints it; "
        "default: %(default)s)",
    )
    p.add_argument("--fsx-pvc", default="fsx-lustre-pvc", help="the FSx PVC every step and the training job mount")
    p.add_argument(
        "--mount-path", default=mount_path, help=f"where they mount it; a storage root must lie under it ({mount_help})"
    )
    p.add_argument("--queue-name", default="", help="Kueue LocalQueue of the job (HyperPod task governance)")
    p.add_argument("--priority-class", default="", help="Kueue WorkloadPriorityClass of the job")
    p.add_argument(
        "--job-namespace",
        action="append",
        default=[],
        metavar="NS",
        help="a namespace jobs may go to (repeatable; compile default: kubeflow; elsewhere any)",
    )
    p.add_argument(
        "--allowed-registry",
        action="append",
        default=[],
        metavar="REGISTRY",
        help="where trainer images may come from, a host and optional path (repeatable; compile default: "
        "--image-registry's, if given; none: any)",
    )
    p.add_argument("--trainer-service-account", default="", help="the trainer pods' service account")
    p.add_argument(
        "--automount-service-account-token",
        action="store_true",
        help="mount its token in the trainer pods (the trainer needs none)",
    )
    p.add_argument(
        "--trainer-toleration",
        type=toleration,
        action="append",
        default=[],
        metavar="KEY[=VALUE]:EFFECT",
        help="for the trainer pods, besides the GPU one (repeatable)",
    )
    p.add_argument(
        "--trainer-node-selector",
        type=key_value,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="for the trainer pods (repeatable)",
    )
    p.add_argument(
        "--trainer-image-pull-secret",
        action="append",
        default=[],
        metavar="NAME",
        help="for the trainer pods (repeatable)",
    )
    p.add_argument(
        "--trainer-env",
        type=key_value,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra environment of the trainer, e.g. NCCL or EFA settings (repeatable)",
    )
    p.add_argument(
        "--no-health-affinity",
        action="store_true",
        help="do not require HyperPod's node-health label (a cluster without HyperPod)",
    )


def platform_from_args(args: argparse.Namespace, namespaces: list[str], registries: list[str]) -> Platform:
    from components.launch_pytorchjob.platform import Platform

    return Platform(
        job_api=args.job_api,
        runtime_name=args.runtime_name,
        pvc_name=args.fsx_pvc,
        mount_path=args.mount_path,
        queue_name=args.queue_name,
        priority_class=args.priority_class,
        namespaces=tuple(args.job_namespace or namespaces),
        registries=tuple(args.allowed_registry or registries),
        service_account=args.trainer_service_account,
        automount_service_account_token=args.automount_service_account_token,
        tolerations=tuple(args.trainer_toleration),
        node_selector=dict(args.trainer_node_selector),
        image_pull_secrets=tuple(args.trainer_image_pull_secret),
        env=dict(args.trainer_env),
        health_affinity=not args.no_health_affinity,
    )


def cmd_preflight(args: argparse.Namespace) -> int:
    from components.preflight.core import failure_message, preflight

    config, warn_only = preflight_settings(args)
    result = preflight(config, warn_only=warn_only)
    print(json.dumps(result.to_json(), indent=2) if args.json else result.markdown())
    if not result.passed:
        raise StepFailed(failure_message(result).removeprefix("preflight failed: "))  # the CLI says "failed: "
    return 0


def cmd_verify_nccl(args: argparse.Namespace) -> int:
    from components.verify_nccl.core import Expectations, verify_logs, verify_nccl

    low, _, high = args.expect_world_size_range.partition(":")
    try:
        low_size, high_size = int(low or 0), int(high or low or 0)
    except ValueError:
        raise InputError(f"--expect-world-size-range {args.expect_world_size_range!r}: MIN:MAX, e.g. 16:32") from None
    expect = Expectations(
        world_size=args.expect_world_size,
        transport=args.expect_transport,
        instance_type=args.instance_type,
        bandwidth_fails=args.bandwidth_fails,
        min_world_size=low_size,
        max_world_size=high_size,
    )
    if bool(args.storage_root) != bool(args.run_id):
        raise InputError("give --storage-root and --run-id together (a run), or neither (only the PATHs)")
    if args.run_id:
        result = verify_nccl(
            args.storage_root, args.run_id, extra_logs=args.logs, expect=expect, all_attempts=args.all_attempts
        )
    elif args.logs:
        result = verify_logs(args.logs, expect)
    else:
        raise InputError("nothing to verify: give PATHs (NCCL logs, files or directories) or a run")
    print(json.dumps(result.to_json(), indent=2) if args.json else result.markdown())
    if not result.passed:
        raise StepFailed("; ".join(f"{c.name}: {c.detail}" for c in result.failures))
    return 0


def cmd_evaluate(args: argparse.Namespace) -> int:
    from components.evaluate_checkpoint.core import Gate, evaluate_checkpoint

    gate = Gate(
        max_val_loss=args.max_val_loss,
        baseline_run_id=args.baseline_run_id,
        baseline_margin=args.baseline_margin,
        baseline_step=args.baseline_step,
        warn_only=args.gate_warn_only,
    )
    result = evaluate_checkpoint(
        args.storage_root,
        args.dataset,
        args.run_id,
        max_tokens=args.max_tokens,
        checkpoint=args.checkpoint,
        gate=gate,
        export=not args.no_export,
        export_s3_uri=args.export_s3_uri,
        s3_endpoint_url=args.endpoint_url,
    )
    print(result.markdown())
    return 0


def cmd_runs(args: argparse.Namespace) -> int:
    from pipelines.runs import list_runs, render_table

    rows = list_runs(args.storage_root)
    print(json.dumps([asdict(r) for r in rows], indent=2) if args.json else render_table(rows))
    return 0


def cmd_submit(args: argparse.Namespace) -> int:
    from pipelines import remote
    from pipelines.package import Package

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


def cmd_schedule(args: argparse.Namespace) -> int:
    from pipelines import remote
    from pipelines.package import Package

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


EXAMPLES = {
    "compile": "compile --image-registry 123456789012.dkr.ecr.us-west-2.amazonaws.com --tag v0.2.0 "
    "--fsx-pvc fsx-claim --job-namespace ml-team",
    "run-local": "run-local --max-steps 50",
    "stage-data": "stage-data --source s3://my-bucket/corpus/ --storage-root /fsx --dataset web-2026-11",
    "prune-snapshots": "prune-snapshots --storage-root /fsx --dataset web-2026-11 --dry-run",
    "launch": "launch --storage-root local-runs --dataset stdlib-email --run-id try-1 --max-steps 50",
    "render-job": "render-job --image 123456789012.dkr.ecr.us-west-2.amazonaws.com/hyperpod-pretrain-trainer:v0.2.0 "
    "--nnodes 4",
    "preflight": "preflight --image 123456789012.dkr.ecr.us-west-2.amazonaws.com/hyperpod-pretrain-trainer:v0.2.0 "
    "--nnodes 4 --namespace ml-team",
    "render-runtime": "render-runtime --fsx-pvc fsx-claim --restart-budget 5",
    "render-rbac": "render-rbac --namespace team-a --service-account default-editor --kubeflow-profile",
    "render-iam-policy": "render-iam-policy --source s3://my-bucket/corpus/ --checkpoint-s3-uri "
    "s3://my-bucket/checkpoints/",
    "render-service-account": "render-service-account --namespace team-a --name trainer --role-arn "
    "arn:aws:iam::123456789012:role/team-a-trainer",
    "render-storage": "render-storage --namespace team-a --namespace team-b --file-system-id fs-0123456789abcdef0 "
    "--dns-name fs-0123456789abcdef0.fsx.us-east-1.amazonaws.com --mount-name abcdefgh --capacity 2400Gi",
    "submit": "submit --host http://localhost:8080 --param source=s3://my-bucket/corpus/ --param nnodes=4 --wait",
    "schedule": "schedule --host http://localhost:8080 --name nightly --cron '0 0 2 * * *' "
    "--param source=s3://my-bucket/corpus/",
    "verify-nccl": "verify-nccl --storage-root /fsx --run-id nightly-20261202",
    "runs": "runs --storage-root /fsx",
    "evaluate": "evaluate --storage-root local-runs --dataset stdlib-email --run-id try-1 --baseline-run-id previous",
}


def command(sub: Any, name: str, helptext: str) -> argparse.ArgumentParser:
    """A subcommand whose --help ends with an example of its use (EXAMPLES, which a test parses)."""
    usage = f"%(prog)s [options]{' [PATH ...]' if name == 'verify-nccl' else ''}"  # the flags are listed below
    return sub.add_parser(
        name,
        help=helptext,
        description=helptext,
        usage=usage,
        formatter_class=HelpFormatter,
        epilog=f"example:\n  hyperpod-pretrain {EXAMPLES[name]}",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="hyperpod-pretrain", description=__doc__)
    parser.add_argument("--version", action="version", version=f"hyperpod-pretrain {tool_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = command(sub, "compile", "compile the pipeline to YAML")
    p.add_argument("--output", default=str(COMPILED_PIPELINE), help="where to write the pipeline YAML")
    p.add_argument("--check", action="store_true", help="exit non-zero if --output differs from a fresh compile")
    add_platform_args(
        p.add_argument_group("platform", "the training job's platform settings: no run can change them"),
        mount_path="/fsx",
        mount_help="also storage_root's default",
    )
    p.add_argument(
        "--node-selector",
        type=key_value,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="schedule the steps on nodes with this label (repeatable)",
    )
    p.add_argument(
        "--toleration",
        type=toleration,
        action="append",
        default=[],
        metavar="KEY[=VALUE]:EFFECT",
        help="let the steps run on nodes with this taint (repeatable)",
    )
    p.add_argument("--image-pull-secret", action="append", default=[], metavar="NAME", help="(repeatable)")
    p.add_argument(
        "--image-registry",
        default="",
        metavar="REGISTRY",
        help="where docker/build.sh pushed the images, e.g. ACCOUNT.dkr.ecr.REGION.amazonaws.com: "
        "the steps run in REGISTRY/hyperpod-pretrain-components:TAG and trainer_image defaults to "
        "REGISTRY/hyperpod-pretrain-trainer:TAG",
    )
    p.add_argument("--tag", default="", help="the images' tag (default: the project's version)")
    p.add_argument(
        "--mlflow-tracking-uri",
        type=tracking_uri,
        default="",
        metavar="URI",
        help="the team's MLflow tracking server (http(s):// or a SageMaker MLflow ARN): the "
        "mlflow_tracking_uri parameter's default (default: none)",
    )
    p.set_defaults(func=cmd_compile)

    p = command(sub, "run-local", "run the compiled pipeline end to end on this machine (kfp.local)")
    p.add_argument(
        "--verbose",
        action="store_true",
        help="show all kfp.local prints: each step's inputs and outputs, every rank's lines",
    )
    add_storage_args(p, dataset=False, run_id=False, root_default="local-runs")
    p.add_argument(
        "--source",
        help="a local path, file:// URI or s3://bucket/prefix of the corpus to stage (default: "
        "the built-in demo corpus, the stdlib's email package)",
    )
    p.add_argument(
        "--include",
        nargs="+",
        metavar="GLOB",
        help=f"glob patterns of files to stage (default: every file, {SOURCE_INCLUDE[0]!r}, of a --source; "
        f"{DEMO_INCLUDE[0]!r} of the demo corpus; {' '.join(DEFAULT_EXCLUDE)} are left out "
        "either way)",
    )
    p.add_argument("--dataset", default="stdlib-email", help="the dataset's name under <root>/datasets/")
    add_mixture_arg(p, staged=False)
    p.add_argument(
        "--mixture-source",
        type=key_value,
        action="append",
        default=[],
        metavar="DATASET=SOURCE",
        help="where a --mixture dataset's corpus is (a local path, file:// URI or s3://bucket/prefix), "
        "staged as --source is (repeatable)",
    )
    p.add_argument(
        "--mixture-text-field",
        type=key_value,
        action="append",
        default=[],
        metavar="DATASET=FIELD",
        help="the field or column of a --mixture dataset's records that holds the text, where it is not "
        "--text-field's (the pipeline's mixture entry's text_field; repeatable)",
    )
    p.add_argument("--run-id", default="", help="default: local-<UTC time>")
    p.add_argument("--resume-run-id", default="", help="continue this run's training from its newest checkpoint")
    p.add_argument("--skip-staging", action="store_true", help="train on the dataset as staged before")
    p.add_argument(
        "--init-from-run-id",
        default="",
        help="start from this run's weights ('previous': the dataset's newest finished run)",
    )
    add_corpus_args(p.add_argument_group("corpus", "how the corpus is read, split and tokenized"))
    p.add_argument(
        "--tokenize-workers",
        type=positive_int,
        default=2,
        help="groups of files tokenized by parallel steps (the pipeline's fan-out)",
    )
    p.add_argument("--pipeline-file", default=str(COMPILED_PIPELINE), help="the compiled pipeline to run")
    add_train_args(p.add_argument_group("training", "the trainer's settings"))
    add_checkpoint_s3_args(p.add_argument_group("checkpoint copies"))
    p.set_defaults(func=cmd_run_local)

    p = command(sub, "stage-data", "stage a corpus onto the volume and tokenize it")
    p.add_argument("--source", required=True, help="s3://bucket/prefix, file:// URI or local path")
    add_storage_args(p, run_id=False)
    p.add_argument("--include", nargs="+", default=["*"], help="glob patterns of files to stage")
    p.add_argument("--exclude", nargs="*", default=list(DEFAULT_EXCLUDE), help="glob patterns of files to leave out")
    add_corpus_args(p.add_argument_group("corpus", "how the corpus is read, split and tokenized"))
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="read a sample of the source and show what staging would find and the model would read "
        "(formats, documents, tokens, skipped records, each format's first document); write "
        "nothing",
    )
    p.add_argument("--endpoint-url", default="", help="an S3-compatible endpoint (default: AWS_ENDPOINT_URL or AWS)")
    p.add_argument("--workers", type=positive_int, default=16, help="concurrent downloads")
    p.add_argument("--chunk-size-mb", type=positive_int, default=8, help="multipart threshold and part size")
    p.add_argument("--keep-deleted", action="store_true", help="keep mirrored files that are gone from the source")
    p.add_argument("--shard-tokens", type=positive_int, default=SHARD_TOKENS, help="tokens per shard file")
    p.add_argument(
        "--tokenize-groups",
        type=positive_int,
        default=1,
        help="encode the files in this many groups, each with its own shards (the pipeline runs them in "
        "parallel pods; here they run in turn)",
    )
    p.add_argument(
        "--tokenizer-sample-mb",
        type=positive_int,
        default=SAMPLE_MB,
        help="train the tokenizer on this much of the train text (a deterministic sample)",
    )
    p.set_defaults(func=cmd_stage_data)

    p = command(sub, "prune-snapshots", "remove a dataset's snapshots that are not current and no run uses")
    add_storage_args(p, run_id=False)
    p.add_argument("--dry-run", action="store_true", help="only say what would be removed")
    p.set_defaults(func=cmd_prune_snapshots)

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
        p = command(sub, name, helptext)
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
        add_checkpoint_s3_args(p.add_argument_group("checkpoint copies" + without))
        p.set_defaults(func=func)
        if backend == "kubernetes":
            use_defaults(p, {**CLUSTER_DEFAULTS, "backend": "kubernetes"})
            note_given_flags(p)

    p = command(
        sub,
        "render-runtime",
        "print the ClusterTrainingRuntime a --job-api trainjob pipeline needs (apply it once, as a cluster admin)",
    )
    add_platform_args(p, mount_path="/fsx", mount_help="default: %(default)s")
    p.add_argument("--instance-type", default="p5.48xlarge", help="sets GPUs, EFA devices and memory per node")
    p.add_argument(
        "--restart-budget",
        type=int,
        default=3,
        help="whole-group restarts a TrainJob survives (JobSet failurePolicy.maxRestarts; default: %(default)s)",
    )
    p.add_argument(
        "--grace-period-s",
        type=positive_int,
        default=120,
        help="the pods' default termination grace period, the SIGTERM checkpoint's time (a run may change "
        "it: job option grace_period_s; default: %(default)s)",
    )
    p.add_argument("--image", default="", help="a default trainer image (each TrainJob names its own)")
    p.add_argument(
        "--pipeline-file",
        default="",
        metavar="PATH",
        help="the runtime a compiled --job-api trainjob pipeline's TrainJobs need, from its compiled "
        "platform settings and defaults (overridden by --param), as its preflight compares it; the "
        "platform flags are refused beside it (--restart-budget and --grace-period-s stay the runtime's "
        "own)",
    )
    p.add_argument(
        "--param",
        type=key_value,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a parameter of --pipeline-file (instance_type, job_options), as submit takes it",
    )
    p.add_argument("--pipeline-run-id", default="", help=argparse.SUPPRESS)
    note_given_flags(p)
    p.set_defaults(func=cmd_render_runtime)

    p = command(sub, "render-rbac", "print the Roles and bindings the pipeline's service account needs")
    p.add_argument(
        "--namespace",
        default="kubeflow",
        help="the service account's namespace, where the jobs go (a Kubeflow profile's; default: "
        "%(default)s, standalone KFP's)",
    )
    p.add_argument(
        "--service-account",
        default="pipeline-runner",
        help="what the pipeline's pods run as (default: %(default)s, standalone KFP's; a profile's: default-editor)",
    )
    p.add_argument("--jobs-namespace", default="", help="where the jobs go, if not in the service account's namespace")
    p.add_argument("--job-api", choices=JOB_APIS, default=DEFAULT_JOB_API, help="the compiled pipeline's job API")
    p.add_argument("--runtime-name", default=DEFAULT_RUNTIME, help="trainjob: the ClusterTrainingRuntime's name")
    p.add_argument(
        "--kubeflow-profile",
        action="store_true",
        help="the service account is a Kubeflow profile's default-editor: leave out what kubeflow-edit and "
        "Kubeflow's own grants already give it",
    )
    p.add_argument(
        "--cluster-read",
        action="store_true",
        help="add the preflight's optional cluster-wide reads (deploy/rbac-cluster-read.yaml)",
    )
    p.add_argument(
        "--split",
        metavar="DIR",
        help="write one file per deploy/ file, for every job API, instead (render-rbac --split deploy "
        "writes deploy/ as checked in)",
    )
    p.set_defaults(func=cmd_render_rbac)

    p = command(sub, "render-storage", "print a PV and PVC per namespace for one FSx for Lustre file system")
    p.add_argument(
        "--namespace",
        action="append",
        required=True,
        metavar="NS",
        help="a namespace whose runs use the file system (repeatable: one PV and PVC each)",
    )
    p.add_argument("--file-system-id", required=True, help="the FSx file system (aws fsx describe-file-systems)")
    p.add_argument("--dns-name", required=True, help="its DNSName")
    p.add_argument("--mount-name", required=True, help="its LustreConfiguration.MountName")
    p.add_argument("--capacity", required=True, help="its StorageCapacity, e.g. 2400Gi")
    p.add_argument("--pvc-name", default="fsx-lustre-pvc", help="the PVC's name (compile --fsx-pvc)")
    p.add_argument(
        "--deployment-type",
        default="",
        help="its DeploymentType, recorded on the PVs for the preflight's "
        "checkpoint-throughput check (a static PV has no StorageClass to say it)",
    )
    p.add_argument(
        "--per-unit-storage-throughput",
        type=non_negative_int,
        default=0,
        help="a PERSISTENT file system's PerUnitStorageThroughput (MB/s/TiB), recorded too",
    )
    p.set_defaults(func=cmd_render_storage)

    p = command(sub, "render-iam-policy", "print the IAM policy a run's S3 settings need, and nothing more")
    p.add_argument("--source", default="", help="the corpus prefix (s3://bucket/prefix/): list and read")
    p.add_argument("--tokenizer-path", default="", help="a tokenizer in S3: read")
    p.add_argument(
        "--checkpoint-s3-uri",
        default="",
        help="where the runs' checkpoint copies go (the trainer's role): list, read, write, prune",
    )
    p.add_argument("--export-s3-uri", default="", help="where evaluation exports the model: write")
    p.add_argument("--partition", default="aws", help="the AWS partition of the ARNs (aws, aws-cn, aws-us-gov)")
    p.set_defaults(func=cmd_render_iam_policy)

    p = command(sub, "render-service-account", "print a ServiceAccount bound to an IAM role (IRSA or Pod Identity)")
    p.add_argument("--namespace", required=True, help="its namespace (a profile's, or where the jobs run)")
    p.add_argument("--name", required=True, help="its name (compile --trainer-service-account for the trainer's)")
    p.add_argument("--role-arn", required=True, help="the IAM role its pods assume")
    p.add_argument(
        "--pod-identity",
        action="store_true",
        help="EKS Pod Identity instead of IRSA: no annotation; prints the association to make",
    )
    p.add_argument(
        "--oidc-issuer",
        default="",
        help="IRSA: the cluster's OIDC issuer URL, for the trust policy (aws eks describe-cluster --query "
        "cluster.identity.oidc.issuer); default: placeholders",
    )
    p.add_argument("--cluster-name", default="", help="the EKS cluster, for the commands printed")
    p.set_defaults(func=cmd_render_service_account)

    p = command(sub, "submit", "upload the compiled pipeline (once per content) and start a run on KFP")
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

    p = command(sub, "schedule", "create a recurring run on KFP, or disable, enable or delete one")
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

    p = command(sub, "verify-nccl", "check NCCL logs (and a run's comms self-test reports): exit 1 on a failure")
    p.add_argument("--storage-root", default="", help="with --run-id: read the run's self-test reports and nccl/")
    p.add_argument("--run-id", default="", help="with --storage-root: the run whose reports and nccl/ to read")
    p.add_argument(
        "--expect-world-size",
        "--world-size",
        type=int,
        default=0,
        help="expected ranks (default: what the logs and reports claim)",
    )
    p.add_argument(
        "--expect-world-size-range",
        default="",
        metavar="MIN:MAX",
        help="an elastic job: the judged attempt's size must be in this range",
    )
    p.add_argument(
        "--all-attempts",
        action="store_true",
        help="a run's earlier attempts fail the check too (default: only the latest is judged)",
    )
    p.add_argument(
        "--expect-transport",
        choices=["efa", "ib", "socket", "any"],
        default="",
        help="inter-node transport (default: efa on EFA instance types, else any)",
    )
    p.add_argument("--instance-type", default="", help="sets the default transport and the bandwidth floor")
    p.add_argument("--bandwidth-fails", action="store_true", help="a bus bandwidth below the floor fails, not warns")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the Markdown report")
    p.add_argument("logs", nargs="*", metavar="PATH", help="NCCL logs: files or directories (gzip is fine)")
    p.set_defaults(func=cmd_verify_nccl)

    p = command(sub, "runs", "list the runs on a storage root: dataset snapshot, state, step, val loss, training time")
    add_storage_args(p, dataset=False, run_id=False, root_default="local-runs")
    p.add_argument("--json", action="store_true", help="print a JSON list instead of the table")
    p.set_defaults(func=cmd_runs)

    p = command(sub, "evaluate", "evaluate a run's latest checkpoint on the val split")
    add_storage_args(p)
    p.add_argument("--max-tokens", type=positive_int, default=65536, help="val tokens to evaluate at most")
    p.add_argument("--checkpoint", default="latest", help="'latest' or a step number")
    p.add_argument("--max-val-loss", type=float, default=0.0, help="gate: fail above this val loss (0: none)")
    p.add_argument("--baseline-run-id", default="", help="gate: a run id, or 'previous', to be no worse than")
    p.add_argument(
        "--baseline-margin", type=float, default=0.0, help="gate: val bits per byte allowed above the baseline's"
    )
    p.add_argument(
        "--baseline-step",
        type=int,
        default=0,
        help="gate: the baseline's evaluation of this step (0: its newest evaluated)",
    )
    p.add_argument("--gate-warn-only", action="store_true", help="a failed gate warns instead of failing")
    p.add_argument("--no-export", action="store_true", help="skip the Hugging Face export to <run>/export/")
    p.add_argument("--export-s3-uri", default="", help="also upload the export to s3://bucket/prefix")
    p.add_argument("--endpoint-url", default="", help="an S3-compatible endpoint for the upload")
    p.set_defaults(func=cmd_evaluate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging()
    try:
        return args.func(args)
    except InputError as exc:
        print(f"hyperpod-pretrain {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except StepFailed as exc:
        print(f"hyperpod-pretrain {args.command}: failed: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
