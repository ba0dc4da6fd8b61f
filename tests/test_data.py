"""The shard reader, the keyed sample order, and a multi-shard dataset staged, trained and evaluated for real."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from components.evaluate_checkpoint.core import evaluate_checkpoint
from components.launch_training.core import launch
from components.stage_data.core import stage_data
from tests.helpers import snapshot_dir, tiny_launch, write_corpus
from trainer.checkpoint import read_checkpoint
from trainer.data import ORDER, DataPosition, TokenBatches, TokenSplit, WindowOrder, load_split
from trainer.errors import DataError
from trainer.layout import META, RunPaths


def shards_of(sizes: list[int]) -> list[np.ndarray]:
    """Shards whose tokens number their place in the whole stream, so a window shows where it was read."""
    bounds = np.cumsum([0, *sizes])
    return [np.arange(lo, hi, dtype=np.uint32) for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)]


def test_windows_of_several_shards_stay_inside_their_shard() -> None:
    seq_len, sizes = 8, [50, 9, 8, 33, 17]  # windows per shard: 6, 1, 0 (too short), 4, 2
    split = TokenSplit(shards_of(sizes))
    assert split.window_offsets(seq_len).tolist() == [0, 6, 7, 7, 11, 13]
    rows = split.windows(np.arange(split.num_windows(seq_len)), seq_len)
    bounds = np.cumsum([0, *sizes])
    expected = [
        np.arange(lo + i * seq_len, lo + i * seq_len + seq_len + 1)
        for lo, n in zip(bounds[:-1], sizes, strict=True)
        for i in range((n - 1) // seq_len)
    ]
    assert rows.dtype == np.int64 and rows.tolist() == [e.tolist() for e in expected]
    for row in rows:  # consecutive tokens: no window runs from one shard into the next
        assert np.all(np.diff(row) == 1) and np.searchsorted(bounds, row[0], "right") == np.searchsorted(
            bounds, row[-1], "right"
        )
    assert split.windows(np.array([12, 0, 6]), seq_len).tolist() == [
        expected[12].tolist(),
        expected[0].tolist(),
        expected[6].tolist(),
    ]
    with pytest.raises(IndexError):
        split.windows(np.array([13]), seq_len)
    assert len(split) == sum(sizes) and split[45:60].tolist() == list(range(45, 60))  # a range across shards


def test_single_shard_windows_are_the_token_stream_as_before() -> None:
    tokens = np.random.default_rng(0).integers(0, 2**16, size=1000, dtype=np.uint16)
    split, seq_len = TokenSplit([tokens]), 64
    assert split.num_windows(seq_len) == (len(tokens) - 1) // seq_len
    for i in range(split.num_windows(seq_len)):
        expected = tokens[i * seq_len : i * seq_len + seq_len + 1]
        assert split.windows(np.array([i]), seq_len)[0].tolist() == expected.tolist()


def test_load_split_reads_the_staged_shards_and_names_a_missing_split(tmp_path: Path) -> None:
    sizes = [40, 25, 30]
    for i, shard in enumerate(shards_of(sizes)):
        shard.astype(np.uint16).tofile(tmp_path / f"train_{i:04d}.bin")
    meta = {
        "dtype": "uint16",
        "shards": {"train": [{"file": f"train_{i:04d}.bin", "tokens": n} for i, n in enumerate(sizes)], "val": []},
    }
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    split = load_split(tmp_path, "train")
    assert all(isinstance(s, np.memmap) for s in split.shards)  # mapped, not read into memory
    assert split.num_windows(8) == 4 + 3 + 3 and split[:].tolist() == list(range(95))
    with pytest.raises(DataError, match="the val split has no shards"):
        load_split(tmp_path, "val")


@pytest.mark.parametrize("size", [1, 2, 7, 1000, 2**16 + 3])
def test_the_order_is_a_permutation(size: int) -> None:
    order = WindowOrder(size, seed=1234, epoch=0)
    assert np.array_equal(np.sort(order(np.arange(size))), np.arange(size))
    assert np.array_equal(order(np.arange(size))[size // 3 : size // 2], order(np.arange(size // 3, size // 2)))


def test_the_order_changes_with_epoch_and_seed_and_only_with_them() -> None:
    positions = np.arange(1000)
    base = WindowOrder(1000, seed=1, epoch=0)(positions)
    assert np.array_equal(base, WindowOrder(1000, seed=1, epoch=0)(positions))
    for other in (WindowOrder(1000, seed=1, epoch=1), WindowOrder(1000, seed=2, epoch=0)):
        assert np.mean(other(positions) == base) < 0.05
    assert not np.array_equal(base, positions)  # shuffled at all
    assert abs(np.corrcoef(positions, base)[0, 1]) < 0.1  # no trace of the identity


def test_batches_of_world_sizes_1_and_2_are_the_same_windows_in_the_same_order() -> None:
    split = TokenSplit(shards_of([300, 170, 41, 260]))
    one = TokenBatches(split, seq_len=16, batch_size=8, rank=0, world_size=1, seed=3)
    two = [TokenBatches(split, seq_len=16, batch_size=4, rank=r, world_size=2, seed=3) for r in (0, 1)]
    assert one.num_windows == 18 + 10 + 2 + 16
    seen = []
    for _ in range(12):  # two epochs and more: 46 windows give 5 global batches of 8 an epoch
        x1, y1 = one.next_batch()
        halves = [b.next_batch() for b in two]
        assert torch.equal(x1, torch.cat([h[0] for h in halves])) and torch.equal(y1, torch.cat([h[1] for h in halves]))
        assert one.last_windows.tolist() == two[0].last_windows.tolist() + two[1].last_windows.tolist()
        assert torch.equal(x1[:, 1:], y1[:, :-1])
        seen.append(one.last_windows)
        assert one.position == two[0].position == two[1].position
    first_epoch = np.concatenate(seen[:5])
    assert len(set(first_epoch.tolist())) == 40 and one.position == DataPosition(epoch=2, offset=16)
    assert first_epoch.tolist() == one.epoch_order(0)[:40].tolist()
    assert not np.array_equal(np.concatenate(seen[5:10]), first_epoch)  # epoch 1 is another order


def test_a_position_from_before_the_keyed_order_loads_with_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    position = DataPosition()
    with caplog.at_level(logging.WARNING, logger="trainer.data"):
        position.load_state_dict({"epoch": 2, "offset": 96})  # a checkpoint written before the order was recorded
    assert position == DataPosition(epoch=2, offset=96)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "may repeat or be skipped" in warnings[0]
    caplog.clear()
    restored = DataPosition()
    restored.load_state_dict(DataPosition(epoch=1, offset=8).state_dict())
    assert restored == DataPosition(epoch=1, offset=8) and not caplog.records
    assert DataPosition().state_dict()["order"] == ORDER
    with pytest.raises(DataError, match="sample order 'feistel-9' is unknown"):
        DataPosition().load_state_dict({"epoch": 0, "offset": 0, "order": "feistel-9"})


def test_a_multi_shard_dataset_stages_trains_under_torchrun_and_evaluates(tmp_path: Path) -> None:
    """Shards far smaller than the default, set at staging: the train split has several, and everything runs."""
    root = tmp_path / "fsx"
    corpus = write_corpus(tmp_path / "corpus", sentences=400)
    stage_data(str(corpus), str(root), "synthetic", vocab_size=512, val_fraction=0.25, shard_tokens=2048)
    snapshot = snapshot_dir(root, "synthetic")
    meta = json.loads((snapshot / META).read_text())
    assert len(meta["shards"]["train"]) >= 4 and len(meta["shards"]["val"]) >= 2, meta["shards"]
    train = load_split(snapshot, "train")
    assert train.num_windows(64) < (len(train) - 1) // 64  # the shards' tails are dropped, not joined

    launch(tiny_launch(root, "sharded", max_steps=20, checkpoint_every=10, log_every=5, nproc_per_node=1))
    run = RunPaths.of(root, "sharded")
    checkpoint = read_checkpoint(run.latest_checkpoint)
    assert checkpoint["step"] == 20 and checkpoint["data"] == {"epoch": 0, "offset": 20 * 8, "order": ORDER}
    rows = [json.loads(line) for line in run.metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == [5, 10, 15, 20] and rows[-1]["loss"] < rows[0]["loss"]

    result = evaluate_checkpoint(str(root), "synthetic", "sharded", max_tokens=2**20, export=False)
    val = load_split(snapshot, "val")
    assert val.window_offsets(64)[1] < val.num_windows(64)  # the evaluation read past the first shard
    assert result.step == 20 and result.val_tokens == val.num_windows(64) * 64
    assert result.val_loss < result.untrained_val_loss
