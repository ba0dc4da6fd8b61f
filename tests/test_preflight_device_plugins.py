"""The device-plugins check on the real control plane (tests/cluster/; the cluster each test writes: make_site in
tests/conftest.py): the EFA and NVIDIA device plugins' DaemonSets, in any namespace, and ready."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from components.launch_training.manifest import render_job
from components.preflight.core import check_manifest
from components.preflight.result import FAIL, NOT_APPLICABLE, PASS
from tests.preflight_helpers import FAST, Site, check, config, others_pass


@pytest.mark.parametrize(
    ("plugins", "reason", "fix"),
    [
        (
            [{"efa": False}],
            "no EFA device plugin DaemonSet (a name with efa and device-plugin) in any namespace",
            "Ensure aws-efa-k8s-device-plugin DaemonSet is running",
        ),
        (
            [{"nvidia": False}],
            "no NVIDIA device plugin DaemonSet (a name with nvidia and device-plugin) in any namespace",
            "Ensure the NVIDIA device plugin DaemonSet is running",
        ),
        (
            [{"nvidia": False, "ready": 1}, {"efa": False}],
            "EFA device plugin kube-system/aws-efa-k8s-device-plugin-daemonset: 1 of 2 pods ready",
            "Ensure aws-efa-k8s-device-plugin DaemonSet is running (kubectl -n "
            "kube-system describe ds aws-efa-k8s-device-plugin-daemonset)",
        ),
        (
            [{"nvidia": False, "desired": 0}, {"efa": False}],
            "EFA device plugin kube-system/aws-efa-k8s-device-plugin-daemonset schedules no pod (0 desired)",
            "Ensure aws-efa-k8s-device-plugin DaemonSet is running",
        ),
    ],
)
def test_device_plugin_problems_fail(
    make_site: Callable[..., Site], plugins: list[dict[str, Any]], reason: str, fix: str
) -> None:
    site = make_site(device_plugins=False)
    for kwargs in plugins:
        site.hp.add_device_plugins(**kwargs)
    result = site.run()
    got = check(result, "device-plugins")
    assert got.status == FAIL and got.reason.startswith(reason) and got.fix.startswith(fix)
    others_pass(result, "device-plugins")


def test_a_device_plugin_in_another_namespace_counts(make_site: Callable[..., Site]) -> None:
    site = make_site(device_plugins=False)
    site.hp.add_device_plugins(efa=False)
    efa = site.hp.namespace(f"aws-efa-{site.hp.tag}")
    site.hp.add_daemonset(efa, "efa-device-plugin", image="efa:1", desired=2)
    got = check(site.run(), "device-plugins")
    assert got.status == PASS and got.reason.startswith(f"EFA {efa}/efa-device-plugin 2/2 ready")


def test_device_plugins_not_applicable_without_gpus_or_efa(site: Site) -> None:
    job = render_job(config(namespace=site.namespace).job_spec())
    container = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    for amounts in container["resources"].values():
        amounts.pop("nvidia.com/gpu"), amounts.pop("vpc.amazonaws.com/efa")
    with site.api() as api:
        got = check(check_manifest(job, api, settings=FAST), "device-plugins")
    assert (got.status, got.reason) == (NOT_APPLICABLE, "the job requests neither GPUs nor EFA devices")
