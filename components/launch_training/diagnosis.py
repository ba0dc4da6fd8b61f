"""Diagnosis while the job runs: its pods' statuses, their events and the streamed log lines, matched to the
seed's troubleshooting table and reported once each, in plain words, as they happen.

Pure: the launcher feeds it what it read (`observe` for pods and events, `observe_line` for log lines) and it
answers with findings; the two look-ups it may need (a crashed container's last lines, the last memory use the
trainer recorded) are functions it is given.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

PENDING = "Pod stuck in Pending"
NO_PEERS = "Pods can't find each other"
EFA = "EFA errors"
OOM = "OOMKilled"
IMAGE_PULL = "Image pull error"
CRASH_LOOP = "CrashLoopBackOff"
NOT_CREATED = "No pods made"

FIX = {
    PENDING: "check `kubectl describe node` for allocatable GPUs; free nodes, or ask for fewer (nnodes)",
    EFA: "ensure the aws-efa-k8s-device-plugin DaemonSet is running on the GPU nodes, and that the trainer image "
    "carries libfabric's EFA provider and aws-ofi-nccl (docker/trainer.Dockerfile)",
    NO_PEERS: "verify the operator created the job's headless services (a PyTorchJob's: `kubectl get svc -l "
    "training.kubeflow.org/job-name=<job>`; a TrainJob's: `kubectl get svc <job>`, JobSet's subdomain) and that "
    "cluster DNS resolves them",
    OOM: "increase memory in resources (job_options memory=..., within the instance's), or lower batch_size",
    IMAGE_PULL: "ECR auth expired or missing: re-run `aws ecr get-login-password` for an image pull secret, or "
    "let the nodes pull with their instance role / IRSA; check the image name and tag",
    CRASH_LOOP: "the container exits at start: its last lines above say why",
    NOT_CREATED: "the operator's event says why it cannot make the job's pods (`kubectl get events --field-selector "
    "involvedObject.name=<job>`); a TrainJob queued by Kueue up to v0.19.2 whose grace period is not its runtime's "
    "never gets them: run with the runtime's grace_period_s",
}

# Log lines that name a symptom: torchrun's rendezvous and c10d store errors, DNS failures, and the EFA/OFI
# lines of aws-ofi-nccl, libfabric and NCCL's net plugin loader.
LOG_PATTERNS: list[tuple[str, re.Pattern[str]]] = [
    (
        NO_PEERS,
        re.compile(
            r"RendezvousTimeoutError|RendezvousConnectionError|DistNetworkError|"
            r"Name or service not known|Temporary failure in name resolution|"
            r"client socket has timed out while trying to connect",
            re.I,
        ),
    ),
    (
        EFA,
        re.compile(
            r"NET/OFI.*(error|unable|fail)|fi_getinfo.*(fail|empty)|Failed to initialize any NET plugin|"
            r"OFI plugin.*not found|Unable to find a protocol that worked",
            re.I,
        ),
    ),
]
INSUFFICIENT = re.compile(r"Insufficient ([\w./-]*\w)")


@dataclass(frozen=True)
class Finding:
    symptom: str  # a row of the troubleshooting table
    pod: str
    detail: str

    @property
    def fix(self) -> str:
        return FIX[self.symptom]

    def line(self) -> str:
        return f"{self.symptom} ({self.pod}): {self.detail}. Fix: {self.fix}"


def _seconds(value: float) -> str:
    return f"{value:.0f} s" if value < 120 else f"{value / 60:.0f} min"


class Diagnosis:
    """Each (symptom, pod) once; and how long the job's oldest Pending pod has waited, for the Pending deadline."""

    def __init__(
        self,
        job: str,
        last_lines: Callable[[str], str] = lambda pod: "",
        memory_note: Callable[[], str] = lambda: "",
        now: Callable[[], float] = time.time,
    ):
        self.job, self.last_lines, self.memory_note, self.now = job, last_lines, memory_note, now
        self.findings: list[Finding] = []
        self._seen: set[tuple[str, str]] = set()
        self._lock = threading.Lock()  # log lines arrive from the log streamers' threads
        self.pending_since: float | None = None  # creation time of the oldest pod now Pending (epoch seconds)
        # An elastic job runs on its minimum of pods: once that many are scheduled (or the job ran with them), an
        # unschedulable pod is one beyond the minimum waiting for room, which the launcher reports as such, not a
        # "Pod stuck in Pending".
        self.min_pods = 0  # 0: every pod must be scheduled
        self.started = False
        self._room_for_minimum = False
        self.not_created = False  # the job's operator said it could not make the job's pods (observe_job_events)

    def report(self, symptom: str, pod: str, detail: str) -> Finding | None:
        with self._lock:
            if (symptom, pod) in self._seen:
                return None
            self._seen.add((symptom, pod))
            finding = Finding(symptom, pod, detail)
            self.findings.append(finding)
        log.warning("diagnosis: %s", finding.line())
        return finding

    def pending_for(self) -> float:
        return 0.0 if self.pending_since is None else self.now() - self.pending_since

    def summary(self) -> str:
        return "; ".join(f"{f.symptom} ({f.pod}): {f.detail}" for f in self.findings)

    def short(self, pod: str) -> str:
        return pod.removeprefix(self.job + "-")

    # -- pods and events ----------------------------------------------------------------------------------------

    def observe(self, pods: Iterable[Any], events: Iterable[Any]) -> None:
        """Pods are kubernetes V1Pod objects of the job; events those read for them (any others are ignored)."""
        pods = list(pods)
        created = [_created(p, self.now()) for p in pods if p.status.phase == "Pending"]
        self.pending_since = min(created) if created else None
        scheduled = sum(1 for p in pods if p.spec is not None and p.spec.node_name)
        self._room_for_minimum = self.started or (0 < self.min_pods <= scheduled)
        names = {p.metadata.name for p in pods}
        for event in events:  # first: an event's words are fuller than a status's (the pull error's cause)
            obj = event.involved_object
            if obj is not None and obj.name in names:
                self._observe_event(obj.name, event.reason or "", event.message or "")
        for pod in pods:
            self._observe_pod(pod)

    def observe_job_events(self, events: Iterable[Any]) -> None:
        """Warning events of the job itself and of what its operator makes under its name (a TrainJob's from Trainer,
        its JobSet's from JobSet), read while it may run and has no pod: why none was made."""
        for event in events:
            obj = event.involved_object
            if event.type != "Warning" or obj is None or obj.kind == "Pod":
                continue
            self.not_created = True
            self.report(NOT_CREATED, obj.kind or "job", f"{event.reason}: {_first_line(event.message)}")

    def _observe_pod(self, pod: Any) -> None:
        name = self.short(pod.metadata.name)
        for condition in pod.status.conditions or []:
            if condition.type == "PodScheduled" and condition.status == "False" and condition.reason == "Unschedulable":
                self._unschedulable(name, condition.message or "")
        for status in pod.status.container_statuses or []:
            waiting = status.state.waiting if status.state else None
            if waiting and waiting.reason in ("ErrImagePull", "ImagePullBackOff", "InvalidImageName"):
                self.report(IMAGE_PULL, name, f"{waiting.reason} for {status.image}: {_first_line(waiting.message)}")
            for state in (status.state, status.last_state):
                terminated = state.terminated if state else None
                if terminated and terminated.reason == "OOMKilled":
                    limit = _memory_limit(pod)
                    note = self.memory_note()
                    self.report(
                        OOM,
                        name,
                        f"the container was killed for using more than its memory limit"
                        f"{f' ({limit})' if limit else ''} (exit code {terminated.exit_code})"
                        f"{f'; {note}' if note else ''}",
                    )
            if waiting and waiting.reason == "CrashLoopBackOff":
                last = status.last_state.terminated if status.last_state else None
                how = f"exit code {last.exit_code} ({last.reason})" if last else "it keeps exiting"
                if last and last.reason == "OOMKilled":
                    continue  # reported as OOMKilled
                tail = self.last_lines(pod.metadata.name).strip()
                self.report(
                    CRASH_LOOP,
                    name,
                    f"restarted {status.restart_count} times, {how}"
                    + (f"; its last lines: {' | '.join(tail.splitlines()[-5:])}" if tail else ""),
                )

    def _observe_event(self, pod: str, reason: str, message: str) -> None:
        name = self.short(pod)
        if reason == "FailedScheduling":
            self._unschedulable(name, message)
        elif reason == "Failed" and "failed to pull" in message.lower():
            self.report(IMAGE_PULL, name, _first_line(message))

    def _unschedulable(self, pod: str, message: str) -> None:
        if self._room_for_minimum:
            return
        short = set(INSUFFICIENT.findall(message))
        waited = f"Pending for {_seconds(self.pending_for())}"
        if "vpc.amazonaws.com/efa" in short:
            self.report(
                EFA,
                pod,
                f"{waited}: no node offers the requested EFA devices ({_first_line(message)}): "
                "the EFA device plugin may be missing",
            )
        if short - {"vpc.amazonaws.com/efa"}:
            self.report(
                PENDING,
                pod,
                f"{waited}: insufficient {', '.join(sorted(short - {'vpc.amazonaws.com/efa'}))}"
                f" ({_first_line(message)})",
            )
        elif not short:
            self.report(PENDING, pod, f"{waited}: {_first_line(message)}")

    # -- log lines ----------------------------------------------------------------------------------------------

    def observe_line(self, pod: str, text: str) -> None:
        for symptom, pattern in LOG_PATTERNS:
            if pattern.search(text):
                self.report(symptom, self.short(pod), f"in its log: {text.strip()[:300]}")


def _created(pod: Any, default: float) -> float:
    stamp = pod.metadata.creation_timestamp
    return stamp.timestamp() if stamp is not None else default


def _first_line(text: str | None, keep: int = 400) -> str:
    """The first line, its middle cut when long: the cause of an error is often at its end."""
    line = (text or "").strip().splitlines()[0] if (text or "").strip() else ""
    return line if len(line) <= keep else f"{line[: keep // 3]} ... {line[-(keep - keep // 3) :]}"


def _memory_limit(pod: Any) -> str:
    for container in pod.spec.containers or []:
        limits = (container.resources.limits or {}) if container.resources else {}
        if "memory" in limits:
            return f"limit {limits['memory']}"
    return ""
