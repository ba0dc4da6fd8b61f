"""Stopping a run's job (a PyTorchJob or a TrainJob) when the run stops, in the layers that survive KFP's terminate.

KFP terminates a run by signalling the step's whole process group: its Go launcher has no handler and dies, the
container ends, and the Python step is killed moments later (kubeflow/pipelines, apiserver GetTerminatePatch ->
Argo's `argoexec kill 15 1`, the emissary forwarding to the process group). So:

1. the launcher's SIGTERM handler sends the delete itself (`SigtermToEvent` + `ImmediateDelete`), then its loop
   deletes again with retries (`delete_job`) if it lives long enough;
2. the pipeline's exit step, which KFP runs after a terminate, deletes the run's job if it is still running
   (`delete_unfinished_job`);
3. the job's own deadline (a PyTorchJob's runPolicy.activeDeadlineSeconds, a TrainJob's spec.activeDeadlineSeconds)
   lets its operator stop it whatever happened.

A TrainJob's delete returns only once nothing of it can make a pod any more (`wait_until_inert`): it is deleted in
the background (trainjob.py), so when the delete answers, its JobSet and the JobSet's Jobs are still there, and a Job
that is not being deleted still makes pods (kubernetes pkg/controller/job/job_controller.go `syncJob` calls
`manageJob` only while `job.DeletionTimestamp == nil`); Trainer v2.3.0 may even apply a new JobSet from a reconcile
that read the TrainJob before it went. The garbage collector removes all of it, within moments.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from common.errors import StepFailed
from components.kube import Kube, describe
from components.launch_training.job_api import JobApi
from components.launch_training.manifest import PIPELINE_RUN_LABEL, label_value

log = logging.getLogger(__name__)


class Cancelled(StepFailed):
    """SIGTERM: the job was deleted."""


SETTLE_TIMEOUT_S = 120.0  # the garbage collector removes a deleted TrainJob's JobSet and Jobs within seconds
SETTLE_POLL_S = 0.5


def delete_job(
    kube: Kube, api: JobApi, ns: str, name: str, uid: str | None = None, settle_timeout_s: float = SETTLE_TIMEOUT_S
) -> None:
    """With the API's propagation (a PyTorchJob: Foreground, it goes when its pods have gone; a TrainJob: Background,
    it goes at once and its JobSet and pods after it, see trainjob.py). `uid`: only that object.

    A PyTorchJob is not waited for: once it is being deleted the Training Operator makes no pod for it. A TrainJob is,
    until nothing of it can make a pod (`wait_until_inert`), so that no trainer starts after the step said it stopped.
    """
    body: dict[str, Any] = {"propagationPolicy": api.propagation}
    if uid:
        body["preconditions"] = {"uid": uid}
    try:
        kube.call(
            f"delete {api.kind}",
            kube.custom.delete_namespaced_custom_object,
            api.group,
            api.version,
            ns,
            api.plural,
            name,
            body=body,
        )
        log.info(
            "deleted %s %s/%s (%s)",
            api.kind,
            ns,
            name,
            "its pods go first" if api.propagation == "Foreground" else "its pods go after it",
        )
    except ApiException as exc:
        if exc.status not in (404, 409):  # 409: the precondition failed, another object holds the name now
            raise
    if api.pod_makers:
        wait_until_inert(kube, api, ns, name, uid, settle_timeout_s)


def wait_until_inert(
    kube: Kube, api: JobApi, ns: str, name: str, uid: str | None, timeout_s: float, poll_s: float = SETTLE_POLL_S
) -> None:
    """Until nothing of the deleted job `uid` can make a pod: the job gone (Trainer v2.3.0 reconciles a TrainJob that
    is being deleted), its children of its name (a JobSet) gone or being deleted (JobSet v0.12.0 leaves one being
    deleted alone, jobset#561), and their pod makers (the JobSet's batch Jobs) gone or being deleted (the Job
    controller makes pods only for a Job that is not). Raises StepFailed, naming what is left, past `timeout_s`."""
    deadline, said = time.monotonic() + timeout_s, ""
    while True:
        left = _pod_makers_left(kube, api, ns, name, uid)
        if not left:
            return
        if time.monotonic() > deadline:
            kinds = ",".join(plural for _, _, plural in (*api.children, *api.pod_makers))
            raise StepFailed(
                f"{api.kind} {ns}/{name} was deleted, but {left} can still make its pods {timeout_s:.0f}s later: is "
                f"the garbage collector running? Check `kubectl get {kinds} -n {ns} -l {api.pod_selector(name)}`"
            )
        if left != said:
            log.info("%s %s/%s deleted; waiting until nothing of it can make a pod: %s", api.kind, ns, name, left)
            said = left
        time.sleep(poll_s)


def _pod_makers_left(kube: Kube, api: JobApi, ns: str, name: str, uid: str | None) -> str:
    """What of the deleted job can still make a pod, in words; "" when nothing can."""
    try:
        job = kube.call(
            f"get {api.kind}", kube.custom.get_namespaced_custom_object, api.group, api.version, ns, api.plural, name
        )
    except ApiException as exc:
        if exc.status != 404:
            raise
        job = None
    if job is not None:
        if uid and job["metadata"]["uid"] != uid:
            return ""  # ours is gone and the name is another job's: what is there now is not ours to wait for
        return f"the {api.kind} itself"
    for group, version, plural in api.children:
        try:
            child = kube.call(
                f"get {plural}", kube.custom.get_namespaced_custom_object, group, version, ns, plural, name
            )
        except ApiException as exc:
            if exc.status != 404:
                raise
            continue
        owners = {o.get("uid") for o in child["metadata"].get("ownerReferences") or []}
        if not child["metadata"].get("deletionTimestamp") and (not uid or uid in owners):
            return f"{plural} {ns}/{name}"
    for group, version, plural in api.pod_makers:
        lister = kube.custom.list_namespaced_custom_object
        found = kube.call(f"list {plural}", lister, group, version, ns, plural, label_selector=api.pod_selector(name))
        live = [i["metadata"]["name"] for i in found.get("items") or [] if not i["metadata"].get("deletionTimestamp")]
        if live:
            return f"{plural} {', '.join(sorted(live))}"
    return ""


class SigtermToEvent:
    """While active, SIGTERM (how KFP terminates a run) sets `stop` and calls `on_signal` at once, in the handler.

    KFP signals the step's whole process group: its Go launcher has no handler and dies, the container ends, and
    this process is killed moments later. So whatever must reach the API server is sent from the handler itself.
    """

    def __init__(self, stop: threading.Event, on_signal: Callable[[], None] = lambda: None):
        self.stop, self.on_signal, self.previous = stop, on_signal, None

    def _handle(self, *_: object) -> None:
        first = not self.stop.is_set()
        self.stop.set()
        if first:
            self.on_signal()

    def __enter__(self) -> SigtermToEvent:
        if threading.current_thread() is threading.main_thread():
            self.previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGTERM, self.previous)


class ImmediateDelete:
    """The delete a SIGTERM sends from its handler: its own connection pool (the handler may interrupt a request of
    the main pool, whose lock it would wait on for ever), one try, a short timeout. Armed once the job is ours."""

    def __init__(self, api_client: Any, api: JobApi, ns: str, name: str, timeout_s: float = 3.0):
        self.custom = client.CustomObjectsApi(client.ApiClient(api_client.configuration))
        self.api, self.ns, self.name, self.timeout_s = api, ns, name, timeout_s
        self.uid: str | None = None

    def __call__(self) -> None:
        if self.uid is None:
            return  # not created (or not ours) yet: the launch loop deletes it as soon as it is
        try:
            self.custom.delete_namespaced_custom_object(
                self.api.group,
                self.api.version,
                self.ns,
                self.api.plural,
                self.name,
                body={"propagationPolicy": self.api.propagation, "preconditions": {"uid": self.uid}},
                _request_timeout=(self.timeout_s, self.timeout_s),
            )
            log.warning("SIGTERM: deleted %s %s/%s", self.api.kind, self.ns, self.name)
        except Exception as exc:  # the loop tries again, with retries, if it lives long enough
            log.warning(
                "SIGTERM: deleting %s %s/%s failed at once: %s", self.api.kind, self.ns, self.name, describe(exc)
            )


def delete_unfinished_job(kube: Kube, api: JobApi, ns: str, name: str, pipeline_run_id: str) -> str:
    """The pipeline's exit step, after a run that did not succeed: a job of this pipeline run still running (its
    launcher was killed before it could delete it) is deleted. Returns what was done, in words.

    A succeeded job is left for its logs (ttlSecondsAfterFinished removes a PyTorchJob, the runtime's JobSet TTL a
    TrainJob's pods), and so is a failed PyTorchJob; a Failed TrainJob is deleted, since Trainer v2.3.0 would run it
    again once its JobSet is gone (trainjob.py). A job of the name that another pipeline run made is not touched.
    """
    kind = api.kind
    try:
        job = kube.call(
            f"get {kind}", kube.custom.get_namespaced_custom_object, api.group, api.version, ns, api.plural, name
        )
    except ApiException as exc:
        if exc.status == 404:
            return f"no {kind} {ns}/{name} to clean up"
        raise
    labels = job["metadata"].get("labels") or {}
    if labels.get(PIPELINE_RUN_LABEL) != label_value(pipeline_run_id):
        return f"{kind} {ns}/{name} belongs to another pipeline run: left alone"
    if api.is_failed(job) and api.delete_failed and not job["metadata"].get("deletionTimestamp"):
        delete_job(kube, api, ns, name, job["metadata"]["uid"])
        return f"{kind} {ns}/{name} had failed: deleted, so that its operator does not run it again"
    if api.is_finished(job):
        return f"{kind} {ns}/{name} had already finished: left for its logs"
    if job["metadata"].get("deletionTimestamp"):
        return f"{kind} {ns}/{name} was already being deleted"
    delete_job(kube, api, ns, name, job["metadata"]["uid"])
    return f"{kind} {ns}/{name} was still running after the run ended: deleted"
