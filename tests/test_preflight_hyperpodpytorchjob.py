"""A pipeline compiled for HyperPodPyTorchJobs (the SageMaker HyperPod training operator), on the real control plane
(tests/cluster/; the cluster each test writes: make_site in tests/conftest.py): the crd check against our CRD of the
kind (in every session's control plane, not in spares), the operator's version read from its Deployment in
aws-hyperpod, and the real API server's Kubernetes version judged against what AWS says the operator supports; the
one-line fix on a cluster that has another job API instead; the image check's hyperpodrun (its command, and whether
the image carries it); the Role that lets the runner, and a Kubeflow profile's default-editor, find the operator."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import kubernetes
import pytest
import yaml

from components.kube import Kube
from components.launch_training.hyperpodpytorchjob import HYPERPODPYTORCHJOB
from components.launch_training.job_api import JOB_APIS
from components.preflight.access import HYPERPOD_OPERATOR_NAMESPACE, roles
from components.preflight.context import Context
from components.preflight.crd import judge_kubernetes, kubernetes_version
from components.preflight.image import HYPERPOD_TRAINER_REPOSITORY, TRAINER_REPOSITORY, check_image
from components.preflight.operator_versions import (
    HYPERPOD_HOW_TO_CHECK,
    HYPERPOD_KUBERNETES,
    HYPERPOD_NAMESPACE,
    OPERATOR_READERS,
)
from components.preflight.result import FAIL, PASS, WARN
from pipelines import pipeline
from pipelines.deploy.rbac import Subject, render
from tests.cluster.control_plane import HYPERPODPYTORCHJOB_CRD, PYTORCHJOB_CRD, ControlPlane, audit_time, deploy_grants
from tests.cluster.installed import HYPERPOD_OPERATOR_DEPLOYMENT
from tests.preflight_helpers import (
    ECR_IMAGE,
    FAST,
    HYPERPOD_IMAGE,
    HYPERPOD_PLATFORM,
    IMAGE,
    Site,
    check,
    config,
    others_pass,
    runner_reads,
)

CRD = "hyperpodpytorchjobs.sagemaker.amazonaws.com v1 installed"
OPERATOR = f"the SageMaker HyperPod training operator v1.1.0 ({HYPERPOD_NAMESPACE}/{HYPERPOD_OPERATOR_DEPLOYMENT})"
SOURCE = (
    'AWS, "Using the HyperPod training operator", Supported versions: '
    "docs.aws.amazon.com/sagemaker/latest/dg/sagemaker-eks-operator.html"
)


def kubernetes_line(plane: ControlPlane) -> tuple[str, str, str]:
    """(status, reason part, fix) the crd check must give for the real API server's Kubernetes version, read as the
    preflight reads it (GET /version) but judged from its major and minor fields."""
    info = kubernetes.client.VersionApi(plane.admin).get_code()
    minor = (int(info.major), int(info.minor.rstrip("+")))
    if (1, 28) <= minor <= (1, 33):
        return PASS, f"Kubernetes {info.git_version}, within what the operator supports (1.28 to 1.33)", ""
    return (
        WARN,
        f"Kubernetes {info.git_version} is outside what the operator supports (1.28 to 1.33; {SOURCE})",
        f"run on a cluster of Kubernetes 1.28 to 1.33, or check whether that page lists {minor[0]}.{minor[1]} by now",
    )


def run(site: Site, **overrides: Any) -> Any:
    """The preflight of a pipeline compiled for HyperPodPyTorchJobs, run with the image that carries hyperpodrun."""
    return site.run(platform=HYPERPOD_PLATFORM, **{"image": HYPERPOD_IMAGE, **overrides})


def test_the_crd_the_operators_version_and_the_kubernetes_version(make_site: Callable[..., Site]) -> None:
    """The CRD served, the operator's version its Deployment's image tag, the real server's Kubernetes version
    judged; every request granted by deploy/ (the Deployments in aws-hyperpod listed, /version read)."""
    site = make_site(operator=None)
    site.hp.add_hyperpod_operator("v1.1.0")
    since = audit_time()
    result = run(site)
    crd = check(result, "crd")
    status, line, fix = kubernetes_line(site.plane)
    assert (crd.status, crd.reason, crd.fix) == (status, f"{CRD}; {OPERATOR}; {line}", fix)
    others_pass(result, "crd")
    assert result.target.startswith(f"HyperPodPyTorchJob `{site.namespace}/hpp-pf-1-train-")
    reads = runner_reads(site, since)
    assert ("get", "customresourcedefinitions", "", "hyperpodpytorchjobs.sagemaker.amazonaws.com", 200) in reads
    assert ("list", "deployments", HYPERPOD_NAMESPACE, "", 200) in reads
    assert ("get", "/version/", "", "", 200) in reads  # the client asks for /version/
    assert not [r for r in reads if r[4] == 403], reads


def test_a_tag_that_is_no_version_and_no_operator_found(make_site: Callable[..., Site]) -> None:
    """An image pinned by digest shows no version but its tag; a Deployment in aws-hyperpod of another name is not
    taken for the operator; without the operator, the version is unknown and the add-on's own record is named."""
    site = make_site(operator=None)
    site.hp.add_hyperpod_operator("sha256:" + "c" * 64)
    site.hp.add_deployment(HYPERPOD_NAMESPACE, f"health-dashboard-{site.hp.tag}", image="registry.example.com/d:1")
    status, line, _ = kubernetes_line(site.plane)
    digest = check(run(site), "crd")
    assert digest.status == status and digest.reason == (
        f"{CRD}; the SageMaker HyperPod training operator image tag none ({HYPERPOD_NAMESPACE}/"
        f"{HYPERPOD_OPERATOR_DEPLOYMENT}); {line}"
    )
    site.hp.apps.delete_namespaced_deployment(HYPERPOD_OPERATOR_DEPLOYMENT, HYPERPOD_NAMESPACE)
    unknown = check(run(site), "crd")
    assert unknown.status == status and unknown.reason == (
        f"{CRD}; the SageMaker HyperPod training operator version unknown (no Deployment named *training-operator* in "
        f"{HYPERPOD_NAMESPACE}; check by hand: aws eks describe-addon --cluster-name <cluster> --addon-name "
        f"amazon-sagemaker-hyperpod-training-operator --query addon.addonVersion); {line}"
    )
    assert HYPERPOD_HOW_TO_CHECK in unknown.reason


def test_without_the_right_to_list_deployments_the_version_is_unknown(make_site: Callable[..., Site]) -> None:
    site = make_site(operator=None, grants=deploy_grants(without=("list deployments",)))
    site.hp.add_hyperpod_operator("v1.1.0")
    status, line, _ = kubernetes_line(site.plane)
    crd = check(run(site), "crd")
    assert crd.status == status and crd.reason == (
        f"{CRD}; the SageMaker HyperPod training operator version unknown (Deployments in {HYPERPOD_NAMESPACE} not "
        f"readable: the service account may not list them; {HYPERPOD_HOW_TO_CHECK}); {line}"
    )


def test_a_cluster_without_the_crd_and_one_with_another_job_api_instead(
    spare: ControlPlane, make_site: Callable[..., Site]
) -> None:
    """No job API's CRD: the install line. The HyperPodPyTorchJob CRD alone, compiled for PyTorchJobs: the fix names
    hyperpodpytorchjob (found after trainjob's, absent, is looked for). The PyTorchJob CRD alone, compiled for
    HyperPodPyTorchJobs: the fix names pytorchjob."""
    site = make_site(plane=spare, operator=None)
    crd = check(run(site), "crd")
    assert (crd.status, crd.reason, crd.fix) == (
        FAIL,
        "the HyperPodPyTorchJob CRD hyperpodpytorchjobs.sagemaker.amazonaws.com is not installed: no job can be "
        "created",
        "install the EKS add-on amazon-sagemaker-hyperpod-training-operator (aws eks create-addon --cluster-name "
        "<cluster> --addon-name amazon-sagemaker-hyperpod-training-operator)",
    )
    spare.install_crd(HYPERPODPYTORCHJOB_CRD)
    crd = check(site.run(), "crd")
    assert (crd.status, crd.reason, crd.fix) == (
        FAIL,
        "this cluster has the SageMaker HyperPod training operator (HyperPodPyTorchJob) and no PyTorchJob CRD: "
        "compile with --job-api hyperpodpytorchjob",
        "",
    )
    spare.remove_crd("hyperpodpytorchjobs.sagemaker.amazonaws.com")
    spare.install_crd(PYTORCHJOB_CRD)
    crd = check(run(site), "crd")
    assert (crd.status, crd.reason, crd.fix) == (
        FAIL,
        "this cluster has the Kubeflow Training Operator (PyTorchJob) and no HyperPodPyTorchJob CRD: compile with "
        "--job-api pytorchjob",
        "",
    )


def test_a_kubeflow_profiles_default_editor_finds_the_operator(make_site: Callable[..., Site], kubeflow: None) -> None:
    """As a profile's default-editor, with what render-rbac --kubeflow-profile --job-api hyperpodpytorchjob renders:
    the operator's Deployment is listed in aws-hyperpod, and every check but the crd's (the server's Kubernetes
    version) passes as on the runner's site."""
    site = make_site(operator=None, profile=HYPERPODPYTORCHJOB.name)
    site.hp.add_hyperpod_operator("v1.1.0")
    result = run(site)
    status, line, _ = kubernetes_line(site.plane)
    crd = check(result, "crd")
    assert (crd.status, crd.reason) == (status, f"{CRD}; {OPERATOR}; {line}")
    others_pass(result, "crd")


# -- the image check: a manifest's, no cluster read -------------------------------------------------------------


def image_check(image: str, command: list[str] | None = None) -> Any:
    """The image check of the HyperPodPyTorchJob a run with ``image`` makes (its container's command replaced by
    ``command``, if given)."""
    job = config(image=image, namespace="team-a", platform=HYPERPOD_PLATFORM).checked_job()[1]
    if command is not None:
        job = copy.deepcopy(job)
        job["spec"]["replicaSpecs"][0]["template"]["spec"]["containers"][0]["command"] = command
    api = kubernetes.client.ApiClient()
    return check_image(Context(job, Kube(api, FAST), api, memory_gib=2048))


def test_the_image_must_carry_hyperpodrun() -> None:
    """Ours with hyperpodrun passes as any image does; the plain trainer image fails naming the build that makes the
    right one; another repository cannot be told about: its usual result, and a warning."""
    ours = image_check(HYPERPOD_IMAGE)
    assert (ours.status, ours.reason, ours.fix) == (
        PASS,
        f"{HYPERPOD_IMAGE}: well formed (registry.example.com, 1.0)",
        "",
    )
    plain = image_check(IMAGE)
    assert (plain.status, plain.reason, plain.fix) == (
        FAIL,
        f"image {IMAGE}: hyperpod-pretrain-trainer has no hyperpodrun, which a HyperPodPyTorchJob's workers run",
        "build with docker/build.sh --job-api hyperpodpytorchjob, which pushes hyperpod-pretrain-trainer-hyperpod, "
        "and run with that image",
    )
    assert image_check(ECR_IMAGE).status == FAIL, "in ECR too"
    other = image_check("registry.example.com/ml/our-trainer:2.0")
    fix = (
        "use the image docker/build.sh --job-api hyperpodpytorchjob, which pushes hyperpod-pretrain-trainer-hyperpod, "
        "or one with hyperpod-elastic-agent installed"
    )
    assert (other.status, other.reason, other.fix) == (
        WARN,
        "registry.example.com/ml/our-trainer:2.0: well formed (registry.example.com, 2.0); whether our-trainer carries "
        "hyperpodrun cannot be told from here (docs/images.md)",
        fix,
    )
    in_ecr = image_check("123456789012.dkr.ecr.us-east-1.amazonaws.com/our-trainer:2")
    assert in_ecr.status == WARN and in_ecr.reason.endswith(
        "(AmazonEC2ContainerRegistryReadOnly); whether our-trainer carries hyperpodrun cannot be told from here "
        "(docs/images.md)"
    )
    assert in_ecr.fix == (
        "Re-run aws ecr get-login-password or use IRSA; attach AmazonEC2ContainerRegistryReadOnly to the nodes' role; "
        f"{fix}"
    )


@pytest.mark.parametrize(
    ("command", "first"),
    [
        (["sh", "-c", "hyperpodrun --nnodes=2 -m trainer.train_ddp"], "'sh'"),
        ([], "nothing"),
        (["torchrun"], "'torchrun'"),
    ],
)
def test_the_command_must_start_with_hyperpodrun(command: list[str], first: str) -> None:
    """In exec form: under a shell, the pod's SIGTERM would not reach the agent."""
    got = image_check(HYPERPOD_IMAGE, command)
    assert (got.status, got.reason, got.fix) == (
        FAIL,
        f"the HyperPodPyTorchJob's container command starts with {first}, not hyperpodrun: the operator runs its "
        "workers through the HyperPod elastic agent, PID 1 in exec form",
        "start the command with hyperpodrun, as hyperpod-pretrain render-job --job-api hyperpodpytorchjob renders it",
    )
    assert image_check(HYPERPOD_IMAGE, ["/usr/local/bin/hyperpodrun", "--nnodes=2"]).status == PASS


def test_the_image_checks_repositories_are_the_ones_compile_names() -> None:
    for api, repository in (("pytorchjob", TRAINER_REPOSITORY), ("hyperpodpytorchjob", HYPERPOD_TRAINER_REPOSITORY)):
        assert pipeline.Images.in_registry("r.example", "t", api).trainer == f"r.example/{repository}:t"


# -- the Kubernetes versions and the Role, no cluster ------------------------------------------------------------


@pytest.mark.parametrize(
    ("git_version", "minor", "status"),
    [
        ("v1.27.16-eks-2d5f260", (1, 27), WARN),
        ("v1.28.0", (1, 28), PASS),
        ("v1.33.5-eks-113cf36", (1, 33), PASS),
        ("v1.34.1", (1, 34), WARN),
    ],
)
def test_the_kubernetes_versions_the_operator_supports(git_version: str, minor: tuple[int, int], status: str) -> None:
    """1.28 to 1.33, the ends included, read off gitVersion as the API server and EKS's write it."""
    assert kubernetes_version(git_version) == minor
    if status == PASS:
        assert judge_kubernetes(git_version, HYPERPOD_KUBERNETES) == (
            PASS,
            f"Kubernetes {git_version}, within what the operator supports (1.28 to 1.33)",
            "",
        )
    else:
        assert judge_kubernetes(git_version, HYPERPOD_KUBERNETES) == (
            WARN,
            f"Kubernetes {git_version} is outside what the operator supports (1.28 to 1.33; {SOURCE})",
            f"run on a cluster of Kubernetes 1.28 to 1.33, or check whether that page lists 1.{minor[1]} by now",
        )


def test_every_job_api_has_an_operator_reader_and_the_role_is_in_aws_hyperpod() -> None:
    """other_api_line and check_crd read each API's operator (OPERATOR_READERS); render-rbac puts the HyperPod
    operator's read in the namespace the reader lists, for deploy/ and a Kubeflow profile alike."""
    assert set(OPERATOR_READERS) == set(JOB_APIS)
    assert HYPERPOD_OPERATOR_NAMESPACE == HYPERPOD_NAMESPACE
    assert "hyperpodpytorchjobs.sagemaker.amazonaws.com" in roles(HYPERPODPYTORCHJOB.name)[1].rules[0].names
    for profile in (False, True):
        subject = Subject("team-a", "default-editor")
        docs = list(yaml.safe_load_all(render(subject, HYPERPODPYTORCHJOB.name, kubeflow_profile=profile)))
        read = [d for d in docs if d["metadata"]["name"].startswith("hyperpod-pretrain-hyperpod-operator-read")]
        assert [(d["kind"], d["metadata"]["namespace"]) for d in read] == [
            ("Role", HYPERPOD_NAMESPACE),
            ("RoleBinding", HYPERPOD_NAMESPACE),
        ]
