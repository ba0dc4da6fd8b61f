"""Why training failed, from what outlives the pods: the trainer's own files on the shared volume.

With restartPolicy OnFailure, Training Operator 1.8.1 deletes every pod of a job that reached its backoff limit
before it writes the Failed condition (pkg/controller.v1/common/job.go, ReconcileJobs -> DeletePodsAndServices), so
the pods' logs are usually gone when the launcher learns of the failure. The trainer writes its per-rank logs
(`<run>/logs/rank_<N>.log`) and rank 0 its state (`<run>/status.json`) onto the volume the launcher mounts too:
those say which rank failed first and its last lines, whatever happened to the pods.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from trainer.layout import RunPaths

TAIL_LINES = 12
TAIL_BYTES = 64 * 1024  # a rank's log can be large: only its end is read
_RANK_LOG = re.compile(r"rank_(\d+)\.log$")
# The trainer's log format (trainer/train_ddp.py setup_logging): "<asctime> [rank N] LEVEL logger: message".
_ERROR_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \[rank \d+\] (ERROR|CRITICAL) ")


@dataclass
class TrainerEvidence:
    state: str  # status.json's state ("crashed", "bad-input", ...), "" when it has none
    step: int | None
    error: str  # status.json's error
    rank: int | None  # the rank that logged an error first (None: no rank logged one)
    last_lines: list[str]  # that rank's last lines (rank 0's when no rank logged an error)

    def summary(self) -> str:
        """One line for the step's failure message."""
        parts = []
        if self.state:
            at = f" at step {self.step}" if self.step is not None else ""
            parts.append(f"trainer {self.state}{at}" + (f" ({self.error[:300]})" if self.error else ""))
        if self.last_lines:
            who = (
                f"rank {self.rank}, the first to log an error"
                if self.rank is not None
                else "rank 0 (no rank logged an error)"
            )
            parts.append(f"last lines of {who}: " + " | ".join(line.strip()[:300] for line in self.last_lines))
        return "; ".join(parts)


def read_evidence(run: RunPaths, tail: int = TAIL_LINES) -> TrainerEvidence | None:
    """What the run directory says about a failure; None when the trainer left nothing there (it never started)."""
    status = _read_status(run.status)
    tails = {rank: _tail(path, TAIL_BYTES) for rank, path in _rank_logs(run.logs).items()}
    if not status and not any(tails.values()):
        return None
    first_error: tuple[str, int] | None = None
    for rank, lines in tails.items():
        for line in lines:
            match = _ERROR_LINE.match(line)
            if match and (first_error is None or (match.group(1), rank) < first_error):
                first_error = (match.group(1), rank)
                break
    rank = first_error[1] if first_error else None
    lines = tails.get(rank if rank is not None else 0) or []
    return TrainerEvidence(
        state=str(status.get("state", "")),
        step=status.get("step"),
        error=str(status.get("error", "")),
        rank=rank,
        last_lines=lines[-tail:],
    )


def failure_evidence(trainer: TrainerEvidence | None, pod_tails: dict[str, str], operator_faults: str = "") -> str:
    """What the step's failure message adds to the job's condition: the operator's own account of the faults it
    restarted the job for, where its status keeps one (a HyperPodPyTorchJob's latestFaultyPodInstanceList: the
    restart type, the faulty pods and their ranks); then the trainer's account from the volume, or without one what
    the failed pods showed (at their last restart, or now, if they still exist)."""
    faults = f"; the operator's last restart: {operator_faults}" if operator_faults else ""
    if trainer is not None and (summary := trainer.summary()):
        return f"{faults}; {summary}"
    if pod_tails:
        return f"{faults}; " + "; ".join(f"{pod}: {tail}" for pod, tail in sorted(pod_tails.items()))
    return f"{faults}; the trainer left no log or status on the volume (it may never have started)"


def last_lines_of_every_rank(run: RunPaths, lines: int = 2) -> str:
    """Each rank's last lines, for a stall: which ranks were where when progress stopped."""
    tails = {rank: _tail(path, TAIL_BYTES)[-lines:] for rank, path in sorted(_rank_logs(run.logs).items())}
    return (
        " || ".join(f"rank {rank}: " + " | ".join(line.strip()[:200] for line in tail) for rank, tail in tails.items())
        or "no rank left a log on the volume"
    )


def _read_status(path: Path) -> dict:
    try:
        status = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return status if isinstance(status, dict) else {}


def _rank_logs(logs: Path) -> dict[int, Path]:
    try:
        return {int(m.group(1)): p for p in logs.iterdir() if (m := _RANK_LOG.search(p.name))}
    except OSError:
        return {}


def _tail(path: Path, size: int) -> list[str]:
    """The last complete lines within `size` bytes of the file's end."""
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            end = f.tell()
            f.seek(max(0, end - size))
            data = f.read()
    except OSError:
        return []
    lines = data.decode("utf-8", errors="replace").splitlines()
    return lines[1:] if end > size and lines else lines
