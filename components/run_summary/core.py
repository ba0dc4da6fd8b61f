"""The run summary: every step records how it ended on the shared volume, and the pipeline's exit step gathers it.

KFP gives an exit step only the pipeline's final state (`dsl.PipelineTaskFinalStatus`), and an exit step may not
take the outputs of the steps it guards. So each step writes <root>/runs/<run_id>/steps/<step>.json as it ends
(`recorded_step`), and the exit step (`summarize_run`) reads those into summary.json and summary.md. A step
whose pod was killed outright leaves no record; the summary says so beside KFP's own error message.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from components.errors import InputError
from trainer.atomic import atomic_open, write_json
from trainer.layout import RunPaths

log = logging.getLogger(__name__)

STEPS = ("preflight", "stage-data", "launch-pytorchjob", "verify-nccl", "evaluate-checkpoint")


def resolve_run_id(run_id: str, resume_run_id: str, pipeline_run_id: str) -> str:
    """The run directory this pipeline run trains in: a resumed run's, the one named, or the KFP run's id."""
    if resume_run_id and run_id and resume_run_id != run_id:
        raise InputError(f"run_id {run_id!r} and resume_run_id {resume_run_id!r} name different runs: give one")
    return resume_run_id or run_id or pipeline_run_id


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


@dataclass
class StepRecord:
    step: str
    state: str = "running"  # succeeded, skipped, failed
    started_at: str = field(default_factory=_now)
    finished_at: str = ""
    seconds: float = 0.0
    error: str = ""
    reports: dict[str, str] = field(default_factory=dict)  # what -> a path on the volume or a KFP artifact URI
    details: dict[str, Any] = field(default_factory=dict)  # the job's name, the gate's verdict, ...


@contextmanager
def recorded_step(storage_root: str, run_id: str, step: str, reports: dict[str, str]) -> Iterator[StepRecord]:
    """Record the step's outcome as it ends, success or not; recording never hides the step's own error."""
    record = StepRecord(step, reports=dict(reports))
    started = time.monotonic()
    try:
        yield record
        if record.state == "running":
            record.state = "succeeded"
    except BaseException as exc:
        record.state = "failed"
        record.error = str(exc) or type(exc).__name__
        raise
    finally:
        record.finished_at, record.seconds = _now(), round(time.monotonic() - started, 1)
        try:
            write_json(RunPaths.of(storage_root, run_id).step_record(step), dataclasses.asdict(record))
        except (OSError, ValueError) as exc:
            log.warning("could not record the outcome of %s: %s", step, exc)


@dataclass
class RunSummary:
    run_id: str
    pipeline_run_id: str
    state: str  # the pipeline's, as KFP reports it: SUCCEEDED, FAILED, CANCELED, ...
    error: str
    finished_at: str
    job: dict[str, str]  # the PyTorchJob's name and namespace, when one was launched
    steps: list[dict[str, Any]]

    def markdown(self) -> str:
        lines = [
            f"# Run {self.run_id}: {self.state}",
            "",
            f"KFP run `{self.pipeline_run_id}`, finished {self.finished_at}.",
        ]
        if self.job:
            lines.append(f"PyTorchJob `{self.job['namespace']}/{self.job['name']}`.")
        if self.error:
            lines += ["", f"Error: {self.error}"]
        lines += ["", "| step | outcome | seconds | detail | reports |", "|---|---|---|---|---|"]
        for step in self.steps:
            detail = step.get("error") or ", ".join(f"{k} {v}" for k, v in sorted(step.get("details", {}).items()))
            reports = " ".join(f"[{name}]({where})" for name, where in sorted(step.get("reports", {}).items()))
            seconds = step.get("seconds", "")
            lines.append(f"| {step['step']} | {step['state']} | {seconds} | {_cell(detail)} | {reports} |")
        return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")[:300]


def read_step(paths: RunPaths, step: str) -> dict[str, Any]:
    try:
        return json.loads(paths.step_record(step).read_text())
    except FileNotFoundError:
        return {"step": step, "state": "no record", "error": "", "reports": {}, "details": {}}
    except (OSError, ValueError) as exc:
        return {"step": step, "state": "unreadable", "error": f"{paths.step_record(step)}: {exc}", "reports": {},
                "details": {}}  # fmt: skip


def summarize_run(storage_root: str, run_id: str, pipeline_run_id: str, state: str, error: str = "") -> RunSummary:
    """Gather the steps' records into summary.json and summary.md under the run's directory."""
    paths = RunPaths.of(storage_root, run_id)
    steps = [read_step(paths, step) for step in STEPS]
    launched = next(s for s in steps if s["step"] == "launch-pytorchjob")["details"]
    job = {"name": launched["job_name"], "namespace": launched["namespace"]} if launched.get("job_name") else {}
    summary = RunSummary(run_id, pipeline_run_id, state, error, _now(), job, steps)
    write_json(paths.summary, dataclasses.asdict(summary))
    with atomic_open(paths.summary_report, "w") as f:
        f.write(summary.markdown())
    return summary
