"""CheckpointManager: atomic commits, keep-last-N, verified loading with fallback, asynchronous saves."""

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from trainer.checkpoint import INDEX, CheckpointError, CheckpointManager, rng_state, set_rng_state, step_file_name


def state_of(step: int, numel: int = 1000) -> dict:
    return {"model": {"w": torch.full((numel,), float(step))}, "step": step, "progress": {"step": step}}


def test_commits_links_latest_and_keeps_the_last_n(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, keep=2)
    for step in (10, 20, 30):
        manager.save(state_of(step), step)
    manager.close()  # old files are deleted in the background
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "checkpoint_latest.pt", step_file_name(20), step_file_name(30), INDEX
    ]  # fmt: skip
    assert os.path.samefile(tmp_path / "checkpoint_latest.pt", tmp_path / step_file_name(30))
    index = json.loads((tmp_path / INDEX).read_text())
    assert [e["step"] for e in index["checkpoints"]] == [20, 30] and index["latest"]["step"] == 30
    loaded = manager.load()
    assert loaded["step"] == 30 and torch.equal(loaded["model"]["w"], torch.full((1000,), 30.0))


def test_no_checkpoint_is_none(tmp_path: Path) -> None:
    assert CheckpointManager(tmp_path / "absent").load() is None


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda b: b[: len(b) // 2], "truncated or altered"),
        (lambda b: b[: len(b) // 2] + bytes([b[len(b) // 2] ^ 0xFF]) + b[len(b) // 2 + 1 :], "fails its CRC32"),
    ],
    ids=["truncated", "bit-flip"],
)
def test_damaged_latest_falls_back_with_a_warning(tmp_path: Path, caplog, damage, message: str) -> None:
    manager = CheckpointManager(tmp_path, keep=3)
    for step in (10, 20):
        manager.save(state_of(step), step)
    latest = tmp_path / "checkpoint_latest.pt"
    damaged = damage(latest.read_bytes())
    latest.write_bytes(damaged)  # a hard link: the step-20 file is damaged with it
    with caplog.at_level(logging.WARNING):
        assert manager.load()["step"] == 10
    assert message in caplog.text and "trying an older checkpoint" in caplog.text


def test_all_damaged_is_an_error_naming_each(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, keep=3)
    manager.save(state_of(10), 10)
    (tmp_path / step_file_name(10)).write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="no usable checkpoint") as failure:
        manager.load()
    assert "checkpoint_latest.pt" in str(failure.value)


def test_async_save_writes_a_snapshot(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, keep=2, async_save=True)
    state = state_of(10, numel=2_000_000)
    manager.save(state, 10, blocking=False)
    manager.wait_until_staged()  # the trainer's barrier before optimizer.step()
    state["model"]["w"].fill_(-1.0)  # training goes on changing the weights in place
    manager.wait()
    assert torch.equal(manager.load()["model"]["w"], torch.full((2_000_000,), 10.0))
    assert manager.last_commit_s is not None
    state["step"] = 20
    manager.save(state, 20, blocking=False)  # into the same CPU buffers
    manager.close()
    assert torch.equal(manager.load()["model"]["w"], torch.full((2_000_000,), -1.0))


def test_a_failed_async_copy_is_raised_to_the_trainer(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, async_save=True)
    manager.save(state_of(1), 1)
    uncopyable = {"model": {"w": torch.empty(4, device="meta")}, "step": 2}  # a meta tensor has no data to copy
    manager.save(uncopyable, 2, blocking=False)
    with pytest.raises(NotImplementedError):
        manager.wait_until_staged()
    with pytest.raises(NotImplementedError):
        manager.wait()
    assert manager.load()["step"] == 1


def test_async_copy_keeps_tied_weights_tied(tmp_path: Path) -> None:
    embedding = torch.ones(1000, 8)
    state = {"model": {"wte.weight": embedding, "lm_head.weight": embedding}, "step": 1}
    manager = CheckpointManager(tmp_path, async_save=True)
    manager.save(state, 1, blocking=False)
    manager.close()
    sync_dir = tmp_path / "sync"
    CheckpointManager(sync_dir).save(state, 1)
    assert (tmp_path / step_file_name(1)).stat().st_size == (sync_dir / step_file_name(1)).stat().st_size
    loaded = manager.load()["model"]
    assert loaded["wte.weight"].untyped_storage().data_ptr() == loaded["lm_head.weight"].untyped_storage().data_ptr()


def test_rng_state_round_trips_through_a_weights_only_checkpoint(tmp_path: Path) -> None:
    import random

    import numpy as np

    manager = CheckpointManager(tmp_path)
    manager.save({**state_of(1), "rng": rng_state()}, 1)
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    set_rng_state(manager.load()["rng"])
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected


WRITER = """
import sys, torch
from pathlib import Path
from trainer.checkpoint import CheckpointManager
manager = CheckpointManager(Path(sys.argv[1]), keep=3)
manager.save({"model": {"w": torch.zeros(10)}, "step": 1}, 1)
print("first committed", flush=True)
manager.save({"model": {"w": torch.ones(300_000_000 // 4)}, "step": 2}, 2)  # 300 MB: slow enough to catch
print("second committed", flush=True)
"""


def test_kill_9_during_a_write_leaves_the_previous_checkpoint_intact(tmp_path: Path) -> None:
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    assert writer.stdout.readline().strip() == "first committed"
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob(".checkpoint_step_00000002.pt.*.tmp")) and time.monotonic() < deadline:
        time.sleep(0.001)
    os.kill(writer.pid, signal.SIGKILL)  # mid-write
    writer.wait()
    assert writer.returncode == -signal.SIGKILL and not (tmp_path / step_file_name(2)).exists()

    manager = CheckpointManager(tmp_path, keep=3)
    assert manager.load()["step"] == 1
    manager.save(state_of(3), 3)  # the next save sweeps the dead writer's temporary file away
    assert not list(tmp_path.glob(".*.tmp"))


def test_the_schema_says_what_an_old_checkpoint_cannot_have_checked() -> None:
    from trainer.checkpoint import SCHEMA, check_schema, old_checkpoint_warning, unchecked_by_old_checkpoint

    current, old = {**state_of(5), "schema": SCHEMA}, state_of(5)  # schema 1: no key
    assert unchecked_by_old_checkpoint(current) == []
    unchecked = unchecked_by_old_checkpoint(old)
    assert unchecked == ["its learning-rate schedule (this run's flags set it)",
                         "its dataset snapshot (it goes on with --data-dir's)"]  # fmt: skip
    assert old_checkpoint_warning(unchecked[:1]) == (
        "the checkpoint predates schema 2: its learning-rate schedule (this run's flags set it) is not recorded, "
        "so not checked"
    )
    assert " and its dataset snapshot (it goes on with --data-dir's) are not recorded" in old_checkpoint_warning(
        unchecked
    )
    check_schema(current)
    check_schema(old)
    with pytest.raises(CheckpointError, match="step 5 has schema 3, newer than this trainer's 2"):
        check_schema({**state_of(5), "schema": 3})
