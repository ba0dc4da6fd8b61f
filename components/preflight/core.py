"""Preflight: check the cluster against the exact job the launcher would create, before it creates it.

The manifest is rendered with the launcher's own `render_job(cfg.job_spec())` (a PyTorchJob, or a TrainJob with the
pod its runtime makes) and everything checked comes from it: the job API and its operator (and a TrainJob's
runtime), the Kueue queue, namespace, the worker's resources, nodeSelector, node affinity, tolerations, the PVC,
/dev/shm, the image, the node counts, the auto-resume annotation, and the trainer's preset, grace period and torchrun
shutdown timeout (what a SIGTERM's checkpoint must write, and in how long). Each check is pass, warn, fail or n/a
with a one-line reason and a one-line fix (the seed's troubleshooting table where it has one). Every call goes
through `Kube.call` (timeouts, retries of transient errors); any other API error fails only its own check, and a 403
on reading cluster state warns (the step's service account may not be allowed to look), so the other checks still
run."""

from __future__ import annotations

import json
import logging
import math
import re
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from common.errors import InputError, StepFailed
from components.kube import Kube, KubeSettings, api_client_from_environment, describe
from components.launch_pytorchjob.core import LaunchConfig
from components.launch_pytorchjob.job_api import JobApi, api_of
from components.launch_pytorchjob.manifest import AUTO_RESUME, HEALTH_LABEL, QUEUE_LABEL
from components.launch_pytorchjob.pytorchjob import PYTORCHJOB
from components.launch_pytorchjob.trainjob import (
    DSHM,
    TRAINJOB,
    queued_grace_conflict,
    render_runtime,
    runtime_grace_period,
    trainjob_pod,
)
from components.preflight.access import JOBS, PROFILE_ACCOUNT, kubeflow_source, launcher_access
from trainer.tracking import probe

log = logging.getLogger(__name__)

PASS, WARN, FAIL, NOT_APPLICABLE = "pass", "warn", "fail", "n/a"

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
GPU, EFA = "nvidia.com/gpu", "vpc.amazonaws.com/efa"
FIT_RESOURCES = (GPU, EFA, "cpu", "memory")
HEALTHY = "Schedulable"
# A memory limit above this share of the instance's memory leaves too little for the kubelet's reserve, the eviction
# threshold, the OS, the device plugins and the daemons on the node: EKS nodes keep ~4% of a 2 TiB instance back
# (a p5.48xlarge has ~1968 GiB allocatable of 2048), so 95% is already at the edge of what can be scheduled at all.
MEMORY_HEADROOM = Decimal("0.95")
GI = Decimal(2**30)
EXAMPLES = 4  # nodes named in the nodes check's reason, one per cause first

SEED_FIX = {  # the seed's troubleshooting table
    "pending": "Check kubectl describe node for allocatable GPUs",
    "efa": "Ensure aws-efa-k8s-device-plugin DaemonSet is running",
    "oom": "Increase memory in resources",
    "ecr": "Re-run aws ecr get-login-password or use IRSA",
}
READ_FIX = (
    "grant the step's service account {what} to run this check: kubectl apply -f deploy/rbac.yaml (the CRD, "
    "the Training Operator in kubeflow, the PVC), kubectl apply -f deploy/rbac-cluster-read.yaml (optional: "
    "nodes, pods, DaemonSets and Deployments in all namespaces, PersistentVolumes and "
    "StorageClasses)"
)


@dataclass
class Check:
    name: str
    status: str  # pass, warn, fail, n/a
    reason: str  # one line
    fix: str = ""  # one line; empty when there is nothing to do


@dataclass
class PreflightResult:
    checks: list[Check]
    warn_only: bool = False
    target: str = ""  # what was checked: the PyTorchJob's namespace/name and its size

    @property
    def failures(self) -> list[Check]:
        return [c for c in self.checks if c.status == FAIL]

    @property
    def warnings(self) -> list[Check]:
        return [c for c in self.checks if c.status == WARN]

    @property
    def passed(self) -> bool:
        """No check failed, or failures are allowed (warn_only)."""
        return self.warn_only or not self.failures

    def verdict(self) -> str:
        failed, warned = len(self.failures), len(self.warnings)
        tail = f", {warned} warning(s)" if warned else ""
        if not failed:
            return f"passed{tail}"
        if self.warn_only:
            return f"passed: {failed} failed check(s) allowed (warn_only){tail}"
        return f"FAILED ({failed} check(s){tail})"

    def markdown(self) -> str:
        icon = {PASS: "PASS", FAIL: "**FAIL**", WARN: "warn", NOT_APPLICABLE: "n/a"}
        lines = [f"# Preflight: {self.verdict()}", ""]
        if self.target:
            lines += [self.target, ""]
        lines += ["| check | status | reason | fix |", "| --- | --- | --- | --- |"]
        lines += [f"| {c.name} | {icon[c.status]} | {_cell(c.reason)} | {_cell(c.fix)} |" for c in self.checks]
        return "\n".join(lines) + "\n"

    def to_json(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "warn_only": self.warn_only,
            "verdict": self.verdict(),
            "target": self.target,
            "failed": [c.name for c in self.failures],
            "warned": [c.name for c in self.warnings],
            "checks": [{"name": c.name, "status": c.status, "reason": c.reason, "fix": c.fix} for c in self.checks],
        }


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|") or "-"


def failure_message(result: PreflightResult) -> str:
    """One line naming each failed check with its reason and fix: a failed KFP step uploads no artifact, so the
    Markdown report never reaches the UI, only this message (the exception's) and the log do."""
    if not result.failures:
        return f"preflight {result.verdict()}"
    parts = [f"{c.name}: {c.reason.rstrip('.')}." + (f" Fix: {c.fix}" if c.fix else "") for c in result.failures]
    return "preflight failed: " + "; ".join(parts)


# -- the entry points -------------------------------------------------------------------------------------


def preflight(
    cfg: LaunchConfig, api_client: Any = None, *, warn_only: bool = False, settings: KubeSettings | None = None
) -> PreflightResult:
    """Check the cluster for the PyTorchJob `cfg` makes; `api_client` replaces the in-cluster/kubeconfig one."""
    if cfg.backend == "local":
        reason = "backend local: torchrun runs on this machine, there is no cluster to check"
        return PreflightResult([Check(name, NOT_APPLICABLE, reason) for name in CHECK_NAMES], warn_only, "local run")
    spec, job = cfg.checked_job()  # not the storage: the dataset may not be staged yet when preflight runs
    trainjob = spec.job_api == TRAINJOB.name
    return check_manifest(
        job,
        api_client,
        memory_gib=spec.instance().memory_gib,
        instance_type=spec.instance_type,
        warn_only=warn_only,
        settings=settings,
        pod=trainjob_pod(spec) if trainjob else None,
        runtime=render_runtime(spec) if trainjob else None,
        model=published_config(cfg) if cfg.init_from_model else None,
    )


def published_config(cfg: LaunchConfig) -> dict[str, Any] | str:
    """The config.json of the published model the run starts from: on the volume (given there, or staging's copy
    of an s3:// prefix), else read from S3 (one small object: the copy is staging's); or why it cannot be read."""
    local = Path(cfg.model_dir) / "config.json"
    try:
        if local.is_file() or not cfg.init_from_model.startswith("s3://"):
            return json.loads(local.read_text())
        from common.s3 import S3Settings, S3Source

        source = S3Source(
            cfg.init_from_model, S3Settings(endpoint_url=cfg.s3_endpoint_url, workers=1), what="init_from_model"
        )
        try:
            key = f"{source.prefix.rstrip('/')}/config.json"
            return json.loads(source.client.get_object(Bucket=source.bucket, Key=key)["Body"].read())
        except Exception as exc:  # botocore's, a timeout, not JSON: the check says it
            raise source.fail(exc, f"reading {key}") from None
        finally:
            source.close()
    except (OSError, ValueError, InputError, StepFailed) as exc:
        return f"init_from_model {cfg.init_from_model}: config.json not read ({exc})"


def check_manifest(
    job: dict[str, Any],
    api_client: Any = None,
    *,
    memory_gib: int = 0,
    instance_type: str = "",
    warn_only: bool = False,
    settings: KubeSettings | None = None,
    pod: dict[str, Any] | None = None,
    runtime: dict[str, Any] | None = None,
    model: dict[str, Any] | str | None = None,
) -> PreflightResult:
    """Check the cluster for a rendered job (`render_job`'s dict); `memory_gib`: the instance's. A TrainJob comes
    with the pod template its runtime makes of it (`pod`) and the runtime it expects (`runtime`); a run from a
    published model with its config.json (`model`; a string: why it could not be read)."""
    api_client = api_client or api_client_from_environment()
    kube = Kube(api_client, settings or KubeSettings())
    ctx = Context(job, kube, api_client, memory_gib, instance_type, pod, runtime, model)
    checks = [_guarded(name, fn, ctx) for name, fn in CHECKS]
    for c in checks:  # the log is all a failed step shows in the KFP UI (no artifact is uploaded): the fix goes too
        level = {FAIL: logging.ERROR, WARN: logging.WARNING}.get(c.status, logging.INFO)
        log.log(level, "preflight %s: %s (%s)%s", c.name, c.status, c.reason, f" Fix: {c.fix}" if c.fix else "")
    nodes = str(ctx.min_nodes) if ctx.min_nodes == ctx.max_nodes else f"{ctx.min_nodes} to {ctx.max_nodes}"
    target = f"{ctx.api.kind} `{ctx.namespace}/{job['metadata']['name']}`: {nodes} node(s)" + (
        f" of {instance_type}" if instance_type else ""
    )
    return PreflightResult(checks, warn_only, target)


def _guarded(name: str, fn: Callable[[Context], Check], ctx: Context) -> Check:
    """Run one check; an error it does not handle fails that check alone. Once the API server could not be reached
    at all (every retry of a call lost its connection), the checks that read the cluster fail at once, unattempted."""
    if ctx.unreachable and name in API_CHECKS:
        return Check(name, FAIL, f"not checked: {ctx.unreachable}", UNREACHABLE_FIX)
    try:
        return fn(ctx)
    except ApiException as exc:
        return Check(name, FAIL, f"Kubernetes API: {describe(exc)}", "see the API server's message; rerun when fixed")
    except StepFailed as exc:  # transient errors, retried to the end by Kube.call
        if not isinstance(exc.__cause__, ApiException) or exc.__cause__.status == 0:
            ctx.unreachable = "the Kubernetes API server is unreachable"
        return Check(name, FAIL, str(exc), UNREACHABLE_FIX)
    except Exception as exc:  # bad data from the server (an unparsable quantity), ...
        log.debug("preflight %s", name, exc_info=True)
        return Check(name, FAIL, f"{type(exc).__name__}: {exc}", "see the reason; rerun when fixed")


UNREACHABLE_FIX = "rerun when the API server answers; check the step's network, the API endpoint and credentials"


class Context:
    """The manifest's facts the checks need, and the API groups to read the cluster with."""

    def __init__(
        self,
        job: dict[str, Any],
        kube: Kube,
        api_client: Any,
        memory_gib: int,
        instance_type: str = "",
        pod: dict[str, Any] | None = None,
        runtime: dict[str, Any] | None = None,
        model: dict[str, Any] | str | None = None,
    ):
        self.job, self.kube, self.memory_gib, self.instance_type = job, kube, memory_gib, instance_type
        self.model = model  # a published model's config.json (a string: why it was not read); None: a preset
        self.api: JobApi = api_of(job)
        self.runtime = runtime  # a TrainJob's: the ClusterTrainingRuntime the compiled pipeline expects
        self.namespace: str = job["metadata"]["namespace"]
        self.name: str = job["metadata"]["name"]
        self.apps = client.AppsV1Api(api_client)
        self.core = client.CoreV1Api(api_client)
        self.custom = client.CustomObjectsApi(api_client)
        self.apiext = client.ApiextensionsV1Api(api_client)
        self.authz = client.AuthorizationV1Api(api_client)
        self.authn = client.AuthenticationV1Api(api_client)
        self.storage = client.StorageV1Api(api_client)
        self.min_nodes, self.max_nodes = self.api.nodes(job)
        if pod is None:  # a PyTorchJob carries its pod
            pod = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]
        self.pod: dict[str, Any] = pod.get("spec") or {}
        containers = self.pod.get("containers") or []
        self.container: dict[str, Any] = next(
            (c for c in containers if c.get("name") == self.api.container), containers[0]
        )
        self.request: dict[str, Decimal] = pod_requests(self.pod)
        self.annotations: dict[str, str] = job["metadata"].get("annotations") or {}
        self.unreachable = ""  # set once the API server could not be reached: later cluster reads are skipped
        self.pvc: Any = None  # the job's claim as check_pvc read it (V1PersistentVolumeClaim), for its volume

    def model_config(self, seq_len: int) -> tuple[Any, str, int, bool]:
        """The transformers config of the model the job trains, its name in messages, its vocabulary and whether
        that is assumed: the published model's (its config.json), else the preset's at the snapshot's vocabulary
        (ASSUMED_VOCAB before the dataset is staged). ValueError: the published model's config.json was not read."""
        from trainer.config import TRAIN_DEFAULTS
        from trainer.model import config_from_dict, model_config

        if isinstance(self.model, str):
            raise ValueError(self.model)
        if self.model is not None:
            config = config_from_dict(self.model)
            return config, f"the published {config.model_type} model", config.vocab_size, False
        preset = self.trainer_flag("--preset", TRAIN_DEFAULTS["preset"])
        vocab, assumed = dataset_vocab(self.trainer_flag("--data-dir", ""))
        return model_config(preset, vocab, seq_len, eos_token_id=0), preset, vocab, assumed

    def trainer_flag(self, name: str, default: Any) -> str:
        """A trainer flag's value on the container's command line (the launcher passes every one it sets)."""
        argv = [*(self.container.get("command") or []), *(self.container.get("args") or [])]
        return argv[argv.index(name) + 1] if name in argv[:-1] else str(default)

    @property
    def auto_resume(self) -> bool:
        return self.annotations.get(AUTO_RESUME) == "true"

    def volume(self, predicate: Callable[[dict[str, Any]], bool]) -> dict[str, Any] | None:
        return next((v for v in self.pod.get("volumes") or [] if predicate(v)), None)


def pod_of_job(ctx: Context, pod: dict[str, Any]) -> bool:
    """Whether a pod (raw JSON) is one of the job's (its API's label)."""
    key, _, value = ctx.api.pod_selector(ctx.name).partition("=")
    return (pod["metadata"].get("labels") or {}).get(key) == value


def forbidden(exc: BaseException) -> bool:
    return isinstance(exc, ApiException) and exc.status == 403


def not_found(exc: BaseException) -> bool:
    return isinstance(exc, ApiException) and exc.status == 404


# -- 1. the job API: its CRD, its operator and (a TrainJob's) runtime ----------------------------------------

# Kubeflow Trainer publishes its version to every authenticated user (kubeflow/trainer v2.3.0,
# manifests/overlays/manager/kustomization.yaml: configMapGenerator kubeflow-trainer-public, literal
# kubeflow_trainer_version; manifests/base/rbac/public_configmap_role*.yaml: get for system:authenticated).
TRAINER_NAMESPACE, TRAINER_PUBLIC = "kubeflow-system", "kubeflow-trainer-public"
TRAINER_VERSION_KEY = "kubeflow_trainer_version"
TRAINER_DEPLOYMENT = "kubeflow-trainer-controller-manager"  # manifests/base/manager/manager.yaml, image tagged vX.Y.Z
TRAINER_INSTALL = (
    "install Kubeflow Trainer v2.3 (kubectl apply --server-side -k github.com/kubeflow/trainer.git/"
    "manifests/overlays/manager?ref=v2.3.0)"
)
OPERATOR_INSTALL = (
    "install the Kubeflow Training Operator 1.8.x (kubectl apply --server-side -k github.com/"
    "kubeflow/training-operator.git/manifests/overlays/standalone?ref=v1.8.1)"
)


def crd_name(api: JobApi) -> str:
    return f"{api.plural}.{api.group}"


def read_crd(ctx: Context, api: JobApi) -> dict[str, Any] | None:
    """The API's CRD (raw JSON: the typed model would deserialize its schema, thousands of lines, for nothing);
    None when it is not installed. Raises a 403."""
    try:
        answer = ctx.kube.call(
            "read CRD", ctx.apiext.read_custom_resource_definition, crd_name(api), _preload_content=False
        )
    except ApiException as exc:
        if not_found(exc):
            return None
        raise
    return json.loads(answer.data)


def other_api_line(ctx: Context) -> str:
    """When the compiled API's CRD is missing: what the cluster has instead, and the one thing to do."""
    other = TRAINJOB if ctx.api.name == PYTORCHJOB.name else PYTORCHJOB
    try:
        found = read_crd(ctx, other) is not None
    except ApiException:
        found = False
    if not found:
        return ""
    if other is TRAINJOB:
        version = trainer_version(ctx).version
        return (
            f"this cluster has Kubeflow Trainer {version or '(version unknown)'} and no PyTorchJob CRD: compile "
            "with --job-api trainjob and apply deploy/trainjob-runtime.yaml"
        )
    return (
        "this cluster has the Kubeflow Training Operator (PyTorchJob) and no TrainJob CRD: compile with --job-api "
        "pytorchjob"
    )


def check_crd(ctx: Context) -> Check:
    """The compiled job API is served (its CRD installed, v-served and Established) and its operator's version."""
    api = ctx.api
    name = crd_name(api)
    install = TRAINER_INSTALL if api is TRAINJOB else OPERATOR_INSTALL
    try:
        crd = read_crd(ctx, api)
        if crd is None:
            instead = other_api_line(ctx)
            return Check(
                "crd",
                FAIL,
                instead or f"the {api.kind} CRD {name} is not installed: no job can be created",
                "" if instead else install,
            )
    except ApiException as exc:
        if not forbidden(exc):
            raise
        crd = None
    reasons, fixes, status = [], [], PASS
    if crd is None:
        status = WARN
        reasons.append("cannot read CRDs: the service account may not get customresourcedefinitions")
        fixes.append(READ_FIX.format(what="get on customresourcedefinitions.apiextensions.k8s.io"))
    else:
        served = [v["name"] for v in (crd.get("spec") or {}).get("versions") or [] if v.get("served")]
        conditions = (crd.get("status") or {}).get("conditions") or []
        established = next((c for c in conditions if c.get("type") == "Established"), None)
        if api.version not in served:
            return Check("crd", FAIL, f"{name} serves {', '.join(served) or 'no version'}, not {api.version}", install)
        if established is None or established.get("status") != "True":
            why = f": {established['message']}" if established is not None and established.get("message") else ""
            return Check(
                "crd", FAIL, f"{name} is not Established{why}", f"kubectl describe crd {name}; reinstall {api.operator}"
            )
        reasons.append(f"{name} {api.version} installed")
    if api is TRAINJOB:
        found = trainer_version(ctx)
        reasons.append(f"Kubeflow Trainer {found.version or 'version unknown'} ({found.where})")
        return Check("crd", status, "; ".join(reasons), "; ".join(fixes))
    operator = operator_version(ctx)
    shown = f"Training Operator {operator.version or 'version unknown'} ({operator.where})"
    if ctx.auto_resume and operator.version.removeprefix("v") not in AUTO_RESUME_OPERATOR_VERSIONS:
        status = WARN
        reasons.append(
            f"{shown}: HyperPod auto-resume needs {', '.join(AUTO_RESUME_OPERATOR_VERSIONS[:-1])} or "
            f"{AUTO_RESUME_OPERATOR_VERSIONS[-1]}"
        )
        if not operator.version:
            fixes.append(HOW_TO_CHECK.format(ns=operator.namespace, name=operator.name))
        fixes.append("install Training Operator v1.8.1, or turn auto-resume off (job option auto_resume: false)")
    else:
        reasons.append(shown)
    return Check("crd", status, "; ".join(reasons), "; ".join(fixes))


@dataclass
class TrainerVersion:
    version: str  # "v2.3.0", "" when unknown
    where: str


def trainer_version(ctx: Context) -> TrainerVersion:
    """Kubeflow Trainer's version: its public ConfigMap (readable by everyone), else its controller's image tag."""
    where = f"{TRAINER_NAMESPACE}/{TRAINER_PUBLIC}"
    try:
        config = ctx.kube.call("get ConfigMap", ctx.core.read_namespaced_config_map, TRAINER_PUBLIC, TRAINER_NAMESPACE)
        version = (config.data or {}).get(TRAINER_VERSION_KEY, "")
        if version:
            return TrainerVersion(version, where)
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
        return TrainerVersion(
            "", f"{missing}; its controller {TRAINER_NAMESPACE}/{TRAINER_DEPLOYMENT} not found or not readable"
        )
    containers = deployments[0]["spec"]["template"]["spec"].get("containers") or []
    tag = image_tag(next((c.get("image", "") for c in containers), ""))
    where = f"{TRAINER_NAMESPACE}/{TRAINER_DEPLOYMENT}, image tag {tag or 'none'}"
    return TrainerVersion(tag if _SEMVER.fullmatch(tag) else "", f"{missing}; {where}")


# What our ClusterTrainingRuntime must hold for the compiled pipeline's TrainJobs: the paths compared, each with what
# it is for. The rest (extra tolerations, labels) is the platform team's to change.
RUNTIME_CONTRACT = (
    ("mlPolicy.torch", "the torch policy (PET_* rendezvous environment)"),
    (
        "template.spec.failurePolicy",
        "JobSet restarts the group (its maxRestarts, the restart budget, is the runtime's "
        "own: render-runtime --restart-budget)",
    ),
    ("template.spec.replicatedJobs[node].template.metadata.labels", "the trainer's ancestor label"),
    ("template.spec.replicatedJobs[node].template.spec.backoffLimit", "a failed pod fails its Job"),
    ("pod.restartPolicy", "no restarts in place"),
    ("pod.containers[node].command", "torchrun's settings"),
    ("pod.containers[node].volumeMounts", "the FSx and /dev/shm mounts"),
    ("pod.volumes", "the FSx claim"),
    ("pod.serviceAccountName", "the trainer pods' service account"),
    ("pod.automountServiceAccountToken", "no API token in the trainer pods"),
)


NODE_POD = "template.spec.replicatedJobs[node].template.spec.template.spec"  # the trainer's pod in a runtime


def runtime_field(runtime: dict[str, Any], path: str) -> Any:
    """A field of a ClusterTrainingRuntime's spec by a contract path (`[node]`: the list entry of that name; `pod.`:
    the node job's pod spec); None where it is missing."""
    value: Any = runtime.get("spec")
    full = f"{NODE_POD}.{path.removeprefix('pod.')}" if path.startswith("pod.") else path
    for part in full.replace("[", ".[").split("."):
        if part.startswith("["):
            value = next((i for i in value or [] if isinstance(i, dict) and i.get("name") == part[1:-1]), None)
        else:
            value = value.get(part) if isinstance(value, dict) else None
    return value


def contract_field(runtime: dict[str, Any], path: str) -> Any:
    """A contract field as compared: less what each TrainJob patches in itself (TrainJobApi.render's
    spec.runtimePatches), the size of /dev/shm, a run's choice (job option shm_size)."""
    value = runtime_field(runtime, path)
    if path == "template.spec.failurePolicy":  # present, whatever its budget
        return "set" if isinstance(value, dict) and value.get("maxRestarts") is not None else "missing"
    if path == "pod.volumes" and isinstance(value, list):
        value = [
            {**v, "emptyDir": {k: x for k, x in v["emptyDir"].items() if k != "sizeLimit"}}
            if v.get("name") == DSHM and isinstance(v.get("emptyDir"), dict)
            else v
            for v in value
        ]
    return value


def check_runtime(ctx: Context) -> Check:
    """A TrainJob's ClusterTrainingRuntime exists and holds what the compiled pipeline relies on."""
    if ctx.runtime is None:
        return Check("runtime", NOT_APPLICABLE, f"a {ctx.api.kind} carries its own pods: no runtime")
    name = ctx.runtime["metadata"]["name"]
    apply = (
        "apply deploy/trainjob-runtime.yaml, or what `hyperpod-pretrain render-runtime` prints for this "
        "pipeline's settings (a cluster admin: ClusterTrainingRuntimes are cluster-scoped)"
    )
    try:
        found = ctx.kube.call(
            "get ClusterTrainingRuntime",
            ctx.custom.get_cluster_custom_object,
            TRAINJOB.group,
            TRAINJOB.version,
            "clustertrainingruntimes",
            name,
        )
    except ApiException as exc:
        if not_found(exc):
            return Check(
                "runtime",
                FAIL,
                f"ClusterTrainingRuntime {name} is not installed: every TrainJob of this pipeline names it",
                apply,
            )
        if not forbidden(exc):
            raise
        return Check(
            "runtime",
            WARN,
            f"cannot read ClusterTrainingRuntime {name}: the service account may not get clustertrainingruntimes",
            READ_FIX.format(what="get on clustertrainingruntimes.trainer.kubeflow.org"),
        )
    differs = [
        f"{path} ({why}) is {json.dumps(contract_field(found, path))}, not "
        f"{json.dumps(contract_field(ctx.runtime, path))}"
        for path, why in RUNTIME_CONTRACT
        if contract_field(found, path) != contract_field(ctx.runtime, path)
    ]
    if differs:
        return Check(
            "runtime",
            FAIL,
            f"ClusterTrainingRuntime {name} differs from this pipeline's: "
            f"{'; '.join(differs[:3])}" + (f"; and {len(differs) - 3} more" if len(differs) > 3 else ""),
            apply,
        )
    queue = (ctx.job["metadata"].get("labels") or {}).get(QUEUE_LABEL, "")
    grace = int(ctx.pod.get("terminationGracePeriodSeconds", runtime_grace_period(found)))
    if why := queued_grace_conflict(queue, grace, name, runtime_grace_period(found)):
        reason, _, fix = why.partition("; run with ")
        return Check("runtime", FAIL, reason, f"run with {fix}")
    budget = runtime_field(found, "template.spec.failurePolicy.maxRestarts")
    return Check("runtime", PASS, f"ClusterTrainingRuntime {name} matches this pipeline's (restart budget {budget})")


_SEMVER = re.compile(r"v?(\d+)\.(\d+)\.(\d+)(?:[-+][0-9A-Za-z.+-]+)?")


@dataclass
class OperatorVersion:
    version: str  # as written ("v1.8.1"), "" when unknown
    where: str  # the Deployment it was read from and how, or why it could not be
    namespace: str = OPERATOR_NAMESPACE  # the Deployment's, for the how-to-check line
    name: str = "training-operator"


def operator_version(ctx: Context) -> OperatorVersion:
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
    found = OperatorVersion("", f"{namespace}/{name}", namespace, name)
    label = (deployment["metadata"].get("labels") or {}).get(VERSION_LABEL, "")
    if _SEMVER.fullmatch(label):
        found.version = label
        return found
    containers = (((deployment.get("spec") or {}).get("template") or {}).get("spec") or {}).get("containers") or []
    images = [c.get("image") or "" for c in containers]
    image = next((i for i in images if "training-operator" in i), images[0] if images else "")
    tag = image_tag(image)
    if _SEMVER.fullmatch(tag):
        found.version = tag
    elif tag in OPERATOR_RELEASE_TAGS:
        found.version, found.where = OPERATOR_RELEASE_TAGS[tag], f"{found.where}, image tag {tag}"
    else:
        found.where += f", image tag {tag or 'none'!r} is no version nor a release's tag known here"
    return found


def image_tag(image: str) -> str:
    name = image.split("@", 1)[0]
    last = name.rsplit("/", 1)[-1]
    return last.split(":", 1)[1] if ":" in last else ""


# -- 2. the launcher's permissions --------------------------------------------------------------------------


LAUNCHER_ACCESS = launcher_access(PYTORCHJOB)


def whoami(ctx: Context) -> str:
    """The step's own user name (a SelfSubjectReview, which every authenticated user may make: the bootstrap
    ClusterRole system:basic-user), or "" where the server cannot say."""
    review = client.V1SelfSubjectReview(metadata=client.V1ObjectMeta())
    try:
        answer = ctx.kube.call("review identity", ctx.authn.create_self_subject_review, review)
    except ApiException:
        return ""
    return (answer.status.user_info.username or "") if answer.status and answer.status.user_info else ""


def rbac_fix(ctx: Context, user: str) -> str:
    """The command that renders what is missing for the step's service account and the jobs' namespace (a Kubeflow
    profile's default-editor: less what kubeflow-edit gives it)."""
    prefix = "system:serviceaccount:"
    if user.startswith(prefix):
        account_ns, _, account = user.removeprefix(prefix).partition(":")
    else:
        account_ns, account = "<its namespace>", "<the pipeline steps' service account>"
    where = f"--namespace {account_ns}"
    if account_ns != ctx.namespace:
        where += f" --jobs-namespace {ctx.namespace}"
    profile = " --kubeflow-profile" if account == PROFILE_ACCOUNT and account_ns == ctx.namespace else ""
    return (
        f"hyperpod-pretrain render-rbac {where} --service-account {account} --job-api {ctx.api.name}{profile} "
        "| kubectl apply -f -"
    )


def granted_by(ctx: Context, user: str, access: tuple[tuple[str, str, str, str, bool], ...]) -> str:
    """Which roles are expected to grant the launcher's access: for a Kubeflow profile's default-editor, Kubeflow's
    aggregated into kubeflow-edit where they cover it; render-rbac's Roles for the rest."""
    profile = user == f"system:serviceaccount:{ctx.namespace}:{PROFILE_ACCOUNT}"
    sources: dict[str, int] = {}
    for verb, group, resource, subresource, _ in access:
        kubeflow = profile and kubeflow_source(
            ctx.api.name, JOBS, verb, group, f"{resource}/{subresource}" if subresource else resource
        )
        name = f"Kubeflow's {kubeflow.role} (kubeflow-edit)" if kubeflow else "render-rbac's Roles"
        sources[name] = sources.get(name, 0) + 1
    return "; ".join(f"{count} from {name}" for name, count in sources.items())


def check_permissions(ctx: Context) -> Check:
    ns = ctx.namespace
    missing: list[tuple[str, str, bool]] = []
    access = launcher_access(ctx.api)
    user = whoami(ctx)
    fix = rbac_fix(ctx, user)
    for verb, group, resource, subresource, needed in access:
        attrs = client.V1ResourceAttributes(
            namespace=ns, verb=verb, group=group, resource=resource, subresource=subresource or None
        )
        review = client.V1SelfSubjectAccessReview(spec=client.V1SelfSubjectAccessReviewSpec(resource_attributes=attrs))
        try:
            answer = ctx.kube.call("review access", ctx.authz.create_self_subject_access_review, review)
        except ApiException as exc:
            if not forbidden(exc):
                raise
            return Check(
                "permissions",
                WARN,
                "cannot review the service account's access (SelfSubjectAccessReview forbidden)",
                fix,
            )
        if not (answer.status and answer.status.allowed):
            qualified = f"{resource}.{group}" if group else resource
            missing.append((verb, f"{qualified}/{subresource}" if subresource else qualified, needed))
    who = user.removeprefix("system:serviceaccount:").replace(":", "/") or "the service account"
    needed = [f"{verb} {what}" for verb, what, must in missing if must]
    optional = [f"{verb} {what}" for verb, what, must in missing if not must]
    if needed:
        also = f"; also {', '.join(optional)} (the pods' events)" if optional else ""
        return Check("permissions", FAIL, f"{who} may not, in namespace {ns}: {', '.join(needed)}{also}", fix)
    if optional:
        return Check(
            "permissions",
            WARN,
            f"{who} may not {', '.join(optional)} in {ns}: the launcher runs but cannot show the pods' events",
            fix,
        )
    return Check(
        "permissions",
        PASS,
        f"all {len(access)} permissions the launcher uses, in namespace {ns}, for {who} "
        f"({granted_by(ctx, user, access)})",
    )


# -- 3. the FSx PVC -----------------------------------------------------------------------------------------


def check_pvc(ctx: Context) -> Check:
    volume = ctx.volume(lambda v: "persistentVolumeClaim" in v)
    if volume is None:
        return Check("fsx-pvc", NOT_APPLICABLE, "the job mounts no PersistentVolumeClaim")
    claim, ns = volume["persistentVolumeClaim"]["claimName"], ctx.namespace
    try:
        pvc = ctx.kube.call("read PVC", ctx.kube.core.read_namespaced_persistent_volume_claim, claim, ns)
    except ApiException as exc:
        if not_found(exc):
            return Check(
                "fsx-pvc",
                FAIL,
                f"PVC {claim} does not exist in namespace {ns}: the pods would stay Pending",
                f"hyperpod-pretrain render-storage --namespace {ns} --pvc-name {claim} --file-system-id "
                "<fs-id> --dns-name <its DNSName> --mount-name <its MountName> --capacity <its size> | "
                "kubectl apply -f - (the file system the other namespaces' runs use: aws fsx "
                "describe-file-systems), or a PVC of the FSx CSI driver's StorageClass",
            )
        if forbidden(exc):
            return Check(
                "fsx-pvc",
                WARN,
                f"cannot read PVC {claim}: the service account may not get persistentvolumeclaims in {ns}",
                READ_FIX.format(what=f"get on persistentvolumeclaims in {ns}"),
            )
        raise
    ctx.pvc = pvc
    phase = (pvc.status.phase if pvc.status else None) or "unknown"
    modes = (pvc.status.access_modes if pvc.status and pvc.status.access_modes else None) or pvc.spec.access_modes
    modes = list(modes or [])
    problems, fixes = [], []
    if phase != "Bound":
        problems.append(f"PVC {claim} is {phase}, not Bound")
        fixes.append(
            f"kubectl -n {ns} describe pvc {claim}: check the FSx CSI driver, the StorageClass or the "
            "static PV's claimRef"
        )
    if "ReadWriteMany" not in modes:
        problems.append(
            f"PVC {claim} is {', '.join(modes) or 'without access modes'}, not ReadWriteMany: the "
            f"{ctx.max_nodes} nodes and the pipeline's steps must mount it at once"
        )
        fixes.append("use an FSx for Lustre PV/PVC with accessModes [ReadWriteMany]")
    if problems:
        return Check("fsx-pvc", FAIL, "; ".join(problems), "; ".join(fixes))
    capacity = (pvc.status.capacity or {}).get("storage", "?")
    if other := other_file_system(ctx, pvc):
        return Check(
            "fsx-pvc",
            FAIL,
            other,
            f"give namespace {ns} a PVC {claim} on the steps' file system: "
            f"hyperpod-pretrain render-storage --namespace {ns} --pvc-name {claim} ... for that file "
            "system",
        )
    return Check("fsx-pvc", PASS, f"{claim} in {ns}: Bound, ReadWriteMany, {capacity}")


MOUNTINFO = Path("/proc/self/mountinfo")  # this process's mounts (proc(5)): where the step sees the storage root


def lustre_mount(path: str, mountinfo: Path | None = None) -> tuple[str, str] | None:
    """(mount point, source) of the Lustre file system ``path`` lies on in this process, or None (not Lustre, not
    mounted here: the preflight run from a laptop). proc(5): the mount point is field 5, the file system type and
    source follow the "-" separator; a space in a path is written \\040."""
    try:
        lines = (mountinfo or MOUNTINFO).read_text().splitlines()
    except OSError:
        return None
    best: tuple[str, str, str] | None = None
    for line in lines:
        fields = line.split()
        if "-" not in fields[6:]:
            continue
        point = fields[4].replace("\\040", " ")
        rest = fields[fields.index("-", 6) + 1 :]
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and len(rest) >= 2 and (best is None or len(point) > len(best[0])):
            best = (point, rest[0], rest[1])
    return (best[0], best[2]) if best and best[1] == "lustre" else None


def other_file_system(ctx: Context, pvc: Any) -> str:
    """Why the job's volume is another file system than the one this step has where the job mounts it, or "". A Lustre
    mount's source is <NID>@tcp:/<mount name> (the client shows the server's address, not the FSx DNS name the CSI
    driver mounted: aws-fsx-csi-driver pkg/driver/node.go NodePublishVolume), so file systems are told apart by mount
    name, which FSx makes unique per file system."""
    volume = ctx.volume(lambda v: "persistentVolumeClaim" in v) or {}
    path = next(
        (m["mountPath"] for m in ctx.container.get("volumeMounts") or [] if m["name"] == volume.get("name")), ""
    )
    mounted = lustre_mount(path) if path else None  # one volume, one path: the steps have it there too
    if mounted is None or not pvc.spec.volume_name:
        return ""
    try:
        pv = ctx.kube.call("read PV", ctx.kube.core.read_persistent_volume, pvc.spec.volume_name)
    except ApiException as exc:
        if forbidden(exc) or not_found(exc):  # checkpoint-throughput says so
            return ""
        raise
    csi = pv.spec.csi
    if csi is None or csi.driver != FSX_DRIVER:
        return ""
    attributes = csi.volume_attributes or {}
    mount_name = attributes.get("mountname") or "fsx"  # the driver's default (NodePublishVolume)
    point, source = mounted
    if source.rpartition(":/")[2].split("/")[0] == mount_name:
        return ""
    return (
        f"this step has {source} at {point}, where the job mounts PVC {pvc.metadata.name}, but that PVC in "
        f"{ctx.namespace} is FSx {csi.volume_handle} ({attributes.get('dnsname', '?')}@tcp:/{mount_name}): the "
        "job would train on and checkpoint to another file system than the one the data is staged on"
    )


# -- 3b. the FSx file system's throughput for the SIGTERM checkpoint --------------------------------------------

FSX_DRIVER = "fsx.csi.aws.com"
PROVISIONED_BY = "pv.kubernetes.io/provisioned-by"  # set on a PV its StorageClass's provisioner created
# What render-storage writes on a static PV, which has no StorageClass to say how its file system was made.
STATIC_DEPLOYMENT_TYPE = "hyperpod-pretrain/fsx-deployment-type"
STATIC_PER_UNIT_THROUGHPUT = "hyperpod-pretrain/fsx-per-unit-storage-throughput"
# What the trainer checkpoints per parameter: fp32 weights and AdamW's exp_avg and exp_avg_sq, 4 bytes each (bf16
# autocast keeps the weights in fp32). The ranks write their shares in parallel (torch.distributed.checkpoint), each
# tensor once, so the save runs at the file system's throughput, not one client's.
STATE_BYTES_PER_PARAMETER = 12
# On top of those bytes. The rest of the checkpoint (schedule, RNG states, data position, the format's metadata) is
# well under 1% of them; the margin is for creating, syncing and renaming the files on Lustre's metadata server,
# which take time but no throughput.
STATE_MARGIN = Decimal("0.10")
# The share of the preemption budget the save may take. SIGTERM lands mid-step and the step in flight finishes first
# (how long a step takes is unknown here); the processes must still exit after the save. Half is left for both.
SAVE_SHARE = Decimal("0.5")
ASSUMED_VOCAB = 8192  # the pipeline's default vocab_size (pipelines/pipeline.py; tests/test_preflight.py holds it)
DEFAULT_GRACE_S = 30  # a pod's terminationGracePeriodSeconds when it sets none (the Kubernetes default)
MB = Decimal(10**6)  # FSx throughput is in MB/s of 10^6 bytes
# FSx for Lustre counts throughput per "TiB" of 1,000 GiB: "for a 2.4-TiB file system, provisioning 50 MB/s/TiB of
# PerUnitStorageThroughput yields 120 MB/s" (FSx API Reference, CreateFileSystemLustreConfiguration), and 2.4 TiB is
# the 2,400 GiB size step.
FSX_GIB_PER_TIB = 1000
# Baseline disk throughput of writes, MB/s per TiB: a checkpoint is all writes, and bursts are not counted on. The FSx
# for Lustre User Guide, "Performance characteristics of SSD and HDD storage classes": SCRATCH_2 writes 100 (reads
# 200); a persistent file system writes its PerUnitStorageThroughput, PERSISTENT_1 SSD 50, 100 or 200, HDD 12 or 40,
# PERSISTENT_2 125, 250, 500 or 1000 (API Reference, LustreFileSystemConfiguration). SCRATCH_1, the API's default
# deploymentType and the FSx CSI driver's when a StorageClass names none (pkg/util/util.go, RoundUpVolumeSize), is
# counted at the 200 MB/s/TiB scratch baseline ("Deployment options for FSx for Lustre file systems"). The CSI driver
# puts none of this on the PV (its volumeAttributes are dnsname and mountname only), so it comes from the StorageClass
# that provisioned it: a throughput changed since (aws fsx update-file-system) is not seen.
SCRATCH_WRITE = {"SCRATCH_1": 200, "SCRATCH_2": 100}
PER_UNIT_TIERS: dict[tuple[str, str], tuple[int, ...]] = {
    ("PERSISTENT_1", "SSD"): (50, 100, 200),
    ("PERSISTENT_1", "HDD"): (12, 40),
    ("PERSISTENT_2", "SSD"): (125, 250, 500, 1000),
}
SLOWEST_TIER = 12  # MB/s per TiB: no FSx for Lustre file system writes slower (PERSISTENT_1 HDD at 12)


@dataclass
class CheckpointNeed:
    """What a SIGTERM's checkpoint writes and the time it has for it."""

    model: str  # the preset's name, or "the published llama model"
    parameters: int
    vocab: int
    vocab_assumed: bool
    grace_s: int  # the pod's terminationGracePeriodSeconds
    shutdown_s: int  # torchrun's shutdown timeout: it SIGKILLs the workers this long after forwarding SIGTERM

    @property
    def budget_s(self) -> int:
        return min(self.grace_s, self.shutdown_s)

    @property
    def state_bytes(self) -> int:
        return self.parameters * STATE_BYTES_PER_PARAMETER

    @property
    def write_bytes(self) -> Decimal:
        return self.state_bytes * (1 + STATE_MARGIN)

    @property
    def mbps(self) -> Decimal:
        return self.write_bytes / MB / (self.budget_s * SAVE_SHARE)

    def seconds_at(self, mbps: Decimal) -> Decimal:
        return self.write_bytes / MB / mbps

    def describe(self) -> str:
        vocab = f"vocabulary {self.vocab:,}" + (
            " assumed: the pipeline's default, the dataset is not staged yet" if self.vocab_assumed else ""
        )
        model = self.model if self.model.startswith("the ") else f"the {self.model}"
        return (
            f"{model} checkpoint, {self.parameters:,} parameters x {STATE_BYTES_PER_PARAMETER} bytes = "
            f"{size_text(self.state_bytes)} ({vocab}), {size_text(self.write_bytes)} with a "
            f"{STATE_MARGIN * 100:.0f}% margin, needs {rate_text(self.mbps)} to take at most half of the "
            f"{self.budget_s} s preemption budget (the smaller of the pod's {self.grace_s} s grace period and "
            f"torchrun's {self.shutdown_s} s shutdown timeout; the other half is for the step in flight at "
            "SIGTERM, of a length unknown here)"
        )


def size_text(n: Decimal | int) -> str:
    return f"{Decimal(n) / 10**9:.1f} GB" if n >= 10**8 else f"{Decimal(n) / MB:.1f} MB"


def rate_text(mbps: Decimal) -> str:
    return f"{mbps:,.0f} MB/s" if mbps >= 10 else f"{mbps:.2f} MB/s"


def checkpoint_need(ctx: Context) -> CheckpointNeed:
    """The job's checkpoint size (its model built on the meta device: shapes only, no memory) and save budget."""
    import torch

    from trainer.config import TRAIN_DEFAULTS
    from trainer.model import build_model
    from trainer.preemption import TORCHRUN_DEFAULT_SHUTDOWN_S

    config, name, vocab, assumed = ctx.model_config(int(ctx.trainer_flag("--seq-len", TRAIN_DEFAULTS["seq_len"])))
    with torch.device("meta"):
        model = build_model(config)
    parameters = sum(p.numel() for p in model.parameters())  # tied embeddings once, as the state_dict saves them
    env = {e["name"]: e.get("value", "") for e in ctx.container.get("env") or []}
    grace = int(ctx.pod.get("terminationGracePeriodSeconds", DEFAULT_GRACE_S))
    shutdown = int(env.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT") or TORCHRUN_DEFAULT_SHUTDOWN_S)
    return CheckpointNeed(name, parameters, vocab, assumed, grace, shutdown)


def dataset_vocab(data_dir: str) -> tuple[int, bool]:
    """The vocabulary of the snapshot the job trains on, read where the trainer reads it (the preflight step mounts
    the same volume at the same path); (ASSUMED_VOCAB, True) before the dataset is staged."""
    from trainer.data import DataError
    from trainer.layout import META
    from trainer.snapshot import given_snapshot, model_vocab

    if not data_dir:
        return ASSUMED_VOCAB, True
    try:
        return model_vocab(json.loads((given_snapshot(Path(data_dir)) / META).read_text())), False
    except (DataError, OSError, ValueError, KeyError, TypeError):
        return ASSUMED_VOCAB, True


@dataclass
class FsxFileSystem:
    """An FSx for Lustre file system as its PersistentVolume and the StorageClass that provisioned it say."""

    pv: str
    handle: str  # the file system's id, fs-...
    capacity_gib: Decimal
    deployment: str = ""  # "": unknown
    storage_type: str = "SSD"
    per_unit: int = 0  # MB/s written per TiB; 0: unknown

    @property
    def tib(self) -> Decimal:
        return self.capacity_gib / FSX_GIB_PER_TIB

    @property
    def mbps(self) -> Decimal:
        return self.tib * self.per_unit

    def name(self) -> str:
        return f"FSx {self.handle} (PV {self.pv}, {self.capacity_gib:,.0f} GiB)"


def write_tier(parameters: dict[str, str]) -> tuple[str, str, int]:
    """(deploymentType, storageType, MB/s written per TiB) from an FSx StorageClass's parameters; 0 MB/s: unknown."""
    deployment = parameters.get("deploymentType") or "SCRATCH_1"
    storage_type = (parameters.get("storageType") or "SSD").upper()
    if deployment in SCRATCH_WRITE:
        return deployment, storage_type, SCRATCH_WRITE[deployment]
    try:
        per_unit = int(parameters.get("perUnitStorageThroughput") or 0)
    except ValueError:
        per_unit = 0
    return deployment, storage_type, per_unit if per_unit in PER_UNIT_TIERS.get((deployment, storage_type), ()) else 0


def fsx_size_gib(at_least_gib: Decimal, deployment: str, storage_type: str, per_unit: int) -> int:
    """The size the FSx CSI driver provisions for a request of `at_least_gib` (kubernetes-sigs/aws-fsx-csi-driver
    pkg/util/util.go, RoundUpVolumeSize): HDD in steps of 6,000 GiB (12 MB/s/TiB) or 1,800 GiB (40); SCRATCH_1 1,200,
    2,400, then steps of 3,600; the others 1,200, then steps of 2,400."""
    if storage_type == "HDD":
        step = 6000 if per_unit == 12 else 1800
        return step * max(1, math.ceil(at_least_gib / step))
    step = 3600 if deployment == "SCRATCH_1" else 2400
    if at_least_gib < step:
        return 1200 * max(1, math.ceil(at_least_gib / 1200))
    return step * math.ceil(at_least_gib / step)


def fitting_choices(need: CheckpointNeed, fsx: FsxFileSystem) -> list[str]:
    """What would fit: this tier at a larger size, a faster tier at this size, a longer budget."""
    size = fsx_size_gib(need.mbps * FSX_GIB_PER_TIB / fsx.per_unit, fsx.deployment, fsx.storage_type, fsx.per_unit)
    choices = [
        f"a file system of {size:,} GiB ({Decimal(size) / FSX_GIB_PER_TIB:.1f} TiB) at {fsx.per_unit} "
        "MB/s/TiB (a larger PVC request where the StorageClass allows expansion, or aws fsx "
        "update-file-system --storage-capacity)"
    ]
    scratch = fsx.deployment in SCRATCH_WRITE
    tiers = PER_UNIT_TIERS[("PERSISTENT_2", "SSD")] if scratch else PER_UNIT_TIERS[(fsx.deployment, fsx.storage_type)]
    faster = next((u for u in tiers if u > fsx.per_unit and fsx.tib * u >= need.mbps), None)
    if faster is not None:
        rate = rate_text(fsx.tib * faster)
        choices.append(
            f"a PERSISTENT_2 file system of this size at {faster} MB/s/TiB ({rate})"
            if scratch
            else f"the {faster} MB/s/TiB tier ({rate} at this size; aws fsx update-file-system "
            f"--lustre-configuration PerUnitStorageThroughput={faster})"
        )
    budget = math.ceil(need.seconds_at(fsx.mbps) / SAVE_SHARE)
    choices.append(f"a preemption budget of at least {budget} s (job options grace_period_s and shutdown_timeout_s)")
    return choices


def check_checkpoint_throughput(ctx: Context) -> Check:
    name = "checkpoint-throughput"
    volume = ctx.volume(lambda v: "persistentVolumeClaim" in v)
    if volume is None:
        return Check(name, NOT_APPLICABLE, "the job mounts no PersistentVolumeClaim to checkpoint to")
    need = checkpoint_need(ctx)
    claim = volume["persistentVolumeClaim"]["claimName"]
    pv_name = ctx.pvc.spec.volume_name if ctx.pvc is not None else None
    if not pv_name:
        why = "could not be read" if ctx.pvc is None else "is bound to no PersistentVolume"
        return Check(
            name, NOT_APPLICABLE, f"{need.describe()}; PVC {claim} {why} (see fsx-pvc): its file system is unknown"
        )
    try:
        pv = ctx.kube.call("read PV", ctx.kube.core.read_persistent_volume, pv_name)
    except ApiException as exc:
        if forbidden(exc):
            return Check(
                name,
                WARN,
                f"{need.describe()}; cannot read PersistentVolume {pv_name}: the service account "
                "may not get persistentvolumes",
                READ_FIX.format(what="get on persistentvolumes and storageclasses.storage.k8s.io"),
            )
        if not_found(exc):
            return Check(
                name,
                WARN,
                f"{need.describe()}; PersistentVolume {pv_name} of PVC {claim} does not exist",
                f"kubectl -n {ctx.namespace} describe pvc {claim}",
            )
        raise
    csi = pv.spec.csi
    if csi is None or csi.driver != FSX_DRIVER:
        what = f"CSI driver {csi.driver}" if csi is not None else "not a CSI volume"
        return Check(
            name,
            NOT_APPLICABLE,
            f"{need.describe()}; PersistentVolume {pv_name} is not FSx for Lustre "
            f"({what}): compare its write throughput with that",
        )
    fsx = FsxFileSystem(pv_name, csi.volume_handle, quantity((pv.spec.capacity or {})["storage"]) / GI)
    unknown, fix = read_tier(ctx, fsx, pv)
    if unknown:
        floor = fsx.tib * SLOWEST_TIER
        if need.mbps <= floor:
            return Check(
                name,
                PASS,
                f"{need.describe()}; {fsx.name()} writes at least {rate_text(floor)} at the "
                f"slowest FSx for Lustre tier ({SLOWEST_TIER} MB/s/TiB; {unknown})",
            )
        return Check(
            name,
            WARN,
            f"{need.describe()}; the write throughput of {fsx.name()} is unknown here: {unknown}",
            fix
            or f"compare it yourself: aws fsx describe-file-systems --file-system-ids {fsx.handle} "
            "gives StorageCapacity (GiB) and LustreConfiguration's DeploymentType and "
            "PerUnitStorageThroughput; StorageCapacity / 1000 x the MB/s per TiB it writes (the "
            "PerUnitStorageThroughput; SCRATCH_2 100, SCRATCH_1 200) must reach "
            f"{rate_text(need.mbps)}",
        )
    tier = f"{fsx.deployment}" + (f" {fsx.storage_type}" if fsx.storage_type != "SSD" else "")
    has = f"{fsx.name()}, {tier}, writes {fsx.per_unit} MB/s/TiB = {rate_text(fsx.mbps)}"
    seconds = need.seconds_at(fsx.mbps)
    took = f"~{seconds:.0f} s" if seconds >= 10 else f"~{seconds:.1f} s"
    if fsx.mbps >= need.mbps:
        return Check(name, PASS, f"{need.describe()}; {has}: the save takes {took}")
    return Check(
        name,
        WARN,
        f"{need.describe()}; {has}: the save would take {took} of the "
        f"{need.budget_s} s budget, so a preemption may lose the steps since the last periodic checkpoint "
        "(the run itself works)",
        "for this job: " + ", or ".join(fitting_choices(need, fsx)),
    )


def read_tier(ctx: Context, fsx: FsxFileSystem, pv: Any) -> tuple[str, str]:
    """Fill in `fsx`'s deployment type and write throughput from the StorageClass that provisioned its PV; else
    (why they are unknown, the fix when there is one)."""
    storage_class = pv.spec.storage_class_name
    annotations = pv.metadata.annotations or {}
    if annotations.get(PROVISIONED_BY) != FSX_DRIVER:
        if STATIC_DEPLOYMENT_TYPE in annotations:  # as render-storage recorded it
            fsx.deployment, fsx.storage_type, fsx.per_unit = write_tier(
                {
                    "deploymentType": annotations[STATIC_DEPLOYMENT_TYPE],
                    "perUnitStorageThroughput": annotations.get(STATIC_PER_UNIT_THROUGHPUT, ""),
                }
            )
            if fsx.per_unit:
                return "", ""
        return "its PersistentVolume was provisioned statically, so no StorageClass says how it was created", ""
    if not storage_class:
        return "its PersistentVolume names no StorageClass", ""
    try:
        found = ctx.kube.call("read StorageClass", ctx.storage.read_storage_class, storage_class)
    except ApiException as exc:
        if forbidden(exc):
            why = f"cannot read StorageClass {storage_class}: the service account may not get storageclasses"
            return why, READ_FIX.format(what="get on storageclasses.storage.k8s.io")
        if not_found(exc):
            return f"StorageClass {storage_class}, which provisioned it, no longer exists", ""
        raise
    fsx.deployment, fsx.storage_type, fsx.per_unit = write_tier(found.parameters or {})
    if not fsx.per_unit:
        per_unit = (found.parameters or {}).get("perUnitStorageThroughput") or "none"
        return (
            f"StorageClass {storage_class} has deploymentType {fsx.deployment}, storageType {fsx.storage_type}, "
            f"perUnitStorageThroughput {per_unit}: no tier known here",
            "",
        )
    return "", ""


# -- 4. nodes the workers fit on ----------------------------------------------------------------------------


@dataclass
class NodeFit:
    name: str
    slots: int = 0  # workers that fit on it now, after what runs there
    idle_slots: int = 0  # workers that would fit were nothing else running there (its allocatable alone)
    cause: str = ""  # why none fits now, counted across nodes ("cordoned", "short of nvidia.com/gpu", ...)
    detail: str = ""  # the same, for this node ("nvidia.com/gpu 8 requested, 4 free")


def check_nodes(ctx: Context) -> Check:
    kube = ctx.kube
    try:
        nodes = raw_items(kube.call("list nodes", kube.core.list_node, _preload_content=False))
    except ApiException as exc:
        if not forbidden(exc):
            raise
        return Check(
            "nodes",
            WARN,
            "cannot list nodes: the service account may not list nodes, so whether "
            f"{ctx.min_nodes} node(s) fit is unknown",
            READ_FIX.format(what="list on nodes and on pods in all namespaces"),
        )
    used: dict[str, dict[str, Decimal]] = {}
    pods_unknown = ""
    try:
        pods = raw_items(
            kube.call(
                "list pods",
                kube.core.list_pod_for_all_namespaces,
                _preload_content=False,
                field_selector="status.phase!=Succeeded,status.phase!=Failed",
            )
        )
    except ApiException as exc:
        if not forbidden(exc):
            raise
        pods_unknown = "cannot list pods in all namespaces, so free resources are unknown: counted by allocatable"
        pods = []
    for pod in pods:
        node = (pod.get("spec") or {}).get("nodeName")
        if not node or pod_of_job(ctx, pod):  # unscheduled, or ours
            continue
        add_to(used.setdefault(node, {}), pod_requests(pod["spec"]))
    fits = sorted((node_fit(ctx, node, used.get(node["metadata"]["name"], {})) for node in nodes), key=lambda f: f.name)
    slots, idle_slots = sum(f.slots for f in fits), sum(f.idle_slots for f in fits)
    fitting = [f for f in fits if f.slots]
    request = ", ".join(f"{show(r, q)} {r}" for r, q in ctx.request.items() if r in FIT_RESOURCES and q)
    needs = f"the job needs {ctx.min_nodes}" + (f" (up to {ctx.max_nodes})" if ctx.max_nodes != ctx.min_nodes else "")
    workers = f" ({slots} workers in all)" if slots != len(fitting) else ""
    busy = slots < ctx.min_nodes <= idle_slots  # too full now, big enough once the other pods are gone
    if busy:
        idle_nodes = sum(1 for f in fits if f.idle_slots)
        reason = (
            f"does not fit now: {len(fitting)} of {len(fits)} node(s) free for a worker{workers} ({request}); "
            f"{needs}; would fit an idle cluster ({idle_nodes} node(s) hold a worker when nothing else runs), "
            "so the job will wait in Pending/queue until capacity frees"
        )
    else:
        reason = f"{len(fitting)} of {len(fits)} node(s) fit a worker{workers} ({request}); {needs}"
        if slots < ctx.min_nodes:
            reason += f"; even an idle cluster holds only {idle_slots}"
    others = [f for f in fits if not f.slots]
    if others:
        counts = sorted(Counter(f.cause for f in others).items(), key=lambda item: (-item[1], item[0]))
        examples = [next(f for f in others if f.cause == cause) for cause, _ in counts]
        examples += [f for f in others if f not in examples]
        named = "; ".join(f"{f.name}: {f.detail}" for f in examples[:EXAMPLES])
        more = f"; +{len(others) - EXAMPLES} more" if len(others) > EXAMPLES else ""
        summary = ", ".join(f"{n} {cause}" for cause, n in counts)
        reason += f". Not fitting{' now' if busy else ''}: {summary} ({named}{more})"
    if pods_unknown:
        reason += f". {pods_unknown}"
    if busy:
        return Check(
            "nodes",
            WARN,
            reason,
            "nothing to change if waiting is fine; to start sooner, see what holds the "
            "nodes (kubectl get pods -A -o wide --field-selector spec.nodeName=NODE) and free them, or lower "
            "nnodes (or set max_nodes above it: an elastic job starts with what fits)",
        )
    fix = (
        f"{SEED_FIX['pending']}; uncordon or replace unhealthy nodes, free busy ones, add tolerations, or lower nnodes"
    )
    if slots < ctx.min_nodes:
        return Check("nodes", FAIL, reason, fix)
    if slots < ctx.max_nodes:
        return Check("nodes", WARN, reason + f": the elastic job starts with {slots} of {ctx.max_nodes}", fix)
    if pods_unknown:
        return Check("nodes", WARN, reason, READ_FIX.format(what="list on pods in all namespaces"))
    return Check("nodes", PASS, reason)


def raw_items(response: Any) -> list[dict[str, Any]]:
    """The items of a list read with _preload_content=False: plain dicts, as the API server wrote them (a cluster's
    pods deserialize into typed models many times slower)."""
    return json.loads(response.data).get("items") or []


def node_fit(ctx: Context, node: dict[str, Any], used: dict[str, Decimal]) -> NodeFit:
    """How many workers fit on the node now and with nothing else on it, or the first reason none does now. What
    keeps a worker off the node whatever runs there (cordon, health, Ready, selector, affinity, taints) blocks both."""
    name = node["metadata"]["name"]
    labels = node["metadata"].get("labels") or {}
    spec, status = node.get("spec") or {}, node.get("status") or {}
    fit = NodeFit(name)

    def blocked(cause: str, detail: str = "") -> NodeFit:
        fit.cause, fit.detail = cause, detail or cause
        return fit

    if spec.get("unschedulable"):
        return blocked("cordoned")
    ready = next((c for c in status.get("conditions") or [] if c.get("type") == "Ready"), None)
    if ready is None or ready.get("status") != "True":
        return blocked("not Ready", f"not Ready ({(ready or {}).get('reason') or 'no Ready condition'})")
    health = labels.get(HEALTH_LABEL)
    if health is not None and health != HEALTHY:  # HyperPod is about to reboot or replace it, affinity or not
        return blocked(f"health {health}")
    selector = ctx.pod.get("nodeSelector") or {}
    wrong = [f"{k}={v}" for k, v in selector.items() if labels.get(k) != v]
    if wrong:
        return blocked("node selector", f"node selector {', '.join(wrong)} not matched")
    unmatched = required_affinity_mismatch(ctx.pod.get("affinity") or {}, labels)
    if unmatched:
        if HEALTH_LABEL in unmatched and health is None:
            return blocked("no health label", f"no {HEALTH_LABEL} label (the job's affinity requires {HEALTHY})")
        return blocked("node affinity", f"node affinity {unmatched} not matched")
    taint = untolerated_taint(spec.get("taints") or [], ctx.pod.get("tolerations") or [])
    if taint:
        return blocked("untolerated taint", f"taint {taint} not tolerated")
    allocatable = {r: quantity(v) for r, v in (status.get("allocatable") or {}).items()}
    wanted = {r: q for r, q in ctx.request.items() if r in FIT_RESOURCES and q > 0}
    idle = {r: allocatable.get(r, Decimal(0)) for r in wanted}
    free = {r: idle[r] - used.get(r, Decimal(0)) for r in wanted}
    fit.slots, fit.idle_slots = workers_in(wanted, free, ctx.max_nodes), workers_in(wanted, idle, ctx.max_nodes)
    short = [(r, q, free[r]) for r, q in wanted.items() if free[r] < q]
    if short:
        detail = ", ".join(f"{r} {show(r, w)} requested, {show(r, max(f, Decimal(0)))} free" for r, w, f in short)
        return blocked(f"short of {short[0][0]}", detail)
    return fit


def workers_in(wanted: dict[str, Decimal], free: dict[str, Decimal], most: int) -> int:
    """How many workers needing `wanted` fit in `free`, at most `most` (all of them when nothing is requested)."""
    return min([int(max(free[r], Decimal(0)) // q) for r, q in wanted.items()] + [most])


def required_affinity_mismatch(affinity: dict[str, Any], labels: dict[str, str]) -> str:
    """ "" when the node satisfies the pod's required node affinity, else the first term's unmatched expression."""
    required = (affinity.get("nodeAffinity") or {}).get("requiredDuringSchedulingIgnoredDuringExecution") or {}
    terms = required.get("nodeSelectorTerms") or []
    if not terms:
        return ""
    first_miss = ""
    for term in terms:  # terms are ORed, expressions ANDed
        missed = next((e for e in term.get("matchExpressions") or [] if not expression_matches(e, labels)), None)
        if missed is None:
            return ""
        first_miss = first_miss or f"{missed['key']} {missed['operator']} {','.join(missed.get('values') or [])}"
    return first_miss.strip()


def expression_matches(expression: dict[str, Any], labels: dict[str, str]) -> bool:
    key, operator, values = expression["key"], expression["operator"], expression.get("values") or []
    value = labels.get(key)
    if operator == "In":
        return value in values
    if operator == "NotIn":
        return value not in values
    if operator == "Exists":
        return value is not None
    if operator == "DoesNotExist":
        return value is None
    if operator in ("Gt", "Lt"):
        try:
            number, bound = int(value or ""), int(values[0])
        except (ValueError, IndexError):
            return False
        return number > bound if operator == "Gt" else number < bound
    return False


def untolerated_taint(taints: Iterable[dict[str, Any]], tolerations: list[dict[str, Any]]) -> str:
    """The first NoSchedule/NoExecute taint no toleration tolerates, as key=value:Effect; "" if none."""
    for taint in taints:
        if taint.get("effect") not in ("NoSchedule", "NoExecute"):
            continue
        if not any(tolerates(t, taint) for t in tolerations):
            value = taint.get("value")
            return f"{taint.get('key')}" + (f"={value}" if value else "") + f":{taint['effect']}"
    return ""


def tolerates(toleration: dict[str, Any], taint: dict[str, Any]) -> bool:
    """Whether a pod's toleration tolerates a node's taint (an empty effect or key with Exists matches all)."""
    effect = toleration.get("effect") or ""
    if effect and effect != taint.get("effect"):
        return False
    key, operator = toleration.get("key") or "", toleration.get("operator") or "Equal"
    if operator == "Exists":
        return not key or key == taint.get("key")
    return key == taint.get("key") and (toleration.get("value") or "") == (taint.get("value") or "")


def pod_requests(pod_spec: dict[str, Any]) -> dict[str, Decimal]:
    """What the scheduler counts for a pod: the containers' requests (a limit stands in for a missing request),
    sidecar init containers included; at least any one init container's; plus the pod's overhead."""

    def of(container: dict[str, Any]) -> dict[str, Decimal]:
        resources = container.get("resources") or {}
        amounts = {**(resources.get("limits") or {}), **(resources.get("requests") or {})}
        return {r: quantity(v) for r, v in amounts.items()}

    total: dict[str, Decimal] = {}
    for container in pod_spec.get("containers") or []:
        add_to(total, of(container))
    init_peak: dict[str, Decimal] = {}
    sidecars: dict[str, Decimal] = {}
    for container in pod_spec.get("initContainers") or []:
        if container.get("restartPolicy") == "Always":  # a sidecar runs alongside the containers
            add_to(sidecars, of(container))
            add_to(total, of(container))
        else:
            for r, q in of(container).items():
                init_peak[r] = max(init_peak.get(r, Decimal(0)), q + sidecars.get(r, Decimal(0)))
    for r, q in init_peak.items():
        total[r] = max(total.get(r, Decimal(0)), q)
    add_to(total, {r: quantity(v) for r, v in (pod_spec.get("overhead") or {}).items()})
    return total


def add_to(total: dict[str, Decimal], amounts: dict[str, Decimal]) -> None:
    for r, q in amounts.items():
        total[r] = total.get(r, Decimal(0)) + q


_QUANTITY = re.compile(r"([+-]?(?:\d+(?:\.\d*)?|\.\d+))([eE][+-]?\d+|Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE])?")
_SUFFIX = {
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "Pi": 2**50,
    "Ei": 2**60,
    "n": Decimal("1e-9"),
    "u": Decimal("1e-6"),
    "m": Decimal("1e-3"),
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "P": 10**15,
    "E": 10**18,
}


def quantity(value: str | int | float) -> Decimal:
    """A Kubernetes resource quantity as a number: "96", "500m", "512Gi", "2063937952Ki", "1e3", "1.5", 8."""
    if isinstance(value, bool):
        raise ValueError(f"not a quantity: {value!r}")
    if isinstance(value, int | float):
        return Decimal(str(value))
    match = _QUANTITY.fullmatch(value.strip())
    if not match:
        raise ValueError(f"not a Kubernetes quantity: {value!r}")
    number, suffix = match.groups()
    try:
        amount = Decimal(number)
    except InvalidOperation:
        raise ValueError(f"not a Kubernetes quantity: {value!r}") from None
    if not suffix:
        return amount
    if suffix[0] in "eE" and len(suffix) > 1:
        return amount.scaleb(int(suffix[1:]))
    return amount * Decimal(_SUFFIX[suffix])


def show(resource: str, amount: Decimal) -> str:
    """A quantity for people: memory in Gi, everything else as a plain number."""
    if resource == "memory" or resource.endswith("storage"):
        gib = amount / GI
        return f"{gib.quantize(Decimal(1)) if gib == gib.to_integral_value() else round(gib, 1)}Gi"
    return str(amount.quantize(Decimal(1)) if amount == amount.to_integral_value() else amount.normalize())


# -- 5. device plugins --------------------------------------------------------------------------------------


def check_device_plugins(ctx: Context) -> Check:
    wanted = [
        (what, words, fix)
        for what, resource, words, fix in (
            ("EFA", EFA, ("efa", "device-plugin"), SEED_FIX["efa"]),
            (
                "NVIDIA",
                GPU,
                ("nvidia", "device-plugin"),
                "Ensure the NVIDIA device plugin DaemonSet is running "
                "(HyperPod installs it in kube-system; or the NVIDIA GPU Operator)",
            ),
        )
        if ctx.request.get(resource, Decimal(0)) > 0
    ]
    if not wanted:
        return Check("device-plugins", NOT_APPLICABLE, "the job requests neither GPUs nor EFA devices")
    try:
        daemonsets = raw_items(
            ctx.kube.call("list DaemonSets", ctx.apps.list_daemon_set_for_all_namespaces, _preload_content=False)
        )
    except ApiException as exc:
        if not forbidden(exc):
            raise
        return Check(
            "device-plugins",
            WARN,
            "cannot list DaemonSets: the service account may not list daemonsets in all namespaces",
            READ_FIX.format(what="list on daemonsets.apps"),
        )
    problems, fixes, fine = [], [], []
    for what, words, fix in wanted:
        found = [d for d in daemonsets if all(w in d["metadata"]["name"].lower() for w in words)]
        if not found:
            problems.append(f"no {what} device plugin DaemonSet (a name with {' and '.join(words)}) in any namespace")
            fixes.append(fix)
            continue
        best = max(found, key=lambda d: (d.get("status") or {}).get("numberReady") or 0)
        ready = (best.get("status") or {}).get("numberReady") or 0
        desired = (best.get("status") or {}).get("desiredNumberScheduled") or 0
        ns, name = best["metadata"].get("namespace", ""), best["metadata"]["name"]
        where = f"{ns}/{name}"
        if desired == 0:
            problems.append(
                f"{what} device plugin {where} schedules no pod (0 desired): its nodeSelector or "
                "tolerations match no node"
            )
            fixes.append(f"{fix} (kubectl -n {ns} describe ds {name})")
        elif ready != desired:
            problems.append(f"{what} device plugin {where}: {ready} of {desired} pods ready")
            fixes.append(f"{fix} (kubectl -n {ns} describe ds {name})")
        else:
            fine.append(f"{what} {where} {ready}/{desired} ready")
    if problems:
        return Check("device-plugins", FAIL, "; ".join(problems + fine), "; ".join(fixes))
    return Check("device-plugins", PASS, "; ".join(fine))


# -- 6. the image -------------------------------------------------------------------------------------------

# The distribution reference grammar (github.com/distribution/reference): [domain/]path[:tag][@digest].
_ALNUM = r"[a-z0-9]+"
_SEPARATOR = r"(?:[._]|__|-+)"
_PATH_COMPONENT = rf"{_ALNUM}(?:{_SEPARATOR}{_ALNUM})*"
_DOMAIN_COMPONENT = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_IPV6 = r"\[(?:[a-fA-F0-9:]+)\]"
_HOST = rf"(?:{_DOMAIN_COMPONENT}(?:\.{_DOMAIN_COMPONENT})*|{_IPV6})"
_DOMAIN = rf"{_HOST}(?::[0-9]+)?"
_TAG = r"[\w][\w.-]{0,127}"
_DIGEST = r"[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,}"
IMAGE_REFERENCE = re.compile(
    rf"(?:(?P<domain>{_DOMAIN})/)?(?P<path>{_PATH_COMPONENT}(?:/{_PATH_COMPONENT})*)"
    rf"(?::(?P<tag>{_TAG}))?(?:@(?P<digest>{_DIGEST}))?"
)
ECR = re.compile(r"(?P<account>\d{12})\.dkr\.ecr(?:-fips)?\.(?P<region>[a-z0-9-]+)\.amazonaws\.com(?:\.cn)?")
MAX_NAME_LENGTH = 255


def parse_reference(image: str) -> dict[str, str]:
    """{domain, path, tag, digest} of a well-formed image reference; ValueError naming what is wrong."""
    match = IMAGE_REFERENCE.fullmatch(image)
    if match is None:
        raise ValueError(_reference_problem(image))
    parts = {k: v or "" for k, v in match.groupdict().items()}
    domain = parts["domain"]
    if domain and not ("." in domain or ":" in domain or domain == "localhost" or domain != domain.lower()):
        parts["domain"], parts["path"] = "", f"{domain}/{parts['path']}"  # "library/ubuntu": a path, no registry
    name = (parts["domain"] + "/" if parts["domain"] else "") + parts["path"]
    if len(name) > MAX_NAME_LENGTH:
        raise ValueError(f"the repository name is longer than {MAX_NAME_LENGTH} characters")
    algorithm, _, hexdigits = parts["digest"].partition(":")
    if algorithm == "sha256" and len(hexdigits) != 64:
        raise ValueError(f"a sha256 digest has 64 hex digits, this one {len(hexdigits)}")
    return parts


def _reference_problem(image: str) -> str:
    name, _, digest = image.partition("@")
    last = name.rsplit("/", 1)[-1]
    repository = name.rsplit(":", 1)[0] if ":" in last else name
    first, _, rest = repository.partition("/")
    path = rest if rest and ("." in first or ":" in first or first == "localhost") else repository
    if not image:
        return "it is empty"
    if any(c.isspace() for c in image):
        return "it contains whitespace"
    if "://" in image:
        return "a reference has no scheme (drop the https://)"
    if digest and not re.fullmatch(_DIGEST, digest):
        return f"digest {digest!r} is not algorithm:hex (sha256:<64 hex digits>)"
    if last.count(":") > 1 or last.endswith(":"):
        return "the tag is empty or has a ':'"
    if ":" in last and not re.fullmatch(_TAG, last.split(":", 1)[1]):
        return f"tag {last.split(':', 1)[1]!r} is not [A-Za-z0-9_][A-Za-z0-9_.-]{{0,127}}"
    if path != path.lower():
        return f"repository {path!r} has uppercase letters"
    return "repository path components are lowercase letters and digits separated by '.', '_', '__' or '-'"


def check_image(ctx: Context) -> Check:
    image = ctx.container.get("image") or ""
    try:
        parts = parse_reference(image)
    except ValueError as exc:
        return Check(
            "image",
            FAIL,
            f"image {image!r} is not a valid reference: {exc}",
            "give registry/repository:tag or registry/repository@sha256:<64 hex digits>",
        )
    secrets = [s.get("name", "") for s in ctx.pod.get("imagePullSecrets") or []]
    ecr = ECR.fullmatch(parts["domain"])
    pinned = f"@{parts['digest'][:19]}..." if parts["digest"] else f":{parts['tag'] or 'latest'}"
    if ecr is not None:
        where = (
            f"ECR image {parts['path']}{pinned} (account {ecr['account']}, {ecr['region']}): its registry is not "
            "reachable from here"
        )
        if secrets:
            return Check(
                "image",
                WARN,
                f"{where}; an ECR token in an image pull secret ({', '.join(secrets)}) "
                "expires after 12 hours: refresh it, or drop the secret and use the node role / IRSA",
                f"{SEED_FIX['ecr']} (ECR auth expires)",
            )
        return Check(
            "image",
            WARN,
            f"{where}; nodes pull with their instance role: it needs ecr:BatchGetImage "
            "(AmazonEC2ContainerRegistryReadOnly)",
            f"{SEED_FIX['ecr']}; attach AmazonEC2ContainerRegistryReadOnly to the nodes' role",
        )
    if not parts["tag"] and not parts["digest"] or parts["tag"] == "latest" and not parts["digest"]:
        return Check(
            "image",
            WARN,
            f"image {image} has no tag but :latest: a rerun or a restarted pod may get another image",
            "tag the image (docker/build.sh) or pin it by @sha256 digest",
        )
    registry = parts["domain"] or "docker.io"
    return Check("image", PASS, f"{image}: well formed ({registry}, {pinned.lstrip(':@')})")


# -- 7. memory ----------------------------------------------------------------------------------------------


def check_memory(ctx: Context) -> Check:
    resources = ctx.container.get("resources") or {}
    memory = (resources.get("limits") or {}).get("memory") or (resources.get("requests") or {}).get("memory")
    shm_volume = ctx.volume(lambda v: (v.get("emptyDir") or {}).get("medium") == "Memory")
    shm_text = (shm_volume or {}).get("emptyDir", {}).get("sizeLimit")
    if memory is None:
        return Check(
            "memory",
            WARN,
            "the container has no memory limit: /dev/shm and the processes are unbounded",
            f"{SEED_FIX['oom']} (job option memory)",
        )
    limit = quantity(memory)
    problems, fixes, notes = [], [], []
    status = PASS
    if shm_text is not None:
        shm = quantity(shm_text)
        if shm >= limit:
            status = FAIL
            over = shm - limit
            by = "equal to it" if not over else f"{show('memory', over)} over it"
            problems.append(
                f"/dev/shm sizeLimit {show('memory', shm)} is not below the {show('memory', limit)} "
                f"memory limit ({by}): /dev/shm is memory-backed and counts against the pod's memory, "
                "so the pod is OOM-killed before /dev/shm fills"
            )
            fixes.append(f"{SEED_FIX['oom']} (job option memory) or lower shm_size below it")
        else:
            notes.append(
                f"/dev/shm {show('memory', shm)} leaves {show('memory', limit - shm)} of the "
                f"{show('memory', limit)} limit for the processes"
            )
    if not ctx.memory_gib:
        if status == FAIL:
            return Check("memory", FAIL, "; ".join(problems), "; ".join(fixes))
        return Check(
            "memory", NOT_APPLICABLE, "the instance type's memory is unknown" + (f"; {notes[0]}" if notes else "")
        )
    instance = Decimal(ctx.memory_gib) * GI
    ceiling = instance * MEMORY_HEADROOM
    pct = f"{limit / instance * 100:.0f}%"
    if limit > instance:
        status = FAIL
        problems.append(
            f"memory limit {show('memory', limit)} is above the instance's {ctx.memory_gib}Gi "
            f"({pct}): no node can hold a worker"
        )
        fixes.append(f"lower job option memory to at most {show('memory', ceiling)} (95% of {ctx.memory_gib}Gi)")
    elif limit > ceiling:
        status = WARN if status == PASS else status
        problems.append(
            f"memory limit {show('memory', limit)} is {pct} of the instance's {ctx.memory_gib}Gi: above "
            "95% too little is left for the kubelet's reserve, the OS and the node's daemons"
        )
        fixes.append(f"lower job option memory to at most {show('memory', ceiling)} (95% of {ctx.memory_gib}Gi)")
    if problems:
        return Check("memory", status, "; ".join(problems), "; ".join(fixes))
    return Check(
        "memory",
        PASS,
        f"memory limit {show('memory', limit)} is {pct} of the instance's {ctx.memory_gib}Gi "
        f"(at most 95%)" + (f"; {notes[0]}" if notes else ""),
    )


# -- GPU memory ------------------------------------------------------------------------------------------------

# Each GPU's memory by instance type (HyperPod's ml.<type> too), from AWS's accelerated-computing instance pages
# and NVIDIA's data sheets: g5 A10G 24 GB, g6e L40S 48 GB, p4d A100 40 GB, p4de A100 80 GB, p5 H100 80 GB, p5e and
# p5en H200 141 GB, p6-b200 B200 (1,440 GB of HBM3e over 8 GPUs) 180 GB. The vendors' "GB" here are GiB of HBM (an
# H100's five 16 GiB stacks are its 80 GB), and the estimate is in GiB too (trainer/memory.py).
GPU_MEMORY_GIB: dict[str, int] = {
    "g5.48xlarge": 24,
    "g6e.48xlarge": 48,
    "p4d.24xlarge": 40,
    "p4de.24xlarge": 80,
    "p5.48xlarge": 80,
    "p5e.48xlarge": 141,
    "p5en.48xlarge": 141,
    "p6-b200.48xlarge": 180,
}
GPU_MEMORY_USABLE = Decimal("0.90")  # the rest for the allocator's fragmentation, NCCL's buffers, the CUDA context
GPU_MEMORY_TIGHT = Decimal("0.80")  # above this share of the GPU a run fits, but with little room


def check_gpu_memory(ctx: Context) -> Check:
    """The run's estimated memory per GPU (trainer/memory.py) against the instance type's GPU; when it does not fit,
    what would."""
    from trainer.config import TRAIN_DEFAULTS
    from trainer.memory import GIB, estimate, model_shape

    name = "gpu-memory"
    gpu_gib = GPU_MEMORY_GIB.get(ctx.instance_type.removeprefix("ml."))
    gpus = int(ctx.request.get(GPU, 0))
    if not gpus:
        return Check(name, NOT_APPLICABLE, "the job requests no GPUs")
    flag = ctx.trainer_flag
    seq_len = int(flag("--seq-len", TRAIN_DEFAULTS["seq_len"]))
    batch = int(flag("--batch-size", TRAIN_DEFAULTS["batch_size"]))
    accumulation = int(flag("--grad-accum-steps", TRAIN_DEFAULTS["grad_accum_steps"]))
    parallelism = flag("--parallelism", TRAIN_DEFAULTS["parallelism"])
    recompute = flag("--activation-checkpointing", TRAIN_DEFAULTS["activation_checkpointing"])
    config, preset, vocab, assumed = ctx.model_config(seq_len)
    shape = model_shape(config)

    def per_gpu(parallelism: str, nodes: int, batch: int, recompute: str) -> int:
        return estimate(shape, parallelism, nodes * gpus, gpus, batch, seq_len, recompute).total

    need = estimate(shape, parallelism, ctx.max_nodes * gpus, gpus, batch, seq_len, recompute)
    size = f"{shape.parameters / 1e9:.2f}B" if shape.parameters >= 10**9 else f"{shape.parameters / 1e6:.1f}M"
    accumulated = (
        f", {accumulation} micro-batches a step (no more memory: gradients stay sharded between them)"
        if accumulation > 1
        else ""
    )
    run = (
        f"{preset} ({size} parameters at vocabulary {vocab:,}"
        f"{', assumed' if assumed else ''}) under {parallelism} on {ctx.max_nodes} node(s) x {gpus} GPUs, "
        f"micro-batch {batch} x {seq_len} tokens{accumulated}, activation checkpointing {recompute}: "
        f"{need.describe()}"
    )
    if gpu_gib is None:
        return Check(
            name,
            NOT_APPLICABLE,
            f"{run}; the GPU memory of {ctx.instance_type or 'this instance type'} is "
            f"unknown (known: {', '.join(GPU_MEMORY_GIB)})",
        )
    usable = Decimal(gpu_gib) * GPU_MEMORY_USABLE * GIB
    if need.total <= Decimal(gpu_gib) * GPU_MEMORY_TIGHT * GIB:
        return Check(name, PASS, f"{run}, of the {gpu_gib} GiB of a {ctx.instance_type} GPU")
    if need.total <= usable:
        return Check(
            name,
            WARN,
            f"{run}: tight in the {gpu_gib} GiB of a {ctx.instance_type} GPU (over {GPU_MEMORY_TIGHT:.0%})",
            "if it runs out of memory: " + memory_fixes(per_gpu, parallelism, ctx.max_nodes, batch, recompute, usable),
        )
    return Check(
        name,
        FAIL,
        f"{run}: more than the {gpu_gib} GiB of a {ctx.instance_type} GPU can hold ({usable / GIB:.0f} GiB usable)",
        memory_fixes(per_gpu, parallelism, ctx.max_nodes, batch, recompute, usable),
    )


def memory_fixes(
    per_gpu: Callable[[str, int, int, str], int],
    parallelism: str,
    nodes: int,
    batch: int,
    recompute: str,
    usable: Decimal,
) -> str:
    """The first few changes (job options) after which the run would fit, each with its estimate."""
    from trainer.memory import GIB

    sharded = "hsdp" if nodes > 1 else "fsdp"
    candidates = [
        (f"job option parallelism={sharded}", sharded, nodes, batch, recompute),
        (f"parallelism={sharded} and activation_checkpointing=selective", sharded, nodes, batch, "selective"),
        (f"parallelism={sharded} and activation_checkpointing=full", sharded, nodes, batch, "full"),
        (f"parallelism=hsdp on {max(2, nodes * 2)} nodes", "hsdp", max(2, nodes * 2), batch, recompute),
        (
            f"batch_size {max(1, batch // 2)} (raise grad_accum_steps to keep the global batch)",
            parallelism,
            nodes,
            max(1, batch // 2),
            recompute,
        ),
        (
            f"batch_size {max(1, batch // 4)} with parallelism={sharded} and activation_checkpointing=full",
            sharded,
            nodes,
            max(1, batch // 4),
            "full",
        ),
    ]
    changed = [
        (text, settings) for text, *settings in candidates if tuple(settings) != (parallelism, nodes, batch, recompute)
    ]
    fits = [
        f"{text} ({per_gpu(*settings) / GIB:.1f} GiB)" for text, settings in changed if per_gpu(*settings) <= usable
    ][:3]
    if not fits:
        return "no single change fits: a larger GPU (p5e/p5en: 141 GiB), more nodes under hsdp with full checkpointing"
    return "it would fit with " + "; or ".join(fits)


# -- Kueue --------------------------------------------------------------------------------------------------------

# Kueue as its release manifests install it (kubernetes-sigs/kueue v0.19.2, config/default/kustomization.yaml:
# namespace kueue-system, namePrefix kueue-, labels app.kubernetes.io/name=kueue): the controller's Deployment and
# its configuration, whose integrations.frameworks lists the job kinds it manages (controller_manager_config.yaml).
KUEUE_NAMESPACE, KUEUE_SELECTOR, KUEUE_CONFIG = "kueue-system", "app.kubernetes.io/name=kueue", "kueue-manager-config"
KUEUE_FRAMEWORK = {"pytorchjob": "kubeflow.org/pytorchjob", "trainjob": "trainer.kubeflow.org/trainjob"}
KUEUE_TRAINJOB_SINCE = (0, 14, 0)  # Kueue's trainjob integration (alpha) is in v0.14.0 and later (kueue#6597)
# The Kubeflow Trainer API each Kueue release is built on (github.com/kubeflow/trainer/v2 in its go.mod, read at every
# tag v0.14.0 to v0.19.2; v0.18.0 and v0.18.1 pin a pseudo-version before v2.2.1). Its TrainJob integration writes an
# admitted or preempted TrainJob back whole with those types (pkg/controller/jobs/trainjob/trainjob_controller.go,
# RunWithPodSetsInfo and Stop: Update), so what a newer Trainer added is dropped. Trainer v2.3.0's types came to
# Kueue's main branch after v0.19.2 (kubernetes-sigs/kueue#14504): a later release is taken to carry them.
KUEUE_TRAINER_API = (
    (0, 14, 0, "v2.0.1"),
    (0, 14, 5, "v2.1.0"),
    (0, 17, 0, "v2.2.0"),
    (0, 18, 0, "v2.2.1"),
    (0, 20, 0, "v2.3.0"),
)
# Its PyTorchJob integration is built on kubeflow/training-operator v1.9.3's types at every one of those tags, and
# admits and stops a job with a merge patch (pkg/util/client Patch, client.MergeFrom): fields it does not know stay.
KUEUE_PYTORCHJOB_NOTE = (
    "admits a PyTorchJob by merge patch, with Training Operator v1.9.3's types per its go.mod: "
    "nothing of the job is dropped"
)


def kueue_trainer_api(version: tuple[int, int, int]) -> str:
    """The Trainer API a Kueue release decodes TrainJobs with ("" before its TrainJob integration)."""
    return next((api for *since, api in reversed(KUEUE_TRAINER_API) if version >= tuple(since)), "")


def kueue_api_note(api: JobApi, version: tuple[int, int, int] | None) -> str:
    """What the Kueue release does to the compiled API's jobs when it admits them, with its source."""
    if api is not TRAINJOB:
        return KUEUE_PYTORCHJOB_NOTE
    trainer = kueue_trainer_api(version) if version else ""
    if trainer.startswith("v2.3"):
        return "is built on Trainer v2.3's API (kubernetes-sigs/kueue#14504): a TrainJob's runtime patches are kept"
    built = (
        f"is built on Trainer {trainer}'s API, per its go.mod"
        if trainer
        else "of an unknown version may be built on Trainer v2.2's API"
    )
    return (
        f"{built}: it drops a TrainJob's runtime-patch grace period at admission, so a queued TrainJob keeps its "
        "runtime's; the runtime check and the launch refuse another"
    )


def check_queue(ctx: Context) -> Check:
    """With a Kueue queue compiled in: Kueue is there, new enough for the job's kind, and manages that kind."""
    queue = (ctx.job["metadata"].get("labels") or {}).get(QUEUE_LABEL)
    if not queue:
        return Check("queue", NOT_APPLICABLE, "no Kueue queue compiled in: the job starts when its pods fit")
    framework = KUEUE_FRAMEWORK[ctx.api.name]
    fix = (
        f"install Kueue v0.14 or later with {framework} in its integrations.frameworks "
        f"({KUEUE_NAMESPACE}/{KUEUE_CONFIG}), or compile without --queue-name"
    )
    try:
        deployments = raw_items(
            ctx.kube.call(
                "list Deployments",
                ctx.apps.list_namespaced_deployment,
                KUEUE_NAMESPACE,
                label_selector=KUEUE_SELECTOR,
                _preload_content=False,
            )
        )
    except ApiException as exc:
        if not forbidden(exc):
            raise
        deployments = None
    reasons: list[str] = []
    if deployments == []:
        return Check(
            "queue",
            FAIL,
            f"queue {queue!r} is compiled in, but no Kueue runs in {KUEUE_NAMESPACE} (no "
            f"Deployment labelled {KUEUE_SELECTOR}): the job would never be admitted",
            fix,
        )
    version = ""
    if deployments:
        containers = deployments[0]["spec"]["template"]["spec"].get("containers") or []
        version = image_tag(next((c.get("image", "") for c in containers if "kueue" in c.get("image", "")), ""))
        match = _SEMVER.fullmatch(version)
        release = (int(match[1]), int(match[2]), int(match[3])) if match else None
        if ctx.api is TRAINJOB and release and release < KUEUE_TRAINJOB_SINCE:
            return Check(
                "queue",
                FAIL,
                f"Kueue {version} admits no TrainJobs (its trainjob integration came in "
                "v0.14.0): the job would wait suspended for ever",
                fix,
            )
        reasons.append(f"Kueue {version or 'version unknown'}")
        note = kueue_api_note(ctx.api, release)
    else:
        reasons.append("Kueue's Deployment not readable (its version unknown)")
        note = kueue_api_note(ctx.api, None)
    try:
        config = ctx.kube.call("get ConfigMap", ctx.core.read_namespaced_config_map, KUEUE_CONFIG, KUEUE_NAMESPACE)
        # controller_manager_config.yaml: a Configuration whose integrations.frameworks lists the managed kinds
        settings = [yaml.safe_load(text) for text in (config.data or {}).values()]
        frameworks = [
            name
            for doc in settings
            if isinstance(doc, dict)
            for name in ((doc.get("integrations") or {}).get("frameworks") or [])
        ]
        if framework not in frameworks:
            return Check(
                "queue",
                FAIL,
                f"{', '.join(reasons)} does not manage {framework} (not in "
                f"integrations.frameworks of {KUEUE_NAMESPACE}/{KUEUE_CONFIG}): the queue label is ignored "
                "and the job runs unqueued",
                fix,
            )
        reasons.append(f"manages {framework}")
    except ApiException as exc:
        if not (forbidden(exc) or not_found(exc)):
            raise
        return Check(
            "queue",
            WARN,
            f"queue {queue!r}; {', '.join(reasons)}; whether it manages {framework} is "
            f"unknown ({KUEUE_NAMESPACE}/{KUEUE_CONFIG} not readable)",
            READ_FIX.format(what=f"get on configmaps {KUEUE_CONFIG} in {KUEUE_NAMESPACE}"),
        )
    return Check("queue", PASS, f"queue {queue!r}: {', '.join(reasons)}; Kueue {note}")


def check_mlflow(ctx: Context) -> Check:
    """The MLflow tracking server the trainer is to send its metrics to, asked once: one that does not answer is a
    warning, never a failure (the trainer trains on without it and counts what it could not send)."""
    uri = ctx.trainer_flag("--mlflow-tracking-uri", "")
    if not uri:
        return Check("mlflow", NOT_APPLICABLE, "no mlflow_tracking_uri: the run is watched in TensorBoard alone")
    experiment = ctx.trainer_flag("--mlflow-experiment", "")
    if why := probe(uri, experiment):
        return Check(
            "mlflow",
            WARN,
            f"{uri} did not answer as an MLflow tracking server ({why}); the run trains without it",
            "check the URI, the step's network to it and its credentials (the pods' IAM role "
            "for a SageMaker ARN, MLFLOW_TRACKING_TOKEN otherwise)",
        )
    return Check("mlflow", PASS, f"{uri} answers; the run goes in experiment {experiment!r}")


CHECKS: tuple[tuple[str, Callable[[Context], Check]], ...] = (
    ("crd", check_crd),
    ("runtime", check_runtime),
    ("queue", check_queue),
    ("permissions", check_permissions),
    ("fsx-pvc", check_pvc),
    ("checkpoint-throughput", check_checkpoint_throughput),
    ("nodes", check_nodes),
    ("device-plugins", check_device_plugins),
    ("image", check_image),
    ("memory", check_memory),
    ("gpu-memory", check_gpu_memory),
    ("mlflow", check_mlflow),
)
CHECK_NAMES = tuple(name for name, _ in CHECKS)
# The checks that read the cluster; the others read the manifest.
API_CHECKS = frozenset(
    {"crd", "runtime", "queue", "permissions", "fsx-pvc", "checkpoint-throughput", "nodes", "device-plugins"}
)
