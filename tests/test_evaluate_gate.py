"""The quality gate (components/evaluate_checkpoint/gate.py): a ceiling, a baseline run, the baseline's step."""

import json
import shutil
from pathlib import Path

import pytest

from common.errors import InputError, StepFailed
from components.evaluate_checkpoint.core import evaluate_checkpoint
from components.evaluate_checkpoint.gate import Gate
from tests.evaluate_helpers import QUICK, short_samples  # noqa: F401 (short_samples: a fixture the tests name)
from trainer.layout import RunPaths


@pytest.mark.usefixtures("short_samples")
def test_the_gate_against_a_ceiling(trained_copy: Path) -> None:
    passed = evaluate_checkpoint(str(trained_copy), "synthetic", "run-1", gate=Gate(max_val_loss=100.0), export=False)
    assert passed.gate_passed and "<= ceiling 100.0000" in passed.gate_reasons[0]
    with pytest.raises(
        StepFailed, match=r"quality gate failed for run run-1 at step 60: val loss \d+\.\d+ > ceiling 0.1000"
    ):
        evaluate_checkpoint(str(trained_copy), "synthetic", "run-1", gate=Gate(max_val_loss=0.1), export=False)
    warned = evaluate_checkpoint(
        str(trained_copy), "synthetic", "run-1", gate=Gate(max_val_loss=0.1, warn_only=True), export=False
    )
    assert not warned.gate_passed
    assert json.loads(RunPaths.of(trained_copy, "run-1").eval_result.read_text())["gate_passed"] is False


@pytest.mark.usefixtures("short_samples")
def test_the_gate_against_a_baseline_run(trained_copy: Path) -> None:
    runs = trained_copy / "runs"
    shutil.copytree(runs / "run-1", runs / "run-0")
    baseline = evaluate_checkpoint(str(trained_copy), "synthetic", "run-0", checkpoint="20", export=False)
    better = evaluate_checkpoint(
        str(trained_copy), "synthetic", "run-1", gate=Gate(baseline_run_id="previous"), export=False
    )
    assert better.gate_passed and better.baseline_run_id == "run-0" and better.baseline_step == 20
    assert better.baseline_val_loss == baseline.val_loss > better.val_loss
    # the verdict names the baseline's run and step, and says it is the baseline's newest evaluation, not its newest
    # checkpoint (step 60, never evaluated)
    assert better.gate_reasons[0].startswith(
        "baseline run run-0 at step 20 (its newest evaluation; its checkpoint of step 60 is not evaluated): val "
        "bits/byte "
    ), better.gate_reasons
    # run-0 at step 20 against run-1 at 60 as its baseline: worse, even with a small margin
    with pytest.raises(
        StepFailed,
        match=r"at step 20: baseline run run-1 at step 60 \(its newest evaluation\): val "
        r"bits/byte \d+\.\d+ > \d+\.\d+ \+ margin 0.0100",
    ):
        evaluate_checkpoint(
            str(trained_copy),
            "synthetic",
            "run-0",
            checkpoint="20",
            export=False,
            gate=Gate(baseline_run_id="run-1", baseline_margin=0.01),
        )
    with pytest.raises(InputError, match="baseline run 'run-9': no evaluation"):
        evaluate_checkpoint(str(trained_copy), "synthetic", "run-1", gate=Gate(baseline_run_id="run-9"))


@pytest.mark.usefixtures("short_samples")
def test_the_gate_names_the_baseline_step_it_compared_with(trained_copy: Path) -> None:
    """A baseline evaluated at two steps: the gate takes its newest by default, or the step asked for, and names
    it in the verdict, the step's error and the JSON."""
    runs = trained_copy / "runs"
    shutil.copytree(runs / "run-1", runs / "run-0")
    for step in ("20", "40"):
        evaluate_checkpoint(str(trained_copy), "synthetic", "run-0", checkpoint=step, **QUICK)
    newest = evaluate_checkpoint(str(trained_copy), "synthetic", "run-1", gate=Gate(baseline_run_id="run-0"), **QUICK)
    assert (newest.baseline_run_id, newest.baseline_step) == ("run-0", 40)
    assert "baseline run run-0 at step 40 (its newest evaluation; its checkpoint of step 60 is not evaluated)" in (
        newest.gate_line()
    )
    asked = evaluate_checkpoint(
        str(trained_copy),
        "synthetic",
        "run-1",
        gate=Gate(baseline_run_id="run-0", baseline_step=20, baseline_margin=-10.0, warn_only=True),
        **QUICK,
    )
    assert not asked.gate_passed and asked.baseline_step == 20
    assert asked.gate_reasons[0].startswith("baseline run run-0 at step 20 (as asked): val bits/byte ")
    saved = json.loads(RunPaths.of(trained_copy, "run-1").eval_result.read_text())
    assert (saved["baseline_run_id"], saved["baseline_step"]) == ("run-0", 20)
    missing = Gate(baseline_run_id="run-0", baseline_step=30)
    with pytest.raises(
        InputError,
        match=r"baseline run 'run-0': no evaluation of step 30 .* \(evaluated steps: 20, "
        r"40\)",
    ):
        evaluate_checkpoint(str(trained_copy), "synthetic", "run-1", gate=missing)
