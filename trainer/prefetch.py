"""The next batches, read in a background thread while the device computes: input off the critical path.

A producer thread walks the sample order from the data position the run resumed at and reads each micro-batch's
windows into an int32 host buffer (pinned on GPU), at most `depth` micro-batches ahead. The training loop takes
them in order: one host-to-device copy per micro-batch, asynchronous from pinned memory, and inputs and targets
cut from it on the device. The run's DataPosition advances only as batches are taken, so a checkpoint records
the consumed position and a resume repeats and skips nothing, whatever the producer had read ahead.

Memory-mapped reads release the GIL while they copy (and while they fault pages in from a cold file system), so
the producer runs beside the training thread's kernel launches.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch

from trainer.data import DataPosition, TokenBatches
from trainer.mixture import MixtureBatches, MixturePosition

log = logging.getLogger(__name__)


@dataclass
class _Batch:
    rows: torch.Tensor  # int32 [batch_size, seq_len + 1], on the host
    windows: np.ndarray  # the window ids (of a mixture: dataset index and window id), for --log-samples
    position: DataPosition | MixturePosition  # the data position after this batch


class Prefetcher:
    """Reads this rank's micro-batches ahead of the loop; `next()` hands them over on the device."""

    def __init__(
        self, batches: TokenBatches | MixtureBatches, device: torch.device, depth: int = 2, read_latency_s: float = 0.0
    ):
        self.batches, self.device = batches, device
        self.read_latency_s = read_latency_s  # fault injection: a cold file system (--fault-read-latency-s)
        self.waited_s = 0.0  # time the loop waited for input, since the last `take_waited()`
        self._pin = device.type == "cuda"
        self._queue: queue.Queue[_Batch | BaseException] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._produce, args=(batches.position.copy(),), name="prefetch", daemon=True
        )
        self._thread.start()

    def _produce(self, position: DataPosition | MixturePosition) -> None:
        b = self.batches
        try:
            while not self._stop.is_set():
                windows = b.take(position)
                if self.read_latency_s:
                    time.sleep(self.read_latency_s)
                rows = torch.empty((b.batch_size, b.seq_len + 1), dtype=torch.int32, pin_memory=self._pin)
                b.read(windows, rows.numpy())
                self._put(_Batch(rows, windows, position.copy()))
        except BaseException as exc:  # handed to the loop, which raises it where the batch was wanted
            self._put(exc)

    def _put(self, item: _Batch | BaseException) -> None:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's next (inputs, targets) on the device (int64), and the run's data position past them."""
        started = time.perf_counter()
        item = self._queue.get()
        self.waited_s += time.perf_counter() - started
        if isinstance(item, BaseException):
            raise item
        self.batches.position.assign(item.position)
        self.batches.last_windows = item.windows
        rows = item.rows.to(self.device, non_blocking=True).long()
        return rows[:, :-1], rows[:, 1:]

    def take_waited(self) -> float:
        """Seconds the loop waited for input since the last call."""
        waited, self.waited_s = self.waited_s, 0.0
        return waited

    def close(self) -> None:
        """Stop the producer (at SIGTERM, or at the end): it exits within its next put."""
        self._stop.set()
        self._thread.join(timeout=10)
