"""The preflight as the pipeline and a person run it, on the real control plane (tests/cluster/; the cluster each test
writes: make_site in tests/conftest.py): the KFP component (its report, its record, its failure), the CLI through a
kubeconfig, and what it reads going no further (another team's secret in neither report nor log)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import kubernetes
import pytest

from common.errors import InputError, StepFailed
from tests.cluster.control_plane import PYTORCHJOB_CRD, ControlPlane, audit_time
from tests.cluster.installed import EFA_PLUGIN
from tests.preflight_helpers import IMAGE, OPERATOR_IMAGE, Site, check
from trainer.config import TRAIN_DEFAULTS


def component_args(tmp_path: Path, namespace: str, **overrides: Any) -> dict[str, Any]:
    args: dict[str, Any] = dict(
        storage_root=str(tmp_path / "fsx"),
        dataset="synthetic",
        run_id="",
        resume_run_id="",
        pipeline_run_id="pipeline-pf-2",
        backend="kubernetes",
        nnodes=2,
        max_nodes=0,
        nproc_per_node=8,
        preset="tiny",
        init_from_model="",
        mlflow_tracking_uri="",
        image=IMAGE,
        namespace=namespace,
        instance_type="ml.p5.48xlarge",
        job_options={},
        platform={
            "pvc_name": "fsx-lustre-pvc",
            "mount_path": str(tmp_path / "fsx"),
            "queue_name": "",
            "priority_class": "",
        },
        evaluation={"gpus": 1.0, "cpu": "8", "memory": "32Gi"},  # as the compiled constant arrives (KFP: 1.0)
        warn_only=False,
        report=SimpleNamespace(path=str(tmp_path / "report.md"), uri="minio://report"),
    )
    return {**args, **overrides}


def test_the_component_writes_the_report_and_fails_on_a_failed_check(
    spare: ControlPlane, make_site: Callable[..., Site], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from components.preflight.component import preflight as component

    spare.install_crd(PYTORCHJOB_CRD)
    site = make_site(plane=spare)
    ns = site.namespace
    assert list(component.component_spec.inputs) == list(component_args(tmp_path, ns))[:-1]
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)  # not in a cluster: the kubeconfig's credentials
    kubeconfig = spare.write_kubeconfig(tmp_path / "kubeconfig", spare.token_for(ns))
    monkeypatch.setattr(kubernetes.config.kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(kubeconfig))
    component.python_func(**component_args(tmp_path, ns))
    report = (tmp_path / "report.md").read_text()
    assert report.startswith("# Preflight: passed\n") and "| nodes | PASS |" in report
    record = json.loads((tmp_path / "fsx/runs/pipeline-pf-2/steps/preflight.json").read_text())
    assert record["state"] == "succeeded" and record["details"]["verdict"] == "passed"

    spare.remove_crd("pytorchjobs.kubeflow.org")
    with pytest.raises(StepFailed) as error:
        component.python_func(**component_args(tmp_path, ns))
    # KFP uploads no report for a failed step: the message carries each failed check's reason and fix.
    assert str(error.value).startswith(
        "preflight failed: crd: the PyTorchJob CRD pytorchjobs.kubeflow.org is not installed: no job can be created."
        " Fix: "
    )
    with pytest.raises(InputError, match=r"storage_root '.*/elsewhere' is outside the FSx mount path"):
        component.python_func(**component_args(tmp_path, ns, storage_root=str(tmp_path / "elsewhere")))
    assert "| crd | **FAIL** |" in (tmp_path / "report.md").read_text()
    component.python_func(**component_args(tmp_path, ns, warn_only=True))  # allowed
    started = time.monotonic()
    component.python_func(**component_args(tmp_path, ns, backend="local", nnodes=1, image=""))
    assert time.monotonic() - started < 5 and "| crd | n/a |" in (tmp_path / "report.md").read_text()


def test_the_cli_checks_through_the_kubeconfig_and_exits_by_the_verdict(site: Site, tmp_path: Path) -> None:
    cli = str(Path(sys.executable).parent / "hyperpod-pretrain")
    env = {k: v for k, v in os.environ.items() if k != "KUBERNETES_SERVICE_HOST"}
    env["KUBECONFIG"] = str(site.plane.write_kubeconfig(tmp_path / "kubeconfig"))
    command = [
        cli,
        "preflight",
        "--storage-root",
        str(tmp_path),
        "--dataset",
        "d",
        "--run-id",
        "r",
        "--image",
        IMAGE,
        "--namespace",
        site.namespace,
        "--nnodes",
        "2",
        "--nproc-per-node",
        "8",
        "--json",
    ]
    passed = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    assert passed.returncode == 0, passed.stderr
    assert {c["name"]: c["status"] for c in json.loads(passed.stdout)["checks"]}["nodes"] == "pass"
    failed = subprocess.run(
        [*command[:-5], "--nnodes", "3", "--nproc-per-node", "8"], capture_output=True, text=True, env=env, timeout=120
    )
    assert failed.returncode == 1
    last = failed.stderr.strip().splitlines()[-1]
    assert last.startswith("hyperpod-pretrain preflight: failed: nodes: 2 of 3 node(s) fit"), last


SECRET = "hunter2-wJalrXUtnFEMI-K7MDENG-bPxRfiCYEXAMPLEKEY"


def test_a_plain_text_secret_in_another_namespaces_pod_reaches_neither_report_nor_log(
    site: Site, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The preflight lists every pod in the cluster for its node and its requests only: a credential written in plain
    text in another team's pod env is in the answer, and must go no further (report, JSON, logs at any level). The
    device plugins and the operator are read whole too (their DaemonSet and Deployment): the same rule."""
    team = site.hp.namespace(f"team-b-{site.hp.tag}")
    site.hp.add_pod(
        team,
        "their-trainer",
        node=site.i00,
        containers=[
            {
                "name": "main",
                "image": "team-b/trainer:3",
                "resources": {"limits": {"nvidia.com/gpu": "8"}},
                "env": [
                    {"name": "AWS_ACCESS_KEY_ID", "value": "AKIAIOSFODNN7EXAMPLE"},
                    {"name": "AWS_SECRET_ACCESS_KEY", "value": SECRET},
                ],
            }
        ],
    )
    secret_env = [{"name": "PROXY_PASSWORD", "value": SECRET}]
    site.hp.apps.delete_namespaced_daemon_set(EFA_PLUGIN, "kube-system")
    site.hp.add_daemonset("kube-system", EFA_PLUGIN, image="efa:1", desired=2, env=secret_env)
    site.hp.apps.delete_namespaced_deployment("training-operator", "kubeflow")
    site.hp.add_deployment(
        "kubeflow",
        "training-operator",
        image=OPERATOR_IMAGE,
        env=secret_env,
        labels={"control-plane": "kubeflow-training-operator"},
    )
    since = audit_time()
    caplog.set_level(logging.DEBUG)  # from here: the objects' creation above was the admin's, logged with their env
    result = site.run()
    command = [
        sys.executable,
        "-m",
        "pipelines.cli",
        "preflight",
        "--json",
        "--storage-root",
        "/fsx",
        "--dataset",
        "synthetic",
        "--run-id",
        "pf-1",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "8",
        "--image",
        IMAGE,
        "--instance-type",
        "ml.p5.48xlarge",
        "--no-owner-reference",
        "--namespace",
        site.namespace,
    ]
    # config()'s training settings are LaunchConfig's (the trainer's); the command defaults to the pipeline's
    command += [
        arg
        for key in ("preset", "max_steps", "batch_size", "seq_len", "lr", "warmup_steps")
        for arg in (f"--{key.replace('_', '-')}", str(TRAIN_DEFAULTS[key]))
    ]
    env = {**os.environ, "KUBECONFIG": str(site.plane.write_kubeconfig(tmp_path / "kubeconfig"))}
    cli = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    listed = {
        (e["verb"], e["objectRef"]["resource"], e["objectRef"].get("namespace", ""))
        for e in site.runner_requests(since)
    }
    assert {("list", "pods", ""), ("list", "daemonsets", ""), ("list", "deployments", "kubeflow")} <= listed
    nodes = check(result, "nodes")
    assert f"{site.i00}: nvidia.com/gpu 8 requested, 0 free" in nodes.reason, "their pod was counted"
    assert cli.returncode == 0, cli.stderr
    assert json.loads(cli.stdout)["checks"] == result.to_json()["checks"]
    for text in (result.markdown(), json.dumps(result.to_json()), caplog.text, cli.stdout, cli.stderr):
        assert SECRET not in text and "AKIAIOSFODNN7EXAMPLE" not in text
