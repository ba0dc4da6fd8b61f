"""What runs left on the volume: verify-nccl (a run's NCCL logs and comms self-test reports), runs (the runs on a
storage root) and evaluate (a run's checkpoints on the val split, and the gate)."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from typing import Any

from common.errors import InputError, StepFailed
from components.evaluate_checkpoint.benchmarks import BenchmarkSettings
from components.evaluate_checkpoint.inputs import DTYPES, LATEST, UNEVALUATED
from pipelines.cli.args import add_benchmark_args, add_storage_args, command, positive_int
from pipelines.runs import list_runs, render_table

# The imports inside functions are heavy (torch; verify_nccl's multiprocessing, 0.1 s): only the command that runs
# takes them, and `hyperpod-pretrain --help` loads none.

EXAMPLES = {  # each command's example, ending its --help (a test parses each)
    "verify-nccl": "verify-nccl --storage-root /fsx --run-id nightly-20261202",
    "runs": "runs --storage-root /fsx",
    "evaluate": "evaluate --storage-root local-runs --dataset stdlib-email --run-id try-1 --baseline-run-id previous",
}


def add_commands(sub: Any) -> None:
    add_verify_nccl(sub)
    add_runs(sub)
    add_evaluate(sub)


def add_verify_nccl(sub: Any) -> None:
    """verify-nccl: NCCL logs, and a run's comms self-test reports, checked."""
    p = command(
        sub,
        "verify-nccl",
        "check NCCL logs (and a run's comms self-test reports): exit 1 on a failure",
        EXAMPLES["verify-nccl"],
    )
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


def add_runs(sub: Any) -> None:
    """runs: the runs on a storage root, as a table."""
    p = command(
        sub,
        "runs",
        "list the runs on a storage root: dataset snapshot, state, step, val loss, training time",
        EXAMPLES["runs"],
    )
    add_storage_args(p, dataset=False, run_id=False, root_default="local-runs")
    p.add_argument("--json", action="store_true", help="print a JSON list instead of the table")
    p.set_defaults(func=cmd_runs)


def cmd_runs(args: argparse.Namespace) -> int:
    rows = list_runs(args.storage_root)
    print(json.dumps([asdict(r) for r in rows], indent=2) if args.json else render_table(rows))
    return 0


def add_evaluate(sub: Any) -> None:
    """evaluate: a run's checkpoint on the val split."""
    p = command(sub, "evaluate", "evaluate a run's checkpoints on the val split", EXAMPLES["evaluate"])
    add_storage_args(p)
    p.add_argument("--max-tokens", type=positive_int, default=65536, help="val tokens to evaluate at most")
    p.add_argument(
        "--checkpoint",
        default=LATEST,
        metavar="WHICH",
        help=f"{LATEST!r} (the newest committed), {UNEVALUATED!r} (each committed checkpoint not evaluated yet, "
        "oldest first; the newest again when all are), or steps, e.g. 100 or 100,200; only the newest evaluated is "
        "gated and exported",
    )
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
    add_benchmark_args(p)
    p.add_argument("--no-export", action="store_true", help="skip the Hugging Face export to <run>/export/")
    p.add_argument("--export-s3-uri", default="", help="also upload the export to s3://bucket/prefix")
    p.add_argument("--endpoint-url", default="", help="an S3-compatible endpoint for the upload")
    p.add_argument(
        "--dtype",
        choices=DTYPES,
        default="auto",
        help="the models' dtype while evaluated (auto: bfloat16 on a GPU, float32 on a CPU); the export's too, "
        "unless the run began from a published model",
    )
    p.set_defaults(func=cmd_evaluate)


def cmd_evaluate(args: argparse.Namespace) -> int:
    from components.evaluate_checkpoint.checkpoints import evaluate_checkpoints
    from components.evaluate_checkpoint.gate import Gate
    from components.evaluate_checkpoint.loading import steady_host_memory

    steady_host_memory()
    gate = Gate(
        max_val_loss=args.max_val_loss,
        baseline_run_id=args.baseline_run_id,
        baseline_margin=args.baseline_margin,
        baseline_step=args.baseline_step,
        benchmarks=args.benchmark_gate,
        warn_only=args.gate_warn_only,
    )
    results = evaluate_checkpoints(
        args.storage_root,
        args.dataset,
        args.run_id,
        max_tokens=args.max_tokens,
        checkpoints=args.checkpoint,
        gate=gate,
        export=not args.no_export,
        export_s3_uri=args.export_s3_uri,
        s3_endpoint_url=args.endpoint_url,
        dtype=args.dtype,
        benchmarks=BenchmarkSettings(args.benchmarks, args.benchmark_data, args.benchmark_limit),
    )
    print("\n\n".join(result.markdown() for result in results))
    return 0
