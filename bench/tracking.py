"""Watching a run: the trainer's tokens/s with TensorBoard and MLflow on, against both off, side by side.

Stages a small synthetic corpus once (tests.helpers.write_corpus, vocabulary 512), starts a real MLflow tracking
server on loopback (tests/mlflow_server.py: `mlflow server`, SQLite) and a relay in front of it that holds each
answer until --delay-s (5 s) after its request began, then trains the same short run (preset tiny, 2 processes under
torchrun through the local launcher, seq 64, batch 8, a metrics row every step: the watchers' worst case; one
checkpoint, at the end) in three configurations, interleaved over rounds so that other work on the machine hits all
three alike:

- off: TRAINER_TENSORBOARD=false, no tracking URI;
- on: TensorBoard's event files and MLflow to the loopback server;
- slow: TensorBoard and MLflow through the relay: a server that answers every request 5 s late.

Per run: the median tokens/s and step time of metrics.jsonl's rows past the first 10 steps, the wall time of
`launch()`, the MLflow points not sent (rank 0's log), the MLflow server's CPU time meanwhile and the ranks' peak RSS
(the feed's queue stays bounded). Then, in this process, the cost of a `RunWatch.row` call with a real row, one every
off-run step (TensorBoard alone, then with the feed): the caller's time, this process's CPU and the server's. The
server is left to go idle first (mlflow 3's job runner, where on, starts workers for some 10 s after it answers). It
is a measurement, not a test: it never asserts on times.

    .venv/bin/python bench/tracking.py [--rounds 3] [--steps 200] [--delay-s 5] [--write-results]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from machine import RESULTS, append_section, machine_lines

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # tests.helpers, tests.mlflow_server

from components.launch_training.core import launch  # noqa: E402
from components.stage_data.core import stage_data  # noqa: E402
from tests.helpers import tiny_launch, write_corpus  # noqa: E402
from tests.mlflow_server import MlflowServer, Relay  # noqa: E402
from trainer.tracking import MlflowFeed, RunWatch, chart_points  # noqa: E402

log = logging.getLogger("bench-tracking")

TARGET = 0.98  # on / off and slow / off tokens/s
WARMUP = 10  # the first steps' rows, left out of the median unless --warmup-steps says more
CLOSE_TIMEOUT_S = 30.0  # train_ddp.py: watch.close(timeout_s=30.0) at a normal end
ROWS = 300
UNSENT = re.compile(r"MLflow: (\d+) metric points of this run were not sent")
CONFIGS = ("off", "on", "slow")


@dataclass
class Run:
    tokens_per_s: float  # median over the rows past the warm-up
    step_s: float  # median step_time_s over the same rows
    wall_s: float
    unsent: int  # from rank 0's log; 0 when it says nothing
    points: int  # the metric points the run made: its rows', and 2 of its one checkpoint
    rss_gib: float  # the peak rss_gib of the rows (the larger rank's)
    server_cpu_s: float  # CPU seconds the MLflow server's processes used meanwhile


def tree_cpu_s(root: int) -> float:
    """CPU seconds so far of process `root` and its descendants (/proc; children it reaped included)."""
    children: dict[int, list[int]] = {}
    cpu: dict[int, float] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # field n of proc(5) at n - 3
        except OSError:  # gone meanwhile
            continue
        pid = int(stat.parent.name)
        children.setdefault(int(fields[1]), []).append(pid)
        cpu[pid] = sum(map(int, fields[11:15])) / os.sysconf("SC_CLK_TCK")
    todo, total = [root], 0.0
    while todo:
        pid = todo.pop()
        total += cpu.get(pid, 0.0)
        todo += children.get(pid, [])
    return total


def settle(pid: int, timeout_s: float = 120.0) -> None:
    """Wait for the MLflow server to go idle (its job runner, where on, starts workers for 10 s after it answers)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        before = tree_cpu_s(pid)
        time.sleep(2.0)
        if tree_cpu_s(pid) - before < 0.1:
            return


def train(
    root: Path, name: str, steps: int, env: dict[str, str], server: int, warmup: int = WARMUP, log_every: int = 1
) -> Run:
    cfg = tiny_launch(
        root,
        name,
        max_steps=steps,
        log_every=log_every,
        checkpoint_every=steps,
        eval_every=0,
        timeout_s=900,
        extra_env=env,
    )
    started, served = time.perf_counter(), tree_cpu_s(server)
    launch(cfg)
    wall, served = time.perf_counter() - started, tree_cpu_s(server) - served
    rows = [json.loads(line) for line in cfg.run_paths.metrics.read_text().splitlines() if line.strip()]
    steady = [r for r in rows if r["step"] > warmup]
    said = UNSENT.search(cfg.run_paths.rank_log(0).read_text())
    run = Run(
        statistics.median(r["tokens_per_s"] for r in steady),
        statistics.median(r["step_time_s"] for r in steady),
        wall,
        int(said[1]) if said else 0,
        sum(map(len, map(chart_points, rows))) + 2,
        max(r["rss_gib"] for r in rows),
        served,
    )
    log.info("  %s: %.0f tokens/s, %.1f s, %d points not sent", name, run.tokens_per_s, wall, run.unsent)
    return run


def row_cost(server: MlflowServer, directory: Path, row: dict[str, Any], interval_s: float) -> dict[str, float]:
    """Microseconds per RunWatch.row call, ROWS calls one every `interval_s` (the off runs' step: the feed sends about
    a request a row, as in training): of the caller's time, of this process's CPU (the TensorBoard writer's and the
    feed's threads included) and of the MLflow server's CPU; TensorBoard alone, then with the MLflow feed."""
    from torch.utils.tensorboard import SummaryWriter

    cost = {}
    for kind in ("tensorboard", "mlflow"):
        events = SummaryWriter(str(directory / kind), max_queue=1000, flush_secs=10)
        feed = MlflowFeed(server.url, "bench-rows", directory / kind, kind, {}) if kind == "mlflow" else None
        watch = RunWatch(events, feed, directory / kind / "mlflow.json")
        watch.row(row)  # the first: imports
        deadline = time.monotonic() + 60
        while feed is not None and feed.run_id is None and time.monotonic() < deadline:
            time.sleep(0.1)  # the feed imports mlflow and opens its run
        caller, cpu, served = 0.0, time.process_time(), tree_cpu_s(server.process.pid)
        for step in range(ROWS):
            started = time.perf_counter()
            watch.row(row | {"step": step + 1})
            caller += time.perf_counter() - started
            time.sleep(interval_s)
        watch.close(CLOSE_TIMEOUT_S)  # writes and sends it all
        cost[kind] = caller / ROWS * 1e6
        cost[f"{kind} cpu"] = (time.process_time() - cpu) / ROWS * 1e6
        cost[f"{kind} server"] = (tree_cpu_s(server.process.pid) - served) / ROWS * 1e6
    return cost


def median_ratio(runs: dict[str, list[Run]], config: str, field: str) -> float:
    pairs = zip(runs[config], runs["off"], strict=True)
    return statistics.median(getattr(c, field) / getattr(o, field) for c, o in pairs)


def report(runs: dict[str, list[Run]], cost: dict[str, float], args: argparse.Namespace) -> list[str]:
    lines = [
        f"| round | config | tokens/s (median, steps > {args.warmup_steps}) | step (ms) | / off | wall (s) | "
        "/ off | MLflow points not sent | MLflow server CPU (s) | peak RSS, either rank (GiB) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n in range(args.rounds):
        off = runs["off"][n]
        for config in CONFIGS:
            r = runs[config][n]
            lines.append(
                f"| {n + 1} | {config} | {r.tokens_per_s:.0f} | {r.step_s * 1e3:.2f} | "
                f"{r.tokens_per_s / off.tokens_per_s:.3f} | {r.wall_s:.1f} | {r.wall_s / off.wall_s:.2f} | "
                f"{r.unsent} of {r.points} | {r.server_cpu_s:.1f} | {r.rss_gib:.2f} |"
            )
    on, slow = median_ratio(runs, "on", "tokens_per_s"), median_ratio(runs, "slow", "tokens_per_s")
    delays = [s.wall_s - o.wall_s for s, o in zip(runs["slow"], runs["off"], strict=True)]
    beyond_on = [s.wall_s - o.wall_s for s, o in zip(runs["slow"], runs["on"], strict=True)]
    step = {c: statistics.median(r.step_s for r in runs[c]) * 1e3 for c in CONFIGS}  # ms
    rank0, served = cost["mlflow cpu"] / 1e3, cost["mlflow server"] / 1e3  # ms per row
    return lines + [
        "",
        f"Medians of per-round ratios: tokens/s on / off **{on:.3f}**, slow / off **{slow:.3f}** (target >= {TARGET}: "
        f"{'met' if min(on, slow) >= TARGET else 'NOT met'}); wall time on / off "
        f"{median_ratio(runs, 'on', 'wall_s'):.2f}, slow / off {median_ratio(runs, 'slow', 'wall_s'):.2f}. Median "
        f"step: off {step['off']:.1f} ms, on {step['on']:.1f} ms, slow {step['slow']:.1f} ms. The slow runs ended "
        f"{min(delays):.1f}-{max(delays):.1f} s after the off runs of their round, {min(beyond_on):.1f}-"
        f"{max(beyond_on):.1f} s after the on runs (the feed's close timeout: {CLOSE_TIMEOUT_S:.0f} s; "
        f"{'within it' if max(beyond_on) <= CLOSE_TIMEOUT_S else 'PAST IT'}).",
        "",
        f"Per `RunWatch.row` call, in process ({ROWS} calls with the last on run's last row, one every "
        f"{step['off']:.1f} ms): TensorBoard alone {cost['tensorboard']:.0f} us of the caller's time, "
        f"{cost['tensorboard cpu']:.0f} us of the process's CPU (its writer thread included); with the MLflow feed "
        f"{cost['mlflow']:.0f} us of the caller's time, {cost['mlflow cpu']:.0f} us of the process's CPU (the feed's "
        f"thread sending included), and {cost['mlflow server']:.0f} us of the MLflow server's CPU.",
        "",
        f"PROJECTION (computed, not measured): a row with MLflow costs rank 0's process {rank0:.2f} ms of CPU and the "
        f"server {served:.2f} ms; here both share 2 CPUs with 2 busy ranks, against a {step['off']:.1f} ms step. On a "
        f"GPU node the server is elsewhere and rank 0's threads have spare cores: at most {rank0:.2f} ms a row on the "
        f"critical path (the GIL), {rank0 / 100:.2%} of a 100 ms step, {rank0 / 1000:.3%} of a 1 s step, a tenth of "
        "that at the default log_every=10.",
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3, help="rounds of off, on, slow")
    p.add_argument("--steps", type=int, default=200, help="steps per run (a metrics row each)")
    p.add_argument("--delay-s", type=float, default=5.0, help="how late the relay lets each answer through (slow)")
    p.add_argument(
        "--warmup-steps",
        type=int,
        default=WARMUP,
        help="steps left out of the medians: the start, and the feed's import of MLflow (seconds of CPU)",
    )
    p.add_argument(
        "--log-every",
        type=int,
        default=1,
        help="steps between metrics rows (default 1: the watchers' worst case; the trainer's default is 10)",
    )
    p.add_argument("--write-results", action="store_true", help=f"append a dated section to {RESULTS.name}")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.steps <= 2 * args.warmup_steps:
        p.error(f"--rounds must be at least 1 and --steps above twice --warmup-steps ({2 * args.warmup_steps})")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    with tempfile.TemporaryDirectory(prefix="bench-tracking-") as tmp:
        root = Path(tmp) / "fsx"
        stage_data(str(write_corpus(Path(tmp) / "corpus")), str(root), "synthetic", vocab_size=512)
        runs: dict[str, list[Run]] = {config: [] for config in CONFIGS}
        with MlflowServer(Path(tmp) / "mlflow") as server:
            relay = Relay(server.port, delay_s=args.delay_s)
            settle(server.process.pid)
            tracking = {"TRAINER_TENSORBOARD": "true", "TRAINER_MLFLOW_EXPERIMENT": "bench-tracking"}
            envs = {
                "off": {"TRAINER_TENSORBOARD": "false"},
                "on": tracking | {"TRAINER_MLFLOW_TRACKING_URI": server.url},
                "slow": tracking | {"TRAINER_MLFLOW_TRACKING_URI": relay.url},
            }
            for n in range(args.rounds):
                log.info("round %d/%d", n + 1, args.rounds)
                for config in CONFIGS:
                    runs[config].append(
                        train(
                            root,
                            f"{config}-{n}",
                            args.steps,
                            envs[config],
                            server.process.pid,
                            args.warmup_steps,
                            args.log_every,
                        )
                    )
            relay.stop()
            last = tiny_launch(root, f"on-{args.rounds - 1}").run_paths.metrics.read_text().splitlines()[-1]
            interval_s = statistics.median(r.step_s for r in runs["off"])
            cost = row_cost(server, Path(tmp) / "rows", json.loads(last), interval_s)
    options = (
        f"--rounds {args.rounds} --steps {args.steps} --warmup-steps {args.warmup_steps} --log-every "
        f"{args.log_every} --delay-s {args.delay_s:g}"
    )
    command = f"`.venv/bin/python bench/tracking.py {options}`"
    body = [
        command,
        "",
        f"The trainer (preset tiny, 2 processes under torchrun, gloo on CPU, seq 64, batch 8 per rank, a metrics "
        f"row every {args.log_every} step(s), {args.steps} steps) with TensorBoard and MLflow off, on (a real "
        f"`mlflow server` with "
        f"SQLite on loopback), and slow (the same server behind a relay answering each request "
        f"{args.delay_s:g} s late); {args.rounds} rounds of off, on, slow in turn.",
        "",
        *report(runs, cost, args),
    ]
    print("\n".join(body))
    if args.write_results:
        append_section(
            "Watching a run: TensorBoard and MLflow overhead (bench/tracking.py)",
            body,
            machine_lines("torch", "tensorboard", "mlflow"),
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
