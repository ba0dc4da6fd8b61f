"""The TrainJob and our ClusterTrainingRuntime (components/launch_training/trainjob.py): what they hold, what a run
may not ask of them, and that the real API server takes both whole against the Kubeflow Trainer v2.3.0 CRDs."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes
import pytest
import yaml

from common.errors import InputError
from components.launch_training.config import LaunchConfig
from components.launch_training.manifest import JobSpec, render_job
from components.launch_training.platform import Platform, run_options
from components.launch_training.rendering import SPEC_HASH_ANNOTATION
from components.launch_training.trainjob import PATCH_MANAGER, TRAINJOB, render_runtime, runtime_command
from pipelines.cli import main
from tests.helpers import RENDER_JOB

REPO = Path(__file__).resolve().parents[1]
RESERVED = {"PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT"}


def leaves(obj: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(obj, dict):
        return {k: v for key, value in obj.items() for k, v in leaves(value, f"{prefix}.{key}").items()}
    if isinstance(obj, list):
        return {k: v for i, value in enumerate(obj) for k, v in leaves(value, f"{prefix}[{i}]").items()}
    return {prefix: obj}


def kept(sent: Any, stored: Any) -> list[str]:
    """The fields of `sent` that `stored` lost or changed (fields `stored` adds, its schema's defaults, are fine)."""
    after = leaves(stored)
    return [
        f"{path}: {value!r} -> {after.get(path, 'pruned')!r}"
        for path, value in leaves(sent).items()
        if after.get(path, object()) != value
    ]


def trainjob_spec(**overrides: Any) -> JobSpec:
    return JobSpec(
        **{
            "name": "hpp-r1-train-0123456789",
            "image": "img:1",
            "trainer_args": ["--preset", "tiny"],
            "job_api": "trainjob",
            **overrides,
        }
    )


def test_a_trainjob_names_the_runtime_and_sets_only_what_a_run_chooses() -> None:
    job = render_job(trainjob_spec(grace_period_s=300, shm_size="64Gi", labels={"hyperpod-pretrain.io/run-id": "r1"}))
    spec = job["spec"]
    assert (job["apiVersion"], job["kind"]) == ("trainer.kubeflow.org/v1alpha1", "TrainJob")
    assert spec["runtimeRef"] == {
        "apiGroup": "trainer.kubeflow.org",
        "kind": "ClusterTrainingRuntime",
        "name": "hyperpod-pretrain",
    }
    trainer = spec["trainer"]
    assert (trainer["numNodes"], trainer["numProcPerNode"], trainer["args"]) == (2, 8, ["--preset", "tiny"])
    assert trainer["resourcesPerNode"]["limits"]["nvidia.com/gpu"] == 8
    assert "command" not in trainer, "torchrun's settings are the runtime's"
    env = {e["name"]: e["value"] for e in trainer["env"]}
    assert not RESERVED & set(env), "Trainer's webhook refuses the torch plugin's own variables"
    assert env["TRAINER_GRACE_PERIOD_S"] == "300" and env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == "280"
    (patch,) = spec["runtimePatches"]
    pod = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
    assert patch["manager"] == PATCH_MANAGER and pod["metadata"]["labels"] == {"hyperpod-pretrain.io/run-id": "r1"}
    assert pod["spec"]["terminationGracePeriodSeconds"] == 300
    assert pod["spec"]["volumes"] == [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "64Gi"}}]
    assert "sagemaker.amazonaws.com/enable-job-auto-resume" not in job["metadata"]["annotations"]


def test_the_runtime_holds_the_platforms_pod_torchrun_and_the_restart_budget() -> None:
    runtime = render_runtime(
        trainjob_spec(
            restart_budget=5, service_account="trainer", image="", tolerations=[{"key": "team", "operator": "Exists"}]
        )
    )
    jobset = runtime["spec"]["template"]["spec"]
    (node,) = jobset["replicatedJobs"]
    pod = node["template"]["spec"]["template"]["spec"]
    assert jobset["failurePolicy"] == {"maxRestarts": 5}
    assert node["template"]["metadata"]["labels"] == {"trainer.kubeflow.org/trainjob-ancestor-step": "trainer"}
    assert node["template"]["spec"]["backoffLimit"] == 0 and pod["restartPolicy"] == "Never"
    assert pod["containers"][0]["command"] == runtime_command() and "image" not in pod["containers"][0]
    assert "--max-restarts=0" in runtime_command() and "--node-rank=$(PET_NODE_RANK)" in runtime_command()
    assert (pod["serviceAccountName"], pod["automountServiceAccountToken"]) == ("trainer", False)
    assert pod["tolerations"] == [{"key": "team", "operator": "Exists"}]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"restart_budget": 2},
            "job option 'restart_budget' does not apply to a TrainJob: its restarts are its "
            "runtime's (JobSet failurePolicy.maxRestarts), set by the platform team with `hyperpod-pretrain "
            "render-runtime --restart-budget N`",
        ),
        ({"max_restarts": 1}, "job option 'max_restarts' does not apply to a TrainJob: torchrun does not restart"),
        (
            {"auto_resume": True},
            "job option 'auto_resume' does not apply to a TrainJob: HyperPod auto-resume covers PyTorchJobs only",
        ),
        ({"rdzv_backend": "c10d"}, "job option 'rdzv_backend' does not apply to a TrainJob"),
    ],
)
def test_what_a_trainjob_has_no_place_for_is_refused_in_one_line(options: dict[str, Any], message: str) -> None:
    with pytest.raises(InputError) as refused:
        run_options(options, "trainjob")
    assert str(refused.value).startswith(message) and "\n" not in str(refused.value)
    assert run_options(options, "pytorchjob") == options, "a PyTorchJob takes them"


def test_elastic_sizes_and_auto_resume_are_refused_for_a_trainjob() -> None:
    with pytest.raises(InputError, match=r"max_nodes 4 above nnodes 2: Kubeflow Trainer v2.2\+ has no elastic"):
        render_job(trainjob_spec(min_nodes=2, max_nodes=4))
    with pytest.raises(InputError, match="HyperPod auto-resume covers PyTorchJobs only, not TrainJobs"):
        render_job(trainjob_spec(auto_resume=True))
    with pytest.raises(InputError, match="job API 'mpijob' is unknown: choose one of pytorchjob, trainjob, hyperpod"):
        Platform(job_api="mpijob")
    cfg = LaunchConfig.of(
        storage_root="/fsx",
        dataset="d",
        run_id="r",
        backend="kubernetes",
        nnodes=2,
        nproc_per_node=8,
        image="img:1",
        platform=Platform(job_api="trainjob"),
        job_options={"auto_resume_wait_s": 10},
    )
    with pytest.raises(InputError, match="'auto_resume_wait_s' does not apply to a TrainJob"):
        cfg.job_spec()


def test_deploy_runtime_is_render_runtime_with_its_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["render-runtime"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert yaml.safe_load((REPO / "deploy/trainjob-runtime.yaml").read_text()) == printed, (
        "deploy/trainjob-runtime.yaml is stale: hyperpod-pretrain render-runtime > deploy/trainjob-runtime.yaml "
        "(and keep its header)"
    )


def test_the_compiled_pipeline_carries_the_job_api_to_every_step_that_talks_to_the_cluster(tmp_path: Path) -> None:
    assert main(["compile", "--job-api", "trainjob", "--output", str(tmp_path / "p.yaml")]) == 0
    text = (tmp_path / "p.yaml").read_text()
    # The launcher and the preflight get it in the platform constant; the exit step and verify_nccl as a parameter.
    assert text.count("job_api: trainjob") == 2 and text.count("constant: trainjob") == 2, text.count("trainjob")
    assert "pytorchjob" not in text.replace("launch_pytorchjob", "").replace("launch-pytorchjob", "")


def test_render_runtime_and_the_trainjob_it_runs_are_accepted_whole_by_the_api_server(control_plane: Any) -> None:
    """What `render-runtime` and `render-job --job-api trainjob` print, created on the real API server with strict
    field validation against the v2.3.0 CRDs (the TrainJob through Trainer's webhooks, and Kueue's, as installed):
    a field the schema does not know is refused rather than pruned, and both are stored as rendered."""
    from tests.cluster.control_plane import trainer_skip_reason

    if reason := trainer_skip_reason():
        pytest.skip(reason)
    command = [
        sys.executable,
        "-m",
        "pipelines.cli",
        "render-runtime",
        "--trainer-toleration",
        "team=a:NoSchedule",
        "--restart-budget",
        "5",
    ]
    runtime = yaml.safe_load(subprocess.run(command, capture_output=True, text=True, timeout=120, check=True).stdout)
    printed = subprocess.run([*RENDER_JOB, "--job-api", "trainjob"], capture_output=True, text=True, timeout=120)
    assert printed.returncode == 0, printed.stderr
    job = yaml.safe_load(printed.stdout)
    api = kubernetes.client.CustomObjectsApi(control_plane.admin)
    group, version = TRAINJOB.group, TRAINJOB.version
    namespace = control_plane.test_namespace()
    try:
        stored_runtime = api.create_cluster_custom_object(
            group, version, "clustertrainingruntimes", runtime, field_validation="Strict"
        )
        job["metadata"]["namespace"] = namespace
        stored = api.create_namespaced_custom_object(
            group, version, namespace, "trainjobs", job, dry_run="All", field_validation="Strict"
        )
        unknown = copy.deepcopy(job)
        unknown["spec"]["trainer"]["shmSize"] = "1Gi"
        with pytest.raises(kubernetes.client.exceptions.ApiException) as refused:
            api.create_namespaced_custom_object(
                group, version, namespace, "trainjobs", unknown, dry_run="All", field_validation="Strict"
            )
    finally:
        api.delete_cluster_custom_object(group, version, "clustertrainingruntimes", runtime["metadata"]["name"])
        control_plane.delete_namespace(namespace)
    # Stored as rendered: every field kept with its value; the CRD's defaults added (replicas 1, restartStrategy).
    assert kept(runtime["spec"], stored_runtime["spec"]) == [], "fields the schema pruned or changed"
    assert stored_runtime["spec"]["template"]["spec"]["failurePolicy"] == {
        "maxRestarts": 5,
        "restartStrategy": "Recreate",
    }
    sent = {k: v for k, v in job["spec"].items() if k != "runtimePatches"}
    assert kept(sent, stored["spec"]) == [], "fields the schema pruned or changed"
    assert (stored["spec"]["managedBy"], stored["spec"]["suspend"]) == (
        "trainer.kubeflow.org/trainjob-controller",
        False,
    ), "the CRD's defaults"
    ours = next(p for p in stored["spec"]["runtimePatches"] if p["manager"] == PATCH_MANAGER)
    # Trainer's defaulting webhook stamps each patch's time (pkg/webhooks/trainjob_webhook.go); Kueue's adds its own.
    assert {k: v for k, v in ours.items() if k != "time"} == job["spec"]["runtimePatches"][0]
    assert refused.value.status == 400 and "unknown field" in refused.value.body and "shmSize" in refused.value.body


def test_the_grace_period_is_patched_only_when_it_is_not_the_runtimes() -> None:
    """Kueue v0.19.2 drops a runtime patch's grace period (trainjob.py): none is sent when the runtime's is the run's;
    the spec digest is the run's either way, so a retried step finds its job whether the runtime was readable or
    not; a queued TrainJob whose grace period is not the runtime's is refused in one line."""
    unknown = render_job(trainjob_spec(queue_name="q"))
    same = render_job(trainjob_spec(queue_name="q", runtime_grace_period_s=120))
    other = render_job(trainjob_spec(runtime_grace_period_s=30))

    def pod_patch(job: dict[str, Any]) -> dict[str, Any]:
        patch = job["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]
        return patch["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]

    assert (
        pod_patch(unknown)["terminationGracePeriodSeconds"] == 120
        and pod_patch(other)["terminationGracePeriodSeconds"] == 120
    )
    assert "terminationGracePeriodSeconds" not in pod_patch(same)
    assert (
        same["metadata"]["annotations"][SPEC_HASH_ANNOTATION]
        == unknown["metadata"]["annotations"][SPEC_HASH_ANNOTATION]
    )
    with pytest.raises(InputError, match=r"^grace_period_s 120 is not ClusterTrainingRuntime hyperpod-pretrain's 30, "):
        render_job(trainjob_spec(queue_name="q", runtime_grace_period_s=30))
