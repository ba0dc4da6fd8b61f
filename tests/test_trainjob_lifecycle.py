"""TrainJobs as the released controllers run them, where they are unkind (tests/cluster/: Kueue v0.19.2, JobSet v0.12.0,
Kubeflow Trainer v2.3.0 played on the real API server and Job controller):

- Kueue writes an admitted TrainJob back through Trainer v2.2.1's types (a runtime patch's grace period dropped), and
  JobSet's webhook then refuses Trainer's re-apply of the suspended JobSet: the TrainJob never gets a pod.
- JobSet's ttlSecondsAfterFinished removes a Failed TrainJob's JobSet, and Trainer v2.3.0 builds a new one: the run
  trains again, unattended.
- Trainer v2.3.0 reconciles a TrainJob that is being deleted: a foreground delete lets it build a new JobSet.

Each test here failed on the launcher before it deleted TrainJobs in the background, deleted Failed ones, refused a
queued TrainJob's grace period that is not its runtime's and kept its Pending clock without pods.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import kubernetes
import pytest

from common.errors import InputError, StepFailed
from components.kube import Kube
from components.launch_pytorchjob.cancel import Cancelled
from components.launch_pytorchjob.core import launch
from components.launch_pytorchjob.k8s_backend import run_job
from components.launch_pytorchjob.manifest import render_job
from tests.cluster import jobset as jobset_player
from tests.cluster.timelines import Timeline
from tests.test_k8s_launcher import cluster_config, deleted_jobs, fast, on, running, wait_for

QUEUE = "hyperpod-ns-team-a-localqueue"


def jobsets(cluster: Any, name: str) -> list[dict[str, Any]]:
    """The JobSets of the namespace named `name` (as the admin)."""
    found = json.loads(cluster.custom.list_namespaced_custom_object(
        jobset_player.GROUP, jobset_player.VERSION, cluster.namespace, jobset_player.PLURAL,
        _preload_content=False).data)["items"]  # fmt: skip
    return [j for j in found if j["metadata"]["name"] == name]


def uids(objects: list[dict[str, Any]]) -> set[str]:
    return {o["metadata"]["uid"] for o in objects}


def test_a_queued_trainjob_whose_grace_period_is_not_the_runtimes_is_refused_before_anything_is_created(
    staged_root: Path, make_cluster
) -> None:
    """Kueue v0.19.2 would drop the grace period at admission and JobSet's webhook refuse the runtime's: refused in
    one line, naming both values and what to change, with nothing sent to the cluster."""
    cluster = make_cluster(api="trainjob", timeline=Timeline.queued(admit_after_s=0.3))
    cfg = cluster_config(staged_root, "grace", **on(cluster, queue_name=QUEUE), job_options={"grace_period_s": 300},
                         timeout_s=15)  # fmt: skip
    with pytest.raises(InputError) as refused:
        launch(cfg, cluster.runner())
    message = str(refused.value)
    assert "\n" not in message and "grace_period_s 300 is not ClusterTrainingRuntime" in message
    assert "run with job option grace_period_s=120" in message and "--grace-period-s 300" in message
    assert cluster.requests("create", "trainjobs") == [] and cluster.job(cfg.job_name) is None


def test_an_admitted_trainjob_that_gets_no_pods_fails_at_the_pending_deadline_with_the_operators_reason(
    staged_root: Path, make_cluster
) -> None:
    """A TrainJob whose grace period was patched in (the runtime not readable at launch) under Kueue v0.19.2: admitted,
    Resumed, and never a JobSet the webhook accepts. The Pending clock runs from the admission, with no pod to key it
    on, and the step fails with Trainer's event. (Before: no Pending pod, no clock: the launch waited for ever.)"""
    cluster = make_cluster(api="trainjob", timeline=Timeline([(0.3, lambda job: job.admit())]))
    cfg = cluster_config(staged_root, "no-pods", **on(cluster, queue_name=QUEUE), job_options={"grace_period_s": 300})
    job = render_job(cfg.job_spec())  # the runtime's grace period unknown: the run's is patched in
    cancel = threading.Event()
    never = threading.Timer(30, cancel.set)  # the old launcher never gave up
    never.start()
    try:
        with pytest.raises(StepFailed) as failed:
            run_job(Kube(cluster.runner()), job, fast(pending_timeout_s=4), cancel)
    finally:
        never.cancel()
    message = str(failed.value)
    assert not isinstance(failed.value, Cancelled), "the launch waited past the Pending deadline"
    assert "never started: no pods made for" in message and "past the Pending deadline of 4s" in message
    assert "TrainJobResourcesCreationFailed" in message and "field is immutable" in message
    assert cluster.pods(cfg.job_name) == []
    assert deleted_jobs(cluster) == [(cfg.job_name, "Background")]


def test_a_failed_trainjob_is_deleted_and_does_not_train_again_after_its_jobsets_ttl(
    staged_root: Path, make_cluster
) -> None:
    """Trainer v2.3.0 clears Failed before it asks whether the TrainJob finished: once JobSet's TTL removed the JobSet
    it builds a new one (trainer#3779). The launcher reads why it failed, then deletes it."""
    cluster = make_cluster(api="trainjob", timeline=Timeline.failure(), restart_budget=0,
                           runtime_options={"ttl_after_finished_s": 1})  # fmt: skip
    cfg = cluster_config(staged_root, "failed-ttl", **on(cluster))
    with pytest.raises(StepFailed, match=r"failed \(attempt 1\): ReachedMaxRestarts") as failed:
        launch(cfg, cluster.runner())
    first = uids(jobsets(cluster, cfg.job_name))
    time.sleep(4)  # the TTL (1 s; condition times have whole seconds) and a reconcile of Trainer's after it
    assert uids(jobsets(cluster, cfg.job_name)) <= first, "a new JobSet: the run trained again"
    assert cluster.job(cfg.job_name) is None
    assert "the TrainJob was deleted, so that Kubeflow Trainer does not run it again" in str(failed.value)
    wait_for(lambda: cluster.pods(cfg.job_name) == [] and jobsets(cluster, cfg.job_name) == [], 30,
             "the JobSet and its pods collected")  # fmt: skip


def test_no_pod_and_no_jobset_is_made_after_a_cancel_returned_over_ten_cancels(staged_root: Path,
                                                                                make_cluster) -> None:  # fmt: skip
    """SIGTERM's delete (the loop's, here) while the TrainJob runs, ten times: Trainer v2.3.0 reconciles a TrainJob
    that still exists without its JobSet, so a foreground delete (the JobSet removed first, the TrainJob held by its
    finalizer) let it build another. In the background the TrainJob goes first, and nothing of it is made again."""
    cluster = make_cluster(api="trainjob", timeline=Timeline.running(2))
    core = kubernetes.client.CoreV1Api(cluster.admin)
    made_after: list[str] = []
    names: list[str] = []
    for attempt in range(10):
        cfg = cluster_config(staged_root, f"cancel-{attempt}", **on(cluster))
        names.append(cfg.job_name)
        job = render_job(cfg.job_spec())
        cancel = threading.Event()
        outcome: list[BaseException] = []

        def launcher(job: dict[str, Any] = job, cancel: threading.Event = cancel,
                     outcome: list[BaseException] = outcome) -> None:  # fmt: skip
            try:
                run_job(Kube(cluster.runner()), job, fast(logs="none"), cancel)
            except BaseException as exc:  # noqa: BLE001 (asserted below)
                outcome.append(exc)

        thread = threading.Thread(target=launcher)
        thread.start()
        wait_for(lambda name=cfg.job_name: running(cluster.job(name)), 30, "the TrainJob runs")
        cancel.set()
        thread.join(30)
        assert len(outcome) == 1 and isinstance(outcome[0], Cancelled), outcome
        seen_sets, seen_pods = uids(jobsets(cluster, cfg.job_name)), uids(cluster.pods(cfg.job_name))
        until = time.monotonic() + 30
        while time.monotonic() < until:
            sets, pods = jobsets(cluster, cfg.job_name), cluster.pods(cfg.job_name)
            made_after += [f"{cfg.job_name}: JobSet {u}" for u in uids(sets) - seen_sets]
            made_after += [f"{cfg.job_name}: pod {u}" for u in uids(pods) - seen_pods]
            seen_sets |= uids(sets)
            seen_pods |= uids(pods)
            if cluster.job(cfg.job_name) is None and not sets and not pods:
                break
            time.sleep(0.05)
        else:
            raise AssertionError(f"{cfg.job_name}: not collected within 30 s")
    time.sleep(1)  # a late reconcile of Trainer's, for any of them
    made_after += [f"{n}: JobSet {u} (late)" for n in names for u in uids(jobsets(cluster, n))]
    assert made_after == []
    assert {policy for _, policy in deleted_jobs(cluster)} == {"Background"}
    assert not [p for p in core.list_namespaced_pod(cluster.namespace).items if not p.metadata.deletion_timestamp]
