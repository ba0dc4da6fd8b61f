"""The compiled pipeline: no drift from the code, and a whole run of the checked-in YAML through kfp.local."""

import json
import subprocess
import sys
from pathlib import Path

import yaml

from pipelines import COMPILED_PIPELINE
from trainer.layout import RunPaths

CLI = str(Path(sys.executable).parent / "hyperpod-pretrain")


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


def test_compiled_pipeline_chains_the_four_steps() -> None:
    spec = next(yaml.safe_load_all(COMPILED_PIPELINE.read_text()))
    tasks = spec["root"]["dag"]["tasks"]
    assert set(tasks) == {"stage-data", "launch-pytorchjob", "verify-nccl", "evaluate-checkpoint"}
    assert tasks["launch-pytorchjob"]["dependentTasks"] == ["stage-data"]
    assert "launch-pytorchjob" in tasks["evaluate-checkpoint"]["dependentTasks"]
    assert "pip install" not in COMPILED_PIPELINE.read_text()


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
    assert set(kfp_reports) == {"stage-data", "launch-pytorchjob", "verify-nccl", "evaluate-checkpoint"}
    assert "| copied |" in kfp_reports["stage-data"].read_text()
    for name, path in kfp_reports.items():
        assert str(path) in result.stdout, name


def test_run_local_fails_when_a_step_fails(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    result = subprocess.run(
        [CLI, "run-local", "--storage-root", str(tmp_path / "fsx"), "--source", str(empty)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 1
    assert "Inner task failed" in result.stderr.splitlines()[-1] and "stage-data" in result.stderr.splitlines()[-1]
    assert "no files to stage" in result.stderr + result.stdout


def executor_of(spec: dict, task: str) -> str:
    return spec["root"]["dag"]["tasks"][task]["componentRef"]["name"].replace("comp-", "exec-")


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
    tasks = pipeline_spec["root"]["dag"]["tasks"]
    assert set(tasks) == {"stage-data", "launch-pytorchjob", "verify-nccl", "evaluate-checkpoint"}
    for name in tasks:
        k8s = executors[executor_of(pipeline_spec, name)]
        assert k8s["pvcMount"][0]["mountPath"] == "/fsx"
        assert k8s["pvcMount"][0]["pvcNameParameter"]["componentInputParameter"] == "fsx_pvc"
        assert k8s["nodeSelector"]["labels"] == {"role": "cpu-workers"}
        assert k8s["tolerations"] == [{"key": "dedicated", "operator": "Equal", "value": "pipelines",
                                       "effect": "NoSchedule"}]  # fmt: skip
        assert [s["secretName"] for s in k8s["imagePullSecret"]] == ["ecr-pull"]
    assert "activeDeadlineSeconds" not in executors[executor_of(pipeline_spec, "launch-pytorchjob")]
    assert executors[executor_of(pipeline_spec, "stage-data")]["activeDeadlineSeconds"] == "21600"
    # Caching off where a step must rerun; retries with backoff where a rerun is safe and often helps.
    for name, cached, retries in (("stage-data", True, 2), ("launch-pytorchjob", False, 0), ("verify-nccl", True, 2),
                                  ("evaluate-checkpoint", False, 0)):  # fmt: skip
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
    assert {"source", "fsx_pvc", "storage_root", "trainer_image"} <= set(loaded.component_spec.inputs)
