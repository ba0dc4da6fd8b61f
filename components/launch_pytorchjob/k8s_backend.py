"""The Kubernetes backend: create (or re-attach to) the job, watch it to the end, stream its logs.

Written once for both job APIs (a PyTorchJob or a TrainJob): what differs between them is asked of the job's
`JobApi` (job_api.py), never tested for here.

- Create: the name comes from the KFP run id, so a retried step or run finds its own job. A running or
  succeeded job with our spec digest is re-attached to; a failed one is deleted, waited for, and created again
  as the next attempt; one with another digest is refused and never touched.
- Watch: a watch on the one job, resumed after dropped streams and 410 Gone (by reading the job again),
  falling back to polling when watching is refused; conditions and pod phases are logged as they change.
- Logs: node 0's (or every node's) log is streamed into this step's log, prefixed by pod, waiting
  through Pending, following the node's pod when it is replaced (a TrainJob's restart names it anew), and
  reconnecting without repeating lines (timestamps mark where it stopped), also when a
  stream falls silent (a read timeout); a container that restarted between two reads has its previous
  instance's rest read first. Logs are for people: an unreadable one (no kubelet answers) is retried with a
  growing pause and never fails the launch.
- Diagnosis: every few seconds the job's pods and their events, and every streamed log line, are matched to
  the troubleshooting table (diagnosis.py); each symptom is logged once as it happens.
- Deadlines (deadlines.py): queued (suspended by Kueue), never started (pods Pending), running below its minimum
  of pods (a lost node), and the training deadline, each its own; past one the job is deleted and the step fails.
- The end: Succeeded returns; Failed raises with the condition's reason, the trainer's own account from the
  volume (evidence.py) or what the pods showed at their restarts, and the diagnosis; a SIGTERM (KFP terminating
  the run) deletes the job from the signal handler itself, then again from the loop, and raises.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from kubernetes.client.exceptions import ApiException
from kubernetes.watch import Watch

from common.errors import StepFailed
from components.kube import Kube, api_client_from_environment, describe, is_transient
from components.launch_pytorchjob.cancel import Cancelled, ImmediateDelete, SigtermToEvent, delete_job
from components.launch_pytorchjob.core import LaunchConfig, LaunchResult
from components.launch_pytorchjob.deadlines import Deadlines
from components.launch_pytorchjob.diagnosis import Diagnosis
from components.launch_pytorchjob.evidence import TrainerEvidence, last_lines_of_every_rank, read_evidence
from components.launch_pytorchjob.job_api import JobApi, api_of
from components.launch_pytorchjob.manifest import ATTEMPT_ANNOTATION, AUTO_RESUME, SPEC_HASH_ANNOTATION, render_job
from components.launch_pytorchjob.progress import TrainingWatch
from components.launch_pytorchjob.restarts import Restarts
from components.launch_pytorchjob.trainjob import runtime_grace_period

log = logging.getLogger(__name__)

TAIL_LINES = 40
LOG_DRAIN_S = 10.0  # after the job ends, how long its log streams may take to reach their end
DIAGNOSE_EVERY_S = 10.0  # how often the job's pods and events are read for the diagnosis
EVENT_READS_PER_TICK = 4  # Pending pods whose events are read each time


@dataclass(frozen=True)
class WatchSettings:
    deadline_s: float = 0  # 0: none; time spent queued (suspended by Kueue) does not count
    watch_timeout_s: int = 60  # each watch request ends after this and is reopened
    poll_interval_s: float = 10.0  # when watching is refused
    logs: str = "worker-0"  # or "all" or "none"
    log_reconnect_s: float = 1.0  # after a stream ends or a read fails; doubled per failed read, up to the max
    log_reconnect_max_s: float = 15.0
    # A log stream from a node that went away sends nothing and never closes: past this silence it is reopened
    # (from where it stopped, so nothing repeats). Quiet trainers cost a reconnect, nothing else.
    log_read_timeout_s: float = 120.0
    # Until the job first runs with its minimum of pods: pods Pending this long, or no pods this long after it could
    # run (created, or admitted), delete it (0: never).
    pending_timeout_s: float = 0
    # With no Pending deadline: an admitted job whose operator reported it could not make its pods (a Warning event
    # on the job) and made none this long is deleted all the same: such a job would wait for ever.
    creation_timeout_s: float = 600
    # After that: fewer than the minimum running this long (a lost node not yet replaced) deletes it (0: never).
    recovery_timeout_s: float = 0
    queue_timeout_s: float = 0  # suspended (queued by Kueue) this long deletes it (0: wait as long as it takes)
    replace_timeout_s: float = 600  # a failed earlier attempt's job must be gone within this before a new one
    # A Failed job with HyperPod auto-resume on is watched this long more, in case auto-resume brings it back (0: no).
    auto_resume_wait_s: float = 0
    diagnose_every_s: float = DIAGNOSE_EVERY_S
    training_check_s: float = 5.0  # how often the trainer's status.json on the volume is read (progress.py)


@dataclass
class JobOutcome:
    name: str
    namespace: str
    state: str  # Succeeded, Failed, DeadlineExceeded, Cancelled
    reattached: bool
    attempt: int  # 1 for the run's first job; +1 each time a failed one was replaced
    queued_s: float | None  # creation to Running
    running_s: float | None  # Running to the end
    restarts: int
    conditions: list[dict[str, Any]] = field(default_factory=list)
    diagnosis: list[str] = field(default_factory=list)  # what went wrong on the way, one line each


# -- create or re-attach ----------------------------------------------------------------------------------


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


def get_job(kube: Kube, api: JobApi, ns: str, name: str) -> dict[str, Any]:
    return kube.call(
        f"get {api.kind}", kube.custom.get_namespaced_custom_object, api.group, api.version, ns, api.plural, name
    )


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


# -- watching ---------------------------------------------------------------------------------------------


class Reader(threading.Thread):
    """A thread that reads one long response at a time (a watch, a followed log) until `stop` is set. A blocked read
    would notice `stop` only at its next byte or its read timeout (minutes), and the launch would return with the
    thread still reading, logging and making loggers: `interrupt()` ends the read at once from another thread
    (urllib3's `HTTPResponse.shutdown`, 2.3+)."""

    def __init__(self, name: str, stop: threading.Event):
        super().__init__(name=name, daemon=True)
        self.stop = stop
        self._response: Any = None

    def reading(self, response: Any) -> Any:
        """Note the response being read (ended at once when `stop` is already set); returns it."""
        self._response = response
        if self.stop.is_set():
            self.interrupt()
        return response

    def watch(
        self, kube: Kube, settings: WatchSettings, listing: Callable[..., Any], *args: Any, **kwargs: Any
    ) -> tuple[Watch, Any]:
        """A watch through `listing` (a list call of the client), each request ending after settings.watch_timeout_s,
        its response one `interrupt()` ends."""

        @functools.wraps(listing)  # Watch reads the docstring for what to deserialize
        def opened(*args: Any, **kwargs: Any) -> Any:
            return self.reading(listing(*args, **kwargs))

        watch = Watch()
        limits = {
            "timeout_seconds": settings.watch_timeout_s,
            "_request_timeout": (kube.settings.request_timeout_s, settings.watch_timeout_s + 15),
        }
        return watch, watch.stream(opened, *args, **kwargs, **limits)

    def interrupt(self) -> None:
        response = self._response
        if response is not None:
            with contextlib.suppress(Exception):  # already read to its end, or released to the pool
                response.shutdown()


def end_readers(readers: list[Reader], stop: threading.Event, timeout_s: float = 5.0) -> None:
    """Stop every reader and wait (bounded) until each has returned."""
    stop.set()
    for reader in readers:
        reader.interrupt()
    until = time.monotonic() + timeout_s
    for reader in readers:
        reader.join(timeout=max(0.0, until - time.monotonic()))
        if reader.is_alive():
            log.debug("%s did not end within %.0fs of the launch's end", reader.name, timeout_s)


class JobWatcher(Reader):
    """Puts every new state of the job on `updates`: a watch, resumed and re-listed as needed, or polling."""

    def __init__(self, kube: Kube, job: dict[str, Any], settings: WatchSettings, stop: threading.Event):
        super().__init__("job-watch", stop)
        self.kube, self.settings = kube, settings
        self.api = api_of(job)
        self.ns, self.name = job["metadata"]["namespace"], job["metadata"]["name"]
        self.resource_version = job["metadata"].get("resourceVersion")
        self.updates: queue.Queue[dict[str, Any] | BaseException] = queue.Queue()
        self.polling = False

    def run(self) -> None:
        try:
            self._run()
        except BaseException as exc:  # anything unexpected reaches the launcher, which must not wait forever
            self.updates.put(exc)

    def _run(self) -> None:
        failures = 0
        while not self.stop.is_set():
            try:
                if self.polling:
                    self.updates.put(self._get())
                    self.stop.wait(self.settings.poll_interval_s)
                    continue
                self._watch_once()
                failures = 0
            except ApiException as exc:
                if exc.status == 410:  # our resourceVersion is too old: read the job, watch from there
                    log.info("watch expired (410 Gone); reading the job and watching again")
                    self._relist()
                elif exc.status in (403, 405):
                    log.warning(
                        "cannot watch %ss (%s): polling every %gs instead",
                        self.api.kind,
                        describe(exc),
                        self.settings.poll_interval_s,
                    )
                    self.polling = True
                elif is_transient(exc):
                    failures += 1
                    self._pause(failures, exc)
                else:
                    self.updates.put(exc)
                    return
            except Exception as exc:
                if not is_transient(exc):
                    self.updates.put(exc)
                    return
                failures += 1
                self._pause(failures, exc)

    def _pause(self, failures: int, exc: BaseException) -> None:
        if self.stop.is_set():
            return
        delay = min(8.0, 0.25 * 2 ** (failures - 1))
        log.info("watch interrupted (%s); reconnecting in %.1fs", describe(exc), delay)
        if failures >= 3:
            self._relist()  # what changed while we were away
        self.stop.wait(delay)

    def _get(self) -> dict[str, Any]:
        return get_job(self.kube, self.api, self.ns, self.name)

    def _relist(self) -> None:
        job = self._get()
        self.resource_version = job["metadata"]["resourceVersion"]
        self.updates.put(job)

    def _watch_once(self) -> None:
        watch, stream = self.watch(
            self.kube,
            self.settings,
            self.kube.custom.list_namespaced_custom_object,
            self.api.group,
            self.api.version,
            self.ns,
            self.api.plural,
            field_selector=f"metadata.name={self.name}",
            resource_version=self.resource_version,
        )
        try:
            for event in stream:
                obj = event["raw_object"]
                self.resource_version = obj["metadata"]["resourceVersion"]
                if event["type"] == "DELETED":
                    self.updates.put(StepFailed(f"{self.api.kind} {self.ns}/{self.name} was deleted by someone else"))
                    self.stop.set()
                    return
                self.updates.put(obj)
                if self.stop.is_set():
                    return
        finally:
            watch.stop()


class PodWatcher(Reader):
    """Puts every state of the job's pods on `pods`: a list, then a watch from it, both again after an interruption.
    A pod that its operator deletes and makes anew after a failure lives for moments between two readings of the
    diagnosis; the restart budget counts each (restarts.py). Without the watch verb it says so once and stops: the
    diagnosis's readings still count what they see."""

    def __init__(self, kube: Kube, api: JobApi, ns: str, name: str, settings: WatchSettings, stop: threading.Event):
        super().__init__("pod-watch", stop)
        self.kube, self.api, self.ns, self.settings = kube, api, ns, settings
        self.selector = api.pod_selector(name)
        self.pods: queue.Queue[Any] = queue.Queue()

    def run(self) -> None:
        failures = 0
        while not self.stop.is_set():
            try:
                listed = self.kube.call(
                    "list pods", self.kube.core.list_namespaced_pod, self.ns, label_selector=self.selector
                )
                for pod in listed.items:
                    self.pods.put(pod)
                self._watch_from(listed.metadata.resource_version)
                failures = 0
            except Exception as exc:
                if not is_transient(exc) and not isinstance(exc, StepFailed):
                    if not self.stop.is_set():
                        log.warning(
                            "not watching the job's pods (%s): restarts are counted as the diagnosis reads "
                            "them, every %gs",
                            describe(exc),
                            self.settings.diagnose_every_s,
                        )
                    return
                failures += 1
                self.stop.wait(min(8.0, 0.25 * 2 ** (failures - 1)))

    def _watch_from(self, resource_version: str) -> None:
        watch, stream = self.watch(
            self.kube,
            self.settings,
            self.kube.core.list_namespaced_pod,
            self.ns,
            label_selector=self.selector,
            resource_version=resource_version,
        )
        try:
            for event in stream:
                if event["type"] in ("ADDED", "MODIFIED"):
                    self.pods.put(event["object"])
                if self.stop.is_set():
                    return
        finally:
            watch.stop()


def drained(pods: queue.Queue[Any]) -> list[Any]:
    taken = []
    with contextlib.suppress(queue.Empty):
        while True:
            taken.append(pods.get_nowait())
    return taken


# -- logs -------------------------------------------------------------------------------------------------


def stamp_key(stamp: str) -> tuple[str, int]:
    """An RFC 3339 timestamp as the kubelet writes it (UTC, up to 9 fraction digits, trailing zeros cut), sortable."""
    base, _, rest = stamp.partition(".")
    digits = "".join(c for c in rest if c.isdigit())
    return base[:19], int(digits.ljust(9, "0")[:9] or 0)


class LogStreamer(Reader):
    """Follows one node's log into ours, prefixed by pod; reconnects where it stopped, never repeating a line.

    The node's pod is looked up by label at each connection: a PyTorchJob's is recreated under its name, a TrainJob's
    restarted group brings pods of new names; lines are kept in order by their timestamps either way.
    """

    def __init__(
        self,
        kube: Kube,
        api: JobApi,
        namespace: str,
        job_name: str,
        node: int,
        settings: WatchSettings,
        stop: threading.Event,
        on_line: Callable[[str, str], None] = lambda pod, text: None,
    ):
        super().__init__(f"log-{job_name}-{node}", stop)
        self.kube, self.api, self.ns, self.settings = kube, api, namespace, settings
        self.selector = api.node_selector(job_name, node)
        self.pod = ""  # the node's pod at the last connection
        self.on_line = on_line
        self.job_done = threading.Event()  # set when the job ended: the next complete read is the last
        self.last: tuple[str, int] = ("", 0)  # timestamp of the last line printed
        self.printed_at_last = 0  # lines printed with exactly that timestamp
        self.restarts_read = 0  # the container's restart count at the last read
        self.lines = 0
        self.out = logging.getLogger("pod")

    def run(self) -> None:
        """Logs are for people: a log that cannot be read (no kubelet answers: the API server's 500) is retried with
        a growing pause and never fails the launch; the job's status decides."""
        delay = self.settings.log_reconnect_s
        while not self.stop.is_set():
            done = self.job_done.is_set()
            try:
                printed = self.lines
                self._follow(done)
                # After the job ended, a read that ends cleanly may still have been cut short (a kubelet restarting):
                # read again until a read brings nothing new.
                if done and self.lines == printed:
                    return
                delay = self.settings.log_reconnect_s
            except ApiException as exc:
                if self.stop.is_set():
                    return
                # 400: "waiting to start" (Pending, pulling the image); 404: not created yet, or being replaced
                if exc.status not in (400, 404) and not is_transient(exc):
                    log.warning("stopped streaming %s's log: %s", self.pod, describe(exc))
                    return
                if done:
                    log.info("the last lines of %s could not be read (%s)", self.pod, describe(exc))
                    return
                if is_transient(exc) and delay == self.settings.log_reconnect_s:
                    log.info(
                        "%s's log is not readable now (%s): retrying with a growing pause", self.pod, describe(exc)
                    )
                delay = min(self.settings.log_reconnect_max_s, delay * 2)
            except Exception as exc:  # a dropped or silent stream: urllib3 and socket errors, the read timeout
                if self.stop.is_set():
                    return  # the read was interrupted: the launch has ended
                if not is_transient(exc) and not isinstance(exc, OSError):
                    log.warning("stopped streaming %s's log: %s", self.pod, describe(exc))
                    return
                if done:
                    return
                log.info("log stream of %s interrupted (%s): reconnecting", self.pod, describe(exc))
            if not self.job_done.is_set():
                self.job_done.wait(delay)

    def interrupt(self) -> None:
        """Also ends a pause between reads (it waits on job_done): a launch that gives up before the job ends must
        not wait for a node's pause, up to log_reconnect_max_s, to end."""
        if self.stop.is_set():
            self.job_done.set()
        super().interrupt()

    def _follow(self, done: bool = False) -> None:
        """The rest of the container's previous instance, if it restarted since the last read (a crash between two
        reads, or before the first), then the current one: followed while the job runs, read whole once it ended."""
        if self.restarted_since_last_read():
            with contextlib.suppress(ApiException):  # 400: no previous instance
                self._read(previous=True)
        self._read(previous=False, follow=not done)

    def restarted_since_last_read(self) -> bool:
        """Find the node's pod (the newest, unless it is being deleted and an older one is not); whether its
        container's restart count moved since the last read (always, before the first read of a pod). No pod yet:
        the 404 a missing pod's log would answer."""
        timeout = self.kube.settings.request_timeout_s
        pods = self.kube.core.list_namespaced_pod(self.ns, label_selector=self.selector, _request_timeout=timeout).items
        if not pods:
            raise ApiException(status=404, reason=f"no pod matches {self.selector} yet")
        pod = max(pods, key=lambda p: (p.metadata.deletion_timestamp is None, p.metadata.creation_timestamp))
        if pod.metadata.name != self.pod:
            self.pod, self.restarts_read = pod.metadata.name, 0
            self.out = logging.getLogger(f"pod.{self.pod}")
        statuses = [s for s in pod.status.container_statuses or [] if s.name == self.api.container]
        count = statuses[0].restart_count or 0 if statuses else 0
        moved, self.restarts_read = count != self.restarts_read, count
        return moved and count > 0

    def _read(self, previous: bool, follow: bool = False) -> None:
        kwargs: dict[str, Any] = {"previous": True} if previous else {"follow": follow}
        if self.last[0]:  # ask from a little before the last line; what was printed is skipped
            last = datetime.fromisoformat(self.last[0] + "+00:00").timestamp()
            kwargs["since_seconds"] = max(1, math.ceil(time.time() - last) + 1)
        response = self.reading(
            self.kube.core.read_namespaced_pod_log(
                self.pod,
                self.ns,
                container=self.api.container,
                timestamps=True,
                _preload_content=False,
                _request_timeout=(self.kube.settings.request_timeout_s, self.settings.log_read_timeout_s),
                **kwargs,
            )
        )
        skip = self.printed_at_last
        try:
            pending = b""
            for chunk in response.stream(64 * 1024, decode_content=False):
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    stamp, _, text = line.decode("utf-8", errors="replace").partition(" ")
                    key = stamp_key(stamp)
                    if key < self.last:
                        continue
                    if key == self.last and skip > 0:
                        skip -= 1
                        continue
                    if key != self.last:
                        self.last, self.printed_at_last = key, 0
                    self.printed_at_last += 1
                    self.lines += 1
                    self.out.info("%s", text)
                    self.on_line(self.pod, text)
                if self.stop.is_set():
                    return
        finally:
            response.release_conn()


# -- the run ----------------------------------------------------------------------------------------------


def job_pods(kube: Kube, api: JobApi, ns: str, name: str) -> list[Any]:
    return kube.call("list pods", kube.core.list_namespaced_pod, ns, label_selector=api.pod_selector(name)).items


def pod_summary(api: JobApi, name: str, pods: list[Any]) -> str:
    """'worker-0 Running, worker-1 Pending', from the job's pods."""
    phases = [
        f"{api.pod_label(pod.metadata.name, name)} {pod.status.phase}"
        for pod in sorted(pods, key=lambda p: p.metadata.name)
    ]
    return ", ".join(phases) or "no pods yet"


def describe_failure(kube: Kube, api: JobApi, ns: str, name: str) -> dict[str, str]:
    """Log the failing pod's last lines and its events, so the step's log says why without kubectl; returns the
    last lines read, by pod (none when the pods are gone)."""
    pods = job_pods(kube, api, ns, name)

    def failed(pod: Any) -> bool:
        for status in pod.status.container_statuses or []:
            for state in (status.state, status.last_state):
                if state and state.terminated and state.terminated.exit_code:
                    return True
        return pod.status.phase == "Failed"

    culprits = [p for p in pods if failed(p)] or pods[:1]
    tails: dict[str, str] = {}
    for pod in culprits[:2]:
        pod_name = pod.metadata.name
        try:
            text = kube.read_for_people(
                "read log",
                kube.core.read_namespaced_pod_log,
                pod_name,
                ns,
                container=api.container,
                tail_lines=TAIL_LINES,
            )
            log.error("last %d lines of %s:\n%s", TAIL_LINES, pod_name, text.rstrip() or "(empty)")
            if failed(pod) and text.strip():
                tails[pod_name] = "last lines: " + " | ".join(text.strip().splitlines()[-8:])
        except (ApiException, StepFailed) as exc:  # no kubelet answers: the API server's 500, retried, then this
            log.error("cannot read %s's log: %s", pod_name, describe(exc))
        try:
            events = kube.call(
                "list events", kube.core.list_namespaced_event, ns, field_selector=f"involvedObject.name={pod_name}"
            ).items
            lines = [f"  {e.type} {e.reason}: {e.message}" for e in events] or ["  (none)"]
            log.error("events of %s:\n%s", pod_name, "\n".join(lines))
        except ApiException as exc:
            if exc.status == 403:
                log.error(
                    "events of %s: not readable by this service account (%s); add 'list events' to its "
                    "Role (deploy/rbac.yaml) to see them here",
                    pod_name,
                    describe(exc),
                )
            else:
                log.error("events of %s: %s", pod_name, describe(exc))
    return tails


def current_lines(kube: Kube, api: JobApi, ns: str, pod: str) -> str:
    """The last lines of the container as it is (a failed pod's, before it is deleted)."""
    try:
        return kube.read_for_people(
            "read log", kube.core.read_namespaced_pod_log, pod, ns, container=api.container, tail_lines=TAIL_LINES
        )
    except (ApiException, StepFailed):  # logs are for people
        return ""


def last_lines(kube: Kube, api: JobApi, ns: str, pod: str) -> str:
    """The last lines of the container's previous run (a crash-looping container's own is about to restart)."""
    try:
        return kube.read_for_people(
            "read log",
            kube.core.read_namespaced_pod_log,
            pod,
            ns,
            container=api.container,
            tail_lines=TAIL_LINES,
            previous=True,
        )
    except (ApiException, StepFailed):  # logs are for people: an unreadable one never ends the launch
        return ""


class Diagnoser:
    """Reads the job's pods and their events for the diagnosis, at most every `every_s`.

    Also keeps what will be gone when the job fails: with restartPolicy OnFailure the Training Operator deletes every
    pod at the backoff limit, so the last lines of each container that exited are read at its restart; a TrainJob's
    failed pod (restartPolicy Never) goes when JobSet restarts the group, so its last lines are read once it failed.
    """

    def __init__(self, kube: Kube, api: JobApi, ns: str, name: str, diagnosis: Diagnosis, every_s: float):
        self.kube, self.api, self.ns, self.name = kube, api, ns, name
        self.diagnosis, self.every_s = diagnosis, every_s
        self.next_at = 0.0
        self.events_readable = True
        self.pods: list[Any] | None = None  # the last list read; None until one was
        self.restart_tails: dict[str, str] = {}  # pod -> "exit code N; last lines: ..." of its last restart
        self._restarts_seen: dict[str, int] = {}
        self._restart_lines: dict[str, tuple[int, str]] = {}  # pod -> (restart, its last lines) last read
        self._event_turn = 0  # where the next reading of Pending pods' events starts
        # Set by the launcher while the job may run (admitted) but has not started: with no pod to look at, the job's
        # own events (a TrainJob's, and its JobSet's of the same name) say why its operator made none.
        self.awaiting_pods = False

    def tick(self, force: bool = False) -> None:
        if not force and time.monotonic() < self.next_at:
            return
        self.next_at = time.monotonic() + self.every_s
        try:  # the diagnosis helps; it never stops the launch
            pods = job_pods(self.kube, self.api, self.ns, self.name)
        except (ApiException, StepFailed) as exc:
            log.warning("diagnosis: cannot list the job's pods: %s", describe(exc))
            return
        self.pods = pods
        events: list[Any] = []
        for pod in self._events_to_read(pods):
            try:
                events += self.kube.call(
                    "list events",
                    self.kube.core.list_namespaced_event,
                    self.ns,
                    field_selector=f"involvedObject.kind=Pod,involvedObject.name={pod}",
                ).items
            except (ApiException, StepFailed) as exc:
                self.events_readable = False  # the pods' statuses still tell most of it
                log.info("diagnosis: without events (%s)", describe(exc))
                break
        self.diagnosis.observe(pods, events)
        if self.awaiting_pods and self.events_readable and not [p for p in pods if not p.metadata.deletion_timestamp]:
            try:
                self.diagnosis.observe_job_events(
                    self.kube.call(
                        "list events",
                        self.kube.core.list_namespaced_event,
                        self.ns,
                        field_selector=f"involvedObject.name={self.name},type=Warning",
                    ).items
                )
            except (ApiException, StepFailed) as exc:
                self.events_readable = False
                log.info("diagnosis: without events (%s)", describe(exc))
        self._keep_restart_tails(pods)

    def _events_to_read(self, pods: list[Any]) -> list[str]:
        """The Pending pods whose events to read this time: the scheduler's and the image puller's words are all the
        diagnosis takes from events, and a Pending pod is where they are. Each pod's own (KFP's pods share the
        namespace), a few a time, in turn; none while the job runs."""
        waiting = sorted(p.metadata.name for p in pods if p.status.phase == "Pending")
        if not (self.events_readable and waiting):
            return []
        start = self._event_turn % len(waiting)
        self._event_turn += EVENT_READS_PER_TICK
        return (waiting[start:] + waiting[:start])[:EVENT_READS_PER_TICK]

    def _keep_restart_tails(self, pods: list[Any]) -> None:
        for pod in pods:
            for status in pod.status.container_statuses or []:
                name = pod.metadata.name
                ended = status.state.terminated if status.state else None
                if pod.status.phase == "Failed" and ended is not None and name not in self.restart_tails:
                    tail = current_lines(self.kube, self.api, self.ns, name).strip().splitlines()[-8:]
                    lines = f"; last lines: {' | '.join(tail)}" if tail else ""
                    self.restart_tails[name] = f"exit code {ended.exit_code} ({ended.reason}){lines}"
                    log.warning("%s failed (%s)", name, self.restart_tails[name])
                count = status.restart_count or 0
                last = status.last_state.terminated if status.last_state else None
                if count <= self._restarts_seen.get(name, 0) or last is None:
                    continue
                self._restarts_seen[name] = count
                tail = last_lines(self.kube, self.api, self.ns, name).strip().splitlines()[-8:]
                lines = f"; last lines: {' | '.join(tail)}" if tail else ""
                if not tail and name in self._restart_lines:  # unreadable now (the pod going): the earlier ones
                    lines = (
                        f"; last lines before restart {self._restart_lines[name][0]}: {self._restart_lines[name][1]}"
                    )
                elif tail:
                    self._restart_lines[name] = (count, " | ".join(tail))
                self.restart_tails[name] = f"exit code {last.exit_code} ({last.reason}) at restart {count}{lines}"
                log.warning("%s restarted (%s)", name, self.restart_tails[name])


def not_started_for(diagnoser: Diagnoser, diagnosis: Diagnosis, deadlines: Deadlines) -> tuple[str, float]:
    """What keeps a job that has not started, and for how long, from the pods last read: pods Pending count from the
    oldest one; no pods at all, from when the job could run (created, or admitted by Kueue), since an operator that
    cannot make them says so only in its events."""
    if any(not p.metadata.deletion_timestamp for p in diagnoser.pods or []):
        return "pods Pending", diagnosis.pending_for()
    return "no pods made", deadlines.runnable_for()


def run_job(
    kube: Kube,
    job: dict[str, Any],
    settings: WatchSettings,
    cancel: threading.Event,
    diagnosis: Diagnosis | None = None,
    evidence: Callable[[], TrainerEvidence | None] = lambda: None,
    on_owned: Callable[[str], None] = lambda uid: None,
    training: TrainingWatch | None = None,
) -> JobOutcome:
    """Create or re-attach, then follow the job to its end. `cancel` set (by SIGTERM): delete and raise.

    `evidence` reads the trainer's own account of a failure (its logs on the volume); `on_owned` is told the uid of
    the job once it is known to be ours (created, or re-attached with our spec digest); `training` reads the
    trainer's progress: a permanent failure or a stall deletes the job (restarts would not help).
    """
    api = api_of(job)
    ns, name = job["metadata"]["namespace"], job["metadata"]["name"]
    diagnosis = diagnosis or Diagnosis(name, last_lines=lambda pod: last_lines(kube, api, ns, pod))
    diagnoser = Diagnoser(kube, api, ns, name, diagnosis, settings.diagnose_every_s)
    min_pods, workers = api.nodes(job)
    deadlines = Deadlines(min_pods, api)
    if min_pods < workers:
        diagnosis.min_pods = min_pods  # elastic: pods beyond the minimum may wait for room
    stored, reattached, attempt = create_or_attach(kube, job, settings.replace_timeout_s, cancel)
    uid = stored["metadata"]["uid"]
    on_owned(uid)
    started = time.monotonic()
    stop = threading.Event()
    watcher = JobWatcher(kube, stored, settings, stop)
    watcher.updates.put(stored)
    watcher.start()
    restart_count, restart_limit = Restarts(), api.restart_limit(stored)
    pod_watcher = PodWatcher(kube, api, ns, name, settings, stop)
    pod_watcher.start()
    nodes = {"none": [], "all": list(range(workers))}.get(settings.logs, [0])
    streamers = [LogStreamer(kube, api, ns, name, node, settings, stop, diagnosis.observe_line) for node in nodes]
    for streamer in streamers:
        streamer.start()
    last_seen, current = None, stored
    next_training_check = 0.0
    auto_resumed = (job["metadata"].get("annotations") or {}).get(AUTO_RESUME) == "true"
    failed_at: float | None = None  # Failed, and waiting for auto-resume to bring it back

    def give_up(why: str) -> None:
        diagnoser.tick(force=True)  # one more look before the job goes: the reason given is the latest
        phases = pod_summary(api, name, job_pods(kube, api, ns, name))
        describe_failure(kube, api, ns, name)  # a pod stuck in Pending says why in its events
        delete_job(kube, api, ns, name, uid)
        raise StepFailed(f"{api.kind} {ns}/{name} {why} (pods: {phases}){_why(diagnosis)}; it was deleted")

    try:
        while True:
            if cancel.is_set():
                log.warning("SIGTERM: the run is being terminated; deleting %s %s/%s", api.kind, ns, name)
                delete_job(kube, api, ns, name, uid)
                raise Cancelled(f"cancelled: {api.kind} {ns}/{name} deleted on SIGTERM")
            if settings.deadline_s and deadlines.active_time(started) > settings.deadline_s:
                last = (api.latest_condition(current) or {}).get("type", "none")
                give_up(
                    f"did not finish within {settings.deadline_s:.0f}s (not counting time queued; last state: {last})"
                )
            if failed_at is not None and time.monotonic() - failed_at > settings.auto_resume_wait_s:
                log.warning(
                    "%s %s/%s stayed Failed for %.0fs: auto-resume did not bring it back",
                    api.kind,
                    ns,
                    name,
                    settings.auto_resume_wait_s,
                )
                break
            diagnoser.awaiting_pods = not deadlines.queued and not deadlines.started
            diagnoser.tick()
            if diagnoser.pods is not None:
                deadlines.pods_changed(diagnoser.pods, current)
                diagnosis.started = deadlines.started
            if deadlines.queued or api.is_failed(current):
                restart_count.forget_pods()  # Kueue's preemption, HyperPod's auto-resume: pods made anew by design
            # the watch's states in order; the diagnosis's readings where the watch is refused
            for pod in drained(pod_watcher.pods) + ([] if pod_watcher.is_alive() else diagnoser.pods or []):
                restart_count.observe(api.pod_label(pod.metadata.name, name), pod)
            if restart_count.past(restart_limit):
                give_up(
                    f"used up its restart budget: {restart_count.count} restarts (backoffLimit {restart_limit}), "
                    f"{restart_count.summary()}"
                )
            if deadlines.queued:
                if settings.queue_timeout_s and deadlines.queued_for() > settings.queue_timeout_s:
                    give_up(
                        f"was queued (suspended, not admitted) for {deadlines.queued_for():.0f}s, past the queue "
                        f"deadline of {settings.queue_timeout_s:.0f}s"
                    )
            elif not deadlines.started:
                limit = settings.pending_timeout_s or (settings.creation_timeout_s if diagnosis.not_created else 0)
                if limit and not_started_for(diagnoser, diagnosis, deadlines)[1] > limit:
                    # decided on the pods as they are now: the last reading may be from before they were made, or
                    # ran (the diagnosis reads them every diagnose_every_s, longer than a Pending deadline may be)
                    diagnoser.tick(force=True)
                    if diagnoser.pods is not None:
                        deadlines.pods_changed(diagnoser.pods, current)
                    what, waited = not_started_for(diagnoser, diagnosis, deadlines)
                    if not deadlines.started and waited > limit:
                        deadline = "Pending" if settings.pending_timeout_s else "creation"
                        give_up(
                            f"never started: {what} for {waited:.0f}s, past the {deadline} deadline of {limit:.0f}s"
                        )
            elif settings.recovery_timeout_s and deadlines.degraded_for() > settings.recovery_timeout_s:
                give_up(
                    f"ran with fewer than its minimum of {min_pods} pod(s) for {deadlines.degraded_for():.0f}s "
                    f"(a lost node not replaced), past the recovery deadline of "
                    f"{settings.recovery_timeout_s:.0f}s"
                )
            if training is not None and time.monotonic() >= next_training_check:
                next_training_check = time.monotonic() + settings.training_check_s
                if why := training.check():
                    lines = f"; last lines: {last_lines_of_every_rank(training.run)}" if "stalled" in why else ""
                    give_up(f"was stopped, not restarted: {why}{lines}")
            try:
                update = watcher.updates.get(timeout=0.2)
            except queue.Empty:
                if not watcher.is_alive() and watcher.updates.empty():
                    raise StepFailed(f"lost track of {api.kind} {ns}/{name}: the watch stopped") from None
                continue
            if isinstance(update, BaseException):
                if cancel.is_set():
                    continue  # the signal handler's delete, seen by the watch first: cancelled, said at the top
                raise update
            current = update
            deadlines.job_changed(current)
            condition = api.latest_condition(current)
            key = (condition or {}).get("type"), (condition or {}).get("reason")
            if key != last_seen and condition is not None:
                last_seen = key
                phases = pod_summary(api, name, job_pods(kube, api, ns, name))
                log.info(
                    "%s %s: %s (%s) %s; pods: %s",
                    api.kind,
                    name,
                    condition["type"],
                    condition.get("reason", ""),
                    condition.get("message", ""),
                    phases,
                )
            if failed_at is not None and not api.is_failed(current):
                log.warning(
                    "%s %s/%s is no longer Failed (%s): auto-resume brought it back",
                    api.kind,
                    ns,
                    name,
                    (condition or {}).get("type", "no condition"),
                )
                failed_at = None
            if api.is_failed(current) and auto_resumed and settings.auto_resume_wait_s:
                if failed_at is None:
                    failed_at = time.monotonic()
                    log.warning(
                        "%s %s/%s failed; HyperPod auto-resume is on and may restart it: watching it %.0fs "
                        "more before the step fails",
                        api.kind,
                        ns,
                        name,
                        settings.auto_resume_wait_s,
                    )
                continue
            if api.is_finished(current):
                break
        # The last lines may come after the job's condition. After a failure, other workers may still be running
        # (until cleanPodPolicy removes them): their streams are not waited for long.
        drain_until = time.monotonic() + (LOG_DRAIN_S if api.is_succeeded(current) else 2.0)
        for streamer in streamers:
            streamer.job_done.set()
        for streamer in streamers:
            streamer.join(timeout=max(0.0, drain_until - time.monotonic()))
    finally:
        end_readers([watcher, pod_watcher, *streamers], stop)
    queued, running = api.times(current)
    restarts = max(api.restarts(current, job_pods(kube, api, ns, name)), restart_count.count)
    findings = [f.line() for f in diagnosis.findings]
    state = "Succeeded" if api.is_succeeded(current) else "Failed"
    outcome = JobOutcome(
        name, ns, state, reattached, attempt, queued, running, restarts, api.conditions(current), findings
    )
    if state == "Failed":
        condition = api.latest_condition(current) or {}
        diagnoser.tick(force=True)  # the pods' last word, if they still exist: an OOMKilled, a crash loop
        pod_tails = {**diagnoser.restart_tails, **describe_failure(kube, api, ns, name)}
        reason = f"{condition.get('reason', '')}: {condition.get('message', '')}".strip(": ")
        message = (
            f"{api.kind} {ns}/{name} failed (attempt {attempt}): {reason}{_evidence(evidence(), pod_tails)}"
            f"{_why(diagnosis)}"
        )
        if api.delete_failed:  # its operator would run it again (trainjob.py); what it showed is read above
            try:
                delete_job(kube, api, ns, name, uid)
                message += f"; the {api.kind} was deleted, so that {api.operator} does not run it again"
            except (ApiException, StepFailed) as exc:
                message += (
                    f"; deleting it failed ({describe(exc)}): delete it (`kubectl delete {api.plural} -n {ns} "
                    f"{name}`), or {api.operator} may run it again"
                )
        raise StepFailed(message)
    log.info(
        "%s %s/%s succeeded (attempt %d; queued %s, running %s, %d restarts)",
        api.kind,
        ns,
        name,
        attempt,
        f"{queued:.0f}s" if queued is not None else "?",
        f"{running:.0f}s" if running is not None else "?",
        restarts,
    )
    return outcome


def _evidence(trainer: TrainerEvidence | None, pod_tails: dict[str, str]) -> str:
    """The trainer's account from the volume; without one, what the failed pods showed (at their last restart,
    or now, if they still exist)."""
    if trainer is not None and (summary := trainer.summary()):
        return f"; {summary}"
    if pod_tails:
        return "; " + "; ".join(f"{pod}: {tail}" for pod, tail in sorted(pod_tails.items()))
    return "; the trainer left no log or status on the volume (it may never have started)"


def _why(diagnosis: Diagnosis) -> str:
    return f"; diagnosis: {diagnosis.summary()}" if diagnosis.findings else ""


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
