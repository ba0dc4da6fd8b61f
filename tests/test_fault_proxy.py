"""The fault proxy (tests/cluster/fault_proxy.py) in front of the real API server: forwarding, and each fault."""

from __future__ import annotations

import json
import time
from typing import Any

import kubernetes
import pytest
import urllib3
from kubernetes.client.exceptions import ApiException

from tests.cluster.control_plane import LESS_GRANTED, deploy_grants
from tests.cluster.fault_proxy import FaultProxy


def runner_without_retries(control_plane: Any, host: str, namespace: str) -> kubernetes.client.ApiClient:
    """The runner's client without urllib3's own retries (set before the ApiClient: its pool is made then)."""
    configuration = control_plane.configuration(control_plane.token_for(namespace), host)
    configuration.retries = False
    return kubernetes.client.ApiClient(configuration)


def pods_path(namespace: str) -> str:
    return f"^/api/v1/namespaces/{namespace}/pods"


def test_forwards_and_fails_on_demand(control_plane: Any, make_cluster: Any, fault_proxy: FaultProxy) -> None:
    cluster = make_cluster(grants=deploy_grants())  # an account of its own: it meets a 403 on purpose below
    core = kubernetes.client.CoreV1Api(cluster.runner(fault_proxy.url))
    assert core.list_namespaced_pod(cluster.namespace).items == []

    fault_proxy.fail_next("GET", pods_path(cluster.namespace), 503, times=2)
    for _ in range(2):
        with pytest.raises(ApiException) as failed:
            core.list_namespaced_pod(cluster.namespace)
        assert failed.value.status == 503
        assert json.loads(failed.value.body)["reason"] == "ServiceUnavailable"
    assert core.list_namespaced_pod(cluster.namespace).items == []

    # urllib3's own retries (the client's default) would resend an idempotent request answered 413, 429 or 503 with a
    # Retry-After, after sleeping that long; without them the 429 reaches the caller.
    no_retries = runner_without_retries(control_plane, fault_proxy.url, cluster.namespace)
    fault_proxy.fail_next("GET", pods_path(cluster.namespace), 429, retry_after=1)
    with pytest.raises(ApiException) as limited:
        kubernetes.client.CoreV1Api(no_retries).list_namespaced_pod(cluster.namespace)
    assert limited.value.status == 429
    assert limited.value.headers["Retry-After"] == "1"
    status = json.loads(limited.value.body)
    assert (status["kind"], status["reason"], status["code"]) == ("Status", "TooManyRequests", 429)
    assert status["details"] == {"retryAfterSeconds": 1}
    fault_proxy.fail_next("GET", pods_path(cluster.namespace), 429, retry_after=0)
    assert core.list_namespaced_pod(cluster.namespace).items == []  # urllib3 sent it again at once

    # The API server's own answers come through whole: a 403 for what deploy/rbac.yaml does not grant.
    with pytest.raises(ApiException) as forbidden:
        core.read_namespaced_pod("p1", cluster.namespace)
    assert forbidden.value.status == 403 and LESS_GRANTED in json.loads(forbidden.value.body)["message"]
    assert forbidden.value.headers.get("Audit-Id")

    path = f"/api/v1/namespaces/{cluster.namespace}/pods"
    assert [kind for kind, _, _ in fault_proxy.injected] == ["fail"] * 4
    assert [r for r in fault_proxy.requests if r[1].startswith(path)] == [("GET", path)] * 7 + [("GET", f"{path}/p1")]


def test_cut_watch_after_events(control_plane: Any, make_cluster: Any, fault_proxy: FaultProxy) -> None:
    cluster = make_cluster()
    # The runner may not watch pods (deploy/rbac.yaml): the admin watches, through the proxy, with its own token.
    core = kubernetes.client.CoreV1Api(
        kubernetes.client.ApiClient(control_plane.configuration(control_plane.admin_token, fault_proxy.url))
    )
    admin_core = kubernetes.client.CoreV1Api(control_plane.admin)
    # The watch starts after p0: p1, p2 and p3 come from the watch cache's history, whenever the watch opens. (A watch
    # without a resourceVersion is not deterministic here: the pod watch cache only moves on pod events, etcd 3.4
    # cannot tell it it is current, and after 3 s such a watch gets an ERROR event, 504 "Too large resource version".)
    since = admin_core.create_namespaced_pod(cluster.namespace, pod("p0")).metadata.resource_version
    for name in ("p1", "p2"):
        admin_core.create_namespaced_pod(cluster.namespace, pod(name))
    # Through the proxy: the API server's Warning headers come back (here for a deprecated node label).
    deprecated = pod("p3")
    deprecated["spec"]["nodeSelector"] = {"beta.kubernetes.io/arch": "amd64"}
    _, status, headers = core.create_namespaced_pod_with_http_info(cluster.namespace, deprecated)
    assert status == 201 and "beta.kubernetes.io/arch" in " ".join(headers.getlist("Warning"))
    fault_proxy.cut_watch_after(2, path_regex=pods_path(cluster.namespace))
    ended_before = watches_ended(control_plane)

    stream = kubernetes.watch.Watch().stream(
        core.list_namespaced_pod, cluster.namespace, resource_version=since, timeout_seconds=10
    )
    seen: list[str] = []
    with pytest.raises(urllib3.exceptions.ProtocolError):  # the chunked body ended without its last chunk
        for event in stream:  # bounded: the server ends the watch after 10 s
            seen.append(event["object"].metadata.name)
            assert len(seen) <= 2, f"the stream went on past the cut: {seen}"
    assert seen == ["p1", "p2"]
    watch = fault_proxy.requests[-1][1]
    assert "watch=true" in watch.lower()  # the client writes watch=True
    assert fault_proxy.injected == [("cut_watch", "GET", watch)]
    wait_for_watches_ended(control_plane, ended_before + 1)  # the cut closed the upstream side too

    # A client that hangs up mid-watch: the proxy closes the upstream side as well.
    response = core.list_namespaced_pod(
        cluster.namespace, watch=True, resource_version=since, timeout_seconds=30, _preload_content=False
    )
    assert json.loads(next(kubernetes.watch.watch.iter_resp_lines(response)))["object"]["metadata"]["name"] == "p1"
    response.close()
    wait_for_watches_ended(control_plane, ended_before + 2)


def watches_ended(control_plane: Any) -> float:
    """Pod watches the API server has finished (``apiserver_request_total`` counts a watch when it ends)."""
    return sum(n for (verb, _), n in control_plane.request_counts("pods").items() if verb == "WATCH")


def wait_for_watches_ended(control_plane: Any, count: float, timeout_s: float = 5) -> None:
    deadline = time.monotonic() + timeout_s
    while watches_ended(control_plane) < count and time.monotonic() < deadline:
        time.sleep(0.05)
    assert watches_ended(control_plane) == count


def pod(name: str) -> dict[str, Any]:
    return {"metadata": {"name": name}, "spec": {"containers": [{"name": "c", "image": "x"}]}}


def test_drop_and_delay(control_plane: Any, make_cluster: Any, fault_proxy: FaultProxy) -> None:
    cluster = make_cluster()
    path = pods_path(cluster.namespace)
    # without urllib3's retries, else it resends the dropped GET itself
    core = kubernetes.client.CoreV1Api(runner_without_retries(control_plane, fault_proxy.url, cluster.namespace))

    fault_proxy.drop_next("GET", path)
    with pytest.raises(urllib3.exceptions.ProtocolError):
        core.list_namespaced_pod(cluster.namespace)
    assert core.list_namespaced_pod(cluster.namespace).items == []

    # With urllib3's default retries the dropped GET is sent again and succeeds: two requests, one call.
    default = kubernetes.client.CoreV1Api(cluster.runner(fault_proxy.url))
    fault_proxy.drop_next("GET", path)
    before = len(fault_proxy.requests)
    assert default.list_namespaced_pod(cluster.namespace).items == []
    assert len(fault_proxy.requests) - before == 2

    fault_proxy.delay_next("*", path, 0.3)
    started = time.monotonic()
    assert core.list_namespaced_pod(cluster.namespace).items == []
    assert time.monotonic() - started >= 0.3
    assert [kind for kind, _, _ in fault_proxy.injected] == ["drop", "drop", "delay"]


def test_followed_log_streams_through(control_plane: Any, make_cluster: Any, fault_proxy: FaultProxy) -> None:
    """A followed log is chunked and long-lived: each piece reaches the client as it comes, before the stream ends."""
    cluster = make_cluster()
    kubernetes.client.CoreV1Api(control_plane.admin).create_namespaced_pod(cluster.namespace, pod("w"))
    cluster.kubelet.start("w")
    cluster.kubelet.print("w", "first")
    core = kubernetes.client.CoreV1Api(cluster.runner(fault_proxy.url))
    response = core.read_namespaced_pod_log(
        "w", cluster.namespace, container="c", follow=True, _preload_content=False, _request_timeout=10
    )
    pieces = response.stream(amt=None)
    assert next(pieces) == b"first\n"
    cluster.kubelet.print("w", "second")
    assert next(pieces) == b"second\n"
    cluster.kubelet.exit("w", 0)
    assert list(pieces) == []  # the kubelet ended the stream: a clean end through the proxy too
    assert fault_proxy.injected == []
