"""The run summary: every step records how it ended on the shared volume, and the pipeline's exit step gathers it.

KFP gives an exit step only the pipeline's final state (`dsl.PipelineTaskFinalStatus`), and an exit step may not
take the outputs of the steps it guards. So each step writes <root>/runs/<run_id>/steps/<step>.json when it
starts ("running") and again as it ends (`recorded_step`), and the exit step (`summarize_run`) reads those into
summary.json and summary.md. The run's state comes from those records, not from KFP: a real KFP (2.14 to 2.17)
reports MLMD's state of the exit handler's DAG (COMPLETE, FAILED, or RUNNING when a step was killed before it
could publish; backend/src/v2/driver/resolve.go) with an empty error, kfp.local reports SUCCEEDED or FAILED. A
step whose record still says "running" was stopped from outside: the run was terminated, or its pod was killed
(deadline, eviction, OOM). KFP's own word is kept beside it as `kfp_state`.

A run id outlives its pipeline runs: a resume (`resume_run_id`) trains in the same directory, so the steps' records
carry the pipeline run that wrote them, and a summary reads only its own pipeline run's. A step that knows its
pipeline run (the preflight, always the first) names it and so marks the run directory's current pipeline run
(steps/_pipeline_run.json); the steps that are not given it (the verify and evaluate steps) take it from there. A
step retried within one pipeline run rewrites its own record. Each summary is kept (summaries/<pipeline run>.json
and .md); summary.json and summary.md are the newest, and list the earlier ones.

KFP retries a failed step whatever failed it, and neither KFP nor Argo as KFP compiles it retries on some exit codes
only. So a step that failed on its input (an InputError: a source that does not exist, a setting out of bounds) is
marked permanent in its record, and a retry of it in the same pipeline run fails at once with the recorded reason,
doing nothing; any other failure (a lost node, a timeout, a flaky call) is retried as KFP's retry policy says.

After a run that did not succeed, the exit step also deletes the run's job if it is still running: KFP
runs the exit step after a terminate, when the launcher may have been killed before it could delete the job.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from common.errors import InputError
from trainer.atomic import atomic_open, read_json_lines, write_json
from trainer.layout import RunPaths
from trainer.tracking import end_run, record_outcome, watch_line, where_to_look

log = logging.getLogger(__name__)

STEPS = ("preflight", "stage-data", "finalize-data", "launch-pytorchjob", "verify-nccl", "evaluate-checkpoint")
GROUP_STEPS = "tokenize-data-g*"  # one record per group of staging's fan-out, between stage-data and finalize-data
PIPELINE_RUN_MARKER = "_pipeline_run.json"  # in steps/: the pipeline run now using the run directory (no step's name)
SUMMARIES = "summaries"  # <run>/summaries/<pipeline run>.json and .md: every pipeline run's summary, kept
DETAIL_CHARS = 300  # a step's detail in summary.md's table; summary.json keeps it whole


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
    pipeline_run_id: str = ""  # the pipeline run that ran the step: a resume's summary leaves an earlier run's out
    attempt: int = 1  # 1, then +1 each time the same pipeline run starts the step again (KFP's retry)
    permanent: bool = False  # it failed on its input (an InputError): the same pipeline run does not run it again


NOT_RETRIED = "(not retried: it failed the same way on attempt {attempt})"


@contextmanager
def recorded_step(
    storage_root: str, run_id: str, step: str, reports: dict[str, str], pipeline_run_id: str = ""
) -> Iterator[StepRecord]:
    """Record the step's outcome as it ends, success or not; recording never hides the step's own error.

    `pipeline_run_id` (KFP's run id) marks the run directory as this pipeline run's; a step not given it is
    recorded under the pipeline run the directory was last marked with (the first step of every pipeline run
    marks it). A step that failed on its input earlier in this pipeline run is not run again: the retry raises
    the recorded reason at once and leaves the record, with that reason, as it is."""
    record = StepRecord(
        step, reports=dict(reports), pipeline_run_id=_pipeline_run(storage_root, run_id, pipeline_run_id)
    )
    earlier = _earlier_attempt(storage_root, run_id, record)
    if earlier.get("permanent") and earlier.get("state") == "failed":
        reason = earlier.get("error") or "it recorded no reason"
        raise InputError(f"{reason} {NOT_RETRIED.format(attempt=_attempt(earlier))}")
    record.attempt = _attempt(earlier) + 1 if earlier else 1
    started = time.monotonic()
    _write_record(storage_root, run_id, record)  # "running": if the step is killed outright, this stays
    try:
        yield record
        if record.state == "running":
            record.state = "succeeded"
    except BaseException as exc:
        record.state = "failed"
        record.error = str(exc) or type(exc).__name__
        record.permanent = isinstance(exc, InputError)
        raise
    finally:
        record.finished_at, record.seconds = _now(), round(time.monotonic() - started, 1)
        _write_record(storage_root, run_id, record)


def _earlier_attempt(storage_root: str, run_id: str, record: StepRecord) -> dict[str, Any]:
    """The step's record from an earlier attempt in the same pipeline run (KFP's retry), or {}: a record of another
    pipeline run (a resume's run directory holds them), or of none (the CLI, tests), is not an earlier attempt."""
    if not record.pipeline_run_id:
        return {}
    try:
        earlier = json.loads(RunPaths.of(storage_root, run_id).step_record(record.step).read_text())
    except (OSError, ValueError):
        return {}
    ours = isinstance(earlier, dict) and earlier.get("pipeline_run_id") == record.pipeline_run_id
    return earlier if ours else {}


def _attempt(record: dict[str, Any]) -> int:
    """A record's attempt (1 in a record written before attempts were counted)."""
    attempt = record.get("attempt", 1)
    return attempt if isinstance(attempt, int) and attempt > 0 else 1


def _pipeline_run(storage_root: str, run_id: str, pipeline_run_id: str) -> str:
    """The pipeline run a step's record belongs to: the one given (marked as the run directory's current one), or
    the one marked. Recording only warns: a step is never failed by its record."""
    try:
        marker = RunPaths.of(storage_root, run_id).steps / PIPELINE_RUN_MARKER
        if not pipeline_run_id:
            marked = current_pipeline_run(marker)
            if not marked:
                log.warning(
                    "run %s: no pipeline run has marked it (steps/%s): this record names none",
                    run_id,
                    PIPELINE_RUN_MARKER,
                )
            return marked
        if current_pipeline_run(marker) != pipeline_run_id:
            write_json(marker, {"pipeline_run_id": pipeline_run_id, "since": _now()})
            log.info("run %s: its steps now record pipeline run %s", run_id, pipeline_run_id)
    except (OSError, ValueError) as exc:
        log.warning("run %s: could not mark its pipeline run: %s", run_id, exc)
    return pipeline_run_id


def current_pipeline_run(marker: Path) -> str:
    """The pipeline run the marker names; empty when there is none or it cannot be read."""
    try:
        return str(json.loads(marker.read_text()).get("pipeline_run_id", ""))
    except (OSError, ValueError, AttributeError):
        return ""


def _write_record(storage_root: str, run_id: str, record: StepRecord) -> None:
    try:
        write_json(RunPaths.of(storage_root, run_id).step_record(record.step), dataclasses.asdict(record))
    except (OSError, ValueError) as exc:
        log.warning("could not record the outcome of %s: %s", record.step, exc)


SUCCEEDED, FAILED, TERMINATED, INCOMPLETE = "SUCCEEDED", "FAILED", "TERMINATED", "INCOMPLETE"
NO_RECORD = "no record"  # the step did not start in this pipeline run (an earlier run's record does not count)
UPLOADED_WHEN = ("succeeded", "skipped")  # KFP's launcher uploads a step's output artifacts only when it exits 0
_REMOTE = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")  # minio://, s3://, gs://: a KFP artifact, not on the volume
# The error kfp.local hands the exit step ("Task exit-handler-1 failed."): its own name for the group that failed
_KFP_TASK_FAILED = re.compile(r"^Task (?P<task>\S+) failed\.?$")
_KFP_GROUPS = re.compile(r"^(exit-handler|condition|for-loop|condition-branches)-\d+$")


@dataclass
class RunSummary:
    run_id: str
    pipeline_run_id: str
    state: str  # from the steps' records: SUCCEEDED, FAILED, TERMINATED (a step stopped from outside), INCOMPLETE
    error: str  # in our words, from the records: the failed step and its own reason
    finished_at: str
    job: dict[str, str]  # the job's name, namespace and kind (PyTorchJob, TrainJob), when one was launched
    steps: list[dict[str, Any]]  # this pipeline run's records; `reports` only those there, `missing_reports` not
    kfp_state: str = ""  # what KFP said: COMPLETE/FAILED/RUNNING (KFP 2.14+), SUCCEEDED/FAILED (kfp.local)
    cleanup: str = ""  # what the exit step did about a job still running
    kfp_error: str = ""  # KFP's error as given: empty from a real KFP, "Task exit-handler-1 failed." from kfp.local
    earlier: dict[str, str] = field(default_factory=dict)  # the run id's earlier pipeline runs -> their summary.md
    watch: dict[str, str] = field(default_factory=dict)  # its TensorBoard directory and MLflow run: where to look
    mixture: list[dict[str, Any]] = field(default_factory=list)  # a mixture's datasets: share, tokens, epochs so far

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
        if watch := watch_line(self.watch):
            lines += ["", watch]
        if self.mixture:
            each = "; ".join(
                f"{m['dataset']} {m['share']:.1%} (weight {m['weight']:g}): {m['tokens']:,} tokens, "
                f"{m['epochs']:.2f} epochs"
                for m in self.mixture
            )
            lines += ["", f"Mixture: {each}."]
        lines += ["", "| step | outcome | seconds | detail | reports |", "|---|---|---|---|---|"]
        for step in self.steps:
            reports = " ".join(f"[{name}]({where})" for name, where in sorted(step.get("reports", {}).items()))
            seconds = step.get("seconds", "")
            lines.append(f"| {step['step']} | {step['state']} | {seconds} | {_cell(_detail(step))} | {reports} |")
        if self.earlier:
            runs = ", ".join(f"[{run}]({where})" for run, where in self.earlier.items())
            lines += ["", f"Earlier pipeline runs of this run, newest first: {runs}."]
        return "\n".join(lines) + "\n"


def _detail(step: dict[str, Any]) -> str:
    """A failed step's error, else its details; a `reason` (why a step was skipped) reads as itself."""
    if step.get("error"):
        return str(step["error"])
    details = dict(step.get("details", {}))
    reason = [str(details.pop("reason"))] if "reason" in details else []
    return ", ".join(reason + [f"{k} {v}" for k, v in sorted(details.items())])


def run_state(steps: list[dict[str, Any]], kfp_state: str = "", kfp_error: str = "") -> tuple[str, str]:
    """The run's state and error from its steps' records (in pipeline order), in our words: KFP's error names at
    most a task of its own ("Task exit-handler-1 failed."), the failed step's record says why."""
    failed = [s for s in steps if s["state"] == "failed"]
    kfp = kfp_words(kfp_error)
    if failed:
        return FAILED, f"{failed[0]['step']} failed: {failed[0].get('error') or 'it recorded no reason'}"
    if all(s["state"] in UPLOADED_WHEN for s in steps):
        if kfp_state == FAILED:  # e.g. a step's outputs could not be saved after its work succeeded
            return FAILED, (
                f"every step recorded its success, but KFP failed the run ({kfp or 'it gave no reason'}): "
                "see the failed step's log in KFP"
            )
        return SUCCEEDED, ""
    also = f" ({kfp})" if kfp else ""
    stopped = [s for s in steps if s["state"] in ("running", "unreadable")]
    if stopped:
        why = "the run was terminated, or the step's pod was killed (its deadline, an eviction, out of memory)"
        return TERMINATED, f"{stopped[0]['step']} was stopped while running: {why}{also}"
    missing = [s["step"] for s in steps if s["state"] == NO_RECORD]
    return INCOMPLETE, f"{', '.join(missing)} never ran{also}"


def kfp_words(kfp_error: str) -> str:
    """KFP's error for the exit step, said in ours: empty when it only names a group of KFP's own (the failed step
    itself is in the records), "KFP: step X failed" when it names a step, else KFP's text."""
    error = " ".join(kfp_error.split())
    named = _KFP_TASK_FAILED.match(error)
    if named and _KFP_GROUPS.match(named["task"]):
        return ""
    if named:
        return f"KFP: step {named['task']} failed"
    return f"KFP: {error}" if error else ""


def shorten(text: str, limit: int = DETAIL_CHARS) -> str:
    """`text` on one line, at most `limit` characters: cut at a word with an ellipsis, as a word cut in half reads as
    another word (a path, a number); only a single word longer than half the limit is cut inside."""
    text = " ".join(text.split())
    if len(text) <= limit:
        return text
    cut = text[: limit - 1]
    if text[limit - 1] != " ":  # the cut falls inside a word: end at the word before it
        space = cut.rfind(" ")
        if space > limit // 2:
            cut = cut[:space]
    return cut.rstrip(" ,;:") + "…"


def _cell(text: str) -> str:
    return shorten(text).replace("|", "\\|")


def _no_record(step: str) -> dict[str, Any]:
    return {"step": step, "state": NO_RECORD, "error": "", "reports": {}, "details": {}}


def read_step(paths: RunPaths, step: str) -> dict[str, Any]:
    try:
        return json.loads(paths.step_record(step).read_text())
    except FileNotFoundError:
        return _no_record(step)
    except (OSError, ValueError) as exc:
        return {
            "step": step,
            "state": "unreadable",
            "error": f"{paths.step_record(step)}: {exc}",
            "reports": {},
            "details": {},
        }


def _ours(record: dict[str, Any], pipeline_run_id: str, marked: str) -> bool:
    """Whether a record belongs to this pipeline run. An earlier pipeline run's (a resume's run directory holds them)
    does not. One that names none was written outside a pipeline run (a test, the CLI) or before records named
    theirs: it counts only while no pipeline run has marked the directory (`marked`), as then it cannot be told
    apart. An unreadable one counts: it names nothing, and the summary says it could not be read."""
    if not pipeline_run_id or record["state"] in (NO_RECORD, "unreadable"):
        return True
    named = record.get("pipeline_run_id", "")
    return named == pipeline_run_id or (not named and not marked)


def _with_existing_reports(record: dict[str, Any]) -> dict[str, Any]:
    """The record with only the reports that are there: a file on the volume (or kfp.local's artifacts) that
    exists, a KFP artifact of a step that ended well (KFP uploads none for a failed or killed step)."""
    there: dict[str, str] = {}
    missing: dict[str, str] = {}
    for name, where in record.get("reports", {}).items():
        (there if _exists(str(where), record["state"]) else missing)[name] = where
    return {**record, "reports": there, **({"missing_reports": missing} if missing else {})}


def _exists(where: str, state: str) -> bool:
    if where.startswith("file://"):
        where = where.removeprefix("file://")
    elif _REMOTE.match(where):
        return state in UPLOADED_WHEN
    try:
        return bool(where) and Path(where).exists()
    except OSError:
        return False


def summarize_run(
    storage_root: str,
    run_id: str,
    pipeline_run_id: str,
    state: str,
    error: str = "",
    cleanup: Callable[[], str] | None = None,
) -> RunSummary:
    """Gather this pipeline run's step records into summary.json and summary.md under the run's directory, and keep
    them as summaries/<pipeline run>.json and .md. `state` and `error` are KFP's final status; `cleanup` (the
    job's) is called when the run did not succeed. The run's MLflow run, if it has one, gets the summary and ends
    with the run's outcome (mlflow_status); a resume's trainer sets it running again."""
    paths = RunPaths.of(storage_root, run_id)
    fanned = [read_step(paths, record.stem) for record in sorted(paths.steps.glob(f"{GROUP_STEPS}.json"))]
    marked = current_pipeline_run(paths.steps / PIPELINE_RUN_MARKER)
    groups = [
        g for g in fanned if _ours(g, pipeline_run_id, marked)
    ]  # an earlier run's fan-out may have had more groups
    records = {name: read_step(paths, name) for name in STEPS}
    steps = [r if _ours(r, pipeline_run_id, marked) else _no_record(name) for name, r in records.items()]
    steps[STEPS.index("finalize-data") : STEPS.index("finalize-data")] = groups
    steps = [_with_existing_reports(s) for s in steps]
    launched = next(s for s in steps if s["step"] == "launch-pytorchjob")["details"]
    job = (
        {
            "name": launched["job_name"],
            "namespace": launched["namespace"],
            "kind": launched.get("job_kind", "PyTorchJob"),
        }
        if launched.get("job_name")
        else {}
    )
    derived, why = run_state(steps, state, error)
    cleaned = ""
    if derived != SUCCEEDED and cleanup is not None:
        try:
            cleaned = cleanup()
            log.info("clean-up: %s", cleaned)
        except Exception as exc:  # the summary is still written; the log says what is left running
            cleaned = f"could not clean up the job: {exc}"
            log.error("%s", cleaned)
    own = _summary_name(pipeline_run_id)
    _keep_previous_summary(paths)
    summary = RunSummary(
        run_id,
        pipeline_run_id,
        derived,
        why,
        _now(),
        job,
        steps,
        kfp_state=state,
        cleanup=cleaned,
        kfp_error=error,
        earlier=_earlier_summaries(paths, own),
        watch=where_to_look(paths.root),
        mixture=mixture_accounting(paths),
    )
    kept = paths.root / SUMMARIES
    for path in (kept / f"{own}.json", paths.summary):
        write_json(path, dataclasses.asdict(summary))
    for path in (kept / f"{own}.md", paths.summary_report):
        with atomic_open(path, "w") as f:
            f.write(summary.markdown())
    record_outcome(paths.root, None, {}, [paths.summary_report, paths.summary], {"pipeline_state": derived}, "summary")
    end_run(paths.root, mlflow_status(derived, state))
    return summary


def mlflow_status(state: str, kfp_state: str) -> str:
    """How the run's MLflow run ends: FINISHED when it succeeded, KILLED when it was stopped from outside (a step
    killed while running, or a run KFP says was cancelled before its next step), else FAILED."""
    if state == SUCCEEDED:
        return "FINISHED"
    if state == TERMINATED or (state == INCOMPLETE and kfp_state.upper().startswith("CANCEL")):
        return "KILLED"
    return "FAILED"


def mixture_accounting(paths: RunPaths) -> list[dict[str, Any]]:
    """A mixture run's datasets (config.json) with the tokens and epochs of each the last metrics row counted; [] for
    a run of one dataset, or one that never started."""
    try:
        mixture = json.loads(paths.config.read_text())["dataset"].get("mixture") or []
    except (OSError, ValueError, KeyError, AttributeError):
        return []
    rows = [r for r in read_json_lines(paths.metrics) if isinstance(r.get("datasets"), dict)]
    counted = rows[-1]["datasets"] if rows else {}
    return [
        {
            "dataset": m["dataset"],
            "weight": m["weight"],
            "share": m["share"],
            "snapshot": m["snapshot"],
            "tokens": counted.get(m["dataset"], {}).get("tokens", 0),
            "epochs": counted.get(m["dataset"], {}).get("epochs", 0.0),
        }
        for m in mixture
    ]


def _summary_name(pipeline_run_id: str) -> str:
    """A file name for the pipeline run's summary: KFP's run id is a UUID, kfp.local's a number; anything else is
    made safe, and a summary of no pipeline run is named by its time."""
    name = re.sub(r"[^A-Za-z0-9._-]", "_", pipeline_run_id).lstrip(".")
    return name or f"unknown-{datetime.now(UTC).strftime('%Y%m%dT%H%M%S')}"


def _keep_previous_summary(paths: RunPaths) -> None:
    """A summary written before summaries were kept per pipeline run (only summary.json and .md) is kept under
    summaries/ before the new one replaces it."""
    try:
        previous = json.loads(paths.summary.read_text())
        kept = paths.root / SUMMARIES / _summary_name(str(previous["pipeline_run_id"]))
        if not Path(f"{kept}.json").exists():
            kept.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(paths.summary, f"{kept}.json")
            if paths.summary_report.exists():
                shutil.copyfile(paths.summary_report, f"{kept}.md")
    except FileNotFoundError:
        return
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("could not keep the previous summary %s: %s", paths.summary, exc)


def _earlier_summaries(paths: RunPaths, own: str) -> dict[str, str]:
    """The run id's other pipeline runs' summaries, newest first: pipeline run -> its summary.md."""
    found = [p for p in (paths.root / SUMMARIES).glob("*.md") if p.name != f"{own}.md"]
    found.sort(key=lambda p: (p.stat().st_mtime_ns, p.name), reverse=True)
    return {p.stem: str(p) for p in found}


def job_cleanup(
    backend: str, namespace: str, run_id: str, pipeline_run_id: str, job_api: str = "pytorchjob", api_client: Any = None
) -> Callable[[], str] | None:
    """The exit step's clean-up of the run's job (kubernetes backend only), in the compiled job API: named as the
    launcher names it."""
    if backend != "kubernetes":
        return None

    def cleanup() -> str:
        from components.kube import Kube, api_client_from_environment
        from components.launch_training.apis import job_api as api_named
        from components.launch_training.cancel import delete_unfinished_job
        from components.launch_training.manifest import job_name

        kube = Kube(api_client or api_client_from_environment())
        name = job_name(pipeline_run_id or run_id, run_id)
        return delete_unfinished_job(kube, api_named(job_api), namespace, name, pipeline_run_id)

    return cleanup
