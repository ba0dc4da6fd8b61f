"""The quality gate: what an evaluation is compared with (a ceiling, a baseline run's evaluation) and the verdict, apart
from the measuring, so the baseline is found (or refused) before a checkpoint is read.

An absolute ceiling on the val loss and/or no worse than a baseline run's evaluation plus a margin in bits per byte
(which survive a change of tokenizer); the baseline is a run id or "previous" (the newest other run of the same dataset
evaluated on the same fixed val set; any other is refused), at its newest evaluated step unless a step is named; the
verdict names the baseline's run and step. A failed gate fails the step with the numbers, or only warns.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.errors import InputError
from components.evaluate_checkpoint.history import evaluated_step, evaluation_of
from components.evaluate_checkpoint.results import EvalResult
from trainer.checkpoint import committed_checkpoints
from trainer.layout import RunPaths

PREVIOUS = "previous"


@dataclass
class Gate:
    max_val_loss: float = 0.0  # 0: no ceiling
    baseline_run_id: str = ""  # a run id, "previous", or "" for none
    baseline_margin: float = 0.0  # bits per byte the run may exceed the baseline's by
    baseline_step: int = 0  # the baseline's evaluation of this step; 0: its newest evaluated step
    benchmarks: str = ""  # thresholds on benchmark metrics, "hellaswag:acc_norm>=0.30,piqa:acc>0.6" (benchmarks.py)
    warn_only: bool = False


@dataclass(frozen=True)
class Baseline:
    """The evaluation a run is gated against: whose, of which step, and why that step (for the verdict's words)."""

    run_id: str
    step: int
    evaluation: dict[str, Any]
    which: str  # "its newest evaluation" (and of a newer checkpoint not evaluated, if so) or "as asked"


def find_baseline(
    storage_root: str, dataset: str, run_id: str, baseline: str, val_set: str, step: int = 0
) -> Baseline | None:
    """The baseline's evaluation: a named run's, or the newest other run evaluated on the same val set; of `step`,
    or by default of the baseline's newest evaluated step (its latest checkpoint, when that was evaluated).

    Evaluations compare only on the same held-out text (the dataset's fixed val set), in bits per byte, which a
    change of tokenizer does not move; one on another val set, or from before val sets were recorded, is refused.
    """
    if not baseline:
        return None
    if step < 0:
        raise InputError(f"baseline step {step}: give a step number, or 0 for the baseline's newest evaluation")
    at = f"step {step}" if step else "any step"
    if baseline != PREVIOUS:
        try:
            other = RunPaths.of(storage_root, baseline)
        except ValueError as exc:
            raise InputError(str(exc)) from None
        path = evaluation_of(other, step)
        if path is None:
            evaluated = set(other.eval_steps()) | {evaluated_step(other.eval_result)}
            steps = ", ".join(str(s) for s in sorted(s for s in evaluated if s is not None))
            raise InputError(
                f"baseline run {baseline!r}: no evaluation of {at} under {other.eval} (evaluated steps: "
                f"{steps or 'none'})"
            )
        theirs = json.loads(path.read_text())
        if theirs.get("val_set_sha256") != val_set or theirs.get("dataset") != dataset:
            recorded = f"dataset {theirs.get('dataset')!r}, val set {theirs.get('val_set_sha256')}"
            raise InputError(
                f"baseline run {baseline!r} was evaluated on another val set ({recorded}) than run "
                f"{run_id!r} (dataset {dataset!r}, val set {val_set}): their losses do not compare; "
                "choose a baseline of the same dataset and val set, or evaluate it again"
            )
        return baseline_of(other, theirs, step)
    candidates = []
    for latest in Path(storage_root, "runs").glob("*/eval/eval.json"):
        other = RunPaths(latest.parent.parent)
        path = evaluation_of(other, step)
        if other.root.name == run_id or path is None:
            continue
        try:
            theirs = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if theirs.get("dataset") == dataset and theirs.get("val_set_sha256") == val_set:
            candidates.append((path.stat().st_mtime, other.root.name, other, theirs))
    if not candidates:
        raise InputError(
            f"baseline 'previous': no other run of dataset {dataset!r} evaluated on the same val set "
            f"({val_set}){f' at step {step}' if step else ''} under {storage_root}"
        )
    _, _, other, theirs = max(candidates, key=lambda c: c[:2])
    return baseline_of(other, theirs, step)


def baseline_of(run: RunPaths, evaluation: dict[str, Any], asked: int) -> Baseline:
    """Say which of the baseline's evaluations the gate uses: the one asked for, or its newest, and whether the
    baseline has a newer committed checkpoint that nobody evaluated (then the comparison is with an older state)."""
    step = int(evaluation["step"])
    if asked:
        return Baseline(run.root.name, step, evaluation, "as asked")
    committed = committed_checkpoints(run.checkpoints)
    newer = committed[0].step if committed and committed[0].step > step else None
    which = "its newest evaluation" + (f"; its checkpoint of step {newer} is not evaluated" if newer else "")
    return Baseline(run.root.name, step, evaluation, which)


def apply_gate(
    result: EvalResult, gate: Gate, baseline: Baseline | None, benchmark_verdicts: list[tuple[bool, str]]
) -> None:
    """Mark the result with each part of the gate: the ceiling, the baseline, and the benchmark thresholds'
    verdicts (benchmarks.py check_benchmark_gates)."""
    if gate.max_val_loss:
        ok = result.val_loss <= gate.max_val_loss
        result.gate_reasons.append(
            f"val loss {result.val_loss:.4f} {'<=' if ok else '>'} ceiling {gate.max_val_loss:.4f}"
        )
        result.gate_passed &= ok
    if baseline is not None:
        theirs = baseline.evaluation
        limit = theirs["val_bits_per_byte"] + gate.baseline_margin
        ok = result.val_bits_per_byte <= limit
        result.baseline_run_id, result.baseline_step = baseline.run_id, baseline.step
        result.baseline_val_loss, result.baseline_bits_per_byte = theirs["val_loss"], theirs["val_bits_per_byte"]
        other_data = (theirs.get("snapshot"), theirs.get("tokenizer_sha256")) != (
            result.snapshot,
            result.tokenizer_sha256,
        )
        note = f"; snapshot {theirs.get('snapshot')} vs {result.snapshot}, same val set" if other_data else ""
        result.gate_reasons.append(
            f"baseline run {baseline.run_id} at step {baseline.step} ({baseline.which}): val "
            f"bits/byte {result.val_bits_per_byte:.4f} {'<=' if ok else '>'} "
            f"{theirs['val_bits_per_byte']:.4f} + margin {gate.baseline_margin:.4f} (bits per "
            f"byte compare across tokenizers{note})"
        )
        result.gate_passed &= ok
    for ok, words in benchmark_verdicts:
        result.gate_reasons.append(words)
        result.gate_passed &= ok
