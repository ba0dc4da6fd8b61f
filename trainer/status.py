"""`<run>/status.json`: where a run stands, written by the trainer for the launcher, which reads it to tell a
preempted-and-saved run from a crash and to see progress (torchrun itself exits 1 when it is signalled).

States: running, done, preempted, preempted-unsaved, bad-input, diverged, hung, crashed; with the step, the exit code
(trainer/preemption.py ExitCode) and the attempt.
"""

from __future__ import annotations

import time
from typing import Any

from trainer.atomic import write_json
from trainer.layout import RunPaths
from trainer.preemption import ExitCode


def write_status(run: RunPaths, rank: int, state: str, durable: bool = True, **details: Any) -> None:
    """Rank 0 records where the run stands, so that the launcher can tell preempted-and-saved from a crash, and
    see progress (at every logged step: not `durable`, no fsync, as it is rewritten so often)."""
    if rank == 0:
        write_json(run.status, {"state": state, **details, "time": time.time()}, fsync=durable)


def write_hung_status(run: RunPaths, step: int, silent: list[int], reason: str, attempt: int) -> None:
    """Status `hung`, written by the lowest rank still answering (rank 0 may be the silent one)."""
    status = {"state": "hung", "step": step, "silent_ranks": silent, "error": reason, "attempt": attempt}
    write_json(run.status, {**status, "exit_code": int(ExitCode.CRASHED), "time": time.time()})
