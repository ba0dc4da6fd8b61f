"""The kubernetes backend against the real kube-apiserver and controller manager (tests/cluster/control_plane.py).

The launcher is the pipeline runner (its service-account token; deploy/rbac*.yaml's Roles in the test's namespace,
the real RBAC authorizer deciding). The Training Operator v1.8.1 and its webhook, Kubeflow Trainer v2.3.0 and JobSet
v0.12.0 with their webhooks (over the real Job controller), Kueue and the kubelet are played on top (tests/cluster/);
what the tests assert of requests comes from the API server's audit log and metrics.

The launcher's lifecycle (success, failure with evidence, a new attempt after a failure, re-attach, SIGTERM, the exit
step's clean-up, deadlines, Kueue's queueing and preemption, stall, divergence) runs against both job APIs: those
tests take `api` (BOTH_APIS) and say what differs between the two where their timelines must.
"""

from __future__ import annotations

import json
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
from urllib.parse import unquote

import kubernetes
import pytest

from common.errors import InputError, StepFailed
from components.kube import Kube, KubeSettings, api_client_from_environment
from components.launch_training.attach import create_or_attach
from components.launch_training.config import OPERATOR_DEADLINE_MARGIN_S, LaunchConfig
from components.launch_training.core import launch
from components.launch_training.follow import run_job
from components.launch_training.job_api import JOB_APIS
from components.launch_training.manifest import DEFAULT_RUNTIME, job_name, render_job
from components.launch_training.platform import Platform
from components.launch_training.watch_settings import DIAGNOSE_EVERY_S, WatchSettings
from components.run_summary.core import job_cleanup, summarize_run
from components.verify_nccl.core import fetch_pod_logs
from tests.cluster.control_plane import deploy_grants
from tests.cluster.timelines import Timeline
from tests.helpers import snapshot_dir
from trainer.layout import RunPaths
from trainer.metrics import step_line
from trainer.train_ddp import LOG_FORMAT, write_status

LINES = [f"step {i} loss {5 - i / 10:.2f}" for i in range(1, 13)]
# A crash loop of 3 container restarts fails the job (backoffLimit 1 x 2 nodes + 1), and the launcher fails the step
# at once instead of watching for HyperPod auto-resume.
FAILS_AT_THIRD_RESTART = {"restart_budget": 1, "auto_resume_wait_s": 0}
BOTH_APIS = pytest.mark.parametrize("api", JOB_APIS)


def on(cluster: Any, **platform: Any) -> dict[str, Any]:
    """The settings that put a run on `cluster`: its namespace, and its job API (and runtime) as compiled in."""
    runtime = cluster.runtime_name or DEFAULT_RUNTIME
    return {
        "namespace": cluster.namespace,
        "platform": Platform(job_api=cluster.api.name, runtime_name=runtime, **platform),
    }


def restart_budget(api: str, budget: int) -> dict[str, Any]:
    """What a run on `api` gives for a restart budget: a PyTorchJob's is a job option (its backoffLimit); a
    TrainJob's is its runtime's JobSet maxRestarts (make_cluster(restart_budget=...)), so nothing."""
    return {"restart_budget": budget, "auto_resume_wait_s": 0} if api == "pytorchjob" else {}


def crash_until_failed(api: str, log_lines: Any = None, tick_s: float = 0.3) -> Timeline:
    """Worker 1 crashes until the job fails, with a restart budget of 1 (FAILS_AT_THIRD_RESTART; a TrainJob's
    runtime with maxRestarts 1). A PyTorchJob: OnFailure restarts the container in place; at the backoff limit (3
    restarts, job-wide) the Training Operator deletes every pod and writes Failed (1.8.1 ReconcileJobs). A TrainJob:
    the pod fails (restartPolicy Never), its Job fails (backoffLimit 0: the real Job controller), JobSet deletes and
    recreates the group once (failure_policy.go, restartJobSetActionApplier), and the second failure exhausts
    maxRestarts: Failed, ReachedMaxRestarts."""
    lines = list(log_lines) if log_lines is not None else None
    if api == "pytorchjob":
        return Timeline.crash_loop(crashes=4, tick_s=tick_s, **({"log_lines": lines} if lines else {}))
    crash = Timeline.failure(**({"log_lines": lines} if lines else {}), tick_s=tick_s)
    again = Timeline([(tick_s, lambda job: job.start_recreated(0, 1))])
    return (
        crash
        + again
        + Timeline.lines(lines or ["Traceback (most recent call last):"], [1], tick_s)
        + Timeline.exits([1], 1, tick_s)
    )


def node_lines(caplog: pytest.LogCaptureFixture, api: str, job: str, node: int) -> list[str]:
    """The lines streamed from node `node`'s pods (a TrainJob's are named <job>-node-0-<node>-<suffix>)."""
    if api == "pytorchjob":
        return pod_lines(caplog, f"{job}-worker-{node}")
    prefix = f"pod.{job}-node-0-{node}-"
    return [r.getMessage() for r in caplog.records if r.name.startswith(prefix)]


def cluster_config(staged_root: Path, run_id: str, namespace: str = "kubeflow", **overrides: Any) -> LaunchConfig:
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
        namespace=namespace,
    )
    return LaunchConfig.of(**{**settings, **overrides})


def fast(**overrides: Any) -> WatchSettings:
    """Short deadlines for tests. A pod's creationTimestamp has whole seconds (metav1.Time), so the Pending clock may
    read up to a second more than has passed: a Pending deadline that must not fire is 2 s or more here."""
    return WatchSettings(**{"diagnose_every_s": 0.2, "poll_interval_s": 0.2, "replace_timeout_s": 30, **overrides})


def pod_lines(caplog: pytest.LogCaptureFixture, pod: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == f"pod.{pod}"]


def forbidden(cluster: Any) -> list[str]:
    """The runner's requests that RBAC refused (audit: a 403 without an allow decision)."""
    return [
        f"{e['verb']} {e['objectRef']}"
        for e in cluster.audit()
        if e["responseStatus"]["code"] == 403
        and e.get("annotations", {}).get("authorization.k8s.io/decision") != "allow"
    ]


def running(job: dict[str, Any] | None) -> bool:
    """A PyTorchJob's Running condition; a TrainJob has none: its node group ready (status.jobsStatus, JobSet's
    replicatedJobsStatus: a Job counts ready when its ready pods reach its parallelism)."""
    status = (job or {}).get("status", {})
    if (job or {}).get("kind") == "TrainJob":
        return any(entry.get("ready") for entry in status.get("jobsStatus") or [])
    return any(c["type"] == "Running" and c["status"] == "True" for c in status.get("conditions", []))


def wait_for(predicate: Any, timeout_s: float = 30, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"not within {timeout_s:.0f}s: {what}")


def deleted_jobs(cluster: Any) -> list[tuple[str, str]]:
    """(name, propagationPolicy) of every job the runner deleted (audit log; the policy from the body)."""
    return [
        (e["objectRef"]["name"], e.get("requestObject", {}).get("propagationPolicy", ""))
        for e in cluster.requests("delete", cluster.api.plural)
    ]


# -- a launch from start to end ---------------------------------------------------------------------------------


@BOTH_APIS
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
    else:
        # v2.3.0 copies JobSet's Completed as Complete (plugins/jobset/jobset.go Status), with the child jobs' counts.
        assert job["spec"]["trainer"]["numNodes"] == 2 and result.job_kind == "TrainJob"
        assert "TrainJob " + result.job_name + ": Complete (AllJobsCompleted)" in caplog.text
        assert job["status"]["jobsStatus"] == [
            {"name": "node", "ready": 0, "succeeded": 1, "failed": 0, "active": 0, "suspended": 0}
        ]


@BOTH_APIS
def test_a_profiles_default_editor_launches_verifies_and_cleans_up(
    api: str, staged_root: Path, make_cluster, kubeflow: None, tmp_path: Path
) -> None:
    """In a Kubeflow profile's namespace, as its default-editor (kubeflow-edit from the profile controller, and only
    what `render-rbac --kubeflow-profile` adds): the launch, verification's read of the pods' logs and the exit step's
    clean-up meet no refusal; tests/test_rbac.py holds each rendered rule to a request made here. A TrainJob run
    first finds a Failed TrainJob of its name left behind, and replaces it once its JobSet is gone."""
    cluster = make_cluster(
        timeline=Timeline.success(workers=2, log_lines=LINES), api=api, profile=True, restart_budget=0
    )
    cfg = cluster_config(staged_root, "in-profile", **on(cluster))
    if api == "trainjob":
        cluster.timeline = Timeline.failure()
        cluster.create_job(render_job(cfg.job_spec()))
        wait_for(lambda: cluster.api.is_failed(cluster.job(cfg.job_name) or {}), 30, "the TrainJob failed")
        cluster.timeline = Timeline.success(workers=2, log_lines=LINES)
    result = launch(cfg, cluster.runner())
    assert (result.state, result.namespace) == ("Succeeded", cluster.namespace)
    assert result.attempt == (2 if api == "trainjob" else 1)
    logs = fetch_pod_logs(result.job_name, cluster.namespace, tmp_path / "logs", api, api_client=cluster.runner())
    assert len(logs) == 2 and all(path.read_text() for path in logs)
    cleanup = job_cleanup("kubernetes", cluster.namespace, "in-profile", "pipeline-in-profile", api, cluster.runner())
    assert "had already finished: left for its logs" in cleanup()
    assert forbidden(cluster) == [], "kubeflow-edit and render-rbac --kubeflow-profile grant every request"


def test_the_live_log_of_rank_0_is_read_once_across_a_container_restart(
    staged_root: Path, make_cluster, caplog
) -> None:
    """Worker-0's container crashes and the kubelet restarts it in place (OnFailure): the stream of the first
    instance ends, the launcher reconnects to the second, and every line of both reaches the step's log once."""
    caplog.set_level(logging.INFO)
    first, second = LINES[:5], LINES[5:]
    timeline = (
        Timeline.started(2)
        + Timeline.lines(first, [0, 1], tick_s=0.1).then(0.1, lambda job: job.exit(0, 1))
        + Timeline.lines(second, [0, 1], tick_s=0.1)
        + Timeline.exits([0, 1], 0)
    )
    cluster = make_cluster(timeline=timeline)
    result = launch(cluster_config(staged_root, "restart-log", cluster.namespace), cluster.runner())
    assert result.state == "Succeeded" and result.restarts >= 1
    assert pod_lines(caplog, f"{result.job_name}-worker-0") == first + second
    reads = [e for e in cluster.requests("get", "pods", "log") if e["responseStatus"]["code"] == 200]
    assert len(reads) >= 2, "the first instance's stream ended at its exit; the second was read on a new request"


def test_a_whole_launch_while_no_kubelet_answers_reads_logs_at_most_twice_a_second(
    staged_root: Path, make_cluster, caplog
) -> None:
    """With no kubelet to reach, the real API server answers pods/log with 500: the launch still succeeds, on the
    job's status, and its log requests (apiserver_request_total) stay under 2 a second."""
    caplog.set_level(logging.INFO)
    cluster = make_cluster(timeline=Timeline.success(workers=2, log_lines=LINES, tick_s=0.3), serve_logs=False)
    plane = cluster.control_plane
    before = plane.request_counts("pods", "log")
    started = time.monotonic()
    result = launch(cluster_config(staged_root, "no-kubelet", cluster.namespace, stream_logs="all"), cluster.runner())
    seconds = time.monotonic() - started
    after = plane.request_counts("pods", "log")
    requests = sum(after.values()) - sum(before.values())
    assert result.state == "Succeeded"
    # pods/log is a connecter: the metric's verb is CONNECT
    assert after.get(("CONNECT", "500"), 0) > before.get(("CONNECT", "500"), 0), "the API server's own 500 was met"
    assert requests <= 2 * seconds, f"{requests} log requests in {seconds:.1f}s"


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


def test_a_failed_worker_of_a_never_restarted_job_fails_it_with_the_pods_last_lines(
    staged_root: Path, make_cluster
) -> None:
    """restartPolicy Never: the pod fails, the operator fails the job at once ("... is failed because 1 Worker
    replica(s) failed."), and the failed pod (left by cleanPodPolicy Running) shows its last lines and events."""
    lines = ["Traceback (most recent call last):", "RuntimeError: CUDA error: out of memory"]
    cluster = make_cluster(timeline=Timeline.failure(log_lines=lines))
    cfg = cluster_config(
        staged_root, "bad", cluster.namespace, job_options={"restart_policy": "Never", "auto_resume": False}
    )
    with pytest.raises(StepFailed) as failure:
        launch(cfg, cluster.runner())
    message = str(failure.value)
    assert (
        f"failed (attempt 1): PyTorchJobFailed: PyTorchJob {cfg.job_name} is failed because 1 Worker replica(s) "
        "failed." in message
    )
    assert "RuntimeError: CUDA error: out of memory" in message, "the failed pod's last lines"
    (failed,) = [p for p in cluster.pods(cfg.job_name) if p["status"]["phase"] == "Failed"]
    assert failed["metadata"]["name"].endswith("worker-1")


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


def test_a_crash_loop_fails_at_the_backoff_limit_with_the_lines_kept_at_each_restart(
    staged_root: Path, make_cluster
) -> None:
    """OnFailure: the kubelet restarts the container in place; at the backoff limit (restart budget 1 on 2 nodes:
    3 restarts, job-wide) the operator deletes every pod before it writes Failed. The lines read at each restart
    (the diagnosis looks more often than the kubelet's back-off restarts) are the evidence."""
    cluster = make_cluster(timeline=Timeline.crash_loop(crashes=4, tick_s=0.3))
    cfg = cluster_config(staged_root, "crash-loop", cluster.namespace, job_options=FAILS_AT_THIRD_RESTART)
    job = render_job(cfg.job_spec())
    with pytest.raises(StepFailed) as failure:
        run_job(Kube(cluster.runner()), job, fast(logs="none"), threading.Event())
    message = str(failure.value)
    assert "failed (attempt 1): PyTorchJobFailed: Job hpp-crash-loop-train-" in message
    assert "has failed because it has reached the specified backoff limit" in message
    assert "ModuleNotFoundError: No module named 'trainer'" in message
    # the exit code as kept at a restart, or as the diagnosis says it when the pods could still be read at the end
    assert "exit code 1 (Error)" in message
    wait_for(lambda: cluster.pods(job_name("pipeline-crash-loop", "crash-loop")) == [], 10, "pods deleted")


def test_an_exit_code_job_whose_worker_is_oom_killed_and_made_anew_ends_at_its_restart_budget(
    staged_root: Path, make_cluster
) -> None:
    """restartPolicy ExitCode: the operator gives the pods restartPolicy Never, deletes a worker that exits 137
    (OOMKilled) and makes a new pod (restartCount 0), and its backoff limit, counting restarts of Running pods, never
    fires (1.8.1 ReconcilePods, PastBackoffLimit). The launcher counts each new pod of a replica as a restart: the
    budget (1 on 2 nodes: backoffLimit 3) is used up at the third, and the step fails then, naming the exit code."""
    made_anew: list[float] = []

    def oom_and_made_anew(job: Any) -> None:
        job.exit(1, 137, "OOMKilled")
        job.start_recreated(1)
        made_anew.append(time.monotonic())

    timeline = Timeline.started(2)
    for _ in range(8):  # more than the budget: the old launcher watched this loop until its deadline
        timeline = timeline.then(0.3, oom_and_made_anew)
    cluster = make_cluster(timeline=timeline)
    options = {**FAILS_AT_THIRD_RESTART, "restart_policy": "ExitCode", "auto_resume": False}
    cfg = cluster_config(staged_root, "oom-anew", cluster.namespace, job_options=options)
    job = render_job(cfg.job_spec())
    with pytest.raises(StepFailed) as failure:
        run_job(Kube(cluster.runner()), job, fast(logs="none", diagnose_every_s=DIAGNOSE_EVERY_S), threading.Event())
    ended = time.monotonic()
    message = str(failure.value)
    assert "used up its restart budget: 3 restarts (backoffLimit 3)" in message, message
    assert "worker-1: exit code 137 (OOMKilled)" in message
    assert len(made_anew) >= 3 and ended - made_anew[2] < 5, f"{ended - made_anew[2]:.1f}s after the third restart"
    assert deleted_jobs(cluster) == [(job["metadata"]["name"], "Foreground")]


def test_a_failure_without_the_events_permission_says_so(staged_root: Path, make_cluster, caplog) -> None:
    """A job that never starts is described (its pods' events) before it is deleted: without 'list events' the step's
    log says which rule is missing, and the launch goes on without them."""
    cluster = make_cluster(timeline=Timeline.stuck_pending(), grants=deploy_grants(without=("list events",)))
    job = render_job(cluster_config(staged_root, "no-events", cluster.namespace).job_spec())
    with pytest.raises(StepFailed, match="past the Pending deadline"):
        run_job(Kube(cluster.runner()), job, fast(pending_timeout_s=2), threading.Event())
    assert "not readable by this service account" in caplog.text and "deploy/rbac.yaml" in caplog.text
    assert forbidden(cluster), "RBAC refused the events, on the real authorizer"


def test_polls_when_watching_is_refused(staged_root: Path, make_cluster, caplog) -> None:
    caplog.set_level(logging.INFO)
    cluster = make_cluster(
        timeline=Timeline.success(workers=2, log_lines=LINES[:3]), grants=deploy_grants(without=("watch pytorchjobs",))
    )
    job = render_job(cluster_config(staged_root, "polled", cluster.namespace).job_spec())
    outcome = run_job(Kube(cluster.runner()), job, WatchSettings(poll_interval_s=0.2), threading.Event())
    assert outcome.state == "Succeeded" and "polling every 0.2s instead" in caplog.text
    assert [e["verb"] for e in cluster.audit() if e["responseStatus"]["code"] == 403] == ["watch"]


def test_a_restarted_worker_is_reported_and_the_job_carries_on(staged_root: Path, make_cluster, caplog) -> None:
    caplog.set_level(logging.INFO)
    timeline = (
        Timeline.started(2)
        + Timeline.lines(LINES[:2], [0, 1]).then(0.1, lambda job: job.exit(1, 1))
        + Timeline.lines(LINES[2:4], [0, 1], tick_s=0.5)
        + Timeline.exits([0, 1], 0)
    )
    cluster = make_cluster(timeline=timeline)
    job = render_job(cluster_config(staged_root, "restart", cluster.namespace).job_spec())
    outcome = run_job(Kube(cluster.runner()), job, fast(), threading.Event())
    assert outcome.state == "Succeeded" and outcome.restarts >= 1
    assert "worker-1 restarted (exit code 1 (Error) at restart 1" in caplog.text


def test_every_agent_restarting_at_once_is_one_restart_of_the_budget(staged_root: Path, make_cluster) -> None:
    """worker-0 holds the c10d store: when it goes, every agent's container exits and restarts (OnFailure), and the
    Training Operator counts each towards the job-wide backoffLimit (1.8.1 PastBackoffLimit). A 3-node job survives
    it with the default budget; with a backoffLimit of 3 (the default before) it failed here."""
    timeline = (
        Timeline.started(3)
        + Timeline.lines(LINES[:2], range(3))
        + Timeline.exits(range(3), 1)
        + Timeline.lines(LINES[2:4], range(3), tick_s=0.3)
        + Timeline.exits(range(3), 0)
    )
    cluster = make_cluster(timeline=timeline)
    job = render_job(cluster_config(staged_root, "all-restart", cluster.namespace, nnodes=3).job_spec())
    outcome = run_job(Kube(cluster.runner()), job, fast(logs="none"), threading.Event())
    assert outcome.state == "Succeeded" and outcome.restarts >= 3


def test_transient_faults_and_cut_streams_are_survived(staged_root: Path, make_cluster, fault_proxy, caplog) -> None:
    """Between the launcher and the real API server, the fault proxy answers 503 and 429 (with Retry-After) to the
    create, 500 to pod lists, and cuts two watches mid-stream; the kubelet ends two log streams early. The launch
    succeeds and every line of both workers' logs is shown once, in order."""
    caplog.set_level(logging.INFO)
    cluster = make_cluster(timeline=Timeline.success(workers=2, log_lines=LINES, tick_s=0.1))
    jobs, pods = f"/namespaces/{cluster.namespace}/pytorchjobs", f"/namespaces/{cluster.namespace}/pods"
    fault_proxy.fail_next("POST", f"{jobs}$", 503, times=2)
    fault_proxy.fail_next("POST", f"{jobs}$", 429, retry_after=1)
    fault_proxy.fail_next("GET", f"{pods}\\?", 500, times=2)
    fault_proxy.delay_next("GET", f"{pods}\\?", 1.0)  # a slow answer
    fault_proxy.cut_watch_after(1, times=2)  # the job changes 3 times here: Created, Running, Succeeded
    cluster.kubelet.cut_log_after(3, times=2)
    cfg = cluster_config(staged_root, "flaky", cluster.namespace, stream_logs="all")
    result = launch(cfg, cluster.runner(fault_proxy.url))
    kinds = [kind for kind, _, _ in fault_proxy.injected]
    assert result.state == "Succeeded"
    assert kinds.count("fail") == 5 and kinds.count("cut_watch") == 2 and kinds.count("delay") == 1, kinds
    assert [e["responseStatus"]["code"] for e in cluster.requests("create", "pytorchjobs")] == [201], (
        "the faults were the proxy's: the API server saw one create"
    )
    for worker in (0, 1):
        assert pod_lines(caplog, f"{result.job_name}-worker-{worker}") == LINES, "every line once, in order"


def test_an_expired_watch_reads_the_job_again(staged_root: Path, make_cluster, fault_proxy, caplog) -> None:
    """The watch is cut; while the launcher reconnects (slowly), the job changes and etcd compacts its history: the
    real API server answers the watch from the old resourceVersion with 410 Expired, and the launcher reads the job
    and watches from there."""
    caplog.set_level(logging.INFO)
    cluster = make_cluster(timeline=Timeline.success(workers=1, log_lines=LINES[:4], tick_s=0.5))
    fault_proxy.cut_watch_after(1)
    fault_proxy.delay_next("GET", "(?i)watch=true", 1.5)

    def change_and_compact() -> None:
        wait_for(lambda: any(kind == "cut_watch" for kind, _, _ in fault_proxy.injected), 30, "the cut")
        api = kubernetes.client.CustomObjectsApi(cluster.admin)
        for i in range(2):
            api.patch_namespaced_custom_object(
                "kubeflow.org",
                "v1",
                cluster.namespace,
                "pytorchjobs",
                name,
                {"metadata": {"annotations": {"test/touched": str(i)}}},
            )
        cluster.control_plane.compact()

    name = job_name("pipeline-gone", "gone")
    compaction = threading.Thread(target=change_and_compact, daemon=True)
    compaction.start()
    result = launch(cluster_config(staged_root, "gone", cluster.namespace, nnodes=1), cluster.runner(fault_proxy.url))
    compaction.join(timeout=10)
    assert result.state == "Succeeded" and "watch expired (410 Gone)" in caplog.text


def test_an_api_server_that_goes_away_fails_the_step_instead_of_hanging(
    staged_root: Path, make_cluster, fault_proxy
) -> None:
    cluster = make_cluster(timeline=Timeline.running(1))
    job = render_job(cluster_config(staged_root, "vanishing", cluster.namespace, nnodes=1).job_spec())
    kube = Kube(cluster.runner(fault_proxy.url), KubeSettings(attempts=2, backoff_s=0.05))
    outcome: list[BaseException] = []

    def launcher() -> None:
        try:
            run_job(kube, job, WatchSettings(logs="none"), threading.Event())
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=launcher, daemon=True)
    thread.start()
    wait_for(lambda: running(cluster.job(job["metadata"]["name"])), 30, "the job runs")
    fault_proxy.stop()  # the API server goes away for good, as far as the launcher can tell
    thread.join(timeout=60)
    assert not thread.is_alive(), "the launcher is still waiting on a server that is gone"
    assert isinstance(outcome[0], StepFailed) and "failed 2 times" in str(outcome[0])


@BOTH_APIS
def test_a_retried_step_reattaches_to_its_job(api: str, staged_root: Path, make_cluster, caplog) -> None:
    cluster = make_cluster(timeline=Timeline.success(workers=2, log_lines=LINES[:3]), api=api)
    cfg = cluster_config(staged_root, "retry", **on(cluster))
    first = launch(cfg, cluster.runner())
    second = launch(cfg, cluster.runner())  # the step again, as KFP retries it: the job is still there
    creates = [e["responseStatus"]["code"] for e in cluster.requests("create", cluster.api.plural)]
    assert second.job_name == first.job_name and second.reattached and second.state == "Succeeded"
    assert creates == [201, 409] and "re-attaching" in caplog.text


def test_a_different_job_under_the_same_name_is_refused(staged_root: Path, make_cluster) -> None:
    cluster = make_cluster()
    cluster.create_job(render_job(cluster_config(staged_root, "clash", cluster.namespace, max_steps=999).job_spec()))
    with pytest.raises(StepFailed, match="already exists with a different spec"):
        launch(cluster_config(staged_root, "clash", cluster.namespace), cluster.runner())
    assert deleted_jobs(cluster) == [], "someone else's job is left alone"


@BOTH_APIS
def test_the_deadline_deletes_the_job_and_the_garbage_collector_its_pods(
    api: str, staged_root: Path, make_cluster, garbage_collector
) -> None:
    """A PyTorchJob in the foreground: it goes once its pods have gone. A TrainJob in the background (Trainer v2.3.0
    would build a new JobSet for one still there without its JobSet): it goes first, its JobSet, Jobs and pods after."""
    cluster = make_cluster(timeline=Timeline.stuck_pending(), api=api)
    cfg = cluster_config(staged_root, "stuck", **on(cluster), timeout_s=2)
    with pytest.raises(StepFailed, match=r"did not finish within 2s .*Pending.*it was deleted"):
        launch(cfg, cluster.runner())
    assert [name for name, _ in deleted_jobs(cluster)] == [cfg.job_name]
    wait_for(
        lambda: cluster.job(cfg.job_name) is None and cluster.pods(cfg.job_name) == [],
        30,
        "the deletion finished: the job and its pods gone",
    )


def launcher_command(staged_root: Path, run_id: str, namespace: str, cluster: Any = None) -> list[str]:
    """The launch subcommand on the cluster (its job API and runtime as the compile flags give them)."""
    api = ["--job-api", cluster.api.name, "--runtime-name", cluster.runtime_name or DEFAULT_RUNTIME] if cluster else []
    return [
        sys.executable,
        "-m",
        "pipelines.cli",
        "launch",
        "--backend",
        "kubernetes",
        "--storage-root",
        str(staged_root),
        "--dataset",
        "synthetic",
        "--run-id",
        run_id,
        "--nnodes",
        "2",
        "--nproc-per-node",
        "8",
        "--image",
        "img:1",
        "--no-owner-reference",
        "--namespace",
        namespace,
        *api,
    ]


@BOTH_APIS
def test_sigterm_deletes_the_job_and_exits_within_5_s(
    api: str, staged_root: Path, make_cluster, tmp_path: Path
) -> None:
    """KFP terminates a run by signalling the step's process: the job must not outlive it."""
    cluster = make_cluster(timeline=Timeline.running(2), api=api)
    kubeconfig = cluster.control_plane.write_kubeconfig(tmp_path / "kubeconfig")
    env = {**os.environ, "KUBECONFIG": str(kubeconfig)}
    launcher = subprocess.Popen(
        launcher_command(staged_root, "cancel", cluster.namespace, cluster), env=env, stderr=subprocess.PIPE, text=True
    )
    name = job_name("cancel", "cancel")
    wait_for(lambda: running(cluster.job(name)), 60, "the job runs")
    signalled = time.monotonic()
    launcher.send_signal(signal.SIGTERM)
    _, stderr = launcher.communicate(timeout=30)
    exited = time.monotonic() - signalled
    assert exited < 5, f"the launcher took {exited:.1f}s to exit after SIGTERM"
    assert launcher.returncode == 1 and "deleted on SIGTERM" in stderr.strip().splitlines()[-1]
    assert f"SIGTERM: deleted {cluster.api.kind}" in stderr, "the signal handler itself sent the delete"
    assert {policy for _, policy in deleted_jobs(cluster)} == {cluster.api.propagation}


def test_sigterm_deletes_the_job_even_when_the_process_is_killed_right_after(
    staged_root: Path, make_cluster, tmp_path: Path
) -> None:
    """KFP signals the step's process group: its Go launcher dies at once, the container ends, and this process is
    killed moments later (reference/kfp_backend_support.md, "Terminate"). The delete must already be out by then."""
    cluster = make_cluster(timeline=Timeline.running(2))
    env = {**os.environ, "KUBECONFIG": str(cluster.control_plane.write_kubeconfig(tmp_path / "kubeconfig"))}
    launcher = subprocess.Popen(
        launcher_command(staged_root, "killed", cluster.namespace), env=env, stderr=subprocess.DEVNULL
    )
    name = job_name("killed", "killed")
    wait_for(lambda: running(cluster.job(name)), 60, "the job runs")
    launcher.send_signal(signal.SIGTERM)
    time.sleep(0.1)  # the container's end
    launcher.kill()
    launcher.wait(timeout=10)
    assert deleted_jobs(cluster)[:1] == [(name, "Foreground")]


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


# -- as a real cluster runs it: retries, evidence, elasticity, queues, volumes -----------------------------------


def back_after_auto_resume(comebacks: int) -> Timeline:
    """Running; worker-1's container exits 1 and restarts: with restart budget 0 that is the backoff limit, and the
    operator deletes the pods and fails the job. Each of the ``comebacks`` times the job is brought back (its pods
    created again) they run, and fail the same way, except the last time: then they succeed."""
    timeline = Timeline.started(2) + Timeline.lines(LINES[:1], [0, 1]) + Timeline.exits([1], 1)
    for comeback in range(1, comebacks + 1):
        timeline = timeline.then(0.1, lambda job: job.start_recreated(0, 1)) + Timeline.lines(LINES[1:2], [0, 1])
        timeline += Timeline.exits([1], 1) if comeback < comebacks else Timeline.exits([0, 1], 0)
    return timeline


def test_a_failed_job_that_auto_resume_brings_back_runs_to_success(staged_root: Path, make_cluster, caplog) -> None:
    """HyperPod's job auto-restart may update a PyTorchJob's status (its published grants); played as
    tests/cluster/hyperpod.py assumes, it drops the Failed condition a second after the operator wrote it, and the
    operator creates the pods again. The launcher watches a Failed auto-resume job before it fails the step (before:
    it failed the step at once, while the job went on)."""
    from tests.cluster.hyperpod import JobAutoRestart

    caplog.set_level(logging.INFO)
    cluster = make_cluster(timeline=back_after_auto_resume(comebacks=1))
    restarter = JobAutoRestart(cluster.admin, cluster.namespace, delay_s=1.0)
    try:
        cfg = cluster_config(
            staged_root,
            "auto-resumed",
            cluster.namespace,
            job_options={"restart_budget": 0, "auto_resume_max_retries": 1, "auto_resume_wait_s": 30},
        )
        result = launch(cfg, cluster.runner())
    finally:
        restarter.stop()
    assert result.state == "Succeeded" and restarter.retries == {cluster.job(cfg.job_name)["metadata"]["uid"]: 1}
    assert restarter.errors == []
    assert "failed; HyperPod auto-resume is on and may restart it" in caplog.text
    assert "is no longer Failed (Restarting): auto-resume brought it back" in caplog.text
    assert deleted_jobs(cluster) == []


def test_a_failed_job_that_auto_resume_leaves_failed_fails_the_step_after_the_wait(
    staged_root: Path, make_cluster
) -> None:
    cluster = make_cluster(timeline=back_after_auto_resume(comebacks=0))
    cfg = cluster_config(
        staged_root,
        "not-resumed",
        cluster.namespace,
        job_options={"restart_budget": 0, "auto_resume_max_retries": 1, "auto_resume_wait_s": 1},
    )
    started = time.monotonic()
    with pytest.raises(StepFailed, match=r"failed \(attempt 1\): PyTorchJobFailed: .* backoff limit"):
        launch(cfg, cluster.runner())
    assert time.monotonic() - started > 1 and deleted_jobs(cluster) == []


@BOTH_APIS
def test_a_retried_run_after_a_failed_job_trains_again(
    api: str, staged_root: Path, make_cluster, garbage_collector, caplog
) -> None:
    """KFP's run-level Retry keeps the run id, so the job name: the failed job is replaced, not re-reported. The
    foreground deletion of the failed job ends only when the garbage collector has removed its pods. A Failed TrainJob
    is deleted by the launch that saw it fail (Trainer v2.3.0 would run it again once its JobSet's TTL removed the
    JobSet), so the retry finds none and creates it anew, as attempt 1: the trainer's own attempt counts on."""
    caplog.set_level(logging.INFO)
    cluster = make_cluster(timeline=crash_until_failed(api, tick_s=0.2), api=api, restart_budget=1)
    cfg = cluster_config(staged_root, "retried", **on(cluster), job_options=restart_budget(api, 1))
    reason = "PyTorchJobFailed: Job .* backoff limit" if api == "pytorchjob" else "ReachedMaxRestarts"
    with pytest.raises(StepFailed, match=rf"failed \(attempt 1\): {reason}"):
        launch(cfg, cluster.runner())
    cluster.timeline = Timeline.success(workers=2, log_lines=LINES[:3])
    second = launch(cfg, cluster.runner())
    job = cluster.job(second.job_name)
    creates = [e["responseStatus"]["code"] for e in cluster.requests("create", cluster.api.plural)]
    assert deleted_jobs(cluster) == [(second.job_name, cluster.api.propagation)], "the failed job, once"
    if api == "trainjob":
        assert (second.state, second.attempt, second.reattached) == ("Succeeded", 1, False)
        assert creates == [201, 201], "the failed TrainJob was deleted when it failed: nothing in the way"
        return
    assert (second.state, second.attempt, second.reattached) == ("Succeeded", 2, False)
    assert job["metadata"]["annotations"]["hyperpod-pretrain.io/attempt"] == "2"
    assert creates == [201, 409, 201], "attempt 1; the 409 that found the failed job; attempt 2 once it was gone"
    assert "deleting it to train again as attempt 2" in caplog.text


def test_a_failed_trainjob_left_behind_is_replaced_once_its_jobset_and_pods_are_gone(
    staged_root: Path, make_cluster, garbage_collector
) -> None:
    """A launch killed before it deleted its Failed TrainJob: the retry deletes it (in the background: it goes at
    once) and waits for its JobSet and pods, which the garbage collector removes after it. A JobSet still there would
    be taken for the new TrainJob's (Trainer v2.3.0 applies none while one of the name runs, and copies its Failed)."""
    cluster = make_cluster(api="trainjob", timeline=Timeline.failure(), restart_budget=0)
    cfg = cluster_config(staged_root, "left-failed", **on(cluster))
    cluster.create_job(render_job(cfg.job_spec()))
    wait_for(lambda: cluster.api.is_failed(cluster.job(cfg.job_name) or {}), 30, "the TrainJob failed")
    cluster.timeline = Timeline.success(workers=2, log_lines=LINES[:2])
    result = launch(cfg, cluster.runner())
    assert (result.state, result.attempt, result.reattached) == ("Succeeded", 2, False)
    assert deleted_jobs(cluster) == [(cfg.job_name, "Background")]
    assert [e["responseStatus"]["code"] for e in cluster.requests("get", "jobsets")][-1:] == [404], "waited until gone"


@BOTH_APIS
def test_a_job_of_a_run_that_is_still_running_is_reattached_not_replaced(
    api: str, staged_root: Path, make_cluster
) -> None:
    cluster = make_cluster(
        timeline=Timeline.running(2).then(1.5, lambda job: [job.exit(i, 0) for i in (0, 1)]), api=api
    )
    cfg = cluster_config(staged_root, "still-running", **on(cluster))
    cluster.create_job(render_job(cfg.job_spec()))
    wait_for(lambda: running(cluster.job(cfg.job_name)), 30, "the job runs")
    result = launch(cfg, cluster.runner())
    assert (result.state, result.reattached, result.attempt) == ("Succeeded", True, 1) and deleted_jobs(cluster) == []


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
            logger.info("%s", step_line(step, 100, 5 - step / 10, 3e-3, 0.5, 20000, None, 60.0))
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
                f.write(
                    logging.Formatter(LOG_FORMAT.replace("{rank}", str(rank))).format(
                        logging.makeLogRecord(
                            {
                                "name": "trainer",
                                "levelname": "ERROR",
                                "levelno": logging.ERROR,
                                "msg": "training crashed: Connection reset by peer",
                            }
                        )
                    )
                    + "\n"
                )
    write_status(run, 0, "crashed", exit_code=1, step=30, error="RuntimeError('Connection reset by peer')")


@BOTH_APIS
def test_a_failed_job_whose_pods_were_deleted_still_names_the_trainers_last_lines(
    api: str, staged_copy: Path, make_cluster
) -> None:
    """Training Operator 1.8.1 deletes every pod at the backoff limit before it writes Failed; JobSet deletes a
    failed group's Jobs, and with them their pods, at each restart: the evidence comes from the trainer's own logs on
    the volume."""
    cluster = make_cluster(timeline=crash_until_failed(api, log_lines=["boom"], tick_s=0.05), api=api, restart_budget=1)
    cfg = cluster_config(staged_copy, "evidence", **on(cluster), job_options=restart_budget(api, 1))
    write_trainer_logs(cfg.run_paths, failing_rank=3)
    with pytest.raises(StepFailed) as failure:
        launch(cfg, cluster.runner())
    message = str(failure.value)
    limit = "backoff limit" if api == "pytorchjob" else "ReachedMaxRestarts: jobset failed due to reaching max number"
    assert limit in message and "trainer crashed at step 30" in message
    assert "rank 3, the first to log an error" in message
    assert "RuntimeError: CUDA error: an illegal memory access was encountered" in message


def test_an_elastic_job_running_on_its_minimum_with_pods_pending_succeeds(
    staged_root: Path, make_cluster, caplog
) -> None:
    """A 2:4 job runs on 2 nodes while 2 pods wait Pending for room, past the Pending deadline: that is elasticity,
    not a stuck job. The operator creates maxReplicas pods and calls an elastic job Succeeded when one worker
    succeeded (#1752). (It was once deleted as "never started: no pods made" once it ran longer than the deadline.)"""
    caplog.set_level(logging.INFO)
    timeline = Timeline.started(2, pending=2) + Timeline.lines(LINES[:6], [0, 1], 1.0) + Timeline.exits([0, 1])
    cluster = make_cluster(timeline=timeline)
    job = render_job(cluster_config(staged_root, "elastic", cluster.namespace, nnodes=2, max_nodes=4).job_spec())
    # the pods read at the launcher's own pace (every 10 s), not the other tests' 0.2 s
    settings = fast(pending_timeout_s=2.5, diagnose_every_s=DIAGNOSE_EVERY_S)
    outcome = run_job(Kube(cluster.runner()), job, settings, threading.Event())
    assert outcome.state == "Succeeded" and deleted_jobs(cluster) == []
    assert "Pending beyond the minimum of 2" in caplog.text
    assert not [f for f in outcome.diagnosis if f.startswith("Pod stuck in Pending")], outcome.diagnosis


@BOTH_APIS
def test_a_job_that_never_starts_is_deleted_at_the_pending_deadline(api: str, staged_root: Path, make_cluster) -> None:
    cluster = make_cluster(timeline=Timeline.stuck_pending(), api=api)
    job = render_job(cluster_config(staged_root, "never", **on(cluster)).job_spec())
    # 3 s: a TrainJob's pods come from JobSet's Jobs through the Job controller, and the scheduler's warning follows
    # them; under load 1 s could end before it was written (seen once in a clean-clone run)
    with pytest.raises(StepFailed, match=r"never started: pods Pending .* Insufficient nvidia.com/gpu"):
        run_job(Kube(cluster.runner()), job, fast(pending_timeout_s=3), threading.Event())
    assert [policy for _, policy in deleted_jobs(cluster)] == [cluster.api.propagation]


def test_a_job_that_gets_no_pod_at_all_fails_at_the_pending_deadline_with_the_operators_reason(
    staged_root: Path, make_cluster
) -> None:
    """A namespace whose ResourceQuota allows no pod: the operator's creates are refused (its FailedCreate events on
    the job), and with no pod to key it on, the Pending clock runs from the job's creation."""
    cluster = make_cluster(timeline=Timeline())
    core = kubernetes.client.CoreV1Api(cluster.admin)
    quota = {"metadata": {"name": "no-pods"}, "spec": {"hard": {"pods": "0"}}}
    core.create_namespaced_resource_quota(cluster.namespace, quota)
    # what kube-controller-manager's resourcequota controller (not run here) writes before admission enforces it
    status = {"status": {"hard": {"pods": "0"}, "used": {"pods": "0"}}}
    core.patch_namespaced_resource_quota_status("no-pods", cluster.namespace, status)
    job = render_job(cluster_config(staged_root, "no-pod", **on(cluster)).job_spec())
    with pytest.raises(StepFailed) as failed:
        run_job(
            Kube(cluster.runner()), job, fast(pending_timeout_s=3, diagnose_every_s=DIAGNOSE_EVERY_S), threading.Event()
        )
    message = str(failed.value)
    assert "never started: no pods made for" in message and "past the Pending deadline of 3s" in message
    assert "FailedCreate: Error creating: pods" in message and "exceeded quota: no-pods" in message, message
    assert cluster.pods(job["metadata"]["name"]) == []


@BOTH_APIS
def test_a_lost_node_gets_the_recovery_deadline(api: str, staged_root: Path, make_cluster) -> None:
    """After the job ran, its pod on a lost node is deleted and its operator makes it again, Pending (no node yet):
    held to the recovery deadline, not the (shorter) Pending one. A PyTorchJob's operator recreates the one pod; a
    TrainJob's Job counts the deleted pod as failed (backoffLimit 0), and JobSet recreates the whole group."""

    def lose_node(job: Any) -> None:
        kubernetes.client.CoreV1Api(job.cluster.admin).delete_namespaced_pod(job.pod(1), job.cluster.namespace)

    timeline = Timeline.running(2).then(0.5, lose_node).then(0.5, lambda job: job.unschedulable(1, "no node"))
    cluster = make_cluster(timeline=timeline, api=api)
    job = render_job(cluster_config(staged_root, "lost-node", **on(cluster)).job_spec())
    started = time.monotonic()
    with pytest.raises(StepFailed, match=r"fewer than its minimum of 2 pod\(s\) for \d+s .* recovery deadline"):
        run_job(Kube(cluster.runner()), job, fast(pending_timeout_s=2, recovery_timeout_s=4), threading.Event())
    assert time.monotonic() - started > 4


def test_a_pod_stuck_terminating_on_a_lost_node_counts_as_lost(staged_root: Path, make_cluster) -> None:
    """A node that went away took its kubelet: its pod, once deleted, stays Terminating (and Running) for ever, and
    the operator makes no new one until it is gone. That is a lost node: the recovery deadline runs."""

    def lose_node(job: Any) -> None:
        job.cluster.kubelet.lose_node(job.pod(1))
        kubernetes.client.CoreV1Api(job.cluster.admin).delete_namespaced_pod(job.pod(1), job.cluster.namespace)

    cluster = make_cluster(timeline=Timeline.running(2).then(0.5, lose_node))
    job = render_job(cluster_config(staged_root, "stuck", cluster.namespace).job_spec())
    with pytest.raises(StepFailed, match=r"fewer than its minimum of 2 pod\(s\) for \d+s .* recovery deadline"):
        run_job(Kube(cluster.runner()), job, fast(recovery_timeout_s=2), threading.Event())
    stuck = [p for p in cluster.pods(job["metadata"]["name"]) if p["metadata"]["name"].endswith("worker-1")]
    assert stuck and stuck[0]["metadata"].get("deletionTimestamp"), "still Terminating"


@BOTH_APIS
def test_a_queued_job_is_reported_and_not_deleted_by_the_pending_deadline(
    api: str, staged_root: Path, make_cluster, caplog
) -> None:
    """HyperPod task governance (Kueue) creates the job suspended and admits it later: waiting in the queue is not
    being stuck in Pending."""
    caplog.set_level(logging.INFO)
    cluster = make_cluster(timeline=Timeline.queued(admit_after_s=3.5, log_lines=LINES[:2]), api=api)
    cfg = cluster_config(
        staged_root,
        "queued",
        **on(cluster, queue_name="hyperpod-ns-team-a-localqueue", priority_class="training-priority"),
    )
    job = render_job(cfg.job_spec())
    assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "hyperpod-ns-team-a-localqueue"
    assert job["metadata"]["labels"]["kueue.x-k8s.io/priority-class"] == "training-priority"
    outcome = run_job(Kube(cluster.runner()), job, fast(pending_timeout_s=2.5), threading.Event())
    stored = cluster.job(cfg.job_name)
    assert outcome.state == "Succeeded" and deleted_jobs(cluster) == []
    assert f"{cluster.namespace}/{cfg.job_name}" in cluster.kueue.suspended_at_create, "Kueue's webhook held it"
    assert "is queued: suspended until the cluster's queue (Kueue) admits it" in caplog.text
    assert re.search(r"was admitted after \d+s in the queue", caplog.text)
    if api == "pytorchjob":
        assert stored["spec"]["runPolicy"]["suspend"] is False
        template = stored["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]
        assert template["metadata"]["labels"]["kueue.x-k8s.io/podset"] == "worker", "Kueue's pod-set labels"
    else:  # Kueue's trainjob integration writes its admission as a runtime patch of its own (kueue.x-k8s.io/manager)
        assert stored["spec"]["suspend"] is False
        patch = next(p for p in stored["spec"]["runtimePatches"] if p["manager"] == "kueue.x-k8s.io/manager")
        (node,) = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
        assert node["template"]["spec"]["template"]["metadata"]["labels"]["kueue.x-k8s.io/podset"] == "node"


@BOTH_APIS
def test_a_job_preempted_by_kueue_and_admitted_again_is_not_taken_for_a_lost_node(
    api: str, staged_root: Path, make_cluster, caplog
) -> None:
    """HyperPod task governance preempts the running job for a higher-priority team (suspend: the operator deletes
    its pods, Suspended True, Running False) and admits it again later; its new pods wait for the scheduler. Queue
    time is not time below the minimum of pods: the recovery deadline (shorter than the queue wait) must not fire."""
    caplog.set_level(logging.INFO)
    cluster = make_cluster(timeline=Timeline.preempted(queued_s=3.0, pending_s=2.0, log_lines=LINES[:3]), api=api)
    cfg = cluster_config(staged_root, "preempted", **on(cluster, queue_name="team-a"))
    job = render_job(cfg.job_spec())
    outcome = run_job(Kube(cluster.runner()), job, fast(pending_timeout_s=6, recovery_timeout_s=1.5), threading.Event())
    conditions = {c["type"]: c for c in outcome.conditions}
    assert outcome.state == "Succeeded" and deleted_jobs(cluster) == []
    resumed = "PyTorchJobResumed" if api == "pytorchjob" else "Resumed"  # TrainJobResumedReason (v2.3.0)
    assert conditions["Suspended"]["status"] == "False" and conditions["Suspended"]["reason"] == resumed
    assert len(re.findall(r"was admitted after \d+s in the queue", caplog.text)) == 2, "admitted, then re-admitted"


@BOTH_APIS
def test_the_queue_deadline_is_its_own(api: str, staged_root: Path, make_cluster) -> None:
    cluster = make_cluster(api=api)
    job = render_job(cluster_config(staged_root, "queued-long", **on(cluster, queue_name="q")).job_spec())
    with pytest.raises(StepFailed, match=r"queued \(suspended, not admitted\) for \d+s, past the queue deadline"):
        run_job(Kube(cluster.runner()), job, fast(pending_timeout_s=1.2, queue_timeout_s=1), threading.Event())
    assert len(deleted_jobs(cluster)) == 1


def test_a_log_stream_that_falls_silent_is_reopened(staged_root: Path, make_cluster, caplog) -> None:
    """A stream from a lost node sends nothing and never closes: the read timeout reopens it, nothing repeats."""
    caplog.set_level(logging.INFO)
    cluster = make_cluster(timeline=Timeline.success(workers=2, log_lines=LINES, tick_s=0.15))
    cluster.kubelet.stall_log_after(3)
    job = render_job(cluster_config(staged_root, "silent", cluster.namespace).job_spec())
    outcome = run_job(Kube(cluster.runner()), job, fast(log_read_timeout_s=0.5), threading.Event())
    assert outcome.state == "Succeeded"
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


def test_after_a_kueue_resume_the_operators_deadline_waits_for_the_jobs_next_change(
    staged_root: Path, make_cluster
) -> None:
    """Why cancel layer 3 is not enough alone after a preemption (docs/launcher.md, "Cancelling in detail"): on
    resume 1.8.1 sets startTime anew and queues no deadline timer (the one it queued at the first start fires, finds
    the new startTime not yet past, and none follows), so the job runs past activeDeadlineSeconds until something
    about it changes."""
    timeline = (
        Timeline([(0.05, lambda job: job.admit())])
        + Timeline.started(2)
        + Timeline(
            [(0.1, lambda job: job.preempt()), (0.3, lambda job: job.admit()), (0.3, lambda job: job.start(0, 1))]
        )
    )
    cluster = make_cluster(timeline=timeline)
    spec = cluster_config(
        staged_root, "resumed-deadline", cluster.namespace, platform=Platform(queue_name="team-a")
    ).job_spec()
    spec.active_deadline_s = 2
    name = cluster.create_job(render_job(spec))["metadata"]["name"]

    def resumed_and_running() -> bool:
        conditions = {c["type"]: c for c in (cluster.job(name) or {}).get("status", {}).get("conditions", [])}
        resumed = conditions.get("Suspended", {}).get("reason") == "PyTorchJobResumed"
        return resumed and running(cluster.job(name)) and len(cluster.pods(name)) == 2

    wait_for(resumed_and_running, 30, "preempted, admitted again and running")
    time.sleep(4)  # twice the deadline after the resume, and past the first start's timer
    assert running(cluster.job(name)), "no deadline without a change"
    core = kubernetes.client.CoreV1Api(cluster.admin)
    core.patch_namespaced_pod(f"{name}-worker-1", cluster.namespace, {"metadata": {"labels": {"touched": "1"}}})
    wait_for(
        lambda: "active longer than specified deadline" in json.dumps(cluster.job(name)["status"]),
        10,
        "the next change reconciles the job past its deadline",
    )


@BOTH_APIS
def test_a_terminated_runs_job_is_deleted_by_the_exit_step(
    api: str, staged_root: Path, make_cluster, tmp_path: Path
) -> None:
    """KFP runs the exit step after a terminate; the launcher may have died (SIGKILL) before it deleted anything.
    The exit step sees the launcher's record still "running" and deletes the job; the owner reference would wait for
    the launcher's pod object, which KFP keeps for a day."""
    cluster = make_cluster(timeline=Timeline.running(2), api=api)
    root = tmp_path / "fsx"
    shutil.copytree(staged_root, root)
    pipeline_run = "6d1c2b3a-0000-4000-8000-00000000abcd"
    # The launcher step as its component runs it: recorded_step around launch (components/launch_training).
    script = (
        "import sys\n"
        "from components.run_summary.core import recorded_step\n"
        "from pipelines.cli import main\n"
        f"with recorded_step({str(root)!r}, 'killed-run', 'launch-pytorchjob', {{}}):\n"
        "    main(sys.argv[1:])\n"
    )
    command = [
        sys.executable,
        "-c",
        script,
        *launcher_command(root, "killed-run", cluster.namespace, cluster)[3:],
        "--pipeline-run-id",
        pipeline_run,
    ]
    env = {**os.environ, "KUBECONFIG": str(cluster.control_plane.write_kubeconfig(tmp_path / "kubeconfig"))}
    launcher = subprocess.Popen(command, env=env, stderr=subprocess.DEVNULL)
    name = job_name(pipeline_run, "killed-run")
    wait_for(lambda: running(cluster.job(name)), 60, "the job runs")
    launcher.kill()  # outright: no handler runs
    launcher.wait(timeout=10)
    assert deleted_jobs(cluster) == [] and running(cluster.job(name))
    cleanup = job_cleanup("kubernetes", cluster.namespace, "killed-run", pipeline_run, api, cluster.runner())
    summary = summarize_run(str(root), "killed-run", pipeline_run, "RUNNING", cleanup=cleanup)
    deletions = deleted_jobs(cluster)
    other = job_cleanup("kubernetes", cluster.namespace, "killed-run", "another-pipeline-run", api, cluster.runner())()
    assert summary.state == "TERMINATED" and summary.cleanup.endswith("was still running after the run ended: deleted")
    assert deletions == [(name, cluster.api.propagation)]
    assert other.startswith(f"no {cluster.api.kind}") or "another pipeline run" in other or "being deleted" in other


@BOTH_APIS
def test_the_exit_step_leaves_a_finished_job_and_someone_elses_alone(api: str, staged_root: Path, make_cluster) -> None:
    cluster = make_cluster(timeline=Timeline.success(workers=2, log_lines=LINES[:2]), api=api)
    cfg = cluster_config(staged_root, "finished", **on(cluster))
    launch(cfg, cluster.runner())
    done = job_cleanup("kubernetes", cluster.namespace, cfg.run_id, cfg.pipeline_run_id, api, cluster.runner())()
    cluster.create_job(render_job(cluster_config(staged_root, "theirs", **on(cluster), pipeline_run_id="").job_spec()))
    theirs = job_cleanup("kubernetes", cluster.namespace, "theirs", "", api, cluster.runner())()
    assert "had already finished: left for its logs" in done
    assert "belongs to another pipeline run: left alone" in theirs and deleted_jobs(cluster) == []


def test_the_exit_step_deletes_a_failed_trainjob_left_behind(staged_root: Path, make_cluster) -> None:
    """A launch killed before it deleted its Failed TrainJob: the exit step deletes it, since Trainer v2.3.0 would run
    it again once its JobSet's TTL removed the JobSet (a failed PyTorchJob stays for its logs)."""
    cluster = make_cluster(api="trainjob", timeline=Timeline.failure(), restart_budget=0)
    cfg = cluster_config(staged_root, "exit-failed", **on(cluster))
    cluster.create_job(render_job(cfg.job_spec()))
    wait_for(lambda: cluster.api.is_failed(cluster.job(cfg.job_name) or {}), 30, "the TrainJob failed")
    done = job_cleanup("kubernetes", cluster.namespace, cfg.run_id, cfg.pipeline_run_id, "trainjob", cluster.runner())()
    assert done.endswith("had failed: deleted, so that its operator does not run it again")
    assert deleted_jobs(cluster) == [(cfg.job_name, "Background")] and cluster.job(cfg.job_name) is None


def test_a_delete_for_a_job_since_replaced_under_its_name_deletes_nothing(staged_root: Path, make_cluster) -> None:
    """Every delete of the launcher and the exit step names the uid it knows (cancel.delete_job). When someone else's
    job holds the name by then, the API server answers 409 (apiserver's registry Store.Delete, "Precondition failed:
    UID in precondition") and the job stays."""
    from components.launch_training.cancel import delete_job
    from components.launch_training.pytorchjob import PYTORCHJOB

    cluster = make_cluster()
    job = render_job(cluster_config(staged_root, "replaced", cluster.namespace).job_spec())
    name = job["metadata"]["name"]
    stale_uid = cluster.create_job(job)["metadata"]["uid"]
    api = kubernetes.client.CustomObjectsApi(cluster.admin)
    api.delete_namespaced_custom_object("kubeflow.org", "v1", cluster.namespace, "pytorchjobs", name)
    wait_for(lambda: cluster.job(name) is None, 30, "the first job is gone")
    current_uid = cluster.create_job(job)["metadata"]["uid"]
    delete_job(Kube(cluster.runner()), PYTORCHJOB, cluster.namespace, name, stale_uid)
    assert (cluster.job(name) or {}).get("metadata", {}).get("uid") == current_uid
    answers = [e["responseStatus"]["code"] for e in cluster.requests("delete", "pytorchjobs")]
    assert answers == [409]


def rank_logs(run: RunPaths, world: int, steps: tuple[int, ...]) -> None:
    """Each rank's log as the trainer writes it (its LOG_FORMAT), up to the last of `steps`."""
    run.logs.mkdir(parents=True, exist_ok=True)
    for rank in range(world):
        with open(run.rank_log(rank), "a") as f:
            for step in steps:  # train_ddp's step line: its record, with the line trainer.metrics.step_line makes
                line = step_line(step, steps[-1], 5 - step / 10, 3e-3, 0.5, 20000, None, 1.0 * (steps[-1] - step))
                record = logging.makeLogRecord(
                    {"name": "trainer", "levelname": "INFO", "levelno": logging.INFO, "msg": "%s", "args": (line,)}
                )
                f.write(logging.Formatter(LOG_FORMAT.replace("{rank}", str(rank))).format(record) + "\n")


def restarted_again_and_again(api: str, exit_code: int, times: int, tick_s: float, log_lines: list[str]) -> Timeline:
    """Worker 1 exits `exit_code` each time it starts, `times` times: a PyTorchJob's container restarts in place
    (OnFailure, crash_loop); a TrainJob's group is recreated by JobSet each time (its runtime's maxRestarts)."""
    if api == "pytorchjob":
        return Timeline.crash_loop(workers=2, exit_code=exit_code, crashes=times, tick_s=tick_s, log_lines=log_lines)
    timeline = Timeline.started(2, tick_s)
    for _ in range(times):
        timeline += Timeline.lines(log_lines, [1], tick_s) + Timeline.exits([1], exit_code, tick_s)
        timeline = timeline.then(tick_s, lambda job: job.start_recreated(0, 1))
    return timeline


@BOTH_APIS
def test_a_diverged_trainer_ends_its_job_instead_of_restarting_it(api: str, staged_root: Path, make_cluster) -> None:
    """The trainer writes status.json "diverged" (trainer/health.py's line) and exits 3; a PyTorchJob's container is
    restarted in place (OnFailure), a TrainJob's group recreated by JobSet, again and again. The launcher reads the
    status on the volume and deletes the job before the operator's restart budget (or HyperPod auto-resume) gets a
    say."""
    from trainer.health import Divergence
    from trainer.preemption import ExitCode

    root = staged_root.parent / f"diverged-k8s-{api}"
    shutil.copytree(staged_root, root, symlinks=True, dirs_exist_ok=True)
    divergence = Divergence(limit=3)
    for step in range(25, 29):
        divergence.record(step, finite=False)
    run = cluster_config(root, "diverged").run_paths

    def diverge(job: Any) -> None:
        rank_logs(run, 2, (10, 20))
        write_status(run, 0, "diverged", step=25, exit_code=ExitCode.DIVERGED, error=divergence.reason())

    loop = restarted_again_and_again(api, int(ExitCode.DIVERGED), 40, 0.5, ["diverged"])
    cluster = make_cluster(
        timeline=Timeline([*loop.steps[:1], (0.1, diverge), *loop.steps[1:]]), api=api, restart_budget=50
    )
    cfg = cluster_config(root, "diverged", **on(cluster), job_options=restart_budget(api, 50))
    with pytest.raises(StepFailed) as failure:
        launch(cfg, cluster.runner())
    message = str(failure.value)
    assert "was stopped, not restarted: diverged at step 25: the loss or gradient norm" in message
    assert "it was deleted" in message and "backoff" not in message and "MaxRestarts" not in message
    assert deleted_jobs(cluster)


@BOTH_APIS
def test_a_job_whose_step_stops_advancing_is_deleted_with_every_ranks_last_lines(
    api: str, staged_root: Path, make_cluster
) -> None:
    root = staged_root.parent / f"stalled-k8s-{api}"
    shutil.copytree(staged_root, root, symlinks=True, dirs_exist_ok=True)
    run = cluster_config(root, "stalled").run_paths

    def three_steps_then_nothing(job: Any) -> None:
        rank_logs(run, 2, (1, 2, 3))
        write_status(run, 0, "running", step=3, world_size=16, attempt=1)

    timeline = Timeline.started(2).then(0.1, three_steps_then_nothing) + Timeline.lines(
        [f"line {i}" for i in range(60)], [0, 1], tick_s=0.5
    )
    cluster = make_cluster(timeline=timeline, api=api)
    with pytest.raises(StepFailed) as failure:
        launch(cluster_config(root, "stalled", **on(cluster), stall_timeout_s=2), cluster.runner())
    message = str(failure.value)
    assert "stalled: no training step completed for" in message and "after step 3" in message
    assert "[rank 0] INFO trainer: step 3/3  loss" in message and "[rank 1] INFO trainer: step 3/3  loss" in message
    assert deleted_jobs(cluster)
