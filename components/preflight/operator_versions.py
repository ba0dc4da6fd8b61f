"""Which release of each job API's operator the cluster runs, read where that operator publishes it: the Training
Operator's Deployment (its version label, else its image tag and the table of release images below), Kubeflow
Trainer's public ConfigMap (else its controller's image tag), the SageMaker HyperPod training operator's Deployment in
aws-hyperpod (its image tag). The crd check reports it; HyperPod auto-resume needs certain Training Operator releases,
and the HyperPod training operator certain Kubernetes versions (`OperatorReader.kubernetes`).

Reading the cluster is the preflight's, so the reader of each API's operator is chosen here by the API's name
(`OPERATOR_READERS`); what the launcher knows of each API stays on its JobApi."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kubernetes.client.exceptions import ApiException

from components.launch_training.hyperpodpytorchjob import HYPERPODPYTORCHJOB
from components.launch_training.pytorchjob import PYTORCHJOB
from components.launch_training.trainjob import TRAINJOB
from components.preflight.context import Context, forbidden, not_found, raw_items
from components.preflight.image_reference import SEMVER, image_tag

# The Training Operator is found by its label, whatever its Deployment is called: the release manifests name it
# training-operator, HyperPod's dependency chart after the Helm release (aws/sagemaker-hyperpod-cli,
# helm_chart/HyperPodHelmChart/charts/training-operators); both put it in kubeflow with this label.
OPERATOR_NAMESPACE, OPERATOR_SELECTOR = "kubeflow", "control-plane=kubeflow-training-operator"
VERSION_LABEL = "app.kubernetes.io/version"
AUTO_RESUME_OPERATOR_VERSIONS = ("1.7.0", "1.8.0", "1.8.1")  # the Training Operator versions HyperPod resumes
# Release images carry the commit they were built from (kubeflow/training-operator:v1-<sha>), not the release. Image
# tag -> release, each from kubeflow/training-operator at that release's tag, manifests/overlays/standalone/
# kustomization.yaml, `images: newTag` (1.9.x publishes to ghcr.io/kubeflow/training-v1/training-operator). Matched on
# the tag alone, so an image mirrored to another registry (ECR) is recognised too.
OPERATOR_RELEASE_TAGS: dict[str, str] = {
    "v1-855e096": "v1.7.0",
    "v1-9e52eb7": "v1.8.0",
    "v1-04f9f13": "v1.8.1",
    "v1-5170a36": "v1.9.0",
    "v1-5c0e763": "v1.9.1",
    "v1-3f15cb8": "v1.9.2",
    "v1-d6eb98e": "v1.9.3",
    "v1-93c5489": "v1.9.4",
}
OPERATOR_MANIFEST = "github.com/kubeflow/training-operator/blob/v1.8.1/manifests/overlays/standalone/kustomization.yaml"
HOW_TO_CHECK = (
    "check by hand: kubectl -n {ns} get deploy {name} -o jsonpath='{{.spec.template.spec.containers[0]"
    ".image}}' and compare its tag with newTag in the release's manifests/overlays/standalone/"
    f"kustomization.yaml ({OPERATOR_MANIFEST})"
)

# Kubeflow Trainer publishes its version to every authenticated user (kubeflow/trainer v2.3.0,
# manifests/overlays/manager/kustomization.yaml: configMapGenerator kubeflow-trainer-public, literal
# kubeflow_trainer_version; manifests/base/rbac/public_configmap_role*.yaml: get for system:authenticated).
TRAINER_NAMESPACE, TRAINER_PUBLIC = "kubeflow-system", "kubeflow-trainer-public"
TRAINER_VERSION_KEY = "kubeflow_trainer_version"
TRAINER_DEPLOYMENT = "kubeflow-trainer-controller-manager"  # manifests/base/manager/manager.yaml, image tagged vX.Y.Z
TRAINER = "Kubeflow Trainer"

# The SageMaker HyperPod training operator, the EKS add-on amazon-sagemaker-hyperpod-training-operator, runs in
# aws-hyperpod (AWS, "Using the HyperPod training operator", docs.aws.amazon.com/sagemaker/latest/dg/
# sagemaker-eks-operator.html). AWS publishes no name of its Deployment; the one name it publishes of the operator's
# objects is its ServiceMonitor's, hyperpod-training-operator (AWS, "Using the training operator to run jobs",
# sagemaker-eks-operator-usage.html, Monitoring). That the Deployment's name contains training-operator is our
# assumption from it. The add-on's version is what EKS says it installed.
HYPERPOD_NAMESPACE, HYPERPOD_DEPLOYMENT_PART = "aws-hyperpod", "training-operator"
HYPERPOD_ADDON = "amazon-sagemaker-hyperpod-training-operator"
HYPERPOD_HOW_TO_CHECK = (
    f"check by hand: aws eks describe-addon --cluster-name <cluster> --addon-name {HYPERPOD_ADDON} "
    "--query addon.addonVersion"
)


@dataclass
class OperatorVersion:
    """An operator's release as read off the cluster."""

    version: str  # as written ("v1.8.1"), "" when unknown
    where: str  # what it was read from and how, or why it could not be
    operator: str = "Training Operator"  # for messages
    how_to_check: str = HOW_TO_CHECK.format(ns=OPERATOR_NAMESPACE, name="training-operator")  # "": no way known


def training_operator_version(ctx: Context) -> OperatorVersion:
    """The Training Operator's version: a semver version label or image tag, else its release image tag's release.

    Its Deployment is listed by label in kubeflow (deploy/rbac.yaml grants that), else in every namespace (the
    optional cluster-read file). Read raw, as pods are: a preloaded response is logged whole at DEBUG by the kubernetes
    client (kubernetes/client/rest.py), with every plain-text env value in it."""
    kube, apps = ctx.kube, ctx.apps
    deployments: list[Any] = []
    refused = False
    try:
        deployments = raw_items(
            kube.call(
                "list Deployments",
                apps.list_namespaced_deployment,
                OPERATOR_NAMESPACE,
                label_selector=OPERATOR_SELECTOR,
                _preload_content=False,
            )
        )
    except ApiException as exc:
        if not forbidden(exc):
            raise
        refused = True
    if not deployments:
        try:
            deployments = raw_items(
                kube.call(
                    "list Deployments",
                    apps.list_deployment_for_all_namespaces,
                    label_selector=OPERATOR_SELECTOR,
                    _preload_content=False,
                )
            )
        except ApiException as exc:
            if not forbidden(exc):
                raise
            if refused:
                return OperatorVersion("", "cannot read Deployments: the service account may not list deployments")
            why = f"no Deployment labelled {OPERATOR_SELECTOR} in {OPERATOR_NAMESPACE}; other namespaces not readable"
            return OperatorVersion("", why)
    if not deployments:
        return OperatorVersion("", f"no Deployment labelled {OPERATOR_SELECTOR} in any namespace")
    deployment = deployments[0]
    namespace, name = deployment["metadata"].get("namespace", ""), deployment["metadata"]["name"]
    found = OperatorVersion("", f"{namespace}/{name}", how_to_check=HOW_TO_CHECK.format(ns=namespace, name=name))
    label = (deployment["metadata"].get("labels") or {}).get(VERSION_LABEL, "")
    if SEMVER.fullmatch(label):
        found.version = label
        return found
    containers = (((deployment.get("spec") or {}).get("template") or {}).get("spec") or {}).get("containers") or []
    images = [c.get("image") or "" for c in containers]
    image = next((i for i in images if "training-operator" in i), images[0] if images else "")
    tag = image_tag(image)
    if SEMVER.fullmatch(tag):
        found.version = tag
    elif tag in OPERATOR_RELEASE_TAGS:
        found.version, found.where = OPERATOR_RELEASE_TAGS[tag], f"{found.where}, image tag {tag}"
    else:
        found.where += f", image tag {tag or 'none'!r} is no version nor a release's tag known here"
    return found


def trainer_version(ctx: Context) -> OperatorVersion:
    """Kubeflow Trainer's version: its public ConfigMap (readable by everyone), else its controller's image tag."""
    where = f"{TRAINER_NAMESPACE}/{TRAINER_PUBLIC}"
    try:
        config = ctx.kube.call("get ConfigMap", ctx.core.read_namespaced_config_map, TRAINER_PUBLIC, TRAINER_NAMESPACE)
        version = (config.data or {}).get(TRAINER_VERSION_KEY, "")
        if version:
            return OperatorVersion(version, where, TRAINER, how_to_check="")
        missing = f"{where} has no {TRAINER_VERSION_KEY}"
    except ApiException as exc:
        if not (forbidden(exc) or not_found(exc)):
            raise
        missing = f"{where} not {'readable' if forbidden(exc) else 'found'}"
    try:  # listed by name: deploy/rbac-cluster-read.yaml grants list on Deployments, not get
        deployments = raw_items(
            ctx.kube.call(
                "list Deployments",
                ctx.apps.list_namespaced_deployment,
                TRAINER_NAMESPACE,
                field_selector=f"metadata.name={TRAINER_DEPLOYMENT}",
                _preload_content=False,
            )
        )
    except ApiException as exc:
        if not forbidden(exc):
            raise
        deployments = []
    if not deployments:
        why = f"{missing}; its controller {TRAINER_NAMESPACE}/{TRAINER_DEPLOYMENT} not found or not readable"
        return OperatorVersion("", why, TRAINER, how_to_check="")
    containers = deployments[0]["spec"]["template"]["spec"].get("containers") or []
    tag = image_tag(next((c.get("image", "") for c in containers), ""))
    where = f"{TRAINER_NAMESPACE}/{TRAINER_DEPLOYMENT}, image tag {tag or 'none'}"
    return OperatorVersion(tag if SEMVER.fullmatch(tag) else "", f"{missing}; {where}", TRAINER, how_to_check="")


def trainer_installed(ctx: Context) -> str:
    """Kubeflow Trainer and its version, which every authenticated user may read."""
    return f"{TRAINER} {trainer_version(ctx).version or '(version unknown)'}"


def training_operator_installed(ctx: Context) -> str:
    """The Training Operator, its version unread: a pipeline compiled for TrainJobs may not list Deployments in
    kubeflow."""
    return "the Kubeflow Training Operator (PyTorchJob)"


def hyperpod_operator_version(ctx: Context) -> OperatorVersion:
    """The HyperPod training operator's version: the image tag of the Deployment in aws-hyperpod whose name contains
    training-operator (module comment: our assumption), when the tag reads as a version.

    deploy/rbac-hyperpodpytorchjob.yaml grants the list; read raw, as the Training Operator's is (its env stays out of
    the client's DEBUG log)."""
    try:
        deployments = raw_items(
            ctx.kube.call(
                "list Deployments", ctx.apps.list_namespaced_deployment, HYPERPOD_NAMESPACE, _preload_content=False
            )
        )
    except ApiException as exc:
        if not forbidden(exc):
            raise
        return _hyperpod_unknown(
            f"Deployments in {HYPERPOD_NAMESPACE} not readable: the service account may not list them"
        )
    names = [d["metadata"]["name"] for d in deployments]
    name = next((n for n in names if HYPERPOD_DEPLOYMENT_PART in n), "")
    if not name:
        return _hyperpod_unknown(f"no Deployment named *{HYPERPOD_DEPLOYMENT_PART}* in {HYPERPOD_NAMESPACE}")
    deployment = deployments[names.index(name)]
    containers = (((deployment.get("spec") or {}).get("template") or {}).get("spec") or {}).get("containers") or []
    tag = image_tag(next((c.get("image") or "" for c in containers), ""))
    version = tag if SEMVER.fullmatch(tag) else f"image tag {tag or 'none'}"
    return OperatorVersion(version, f"{HYPERPOD_NAMESPACE}/{name}", HYPERPODPYTORCHJOB.operator, HYPERPOD_HOW_TO_CHECK)


def _hyperpod_unknown(why: str) -> OperatorVersion:
    """Version unknown: why, and how to read it by hand, in what the crd check shows (its version gates nothing, so
    no fix is called for)."""
    return OperatorVersion("", f"{why}; {HYPERPOD_HOW_TO_CHECK}", HYPERPODPYTORCHJOB.operator, HYPERPOD_HOW_TO_CHECK)


def hyperpod_operator_installed(ctx: Context) -> str:
    """The HyperPod training operator, its version unread: a pipeline compiled for another job API may not list
    Deployments in aws-hyperpod."""
    return f"{HYPERPODPYTORCHJOB.operator} ({HYPERPODPYTORCHJOB.kind})"


@dataclass(frozen=True)
class SupportedKubernetes:
    """The Kubernetes minor versions an operator's publisher says it supports, and where it says so."""

    lowest: tuple[int, int]
    highest: tuple[int, int]
    source: str

    def __contains__(self, version: tuple[int, int]) -> bool:
        return self.lowest <= version <= self.highest

    def __str__(self) -> str:
        return f"{self.lowest[0]}.{self.lowest[1]} to {self.highest[0]}.{self.highest[1]}"


# AWS, "Using the HyperPod training operator" (docs.aws.amazon.com/sagemaker/latest/dg/sagemaker-eks-operator.html),
# Supported versions: Kubernetes 1.28, 1.29, 1.30, 1.31, 1.32 and 1.33 (an older copy of the page stops at 1.32).
HYPERPOD_KUBERNETES = SupportedKubernetes(
    (1, 28),
    (1, 33),
    'AWS, "Using the HyperPod training operator", Supported versions: '
    "docs.aws.amazon.com/sagemaker/latest/dg/sagemaker-eks-operator.html",
)


@dataclass(frozen=True)
class OperatorReader:
    """How the preflight reads one job API's operator off the cluster."""

    version: Callable[[Context], OperatorVersion]  # its release, where it publishes it
    installed: Callable[[Context], str]  # what the cluster has, said to a pipeline compiled for another job API
    kubernetes: SupportedKubernetes | None = None  # the Kubernetes versions it supports, where its publisher says


OPERATOR_READERS: dict[str, OperatorReader] = {
    PYTORCHJOB.name: OperatorReader(training_operator_version, training_operator_installed),
    TRAINJOB.name: OperatorReader(trainer_version, trainer_installed),
    HYPERPODPYTORCHJOB.name: OperatorReader(
        hyperpod_operator_version, hyperpod_operator_installed, HYPERPOD_KUBERNETES
    ),
}
