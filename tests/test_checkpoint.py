"""CheckpointManager in one process: atomic commits, keep-last-N, verified loading with fallback, asynchronous
saves, single-file checkpoints from before DCP. The collective paths (2 ranks) are tested under torchrun in
test_trainer.py."""

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers import write_single_file_checkpoint
from trainer.checkpoint import (
    CheckpointError,
    CheckpointManager,
    SaveFailed,
    committed_checkpoints,
    newest_checkpoint,
    read_checkpoint,
    read_weights,
    rng_state,
    set_rng_state,
)


def state_of(step: int) -> dict:
    return {"model": {"w": torch.full((10,), float(step))}, "step": step, "progress": {"step": step}}


class Trained:
    """A model and optimizer with state, whose weights say which step they are."""

    def __init__(self, width: int = 32):
        self.model = torch.nn.Linear(width, width)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.model(torch.ones(2, width)).sum().backward()
        self.optimizer.step()

    def at(self, step: int) -> "Trained":
        with torch.no_grad():
            self.model.weight.fill_(float(step))
        return self

    def save(self, manager: CheckpointManager, step: int, blocking: bool = True) -> None:
        manager.save(step, self.model, self.optimizer, {"step": step}, rng_state(), blocking=blocking)


def test_commits_links_latest_and_keeps_the_last_n(tmp_path: Path) -> None:
    manager, trained = CheckpointManager(tmp_path, keep=2), Trained()
    for step in (10, 20, 30):
        trained.at(step).save(manager, step)
    manager.close()
    assert [c.step for c in committed_checkpoints(tmp_path)] == [30, 20]
    assert os.readlink(tmp_path / "checkpoint_latest") == "step_00000030"
    commit = json.loads((tmp_path / "step_00000030" / "commit.json").read_text())
    assert commit["step"] == 30 and commit["world_size"] == 1 and ".metadata" in commit["files"]
    assert not list(tmp_path.glob(".*")), "no temporary directories left"
    restored = Trained()
    CheckpointManager(tmp_path).restore(newest_checkpoint(tmp_path), restored.model, restored.optimizer)
    assert torch.equal(restored.model.weight, torch.full((32, 32), 30.0))
    assert torch.equal(
        restored.optimizer.state_dict()["state"][0]["exp_avg"], trained.optimizer.state_dict()["state"][0]["exp_avg"]
    )


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "async"])
def test_a_save_that_fails_is_one_error_of_ours_and_the_last_good_checkpoint_stands(
    tmp_path: Path, blocking: bool
) -> None:
    """DCP raises CheckpointException, a BaseException that no `except Exception` catches; the manager turns every
    save failure into SaveFailed, naming the step and the cause, and whether a restart can help (ENOSPC: no)."""
    manager, trained = CheckpointManager(tmp_path, async_save=True, fail_from_step=20), Trained()
    trained.at(10).save(manager, 10)
    with pytest.raises(SaveFailed) as failure:
        trained.at(20).save(manager, 20, blocking=blocking)
        manager.close()  # an asynchronous save's failure comes out here, or at the next save
    if blocking:
        manager.close()
    assert isinstance(failure.value, Exception) and failure.value.step == 20 and failure.value.permanent
    assert "the checkpoint of step 20 could not be written: OSError: [Errno 28] No space left" in str(failure.value)
    assert "a restart will not help" in str(failure.value)
    assert os.readlink(tmp_path / "checkpoint_latest") == "step_00000010"
    assert [c.step for c in committed_checkpoints(tmp_path)] == [10]
    assert read_checkpoint(tmp_path / "checkpoint_latest")["step"] == 10


def test_the_cuda_generator_saved_and_restored_is_this_devices_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU path's logic on the CPU build: only the current device's CUDA generator is read (reading every GPU's
    opens a context on each from every rank), and a checkpoint written before, with every GPU's, restores this
    device's entry."""
    restored: list[torch.Tensor] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": torch.tensor([11], dtype=torch.uint8))
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: pytest.fail("every GPU's generator read"))
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device="cuda": restored.append(state))
    state = rng_state()
    assert torch.equal(state["cuda_device"], torch.tensor([11], dtype=torch.uint8)) and "cuda" not in state
    set_rng_state(state)
    older = {k: v for k, v in state.items() if k != "cuda_device"}
    set_rng_state({**older, "cuda": [torch.tensor([0], dtype=torch.uint8), torch.tensor([22], dtype=torch.uint8)]})
    assert [int(s[0]) for s in restored] == [11, 22]


def test_no_checkpoint_is_none(tmp_path: Path) -> None:
    assert newest_checkpoint(tmp_path / "absent") is None


def test_an_uncommitted_directory_is_ignored_and_a_damaged_one_falls_back(tmp_path: Path, caplog) -> None:
    manager, trained = CheckpointManager(tmp_path, keep=3), Trained()
    for step in (10, 20):
        trained.at(step).save(manager, step)
    manager.close()
    (tmp_path / "step_00000030").mkdir()  # renamed without its commit.json: cannot happen, but is not trusted
    (tmp_path / "step_00000030" / ".metadata").write_bytes(b"x")
    assert newest_checkpoint(tmp_path).step == 20
    share = tmp_path / "step_00000020" / "__0_0.distcp"
    share.write_bytes(share.read_bytes()[:100])
    assert newest_checkpoint(tmp_path).step == 10
    assert "step_00000020 is truncated or altered: __0_0.distcp is 100 bytes" in caplog.text
    (tmp_path / "step_00000010" / "commit.json").write_text("{")
    with pytest.raises(CheckpointError, match="no usable checkpoint") as failure:
        newest_checkpoint(tmp_path)
    assert "step_00000010 has no readable commit.json" in str(failure.value)


def test_a_record_that_fails_its_crc32_is_named_and_the_weights_alone_still_read(tmp_path: Path) -> None:
    from torch.distributed.checkpoint import FileSystemReader

    manager, trained = CheckpointManager(tmp_path), Trained(width=256)
    trained.at(5).save(manager, 5)
    manager.close()
    checkpoint = newest_checkpoint(tmp_path)
    items = FileSystemReader(checkpoint.path).read_metadata().storage_data
    exp_avg = next(item for index, item in items.items() if index.fqn == "optim.state.weight.exp_avg")
    with open(checkpoint.path / exp_avg.relative_path, "r+b") as f:  # one flipped bit, sizes unchanged
        f.seek(exp_avg.offset + exp_avg.length // 2)
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 1]))
    assert torch.equal(read_weights(checkpoint)["weight"], torch.full((256, 256), 5.0))
    fresh = Trained(width=256)
    with pytest.raises(CheckpointError, match=r"step_00000005 cannot be read: .* fails its CRC32"):
        CheckpointManager(tmp_path).restore(checkpoint, fresh.model, fresh.optimizer)


def test_an_async_save_holds_its_step_while_training_changes_the_weights(tmp_path: Path) -> None:
    manager, trained = CheckpointManager(tmp_path, keep=2, async_save=True), Trained(width=512)
    trained.at(10).save(manager, 10, blocking=False)
    manager.wait_until_staged()  # the trainer's barrier before optimizer.step()
    trained.at(-1)  # training goes on changing the weights in place
    manager.wait()
    assert manager.last_save is not None and manager.last_save.step == 10
    assert torch.equal(read_weights(newest_checkpoint(tmp_path))["weight"], torch.full((512, 512), 10.0))
    trained.save(manager, 20, blocking=False)  # into the same host buffers
    manager.close()
    assert torch.equal(read_weights(newest_checkpoint(tmp_path))["weight"], torch.full((512, 512), -1.0))


def test_rng_state_round_trips_through_a_weights_only_checkpoint(tmp_path: Path) -> None:
    manager, trained = CheckpointManager(tmp_path), Trained()
    trained.save(manager, 1)
    manager.close()
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    set_rng_state(newest_checkpoint(tmp_path).rng_of(0))
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected
    assert newest_checkpoint(tmp_path).rng_of(1) is None, "a rank the saved run did not have"


def test_a_single_file_checkpoint_from_before_dcp_loads_and_is_superseded(tmp_path: Path) -> None:
    trained = Trained().at(7)
    state = {
        **state_of(7),
        "model": trained.model.state_dict(),
        "optimizer": trained.optimizer.state_dict(),
        "rng": [rng_state()],
    }
    write_single_file_checkpoint(tmp_path, state)
    found = newest_checkpoint(tmp_path)
    assert not found.sharded and found.step == 7 and read_checkpoint(found.path)["step"] == 7
    restored = Trained()
    manager = CheckpointManager(tmp_path)
    manager.restore(found, restored.model, restored.optimizer)
    assert torch.equal(restored.model.weight, trained.model.weight)
    restored.save(manager, 8)
    manager.close()
    assert newest_checkpoint(tmp_path).sharded and not (tmp_path / "checkpoint_latest.pt").exists()
    assert [c.step for c in committed_checkpoints(tmp_path)] == [8, 7], "the old file stays as a fallback"
    (tmp_path / "checkpoint_step_00000007.pt").write_bytes(b"garbage")
    assert newest_checkpoint(tmp_path).step == 8


WRITER = """
import sys, torch
from pathlib import Path
from trainer.checkpoint import CheckpointManager
small, large = torch.nn.Linear(4, 4), torch.nn.Linear(8192, 8192)  # 256 MB of weights: slow enough to catch
manager = CheckpointManager(Path(sys.argv[1]), keep=3, attempt=1)
optimizer = torch.optim.SGD(small.parameters())
manager.save(1, small, optimizer, {"step": 1}, {})
print("first committed", flush=True)
manager.save(2, small, optimizer, {"step": 2}, {})
manager.save(3, large, torch.optim.SGD(large.parameters()), {"step": 3}, {})
print("third committed", flush=True)
"""


def test_kill_9_during_a_write_leaves_the_previous_checkpoint_in_use(tmp_path: Path) -> None:
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)},
    )
    assert writer.stdout.readline().strip() == "first committed"
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob(".step_00000003.attempt-1.tmp/__0_*.distcp")) and time.monotonic() < deadline:
        time.sleep(0.001)
    os.kill(writer.pid, signal.SIGKILL)  # mid-write
    writer.wait()
    assert writer.returncode == -signal.SIGKILL and not (tmp_path / "step_00000003").exists()

    assert newest_checkpoint(tmp_path).step == 2
    assert os.readlink(tmp_path / "checkpoint_latest") == "step_00000002"
    manager, trained = CheckpointManager(tmp_path, keep=3, attempt=2), Trained()
    trained.save(manager, 3)  # the next attempt's first save sweeps the dead writer's directory away
    manager.close()
    assert not list(tmp_path.glob(".*.tmp")) and newest_checkpoint(tmp_path).step == 3


def test_the_schema_says_what_an_old_checkpoint_cannot_have_checked() -> None:
    from trainer.checkpoint import SCHEMA, check_schema, old_checkpoint_warning, unchecked_by_old_checkpoint

    current, old = {**state_of(5), "schema": SCHEMA}, state_of(5)  # schema 1: no key
    assert unchecked_by_old_checkpoint(current) == []
    unchecked = unchecked_by_old_checkpoint(old)
    assert unchecked == [
        "its learning-rate schedule (this run's flags set it)",
        "its dataset snapshot (it goes on with --data-dir's)",
    ]
    assert old_checkpoint_warning(unchecked[:1]) == (
        "the checkpoint predates schema 2: its learning-rate schedule (this run's flags set it) is not recorded, "
        "so not checked"
    )
    assert " and its dataset snapshot (it goes on with --data-dir's) are not recorded" in old_checkpoint_warning(
        unchecked
    )
    check_schema(current)
    check_schema(old)
    with pytest.raises(CheckpointError, match="step 5 has schema 4, newer than this trainer's 3"):
        check_schema({**state_of(5), "schema": 4})


def test_each_rank_reads_a_balanced_share_the_same_on_every_rank() -> None:
    from trainer.dcp_io import owners

    sizes = [4096, 4096, 1024, 1024, 512, 512, 256, 8, 8, 8]
    tensors = {f"t{i}": torch.empty(n) for i, n in enumerate(sizes)}
    owner = owners(tensors, world=2)
    assert owner == owners(dict(reversed(list(tensors.items()))), world=2), "independent of the dict's order"
    shares = [sum(tensors[k].numel() for k, r in owner.items() if r == rank) for rank in (0, 1)]
    assert abs(shares[0] - shares[1]) <= 256 and sum(shares) == sum(sizes)
    assert set(owners(tensors, world=1).values()) == {0}
    assert len(set(owners(tensors, world=16).values())) == len(sizes), "more ranks than tensors: one each"


def test_tied_weights_are_written_once_and_come_back_tied(tmp_path: Path) -> None:
    from torch.distributed.checkpoint import FileSystemReader

    from trainer.model import build_model, model_config

    model = build_model(model_config("tiny", 512, 64, 0, 0.0))
    optimizer = torch.optim.AdamW(model.parameters())
    manager = CheckpointManager(tmp_path)
    manager.save(1, model, optimizer, {"step": 1}, {})
    manager.close()
    saved = FileSystemReader(tmp_path / "step_00000001").read_metadata().state_dict_metadata
    assert "model.transformer.wte.weight" in saved and "model.lm_head.weight" not in saved
    weights = read_weights(newest_checkpoint(tmp_path))
    assert weights["lm_head.weight"] is weights["transformer.wte.weight"]
    restored = build_model(model_config("tiny", 512, 64, 0, 0.0))
    with torch.no_grad():
        restored.transformer.wte.weight.zero_()
    manager.restore(newest_checkpoint(tmp_path), restored, torch.optim.AdamW(restored.parameters()))
    assert restored.lm_head.weight is restored.transformer.wte.weight
    assert torch.equal(restored.lm_head.weight, model.lm_head.weight)


def test_files_written_whole_honour_the_umask(tmp_path: Path) -> None:
    """mkstemp makes its file 0600 whatever the umask; on a shared FSx volume a teammate's uid could not read
    config.json, status.json, a summary or a checkpoint's commit.json. The rename keeps the mode open() would give."""
    from trainer.atomic import atomic_open, write_json

    previous = os.umask(0o027)
    try:
        write_json(tmp_path / "a.json", {"x": 1})
        with atomic_open(tmp_path / "b.bin") as f:
            f.write(b"x")
        os.umask(0o002)
        write_json(tmp_path / "c.json", {})
    finally:
        os.umask(previous)
    modes = {p.name: p.stat().st_mode & 0o777 for p in tmp_path.iterdir()}
    assert modes == {"a.json": 0o640, "b.bin": 0o640, "c.json": 0o664}


def test_every_file_of_a_trained_run_is_readable_by_the_team(trained_root: Path) -> None:
    """What staging, the trainer (its checkpoints, status, metrics, logs) and the launcher wrote for a run, under this
    process's umask (0644 under the usual 022): the mode open() gives, for every file."""
    from trainer.atomic import file_mode

    files = [p for p in trained_root.rglob("*") if p.is_file() and not p.is_symlink()]
    wrong = {
        str(p.relative_to(trained_root)): oct(p.stat().st_mode & 0o777)
        for p in files
        if p.stat().st_mode & 0o777 != file_mode()
    }
    assert len(files) > 20 and not wrong, wrong
