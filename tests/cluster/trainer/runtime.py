"""The runtime a TrainJob runs on: the (Cluster)TrainingRuntime it refers to (``RuntimeRefToRuntimeRegistryKey``),
read once and kept in the ``<trainjob>-runtime-snapshot`` ConfigMap the TrainJob owns
(``pkg/runtime/core/snapshot.go``), and the strategic merge of its runtime patches (``mergeRuntimePatches``)."""

from __future__ import annotations

import copy
import json
from typing import Any

import kubernetes
import yaml
from kubernetes.client.exceptions import ApiException

from tests.cluster.controller import controller_reference
from tests.cluster.trainer.api import (
    CLUSTER_RUNTIME_KEY,
    CLUSTER_RUNTIMES,
    GROUP,
    KIND,
    RUNTIMES,
    SNAPSHOT_KEY,
    SNAPSHOT_SUFFIX,
    VERSION,
    server_side_apply,
)


def runtime_key(trainjob: dict[str, Any]) -> str:
    """``RuntimeRefToRuntimeRegistryKey``: ``schema.GroupKind{apiGroup, kind}.String()`` (the CRD defaults them to
    trainer.kubeflow.org and ClusterTrainingRuntime)."""
    ref = (trainjob.get("spec") or {}).get("runtimeRef") or {}
    group, kind = ref.get("apiGroup", ""), ref.get("kind", "")
    return f"{kind}.{group}" if group else kind


def read_runtime(custom: kubernetes.client.CustomObjectsApi, trainjob: dict[str, Any]) -> dict[str, Any]:
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


def resolve_runtime(
    api: kubernetes.client.ApiClient,
    core: kubernetes.client.CoreV1Api,
    custom: kubernetes.client.CustomObjectsApi,
    namespace: str,
    trainjob: dict[str, Any],
) -> dict[str, Any]:
    """``NewObjects``' runtime: from the snapshot ConfigMap the TrainJob owns (``getRuntimeSnapshot``), else read
    from the API server and the snapshot made (``createRuntimeSnapshot``, applied as ``trainer``)."""
    meta = trainjob["metadata"]
    name = meta["name"] + SNAPSHOT_SUFFIX
    try:
        cm = json.loads(core.read_namespaced_config_map(name, namespace, _preload_content=False).data)
    except ApiException as exc:
        if exc.status != 404:
            raise
    else:
        owner = next((o for o in cm["metadata"].get("ownerReferences") or [] if o.get("controller")), None)
        if owner is None or owner["uid"] != meta["uid"]:
            raise ValueError("invalid runtime snapshot: a snapshot configmap exists but is owned by another object")
        return yaml.safe_load(cm["data"][SNAPSHOT_KEY])
    try:
        runtime = read_runtime(custom, trainjob)
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
            "namespace": namespace,
            "ownerReferences": [controller_reference(f"{GROUP}/{VERSION}", KIND, meta)],
        },
        "data": {SNAPSHOT_KEY: yaml.safe_dump(runtime, sort_keys=True)},
    }
    server_side_apply(api, f"/api/v1/namespaces/{namespace}/configmaps/{name}", snapshot)
    return runtime


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
