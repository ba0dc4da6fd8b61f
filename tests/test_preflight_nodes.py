"""The nodes check on the real control plane (tests/cluster/; the cluster each test writes: make_site in
tests/conftest.py: two p5.48xlarge nodes with room, a CPU node, other teams' pods): whether the job's workers fit now or
on an idle cluster, why each node does not, and what the runner may not list (the quantities and a pod's requests as the
scheduler counts them: tests/test_preflight_scheduling.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from components.launch_training.platform import Platform
from components.preflight.result import FAIL, PASS, WARN
from tests.cluster.control_plane import WITHOUT_CLUSTER_READ, deploy_grants
from tests.preflight_helpers import Site, all_pass, check, others_pass, statuses

GPU8 = {"cpu": "90", "memory": "1000Gi", "nvidia.com/gpu": "8", "vpc.amazonaws.com/efa": "32"}

HALF = {"cpu": "48", "memory": "500Gi", "nvidia.com/gpu": "4", "vpc.amazonaws.com/efa": "16"}  # half a p5.48xlarge


def busy(site: Site, node: str, name: str = "other-train-0", **pod: Any) -> None:
    """Another team's pod on ``node`` (half a p5.48xlarge unless ``pod`` says otherwise)."""
    team = site.hp.namespace(f"team-b-{site.hp.tag}")
    site.hp.add_pod(team, name, node=node, **(pod or {"requests": HALF, "limits": HALF}))


def test_a_busy_cluster_that_fits_when_idle_warns(site: Site) -> None:
    busy(site, site.i01)
    result = site.run()
    nodes = check(result, "nodes")
    assert nodes.status == WARN
    assert result.passed and result.verdict() == "passed, 1 warning(s)"  # the job waits; the run goes on
    assert nodes.reason.startswith(
        "does not fit now: 1 of 3 node(s) free for a worker (8 nvidia.com/gpu, 32 vpc.amazonaws.com/efa, 512Gi "
        "memory, 96 cpu); the job needs 2; would fit an idle cluster (2 node(s) hold a worker when nothing else "
        "runs), so the job will wait in Pending/queue until capacity frees. Not fitting now: "
    )
    assert "1 short of nvidia.com/gpu" in nodes.reason and "1 no health label" in nodes.reason
    assert f"{site.i01}: nvidia.com/gpu 8 requested, 4 free, vpc.amazonaws.com/efa 32 requested, 16 free" in (
        nodes.reason
    )
    assert nodes.fix.startswith("nothing to change if waiting is fine; to start sooner, see what holds the nodes")
    others_pass(result, "nodes")

    elastic = check(site.run(max_nodes=4), "nodes")  # min 2 of max 4: still waits for 2
    assert elastic.status == WARN and "the job needs 2 (up to 4); would fit an idle cluster" in elastic.reason


@pytest.mark.parametrize(
    ("overrides", "busy_node", "reason", "detail"),
    [
        # 3 nodes needed, 2 GPU nodes in the cluster: idle or busy, never enough.
        (
            {"nnodes": 3},
            False,
            "2 of 3 node(s) fit a worker (8 nvidia.com/gpu, 32 vpc.amazonaws.com/efa, 512Gi "
            "memory, 96 cpu); the job needs 3; even an idle cluster holds only 2. Not fitting: 1 no health label",
            "{cpu}: no sagemaker.amazonaws.com/node-health-status label",
        ),
        (
            {"nnodes": 3},
            True,
            "1 of 3 node(s) fit a worker (8 nvidia.com/gpu, 32 vpc.amazonaws.com/efa, 512Gi "
            "memory, 96 cpu); the job needs 3; even an idle cluster holds only 2. Not fitting: ",
            "{i01}: nvidia.com/gpu 8 requested, 4 free",
        ),
        # More memory than any node's allocatable (2063937952Ki on a p5.48xlarge): no idle node holds one.
        (
            {"job_options": {"memory": "2000Gi"}},
            True,
            "0 of 3 node(s) fit a worker (8 nvidia.com/gpu, 32 "
            "vpc.amazonaws.com/efa, 2000Gi memory, 96 cpu); the job needs 2; even an idle cluster holds only 0",
            "{i00}: memory 2000Gi requested, 1968.3Gi free",
        ),
    ],
)
def test_a_job_no_node_set_could_ever_hold_fails(
    site: Site, overrides: dict[str, Any], busy_node: bool, reason: str, detail: str
) -> None:
    if busy_node:
        busy(site, site.i01)
    result = site.run(**overrides)
    nodes = check(result, "nodes")
    assert nodes.status == FAIL and not result.passed
    detail = detail.format(i00=site.i00, i01=site.i01, cpu=site.cpu)
    assert nodes.reason.startswith(reason) and detail in nodes.reason, nodes.reason
    assert nodes.fix.startswith("Check kubectl describe node for allocatable GPUs")


def test_cpu_and_memory_are_counted_with_their_units(site: Site) -> None:
    busy(site, site.i00, "cpu-hog", requests={"cpu": "150500m"})
    busy(site, site.i01, "mem-hog", limits={"memory": "1500Gi"})  # limit = request
    nodes = check(site.run(), "nodes")
    assert nodes.status == WARN and nodes.reason.startswith("does not fit now: 0 of 3 node(s) free")
    assert f"{site.i00}: cpu 96 requested, 41.475 free" in nodes.reason  # 192 - 150.5 - 0.025
    assert f"{site.i01}: memory 512Gi requested, 468.3Gi free" in nodes.reason  # 2063937952Ki - 1500Gi


@pytest.mark.parametrize(
    ("node", "cause", "detail"),
    [
        ({"unschedulable": True}, "1 cordoned", "cordoned"),
        ({"health_status": "Unschedulable"}, "1 health Unschedulable", "health Unschedulable"),
        (
            {"health_status": "UnschedulablePendingReplacement"},
            "1 health UnschedulablePendingReplacement",
            "health UnschedulablePendingReplacement",
        ),
        (
            {"taints": ["dedicated=inference:NoSchedule"]},
            "1 untolerated taint",
            "taint dedicated=inference:NoSchedule not tolerated",
        ),
        ({"taints": ["maintenance:NoExecute"]}, "1 untolerated taint", "taint maintenance:NoExecute not tolerated"),
        ({"ready": False}, "1 not Ready", "not Ready (KubeletNotReady)"),
        (
            {"health_status": None},
            "2 no health label",
            "no sagemaker.amazonaws.com/node-health-status label (the job's affinity requires Schedulable)",
        ),
    ],
)
def test_a_node_that_cannot_take_a_worker(
    make_site: Callable[..., Site], node: dict[str, Any], cause: str, detail: str
) -> None:
    site = make_site(node_01={"deep_health_check": "Passed", **node})
    result = site.run()
    nodes = check(result, "nodes")
    assert nodes.status == FAIL and nodes.reason.startswith("1 of 3 node(s) fit a worker")
    assert f"Not fitting: {cause}" in nodes.reason or f", {cause}" in nodes.reason
    assert f"{site.i01}: {detail}" in nodes.reason
    others_pass(result, "nodes")


def test_tolerated_taints_and_preferred_effects_do_not_block(make_site: Callable[..., Site]) -> None:
    site = make_site(
        node_00={"taints": ["nvidia.com/gpu=present:NoSchedule", "spot:PreferNoSchedule"]},
        node_01={"taints": ["dedicated=training:NoSchedule"]},
    )
    tolerations = ({"key": "dedicated", "operator": "Equal", "value": "training"},)  # besides the GPU one
    assert check(site.run(platform=Platform(tolerations=tolerations)), "nodes").status == PASS
    assert check(site.run(), "nodes").status == FAIL  # the default toleration is for nvidia.com/gpu only


def test_node_selector_must_match(site: Site) -> None:
    platform = Platform(node_selector={"node.kubernetes.io/instance-type": "ml.p5en.48xlarge"})
    nodes = check(site.run(platform=platform), "nodes")
    assert nodes.status == FAIL and nodes.reason.startswith("0 of 3 node(s) fit a worker")
    assert f"Not fitting: 3 node selector ({site.cpu}: node selector" in nodes.reason
    assert "node selector node.kubernetes.io/instance-type=ml.p5en.48xlarge not matched" in nodes.reason
    platform = Platform(node_selector={"node.kubernetes.io/instance-type": "ml.p5.48xlarge"})
    assert check(site.run(platform=platform), "nodes").status == PASS


def test_without_the_health_affinity_an_unlabelled_node_fits(make_site: Callable[..., Site]) -> None:
    site = make_site(node_01={"health_status": None})
    assert check(site.run(), "nodes").status == FAIL
    nodes = check(site.run(platform=Platform(health_affinity=False)), "nodes")
    assert nodes.status == PASS and nodes.reason.startswith("2 of 3 node(s) fit a worker")  # cpu-system: short


def test_pods_that_hold_nothing_are_not_counted(site: Site) -> None:
    team = site.hp.namespace(f"team-c-{site.hp.tag}")
    site.hp.add_pod(team, "waiting", phase="Pending", limits={"nvidia.com/gpu": "8"})  # not scheduled
    busy(site, site.i00, "done", phase="Succeeded", requests=GPU8, limits=GPU8)
    busy(site, site.i01, "crashed", phase="Failed", requests=GPU8, limits=GPU8)
    nodes = check(site.run(), "nodes")
    assert nodes.status == PASS and nodes.reason.startswith("2 of 3 node(s) fit a worker")
    site.hp.add_pod(team, "starting", node=site.i01, phase="Pending", limits={"nvidia.com/gpu": "1"})
    nodes = check(site.run(), "nodes")  # a pod bound to a node holds its requests before it runs
    assert nodes.status == WARN and f"{site.i01}: nvidia.com/gpu 8 requested, 7 free" in nodes.reason


def test_elastic_job_with_fewer_nodes_than_max_warns(site: Site) -> None:
    nodes = check(site.run(max_nodes=4), "nodes")
    assert nodes.status == WARN
    assert nodes.reason.startswith(
        "2 of 3 node(s) fit a worker (8 nvidia.com/gpu, 32 vpc.amazonaws.com/efa, 512Gi "
        "memory, 96 cpu); the job needs 2 (up to 4)"
    )
    assert nodes.reason.endswith(": the elastic job starts with 2 of 4")


def test_many_unfit_nodes_are_summarized_on_one_line(site: Site) -> None:
    for i in range(2, 12):
        site.hp.add_node(f"hyperpod-i-{i:02d}", unschedulable=i % 2 == 0, health_status="Unschedulable")
    nodes = check(site.run(nnodes=3), "nodes")
    assert nodes.status == FAIL and "\n" not in nodes.reason
    tag = site.hp.tag
    assert (
        f"Not fitting: 5 cordoned, 5 health Unschedulable, 1 no health label (hyperpod-i-02-{tag}: cordoned; "
        f"hyperpod-i-03-{tag}: health Unschedulable; {site.cpu}: no " in nodes.reason
    )
    assert nodes.reason.endswith("; +7 more)")


def test_cannot_list_nodes_warns_and_the_other_checks_run(make_site: Callable[..., Site]) -> None:
    site = make_site(grants=deploy_grants(without=("list nodes",)))
    result = site.run()
    nodes = check(result, "nodes")
    assert nodes.status == WARN and result.passed
    assert (
        nodes.reason == "cannot list nodes: the service account may not list nodes, so whether 2 node(s) fit is unknown"
    )
    assert nodes.fix.startswith("grant the step's service account list on nodes and on pods in all namespaces")
    others_pass(result, "nodes")


def test_cannot_list_pods_counts_by_allocatable_and_warns(make_site: Callable[..., Site]) -> None:
    # across all namespaces; the launcher's list in its own namespace stays allowed
    site = make_site(grants=deploy_grants(without=("hyperpod-pretrain-cluster-read: list pods",)))
    result = site.run()
    nodes = check(result, "nodes")
    assert nodes.status == WARN and nodes.reason.startswith("2 of 3 node(s) fit a worker")
    assert nodes.reason.endswith(
        "cannot list pods in all namespaces, so free resources are unknown: counted by allocatable"
    )
    assert nodes.fix.startswith("grant the step's service account list on pods in all namespaces")
    others_pass(result, "nodes")


def test_without_the_cluster_read_file_the_preflight_warns_that_it_could_not_look(
    make_site: Callable[..., Site],
) -> None:
    site = make_site(grants=deploy_grants(WITHOUT_CLUSTER_READ))
    result = site.run()
    assert result.passed and statuses(result) == all_pass() | {
        "checkpoint-throughput": WARN,
        "nodes": WARN,
        "device-plugins": WARN,
    }
    for got in result.warnings:
        assert got.reason.startswith("cannot list") or "; cannot read PersistentVolume pvc-" in got.reason, got
        assert "kubectl apply -f deploy/rbac-cluster-read.yaml" in got.fix, got
    account = f"system:serviceaccount:{site.namespace}:"
    refused = {
        (e["verb"], e["objectRef"]["resource"], e["objectRef"].get("namespace", ""))
        for e in site.plane.audit_events()
        if e["user"]["username"].startswith(account) and e["responseStatus"]["code"] == 403
    }
    assert refused == {("list", "nodes", ""), ("list", "daemonsets", ""), ("get", "persistentvolumes", "")}, (
        "only the cluster-wide reads, refused by the real authorizer"
    )
