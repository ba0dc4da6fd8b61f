"""What the launcher's tests on the real control plane share (tests/test_k8s_launcher*.py,
tests/test_trainjob_lifecycle.py): a run's settings on a cluster (`cluster_config`, `on`, `restart_budget`), short
deadlines (`fast`), a worker crashing until the job fails, and what a test reads back (the lines streamed, the
requests RBAC refused, the jobs deleted, a job running)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from components.launch_training.config import LaunchConfig
from components.launch_training.manifest import DEFAULT_RUNTIME
from components.launch_training.platform import Platform
from components.launch_training.watch_settings import WatchSettings
from tests.cluster.timelines import Timeline

LINES = [f"step {i} loss {5 - i / 10:.2f}" for i in range(1, 13)]

# A crash loop of 3 container restarts fails the job (backoffLimit 1 x 2 nodes + 1), and the launcher fails the step
# at once instead of watching for HyperPod auto-resume.
FAILS_AT_THIRD_RESTART = {"restart_budget": 1, "auto_resume_wait_s": 0}

# The job APIs whose operators tests/cluster/ plays. The launcher's lifecycle (success, failure with evidence, retry,
# cancel, deadline, Kueue's suspend and resume) is tested on all three (ALL_APIS); the rest of what it guarantees on
# the two Kubeflow APIs (BOTH_APIS): the suite's time is spent where the HyperPodPyTorchJob differs.
PLAYED_APIS = ("pytorchjob", "trainjob", "hyperpodpytorchjob")
ALL_APIS = pytest.mark.parametrize("api", PLAYED_APIS)
BOTH_APIS = pytest.mark.parametrize("api", PLAYED_APIS[:2])


def on(cluster: Any, **platform: Any) -> dict[str, Any]:
    """The settings that put a run on `cluster`: its namespace, and its job API (and runtime) as compiled in."""
    runtime = cluster.runtime_name or DEFAULT_RUNTIME
    return {
        "namespace": cluster.namespace,
        "platform": Platform(job_api=cluster.api.name, runtime_name=runtime, **platform),
    }


def restart_budget(api: str, budget: int) -> dict[str, Any]:
    """What a run on `api` gives for a restart budget: a PyTorchJob's is a job option (its backoffLimit), as a
    HyperPodPyTorchJob's (its maxFullJobRestarts); a TrainJob's is its runtime's JobSet maxRestarts
    (make_cluster(restart_budget=...)), so nothing."""
    return {
        "pytorchjob": {"restart_budget": budget, "auto_resume_wait_s": 0},
        "hyperpodpytorchjob": {"restart_budget": budget},
    }.get(api, {})


def crash_until_failed(api: str, log_lines: Any = None, tick_s: float = 0.3) -> Timeline:
    """Worker 1 crashes until the job fails, with a restart budget of 1 (FAILS_AT_THIRD_RESTART; a TrainJob's
    runtime with maxRestarts 1). A PyTorchJob: OnFailure restarts the container in place; at the backoff limit (3
    restarts, job-wide) the Training Operator deletes every pod and writes Failed (1.8.1 ReconcileJobs). A TrainJob:
    the pod fails (restartPolicy Never), its Job fails (backoffLimit 0: the real Job controller), JobSet deletes and
    recreates the group once (failure_policy.go, restartJobSetActionApplier), and the second failure exhausts
    maxRestarts: Failed, ReachedMaxRestarts. A HyperPodPyTorchJob the same way: its pod fails, the operator restarts
    the whole job once (a JLR: its pods made again), and the second failure spends maxFullJobRestarts 1: Failed
    (tests/cluster/hyperpod_training_operator.py)."""
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
    """The lines streamed from node `node`'s pods (a TrainJob's are named <job>-node-0-<node>-<suffix>). A
    HyperPodPyTorchJob's pods cannot be told apart by node (hyperpodpytorchjob.py: a node's selector is the job's): the
    lines of the `node`-th of its pods streamed, in the order their lines came."""
    if api == "pytorchjob":
        return pod_lines(caplog, f"{job}-worker-{node}")
    if api == "hyperpodpytorchjob":
        streamed = list(dict.fromkeys(r.name for r in caplog.records if r.name.startswith(f"pod.{job}-")))
        return pod_lines(caplog, streamed[node].removeprefix("pod.")) if node < len(streamed) else []
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
    """A PyTorchJob's or a HyperPodPyTorchJob's Running condition; a TrainJob has none: its node group ready
    (status.jobsStatus, JobSet's replicatedJobsStatus: a Job counts ready when its ready pods reach its parallelism)."""
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
