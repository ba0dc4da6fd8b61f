"""Watching a run: the trainer's tokens/s with TensorBoard and MLflow on, against both off, side by side.

Stages a small synthetic corpus once (tests.helpers.write_corpus, vocabulary 512), starts a real MLflow tracking
server on loopback (tests/mlflow_server.py: `mlflow server`, SQLite) and a relay in front of it that delays each
chunk a client sends by --delay-s (5 s), then trains the same short run (preset tiny, 2 processes under torchrun
through the local launcher, seq 64, batch 8, a metrics row every step: the watchers' worst case; one checkpoint, at
the end) in three configurations, interleaved over rounds so that other work on the machine hits all three alike:

- off: TRAINER_TENSORBOARD=false, no tracking URI;
- on: TensorBoard's event files and MLflow to the loopback server;
- slow: TensorBoard and MLflow through the relay. At 5 s it answers no write in time: a POST is two chunks (headers,
  body: 10 s, the feed's request timeout), and the server's 5 s keep-alive drops a reused connection meanwhile.

Per run: the median tokens/s of metrics.jsonl's rows past the first 10 steps, the wall time of `launch()`, the ranks'
peak RSS (the feed's queue stays bounded) and, from rank 0's log, the MLflow points not sent. Then, in this process,
the cost of one `RunWatch.row` call with a real row (TensorBoard alone, and with the feed to the server). It is a
measurement, not a test: it never asserts on times.

    .venv/bin/python bench/tracking.py [--rounds 3] [--steps 200] [--delay-s 5] [--write-results]
"""

from __future__ import annotations

import argparse
import json
import logging
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

from components.launch_pytorchjob.core import launch  # noqa: E402
from components.stage_data.core import stage_data  # noqa: E402
from tests.helpers import tiny_launch, write_corpus  # noqa: E402
from tests.mlflow_server import MlflowServer, Relay  # noqa: E402
from trainer.tracking import MlflowFeed, RunWatch, chart_points  # noqa: E402

log = logging.getLogger("bench-tracking")

TARGET = 0.98  # on / off and slow / off tokens/s
WARMUP = 10  # rows of the first steps left out of the median
CLOSE_TIMEOUT_S = 30.0  # train_ddp.py: watch.close(timeout_s=30.0) at a normal end
ROW_CALLS = 1000
UNSENT = re.compile(r"MLflow: (\d+) metric points of this run were not sent")
CONFIGS = ("off", "on", "slow")


@dataclass
class Run:
    tokens_per_s: float  # median over the rows past WARMUP
    step_s: float  # median step_time_s over the same rows
    wall_s: float
    unsent: int  # from rank 0's log; 0 when it says nothing
    points: int  # the metric points the rows made (the one checkpoint's 2 besides)
    rss_gib: float  # the peak rss_gib of the rows (the larger rank's)


def train(root: Path, name: str, steps: int, env: dict[str, str]) -> Run:
    cfg = tiny_launch(root, name, max_steps=steps, log_every=1, checkpoint_every=steps, eval_every=0, timeout_s=900,
                      extra_env=env)  # fmt: skip
    started = time.perf_counter()
    launch(cfg)
    wall = time.perf_counter() - started
    rows = [json.loads(line) for line in cfg.run_paths.metrics.read_text().splitlines() if line.strip()]
    steady = [r for r in rows if r["step"] > WARMUP]
    said = UNSENT.search(cfg.run_paths.rank_log(0).read_text())
    run = Run(statistics.median(r["tokens_per_s"] for r in steady), statistics.median(r["step_time_s"] for r in steady),
              wall, int(said[1]) if said else 0, sum(map(len, map(chart_points, rows))),
              max(r["rss_gib"] for r in rows))  # fmt: skip
    log.info("  %s: %.0f tokens/s, %.1f s, %d points not sent", name, run.tokens_per_s, wall, run.unsent)
    return run


def row_cost(url: str, directory: Path, row: dict[str, Any]) -> dict[str, float]:
    """Microseconds of rank 0's time per RunWatch.row call (ROW_CALLS calls, back to back), TensorBoard alone and
    with the MLflow feed; and the process's CPU time per row, the writer's and the feed's threads included."""
    from torch.utils.tensorboard import SummaryWriter

    cost = {}
    for kind in ("tensorboard", "tensorboard+mlflow"):
        events = SummaryWriter(str(directory / kind), max_queue=1000, flush_secs=10)
        feed = MlflowFeed(url, "bench-rows", directory / kind, kind, {}) if "mlflow" in kind else None
        watch = RunWatch(events, feed, directory / kind / "mlflow.json")
        watch.row(row)  # the first: imports
        deadline = time.monotonic() + 60
        while feed is not None and feed.run_id is None and time.monotonic() < deadline:
            time.sleep(0.1)  # the feed imports mlflow and opens its run
        wall, cpu = time.perf_counter(), time.process_time()
        for step in range(ROW_CALLS):
            watch.row(row | {"step": step + 1})
        cost[kind] = (time.perf_counter() - wall) / ROW_CALLS * 1e6
        watch.close(CLOSE_TIMEOUT_S)  # writes and sends it all
        cost[f"{kind} cpu"] = (time.process_time() - cpu) / ROW_CALLS * 1e6
    return cost


def median_ratio(runs: dict[str, list[Run]], config: str, field: str) -> float:
    pairs = zip(runs[config], runs["off"], strict=True)
    return statistics.median(getattr(c, field) / getattr(o, field) for c, o in pairs)


def report(runs: dict[str, list[Run]], cost: dict[str, float], args: argparse.Namespace) -> list[str]:
    lines = ["| round | config | tokens/s (median, steps > 10) | step (ms) | / off | wall (s) | / off | "
             "MLflow points not sent | peak RSS, either rank (GiB) |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for n in range(args.rounds):
        off = runs["off"][n]
        for config in CONFIGS:
            r = runs[config][n]
            lines.append(f"| {n + 1} | {config} | {r.tokens_per_s:.0f} | {r.step_s * 1e3:.2f} | "
                         f"{r.tokens_per_s / off.tokens_per_s:.3f} | {r.wall_s:.1f} | {r.wall_s / off.wall_s:.2f} | "
                         f"{r.unsent} | {r.rss_gib:.2f} |")  # fmt: skip
    on, slow = median_ratio(runs, "on", "tokens_per_s"), median_ratio(runs, "slow", "tokens_per_s")
    delays = [s.wall_s - o.wall_s for s, o in zip(runs["slow"], runs["off"], strict=True)]
    beyond_on = [s.wall_s - o.wall_s for s, o in zip(runs["slow"], runs["on"], strict=True)]
    per_row_ms = cost["tensorboard+mlflow"] / 1e3
    step_ms = statistics.median(r.step_s for r in runs["off"]) * 1e3
    met = "met" if min(on, slow) >= TARGET else "NOT met"
    lines += [
        "",
        f"Medians of per-round ratios: tokens/s on / off **{on:.3f}**, slow / off **{slow:.3f}** (target >= {TARGET}: "
        f"{met}); wall time on / off {median_ratio(runs, 'on', 'wall_s'):.2f}, slow / off "
        f"{median_ratio(runs, 'slow', 'wall_s'):.2f}. The slow runs ended {min(delays):.1f}-{max(delays):.1f} s after "
        f"the off runs of their round, {min(beyond_on):.1f}-{max(beyond_on):.1f} s after the on runs (the feed's close "
        f"timeout: {CLOSE_TIMEOUT_S:.0f} s; {'within it' if max(delays) <= CLOSE_TIMEOUT_S else 'PAST IT'}), with "
        f"{', '.join(f'{r.unsent} of {r.points}' for r in runs['slow'])} MLflow points not sent.",
        "",
        f"One `RunWatch.row` call, in process ({ROW_CALLS} calls with a real row, back to back): TensorBoard alone "
        f"{cost['tensorboard']:.0f} us, with the MLflow feed {cost['tensorboard+mlflow']:.0f} us of the caller's time; "
        f"the process's CPU per row, the writer's and the feed's threads included: {cost['tensorboard cpu']:.0f} us "
        f"and {cost['tensorboard+mlflow cpu']:.0f} us.",
        "",
        f"PROJECTION (computed, not measured): a row costs rank 0 about {per_row_ms:.2f} ms, "
        f"{per_row_ms / step_ms:.1%} of this CPU tiny model's {step_ms:.1f} ms step; on a GPU step of 100 ms it "
        f"would be {per_row_ms / 100:.2%}, of 1 s {per_row_ms / 1000:.3%}, and a tenth of that at the default "
        "log_every=10. Not shown here: a remote server (here it shares the 2 CPUs with the trainer), a full queue.",
    ]
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3, help="rounds of off, on, slow")
    p.add_argument("--steps", type=int, default=200, help="steps per run (a metrics row each)")
    p.add_argument("--delay-s", type=float, default=5.0, help="the relay's delay of each request chunk (slow)")
    p.add_argument("--write-results", action="store_true", help=f"append a dated section to {RESULTS.name}")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.steps <= 2 * WARMUP:
        p.error(f"--rounds must be at least 1 and --steps above {2 * WARMUP}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    with tempfile.TemporaryDirectory(prefix="bench-tracking-") as tmp:
        root = Path(tmp) / "fsx"
        stage_data(str(write_corpus(Path(tmp) / "corpus")), str(root), "synthetic", vocab_size=512)
        runs: dict[str, list[Run]] = {config: [] for config in CONFIGS}
        with MlflowServer(Path(tmp) / "mlflow") as server:
            relay = Relay(server.port, delay_s=args.delay_s)
            tracking = {"TRAINER_TENSORBOARD": "true", "TRAINER_MLFLOW_EXPERIMENT": "bench-tracking"}
            envs = {"off": {"TRAINER_TENSORBOARD": "false"},
                    "on": tracking | {"TRAINER_MLFLOW_TRACKING_URI": server.url},
                    "slow": tracking | {"TRAINER_MLFLOW_TRACKING_URI": relay.url}}  # fmt: skip
            for n in range(args.rounds):
                log.info("round %d/%d", n + 1, args.rounds)
                for config in CONFIGS:
                    runs[config].append(train(root, f"{config}-{n}", args.steps, envs[config]))
            relay.stop()
            last = tiny_launch(root, f"on-{args.rounds - 1}").run_paths.metrics.read_text().splitlines()[-1]
            cost = row_cost(server.url, Path(tmp) / "rows", json.loads(last))
    options = f"--rounds {args.rounds} --steps {args.steps} --delay-s {args.delay_s:g}"
    command = f"`.venv/bin/python bench/tracking.py {options}`"
    body = [command, "",
            f"The trainer (preset tiny, 2 processes under torchrun, gloo on CPU, seq 64, batch 8 per rank, a metrics "
            f"row every step, {args.steps} steps) with TensorBoard and MLflow off, on (a real `mlflow server` with "
            f"SQLite on loopback), and slow (the same server behind a relay delaying each chunk of a request "
            f"{args.delay_s:g} s); {args.rounds} rounds of off, on, slow in turn.", "",
            *report(runs, cost, args)]  # fmt: skip
    print("\n".join(body))
    if args.write_results:
        append_section("Watching a run: TensorBoard and MLflow overhead (bench/tracking.py)", body,
                       machine_lines("torch", "tensorboard", "mlflow"))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
