"""Diagnosis while the job runs: pod statuses, events and log lines from the real API server, written by the
kubelet and scheduler player on a timeline; each symptom of the troubleshooting table reported once, in its words;
the Pending deadline fails early."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import kubernetes
import pytest

from common.errors import StepFailed
from components.launch_training import k8s_backend
from components.launch_training.config import LaunchConfig
from components.launch_training.core import launch
from components.launch_training.diagnosis import FIX, Diagnosis
from components.launch_training.k8s_backend import last_memory_use
from tests.cluster.timelines import Timeline
from trainer.metrics import step_line

pytestmark = pytest.mark.timeout(120)
EFA_SHORT = "0/4 nodes are available: 4 Insufficient vpc.amazonaws.com/efa."


@pytest.fixture(autouse=True)
def diagnose_often(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(k8s_backend, "DIAGNOSE_EVERY_S", 0.1)


def config(root: Path, run_id: str, namespace: str, **overrides: Any) -> LaunchConfig:
    settings: dict[str, Any] = dict(
        storage_root=str(root),
        dataset="synthetic",
        run_id=run_id,
        backend="kubernetes",
        nnodes=2,
        nproc_per_node=8,
        pipeline_run_id=f"p-{run_id}",
        image="trainer:1",
        owner_reference=False,
        timeout_s=30,
        stream_logs="all",
        namespace=namespace,
    )
    return LaunchConfig.of(**{**settings, **overrides})


def findings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage().removeprefix("diagnosis: ") for r in caplog.records if r.getMessage().startswith("diagnosis:")
    ]


def test_pods_pending_past_the_pending_deadline_fail_early_and_delete_the_job(
    staged_root: Path, make_cluster, caplog
) -> None:
    cluster = make_cluster(timeline=Timeline.stuck_pending())
    with pytest.raises(StepFailed) as failure:
        launch(config(staged_root, "pending", cluster.namespace, pending_timeout_s=2, timeout_s=60), cluster.runner())
    (delete,) = cluster.requests("delete", "pytorchjobs")
    message = str(failure.value)
    assert "past the Pending deadline of 2s" in message and "it was deleted" in message
    assert "diagnosis: Pod stuck in Pending (worker-0): Pending for" in message
    assert "insufficient nvidia.com/gpu (0/4 nodes are available: 4 Insufficient nvidia.com/gpu.)" in message
    assert delete["requestObject"]["propagationPolicy"] == "Foreground"
    seen = findings(caplog)
    assert sorted(f.split(":")[0] for f in seen) == [
        "Pod stuck in Pending (worker-0)",
        "Pod stuck in Pending (worker-1)",
    ]
    assert all(FIX["Pod stuck in Pending"] in f for f in seen)  # the seed's fix, with the finding


def test_missing_efa_devices_name_the_device_plugin(staged_root: Path, make_cluster, caplog) -> None:
    cluster = make_cluster(timeline=Timeline.stuck_pending(message=EFA_SHORT))
    with pytest.raises(StepFailed, match="EFA errors"):
        # 2 s: a pod's creationTimestamp has whole seconds, so 1 s could pass at the first look, before the timeline
        # has marked the second pod
        launch(config(staged_root, "no-efa", cluster.namespace, pending_timeout_s=2), cluster.runner())
    seen = findings(caplog)
    assert len(seen) == 2 and all(f.startswith("EFA errors (worker-") for f in seen)
    assert "the EFA device plugin may be missing" in seen[0] and "aws-efa-k8s-device-plugin" in seen[0]


def test_an_image_pull_error_is_reported_once_per_pod_and_fails_at_the_pending_deadline(
    staged_root: Path, make_cluster, caplog
) -> None:
    cluster = make_cluster(timeline=Timeline.image_pull_error())
    with pytest.raises(StepFailed, match="past the Pending deadline") as failure:
        launch(config(staged_root, "pull", cluster.namespace, pending_timeout_s=2), cluster.runner())
    seen = findings(caplog)
    assert [f.split(":")[0] for f in seen] == ["Image pull error (worker-0)", "Image pull error (worker-1)"]
    assert seen[0].startswith('Image pull error (worker-0): Failed to pull image "trainer:1": rpc error')
    assert "401 Unauthorized. Fix: ECR auth expired" in seen[0] and "aws ecr get-login-password" in seen[0]
    assert "Image pull error" in str(failure.value)


def test_oomkilled_says_the_limit_and_the_last_memory_seen(staged_copy: Path, make_cluster, caplog) -> None:
    cluster = make_cluster(timeline=Timeline.oom_killed())
    cfg = config(staged_copy, "oom", cluster.namespace, timeout_s=3)
    cfg.run_paths.root.mkdir(parents=True)
    cfg.run_paths.metrics.write_text(json.dumps({"step": 120, "loss": 3.1, "rss_gib": 37.25}) + "\n")
    with pytest.raises(StepFailed) as failure:
        launch(cfg, cluster.runner())
    seen = findings(caplog)
    assert [f.split(":")[0] for f in seen] == ["OOMKilled (worker-1)"]  # once, though it crashed twice
    assert "more than its memory limit (limit 512Gi) (exit code 137)" in seen[0]
    assert "the largest worker process held 37.2 GiB at step 120" in seen[0]
    assert "Fix: increase memory in resources" in seen[0]
    assert "diagnosis: OOMKilled (worker-1)" in str(failure.value)


def test_a_crash_loop_shows_its_last_lines(staged_root: Path, make_cluster, caplog) -> None:
    lines = ["Traceback (most recent call last):", "ModuleNotFoundError: No module named 'trainer'"]
    cluster = make_cluster(timeline=Timeline.crash_loop(log_lines=lines, crashes=2))
    with pytest.raises(StepFailed):
        launch(config(staged_root, "crash", cluster.namespace, timeout_s=3), cluster.runner())
    seen = [f for f in findings(caplog) if f.startswith("CrashLoopBackOff")]
    assert len(seen) == 1 and seen[0].startswith("CrashLoopBackOff (worker-1): restarted")
    assert "exit code 1 (Error)" in seen[0] and "ModuleNotFoundError: No module named 'trainer'" in seen[0]


def test_rendezvous_and_efa_lines_in_the_log_are_named_once(staged_root: Path, make_cluster, caplog) -> None:
    lines = [
        step_line(1, 30, 5.0, 3e-3, 0.5, 20000, None, 58.0),
        "torch.distributed.elastic.rendezvous.api.RendezvousTimeoutError: rendezvous timed out",
        "torch.distributed.elastic.rendezvous.api.RendezvousTimeoutError: rendezvous timed out",
        "ip-10-0-0-1:42:42 [0] NCCL INFO NET/OFI Unable to find a protocol that worked",
        step_line(2, 30, 4.0, 3e-3, 0.5, 20000, None, 56.0),
    ]
    caplog.set_level(logging.INFO)
    cluster = make_cluster(timeline=Timeline.success(workers=2, log_lines=lines))
    result = launch(config(staged_root, "peers", cluster.namespace, stream_logs="worker-0"), cluster.runner())
    seen = findings(caplog)
    assert [f.split(":")[0] for f in seen] == ["Pods can't find each other (worker-0)", "EFA errors (worker-0)"]
    assert "RendezvousTimeoutError" in seen[0] and "headless services" in seen[0]
    assert result.state == "Succeeded" and len(result.diagnosis) == 2  # reported, and in the step's report


def test_a_healthy_run_reports_nothing(staged_root: Path, make_cluster, caplog) -> None:
    cluster = make_cluster(timeline=Timeline.success(workers=2))
    result = launch(config(staged_root, "healthy", cluster.namespace, pending_timeout_s=30), cluster.runner())
    assert findings(caplog) == [] and result.diagnosis == []


def test_pending_time_counts_from_the_oldest_pending_pod() -> None:
    clock = [1000.0]
    diagnosis = Diagnosis("job", now=lambda: clock[0])
    assert diagnosis.pending_for() == 0.0
    pod = kubernetes.client.V1Pod(
        metadata=kubernetes.client.V1ObjectMeta(name="job-worker-0", creation_timestamp=None),
        status=kubernetes.client.V1PodStatus(phase="Pending"),
    )
    diagnosis.observe([pod], [])
    clock[0] += 42
    assert diagnosis.pending_for() == 42.0
    pod.status.phase = "Running"
    diagnosis.observe([pod], [])
    assert diagnosis.pending_for() == 0.0


def test_last_memory_use_reads_the_newest_row_that_has_it(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    assert last_memory_use(metrics) == ""
    metrics.write_text('{"step": 10, "rss_gib": 1.5}\n{"step": 20, "rss_gib": 2.25}\n{"step": 30}\n')
    assert last_memory_use(metrics) == "the largest worker process held 2.2 GiB at step 20 (metrics.jsonl)"
