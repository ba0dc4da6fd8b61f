"""Which of a run's checkpoints an evaluation measures, and each one evaluated in turn: the newest ('latest'), every
committed one not evaluated yet ('unevaluated'), or the steps named ("100,200"). Each is kept as any evaluation is
(history.py), so a long run, and a recurring pretraining evaluating each night, gather their curves in
eval/history.jsonl, which the reports plot (report.py).

The steps go oldest first; only the newest of them is gated and exported: an older checkpoint's verdict fails
nothing, and the export holds the furthest weights. What an evaluation refuses is refused before the first one
writes anything: the steps (each a committed checkpoint on the volume, its files all there), the settings and the
newest's gate, then the first evaluation checks the rest as it always does.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from common.errors import InputError
from components.evaluate_checkpoint.benchmarks import BenchmarkSettings
from components.evaluate_checkpoint.core import check_gate, evaluate_checkpoint, read_run
from components.evaluate_checkpoint.gate import Gate
from components.evaluate_checkpoint.history import evaluated_step
from components.evaluate_checkpoint.inputs import LATEST, UNEVALUATED, check_checkpoints, check_inputs
from components.evaluate_checkpoint.results import EvalResult
from trainer.checkpoint import Checkpoint, checked, committed_checkpoints
from trainer.errors import CheckpointError
from trainer.layout import RunPaths

log = logging.getLogger(__name__)


def checkpoints_to_evaluate(run: RunPaths, which: str = LATEST) -> list[int]:
    """The steps to evaluate, oldest first: 'latest' the newest committed checkpoint; 'unevaluated' every committed
    one whose step has no kept evaluation, or the newest again when all have one (so the evaluation always has a
    result); a comma list of steps those steps, each of which must be a committed checkpoint still on the volume.
    Refused in one line: a malformed value, a run with no committed checkpoint, steps not among the committed."""
    named = check_checkpoints(which)
    committed = sorted({c.step for c in committed_checkpoints(run.checkpoints)})
    if not committed:
        raise InputError(f"{run.checkpoints} holds no committed checkpoint (any): run {run.root.name!r} is incomplete")
    if named:
        missing = [step for step in named if step not in committed]
        if missing:
            raise InputError(
                f"run {run.root.name!r} holds no committed checkpoint of step {', '.join(map(str, missing))} under "
                f"{run.checkpoints} (committed: {', '.join(map(str, committed))})"
            )
        return named
    if which.strip() == UNEVALUATED:
        evaluated = set(run.eval_steps()) | {evaluated_step(run.eval_result)}
        return [step for step in committed if step not in evaluated] or committed[-1:]
    return committed[-1:]


def evaluate_checkpoints(
    storage_root: str,
    dataset: str,
    run_id: str,
    max_tokens: int = 65536,
    batch_size: int = 8,
    checkpoints: str = LATEST,
    gate: Gate | None = None,
    export: bool = True,
    export_s3_uri: str = "",
    s3_endpoint_url: str = "",
    dtype: str = "auto",
    benchmarks: BenchmarkSettings | None = None,
) -> list[EvalResult]:
    """Evaluate the checkpoints `checkpoints` names (checkpoints_to_evaluate) with core.evaluate_checkpoint, oldest
    first, and return their results in that order. The newest of them is gated (StepFailed when the gate fails, once
    it is kept) and exported (and uploaded to `export_s3_uri`); the older ones are neither. The benchmark data is
    staged once, by the first evaluation. A checkpoint deleted while the older ones were evaluated (a training still
    running keeps only its newest --keep-checkpoints) is skipped with a warning."""
    gate, benchmarks = gate or Gate(), benchmarks or BenchmarkSettings()
    check_inputs(max_tokens, batch_size, export, export_s3_uri, dtype)
    run, _ = read_run(storage_root, dataset, run_id)
    steps = checkpoints_to_evaluate(run, checkpoints)
    if len(steps) > 1:  # what the newest's evaluation would refuse, refused before the older ones are kept
        check_committed(run, steps)
        check_gate(storage_root, dataset, run_id, gate, benchmarks)
        log.info("run %s: evaluating the checkpoints of steps %s", run_id, ", ".join(map(str, steps)))
    results: list[EvalResult] = []
    for step in steps:
        newest = step == steps[-1]
        if not newest and step not in {c.step for c in committed_checkpoints(run.checkpoints)}:
            log.warning(
                "run %s: the checkpoint of step %d is gone from %s: not evaluated", run_id, step, run.checkpoints
            )
            continue
        results.append(
            evaluate_checkpoint(
                storage_root,
                dataset,
                run_id,
                max_tokens=max_tokens,
                batch_size=batch_size,
                checkpoint=str(step),
                gate=gate if newest else Gate(),
                export=export and newest,
                export_s3_uri=export_s3_uri if newest else "",
                s3_endpoint_url=s3_endpoint_url,
                dtype=dtype,
                benchmarks=replace(benchmarks, data_uri="") if results else benchmarks,  # staged by the first
            )
        )
    return results


def check_committed(run: RunPaths, steps: list[int]) -> None:
    """Each step's checkpoint has all its files at their sizes (a single file from before DCP: read and checked
    whole), as find_checkpoint checks it, refused in one line before any step is evaluated."""
    found: dict[int, Checkpoint] = {}
    for candidate in committed_checkpoints(run.checkpoints):  # of one step, the one find_checkpoint takes
        found.setdefault(candidate.step, candidate)
    for step in steps:
        try:
            checked(found[step])
        except CheckpointError as exc:
            raise InputError(str(exc)) from None
