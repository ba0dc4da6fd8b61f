"""Progress lines of staging's long work (training the tokenizer, encoding a group), so that a person watching a run
(run-local shows every components.stage_data line by default; the KFP UI shows the step's log) sees it move at least
every PROGRESS_EVERY_S, whatever the work is doing: a line comes from a thread of its own, so neither a 16 MB batch
being encoded nor the tokenizer trainer's merge phase (native code) holds it back."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import Any

log = logging.getLogger(__name__)

PROGRESS_EVERY_S = 15.0  # between lines: half of the 30 s a person waits before thinking the work is stuck
POLL_S = 1.0  # how often the thread looks at the clock


class Progress:
    """Logs `describe(elapsed seconds)` every `every_s` while the work inside `with` runs. `tick()` is the whole
    decision, with an injectable clock, so that the interval is tested without waiting."""

    def __init__(
        self,
        describe: Callable[[float], str],
        every_s: float = PROGRESS_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
        poll_s: float = POLL_S,
    ) -> None:
        self.describe, self.every_s, self.clock, self.poll_s = describe, every_s, clock, poll_s
        self.started = self.last = clock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def tick(self) -> str | None:
        """The progress line if one is due (and log it), else None."""
        now = self.clock()
        if now - self.last < self.every_s:
            return None
        self.last = now
        line = self.describe(now - self.started)
        log.info("%s", line)
        return line

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.tick()
            except Exception as exc:  # a progress line is never worth failing the staging for
                log.warning("progress line failed (%s): no more of them", exc)
                return

    def __enter__(self) -> Progress:
        self.started = self.last = self.clock()
        self._thread = threading.Thread(target=self._run, name="progress", daemon=True)
        self._thread.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


def eta(done: float, total: float, seconds: float) -> str:
    """Time left at the rate so far, in words a line can end with."""
    if done <= 0 or seconds <= 0:
        return "time left unknown yet"
    left = max(0.0, total - done) * seconds / done
    return f"about {left / 60:.0f} min left" if left >= 120 else f"about {left:.0f} s left"


class SampleProgress:
    """How far the tokenizer's training got: the text read into its sample, then (all read) its merges being found,
    which the trainer does in native code and does not report."""

    def __init__(self, limit_mb: int) -> None:
        self.limit_mb = limit_mb
        self.bytes = 0  # of text read into the sample so far
        self.read_all = False

    def counted(self, texts: Iterator[str]) -> Iterator[str]:
        """The sample's texts, counted as the trainer reads them."""
        for text in texts:
            self.bytes += len(text.encode())
            yield text
        self.read_all = True

    def line(self, elapsed: float) -> str:
        if self.read_all:
            return (
                f"training the tokenizer: its sample of {self.bytes / 1e6:,.1f} MB read, finding the merges "
                f"({elapsed:.0f} s so far)"
            )
        return (
            f"training the tokenizer: {self.bytes / 1e6:,.1f} MB of text read into its sample (up to "
            f"{self.limit_mb:,} MB), {elapsed:.0f} s so far"
        )


class GroupProgress:
    """How far a group's encode got. The encoder reads ahead of what it has written (up to two batches of 16 MB of
    text), so the bytes read of the group's files (the file being read, whose reader counts its own) are scaled by the
    share of the text read that is written: the line's MB, rate and time left are of what is encoded, as its files
    done and tokens are (`written`: the group's writer, with files_done, text_written and tokens_written()). Set by
    the encoder's thread, read by the progress thread: plain attributes, so a line may be a moment behind."""

    def __init__(self, name: str, sizes: list[int], first: int, written: Any) -> None:
        self.name, self.sizes, self.first, self.written = name, sizes, first, written
        self.total = sum(sizes[first:])  # this attempt's: a resumed group carries on after its last finished file
        self.current: tuple[int, Any] = (first, None)  # (file index, its reader), set as one
        self.text_read = 0  # characters of the documents read

    def reading(self, index: int, reader: Any) -> None:
        self.current = (index, reader)

    def line(self, elapsed: float) -> str:
        index, reader = self.current
        read = sum(self.sizes[self.first : index])
        if reader is not None and index < len(self.sizes):
            read += min(getattr(reader, "bytes_read", 0), self.sizes[index])
        text_read = self.text_read
        done = read * min(1.0, self.written.text_written / text_read) if text_read else read
        files, rate = len(self.sizes) - self.first, done / max(elapsed, 1e-9)
        return (
            f"encoding {self.name}: {self.written.files_done} of {files} files done, {done / 1e6:,.1f} of "
            f"{self.total / 1e6:,.1f} MB, {rate / 1e6:,.1f} MB/s, {eta(done, self.total, elapsed)}; "
            f"{self.written.tokens_written():,} tokens written"
        )
