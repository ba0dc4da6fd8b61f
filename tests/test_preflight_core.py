"""The preflight's entry and its result, without a cluster: the message a failed step shows, and an API server
that cannot be reached failing the checks that read it once, quickly (the checks on the real control plane are in
tests/test_preflight.py)."""

from __future__ import annotations

import socket
import time

import kubernetes

from components.preflight.core import preflight
from components.preflight.result import FAIL, PASS, WARN, Check, PreflightResult, failure_message
from tests.preflight_helpers import FAST, check, config, statuses


def test_the_failure_message_of_hand_made_results() -> None:
    checks = [
        Check("nodes", FAIL, "0 of 2 node(s) fit.", "add nodes"),
        Check("image", FAIL, "no image"),
        Check("memory", WARN, "96%", "lower memory"),
        Check("crd", PASS, "installed"),
    ]
    assert (
        failure_message(PreflightResult(checks)) == "preflight failed: nodes: 0 of 2 node(s) fit. Fix: add nodes; "
        "image: no image."
    )
    assert failure_message(PreflightResult(checks[2:])) == "preflight passed, 1 warning(s)"


def test_an_unreachable_api_server_fails_the_cluster_checks_once() -> None:
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{probe.getsockname()[1]}"
    configuration = kubernetes.client.Configuration()
    configuration.host = url
    with kubernetes.client.ApiClient(configuration) as api:
        started = time.monotonic()
        result = preflight(config(), api, settings=FAST)
    assert time.monotonic() - started < 10
    crd = check(result, "crd")
    assert crd.status == FAIL and crd.reason.startswith("Kubernetes API: read CRD failed 3 times; last: MaxRetryError")
    for name in ("permissions", "fsx-pvc", "checkpoint-throughput", "nodes", "device-plugins"):
        got = check(result, name)
        assert (got.status, got.reason) == (FAIL, "not checked: the Kubernetes API server is unreachable")
        assert got.fix.startswith("rerun when the API server answers")
    assert statuses(result)["image"] == statuses(result)["memory"] == PASS  # from the manifest alone
