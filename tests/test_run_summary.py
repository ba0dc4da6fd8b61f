"""The run summary: step records written as steps end, gathered by the exit step."""

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from common.errors import InputError, StepFailed
from components.run_summary.core import STEPS, recorded_step, resolve_run_id, summarize_run
from trainer.layout import RunPaths


def test_the_run_id_comes_from_resume_then_run_id_then_the_kfp_run() -> None:
    assert resolve_run_id("", "", "kfp-uuid") == "kfp-uuid"
    assert resolve_run_id("mine", "", "kfp-uuid") == "mine"
    assert resolve_run_id("", "old", "kfp-uuid") == "old"
    assert resolve_run_id("old", "old", "kfp-uuid") == "old"
    with pytest.raises(InputError, match="name different runs"):
        resolve_run_id("new", "old", "kfp-uuid")


def test_records_and_summary_of_a_failed_run(tmp_path: Path) -> None:
    root = str(tmp_path)
    with recorded_step(root, "r1", "stage-data", {"report": "minio://a/report"}) as record:
        record.state, record.details = "skipped", {"train_tokens": 10}
    with recorded_step(root, "r1", "launch-pytorchjob", {"report": "minio://b/report"}) as record:
        record.details = {"job_name": "hpp-r1-train-0123456789", "namespace": "kubeflow", "job_kind": "TrainJob"}
    with pytest.raises(StepFailed), recorded_step(root, "r1", "verify-nccl", {}):
        raise StepFailed("transport: rank 3 | used Socket")

    summary = summarize_run(root, "r1", "kfp-uuid", "FAILED", "verify-nccl failed")
    paths = RunPaths.of(root, "r1")
    saved = json.loads(paths.summary.read_text())
    assert saved["state"] == "FAILED" and saved["error"] == "verify-nccl failed"
    assert saved["job"] == {"name": "hpp-r1-train-0123456789", "namespace": "kubeflow", "kind": "TrainJob"}
    outcomes = {s["step"]: s["state"] for s in saved["steps"]}
    assert outcomes == {"preflight": "no record", "stage-data": "skipped", "finalize-data": "no record",
                        "launch-pytorchjob": "succeeded", "verify-nccl": "failed",
                        "evaluate-checkpoint": "no record"}  # fmt: skip
    assert [s["step"] for s in saved["steps"]] == list(STEPS)
    assert saved["steps"][4]["error"] == "transport: rank 3 | used Socket"
    markdown = paths.summary_report.read_text()
    assert markdown == summary.markdown()
    assert "| verify-nccl | failed |" in markdown and "rank 3 \\| used Socket" in markdown  # the pipe is escaped
    assert "[report](minio://b/report)" in markdown and "`kubeflow/hpp-r1-train-0123456789`" in markdown


def test_a_record_that_cannot_be_written_does_not_hide_the_step_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(StepFailed, match="the real error"), recorded_step(str(blocker), "r1", "verify-nccl", {}):
        raise StepFailed("the real error")
    with recorded_step(str(tmp_path), "bad/run id", "verify-nccl", {}):
        pass  # an invalid run id is the step's own business: recording only warns


def test_an_unreadable_record_is_reported_not_fatal(tmp_path: Path) -> None:
    paths = RunPaths.of(tmp_path, "r1")
    paths.steps.mkdir(parents=True)
    paths.step_record("stage-data").write_text("{not json")
    summary = summarize_run(str(tmp_path), "r1", "kfp-uuid", "SUCCEEDED")
    assert summary.steps[1]["state"] == "unreadable" and "stage-data.json" in summary.steps[1]["error"]
    assert summary.job == {}


def steps_ending(root: str, run_id: str, last: str, how: str) -> None:
    """Records of the steps up to `last`, which ends as `how`: succeeded, failed, or killed (its record stays at
    "running", as when its pod is killed outright)."""
    for step in STEPS[: STEPS.index(last) + 1]:
        if step != last or how == "succeeded":
            with recorded_step(root, run_id, step, {}):
                pass
        elif how == "failed":
            with pytest.raises(StepFailed), recorded_step(root, run_id, step, {}):
                raise StepFailed("rank 3: NCCL WARN")
        else:  # the step's process killed outright inside its recorded_step, as a pod's SIGKILL does
            script = (f"import os, signal\nfrom components.run_summary.core import recorded_step\n"
                      f"with recorded_step({root!r}, {run_id!r}, {step!r}, {{}}):\n"
                      "    os.kill(os.getpid(), signal.SIGKILL)\n")  # fmt: skip
            assert subprocess.run([sys.executable, "-c", script], timeout=60).returncode == -signal.SIGKILL


@pytest.mark.parametrize(
    ("last", "how", "kfp_state", "state"),
    [
        ("evaluate-checkpoint", "succeeded", "COMPLETE", "SUCCEEDED"),  # KFP 2.14+: MLMD's state of the DAG
        ("evaluate-checkpoint", "succeeded", "SUCCEEDED", "SUCCEEDED"),  # kfp.local
        ("verify-nccl", "failed", "FAILED", "FAILED"),
        ("launch-pytorchjob", "killed", "RUNNING", "TERMINATED"),  # terminated: the launcher never published
        ("stage-data", "succeeded", "FAILED", "INCOMPLETE"),  # the next step never started (its driver failed)
    ],
)
def test_the_state_comes_from_the_steps_records(tmp_path: Path, last: str, how: str, kfp_state: str,
                                                 state: str) -> None:  # fmt: skip
    """A real KFP's final status is MLMD's (COMPLETE/FAILED/RUNNING) with an empty error
    (kubeflow/pipelines backend/src/v2/driver/resolve.go, 2.14-2.17); the steps' own records say what happened."""
    root = str(tmp_path)
    steps_ending(root, "r1", last, how)
    cleanups: list[str] = []
    summary = summarize_run(root, "r1", "kfp-uuid", kfp_state, "", cleanup=lambda: cleanups.append("x") or "done")
    assert (summary.state, summary.kfp_state) == (state, kfp_state)
    assert bool(cleanups) == (state != "SUCCEEDED"), "the job is cleaned up after any run that did not succeed"
    if state == "FAILED":
        assert summary.error == "verify-nccl failed: rank 3: NCCL WARN"
    if state == "TERMINATED":
        assert summary.error.startswith("launch-pytorchjob was stopped while running: the run was terminated")
        assert "| launch-pytorchjob | running |" in summary.markdown()
    if state == "INCOMPLETE":
        assert summary.error == "finalize-data, launch-pytorchjob, verify-nccl, evaluate-checkpoint never ran"


def test_a_failed_cleanup_is_reported_in_the_summary(tmp_path: Path) -> None:
    steps_ending(str(tmp_path), "r1", "launch-pytorchjob", "killed")

    def cleanup() -> str:
        raise StepFailed("Kubernetes API: delete PyTorchJob failed 6 times")

    summary = summarize_run(str(tmp_path), "r1", "kfp-uuid", "RUNNING", cleanup=cleanup)
    assert summary.cleanup == "could not clean up the job: Kubernetes API: delete PyTorchJob failed 6 times"
    assert "Clean-up: could not clean up" in RunPaths.of(tmp_path, "r1").summary_report.read_text()


def test_the_tokenization_groups_records_sit_between_staging_and_its_fan_in(tmp_path: Path) -> None:
    """One record per group of staging's fan-out (tokenize-data-gNNN): a group killed outright leaves "running"."""
    root = str(tmp_path)
    steps_ending(root, "r1", "stage-data", "succeeded")
    with recorded_step(root, "r1", "tokenize-data-g000", {}):
        pass
    script = ("import os, signal\nfrom components.run_summary.core import recorded_step\n"
              f"with recorded_step({root!r}, 'r1', 'tokenize-data-g001', {{}}):\n"
              "    os.kill(os.getpid(), signal.SIGKILL)\n")  # fmt: skip
    assert subprocess.run([sys.executable, "-c", script], timeout=60).returncode == -signal.SIGKILL
    summary = summarize_run(root, "r1", "kfp-uuid", "RUNNING")
    assert [s["step"] for s in summary.steps][1:5] == ["stage-data", "tokenize-data-g000", "tokenize-data-g001",
                                                       "finalize-data"]  # fmt: skip
    assert summary.state == "TERMINATED" and summary.error.startswith("tokenize-data-g001 was stopped while running")
