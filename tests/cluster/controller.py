"""What every controller played here shares: a loop of its own that passes over the namespace every `poll_s`
(what its informers would deliver), retrying at the next pass after an API error, as controller-runtime requeues.
Any other error is a bug of the player: it is logged and kept in `errors`, which the test checks."""

from __future__ import annotations

import logging
import threading

import urllib3
from kubernetes.client.exceptions import ApiException

log = logging.getLogger(__name__)


class PolledController:
    """Subclasses implement `reconcile_all()` and call `start()` at the end of their `__init__`."""

    def __init__(self, name: str, poll_s: float):
        self.name, self.poll_s = name, poll_s
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name=name)

    def reconcile_all(self) -> None:
        raise NotImplementedError

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.reconcile_all()
            except (ApiException, urllib3.exceptions.HTTPError) as exc:
                log.info("%s: %s; next pass", self.name, exc)
            except Exception as exc:  # a player that dies silently would leave a test waiting: say why
                log.exception("%s: %s", self.name, exc)
                self.errors.append(repr(exc))
