"""TrainJob -> JobSet: the JobSet apply configuration Trainer v2.3.0 builds of a TrainJob and its runtime
(``pkg/runtime/core/trainingruntime.go`` ``newRuntimeInfo``; ``pkg/runtime/framework/plugins/torch/torch.go``
``EnforceMLPolicy``, ``plainml/plainml.go``; ``jobset/jobset.go`` ``SyncParallelCount`` and ``Build``,
``jobset/builder.go``), with the ``apply`` helpers and resource counts they use."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

from tests.cluster import jobset as js_player
from tests.cluster.controller import controller_reference
from tests.cluster.trainer.api import (
    ANCESTOR_LABEL,
    ANCESTOR_TRAINER,
    COMPLETION_INDEX_FIELD_PATH,
    GROUP,
    KIND,
    NODE,
    TRAINER_PORT,
    VERSION,
)
from tests.cluster.trainer.runtime import strategic_merge


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


def pod_spec(rjob: dict[str, Any]) -> dict[str, Any]:
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
            for container in pod_spec(rjob).get("containers") or []:
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
                for c in pod_spec(jobset_spec["replicatedJobs"][trainer_index]).get("containers") or []
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
        for container in pod_spec(rjob).get("containers") or []:
            if container.get("name") != NODE or trainer is None:
                continue
            for field in ("image", "command", "args"):
                if trainer.get(field) is not None:
                    container[field] = trainer[field]
            upsert_env(container.setdefault("env", []), *(trainer.get("env") or []))
    for rjob in jobset_spec["replicatedJobs"]:
        for container in pod_spec(rjob).get("containers") or []:
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
    meta["ownerReferences"] = [controller_reference(f"{GROUP}/{VERSION}", KIND, trainjob["metadata"])]
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
            for container in pod_spec(rjob).get("containers") or []:
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
