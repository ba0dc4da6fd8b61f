"""Kubernetes quantities and what the scheduler counts of a pod, as the nodes check reads them (the nodes check
itself, on the real control plane, is in tests/test_preflight_nodes.py)."""

from __future__ import annotations

from decimal import Decimal

import pytest

from components.preflight.quantities import quantity
from components.preflight.scheduling import pod_requests


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("96", "96"),
        ("500m", "0.5"),
        ("512Gi", str(512 * 2**30)),
        ("2063937952Ki", str(2063937952 * 1024)),
        ("1e3", "1000"),
        ("1E3", "1000"),
        ("1E", str(10**18)),
        ("1.5", "1.5"),
        ("1.5Gi", str(3 * 2**29)),
        ("100M", str(10**8)),
        ("0.1", "0.1"),
        (".5", "0.5"),
        ("25u", "0.000025"),
        (8, "8"),
        ("+2k", "2000"),
    ],
)
def test_quantities(text: str | int, value: str) -> None:
    assert quantity(text) == Decimal(value)


@pytest.mark.parametrize("text", ["", "Gi", "1GB", "1e", "1 Gi", "0x10", "1.2.3"])
def test_bad_quantities(text: str) -> None:
    with pytest.raises(ValueError):
        quantity(text)


def test_pod_requests_like_the_scheduler() -> None:
    spec = {
        "containers": [
            {"name": "a", "resources": {"requests": {"cpu": "1", "memory": "1Gi"}}},
            {"name": "b", "resources": {"limits": {"cpu": "500m", "nvidia.com/gpu": 2}}},  # a limit is the request
        ],
        "initContainers": [
            {"name": "setup", "resources": {"requests": {"cpu": "4"}}},
            {"name": "proxy", "restartPolicy": "Always", "resources": {"requests": {"memory": "1Gi"}}},
        ],
        "overhead": {"cpu": "250m"},
    }
    assert pod_requests(spec) == {
        "cpu": Decimal("4.25"),
        "memory": Decimal(2 * 2**30),
        "nvidia.com/gpu": Decimal(2),
    }
