"""The pipeline, and the corpus on the volume: compile, run-local (the whole pipeline on this machine, kfp.local),
stage-data and prune-snapshots."""

from __future__ import annotations

import argparse
import difflib
import json
import logging
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

from common.errors import InputError, StepFailed
from components.evaluate_checkpoint.benchmarks import DEFAULT_BENCHMARKS
from components.evaluate_checkpoint.inputs import LATEST, UNEVALUATED
from components.evaluate_checkpoint.resources import EvaluationResources
from components.stage_data import SAMPLE_MB, SHARD_TOKENS, TEXT_FIELD, VAL_FRACTION, VOCAB_SIZE
from components.stage_data.settings import StageSettings
from components.stage_data.snapshots import prune_snapshots
from components.stage_data.sources import DEFAULT_EXCLUDE
from pipelines import COMPILED_PIPELINE
from pipelines.cli.args import (
    DEMO_INCLUDE,
    SOURCE_INCLUDE,
    add_benchmark_args,
    add_mixture_arg,
    add_platform_args,
    add_storage_args,
    command,
    key_value,
    non_negative_int,
    platform_from_args,
    positive_int,
    toleration,
)
from pipelines.cli.run_settings import add_endpoint_arg, add_train_args, run_local_arguments, tracking_uri
from pipelines.local_run import run_local
from trainer.layout import RunPaths
from trainer.tracking import where_to_look

# The imports inside functions are heavy (kfp, torch): only the command that runs takes them, and
# `hyperpod-pretrain --help` loads none.

log = logging.getLogger("hyperpod-pretrain")
EVALUATION = EvaluationResources()  # the evaluate step's pod by default: compile's --evaluation-* flags

EXAMPLES = {  # each command's example, ending its --help (a test parses each)
    "compile": "compile --image-registry 123456789012.dkr.ecr.us-west-2.amazonaws.com --tag v0.2.0 "
    "--fsx-pvc fsx-claim --job-namespace ml-team",
    "run-local": "run-local --max-steps 50",
    "stage-data": "stage-data --source s3://my-bucket/corpus/ --storage-root /fsx --dataset web-2026-11",
    "prune-snapshots": "prune-snapshots --storage-root /fsx --dataset web-2026-11 --dry-run",
}


def add_commands(sub: Any) -> None:
    add_compile(sub)
    add_run_local(sub)
    add_stage_data(sub)
    add_prune_snapshots(sub)


def add_compile(sub: Any) -> None:
    """compile: the pipeline's YAML, with the platform team's settings compiled in."""
    p = command(sub, "compile", "compile the pipeline to YAML", EXAMPLES["compile"])
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
        "the steps run in REGISTRY/hyperpod-pretrain-components:TAG (the evaluation on a GPU in "
        "REGISTRY/hyperpod-pretrain-evaluator:TAG) and trainer_image defaults to "
        "REGISTRY/hyperpod-pretrain-trainer:TAG (REGISTRY/hyperpod-pretrain-trainer-hyperpod:TAG for "
        "--job-api hyperpodpytorchjob)",
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
    evaluation = p.add_argument_group(
        "evaluation", "where the evaluate step runs; the preflight's evaluation-memory check holds the model to it"
    )
    evaluation.add_argument(
        "--evaluation-gpus",
        type=non_negative_int,
        default=EVALUATION.gpus,
        metavar="N",
        help="1: on a GPU of the training nodes (the trainer pods' node selector and tolerations), the model in "
        "bf16, in the evaluator image; 0: on the CPU, in fp32, in the components image (a cluster without a "
        "spare GPU)",
    )
    evaluation.add_argument(
        "--evaluation-cpu", default=EVALUATION.cpu, metavar="CPU", help="the evaluate step's CPUs (e.g. 8, 500m)"
    )
    evaluation.add_argument(
        "--evaluation-memory",
        default=EVALUATION.memory,
        metavar="QUANTITY",
        help="the evaluate step's memory limit (e.g. 64Gi): on the CPU it holds the fp32 model, 4 bytes a parameter",
    )
    evaluation.add_argument(
        "--benchmark-data-s3-uri",
        default="",
        metavar="URI",
        help="where the team mirrored lm-evaluation-harness tasks' data (s3://bucket/prefix, a folder per task; "
        "docs/evaluation.md): the benchmark_data_uri parameter's default, and then the benchmarks parameter "
        f"defaults to {DEFAULT_BENCHMARKS} (default: none, and no benchmarks)",
    )
    p.set_defaults(func=cmd_compile)


def cmd_compile(args: argparse.Namespace) -> int:
    from pipelines.pipeline import Images, PlatformOptions, compile_pipeline

    if args.tag and not args.image_registry:
        raise InputError("--tag names the images in --image-registry: give both")
    images = Images.in_registry(args.image_registry, args.tag, args.job_api) if args.image_registry else Images()
    registry = [args.image_registry.rstrip("/")] if args.image_registry else []
    job = platform_from_args(args, namespaces=["kubeflow"], registries=registry)
    platform = PlatformOptions(
        job=job,
        node_selector=dict(args.node_selector),
        tolerations=args.toleration,
        image_pull_secrets=args.image_pull_secret,
        images=images,
        mlflow_tracking_uri=args.mlflow_tracking_uri,
        benchmark_data_s3_uri=args.benchmark_data_s3_uri,
    )
    platform.evaluate_with(EvaluationResources(args.evaluation_gpus, args.evaluation_cpu, args.evaluation_memory))
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


def add_run_local(sub: Any) -> None:
    """run-local: the whole pipeline on this machine."""
    p = command(
        sub, "run-local", "run the compiled pipeline end to end on this machine (kfp.local)", EXAMPLES["run-local"]
    )
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
    p.add_argument(
        "--eval-checkpoints",
        default=LATEST,
        metavar="WHICH",
        help=f"the checkpoints the evaluate step measures (the eval_checkpoints parameter): {LATEST!r}, "
        f"{UNEVALUATED!r} (each one not evaluated yet, oldest first), or steps, e.g. 100,200; the newest of them is "
        "gated and exported",
    )
    add_benchmark_args(p.add_argument_group("benchmarks", "what the evaluation scores besides the val loss"))
    add_endpoint_arg(p.add_argument_group("S3"))
    p.set_defaults(func=cmd_run_local)


def cmd_run_local(args: argparse.Namespace) -> int:
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


def add_stage_data(sub: Any) -> None:
    """stage-data: staging's core by itself."""
    p = command(sub, "stage-data", "stage a corpus onto the volume and tokenize it", EXAMPLES["stage-data"])
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


def cmd_stage_data(args: argparse.Namespace) -> int:
    from components.stage_data.core import stage_data

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


def add_prune_snapshots(sub: Any) -> None:
    """prune-snapshots: the snapshots no run uses."""
    p = command(
        sub,
        "prune-snapshots",
        "remove a dataset's snapshots that are not current and no run uses",
        EXAMPLES["prune-snapshots"],
    )
    add_storage_args(p, run_id=False)
    p.add_argument("--dry-run", action="store_true", help="only say what would be removed")
    p.set_defaults(func=cmd_prune_snapshots)


def cmd_prune_snapshots(args: argparse.Namespace) -> int:
    result = prune_snapshots(args.storage_root, args.dataset, dry_run=args.dry_run)
    print(json.dumps(asdict(result), indent=2))
    return 0
