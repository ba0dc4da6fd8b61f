"""Every evaluation kept (components/evaluate_checkpoint/history.py): per step, in the history, the newest at eval/."""

import json
from pathlib import Path

import pytest

from components.evaluate_checkpoint.core import evaluate_checkpoint
from tests.evaluate_helpers import QUICK, short_samples  # noqa: F401 (short_samples: a fixture the tests name)
from trainer.layout import RunPaths


@pytest.mark.usefixtures("short_samples")
def test_two_evaluations_of_a_run_keep_both(trained_copy: Path) -> None:
    """Evaluations of steps 40, 60 and then 20: each keeps its own directory and a history line; the run's
    eval/eval.json and reports are the newest step's (60), whatever order they ran in."""
    run = RunPaths.of(trained_copy, "run-1")
    results = {
        s: evaluate_checkpoint(str(trained_copy), "synthetic", "run-1", checkpoint=str(s), **QUICK)
        for s in (40, 60, 20)
    }
    assert run.eval_steps() == [20, 40, 60]
    for step, result in results.items():
        kept = json.loads((run.eval_step(step) / "eval.json").read_text())
        assert kept["step"] == step and kept["val_loss"] == result.val_loss and kept["report_dir"] == result.report_dir
        assert f"at step {step} " in (run.eval_step(step) / "report.md").read_text()
        assert f"at step {step} " in (run.eval_step(step) / "report.html").read_text()
    history = [json.loads(line) for line in run.eval_history.read_text().splitlines()]
    assert [(h["step"], h["val_loss"], h["report_dir"]) for h in history] == [
        (s, results[s].val_loss, f"step_{s:08d}") for s in (40, 60, 20)
    ]
    assert all(h["evaluated_at"] and h["gate_passed"] is True and "val_bits_per_byte" in h for h in history)
    latest = json.loads(run.eval_result.read_text())
    assert latest == json.loads((run.eval_step(60) / "eval.json").read_text())
    assert run.eval_html.read_text() == (run.eval_step(60) / "report.html").read_text()
    assert run.eval_report.read_text() == (run.eval_step(60) / "report.md").read_text()


@pytest.mark.usefixtures("short_samples")
def test_an_evaluation_from_before_steps_were_kept_is_kept(trained_copy: Path) -> None:
    """A run evaluated before per-step directories has only eval/eval.json (step 60): evaluating step 40 moves
    that one into its step's directory and the history first, and leaves it as the newest."""
    run = RunPaths.of(trained_copy, "run-1")
    run.eval.mkdir()
    old = {"step": 60, "val_loss": 1.5, "val_bits_per_byte": 0.5, "gate_passed": True, "dataset": "synthetic"}
    run.eval_result.write_text(json.dumps(old))
    run.eval_report.write_text("# the step-60 report\n")
    evaluate_checkpoint(str(trained_copy), "synthetic", "run-1", checkpoint="40", **QUICK)
    assert json.loads(run.eval_result.read_text()) == old
    assert json.loads((run.eval_step(60) / "eval.json").read_text()) == old
    assert (run.eval_step(60) / "report.md").read_text() == "# the step-60 report\n"
    assert [json.loads(line)["step"] for line in run.eval_history.read_text().splitlines()] == [60, 40]
