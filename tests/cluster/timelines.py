"""What happens to a job after it is created, as the tests script it: the kubelet's and Kueue's parts on a timeline.

The operator players (the Training Operator; Kubeflow Trainer, JobSet and the real Job controller) react to what these
write (pods Running, containers exiting, suspend flipped) as the real ones do: a timeline never writes a job condition
itself. A timeline speaks of nodes by index; the pod of a node is found by the job API's label, whatever its name (a
PyTorchJob's <job>-worker-<i>; a TrainJob's <job>-node-0-<i>-<suffix>, a new one after each restart of the group). A
HyperPodPyTorchJob's pods carry no label of their node (tests/cluster/hyperpod_training_operator.py): node i's is the
one its operator names <job>-<group>-<i>.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from components.launch_training.hyperpodpytorchjob import HYPERPODPYTORCHJOB, REPLICA
from tests.cluster.hyperpod_training_operator import pod_name
from trainer.metrics import step_line

if TYPE_CHECKING:
    from tests.cluster.cluster import Cluster

log = logging.getLogger(__name__)

INSUFFICIENT_GPU = "0/{nodes} nodes are available: {nodes} Insufficient nvidia.com/gpu."
# Rank 0's training lines as trainer.metrics.step_line writes them (the launcher streams them; nothing parses them).
DEFAULT_LINES = tuple(
    step_line(s, 30, loss, 3e-3, 0.5, 20000, None, 2.0 * (30 - s)) for s, loss in ((10, 4.2), (20, 3.1), (30, 2.5))
)
CRASH_LINES = ("Traceback (most recent call last):", "ModuleNotFoundError: No module named 'trainer'")
IMAGE_PULL_UNAUTHORIZED = (  # containerd's error for a registry that refuses the node's credentials
    'rpc error: code = Unknown desc = failed to pull and unpack image "{ref}": failed to resolve reference '
    '"{ref}": unexpected status from HEAD request to https://{registry}/v2/{repository}/manifests/{tag}: '
    "401 Unauthorized"
)


def image_parts(image: str) -> dict[str, str]:
    """An image as containerd resolves it: ``ref`` normalized (docker.io/library/... for Docker Hub), the registry
    host it asks, the repository and the tag (``latest`` by default)."""
    first, _, rest = image.partition("/")
    if rest and ("." in first or ":" in first or first == "localhost"):
        registry, path = first, rest
    else:
        registry, path = "docker.io", image if "/" in image else f"library/{image}"
    path, _, tag = path.partition(":")
    host = "registry-1.docker.io" if registry == "docker.io" else registry
    return {"ref": f"{registry}/{path}:{tag or 'latest'}", "registry": host, "repository": path, "tag": tag or "latest"}


@dataclass
class JobPlay:
    """One job's pods, through the kubelet and scheduler player, and its admission, through the Kueue player."""

    cluster: Cluster
    name: str

    def pods(self, index: int) -> list[dict[str, Any]]:
        """Node `index`'s pods, newest first, those being deleted last."""
        core = self.cluster.kubelet.core
        selector = self.cluster.api.node_selector(self.name, index)
        pods = json.loads(
            core.list_namespaced_pod(self.cluster.namespace, label_selector=selector, _preload_content=False).data
        )["items"]
        if self.cluster.api is HYPERPODPYTORCHJOB:
            pods = [p for p in pods if p["metadata"]["name"] == pod_name(self.name, REPLICA, index)]
        return sorted(
            pods,
            key=lambda p: (
                not p["metadata"].get("deletionTimestamp"),
                p["metadata"]["creationTimestamp"],
                p["metadata"]["name"],
            ),
            reverse=True,
        )

    def pod(self, index: int, timeout_s: float = 30) -> str:
        """The name of node `index`'s pod (its newest live one), once its operator has created it."""
        deadline = time.monotonic() + timeout_s
        while not (pods := [p for p in self.pods(index) if not p["metadata"].get("deletionTimestamp")]):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no pod of node {index} of {self.name} within {timeout_s:.0f}s")
            time.sleep(0.05)
        return pods[0]["metadata"]["name"]

    def start(self, *indices: int) -> None:
        for index in indices:
            self.cluster.kubelet.start(self.pod(index))

    def start_recreated(self, *indices: int, timeout_s: float = 30) -> None:
        """Once the operator has created these nodes' pods again (new, not yet bound), each scheduled and running."""
        deadline = time.monotonic() + timeout_s
        for index in indices:
            while not (
                fresh := [
                    p
                    for p in self.pods(index)
                    if not p["spec"].get("nodeName") and not p["metadata"].get("deletionTimestamp")
                ]
            ):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"node {index} of {self.name} not created again within {timeout_s:.0f}s")
                time.sleep(0.05)
            self.cluster.kubelet.start(fresh[0]["metadata"]["name"])

    def unschedulable(self, index: int, message: str) -> None:
        self.cluster.kubelet.wait_for_pod(self.pod(index))
        self.cluster.kubelet.unschedulable(self.pod(index), message)

    def print(self, index: int, *lines: str) -> None:
        self.cluster.kubelet.print(self.pod(index), *lines)

    def exit(self, index: int, code: int, reason: str = "") -> None:
        self.cluster.kubelet.exit(self.pod(index), code, reason)

    def admit(self) -> None:
        self.cluster.kueue.admit(self.cluster.namespace, self.name, kind=self.cluster.api.kind)

    def preempt(self) -> None:
        self.cluster.kueue.preempt(self.cluster.namespace, self.name, kind=self.cluster.api.kind)


Action = Callable[[JobPlay], None]


@dataclass
class Timeline:
    """Steps ``(delay_s, action)`` played in order from a job's creation; each delay counts from the step before."""

    steps: list[tuple[float, Action]] = field(default_factory=list)

    def then(self, delay_s: float, action: Action) -> Timeline:
        return Timeline([*self.steps, (delay_s, action)])

    def __add__(self, other: Timeline) -> Timeline:
        return Timeline([*self.steps, *other.steps])

    def play(self, job: JobPlay, closed: threading.Event, gone: Callable[[], bool]) -> None:
        """Each step after its delay, unless the cluster closed meanwhile or the job is gone (asked once a step)."""
        for delay, action in self.steps:
            if closed.wait(delay) or gone():
                return
            action(job)

    # -- the usual ones ---------------------------------------------------------------------------------------

    @classmethod
    def started(cls, workers: int = 2, tick_s: float = 0.05, pending: int = 0) -> Timeline:
        """Every worker scheduled and running (``pending`` more after them find no room)."""
        message = INSUFFICIENT_GPU.format(nodes=workers)
        steps: list[tuple[float, Action]] = [(tick_s, lambda job: job.start(*range(workers)))]
        steps += [(0.0, lambda job, i=i: job.unschedulable(i, message)) for i in range(workers, workers + pending)]
        return cls(steps)

    @classmethod
    def lines(cls, lines: Iterable[str], workers: Iterable[int], tick_s: float = 0.05) -> Timeline:
        """Each line printed by each of ``workers``, one line per tick."""
        indices = list(workers)
        return cls([(tick_s, lambda job, line=line: [job.print(i, line) for i in indices]) for line in lines])

    @classmethod
    def exits(cls, workers: Iterable[int], code: int = 0, tick_s: float = 0.05) -> Timeline:
        return cls([(tick_s, lambda job: [job.exit(i, code) for i in workers])])

    @classmethod
    def success(cls, workers: int = 2, log_lines: Iterable[str] = DEFAULT_LINES, tick_s: float = 0.05) -> Timeline:
        """Running, lines printed by every worker, every container exits 0: the operator says Succeeded."""
        return (
            cls.started(workers, tick_s)
            + cls.lines(log_lines, range(workers), tick_s)
            + cls.exits(range(workers), 0, tick_s)
        )

    @classmethod
    def failure(
        cls,
        workers: int = 2,
        failing: int = 1,
        log_lines: Iterable[str] = CRASH_LINES,
        exit_code: int = 1,
        tick_s: float = 0.05,
    ) -> Timeline:
        """Running; worker ``failing`` prints ``log_lines`` and exits ``exit_code``. With restartPolicy Never the pod
        fails and the operator fails the job; with OnFailure the kubelet restarts the container instead."""
        return (
            cls.started(workers, tick_s)
            + cls.lines(log_lines, [failing], tick_s)
            + cls.exits([failing], exit_code, tick_s)
        )

    @classmethod
    def running(cls, workers: int = 2, tick_s: float = 0.05) -> Timeline:
        """Running, and so it stays until it is deleted."""
        return cls.started(workers, tick_s)

    @classmethod
    def stuck_pending(cls, workers: int = 2, message: str = "", tick_s: float = 0.05) -> Timeline:
        """No worker finds a node: Unschedulable, with the scheduler's FailedScheduling warning, for ever."""
        text = message or INSUFFICIENT_GPU.format(nodes=4)
        return cls([(tick_s, lambda job: [job.unschedulable(i, text) for i in range(workers)])])

    @classmethod
    def crash_loop(
        cls,
        workers: int = 2,
        log_lines: Iterable[str] = CRASH_LINES,
        failing: int = 1,
        exit_code: int = 1,
        reason: str = "Error",
        crashes: int = 3,
        tick_s: float = 0.05,
    ) -> Timeline:
        """Running; worker ``failing`` prints ``log_lines`` and exits ``exit_code``, ``crashes`` times. The kubelet
        restarts it (at once the first time, after a CrashLoopBackOff from then on); once the restarts reach the
        job's backoffLimit the operator deletes every pod and fails the job."""
        timeline = cls.started(workers, tick_s)
        lines = list(log_lines)
        for crash in range(crashes):
            if crash >= 2:  # the second exit left it in CrashLoopBackOff: the back-off's end
                timeline = timeline.then(tick_s, lambda job: job.cluster.kubelet.restart(job.pod(failing)))
            timeline = timeline + cls.lines(lines, [failing], tick_s)
            timeline = timeline.then(tick_s, lambda job: job.exit(failing, exit_code, reason))
        return timeline

    @classmethod
    def image_pull_error(cls, workers: int = 2, error: str = IMAGE_PULL_UNAUTHORIZED, tick_s: float = 0.05) -> Timeline:
        """Scheduled, but the image cannot be pulled: ErrImagePull, then ImagePullBackOff, for ever. ``error`` may
        name ``{image}``, ``{registry}``, ``{repository}`` and ``{tag}`` of the pod's image."""

        def failed(job: JobPlay) -> None:
            for i in range(workers):
                image = job.cluster.kubelet.wait_for_pod(job.pod(i))["spec"]["containers"][0]["image"]
                job.cluster.kubelet.pull_failed(job.pod(i), error.format(**image_parts(image)))

        return cls(
            [
                (tick_s, failed),
                (tick_s, lambda job: [job.cluster.kubelet.pull_back_off(job.pod(i)) for i in range(workers)]),
            ]
        )

    @classmethod
    def oom_killed(cls, workers: int = 2, failing: int = 1, crashes: int = 2, tick_s: float = 0.05) -> Timeline:
        """Running; worker ``failing``'s container is killed for memory (OOMKilled, exit code 137), ``crashes``
        times, as :meth:`crash_loop`."""
        first_step = step_line(1, 30, 5.0, 3e-3, 0.5, 20000, None, 58.0)
        return cls.crash_loop(workers, [first_step], failing, 137, "OOMKilled", crashes, tick_s)

    @classmethod
    def queued(
        cls,
        workers: int = 2,
        admit_after_s: float = 1.0,
        log_lines: Iterable[str] = DEFAULT_LINES,
        tick_s: float = 0.05,
    ) -> Timeline:
        """Created suspended by Kueue's webhook, admitted after ``admit_after_s``, then a success."""
        return Timeline([(admit_after_s, lambda job: job.admit())]) + cls.success(workers, log_lines, tick_s)

    @classmethod
    def preempted(
        cls,
        workers: int = 2,
        queued_s: float = 3.0,
        pending_s: float = 2.0,
        log_lines: Iterable[str] = DEFAULT_LINES,
        tick_s: float = 0.05,
    ) -> Timeline:
        """Admitted and running; Kueue preempts it (suspended: the operator deletes its pods) for ``queued_s``, admits
        it again, and the operator's new pods wait ``pending_s`` for the scheduler before they run to success."""
        lines = list(log_lines)
        return (
            Timeline([(tick_s, lambda job: job.admit())])
            + cls.started(workers, tick_s)
            + cls.lines(lines[:1], range(workers), tick_s)
            + Timeline([(tick_s, lambda job: job.preempt()), (queued_s, lambda job: job.admit())])
            + Timeline([(pending_s, lambda job: job.start(*range(workers)))])
            + cls.lines(lines[1:], range(workers), tick_s)
            + cls.exits(range(workers), 0, tick_s)
        )
