"""The preflight check through the real `kubernetes` client, on the real control plane (tests/cluster/).

Each test writes the cluster it reads (tests/cluster/installed.py: nodes, other teams' pods, device plugins, the
Training Operator's Deployment, the FSx PVC with its PV and StorageClass) and removes it; cluster-scoped names carry the
test's tag. The runner is the pipeline runner (deploy/rbac*.yaml), or, in a test of less granted, an account of the
test's own bound to those files less the rules cut. Tests that need the CRD absent or changed run on a spare API server
over the same etcd (ControlPlane.spare). A pipeline compiled for TrainJobs (Kubeflow Trainer v2) is checked against
Kubeflow Trainer's install, our ClusterTrainingRuntime (named hyperpod-pretrain, as deploy/rbac-trainjob.yaml lets the
runner read only that one: cluster-scoped, so each test that makes it deletes it) and, with a queue, Kueue's.

What needs no cluster is tested beside this file, a file a module (tests/test_preflight_<module>.py). The tests on the
control plane stay here together: tests/test_rbac.py measures the deploy files' rules from this file's requests.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import json
import logging
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import kubernetes
import pytest
import yaml

from common.errors import InputError, StepFailed
from components.launch_training.job_api import JOB_APIS
from components.launch_training.manifest import render_job
from components.launch_training.platform import Platform
from components.launch_training.trainjob import TRAINJOB, render_runtime
from components.preflight import fsx_pvc
from components.preflight.access import launcher_access
from components.preflight.context import ASSUMED_VOCAB
from components.preflight.core import CHECK_NAMES, check_manifest, preflight
from components.preflight.fsx_tiers import fsx_size_gib
from components.preflight.operator_versions import OPERATOR_RELEASE_TAGS
from components.preflight.permissions import LAUNCHER_ACCESS
from components.preflight.result import FAIL, NOT_APPLICABLE, PASS, WARN, Check, PreflightResult, failure_message
from pipelines.deploy.storage import FileSystem
from pipelines.deploy.storage import documents as volume_documents
from tests.cluster.cluster import profile_namespace
from tests.cluster.control_plane import (
    LESS_GRANTED,
    PYTORCHJOB_CRD,
    REPO,
    RUNNER_USER,
    TRAINER_CRDS,
    WITHOUT_CLUSTER_READ,
    ControlPlane,
    audit_time,
    deploy_grants,
    read_crd,
    trainer_skip_reason,
)
from tests.cluster.installed import (
    EFA_PLUGIN,
    FILE_SYSTEM,
    KUEUE_CONFIG,
    KUEUE_DEFAULT_FRAMEWORKS,
    KUEUE_NAMESPACE,
    Installed,
    unique_tag,
)
from tests.preflight_helpers import ECR_IMAGE, FAST, IMAGE, check, config, statuses
from trainer.config import TRAIN_DEFAULTS
from trainer.layout import META, DatasetPaths

OPERATOR_IMAGE = "kubeflow/training-operator:v1-04f9f13"  # Training Operator v1.8.1's release image
GPU8 = {"cpu": "90", "memory": "1000Gi", "nvidia.com/gpu": "8", "vpc.amazonaws.com/efa": "32"}

SCRATCH_2 = {
    "subnetId": "subnet-0123456789abcdef0",
    "securityGroupIds": "sg-0123456789abcdef0",
    "deploymentType": "SCRATCH_2",
}


@dataclass
class Site:
    """One test's cluster: its namespace (the job's), what is installed, and the three nodes' names."""

    plane: ControlPlane
    namespace: str
    hp: Installed
    i00: str = ""
    i01: str = ""
    cpu: str = ""

    def api(self, host: str = "") -> kubernetes.client.ApiClient:
        return self.plane.runner_client(host, self.namespace)

    def run(self, api: Any = None, **overrides: Any) -> PreflightResult:
        warn_only = overrides.pop("warn_only", False)
        cfg = config(**{"namespace": self.namespace, **overrides})
        if api is not None:
            return preflight(cfg, api, warn_only=warn_only, settings=FAST)
        with self.api() as client:
            return preflight(cfg, client, warn_only=warn_only, settings=FAST)

    def runner_requests(self, since: str) -> list[dict[str, Any]]:
        """The runner's requests received from ``since`` on (audit_time())."""
        return self.plane.audit_events(user=RUNNER_USER, since=since)

    def in_profile(self, api: str) -> Site:
        """The same cluster, from another Kubeflow profile's namespace (the ``kubeflow`` fixture), without a PVC."""
        namespace = profile_namespace(self.plane, api, cluster_read=True)
        self.hp.adopt_namespace(namespace)
        return Site(self.plane, namespace, self.hp, self.i00, self.i01, self.cpu)

    def with_grants(self, grants: list[dict[str, Any]]) -> Site:
        """The same cluster, from a namespace of its own (with the FSx PVC) whose account has only ``grants``."""
        namespace = self.plane.test_namespace(grants)
        self.hp.adopt_namespace(namespace)
        self.hp.add_pvc(namespace, "fsx-lustre-pvc")
        return Site(self.plane, namespace, self.hp, self.i00, self.i01, self.cpu)


@pytest.fixture
def make_site(control_plane: ControlPlane) -> Iterator[Callable[..., Site]]:
    """A healthy cluster: two GPU nodes with room, a CPU node, a daemon pod, the device plugins, the FSx PVC (1,200
    GiB, SCRATCH_2, dynamically provisioned) and the Training Operator v1.8.1; ``grants``: run as an account bound to
    these (deploy_grants() with rules cut) instead of the runner; ``profile`` (a job API): run as a Kubeflow profile's
    default-editor (the ``kubeflow`` fixture), with what render-rbac --kubeflow-profile --cluster-read renders for it;
    ``node_00``/``node_01``: the GPU nodes' settings."""
    made: list[Site] = []

    def make(
        *,
        plane: ControlPlane | None = None,
        grants: list[dict[str, Any]] | None = None,
        pvc: bool = True,
        device_plugins: bool = True,
        operator: str | None = OPERATOR_IMAGE,
        node_00: dict[str, Any] | None = None,
        node_01: dict[str, Any] | None = None,
        profile: str = "",
    ) -> Site:
        plane = plane or control_plane
        namespace = profile_namespace(plane, profile, cluster_read=True) if profile else plane.test_namespace(grants)
        site = Site(plane, namespace, Installed(plane, unique_tag()))
        made.append(site)
        hp = site.hp
        site.i00 = hp.add_node("hyperpod-i-00", **(node_00 or {"deep_health_check": "Passed"}))
        site.i01 = hp.add_node("hyperpod-i-01", **(node_01 or {"deep_health_check": "Passed"}))
        site.cpu = hp.add_node("cpu-system", instance_type="ml.m5.2xlarge", health_status=None)
        hp.add_pod(site.namespace, "aws-node-0", node=site.i00, requests={"cpu": "25m", "memory": "64Mi"})
        if device_plugins:
            hp.add_device_plugins()
        hp.add_storage_class("fsx-sc", SCRATCH_2)
        if pvc:
            hp.add_pvc(site.namespace, "fsx-lustre-pvc")
        if operator:
            hp.add_operator(operator)
        return site

    yield make
    for site in made:
        site.hp.close()
        site.plane.delete_namespace(site.namespace)


@pytest.fixture
def site(make_site: Callable[..., Site]) -> Site:
    return make_site()


@pytest.fixture
def spare(control_plane: ControlPlane, tmp_path: Path) -> Iterator[ControlPlane]:
    """A spare API server over the same etcd, with no CRD installed: the shared one is never removed."""
    with control_plane.spare(tmp_path / "spare", []) as plane:
        yield plane


# A PyTorchJob without a Kueue queue (the default site): no runtime to check, no queue; no MLflow server named.
NOT_FOR_A_PYTORCHJOB = {"runtime": NOT_APPLICABLE, "queue": NOT_APPLICABLE, "mlflow": NOT_APPLICABLE}
# A TrainJob (compiled with --job-api trainjob) without a queue: its runtime is checked, the queue is n/a.
NOT_FOR_A_TRAINJOB = {"queue": NOT_APPLICABLE, "mlflow": NOT_APPLICABLE}


def all_pass(names: Iterable[str] = CHECK_NAMES, api: str = "pytorchjob") -> dict[str, str]:
    """What a passing site's checks say: pass, but n/a for what the job has none of (a PyTorchJob: a runtime and a
    queue; a TrainJob: a queue)."""
    not_applicable = NOT_FOR_A_TRAINJOB if api == TRAINJOB.name else NOT_FOR_A_PYTORCHJOB
    return {n: not_applicable.get(n, PASS) for n in names}


def others_pass(result: PreflightResult, *names: str) -> None:
    """The checks but ``names`` say what a passing site's do, for the job API the result checked (its target)."""
    api = TRAINJOB.name if result.target.startswith(f"{TRAINJOB.kind} ") else "pytorchjob"
    assert {n: s for n, s in statuses(result).items() if n not in names} == all_pass(
        (n for n in CHECK_NAMES if n not in names), api
    ), result.markdown()


# -- the whole cluster ---------------------------------------------------------------------------------------


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


def test_an_ecr_image_gives_exactly_one_warning(site: Site) -> None:
    result = site.run(image=ECR_IMAGE)
    assert result.passed and [c.name for c in result.warnings] == ["image"] and not result.failures
    image = check(result, "image")
    assert image.reason == (
        "ECR image hyperpod-pretrain-trainer:1 (account 123456789012, us-east-1): its registry is not reachable from "
        "here; nodes pull with their instance role: it needs ecr:BatchGetImage (AmazonEC2ContainerRegistryReadOnly)"
    )
    assert image.fix.startswith("Re-run aws ecr get-login-password or use IRSA")
    assert result.verdict() == "passed, 1 warning(s)"

    job = render_job(
        config(
            image=ECR_IMAGE, namespace=site.namespace, platform=Platform(image_pull_secrets=("ecr-token",))
        ).job_spec()
    )
    with site.api() as api:
        with_secret = check(check_manifest(job, api, memory_gib=2048, settings=FAST), "image")
    assert with_secret.status == WARN
    assert (
        "an ECR token in an image pull secret (ecr-token) expires after 12 hours: refresh it, or drop the secret "
        "and use the node role / IRSA" in with_secret.reason
    )
    assert with_secret.fix == "Re-run aws ecr get-login-password or use IRSA (ECR auth expires)"


# -- 1. the CRD and the Training Operator --------------------------------------------------------------------


def test_crd_missing_fails(spare: ControlPlane, make_site: Callable[..., Site]) -> None:
    result = make_site(plane=spare).run()
    crd = check(result, "crd")
    assert crd.status == FAIL and not result.passed
    assert crd.reason == "the PyTorchJob CRD pytorchjobs.kubeflow.org is not installed: no job can be created"
    assert crd.fix.startswith("install the Kubeflow Training Operator 1.8.x")
    others_pass(result, "crd")
    assert result.verdict() == "FAILED (1 check(s))"
    assert "| crd | **FAIL** | the PyTorchJob CRD" in result.markdown()


# A tag this table does not know (no release's), on the registry 1.9.x moved to.
UNKNOWN_RELEASE_IMAGE = "ghcr.io/kubeflow/training-v1/training-operator:v1-0000000"
UNKNOWN = "is no version nor a release's tag known here"
INSTALL_FIX = "install Training Operator v1.8.1, or turn auto-resume off (job option auto_resume: false)"


@pytest.mark.parametrize(
    ("image", "labels", "namespace", "auto_resume", "status", "shown"),
    [
        ("kubeflow/training-operator:v1.6.0", {}, "kubeflow", True, WARN, "v1.6.0 (kubeflow/training-operator)"),
        ("kubeflow/training-operator:v1.6.0", {}, "kubeflow", False, PASS, "v1.6.0 (kubeflow/training-operator)"),
        ("kubeflow/training-operator:v1.7.0", {}, "kubeflow", True, PASS, "v1.7.0 (kubeflow/training-operator)"),
        (
            UNKNOWN_RELEASE_IMAGE,
            {"app.kubernetes.io/version": "v1.8.0"},
            "kubeflow",
            True,
            PASS,
            "v1.8.0 (kubeflow/training-operator)",
        ),  # a semver version label wins over the image
        (
            "kubeflow/training-operator@sha256:" + "c" * 64,
            {},
            "kubeflow",
            False,
            PASS,
            f"version unknown (kubeflow/training-operator, image tag 'none' {UNKNOWN})",
        ),
        ("kubeflow/training-operator:v1.8.1", {}, "training", True, PASS, "v1.8.1 (training/training-operator)"),
    ],
)
def test_training_operator_version(
    make_site: Callable[..., Site],
    image: str,
    labels: dict[str, str],
    namespace: str,
    auto_resume: bool,
    status: str,
    shown: str,
) -> None:
    site = make_site(operator=None)
    site.hp.add_operator(image, namespace=site.hp.namespace(namespace), labels=labels)
    result = site.run(job_options={"auto_resume": auto_resume})
    crd = check(result, "crd")
    assert crd.status == status and f"Training Operator {shown}" in crd.reason
    if status == WARN:
        assert crd.reason.endswith("HyperPod auto-resume needs 1.7.0, 1.8.0 or 1.8.1")
        assert crd.fix == INSTALL_FIX
    else:
        assert crd.fix == ""
    others_pass(result, "crd")


def test_every_release_image_tagged_with_its_commit_is_recognised(make_site: Callable[..., Site]) -> None:
    """As installed and as mirrored to ECR; a release HyperPod auto-resume does not list (1.9.x) warns."""
    site = make_site(operator=None)
    for tag, version in sorted(OPERATOR_RELEASE_TAGS.items()):
        for image in (
            f"kubeflow/training-operator:{tag}",
            f"123456789012.dkr.ecr.us-east-1.amazonaws.com/mirror/training-operator:{tag}",
        ):
            site.hp.add_operator(image)
            crd = check(site.run(job_options={"auto_resume": True}), "crd")
            site.hp.apps.delete_namespaced_deployment("training-operator", "kubeflow")
            shown = f"Training Operator {version} (kubeflow/training-operator, image tag {tag})"
            if version.startswith("v1.9."):
                assert crd.status == WARN and crd.reason.endswith(
                    f"{shown}: HyperPod auto-resume needs 1.7.0, 1.8.0 or 1.8.1"
                ), crd
            else:
                assert (crd.status, crd.fix) == (PASS, ""), crd
                assert crd.reason.endswith(shown)


def test_an_unknown_commit_tag_warns_and_says_how_to_check_by_hand(make_site: Callable[..., Site]) -> None:
    site = make_site(operator=UNKNOWN_RELEASE_IMAGE)
    result = site.run(job_options={"auto_resume": True})
    crd = check(result, "crd")
    assert crd.status == WARN and result.passed
    assert crd.reason == (
        "pytorchjobs.kubeflow.org v1 installed; Training Operator version unknown (kubeflow/training-operator, image "
        f"tag 'v1-0000000' {UNKNOWN}): HyperPod auto-resume needs 1.7.0, 1.8.0 or 1.8.1"
    )
    assert crd.fix == (
        "check by hand: kubectl -n kubeflow get deploy training-operator -o jsonpath='{.spec.template.spec."
        "containers[0].image}' and compare its tag with newTag in the release's manifests/overlays/standalone/"
        "kustomization.yaml (github.com/kubeflow/training-operator/blob/v1.8.1/manifests/overlays/standalone/"
        f"kustomization.yaml); {INSTALL_FIX}"
    )
    others_pass(result, "crd")


def test_hyperpods_install_is_found_by_its_label_with_the_base_file_alone(make_site: Callable[..., Site]) -> None:
    """HyperPod's dependency chart names the operator's Deployment after the Helm release, in kubeflow, labelled
    control-plane: kubeflow-training-operator: deploy/rbac.yaml's list in kubeflow finds it."""
    site = make_site(operator=None, grants=deploy_grants(WITHOUT_CLUSTER_READ))
    site.hp.add_operator(OPERATOR_IMAGE, name="hyperpod-dependencies-training-operators")
    crd = check(site.run(), "crd")
    assert (crd.status, crd.reason) == (
        PASS,
        "pytorchjobs.kubeflow.org v1 installed; Training Operator v1.8.1 ("
        "kubeflow/hyperpod-dependencies-training-operators, image tag "
        "v1-04f9f13)",
    )


def test_an_operator_in_another_namespace_needs_the_cluster_read_file(make_site: Callable[..., Site]) -> None:
    both = make_site(operator=None)
    both.hp.add_operator(
        OPERATOR_IMAGE, namespace=both.hp.namespace(f"ml-operators-{both.hp.tag}"), name="kubeflow-training-operator"
    )
    found = check(both.run(), "crd")
    base_only = both.with_grants(deploy_grants(WITHOUT_CLUSTER_READ))
    assert found.status == PASS and found.reason.endswith(
        f"Training Operator v1.8.1 (ml-operators-{both.hp.tag}/kubeflow-training-operator, image tag v1-04f9f13)"
    )
    crd = check(base_only.run(), "crd")
    assert crd.status == WARN and crd.reason.startswith(
        "pytorchjobs.kubeflow.org v1 installed; Training Operator version unknown (no Deployment labelled "
        "control-plane=kubeflow-training-operator in kubeflow; other namespaces not readable)"
    ), crd.reason


def test_no_training_operator_and_no_right_to_read_crds(make_site: Callable[..., Site]) -> None:
    site = make_site(operator=None, grants=deploy_grants(without=("get customresourcedefinitions",)))
    crd = check(site.run(), "crd")
    assert crd.status == WARN
    assert crd.reason == (
        "cannot read CRDs: the service account may not get customresourcedefinitions; Training Operator version "
        "unknown (no Deployment labelled control-plane=kubeflow-training-operator in any namespace): HyperPod "
        "auto-resume needs 1.7.0, 1.8.0 or 1.8.1"
    )
    assert crd.fix.startswith("grant the step's service account get on customresourcedefinitions.apiextensions.k8s.io")


def test_a_crd_that_does_not_serve_v1_fails(spare: ControlPlane, make_site: Callable[..., Site]) -> None:
    crd = read_crd(PYTORCHJOB_CRD)
    for version in crd["spec"]["versions"]:
        version["served"] = False
    spare.install_crd(crd)
    got = check(make_site(plane=spare).run(), "crd")
    assert (got.status, got.reason) == (FAIL, "pytorchjobs.kubeflow.org serves no version, not v1")


def test_bad_input_fails_before_any_request(site: Site) -> None:
    since = audit_time()
    with pytest.raises(InputError, match="nnodes must be a positive integer, got 0"):
        site.run(nnodes=0)
    with pytest.raises(InputError, match="nproc-per-node 4 differs from the 8 GPUs requested per node"):
        site.run(nproc_per_node=4)
    assert site.runner_requests(since) == []


# -- the job API: TrainJob -----------------------------------------------------------------------------------------

# Compiled with --job-api trainjob: Kubeflow Trainer v2.3's TrainJob naming our ClusterTrainingRuntime, which must be
# named hyperpod-pretrain here: deploy/rbac-trainjob.yaml lets the runner get that one only.
TRAINJOB_PLATFORM = Platform(job_api=TRAINJOB.name, runtime_name="hyperpod-pretrain")
RUNTIMES = "clustertrainingruntimes"
DEPLOY_RUNTIME = REPO / "deploy/trainjob-runtime.yaml"
QUEUE = "hyperpod-ns-team-a-localqueue"  # HyperPod task governance's LocalQueue of a team
TRAINER_CRD_REASON = (
    "trainjobs.trainer.kubeflow.org v1alpha1 installed; Kubeflow Trainer v2.3.0 "
    "(kubeflow-system/kubeflow-trainer-public)"
)
# kubernetes-sigs/kueue v0.13.9, config/components/manager/controller_manager_config.yaml: integrations.frameworks
# (no trainjob integration yet: it came in v0.14.0).
KUEUE_0_13_FRAMEWORKS = (
    "batch/job",
    "kubeflow.org/mpijob",
    "ray.io/rayjob",
    "ray.io/raycluster",
    "jobset.x-k8s.io/jobset",
    "kubeflow.org/paddlejob",
    "kubeflow.org/pytorchjob",
    "kubeflow.org/tfjob",
    "kubeflow.org/xgboostjob",
    "kubeflow.org/jaxjob",
    "workload.codeflare.dev/appwrapper",
)


def trainjob_runtime(site: Site, **overrides: Any) -> dict[str, Any]:
    """Our ClusterTrainingRuntime for the LaunchConfig `site.run(platform=TRAINJOB_PLATFORM, **overrides)` checks:
    `render_runtime` of its job_spec(), what `hyperpod-pretrain render-runtime` prints for the same settings."""
    settings = {"namespace": site.namespace, "platform": TRAINJOB_PLATFORM, **overrides}
    return render_runtime(config(**settings).job_spec())


@contextlib.contextmanager
def runtime_applied(plane: ControlPlane, runtime: dict[str, Any]) -> Iterator[Callable[[dict[str, Any]], None]]:
    """``runtime`` made as the admin (cluster-scoped: deleted however the test ends); yields a function that replaces
    it with another, deleted and made again (its failurePolicy is immutable: the CRD's validation rule)."""
    custom = kubernetes.client.CustomObjectsApi(plane.admin)
    name = runtime["metadata"]["name"]
    custom.create_cluster_custom_object(TRAINJOB.group, TRAINJOB.version, RUNTIMES, runtime)

    def replace(other: dict[str, Any]) -> None:
        custom.delete_cluster_custom_object(TRAINJOB.group, TRAINJOB.version, RUNTIMES, name)
        custom.create_cluster_custom_object(TRAINJOB.group, TRAINJOB.version, RUNTIMES, other)

    try:
        yield replace
    finally:
        custom.delete_cluster_custom_object(TRAINJOB.group, TRAINJOB.version, RUNTIMES, name)


def needs_trainer() -> None:
    if reason := trainer_skip_reason():
        pytest.skip(reason)


@pytest.fixture
def trainer_spare(control_plane: ControlPlane, tmp_path: Path) -> Iterator[ControlPlane]:
    """A spare API server with Kubeflow Trainer v2.3.0's and JobSet v0.12.0's CRDs and no PyTorchJob CRD: a cluster
    that has Kubeflow Trainer v2 alone."""
    needs_trainer()
    with control_plane.spare(tmp_path / "spare", list(TRAINER_CRDS)) as plane:
        yield plane


@pytest.fixture
def trainer_site(make_site: Callable[..., Site]) -> Site:
    """The healthy cluster on the shared control plane (both job APIs' CRDs), Kubeflow Trainer v2.3.0 installed
    beside the Training Operator."""
    needs_trainer()
    site = make_site()
    site.hp.add_trainer()
    return site


def runner_reads(site: Site, since: str) -> set[tuple[str, str, str, str, int]]:
    """The runner's requests since ``since``: (verb, resource, namespace, name, HTTP code)."""
    return {
        (
            e["verb"],
            e["objectRef"]["resource"],
            e["objectRef"].get("namespace", ""),
            e["objectRef"].get("name", ""),
            e["responseStatus"]["code"],
        )
        for e in site.runner_requests(since)
    }


def test_a_cluster_with_kubeflow_trainer_alone_names_the_fix_in_one_line(
    trainer_spare: ControlPlane, make_site: Callable[..., Site]
) -> None:
    """Compiled for PyTorchJobs on a cluster with Kubeflow Trainer v2 alone: the crd check fails with the one line that
    says what to do, the version read from Trainer's public ConfigMap. Compiled for TrainJobs: the crd check passes,
    and the runtime check with our ClusterTrainingRuntime applied (without it: fails, naming how to apply it)."""
    site = make_site(plane=trainer_spare, operator=None)
    site.hp.add_trainer()
    since = audit_time()
    pytorchjob = site.run()
    crd = check(pytorchjob, "crd")
    assert (crd.status, crd.reason, crd.fix) == (
        FAIL,
        "this cluster has Kubeflow Trainer v2.3.0 and no PyTorchJob "
        "CRD: compile with --job-api trainjob and apply "
        "deploy/trainjob-runtime.yaml",
        "",
    )
    assert failure_message(pytorchjob) == f"preflight failed: crd: {crd.reason}."
    others_pass(pytorchjob, "crd")

    trainjob = site.run(platform=TRAINJOB_PLATFORM)
    crd, runtime = check(trainjob, "crd"), check(trainjob, "runtime")
    assert (crd.status, crd.reason, crd.fix) == (PASS, TRAINER_CRD_REASON, "")
    assert (runtime.status, runtime.reason) == (
        FAIL,
        "ClusterTrainingRuntime hyperpod-pretrain is not installed: every TrainJob of this pipeline names it",
    )
    assert runtime.fix == (
        "apply deploy/trainjob-runtime.yaml, or what `hyperpod-pretrain render-runtime` prints for "
        "this pipeline's settings (a cluster admin: ClusterTrainingRuntimes are "
        "cluster-scoped)"
    )
    others_pass(trainjob, "runtime")
    assert trainjob.target.startswith(f"TrainJob `{site.namespace}/hpp-pf-1-train-")

    with runtime_applied(trainer_spare, trainjob_runtime(site)):
        applied = site.run(platform=TRAINJOB_PLATFORM)
    assert statuses(applied) == all_pass(api=TRAINJOB.name), applied.markdown()
    assert (
        check(applied, "runtime").reason == "ClusterTrainingRuntime hyperpod-pretrain matches this pipeline's "
        "(restart budget 3)"
    )
    reads = runner_reads(site, since)
    # The version from the ConfigMap Trainer lets every authenticated user read (manifests/base/rbac/
    # public_configmap_role*.yaml), not from its Deployment; nothing the runner asked was refused.
    assert ("get", "configmaps", "kubeflow-system", "kubeflow-trainer-public", 200) in reads
    assert not {r for r in reads if r[1] == "deployments" and r[2] == "kubeflow-system"}
    assert ("get", "customresourcedefinitions", "", "trainjobs.trainer.kubeflow.org", 200) in reads
    assert ("get", RUNTIMES, "", "hyperpod-pretrain", 404) in reads and (
        "get",
        RUNTIMES,
        "",
        "hyperpod-pretrain",
        200,
    ) in reads
    assert not [r for r in reads if r[4] == 403], reads


@pytest.mark.parametrize("api", JOB_APIS)
def test_a_kubeflow_profiles_default_editor_passes_with_what_kubeflow_and_render_rbac_grant(
    api: str, make_site: Callable[..., Site], kubeflow: None
) -> None:
    """A profile's namespace, as its default-editor: every check passes, and the permissions check names who grants
    the launcher's access (Kubeflow's roles through kubeflow-edit, render-rbac's for the rest: none here)."""
    if api == TRAINJOB.name:
        needs_trainer()
    site = make_site(profile=api)
    platform = TRAINJOB_PLATFORM if api == TRAINJOB.name else Platform()
    with contextlib.ExitStack() as stack:
        if api == TRAINJOB.name:
            site.hp.add_trainer()
            stack.enter_context(runtime_applied(site.plane, trainjob_runtime(site)))
        result = site.run(platform=platform)
    assert statuses(result) == all_pass(api=api), result.markdown()
    job_role = "kubeflow-trainer-edit" if api == TRAINJOB.name else "kubeflow-training-edit"
    # A TrainJob's JobSet (a new attempt waits for it to go) is not Kubeflow's to grant: render-rbac's Role does. Its
    # Jobs (a delete waits until they are gone or going) are listed under kubeflow-kubernetes-view's grant.
    count, ours, views = (10, "1 from render-rbac's Roles; ", 5) if api == TRAINJOB.name else (8, "", 4)
    assert check(result, "permissions").reason == (
        f"all {count} permissions the launcher uses, in namespace {site.namespace}, for {site.namespace}/default-editor"
        f" (4 from Kubeflow's {job_role} (kubeflow-edit); {ours}{views} from Kubeflow's kubeflow-kubernetes-view "
        "(kubeflow-edit))"
    )


def test_a_cluster_with_the_training_operator_alone_names_pytorchjob(
    spare: ControlPlane, make_site: Callable[..., Site]
) -> None:
    spare.install_crd(PYTORCHJOB_CRD)
    result = make_site(plane=spare).run(platform=TRAINJOB_PLATFORM)
    crd = check(result, "crd")
    assert (crd.status, crd.reason, crd.fix) == (
        FAIL,
        "this cluster has the Kubeflow Training Operator (PyTorchJob) "
        "and no TrainJob CRD: compile with --job-api pytorchjob",
        "",
    )
    assert check(result, "runtime").status == FAIL, "no ClusterTrainingRuntime API either"


def test_with_both_job_apis_each_compiled_choice_passes_with_its_own(trainer_site: Site) -> None:
    """The shared control plane has both CRDs, the Training Operator and Kubeflow Trainer: a pipeline compiled for
    either passes, each crd check naming its own API; the TrainJob's runtime is deploy/trainjob-runtime.yaml."""
    site, ns = trainer_site, trainer_site.namespace
    pytorchjob = site.run()
    assert statuses(pytorchjob) == all_pass(), pytorchjob.markdown()
    assert check(pytorchjob, "crd").reason == (
        "pytorchjobs.kubeflow.org v1 installed; Training Operator v1.8.1 (kubeflow/training-operator, image tag "
        "v1-04f9f13)"
    )
    with runtime_applied(site.plane, yaml.safe_load(DEPLOY_RUNTIME.read_text())):
        trainjob = site.run(platform=TRAINJOB_PLATFORM)
    assert statuses(trainjob) == all_pass(api=TRAINJOB.name), trainjob.markdown()
    assert trainjob.passed and trainjob.verdict() == "passed"
    assert check(trainjob, "crd").reason == TRAINER_CRD_REASON
    assert (
        check(trainjob, "runtime").reason == "ClusterTrainingRuntime hyperpod-pretrain matches this pipeline's "
        "(restart budget 3)"
    )
    assert check(trainjob, "queue").reason == "no Kueue queue compiled in: the job starts when its pods fit"
    # The pod the runtime and the TrainJob make together, checked as a PyTorchJob's worker is.
    assert check(trainjob, "nodes").reason == check(pytorchjob, "nodes").reason
    assert check(trainjob, "memory").reason == check(pytorchjob, "memory").reason
    assert check(trainjob, "fsx-pvc").reason == f"fsx-lustre-pvc in {ns}: Bound, ReadWriteMany, 1200Gi"
    assert trainjob.target.startswith(f"TrainJob `{ns}/hpp-pf-1-train-") and "2 node(s) of ml.p5.48xlarge" in (
        trainjob.target
    )


def test_a_runtime_that_differs_from_the_pipelines_fails_naming_the_field(trainer_site: Site) -> None:
    """Our runtime as applied must hold what the compiled pipeline relies on (RUNTIME_CONTRACT): a field changed by
    hand, or a runtime rendered for other platform settings, fails naming each field; what a run sets itself (its
    /dev/shm size, a TrainJob runtime patch) does not count."""
    site = trainer_site
    ours = trainjob_runtime(site)
    with runtime_applied(site.plane, ours) as replace:
        # The restart budget is the runtime's own (render-runtime --restart-budget): another one is no difference.
        budget = copy.deepcopy(ours)
        budget["spec"]["template"]["spec"]["failurePolicy"]["maxRestarts"] = 5
        replace(budget)
        runtime = check(site.run(platform=TRAINJOB_PLATFORM), "runtime")
        assert (runtime.status, runtime.reason) == (
            PASS,
            "ClusterTrainingRuntime hyperpod-pretrain matches this pipeline's (restart budget 5)",
        )
        edited = copy.deepcopy(ours)
        del edited["spec"]["template"]["spec"]["failurePolicy"]
        replace(edited)
        result = site.run(platform=TRAINJOB_PLATFORM)
        runtime = check(result, "runtime")
        assert (runtime.status, runtime.reason) == (
            FAIL,
            "ClusterTrainingRuntime hyperpod-pretrain differs from this "
            "pipeline's: template.spec.failurePolicy (JobSet restarts the "
            "group (its maxRestarts, the restart budget, is the runtime's own: "
            'render-runtime --restart-budget)) is "missing", not '
            '"set"',
        )
        assert runtime.fix.startswith("apply deploy/trainjob-runtime.yaml, or what `hyperpod-pretrain render-runtime`")
        others_pass(result, "runtime")

        replace(trainjob_runtime(site, platform=Platform(job_api=TRAINJOB.name, pvc_name="team-fsx")))
        runtime = check(site.run(platform=TRAINJOB_PLATFORM), "runtime")
        # The runtime as the server keeps it (its keys sorted), against the one this pipeline renders.
        assert runtime.status == FAIL and runtime.reason.startswith(
            "ClusterTrainingRuntime hyperpod-pretrain differs from this pipeline's: pod.volumes (the FSx claim) is "
            '[{"name": "fsx-pvc", "persistentVolumeClaim": {"claimName": "team-fsx"}}, '
        ), runtime.reason
        assert "; " not in runtime.reason, "the one field that differs"
        ours_claim = '], not [{"name": "fsx-pvc", "persistentVolumeClaim": {"claimName": "fsx-lustre-pvc"}}, '
        assert ours_claim in runtime.reason

        elsewhere = Platform(
            job_api=TRAINJOB.name,
            pvc_name="team-fsx",
            mount_path="/lustre",
            service_account="trainer",
            automount_service_account_token=True,
        )
        replace(trainjob_runtime(site, storage_root="/lustre", platform=elsewhere))
        runtime = check(site.run(platform=TRAINJOB_PLATFORM), "runtime")
        assert runtime.status == FAIL and runtime.reason.startswith(
            "ClusterTrainingRuntime hyperpod-pretrain differs from this pipeline's: pod.containers[node].volumeMounts "
            '(the FSx and /dev/shm mounts) is [{"mountPath": "/lustre", "name": "fsx-pvc"}'
        ), runtime.reason
        assert (
            '; pod.volumes (the FSx claim) is [{"name": "fsx-pvc", "persistentVolumeClaim": {"claimName": '
            '"team-fsx"}}' in runtime.reason
        )
        assert '; pod.serviceAccountName (the trainer pods\' service account) is "trainer", not null' in runtime.reason
        assert runtime.reason.endswith("; and 1 more"), "three fields named, the fourth counted"

        replace(ours)
        # A run's /dev/shm is its own (the TrainJob patches the runtime's): it does not make the runtime differ.
        result = site.run(platform=TRAINJOB_PLATFORM, job_options={"shm_size": "128Gi"})
        assert check(result, "runtime").status == PASS, check(result, "runtime")
        # So is its grace period, unless Kueue queues the TrainJob: Kueue v0.19.2 drops it at admission (trainjob.py).
        longer = {"grace_period_s": 300}
        assert check(site.run(platform=TRAINJOB_PLATFORM, job_options=longer), "runtime").status == PASS
        queued = Platform(job_api=TRAINJOB.name, queue_name=QUEUE)
        runtime = check(site.run(platform=queued, job_options={"grace_period_s": 300}), "runtime")
        assert (runtime.status, runtime.fix) == (
            FAIL,
            "run with job option grace_period_s=120, or have the platform "
            "team render the runtime with --grace-period-s 300",
        )
        assert runtime.reason.startswith("grace_period_s 300 is not ClusterTrainingRuntime hyperpod-pretrain's 120")


DROPS_GRACE = (
    "it drops a TrainJob's runtime-patch grace period at admission, so a queued TrainJob keeps its "
    "runtime's; the runtime check and the launch refuse another"
)


@pytest.mark.parametrize(
    ("api", "version", "frameworks", "status", "reason"),
    [
        (
            TRAINJOB.name,
            "v0.19.2",
            KUEUE_DEFAULT_FRAMEWORKS,
            PASS,
            f"queue {QUEUE!r}: Kueue v0.19.2, manages trainer.kubeflow.org/trainjob; Kueue is "
            f"built on Trainer v2.2.1's "
            f"API, per its go.mod: {DROPS_GRACE}",
        ),
        (
            TRAINJOB.name,
            "v0.14.0",
            KUEUE_DEFAULT_FRAMEWORKS,
            PASS,
            f"queue {QUEUE!r}: Kueue v0.14.0, manages trainer.kubeflow.org/trainjob; Kueue is "
            f"built on Trainer v2.0.1's "
            f"API, per its go.mod: {DROPS_GRACE}",
        ),
        (
            TRAINJOB.name,
            "v0.20.0",
            KUEUE_DEFAULT_FRAMEWORKS,
            PASS,
            f"queue {QUEUE!r}: Kueue v0.20.0, manages trainer.kubeflow.org/trainjob; Kueue is built on Trainer v2.3's "
            "API (kubernetes-sigs/kueue#14504): a TrainJob's runtime patches are kept",
        ),
        (
            TRAINJOB.name,
            "v0.13.9",
            KUEUE_0_13_FRAMEWORKS,
            FAIL,
            "Kueue v0.13.9 admits no TrainJobs (its trainjob integration came in v0.14.0): "
            "the job would wait suspended "
            "for ever",
        ),
        (
            TRAINJOB.name,
            "v0.19.2",
            tuple(f for f in KUEUE_DEFAULT_FRAMEWORKS if f != "trainer.kubeflow.org/trainjob"),
            FAIL,
            f"Kueue v0.19.2 does not manage trainer.kubeflow.org/trainjob (not in integrations.frameworks of "
            f"{KUEUE_NAMESPACE}/{KUEUE_CONFIG}): the queue label is ignored and the job runs unqueued",
        ),
        (
            TRAINJOB.name,
            None,
            (),
            FAIL,
            f"queue {QUEUE!r} is compiled in, but no Kueue runs in kueue-system (no Deployment labelled "
            "app.kubernetes.io/name=kueue): the job would never be admitted",
        ),
        # The release's own configuration leaves kubeflow.org/pytorchjob commented out; v0.13's listed it.
        (
            "pytorchjob",
            "v0.19.2",
            KUEUE_DEFAULT_FRAMEWORKS,
            FAIL,
            "Kueue v0.19.2 does not manage kubeflow.org/pytorchjob (not in integrations.frameworks of "
            f"{KUEUE_NAMESPACE}/{KUEUE_CONFIG}): the queue label is ignored and the job runs unqueued",
        ),
        (
            "pytorchjob",
            "v0.13.9",
            KUEUE_0_13_FRAMEWORKS,
            PASS,
            f"queue {QUEUE!r}: Kueue v0.13.9, manages kubeflow.org/pytorchjob; Kueue admits a "
            f"PyTorchJob by merge patch, "
            "with Training Operator v1.9.3's types per its go.mod: nothing of the job is dropped",
        ),
    ],
    ids=[
        "trainjob-v0.19.2",
        "trainjob-v0.14.0",
        "trainjob-v0.20.0",
        "trainjob-v0.13.9",
        "trainjob-not-listed",
        "trainjob-no-kueue",
        "pytorchjob-v0.19.2-default-config",
        "pytorchjob-v0.13.9",
    ],
)
def test_the_queue_check_reads_kueues_version_and_frameworks(
    make_site: Callable[..., Site], api: str, version: str | None, frameworks: tuple[str, ...], status: str, reason: str
) -> None:
    """With a Kueue queue compiled in: Kueue's controller in kueue-system (by its label), its image tag's version
    (v0.14.0 or later for a TrainJob) and its configuration's integrations.frameworks naming the job's kind."""
    if api == TRAINJOB.name:
        needs_trainer()
    site = make_site()
    if version is not None:
        site.hp.add_kueue(version, frameworks)
    platform = Platform(job_api=api, queue_name=QUEUE)
    since = audit_time()
    with contextlib.ExitStack() as stack:
        if api == TRAINJOB.name:
            site.hp.add_trainer()
            stack.enter_context(runtime_applied(site.plane, trainjob_runtime(site, platform=platform)))
        result = site.run(platform=platform)
    queue = check(result, "queue")
    assert (queue.status, queue.reason) == (status, reason), queue
    if status == FAIL:
        framework = "trainer.kubeflow.org/trainjob" if api == TRAINJOB.name else "kubeflow.org/pytorchjob"
        assert queue.fix == (
            f"install Kueue v0.14 or later with {framework} in its integrations.frameworks "
            "(kueue-system/kueue-manager-config), or compile without --queue-name"
        )
    assert {n: s for n, s in statuses(result).items() if n != "queue"} == {
        n: s for n, s in all_pass(api=api).items() if n != "queue"
    }, result.markdown()
    reads = runner_reads(site, since)
    assert ("list", "deployments", KUEUE_NAMESPACE, "", 200) in reads
    if version is not None and not reason.startswith("Kueue v0.13.9 admits"):
        assert ("get", "configmaps", KUEUE_NAMESPACE, KUEUE_CONFIG, 200) in reads
    assert not [r for r in reads if r[4] == 403], reads


def test_without_a_queue_the_queue_check_is_not_applicable(trainer_site: Site) -> None:
    trainer_site.hp.add_kueue()  # there, but the pipeline names no queue: nothing of Kueue's is read
    since = audit_time()
    queue = check(trainer_site.run(platform=TRAINJOB_PLATFORM), "queue")
    assert (queue.status, queue.reason) == (
        NOT_APPLICABLE,
        "no Kueue queue compiled in: the job starts when its pods fit",
    )
    assert not {r for r in runner_reads(trainer_site, since) if r[2] == KUEUE_NAMESPACE}


def test_a_trainjob_preflight_asks_for_the_trainjob_verbs(trainer_site: Site) -> None:
    """launcher_access(TRAINJOB): the launcher's TrainJob verbs (deploy/rbac-trainjob.yaml's Role) and the pods', not
    the PyTorchJob's: granted by the deploy files, and the ones named when cut."""
    site = trainer_site
    permissions = check(site.run(platform=TRAINJOB_PLATFORM), "permissions")
    assert len(launcher_access(TRAINJOB)) == 10 and {a[1:3] for a in launcher_access(TRAINJOB)} == {
        ("trainer.kubeflow.org", "trainjobs"),
        ("jobset.x-k8s.io", "jobsets"),
        ("batch", "jobs"),
        ("", "pods"),
        ("", "events"),
    }
    assert (permissions.status, permissions.reason) == (
        PASS,
        "all 10 permissions the launcher uses, in namespace "
        f"{site.namespace}, for kubeflow/pipeline-runner (10 from "
        "render-rbac's Roles)",
    )
    pytorchjobs_cut = site.with_grants(deploy_grants(without=("create pytorchjobs", "delete pytorchjobs")))
    assert check(pytorchjobs_cut.run(platform=TRAINJOB_PLATFORM), "permissions").status == PASS
    trainjobs_cut = site.with_grants(deploy_grants(without=("create trainjobs", "watch trainjobs")))
    permissions = check(trainjobs_cut.run(platform=TRAINJOB_PLATFORM), "permissions")
    assert (permissions.status, permissions.reason) == (
        FAIL,
        f"{trainjobs_cut.namespace}/{LESS_GRANTED} may not, "
        f"in namespace {trainjobs_cut.namespace}: create "
        "trainjobs.trainer.kubeflow.org, watch "
        "trainjobs.trainer.kubeflow.org",
    )
    assert check(trainjobs_cut.run(), "permissions").status == PASS, "a PyTorchJob's verbs are all there"


# -- 2. permissions ------------------------------------------------------------------------------------------


def test_permissions_missing_create_pytorchjobs_fails(make_site: Callable[..., Site]) -> None:
    site = make_site(grants=deploy_grants(without=("create pytorchjobs", "get pods/log", "list events")))
    result = site.run()
    permissions = check(result, "permissions")
    assert permissions.status == FAIL
    assert permissions.reason == (
        f"{site.namespace}/{LESS_GRANTED} may not, in namespace {site.namespace}: create pytorchjobs.kubeflow.org, get "
        "pods/log; also list events (the pods' events)"
    )
    assert permissions.fix == (
        f"hyperpod-pretrain render-rbac --namespace {site.namespace} --service-account "
        f"{LESS_GRANTED} --job-api pytorchjob | kubectl apply -f -"
    )
    others_pass(result, "permissions")


def test_permissions_missing_list_events_warns(make_site: Callable[..., Site]) -> None:
    site = make_site(grants=deploy_grants(without=("list events",)))
    result = site.run()
    permissions = check(result, "permissions")
    assert permissions.status == WARN and result.passed
    assert permissions.reason == (
        f"{site.namespace}/{LESS_GRANTED} may not list events in {site.namespace}: the "
        "launcher runs but cannot show the pods' events"
    )
    assert permissions.fix.startswith(f"hyperpod-pretrain render-rbac --namespace {site.namespace} ")


def test_permissions_in_a_namespace_rbac_yaml_does_not_cover(make_site: Callable[..., Site]) -> None:
    site = make_site(grants=deploy_grants())  # an account of the test's own: the runner meets no 403
    team = site.hp.namespace(f"hyperpod-team-{site.hp.tag}")
    site.hp.add_pvc(team, "fsx-lustre-pvc")
    permissions = check(site.run(namespace=team), "permissions")
    assert permissions.status == FAIL and permissions.reason.startswith(
        f"{site.namespace}/{LESS_GRANTED} may not, in namespace {team}: create pytorchjobs.kubeflow.org, get "
        "pytorchjobs.kubeflow.org, watch pytorchjobs.kubeflow.org, delete pytorchjobs.kubeflow.org, watch pods, get "
        "pods/log; also list events"  # list pods: granted in every namespace by deploy/rbac-cluster-read.yaml
    )
    assert permissions.fix == (
        f"hyperpod-pretrain render-rbac --namespace {site.namespace} --jobs-namespace "
        f"{team} --service-account {LESS_GRANTED} --job-api pytorchjob | kubectl apply -f "
        "-"
    )


# -- 3. the FSx PVC ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pvc", "reason", "fix", "throughput"),
    [
        (
            None,
            "PVC fsx-lustre-pvc does not exist in namespace {ns}: the pods would stay Pending",
            "hyperpod-pretrain render-storage --namespace {ns} --pvc-name fsx-lustre-pvc ",
            "could not be read",
        ),
        (
            {"phase": "Pending"},
            "PVC fsx-lustre-pvc is Pending, not Bound",
            "kubectl -n {ns} describe pvc fsx-lustre-pvc: check the FSx CSI driver",
            "is bound to no PersistentVolume",
        ),
        (
            {"access_modes": ("ReadWriteOnce",)},
            "PVC fsx-lustre-pvc is ReadWriteOnce, not ReadWriteMany: the 2 nodes and the "
            "pipeline's steps must mount it "
            "at once",
            "use an FSx for Lustre PV/PVC with accessModes [ReadWriteMany]",
            "",
        ),
    ],
)
def test_pvc_problems_fail(
    make_site: Callable[..., Site], pvc: dict[str, Any] | None, reason: str, fix: str, throughput: str
) -> None:
    site = make_site(pvc=False)
    if pvc is not None:
        site.hp.add_pvc(site.namespace, "fsx-lustre-pvc", **pvc)
    result = site.run()
    got = check(result, "fsx-pvc")
    ns = site.namespace
    assert (got.status, got.reason) == (FAIL, reason.format(ns=ns)) and got.fix.startswith(fix.format(ns=ns))
    others_pass(result, "fsx-pvc", "checkpoint-throughput")
    checkpoint = check(result, "checkpoint-throughput")
    if throughput:  # no volume to compare with: fsx-pvc says why, this check only what the checkpoint needs
        assert checkpoint.status == NOT_APPLICABLE, checkpoint
        assert (
            checkpoint.reason.endswith(f"; PVC fsx-lustre-pvc {throughput} (see fsx-pvc): its file system is unknown")
            and "needs 0.49 MB/s" in checkpoint.reason
        )
    else:
        assert checkpoint.status == PASS, checkpoint


def test_profiles_share_one_file_system_through_the_volumes_render_storage_makes(
    make_site: Callable[..., Site], kubeflow: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """render-storage's PV and PVC per namespace give two profiles one FSx file system: the preflight passes in both
    (the checkpoint's throughput from the tier render-storage records on the PV); a third profile without a PVC is
    told the command; a step whose storage root is on another Lustre file system is told the job would not see its
    data (the step's mounts: /proc/self/mountinfo, here a file of the same format)."""
    first = make_site(profile="pytorchjob", pvc=False)
    second, third = first.in_profile("pytorchjob"), first.in_profile("pytorchjob")
    fsx = FileSystem(
        FILE_SYSTEM, f"{FILE_SYSTEM}.fsx.us-east-1.amazonaws.com", "abcdefgh", "2400Gi", "PERSISTENT_2", 250
    )
    first.hp.apply_volumes(volume_documents(fsx, [first.namespace, second.namespace], "fsx-lustre-pvc"))
    mountinfo = tmp_path / "mountinfo"
    monkeypatch.setattr(fsx_pvc, "MOUNTINFO", mountinfo)
    root = "22 1 0:20 / / rw,relatime - overlay overlay rw\n"
    mountinfo.write_text(root + "36 22 0:50 / /fsx rw,relatime shared:5 - lustre 10.0.1.5@tcp:/abcdefgh rw,flock\n")
    for site in (first, second):
        result = site.run()
        assert statuses(result) == all_pass(), result.markdown()
        assert check(result, "fsx-pvc").reason == f"fsx-lustre-pvc in {site.namespace}: Bound, ReadWriteMany, 2400Gi"
        assert "PERSISTENT_2" in check(result, "checkpoint-throughput").reason
    missing = check(third.run(), "fsx-pvc")
    assert missing.status == FAIL and missing.fix.startswith(
        f"hyperpod-pretrain render-storage --namespace {third.namespace} --pvc-name fsx-lustre-pvc --file-system-id "
    )
    mountinfo.write_text(root + "36 22 0:50 / /fsx rw,relatime - lustre 10.0.9.9@tcp:/zyxwvut1 rw,flock\n")
    other = check(first.run(), "fsx-pvc")
    assert (other.status, other.reason) == (
        FAIL,
        (
            "this step has 10.0.9.9@tcp:/zyxwvut1 at /fsx, where the job mounts PVC fsx-lustre-pvc, but that PVC in "
            f"{first.namespace} is FSx {FILE_SYSTEM} ({FILE_SYSTEM}.fsx.us-east-1.amazonaws.com@tcp:/abcdefgh): "
            "the job would train on and checkpoint to another file system than the one the data is staged on"
        ),
    )


def test_pvc_name_from_the_compiled_platform_settings(site: Site) -> None:
    """The PVC is the platform team's (compile time): the preflight checks the one the job and the steps mount."""
    site.hp.add_pvc(site.namespace, "team-fsx", access_modes=("ReadWriteOnce", "ReadWriteMany"), capacity="2400Gi")
    assert check(site.run(platform=Platform(pvc_name="team-fsx")), "fsx-pvc").reason == (
        f"team-fsx in {site.namespace}: Bound, ReadWriteMany, 2400Gi"
    )
    with pytest.raises(InputError, match="job option 'pvc_name' is not a run option"):
        site.run(job_options={"pvc_name": "team-fsx"})


# -- 3b. the checkpoint's throughput on FSx -------------------------------------------------------------------

LLAMA_1B = 989_923_328  # llama-1b's parameters with the pipeline's default vocabulary (8,192): issue 19's 11.9 GB
PERSISTENT_2 = {**SCRATCH_2, "deploymentType": "PERSISTENT_2"}


def checkpoint_mb(parameters: int) -> float:
    """What a SIGTERM's checkpoint writes, in MB: fp32 weights, exp_avg and exp_avg_sq (12 bytes a parameter), +10%."""
    return parameters * 12 * 1.1 / 1e6


def throughput(site: Site, **overrides: Any) -> Check:
    return check(site.run(**{"preset": "llama-1b", **overrides}), "checkpoint-throughput")


def test_an_fsx_fast_enough_for_the_sigterm_checkpoint_passes(make_site: Callable[..., Site]) -> None:
    site = make_site(pvc=False)
    p2 = site.hp.add_storage_class("fsx-p2", {**PERSISTENT_2, "perUnitStorageThroughput": "500"})
    pv = site.hp.add_pvc(site.namespace, "fsx-lustre-pvc", storage_class=p2)["spec"]["volumeName"]
    result = site.run(preset="llama-1b")
    got = check(result, "checkpoint-throughput")
    # 120 s grace period; the launcher gives torchrun's shutdown timeout 20 s less: 100 s, half of it for the save.
    assert round(checkpoint_mb(LLAMA_1B) / 50) == 261 and round(checkpoint_mb(LLAMA_1B) / 600) == 22
    assert got.status == PASS and got.reason == (
        "the llama-1b checkpoint, 989,923,328 parameters x 12 bytes = 11.9 GB (vocabulary 8,192 assumed: the "
        "pipeline's default, the dataset is not staged yet), 13.1 GB with a 10% margin, needs 261 MB/s to take at "
        "most half of the 100 s preemption budget (the smaller of the pod's 120 s grace period and torchrun's 100 s "
        "shutdown timeout; the other half is for the step in flight at SIGTERM, of a length unknown here); FSx "
        f"fs-0123456789abcdef0 (PV {pv}, 1,200 GiB), PERSISTENT_2, writes 500 MB/s/TiB = 600 MB/s: the save takes ~22 s"
    )
    others_pass(result, "checkpoint-throughput")


def test_a_slow_fsx_warns_naming_a_size_a_tier_and_a_budget_that_fit(make_site: Callable[..., Site]) -> None:
    site = make_site(pvc=False)
    p2 = site.hp.add_storage_class("fsx-p2", {**PERSISTENT_2, "perUnitStorageThroughput": "125"})
    site.hp.add_pvc(site.namespace, "fsx-lustre-pvc", storage_class=p2)
    result = site.run(preset="llama-1b")
    got = check(result, "checkpoint-throughput")
    has = 1.2 * 125  # MB/s: FSx counts 1,200 GiB as 1.2 TiB
    assert checkpoint_mb(LLAMA_1B) / 50 > has, "261 MB/s needed"
    assert got.status == WARN and result.passed and result.verdict() == "passed, 1 warning(s)"
    assert got.reason.endswith(
        f"PERSISTENT_2, writes 125 MB/s/TiB = 150 MB/s: the save would take ~{checkpoint_mb(LLAMA_1B) / has:.0f} s of "
        "the 100 s budget, so a preemption may lose the steps since the last periodic checkpoint (the run itself works)"
    ), got.reason
    budget = math.ceil(checkpoint_mb(LLAMA_1B) / has * 2)
    assert (2.4 * 125, 1.2 * 250) == (300, 300) and budget == 175  # each fits 261 MB/s; 87.1 s is half of 175 s
    assert got.fix == (
        "for this job: a file system of 2,400 GiB (2.4 TiB) at 125 MB/s/TiB (a larger PVC request where the "
        "StorageClass allows expansion, or aws fsx update-file-system --storage-capacity), or the 250 MB/s/TiB tier "
        "(300 MB/s at this size; aws fsx update-file-system --lustre-configuration PerUnitStorageThroughput=250), or "
        "a preemption budget of at least 175 s (job options grace_period_s and shutdown_timeout_s)"
    )
    others_pass(result, "checkpoint-throughput")
    # The budget it names fits: a 195 s grace period gives torchrun 175 s.
    assert throughput(site, job_options={"grace_period_s": 195}).status == PASS
    assert throughput(site, job_options={"grace_period_s": 194}).status == WARN


def test_scratch_is_counted_at_its_write_baseline(site: Site) -> None:
    """SCRATCH_2 reads 200 MB/s/TiB but writes 100: the healthy cluster's 1,200 GiB writes 120 MB/s, too slow."""
    got = throughput(site)
    assert got.status == WARN and "SCRATCH_2, writes 100 MB/s/TiB = 120 MB/s: the save would take ~109 s" in got.reason
    size = fsx_size_gib(Decimal(checkpoint_mb(LLAMA_1B) / 50 * 1000 / 100), "SCRATCH_2", "SSD", 100)
    assert size == 4800, "2,613 GiB rounds up to the driver's next 2,400 GiB step"
    assert got.fix.startswith("for this job: a file system of 4,800 GiB (4.8 TiB) at 100 MB/s/TiB")
    assert (
        ", or a PERSISTENT_2 file system of this size at 250 MB/s/TiB (300 MB/s), or a preemption budget of at "
        "least 218 s" in got.fix
    )


def test_the_budget_is_the_grace_period_capped_by_torchruns_shutdown_timeout(site: Site) -> None:
    longer = throughput(site, job_options={"grace_period_s": 300})
    assert (
        longer.status == PASS
        and "needs 93 MB/s to take at most half of the 280 s preemption budget (the smaller "
        "of the pod's 300 s grace period and torchrun's 280 s shutdown timeout;"
        in longer.reason
    )
    assert round(checkpoint_mb(LLAMA_1B) / 140) == 93
    default = throughput(site, job_options={"shutdown_timeout_s": 0})  # torchrun's own: 30 s
    assert (
        default.status == WARN
        and "needs 871 MB/s to take at most half of the 30 s preemption budget (the "
        "smaller of the pod's 120 s grace period and torchrun's 30 s shutdown timeout;"
        in default.reason
    )


def test_the_vocabulary_of_a_staged_dataset_is_used(site: Site, staged_root: Path) -> None:
    got = throughput(site, storage_root=str(staged_root))
    meta = json.loads((DatasetPaths.of(staged_root, "synthetic").current_snapshot() / META).read_text())
    assert meta["vocab_size"] < 512, "BPE on the small corpus stops short of the 512 asked for"
    vocab = meta["model_vocab_size"]  # the model's: the tokenizer's padded to a multiple of 64
    assert vocab % 64 == 0 and vocab - 64 < meta["vocab_size"] <= vocab
    smaller = LLAMA_1B - (ASSUMED_VOCAB - vocab) * 2048  # tied embeddings, 2048 wide
    assert f"the llama-1b checkpoint, {smaller:,} parameters x 12 bytes = 11.7 GB (vocabulary {vocab}), " in got.reason


def test_the_assumed_vocabulary_is_the_pipelines_default() -> None:
    from pipelines.pipeline import PlatformOptions, build_pipeline

    signature = inspect.signature(build_pipeline(PlatformOptions()).pipeline_func)
    assert signature.parameters["vocab_size"].default == ASSUMED_VOCAB


def test_a_static_pv_is_compared_with_the_slowest_tier(make_site: Callable[..., Site]) -> None:
    """A statically provisioned PV says nothing of its tier, even when it names a StorageClass to bind with."""
    site = make_site(pvc=False)
    pv = site.hp.name("fsx-static")
    for storage_class in ("", None):  # none, or this test's fsx-sc
        site.hp.add_pvc(site.namespace, "fsx-lustre-pvc", static_pv=pv, storage_class=storage_class, capacity="2400Gi")
        got = throughput(site)
        assert got.status == WARN and got.reason.endswith(
            f"; the write throughput of FSx fs-0123456789abcdef0 (PV {pv}, 2,400 GiB) is unknown here: its "
            "PersistentVolume was provisioned statically, so no StorageClass says how it was created"
        ), got.reason
        assert got.fix.startswith(
            "compare it yourself: aws fsx describe-file-systems --file-system-ids fs-0123456789abcdef0 "
        ) and got.fix.endswith("must reach 261 MB/s")
        small = throughput(site, preset="small")
        assert small.status == PASS and small.reason.endswith(
            f"(PV {pv}, 2,400 GiB) writes at least 29 MB/s at the slowest FSx for Lustre tier (12 MB/s/TiB; its "
            "PersistentVolume was provisioned statically, so no StorageClass says how it was created)"
        ), small.reason
        site.hp.remove_pvc(site.namespace, "fsx-lustre-pvc")


def test_a_storage_class_gone_or_without_a_known_tier_leaves_it_unknown(make_site: Callable[..., Site]) -> None:
    site = make_site(pvc=False)
    site.hp.add_pvc(site.namespace, "fsx-lustre-pvc", storage_class=site.hp.name("fsx-gone"))
    gone = throughput(site)
    assert gone.status == WARN and gone.reason.endswith(
        f"is unknown here: StorageClass {site.hp.name('fsx-gone')}, which provisioned it, no longer exists"
    )
    site.hp.remove_pvc(site.namespace, "fsx-lustre-pvc")
    p2 = site.hp.add_storage_class("fsx-p2", PERSISTENT_2)  # no perUnitStorageThroughput: the CSI driver refuses it
    site.hp.add_pvc(site.namespace, "fsx-lustre-pvc", storage_class=p2)
    assert throughput(site).reason.endswith(
        f"StorageClass {p2} has deploymentType PERSISTENT_2, storageType SSD, perUnitStorageThroughput none: no tier "
        "known here"
    )


def test_a_volume_that_is_not_fsx_is_not_applicable(make_site: Callable[..., Site]) -> None:
    site = make_site(pvc=False)
    efs = site.hp.name("efs-pv")
    pvc = site.hp.add_pvc(site.namespace, "fsx-lustre-pvc", static_pv=efs, storage_class="", pv=False)
    site.hp.add_pv(efs, driver="efs.csi.aws.com", volume_handle="fs-0abc", claim=pvc, dynamic=False)
    result = site.run(preset="llama-1b")
    got = check(result, "checkpoint-throughput")
    assert got.status == NOT_APPLICABLE and "needs 261 MB/s" in got.reason, "the platform team compares with that"
    assert got.reason.endswith(
        f"; PersistentVolume {efs} is not FSx for Lustre (CSI driver efs.csi.aws.com): "
        "compare its write throughput with that"
    )
    others_pass(result, "checkpoint-throughput")


def test_cannot_read_the_pv_or_storage_class_warns_with_what_it_needs(make_site: Callable[..., Site]) -> None:
    site = make_site(grants=deploy_grants(without=("get storageclasses",)))
    storage_class = throughput(site)
    assert storage_class.status == WARN and "needs 261 MB/s" in storage_class.reason
    assert storage_class.reason.endswith(
        f"is unknown here: cannot read StorageClass {site.hp.name('fsx-sc')}: the "
        "service account may not get storageclasses"
    )
    assert storage_class.fix.startswith(
        "grant the step's service account get on storageclasses.storage.k8s.io to run this check"
    )
    site = site.with_grants(deploy_grants(without=("get storageclasses", "get persistentvolumes")))
    result = site.run(preset="llama-1b")
    pv = check(result, "checkpoint-throughput")
    assert pv.status == WARN and result.passed and "needs 261 MB/s" in pv.reason
    assert pv.reason.split("; ")[-1].startswith("cannot read PersistentVolume pvc-") and pv.reason.endswith(
        ": the service account may not get persistentvolumes"
    )
    assert (
        pv.fix.startswith(
            "grant the step's service account get on persistentvolumes and "
            "storageclasses.storage.k8s.io to run this check"
        )
        and "kubectl apply -f deploy/rbac-cluster-read.yaml" in pv.fix
    )
    others_pass(result, "checkpoint-throughput")


# -- 4. nodes ------------------------------------------------------------------------------------------------


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


# -- 5. device plugins ---------------------------------------------------------------------------------------


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


# -- 6. the image --------------------------------------------------------------------------------------------


def test_a_malformed_image_fails(site: Site) -> None:
    result = site.run(image="Registry.example.com/ML/Trainer:1")
    image = check(result, "image")
    assert image.status == FAIL
    assert image.reason == (
        "image 'Registry.example.com/ML/Trainer:1' is not a valid reference: repository 'ML/Trainer' has uppercase "
        "letters"
    )
    assert image.fix == "give registry/repository:tag or registry/repository@sha256:<64 hex digits>"
    others_pass(result, "image")


def test_an_untagged_image_warns(site: Site) -> None:
    image = check(site.run(image="registry.example.com/ml/trainer"), "image")
    assert image.status == WARN and "has no tag but :latest" in image.reason


# -- 7. memory -----------------------------------------------------------------------------------------------


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


# -- the verdict, the local backend, API errors ----------------------------------------------------------------


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


# -- the KFP component, the CLI, and what is read --------------------------------------------------------------


def component_args(tmp_path: Path, namespace: str, **overrides: Any) -> dict[str, Any]:
    args: dict[str, Any] = dict(
        storage_root=str(tmp_path / "fsx"),
        dataset="synthetic",
        run_id="",
        resume_run_id="",
        pipeline_run_id="pipeline-pf-2",
        backend="kubernetes",
        nnodes=2,
        max_nodes=0,
        nproc_per_node=8,
        preset="tiny",
        init_from_model="",
        mlflow_tracking_uri="",
        image=IMAGE,
        namespace=namespace,
        instance_type="ml.p5.48xlarge",
        job_options={},
        platform={
            "pvc_name": "fsx-lustre-pvc",
            "mount_path": str(tmp_path / "fsx"),
            "queue_name": "",
            "priority_class": "",
        },
        warn_only=False,
        report=SimpleNamespace(path=str(tmp_path / "report.md"), uri="minio://report"),
    )
    return {**args, **overrides}


def test_the_component_writes_the_report_and_fails_on_a_failed_check(
    spare: ControlPlane, make_site: Callable[..., Site], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from components.preflight.component import preflight as component

    spare.install_crd(PYTORCHJOB_CRD)
    site = make_site(plane=spare)
    ns = site.namespace
    assert list(component.component_spec.inputs) == list(component_args(tmp_path, ns))[:-1]
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)  # not in a cluster: the kubeconfig's credentials
    kubeconfig = spare.write_kubeconfig(tmp_path / "kubeconfig", spare.token_for(ns))
    monkeypatch.setattr(kubernetes.config.kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(kubeconfig))
    component.python_func(**component_args(tmp_path, ns))
    report = (tmp_path / "report.md").read_text()
    assert report.startswith("# Preflight: passed\n") and "| nodes | PASS |" in report
    record = json.loads((tmp_path / "fsx/runs/pipeline-pf-2/steps/preflight.json").read_text())
    assert record["state"] == "succeeded" and record["details"]["verdict"] == "passed"

    spare.remove_crd("pytorchjobs.kubeflow.org")
    with pytest.raises(StepFailed) as error:
        component.python_func(**component_args(tmp_path, ns))
    # KFP uploads no report for a failed step: the message carries each failed check's reason and fix.
    assert str(error.value).startswith(
        "preflight failed: crd: the PyTorchJob CRD pytorchjobs.kubeflow.org is not installed: no job can be created."
        " Fix: "
    )
    with pytest.raises(InputError, match=r"storage_root '.*/elsewhere' is outside the FSx mount path"):
        component.python_func(**component_args(tmp_path, ns, storage_root=str(tmp_path / "elsewhere")))
    assert "| crd | **FAIL** |" in (tmp_path / "report.md").read_text()
    component.python_func(**component_args(tmp_path, ns, warn_only=True))  # allowed
    started = time.monotonic()
    component.python_func(**component_args(tmp_path, ns, backend="local", nnodes=1, image=""))
    assert time.monotonic() - started < 5 and "| crd | n/a |" in (tmp_path / "report.md").read_text()


def test_the_cli_checks_through_the_kubeconfig_and_exits_by_the_verdict(site: Site, tmp_path: Path) -> None:
    cli = str(Path(sys.executable).parent / "hyperpod-pretrain")
    env = {k: v for k, v in os.environ.items() if k != "KUBERNETES_SERVICE_HOST"}
    env["KUBECONFIG"] = str(site.plane.write_kubeconfig(tmp_path / "kubeconfig"))
    command = [
        cli,
        "preflight",
        "--storage-root",
        str(tmp_path),
        "--dataset",
        "d",
        "--run-id",
        "r",
        "--image",
        IMAGE,
        "--namespace",
        site.namespace,
        "--nnodes",
        "2",
        "--nproc-per-node",
        "8",
        "--json",
    ]
    passed = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    assert passed.returncode == 0, passed.stderr
    assert {c["name"]: c["status"] for c in json.loads(passed.stdout)["checks"]}["nodes"] == "pass"
    failed = subprocess.run(
        [*command[:-5], "--nnodes", "3", "--nproc-per-node", "8"], capture_output=True, text=True, env=env, timeout=120
    )
    assert failed.returncode == 1
    last = failed.stderr.strip().splitlines()[-1]
    assert last.startswith("hyperpod-pretrain preflight: failed: nodes: 2 of 3 node(s) fit"), last


def test_job_manifest_is_not_changed_by_the_checks(site: Site) -> None:
    job = render_job(config(namespace=site.namespace).job_spec())
    before = copy.deepcopy(job)
    with site.api() as api:
        check_manifest(job, api, memory_gib=2048, settings=FAST)
    assert job == before


SECRET = "hunter2-wJalrXUtnFEMI-K7MDENG-bPxRfiCYEXAMPLEKEY"


def test_a_plain_text_secret_in_another_namespaces_pod_reaches_neither_report_nor_log(
    site: Site, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The preflight lists every pod in the cluster for its node and its requests only: a credential written in plain
    text in another team's pod env is in the answer, and must go no further (report, JSON, logs at any level). The
    device plugins and the operator are read whole too (their DaemonSet and Deployment): the same rule."""
    team = site.hp.namespace(f"team-b-{site.hp.tag}")
    site.hp.add_pod(
        team,
        "their-trainer",
        node=site.i00,
        containers=[
            {
                "name": "main",
                "image": "team-b/trainer:3",
                "resources": {"limits": {"nvidia.com/gpu": "8"}},
                "env": [
                    {"name": "AWS_ACCESS_KEY_ID", "value": "AKIAIOSFODNN7EXAMPLE"},
                    {"name": "AWS_SECRET_ACCESS_KEY", "value": SECRET},
                ],
            }
        ],
    )
    secret_env = [{"name": "PROXY_PASSWORD", "value": SECRET}]
    site.hp.apps.delete_namespaced_daemon_set(EFA_PLUGIN, "kube-system")
    site.hp.add_daemonset("kube-system", EFA_PLUGIN, image="efa:1", desired=2, env=secret_env)
    site.hp.apps.delete_namespaced_deployment("training-operator", "kubeflow")
    site.hp.add_deployment(
        "kubeflow",
        "training-operator",
        image=OPERATOR_IMAGE,
        env=secret_env,
        labels={"control-plane": "kubeflow-training-operator"},
    )
    since = audit_time()
    caplog.set_level(logging.DEBUG)  # from here: the objects' creation above was the admin's, logged with their env
    result = site.run()
    command = [
        sys.executable,
        "-m",
        "pipelines.cli",
        "preflight",
        "--json",
        "--storage-root",
        "/fsx",
        "--dataset",
        "synthetic",
        "--run-id",
        "pf-1",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "8",
        "--image",
        IMAGE,
        "--instance-type",
        "ml.p5.48xlarge",
        "--no-owner-reference",
        "--namespace",
        site.namespace,
    ]
    # config()'s training settings are LaunchConfig's (the trainer's); the command defaults to the pipeline's
    command += [
        arg
        for key in ("preset", "max_steps", "batch_size", "seq_len", "lr", "warmup_steps")
        for arg in (f"--{key.replace('_', '-')}", str(TRAIN_DEFAULTS[key]))
    ]
    env = {**os.environ, "KUBECONFIG": str(site.plane.write_kubeconfig(tmp_path / "kubeconfig"))}
    cli = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    listed = {
        (e["verb"], e["objectRef"]["resource"], e["objectRef"].get("namespace", ""))
        for e in site.runner_requests(since)
    }
    assert {("list", "pods", ""), ("list", "daemonsets", ""), ("list", "deployments", "kubeflow")} <= listed
    nodes = check(result, "nodes")
    assert f"{site.i00}: nvidia.com/gpu 8 requested, 0 free" in nodes.reason, "their pod was counted"
    assert cli.returncode == 0, cli.stderr
    assert json.loads(cli.stdout)["checks"] == result.to_json()["checks"]
    for text in (result.markdown(), json.dumps(result.to_json()), caplog.text, cli.stdout, cli.stderr):
        assert SECRET not in text and "AKIAIOSFODNN7EXAMPLE" not in text


def test_an_mlflow_server_that_answers_passes_and_one_that_does_not_is_a_warning(site: Site, mlflow_server) -> None:
    """The trainer's tracking server asked once (a real MLflow server on loopback): a closed port or a server that is
    not MLflow warns, naming the URI, and the run goes ahead."""
    from tests.servers import free_port

    answered = site.run(mlflow_tracking_uri=mlflow_server.url)
    assert check(answered, "mlflow").status == PASS and answered.passed
    assert (
        check(answered, "mlflow").reason == f"{mlflow_server.url} answers; the run goes in experiment "
        "'hyperpod-pretrain'"
    )
    closed = f"http://127.0.0.1:{free_port()}"
    unanswered = site.run(mlflow_tracking_uri=closed)
    assert check(unanswered, "mlflow").status == WARN and unanswered.passed, unanswered.markdown()
    assert check(unanswered, "mlflow").reason.startswith(f"{closed} did not answer as an MLflow tracking server (")
    others_pass(unanswered, "mlflow")
