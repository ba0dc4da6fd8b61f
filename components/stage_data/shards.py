"""Token shards: flat files of token ids (uint16, or uint32 past 65,536 tokens) that the trainer memory-maps, written
by appending, synced before a journal says they hold what was written, and cut back to a journal's position when a
killed encode starts again."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from components.stage_data import SHARD_TOKENS


class ShardWriter:
    """Appends token ids to <prefix>_NNNN.bin files of at most `shard_tokens` tokens each."""

    def __init__(self, directory: Path, split: str, dtype: np.dtype, shard_tokens: int = SHARD_TOKENS):
        self.directory, self.split, self.dtype, self.shard_tokens = directory, split, dtype, shard_tokens
        self.shards: list[dict[str, Any]] = []
        self._file: Any = None

    @property
    def written(self) -> int:
        """Tokens in this split's shards so far."""
        return sum(s["tokens"] for s in self.shards)

    def position(self) -> list[int]:
        """[shards, tokens in the last]: with every earlier shard full, enough to cut the files back to this point."""
        return [len(self.shards), self.shards[-1]["tokens"] if self.shards else 0]

    def resume(self, position: list[int]) -> None:
        """Cut the shard files back to `position` (what the journal recorded), dropping what came after it."""
        count, last_tokens = position
        self.shards = [{"file": self._name(i), "tokens": self.shard_tokens} for i in range(count)]
        for stale in self.directory.glob(f"{self.split}_*.bin"):
            if stale.name not in {s["file"] for s in self.shards}:
                stale.unlink()
        if count:
            self.shards[-1]["tokens"] = last_tokens
            self._file = open(self.directory / self.shards[-1]["file"], "r+b")
            self._file.truncate(last_tokens * self.dtype.itemsize)
            self._file.seek(0, os.SEEK_END)

    def sync(self) -> None:
        """Make what was written durable, before a journal says it was."""
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())

    def _name(self, index: int) -> str:
        return f"{self.split}_{index:04d}.bin"

    def write(self, ids: np.ndarray) -> None:
        ids = ids.astype(self.dtype, copy=False)
        while len(ids):
            if self._file is None or self.shards[-1]["tokens"] == self.shard_tokens:
                self._next_shard()
            room = self.shard_tokens - self.shards[-1]["tokens"]
            self._file.write(ids[:room].tobytes())
            self.shards[-1]["tokens"] += min(room, len(ids))
            ids = ids[room:]

    def _next_shard(self) -> None:
        self._close_file()
        name = self._name(len(self.shards))
        self._file = open(self.directory / name, "wb")
        self.shards.append({"file": name, "tokens": 0})

    def _close_file(self) -> None:
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            self._file = None

    def close(self) -> int:
        self._close_file()
        return self.written
