"""Token shards and the deterministic sample order that makes resume exact.

A split is its shard files (train_*.bin, val_*.bin), each memory-mapped and never copied: a process holds
the pages it reads, not the corpus. Each shard is cut into non-overlapping windows of seq_len + 1 tokens
(window i of a shard is tokens[i*seq_len : i*seq_len + seq_len + 1]); a window never crosses into the next
shard and each shard's ragged tail is dropped. The windows of all shards are numbered in shard order, so
a single-shard split has exactly the windows of its one token stream.

Each epoch visits the windows in a keyed pseudo-random permutation of their numbers: a Feistel network over
the next power of two, cycle-walked back into range, keyed by (seed, epoch). Only the positions a batch
needs are evaluated, so the order costs no memory however many windows there are. Each micro-batch consumes
the next `batch_size * world_size` positions of that order, and rank r takes its slice of them, so the data
position is a single number of windows that does not depend on the world size: a restart with another world
size carries on where it stopped.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from trainer.errors import DataError

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

ORDER = "feistel-1"  # the sample order's kind, saved with the data position
MIXTURE_ORDER = "mixture-1"  # a mixture's (trainer/mixture.py), which a run of one dataset cannot resume


def load_meta(tokenized_dir: Path) -> dict[str, Any]:
    meta_path = tokenized_dir / "meta.json"
    if not meta_path.is_file():
        raise DataError(f"{meta_path} does not exist: stage the dataset first")
    return json.loads(meta_path.read_text())


class TokenSplit:
    """One split's shards, memory-mapped, read as windows that stay inside one shard."""

    def __init__(self, shards: Sequence[np.ndarray], name: str = "train"):
        self.shards, self.name = list(shards), name
        self._offsets: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        """Tokens in all shards together."""
        return sum(len(s) for s in self.shards)

    def __getitem__(self, index: slice) -> np.ndarray:
        """Tokens [start, stop) of the shards read one after another; only that range is copied."""
        if not isinstance(index, slice) or index.step not in (None, 1):
            raise TypeError("a token split takes a contiguous slice, split[start:stop]")
        start, stop, _ = index.indices(len(self))
        parts, base = [], 0
        for shard in self.shards:
            lo, hi = max(start - base, 0), min(stop - base, len(shard))
            if lo < hi:
                parts.append(np.asarray(shard[lo:hi]))
            base += len(shard)
        return np.concatenate(parts) if parts else np.empty(0, dtype=self.shards[0].dtype)

    def window_offsets(self, seq_len: int) -> np.ndarray:
        """The number of the first window of each shard, then the total: one entry per shard, plus one."""
        if seq_len not in self._offsets:
            counts = [max(0, (len(s) - 1) // seq_len) for s in self.shards]
            self._offsets[seq_len] = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
        return self._offsets[seq_len]

    def num_windows(self, seq_len: int) -> int:
        return int(self.window_offsets(seq_len)[-1])

    def windows(self, ids: np.ndarray, seq_len: int, out: np.ndarray | None = None) -> np.ndarray:
        """The windows numbered `ids`, as rows of seq_len + 1 tokens (int64, or into `out`'s rows)."""
        offsets = self.window_offsets(seq_len)
        ids = np.asarray(ids, dtype=np.int64)
        if len(ids) and (ids.min() < 0 or ids.max() >= offsets[-1]):
            raise IndexError(f"window ids out of range: the {self.name} split has {offsets[-1]} windows of {seq_len}")
        shard = np.searchsorted(offsets, ids, side="right") - 1
        starts = (ids - offsets[shard]) * seq_len
        rows = np.empty((len(ids), seq_len + 1), dtype=np.int64) if out is None else out
        for row, (k, start) in enumerate(zip(shard.tolist(), starts.tolist(), strict=True)):
            rows[row] = self.shards[k][start : start + seq_len + 1]
        return rows


def load_split(tokenized_dir: Path, split: str) -> TokenSplit:
    """The shards of one split, memory-mapped (a large corpus costs page cache, not process memory)."""
    meta = load_meta(tokenized_dir)
    shards = [np.memmap(tokenized_dir / s["file"], dtype=meta["dtype"], mode="r") for s in meta["shards"][split]]
    if not shards:
        raise DataError(f"{tokenized_dir}: the {split} split has no shards")
    return TokenSplit(shards, split)


class WindowOrder:
    """A keyed pseudo-random permutation of range(size), evaluated at the positions asked for: O(1) memory.

    A Feistel network on the bits that cover size (the value split into a high and a low half; each round
    XORs one half with a keyed hash of the other, so each round, and the network, is a bijection of that
    power of two whatever the hash); a value that lands at or past size is encrypted again (cycle walking)
    until it falls in range, which keeps the map a bijection of range(size). The power of two is under
    2 * size, so a position takes two encryptions on average. The round keys come from a hash of (seed,
    epoch): the same order on every machine and numpy version.
    """

    ROUNDS = 6

    def __init__(self, size: int, seed: int | str, epoch: int):
        self.size = size
        bits = max(1, (size - 1).bit_length())
        self.low_bits = np.uint64(bits // 2)
        self.masks = (np.uint64((1 << (bits - bits // 2)) - 1), np.uint64((1 << (bits // 2)) - 1))  # high, low
        self.keys = [
            np.uint64(int.from_bytes(hashlib.blake2b(f"{ORDER}/{seed}/{epoch}/{r}".encode(), digest_size=8).digest()))
            for r in range(self.ROUNDS)
        ]

    @staticmethod
    def _hash(half: np.ndarray, key: np.uint64) -> np.ndarray:
        z = half ^ key  # the splitmix64 finaliser: every input bit reaches every output bit
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))

    def _encrypt(self, x: np.ndarray) -> np.ndarray:
        high, low = x >> self.low_bits, x & self.masks[1]
        for r, key in enumerate(self.keys):
            if r % 2 == 0:
                high ^= self._hash(low, key) & self.masks[0]
            else:
                low ^= self._hash(high, key) & self.masks[1]
        return (high << self.low_bits) | low

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        """The window ids at these positions of the order."""
        positions = np.asarray(positions, dtype=np.int64)
        if len(positions) and (positions.min() < 0 or positions.max() >= self.size):
            raise IndexError(f"positions out of range: the order has {self.size}")
        x = self._encrypt(positions.astype(np.uint64))
        outside = np.flatnonzero(x >= self.size)
        while len(outside):
            x[outside] = self._encrypt(x[outside])
            outside = outside[x[outside] >= self.size]
        return x.astype(np.int64)


@dataclass
class DataPosition:
    """Where the sample order stands: restored from a checkpoint, it replays nothing and skips nothing."""

    epoch: int = 0
    offset: int = 0  # windows of this epoch already consumed, by all ranks together

    def copy(self) -> DataPosition:
        return DataPosition(self.epoch, self.offset)

    def assign(self, other: DataPosition) -> None:
        self.epoch, self.offset = other.epoch, other.offset

    def where(self) -> str:
        return f"window {self.offset} of epoch {self.epoch}"

    def state_dict(self) -> dict[str, int | str]:
        return {"epoch": self.epoch, "offset": self.offset, "order": ORDER}

    def load_state_dict(self, state: dict[str, int | str]) -> None:
        order = state.get("order")
        if order == MIXTURE_ORDER:
            raise DataError(
                "this run trained on a data mixture: an exact resume keeps its data, so resume with its "
                "--mixture, or start a new run from its weights (--init-from)"
            )
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])
        if order is None:
            log.warning(
                "the checkpoint's data position (epoch %d, window %d) comes from an older sample order: the "
                "order from here on is %s, not the one the run started with, so some windows of this epoch "
                "may repeat or be skipped",
                self.epoch,
                self.offset,
                ORDER,
            )
        elif order != ORDER:
            raise DataError(f"the checkpoint's sample order {order!r} is unknown to this trainer (it knows {ORDER!r})")


class TokenBatches:
    """Yields this rank's (inputs, targets) for each global step, advancing a DataPosition."""

    def __init__(
        self, tokens: TokenSplit | np.ndarray, seq_len: int, batch_size: int, rank: int, world_size: int, seed: int
    ):
        self.tokens = tokens if isinstance(tokens, TokenSplit) else TokenSplit([tokens])
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.num_windows = self.tokens.num_windows(seq_len)
        self.global_batch = batch_size * world_size
        if self.num_windows < self.global_batch:
            raise DataError(
                f"the {self.tokens.name} split has {len(self.tokens)} tokens in {len(self.tokens.shards)} shard(s), "
                f"{self.num_windows} windows of {seq_len}: fewer than one global batch ({batch_size} x {world_size} "
                "ranks); use a larger corpus or smaller batch"
            )
        self.position = DataPosition()
        self.last_windows = np.empty(0, dtype=np.int64)  # the window ids of the latest batch, for auditing
        self._order = WindowOrder(self.num_windows, seed, 0)
        self._order_epoch = 0

    def epoch_order(self, epoch: int, start: int = 0, stop: int | None = None) -> np.ndarray:
        """The window ids at positions [start, stop) of this epoch's order (all of them by default)."""
        if epoch != self._order_epoch:
            self._order, self._order_epoch = WindowOrder(self.num_windows, self.seed, epoch), epoch
        return self._order(np.arange(start, self.num_windows if stop is None else stop))

    def take(self, pos: DataPosition) -> np.ndarray:
        """The window ids of this rank's micro-batch at `pos`, advancing `pos` past the global batch."""
        if pos.offset + self.global_batch > self.num_windows:  # drop the ragged tail of an epoch
            pos.epoch, pos.offset = pos.epoch + 1, 0
        start = pos.offset + self.rank * self.batch_size
        windows = self.epoch_order(pos.epoch, start, start + self.batch_size)
        pos.offset += self.global_batch
        return windows

    @property
    def train_tokens(self) -> int:
        return len(self.tokens)

    def read(self, windows: np.ndarray, out: np.ndarray) -> np.ndarray:
        """The tokens of the windows `take` chose, into `out` (batch_size x seq_len + 1)."""
        return self.tokens.windows(windows, self.seq_len, out=out)

    def sample_ids(self, windows: np.ndarray) -> list[str]:
        """For --log-samples: the window ids."""
        return [str(w) for w in windows.tolist()]

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's next (inputs, targets), read here and now (the trainer reads ahead: trainer/prefetch.py)."""
        import torch  # here alone: staging and the launcher read this module's metadata and need no torch (2 s)

        self.last_windows = self.take(self.position)
        rows_t = torch.from_numpy(self.tokens.windows(self.last_windows, self.seq_len))
        return rows_t[:, :-1], rows_t[:, 1:]
