"""Kubernetes API calls with a timeout each and bounded retries on transient errors only.

Written once for every call the launcher makes: 429 (honouring Retry-After), 5xx and dropped or refused
connections are retried with exponential backoff; anything else (403, 404, 409, 422, ...) is an answer
and goes straight back to the caller.
"""

from __future__ import annotations

import json
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import urllib3
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from common.errors import InputError, StepFailed

log = logging.getLogger(__name__)

T = TypeVar("T")
TRANSIENT_STATUS = frozenset({429, 500, 502, 503, 504})


@dataclass(frozen=True)
class KubeSettings:
    request_timeout_s: float = 30.0  # connect and read, per call
    people_read_timeout_s: float = 10.0  # a read only a person needs (read_for_people): short, it holds the loop
    attempts: int = 6
    backoff_s: float = 0.5  # doubled per attempt, capped at max_backoff_s, with jitter
    max_backoff_s: float = 8.0


def api_client_from_environment(kubeconfig: str = "", context: str = "") -> client.ApiClient:
    """In-cluster credentials (the step's service account) where they exist, else a kubeconfig."""
    configuration = client.Configuration()
    try:
        config.load_incluster_config(client_configuration=configuration)
        return client.ApiClient(configuration)
    except config.ConfigException:
        pass
    try:
        config.load_kube_config(
            config_file=kubeconfig or None, context=context or None, client_configuration=configuration
        )
    except (config.ConfigException, OSError) as exc:
        raise InputError(f"no Kubernetes credentials: not in a cluster, and no usable kubeconfig ({exc})") from None
    return client.ApiClient(configuration)


def is_transient(exc: BaseException) -> bool:
    if isinstance(exc, ApiException):
        return exc.status in TRANSIENT_STATUS or exc.status == 0  # 0: the client gave up on the connection
    return isinstance(exc, urllib3.exceptions.HTTPError | ConnectionError | TimeoutError)


def retry_after_s(exc: BaseException) -> float | None:
    headers = getattr(exc, "headers", None) or {}
    try:
        return float(headers.get("Retry-After"))
    except (TypeError, ValueError):
        return None


class Kube:
    """The two API groups the launcher uses, every call through `call` (timeout, retries)."""

    def __init__(self, api_client: client.ApiClient, settings: KubeSettings = KubeSettings()):
        self.settings = settings
        self.custom = client.CustomObjectsApi(api_client)
        self.core = client.CoreV1Api(api_client)

    def call(self, what: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        return self._call(self.settings.attempts, what, fn, *args, **kwargs)

    def read_for_people(self, what: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """A read that only helps a person (a log's last lines, events): retried once at most, so an unreadable one
        (no kubelet answers) costs a second, not the minute of `call`'s retries; each try with a short timeout."""
        kwargs.setdefault("_request_timeout", min(self.settings.request_timeout_s, self.settings.people_read_timeout_s))
        return self._call(min(2, self.settings.attempts), what, fn, *args, **kwargs)

    def _call(self, attempts: int, what: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        kwargs.setdefault("_request_timeout", self.settings.request_timeout_s)
        for attempt in range(1, attempts + 1):
            try:
                return fn(*args, **kwargs)
            except Exception as exc:
                if not is_transient(exc) or attempt == attempts:
                    if is_transient(exc):
                        last = describe(exc)
                        raise StepFailed(f"Kubernetes API: {what} failed {attempt} times; last: {last}") from exc
                    raise
                delay = retry_after_s(exc)
                if delay is None:
                    delay = min(self.settings.max_backoff_s, self.settings.backoff_s * 2 ** (attempt - 1))
                    delay *= random.uniform(0.5, 1.0)
                log.warning(
                    "Kubernetes API: %s: %s; retrying in %.1fs (attempt %d of %d)",
                    what,
                    describe(exc),
                    delay,
                    attempt + 1,
                    attempts,
                )
                time.sleep(delay)
        raise AssertionError("unreachable")


def describe(exc: BaseException) -> str:
    """One line for an API error: status, reason and the server's message."""
    if isinstance(exc, ApiException):
        try:
            message = json.loads(exc.body or "{}").get("message", "")
        except (ValueError, AttributeError, TypeError):
            message = str(exc.body or "")[:200]
        return f"HTTP {exc.status} {exc.reason or ''}".strip() + (f": {message}" if message else "")
    return f"{type(exc).__name__}: {exc}"
