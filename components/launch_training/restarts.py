"""A job's restarts as its restart budget must count them, pods made anew included.

A container restarted in place (restartPolicy OnFailure) raises its pod's restartCount, which the Training Operator
sums into its backoff limit. Under restartPolicy ExitCode the operator gives the pods restartPolicy Never, deletes a
worker that failed with a retryable exit code (>= 128: 137 when the kernel killed it for memory) and makes a new pod
for the same replica, with a restartCount of 0; its backoff limit counts restarts of Running pods only, so it never
fires, and an OOM loop would run until the step's deadline (Training Operator v1.8.1,
``pkg/controller.v1/common/pod.go`` ``ReconcilePods``, ``pkg/core/job.go`` ``PastBackoffLimit``). Here each new pod
of a replica that already had one counts as one restart, as an in-place one does, and the failed pod's exit code is
kept to say why.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Restarts:
    """Fed every pod state the launcher sees (``observe``), by the replica each pod stands for."""

    pod_by_replica: dict[str, str] = field(default_factory=dict)  # replica -> uid of its newest pod
    known: set[str] = field(default_factory=set)  # every pod uid seen
    in_place: dict[str, int] = field(default_factory=dict)  # uid -> its containers' restarts
    made_anew: int = 0
    endings: dict[str, str] = field(default_factory=dict)  # uid -> "worker-1: exit code 137 (OOMKilled)"
    last_endings: list[str] = field(default_factory=list)  # of the pods replaced, oldest first

    def observe(self, replica: str, pod: Any) -> None:
        uid = pod.metadata.uid
        statuses = (pod.status.container_statuses or []) if pod.status else []
        self.in_place[uid] = max(self.in_place.get(uid, 0), sum(s.restart_count or 0 for s in statuses))
        for status in statuses:
            ended = status.state.terminated if status.state else None
            if ended is not None and ended.exit_code:
                self.endings[uid] = f"{replica}: exit code {ended.exit_code} ({ended.reason or 'no reason given'})"
        if uid in self.known:  # a later state of a pod seen before (or an older reading of it)
            return
        self.known.add(uid)
        previous = self.pod_by_replica.get(replica)
        if previous is not None:
            self.made_anew += 1
            self.last_endings.append(self.endings.get(previous, f"{replica}: its pod went (no exit code seen)"))
        self.pod_by_replica[replica] = uid

    def forget_pods(self) -> None:
        """The job was suspended (Kueue) or failed (HyperPod auto-resume may bring it back): its pods go by design, and
        the ones made when it runs again are new pods, not restarts."""
        self.pod_by_replica.clear()

    @property
    def count(self) -> int:
        return self.made_anew + sum(self.in_place.values())

    def past(self, limit: int | None) -> bool:
        """Whether the job has used up `limit` restarts with pods made anew among them (in-place restarts alone are
        the operator's to count)."""
        return limit is not None and self.made_anew > 0 and self.count >= limit

    def summary(self) -> str:
        shown = self.last_endings[-3:]
        more = f" ({len(self.last_endings) - len(shown)} earlier)" if len(self.last_endings) > len(shown) else ""
        return f"pods made anew after: {'; '.join(shown)}{more}"
