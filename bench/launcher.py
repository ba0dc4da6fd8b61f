"""Time from a PyTorchJob's terminal condition to the launcher returning: with the watch, and polling.

Against the test suite's loopback Kubernetes API server (tests/k8s_server.py, which needs the PyTorchJob
CRD from ../shared/reference), each run creates a one-worker job that runs briefly, logs a line and
succeeds; the server notes the moment the Succeeded condition is set, and the launcher (`launch()` with
backend kubernetes, streaming worker-0's log) the moment it returns. Watch runs and polling runs (the
server refuses watches with 403, so the launcher falls back to reading the job every poll interval)
alternate, in one process. It is a measurement, not a test: it never asserts.

    .venv/bin/python bench/launcher.py [--runs 10] [--write-results]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

import kubernetes
from machine import RESULTS, append_section, machine_lines

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # tests.k8s_server and tests.helpers

from components.launch_pytorchjob.core import LaunchConfig, launch  # noqa: E402
from components.launch_pytorchjob.k8s_backend import WatchSettings  # noqa: E402
from components.stage_data.core import stage_data  # noqa: E402
from tests.helpers import write_corpus  # noqa: E402
from tests.k8s_server import CRD_PATH, FakeKubernetes, Lifecycle  # noqa: E402

log = logging.getLogger("bench-launcher")

TARGET_S = 1.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=10, help="runs of each mode")
    p.add_argument("--write-results", action="store_true", help=f"append a dated section to {RESULTS.name}")
    args = p.parse_args(argv)
    if args.runs < 1:
        p.error("--runs must be at least 1")
    return args


def one_run(root: Path, n: int, polling: bool) -> float:
    """Seconds from the Succeeded condition to launch() returning."""
    succeeded: list[float] = []

    def succeed(job) -> None:
        job.succeed_all()
        succeeded.append(time.perf_counter())

    lifecycle = (
        Lifecycle()
        .then(0, lambda j: j.create_pods(1))
        .then(0.05, lambda j: j.run(0))
        .then(0.05, lambda j: j.set_condition("Running", "PyTorchJobRunning", "running"))
        .then(0.05, lambda j: j.log(0, "step 1 loss 4.2"))
        .then(0.3, succeed)
    )
    with FakeKubernetes(CRD_PATH, lifecycle) as server:
        if polling:
            server.faults.fail_next("GET", r"(?i)watch=true", 403, times=10_000)
        cfg = LaunchConfig(storage_root=str(root), dataset="bench", run_id=f"bench-{n}-{int(polling)}",
                           backend="kubernetes", nnodes=1, nproc_per_node=8, image="img:1", owner_reference=False,
                           timeout_s=120)  # fmt: skip
        launch(cfg, kubernetes.client.ApiClient(server.client_configuration()))
        returned = time.perf_counter()
    return returned - succeeded[0]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    log.setLevel(logging.INFO)
    if not CRD_PATH.is_file():
        log.error("the PyTorchJob CRD is not at %s: this benchmark needs ../shared/reference", CRD_PATH)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "fsx"
        stage_data(str(write_corpus(Path(tmp) / "corpus", files=4)), str(root), "bench", vocab_size=300)
        times: dict[str, list[float]] = {"watch": [], "polling": []}
        for n in range(args.runs):
            for mode in ("watch", "polling") if n % 2 == 0 else ("polling", "watch"):
                times[mode].append(one_run(root, n, polling=mode == "polling"))
                log.info("run %d, %s: %.3fs", n + 1, mode, times[mode][-1])
    interval = WatchSettings().poll_interval_s
    watch, polling = statistics.median(times["watch"]), statistics.median(times["polling"])
    text = [
        f"Launcher latency (`bench/launcher.py`): from the Succeeded condition to `launch()` returning, against the "
        f"loopback Kubernetes API server of the tests; a one-worker job, worker-0's log streamed; {args.runs} runs "
        f"of each mode, alternating. Polling: the server refuses watches (403), the launcher reads the job every "
        f"{interval:.0f} s. Rerun with `.venv/bin/python bench/launcher.py --write-results`.",
        "",
        "| mode | median (s) | min (s) | max (s) | target | met |",
        "|---|---:|---:|---:|---:|:---:|",
        f"| watch | {watch:.3f} | {min(times['watch']):.3f} | {max(times['watch']):.3f} | < {TARGET_S:.0f} s | "
        f"{'yes' if watch < TARGET_S else 'no'} |",
        f"| polling fallback | {polling:.3f} | {min(times['polling']):.3f} | {max(times['polling']):.3f} | | |",
        "",
        f"polling / watch: {polling / watch:.1f}x",
    ]
    print("\n".join(text))
    if args.write_results:
        append_section("launcher latency", text, machine_lines("kubernetes"))
        log.info("appended results to %s", RESULTS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
