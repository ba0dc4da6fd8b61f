"""Least privilege: what a person starting a run may choose, and the hostile run parameters that are refused.

Every case goes through the launcher and the preflight against the real API server, and its audit log shows that
nothing reached the API: refused before any call, with one line naming the parameter.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from common.errors import InputError
from components.launch_training.config import LaunchConfig
from components.launch_training.core import launch
from components.launch_training.manifest import render_job
from components.launch_training.platform import RUN_OPTIONS, TRAINER_OPTIONS, Platform
from components.launch_training.pytorchjob import PYTORCHJOB
from components.preflight.core import preflight
from tests.cluster.control_plane import RUNNER_USER, audit_time

REGISTRY = "123456789012.dkr.ecr.us-east-1.amazonaws.com"
IMAGE = f"{REGISTRY}/hyperpod-pretrain-trainer:1"
PLATFORM = Platform(namespaces=("hyperpod-ns-team-a",), registries=(REGISTRY,), service_account="trainer")


def config(root: Path, **overrides: Any) -> LaunchConfig:
    settings: dict[str, Any] = dict(
        storage_root=str(root),
        dataset="synthetic",
        run_id="r1",
        backend="kubernetes",
        nnodes=2,
        nproc_per_node=8,
        pipeline_run_id="pipeline-r1",
        image=IMAGE,
        namespace="hyperpod-ns-team-a",
        owner_reference=False,
        platform=PLATFORM,
    )
    return LaunchConfig.of(**{**settings, **overrides})


HOSTILE: list[tuple[str, dict[str, Any], str]] = [
    # privileged fields through job_options: the platform team's, compiled in
    *[
        (f"job option {key}", {"job_options": {key: value}}, rf"job option '{key}' is not a run option")
        for key, value in [
            ("service_account", "training-operator"),
            ("tolerations", [{"operator": "Exists"}]),
            ("env", {"LD_PRELOAD": "/fsx/evil.so"}),
            ("image_pull_secrets", ["other-team-pull"]),
            ("node_selector", {"kubernetes.io/hostname": "ip-10-0-0-1"}),
            ("health_affinity", False),
            ("annotations", {"sidecar.istio.io/inject": "true"}),
            ("labels", {"team": "b"}),
            ("pvc_name", "other-team-fsx"),
            ("mount_path", "/"),
            ("automount_service_account_token", True),
            ("privileged", True),
            ("host_network", True),
        ]
    ],
    # an image from another registry, or not an image reference at all
    ("image registry", {"image": "docker.io/evil/miner:latest"}, r"trainer_image .* is not from an allowed registry"),
    ("image prefix", {"image": f"{REGISTRY}.evil.io/x:1"}, r"is not from an allowed registry"),
    ("image newline", {"image": f"{IMAGE}\n  securityContext: {{privileged: true}}"}, r"is not an image reference"),
    ("image size", {"image": f"{IMAGE}{'a' * 600}"}, r"is not an image reference"),
    # a namespace not allowed
    ("namespace", {"namespace": "kube-system"}, r"namespace 'kube-system' is not one jobs may go to"),
    # oversized values
    ("nnodes", {"nnodes": 100_000}, r"nnodes 100000 is above the limit of 1024"),
    ("nproc", {"nproc_per_node": 4096}, r"nproc-per-node 4096 is above the limit of 64"),
    ("batch", {"batch_size": 10**8}, r"batch-size 100000000 is above the limit"),
    ("timeout", {"timeout_s": 10**10}, r"timeout-s 10000000000 is above the limit"),
    ("option size", {"job_options": {"restart_budget": 10**9}}, r"'restart_budget' must be an integer from 0 to 100"),
    ("option renamed", {"job_options": {"backoff_limit": 5}}, r"'backoff_limit' is now 'restart_budget'"),
    ("option type", {"job_options": {"grace_period_s": "120; rm -rf /"}}, r"'grace_period_s' must be an integer"),
    ("option bool", {"job_options": {"auto_resume": "yes"}}, r"'auto_resume' must be true or false"),
    ("option string", {"job_options": {"memory": "9" * 100}}, r"'memory' must be a string of at most 64"),
    # YAML/JSON injection in strings: every string is checked for what it must be
    ("quantity", {"job_options": {"cpu": "96\nprivileged: true"}}, r"cpu '96\\nprivileged: true' is not a Kubernetes"),
    ("policy", {"job_options": {"restart_policy": "Never\n"}}, r"restart policy 'Never\\n'"),
    (
        "instance",
        {"instance_type": "p5.48xlarge\n  hostPID: true"},
        r"instance type 'p5.48xlarge\\n  hostPID: true' is",
    ),
    ("preset", {"preset": 'gpt2-124m"}, {"x'}, r"preset .* is unknown: choose one of"),
    ("dataset yaml", {"dataset": "corpus\nspec: {}"}, r"dataset 'corpus\\nspec: \{\}' is not a valid name"),
    # path escapes
    ("run_id escape", {"run_id": "../other-team/runs/r9"}, r"run id '\.\./other-team/runs/r9' is not a valid name"),
    ("run_id absolute", {"run_id": "/etc"}, r"run id '/etc' is not a valid name"),
    ("dataset escape", {"dataset": "../../secrets"}, r"dataset '\.\./\.\./secrets' is not a valid name"),
    (
        "snapshot escape",
        {"snapshot": "../../other/snapshots/x"},
        r"snapshot '\.\./\.\./other/snapshots/x' is not a valid",
    ),
    (
        "warm start escape",
        {"init_from_run_id": "../../other-team/runs/r9"},
        r"run id '\.\./\.\./other-team/runs/r9' is not",
    ),
    ("storage root escape", {"storage_root": "/fsx/../etc"}, r"storage_root '/fsx/../etc' is outside the FSx mount"),
]


@pytest.mark.parametrize(("what", "overrides", "message"), HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_run_parameters_are_refused_before_any_api_call(
    staged_root: Path, what: str, overrides: dict[str, Any], message: str, control_plane: Any
) -> None:
    if what == "storage root escape":
        overrides = {
            **overrides,
            "platform": Platform(
                **{
                    **PLATFORM.to_dict(),
                    "mount_path": "/fsx",
                    "namespaces": ("hyperpod-ns-team-a",),
                    "registries": (REGISTRY,),
                }
            ),
        }
    cfg = config(staged_root, **overrides)
    api = control_plane.runner_client()  # the pipeline runner, on the real API server
    since = audit_time()
    with pytest.raises(InputError, match=message) as launched:
        launch(cfg, api)
    with pytest.raises(InputError, match=message):
        preflight(cfg, api)
    assert control_plane.audit_events(user=RUNNER_USER, since=since) == [], f"{what}: the API server was called"
    assert "\n" not in str(launched.value).replace("\\n", ""), "one line"


def test_a_run_may_set_sizes_counts_timeouts_and_training_settings(staged_root: Path) -> None:
    options = {
        "cpu": "90",
        "memory": "1024Gi",
        "shm_size": "512Gi",
        "grace_period_s": 300,
        "shutdown_timeout_s": 240,
        "max_restarts": 5,
        "restart_budget": 2,
        "ttl_after_finished_s": 86400,
        "auto_resume": False,
        "auto_resume_max_retries": 2,
        "auto_resume_wait_s": 600,
        "restart_policy": "OnFailure",
        "clean_pod_policy": "All",
        "rdzv_backend": "c10d",
        "gpus_per_node": 8,
        "efa_per_node": 32,
        "parallelism": "hsdp",
        "activation_checkpointing": "selective",
        "grad_accum_steps": 4,
        "compile": "off",
        "ddp_comm_hook": "none",
    }
    # every option a PyTorchJob has a place for (the HyperPodPyTorchJob's rules': tests/test_hyperpodpytorchjob.py)
    assert set(options) == {*RUN_OPTIONS, *TRAINER_OPTIONS} - set(PYTORCHJOB.refused_options)
    job = render_job(config(staged_root, job_options=options).job_spec())
    pod = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    assert pod["containers"][0]["resources"]["limits"]["memory"] == "1024Gi"
    command = " ".join(pod["containers"][0]["command"] + pod["containers"][0].get("args", []))
    assert "--parallelism hsdp --activation-checkpointing selective --grad-accum-steps 4 --compile off" in command
    with pytest.raises(InputError, match="job option 'parallelism': 'zero3' is unknown: choose one of ddp, fsdp, hsdp"):
        config(staged_root, job_options={"parallelism": "zero3"}).job_spec()
    assert pod["terminationGracePeriodSeconds"] == 300 and job["spec"]["runPolicy"]["backoffLimit"] == 2 * 2 + 1


def test_the_trainer_pods_carry_the_platform_teams_settings_and_no_privilege(staged_root: Path) -> None:
    platform = Platform(
        namespaces=("hyperpod-ns-team-a",),
        registries=(REGISTRY,),
        service_account="trainer",
        tolerations=({"key": "dedicated", "operator": "Equal", "value": "training", "effect": "NoSchedule"},),
        node_selector={"team": "a"},
        image_pull_secrets=("team-a-pull",),
        env={"FI_EFA_FORK_SAFE": "1"},
    )
    pod = render_job(config(staged_root, platform=platform).job_spec())["spec"]["pytorchReplicaSpecs"]["Worker"]
    spec = pod["template"]["spec"]
    assert spec["serviceAccountName"] == "trainer" and spec["automountServiceAccountToken"] is False
    assert spec["tolerations"] == [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
        {"key": "dedicated", "operator": "Equal", "value": "training", "effect": "NoSchedule"},
    ]
    assert spec["nodeSelector"] == {"team": "a"} and spec["imagePullSecrets"] == [{"name": "team-a-pull"}]
    container = spec["containers"][0]
    assert {"name": "FI_EFA_FORK_SAFE", "value": "1"} in container["env"]
    assert container["securityContext"] == {"privileged": False, "allowPrivilegeEscalation": False}
    assert not {"hostNetwork", "hostPID", "hostIPC"} & set(spec), "no host namespaces"
    assert "capabilities" not in container["securityContext"]
    mounted = Platform(
        **{
            **platform.to_dict(),
            "automount_service_account_token": True,
            "namespaces": (),
            "registries": (),
            "tolerations": (),
            "image_pull_secrets": (),
        }
    )
    spec = render_job(config(staged_root, platform=mounted).job_spec())["spec"]["pytorchReplicaSpecs"]["Worker"]
    assert spec["template"]["spec"]["automountServiceAccountToken"] is True, "only when compiled so"


def test_the_cli_refuses_a_privileged_job_option_in_one_line(tmp_path: Path) -> None:
    cli = str(Path(sys.executable).parent / "hyperpod-pretrain")
    result = subprocess.run(
        [
            cli,
            "render-job",
            "--storage-root",
            str(tmp_path),
            "--dataset",
            "d",
            "--run-id",
            "r",
            "--image",
            IMAGE,
            "--nnodes",
            "2",
            "--nproc-per-node",
            "8",
            "--job-option",
            "service_account=training-operator",
            "--job-option",
            "tolerations=[{operator: Exists}]",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and result.stdout == ""
    (line,) = result.stderr.strip().splitlines()
    assert "job option 'service_account' is not a run option" in line
