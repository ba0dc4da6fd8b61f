import json
import shutil
from pathlib import Path

import pytest
import torch

from components.errors import InputError
from components.evaluate_checkpoint.core import evaluate_checkpoint
from trainer.layout import RunPaths


@pytest.fixture
def trained_copy(trained_root: Path, tmp_path: Path) -> Path:
    root = tmp_path / "fsx"
    shutil.copytree(trained_root, root)
    return root


def test_trained_model_beats_untrained(trained_copy: Path) -> None:
    result = evaluate_checkpoint(str(trained_copy), "synthetic", "run-1")
    assert result.step == 60 and result.val_tokens > 0
    assert result.val_loss < result.untrained_val_loss - 1.0, result
    run = RunPaths.of(trained_copy, "run-1")
    assert json.loads(run.eval_result.read_text())["val_loss"] == result.val_loss
    assert "val perplexity" in run.eval_report.read_text()


def test_corrupt_checkpoint_is_one_clear_error(trained_copy: Path) -> None:
    ckpt = RunPaths.of(trained_copy, "run-1").latest_checkpoint
    ckpt.write_bytes(ckpt.read_bytes()[:1000])  # truncated, as after a crash without atomic saves
    with pytest.raises(InputError, match="is corrupt") as failure:
        evaluate_checkpoint(str(trained_copy), "synthetic", "run-1")
    assert "\n" not in str(failure.value)


def test_checkpoint_that_is_not_plain_tensors_is_refused(trained_copy: Path) -> None:
    ckpt = RunPaths.of(trained_copy, "run-1").latest_checkpoint
    torch.save({"model": {}, "step": 1, "payload": Path("/etc/passwd")}, ckpt)  # an arbitrary object
    with pytest.raises(InputError, match="not a plain-tensor checkpoint"):
        evaluate_checkpoint(str(trained_copy), "synthetic", "run-1")


def test_checkpoint_of_another_model_is_refused(trained_copy: Path) -> None:
    ckpt = RunPaths.of(trained_copy, "run-1").latest_checkpoint
    state = torch.load(ckpt, weights_only=True)
    state["model"] = {k: v[..., :1] if v.dim() else v for k, v in state["model"].items()}
    torch.save(state, ckpt)
    with pytest.raises(InputError, match="does not fit the model"):
        evaluate_checkpoint(str(trained_copy), "synthetic", "run-1")


def test_missing_checkpoint(trained_copy: Path) -> None:
    RunPaths.of(trained_copy, "run-1").latest_checkpoint.unlink()
    with pytest.raises(InputError, match="checkpoint_latest.pt does not exist"):
        evaluate_checkpoint(str(trained_copy), "synthetic", "run-1")
