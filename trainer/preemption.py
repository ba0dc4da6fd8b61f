"""Preemption: catch SIGTERM/SIGINT on every rank and stop all ranks at the same step boundary.

On HyperPod a sick node is cordoned and its pod gets SIGTERM; under torchrun the agent forwards it to
every worker, then SIGKILLs them after its shutdown timeout (30 s unless TORCH_ELASTIC_SHUTDOWN_TIMEOUT
or --shutdown-timeout says otherwise), whatever the pod's grace period. The handler only records the
signal; at each step boundary the ranks agree (an all_reduce MAX of the flag), so a signal that reached
one rank stops all of them after the same step, and rank 0 commits a checkpoint of exactly that step.
"""

from __future__ import annotations

import enum
import logging
import os
import signal
import time

import torch
import torch.distributed as dist

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


class StopSignal:
    """Records SIGTERM/SIGINT; `should_stop()` tells every rank, collectively, whether any rank got one."""

    def __init__(self, device: torch.device):
        self.signal: signal.Signals | None = None
        self.received_at: float | None = None  # time.monotonic() of the first signal
        self._flag = torch.zeros(2, dtype=torch.int32, device=device)  # the stop reason, a non-finite step
        # Kept until the process exits: torchrun's own SIGTERM to the last workers, when the first of them
        # has exited, must not kill one that is still tearing down after its checkpoint.
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._record)

    def _record(self, signum: int, _frame: object) -> None:
        if self.signal is None:
            self.signal, self.received_at = signal.Signals(signum), time.monotonic()
            log.warning("received %s: stopping at the end of this step to checkpoint", self.signal.name)

    def should_stop(self, time_up: bool = False, nonfinite: torch.Tensor | None = None) -> tuple[str | None, bool]:
        """Collective, at every step boundary on every rank: "signal", "max-time" or None, the same everywhere; and
        whether the step's `nonfinite` flag (a device tensor, trainer/health.py) was set on any rank.

        Any rank's signal stops all of them; so does any rank's clock passing --max-time. The flag rides along in
        the same all-reduce, so reading it costs no synchronisation of its own.
        """
        self._flag[0] = 2 if self.signal else 1 if time_up else 0
        self._flag[1] = 0 if nonfinite is None else nonfinite.to(torch.int32)
        dist.all_reduce(self._flag, op=dist.ReduceOp.MAX)
        agreed, bad = self._flag.tolist()
        if agreed == 2 and self.received_at is None:  # another rank got the signal: time it from now
            self.received_at = time.monotonic()
        return {0: None, 1: "max-time", 2: "signal"}[agreed], bool(bad)

    def seconds_since(self) -> float:
        return time.monotonic() - self.received_at if self.received_at is not None else 0.0
