"""The crd check on the real control plane (tests/cluster/; the cluster each test writes: make_site in
tests/conftest.py): the PyTorchJob CRD, and the Training Operator's version read from its Deployment's image or labels,
as HyperPod auto-resume needs it. Tests that need the CRD absent or changed run on a spare API server over the same etcd
(ControlPlane.spare); the crd check of a pipeline compiled for TrainJobs is in tests/test_preflight_trainjob.py, for
HyperPodPyTorchJobs in tests/test_preflight_hyperpodpytorchjob.py."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from components.preflight.operator_versions import OPERATOR_RELEASE_TAGS
from components.preflight.result import FAIL, PASS, WARN
from tests.cluster.control_plane import PYTORCHJOB_CRD, WITHOUT_CLUSTER_READ, ControlPlane, deploy_grants, read_crd
from tests.preflight_helpers import OPERATOR_IMAGE, Site, check, others_pass


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
