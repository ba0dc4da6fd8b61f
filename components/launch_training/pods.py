"""What the kubernetes backend reads of the job and its pods: the job as stored, its pods and a one-line summary of
them, a failed pod's last lines and events, and the `Diagnoser` that reads the pods and their events for the
diagnosis (diagnosis.py) and keeps the last lines of each container that exits before they are gone."""

from __future__ import annotations

import logging
import time
from typing import Any

from kubernetes.client.exceptions import ApiException

from common.errors import StepFailed
from components.kube import Kube, describe
from components.launch_training.diagnosis import Diagnosis
from components.launch_training.job_api import JobApi

log = logging.getLogger(__name__)

TAIL_LINES = 40
EVENT_READS_PER_TICK = 4  # Pending pods whose events are read each time


def get_job(kube: Kube, api: JobApi, ns: str, name: str) -> dict[str, Any]:
    return kube.call(
        f"get {api.kind}", kube.custom.get_namespaced_custom_object, api.group, api.version, ns, api.plural, name
    )


def job_pods(kube: Kube, api: JobApi, ns: str, name: str) -> list[Any]:
    return kube.call("list pods", kube.core.list_namespaced_pod, ns, label_selector=api.pod_selector(name)).items


def pod_summary(api: JobApi, name: str, pods: list[Any]) -> str:
    """'worker-0 Running, worker-1 Pending', from the job's pods."""
    phases = [
        f"{api.pod_label(pod.metadata.name, name)} {pod.status.phase}"
        for pod in sorted(pods, key=lambda p: p.metadata.name)
    ]
    return ", ".join(phases) or "no pods yet"


def describe_failure(kube: Kube, api: JobApi, ns: str, name: str) -> dict[str, str]:
    """Log the failing pod's last lines and its events, so the step's log says why without kubectl; returns the
    last lines read, by pod (none when the pods are gone)."""
    pods = job_pods(kube, api, ns, name)

    def failed(pod: Any) -> bool:
        for status in pod.status.container_statuses or []:
            for state in (status.state, status.last_state):
                if state and state.terminated and state.terminated.exit_code:
                    return True
        return pod.status.phase == "Failed"

    culprits = [p for p in pods if failed(p)] or pods[:1]
    tails: dict[str, str] = {}
    for pod in culprits[:2]:
        pod_name = pod.metadata.name
        try:
            text = kube.read_for_people(
                "read log",
                kube.core.read_namespaced_pod_log,
                pod_name,
                ns,
                container=api.container,
                tail_lines=TAIL_LINES,
            )
            log.error("last %d lines of %s:\n%s", TAIL_LINES, pod_name, text.rstrip() or "(empty)")
            if failed(pod) and text.strip():
                tails[pod_name] = "last lines: " + " | ".join(text.strip().splitlines()[-8:])
        except (ApiException, StepFailed) as exc:  # no kubelet answers: the API server's 500, retried, then this
            log.error("cannot read %s's log: %s", pod_name, describe(exc))
        try:
            events = kube.call(
                "list events", kube.core.list_namespaced_event, ns, field_selector=f"involvedObject.name={pod_name}"
            ).items
            lines = [f"  {e.type} {e.reason}: {e.message}" for e in events] or ["  (none)"]
            log.error("events of %s:\n%s", pod_name, "\n".join(lines))
        except ApiException as exc:
            if exc.status == 403:
                log.error(
                    "events of %s: not readable by this service account (%s); add 'list events' to its "
                    "Role (deploy/rbac.yaml) to see them here",
                    pod_name,
                    describe(exc),
                )
            else:
                log.error("events of %s: %s", pod_name, describe(exc))
    return tails


def current_lines(kube: Kube, api: JobApi, ns: str, pod: str) -> str:
    """The last lines of the container as it is (a failed pod's, before it is deleted)."""
    try:
        return kube.read_for_people(
            "read log", kube.core.read_namespaced_pod_log, pod, ns, container=api.container, tail_lines=TAIL_LINES
        )
    except (ApiException, StepFailed):  # logs are for people
        return ""


def last_lines(kube: Kube, api: JobApi, ns: str, pod: str) -> str:
    """The last lines of the container's previous run (a crash-looping container's own is about to restart)."""
    try:
        return kube.read_for_people(
            "read log",
            kube.core.read_namespaced_pod_log,
            pod,
            ns,
            container=api.container,
            tail_lines=TAIL_LINES,
            previous=True,
        )
    except (ApiException, StepFailed):  # logs are for people: an unreadable one never ends the launch
        return ""


class Diagnoser:
    """Reads the job's pods and their events for the diagnosis, at most every `every_s`.

    Also keeps what will be gone when the job fails: with restartPolicy OnFailure the Training Operator deletes every
    pod at the backoff limit, so the last lines of each container that exited are read at its restart; a TrainJob's
    failed pod (restartPolicy Never) goes when JobSet restarts the group, so its last lines are read once it failed.
    """

    def __init__(self, kube: Kube, api: JobApi, ns: str, name: str, diagnosis: Diagnosis, every_s: float):
        self.kube, self.api, self.ns, self.name = kube, api, ns, name
        self.diagnosis, self.every_s = diagnosis, every_s
        self.next_at = 0.0
        self.events_readable = True
        self.pods: list[Any] | None = None  # the last list read; None until one was
        self.restart_tails: dict[str, str] = {}  # pod -> "exit code N; last lines: ..." of its last restart
        self._restarts_seen: dict[str, int] = {}
        self._restart_lines: dict[str, tuple[int, str]] = {}  # pod -> (restart, its last lines) last read
        self._event_turn = 0  # where the next reading of Pending pods' events starts
        # Set by the launcher while the job may run (admitted) but has not started: with no pod to look at, the job's
        # own events (a TrainJob's, and its JobSet's of the same name) say why its operator made none.
        self.awaiting_pods = False

    def tick(self, force: bool = False) -> None:
        if not force and time.monotonic() < self.next_at:
            return
        self.next_at = time.monotonic() + self.every_s
        try:  # the diagnosis helps; it never stops the launch
            pods = job_pods(self.kube, self.api, self.ns, self.name)
        except (ApiException, StepFailed) as exc:
            log.warning("diagnosis: cannot list the job's pods: %s", describe(exc))
            return
        self.pods = pods
        events: list[Any] = []
        for pod in self._events_to_read(pods):
            try:
                events += self.kube.call(
                    "list events",
                    self.kube.core.list_namespaced_event,
                    self.ns,
                    field_selector=f"involvedObject.kind=Pod,involvedObject.name={pod}",
                ).items
            except (ApiException, StepFailed) as exc:
                self.events_readable = False  # the pods' statuses still tell most of it
                log.info("diagnosis: without events (%s)", describe(exc))
                break
        self.diagnosis.observe(pods, events)
        if self.awaiting_pods and self.events_readable and not [p for p in pods if not p.metadata.deletion_timestamp]:
            try:
                self.diagnosis.observe_job_events(
                    self.kube.call(
                        "list events",
                        self.kube.core.list_namespaced_event,
                        self.ns,
                        field_selector=f"involvedObject.name={self.name},type=Warning",
                    ).items
                )
            except (ApiException, StepFailed) as exc:
                self.events_readable = False
                log.info("diagnosis: without events (%s)", describe(exc))
        self._keep_restart_tails(pods)

    def _events_to_read(self, pods: list[Any]) -> list[str]:
        """The Pending pods whose events to read this time: the scheduler's and the image puller's words are all the
        diagnosis takes from events, and a Pending pod is where they are. Each pod's own (KFP's pods share the
        namespace), a few a time, in turn; none while the job runs."""
        waiting = sorted(p.metadata.name for p in pods if p.status.phase == "Pending")
        if not (self.events_readable and waiting):
            return []
        start = self._event_turn % len(waiting)
        self._event_turn += EVENT_READS_PER_TICK
        return (waiting[start:] + waiting[:start])[:EVENT_READS_PER_TICK]

    def _keep_restart_tails(self, pods: list[Any]) -> None:
        for pod in pods:
            for status in pod.status.container_statuses or []:
                name = pod.metadata.name
                ended = status.state.terminated if status.state else None
                if pod.status.phase == "Failed" and ended is not None and name not in self.restart_tails:
                    tail = current_lines(self.kube, self.api, self.ns, name).strip().splitlines()[-8:]
                    lines = f"; last lines: {' | '.join(tail)}" if tail else ""
                    self.restart_tails[name] = f"exit code {ended.exit_code} ({ended.reason}){lines}"
                    log.warning("%s failed (%s)", name, self.restart_tails[name])
                count = status.restart_count or 0
                last = status.last_state.terminated if status.last_state else None
                if count <= self._restarts_seen.get(name, 0) or last is None:
                    continue
                self._restarts_seen[name] = count
                tail = last_lines(self.kube, self.api, self.ns, name).strip().splitlines()[-8:]
                lines = f"; last lines: {' | '.join(tail)}" if tail else ""
                if not tail and name in self._restart_lines:  # unreadable now (the pod going): the earlier ones
                    lines = (
                        f"; last lines before restart {self._restart_lines[name][0]}: {self._restart_lines[name][1]}"
                    )
                elif tail:
                    self._restart_lines[name] = (count, " | ".join(tail))
                self.restart_tails[name] = f"exit code {last.exit_code} ({last.reason}) at restart {count}{lines}"
                log.warning("%s restarted (%s)", name, self.restart_tails[name])
