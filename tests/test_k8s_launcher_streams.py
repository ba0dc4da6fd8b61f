"""The launcher's watch of the job and its streams of the pods' logs, on the real control plane (tests/cluster/; what
the launcher's tests share: tests/launcher_helpers.py): every line once across a container restart, a stream that
falls silent or is cut, no kubelet to answer, a watch refused, cut or expired, transient API errors, and an API
server that goes away."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import kubernetes

from common.errors import StepFailed
from components.kube import Kube, KubeSettings
from components.launch_training.core import launch
from components.launch_training.follow import run_job
from components.launch_training.manifest import job_name, render_job
from components.launch_training.watch_settings import WatchSettings
from tests.cluster.control_plane import deploy_grants
from tests.cluster.timelines import Timeline
from tests.launcher_helpers import LINES, cluster_config, fast, pod_lines, running, wait_for


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


def test_a_log_stream_that_falls_silent_is_reopened(staged_root: Path, make_cluster, caplog) -> None:
    """A stream from a lost node sends nothing and never closes: the read timeout reopens it, nothing repeats."""
    caplog.set_level(logging.INFO)
    cluster = make_cluster(timeline=Timeline.success(workers=2, log_lines=LINES, tick_s=0.15))
    cluster.kubelet.stall_log_after(3)
    job = render_job(cluster_config(staged_root, "silent", cluster.namespace).job_spec())
    outcome = run_job(Kube(cluster.runner()), job, fast(log_read_timeout_s=0.5), threading.Event())
    assert outcome.state == "Succeeded"
    assert pod_lines(caplog, f"{job['metadata']['name']}-worker-0") == LINES


def test_polls_when_watching_is_refused(staged_root: Path, make_cluster, caplog) -> None:
    caplog.set_level(logging.INFO)
    cluster = make_cluster(
        timeline=Timeline.success(workers=2, log_lines=LINES[:3]), grants=deploy_grants(without=("watch pytorchjobs",))
    )
    job = render_job(cluster_config(staged_root, "polled", cluster.namespace).job_spec())
    outcome = run_job(Kube(cluster.runner()), job, WatchSettings(poll_interval_s=0.2), threading.Event())
    assert outcome.state == "Succeeded" and "polling every 0.2s instead" in caplog.text
    assert [e["verb"] for e in cluster.audit() if e["responseStatus"]["code"] == 403] == ["watch"]


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
