"""The data a run trains on, read once at start: its dataset snapshot (or a mixture's), this rank's training batches
and --eval-every's val data; and what config.json records of them.

A resumed run reads the snapshot(s) its checkpoint trained on (trainer/snapshot.py). The datasets of a mixture
(trainer/mixture.py) share one tokenizer, so the first stands for all where one is asked for (the tokenizer, the
model's vocabulary).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainer.data import TokenBatches, TokenSplit, load_meta, load_split
from trainer.errors import DataError
from trainer.evaluation import TokenBytes, token_bytes
from trainer.layout import TOKENIZER
from trainer.mixture import MixtureBatches, MixtureEntry, resolve_mixture, shares
from trainer.snapshot import model_vocab, snapshot_record, training_snapshot

if TYPE_CHECKING:
    from trainer.config import TrainConfig


@dataclass
class RunData:
    directory: Path  # the snapshot (of a mixture: its first dataset's)
    meta: dict[str, Any]  # its meta.json
    mixture: list[MixtureEntry]  # a mixture's datasets; empty for one dataset
    batches: TokenBatches | MixtureBatches
    val: dict[str, TokenSplit] | None = None  # with --eval-every: each dataset's val split
    text_bytes: TokenBytes | None = None  # and the bytes of text the tokens stand for

    @classmethod
    def read(cls, cfg: TrainConfig, state: dict[str, Any] | None, rank: int, world: int) -> RunData:
        """The run's data; `state`, a resumed run's checkpoint state (None for a new run), names its snapshots."""
        mixture = resolve_mixture(cfg.mixture, state, cfg.on_new_snapshot) if cfg.mixture else []
        if mixture:
            directory = mixture[0].directory
        else:
            directory = training_snapshot(Path(cfg.data_dir), state, cfg.on_new_snapshot)
        meta = load_meta(directory)
        batches: TokenBatches | MixtureBatches
        if mixture:
            splits = [load_split(e.directory, "train") for e in mixture]
            batches = MixtureBatches(
                [e.name for e in mixture],
                splits,
                [e.weight for e in mixture],
                cfg.seq_len,
                cfg.batch_size,
                rank,
                world,
                cfg.seed,
            )
        else:
            batches = TokenBatches(load_split(directory, "train"), cfg.seq_len, cfg.batch_size, rank, world, cfg.seed)
        data = cls(directory, meta, mixture, batches)
        if cfg.eval_every:  # each dataset's val split (one, or a mixture's)
            val_dirs = {e.name: e.directory for e in mixture} or {
                snapshot_record(directory, meta)["dataset"]: directory
            }
            data.val, data.text_bytes = validation_data(val_dirs, meta, cfg.seq_len)
        return data

    def weights(self) -> dict[str, float]:
        """A mixture's weights by dataset, which weigh its datasets' val losses in the total; {} for one dataset."""
        return {e.name: e.weight for e in self.mixture}

    def record(self) -> dict[str, Any]:
        """config.json's dataset: the snapshot, the tokenizer's vocabulary and the model's (padded); of a mixture,
        each dataset's snapshot, weight and share (what the evaluation and the summary read)."""
        meta = self.meta
        dataset = {
            **snapshot_record(self.directory, meta),
            "tokenized_dir": str(self.directory),
            "vocab_size": meta["vocab_size"],
            "model_vocab_size": model_vocab(meta),
        }
        if self.mixture:
            batches = self.batches
            dataset["mixture"] = [
                {
                    **snapshot_record(e.directory, meta),
                    "tokenized_dir": str(e.directory),
                    "weight": e.weight,
                    "share": round(share, 6),
                    "train_tokens": len(split),
                }
                for e, share, split in zip(self.mixture, shares(batches.weights), batches.splits, strict=True)
            ]
        return dataset


def validation_data(
    snapshots: dict[str, Path], meta: dict[str, Any], seq_len: int
) -> tuple[dict[str, TokenSplit], TokenBytes]:
    """--eval-every's data, read once: each dataset's val split (memory-mapped; one, or a mixture's), and the bytes
    of text the tokens stand for (bits per byte; a mixture's datasets share their tokenizer). A split without one
    window is bad input at start, not a crash at the first evaluation."""
    splits = {}
    for name, data_dir in snapshots.items():
        splits[name] = val = load_split(data_dir, "val")
        if val.num_windows(seq_len) == 0:
            raise DataError(
                f"--eval-every: the val split of {data_dir} has no window of {seq_len + 1} tokens in one "
                f"shard ({len(val)} tokens in {len(val.shards)} shard(s)): evaluate with a shorter "
                "--seq-len, or turn it off (0)"
            )
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(next(iter(snapshots.values())) / TOKENIZER))
    return splits, token_bytes(tokenizer, meta)
