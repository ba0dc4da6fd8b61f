"""The threads that read long responses of the API server for the launch: `Reader` (a watch or a followed log that
can be ended at once), the `JobWatcher` (the job's states: a watch resumed after dropped streams and 410 Gone,
polling where watching is refused) and the `PodWatcher` (every state of the job's pods, for the restart budget)."""

from __future__ import annotations

import contextlib
import functools
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from kubernetes.client.exceptions import ApiException
from kubernetes.watch import Watch

from common.errors import StepFailed
from components.kube import Kube, describe, is_transient
from components.launch_training.apis import api_of
from components.launch_training.job_api import JobApi
from components.launch_training.pods import get_job
from components.launch_training.watch_settings import WatchSettings

log = logging.getLogger(__name__)


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
