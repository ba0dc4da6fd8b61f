"""Keep every evaluation of a run: per step, in eval/history.jsonl, and the newest step's at eval/ where readers looked
before evaluations were kept, under a lock, since a pipeline's and a person's evaluations of one run may overlap.

Every evaluation is kept per checkpoint: eval/step_<N>/{eval.json,report.md,report.html}, a line in
eval/history.jsonl, and a copy of the newest step's files at eval/eval.json, report.md and report.html.
"""

from __future__ import annotations

import fcntl
import json
import logging
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from components.evaluate_checkpoint.results import EvalResult
from trainer.atomic import atomic_open, atomic_path, read_json_lines, write_json
from trainer.layout import RunPaths

log = logging.getLogger(__name__)


@contextmanager
def eval_lock(run: RunPaths) -> Iterator[None]:
    """Two evaluations of one run (a pipeline's and a person's) never interleave the history or the newest-step
    copies: each writes its files under an exclusive flock."""
    run.eval.mkdir(parents=True, exist_ok=True)
    with open(run.eval_lock, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def save_evaluation(run: RunPaths, result: EvalResult, report_html: str) -> None:
    """Write the evaluation to its step's directory, add it to the history, and copy it to the run's eval/ top
    when its step is the newest evaluated (ties: the newer evaluation wins), so evaluating an older checkpoint
    never hides the run's furthest result from the readers of eval/eval.json. Every file is written whole
    (trainer/atomic.py); eval.json last in each place, so a reader of it never finds reports older than it."""
    with eval_lock(run):
        adopt_unkept_evaluation(run)
        write_evaluation_files(run.eval_step(result.step), result, report_html)
        append_history(run, history_entry(result))
        newest = evaluated_step(run.eval_result)
        if newest is None or result.step >= newest:
            write_evaluation_files(run.eval, result, report_html)
        else:
            log.info(
                "run %s: step %d evaluated; eval/eval.json keeps step %d, the newest evaluated",
                run.root.name,
                result.step,
                newest,
            )


def write_evaluation_files(directory: Path, result: EvalResult, report_html: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    with atomic_open(directory / "report.md", "w") as f:
        f.write(result.markdown())
    with atomic_open(directory / "report.html", "w") as f:
        f.write(report_html)
    write_json(directory / "eval.json", asdict(result))


def history_entry(result: EvalResult) -> dict[str, Any]:
    return {
        "step": result.step,
        "evaluated_at": result.evaluated_at,
        "checkpoint": result.checkpoint,
        "val_tokens": result.val_tokens,
        "val_loss": result.val_loss,
        "val_bits_per_byte": result.val_bits_per_byte,
        "gate_passed": result.gate_passed,
        "gate_reasons": result.gate_reasons,
        "baseline_run_id": result.baseline_run_id,
        "baseline_step": result.baseline_step,
        "report_dir": Path(result.report_dir).name,
        "benchmarks": {f"{b['task']}:{b['metric']}": b["value"] for b in result.benchmarks},
    }


def append_history(run: RunPaths, entry: dict[str, Any]) -> None:
    """Add one line to eval/history.jsonl. The file is rewritten whole under the run's eval lock rather than
    appended to, so a crash mid-write leaves the old history, never a torn last line."""
    try:
        old = run.eval_history.read_text()
    except FileNotFoundError:
        old = ""
    if old and not old.endswith("\n"):
        old += "\n"
    with atomic_open(run.eval_history, "w") as f:
        f.write(old + json.dumps(entry, sort_keys=True) + "\n")


def read_history(run: RunPaths) -> list[dict[str, Any]]:
    """The run's evaluations in the order they ran (eval/history.jsonl); unreadable lines are skipped."""
    return read_json_lines(run.eval_history)


def evaluated_step(eval_json: Path) -> int | None:
    try:
        return int(json.loads(eval_json.read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def adopt_unkept_evaluation(run: RunPaths) -> None:
    """A run evaluated before evaluations were kept per step has only eval/eval.json and its reports: copy them to
    their step's directory and the history first, so the next evaluation (of another step) does not lose them."""
    step = evaluated_step(run.eval_result)
    if step is None or run.eval_step(step).exists():
        return
    for name in ("report.md", "report.html", "eval.json"):
        if (run.eval / name).is_file():
            with atomic_path(run.eval_step(step) / name) as tmp:
                shutil.copyfile(run.eval / name, tmp)
    evaluation = json.loads(run.eval_result.read_text())
    when = evaluation.get("evaluated_at") or datetime.fromtimestamp(run.eval_result.stat().st_mtime, UTC).isoformat(
        timespec="seconds"
    )
    append_history(
        run,
        {
            "step": step,
            "evaluated_at": when,
            "checkpoint": evaluation.get("checkpoint", ""),
            "val_tokens": evaluation.get("val_tokens"),
            "val_loss": evaluation.get("val_loss"),
            "val_bits_per_byte": evaluation.get("val_bits_per_byte"),
            "gate_passed": evaluation.get("gate_passed"),
            "gate_reasons": evaluation.get("gate_reasons"),
            "baseline_run_id": evaluation.get("baseline_run_id", ""),
            "baseline_step": evaluation.get("baseline_step"),
            "report_dir": run.eval_step(step).name,
        },
    )
    log.info("run %s: its earlier evaluation (step %d) kept in %s", run.root.name, step, run.eval_step(step))


def evaluation_of(run: RunPaths, step: int = 0) -> Path | None:
    """The eval.json of a run's evaluation of `step` (0: its newest evaluated step), or None. A run evaluated
    before evaluations were kept per step has only eval/eval.json, which serves for its own step."""
    if not step:
        return run.eval_result if run.eval_result.is_file() else None
    kept = run.eval_step(step) / "eval.json"
    if kept.is_file():
        return kept
    return run.eval_result if evaluated_step(run.eval_result) == step else None
