"""TrainJobs as the released controllers run them, where they are unkind (tests/cluster/: Kueue v0.19.2, JobSet v0.12.0,
Kubeflow Trainer v2.3.0 played on the real API server and Job controller):

- Kueue writes an admitted TrainJob back through Trainer v2.2.1's types (a runtime patch's grace period dropped), and
  JobSet's webhook then refuses Trainer's re-apply of the suspended JobSet: the TrainJob never gets a pod.
- JobSet's ttlSecondsAfterFinished removes a Failed TrainJob's JobSet, and Trainer v2.3.0 builds a new one: the run
  trains again, unattended.
- Trainer v2.3.0 reconciles a TrainJob that is being deleted: a foreground delete lets it build a new JobSet; and
  after a background delete the JobSet's Jobs make pods until the garbage collector reaches them.

Each test here failed on the launcher before it deleted TrainJobs in the background, deleted Failed ones, refused a
queued TrainJob's grace period that is not its runtime's, kept its Pending clock without pods and returned from a
delete only once nothing of the TrainJob could make a pod.
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
from components.launch_training.cancel import Cancelled
from components.launch_training.core import launch
from components.launch_training.follow import run_job
from components.launch_training.manifest import render_job
from tests.cluster import jobset as jobset_player
from tests.cluster.timelines import Timeline
from tests.launcher_helpers import cluster_config, deleted_jobs, fast, on, running, wait_for

QUEUE = "hyperpod-ns-team-a-localqueue"


def jobsets(cluster: Any, name: str) -> list[dict[str, Any]]:
    """The JobSets of the namespace named `name` (as the admin)."""
    found = json.loads(
        cluster.custom.list_namespaced_custom_object(
            jobset_player.GROUP, jobset_player.VERSION, cluster.namespace, jobset_player.PLURAL, _preload_content=False
        ).data
    )["items"]
    return [j for j in found if j["metadata"]["name"] == name]


def uids(objects: list[dict[str, Any]]) -> set[str]:
    return {o["metadata"]["uid"] for o in objects}


def live(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Those not being deleted: JobSet v0.12.0 makes no Job for a JobSet being deleted (jobset#561), and the Job
    controller no pod for a Job being deleted (job_controller.go syncJob: manageJob only without a
    deletionTimestamp); a TrainJob makes its JobSet again either way (Trainer v2.3.0 never looks)."""
    return [o for o in objects if not o["metadata"].get("deletionTimestamp")]


def deleted(cluster: Any, name: str) -> bool:
    """TrainJob `name` gone and its JobSet gone or being deleted: what no pass of Trainer's or JobSet's begun from now
    on will make anything again from."""
    return cluster.job(name) is None and not live(jobsets(cluster, name))


def everything_of(cluster: Any, name: str) -> dict[str, set[str]]:
    """The uids of TrainJob `name` and of what was made for it: its JobSet, the JobSet's Jobs (by JobSet's label)
    and their pods, and which of the JobSets and Jobs are not being deleted."""
    batch = kubernetes.client.BatchV1Api(cluster.admin)
    selector = cluster.api.pod_selector(name)  # JobSet labels its Jobs as it labels their pods
    response = batch.list_namespaced_job(cluster.namespace, label_selector=selector, _preload_content=False)
    jobs = json.loads(response.data)["items"]
    trainjob, sets = cluster.job(name), jobsets(cluster, name)
    return {
        "trainjob": uids([trainjob] if trainjob else []),
        "jobsets": uids(sets),
        "live jobsets": uids(live(sets)),
        "jobs": uids(jobs),
        "live jobs": uids(live(jobs)),
        "pods": uids(cluster.pods(name)),
    }


def test_a_queued_trainjob_whose_grace_period_is_not_the_runtimes_is_refused_before_anything_is_created(
    staged_root: Path, make_cluster
) -> None:
    """Kueue v0.19.2 would drop the grace period at admission and JobSet's webhook refuse the runtime's: refused in
    one line, naming both values and what to change, with nothing sent to the cluster."""
    cluster = make_cluster(api="trainjob", timeline=Timeline.queued(admit_after_s=0.3))
    cfg = cluster_config(
        staged_root, "grace", **on(cluster, queue_name=QUEUE), job_options={"grace_period_s": 300}, timeout_s=15
    )
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
    cluster = make_cluster(
        api="trainjob", timeline=Timeline.failure(), restart_budget=0, runtime_options={"ttl_after_finished_s": 1}
    )
    cfg = cluster_config(staged_root, "failed-ttl", **on(cluster))
    with pytest.raises(StepFailed, match=r"failed \(attempt 1\): ReachedMaxRestarts") as failed:
        launch(cfg, cluster.runner())
    first = uids(jobsets(cluster, cfg.job_name))
    time.sleep(4)  # the TTL (1 s; condition times have whole seconds) and a reconcile of Trainer's after it
    assert uids(jobsets(cluster, cfg.job_name)) <= first, "a new JobSet: the run trained again"
    assert cluster.job(cfg.job_name) is None
    assert "the TrainJob was deleted, so that Kubeflow Trainer does not run it again" in str(failed.value)
    wait_for(
        lambda: cluster.pods(cfg.job_name) == [] and jobsets(cluster, cfg.job_name) == [],
        30,
        "the JobSet and its pods collected",
    )


def test_no_pod_and_no_jobset_is_made_after_a_cancel_returned_over_ten_cancels(staged_root: Path, make_cluster) -> None:
    """SIGTERM's delete (the loop's, here) while the TrainJob runs, ten times: Trainer v2.3.0 reconciles a TrainJob
    that still exists without its JobSet, so a foreground delete (the JobSet removed first, the TrainJob held by its
    finalizer) let it build another. In the background the TrainJob goes first, and nothing of it is made again.

    The cancel returns only once nothing of the TrainJob can make a pod: until the garbage collector reaches them its
    JobSet's Jobs do (the Job controller makes pods for a Job not being deleted), and a cancel that returned at its
    delete met pods made after it on a loaded machine. Trainer and JobSet are held between two of their passes while
    the delete lands: a reconcile already under way, on a TrainJob (or JobSet) read before it went, would apply a new
    JobSet (or Job) once the collector removed the old one, as the released controllers do from their caches, and no
    client can stop that (the collector removes what it makes). Every wait is on a state, none on time."""
    cluster = make_cluster(api="trainjob", timeline=Timeline.running(2))
    jobset_controller, trainer_controller = cluster.controllers
    core = kubernetes.client.CoreV1Api(cluster.admin)
    made_after: list[str] = []
    names: list[str] = []
    for attempt in range(10):
        cfg = cluster_config(staged_root, f"cancel-{attempt}", **on(cluster))
        name = cfg.job_name
        names.append(name)
        job = render_job(cfg.job_spec())
        cancel = threading.Event()
        outcome: list[BaseException] = []
        at_return: list[dict[str, set[str]]] = []

        def launcher(
            job: dict[str, Any] = job,
            cancel: threading.Event = cancel,
            outcome: list[BaseException] = outcome,
            at_return: list[dict[str, set[str]]] = at_return,
            name: str = name,
        ) -> None:
            try:
                run_job(Kube(cluster.runner()), job, fast(logs="none"), cancel)
            except BaseException as exc:  # noqa: BLE001 (asserted below)
                at_return.append(everything_of(cluster, name))  # as the cancel returns
                outcome.append(exc)

        thread = threading.Thread(target=launcher)
        thread.start()
        wait_for(lambda name=name: running(cluster.job(name)), 120, "the TrainJob runs")
        with trainer_controller.between_passes(), jobset_controller.between_passes():
            cancel.set()
            wait_for(lambda name=name: deleted(cluster, name), 120, "the TrainJob gone, its JobSet gone or going")
        thread.join(240)
        assert not thread.is_alive(), f"{name}: the cancel did not return"
        assert len(outcome) == 1 and isinstance(outcome[0], Cancelled), outcome
        seen = at_return[0]
        assert not seen["trainjob"] and not seen["live jobsets"] and not seen["live jobs"], (
            f"{name}: the cancel returned while these could still make pods: {seen}"
        )

        def collected(name: str = name, seen: dict[str, set[str]] = seen) -> bool:
            """All of it gone; whatever was made after the cancel returned is added to made_after on the way."""
            now = everything_of(cluster, name)
            for kind in ("jobsets", "jobs", "pods"):
                made_after.extend(f"{name}: {kind} {uid}" for uid in sorted(now[kind] - seen[kind]))
                seen[kind] |= now[kind]
            return not any(now.values())

        wait_for(collected, 120, f"{name}: its JobSet, Jobs and pods collected")
        trainer_controller.wait_for_pass()  # each has read that all of it is gone, and acted on that
        jobset_controller.wait_for_pass()
        assert collected(), f"{name}: made again after it was collected"
    made_after += [f"{n}: JobSet {u} (late)" for n in names for u in uids(jobsets(cluster, n))]
    assert made_after == []
    assert {policy for _, policy in deleted_jobs(cluster)} == {"Background"}
    assert not [p for p in core.list_namespaced_pod(cluster.namespace).items if not p.metadata.deletion_timestamp]
