"""The memory check on the real control plane (tests/cluster/; the cluster each test writes: make_site in
tests/conftest.py): the memory limit against the instance's memory and its headroom, and /dev/shm below the limit."""

from __future__ import annotations

import pytest

from components.preflight.result import FAIL, NOT_APPLICABLE, WARN
from tests.preflight_helpers import Site, check, others_pass


def test_memory_limit_above_the_instance_fails(site: Site) -> None:
    result = site.run(job_options={"memory": "2100Gi"})
    memory = check(result, "memory")
    assert memory.status == FAIL
    assert memory.reason == "memory limit 2100Gi is above the instance's 2048Gi (103%): no node can hold a worker"
    assert memory.fix == "lower job option memory to at most 1945.6Gi (95% of 2048Gi)"
    nodes = check(result, "nodes")  # no node holds one, busy or idle
    assert nodes.status == FAIL and "memory 2100Gi requested, 1968.3Gi free" in nodes.reason


def test_memory_limit_above_the_headroom_warns(site: Site) -> None:
    memory = check(site.run(job_options={"memory": "1960Gi"}), "memory")
    assert memory.status == WARN and memory.reason.startswith("memory limit 1960Gi is 96% of the instance's 2048Gi")


@pytest.mark.parametrize(("shm", "by"), [("512Gi", "equal to it"), ("600Gi", "88Gi over it"), ("1Ti", "512Gi over it")])
def test_shm_not_below_the_memory_limit_fails(site: Site, shm: str, by: str) -> None:
    result = site.run(job_options={"shm_size": shm})
    memory = check(result, "memory")
    assert memory.status == FAIL and memory.reason.startswith(
        f"/dev/shm sizeLimit {shm if shm != '1Ti' else '1024Gi'} is not below the 512Gi memory limit ({by}): /dev/shm "
        "is memory-backed and counts against the pod's memory"
    )
    assert memory.fix == "Increase memory in resources (job option memory) or lower shm_size below it"
    others_pass(result, "memory")


def test_memory_not_applicable_for_an_unknown_instance_type(site: Site) -> None:
    options = {"gpus_per_node": 8, "efa_per_node": 0}
    memory = check(site.run(instance_type="ml.p6-b200.48xlarge", job_options=options), "memory")
    assert memory.status == NOT_APPLICABLE and memory.reason.startswith("the instance type's memory is unknown")
