"""The compiled pipeline: no drift from the code, and a whole run of the checked-in YAML through kfp.local."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from components.launch_training.platform import Platform
from pipelines import COMPILED_PIPELINE
from tests.benchmark_data import write_task_data
from tests.evaluate_helpers import table
from tests.helpers import run_cli, write_corpus
from trainer.layout import RunPaths

CLI = str(Path(sys.executable).parent / "hyperpod-pretrain")
STEPS = {"preflight", "stage-data", "launch-pytorchjob", "verify-nccl", "evaluate-checkpoint"}
# Staging's fan-out: one tokenize-group task per group (a dsl.ParallelFor, the for-loop-2 sub-DAG), then a fan-in.
TOKENIZATION = {"for-loop-2", "finalize-snapshot"}
CONTAINER_TASKS = STEPS | {"tokenize-group", "finalize-snapshot", "summarize-run"}
RECORDS = STEPS | {"tokenize-data-g000", "tokenize-data-g001", "finalize-data"}  # the steps' records on the volume


def all_tasks(spec: dict) -> dict[str, dict]:
    """The tasks of the root DAG and of every sub-DAG (the exit handler's group holds the four steps)."""
    tasks = dict(spec["root"]["dag"]["tasks"])
    for component in spec["components"].values():
        tasks |= component.get("dag", {}).get("tasks", {})
    return tasks


def test_checked_in_yaml_matches_a_fresh_compile() -> None:
    result = run_cli("compile", "--check")
    assert result.returncode == 0, result.stderr


def test_compile_says_the_platform_settings_it_baked_in(tmp_path: Path) -> None:
    """What the platform team chose, printed as compiled, so that a wrong flag is seen before the upload."""
    output = tmp_path / "pipeline.yaml"
    result = run_cli(
        "compile",
        "--output",
        str(output),
        "--image-registry",
        "123456789012.dkr.ecr.us-east-1.amazonaws.com",
        "--tag",
        "v7",
        "--job-api",
        "trainjob",
        "--job-namespace",
        "team-a",
        "--job-namespace",
        "team-b",
        "--fsx-pvc",
        "team-fsx",
        "--queue-name",
        "team-queue",
        "--trainer-service-account",
        "trainer",
        "--trainer-toleration",
        "dedicated=gpu:NoSchedule",
        "--node-selector",
        "pool=cpu",
    )
    assert result.returncode == 0, result.stderr
    said = result.stderr.split("with the platform settings compiled in:\n", 1)[1]
    assert "hyperpod-pretrain-components:v7; trainer 123456789012.dkr.ecr.us-east-1.amazonaws.com/" in said
    assert "job API: trainjob (ClusterTrainingRuntime hyperpod-pretrain)" in said
    assert "jobs' namespaces: team-a, team-b" in said and "PVC team-fsx mounted at /fsx" in said
    assert "Kueue: queue team-queue" in said and "service account trainer, token not mounted" in said
    assert "tolerations nvidia.com/gpu, dedicated=gpu:NoSchedule" in said and "steps: node selector pool=cpu" in said
    assert "evaluator 123456789012.dkr.ecr.us-east-1.amazonaws.com/hyperpod-pretrain-evaluator:v7;" in said
    assert (
        "evaluation: on 1 GPU (nvidia.com/gpu) on the training nodes (the trainer pods' node selector and "
        "tolerations), 8 CPUs, 32Gi memory, in 123456789012.dkr.ecr.us-east-1.amazonaws.com/"
        "hyperpod-pretrain-evaluator:v7"
    ) in said


def test_drift_is_detected(tmp_path: Path) -> None:
    stale = tmp_path / "pipeline.yaml"
    stale.write_text(COMPILED_PIPELINE.read_text().replace("defaultValue: 5000.0", "defaultValue: 4000.0"))
    assert stale.read_text() != COMPILED_PIPELINE.read_text()
    result = run_cli("compile", "--check", "--output", str(stale))
    assert result.returncode == 1
    assert "differs from a fresh compile" in result.stderr.splitlines()[-1]
    assert any(line.startswith("-") and "defaultValue: 4000.0" in line for line in result.stderr.splitlines())


def test_compiled_pipeline_chains_the_four_steps_inside_an_exit_handler() -> None:
    spec = next(yaml.safe_load_all(COMPILED_PIPELINE.read_text()))
    root = spec["root"]["dag"]["tasks"]
    assert set(root) == {"exit-handler-1", "summarize-run"}
    assert set(spec["components"]["comp-exit-handler-1"]["dag"]["tasks"]) == STEPS | TOKENIZATION
    tasks = all_tasks(spec)
    assert tasks["stage-data"]["dependentTasks"] == ["preflight"]  # a cluster that cannot run the job fails first
    # The groups fan out over stage-data's list of work items; the fan-in waits for the whole loop.
    loop = tasks["for-loop-2"]
    assert loop["parameterIterator"]["items"]["inputParameter"] == "pipelinechannel--stage-data-Output"
    assert set(tasks["finalize-snapshot"]["dependentTasks"]) == {"for-loop-2", "stage-data"}
    assert tasks["launch-pytorchjob"]["dependentTasks"] == ["finalize-snapshot"]
    assert "launch-pytorchjob" in tasks["evaluate-checkpoint"]["dependentTasks"]
    # The summary runs however the steps ended, and gets the pipeline's final status.
    assert root["summarize-run"]["triggerPolicy"]["strategy"] == "ALL_UPSTREAM_TASKS_COMPLETED"
    status = root["summarize-run"]["inputs"]["parameters"]["status"]
    assert status == {"taskFinalStatus": {"producerTask": "exit-handler-1"}}
    # A retried launcher re-attaches: it is given the KFP run's id.
    launcher = tasks["launch-pytorchjob"]["inputs"]["parameters"]
    assert launcher["pipeline_run_id"]["runtimeValue"]["constant"] == "{{$.pipeline_job_uuid}}"


def run_local(**options: object) -> subprocess.CompletedProcess[str]:
    """`hyperpod-pretrain run-local` with ``options`` as its flags, in their order (max_steps=40: `--max-steps 40`;
    skip_staging=True: `--skip-staging` alone)."""
    command = [CLI, "run-local"]
    for name, value in options.items():
        flag = f"--{name.replace('_', '-')}"
        command += [flag] if value is True else [flag, str(value)]
    return subprocess.run(command, capture_output=True, text=True, timeout=600)


def assert_a_quiet_console(result: subprocess.CompletedProcess[str]) -> None:
    """A quiet console (pipelines/local_run.py quiet_console): each step's end, the staging and rank 0's training lines
    with one time each, the reports; not kfp.local's dumps of every step's inputs and outputs, nor its colours."""
    console = (result.stdout + result.stderr).splitlines()
    assert len(console) <= 60, "\n".join(console)
    # One format: run-local's own lines as kfp.local's ("HH:MM:SS.mmm - LEVEL - message"), the steps' indented
    # under them with one time each; no line twice.
    logged = [line for line in console if re.match(r"\d\d:\d\d:\d\d\.\d{3} - [A-Z]+ - ", line)]
    assert logged and not [line for line in console if re.match(r"\s*\d{4}-\d\d-\d\d \d", line)], console
    # The fan-out's tasks share a name: two finishing in the same millisecond print the same line (CI saw it).
    fan_out_end = "Task 'tokenize-group' finished with status SUCCESS"
    assert not [line for line in console if console.count(line) > 1 and not line.endswith(fan_out_end)]
    assert "Task 'launch-pytorchjob' finished with status SUCCESS" in result.stdout and "\x1b[" not in result.stdout
    assert not [line for line in console if "outputs:" in line or '"outputFile"' in line or "[default1]" in line]
    trainer_lines = [line.strip().split(" ", 1)[1] for line in console if line.startswith("    ")]
    assert len([line for line in trainer_lines if line.startswith("model ") and " params; " in line]) == 1
    assert len([line for line in trainer_lines if line.startswith("step 1 took ")]) == 1
    assert [line.split("  ")[0] for line in trainer_lines if "  loss " in line] == [
        f"step {s}/40" for s in (10, 20, 30, 40)
    ]


def assert_the_reports_and_the_summary(
    root: Path, run: RunPaths, result: subprocess.CompletedProcess[str]
) -> dict[str, Path]:
    """Each KFP step's report, where run-local says they are, and the run's summary: every step succeeded but the
    preflight (no cluster to check locally). Returns the reports by step."""
    kfp_reports = {p.parent.name: p for p in (root / "kfp-local" / "e2e").rglob("report")}
    assert set(kfp_reports) == STEPS | {"finalize-snapshot"}
    assert "| copied |" in kfp_reports["stage-data"].read_text()
    assert "| final loss | " in kfp_reports["launch-pytorchjob"].read_text()  # and in the step's metrics
    assert "tokenized now" in kfp_reports["finalize-snapshot"].read_text()
    (pipeline_dir,) = {path.parent.parent for path in kfp_reports.values()}
    assert (
        f"KFP step reports ({len(kfp_reports)})" in result.stdout
        and str(pipeline_dir / "*" / "report") in result.stdout
    )
    assert str(run.eval_html) in result.stdout
    summary = json.loads(run.summary.read_text())
    assert summary["state"] == "SUCCEEDED" and summary["run_id"] == "e2e"
    outcomes = {s["step"]: s["state"] for s in summary["steps"]}
    assert outcomes == dict.fromkeys(RECORDS, "succeeded") | {"preflight": "skipped"}  # no cluster to check locally
    assert str(run.summary_report) in result.stdout
    return kfp_reports


def assert_watched_in_tensorboard_and_mlflow(
    run: RunPaths, result: subprocess.CompletedProcess[str], kfp_reports: dict[str, Path], tracking_uri: str
) -> None:
    """Watched: the summary and the launch report say where; the MLflow run has the training's curves, the
    evaluation's reports and the summary (the parameter went from run-local through the pipeline to each step)."""
    mlflow_run = json.loads(run.mlflow_run.read_text())
    watch = f"Watch: TensorBoard: `tensorboard --logdir {run.tensorboard}`; MLflow run [{mlflow_run['run_id']}]("
    assert watch in run.summary_report.read_text() and watch in kfp_reports["launch-pytorchjob"].read_text()
    assert f"TensorBoard                        tensorboard --logdir {run.tensorboard}" in result.stdout
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    assert [m.step for m in client.get_metric_history(mlflow_run["run_id"], "train/loss")] == [10, 20, 30, 40]
    stored = {a.path for where in ("evaluation", "summary") for a in client.list_artifacts(mlflow_run["run_id"], where)}
    assert stored == {
        "evaluation/report.html",
        "evaluation/report.md",
        "evaluation/eval.json",
        "summary/summary.md",
        "summary/summary.json",
    }
    ended = client.get_run(mlflow_run["run_id"]).info
    assert (ended.status, bool(ended.end_time)) == ("FINISHED", True), "the pipeline's outcome ends the MLflow run"


def assert_the_benchmarks_in_the_reports_and_mlflow(
    run: RunPaths, kfp_reports: dict[str, Path], tracking_uri: str
) -> None:
    """--benchmarks went from run-local through the pipeline to the evaluation: the task data staged from the local
    mirror onto the volume, 5 items of each task scored for the trained and the untrained model, the table in both
    reports (the KFP one and the volume's), the figures in eval.json and the MLflow run at the checkpoint's step."""
    from mlflow.tracking import MlflowClient

    evaluation = json.loads(run.eval_result.read_text())
    rows = {(b["task"], b["metric"]): b for b in evaluation["benchmarks"]}
    assert set(rows) == {
        ("hellaswag", "acc"),
        ("hellaswag", "acc_norm"),
        ("piqa", "acc"),
        ("piqa", "acc_norm"),
        ("lambada_openai", "perplexity"),
        ("lambada_openai", "acc"),
    }
    assert all(b["items"] == 5 and b["start_value"] is not None for b in rows.values())
    assert (run.root.parent.parent / "benchmarks" / "piqa" / "current.json").is_file()
    markdown, page = kfp_reports["evaluate-checkpoint"].read_text(), run.eval_html.read_text()
    assert "## Benchmarks" in markdown and f"| piqa | 0 | 5 | acc | {rows['piqa', 'acc']['value']:.4f} |" in markdown
    assert table(page, "benchmarks")[0][:5] == ["task", "shots", "items", "metric", "trained"]
    history = MlflowClient(tracking_uri).get_metric_history(
        json.loads(run.mlflow_run.read_text())["run_id"], "benchmarks/hellaswag/acc_norm"
    )
    assert [(m.step, m.value) for m in history] == [(40, rows["hellaswag", "acc_norm"]["value"])]


def assert_resumed_to_step_60(run: RunPaths, resumed: subprocess.CompletedProcess[str]) -> None:
    """The same run went on from its step-40 checkpoint to step 60, its schedule extended, without staging again."""
    assert "resumed at step 40" in resumed.stdout + resumed.stderr
    assert "learning-rate schedule extended at step 40 (max_steps: 40 -> 60)" in resumed.stdout + resumed.stderr
    assert json.loads(run.eval_result.read_text())["step"] == 60
    steps = [json.loads(line)["step"] for line in run.metrics.read_text().splitlines()]
    assert steps == sorted(set(steps)) and steps[-1] == 60  # one row per step, none repeated
    outcomes = {s["step"]: s["state"] for s in json.loads(run.summary.read_text())["steps"]}
    assert outcomes["stage-data"] == "skipped" and outcomes["launch-pytorchjob"] == "succeeded"


def code_corpus(tmp_path: Path) -> Path:
    """A second corpus, JSON Lines with its text in `content` (not `text`)."""
    code = tmp_path / "code"
    code.mkdir()
    texts = sorted(write_corpus(tmp_path / "code-text", files=4, sentences=90, seed=7).rglob("*.txt"))
    for i, text in enumerate(texts):
        rows = [{"path": f"{i}/{n}.py", "content": line} for n, line in enumerate(text.read_text().splitlines())]
        (code / f"part-{i}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return code


def assert_a_warm_start_on_a_mixture(root: Path, run: RunPaths) -> None:
    """Run e2e-warm started from run's last weights, on the mixture of synthetic as staged and code staged now with
    the same tokenizer, each group's dataset named through to the evaluation and the reports."""
    warm_run = RunPaths.of(root, "e2e-warm")
    config = json.loads(warm_run.config.read_text())
    assert config["init_from"]["run"] == "e2e" and config["init_from"]["step"] == 60
    mixture = config["dataset"]["mixture"]
    assert [(m["dataset"], m["weight"], m["share"]) for m in mixture] == [("synthetic", 0.8, 0.8), ("code", 0.2, 0.2)]
    assert mixture[0]["snapshot"] == json.loads(run.config.read_text())["dataset"]["snapshot"], "as staged before"
    assert len({m["tokenizer_sha256"] for m in mixture}) == 1
    evaluated = json.loads(warm_run.eval_result.read_text())
    assert [d["dataset"] for d in evaluated["datasets"]] == ["synthetic", "code"]
    reports = {p.parent.name: p.read_text() for p in (root / "kfp-local" / "e2e-warm").rglob("report")}
    assert "| synthetic | 0.8 | 80.0% |" in reports["finalize-snapshot"] and "| code | 0.2 |" in reports["stage-data"]
    assert "| jsonl | 4 | 360 |" in reports["finalize-snapshot"], "every record's `content` staged, none skipped"
    assert "Mixture: synthetic 80.0% (weight 0.8): " in warm_run.summary_report.read_text()
    records = {p.stem for p in warm_run.steps.glob("tokenize-data-g*.json")}
    assert records == {"tokenize-data-g000-synthetic", "tokenize-data-g000-code", "tokenize-data-g001-code"}


def test_run_local_executes_the_compiled_pipeline_end_to_end(corpus: Path, tmp_path: Path, mlflow_server) -> None:
    root = tmp_path / "fsx"
    result = run_local(
        storage_root=root,
        source=corpus,
        include="*.txt",
        dataset="synthetic",
        run_id="e2e",
        vocab_size="512",
        preset="tiny",
        max_steps="40",
        seq_len="64",
        checkpoint_every="20",
        mlflow_tracking_uri=mlflow_server.url,
        mlflow_experiment="e2e",
        benchmarks="hellaswag,piqa,lambada_openai",
        benchmark_data=write_task_data(tmp_path / "benchmark-mirror", items=8)["piqa"].parent,
        benchmark_limit=5,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "local pipeline run e2e succeeded" in result.stdout
    assert_a_quiet_console(result)
    run = RunPaths.of(root, "e2e")
    evaluation = json.loads(run.eval_result.read_text())
    assert evaluation["step"] == 40
    assert evaluation["val_loss"] < evaluation["untrained_val_loss"] - 1.0
    assert "Communication check: passed" in run.comms_verification.read_text()
    kfp_reports = assert_the_reports_and_the_summary(root, run, result)
    assert_watched_in_tensorboard_and_mlflow(run, result, kfp_reports, mlflow_server.url)
    assert_the_benchmarks_in_the_reports_and_mlflow(run, kfp_reports, mlflow_server.url)

    # Continue the same run to step 60 without staging again: the trainer resumes from its step-40 checkpoint and
    # extends its schedule to the new max_steps.
    resumed = run_local(
        storage_root=root,
        source=corpus,
        dataset="synthetic",
        skip_staging=True,
        resume_run_id="e2e",
        vocab_size="512",
        preset="tiny",
        nproc_per_node="1",  # the pipeline's resume is the claim; a world size going 2 -> 1 is test_parallel.py's
        max_steps="60",
        seq_len="64",
        checkpoint_every="20",
        extend_schedule=True,
    )
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert_resumed_to_step_60(run, resumed)

    # A new run from the finished one's weights (a warm start), on a mixture of its dataset as staged and a second
    # corpus staged now with the same tokenizer: the origin travels from staging to the trainer, the mixture from
    # staging's fan-out (each group naming its dataset) through the finalize step to the trainer and the evaluation.
    # The second corpus is JSON Lines with its text in `content`: its entry's own text field (--mixture-text-field).
    warm = run_local(
        storage_root=root,
        mixture="synthetic=0.8,code=0.2",
        mixture_source=f"code={code_corpus(tmp_path)}",
        mixture_text_field="code=content",
        val_fraction="0.1",
        run_id="e2e-warm",
        init_from_run_id="previous",
        preset="tiny",
        nproc_per_node="1",  # a warm start reads weights alone, whatever the world size
        max_steps="10",
        seq_len="64",
    )
    assert warm.returncode == 0, warm.stdout[-3000:] + warm.stderr[-3000:]
    assert_a_warm_start_on_a_mixture(root, run)


def test_run_local_fails_when_a_step_fails(staged_copy: Path) -> None:
    """A step that fails inside the exit handler (the launcher, on a resume whose only checkpoint is damaged: what
    can be checked before the pipeline starts passes, a checkpoint is there, and the config.json the trainer wrote at
    start, whose settings the resume takes): the run fails with the failed step's own reason as its last line, without
    colour codes, and the exit step still writes the summary with which step failed and why. (The launcher has no KFP
    retry: a failing stage-data would spend 30 s in KFP's retry backoff first.)"""
    from dataclasses import asdict

    from trainer.atomic import write_json
    from trainer.config import parse_config

    run = RunPaths.of(staged_copy, "damaged")
    run.checkpoints.mkdir(parents=True)
    (run.checkpoints / "checkpoint_step_5.pt").write_text("not a checkpoint")
    settings = parse_config(
        [
            "--data-dir",
            str(staged_copy / "datasets" / "synthetic"),
            "--run-dir",
            str(run.root),
            "--preset",
            "tiny",
            "--max-steps",
            "5",
        ],
        {},
    )
    write_json(run.config, {"trainer": asdict(settings)})  # as trainer/train_ddp.py records it (with more)
    result = subprocess.run(
        [
            CLI,
            "run-local",
            "--storage-root",
            str(staged_copy),
            "--dataset",
            "synthetic",
            "--skip-staging",
            "--resume-run-id",
            "damaged",
            "--preset",
            "tiny",
            "--max-steps",
            "2",
            "--nproc-per-node",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    last = result.stderr.splitlines()[-1]
    assert result.returncode == 1
    assert last.startswith(
        "hyperpod-pretrain run-local: failed: local pipeline run damaged failed: step "
        "launch-pytorchjob failed: training of run damaged failed"
    ), last
    assert "no usable checkpoint" in last and "\x1b[" not in last
    summary = json.loads(RunPaths.of(staged_copy, "damaged").summary.read_text())
    assert summary["state"] == "FAILED"
    outcomes = {s["step"]: s for s in summary["steps"]}
    assert outcomes["launch-pytorchjob"]["state"] == "failed"
    error = outcomes["launch-pytorchjob"]["error"]  # the launcher's: the workers' exit code and their reason
    assert "exit code 1" in error and "no usable checkpoint" in error and "not a complete checkpoint" in error
    assert outcomes["stage-data"]["state"] == "skipped" and outcomes["verify-nccl"]["state"] == "no record"


def test_a_local_run_failed_on_a_steps_input_exits_2_with_that_steps_reason(tmp_path: Path) -> None:
    """The reason and the exit code come from the failed step's record in the summary: a step that failed on its
    input (InputError, exit 2 on its own) makes run-local exit 2 too; any other failure, 1."""
    from common.errors import InputError
    from components.run_summary.core import recorded_step, summarize_run
    from pipelines.local_run import failed_step_reason

    run = RunPaths.of(tmp_path, "r")
    with pytest.raises(InputError):
        with recorded_step(str(tmp_path), "r", "stage-data", {}, pipeline_run_id="12345678"):
            raise InputError("source /nowhere: no such file or directory")
    summarize_run(str(tmp_path), "r", "12345678", "FAILED", "Task exit-handler-1 failed.")
    assert failed_step_reason(run) == ("step stage-data failed: source /nowhere: no such file or directory", True)
    with pytest.raises(RuntimeError):
        with recorded_step(str(tmp_path), "r", "stage-data", {}, pipeline_run_id="87654321"):
            raise RuntimeError("the volume went away")
    summarize_run(str(tmp_path), "r", "87654321", "FAILED", "Task exit-handler-1 failed.")
    assert failed_step_reason(run) == ("step stage-data failed: the volume went away", False)


def test_a_step_refused_on_its_input_runs_once_and_says_why_in_one_line(tmp_path: Path) -> None:
    """kfp 2.17's local runner honours the compiled retry policies (task_executor.py: 2 retries after 10 s and 20 s),
    and nothing retries on some exit codes only: a Parquet source without the text column took 42-72 s and three
    truncated tracebacks. run-local runs each step once, and a traceback that ends in an InputError is not shown."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    source = tmp_path / "corpus"
    source.mkdir()
    pq.write_table(pa.table({"body": ["the cat sat on the mat. " * 20] * 50}), source / "a.parquet")
    result = subprocess.run(
        [CLI, "run-local", "--storage-root", str(tmp_path / "fsx"), "--source", str(source), "--run-id", "bad"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 2, output[-3000:]
    assert output.count("Task 'stage-data' finished with status FAILURE") == 1, output
    assert "Traceback" not in output and 'File "' not in output, output
    assert "each step runs once" in output and "ignores each step's CPU and memory limits and timeout;" in output
    last = result.stderr.splitlines()[-1]
    assert last.endswith(
        "step stage-data failed: source file a.parquet: no column 'text'; its columns are body: "
        "name the text column with text_field"
    ), last
    record = json.loads(RunPaths.of(tmp_path / "fsx", "bad").step_record("stage-data").read_text())
    assert (record["attempt"], record["permanent"]) == (1, True)


def test_the_quiet_console_shows_a_crash_whole_and_hides_a_refusal() -> None:
    """A traceback that ends in another exception (a crash) is shown with its last line, dotted names too; one that
    ends in an InputError is not (the step's reason is run-local's last line)."""
    import io

    from pipelines.local_run import LineFilter, keep_line, shown

    out = io.StringIO()
    console = LineFilter(out, keep_line, shown, hide_bad_input=True)
    refusal = [
        "Traceback (most recent call last):",
        '  File "/x/core.py", line 1, in plan',
        "    plan()",
        "common.errors.InputError: source a.parquet: no column 'text'",
    ]
    crash = [
        "Traceback (most recent call last):",
        '  File "/x/train.py", line 9, in step',
        "torch.OutOfMemoryError: CUDA out of memory",
    ]
    console.write("\n".join(refusal + crash) + "\n")
    console.finish()
    assert out.getvalue().splitlines() == crash


def executor_of(spec: dict, task: str) -> str:
    return all_tasks(spec)[task]["componentRef"]["name"].replace("comp-", "exec-")


def test_the_quiet_console_puts_back_the_print_that_parallel_kfp_tasks_leave_indenting() -> None:
    """kfp.local's indented_print (kfp/local/logging_utils.py) swaps builtins.print per task and puts back the one it
    found: two tasks in parallel that end in the order they started leave the first one's indenting print behind
    (a run-local's own last lines came out indented). quiet_console puts back the print it found."""
    import builtins

    from kfp.local.logging_utils import indented_print

    from pipelines.local_run import quiet_console

    original = builtins.print
    with quiet_console(verbose=False):
        first, second = indented_print(), indented_print()
        first.__enter__()
        second.__enter__()  # found the first task's indenting print
        first.__exit__(None, None, None)
        second.__exit__(None, None, None)  # puts that one back
        left = builtins.print
    assert left is not original  # what kfp.local leaves
    assert builtins.print is original


def test_the_platform_settings_are_on_the_right_steps(tmp_path: Path) -> None:
    output = tmp_path / "cluster.yaml"
    result = run_cli(
        "compile",
        "--output",
        str(output),
        "--node-selector",
        "role=cpu-workers",
        "--toleration",
        "dedicated=pipelines:NoSchedule",
        "--image-pull-secret",
        "ecr-pull",
        "--fsx-pvc",
        "team-fsx",
        "--queue-name",
        "hyperpod-ns-team-a-localqueue",
        "--image-registry",
        "123456789012.dkr.ecr.us-east-1.amazonaws.com",
        "--job-namespace",
        "hyperpod-ns-team-a",
        "--trainer-service-account",
        "trainer",
        "--trainer-toleration",
        "dedicated=training:NoSchedule",
        "--trainer-env",
        "FI_EFA_FORK_SAFE=1",
        "--trainer-node-selector",
        "pool=gpu",
    )
    assert result.returncode == 0, result.stderr
    pipeline_spec, platform = yaml.safe_load_all(output.read_text())
    executors = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    containers = {name for name, c in pipeline_spec["components"].items() if "executorLabel" in c}
    tasks = {
        name: task
        for name, task in all_tasks(pipeline_spec).items()
        if task.get("componentRef", {}).get("name") in containers
    }
    assert set(tasks) == CONTAINER_TASKS
    for name in tasks:
        k8s = executors[executor_of(pipeline_spec, name)]
        # One volume, one path, fixed at compile time: every step mounts the same PVC at the same place.
        assert k8s["pvcMount"] == [
            {
                "constant": "team-fsx",
                "mountPath": "/fsx",
                "pvcNameParameter": {"runtimeValue": {"constant": "team-fsx"}},
            }
        ], name
        assert [s["secretName"] for s in k8s["imagePullSecret"]] == ["ecr-pull"]
        if name == "evaluate-checkpoint":  # on a GPU: where the trainer pods go, the GPU nodes idle after training
            assert k8s["nodeSelector"]["labels"] == {"pool": "gpu"}
            assert k8s["tolerations"] == [
                {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
                {"key": "dedicated", "operator": "Equal", "value": "training", "effect": "NoSchedule"},
            ]
            continue
        assert k8s["nodeSelector"]["labels"] == {"role": "cpu-workers"}
        assert k8s["tolerations"] == [
            {"key": "dedicated", "operator": "Equal", "value": "pipelines", "effect": "NoSchedule"}
        ]
    parameters = pipeline_spec["root"]["inputDefinitions"]["parameters"]
    assert "fsx_pvc" not in parameters, "a run cannot choose another volume than the steps mount"
    assert parameters["storage_root"]["defaultValue"] == "/fsx"
    # ... and the job mounts it too: the launcher and the preflight get the same settings, as constants.
    for name in ("launch-pytorchjob", "preflight"):
        given = Platform.from_dict(tasks[name]["inputs"]["parameters"]["platform"]["runtimeValue"]["constant"])
        assert given == Platform(
            pvc_name="team-fsx",
            mount_path="/fsx",
            queue_name="hyperpod-ns-team-a-localqueue",
            namespaces=("hyperpod-ns-team-a",),
            registries=("123456789012.dkr.ecr.us-east-1.amazonaws.com",),
            service_account="trainer",
            env={"FI_EFA_FORK_SAFE": "1"},
            tolerations=({"key": "dedicated", "operator": "Equal", "value": "training", "effect": "NoSchedule"},),
            node_selector={"pool": "gpu"},
        ), name
    # What touches privileges is not a run parameter; the namespace's default is the first one allowed.
    assert not {"fsx_pvc", "service_account", "tolerations", "node_selector", "image_pull_secrets"} & set(parameters)
    assert parameters["namespace"]["defaultValue"] == "hyperpod-ns-team-a"
    assert "activeDeadlineSeconds" not in executors[executor_of(pipeline_spec, "launch-pytorchjob")]
    assert executors[executor_of(pipeline_spec, "stage-data")]["activeDeadlineSeconds"] == "21600"
    # Caching off everywhere (a hit of stage-data would skip a changed corpus); retries whose window, which Argo
    # counts from the first attempt's start, holds every attempt up to its timeout.
    for name, retries, timeout_s in (
        ("preflight", 0, 600),
        ("stage-data", 2, 21600),
        ("launch-pytorchjob", 0, 0),
        ("verify-nccl", 2, 3600),
        ("evaluate-checkpoint", 0, 0),
        ("summarize-run", 0, 0),
    ):
        task = tasks[name]
        assert task.get("cachingOptions", {}).get("enableCache", False) is False, name
        assert task.get("retryPolicy", {}).get("maxRetryCount", 0) == retries, name
        if retries:
            policy = task["retryPolicy"]
            assert policy["backoffFactor"] == 2.0 and policy["backoffDuration"] == "10s"
            assert int(policy["backoffMaxDuration"].rstrip("s")) >= (retries + 1) * timeout_s + 10 + 20, name
    resources = {
        name: pipeline_spec["deploymentSpec"]["executors"][executor_of(pipeline_spec, name)]["container"]["resources"]
        for name in tasks
    }
    assert resources["launch-pytorchjob"]["resourceCpuLimit"] == "500m"
    assert resources["evaluate-checkpoint"]["resourceMemoryLimit"] == "32Gi"
    # One GPU for the evaluation, through KFP's own task API (the driver makes it the pod's nvidia.com/gpu limit);
    # no other step has one. The preflight is given the same resources, to hold the model's need against them.
    accelerator = {"count": "1", "resourceCount": "1", "resourceType": "nvidia.com/gpu", "type": "nvidia.com/gpu"}
    assert {name: r.get("accelerator") for name, r in resources.items() if r.get("accelerator")} == {
        "evaluate-checkpoint": accelerator
    }
    evaluation = tasks["preflight"]["inputs"]["parameters"]["evaluation"]["runtimeValue"]["constant"]
    assert evaluation == {"gpus": 1, "cpu": "8", "memory": "32Gi"}


def test_the_evaluation_compiles_onto_the_cpu_for_a_cluster_without_a_spare_gpu(tmp_path: Path) -> None:
    """--evaluation-gpus 0: the evaluate step runs where the other steps run, in the components image, with the
    memory and CPUs given, and no GPU; the preflight is told so. A GPU count the evaluation cannot use is refused."""
    output = tmp_path / "cpu.yaml"
    registry = "123456789012.dkr.ecr.us-east-1.amazonaws.com"
    flags = ["--image-registry", registry, "--tag", "v7", "--node-selector", "role=cpu-workers"]
    result = run_cli(
        "compile",
        "--output",
        str(output),
        *flags,
        "--evaluation-gpus",
        "0",
        "--evaluation-memory",
        "96Gi",
        "--evaluation-cpu",
        "16",
    )
    assert result.returncode == 0, result.stderr
    assert (
        "evaluation: on the CPU (--evaluation-gpus 0), 16 CPUs, 96Gi memory, in "
        f"{registry}/hyperpod-pretrain-components:v7" in result.stderr
    )
    spec, platform = yaml.safe_load_all(output.read_text())
    container = spec["deploymentSpec"]["executors"][executor_of(spec, "evaluate-checkpoint")]["container"]
    assert (
        container["image"] == f"{registry}/hyperpod-pretrain-components:v7"
        and "accelerator" not in container["resources"]
    )
    assert (container["resources"]["resourceMemoryLimit"], container["resources"]["resourceCpuLimit"]) == ("96Gi", "16")
    k8s = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"][executor_of(spec, "evaluate-checkpoint")]
    assert k8s["nodeSelector"]["labels"] == {"role": "cpu-workers"} and "tolerations" not in k8s
    preflight = all_tasks(spec)["preflight"]["inputs"]["parameters"]["evaluation"]["runtimeValue"]["constant"]
    assert preflight == {"gpus": 0, "cpu": "16", "memory": "96Gi"}
    for flags, message in (
        (["--evaluation-gpus", "2"], "--evaluation-gpus 2: 1 (the evaluation loads the model on one GPU) or 0"),
        (["--evaluation-memory", "64GB"], "--evaluation-memory '64GB': a whole amount with its unit, e.g. 64Gi"),
    ):
        bad = run_cli("compile", "--output", str(tmp_path / "x.yaml"), *flags)
        assert bad.returncode == 2 and message in bad.stderr.splitlines()[-1], bad.stderr
    assert not (tmp_path / "x.yaml").exists()


def test_the_compiled_yaml_round_trips_through_kfp() -> None:
    from kfp import components

    loaded = components.load_component_from_file(str(COMPILED_PIPELINE))
    assert loaded.name == "hyperpod-pretrain"
    assert {"source", "storage_root", "trainer_image", "skip_staging", "resume_run_id", "recovery_timeout_s"} <= set(
        loaded.component_spec.inputs
    )


def test_the_images_come_from_the_registry_and_tag(tmp_path: Path) -> None:
    registry = "123456789012.dkr.ecr.us-west-2.amazonaws.com"
    output = tmp_path / "cluster.yaml"
    result = run_cli("compile", "--output", str(output), "--image-registry", registry, "--tag", "v7")
    assert result.returncode == 0, result.stderr
    spec = next(yaml.safe_load_all(output.read_text()))
    containers = [e["container"] for e in spec["deploymentSpec"]["executors"].values()]
    assert len(containers) == len(CONTAINER_TASKS)
    assert {c["image"] for c in containers} == {
        f"{registry}/hyperpod-pretrain-components:v7",
        f"{registry}/hyperpod-pretrain-evaluator:v7",  # the evaluation's, on a GPU: CUDA torch
    }
    evaluator = spec["deploymentSpec"]["executors"][executor_of(spec, "evaluate-checkpoint")]["container"]
    assert evaluator["image"] == f"{registry}/hyperpod-pretrain-evaluator:v7"
    trainer = spec["root"]["inputDefinitions"]["parameters"]["trainer_image"]
    assert trainer["defaultValue"] == f"{registry}/hyperpod-pretrain-trainer:v7"
    # Nothing is installed when a step starts: the image carries kfp and the project.
    for container in containers:
        command = " ".join(container["command"])
        assert "pip install" not in command and "-m pip" not in command and "kfp.dsl.executor_main" in command
    assert "no step installs packages when it starts" in spec["pipelineInfo"]["description"]
    # The checked-in YAML names the local image and leaves the trainer image to each run.
    default = next(yaml.safe_load_all(COMPILED_PIPELINE.read_text()))
    assert {e["container"]["image"] for e in default["deploymentSpec"]["executors"].values()} == {
        "hyperpod-pretrain-components:0.1.0",
        "hyperpod-pretrain-evaluator:0.1.0",
    }
    bad = run_cli("compile", "--output", str(tmp_path / "x.yaml"), "--image-registry", "https://ecr")
    assert bad.returncode == 2 and "image registry 'https://ecr'" in bad.stderr.splitlines()[-1]
    assert not (tmp_path / "x.yaml").exists()


def test_the_parameters_page_lists_every_parameter_with_its_default() -> None:
    import re

    page = (Path(__file__).resolve().parent.parent / "docs" / "parameters.md").read_text()
    table = page.split("\n## Pipeline parameters\n", 1)[1].split("\n## ", 1)[0]
    rows = dict(re.findall(r"^\| `(\w+)` \| ([^|]+) \|", table, re.M))
    spec = next(yaml.safe_load_all(COMPILED_PIPELINE.read_text()))
    parameters = spec["root"]["inputDefinitions"]["parameters"]
    assert set(rows) == set(parameters)
    for name, definition in parameters.items():
        cell = rows[name].strip()
        if "defaultValue" not in definition:
            assert cell == "(required)", name
            continue
        value, kind = definition["defaultValue"], definition["parameterType"]
        expected = {
            "STRING": lambda v: v or '""',
            "NUMBER_INTEGER": lambda v: str(int(v)),
            "NUMBER_DOUBLE": lambda v: repr(float(v)),
            "BOOLEAN": lambda v: str(v).lower(),
        }.get(kind, json.dumps)(value)
        assert re.match(r"`([^`]*)`", cell).group(1) == expected, name


# The first KFP backend release that runs each feature a compiled pipeline may use, read from kubeflow/pipelines
# tags 2.0.0-2.17.0 (there are no 2.6-2.13 releases). Each entry: (first release, where it is decided).
KFP_FEATURES = {
    "exit handler that reports the run's state": (
        "2.4.0",
        "backend/src/v2/compiler/argocompiler/common.go, addExitTask: an Argo exit hook (#11470)",
    ),
    "PipelineTaskFinalStatus input": (
        "2.14.0",
        "argocompiler/dag.go, addImplicitDependencies: 'task final status not supported yet' before (#11953)",
    ),
    "retry policy inside a sub-DAG": ("2.14.0", "argocompiler/container.go, getTaskRetryPolicySpec (#11861)"),
    "{{$.pipeline_job_uuid}} placeholder": ("2.5.0", "backend/src/v2/driver, resolve.go (#11599)"),
    "pvcMount by pvcNameParameter": ("2.5.0", "kubernetes_platform proto read by cmd/driver/main.go (#11770)"),
    "pod activeDeadlineSeconds": ("2.1.0", "backend/src/v2/driver/driver.go"),
    "resource quantities as strings": ("2.4.0", "backend/src/v2/compiler/argocompiler/container.go (#11501)"),
    # A task outside a loop that depends on it: 2.0-2.3 name the loop's Argo tasks otherwise and refuse the workflow
    # ("invalid dependency for-loop-2", #10050); #11627 fixed the name, in 2.4.1 (read from the CHANGELOG's sections).
    "fan-in after a ParallelFor": ("2.4.1", "argocompiler/dag.go, iteratorTask and depends (#11627)"),
    # The SDK writes the accelerator twice: type/count, which every v2 driver makes the container's limit, and
    # resourceType/resourceCount, which 2.4.0's reads first (#11501, with the quantities as strings).
    "GPU request (accelerator)": ("2.0.0", "backend/src/v2/driver/driver.go, initPodSpecPatch: accelerator type/count"),
}


def features_used(spec: dict, platform: dict) -> set[str]:
    """What the compiled YAML asks of the backend, read from the YAML itself."""
    text = yaml.safe_dump(spec)
    executors = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"].values()
    sub_dags = [c["dag"]["tasks"] for c in spec["components"].values() if "dag" in c]
    loops = {name for tasks in sub_dags for name, t in tasks.items() if "parameterIterator" in t}
    found = {
        "exit handler that reports the run's state": any(
            t.get("triggerPolicy", {}).get("strategy") == "ALL_UPSTREAM_TASKS_COMPLETED"
            for t in spec["root"]["dag"]["tasks"].values()
        ),
        "PipelineTaskFinalStatus input": "taskFinalStatus" in text,
        "retry policy inside a sub-DAG": any("retryPolicy" in t for tasks in sub_dags for t in tasks.values()),
        "{{$.pipeline_job_uuid}} placeholder": "{{$.pipeline_job_uuid}}" in text,
        "pvcMount by pvcNameParameter": any("pvcNameParameter" in m for e in executors for m in e.get("pvcMount", [])),
        "pod activeDeadlineSeconds": any("activeDeadlineSeconds" in e for e in executors),
        "resource quantities as strings": any(
            "resourceCpuLimit" in e["container"].get("resources", {})
            for e in spec["deploymentSpec"]["executors"].values()
        ),
        "fan-in after a ParallelFor": any(
            dependency in loops
            for tasks in sub_dags
            for t in tasks.values()
            for dependency in t.get("dependentTasks", [])
        ),
        "GPU request (accelerator)": any(
            "accelerator" in e["container"].get("resources", {}) for e in spec["deploymentSpec"]["executors"].values()
        ),
    }
    return {name for name, used in found.items() if used}


def test_the_minimum_kfp_backend_is_what_the_compiled_yaml_needs() -> None:
    """The README and `submit` name MIN_KFP_BACKEND; it must be the newest first release among the features used."""
    from pipelines import MIN_KFP_BACKEND

    spec, platform = yaml.safe_load_all(COMPILED_PIPELINE.read_text())
    used = features_used(spec, platform)
    assert {"PipelineTaskFinalStatus input", "retry policy inside a sub-DAG", "fan-in after a ParallelFor"} <= used
    assert "GPU request (accelerator)" in used
    needed = max((KFP_FEATURES[name][0] for name in used), key=lambda v: tuple(map(int, v.split("."))))
    assert needed == MIN_KFP_BACKEND
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    assert f"KFP backend {MIN_KFP_BACKEND} or newer" in readme
