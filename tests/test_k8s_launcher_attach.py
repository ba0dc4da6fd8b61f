"""A launch that finds a job of its name, on the real control plane (tests/cluster/; what the launcher's tests share:
tests/launcher_helpers.py): a retried step re-attaches to its job, a run still running is re-attached, a failed job
is replaced by a new attempt once it is gone, and someone else's job is refused, left alone."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from common.errors import StepFailed
from components.launch_training.core import launch
from components.launch_training.manifest import render_job
from tests.cluster.timelines import Timeline
from tests.launcher_helpers import (
    ALL_APIS,
    BOTH_APIS,
    LINES,
    cluster_config,
    crash_until_failed,
    deleted_jobs,
    on,
    restart_budget,
    running,
    wait_for,
)


@ALL_APIS
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


@ALL_APIS
def test_a_retried_run_after_a_failed_job_trains_again(
    api: str, staged_root: Path, make_cluster, garbage_collector, caplog
) -> None:
    """KFP's run-level Retry keeps the run id, so the job name: the failed job is replaced, not re-reported. The
    foreground deletion of the failed job ends only when the garbage collector has removed its pods. A Failed TrainJob
    is deleted by the launch that saw it fail (Trainer v2.3.0 would run it again once its JobSet's TTL removed the
    JobSet), so the retry finds none and creates it anew, as attempt 1: the trainer's own attempt counts on. A Failed
    HyperPodPyTorchJob stays, as a PyTorchJob does, and is replaced the same way."""
    caplog.set_level(logging.INFO)
    cluster = make_cluster(timeline=crash_until_failed(api, tick_s=0.2), api=api, restart_budget=1)
    cfg = cluster_config(staged_root, "retried", **on(cluster), job_options=restart_budget(api, 1))
    reason = {
        "pytorchjob": "PyTorchJobFailed: Job .* backoff limit",
        "trainjob": "ReachedMaxRestarts",
        "hyperpodpytorchjob": "MaxFullJobRestartsReached",
    }[api]
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
