"""What every controller played here shares: a loop of its own that passes over the namespace every `poll_s`
(what its informers would deliver), retrying at the next pass after an API error, as controller-runtime requeues.
Any other error is a bug of the player: it is logged and kept in `errors`, which the test checks.

A pass reads the namespace first and acts on what it read, so a pass under way acts on what was there when it began,
as a real controller acts on its cache: a test that must know where the controller stands uses `between_passes` (no
pass under way while it runs) and `wait_for_pass` (a whole pass has read what is there now and acted on it)."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import urllib3
from kubernetes.client.exceptions import ApiException

log = logging.getLogger(__name__)

# How often a played controller passes over its namespace, and the kubelet over its pods: at most this late, where
# the real component's informers deliver a change at once. 0.1 s cost the suite's control plane about twice the
# requests (an idle test's players: 2.8 CPU-s per 20 s, apiserver and etcd included).
POLL_S = 0.2


def controller_reference(api_version: str, kind: str, owner: dict[str, Any]) -> dict[str, Any]:
    """controller-runtime's ``SetControllerReference`` of an object to ``owner`` (its metadata): the owner the
    garbage collector deletes it with, and waits for in a foreground delete."""
    return {
        "apiVersion": api_version,
        "kind": kind,
        "name": owner["name"],
        "uid": owner["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


class PolledController:
    """Subclasses implement `reconcile_all()` and call `start()` at the end of their `__init__`."""

    def __init__(self, name: str, poll_s: float):
        self.name, self.poll_s = name, poll_s
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name=name)
        self._pass = threading.Lock()  # held by a pass, and by a test between two passes
        self._done = threading.Condition()
        self._passes = 0  # passes that ran to their end without an error

    def reconcile_all(self) -> None:
        raise NotImplementedError

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    @contextlib.contextmanager
    def between_passes(self, timeout_s: float = 120) -> Iterator[None]:
        """No pass runs while the block does: one under way ends first, and the next reads what is there after it."""
        if not self._pass.acquire(timeout=timeout_s):
            raise TimeoutError(f"{self.name}: a pass did not end within {timeout_s:.0f}s")
        try:
            yield
        finally:
            self._pass.release()

    def wait_for_pass(self, timeout_s: float = 120) -> None:
        """Until a pass that began after this call has ended: the controller has acted on what is there now."""
        deadline = time.monotonic() + timeout_s
        with self._done:
            target = self._passes + 2  # the pass under way, if any, may have read before the call
            while self._passes < target:
                if not self._thread.is_alive() or not self._done.wait(max(0.0, deadline - time.monotonic())):
                    raise TimeoutError(f"{self.name}: no whole pass within {timeout_s:.0f}s")

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            with self._pass:
                try:
                    self.reconcile_all()
                except (ApiException, urllib3.exceptions.HTTPError) as exc:
                    log.info("%s: %s; next pass", self.name, exc)
                    continue
                except Exception as exc:  # a player that dies silently would leave a test waiting: say why
                    log.exception("%s: %s", self.name, exc)
                    self.errors.append(repr(exc))
                    continue
            with self._done:
                self._passes += 1
                self._done.notify_all()
