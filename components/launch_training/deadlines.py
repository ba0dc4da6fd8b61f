"""Which of the launcher's clocks runs for a job, from its status (as its API reads it) and its pods."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from components.launch_training.job_api import JobApi

log = logging.getLogger(__name__)


class Deadlines:
    """Which clock runs, from the job's conditions and its pods.

    - queued: the job is suspended (Kueue holds it until admitted); only the queue deadline counts it.
    - not started: until the job first runs with its minimum of pods, the Pending deadline applies (image not
      pulled, no room).
    - started: Pending pods beyond the minimum are how elasticity works (a 2:4 job runs on 2 while 2 wait for
      room): reported once, never fatal. Fewer than the minimum running (a node lost, its pod recreated and
      waiting for a replacement) counts against the recovery deadline.

    The launcher (follow.run_job) feeds it the job and its pods and compares these clocks with its settings.
    """

    def __init__(self, min_pods: int, api: JobApi, now: Callable[[], float] = time.monotonic):
        self.min_pods, self.api, self.now = min_pods, api, now
        self.started = False
        self.queued_since: float | None = None
        self.queued_total = 0.0
        self.degraded_since: float | None = None
        self.runnable_since: float | None = None  # created unsuspended, or last admitted: when it could run
        self.reported_waiting: set[str] = set()

    def job_changed(self, job: dict[str, Any]) -> None:
        suspended = self.api.is_suspended(job)
        if not suspended and self.runnable_since is None:
            self.runnable_since = self.now()
        elif suspended:
            self.runnable_since = None
        if suspended and self.queued_since is None:
            # Queued, or preempted by Kueue (pods deleted, the job suspended): when it is admitted again its pods
            # are created and scheduled anew, so it starts again, under the Pending deadline; the time it waits in
            # the queue is not a lost node's.
            self.started, self.degraded_since = False, None
            self.queued_since = self.now()
            log.info(
                "%s %s is queued: suspended until the cluster's queue (Kueue) admits it",
                self.api.kind,
                job["metadata"]["name"],
            )
        elif not suspended and self.queued_since is not None:
            waited = self.now() - self.queued_since
            self.queued_total += waited
            self.queued_since = None
            log.info("%s %s was admitted after %.0fs in the queue", self.api.kind, job["metadata"]["name"], waited)

    def pods_changed(self, pods: list[Any], job: dict[str, Any]) -> None:
        if self.queued:
            return
        live = [p for p in pods if not p.metadata.deletion_timestamp]
        running = [p for p in live if p.status.phase == "Running"]
        if not self.started and len(running) >= self.min_pods and self.api.is_running(job):
            self.started = True
            log.info(
                "%s %s runs with %d of its pods (minimum %d)",
                self.api.kind,
                job["metadata"]["name"],
                len(running),
                self.min_pods,
            )
        if not self.started:
            return
        self.degraded_since = (self.degraded_since or self.now()) if len(running) < self.min_pods else None
        waiting = sorted(p.metadata.name for p in live if p.status.phase == "Pending")
        new = [name for name in waiting if name not in self.reported_waiting]
        if new and len(running) >= self.min_pods:
            self.reported_waiting.update(new)
            log.info(
                "%s Pending beyond the minimum of %d: the job runs on %d pods and takes them in when there is "
                "room (elastic; not an error)",
                ", ".join(new),
                self.min_pods,
                len(running),
            )

    @property
    def queued(self) -> bool:
        return self.queued_since is not None

    def queued_for(self) -> float:
        return 0.0 if self.queued_since is None else self.now() - self.queued_since

    def runnable_for(self) -> float:
        """How long the job could have run (not queued): the Pending deadline's clock while it has no pods."""
        return 0.0 if self.runnable_since is None else self.now() - self.runnable_since

    def degraded_for(self) -> float:
        return 0.0 if self.degraded_since is None else self.now() - self.degraded_since

    def active_time(self, since: float) -> float:
        """Time since `since`, less the time spent queued: the training deadline's clock."""
        return self.now() - since - self.queued_total - self.queued_for()
