"""Time from a PyTorchJob's terminal condition to the launcher returning: with the watch, and polling.

Against a real Kubernetes control plane (tests/cluster/: etcd, kube-apiserver and kube-controller-manager from
../shared/k8s or KUBEBUILDER_ASSETS, the PyTorchJob CRD from ../shared/reference), the Training Operator v1.8.1 and
the kubelet played by tests/cluster/. Each run is a fresh namespace (a Cluster): the launcher (`launch()` with backend
kubernetes, as the pipeline runner's service account, streaming worker-0's log) creates a one-worker job, whose worker
starts, prints a line and exits 0; the operator player then sets Succeeded. A thread of the bench watching the job as
the admin notes the moment a Succeeded=True condition first appears; the bench notes the moment `launch()` returns.
Watch runs (deploy/rbac.yaml's Role) and polling runs (that Role less `watch` on pytorchjobs: RBAC refuses the watch
with 403, and the launcher reads the job every poll interval) alternate, in one process. It is a measurement, not a
test: it never asserts. Without the binaries or the CRD it says why and exits 0.

    .venv/bin/python bench/launcher.py [--runs 10] [--write-results]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import kubernetes
from machine import RESULTS, append_section, machine_lines

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # tests.cluster and tests.helpers

from components.launch_training.config import LaunchConfig  # noqa: E402
from components.launch_training.core import launch  # noqa: E402
from components.launch_training.watch_settings import WatchSettings  # noqa: E402
from components.stage_data.core import stage_data  # noqa: E402
from tests.cluster.cluster import Cluster  # noqa: E402
from tests.cluster.control_plane import (  # noqa: E402
    PYTORCHJOB_CRD,
    Binaries,
    ControlPlane,
    deploy_grants,
    locate_binaries,
    skip_reason,
)
from tests.cluster.kueue import Kueue  # noqa: E402
from tests.cluster.timelines import Timeline  # noqa: E402
from tests.cluster.training_operator import GROUP, PLURAL, VERSION, ValidatingWebhook, is_true  # noqa: E402
from tests.helpers import write_corpus  # noqa: E402

log = logging.getLogger("bench-launcher")

TARGET_S = 1.0
IMAGE = "123456789012.dkr.ecr.us-east-1.amazonaws.com/hyperpod-pretrain-trainer:bench"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=10, help="runs of each mode")
    p.add_argument("--write-results", action="store_true", help=f"append a dated section to {RESULTS.name}")
    args = p.parse_args(argv)
    if args.runs < 1:
        p.error("--runs must be at least 1")
    return args


class SucceededClock(threading.Thread):
    """Watches one job as the admin, from a resourceVersion read before it exists, and notes when a Succeeded=True
    condition first appears (time.perf_counter(), in :attr:`at`)."""

    def __init__(self, admin: kubernetes.client.ApiClient, namespace: str, name: str):
        super().__init__(name=f"succeeded-{name}", daemon=True)
        self.api = kubernetes.client.CustomObjectsApi(admin)
        self.namespace, self.selector = namespace, f"metadata.name={name}"
        listed = self.api.list_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, field_selector=self.selector)
        self.resource_version: str = listed["metadata"]["resourceVersion"]
        self.at: float | None = None
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.is_set():  # short watches, so that stop() is heard
            watch = kubernetes.watch.Watch()
            for event in watch.stream(
                self.api.list_namespaced_custom_object,
                GROUP,
                VERSION,
                self.namespace,
                PLURAL,
                field_selector=self.selector,
                resource_version=self.resource_version,
                timeout_seconds=2,
            ):
                job = event["raw_object"]
                if is_true(job, "Succeeded"):
                    self.at = time.perf_counter()
                    return
                self.resource_version = job["metadata"]["resourceVersion"]

    def stop(self) -> None:
        self.stopped.set()
        self.join(timeout=5)


def one_run(plane: ControlPlane, tmp: Path, root: Path, n: int, mode: str) -> float:
    """Seconds from the Succeeded condition to launch() returning, in a fresh namespace."""
    cluster = Cluster(
        plane,
        plane.kueue,
        tmp / f"kubelet-{n}-{mode}",
        timeline=Timeline.success(workers=1, log_lines=["step 1 loss 4.2"]),
        grants=deploy_grants(without=("watch pytorchjobs",)) if mode == "polling" else None,
    )
    clock: SucceededClock | None = None
    try:
        # One node of the default instance type (8 GPUs: nproc_per_node must match them): one worker pod.
        cfg = LaunchConfig.of(
            storage_root=str(root),
            dataset="bench",
            run_id=f"bench-{n}-{mode}",
            backend="kubernetes",
            nnodes=1,
            nproc_per_node=8,
            image=IMAGE,
            owner_reference=False,
            timeout_s=120,
            namespace=cluster.namespace,
        )
        clock = SucceededClock(plane.admin, cluster.namespace, cfg.job_name)
        clock.start()
        result = launch(cfg, cluster.runner())
        returned = time.perf_counter()
    finally:
        if clock is not None:
            clock.stop()
        cluster.close()
    if cluster.errors:
        log.warning("run %d, %s: the players met errors: %s", n + 1, mode, cluster.errors)
    if result.state != "Succeeded" or clock.at is None:
        raise RuntimeError(f"run {n + 1}, {mode}: the job ended {result.state}; Succeeded seen: {clock.at is not None}")
    return returned - clock.at


def measure(runs: int, tmp: Path, binaries: Binaries) -> tuple[dict[str, list[float]], str]:
    """The latencies of each mode, and the API server's version."""
    root = tmp / "fsx"
    stage_data(str(write_corpus(tmp / "corpus", files=4)), str(root), "bench", vocab_size=300)
    plane = ControlPlane(binaries, tmp / "control-plane", [PYTORCHJOB_CRD])
    try:
        plane.start()
        plane.webhook = ValidatingWebhook(plane.admin, plane.workdir / "certs")
        plane.kueue = Kueue(plane.admin, plane.workdir / "certs")
        version = kubernetes.client.VersionApi(plane.admin).get_code().git_version
        times: dict[str, list[float]] = {"watch": [], "polling": []}
        for n in range(runs):
            for mode in ("watch", "polling") if n % 2 == 0 else ("polling", "watch"):
                times[mode].append(one_run(plane, tmp, root, n, mode))
                log.info("run %d, %s: %.3fs", n + 1, mode, times[mode][-1])
        return times, version
    finally:
        for player in (plane.kueue, plane.webhook):
            if player is not None:
                player.stop()
        plane.stop()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    log.setLevel(logging.INFO)
    if reason := skip_reason():
        log.warning("skipped: %s", reason)
        return 0
    binaries, _ = locate_binaries()
    with tempfile.TemporaryDirectory() as tmp:
        times, version = measure(args.runs, Path(tmp), binaries)
    interval = WatchSettings().poll_interval_s
    watch, polling = statistics.median(times["watch"]), statistics.median(times["polling"])
    text = [
        f"Launcher latency (`bench/launcher.py`): from the Succeeded condition to `launch()` returning, against the "
        f"real kube-apiserver {version} (RBAC as deploy/rbac.yaml grants the pipeline runner) with the Training "
        f"Operator v1.8.1 and the kubelet played by tests/cluster/; a one-worker job, worker-0's log streamed, a fresh "
        f"namespace per run; {args.runs} runs of each mode, alternating. Succeeded: when the bench's own watch of the "
        f"job (as the admin) first sees the condition. Polling: the Role lacks `watch` on pytorchjobs, RBAC refuses "
        f"the watch (403), the launcher reads the job every {interval:.0f} s. Rerun with "
        f"`.venv/bin/python bench/launcher.py --write-results`.",
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
