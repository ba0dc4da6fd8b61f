"""Kubeflow Trainer v2.3.0's TrainJob controller and webhooks (``trainer.kubeflow.org/v1alpha1``), played on the real
API server; the JobSet it builds is run by :mod:`tests.cluster.jobset`, the Jobs by the real Job controller.

Sources, kubeflow/trainer at tag v2.3.0 (each function below names its own):
- ``pkg/controller/trainjob_controller.go``: ``Reconcile`` (``removeFailedCondition``, ``reconcileObjects``,
  ``setSuspendedCondition``, ``setTrainJobStatus``, ``reconcileDeadline``, one status merge patch).
- ``pkg/runtime/core/{trainingruntime,clustertrainingruntime,snapshot}.go``: the runtime read once and kept in the
  ``<trainjob>-runtime-snapshot`` ConfigMap the TrainJob owns, ``newRuntimeInfo`` (propagated labels and annotations,
  ``mergeRuntimePatches``' strategic merge, ``resourcesPerNode``, the pod counts), ``ValidateObjects``.
- ``pkg/runtime/framework/plugins/torch/torch.go`` ``EnforceMLPolicy`` / ``Validate``; ``plainml/plainml.go``;
  ``jobset/jobset.go`` ``SyncParallelCount``, ``Build`` (server-side apply as field manager ``trainer``, forced; not
  changed while neither the TrainJob nor the JobSet is suspended), ``Status``, ``Validate``; ``jobset/builder.go``.
- ``pkg/webhooks/trainjob_webhook.go``: ``TrainJobDefaulter.Default`` (runtime patch times) and
  ``TrainJobValidator``, registered as in ``manifests/base/webhook`` (configurations ``defaulter.trainer.kubeflow.org``
  and ``validator.trainer.kubeflow.org``); a denial is controller-runtime's ``Denied``: 403 with the error's text
  (``field.ErrorList.ToAggregate``: one error as itself, several as ``[a, b]``).
- ``pkg/constants/constants.go`` and ``pkg/apis/trainer/v1alpha1/trainjob_types.go``: names, reasons and messages.

The controller polls the namespace's TrainJobs and JobSets every ~0.1 s and reconciles a TrainJob when it or its
JobSet changed (``Owns`` through the JobSet plugin's watch), or its deadline timer is due. Not played: initializer
jobs' env, MPI / JAX / XGBoost / Flux policies, coscheduling and Volcano, torchtune, the TrainJobStatus feature (off by
default at v2.3.0), events other than TrainJobResourcesCreationFailed, the runtimes' own webhooks and finalizers.
"""

from __future__ import annotations

import base64
import calendar
import contextlib
import copy
import json
import logging
import math
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kubernetes
import yaml
from kubernetes.client.exceptions import ApiException

from tests.cluster import jobset as js_player
from tests.cluster.controller import PolledController
from tests.cluster.tls import HttpsServer, admission_handler, loopback_cert

log = logging.getLogger(__name__)

GROUP, VERSION, PLURAL, KIND = "trainer.kubeflow.org", "v1alpha1", "trainjobs", "TrainJob"
CLUSTER_RUNTIMES, RUNTIMES = "clustertrainingruntimes", "trainingruntimes"
CLUSTER_RUNTIME_KIND, RUNTIME_KIND = "ClusterTrainingRuntime", "TrainingRuntime"
CLUSTER_RUNTIME_KEY = f"{CLUSTER_RUNTIME_KIND}.{GROUP}"  # schema.GroupKind.String()
RUNTIME_KEY = f"{RUNTIME_KIND}.{GROUP}"
CONTROLLER_NAME = "trainer.kubeflow.org/trainjob-controller"  # pkg/util/trainjob
FIELD_MANAGER = "trainer"
# pkg/constants/constants.go
ANCESTOR_LABEL = "trainer.kubeflow.org/trainjob-ancestor-step"
SUPPORT_LABEL, SUPPORT_DEPRECATED = "trainer.kubeflow.org/support", "deprecated"
DEPRECATION_POLICY_URL = (
    "https://trainer.kubeflow.org/en/latest/operator-guides/runtime.html#runtime-deprecation-policy"
)
ANCESTOR_TRAINER, NODE = "trainer", "node"
DATASET_INITIALIZER, MODEL_INITIALIZER = "dataset-initializer", "model-initializer"
INITIALIZER_VOLUME = "initializer"
TRAINER_PORT = 29500
COMPLETION_INDEX_FIELD_PATH = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
TORCH_RESERVED_ENVS = ("PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT")
SUSPENDED_MESSAGE, RESUMED_MESSAGE = "TrainJob is suspended", "TrainJob is resumed"
DEADLINE_MESSAGE = "TrainJob exceeded its active deadline"
# pkg/apis/trainer/v1alpha1/trainjob_types.go
SUSPENDED, COMPLETE, FAILED = "Suspended", "Complete", "Failed"
SUSPENDED_REASON, RESUMED_REASON = "Suspended", "Resumed"
NOT_SUPPORTED_REASON, DEADLINE_REASON = "TrainingRuntimeNotSupported", "DeadlineExceeded"
SNAPSHOT_SUFFIX, SNAPSHOT_KEY = "-runtime-snapshot", "runtime"
MUTATING_CONFIGURATION, VALIDATING_CONFIGURATION = "defaulter.trainer.kubeflow.org", "validator.trainer.kubeflow.org"
DEFAULTER_WEBHOOK = "defaulter.trainjob.trainer.kubeflow.org"
VALIDATOR_WEBHOOK = "validator.trainjob.trainer.kubeflow.org"
DEFAULTER_PATH = "/mutate-trainer-kubeflow-org-v1alpha1-trainjob"
VALIDATOR_PATH = "/validate-trainer-kubeflow-org-v1alpha1-trainjob"
COMPLETION_INDEX_LABEL = "batch.kubernetes.io/job-completion-index"


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def seconds(stamp: str) -> float:
    return calendar.timegm(time.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ"))


def runtime_key(trainjob: dict[str, Any]) -> str:
    """``RuntimeRefToRuntimeRegistryKey``: ``schema.GroupKind{apiGroup, kind}.String()`` (the CRD defaults them to
    trainer.kubeflow.org and ClusterTrainingRuntime)."""
    ref = (trainjob.get("spec") or {}).get("runtimeRef") or {}
    group, kind = ref.get("apiGroup", ""), ref.get("kind", "")
    return f"{kind}.{group}" if group else kind


def set_status_condition(conditions: list[dict[str, Any]], new: dict[str, Any]) -> None:
    """apimachinery ``meta.SetStatusCondition``: a new condition or a changed status takes the given transition time
    (now when it has none); reason and message are always updated."""
    current = next((c for c in conditions if c["type"] == new["type"]), None)
    if current is None:
        conditions.append({**new, "lastTransitionTime": new.get("lastTransitionTime") or now()})
        return
    if current["status"] != new["status"]:
        current["status"] = new["status"]
        current["lastTransitionTime"] = new.get("lastTransitionTime") or now()
    current["reason"], current["message"] = new.get("reason", ""), new.get("message", "")
    if "observedGeneration" in new:
        current["observedGeneration"] = new["observedGeneration"]


def go_env_list(env: list[dict[str, Any]]) -> str:
    """A ``[]corev1.EnvVar`` as ``%#v`` prints it, which ``field.Invalid`` uses for a value of no simpler kind
    (apimachinery ``field.Error.ErrorBody``). A ``valueFrom`` pointer prints as an address; this one is made up."""
    items = []
    for e in env:
        source = "(*v1.EnvVarSource)(0xc000a2c0f0)" if e.get("valueFrom") else "(*v1.EnvVarSource)(nil)"
        items.append(
            f"v1.EnvVar{{Name:{json.dumps(e.get('name', ''))}, Value:{json.dumps(e.get('value', ''))}, "
            f"ValueFrom:{source}}}"
        )
    return "[]v1.EnvVar{" + ", ".join(items) + "}"


def go_runtime_ref(ref: dict[str, Any]) -> str:
    """A ``trainer.RuntimeRef`` as ``%#v`` prints it (its pointers as addresses: made up here)."""
    group = "(*string)(0xc000b1e2a0)" if "apiGroup" in ref else "(*string)(nil)"
    kind = "(*string)(0xc000b1e2b0)" if "kind" in ref else "(*string)(nil)"
    return f"v1alpha1.RuntimeRef{{Name:{json.dumps(ref.get('name', ''))}, APIGroup:{group}, Kind:{kind}}}"


def server_side_apply(api: kubernetes.client.ApiClient, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """``client.Apply(..., client.FieldOwner("trainer"), client.ForceOwnership)``: a server-side apply."""
    headers = {"Content-Type": "application/apply-patch+yaml", "Accept": "application/json"}
    response = api.call_api(
        path,
        "PATCH",
        body=body,
        auth_settings=["BearerToken"],
        _preload_content=False,
        header_params=headers,
        query_params=[("fieldManager", FIELD_MANAGER), ("force", "true")],
    )
    return json.loads(response[0].data)


# -- strategic merge of runtime patches ------------------------------------------------------------------------------

# The patchMergeKey of each list a runtime patch can reach (JobSetSpec, JobSpec, PodSpec, Container); any other list
# (tolerations, an affinity's terms) is replaced, as strategicpatch does for a list without a merge key.
MERGE_KEYS = {
    "replicatedJobs": "name",
    "containers": "name",
    "initContainers": "name",
    "env": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "imagePullSecrets": "name",
    "schedulingGates": "name",
    "ports": "containerPort",
}


def strategic_merge(original: Any, patch: Any, key: str = "") -> Any:
    """``strategicpatch.StrategicMergePatch`` for the fields of a runtime patch: maps merged recursively (null deletes),
    lists with a merge key merged item by item (new items appended), other lists and scalars replaced."""
    if isinstance(original, dict) and isinstance(patch, dict):
        merged = dict(original)
        for k, v in patch.items():
            if v is None:
                merged.pop(k, None)
            else:
                merged[k] = strategic_merge(original.get(k), v, k)
        return merged
    if isinstance(original, list) and isinstance(patch, list) and key in MERGE_KEYS:
        merge_key = MERGE_KEYS[key]
        merged_list = [copy.deepcopy(item) for item in original]
        for item in patch:
            at = next((i for i, o in enumerate(merged_list) if o.get(merge_key) == item.get(merge_key)), None)
            if at is None:
                merged_list.append(copy.deepcopy(item))
            else:
                merged_list[at] = strategic_merge(merged_list[at], item)
        return merged_list
    return copy.deepcopy(patch)


def _upsert(
    items: list[dict[str, Any]], item: dict[str, Any], same: Callable[[dict[str, Any], dict[str, Any]], bool]
) -> None:  # noqa: E501
    """``apply.upsert``: replace the first item ``same`` as ``item``, else append it."""
    for i, existing in enumerate(items):
        if same(existing, item):
            items[i] = item
            return
    items.append(item)


def upsert_env(env: list[dict[str, Any]], *new: dict[str, Any]) -> None:
    """``apply.UpsertEnvVars`` (by name)."""
    for e in new:
        _upsert(env, copy.deepcopy(e), lambda a, b: a.get("name") == b.get("name"))


def upsert_port(ports: list[dict[str, Any]], *new: dict[str, Any]) -> None:
    """``apply.UpsertPort``: by containerPort or by name (two ports without a name count as the same: ``ptr.Equal`` of
    two nil pointers)."""
    for p in new:
        _upsert(
            ports,
            dict(p),
            lambda a, b: a.get("containerPort") == b.get("containerPort") or a.get("name") == b.get("name"),
        )


def _quantity(text: str | int | float | None) -> float:
    """A resource quantity's value ("500m", "2", "8Gi") as a number."""
    if text is None:
        return 0.0
    text = str(text)
    units = {"m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
    for suffix in sorted(units, key=len, reverse=True):
        if text.endswith(suffix):
            return float(text[: -len(suffix)]) * units[suffix]
    return float(text)


def gpus_per_node(resources: dict[str, Any]) -> int:
    """``GetNumGPUPerNode``: the first resource whose name contains "gpu", from requests, else limits."""

    def gpus(resource_list: dict[str, Any]) -> int:
        for name, value in (resource_list or {}).items():
            if "gpu" in name.lower():
                return int(math.ceil(_quantity(value)))
        return 0

    count = gpus(resources.get("requests") or {})
    return count or gpus(resources.get("limits") or {})


def cpus_per_node(resources: dict[str, Any]) -> int:
    """``getNumCPUPerNode``: the CPU request (else limit), rounded up as ``Quantity.Value`` does."""
    request = (resources.get("requests") or {}).get("cpu")
    if request is None or _quantity(request) == 0:
        limit = (resources.get("limits") or {}).get("cpu")
        return int(math.ceil(_quantity(limit))) if limit is not None else 0
    return int(math.ceil(_quantity(request)))


# -- building the JobSet ------------------------------------------------------------------------------------------


def _ancestor(rjob: dict[str, Any]) -> str | None:
    return (((rjob.get("template") or {}).get("metadata") or {}).get("labels") or {}).get(ANCESTOR_LABEL)


def _pod_spec(rjob: dict[str, Any]) -> dict[str, Any]:
    return rjob.setdefault("template", {}).setdefault("spec", {}).setdefault("template", {}).setdefault("spec", {})


def build_jobset(trainjob: dict[str, Any], runtime: dict[str, Any]) -> dict[str, Any]:
    """The JobSet apply configuration of a TrainJob, as v2.3.0 builds it from its (Cluster)TrainingRuntime:
    ``newRuntimeInfo`` (labels and annotations of the runtime's JobSet template and of the runtime patches,
    ``mergeRuntimePatches``, ``resourcesPerNode`` merged into the trainer's ``node`` container), the ML policy
    (``Torch.EnforceMLPolicy``: ``numNodes``, ``PET_*`` env, port 29500; ``PlainML`` without a framework policy),
    ``SyncParallelCount`` (parallelism and completions), then ``Build`` with ``Builder.Trainer`` (image, command,
    args, env; one replica) and ``Suspend``, owned by the TrainJob (controller)."""
    spec, name = trainjob["spec"], trainjob["metadata"]["name"]
    trainer = spec.get("trainer")
    template = copy.deepcopy(runtime["spec"].get("template") or {})
    ml_policy = runtime["spec"].get("mlPolicy")
    labels = dict((template.get("metadata") or {}).get("labels") or {})
    annotations = dict((template.get("metadata") or {}).get("annotations") or {})
    jobset_spec = template.get("spec") or {}
    order = {r["name"]: i for i, r in enumerate(jobset_spec.get("replicatedJobs") or [])}
    for patch in spec.get("runtimePatches") or []:
        patch_template = (patch.get("trainingRuntimeSpec") or {}).get("template") or {}
        labels |= (patch_template.get("metadata") or {}).get("labels") or {}
        annotations |= (patch_template.get("metadata") or {}).get("annotations") or {}
        if patch_template.get("spec") is not None:
            jobset_spec = strategic_merge(jobset_spec, patch_template["spec"])
    jobset_spec["replicatedJobs"] = sorted(
        jobset_spec.get("replicatedJobs") or [], key=lambda r: order.get(r["name"], len(order))
    )
    counts: list[int] = []
    for rjob in jobset_spec["replicatedJobs"]:
        count = (rjob.get("template") or {}).get("spec", {}).get("parallelism", 1)
        ancestor = _ancestor(rjob)
        if ancestor == ANCESTOR_TRAINER and ml_policy is not None:
            count = ml_policy.get("numNodes", 1)
        if (trainer or {}).get("resourcesPerNode") and ancestor == ANCESTOR_TRAINER and ml_policy is not None:
            for container in _pod_spec(rjob).get("containers") or []:
                if container.get("name") == NODE:  # MergeResourceRequirements: limits and requests per key
                    merged = strategic_merge(container.get("resources") or {}, trainer["resourcesPerNode"])
                    container["resources"] = merged
                    break
        counts.append(max(count, 1))
    trainer_index = next(
        (i for i, r in enumerate(jobset_spec["replicatedJobs"]) if _ancestor(r) == ANCESTOR_TRAINER), None
    )
    policy = ml_policy or {}
    if trainer_index is not None and trainer is not None:
        node_container = next(
            (
                c
                for c in _pod_spec(jobset_spec["replicatedJobs"][trainer_index]).get("containers") or []
                if c.get("name") == NODE
            ),
            None,
        )
    else:
        node_container = None
    if policy.get("torch") is not None:
        _enforce_torch(trainjob, jobset_spec, counts, trainer_index, node_container)
    elif not any(policy.get(k) is not None for k in ("mpi", "jax")):  # PlainML
        if trainer_index is not None and (trainer or {}).get("numNodes") is not None:
            counts[trainer_index] = trainer["numNodes"]
        if node_container is not None:
            upsert_env(node_container.setdefault("env", []), *(trainer.get("env") or []))
    for rjob, count in zip(jobset_spec["replicatedJobs"], counts, strict=True):  # SyncParallelCount
        rjob["template"].setdefault("spec", {}).update(parallelism=count, completions=count)
    for rjob in jobset_spec["replicatedJobs"]:  # Builder.Trainer
        if _ancestor(rjob) != ANCESTOR_TRAINER:
            continue
        rjob["replicas"] = 1
        for container in _pod_spec(rjob).get("containers") or []:
            if container.get("name") != NODE or trainer is None:
                continue
            for field in ("image", "command", "args"):
                if trainer.get(field) is not None:
                    container[field] = trainer[field]
            upsert_env(container.setdefault("env", []), *(trainer.get("env") or []))
    for rjob in jobset_spec["replicatedJobs"]:
        for container in _pod_spec(rjob).get("containers") or []:
            for key in ("env", "ports"):
                if key in container and not container[key]:
                    del container[key]
    if spec.get("suspend") is not None:
        jobset_spec["suspend"] = spec["suspend"]
    meta: dict[str, Any] = {"name": name, "namespace": trainjob["metadata"]["namespace"]}
    if labels:
        meta["labels"] = labels
    if annotations:
        meta["annotations"] = annotations
    meta["ownerReferences"] = [
        {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": KIND,
            "name": name,
            "uid": trainjob["metadata"]["uid"],
            "controller": True,
            "blockOwnerDeletion": True,
        }
    ]
    return {
        "apiVersion": f"{js_player.GROUP}/{js_player.VERSION}",
        "kind": js_player.KIND,
        "metadata": meta,
        "spec": jobset_spec,
    }


def _enforce_torch(
    trainjob: dict[str, Any],
    jobset_spec: dict[str, Any],
    counts: list[int],
    trainer_index: int | None,
    node_container: dict[str, Any] | None,
) -> None:
    """``Torch.EnforceMLPolicy``: the trainer's pod count from ``numNodes``; ``PET_NPROC_PER_NODE`` from
    ``numProcPerNode``, else "auto" with GPUs, else the CPUs per node (at least 1); the trainer's env, then
    ``PET_NNODES``, ``PET_NPROC_PER_NODE``, ``PET_NODE_RANK`` (the completion index annotation), ``PET_MASTER_ADDR``
    (``<trainjob>-node-0-0.<trainjob>``) and ``PET_MASTER_PORT``, and container port 29500 on the ``node`` container
    (only when the TrainJob has a ``trainer``)."""
    trainer, name = trainjob["spec"].get("trainer"), trainjob["metadata"]["name"]
    if trainer_index is not None and (trainer or {}).get("numNodes") is not None:
        counts[trainer_index] = trainer["numNodes"]
    nproc: str = "auto"
    if (trainer or {}).get("numProcPerNode") is not None:
        nproc = str(trainer["numProcPerNode"])
    resources: dict[str, Any] = {}
    for rjob in jobset_spec["replicatedJobs"]:  # ExtractResourcePerNodeFromRuntime
        if rjob["name"] == NODE or _ancestor(rjob) == ANCESTOR_TRAINER:
            for container in _pod_spec(rjob).get("containers") or []:
                if container.get("name") == NODE and container.get("resources") is not None:
                    resources = container["resources"]
                    break
            if resources:
                break
    if (trainer or {}).get("resourcesPerNode"):
        resources = trainer["resourcesPerNode"]
    gpus = gpus_per_node(resources)
    if nproc == "auto" and gpus == 0:
        nproc = str(max(1, cpus_per_node(resources)))
    if node_container is None:
        return
    env = node_container.setdefault("env", [])
    upsert_env(env, *(trainer.get("env") or []))
    nodes = counts[trainer_index] if trainer_index is not None else 1
    upsert_env(
        env,
        {"name": "PET_NNODES", "value": str(nodes)},
        {"name": "PET_NPROC_PER_NODE", "value": nproc},
        {"name": "PET_NODE_RANK", "valueFrom": {"fieldRef": {"fieldPath": COMPLETION_INDEX_FIELD_PATH}}},
    )
    upsert_env(
        env,
        {"name": "PET_MASTER_ADDR", "value": f"{name}-{NODE}-0-0.{name}"},
        {"name": "PET_MASTER_PORT", "value": str(TRAINER_PORT)},
    )
    upsert_port(node_container.setdefault("ports", []), {"containerPort": TRAINER_PORT})


# -- the webhooks -------------------------------------------------------------------------------------------------


class TrainerWebhooks:
    """Trainer's TrainJob defaulting and validating webhooks on loopback, registered once per control plane."""

    def __init__(self, admin: kubernetes.client.ApiClient, workdir: Path):
        self.admin = admin
        self.custom = kubernetes.client.CustomObjectsApi(admin)
        self.denials: list[str] = []
        cert = loopback_cert(workdir, "trainer-webhook")
        self.defaulter = HttpsServer(admission_handler(self.default), cert).start()
        self.validator = HttpsServer(admission_handler(self.validate), cert).start()
        ca = base64.b64encode(cert.pem).decode()
        rules = [
            {"apiGroups": [GROUP], "apiVersions": [VERSION], "operations": ["CREATE", "UPDATE"], "resources": [PLURAL]}
        ]
        api = kubernetes.client.AdmissionregistrationV1Api(admin)

        def configuration(kind: str, name: str, webhook: str, server: HttpsServer, path: str) -> dict[str, Any]:
            return {
                "apiVersion": "admissionregistration.k8s.io/v1",
                "kind": kind,
                "metadata": {"name": name},
                "webhooks": [
                    {
                        "name": webhook,
                        "admissionReviewVersions": ["v1"],
                        "sideEffects": "None",
                        "failurePolicy": "Fail",
                        "timeoutSeconds": 10,
                        "rules": rules,
                        "clientConfig": {"url": f"https://127.0.0.1:{server.port}{path}", "caBundle": ca},
                    }
                ],
            }

        api.create_mutating_webhook_configuration(
            configuration(
                "MutatingWebhookConfiguration",
                MUTATING_CONFIGURATION,
                DEFAULTER_WEBHOOK,
                self.defaulter,
                DEFAULTER_PATH,
            )
        )
        api.create_validating_webhook_configuration(
            configuration(
                "ValidatingWebhookConfiguration",
                VALIDATING_CONFIGURATION,
                VALIDATOR_WEBHOOK,
                self.validator,
                VALIDATOR_PATH,
            )
        )

    def stop(self) -> None:
        api = kubernetes.client.AdmissionregistrationV1Api(self.admin)
        with contextlib.suppress(ApiException):
            api.delete_mutating_webhook_configuration(MUTATING_CONFIGURATION)
        with contextlib.suppress(ApiException):
            api.delete_validating_webhook_configuration(VALIDATING_CONFIGURATION)
        self.defaulter.stop()
        self.validator.stop()

    def default(self, request: dict[str, Any]) -> dict[str, Any]:
        """``TrainJobDefaulter.Default``: on create, each runtime patch without a time gets now; on update, a patch
        equal (time aside) to the old one of its manager keeps the old time, a changed one gets now."""
        trainjob = request.get("object") or {}
        patches = copy.deepcopy((trainjob.get("spec") or {}).get("runtimePatches") or [])
        old_by_manager = (
            {
                p.get("manager", ""): p
                for p in ((request.get("oldObject") or {}).get("spec") or {}).get("runtimePatches") or []
            }
            if request.get("operation") == "UPDATE"
            else None
        )
        stamp = now()
        for patch in patches:
            if old_by_manager is None:
                patch.setdefault("time", stamp)
            elif (old := old_by_manager.get(patch.get("manager", ""))) is not None:
                same = {k: v for k, v in old.items() if k != "time"} == {k: v for k, v in patch.items() if k != "time"}
                if same and old.get("time"):
                    patch["time"] = old["time"]
                elif same:
                    patch.pop("time", None)
                else:
                    patch["time"] = stamp
            else:
                patch.setdefault("time", stamp)
        response: dict[str, Any] = {"uid": request["uid"], "allowed": True}
        if patches != ((trainjob.get("spec") or {}).get("runtimePatches") or []):
            ops = [{"op": "add", "path": "/spec/runtimePatches", "value": patches}]
            response |= {"patchType": "JSONPatch", "patch": base64.b64encode(json.dumps(ops).encode()).decode()}
        return response

    def validate(self, request: dict[str, Any]) -> dict[str, Any]:
        """``TrainJobValidator.ValidateCreate`` / ``ValidateUpdate``; a denial as controller-runtime answers one."""
        new = request.get("object") or {}
        old = request.get("oldObject") if request.get("operation") == "UPDATE" else None
        response: dict[str, Any] = {"uid": request["uid"], "allowed": True}
        if request.get("operation") not in ("CREATE", "UPDATE"):
            return response
        warnings, errors = validate_trainjob(self.custom, old, new)
        if warnings:
            response["warnings"] = warnings
        if errors:
            message = errors[0] if len(errors) == 1 else "[" + ", ".join(errors) + "]"
            self.denials.append(message)
            response |= {"allowed": False, "status": {"code": 403, "reason": "Forbidden", "message": message}}
        return response


def _read_runtime(custom: kubernetes.client.CustomObjectsApi, trainjob: dict[str, Any]) -> dict[str, Any]:
    """The runtime a TrainJob refers to, as the API server has it (404 raised)."""
    ref, namespace = trainjob["spec"]["runtimeRef"], trainjob["metadata"].get("namespace", "")
    if runtime_key(trainjob) == CLUSTER_RUNTIME_KEY:
        response = custom.get_cluster_custom_object(
            GROUP, VERSION, CLUSTER_RUNTIMES, ref["name"], _preload_content=False
        )
    else:
        response = custom.get_namespaced_custom_object(
            GROUP, VERSION, namespace, RUNTIMES, ref["name"], _preload_content=False
        )
    return json.loads(response.data)


def validate_trainjob(
    custom: kubernetes.client.CustomObjectsApi, old: dict[str, Any] | None, new: dict[str, Any]
) -> tuple[list[str], list[str]]:
    """``TrainJobValidator`` with the runtime's ``ValidateObjects`` and the plugins' ``Validate`` (JobSet, then
    Torch): (warnings, errors as their text)."""
    key = runtime_key(new)
    if key not in (CLUSTER_RUNTIME_KEY, RUNTIME_KEY):
        return [], [f"unsupported runtime: {key}"]
    cluster = key == CLUSTER_RUNTIME_KEY
    ref = new["spec"].get("runtimeRef") or {}
    try:
        runtime = _read_runtime(custom, new)
    except ApiException as exc:
        if exc.status != 404:
            raise
        resource = CLUSTER_RUNTIMES if cluster else RUNTIMES
        field, kind = (
            ("spec.RuntimeRef", "clusterTrainingRuntime") if cluster else ("spec.runtimeRef", "trainingRuntime")
        )
        return [], [
            f"{field}: Invalid value: {go_runtime_ref(ref)}: {resource}.{GROUP} {json.dumps(ref.get('name'))} "
            f"not found: specified {kind} must be created before the TrainJob is created"
        ]
    warnings = []
    if cluster and (runtime["metadata"].get("labels") or {}).get(SUPPORT_LABEL) == SUPPORT_DEPRECATED:
        warnings.append(
            f'Referenced ClusterTrainingRuntime "{runtime["metadata"]["name"]}" is deprecated and will be '
            f"removed in a future release of Kubeflow Trainer. See runtime deprecation policy: "
            f"{DEPRECATION_POLICY_URL}"
        )
    errors = _validate_jobset_plugin(custom, runtime, old, new) + _validate_torch_plugin(runtime, new)
    return warnings, errors


def _validate_jobset_plugin(
    custom: kubernetes.client.CustomObjectsApi, runtime: dict[str, Any], old: dict[str, Any] | None, new: dict[str, Any]
) -> list[str]:
    """``JobSet.Validate`` (plugins/jobset/jobset.go): initializer jobs present for an initializer; runtime patches
    changed only while suspended and with no active Job (``checkRuntimePatchesImmutability``); each patch's manager a
    domain-prefixed path; a patch names only replicatedJobs and containers of the runtime, and no env for the
    initializer and node containers."""
    errors: list[str] = []
    patches_path = "spec.runtimePatches"
    value = "[]v1alpha1.RuntimePatch{...}"  # %#v of the patches: pointers and times; not rendered here
    rjobs = (runtime["spec"].get("template") or {}).get("spec", {}).get("replicatedJobs") or []
    names = {
        r["name"]: {
            c["name"]
            for c in (_pod_spec(copy.deepcopy(r)).get("initContainers") or [])
            + (_pod_spec(copy.deepcopy(r)).get("containers") or [])
        }
        for r in rjobs
    }
    ref = go_runtime_ref(new["spec"].get("runtimeRef") or {})
    initializer = new["spec"].get("initializer") or {}
    for kind, config in ((DATASET_INITIALIZER, "datasetConfig"), (MODEL_INITIALIZER, "modelConfig")):
        if initializer.get("dataset" if kind == DATASET_INITIALIZER else "model") is None:
            continue
        if kind not in names:
            errors.append(
                f"spec.runtimeRef: Invalid value: {ref}: must have {kind} job when trainJob is configured "
                f"with input {config}"
            )
        elif kind not in names[kind]:
            errors.append(
                f"spec.runtimeRef: Invalid value: {ref}: must have container with name - {kind} in the {kind} job"
            )
        else:
            rjob = next(r for r in rjobs if r["name"] == kind)
            mounts = [
                m
                for c in _pod_spec(copy.deepcopy(rjob)).get("containers") or []
                if c["name"] == kind
                for m in c.get("volumeMounts") or []
            ]
            if not any(m.get("name") == INITIALIZER_VOLUME for m in mounts):
                errors.append(
                    f"spec.runtimeRef: Invalid value: {ref}: must have volumeMount with name - "
                    f"{INITIALIZER_VOLUME} in container {kind} of the {kind} job"
                )
    new_patches = new["spec"].get("runtimePatches") or []
    if old is not None and (old["spec"].get("runtimePatches") or []) != new_patches:
        if not old["spec"].get("suspend") and not new["spec"].get("suspend"):
            errors.append(
                f"{patches_path}: Forbidden: RuntimePatches can only be modified when the TrainJob is "
                f"suspended before or after the update"
            )
        else:
            try:
                jobset = custom.get_namespaced_custom_object(
                    js_player.GROUP,
                    js_player.VERSION,
                    new["metadata"]["namespace"],
                    js_player.PLURAL,
                    new["metadata"]["name"],
                )
            except ApiException as exc:
                if exc.status != 404:
                    raise
                jobset = {}
            for status in (jobset.get("status") or {}).get("replicatedJobsStatus") or []:
                if status.get("active", 0) > 0:
                    errors.append(
                        f"{patches_path}: Forbidden: RuntimePatches cannot be modified when the JobSet's "
                        f"ReplicatedJob {status['name']} is still active"
                    )
    for patch in new_patches:
        errors += _domain_prefixed_path(f"{patches_path}.manager", patch.get("manager", ""))
        spec = ((patch.get("trainingRuntimeSpec") or {}).get("template") or {}).get("spec")
        if spec is None:
            continue
        for rjob_patch in spec.get("replicatedJobs") or []:
            containers = names.get(rjob_patch.get("name", ""))
            if containers is None:
                errors.append(
                    f"{patches_path}: Invalid value: {value}: must not have replicated job that doesn't "
                    f"exist in the runtime job template"
                )
                continue
            pod = (((rjob_patch.get("template") or {}).get("spec") or {}).get("template") or {}).get("spec")
            if pod is None:
                continue
            for c in pod.get("initContainers") or []:
                if c.get("name") not in containers:
                    errors.append(
                        f"{patches_path}: Invalid value: {value}: must not have initContainer that doesn't "
                        f"exist in the runtime job {rjob_patch['name']}"
                    )
            for c in pod.get("containers") or []:
                if c.get("name") not in containers:
                    errors.append(
                        f"{patches_path}: Invalid value: {value}: must not have container that doesn't "
                        f"exist in the runtime job {rjob_patch['name']}"
                    )
                elif c.get("env") and c["name"] in (DATASET_INITIALIZER, MODEL_INITIALIZER, NODE):
                    errors.append(
                        f"{patches_path}: Invalid value: {value}: must not have envs for the "
                        f"{DATASET_INITIALIZER}, {MODEL_INITIALIZER}, {NODE} containers"
                    )
    return errors


def _domain_prefixed_path(field: str, path: str) -> list[str]:
    """apimachinery ``validation.IsDomainPrefixedPath``: required; ``<DNS-1123 subdomain>/<http path>``."""
    if not path:
        return [f"{field}: Required value"]
    host, sep, rest = path.partition("/")
    if not sep or not host or not rest:
        return [f'{field}: Invalid value: {json.dumps(path)}: must be a domain-prefixed path (such as "acme.io/foo")']
    subdomain = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
    if len(host) > 253 or not subdomain.fullmatch(host):
        return [
            f"{field}: Invalid value: {json.dumps(host)}: a lowercase RFC 1123 subdomain must consist of lower "
            f"case alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character "
            f"(e.g. 'example.com', regex used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]"
            f"([-a-z0-9]*[a-z0-9])?)*')"
        ]
    if not re.fullmatch(r"[A-Za-z0-9/\-._~%!$&'()*+,;=:]+", rest):
        return [
            f"{field}: Invalid value: {json.dumps(rest)}: Invalid path must consist of only alphanumeric "
            f"characters, '/', '-', '.', '_', '~', '%', '!', '$', '&', ''', '(', ')', '*', '+', ',', ';', '=' or "
            f"':' (e.g. '/foo/bar/', regex used for validation is '[A-Za-z0-9/\\-._~%!$&'()*+,;=:]+')"
        ]
    return []


def _validate_torch_plugin(runtime: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """``Torch.Validate``: with a torch ML policy, the envInjection targets exist in the runtime, and the trainer's env
    holds none of the torchrun reserved names (``TorchRunReservedEnvNames``, listed sorted as ``sets.List``)."""
    policy = (runtime["spec"].get("mlPolicy") or {}).get("torch")
    if policy is None:
        return []
    errors = []
    rjobs = (runtime["spec"].get("template") or {}).get("spec", {}).get("replicatedJobs") or []
    for target in (policy.get("envInjection") or {}).get("targets") or []:
        rjob = next((r for r in rjobs if r["name"] == target.get("jobName")), None)
        pod = _pod_spec(copy.deepcopy(rjob)) if rjob else {}
        have = {c["name"] for c in (pod.get("containers") or []) + (pod.get("initContainers") or [])}
        for container in target.get("containerNames") or []:
            if container not in have:
                errors.append(
                    f"spec.runtimeRef: Invalid value: v1alpha1.EnvInjectionTarget{{...}}: envInjection "
                    f'target podSet "{target.get("jobName")}" container "{container}" not found in runtime '
                    f"template"
                )
    env = (new["spec"].get("trainer") or {}).get("env") or []
    reserved = sorted({e["name"] for e in env if e.get("name") in TORCH_RESERVED_ENVS})
    if reserved:
        errors.append(
            f"spec.trainer.env: Invalid value: {go_env_list(env)}: must not have reserved envs, invalid envs "
            f"configured: [{' '.join(reserved)}]"
        )
    return errors


# -- events -------------------------------------------------------------------------------------------------------


def go_error(exc: BaseException) -> str:
    """``err.Error()`` of what a controller-runtime client call returned: an API error is its status's message."""
    if isinstance(exc, ApiException):
        with contextlib.suppress(ValueError, TypeError):
            return str(json.loads(exc.body).get("message") or exc.reason)
        return str(exc.reason)
    return str(exc)


class EventRecorder:
    """controller-runtime's ``mgr.GetEventRecorder(name)``: client-go's ``tools/events`` broadcaster writing
    ``events.k8s.io/v1`` Events (``event_broadcaster.go`` ``recordToSink``): the first of a kind is created; the first
    isomorphic one after it updates it once, as a series of count 2; later ones are only counted in memory (a
    heartbeat sends them every 30 minutes, longer than any test). Isomorphic: the same regarding object (its
    resourceVersion too: a changed TrainJob starts a new Event), reason, action and type; not the note, so a series
    keeps its first message (``getKey``)."""

    def __init__(self, admin: kubernetes.client.ApiClient, controller: str):
        self.events = kubernetes.client.EventsV1Api(admin)
        self.controller = controller
        self.seen: dict[tuple[str, ...], tuple[str, int]] = {}  # isomorphic key -> (event name, count)

    def warn(self, regarding: dict[str, Any], reason: str, action: str, note: str) -> None:
        meta = regarding["metadata"]
        key = (meta["namespace"], meta["uid"], meta.get("resourceVersion", ""), reason, action)
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime()) + f".{int(time.time() * 1e6) % 1_000_000:06d}Z"
        if key not in self.seen:
            name = f"{meta['name']}.{int(time.time() * 1e9):x}"
            body = {
                "apiVersion": "events.k8s.io/v1",
                "kind": "Event",
                "metadata": {"name": name, "namespace": meta["namespace"]},
                "eventTime": stamp,
                "reportingController": self.controller,
                "reportingInstance": f"{self.controller}-0",
                "action": action,
                "reason": reason,
                "note": note,
                "type": "Warning",
                "regarding": {
                    "apiVersion": regarding["apiVersion"],
                    "kind": regarding["kind"],
                    "uid": meta["uid"],
                    "name": meta["name"],
                    "namespace": meta["namespace"],
                    "resourceVersion": meta.get("resourceVersion", ""),
                },
            }
            self.events.create_namespaced_event(meta["namespace"], body, _preload_content=False)
            self.seen[key] = (name, 1)
            return
        name, count = self.seen[key]
        self.seen[key] = (name, count + 1)
        if count == 1:
            self.events.patch_namespaced_event(
                name, meta["namespace"], {"series": {"count": 2, "lastObservedTime": stamp}}, _preload_content=False
            )


# -- the controller -----------------------------------------------------------------------------------------------


def is_finished(trainjob: dict[str, Any]) -> bool:
    """``IsTrainJobFinished``: Complete or Failed True."""
    return js_player.condition_true(trainjob, COMPLETE) or js_player.condition_true(trainjob, FAILED)


class TrainJobController(PolledController):
    """The TrainJob controller for one namespace. ``on_created(trainjob)`` runs (in its own thread) when a TrainJob is
    first seen: the test's timeline for it, as :class:`tests.cluster.training_operator.TrainingOperator` does."""

    def __init__(
        self,
        admin: kubernetes.client.ApiClient,
        namespace: str,
        on_created: Callable[[dict[str, Any]], None] | None = None,
        poll_s: float = 0.1,
    ):
        super().__init__(f"trainer-{namespace}", poll_s)
        self.api = admin
        self.custom = kubernetes.client.CustomObjectsApi(admin)
        self.core = kubernetes.client.CoreV1Api(admin)
        self.namespace, self.on_created = namespace, on_created
        self.seen: set[str] = set()
        self.build_errors: list[str] = []  # what v2.3.0 reports as TrainJobResourcesCreationFailed events
        self.events = EventRecorder(admin, "trainer-trainjob-controller")  # pkg/controller/setup.go
        self._versions: dict[str, tuple[str, ...]] = {}
        self._timers: dict[str, float] = {}  # TrainJob uid -> when its deadline check is due
        self.start()

    def reconcile_all(self) -> None:
        trainjobs = json.loads(
            self.custom.list_namespaced_custom_object(
                GROUP, VERSION, self.namespace, PLURAL, _preload_content=False
            ).data
        )["items"]
        jobsets = json.loads(
            self.custom.list_namespaced_custom_object(
                js_player.GROUP, js_player.VERSION, self.namespace, js_player.PLURAL, _preload_content=False
            ).data
        )["items"]
        for trainjob in trainjobs:
            meta = trainjob["metadata"]
            uid = meta["uid"]
            if uid not in self.seen:
                self.seen.add(uid)
                if self.on_created is not None:
                    threading.Thread(
                        target=self.on_created, args=(trainjob,), daemon=True, name=f"timeline-{meta['name']}"
                    ).start()
            owned = [
                j
                for j in jobsets
                if any(o.get("uid") == uid and o.get("controller") for o in j["metadata"].get("ownerReferences") or [])
            ]
            versions = (meta["resourceVersion"], *sorted(j["metadata"]["resourceVersion"] for j in owned))
            due = self._timers.get(uid)
            timer = due is not None and time.monotonic() >= due
            if versions == self._versions.get(uid) and not timer:
                continue
            if timer:
                del self._timers[uid]
            if self.reconcile(trainjob):
                self._versions[uid] = versions

    def reconcile(self, trainjob: dict[str, Any]) -> bool:
        """``TrainJobReconciler.Reconcile``; False when it met an error (retried at the next pass)."""
        meta, spec = trainjob["metadata"], trainjob["spec"]
        if (spec.get("managedBy") or CONTROLLER_NAME) != CONTROLLER_NAME:
            return True
        # No look at deletionTimestamp: v2.3.0 reconciles a TrainJob being deleted like any other, so one held by a
        # foreground deletion after its JobSet went gets a new JobSet (the same gap as kubeflow/trainer#3779; JobSet
        # fixed it for itself in kubernetes-sigs/jobset#561).
        status = copy.deepcopy(trainjob.get("status") or {})
        before = copy.deepcopy(status)
        conditions = status.setdefault("conditions", [])
        failed = next((c for c in conditions if c["type"] == FAILED), None)
        if failed is not None and failed.get("reason") != DEADLINE_REASON:  # removeFailedCondition
            conditions.remove(failed)
        view = {**trainjob, "status": status}
        ok = True
        key = runtime_key(trainjob)
        if key not in (CLUSTER_RUNTIME_KEY, RUNTIME_KEY):
            set_status_condition(
                conditions,
                {
                    "type": FAILED,
                    "status": "True",
                    "reason": NOT_SUPPORTED_REASON,
                    "message": f"unsupported runtime: {key}",
                },
            )
            ok = False
        elif not is_finished(view):
            try:
                self._reconcile_objects(trainjob)
            except (ApiException, LookupError, ValueError) as exc:
                error = go_error(exc)
                message = f"TrainJob resources reconciliation failed: {error[:950]}" + (
                    " ..." if len(error) > 950 else ""
                )
                log.info("%s/%s: %s", self.namespace, meta["name"], message)
                self.build_errors.append(message)
                self.events.warn(trainjob, "TrainJobResourcesCreationFailed", "Reconciling", message)
                ok = False
        self._set_suspended_condition(trainjob, conditions)
        if key in (CLUSTER_RUNTIME_KEY, RUNTIME_KEY):
            ok = self._set_status_from_jobset(view, status) and ok
        self._reconcile_deadline(view, status)
        if not status.get("conditions"):
            status.pop("conditions", None)
        if status != before:
            patch = {k: status.get(k) for k in {*status, *before}}
            self.custom.patch_namespaced_custom_object_status(
                GROUP, VERSION, self.namespace, PLURAL, meta["name"], {"status": patch}, _preload_content=False
            )
        return ok

    # reconcileObjects -----------------------------------------------------------------------------------------------

    def _runtime(self, trainjob: dict[str, Any]) -> dict[str, Any]:
        """``NewObjects``' runtime: from the snapshot ConfigMap the TrainJob owns (``getRuntimeSnapshot``), else read
        from the API server and the snapshot made (``createRuntimeSnapshot``, applied as ``trainer``)."""
        meta = trainjob["metadata"]
        name = meta["name"] + SNAPSHOT_SUFFIX
        try:
            cm = json.loads(self.core.read_namespaced_config_map(name, self.namespace, _preload_content=False).data)
        except ApiException as exc:
            if exc.status != 404:
                raise
        else:
            owner = next((o for o in cm["metadata"].get("ownerReferences") or [] if o.get("controller")), None)
            if owner is None or owner["uid"] != meta["uid"]:
                raise ValueError("invalid runtime snapshot: a snapshot configmap exists but is owned by another object")
            return yaml.safe_load(cm["data"][SNAPSHOT_KEY])
        try:
            runtime = _read_runtime(self.custom, trainjob)
        except ApiException as exc:
            if exc.status == 404:
                kind = (
                    "not found ClusterTrainingRuntime specified in TrainJob"
                    if runtime_key(trainjob) == CLUSTER_RUNTIME_KEY
                    else "TrainingRuntime specified in TrainJob is not found"
                )
                raise LookupError(f"{kind}: {json.loads(exc.body).get('message', exc.reason)}") from exc
            raise
        runtime["metadata"].pop("managedFields", None)
        snapshot = {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {
                "name": name,
                "namespace": self.namespace,
                "ownerReferences": [
                    {
                        "apiVersion": f"{GROUP}/{VERSION}",
                        "kind": KIND,
                        "name": meta["name"],
                        "uid": meta["uid"],
                        "controller": True,
                        "blockOwnerDeletion": True,
                    }
                ],
            },
            "data": {SNAPSHOT_KEY: yaml.safe_dump(runtime, sort_keys=True)},
        }
        server_side_apply(self.api, f"/api/v1/namespaces/{self.namespace}/configmaps/{name}", snapshot)
        return runtime

    def _reconcile_objects(self, trainjob: dict[str, Any]) -> None:
        """``reconcileObjects`` with the JobSet plugin's ``Build``: the JobSet applied unless it exists and neither
        it nor the TrainJob is suspended."""
        runtime = self._runtime(trainjob)
        name = trainjob["metadata"]["name"]
        try:
            old = self.custom.get_namespaced_custom_object(
                js_player.GROUP, js_player.VERSION, self.namespace, js_player.PLURAL, name
            )
        except ApiException as exc:
            if exc.status != 404:
                raise
            old = None
        if old is not None and not trainjob["spec"].get("suspend") and not old["spec"].get("suspend"):
            return
        body = build_jobset(trainjob, runtime)
        path = f"/apis/{js_player.GROUP}/{js_player.VERSION}/namespaces/{self.namespace}/{js_player.PLURAL}/{name}"
        server_side_apply(self.api, path, body)

    # status ---------------------------------------------------------------------------------------------------------

    @staticmethod
    def _set_suspended_condition(trainjob: dict[str, Any], conditions: list[dict[str, Any]]) -> None:
        """``setSuspendedCondition``: Suspended True while ``spec.suspend``; False (Resumed) once resumed."""
        if trainjob["spec"].get("suspend"):
            new = {"type": SUSPENDED, "status": "True", "reason": SUSPENDED_REASON, "message": SUSPENDED_MESSAGE}
        elif any(c["type"] == SUSPENDED and c["status"] == "True" for c in conditions):
            new = {"type": SUSPENDED, "status": "False", "reason": RESUMED_REASON, "message": RESUMED_MESSAGE}
        else:
            return
        set_status_condition(conditions, new)

    def _set_status_from_jobset(self, view: dict[str, Any], status: dict[str, Any]) -> bool:
        """``setTrainJobStatus`` with the JobSet plugin's ``Status``: the JobSet's Completed and Failed conditions
        copied as Complete and Failed (reason, message and transition time kept), ``jobsStatus`` from its
        ``replicatedJobsStatus``; a DeadlineExceeded Failed condition kept. False when the JobSet is missing while the
        TrainJob is not finished (an error there)."""
        try:
            jobset = self.custom.get_namespaced_custom_object(
                js_player.GROUP, js_player.VERSION, self.namespace, js_player.PLURAL, view["metadata"]["name"]
            )
        except ApiException as exc:
            if exc.status == 404:
                return is_finished(view)
            raise
        conditions = status.setdefault("conditions", [])
        for source, target in ((js_player.COMPLETED, COMPLETE), (js_player.FAILED, FAILED)):
            found = js_player.find_condition(jobset, source)
            if found is not None and found["status"] == "True":
                deadline = next(
                    (c for c in conditions if c["type"] == FAILED and c.get("reason") == DEADLINE_REASON), None
                )
                set_status_condition(conditions, {**found, "type": target})
                if deadline is not None and target == FAILED:
                    set_status_condition(conditions, deadline)
        statuses = [
            {
                "name": s["name"],
                "ready": s.get("ready", 0),
                "succeeded": s.get("succeeded", 0),
                "failed": s.get("failed", 0),
                "active": s.get("active", 0),
                "suspended": s.get("suspended", 0),
            }
            for s in (jobset.get("status") or {}).get("replicatedJobsStatus") or []
        ]
        if statuses:
            status["jobsStatus"] = statuses
        else:
            status.pop("jobsStatus", None)
        return True

    def _reconcile_deadline(self, view: dict[str, Any], status: dict[str, Any]) -> None:
        """``reconcileDeadline``: ``activeDeadlineSeconds`` from creation, or from the last resume; past it Failed
        (DeadlineExceeded) and the JobSet deleted; before it a timer for the moment it passes."""
        deadline_s = view["spec"].get("activeDeadlineSeconds") or 0
        if not deadline_s or is_finished(view) or view["spec"].get("suspend"):
            return
        start = seconds(view["metadata"]["creationTimestamp"])
        suspended = next((c for c in status.get("conditions") or [] if c["type"] == SUSPENDED), None)
        if suspended is not None and suspended["status"] == "False":
            start = seconds(suspended["lastTransitionTime"])
        remaining = start + deadline_s - time.time()
        if remaining < 0:
            set_status_condition(
                status.setdefault("conditions", []),
                {"type": FAILED, "status": "True", "reason": DEADLINE_REASON, "message": DEADLINE_MESSAGE},
            )
            with contextlib.suppress(ApiException):
                self.custom.delete_namespaced_custom_object(
                    js_player.GROUP, js_player.VERSION, self.namespace, js_player.PLURAL, view["metadata"]["name"]
                )
            return
        self._timers[view["metadata"]["uid"]] = time.monotonic() + max(remaining, 1.0)


# -- finding a TrainJob's pods --------------------------------------------------------------------------------------


def node_pods(
    core: kubernetes.client.CoreV1Api, namespace: str, trainjob: str, include_terminating: bool = False
) -> dict[int, dict[str, Any]]:
    """The trainer pods of a TrainJob by node rank (the Job completion index): those of its JobSet's ``node`` Job
    (``<trainjob>-node-0``, pods ``<trainjob>-node-0-<rank>-<5 random>``), not being deleted unless asked."""
    selector = f"{js_player.JOBSET_NAME_KEY}={trainjob},{js_player.REPLICATED_JOB_NAME_KEY}={NODE}"
    pods = json.loads(core.list_namespaced_pod(namespace, label_selector=selector, _preload_content=False).data)
    found: dict[int, dict[str, Any]] = {}
    for pod in sorted(pods["items"], key=lambda p: p["metadata"]["creationTimestamp"]):
        if pod["metadata"].get("deletionTimestamp") and not include_terminating:
            continue
        found[int(pod["metadata"]["labels"][COMPLETION_INDEX_LABEL])] = pod
    return found


def wait_node_pod(
    core: kubernetes.client.CoreV1Api,
    namespace: str,
    trainjob: str,
    rank: int,
    *,
    not_named: set[str] | frozenset[str] = frozenset(),
    timeout_s: float = 30,
) -> str:
    """The name of node ``rank``'s pod of a TrainJob once the Job controller has made it (one not in ``not_named``:
    after a restart or a resume, the new one)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pod = node_pods(core, namespace, trainjob).get(rank)
        if pod is not None and pod["metadata"]["name"] not in not_named:
            return pod["metadata"]["name"]
        time.sleep(0.05)
    raise TimeoutError(f"TrainJob {namespace}/{trainjob}: no pod for node {rank} within {timeout_s:.0f}s")
