"""Preemption: catch SIGTERM/SIGINT on every rank and stop all ranks at the same step boundary.

On HyperPod a sick node is cordoned and its pod gets SIGTERM; under torchrun the agent forwards it to
every worker, then SIGKILLs them after its shutdown timeout (30 s unless TORCH_ELASTIC_SHUTDOWN_TIMEOUT
or --shutdown-timeout says otherwise), whatever the pod's grace period. The handler only records the
signal; at each step boundary the ranks agree (an all_reduce MAX of the flag, read one step later, so the
host does not wait for the device), so a signal that reached one rank stops all of them after the same step,
and rank 0 commits a checkpoint of exactly that step.
"""

from __future__ import annotations

import enum
import logging
import os
import signal
import time
from collections import deque
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from trainer.checkpoint import SaveReport

log = logging.getLogger(__name__)

TORCHRUN_DEFAULT_SHUTDOWN_S = 30.0


class ExitCode(enum.IntEnum):
    """What a trainer process's exit status means (also the container's, on the cluster)."""

    DONE = 0  # reached --max-steps / --max-tokens / --max-time, final checkpoint committed
    CRASHED = 1  # an unexpected exception (torchrun's summary holds the traceback)
    BAD_INPUT = 2  # a flag, the dataset or the checkpoint does not fit; rerunning will not help
    DIVERGED = 3  # the loss or gradient norm stayed non-finite (trainer/health.py); rerunning will not help
    PREEMPTED = 75  # stopped by SIGTERM/SIGINT after committing a checkpoint: rerun to resume (EX_TEMPFAIL)
    PREEMPTED_UNSAVED = 76  # stopped by a signal, but the checkpoint could not be committed


def save_budget_s(grace_period_s: float, environ: dict[str, str] | os._Environ = os.environ) -> float:
    """Seconds from SIGTERM to SIGKILL: the pod's grace period, or torchrun's shutdown timeout if shorter."""
    if "TORCHELASTIC_RUN_ID" not in environ:  # not under torchrun: only the pod's grace period applies
        return grace_period_s
    torchrun_s = float(environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", TORCHRUN_DEFAULT_SHUTDOWN_S))
    return min(grace_period_s, torchrun_s)


def save_budget_report(step_time_s: float, saved: SaveReport, budget_s: float) -> tuple[str, str | None]:
    """After the first checkpoint: could a SIGTERM arriving mid-step still end in a committed checkpoint? The ranks
    agree on it a step later (StopSignal), so up to two steps pass before the save. And how much did writing from
    every rank help (the save would take parallel_speedup times longer from one writer)? The line that says so, and
    a warning when two steps and a save do not fit `budget_s`."""
    save_s, needed_s = saved.seconds, 2 * step_time_s + saved.seconds
    fits = "fits" if needed_s <= budget_s else "does NOT fit"
    line = (
        f"checkpoint save: {saved.total_bytes / 1e6:.1f} MB in {save_s:.1f}s "
        f"({saved.total_bytes / 1e6 / max(save_s, 1e-9):.0f} MB/s), written by {saved.writers} ranks in parallel, "
        f"about {saved.parallel_speedup:.1f}x faster than one writer at the same rate; two steps ({step_time_s:.1f}s "
        f"each) plus a save {fits} the {budget_s:.0f}s preemption budget"
    )
    if needed_s <= budget_s:
        return line, None
    return line, (
        f"!!! PREEMPTION WOULD LOSE WORK: two steps ({step_time_s:.1f}s each: the one the signal lands in and the one "
        f"in which the ranks agree to stop) plus a checkpoint save ({save_s:.1f}s) take longer than the "
        f"{budget_s:.0f}s between SIGTERM and SIGKILL (the grace period, capped by torchrun's shutdown timeout); "
        "raise terminationGracePeriodSeconds and torchrun's --shutdown-timeout, or save faster "
        "(--async-checkpoint does not help here: the final save is always waited for)"
    )


class StopSignal:
    """Records SIGTERM/SIGINT; every rank learns, collectively and one step later, whether any rank got one.

    At each step boundary `propose()` starts an all-reduce (MAX) of this rank's flags (the stop reason, the step's
    non-finite flag) without waiting for it; `agree()` reads the flags of earlier steps, whose all-reduce finished
    while the next step ran, so the host never waits for the device in between. A sync step (a logged step, a
    checkpoint, the last step) reads its own flags too. Every rank reads the same flags at the same steps, so every
    rank stops after the same step: the one after the signal's, or the signal's own when it is a sync step.
    """

    def __init__(self, device: torch.device):
        self.signal: signal.Signals | None = None
        self.received_at: float | None = None  # time.monotonic() of the first signal
        self.device = device
        self._pending: deque[_Flags] = deque()
        # Kept until the process exits: torchrun's own SIGTERM to the last workers, when the first of them
        # has exited, must not kill one that is still tearing down after its checkpoint.
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._record)

    def _record(self, signum: int, _frame: object) -> None:
        if self.signal is None:
            self.signal, self.received_at = signal.Signals(signum), time.monotonic()
            log.warning("received %s: stopping at the end of this step to checkpoint", self.signal.name)

    def propose(self, step: int, time_up: bool, nonfinite: torch.Tensor) -> None:
        """Collective, after every step on every rank: start agreeing on this step's flags. Any rank's signal stops
        all of them; so does any rank's clock passing --max-time; `nonfinite` is a device tensor (trainer/health.py)."""
        self._pending.append(_Flags(step, 2 if self.signal else 1 if time_up else 0, nonfinite, self.device))

    def agree(self, sync_step: bool) -> tuple[str | None, list[tuple[int, bool]]]:
        """The agreed stop reason ("signal", "max-time" or None) and each read step's non-finite flag, in order: the
        flags of every step before the latest, and with `sync_step` the latest's too."""
        agreed, steps = 0, []
        while self._pending and (sync_step or agreed or len(self._pending) > 1):  # a stop reads the latest too
            flags = self._pending.popleft()
            reason, bad = flags.read()
            agreed = max(agreed, reason)
            steps.append((flags.step, bad))
        if agreed == 2 and self.received_at is None:  # another rank got the signal: time it from now
            self.received_at = time.monotonic()
        return {0: None, 1: "max-time", 2: "signal"}[agreed], steps

    def seconds_since(self) -> float:
        return time.monotonic() - self.received_at if self.received_at is not None else 0.0


class _Flags:
    """One step's flags on their way through an asynchronous all-reduce to a host buffer.

    With NCCL, `wait()` only orders the current stream after the all-reduce and the copy to pinned memory is
    queued behind it; `read()` then waits for an event recorded a step ago, long since passed. With gloo the
    all-reduce runs on its own thread and `read()` waits for it, on the host where the flags already are."""

    def __init__(self, step: int, reason: int, nonfinite: torch.Tensor, device: torch.device):
        self.step = step
        self.flags = torch.empty(2, dtype=torch.int32, device=device)
        self.flags[0] = reason
        self.flags[1] = nonfinite
        self.work = dist.all_reduce(self.flags, op=dist.ReduceOp.MAX, async_op=True)
        self.event: torch.cuda.Event | None = None
        if device.type == "cuda":
            self.work.wait()
            self.host = torch.empty(2, dtype=torch.int32, pin_memory=True)
            self.host.copy_(self.flags, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = self.flags

    def read(self) -> tuple[int, bool]:
        if self.event is not None:
            self.event.synchronize()
        else:
            self.work.wait()
        reason, bad = self.host.tolist()
        return reason, bool(bad)
