"""The run summary: step records written as steps end, gathered by the exit step."""

import json
from pathlib import Path

import pytest

from components.errors import InputError, StepFailed
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
        record.details = {"job_name": "hpp-r1-train-0123456789", "namespace": "kubeflow"}
    with pytest.raises(StepFailed), recorded_step(root, "r1", "verify-nccl", {}):
        raise StepFailed("transport: rank 3 | used Socket")

    summary = summarize_run(root, "r1", "kfp-uuid", "FAILED", "verify-nccl failed")
    paths = RunPaths.of(root, "r1")
    saved = json.loads(paths.summary.read_text())
    assert saved["state"] == "FAILED" and saved["error"] == "verify-nccl failed"
    assert saved["job"] == {"name": "hpp-r1-train-0123456789", "namespace": "kubeflow"}
    outcomes = {s["step"]: s["state"] for s in saved["steps"]}
    assert outcomes == {"preflight": "no record", "stage-data": "skipped", "launch-pytorchjob": "succeeded",
                        "verify-nccl": "failed", "evaluate-checkpoint": "no record"}  # fmt: skip
    assert [s["step"] for s in saved["steps"]] == list(STEPS)
    assert saved["steps"][3]["error"] == "transport: rank 3 | used Socket"
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
