"""The trainer under a real torchrun with 2 processes (gloo, CPU), through the local launcher."""

import json
import shutil
from pathlib import Path

import numpy as np
import torch

from components.launch_pytorchjob.core import launch
from tests.helpers import tiny_launch
from trainer.checkpoint import load_checkpoint
from trainer.data import TokenBatches
from trainer.layout import RunPaths


def read_metrics(run: RunPaths) -> list[dict]:
    return [json.loads(line) for line in run.metrics.read_text().splitlines()]


def test_trains_logs_and_checkpoints(trained_root: Path) -> None:
    run = RunPaths.of(trained_root, "run-1")
    records = read_metrics(run)
    assert [r["step"] for r in records] == [10, 20, 30, 40, 50, 60]
    for r in records:
        assert {"step", "loss", "lr", "tokens", "tokens_per_s"} <= r.keys()
    assert records[-1]["tokens"] == 60 * 8 * 64 * 2  # steps x batch x seq_len x ranks
    assert records[-1]["loss"] < records[0]["loss"] - 1.0

    state = load_checkpoint(run.latest_checkpoint)
    assert state["step"] == 60 and state["world_size"] == 2 and state["preset"] == "tiny"
    assert state["data"]["offset"] > 0
    assert not list(run.checkpoints.glob(".*")), "no temporary checkpoint files left"
    config = json.loads(run.config.read_text())
    assert config["trainer"]["max_steps"] == 60 and config["model"]["n_layer"] == 2
    assert "step 60 loss" in run.rank_log(0).read_text()
    assert "comms self-test" in run.rank_log(1).read_text()
    for rank in (0, 1):
        assert json.loads(run.comms_report(rank).read_text())["all_reduce_correct"] is True


def test_resumes_from_checkpoint(trained_root: Path, tmp_path: Path) -> None:
    root = tmp_path / "fsx"
    shutil.copytree(trained_root, root)
    launch(tiny_launch(root, "run-1", max_steps=80))
    run = RunPaths.of(root, "run-1")
    records = read_metrics(run)
    assert [r["step"] for r in records] == [10, 20, 30, 40, 50, 60, 70, 80]
    assert records[-1]["tokens"] == 80 * 8 * 64 * 2
    assert "resumed from" in run.rank_log(0).read_text()
    assert load_checkpoint(run.latest_checkpoint)["step"] == 80


def test_sample_order_does_not_depend_on_world_size() -> None:
    """One global batch at world size 2 is the same windows as two ranks' batches at world size 1, halved."""
    tokens = np.arange(10_000, dtype=np.uint16)
    one = TokenBatches(tokens, seq_len=16, batch_size=8, rank=0, world_size=1, seed=3)
    two = [TokenBatches(tokens, seq_len=16, batch_size=4, rank=r, world_size=2, seed=3) for r in (0, 1)]
    for _ in range(5):
        x1, _ = one.next_batch()
        x2 = torch.cat([b.next_batch()[0] for b in two])
        assert torch.equal(x1, x2)
    assert one.position == two[0].position == two[1].position
