"""The Events the TrainJob controller writes (controller-runtime's recorder), and an error's text as Go gives it."""

from __future__ import annotations

import contextlib
import json
import time
from typing import Any

import kubernetes
from kubernetes.client.exceptions import ApiException


def go_error(exc: BaseException) -> str:
    """``err.Error()`` of what a controller-runtime client call returned: an API error is its status's message."""
    if isinstance(exc, ApiException):
        with contextlib.suppress(ValueError, TypeError):
            return str(json.loads(exc.body).get("message") or exc.reason)
        return str(exc.reason)
    return str(exc)


class EventRecorder:
    """controller-runtime's ``mgr.GetEventRecorder(name)``: client-go's ``tools/events`` broadcaster writing
    ``events.k8s.io/v1`` Events (``event_broadcaster.go`` ``recordToSink``): the first of a kind is created; the first
    isomorphic one after it updates it once, as a series of count 2; later ones are only counted in memory (a
    heartbeat sends them every 30 minutes, longer than any test). Isomorphic: the same regarding object (its
    resourceVersion too: a changed TrainJob starts a new Event), reason, action and type; not the note, so a series
    keeps its first message (``getKey``)."""

    def __init__(self, admin: kubernetes.client.ApiClient, controller: str):
        self.events = kubernetes.client.EventsV1Api(admin)
        self.controller = controller
        self.seen: dict[tuple[str, ...], tuple[str, int]] = {}  # isomorphic key -> (event name, count)

    def warn(self, regarding: dict[str, Any], reason: str, action: str, note: str) -> None:
        meta = regarding["metadata"]
        key = (meta["namespace"], meta["uid"], meta.get("resourceVersion", ""), reason, action)
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime()) + f".{int(time.time() * 1e6) % 1_000_000:06d}Z"
        if key not in self.seen:
            name = f"{meta['name']}.{int(time.time() * 1e9):x}"
            body = {
                "apiVersion": "events.k8s.io/v1",
                "kind": "Event",
                "metadata": {"name": name, "namespace": meta["namespace"]},
                "eventTime": stamp,
                "reportingController": self.controller,
                "reportingInstance": f"{self.controller}-0",
                "action": action,
                "reason": reason,
                "note": note,
                "type": "Warning",
                "regarding": {
                    "apiVersion": regarding["apiVersion"],
                    "kind": regarding["kind"],
                    "uid": meta["uid"],
                    "name": meta["name"],
                    "namespace": meta["namespace"],
                    "resourceVersion": meta.get("resourceVersion", ""),
                },
            }
            self.events.create_namespaced_event(meta["namespace"], body, _preload_content=False)
            self.seen[key] = (name, 1)
            return
        name, count = self.seen[key]
        self.seen[key] = (name, count + 1)
        if count == 1:
            self.events.patch_namespaced_event(
                name, meta["namespace"], {"series": {"count": 2, "lastObservedTime": stamp}}, _preload_content=False
            )
