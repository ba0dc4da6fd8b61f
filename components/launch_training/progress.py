"""The launcher's watch on training itself, from the trainer's status.json on the shared volume.

Two things end a job early, on either backend:
- a permanent failure: the trainer says it diverged or was given bad input. Rerunning will not help, but with
  restartPolicy OnFailure the kubelet restarts the container, the Training Operator counts it towards backoffLimit
  and HyperPod auto-resume starts the job again: hours of GPUs, each time from the same checkpoint. The launcher
  deletes the job as soon as the trainer says so.
- a stall: the trainer writes its step at every logged step; when it has not moved for the stall timeout, the job
  is hung (a collective that never completes, a dead NIC with the process alive) and is deleted.

The stall timeout is a setting; 0 derives it: ten times the longest gap seen so far between two updates, and never
less than STALL_FLOOR_S (the first step can include compiling and loading).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from trainer.layout import RunPaths

PERMANENT = ("diverged", "bad-input")  # trainer states that a restart cannot fix
STALL_FLOOR_S = 900.0
STALL_GAPS = 10  # a derived stall timeout is this many times the longest gap seen between progress updates


@dataclass
class TrainingWatch:
    run: RunPaths
    stall_timeout_s: float = 0.0  # 0: derived (see the module's docstring)
    since: float = field(default_factory=time.time)  # an older status.json is an earlier launch's
    now: Callable[[], float] = time.monotonic
    _progress: tuple | None = None
    _moved_at: float | None = None
    _longest_gap: float = 0.0

    def stall_limit(self) -> float:
        return self.stall_timeout_s or max(STALL_FLOOR_S, STALL_GAPS * self._longest_gap)

    def check(self, permanent: bool = True) -> str | None:
        """Why the job must end now, or None. Call it every few seconds while the job runs. Without `permanent`,
        only a stall counts (where nothing restarts the trainer, its own exit says the rest)."""
        status = self._status()
        state = status.get("state")
        if state in PERMANENT or status.get("permanent"):  # diverged, bad input, a full or read-only volume
            return (status.get("error") or f"trainer {state} at step {status.get('step')}") if permanent else None
        if state != "running":
            self._progress = self._moved_at = None  # not training (yet, or any more): no stall clock until it is
            return None
        now = self.now()
        progress = (status.get("attempt"), status.get("step"))
        if progress != self._progress:
            if self._moved_at is not None and self._progress is not None and progress[0] == self._progress[0]:
                self._longest_gap = max(self._longest_gap, now - self._moved_at)
            self._progress, self._moved_at = progress, now
            return None
        if self._moved_at is not None and now - self._moved_at > self.stall_limit():
            return (
                f"stalled: no training step completed for {now - self._moved_at:.0f}s (stall timeout "
                f"{self.stall_limit():.0f}s) after step {status.get('step')}"
            )
        return None

    def _status(self) -> dict:
        try:
            status = json.loads(self.run.status.read_text())
        except (OSError, ValueError):
            return {}
        if not isinstance(status, dict) or float(status.get("time", 0)) < self.since:
            return {}
        return status
