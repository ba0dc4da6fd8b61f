"""The kubernetes backend through the real `kubernetes` client, against a loopback server speaking the API."""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import kubernetes
import pytest
import yaml

from components.errors import StepFailed
from components.kube import Kube, KubeSettings
from components.launch_pytorchjob.core import LaunchConfig, launch
from components.launch_pytorchjob.k8s_backend import WatchSettings, run_job
from components.launch_pytorchjob.manifest import job_name, render_job
from tests.k8s_server import CRD_PATH, FakeKubernetes, Lifecycle

RBAC = Path(__file__).resolve().parents[1] / "deploy/rbac.yaml"
LINES = [f"step {i} loss {5 - i / 10:.2f}" for i in range(1, 13)]

pytestmark = pytest.mark.skipif(not CRD_PATH.is_file(), reason=f"the PyTorchJob CRD is not here ({CRD_PATH})")


def cluster_config(staged_root: Path, run_id: str, **overrides: Any) -> LaunchConfig:
    settings: dict[str, Any] = dict(
        storage_root=str(staged_root),
        dataset="synthetic",
        run_id=run_id,
        backend="kubernetes",
        nnodes=2,
        nproc_per_node=8,
        pipeline_run_id=f"pipeline-{run_id}",
        image="123456789012.dkr.ecr.us-east-1.amazonaws.com/hyperpod-pretrain-trainer:1",
        owner_reference=False,
        timeout_s=60,
    )
    return LaunchConfig(**{**settings, **overrides})


def client(server: FakeKubernetes) -> kubernetes.client.ApiClient:
    return kubernetes.client.ApiClient(server.client_configuration())


def pod_lines(caplog: pytest.LogCaptureFixture, pod: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == f"pod.{pod}"]


def allowed(method: str, path: str, rules: list[dict[str, Any]]) -> bool:
    """Whether deploy/rbac.yaml's Role lets the service account make this request."""
    path, _, query = path.partition("?")
    match = re.match(r"^/(?:api/v1|apis/(?P<group>[^/]+)/[^/]+)/namespaces/[^/]+/(?P<rest>.*)$", path)
    assert match, path
    group, parts = match.group("group") or "", match.group("rest").split("/")
    resource = parts[0] + (f"/{parts[2]}" if len(parts) > 2 else "")
    named = len(parts) > 1
    verb = {"POST": "create", "DELETE": "delete"}.get(method)
    if verb is None:
        verb = "watch" if "watch=true" in query.lower() else ("get" if named else "list")
    return any(group in r["apiGroups"] and resource in r["resources"] and verb in r["verbs"] for r in rules)


@pytest.fixture(scope="module")
def role_rules() -> list[dict[str, Any]]:
    return next(d for d in yaml.safe_load_all(RBAC.read_text()) if d["kind"] == "Role")["rules"]


def check_clean(server: FakeKubernetes, role_rules: list[dict[str, Any]]) -> None:
    assert server.validation_errors == [] and server.webhook_denials == [] and server.pruned_fields == []
    for method, path in server.requests:
        assert allowed(method, path, role_rules), f"deploy/rbac.yaml does not allow {method} {path}"


def test_success_streams_worker_0_and_reports(staged_root: Path, role_rules, caplog) -> None:
    caplog.set_level(logging.INFO)
    cfg = cluster_config(staged_root, "ok")
    with FakeKubernetes(CRD_PATH, Lifecycle.success(workers=2, log_lines=LINES)) as server:
        result = launch(cfg, client(server))
        job = server.job("kubeflow", result.job_name)
        check_clean(server, role_rules)
    assert (result.state, result.reattached, result.namespace) == ("Succeeded", False, "kubeflow")
    assert result.queued_s is not None and result.running_s is not None and result.restarts == 0
    assert pod_lines(caplog, f"{result.job_name}-worker-0") == LINES
    assert not pod_lines(caplog, f"{result.job_name}-worker-1"), "only worker-0 by default"
    assert job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 2
    assert "Succeeded" in caplog.text and "pods: worker-0 Succeeded, worker-1 Succeeded" in caplog.text


def test_failure_names_the_reason_and_shows_the_failing_pod(staged_root: Path, caplog) -> None:
    caplog.set_level(logging.INFO)
    lifecycle = Lifecycle.failure(
        reason="PyTorchJobFailed", message="worker 1 exited with 1",
        failing_pod_lines=["Traceback (most recent call last):", "RuntimeError: CUDA error: out of memory"],
        events=[("Warning", "BackOff", "Back-off restarting failed container pytorch in pod {pod}")],
    )  # fmt: skip
    with FakeKubernetes(CRD_PATH, lifecycle) as server, pytest.raises(StepFailed) as failure:
        launch(cluster_config(staged_root, "bad"), client(server))
    assert "failed (attempt 1): PyTorchJobFailed: worker 1 exited with 1" in str(failure.value)
    assert "RuntimeError: CUDA error: out of memory" in str(failure.value), "the failed pod's last lines"
    assert "RuntimeError: CUDA error: out of memory" in caplog.text
    assert "Back-off restarting failed container pytorch" in caplog.text


def test_failure_without_events_permission_says_so(staged_root: Path, caplog) -> None:
    with FakeKubernetes(CRD_PATH, Lifecycle.failure()) as server, pytest.raises(StepFailed):
        server.forbid_events = True
        launch(cluster_config(staged_root, "no-events"), client(server))
    assert "not readable by this service account" in caplog.text


def test_a_restarted_worker_is_reported_and_the_job_carries_on(staged_root: Path, caplog) -> None:
    caplog.set_level(logging.INFO)
    with FakeKubernetes(CRD_PATH, Lifecycle.restart(workers=2, log_lines=LINES[:4])) as server:
        result = launch(cluster_config(staged_root, "restart"), client(server))
    assert result.state == "Succeeded" and result.restarts >= 1
    assert "Restarting" in caplog.text


def test_a_retried_step_reattaches_to_its_job(staged_root: Path, caplog) -> None:
    cfg = cluster_config(staged_root, "retry")
    with FakeKubernetes(CRD_PATH, Lifecycle.success(workers=2, log_lines=LINES[:3])) as server:
        first = launch(cfg, client(server))
        second = launch(cfg, client(server))  # the step again, as KFP retries it: the job is still there
        creates = [p for m, p in server.requests if m == "POST"]
    assert second.job_name == first.job_name and second.reattached and second.state == "Succeeded"
    assert len(creates) == 2 and "re-attaching" in caplog.text, "the second create got 409, and no second job"


def test_a_different_job_under_the_same_name_is_refused(staged_root: Path) -> None:
    cfg = cluster_config(staged_root, "clash")
    other = render_job(cluster_config(staged_root, "clash", max_steps=999).job_spec())
    with FakeKubernetes(CRD_PATH) as server, pytest.raises(StepFailed, match="already exists with a different spec"):
        server.put_job(other)
        launch(cfg, client(server))
    assert server.deletions == [], "someone else's job is left alone"


def test_the_deadline_deletes_the_job(staged_root: Path) -> None:
    cfg = cluster_config(staged_root, "stuck", timeout_s=2)
    with FakeKubernetes(CRD_PATH, Lifecycle.stuck_pending()) as server:
        with pytest.raises(StepFailed, match=r"did not finish within 2s .*Pending.*it was deleted"):
            launch(cfg, client(server))
        (namespace, name, propagation), *_ = server.deletions
    assert (namespace, propagation) == ("kubeflow", "Foreground") and name.startswith("hpp-stuck-train-")


def test_transient_faults_and_dropped_streams_are_survived(staged_root: Path, role_rules, caplog) -> None:
    caplog.set_level(logging.INFO)
    cfg = cluster_config(staged_root, "flaky", stream_logs="all")
    with FakeKubernetes(CRD_PATH, Lifecycle.success(workers=2, log_lines=LINES, tick_s=0.1)) as server:
        server.faults.fail_next("POST", r"/pytorchjobs$", 503, times=2)
        server.faults.fail_next("POST", r"/pytorchjobs$", 429, times=1)
        server.faults.fail_next("GET", r"/pods\?", 500, times=4)  # urllib3 absorbs 3; the launcher the 4th
        server.faults.drop_watch_after(2, times=2)
        server.faults.drop_log_after(3, times=2)
        result = launch(cfg, client(server))
        injected = list(server.faults.injected)
        check_clean(server, role_rules)
    assert result.state == "Succeeded"
    assert len(injected) >= 8, injected
    for worker in (0, 1):
        assert pod_lines(caplog, f"{result.job_name}-worker-{worker}") == LINES, "every line once, in order"


def test_an_expired_watch_reads_the_job_again(staged_root: Path, caplog) -> None:
    caplog.set_level(logging.INFO)
    lifecycle = Lifecycle.success(workers=1, log_lines=LINES[:2], tick_s=0.2)
    with FakeKubernetes(CRD_PATH, lifecycle) as server:
        server.faults.drop_watch_after(1, times=1)
        server.history_limit = 1  # the reconnecting watch's resourceVersion is already too old: 410 Gone
        result = launch(cluster_config(staged_root, "gone", nnodes=1), client(server))
    assert result.state == "Succeeded" and "410 Gone" in caplog.text


def kubeconfig(server: FakeKubernetes, path: Path) -> Path:
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "fake",
        "clusters": [{"name": "fake", "cluster": {"server": server.url}}],
        "users": [{"name": "fake", "user": {}}],
        "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}],
    }))  # fmt: skip
    return path


def test_sigterm_deletes_the_job_and_exits_within_5_s(staged_root: Path, tmp_path: Path) -> None:
    """KFP terminates a run by signalling the step's process: the job must not outlive it."""
    runs_forever = (
        Lifecycle()
        .then(0, lambda j: j.create_pods(2))
        .then(0.05, lambda j: [j.run(i) for i in (0, 1)])
        .then(0.05, lambda j: j.set_condition("Running", "PyTorchJobRunning", "running"))
    )
    with FakeKubernetes(CRD_PATH, runs_forever) as server:
        command = [sys.executable, "-m", "pipelines.cli", "launch", "--backend", "kubernetes", "--storage-root",
                   str(staged_root), "--dataset", "synthetic", "--run-id", "cancel", "--nnodes", "2",
                   "--nproc-per-node", "8", "--image", "img:1", "--no-owner-reference"]  # fmt: skip
        env = {**os.environ, "KUBECONFIG": str(kubeconfig(server, tmp_path / "kubeconfig"))}
        launcher = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)
        name, deadline = job_name("cancel", "cancel"), time.monotonic() + 60
        while time.monotonic() < deadline and not running(server.job("kubeflow", name)):
            time.sleep(0.05)
        assert running(server.job("kubeflow", name)), "the job never ran"
        signalled = time.monotonic()
        launcher.send_signal(signal.SIGTERM)
        _, stderr = launcher.communicate(timeout=30)
        exited = time.monotonic() - signalled
        deletions = list(server.deletions)
    assert exited < 5, f"the launcher took {exited:.1f}s to exit after SIGTERM"
    assert launcher.returncode == 1 and "deleted on SIGTERM" in stderr.strip().splitlines()[-1]
    assert "SIGTERM: deleted PyTorchJob" in stderr, "the signal handler itself sent the delete"
    assert {(ns, propagation) for ns, _, propagation in deletions} == {("kubeflow", "Foreground")}


def test_sigterm_deletes_the_job_even_when_the_process_is_killed_right_after(staged_root: Path, tmp_path: Path) -> None:
    """KFP signals the step's process group: its Go launcher dies at once, the container ends, and this process is
    killed moments later (reference/kfp_backend_support.md, "Terminate"). The delete must already be out by then."""
    with FakeKubernetes(CRD_PATH, runs_forever()) as server:
        command = [sys.executable, "-m", "pipelines.cli", "launch", "--backend", "kubernetes", "--storage-root",
                   str(staged_root), "--dataset", "synthetic", "--run-id", "killed", "--nnodes", "2",
                   "--nproc-per-node", "8", "--image", "img:1", "--no-owner-reference"]  # fmt: skip
        env = {**os.environ, "KUBECONFIG": str(kubeconfig(server, tmp_path / "kubeconfig"))}
        launcher = subprocess.Popen(command, env=env, stderr=subprocess.DEVNULL)
        name, deadline = job_name("killed", "killed"), time.monotonic() + 60
        while time.monotonic() < deadline and not running(server.job("kubeflow", name)):
            time.sleep(0.05)
        assert running(server.job("kubeflow", name)), "the job never ran"
        launcher.send_signal(signal.SIGTERM)
        time.sleep(0.1)  # the container's end
        launcher.kill()
        launcher.wait(timeout=10)
        deletions = list(server.deletions)
    assert [(ns, n, propagation) for ns, n, propagation in deletions][:1] == [("kubeflow", name, "Foreground")]


def runs_forever() -> Lifecycle:
    return (
        Lifecycle()
        .then(0, lambda j: j.create_pods(2))
        .then(0.05, lambda j: [j.run(i) for i in (0, 1)])
        .then(0.05, lambda j: j.set_condition("Running", "PyTorchJobRunning", "running"))
    )


def running(job: dict[str, Any] | None) -> bool:
    conditions = (job or {}).get("status", {}).get("conditions", [])
    return any(c["type"] == "Running" and c["status"] == "True" for c in conditions)


def test_polls_when_watching_is_refused(staged_root: Path, caplog) -> None:
    caplog.set_level(logging.INFO)
    job = render_job(cluster_config(staged_root, "polled").job_spec())
    with FakeKubernetes(CRD_PATH, Lifecycle.success(workers=2, log_lines=LINES[:3])) as server:
        server.faults.fail_next("GET", r"(?i)watch=true", 403, times=100)
        outcome = run_job(Kube(client(server)), job, WatchSettings(poll_interval_s=0.2), threading.Event())
    assert outcome.state == "Succeeded" and "polling every 0.2s instead" in caplog.text


def test_the_job_is_owned_by_the_launcher_pod_in_its_namespace(staged_root: Path, tmp_path: Path, monkeypatch) -> None:
    namespace_file = tmp_path / "namespace"
    monkeypatch.setattr("components.launch_pytorchjob.core.SERVICE_ACCOUNT_NAMESPACE", str(namespace_file))
    monkeypatch.setenv("KFP_POD_NAME", "pretrain-launch-pytorchjob-123")
    monkeypatch.setenv("KFP_POD_UID", "6f1c9a52-0000-4000-8000-000000000001")
    namespace_file.write_text("kubeflow")
    cfg = cluster_config(staged_root, "owned", owner_reference=True)
    (owner,) = render_job(cfg.job_spec())["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["name"], owner["uid"]) == ("Pod", "pretrain-launch-pytorchjob-123",
                                                            "6f1c9a52-0000-4000-8000-000000000001")  # fmt: skip
    namespace_file.write_text("kubeflow-user")  # owners cannot cross namespaces: none rather than a broken one
    assert "ownerReferences" not in render_job(cfg.job_spec())["metadata"]
    assert "ownerReferences" not in render_job(cluster_config(staged_root, "owned").job_spec())["metadata"]


def test_an_api_server_that_goes_away_fails_the_step_instead_of_hanging(staged_root: Path) -> None:
    runs_forever = (
        Lifecycle()
        .then(0, lambda j: j.create_pods(1))
        .then(0.05, lambda j: j.run(0))
        .then(0.05, lambda j: j.set_condition("Running", "PyTorchJobRunning", "running"))
    )
    job = render_job(cluster_config(staged_root, "vanishing", nnodes=1).job_spec())
    outcome: list[BaseException] = []
    server = FakeKubernetes(CRD_PATH, runs_forever).__enter__()
    kube = Kube(client(server), KubeSettings(attempts=2, backoff_s=0.05))

    def launcher() -> None:
        try:
            run_job(kube, job, WatchSettings(logs="none"), threading.Event())
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=launcher, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not running(server.job("kubeflow", job["metadata"]["name"])):
        time.sleep(0.05)
    server.__exit__(None, None, None)  # the API server goes away for good
    thread.join(timeout=60)
    assert not thread.is_alive(), "the launcher is still waiting on a server that is gone"
    assert isinstance(outcome[0], StepFailed) and "failed 2 times" in str(outcome[0])
