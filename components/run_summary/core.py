"""The run summary: every step records how it ended on the shared volume, and the pipeline's exit step gathers it.

KFP gives an exit step only the pipeline's final state (`dsl.PipelineTaskFinalStatus`), and an exit step may not
take the outputs of the steps it guards. So each step writes <root>/runs/<run_id>/steps/<step>.json when it
starts ("running") and again as it ends (`recorded_step`), and the exit step (`summarize_run`) reads those into
summary.json and summary.md. The run's state comes from those records, not from KFP: a real KFP (2.14 to 2.17)
reports MLMD's state of the exit handler's DAG (COMPLETE, FAILED, or RUNNING when a step was killed before it
could publish; backend/src/v2/driver/resolve.go) with an empty error, kfp.local reports SUCCEEDED or FAILED. A
step whose record still says "running" was stopped from outside: the run was terminated, or its pod was killed
(deadline, eviction, OOM). KFP's own word is kept beside it as `kfp_state`.

After a run that did not succeed, the exit step also deletes the run's job if it is still running: KFP
runs the exit step after a terminate, when the launcher may have been killed before it could delete the job.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from common.errors import InputError
from trainer.atomic import atomic_open, write_json
from trainer.layout import RunPaths

log = logging.getLogger(__name__)

STEPS = ("preflight", "stage-data", "finalize-data", "launch-pytorchjob", "verify-nccl", "evaluate-checkpoint")
GROUP_STEPS = "tokenize-data-g*"  # one record per group of staging's fan-out, between stage-data and finalize-data


def resolve_run_id(run_id: str, resume_run_id: str, pipeline_run_id: str) -> str:
    """The run directory this pipeline run trains in: a resumed run's, the one named, or the KFP run's id."""
    if resume_run_id and run_id and resume_run_id != run_id:
        raise InputError(f"run_id {run_id!r} and resume_run_id {resume_run_id!r} name different runs: give one")
    return resume_run_id or run_id or pipeline_run_id


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


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
    _write_record(storage_root, run_id, record)  # "running": if the step is killed outright, this stays
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
        _write_record(storage_root, run_id, record)


def _write_record(storage_root: str, run_id: str, record: StepRecord) -> None:
    try:
        write_json(RunPaths.of(storage_root, run_id).step_record(record.step), dataclasses.asdict(record))
    except (OSError, ValueError) as exc:
        log.warning("could not record the outcome of %s: %s", record.step, exc)


SUCCEEDED, FAILED, TERMINATED, INCOMPLETE = "SUCCEEDED", "FAILED", "TERMINATED", "INCOMPLETE"


@dataclass
class RunSummary:
    run_id: str
    pipeline_run_id: str
    state: str  # from the steps' records: SUCCEEDED, FAILED, TERMINATED (a step stopped from outside), INCOMPLETE
    error: str
    finished_at: str
    job: dict[str, str]  # the job's name, namespace and kind (PyTorchJob, TrainJob), when one was launched
    steps: list[dict[str, Any]]
    kfp_state: str = ""  # what KFP said: COMPLETE/FAILED/RUNNING (KFP 2.14+), SUCCEEDED/FAILED (kfp.local)
    cleanup: str = ""  # what the exit step did about a job still running

    def markdown(self) -> str:
        lines = [
            f"# Run {self.run_id}: {self.state}",
            "",
            f"KFP run `{self.pipeline_run_id}`, finished {self.finished_at} "
            f"(KFP's final state: {self.kfp_state or '-'}).",
        ]
        if self.job:
            lines.append(f"{self.job.get('kind', 'PyTorchJob')} `{self.job['namespace']}/{self.job['name']}`.")
        if self.error:
            lines += ["", f"Error: {self.error}"]
        if self.cleanup:
            lines += ["", f"Clean-up: {self.cleanup}"]
        lines += ["", "| step | outcome | seconds | detail | reports |", "|---|---|---|---|---|"]
        for step in self.steps:
            detail = step.get("error") or ", ".join(f"{k} {v}" for k, v in sorted(step.get("details", {}).items()))
            reports = " ".join(f"[{name}]({where})" for name, where in sorted(step.get("reports", {}).items()))
            seconds = step.get("seconds", "")
            lines.append(f"| {step['step']} | {step['state']} | {seconds} | {_cell(detail)} | {reports} |")
        return "\n".join(lines) + "\n"


def run_state(steps: list[dict[str, Any]], kfp_error: str = "") -> tuple[str, str]:
    """The run's state and error from its steps' records (in pipeline order)."""
    failed = [s for s in steps if s["state"] == "failed"]
    if failed:
        return FAILED, kfp_error or f"{failed[0]['step']} failed: {failed[0].get('error', '')}"
    if all(s["state"] in ("succeeded", "skipped") for s in steps):
        return SUCCEEDED, kfp_error
    stopped = [s for s in steps if s["state"] in ("running", "unreadable")]
    if stopped:
        why = "the run was terminated, or the step's pod was killed (its deadline, an eviction, out of memory)"
        return TERMINATED, kfp_error or f"{stopped[0]['step']} was stopped while running: {why}"
    missing = [s["step"] for s in steps if s["state"] == "no record"]
    return INCOMPLETE, kfp_error or f"{', '.join(missing)} never ran"


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


def summarize_run(storage_root: str, run_id: str, pipeline_run_id: str, state: str, error: str = "",
                  cleanup: Callable[[], str] | None = None) -> RunSummary:  # fmt: skip
    """Gather the steps' records into summary.json and summary.md under the run's directory. `state` and `error`
    are KFP's final status; `cleanup` (the job's) is called when the run did not succeed."""
    paths = RunPaths.of(storage_root, run_id)
    groups = [read_step(paths, record.stem) for record in sorted(paths.steps.glob(f"{GROUP_STEPS}.json"))]
    steps = [read_step(paths, step) for step in STEPS]
    steps[STEPS.index("finalize-data") : STEPS.index("finalize-data")] = groups
    launched = next(s for s in steps if s["step"] == "launch-pytorchjob")["details"]
    job = ({"name": launched["job_name"], "namespace": launched["namespace"],
            "kind": launched.get("job_kind", "PyTorchJob")} if launched.get("job_name") else {})  # fmt: skip
    derived, why = run_state(steps, error)
    cleaned = ""
    if derived != SUCCEEDED and cleanup is not None:
        try:
            cleaned = cleanup()
            log.info("clean-up: %s", cleaned)
        except Exception as exc:  # the summary is still written; the log says what is left running
            cleaned = f"could not clean up the job: {exc}"
            log.error("%s", cleaned)
    summary = RunSummary(run_id, pipeline_run_id, derived, why, _now(), job, steps, kfp_state=state, cleanup=cleaned)
    write_json(paths.summary, dataclasses.asdict(summary))
    with atomic_open(paths.summary_report, "w") as f:
        f.write(summary.markdown())
    return summary


def job_cleanup(backend: str, namespace: str, run_id: str, pipeline_run_id: str, job_api: str = "pytorchjob",
                api_client: Any = None) -> Callable[[], str] | None:  # fmt: skip
    """The exit step's clean-up of the run's job (kubernetes backend only), in the compiled job API: named as the
    launcher names it."""
    if backend != "kubernetes":
        return None

    def cleanup() -> str:
        from components.kube import Kube, api_client_from_environment
        from components.launch_pytorchjob.cancel import delete_unfinished_job
        from components.launch_pytorchjob.job_api import job_api as api_named
        from components.launch_pytorchjob.manifest import job_name

        kube = Kube(api_client or api_client_from_environment())
        name = job_name(pipeline_run_id or run_id, run_id)
        return delete_unfinished_job(kube, api_named(job_api), namespace, name, pipeline_run_id)

    return cleanup
