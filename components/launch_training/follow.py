"""Follow a job to its end (`run_job`): create or re-attach (attach.py), then watch it, stream its logs, read its
pods for the diagnosis and the restart budget, and hold it to its deadlines (deadlines.py) and the trainer's
progress (progress.py).

The end: Succeeded returns; Failed raises with the condition's reason, the trainer's own account from the volume
(evidence.py) or what the pods showed at their restarts, and the diagnosis; `cancel` set (a SIGTERM) deletes the job
and raises; past a deadline, a restart budget used up, or a permanent failure of the trainer, the job is deleted and
the step fails with what was seen.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kubernetes.client.exceptions import ApiException

from common.errors import StepFailed
from components.kube import Kube, describe
from components.launch_training.apis import api_of
from components.launch_training.attach import create_or_attach
from components.launch_training.cancel import Cancelled, delete_job
from components.launch_training.deadlines import Deadlines
from components.launch_training.diagnosis import Diagnosis
from components.launch_training.evidence import TrainerEvidence, failure_evidence, last_lines_of_every_rank
from components.launch_training.log_stream import LogStreamer
from components.launch_training.pods import Diagnoser, describe_failure, job_pods, last_lines, pod_summary
from components.launch_training.progress import TrainingWatch
from components.launch_training.readers import JobWatcher, PodWatcher, drained, end_readers
from components.launch_training.rendering import AUTO_RESUME
from components.launch_training.restarts import Restarts
from components.launch_training.watch_settings import WatchSettings

log = logging.getLogger(__name__)

LOG_DRAIN_S = 10.0  # after the job ends, how long its log streams may take to reach their end


@dataclass
class JobOutcome:
    name: str
    namespace: str
    state: str  # Succeeded, Failed, DeadlineExceeded, Cancelled
    reattached: bool
    attempt: int  # 1 for the run's first job; +1 each time a failed one was replaced
    queued_s: float | None  # creation to Running
    running_s: float | None  # Running to the end
    restarts: int
    conditions: list[dict[str, Any]] = field(default_factory=list)
    diagnosis: list[str] = field(default_factory=list)  # what went wrong on the way, one line each


def run_job(
    kube: Kube,
    job: dict[str, Any],
    settings: WatchSettings,
    cancel: threading.Event,
    diagnosis: Diagnosis | None = None,
    evidence: Callable[[], TrainerEvidence | None] = lambda: None,
    on_owned: Callable[[str], None] = lambda uid: None,
    training: TrainingWatch | None = None,
) -> JobOutcome:
    """Create or re-attach, then follow the job to its end. `cancel` set (by SIGTERM): delete and raise.

    `evidence` reads the trainer's own account of a failure (its logs on the volume); `on_owned` is told the uid of
    the job once it is known to be ours (created, or re-attached with our spec digest); `training` reads the
    trainer's progress: a permanent failure or a stall deletes the job (restarts would not help).
    """
    follower = JobFollower(kube, job, settings, cancel, diagnosis, training)
    follower.start(on_owned)
    follower.follow()
    return follower.outcome(evidence)


def not_started_for(diagnoser: Diagnoser, diagnosis: Diagnosis, deadlines: Deadlines) -> tuple[str, float]:
    """What keeps a job that has not started, and for how long, from the pods last read: pods Pending count from the
    oldest one; no pods at all, from when the job could run (created, or admitted by Kueue), since an operator that
    cannot make them says so only in its events."""
    if any(not p.metadata.deletion_timestamp for p in diagnoser.pods or []):
        return "pods Pending", diagnosis.pending_for()
    return "no pods made", deadlines.runnable_for()


class JobFollower:
    """One job, followed by `run_job`: the readers of its states, its pods and its nodes' logs, and what the loop
    holds it to (the deadlines, the restart budget, the trainer's progress)."""

    def __init__(
        self,
        kube: Kube,
        job: dict[str, Any],
        settings: WatchSettings,
        cancel: threading.Event,
        diagnosis: Diagnosis | None,
        training: TrainingWatch | None,
    ):
        self.kube, self.job, self.settings, self.cancel, self.training = kube, job, settings, cancel, training
        self.api = api = api_of(job)
        self.ns, self.name = ns, name = job["metadata"]["namespace"], job["metadata"]["name"]
        self.diagnosis = diagnosis or Diagnosis(name, last_lines=lambda pod: last_lines(kube, api, ns, pod))
        self.diagnoser = Diagnoser(kube, api, ns, name, self.diagnosis, settings.diagnose_every_s)
        self.min_pods, self.workers = api.nodes(job)
        self.deadlines = Deadlines(self.min_pods, api)
        if self.min_pods < self.workers:
            self.diagnosis.min_pods = self.min_pods  # elastic: pods beyond the minimum may wait for room
        self.stop = threading.Event()
        self.last_seen: tuple[Any, Any] | None = None
        self.next_training_check = 0.0
        self.auto_resumed = (job["metadata"].get("annotations") or {}).get(AUTO_RESUME) == "true"
        self.failed_at: float | None = None  # Failed, and waiting for auto-resume to bring it back

    def start(self, on_owned: Callable[[str], None]) -> None:
        """Create or re-attach the job, then start reading it: its states, its pods, its nodes' logs."""
        kube, api, ns, name, settings = self.kube, self.api, self.ns, self.name, self.settings
        stored, self.reattached, self.attempt = create_or_attach(
            kube, self.job, settings.replace_timeout_s, self.cancel
        )
        self.uid = stored["metadata"]["uid"]
        on_owned(self.uid)
        self.started_at = time.monotonic()
        self.watcher = JobWatcher(kube, stored, settings, self.stop)
        self.watcher.updates.put(stored)
        self.watcher.start()
        self.restart_count, self.restart_limit = Restarts(), api.restart_limit(stored)
        self.pod_watcher = PodWatcher(kube, api, ns, name, settings, self.stop)
        self.pod_watcher.start()
        nodes = {"none": [], "all": list(range(self.workers))}.get(settings.logs, [0])
        self.streamers = [
            LogStreamer(kube, api, ns, name, node, settings, self.stop, self.diagnosis.observe_line) for node in nodes
        ]
        for streamer in self.streamers:
            streamer.start()
        self.current = stored

    def follow(self) -> None:
        """Until the job ends, or raise: cancelled, or given up (deleted). The readers have ended when it returns."""
        try:
            while True:
                self.check_cancel_and_deadline()
                if self.auto_resume_waited_out():
                    break
                self.observe_pods()
                self.check_start_and_recovery()
                self.check_training()
                if self.next_update():
                    break
            # The last lines may come after the job's condition. After a failure, other workers may still be running
            # (until cleanPodPolicy removes them): their streams are not waited for long.
            drain_until = time.monotonic() + (LOG_DRAIN_S if self.api.is_succeeded(self.current) else 2.0)
            for streamer in self.streamers:
                streamer.job_done.set()
            for streamer in self.streamers:
                streamer.join(timeout=max(0.0, drain_until - time.monotonic()))
        finally:
            end_readers([self.watcher, self.pod_watcher, *self.streamers], self.stop)

    def give_up(self, why: str) -> None:
        kube, api, ns, name = self.kube, self.api, self.ns, self.name
        self.diagnoser.tick(force=True)  # one more look before the job goes: the reason given is the latest
        phases = pod_summary(api, name, job_pods(kube, api, ns, name))
        describe_failure(kube, api, ns, name)  # a pod stuck in Pending says why in its events
        delete_job(kube, api, ns, name, self.uid)
        raise StepFailed(f"{api.kind} {ns}/{name} {why} (pods: {phases}){_why(self.diagnosis)}; it was deleted")

    def check_cancel_and_deadline(self) -> None:
        api, ns, name, settings = self.api, self.ns, self.name, self.settings
        if self.cancel.is_set():
            log.warning("SIGTERM: the run is being terminated; deleting %s %s/%s", api.kind, ns, name)
            delete_job(self.kube, api, ns, name, self.uid)
            raise Cancelled(f"cancelled: {api.kind} {ns}/{name} deleted on SIGTERM")
        if settings.deadline_s and self.deadlines.active_time(self.started_at) > settings.deadline_s:
            last = (api.latest_condition(self.current) or {}).get("type", "none")
            self.give_up(
                f"did not finish within {settings.deadline_s:.0f}s (not counting time queued; last state: {last})"
            )

    def auto_resume_waited_out(self) -> bool:
        """The job stayed Failed past the time auto-resume was given to bring it back."""
        if self.failed_at is not None and time.monotonic() - self.failed_at > self.settings.auto_resume_wait_s:
            log.warning(
                "%s %s/%s stayed Failed for %.0fs: auto-resume did not bring it back",
                self.api.kind,
                self.ns,
                self.name,
                self.settings.auto_resume_wait_s,
            )
            return True
        return False

    def observe_pods(self) -> None:
        """The pods as the diagnosis reads them, and as the pod watch saw them, against the restart budget."""
        api, deadlines, diagnoser, restart_count = self.api, self.deadlines, self.diagnoser, self.restart_count
        diagnoser.awaiting_pods = not deadlines.queued and not deadlines.started
        diagnoser.tick()
        if diagnoser.pods is not None:
            deadlines.pods_changed(diagnoser.pods, self.current)
            self.diagnosis.started = deadlines.started
        if deadlines.queued or api.is_failed(self.current):
            restart_count.forget_pods()  # Kueue's preemption, HyperPod's auto-resume: pods made anew by design
        # the watch's states in order; the diagnosis's readings where the watch is refused
        for pod in drained(self.pod_watcher.pods) + ([] if self.pod_watcher.is_alive() else diagnoser.pods or []):
            restart_count.observe(api.pod_label(pod.metadata.name, self.name), pod)
        if restart_count.past(self.restart_limit):
            self.give_up(
                f"used up its restart budget: {restart_count.count} restarts (backoffLimit {self.restart_limit}), "
                f"{restart_count.summary()}"
            )

    def check_start_and_recovery(self) -> None:
        """The queue deadline while queued, the Pending (or creation) deadline until it started, then the recovery
        deadline."""
        settings, deadlines, diagnoser, diagnosis = self.settings, self.deadlines, self.diagnoser, self.diagnosis
        if deadlines.queued:
            if settings.queue_timeout_s and deadlines.queued_for() > settings.queue_timeout_s:
                self.give_up(
                    f"was queued (suspended, not admitted) for {deadlines.queued_for():.0f}s, past the queue "
                    f"deadline of {settings.queue_timeout_s:.0f}s"
                )
        elif not deadlines.started:
            limit = settings.pending_timeout_s or (settings.creation_timeout_s if diagnosis.not_created else 0)
            if limit and not_started_for(diagnoser, diagnosis, deadlines)[1] > limit:
                # decided on the pods as they are now: the last reading may be from before they were made, or
                # ran (the diagnosis reads them every diagnose_every_s, longer than a Pending deadline may be)
                diagnoser.tick(force=True)
                if diagnoser.pods is not None:
                    deadlines.pods_changed(diagnoser.pods, self.current)
                what, waited = not_started_for(diagnoser, diagnosis, deadlines)
                if not deadlines.started and waited > limit:
                    deadline = "Pending" if settings.pending_timeout_s else "creation"
                    self.give_up(
                        f"never started: {what} for {waited:.0f}s, past the {deadline} deadline of {limit:.0f}s"
                    )
        elif settings.recovery_timeout_s and deadlines.degraded_for() > settings.recovery_timeout_s:
            self.give_up(
                f"ran with fewer than its minimum of {self.min_pods} pod(s) for {deadlines.degraded_for():.0f}s "
                f"(a lost node not replaced), past the recovery deadline of "
                f"{settings.recovery_timeout_s:.0f}s"
            )

    def check_training(self) -> None:
        """The trainer's own progress: a permanent failure or a stall stops the job (restarts would not help)."""
        training = self.training
        if training is not None and time.monotonic() >= self.next_training_check:
            self.next_training_check = time.monotonic() + self.settings.training_check_s
            if why := training.check():
                lines = f"; last lines: {last_lines_of_every_rank(training.run)}" if "stalled" in why else ""
                self.give_up(f"was stopped, not restarted: {why}{lines}")

    def next_update(self) -> bool:
        """The job's next state from the watch, logged as its condition changes; whether the job has finished."""
        api, ns, name = self.api, self.ns, self.name
        try:
            update = self.watcher.updates.get(timeout=0.2)
        except queue.Empty:
            if not self.watcher.is_alive() and self.watcher.updates.empty():
                raise StepFailed(f"lost track of {api.kind} {ns}/{name}: the watch stopped") from None
            return False
        if isinstance(update, BaseException):
            if self.cancel.is_set():
                return False  # the signal handler's delete, seen by the watch first: cancelled, said at the top
            raise update
        current = self.current = update
        self.deadlines.job_changed(current)
        condition = api.latest_condition(current)
        key = (condition or {}).get("type"), (condition or {}).get("reason")
        if key != self.last_seen and condition is not None:
            self.last_seen = key
            phases = pod_summary(api, name, job_pods(self.kube, api, ns, name))
            log.info(
                "%s %s: %s (%s) %s; pods: %s",
                api.kind,
                name,
                condition["type"],
                condition.get("reason", ""),
                condition.get("message", ""),
                phases,
            )
        if self.failed_at is not None and not api.is_failed(current):
            log.warning(
                "%s %s/%s is no longer Failed (%s): auto-resume brought it back",
                api.kind,
                ns,
                name,
                (condition or {}).get("type", "no condition"),
            )
            self.failed_at = None
        if api.is_failed(current) and self.auto_resumed and self.settings.auto_resume_wait_s:
            if self.failed_at is None:
                self.failed_at = time.monotonic()
                log.warning(
                    "%s %s/%s failed; HyperPod auto-resume is on and may restart it: watching it %.0fs "
                    "more before the step fails",
                    api.kind,
                    ns,
                    name,
                    self.settings.auto_resume_wait_s,
                )
            return False
        return api.is_finished(current)

    def outcome(self, evidence: Callable[[], TrainerEvidence | None]) -> JobOutcome:
        """The ended job's outcome; a Failed one raises, with why."""
        kube, api, ns, name, current = self.kube, self.api, self.ns, self.name, self.current
        queued, running = api.times(current)
        restarts = max(api.restarts(current, job_pods(kube, api, ns, name)), self.restart_count.count)
        findings = [f.line() for f in self.diagnosis.findings]
        state = "Succeeded" if api.is_succeeded(current) else "Failed"
        outcome = JobOutcome(
            name, ns, state, self.reattached, self.attempt, queued, running, restarts, api.conditions(current), findings
        )
        if state == "Failed":
            self.fail(evidence)
        log.info(
            "%s %s/%s succeeded (attempt %d; queued %s, running %s, %d restarts)",
            api.kind,
            ns,
            name,
            self.attempt,
            f"{queued:.0f}s" if queued is not None else "?",
            f"{running:.0f}s" if running is not None else "?",
            restarts,
        )
        return outcome

    def fail(self, evidence: Callable[[], TrainerEvidence | None]) -> None:
        """Raise for the Failed job: its condition, the trainer's account or the pods' last lines, the diagnosis."""
        kube, api, ns, name = self.kube, self.api, self.ns, self.name
        condition = api.latest_condition(self.current) or {}
        self.diagnoser.tick(force=True)  # the pods' last word, if they still exist: an OOMKilled, a crash loop
        pod_tails = {**self.diagnoser.restart_tails, **describe_failure(kube, api, ns, name)}
        reason = f"{condition.get('reason', '')}: {condition.get('message', '')}".strip(": ")
        message = (
            f"{api.kind} {ns}/{name} failed (attempt {self.attempt}): {reason}"
            f"{failure_evidence(evidence(), pod_tails, api.faults(self.current))}{_why(self.diagnosis)}"
        )
        if api.delete_failed:  # its operator would run it again (trainjob.py); what it showed is read above
            try:
                delete_job(kube, api, ns, name, self.uid)
                message += f"; the {api.kind} was deleted, so that {api.operator} does not run it again"
            except (ApiException, StepFailed) as exc:
                message += (
                    f"; deleting it failed ({describe(exc)}): delete it (`kubectl delete {api.plural} -n {ns} "
                    f"{name}`), or {api.operator} may run it again"
                )
        raise StepFailed(message)


def _why(diagnosis: Diagnosis) -> str:
    return f"; diagnosis: {diagnosis.summary()}" if diagnosis.findings else ""
