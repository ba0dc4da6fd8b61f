"""The kubernetes backend through the real `kubernetes` client, against a loopback server speaking the API."""

from __future__ import annotations

import logging
import os
import re
import shutil
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

from components.errors import InputError, StepFailed
from components.kube import Kube, KubeSettings
from components.launch_pytorchjob.core import OPERATOR_DEADLINE_MARGIN_S, LaunchConfig, launch
from components.launch_pytorchjob.k8s_backend import WatchSettings, run_job
from components.launch_pytorchjob.manifest import job_name, render_job
from components.launch_pytorchjob.platform import Platform
from components.run_summary.core import job_cleanup, summarize_run
from tests.helpers import snapshot_dir
from tests.k8s_server import CRD_PATH, PODS, FakeKubernetes, Lifecycle
from trainer.layout import RunPaths
from trainer.train_ddp import LOG_FORMAT, write_status

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


def test_sigterm_deletes_the_job_and_exits_within_5_s(staged_root: Path, tmp_path: Path) -> None:
    """KFP terminates a run by signalling the step's process: the job must not outlive it."""
    with FakeKubernetes(CRD_PATH, Lifecycle.running(2)) as server:
        command = [sys.executable, "-m", "pipelines.cli", "launch", "--backend", "kubernetes", "--storage-root",
                   str(staged_root), "--dataset", "synthetic", "--run-id", "cancel", "--nnodes", "2",
                   "--nproc-per-node", "8", "--image", "img:1", "--no-owner-reference"]  # fmt: skip
        env = {**os.environ, "KUBECONFIG": str(server.write_kubeconfig(tmp_path / "kubeconfig"))}
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
    with FakeKubernetes(CRD_PATH, Lifecycle.running()) as server:
        command = [sys.executable, "-m", "pipelines.cli", "launch", "--backend", "kubernetes", "--storage-root",
                   str(staged_root), "--dataset", "synthetic", "--run-id", "killed", "--nnodes", "2",
                   "--nproc-per-node", "8", "--image", "img:1", "--no-owner-reference"]  # fmt: skip
        env = {**os.environ, "KUBECONFIG": str(server.write_kubeconfig(tmp_path / "kubeconfig"))}
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
    job = render_job(cluster_config(staged_root, "vanishing", nnodes=1).job_spec())
    outcome: list[BaseException] = []
    server = FakeKubernetes(CRD_PATH, Lifecycle.running(1)).__enter__()
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


# -- as a real cluster runs it: retries, evidence, elasticity, queues, volumes -----------------------------------


def fast(**overrides: Any) -> WatchSettings:
    """Short deadlines for tests. A pod's creationTimestamp has whole seconds (metav1.Time), so the Pending clock may
    read up to a second more than has passed: a Pending deadline that must not fire is 2 s or more here."""
    return WatchSettings(**{"diagnose_every_s": 0.1, "poll_interval_s": 0.2, "replace_timeout_s": 30, **overrides})


def test_a_retried_run_after_a_failed_job_trains_again(staged_root: Path, caplog) -> None:
    """KFP's run-level Retry keeps the run id, so the job name: the failed job is replaced, not re-reported."""
    caplog.set_level(logging.INFO)
    cfg = cluster_config(staged_root, "retried")
    with FakeKubernetes(CRD_PATH, Lifecycle.crash_loop(crashes=4)) as server:
        server.pod_termination_s = 0.5  # the old job stays, with its finalizer, while its pods terminate
        with pytest.raises(StepFailed, match=r"failed \(attempt 1\): PyTorchJobFailed: Job .* backoff limit"):
            launch(cfg, client(server))
        server.lifecycle = Lifecycle.success(workers=2, log_lines=LINES[:3])
        second = launch(cfg, client(server))
        job = server.job("kubeflow", second.job_name)
        creates = [p for m, p in server.requests if m == "POST"]
        deletions = list(server.deletions)
    assert (second.state, second.attempt, second.reattached) == ("Succeeded", 2, False)
    assert job["metadata"]["annotations"]["hyperpod-pretrain.io/attempt"] == "2"
    assert deletions == [("kubeflow", second.job_name, "Foreground")], "the failed job, once"
    assert len(creates) == 3, "attempt 1; the 409 that found the failed job; attempt 2 once it was gone"
    assert "deleting it to train again as attempt 2" in caplog.text


def test_a_job_of_a_run_that_is_still_running_is_reattached_not_replaced(staged_root: Path) -> None:
    cfg = cluster_config(staged_root, "still-running")
    with FakeKubernetes(CRD_PATH, Lifecycle.running()) as server:
        server.put_job(render_job(cfg.job_spec()))
        server.lifecycle = Lifecycle.success(workers=2, log_lines=LINES[:2])
        handle = server.handle("kubeflow", cfg.job_name)
        handle.create_pods(2)
        for i in (0, 1):
            handle.run(i)
        handle.set_condition("Running", "PyTorchJobRunning", "running")
        threading.Timer(0.5, handle.succeed_all).start()
        result = launch(cfg, client(server))
        deletions = list(server.deletions)
    assert (result.state, result.reattached, result.attempt) == ("Succeeded", True, 1) and deletions == []


def write_trainer_logs(run: RunPaths, failing_rank: int, world: int = 4) -> None:
    """Per-rank logs and status.json as the trainer writes them (its LOG_FORMAT and write_status)."""
    run.logs.mkdir(parents=True, exist_ok=True)
    for rank in range(world):
        logger = logging.getLogger(f"trainer-fixture-{rank}")
        logger.propagate = False
        handler = logging.FileHandler(run.rank_log(rank))
        handler.setFormatter(logging.Formatter(LOG_FORMAT.replace("{rank}", str(rank))))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        for step in (10, 20, 30):
            logger.info("step %d loss %.2f", step, 5 - step / 10)
        if rank == failing_rank:
            try:
                raise RuntimeError("CUDA error: an illegal memory access was encountered")
            except RuntimeError:
                logger.exception("training crashed")
        handler.close()
        logger.removeHandler(handler)
    time.sleep(0.01)
    for rank in range(world):  # the others die in the collective later
        with open(run.rank_log(rank), "a") as f:
            if rank != failing_rank:
                f.write(logging.Formatter(LOG_FORMAT.replace("{rank}", str(rank))).format(logging.makeLogRecord(
                    {"name": "trainer", "levelname": "ERROR", "levelno": logging.ERROR,
                     "msg": "training crashed: Connection reset by peer"})) + "\n")  # fmt: skip
    write_status(run, 0, "crashed", exit_code=1, step=30, error="RuntimeError('Connection reset by peer')")


def test_a_failed_job_whose_pods_were_deleted_still_names_the_trainers_last_lines(staged_copy: Path) -> None:
    """Training Operator 1.8.1 deletes every pod at the backoff limit before it writes Failed: the evidence comes
    from the trainer's own logs on the volume."""
    cfg = cluster_config(staged_copy, "evidence")
    write_trainer_logs(cfg.run_paths, failing_rank=3)
    with FakeKubernetes(CRD_PATH, Lifecycle.crash_loop(crashes=4, log_lines=["boom"])) as server:
        with pytest.raises(StepFailed) as failure:
            launch(cfg, client(server))
        assert server.pods("kubeflow", cfg.job_name) == [], "the operator deleted the pods"
    message = str(failure.value)
    assert "backoff limit" in message and "trainer crashed at step 30" in message
    assert "rank 3, the first to log an error" in message
    assert "RuntimeError: CUDA error: an illegal memory access was encountered" in message


def test_without_the_trainers_logs_the_lines_kept_at_each_restart_are_the_evidence(staged_root: Path) -> None:
    cfg = cluster_config(staged_root, "restart-lines")
    lines = ["Traceback (most recent call last):", "ModuleNotFoundError: No module named 'trainer'"]
    with FakeKubernetes(CRD_PATH, Lifecycle.crash_loop(crashes=4, log_lines=lines, tick_s=0.3)) as server:
        job = render_job(cfg.job_spec())
        with pytest.raises(StepFailed) as failure:
            run_job(Kube(client(server)), job, fast(logs="none"), threading.Event())
    assert "ModuleNotFoundError: No module named 'trainer'" in str(failure.value)
    assert "exit code 1 (Error) at restart" in str(failure.value)


def test_an_elastic_job_running_on_its_minimum_with_pods_pending_succeeds(staged_root: Path, caplog) -> None:
    """A 2:4 job runs on 2 nodes while 2 pods wait Pending for room: that is elasticity, not a stuck job."""
    caplog.set_level(logging.INFO)
    cfg = cluster_config(staged_root, "elastic", nnodes=2, max_nodes=4)
    job = render_job(cfg.job_spec())
    with FakeKubernetes(CRD_PATH, Lifecycle.elastic(2, 4, log_lines=LINES, tick_s=0.3)) as server:
        outcome = run_job(Kube(client(server)), job, fast(pending_timeout_s=2.5), threading.Event())
        deletions = list(server.deletions)
    assert outcome.state == "Succeeded" and deletions == []
    assert "Pending beyond the minimum of 2" in caplog.text
    assert not [f for f in outcome.diagnosis if f.startswith("Pod stuck in Pending")], outcome.diagnosis


def test_a_job_that_never_starts_is_deleted_at_the_pending_deadline(staged_root: Path) -> None:
    job = render_job(cluster_config(staged_root, "never").job_spec())
    with FakeKubernetes(CRD_PATH, Lifecycle.stuck_pending()) as server:
        with pytest.raises(StepFailed, match=r"never started: pods Pending .* Insufficient nvidia.com/gpu"):
            run_job(Kube(client(server)), job, fast(pending_timeout_s=0.5), threading.Event())
        assert [d[2] for d in server.deletions] == ["Foreground"]


def test_a_lost_node_gets_the_recovery_deadline(staged_root: Path) -> None:
    """After the job ran, a pod recreated Pending (its node lost, no replacement yet) is held to the recovery
    deadline, not the (shorter) Pending one."""
    lost_node = (
        Lifecycle.running()
        .then(0.5, lambda j: j.server._remove(PODS, j.namespace, j.pod_name(1)))
        .then(0.05, lambda j: j.create_pod(1, scheduled=False))
    )
    job = render_job(cluster_config(staged_root, "lost-node").job_spec())
    with FakeKubernetes(CRD_PATH, lost_node) as server:
        started = time.monotonic()
        with pytest.raises(StepFailed, match=r"fewer than its minimum of 2 pod\(s\) for \d+s .* recovery deadline"):
            run_job(Kube(client(server)), job, fast(pending_timeout_s=2, recovery_timeout_s=4), threading.Event())
    assert time.monotonic() - started > 4


def test_a_queued_job_is_reported_and_not_deleted_by_the_pending_deadline(staged_root: Path, caplog) -> None:
    """HyperPod task governance (Kueue) creates the job suspended and admits it later: waiting in the queue is not
    being stuck in Pending."""
    caplog.set_level(logging.INFO)
    cfg = cluster_config(staged_root, "queued", platform=Platform(queue_name="hyperpod-ns-team-a-localqueue",
                                                                  priority_class="training-priority"))  # fmt: skip
    job = render_job(cfg.job_spec())
    assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "hyperpod-ns-team-a-localqueue"
    assert job["metadata"]["labels"]["kueue.x-k8s.io/priority-class"] == "training-priority"
    with FakeKubernetes(CRD_PATH, Lifecycle.queued(admit_after_s=3.5, log_lines=LINES[:2])) as server:
        server.kueue = True
        outcome = run_job(Kube(client(server)), job, fast(pending_timeout_s=2.5), threading.Event())
        stored = server.job("kubeflow", cfg.job_name)
        deletions = list(server.deletions)
    assert outcome.state == "Succeeded" and deletions == []
    assert "is queued: suspended until the cluster's queue (Kueue) admits it" in caplog.text
    assert re.search(r"was admitted after \d+s in the queue", caplog.text)
    assert stored["spec"]["runPolicy"]["suspend"] is False, "Kueue suspended it at creation and admitted it"


def test_the_queue_deadline_is_its_own(staged_root: Path) -> None:
    job = render_job(cluster_config(staged_root, "queued-long", platform=Platform(queue_name="q")).job_spec())
    with FakeKubernetes(CRD_PATH, Lifecycle.queued(admit_after_s=600)) as server:
        server.kueue = True
        with pytest.raises(StepFailed, match=r"queued \(suspended, not admitted\) for \d+s, past the queue deadline"):
            run_job(Kube(client(server)), job, fast(pending_timeout_s=1.2, queue_timeout_s=1), threading.Event())
        assert len(server.deletions) == 1


def test_a_log_stream_that_falls_silent_is_reopened(staged_root: Path, caplog) -> None:
    """A stream from a lost node sends nothing and never closes: the read timeout reopens it, nothing repeats."""
    caplog.set_level(logging.INFO)
    job = render_job(cluster_config(staged_root, "silent").job_spec())
    with FakeKubernetes(CRD_PATH, Lifecycle.success(workers=2, log_lines=LINES, tick_s=0.15)) as server:
        server.faults.stall_log_after(3)
        outcome = run_job(Kube(client(server)), job, fast(log_read_timeout_s=0.5), threading.Event())
        stalled = [f for f in server.faults.injected if f[0] == "stall_log"]
    assert outcome.state == "Succeeded" and stalled
    assert pod_lines(caplog, f"{job['metadata']['name']}-worker-0") == LINES


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


def test_the_training_deadline_reaches_the_operator(staged_root: Path) -> None:
    """runPolicy.activeDeadlineSeconds backs the launcher's deadline up when the launcher is gone."""
    policy = render_job(cluster_config(staged_root, "deadline", timeout_s=3600).job_spec())["spec"]["runPolicy"]
    assert policy["activeDeadlineSeconds"] == 3600 + OPERATOR_DEADLINE_MARGIN_S
    unbounded = render_job(cluster_config(staged_root, "deadline", timeout_s=0).job_spec())["spec"]["runPolicy"]
    assert "activeDeadlineSeconds" not in unbounded


def test_a_terminated_runs_job_is_deleted_by_the_exit_step(staged_root: Path, tmp_path: Path) -> None:
    """KFP runs the exit step after a terminate; the launcher may have died (SIGKILL) before it deleted anything.
    The exit step sees the launcher's record still "running" and deletes the job; the owner reference would wait for
    the launcher's pod object, which KFP keeps for a day."""
    root = tmp_path / "fsx"
    shutil.copytree(staged_root, root)
    pipeline_run = "6d1c2b3a-0000-4000-8000-00000000abcd"
    # The launcher step as its component runs it: recorded_step around launch (components/launch_pytorchjob).
    script = (
        "import sys\n"
        "from components.run_summary.core import recorded_step\n"
        "from pipelines.cli import main\n"
        f"with recorded_step({str(root)!r}, 'killed-run', 'launch-pytorchjob', {{}}):\n"
        "    main(sys.argv[1:])\n"
    )
    command = [sys.executable, "-c", script, "launch", "--backend", "kubernetes", "--storage-root", str(root),
               "--dataset", "synthetic", "--run-id", "killed-run", "--pipeline-run-id", pipeline_run, "--nnodes", "2",
               "--nproc-per-node", "8", "--image", "img:1", "--no-owner-reference"]  # fmt: skip
    with FakeKubernetes(CRD_PATH, Lifecycle.running()) as server:
        env = {**os.environ, "KUBECONFIG": str(server.write_kubeconfig(tmp_path / "kubeconfig"))}
        launcher = subprocess.Popen(command, env=env, stderr=subprocess.DEVNULL)
        name, deadline = job_name(pipeline_run, "killed-run"), time.monotonic() + 60
        while time.monotonic() < deadline and not running(server.job("kubeflow", name)):
            time.sleep(0.05)
        assert running(server.job("kubeflow", name)), "the job never ran"
        launcher.kill()  # outright: no handler runs
        launcher.wait(timeout=10)
        assert server.deletions == [] and running(server.job("kubeflow", name))
        cleanup = job_cleanup("kubernetes", "kubeflow", "killed-run", pipeline_run, client(server))
        summary = summarize_run(str(root), "killed-run", pipeline_run, "RUNNING", cleanup=cleanup)
        deletions = list(server.deletions)
        other = job_cleanup("kubernetes", "kubeflow", "killed-run", "another-pipeline-run", client(server))()
    assert summary.state == "TERMINATED" and summary.cleanup.endswith("was still running after the run ended: deleted")
    assert deletions == [("kubeflow", name, "Foreground")]
    assert other.startswith("no PyTorchJob") or "another pipeline run" in other or "being deleted" in other


def test_the_exit_step_leaves_a_finished_job_and_someone_elses_alone(staged_root: Path) -> None:
    cfg = cluster_config(staged_root, "finished")
    with FakeKubernetes(CRD_PATH, Lifecycle.success(workers=2, log_lines=LINES[:2])) as server:
        launch(cfg, client(server))
        done = job_cleanup("kubernetes", "kubeflow", cfg.run_id, cfg.pipeline_run_id, client(server))()
        server.put_job(render_job(cluster_config(staged_root, "theirs", pipeline_run_id="").job_spec()))
        theirs = job_cleanup("kubernetes", "kubeflow", "theirs", "", client(server))()
        deletions = list(server.deletions)
    assert "had already finished: left for its logs" in done
    assert "belongs to another pipeline run: left alone" in theirs and deletions == []


def rank_logs(run: RunPaths, world: int, steps: tuple[int, ...]) -> None:
    """Each rank's log as the trainer writes it (its LOG_FORMAT), up to the last of `steps`."""
    run.logs.mkdir(parents=True, exist_ok=True)
    for rank in range(world):
        with open(run.rank_log(rank), "a") as f:
            for step in steps:  # train_ddp's step line, with its format string
                record = logging.makeLogRecord({
                    "name": "trainer", "levelname": "INFO", "levelno": logging.INFO,
                    "msg": "step %d loss %.4f lr %.2e grad norm %.2f tokens/s %.0f%s",
                    "args": (step, 5 - step / 10, 3e-3, 0.5, 20000, ""),
                })  # fmt: skip
                f.write(logging.Formatter(LOG_FORMAT.replace("{rank}", str(rank))).format(record) + "\n")


def test_a_diverged_trainer_ends_its_job_instead_of_restarting_it(staged_root: Path) -> None:
    """The trainer writes status.json "diverged" (trainer/health.py's line) and exits 3; with restartPolicy
    OnFailure the kubelet restarts it, again and again. The launcher reads the status on the volume and deletes
    the job before the operator's backoff limit (or HyperPod auto-resume) gets a say."""
    from trainer.health import Divergence
    from trainer.preemption import ExitCode

    root = staged_root.parent / "diverged-k8s"
    shutil.copytree(staged_root, root, symlinks=True, dirs_exist_ok=True)
    cfg = cluster_config(root, "diverged")
    divergence = Divergence(limit=3)
    for step in range(25, 29):
        divergence.record(step, finite=False)

    def diverge(job: Any) -> None:
        rank_logs(cfg.run_paths, 2, (10, 20))
        write_status(cfg.run_paths, 0, "diverged", step=25, exit_code=ExitCode.DIVERGED, error=divergence.reason())

    loop = Lifecycle.crash_loop(workers=2, exit_code=int(ExitCode.DIVERGED), crashes=40, tick_s=0.5)
    with FakeKubernetes(CRD_PATH, Lifecycle([*loop.steps[:3], (0.1, diverge), *loop.steps[3:]])) as server:
        with pytest.raises(StepFailed) as failure:
            launch(cfg, client(server))
        deleted = [path for method, path in server.requests if method == "DELETE" and "pytorchjobs" in path]
        restarts = sum(s.get("restartCount", 0) for p in server.pods("kubeflow", cfg.job_name)
                       for s in p.get("status", {}).get("containerStatuses", []))  # fmt: skip
    message = str(failure.value)
    assert "was stopped, not restarted: diverged at step 25: the loss or gradient norm" in message
    assert "it was deleted" in message and "backoff" not in message
    assert deleted and restarts < 40


def test_a_job_whose_step_stops_advancing_is_deleted_with_every_ranks_last_lines(staged_root: Path) -> None:
    root = staged_root.parent / "stalled-k8s"
    shutil.copytree(staged_root, root, symlinks=True, dirs_exist_ok=True)
    cfg = cluster_config(root, "stalled", stall_timeout_s=2)

    def three_steps_then_nothing(job: Any) -> None:
        rank_logs(cfg.run_paths, 2, (1, 2, 3))
        write_status(cfg.run_paths, 0, "running", step=3, world_size=16, attempt=1)

    lifecycle = Lifecycle.success(workers=2, log_lines=[f"line {i}" for i in range(60)], tick_s=0.5)
    with FakeKubernetes(CRD_PATH, Lifecycle([*lifecycle.steps[:3], (0.1, three_steps_then_nothing),
                                             *lifecycle.steps[3:]])) as server:  # fmt: skip
        with pytest.raises(StepFailed) as failure:
            launch(cfg, client(server))
        deleted = [path for method, path in server.requests if method == "DELETE" and "pytorchjobs" in path]
    message = str(failure.value)
    assert "stalled: no training step completed for" in message and "after step 3" in message
    assert "[rank 0] INFO trainer: step 3 loss" in message and "[rank 1] INFO trainer: step 3 loss" in message
    assert deleted
