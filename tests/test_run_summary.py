"""The run summary: step records written as steps end, gathered by the exit step."""

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from common.errors import InputError, StepFailed
from components.run_summary.core import (
    STEPS,
    kfp_words,
    recorded_step,
    resolve_run_id,
    shorten,
    summarize_run,
)
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

    summary = summarize_run(root, "r1", "kfp-uuid", "FAILED", "")
    paths = RunPaths.of(root, "r1")
    saved = json.loads(paths.summary.read_text())
    assert saved["state"] == "FAILED" and saved["error"] == "verify-nccl failed: transport: rank 3 | used Socket"
    assert saved["job"] == {"name": "hpp-r1-train-0123456789", "namespace": "kubeflow", "kind": "TrainJob"}
    outcomes = {s["step"]: s["state"] for s in saved["steps"]}
    assert outcomes == {
        "preflight": "no record",
        "stage-data": "skipped",
        "finalize-data": "no record",
        "launch-pytorchjob": "succeeded",
        "verify-nccl": "failed",
        "evaluate-checkpoint": "no record",
    }
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


def steps_ending(root: str, run_id: str, last: str, how: str, pipeline_run_id: str = "") -> None:
    """Records of the steps up to `last`, which ends as `how`: succeeded, failed, or killed (its record stays at
    "running", as when its pod is killed outright). The first names `pipeline_run_id`, as the preflight does."""
    for step in STEPS[: STEPS.index(last) + 1]:
        if step != last or how == "succeeded":
            with recorded_step(root, run_id, step, {}, pipeline_run_id if step == STEPS[0] else ""):
                pass
        elif how == "failed":
            with pytest.raises(StepFailed), recorded_step(root, run_id, step, {}):
                raise StepFailed("rank 3: NCCL WARN")
        else:  # the step's process killed outright inside its recorded_step, as a pod's SIGKILL does
            script = (
                f"import os, signal\nfrom components.run_summary.core import recorded_step\n"
                f"with recorded_step({root!r}, {run_id!r}, {step!r}, {{}}):\n"
                "    os.kill(os.getpid(), signal.SIGKILL)\n"
            )
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
def test_the_state_comes_from_the_steps_records(
    tmp_path: Path, last: str, how: str, kfp_state: str, state: str
) -> None:
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
    script = (
        "import os, signal\nfrom components.run_summary.core import recorded_step\n"
        f"with recorded_step({root!r}, 'r1', 'tokenize-data-g001', {{}}):\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    assert subprocess.run([sys.executable, "-c", script], timeout=60).returncode == -signal.SIGKILL
    summary = summarize_run(root, "r1", "kfp-uuid", "RUNNING")
    assert [s["step"] for s in summary.steps][1:5] == [
        "stage-data",
        "tokenize-data-g000",
        "tokenize-data-g001",
        "finalize-data",
    ]
    assert summary.state == "TERMINATED" and summary.error.startswith("tokenize-data-g001 was stopped while running")


# -- true summaries: one pipeline run's own records, every summary kept, only reports that exist, our words ------


def test_a_failed_resumes_summary_lists_no_step_of_the_earlier_pipeline_run(tmp_path: Path) -> None:
    """A resume trains in the earlier pipeline run's directory: its summary reads only its own records (the first
    step names the pipeline run; the others take it from the directory's mark), and the earlier summary is kept."""
    root, paths = str(tmp_path), RunPaths.of(tmp_path, "r1")
    for step in STEPS:  # the first pipeline run: every step ends well, staging in two groups
        with recorded_step(root, "r1", step, {}, "kfp-1" if step == "preflight" else "") as record:
            record.details = {"val_loss": 6.3576} if step == "evaluate-checkpoint" else {}
        if step == "stage-data":
            for group in ("tokenize-data-g000", "tokenize-data-g001"):
                with recorded_step(root, "r1", group, {}):
                    pass
    first = summarize_run(root, "r1", "kfp-1", "SUCCEEDED")
    assert first.state == "SUCCEEDED" and {s["pipeline_run_id"] for s in first.steps} == {"kfp-1"}

    with recorded_step(root, "r1", "preflight", {}, "kfp-2"):  # the resume: marks the run directory as its own
        pass
    with recorded_step(root, "r1", "stage-data", {}) as record:
        record.state = "skipped"
    with recorded_step(root, "r1", "tokenize-data-g000", {}):
        pass
    with pytest.raises(InputError), recorded_step(root, "r1", "finalize-data", {}):
        raise InputError("dataset 'corpus' is not staged")
    summary = summarize_run(root, "r1", "kfp-2", "FAILED", "Task exit-handler-1 failed.")  # kfp.local's words

    outcomes = {s["step"]: s["state"] for s in summary.steps}
    assert outcomes == {
        "preflight": "succeeded",
        "stage-data": "skipped",
        "tokenize-data-g000": "succeeded",
        "finalize-data": "failed",
        "launch-pytorchjob": "no record",
        "verify-nccl": "no record",
        "evaluate-checkpoint": "no record",
    }
    assert {s.get("pipeline_run_id") for s in summary.steps if s["state"] != "no record"} == {"kfp-2"}
    assert summary.error == "finalize-data failed: dataset 'corpus' is not staged"
    assert summary.kfp_error == "Task exit-handler-1 failed."  # kept in summary.json, as KFP said it
    markdown = paths.summary_report.read_text()
    assert "6.3576" not in markdown and "exit-handler" not in markdown
    kept = paths.root / "summaries"
    assert sorted(p.name for p in kept.iterdir()) == ["kfp-1.json", "kfp-1.md", "kfp-2.json", "kfp-2.md"]
    assert "val_loss 6.3576" in (kept / "kfp-1.md").read_text() and first.markdown() == (kept / "kfp-1.md").read_text()
    assert (kept / "kfp-2.md").read_text() == markdown and (
        kept / "kfp-2.json"
    ).read_text() == paths.summary.read_text()
    assert summary.earlier == {"kfp-1": str(kept / "kfp-1.md")} and f"[kfp-1]({kept / 'kfp-1.md'})" in markdown


def test_a_retried_step_updates_its_record_and_an_older_summary_is_kept(tmp_path: Path) -> None:
    """KFP's retry runs a step again in the same pipeline run: its last outcome is the one summarized. A summary
    written before summaries were kept per pipeline run is kept before the new one replaces it."""
    root, paths = str(tmp_path), RunPaths.of(tmp_path, "r1")
    paths.root.mkdir(parents=True)
    paths.summary.write_text(json.dumps({"pipeline_run_id": "kfp-0", "state": "FAILED"}))
    paths.summary_report.write_text("# Run r1: FAILED\n")
    steps_ending(root, "r1", "launch-pytorchjob", "succeeded", "kfp-1")
    with pytest.raises(StepFailed), recorded_step(root, "r1", "verify-nccl", {}):
        raise StepFailed("rank 3: NCCL WARN")
    with recorded_step(root, "r1", "verify-nccl", {}):  # the retry
        pass
    with recorded_step(root, "r1", "evaluate-checkpoint", {}):
        pass
    summary = summarize_run(root, "r1", "kfp-1", "COMPLETE")
    assert summary.state == "SUCCEEDED" and summary.steps[STEPS.index("verify-nccl")]["error"] == ""
    assert (paths.root / "summaries" / "kfp-0.md").read_text() == "# Run r1: FAILED\n"
    assert list(summary.earlier) == ["kfp-0"]


def test_a_step_that_failed_on_its_input_is_not_retried_in_the_same_pipeline_run(tmp_path: Path) -> None:
    """KFP retries any failed step: a retry of a step that failed on its input (an InputError) fails at once with the
    recorded reason, without running its body, and the record keeps the step's own reason for the summary."""
    root, ran = str(tmp_path), []
    steps_ending(root, "r1", "preflight", "succeeded", "kfp-1")  # marks the run directory as pipeline run kfp-1
    missing = "source s3://corpus/missing: no objects under prefix 'missing/'"
    with pytest.raises(InputError), recorded_step(root, "r1", "stage-data", {}):
        ran.append(1)
        raise InputError(missing)
    for _ in range(2):  # KFP's two retries
        with pytest.raises(InputError) as refused, recorded_step(root, "r1", "stage-data", {}):
            ran.append(2)
        assert str(refused.value) == f"{missing} (not retried: it failed the same way on attempt 1)"
    assert ran == [1]
    record = json.loads(RunPaths.of(tmp_path, "r1").step_record("stage-data").read_text())
    assert (record["state"], record["error"], record["permanent"], record["attempt"]) == ("failed", missing, True, 1)
    summary = summarize_run(root, "r1", "kfp-1", "FAILED")
    assert summary.error == f"stage-data failed: {missing}"  # the step's own reason, not the refusal's wrapper


def test_a_transient_failure_is_retried_and_the_attempts_are_counted(tmp_path: Path) -> None:
    """Any other failure (a lost node, a timeout) may pass: KFP's retry runs the step's body again; an input failure
    on the second attempt is then what a third refuses, naming that attempt."""
    root, ran = str(tmp_path), []
    steps_ending(root, "r1", "preflight", "succeeded", "kfp-1")
    with pytest.raises(StepFailed), recorded_step(root, "r1", "verify-nccl", {}):
        ran.append(1)
        raise StepFailed("the API server timed out")
    with pytest.raises(InputError), recorded_step(root, "r1", "verify-nccl", {}) as record:
        ran.append(record.attempt)
        raise InputError("expected transport 'efaa': choose one of efa, ib, socket, any")
    with pytest.raises(InputError, match=r"efaa.*\(not retried: it failed the same way on attempt 2\)$"):
        with recorded_step(root, "r1", "verify-nccl", {}):
            ran.append(3)
    assert ran == [1, 2]


def test_an_input_failure_of_another_pipeline_run_does_not_block(tmp_path: Path) -> None:
    """A resume (another pipeline run in the same run directory) or a run outside any pipeline run starts the step
    afresh: only a retry within the pipeline run that failed is refused."""
    root, ran = str(tmp_path), []
    steps_ending(root, "r1", "preflight", "succeeded", "kfp-1")
    with pytest.raises(InputError), recorded_step(root, "r1", "stage-data", {}):
        raise InputError("source /data/corpus: does not exist")
    with recorded_step(root, "r1", "preflight", {}, "kfp-2"):  # the next pipeline run marks the directory
        pass
    with recorded_step(root, "r1", "stage-data", {}) as record:
        ran.append(record.attempt)
    with pytest.raises(InputError), recorded_step(root, "r2", "stage-data", {}):  # no pipeline run named: the CLI
        raise InputError("source /data/corpus: does not exist")
    with recorded_step(root, "r2", "stage-data", {}) as record:
        ran.append(record.attempt)
    assert ran == [1, 1]


def test_only_reports_that_exist_are_linked(tmp_path: Path) -> None:
    """KFP uploads a step's artifacts only when it exits 0: a failed step's artifact URI leads nowhere, and a path
    on the volume is linked only when the file is there."""
    root = str(tmp_path)
    there = tmp_path / "comms.md"
    there.write_text("ok")
    with recorded_step(root, "r1", "preflight", {"report": "minio://mlpipeline/preflight/report"}, "kfp-1"):
        pass
    reports = {
        "report": "minio://mlpipeline/verify/report",
        "volume": str(there),
        "log": str(tmp_path / "none.md"),
        "local": f"file://{there}",
    }
    with pytest.raises(StepFailed), recorded_step(root, "r1", "verify-nccl", reports):
        raise StepFailed("transport: used Socket")
    summary = summarize_run(root, "r1", "kfp-1", "FAILED")
    verify = summary.steps[STEPS.index("verify-nccl")]
    assert verify["reports"] == {"volume": str(there), "local": f"file://{there}"}
    assert verify["missing_reports"] == {"report": "minio://mlpipeline/verify/report", "log": str(tmp_path / "none.md")}
    markdown = summary.markdown()
    assert "minio://mlpipeline/verify/report" not in markdown and "none.md" not in markdown
    assert "[report](minio://mlpipeline/preflight/report)" in markdown and f"[volume]({there})" in markdown


def test_a_long_detail_is_cut_at_a_word(tmp_path: Path) -> None:
    words = " ".join(f"word{i:03d}" for i in range(100))  # 799 characters, every word 7 long
    assert shorten(words, 40) == "word000 word001 word002 word003 word004…"
    assert shorten("short | text\nhere", 40) == "short | text here"
    assert shorten("x" * 50, 40) == "x" * 39 + "…"  # one word longer than the cell: cut inside it, marked
    with pytest.raises(StepFailed), recorded_step(str(tmp_path), "r1", "verify-nccl", {}):
        raise StepFailed(words)
    summary = summarize_run(str(tmp_path), "r1", "kfp-1", "FAILED")
    row = next(line for line in summary.markdown().splitlines() if line.startswith("| verify-nccl |"))
    detail = row.split(" | ")[3]
    assert detail.endswith("…") and detail[:-1].split()[-1] in words.split() and len(detail) <= 300
    assert summary.steps[STEPS.index("verify-nccl")]["error"] == words  # summary.json keeps it whole


def test_kfps_exit_handler_wording_becomes_ours(tmp_path: Path) -> None:
    """kfp.local hands the exit step "Task exit-handler-1 failed." (a real KFP, an empty error): the summary says
    which step failed and why, from its record, or what KFP said in our words when no record says."""
    assert kfp_words("Task exit-handler-1 failed.") == "" and kfp_words("") == ""
    assert kfp_words("Task stage-data failed.") == "KFP: step stage-data failed"
    assert kfp_words("pod deleted") == "KFP: pod deleted"
    root = str(tmp_path)
    steps_ending(root, "r1", "evaluate-checkpoint", "succeeded", "kfp-1")
    summary = summarize_run(root, "r1", "kfp-1", "FAILED", "Task exit-handler-1 failed.")
    assert summary.state == "FAILED" and "exit-handler" not in summary.markdown()
    assert summary.error.startswith("every step recorded its success, but KFP failed the run (it gave no reason)")
    steps_ending(root, "r2", "stage-data", "succeeded", "kfp-2")
    summary = summarize_run(root, "r2", "kfp-2", "FAILED", "Task finalize-data failed.")
    assert summary.state == "INCOMPLETE"
    assert summary.error == (
        "finalize-data, launch-pytorchjob, verify-nccl, evaluate-checkpoint never ran (KFP: step finalize-data failed)"
    )


def test_records_outside_a_pipeline_run_count_until_one_marks_the_run(tmp_path: Path) -> None:
    """A step recorded outside a pipeline run (a test, the CLI) names none: it counts while no pipeline run has
    marked the directory; once one has, a record naming none is an earlier one's."""
    root = str(tmp_path)
    with recorded_step(root, "r1", "stage-data", {}):
        pass
    assert summarize_run(root, "r1", "kfp-1", "RUNNING").steps[1]["state"] == "succeeded"
    with recorded_step(root, "r1", "preflight", {}, "kfp-1"):
        pass
    assert summarize_run(root, "r1", "kfp-1", "RUNNING").steps[1]["state"] == "no record"


def test_a_local_preflight_is_skipped_without_a_verdict(tmp_path: Path) -> None:
    """With the local backend there is no cluster: every check is n/a, so the step is skipped, with its reason."""
    from kfp import dsl

    from components.preflight.component import preflight

    report = dsl.Markdown(uri=str(tmp_path / "report.md"))
    preflight.python_func(
        storage_root=str(tmp_path),
        dataset="corpus",
        run_id="r1",
        resume_run_id="",
        pipeline_run_id="kfp-1",
        backend="local",
        nnodes=1,
        max_nodes=0,
        nproc_per_node=2,
        preset="tiny",
        init_from_model="",
        mlflow_tracking_uri="",
        image="",
        namespace="kubeflow",
        instance_type="ml.p5.48xlarge",
        job_options={},
        platform={},
        evaluation={"gpus": 1, "cpu": "8", "memory": "32Gi"},
        warn_only=False,
        report=report,
    )
    record = json.loads(RunPaths.of(tmp_path, "r1").step_record("preflight").read_text())
    assert (record["state"], record["details"], record["pipeline_run_id"]) == (
        "skipped",
        {"reason": "backend local: no cluster to check"},
        "kfp-1",
    )
    markdown = summarize_run(str(tmp_path), "r1", "kfp-1", "RUNNING").markdown()
    row = next(line for line in markdown.splitlines() if line.startswith("| preflight |"))
    assert row.startswith("| preflight | skipped |") and "backend local: no cluster to check" in row
    assert "verdict" not in row and f"[report]({tmp_path / 'report.md'})" in row


@pytest.mark.parametrize(
    ("last", "how", "kfp_state", "status"),
    [
        ("evaluate-checkpoint", "succeeded", "COMPLETE", "FINISHED"),
        ("verify-nccl", "failed", "FAILED", "FAILED"),
        ("launch-pytorchjob", "killed", "RUNNING", "KILLED"),  # terminated: the launcher was stopped while running
        ("stage-data", "succeeded", "CANCELED", "KILLED"),  # cancelled before its next step started
        ("stage-data", "succeeded", "FAILED", "FAILED"),  # the next step never started (its driver failed)
    ],
)
def test_the_summary_ends_the_mlflow_run_with_the_runs_outcome(
    mlflow_server, tmp_path: Path, last: str, how: str, kfp_state: str, status: str
) -> None:
    """The exit step ends the run's MLflow run (<run>/mlflow.json, as the trainer records it): FINISHED, FAILED or
    KILLED, with an end time, rather than leaving it RUNNING for ever."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(mlflow_server.url)
    experiment = client.get_experiment_by_name("summaries") or client.create_experiment("summaries")
    run = client.create_run(getattr(experiment, "experiment_id", experiment), run_name="r1")
    paths = RunPaths.of(tmp_path, "r1")
    steps_ending(str(tmp_path), "r1", last, how)
    paths.mlflow_run.write_text(json.dumps({"tracking_uri": mlflow_server.url, "run_id": run.info.run_id}))
    summarize_run(str(tmp_path), "r1", "kfp-uuid", kfp_state)
    ended = client.get_run(run.info.run_id)
    assert ended.info.status == status and ended.info.end_time >= ended.info.start_time
    assert ended.data.tags["pipeline_state"] == json.loads(paths.summary.read_text())["state"]


def test_a_tracking_server_that_is_gone_does_not_fail_the_summary(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The MLflow run cannot be ended: a warning, and the summary is written all the same."""
    import logging
    import socket

    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    paths = RunPaths.of(tmp_path, "r1")
    steps_ending(str(tmp_path), "r1", "evaluate-checkpoint", "succeeded")
    paths.mlflow_run.write_text(json.dumps({"tracking_uri": f"http://127.0.0.1:{port}", "run_id": "0" * 32}))
    with caplog.at_level(logging.WARNING, "trainer.tracking"):
        summary = summarize_run(str(tmp_path), "r1", "kfp-uuid", "COMPLETE")
    assert summary.state == "SUCCEEDED" and paths.summary.exists()
    assert "MLflow: the run of r1 was not ended FINISHED" in caplog.text
