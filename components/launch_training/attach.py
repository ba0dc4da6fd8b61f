"""Create the job, or re-attach to it: the name comes from the KFP run id, so a retried step or run finds its own
job. A running or succeeded job with our spec digest is re-attached to; a failed one is deleted, waited for, and
created again as the next attempt; one with another digest is refused and never touched. The API server must keep
every field sent (an older CRD prunes what it does not know)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

from kubernetes.client.exceptions import ApiException

from common.errors import StepFailed
from components.kube import Kube, describe
from components.launch_training.apis import api_of
from components.launch_training.cancel import Cancelled, delete_job
from components.launch_training.job_api import JobApi
from components.launch_training.manifest import ATTEMPT_ANNOTATION
from components.launch_training.pods import get_job, job_pods
from components.launch_training.rendering import SPEC_HASH_ANNOTATION

log = logging.getLogger(__name__)


def create_or_attach(
    kube: Kube, job: dict[str, Any], replace_timeout_s: float = 600, cancel: threading.Event | None = None
) -> tuple[dict[str, Any], bool, int]:
    """The job as stored, whether it already existed (a retried step re-attaches), and its attempt number.

    The name comes from the pipeline run, so a retried step, and a retried run (KFP's run-level Retry keeps the run
    id), meet the job of an earlier attempt: a running or succeeded one is re-attached to; a failed one, or one
    being deleted (a cancelled attempt), is deleted and waited for, and the job created again as the next attempt
    (the trainer resumes from the run's checkpoint). A job of the same name with another spec digest is not ours to
    touch: refused, never deleted.
    """
    api = api_of(job)
    ns, name = job["metadata"]["namespace"], job["metadata"]["name"]
    created = _create(kube, api, job, attempt=1)
    if created is not None:
        return created, False, 1
    existing = get_job(kube, api, ns, name)
    ours = job["metadata"]["annotations"][SPEC_HASH_ANNOTATION]
    theirs = existing.get("metadata", {}).get("annotations", {}).get(SPEC_HASH_ANNOTATION)
    if theirs != ours:
        raise StepFailed(
            f"{api.kind} {ns}/{name} already exists with a different spec (spec digest {theirs} here, "
            f"{ours} asked for): delete it, or run with another run id"
        )
    attempt = _attempt(existing)
    uid = existing["metadata"]["uid"]
    if existing["metadata"].get("deletionTimestamp"):
        log.warning(
            "%s %s/%s of attempt %d is being deleted: waiting for it to go, then starting attempt %d",
            api.kind,
            ns,
            name,
            attempt,
            attempt + 1,
        )
    elif api.is_failed(existing):
        condition = api.latest_condition(existing) or {}
        log.warning(
            "%s %s/%s of attempt %d failed (%s: %s): deleting it to train again as attempt %d",
            api.kind,
            ns,
            name,
            attempt,
            condition.get("reason", ""),
            condition.get("message", ""),
            attempt + 1,
        )
        delete_job(kube, api, ns, name, uid)
    else:
        state = (api.latest_condition(existing) or {}).get("type", "Created")
        log.info(
            "%s %s/%s of attempt %d already exists with this spec (%s): re-attaching",
            api.kind,
            ns,
            name,
            attempt,
            state,
        )
        return existing, True, attempt
    wait_until_gone(kube, api, ns, name, uid, replace_timeout_s, cancel)
    created = _create(kube, api, job, attempt=attempt + 1)
    if created is None:
        raise StepFailed(
            f"{api.kind} {ns}/{name} was created again by someone else while attempt {attempt}'s was being deleted"
        )
    log.info("attempt %d: created %s %s/%s again", attempt + 1, api.kind, ns, name)
    return created, False, attempt + 1


def _attempt(job: dict[str, Any]) -> int:
    try:
        return max(1, int(job["metadata"].get("annotations", {}).get(ATTEMPT_ANNOTATION, "1")))
    except ValueError:
        return 1


def _create(kube: Kube, api: JobApi, job: dict[str, Any], attempt: int) -> dict[str, Any] | None:
    """The created job, or None when one of that name exists (409)."""
    ns, name = job["metadata"]["namespace"], job["metadata"]["name"]
    annotations = {**job["metadata"]["annotations"], ATTEMPT_ANNOTATION: str(attempt)}
    body = {**job, "metadata": {**job["metadata"], "annotations": annotations}}
    try:
        created = kube.call(
            f"create {api.kind}",
            kube.custom.create_namespaced_custom_object,
            api.group,
            api.version,
            ns,
            api.plural,
            body,
        )
    except ApiException as exc:
        if exc.status == 409:
            return None
        raise StepFailed(f"creating {api.kind} {ns}/{name}: {describe(exc)}") from None
    check_nothing_pruned(api, body, created)
    log.info("created %s %s/%s (attempt %d)", api.kind, ns, name, attempt)
    return created


def wait_until_gone(
    kube: Kube,
    api: JobApi,
    ns: str,
    name: str,
    uid: str,
    timeout_s: float,
    cancel: threading.Event | None = None,
    poll_s: float = 1.0,
) -> None:
    """Until the deleted job is gone, then what its controller made under its name and its pods.

    A foreground-deleted job stays, with its finalizer, until its pods have terminated (their grace period); a
    TrainJob, deleted in the background, goes at once and its JobSet and pods after it: one still there would be
    taken for the new attempt's (Trainer copies its Failed condition onto the new TrainJob), and its pods' SIGTERM
    checkpoints must be written before a new attempt starts.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            current = get_job(kube, api, ns, name)
        except ApiException as exc:
            if exc.status != 404:
                raise
            current = None
        if current is not None and current["metadata"]["uid"] != uid:
            return  # ours is gone; whoever made the new one, creating ours will tell
        left = f"{api.kind} {ns}/{name}" if current is not None else _leftovers(kube, api, ns, name)
        if not left:
            return
        if time.monotonic() > deadline:
            finalizers = f" (finalizers {current['metadata'].get('finalizers', [])})" if current is not None else ""
            raise StepFailed(
                f"{left} of an earlier attempt of {api.kind} {ns}/{name} is still there {timeout_s:.0f}s "
                f"after its deletion{finalizers}: its pods may be stuck Terminating; check `kubectl get "
                f"pods -l {api.pod_selector(name)}`"
            )
        if cancel is not None and cancel.is_set():
            raise Cancelled(f"cancelled while {api.kind} {ns}/{name} of an earlier attempt was being deleted")
        time.sleep(poll_s)


def _leftovers(kube: Kube, api: JobApi, ns: str, name: str) -> str:
    """What of a deleted job is still there: its children of its name (a TrainJob's JobSet), else its pods; "" when
    nothing is."""
    for group, version, plural in api.children:
        try:
            kube.call(f"get {plural}", kube.custom.get_namespaced_custom_object, group, version, ns, plural, name)
            return f"{plural} {ns}/{name}"
        except ApiException as exc:
            if exc.status != 404:
                raise
    pods = job_pods(kube, api, ns, name)
    return f"{len(pods)} pod(s)" if pods else ""


def leaf_paths(obj: Any, prefix: str = "") -> Iterator[str]:
    if isinstance(obj, dict):
        for key, value in obj.items():
            yield from leaf_paths(value, f"{prefix}.{key}" if prefix else key)
    elif isinstance(obj, list):
        for i, value in enumerate(obj):
            yield from leaf_paths(value, f"{prefix}[{i}]")
    else:
        yield prefix


def check_nothing_pruned(api: JobApi, sent: dict[str, Any], stored: dict[str, Any]) -> None:
    """The API server drops fields its CRD schema does not know, silently: fail loudly instead."""
    kept = set(leaf_paths(stored.get("spec", {})))
    lost = [p for p in leaf_paths(sent["spec"]) if p not in kept]
    if lost:
        raise StepFailed(
            f"the API server dropped {', '.join('spec.' + p for p in lost[:5])} from the {api.kind}: {api.crd}"
        )
