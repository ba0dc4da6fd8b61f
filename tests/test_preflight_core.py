"""The preflight's entry and its result: on the real control plane (tests/cluster/; the cluster each test writes:
make_site in tests/conftest.py), a healthy cluster passing every check with reads and access reviews alone, bad input
refused before any request, the verdict with warn_only, the failure message and the log, the local backend, API
errors, and the job's manifest left as it was; without a cluster, the message a failed step shows and an API server
that cannot be reached failing the checks that read it once, quickly. Each check's own tests are in
tests/test_preflight_<check>.py."""

from __future__ import annotations

import copy
import json
import logging
import socket
import time
from collections.abc import Callable
from typing import Any

import kubernetes
import pytest

from common.errors import InputError
from components.launch_training.manifest import render_job
from components.preflight.core import CHECK_NAMES, check_manifest, preflight
from components.preflight.permissions import LAUNCHER_ACCESS
from components.preflight.result import FAIL, NOT_APPLICABLE, PASS, WARN, Check, PreflightResult, failure_message
from tests.cluster.control_plane import ControlPlane, audit_time, deploy_grants
from tests.preflight_helpers import FAST, IMAGE, Site, all_pass, check, config, others_pass, statuses


def test_a_cluster_where_everything_fits_passes(site: Site) -> None:
    since = audit_time()
    result = site.run()
    ns = site.namespace
    assert [c.name for c in result.checks] == list(CHECK_NAMES)
    assert statuses(result) == all_pass(), result.markdown()
    assert result.passed and result.verdict() == "passed"
    assert all("\n" not in c.reason and "\n" not in c.fix for c in result.checks)
    assert check(result, "crd").reason == (
        "pytorchjobs.kubeflow.org v1 installed; Training Operator v1.8.1 (kubeflow/training-operator, image tag "
        "v1-04f9f13)"
    ), "a standard install's image is tagged with a commit, not the version"
    assert check(result, "permissions").reason == (
        f"all 8 permissions the launcher uses, in namespace {ns}, for "
        "kubeflow/pipeline-runner (8 from render-rbac's Roles)"
    )
    assert check(result, "fsx-pvc").reason == f"fsx-lustre-pvc in {ns}: Bound, ReadWriteMany, 1200Gi"
    throughput = check(result, "checkpoint-throughput").reason
    assert throughput.startswith("the small checkpoint, ") and throughput.endswith(
        "SCRATCH_2, writes 100 MB/s/TiB = 120 MB/s: the save takes ~0.2 s"
    ), throughput
    assert check(result, "nodes").reason == (
        "2 of 3 node(s) fit a worker (8 nvidia.com/gpu, 32 vpc.amazonaws.com/efa, 512Gi memory, 96 cpu); the job "
        f"needs 2. Not fitting: 1 no health label ({site.cpu}: no sagemaker.amazonaws.com/node-health-status label "
        "(the job's affinity requires Schedulable))"
    )
    assert check(result, "device-plugins").reason == (
        "EFA kube-system/aws-efa-k8s-device-plugin-daemonset 2/2 ready; "
        "NVIDIA kube-system/nvidia-device-plugin-daemonset 2/2 ready"
    )
    assert check(result, "image").reason == f"{IMAGE}: well formed (registry.example.com, 1.0)"
    assert check(result, "memory").reason == (
        "memory limit 512Gi is 25% of the instance's 2048Gi (at most 95%); /dev/shm 256Gi leaves 256Gi of the 512Gi "
        "limit for the processes"
    )
    markdown = result.markdown()
    assert markdown.startswith("# Preflight: passed\n")
    assert "| check | status | reason | fix |" in markdown and "| nodes | PASS | 2 of 3 node(s)" in markdown
    assert result.target.startswith(f"PyTorchJob `{ns}/hpp-pf-1-train-") and "2 node(s) of ml.p5.48xlarge" in (
        result.target
    )
    payload = json.loads(json.dumps(result.to_json()))
    assert payload["passed"] is True and payload["failed"] == [] and len(payload["checks"]) == len(CHECK_NAMES)
    # Only reads and access reviews, as the API server's audit log has them: nothing is created.
    requests = site.runner_requests(since)
    assert {e["verb"] for e in requests} == {"get", "list", "create"}
    reviews = [e["objectRef"]["resource"] for e in requests if e["verb"] == "create"]
    assert sorted(reviews) == ["selfsubjectaccessreviews"] * len(LAUNCHER_ACCESS) + ["selfsubjectreviews"]
    assert all(e["responseStatus"]["code"] < 300 for e in requests)


def test_bad_input_fails_before_any_request(site: Site) -> None:
    since = audit_time()
    with pytest.raises(InputError, match="nnodes must be a positive integer, got 0"):
        site.run(nnodes=0)
    with pytest.raises(InputError, match="nproc-per-node 4 differs from the 8 GPUs requested per node"):
        site.run(nproc_per_node=4)
    assert site.runner_requests(since) == []


def test_warn_only_passes_with_the_failures_listed(spare: ControlPlane, make_site: Callable[..., Site]) -> None:
    site = make_site(plane=spare)  # no CRD
    site.hp.remove_node(site.i01)
    result = site.run(warn_only=True)
    assert result.passed and [c.name for c in result.failures] == ["crd", "nodes"]
    assert result.verdict() == "passed: 2 failed check(s) allowed (warn_only)"
    markdown = result.markdown()
    assert markdown.startswith("# Preflight: passed: 2 failed check(s) allowed (warn_only)\n")
    assert markdown.count("| **FAIL** |") == 2
    assert result.to_json()["passed"] is True and result.to_json()["failed"] == ["crd", "nodes"]


def test_the_failure_message_and_the_log_carry_each_reason_and_fix(
    spare: ControlPlane, make_site: Callable[..., Site], caplog: pytest.LogCaptureFixture
) -> None:
    site = make_site(plane=spare, grants=deploy_grants(without=("list events",)))  # no CRD; the events: a warning
    site.hp.remove_node(site.i01)
    with caplog.at_level(logging.INFO, logger="components.preflight.core"):
        result = site.run()
    crd, nodes, permissions = check(result, "crd"), check(result, "nodes"), check(result, "permissions")
    message = failure_message(result)
    assert message == f"preflight failed: crd: {crd.reason}. Fix: {crd.fix}; nodes: {nodes.reason}. Fix: {nodes.fix}"
    assert message.startswith(
        "preflight failed: crd: the PyTorchJob CRD pytorchjobs.kubeflow.org is not installed: no job can be created. "
        "Fix: install the Kubeflow Training Operator 1.8.x (kubectl apply --server-side -k github.com/kubeflow/"
        "training-operator.git/manifests/overlays/standalone?ref=v1.8.1); nodes: 1 of 2 node(s) fit a worker"
    )
    assert "\n" not in message and "permissions" not in message  # failures only; a warning does not fail the step
    logged = {(r.levelno, r.getMessage()) for r in caplog.records}
    for level, c in ((logging.ERROR, crd), (logging.ERROR, nodes), (logging.WARNING, permissions)):
        assert (level, f"preflight {c.name}: {c.status} ({c.reason}) Fix: {c.fix}") in logged
    assert (logging.INFO, f"preflight image: pass ({check(result, 'image').reason})") in logged  # nothing to fix


def test_the_local_backend_has_nothing_to_check(site: Site) -> None:
    since = audit_time()
    with site.api() as api:
        result = preflight(config(backend="local", nnodes=1, image=""), api)
    assert statuses(result) == dict.fromkeys(CHECK_NAMES, NOT_APPLICABLE) and result.passed
    assert site.runner_requests(since) == []
    assert result.markdown().startswith("# Preflight: passed\n")


def test_a_transient_500_is_retried(site: Site, fault_proxy: Any) -> None:
    fault_proxy.fail_next("GET", r"^/api/v1/nodes", 500)
    with site.api(fault_proxy.url) as api:
        result = site.run(api)
    assert statuses(result) == all_pass()
    assert [(kind, method) for kind, method, _ in fault_proxy.injected] == [("fail", "GET")]


def test_an_api_error_fails_only_its_check(site: Site, fault_proxy: Any) -> None:
    fault_proxy.fail_next("GET", r"/persistentvolumeclaims/", 503, times=10, message="etcd is away")
    fault_proxy.fail_next("GET", r"/apis/apps/v1/daemonsets", 400, message="bad selector")
    with site.api(fault_proxy.url) as api:
        result = site.run(api)
    pvc, plugins = check(result, "fsx-pvc"), check(result, "device-plugins")
    assert pvc.status == FAIL and pvc.reason == (
        "Kubernetes API: read PVC failed 3 times; last: HTTP 503 Service Unavailable: etcd is away"
    )
    assert plugins.status == FAIL and plugins.reason == "Kubernetes API: HTTP 400 Bad Request: bad selector"
    others_pass(result, "fsx-pvc", "device-plugins", "checkpoint-throughput")
    assert check(result, "checkpoint-throughput").status == NOT_APPLICABLE, "the PVC was not read: no volume known"


def test_job_manifest_is_not_changed_by_the_checks(site: Site) -> None:
    job = render_job(config(namespace=site.namespace).job_spec())
    before = copy.deepcopy(job)
    with site.api() as api:
        check_manifest(job, api, memory_gib=2048, settings=FAST)
    assert job == before


# -- without a cluster -----------------------------------------------------------------------------------------------


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
