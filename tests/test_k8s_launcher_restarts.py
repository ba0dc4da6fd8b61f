"""A job's restarts as the launcher counts them, on the real control plane (tests/cluster/; what the launcher's tests
share: tests/launcher_helpers.py): a crash loop to the backoff limit, pods made anew against the restart budget, a
restart reported while the job carries on, every agent restarting at once, and a Failed job HyperPod auto-resume
brings back, or leaves failed."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from common.errors import StepFailed
from components.kube import Kube
from components.launch_training.core import launch
from components.launch_training.follow import run_job
from components.launch_training.manifest import job_name, render_job
from components.launch_training.watch_settings import DIAGNOSE_EVERY_S
from tests.cluster.timelines import Timeline
from tests.launcher_helpers import FAILS_AT_THIRD_RESTART, LINES, cluster_config, deleted_jobs, fast, wait_for


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
        # Noted before the new pod exists: the launcher may see it and end before this thread goes on.
        made_anew.append(time.monotonic())
        job.start_recreated(1)

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
