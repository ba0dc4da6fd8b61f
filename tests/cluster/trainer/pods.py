"""Finding a TrainJob's pods: the trainer pods of its JobSet's ``node`` Job, by node rank."""

from __future__ import annotations

import json
import time
from typing import Any

import kubernetes

from tests.cluster import jobset as js_player
from tests.cluster.trainer.api import COMPLETION_INDEX_LABEL, NODE


def node_pods(
    core: kubernetes.client.CoreV1Api, namespace: str, trainjob: str, include_terminating: bool = False
) -> dict[int, dict[str, Any]]:
    """The trainer pods of a TrainJob by node rank (the Job completion index): those of its JobSet's ``node`` Job
    (``<trainjob>-node-0``, pods ``<trainjob>-node-0-<rank>-<5 random>``), not being deleted unless asked."""
    selector = f"{js_player.JOBSET_NAME_KEY}={trainjob},{js_player.REPLICATED_JOB_NAME_KEY}={NODE}"
    pods = json.loads(core.list_namespaced_pod(namespace, label_selector=selector, _preload_content=False).data)
    found: dict[int, dict[str, Any]] = {}
    for pod in sorted(pods["items"], key=lambda p: p["metadata"]["creationTimestamp"]):
        if pod["metadata"].get("deletionTimestamp") and not include_terminating:
            continue
        found[int(pod["metadata"]["labels"][COMPLETION_INDEX_LABEL])] = pod
    return found


def wait_node_pod(
    core: kubernetes.client.CoreV1Api,
    namespace: str,
    trainjob: str,
    rank: int,
    *,
    not_named: set[str] | frozenset[str] = frozenset(),
    timeout_s: float = 30,
) -> str:
    """The name of node ``rank``'s pod of a TrainJob once the Job controller has made it (one not in ``not_named``:
    after a restart or a resume, the new one)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pod = node_pods(core, namespace, trainjob).get(rank)
        if pod is not None and pod["metadata"]["name"] not in not_named:
            return pod["metadata"]["name"]
        time.sleep(0.05)
    raise TimeoutError(f"TrainJob {namespace}/{trainjob}: no pod for node {rank} within {timeout_s:.0f}s")
