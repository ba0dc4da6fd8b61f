"""A run cancelled, on the real control plane (tests/cluster/; what the launcher's tests share:
tests/launcher_helpers.py): SIGTERM deletes the job (even when the process is killed right after), and the exit step
deletes what a killed launcher left running (or a Failed TrainJob), leaves a finished job and someone else's alone,
and deletes nothing when the name now holds another job."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import kubernetes

from components.kube import Kube
from components.launch_training.core import launch
from components.launch_training.manifest import DEFAULT_RUNTIME, job_name, render_job
from components.run_summary.core import job_cleanup, summarize_run
from tests.cluster.timelines import Timeline
from tests.launcher_helpers import ALL_APIS, BOTH_APIS, LINES, cluster_config, deleted_jobs, on, running, wait_for


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


@ALL_APIS
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


@ALL_APIS
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
