"""The kubernetes backend against the real kube-apiserver and controller manager (tests/cluster/control_plane.py).

The launcher is the pipeline runner (its service-account token; deploy/rbac*.yaml's Roles in the test's namespace,
the real RBAC authorizer deciding). The Training Operator v1.8.1 and its webhook, Kubeflow Trainer v2.3.0 and JobSet
v0.12.0 with their webhooks (over the real Job controller), the SageMaker HyperPod training operator (its job level,
from what AWS publishes), Kueue and the kubelet are played on top (tests/cluster/); what the tests assert of requests
comes from the API server's audit log and metrics.

The launcher's lifecycle (success, failure with evidence, a new attempt after a failure, re-attach, SIGTERM, the exit
step's clean-up, deadlines, Kueue's queueing and preemption) runs against all three job APIs (ALL_APIS); stall,
divergence and what else it guarantees against the two Kubeflow ones (BOTH_APIS). Those tests take `api` and say
what differs between the APIs where their timelines must.

Here: a launch from start to end, what the API server and the webhooks make of the job, the login and the job's
owner and volume. Beside it, by topic: tests/test_k8s_launcher_streams.py (the job's watch and the pods' log streams,
through faults), _restarts.py (restarts, their budget, HyperPod auto-resume), _diagnosis.py (what the step of a
failed, diverged or stalled job says), _attach.py (re-attach and a new attempt under the same name), _deadlines.py
(the Pending, recovery, queue and training deadlines), _cancel.py (SIGTERM and the exit step's clean-up); what they
share: tests/launcher_helpers.py."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from urllib.parse import unquote

import pytest

from common.errors import InputError, StepFailed
from components.kube import Kube, api_client_from_environment
from components.launch_training.attach import create_or_attach
from components.launch_training.core import launch
from components.launch_training.manifest import render_job
from components.launch_training.platform import Platform
from components.run_summary.core import job_cleanup
from components.verify_nccl.core import fetch_pod_logs
from tests.cluster.timelines import Timeline
from tests.helpers import snapshot_dir
from tests.launcher_helpers import (
    ALL_APIS,
    LINES,
    cluster_config,
    forbidden,
    node_lines,
    on,
    restart_budget,
    wait_for,
)


@ALL_APIS
def test_success_streams_worker_0_and_reports(api: str, staged_root: Path, make_cluster, caplog) -> None:
    caplog.set_level(logging.INFO)
    cluster = make_cluster(timeline=Timeline.success(workers=2, log_lines=LINES), api=api)
    result = launch(cluster_config(staged_root, "ok", **on(cluster)), cluster.runner())
    job = cluster.job(result.job_name)
    assert (result.state, result.reattached, result.namespace) == ("Succeeded", False, cluster.namespace)
    assert result.queued_s is not None and result.running_s is not None and result.restarts == 0
    assert node_lines(caplog, api, result.job_name, 0) == LINES, "every line once, in order"
    assert not node_lines(caplog, api, result.job_name, 1), "only node 0 by default"
    assert forbidden(cluster) == [], "deploy/rbac*.yaml grant every request the launcher makes"
    # Events are read for the job's Pending pods, each by name, and for the job's own warnings while it has no pod:
    # never the namespace's (KFP's pods live there).
    selectors = {
        unquote(e["requestURI"]).split("fieldSelector=")[1].split("&")[0] for e in cluster.requests("list", "events")
    }
    names = {p["metadata"]["name"] for p in cluster.pods(result.job_name)}
    allowed = {f"involvedObject.kind=Pod,involvedObject.name={pod}" for pod in names}
    assert selectors <= allowed | {f"involvedObject.name={result.job_name},type=Warning"}, selectors
    if api == "pytorchjob":
        assert job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 2
        # An elastic job (every job renders elasticPolicy) succeeds when one worker has (1.8.1 UpdateJobStatus,
        # kubeflow/training-operator#1752): worker-1 may still be Running when the condition is logged.
        assert "successfully completed" in caplog.text and "worker-0 Succeeded" in caplog.text
    elif api == "hyperpodpytorchjob":
        # every pod Succeeded: Completed (tests/cluster/hyperpod_training_operator.py), with the job's own times
        assert job["spec"]["replicaSpecs"][0]["replicas"] == 2 and result.job_kind == "HyperPodPyTorchJob"
        assert f"HyperPodPyTorchJob {result.job_name}: Completed (JobCompleted)" in caplog.text
        assert job["status"]["startTime"] and job["status"]["completionTime"]
    else:
        # v2.3.0 copies JobSet's Completed as Complete (plugins/jobset/jobset.go Status), with the child jobs' counts.
        assert job["spec"]["trainer"]["numNodes"] == 2 and result.job_kind == "TrainJob"
        assert "TrainJob " + result.job_name + ": Complete (AllJobsCompleted)" in caplog.text
        assert job["status"]["jobsStatus"] == [
            {"name": "node", "ready": 0, "succeeded": 1, "failed": 0, "active": 0, "suspended": 0}
        ]


@ALL_APIS
def test_a_profiles_default_editor_launches_verifies_and_cleans_up(
    api: str, staged_root: Path, make_cluster, kubeflow: None, tmp_path: Path
) -> None:
    """In a Kubeflow profile's namespace, as its default-editor (kubeflow-edit from the profile controller, and only
    what `render-rbac --kubeflow-profile` adds): the launch, verification's read of the pods' logs and the exit step's
    clean-up meet no refusal; tests/test_rbac.py holds each rendered rule to a request made here. A TrainJob run
    first finds a Failed TrainJob of its name left behind, and replaces it once its JobSet is gone; a HyperPodPyTorchJob
    run a Failed one too (kubeflow-edit does not cover the kind: the delete is render-rbac's to grant)."""
    cluster = make_cluster(
        timeline=Timeline.success(workers=2, log_lines=LINES), api=api, profile=True, restart_budget=0
    )
    options = restart_budget(api, 0) if api == "hyperpodpytorchjob" else {}  # fails at its first fault
    cfg = cluster_config(staged_root, "in-profile", **on(cluster), job_options=options)
    replaced = api in ("trainjob", "hyperpodpytorchjob")
    if replaced:
        cluster.timeline = Timeline.failure()
        cluster.create_job(render_job(cfg.job_spec()))
        wait_for(lambda: cluster.api.is_failed(cluster.job(cfg.job_name) or {}), 30, f"the {cluster.api.kind} failed")
        cluster.timeline = Timeline.success(workers=2, log_lines=LINES)
    result = launch(cfg, cluster.runner())
    assert (result.state, result.namespace) == ("Succeeded", cluster.namespace)
    assert result.attempt == (2 if replaced else 1)
    logs = fetch_pod_logs(result.job_name, cluster.namespace, tmp_path / "logs", api, api_client=cluster.runner())
    assert len(logs) == 2 and all(path.read_text() for path in logs)
    cleanup = job_cleanup("kubernetes", cluster.namespace, "in-profile", "pipeline-in-profile", api, cluster.runner())
    assert "had already finished: left for its logs" in cleanup()
    assert forbidden(cluster) == [], "kubeflow-edit and render-rbac --kubeflow-profile grant every request"


def test_what_the_operators_webhook_refuses_is_refused_at_create(staged_root: Path, make_cluster) -> None:
    """Training Operator v1.8.1's validating webhook, registered with the real API server: a replica type it does
    not know (a lower-case key: it has no defaulting webhook) is refused at create with its message."""
    cluster = make_cluster()
    job = render_job(cluster_config(staged_root, "refused", cluster.namespace).job_spec())
    job["spec"]["pytorchReplicaSpecs"] = {"worker": job["spec"]["pytorchReplicaSpecs"]["Worker"]}
    with pytest.raises(StepFailed) as failure:
        create_or_attach(Kube(cluster.runner()), job)
    message = str(failure.value)
    assert "HTTP 403" in message and 'admission webhook "validator.pytorchjob.training-operator.kubeflow.org" denied'
    assert (
        'spec.pytorchReplicaSpecs[worker]: Unsupported value: "worker": supported values: "Master", "Worker"' in message
    )
    assert cluster.job(job["metadata"]["name"]) is None


def test_a_field_the_crd_does_not_list_is_pruned_by_the_api_server_and_the_launcher_says_so(
    staged_root: Path, make_cluster
) -> None:
    """The real API server silently prunes what the CRD's structural schema does not list (the old KFP launcher put
    cleanPodPolicy at the top of spec, where it vanished): the launcher compares what it sent with what was stored."""
    cluster = make_cluster()
    job = render_job(cluster_config(staged_root, "pruned", cluster.namespace).job_spec())
    job["spec"]["cleanPodPolicy"] = "All"
    with pytest.raises(StepFailed, match=r"the API server dropped spec.cleanPodPolicy from the PyTorchJob"):
        create_or_attach(Kube(cluster.runner()), job)
    stored = cluster.job(job["metadata"]["name"])
    assert stored is not None and "cleanPodPolicy" not in stored["spec"], "created, without the field"


def test_the_in_cluster_login_is_the_service_accounts(
    staged_root: Path, make_cluster, tmp_path: Path, monkeypatch
) -> None:
    """In a KFP step pod the launcher logs in with the mounted service-account token and CA (load_incluster_config):
    the same files, pointed at here, reach the real API server as the pipeline runner."""
    from kubernetes.config import incluster_config

    cluster = make_cluster(timeline=Timeline.success(workers=1, log_lines=LINES[:2]))
    plane = cluster.control_plane
    (tmp_path / "token").write_text(plane.runner_token)
    shutil.copy(plane.ca_file, tmp_path / "ca.crt")
    monkeypatch.setattr(incluster_config, "SERVICE_TOKEN_FILENAME", str(tmp_path / "token"))
    monkeypatch.setattr(incluster_config, "SERVICE_CERT_FILENAME", str(tmp_path / "ca.crt"))
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", str(plane.port))
    result = launch(
        cluster_config(staged_root, "in-cluster", cluster.namespace, nnodes=1), api_client_from_environment()
    )
    assert result.state == "Succeeded"
    users = {e["user"]["username"] for e in cluster.audit()}
    assert users == {"system:serviceaccount:kubeflow:pipeline-runner"}


def test_the_job_is_owned_by_the_launcher_pod_in_its_namespace(staged_root: Path, tmp_path: Path, monkeypatch) -> None:
    namespace_file = tmp_path / "namespace"
    monkeypatch.setattr("components.launch_training.config.SERVICE_ACCOUNT_NAMESPACE", str(namespace_file))
    monkeypatch.setenv("KFP_POD_NAME", "pretrain-launch-pytorchjob-123")
    monkeypatch.setenv("KFP_POD_UID", "6f1c9a52-0000-4000-8000-000000000001")
    namespace_file.write_text("kubeflow")
    cfg = cluster_config(staged_root, "owned", owner_reference=True)
    (owner,) = render_job(cfg.job_spec())["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["name"], owner["uid"]) == (
        "Pod",
        "pretrain-launch-pytorchjob-123",
        "6f1c9a52-0000-4000-8000-000000000001",
    )
    namespace_file.write_text("kubeflow-user")  # owners cannot cross namespaces: none rather than a broken one
    assert "ownerReferences" not in render_job(cfg.job_spec())["metadata"]
    assert "ownerReferences" not in render_job(cluster_config(staged_root, "owned").job_spec())["metadata"]


def test_one_volume_one_path(tmp_path: Path, staged_root: Path) -> None:
    """fsx_pvc=team-fsx and storage_root=<mount>/teamA: the job mounts team-fsx where the steps do, so the trainer
    reads the directory the steps wrote (<pvc>/teamA/...); a storage root outside the mount is refused."""
    mount = tmp_path / "fsx"
    shutil.copytree(staged_root, mount / "teamA")
    platform = Platform(pvc_name="team-fsx", mount_path=str(mount))
    staged = snapshot_dir(mount / "teamA", "synthetic").name
    cfg = cluster_config(mount / "teamA", "team", platform=platform, snapshot=staged)
    pod = render_job(cfg.job_spec())["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    volume = next(v for v in pod["volumes"] if "persistentVolumeClaim" in v)
    mounted = next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == volume["name"])
    assert volume["persistentVolumeClaim"]["claimName"] == "team-fsx" and mounted["mountPath"] == str(mount)
    command = pod["containers"][0]["command"]
    data_dir = Path(command[command.index("--data-dir") + 1])
    assert data_dir.relative_to(mount) == Path(f"teamA/datasets/synthetic/snapshots/{staged}")
    assert (data_dir / "meta.json").is_file(), "what the job reads is what staging wrote"
    with pytest.raises(InputError, match=r"storage_root '/data/teamA' is outside the FSx mount path"):
        cluster_config(Path("/data/teamA"), "team", platform=platform).validate(check_storage=False)
    with pytest.raises(InputError, match="job option 'pvc_name' is not a run option"):
        cluster_config(mount / "teamA", "team", platform=platform, job_options={"pvc_name": "other"}).job_spec()
