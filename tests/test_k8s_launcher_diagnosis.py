"""What the step of a job that went wrong says, on the real control plane (tests/cluster/; what the launcher's tests
share: tests/launcher_helpers.py): a failed pod's last lines and events (or why they could not be read), the
trainer's own logs on the volume once the pods are gone, and a diverged or stalled trainer's job ended with every
rank's last lines."""

from __future__ import annotations

import logging
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from common.errors import StepFailed
from components.kube import Kube
from components.launch_training.core import launch
from components.launch_training.follow import run_job
from components.launch_training.manifest import render_job
from tests.cluster.control_plane import deploy_grants
from tests.cluster.timelines import Timeline
from tests.launcher_helpers import (
    ALL_APIS,
    BOTH_APIS,
    cluster_config,
    crash_until_failed,
    deleted_jobs,
    fast,
    forbidden,
    on,
    restart_budget,
)
from trainer.layout import RunPaths
from trainer.metrics import step_line
from trainer.train_ddp import LOG_FORMAT, write_status


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


def test_a_failure_without_the_events_permission_says_so(staged_root: Path, make_cluster, caplog) -> None:
    """A job that never starts is described (its pods' events) before it is deleted: without 'list events' the step's
    log says which rule is missing, and the launch goes on without them."""
    cluster = make_cluster(timeline=Timeline.stuck_pending(), grants=deploy_grants(without=("list events",)))
    job = render_job(cluster_config(staged_root, "no-events", cluster.namespace).job_spec())
    with pytest.raises(StepFailed, match="past the Pending deadline"):
        run_job(Kube(cluster.runner()), job, fast(pending_timeout_s=2), threading.Event())
    assert "not readable by this service account" in caplog.text and "deploy/rbac.yaml" in caplog.text
    assert forbidden(cluster), "RBAC refused the events, on the real authorizer"


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


@ALL_APIS
def test_a_failed_job_whose_pods_were_deleted_still_names_the_trainers_last_lines(
    api: str, staged_copy: Path, make_cluster
) -> None:
    """Training Operator 1.8.1 deletes every pod at the backoff limit before it writes Failed; JobSet deletes a
    failed group's Jobs, and with them their pods, at each restart, as the HyperPod training operator deletes a
    job's pods at each job-level restart: the evidence comes from the trainer's own logs on the volume, and where the
    operator keeps an account of its last restart (a HyperPodPyTorchJob's latestFaultyPodInstanceList), from it too."""
    cluster = make_cluster(timeline=crash_until_failed(api, log_lines=["boom"], tick_s=0.05), api=api, restart_budget=1)
    cfg = cluster_config(staged_copy, "evidence", **on(cluster), job_options=restart_budget(api, 1))
    write_trainer_logs(cfg.run_paths, failing_rank=3)
    with pytest.raises(StepFailed) as failure:
        launch(cfg, cluster.runner())
    message = str(failure.value)
    limit = {
        "pytorchjob": "backoff limit",
        "trainjob": "ReachedMaxRestarts: jobset failed due to reaching max number",
        "hyperpodpytorchjob": "MaxFullJobRestartsReached",
    }[api]
    assert limit in message and "trainer crashed at step 30" in message
    if api == "hyperpodpytorchjob":  # worker 1 of 2 nodes of 8 processes: ranks 8 to 15
        ranks = ", ".join(map(str, range(8, 16)))
        assert f"the operator's last restart: JLR restart: pods {cfg.job_name}-pods-1; ranks {ranks}" in message
    assert "rank 3, the first to log an error" in message
    assert "RuntimeError: CUDA error: an illegal memory access was encountered" in message


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
