"""The compiled pipeline: no drift from the code, and a whole run of the checked-in YAML through kfp.local."""

import json
import subprocess
import sys
from pathlib import Path

import yaml

from pipelines import COMPILED_PIPELINE
from trainer.layout import RunPaths

CLI = str(Path(sys.executable).parent / "hyperpod-pretrain")
STEPS = {"preflight", "stage-data", "launch-pytorchjob", "verify-nccl", "evaluate-checkpoint"}


def all_tasks(spec: dict) -> dict[str, dict]:
    """The tasks of the root DAG and of every sub-DAG (the exit handler's group holds the four steps)."""
    tasks = dict(spec["root"]["dag"]["tasks"])
    for component in spec["components"].values():
        tasks |= component.get("dag", {}).get("tasks", {})
    return tasks


def test_checked_in_yaml_matches_a_fresh_compile() -> None:
    result = subprocess.run([CLI, "compile", "--check"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_drift_is_detected(tmp_path: Path) -> None:
    stale = tmp_path / "pipeline.yaml"
    stale.write_text(COMPILED_PIPELINE.read_text().replace("defaultValue: 5000.0", "defaultValue: 4000.0"))
    assert stale.read_text() != COMPILED_PIPELINE.read_text()
    result = subprocess.run(
        [CLI, "compile", "--check", "--output", str(stale)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 1
    assert "differs from a fresh compile" in result.stderr.splitlines()[-1]
    assert any(line.startswith("-") and "defaultValue: 4000.0" in line for line in result.stderr.splitlines())


def test_compiled_pipeline_chains_the_four_steps_inside_an_exit_handler() -> None:
    spec = next(yaml.safe_load_all(COMPILED_PIPELINE.read_text()))
    root = spec["root"]["dag"]["tasks"]
    assert set(root) == {"exit-handler-1", "summarize-run"}
    assert set(spec["components"]["comp-exit-handler-1"]["dag"]["tasks"]) == STEPS
    tasks = all_tasks(spec)
    assert tasks["stage-data"]["dependentTasks"] == ["preflight"]  # a cluster that cannot run the job fails first
    assert tasks["launch-pytorchjob"]["dependentTasks"] == ["stage-data"]
    assert "launch-pytorchjob" in tasks["evaluate-checkpoint"]["dependentTasks"]
    # The summary runs however the steps ended, and gets the pipeline's final status.
    assert root["summarize-run"]["triggerPolicy"]["strategy"] == "ALL_UPSTREAM_TASKS_COMPLETED"
    status = root["summarize-run"]["inputs"]["parameters"]["status"]
    assert status == {"taskFinalStatus": {"producerTask": "exit-handler-1"}}
    # A retried launcher re-attaches: it is given the KFP run's id.
    launcher = tasks["launch-pytorchjob"]["inputs"]["parameters"]
    assert launcher["pipeline_run_id"]["runtimeValue"]["constant"] == "{{$.pipeline_job_uuid}}"


def test_run_local_executes_the_compiled_pipeline_end_to_end(corpus: Path, tmp_path: Path) -> None:
    root = tmp_path / "fsx"
    result = subprocess.run(
        [
            CLI,
            "run-local",
            "--storage-root",
            str(root),
            "--source",
            str(corpus),
            "--include",
            "*.txt",
            "--dataset",
            "synthetic",
            "--run-id",
            "e2e",
            "--vocab-size",
            "512",
            "--preset",
            "tiny",
            "--max-steps",
            "40",
            "--seq-len",
            "64",
            "--checkpoint-every",
            "20",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "local pipeline run e2e succeeded" in result.stdout
    run = RunPaths.of(root, "e2e")
    evaluation = json.loads(run.eval_result.read_text())
    assert evaluation["step"] == 40
    assert evaluation["val_loss"] < evaluation["untrained_val_loss"] - 1.0
    assert "Communication check: passed" in run.comms_verification.read_text()
    kfp_reports = {p.parent.name: p for p in (root / "kfp-local" / "e2e").rglob("report")}
    assert set(kfp_reports) == STEPS
    assert "| copied |" in kfp_reports["stage-data"].read_text()
    for name, path in kfp_reports.items():
        assert str(path) in result.stdout, name
    summary = json.loads(run.summary.read_text())
    assert summary["state"] == "SUCCEEDED" and summary["run_id"] == "e2e"
    outcomes = {s["step"]: s["state"] for s in summary["steps"]}
    assert outcomes == dict.fromkeys(STEPS, "succeeded") | {"preflight": "skipped"}  # no cluster to check locally
    assert str(run.summary_report) in result.stdout

    # Continue the same run to step 60 without staging again: the trainer resumes from its step-40 checkpoint.
    resumed = subprocess.run(
        [CLI, "run-local", "--storage-root", str(root), "--source", str(corpus), "--dataset", "synthetic",
         "--skip-staging", "--resume-run-id", "e2e", "--vocab-size", "512", "--preset", "tiny", "--max-steps", "60",
         "--seq-len", "64", "--checkpoint-every", "20"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "resumed at step 40" in resumed.stdout + resumed.stderr
    assert json.loads(run.eval_result.read_text())["step"] == 60
    steps = [json.loads(line)["step"] for line in run.metrics.read_text().splitlines()]
    assert steps == sorted(set(steps)) and steps[-1] == 60  # one row per step, none repeated
    outcomes = {s["step"]: s["state"] for s in json.loads(run.summary.read_text())["steps"]}
    assert outcomes["stage-data"] == "skipped" and outcomes["launch-pytorchjob"] == "succeeded"


def test_run_local_fails_when_a_step_fails(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    result = subprocess.run(
        [CLI, "run-local", "--storage-root", str(tmp_path / "fsx"), "--source", str(empty), "--run-id", "broken"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 1
    assert "stage-data" in result.stderr.splitlines()[-1]
    assert "no files to stage" in result.stderr + result.stdout
    # The exit step still wrote the summary: which step failed, and why.
    summary = json.loads(RunPaths.of(tmp_path / "fsx", "broken").summary.read_text())
    assert summary["state"] == "FAILED"
    outcomes = {s["step"]: s for s in summary["steps"]}
    assert outcomes["stage-data"]["state"] == "failed" and "no files to stage" in outcomes["stage-data"]["error"]
    assert outcomes["launch-pytorchjob"]["state"] == "no record"


def test_resuming_a_run_without_a_checkpoint_fails_early(staged_copy: Path) -> None:
    result = subprocess.run(
        [CLI, "run-local", "--storage-root", str(staged_copy), "--dataset", "synthetic", "--skip-staging",
         "--resume-run-id", "never-trained", "--preset", "tiny", "--max-steps", "2"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 1
    assert "resume_run_id 'never-trained'" in result.stdout + result.stderr
    assert "holds no checkpoint to continue from" in result.stdout + result.stderr


def executor_of(spec: dict, task: str) -> str:
    return all_tasks(spec)[task]["componentRef"]["name"].replace("comp-", "exec-")


def test_the_platform_settings_are_on_the_right_steps(tmp_path: Path) -> None:
    output = tmp_path / "cluster.yaml"
    result = subprocess.run(
        [CLI, "compile", "--output", str(output), "--node-selector", "role=cpu-workers", "--toleration",
         "dedicated=pipelines:NoSchedule", "--image-pull-secret", "ecr-pull"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    pipeline_spec, platform = yaml.safe_load_all(output.read_text())
    executors = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    tasks = {name: task for name, task in all_tasks(pipeline_spec).items() if "componentRef" in task
             and name != "exit-handler-1"}  # fmt: skip
    assert set(tasks) == STEPS | {"summarize-run"}
    for name in tasks:
        k8s = executors[executor_of(pipeline_spec, name)]
        assert k8s["pvcMount"][0]["mountPath"] == "/fsx"
        # The steps inside the exit handler's group see the parameter through the group's input channel.
        pvc = k8s["pvcMount"][0]["pvcNameParameter"]["componentInputParameter"]
        assert pvc == ("fsx_pvc" if name == "summarize-run" else "pipelinechannel--fsx_pvc"), name
        assert k8s["nodeSelector"]["labels"] == {"role": "cpu-workers"}
        assert k8s["tolerations"] == [{"key": "dedicated", "operator": "Equal", "value": "pipelines",
                                       "effect": "NoSchedule"}]  # fmt: skip
        assert [s["secretName"] for s in k8s["imagePullSecret"]] == ["ecr-pull"]
    group_inputs = pipeline_spec["root"]["dag"]["tasks"]["exit-handler-1"]["inputs"]["parameters"]
    assert group_inputs["pipelinechannel--fsx_pvc"] == {"componentInputParameter": "fsx_pvc"}
    assert "activeDeadlineSeconds" not in executors[executor_of(pipeline_spec, "launch-pytorchjob")]
    assert executors[executor_of(pipeline_spec, "stage-data")]["activeDeadlineSeconds"] == "21600"
    # Caching off where a step must rerun; retries with backoff where a rerun is safe and often helps.
    for name, cached, retries in (("preflight", False, 0), ("stage-data", True, 2), ("launch-pytorchjob", False, 0),
                                  ("verify-nccl", True, 2), ("evaluate-checkpoint", False, 0),
                                  ("summarize-run", False, 0)):  # fmt: skip
        task = tasks[name]
        assert task.get("cachingOptions", {}).get("enableCache", False) is cached, name
        assert task.get("retryPolicy", {}).get("maxRetryCount", 0) == retries, name
        if retries:
            assert task["retryPolicy"]["backoffFactor"] == 2.0 and task["retryPolicy"]["backoffDuration"] == "10s"
    resources = {name: pipeline_spec["deploymentSpec"]["executors"][executor_of(pipeline_spec, name)]["container"]
                 ["resources"] for name in tasks}  # fmt: skip
    assert resources["launch-pytorchjob"]["resourceCpuLimit"] == "500m"
    assert resources["evaluate-checkpoint"]["resourceMemoryLimit"] == "32Gi"


def test_the_compiled_yaml_round_trips_through_kfp() -> None:
    from kfp import components

    loaded = components.load_component_from_file(str(COMPILED_PIPELINE))
    assert loaded.name == "hyperpod-pretrain"
    assert {"source", "fsx_pvc", "storage_root", "trainer_image", "skip_staging", "resume_run_id"} <= set(
        loaded.component_spec.inputs
    )


def test_the_images_come_from_the_registry_and_tag(tmp_path: Path) -> None:
    registry = "123456789012.dkr.ecr.us-west-2.amazonaws.com"
    output = tmp_path / "cluster.yaml"
    result = subprocess.run([CLI, "compile", "--output", str(output), "--image-registry", registry, "--tag", "v7"],
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    assert result.returncode == 0, result.stderr
    spec = next(yaml.safe_load_all(output.read_text()))
    containers = [e["container"] for e in spec["deploymentSpec"]["executors"].values()]
    assert len(containers) == 6
    assert {c["image"] for c in containers} == {f"{registry}/hyperpod-pretrain-components:v7"}
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
        "hyperpod-pretrain-components:0.1.0"
    }
    bad = subprocess.run([CLI, "compile", "--output", str(tmp_path / "x.yaml"), "--image-registry", "https://ecr"],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert bad.returncode == 2 and "image registry 'https://ecr'" in bad.stderr.splitlines()[-1]
    assert not (tmp_path / "x.yaml").exists()


def test_the_readme_lists_every_parameter_with_its_default() -> None:
    import re

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    table = readme.split("### Pipeline parameters", 1)[1].split("\n### ", 1)[0]
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
