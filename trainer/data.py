"""Token shards and the deterministic sample order that makes resume exact.

The train split is one stream of tokens (the train_*.bin shards, concatenated). It is cut into
non-overlapping windows of seq_len + 1 tokens. Each epoch visits the windows in a permutation that
depends only on (seed, epoch). Each micro-batch consumes the next `batch_size * world_size` windows of
that order, and rank r takes its slice of them, so the data position is a single number of windows
that does not depend on the world size: a restart with another world size carries on where it stopped.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch


class DataError(Exception):
    """The dataset cannot feed this run (missing, empty, or too small for one global batch)."""


def load_meta(tokenized_dir: Path) -> dict[str, Any]:
    meta_path = tokenized_dir / "meta.json"
    if not meta_path.is_file():
        raise DataError(f"{meta_path} does not exist: stage the dataset first")
    return json.loads(meta_path.read_text())


def load_split(tokenized_dir: Path, split: str) -> np.ndarray:
    """All shards of one split as one token array (memory-mapped, so large corpora cost no RAM)."""
    meta = load_meta(tokenized_dir)
    shards = [np.memmap(tokenized_dir / s["file"], dtype=meta["dtype"], mode="r") for s in meta["shards"][split]]
    if not shards:
        raise DataError(f"{tokenized_dir}: the {split} split has no shards")
    return shards[0] if len(shards) == 1 else np.concatenate(shards)


@dataclass
class DataPosition:
    """Where the sample order stands: restored from a checkpoint, it replays nothing and skips nothing."""

    epoch: int = 0
    offset: int = 0  # windows of this epoch already consumed, by all ranks together

    def state_dict(self) -> dict[str, int]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])


class TokenBatches:
    """Yields this rank's (inputs, targets) for each global step, advancing a DataPosition."""

    def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int, rank: int, world_size: int, seed: int):
        self.tokens = tokens
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.num_windows = (len(tokens) - 1) // seq_len
        self.global_batch = batch_size * world_size
        if self.num_windows < self.global_batch:
            raise DataError(
                f"the train split has {len(tokens)} tokens, {self.num_windows} windows of {seq_len}: fewer than "
                f"one global batch ({batch_size} x {world_size} ranks); use a larger corpus or smaller batch"
            )
        self.position = DataPosition()
        self.last_windows = np.empty(0, dtype=np.int64)  # the window ids of the latest batch, for auditing
        self._order_epoch = -1
        self._order = np.empty(0, dtype=np.int64)

    def epoch_order(self, epoch: int) -> np.ndarray:
        if epoch != self._order_epoch:
            self._order = np.random.default_rng([self.seed, epoch]).permutation(self.num_windows)
            self._order_epoch = epoch
        return self._order

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        pos = self.position
        if pos.offset + self.global_batch > self.num_windows:  # drop the ragged tail of an epoch
            pos.epoch, pos.offset = pos.epoch + 1, 0
        start = pos.offset + self.rank * self.batch_size
        windows = self.epoch_order(pos.epoch)[start : start + self.batch_size]
        pos.offset += self.global_batch
        self.last_windows = windows
        rows = np.stack([self.tokens[w * self.seq_len : w * self.seq_len + self.seq_len + 1] for w in windows])
        rows_t = torch.from_numpy(rows.astype(np.int64))
        return rows_t[:, :-1], rows_t[:, 1:]
