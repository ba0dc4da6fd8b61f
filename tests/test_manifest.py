"""The PyTorchJob manifest: the seed's, field for field where the seed is right; valid against the CRD."""

from __future__ import annotations

import copy
import subprocess
from dataclasses import replace
from pathlib import Path
from typing import Any

import kubernetes
import pytest
import yaml

from common.errors import InputError
from components.launch_training.manifest import JobSpec, job_name, render_job
from components.launch_training.rendering import AUTO_RESUME, MAX_RETRY, RDZV_STORE_OPT_OUT, SPEC_HASH_ANNOTATION
from tests.helpers import RENDER_JOB

# The seed tutorial's manifest (its "pytorchjob-ddp.yaml"), as our users apply it today.
SEED = yaml.safe_load("""
apiVersion: kubeflow.org/v1
kind: PyTorchJob
metadata:
  name: ddp-pretrain
  namespace: kubeflow
spec:
  elasticPolicy:
    rdzvBackend: c10d
    minReplicas: 2
    maxReplicas: 2
  pytorchReplicaSpecs:
    Worker:
      replicas: 2
      restartPolicy: OnFailure
      template:
        spec:
          terminationGracePeriodSeconds: 120
          containers:
            - name: pytorch
              image: 123456789012.dkr.ecr.us-east-1.amazonaws.com/ddp-pretrain:latest
              command:
                - torchrun
                - --nnodes=2
                - --nproc_per_node=8
                - --rdzv_backend=c10d
                - --rdzv_endpoint=$(MASTER_ADDR):$(MASTER_PORT)
                - /workspace/train_ddp.py
              resources:
                requests: {nvidia.com/gpu: 8, vpc.amazonaws.com/efa: 32, memory: "512Gi", cpu: "96"}
                limits: {nvidia.com/gpu: 8, vpc.amazonaws.com/efa: 32, memory: "512Gi", cpu: "96"}
              env:
                - {name: NCCL_DEBUG, value: "INFO"}
                - {name: FI_EFA_USE_DEVICE_RDMA, value: "1"}
                - {name: FI_PROVIDER, value: "efa"}
              volumeMounts:
                - {name: fsx-pvc, mountPath: /fsx}
                - {name: dshm, mountPath: /dev/shm}
          volumes:
            - name: fsx-pvc
              persistentVolumeClaim: {claimName: fsx-lustre-pvc}
            - name: dshm
              emptyDir: {medium: Memory, sizeLimit: "256Gi"}
          tolerations:
            - {key: nvidia.com/gpu, operator: Exists, effect: NoSchedule}
""")

CONTAINER_PATH = "spec.pytorchReplicaSpecs.Worker.template.spec.containers[0]"
# Where ours differs from the seed, and why: every other field of the seed is reproduced exactly.
DIFFERENCES = {
    f"{CONTAINER_PATH}.command": (
        "the operator gives a Worker-only elastic job no MASTER_ADDR/MASTER_PORT, so the seed's rdzv endpoint "
        "stays the literal '$(MASTER_ADDR):$(MASTER_PORT)'; ours is $(PET_RDZV_ENDPOINT) (<job>-worker-0:<port>), "
        "and it runs the installed trainer module with its flags rather than a script path"
    ),
}


def seed_spec(**overrides: Any) -> JobSpec:
    settings: dict[str, Any] = dict(
        name="ddp-pretrain",
        image="123456789012.dkr.ecr.us-east-1.amazonaws.com/ddp-pretrain:latest",
        trainer_args=["--data-dir", "/fsx/datasets/corpus/tokenized", "--run-dir", "/fsx/runs/r1"],
        instance_type="p5.48xlarge",
        min_nodes=2,
        max_nodes=2,
    )
    return JobSpec(**{**settings, **overrides})


def leaves(obj: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(obj, dict):
        return {
            k: v for key, value in obj.items() for k, v in leaves(value, f"{prefix}.{key}" if prefix else key).items()
        }
    if isinstance(obj, list) and obj and all(isinstance(x, dict) and "name" in x for x in obj):
        return {k: v for x in obj for k, v in leaves(x, f"{prefix}[{x['name']}]").items()}
    if isinstance(obj, list) and obj and all(isinstance(x, dict) for x in obj):
        return {k: v for i, x in enumerate(obj) for k, v in leaves(x, f"{prefix}[{i}]").items()}
    return {prefix: obj}


def test_the_seed_parameters_reproduce_the_seed_field_for_field() -> None:
    ours = render_job(seed_spec())
    theirs = leaves(SEED)
    mine = leaves(ours)
    differing = set()
    for path, value in theirs.items():
        container_field = path.split("[pytorch].", 1)[-1] if "[pytorch]." in path else ""
        if container_field.startswith("command"):
            differing.add(f"{CONTAINER_PATH}.command")
            continue
        assert mine.get(path) == value, f"{path}: seed {value!r}, ours {mine.get(path)!r}"
    assert differing == set(DIFFERENCES)
    command = ours["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["command"]
    assert command[:3] == ["torchrun", "--nnodes=2", "--nproc-per-node=8"]
    assert "--rdzv-endpoint=$(PET_RDZV_ENDPOINT)" in command and "--rdzv-backend=c10d" in command
    assert command[-4:] == ["--data-dir", "/fsx/datasets/corpus/tokenized", "--run-dir", "/fsx/runs/r1"]


def test_what_ours_adds_to_the_seed() -> None:
    job = render_job(seed_spec())
    spec = job["spec"]
    # Three whole-job restarts of the seed's 2 nodes survive; the fourth fails the job (a job-wide count).
    assert spec["runPolicy"] == {"cleanPodPolicy": "Running", "backoffLimit": 7, "ttlSecondsAfterFinished": 604800}
    assert spec["nprocPerNode"] == "8" and spec["elasticPolicy"]["maxRestarts"] == 3
    assert job["metadata"]["annotations"][AUTO_RESUME] == "true" and job["metadata"]["annotations"][MAX_RETRY] == "3"
    pod = spec["pytorchReplicaSpecs"]["Worker"]["template"]
    assert pod["metadata"]["annotations"]["sidecar.istio.io/inject"] == "false"
    required = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert (
        required["nodeSelectorTerms"][0]["matchExpressions"][0]["key"] == "sagemaker.amazonaws.com/node-health-status"
    )
    env = {e["name"]: e["value"] for e in pod["spec"]["containers"][0]["env"]}
    # torchrun SIGKILLs its workers its shutdown timeout after SIGTERM: by default the grace period, less a margin.
    assert (env["TRAINER_GRACE_PERIOD_S"], env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"]) == ("120", "100")
    env = {
        e["name"]: e["value"]
        for e in render_job(seed_spec(grace_period_s=300))["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"][
            "containers"
        ][0]["env"]
    }
    assert env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == "280", "derived from the grace period, not written twice"
    env = {
        e["name"]: e["value"]
        for e in render_job(seed_spec(shutdown_timeout_s=0))["spec"]["pytorchReplicaSpecs"]["Worker"]["template"][
            "spec"
        ]["containers"][0]["env"]
    }
    assert "TORCH_ELASTIC_SHUTDOWN_TIMEOUT" not in env, "0: torchrun's own default"
    assert len(job["metadata"]["annotations"][SPEC_HASH_ANNOTATION]) == 64


def test_elastic_nodes_and_instance_types() -> None:
    job = render_job(seed_spec(min_nodes=2, max_nodes=4, instance_type="ml.p5en.48xlarge"))
    worker = job["spec"]["pytorchReplicaSpecs"]["Worker"]
    assert "--nnodes=2:4" in worker["template"]["spec"]["containers"][0]["command"]
    assert (job["spec"]["elasticPolicy"]["minReplicas"], job["spec"]["elasticPolicy"]["maxReplicas"]) == (2, 4)
    assert worker["template"]["spec"]["containers"][0]["resources"]["limits"]["vpc.amazonaws.com/efa"] == 16
    p4d = render_job(seed_spec(instance_type="p4d.24xlarge"))["spec"]["pytorchReplicaSpecs"]["Worker"]
    assert p4d["template"]["spec"]["containers"][0]["resources"]["requests"]["vpc.amazonaws.com/efa"] == 4
    overridden = render_job(seed_spec(instance_type="custom.large", gpus_per_node=4, efa_per_node=0, nproc_per_node=4))
    resources = overridden["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == 4 and "vpc.amazonaws.com/efa" not in resources["limits"]


def test_elastic_replicas_with_and_without_a_queue() -> None:
    """Without a queue an elastic job asks for max_nodes pods and starts on nnodes: the late ones join the running
    job (experiments/elastic_membership.py: it works on the pinned torch with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1,
    and times out without it). Kueue counts Worker.replicas with no minimum, so a queued job is never elastic."""

    def shape(job: dict[str, Any]) -> tuple[int, int, int, str | None]:
        worker = job["spec"]["pytorchReplicaSpecs"]["Worker"]
        env = {e["name"]: e["value"] for e in worker["template"]["spec"]["containers"][0]["env"]}
        elastic = job["spec"]["elasticPolicy"]
        return worker["replicas"], elastic["minReplicas"], elastic["maxReplicas"], env.get(RDZV_STORE_OPT_OUT)

    assert shape(render_job(seed_spec(min_nodes=2, max_nodes=4))) == (4, 2, 4, "1")
    assert shape(render_job(seed_spec(min_nodes=2, max_nodes=2))) == (2, 2, 2, None)
    assert shape(render_job(seed_spec(min_nodes=2, max_nodes=2, queue_name="team-a"))) == (2, 2, 2, None)
    with pytest.raises(InputError, match="max_nodes 4 with Kueue queue 'team-a': Kueue admits the job only when all"):
        render_job(seed_spec(min_nodes=2, max_nodes=4, queue_name="team-a"))


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"nproc_per_node": 4}, "nproc-per-node 4 differs from the 8 GPUs"),
        ({"min_nodes": 3, "max_nodes": 2}, "need 1 <= min <= max"),
        ({"restart_policy": "Never"}, "auto-resume needs restartPolicy OnFailure"),
        ({"namespace": "training"}, "HyperPod auto-resumes jobs only in 'kubeflow'"),
        ({"name": "Bad_Name"}, "is not a DNS-1123 label"),
        ({"name": "x" * 60}, "is not a DNS-1123 label"),
        ({"instance_type": "m5.large"}, "instance type 'm5.large' is unknown"),
        ({"memory": "lots"}, "memory 'lots' is not a Kubernetes quantity"),
        ({"shutdown_timeout_s": 120}, "shutdown timeout 120s must be shorter than the 120s grace period"),
        ({"annotations": {AUTO_RESUME: "true"}}, "both or neither"),
    ],
    ids=[
        "nproc",
        "min-max",
        "restart-policy",
        "namespace",
        "name",
        "long-name",
        "instance",
        "memory",
        "shutdown",
        "half-auto-resume",
    ],
)
def test_inconsistent_inputs_fail_with_one_clear_line(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(InputError, match=message):
        render_job(seed_spec(**overrides))


def test_job_names_are_stable_per_pipeline_run_and_dns_safe() -> None:
    first = job_name("0a1b2c3d-run-uuid", "Nightly_Run.2026-11-30")
    assert first == job_name("0a1b2c3d-run-uuid", "Nightly_Run.2026-11-30"), "a retried step finds its job"
    assert first != job_name("another-run-uuid", "Nightly_Run.2026-11-30")
    render_job(seed_spec(name=first))  # a valid name


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"min_nodes": 1, "max_nodes": 4, "active_deadline_s": 3600},
        {
            "auto_resume": False,
            "namespace": "team-a",
            "owner": ("launcher-pod", "uid-1"),
            "node_selector": {"a": "b"},
            "service_account": "trainer",
            "image_pull_secrets": ["ecr-pull"],
        },
    ],
    ids=["seed", "elastic", "no-auto-resume"],
)
def test_every_rendered_manifest_is_accepted_whole_by_the_api_server(control_plane: Any, overrides: dict) -> None:
    """A server-side dry run with strict field validation on the real API server (the v1.8.1 CRD, the operator's
    webhook): a field the CRD's schema does not know is refused rather than silently pruned, and the job is stored
    as rendered."""
    namespace = control_plane.test_namespace()
    api = kubernetes.client.CustomObjectsApi(control_plane.admin)

    def dry_run(job: dict[str, Any]) -> dict[str, Any]:
        return api.create_namespaced_custom_object(
            "kubeflow.org", "v1", namespace, "pytorchjobs", job, dry_run="All", field_validation="Strict"
        )

    try:
        job = render_job(seed_spec(**{**overrides, "namespace": namespace}))
        stored = dry_run(job)
        unknown = copy.deepcopy(job)
        unknown["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["shmSize"] = "1Gi"
        with pytest.raises(kubernetes.client.exceptions.ApiException) as refused:
            dry_run(unknown)
    finally:
        control_plane.delete_namespace(namespace)
    # Only the CRD's own default is added (runPolicy.suspend: false).
    assert stored["spec"] == {**job["spec"], "runPolicy": {"suspend": False, **job["spec"]["runPolicy"]}}
    assert refused.value.status == 400 and "unknown field" in refused.value.body and "shmSize" in refused.value.body


def test_render_job_prints_yaml(tmp_path: Path) -> None:
    command = list(RENDER_JOB)
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    job = yaml.safe_load(result.stdout)
    assert job["kind"] == "PyTorchJob" and job["metadata"]["name"].startswith("hpp-r1-train-")
    bad = subprocess.run([*command[:-2], "--nproc-per-node", "4"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "nproc-per-node 4 differs" in bad.stderr.strip().splitlines()[-1]


def test_render_job_gives_the_trainer_its_runs_checkpoint_copies_prefix_and_endpoint() -> None:
    base = list(RENDER_JOB)

    def container(*extra: str) -> dict[str, Any]:
        result = subprocess.run([*base, *extra], capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        pod = yaml.safe_load(result.stdout)["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
        return pod["containers"][0]

    plain = container()
    assert "--checkpoint-s3-uri" not in plain["command"] and "AWS_ENDPOINT_URL" not in str(plain["env"])
    copied = container("--checkpoint-s3-uri", "s3://bucket/ckpts/", "--endpoint-url", "http://minio.storage:9000")
    flag = copied["command"].index("--checkpoint-s3-uri")
    assert copied["command"][flag + 1] == "s3://bucket/ckpts/r1", "the run's own prefix"
    assert {"name": "AWS_ENDPOINT_URL", "value": "http://minio.storage:9000"} in copied["env"]
    bad = subprocess.run([*base, "--checkpoint-s3-uri", "bucket/ckpts"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines()[-1] == (
        "hyperpod-pretrain render-job: error: checkpoint_s3_uri 'bucket/ckpts': not an S3 URI (expected s3://bucket/prefix)"
    )


def test_render_job_with_no_settings_renders_what_the_compiled_pipeline_runs(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The cluster commands default to the pipeline's own parameter defaults (pipelines.CLUSTER_DEFAULTS), read here
    from the checked-in compiled YAML: not the trainer's small CPU defaults of the local commands."""
    from pipelines import COMPILED_PIPELINE
    from pipelines.cli import main

    compiled = next(yaml.safe_load_all(COMPILED_PIPELINE.read_text()))  # the pipeline spec, then platform specs
    defaults = {k: v.get("defaultValue") for k, v in compiled["root"]["inputDefinitions"]["parameters"].items()}
    assert main(["render-job"]) == 0
    job = yaml.safe_load(capsys.readouterr().out)
    worker = job["spec"]["pytorchReplicaSpecs"]["Worker"]
    command = worker["template"]["spec"]["containers"][0]["command"]

    def flag(name: str) -> str:
        return command[command.index(name) + 1]

    # KFP writes integer defaults as numbers of its NUMBER_INTEGER type (8.0 in the YAML): compared as numbers
    assert worker["replicas"] == defaults["nnodes"] and int(job["spec"]["nprocPerNode"]) == defaults["nproc_per_node"]
    assert flag("--preset") == defaults["preset"] and int(flag("--max-steps")) == defaults["max_steps"]
    assert int(flag("--seq-len")) == defaults["seq_len"] and float(flag("--lr")) == defaults["lr"]
    assert int(flag("--batch-size")) == defaults["batch_size"]
    assert flag("--data-dir") == f"{defaults['storage_root']}/datasets/{defaults['dataset']}"
    assert job["spec"]["runPolicy"]["activeDeadlineSeconds"] == defaults["train_timeout_s"] + 300


def test_render_job_of_a_pipeline_file_is_the_launchers_job_for_its_defaults_and_params(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """render-job --pipeline-file prints the job a submission of the package with these --param values creates: the
    launcher's render_job of a LaunchConfig made of the package's defaults, its compiled platform and the params
    (stated here by hand, pipeline parameter by LaunchConfig field), whichever job API the package was compiled for."""
    from components.launch_training.config import LaunchConfig
    from components.launch_training.platform import Platform
    from pipelines import COMPILED_PIPELINE
    from pipelines.cli import main

    # What `compile --job-api trainjob` writes differs from the checked-in file in the job API constants only (the
    # platform's and the steps' job_api): swapped here, not compiled, which takes seconds.
    trainjob = tmp_path / "trainjob.yaml"
    trainjob.write_text(
        COMPILED_PIPELINE.read_text()
        .replace("job_api: pytorchjob", "job_api: trainjob")
        .replace("constant: pytorchjob", "constant: trainjob")
    )
    default = Platform(mount_path="/fsx", namespaces=("kubeflow",))  # what the default compile puts in
    image = "registry.example/hyperpod-pretrain-trainer:1"
    for package, platform, nodes in (
        (COMPILED_PIPELINE, default, 4),
        (trainjob, replace(default, job_api="trainjob"), 3),
    ):
        compiled = next(yaml.safe_load_all(package.read_text()))
        d = {k: v.get("defaultValue") for k, v in compiled["root"]["inputDefinitions"]["parameters"].items()}
        params = [
            f"nnodes={nodes}",
            "preset=gpt2-350m",
            f"trainer_image={image}",
            "max_steps=9000",
            "lr=0.0003",
            'job_options={"grace_period_s": 300}',
        ]
        assert main(["render-job", "--pipeline-file", str(package), *(a for p in params for a in ("--param", p))]) == 0
        printed = yaml.safe_load(capsys.readouterr().out)
        config = LaunchConfig.of(
            storage_root=d["storage_root"],
            dataset=d["dataset"],
            run_id="example",
            pipeline_run_id="example",
            backend=d["backend"],
            nnodes=nodes,
            max_nodes=int(d["max_nodes"]),
            nproc_per_node=int(d["nproc_per_node"]),
            preset="gpt2-350m",
            max_steps=9000,
            seed=int(d["seed"]),
            batch_size=int(d["batch_size"]),
            seq_len=int(d["seq_len"]),
            lr=0.0003,
            warmup_steps=int(d["warmup_steps"]),
            extend_schedule=d["extend_schedule"],
            dropout=d["dropout"],
            checkpoint_every=int(d["checkpoint_every"]),
            log_every=int(d["log_every"]),
            timeout_s=int(d["train_timeout_s"]),
            pending_timeout_s=int(d["pending_timeout_s"]),
            recovery_timeout_s=int(d["recovery_timeout_s"]),
            queue_timeout_s=int(d["queue_timeout_s"]),
            stall_timeout_s=int(d["stall_timeout_s"]),
            image=image,
            namespace=d["namespace"],
            instance_type=d["instance_type"],
            job_options={"grace_period_s": 300},
            stream_logs=d["stream_logs"],
            owner_reference=d["owner_reference"],
            platform=platform,
        )
        expected = render_job(config.job_spec())
        assert printed == expected
        if platform.job_api == "trainjob":
            trainer = printed["spec"]["trainer"]
            assert trainer["numNodes"] == nodes and trainer["image"] == image
            command = trainer["args"]
        else:
            worker = printed["spec"]["pytorchReplicaSpecs"]["Worker"]
            container = worker["template"]["spec"]["containers"][0]
            assert worker["replicas"] == nodes and container["image"] == image
            command = container["command"]
        assert command[command.index("--preset") + 1] == "gpt2-350m" and "--max-steps" in command
        assert command[command.index("--data-dir") + 1] == "/fsx/datasets/corpus"  # staging's snapshot: at run time


def test_render_job_and_preflight_take_a_pipeline_file_and_params_or_the_flags_not_both(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """With --pipeline-file, the package and --param set the job: a flag that sets it is refused (given with its
    default value too), --param needs the file, a bad value is refused as submit refuses it; before any cluster call."""
    from pipelines import COMPILED_PIPELINE
    from pipelines.cli import main

    package, image = ["--pipeline-file", str(COMPILED_PIPELINE)], ["--param", "trainer_image=registry.example/t:1"]
    cases = [
        (
            ["render-job", *package, *image, "--nnodes", "2"],
            "--nnodes: with --pipeline-file, the package's defaults "
            "and --param values set the job (and its platform settings are compiled in): give pipeline parameters as "
            "--param KEY=VALUE",
        ),
        (["preflight", *package, *image, "--job-api", "trainjob", "--json"], "--job-api: with --pipeline-file"),
        (["render-job", "--param", "nnodes=4"], "--param sets a parameter of --pipeline-file: give the file too"),
        (
            ["preflight", *package, *image, "--param", "preset=huge"],
            "--param preset='huge': preset 'huge' is unknown: choose one of tiny",
        ),
        (
            ["render-job", *package],
            "the pipeline's defaults: the trainer image is empty (--image; a pipeline's trainer_image)",
        ),
    ]
    for argv, message in cases:
        assert main(argv) == 2, argv
        last = capsys.readouterr().err.strip().splitlines()[-1]
        assert last.startswith(f"hyperpod-pretrain {argv[0]}: error: {message}"), last


def test_preflight_of_a_pipeline_file_warns_only_as_its_step_would() -> None:
    """The preflight step's warn_only is the preflight_warn_only parameter: preflight --pipeline-file takes it from
    the package's default and the --param values, as a submission would; --warn-only still says so on its own."""
    from pipelines import COMPILED_PIPELINE
    from pipelines.cli import build_parser
    from pipelines.cli.job import preflight_settings

    package = ["preflight", "--pipeline-file", str(COMPILED_PIPELINE), "--param", "trainer_image=registry.example/t:1"]
    for extra, expected in (
        ([], False),
        (["--param", "preflight_warn_only=true"], True),
        (["--warn-only"], True),
        (["--param", "preflight_warn_only=false"], False),
    ):
        assert preflight_settings(build_parser().parse_args([*package, *extra]))[1] is expected, extra
    assert preflight_settings(build_parser().parse_args(["preflight", "--warn-only"]))[1] is True
    assert preflight_settings(build_parser().parse_args(["preflight"]))[1] is False
