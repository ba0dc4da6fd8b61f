"""The Kubernetes backend: create (or re-attach to) the job, watch it to the end, stream its logs.

Written once for both job APIs (a PyTorchJob or a TrainJob): what differs between them is asked of the job's
`JobApi` (job_api.py), never tested for here. This module starts the launch (`launch_on_kubernetes`); each part has
a module of its own, named below.

- Create (attach.py): the name comes from the KFP run id, so a retried step or run finds its own job. A running or
  succeeded job with our spec digest is re-attached to; a failed one is deleted, waited for, and created again
  as the next attempt; one with another digest is refused and never touched.
- Watch (readers.py): a watch on the one job, resumed after dropped streams and 410 Gone (by reading the job again),
  falling back to polling when watching is refused; conditions and pod phases are logged as they change.
- Logs (log_stream.py): node 0's (or every node's) log is streamed into this step's log, prefixed by pod, waiting
  through Pending, following the node's pod when it is replaced (a TrainJob's restart names it anew), and
  reconnecting without repeating lines (timestamps mark where it stopped), also when a
  stream falls silent (a read timeout); a container that restarted between two reads has its previous
  instance's rest read first. Logs are for people: an unreadable one (no kubelet answers) is retried with a
  growing pause and never fails the launch.
- Diagnosis (pods.py): every few seconds the job's pods and their events, and every streamed log line, are
  matched to the troubleshooting table (diagnosis.py); each symptom is logged once as it happens.
- Deadlines (deadlines.py): queued (suspended by Kueue), never started (pods Pending), running below its minimum
  of pods (a lost node), and the training deadline, each its own; past one the job is deleted and the step fails.
- The end (follow.py, which runs the loop): Succeeded returns; Failed raises with the condition's reason, the
  trainer's own account from the volume (evidence.py) or what the pods showed at their restarts, and the diagnosis;
  a SIGTERM (KFP terminating the run) deletes the job from the signal handler itself, then again from the loop, and
  raises.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from pathlib import Path
from typing import Any

from kubernetes.client.exceptions import ApiException

from components.kube import Kube, api_client_from_environment, describe
from components.launch_training.cancel import ImmediateDelete, SigtermToEvent
from components.launch_training.config import LaunchConfig, LaunchResult
from components.launch_training.diagnosis import Diagnosis
from components.launch_training.evidence import read_evidence
from components.launch_training.follow import run_job
from components.launch_training.job_api import JobApi
from components.launch_training.manifest import render_job
from components.launch_training.pods import last_lines
from components.launch_training.progress import TrainingWatch
from components.launch_training.trainjob import runtime_grace_period
from components.launch_training.watch_settings import DIAGNOSE_EVERY_S, WatchSettings

log = logging.getLogger(__name__)


def last_memory_use(metrics: Path) -> str:
    """What the trainer last recorded of its memory, for an OOMKilled worker: the largest process's RSS."""
    try:
        rows = [json.loads(line) for line in metrics.read_text().splitlines()[-20:] if line.strip()]
    except (OSError, ValueError):
        return ""
    rows = [r for r in rows if r.get("rss_gib")]
    if not rows:
        return ""
    return f"the largest worker process held {rows[-1]['rss_gib']:.1f} GiB at step {rows[-1]['step']} (metrics.jsonl)"


def runtime_grace(kube: Kube, api: JobApi, runtime: str) -> int | None:
    """The grace period of the named runtime's pods, or None when it cannot be read (the preflight says why)."""
    try:
        found = kube.call(
            f"get {api.runtime_plural}",
            kube.custom.get_cluster_custom_object,
            api.group,
            api.version,
            api.runtime_plural,
            runtime,
        )
    except ApiException as exc:
        log.warning(
            "cannot read %s %s (%s): the run's grace period is patched in", api.runtime_plural, runtime, describe(exc)
        )
        return None
    return runtime_grace_period(found)


def launch_on_kubernetes(cfg: LaunchConfig, api_client: Any = None) -> LaunchResult:
    spec = cfg.job_spec()
    api_client = api_client or api_client_from_environment()
    kube = Kube(api_client)
    if spec.api.runtime_plural:
        spec = dataclasses.replace(spec, runtime_grace_period_s=runtime_grace(kube, spec.api, spec.runtime_name))
    manifest = render_job(spec)
    settings = WatchSettings(
        deadline_s=cfg.timeout_s,
        logs=cfg.stream_logs,
        pending_timeout_s=cfg.pending_timeout_s,
        recovery_timeout_s=cfg.recovery_timeout_s,
        queue_timeout_s=cfg.queue_timeout_s,
        diagnose_every_s=DIAGNOSE_EVERY_S,
        auto_resume_wait_s=spec.auto_resume_wait_s if spec.auto_resumed else 0,
    )
    ns, name = manifest["metadata"]["namespace"], manifest["metadata"]["name"]
    api = spec.api
    diagnosis = Diagnosis(
        name,
        last_lines=lambda pod: last_lines(kube, api, ns, pod),
        memory_note=lambda: last_memory_use(cfg.run_paths.metrics),
    )
    started = time.perf_counter()
    cancel = threading.Event()
    delete_now = ImmediateDelete(api_client, api, ns, name)

    def owned(uid: str) -> None:
        delete_now.uid = uid

    with SigtermToEvent(cancel, delete_now):
        outcome = run_job(
            kube,
            manifest,
            settings,
            cancel,
            diagnosis,
            evidence=lambda: read_evidence(cfg.run_paths),
            on_owned=owned,
            training=TrainingWatch(cfg.run_paths, cfg.stall_timeout_s),
        )
    return LaunchResult(
        run_id=cfg.run_id,
        run_dir=str(cfg.run_paths.root),
        backend=cfg.backend,
        world_size=cfg.world_size,
        seconds=round(time.perf_counter() - started, 3),
        job_name=outcome.name,
        job_kind=api.kind,
        namespace=outcome.namespace,
        state=outcome.state,
        reattached=outcome.reattached,
        attempt=outcome.attempt,
        queued_s=outcome.queued_s,
        running_s=outcome.running_s,
        restarts=outcome.restarts,
        diagnosis=outcome.diagnosis,
    )
