"""The image check on the real control plane (tests/cluster/; the cluster each test writes: make_site in
tests/conftest.py): an ECR image's warning and its pull secret, a malformed or untagged image (the reference grammar
itself: tests/test_preflight_image_reference.py). A HyperPodPyTorchJob's hyperpodrun (its command, and whether the image
carries it): tests/test_preflight_hyperpodpytorchjob.py."""

from __future__ import annotations

from components.launch_training.manifest import render_job
from components.launch_training.platform import Platform
from components.preflight.core import check_manifest
from components.preflight.result import FAIL, WARN
from tests.preflight_helpers import ECR_IMAGE, FAST, Site, check, config, others_pass


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
