"""Node 0's (or every node's) log streamed into the step's log, prefixed by pod: waiting through Pending, following
the node's pod when it is replaced, reconnecting without repeating lines (timestamps mark where it stopped), also
when a stream falls silent; a container that restarted between two reads has its previous instance's rest read
first. Logs are for people: an unreadable one is retried with a growing pause and never fails the launch."""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any

from kubernetes.client.exceptions import ApiException

from components.kube import Kube, describe, is_transient
from components.launch_training.job_api import JobApi
from components.launch_training.readers import Reader
from components.launch_training.watch_settings import WatchSettings

log = logging.getLogger(__name__)


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
