"""Training health: a diverged run stops instead of stepping on, and a silent rank is named instead of waited for.

Divergence. A step whose gradient norm is not finite (a NaN or inf anywhere in any rank's loss or gradients reaches
every rank through DDP's all-reduce, so every rank sees the same norm) skips its optimizer update, so the weights
stay finite and every checkpoint stays good. Past `max_nonfinite_steps` such steps in a row the run stops as
diverged. The skip happens on the device (the fused AdamW kernel's found_inf input, the protocol
torch.amp.GradScaler uses, honoured by the CPU kernel too) and the flag reaches the host a step later, in the
all-reduce the trainer already makes at every step boundary (trainer/preemption.py): no host synchronisation of its
own. The streak and the spike window are saved in every checkpoint. Loss spikes, a logged loss above
`spike_factor` times the median of the recent logged losses, are logged and marked in the metrics.

Hangs. A rank that stops answering (a stopped process, a lost node) leaves the others in a collective until the
process group's timeout. Each rank bumps a counter in the rendezvous store every few seconds from a thread; a
rank whose collective failed reads the counters twice, and the ranks whose counters did not move are the silent
ones, named in the error.

Failures. A rank that raises (an out-of-memory, a failed checkpoint commit or staging copy, a read error) would
leave the others in their next collective for the whole timeout (600 s by default; on other nodes torchrun's agent
does not end them). It writes its rank and error into the store first (`announce_failure`); the same thread that
beats watches for that key every second and, after a short grace for this rank to end by itself, ends its process
too, naming the failed rank and its error.
"""

from __future__ import annotations

import json
import logging
import math
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


@dataclass
class Divergence:
    """Counts consecutive non-finite steps; says when the run has diverged."""

    limit: int  # consecutive non-finite steps tolerated; the next one stops the run
    streak: int = 0
    first_bad_step: int | None = None  # the first step of the current streak
    skipped: int = 0  # non-finite steps in this process's run, in all

    def record(self, step: int, finite: bool) -> bool:
        """After each step: whether the run has now diverged."""
        if finite:
            self.streak, self.first_bad_step = 0, None
            return False
        self.skipped += 1
        self.streak += 1
        if self.first_bad_step is None:
            self.first_bad_step = step
            log.warning("step %d: the loss or gradient norm is not finite; its update was skipped", step)
        return self.streak > self.limit

    def state_dict(self) -> dict[str, int | None]:
        """Saved in every checkpoint: a run resumed mid-streak counts on from where it was."""
        return {"streak": self.streak, "first_bad_step": self.first_bad_step, "skipped": self.skipped}

    def load_state_dict(self, state: dict[str, int | None]) -> None:
        self.streak, self.first_bad_step, self.skipped = state["streak"], state["first_bad_step"], state["skipped"]

    def reason(self) -> str:
        """The one line a diverged run ends with (status.json's error; the launcher's failure message)."""
        return (
            f"diverged at step {self.first_bad_step}: the loss or gradient norm was not finite for {self.streak} "
            f"steps in a row (--max-nonfinite-steps {self.limit}); the last checkpoint is the last good one; "
            "lower the learning rate or check the data, then resume"
        )


@dataclass
class SpikeWatch:
    """A logged loss above `factor` times the median of the last `window` logged losses is a spike."""

    factor: float  # 0: off
    window: int = 20
    recent: deque[float] = field(default_factory=lambda: deque(maxlen=20))

    def is_spike(self, step: int, loss: float) -> bool:
        if not math.isfinite(loss):  # Divergence's business; it would poison the median
            return False
        spike = bool(self.factor and len(self.recent) >= 5 and loss > self.factor * statistics.median(self.recent))
        if spike:
            log.warning(
                "loss spike at step %d: %.4f, above %.1f x the median %.4f of the last %d logged losses",
                step,
                loss,
                self.factor,
                statistics.median(self.recent),
                len(self.recent),
            )
        self.recent.append(loss)
        return spike

    def state_dict(self) -> dict[str, list[float]]:
        """Saved in every checkpoint: a resumed run judges spikes against the same recent losses."""
        return {"recent": list(self.recent)}

    def load_state_dict(self, state: dict[str, list[float]]) -> None:
        self.recent.clear()
        self.recent.extend(state["recent"])


def collective_failed(exc: BaseException) -> bool:
    """Whether `exc` is a collective's failure (worth asking which ranks went silent) rather than this rank's own
    error (an out-of-memory, a shape mismatch), which is reported at once. NCCL's failures are DistBackendError;
    gloo's are RuntimeErrors that name their source file in gloo (`[.../gloo/transport/tcp/...] Timed out ...`)."""
    return isinstance(exc, dist.DistError) or (
        isinstance(exc, RuntimeError) and not isinstance(exc, torch.OutOfMemoryError) and "/gloo/" in str(exc)
    )


FAILED_KEY = "hyperpod-pretrain/failed"  # in the rendezvous store: the first failing rank and its error, as JSON


def announce_failure(store: dist.Store, rank: int, error: str) -> None:
    """Tell the other ranks that this one is failing (the first rank to tell is the one named); never raises: the
    store may be gone already."""
    try:
        store.compare_set(FAILED_KEY, "", json.dumps({"rank": rank, "error": error}))
    except Exception as exc:  # noqa: BLE001 - the failure being reported matters more than this one
        log.warning("could not tell the other ranks of this rank's failure: %s", exc)


class Heartbeat:
    """Each rank's counter in the rendezvous store, bumped from a daemon thread while the process runs; the same
    thread watches for another rank's failure (`announce_failure`).

    The store lives in torchrun's agent (or rank 0's process), not in the worker being watched, so it answers
    about a rank that has stopped. The same thread names the silent ranks itself when no step has completed for
    most of the collective timeout: on GPUs NCCL's watchdog ends the process at the timeout, before any Python
    handler could (TORCH_NCCL_ASYNC_ERROR_HANDLING's default)."""

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        world: int,
        timeout_s: float,
        on_silent: Callable[[list[int], int], None] | None = None,
        on_peer_failure: Callable[[int, str], None] | None = None,
        failure_grace_s: float = 5.0,
    ):
        self.store, self.rank, self.world = store, rank, world
        self.on_silent = on_silent  # told (silent ranks, last step) when the thread names them
        self.on_peer_failure = on_peer_failure  # told (failed rank, its error) once its grace has passed
        self.interval_s = min(10.0, timeout_s / 10)  # a silent rank is told apart within 3 beats
        self.watch_s, self.failure_grace_s = min(1.0, self.interval_s), failure_grace_s
        self.report_after_s = 0.8 * timeout_s
        self.step, self._stepped_at, self._reported = 0, time.monotonic(), False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="heartbeat", daemon=True)
        self._thread.start()

    def stepped(self, step: int) -> None:
        """The training loop completed `step` (a plain assignment: nothing to wait for)."""
        self.step, self._stepped_at, self._reported = step, time.monotonic(), False

    def _beat(self) -> None:
        beaten = 0.0
        while not self._stop.wait(self.watch_s):
            try:
                if self.on_peer_failure is not None and (failed := self.peer_failure()):
                    log.error("rank %d failed: %s", *failed)
                    if not self._stop.wait(self.failure_grace_s):  # this rank may be ending by itself
                        self.on_peer_failure(*failed)
                    return
                if time.monotonic() - beaten >= self.interval_s:
                    beaten = time.monotonic()
                    self.store.add(self._key(self.rank), 1)
                if not self._reported and time.monotonic() - self._stepped_at > self.report_after_s:
                    self._reported = True
                    self._report_stuck()
            except Exception:  # the store is gone (the job is ending): nothing left to tell
                return

    def peer_failure(self) -> tuple[int, str] | None:
        """The rank that announced its failure, and its error, unless none did or it was this one."""
        if not self.store.check([FAILED_KEY]):
            return None
        failed = json.loads(self.store.get(FAILED_KEY))
        return None if failed["rank"] == self.rank else (failed["rank"], failed["error"])

    def _report_stuck(self) -> None:
        waited = time.monotonic() - self._stepped_at
        if silent := self.silent_ranks():
            log.error(
                "no step completed for %.0fs after step %d: rank(s) %s stopped answering (a stopped or hung "
                "process, or a lost node)",
                waited,
                self.step,
                ", ".join(map(str, silent)),
            )
            if self.on_silent is not None:
                self.on_silent(silent, self.step)
        else:
            log.warning(
                "no step completed for %.0fs after step %d, and every rank still answers: a slow step, or "
                "a collective stuck in the network",
                waited,
                self.step,
            )

    def _key(self, rank: int) -> str:
        return f"heartbeat/{rank}"

    def silent_ranks(self) -> list[int]:
        """The ranks whose counters did not move over three beats (this rank's own always does)."""
        keys = [self._key(r) for r in range(self.world)]
        before = [self.store.add(key, 0) for key in keys]
        for _ in range(3):  # beating meanwhile: another rank may be asking the same about this one
            time.sleep(self.interval_s)
            self.store.add(self._key(self.rank), 1)
        after = [self.store.add(key, 0) for key in keys]
        return [r for r in range(self.world) if r != self.rank and after[r] == before[r]]

    def stop(self) -> None:
        self._stop.set()
