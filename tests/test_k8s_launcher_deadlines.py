"""The launcher's deadlines, on the real control plane (tests/cluster/; what the launcher's tests share:
tests/launcher_helpers.py): the run's (the job deleted, its pods after), the Pending one (a job that never starts, or
gets no pod), the recovery one (a lost node), the queue's own, the operator's activeDeadlineSeconds; and what none of
them holds against (an elastic job on its minimum, a job waiting in Kueue's queue or preempted and admitted again)."""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from pathlib import Path
from typing import Any

import kubernetes
import pytest

from common.errors import StepFailed
from components.kube import Kube
from components.launch_training.apis import api_of
from components.launch_training.config import OPERATOR_DEADLINE_MARGIN_S
from components.launch_training.core import launch
from components.launch_training.deadlines import Deadlines
from components.launch_training.follow import run_job
from components.launch_training.manifest import render_job
from components.launch_training.platform import Platform
from components.launch_training.watch_settings import DIAGNOSE_EVERY_S
from tests.cluster.timelines import Timeline
from tests.launcher_helpers import (
    ALL_APIS,
    BOTH_APIS,
    LINES,
    cluster_config,
    deleted_jobs,
    fast,
    on,
    running,
    wait_for,
)


@ALL_APIS
def test_the_deadline_deletes_the_job_and_the_garbage_collector_its_pods(
    api: str, staged_root: Path, make_cluster, garbage_collector
) -> None:
    """A PyTorchJob (or a HyperPodPyTorchJob) in the foreground: it goes once its pods have gone. A TrainJob in the
    background (Trainer v2.3.0 would build a new JobSet for one still there without its JobSet): it goes first, its
    JobSet, Jobs and pods after."""
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


@ALL_APIS
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
    if api == "hyperpodpytorchjob":  # admitted through runPolicy.suspend (tests/cluster/kueue.py)
        assert stored["spec"]["runPolicy"]["suspend"] is False
    elif api == "pytorchjob":
        assert stored["spec"]["runPolicy"]["suspend"] is False
        template = stored["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]
        assert template["metadata"]["labels"]["kueue.x-k8s.io/podset"] == "worker", "Kueue's pod-set labels"
    else:  # Kueue's trainjob integration writes its admission as a runtime patch of its own (kueue.x-k8s.io/manager)
        assert stored["spec"]["suspend"] is False
        patch = next(p for p in stored["spec"]["runtimePatches"] if p["manager"] == "kueue.x-k8s.io/manager")
        (node,) = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
        assert node["template"]["spec"]["template"]["metadata"]["labels"]["kueue.x-k8s.io/podset"] == "node"


@ALL_APIS
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
    if api == "hyperpodpytorchjob":  # no Suspended condition is published: its pods went, Running turned False
        assert "Suspended" not in conditions and cluster.job(cfg.job_name)["spec"]["runPolicy"]["suspend"] is False
    else:
        resumed = "PyTorchJobResumed" if api == "pytorchjob" else "Resumed"  # TrainJobResumedReason (v2.3.0)
        assert conditions["Suspended"]["status"] == "False" and conditions["Suspended"]["reason"] == resumed
    assert len(re.findall(r"was admitted after \d+s in the queue", caplog.text)) == 2, "admitted, then re-admitted"


@ALL_APIS
def test_an_admitted_job_is_not_queued_again_by_its_operators_late_suspended_condition(
    api: str, staged_root: Path, caplog
) -> None:
    """Kueue admits by clearing the spec's suspend; the operator's Suspended condition follows a reconcile later,
    and a reconcile of the object as cached before the admission writes it True after it (seen here on a loaded
    machine, the test above counting three admissions). The spec is the one reading (JobApi.is_suspended)."""
    caplog.set_level(logging.INFO)
    job = render_job(cluster_config(staged_root, "late", platform=Platform(job_api=api)).job_spec())
    policy = job["spec"] if api == "trainjob" else job["spec"]["runPolicy"]
    deadlines = Deadlines(min_pods=2, api=api_of(job))
    for suspend, condition in ((True, None), (False, None), (False, "True"), (False, "False")):
        policy["suspend"] = suspend
        job["status"] = {"conditions": [{"type": "Suspended", "status": condition}] if condition else []}
        deadlines.job_changed(job)
        assert deadlines.queued is suspend
    assert len(re.findall(r"was admitted after \d+s in the queue", caplog.text)) == 1


@BOTH_APIS
def test_the_queue_deadline_is_its_own(api: str, staged_root: Path, make_cluster) -> None:
    cluster = make_cluster(api=api)
    job = render_job(cluster_config(staged_root, "queued-long", **on(cluster, queue_name="q")).job_spec())
    with pytest.raises(StepFailed, match=r"queued \(suspended, not admitted\) for \d+s, past the queue deadline"):
        run_job(Kube(cluster.runner()), job, fast(pending_timeout_s=1.2, queue_timeout_s=1), threading.Event())
    assert len(deleted_jobs(cluster)) == 1


def test_the_training_deadline_reaches_the_operator(staged_root: Path) -> None:
    """runPolicy.activeDeadlineSeconds backs the launcher's deadline up when the launcher is gone."""
    policy = render_job(cluster_config(staged_root, "deadline", timeout_s=3600).job_spec())["spec"]["runPolicy"]
    assert policy["activeDeadlineSeconds"] == 3600 + OPERATOR_DEADLINE_MARGIN_S
    unbounded = render_job(cluster_config(staged_root, "deadline", timeout_s=0).job_spec())["spec"]["runPolicy"]
    assert "activeDeadlineSeconds" not in unbounded


def test_the_hyperpod_operators_deadline_fails_the_job_and_the_step_says_so(staged_root: Path, make_cluster) -> None:
    """A HyperPodPyTorchJob past its runPolicy.activeDeadlineSeconds (the launcher's deadline plus a margin: the one
    that holds when the launcher is gone): its operator deletes its pods and fails it, and a launcher still there
    fails the step with the operator's reason (tests/cluster/hyperpod_training_operator.py)."""
    cluster = make_cluster(timeline=Timeline.running(2), api="hyperpodpytorchjob")
    spec = cluster_config(staged_root, "hp-deadline", **on(cluster)).job_spec()
    spec.active_deadline_s = 2
    job = render_job(spec)
    with pytest.raises(StepFailed, match=r"failed \(attempt 1\): DeadlineExceeded: .* activeDeadlineSeconds"):
        run_job(Kube(cluster.runner()), job, fast(), threading.Event())
    wait_for(lambda: cluster.pods(spec.name) == [], 10, "the operator deleted the pods")
    assert deleted_jobs(cluster) == [], "the operator failed it; a failed job stays for its logs"


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
