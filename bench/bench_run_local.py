"""Time `hyperpod-pretrain run-local` stage by stage against the same stages run directly through the CLI.

kfp.local adds a subprocess, an executor and artifact bookkeeping around every component; this script
shows what that costs. In one invocation it runs the whole pipeline under kfp.local, reads each task's
wall time from kfp.local's own "Executing task" / "finished with status" log lines, then runs the same
four cores as plain CLI subcommands (stage-data, launch, verify-nccl, evaluate) with identical settings,
each timed as a whole subprocess. It prints one table: seconds under kfp.local, seconds direct, and the
ratio, per stage and in total. It is a measurement, not a test: it never asserts on times.

    .venv/bin/python bench/bench_run_local.py [--repeats 3] [--write-results]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from machine import RESULTS, append_section, machine_lines

log = logging.getLogger("bench-run-local")

REPO = Path(__file__).resolve().parent.parent
CLI = Path(sys.executable).parent / "hyperpod-pretrain"

# kfp.local task names, in pipeline order; direct_commands maps each to its CLI subcommand.
STAGES: tuple[str, ...] = ("stage-data", "launch-pytorchjob", "verify-nccl", "evaluate-checkpoint")
TOTAL = "total"

# The data and evaluation settings run-local uses (cli.cmd_run_local hard-codes VAL_FRACTION and
# EVAL_MAX_TOKENS; the others are its defaults), given explicitly to both sides. Training flags other
# than preset, steps and processes are left at their defaults, which run-local and launch share
# (trainer.config.TRAIN_DEFAULTS); check_same_work confirms from the runs' own records that both sides
# did the same work.
DATASET = "stdlib-email"
INCLUDE = "*.py"
VOCAB_SIZE = 2048
VAL_FRACTION = 0.05
EVAL_MAX_TOKENS = 65536

ANSI = re.compile(r"\x1b\[[0-9;]*m")
# kfp.local's log lines, after stripping colours: "07:13:02.748 - INFO - Executing task 'stage-data'" and
# "07:13:02.748 - INFO - Task 'stage-data' finished with status SUCCESS".
TASK_START = re.compile(r"^(\d\d:\d\d:\d\d\.\d{3}) - INFO - Executing task '([^']+)'")
TASK_END = re.compile(r"^(\d\d:\d\d:\d\d\.\d{3}) - INFO - Task '([^']+)' finished with status (\w+)")
TAIL_LINES = 40


class BenchFailed(Exception):
    """A benchmarked command failed or its output could not be read; carries the output's tail."""


@dataclass
class Timing:
    """One repeat of one side: seconds per stage (keyed by kfp task name) and for the whole side."""

    stages: dict[str, float]
    total: float


@dataclass
class Row:
    name: str
    kfp_s: float
    direct_s: float
    ratio: float


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--storage-root",
        default="",
        help="where both sides write (under kfp/ and direct/); default: a fresh temporary directory",
    )
    p.add_argument("--keep", action="store_true", help="keep the temporary storage root instead of removing it")
    p.add_argument("--repeats", type=int, default=1, help="run both sides this many times; report medians")
    p.add_argument("--preset", default="small", help="model preset (see trainer.model.PRESETS)")
    p.add_argument("--max-steps", type=int, default=200)
    p.add_argument("--nproc-per-node", type=int, default=2)
    p.add_argument("--write-results", action="store_true", help=f"append a dated section to {RESULTS.name}")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    return args


def run_command(argv: list[str]) -> tuple[float, str]:
    """Run one CLI command to completion; return its wall seconds and merged stdout+stderr.

    Merging the streams keeps kfp.local's log lines (stderr) in order with the tasks' output.
    """
    log.info("running %s", " ".join(argv[1:]))
    started = time.perf_counter()
    proc = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)
    seconds = time.perf_counter() - started
    if proc.returncode != 0:
        raise BenchFailed(f"{' '.join(argv)} exited {proc.returncode}\n{tail(proc.stdout)}")
    log.info("  done in %.1fs", seconds)
    return seconds, proc.stdout


def tail(output: str, lines: int = TAIL_LINES) -> str:
    return "\n".join(ANSI.sub("", output).splitlines()[-lines:])


def clock_seconds(stamp: str) -> float:
    hours, minutes, seconds = stamp.split(":")
    return int(hours) * 3600 + int(minutes) * 60 + float(seconds)


def task_seconds(output: str) -> dict[str, float]:
    """Each kfp.local task's wall time, from the timestamps on its start and finish lines.

    The stamps carry no date, so a task that crosses midnight gets a day added back.
    """
    started: dict[str, float] = {}
    seconds: dict[str, float] = {}
    for line in ANSI.sub("", output).splitlines():
        if match := TASK_START.match(line):
            started[match[2]] = clock_seconds(match[1])
        elif match := TASK_END.match(line):
            stamp, name, status = match[1], match[2], match[3]
            if status != "SUCCESS" or name not in started:
                raise BenchFailed(f"task {name!r} finished with status {status}\n{tail(output)}")
            seconds[name] = (clock_seconds(stamp) - started[name]) % 86400
    missing = [name for name in STAGES if name not in seconds]
    if missing:
        raise BenchFailed(f"no finish line for task(s) {', '.join(missing)} in run-local's output\n{tail(output)}")
    return seconds


def run_kfp_side(root: Path, run_id: str, args: argparse.Namespace) -> Timing:
    """The whole pipeline under kfp.local, with its default source (the stdlib email package)."""
    total, output = run_command(
        [
            str(CLI),
            "run-local",
            "--storage-root",
            str(root),
            "--run-id",
            run_id,
            "--dataset",
            DATASET,
            "--include",
            INCLUDE,
            "--vocab-size",
            str(VOCAB_SIZE),
            "--preset",
            args.preset,
            "--max-steps",
            str(args.max_steps),
            "--nproc-per-node",
            str(args.nproc_per_node),
        ]
    )
    stages = task_seconds(output)
    log.info("kfp.local spent %.1fs of %.1fs outside its four tasks", total - sum(stages.values()), total)
    return Timing(stages, total)


def direct_commands(root: Path, run_id: str, args: argparse.Namespace) -> dict[str, list[str]]:
    """The four CLI subcommands that do run-local's work, keyed by the kfp task each one stands for."""
    from pipelines.local_run import default_corpus

    cli, storage = str(CLI), ["--storage-root", str(root)]
    return {
        "stage-data": [
            cli,
            "stage-data",
            "--source",
            default_corpus(),
            "--include",
            INCLUDE,
            *storage,
            "--dataset",
            DATASET,
            "--vocab-size",
            str(VOCAB_SIZE),
            "--val-fraction",
            str(VAL_FRACTION),
        ],
        "launch-pytorchjob": [
            cli,
            "launch",
            "--backend",
            "local",
            *storage,
            "--dataset",
            DATASET,
            "--run-id",
            run_id,
            "--nnodes",
            "1",
            "--nproc-per-node",
            str(args.nproc_per_node),
            "--preset",
            args.preset,
            "--max-steps",
            str(args.max_steps),
        ],
        # run-local's verify step checks nnodes * nproc_per_node ranks, with nnodes fixed at 1.
        "verify-nccl": [cli, "verify-nccl", *storage, "--run-id", run_id, "--world-size", str(args.nproc_per_node)],
        "evaluate-checkpoint": [
            cli,
            "evaluate",
            *storage,
            "--dataset",
            DATASET,
            "--run-id",
            run_id,
            "--max-tokens",
            str(EVAL_MAX_TOKENS),
        ],
    }


def run_direct_side(root: Path, run_id: str, args: argparse.Namespace) -> Timing:
    """The same four stages in sequence, each its own process, as a user would run them by hand."""
    stages = {name: run_command(argv)[0] for name, argv in direct_commands(root, run_id, args).items()}
    return Timing(stages, sum(stages.values()))


def check_fresh(root: Path, repeats: int) -> None:
    """Refuse run ids that already exist: training would resume from their checkpoints and do less work."""
    for side, prefix in (("kfp", "bench-kfp"), ("direct", "bench-direct")):
        for n in range(repeats):
            run_dir = root / side / "runs" / f"{prefix}-{n}"
            if run_dir.exists():
                raise BenchFailed(f"{run_dir} exists (training would resume from it): use an empty --storage-root")


def measure_once(root: Path, n: int, args: argparse.Namespace) -> tuple[Timing, Timing]:
    """One repeat of both sides; the side that goes first alternates so drift on a shared box evens out."""
    kfp_root, kfp_id = root / "kfp", f"bench-kfp-{n}"
    direct_root, direct_id = root / "direct", f"bench-direct-{n}"
    if n % 2 == 0:
        kfp = run_kfp_side(kfp_root, kfp_id, args)
        direct = run_direct_side(direct_root, direct_id, args)
    else:
        direct = run_direct_side(direct_root, direct_id, args)
        kfp = run_kfp_side(kfp_root, kfp_id, args)
    check_same_work((kfp_root, kfp_id), (direct_root, direct_id))
    return kfp, direct


def work_record(storage_root: Path, run_id: str) -> dict[str, Any]:
    """What a run did, from the files its steps wrote, minus anything that names its own paths or id."""
    from trainer.layout import META, DatasetPaths, RunPaths

    run = RunPaths.of(storage_root, run_id)
    config = json.loads(run.config.read_text())
    trainer = {k: v for k, v in config["trainer"].items() if k not in ("data_dir", "run_dir")}
    evaluation = json.loads(run.eval_result.read_text())
    return {
        "dataset": json.loads((DatasetPaths.of(storage_root, DATASET).current_snapshot() / META).read_text()),
        "model": config["model"],
        "trainer": trainer,
        "world_size": config["world_size"],
        "evaluation": {k: evaluation[k] for k in ("step", "train_tokens_seen", "val_tokens")},
        "val_loss": evaluation["val_loss"],
    }


def check_same_work(kfp: tuple[Path, str], direct: tuple[Path, str]) -> None:
    """Fail unless both sides staged, trained and evaluated alike; otherwise the ratios would mislead."""
    try:
        a, b = work_record(*kfp), work_record(*direct)
    except (OSError, KeyError, ValueError) as exc:
        raise BenchFailed(f"cannot read what the runs did: {exc}") from None
    differ = [key for key in a if key != "val_loss" and a[key] != b[key]]
    if differ:
        details = "\n".join(f"  {key}: kfp.local {a[key]} / direct {b[key]}" for key in differ)
        raise BenchFailed(f"the two sides did different work ({', '.join(differ)}):\n{details}")
    log.info("same work on both sides; val loss kfp.local %.4f, direct %.4f", a["val_loss"], b["val_loss"])


def seconds_of(timing: Timing, name: str) -> float:
    return timing.total if name == TOTAL else timing.stages[name]


def summarise(pairs: list[tuple[Timing, Timing]]) -> list[Row]:
    """Median seconds per side and median of the per-repeat ratios (each ratio measured side by side)."""
    rows = []
    for name in (*STAGES, TOTAL):
        kfp = [seconds_of(k, name) for k, _ in pairs]
        direct = [seconds_of(d, name) for _, d in pairs]
        ratios = [k / d for k, d in zip(kfp, direct, strict=True)]
        rows.append(Row(name, statistics.median(kfp), statistics.median(direct), statistics.median(ratios)))
    return rows


def table(rows: list[Row]) -> str:
    lines = ["| stage | kfp.local (s) | direct (s) | kfp.local / direct |", "|---|---:|---:|---:|"]
    lines += [f"| {r.name} | {r.kfp_s:.2f} | {r.direct_s:.2f} | {r.ratio:.2f} |" for r in rows]
    return "\n".join(lines)


def caption(args: argparse.Namespace) -> str:
    how = "one run" if args.repeats == 1 else f"median of {args.repeats} repeats (ratio: median of per-repeat ratios)"
    return (
        f"preset {args.preset}, {args.max_steps} steps, {args.nproc_per_node} processes; {how}. "
        f"kfp.local stage times are task wall times from kfp.local's log; its total is the whole "
        f"run-local command. Direct times are whole CLI processes; the direct total is their sum."
    )


def write_results(rows: list[Row], args: argparse.Namespace) -> None:
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    machine = [*machine_lines("torch", "kfp"), f"load average at the end: {load}"]
    append_section("run-local stage by stage", [caption(args), "", table(rows)], machine)
    log.info("appended results to %s", RESULTS)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    temporary = not args.storage_root
    root = Path(args.storage_root or tempfile.mkdtemp(prefix="bench-run-local-")).resolve()
    log.info("storage root %s", root)
    try:
        check_fresh(root, args.repeats)
        pairs = []
        for n in range(args.repeats):
            log.info("repeat %d/%d", n + 1, args.repeats)
            pairs.append(measure_once(root, n, args))
        rows = summarise(pairs)
    except BenchFailed as exc:
        print(f"bench_run_local: failed: {exc}", file=sys.stderr)
        return 1
    finally:
        if temporary and not args.keep:
            shutil.rmtree(root, ignore_errors=True)
        elif temporary:
            log.info("kept %s", root)
    if args.write_results:
        write_results(rows, args)
    print(f"{caption(args)}\n\n{table(rows)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
