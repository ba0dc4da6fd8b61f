"""The runtime check: a TrainJob names a ClusterTrainingRuntime the platform team applied once, and the job only
works as compiled when that runtime holds what the pipeline relies on (its contract below) and agrees with the run's
grace period when Kueue queues it."""

from __future__ import annotations

import json
from typing import Any

from kubernetes.client.exceptions import ApiException

from components.launch_training.rendering import QUEUE_LABEL
from components.launch_training.trainjob import DSHM, queued_grace_conflict, runtime_grace_period
from components.preflight.context import Context, forbidden, not_found
from components.preflight.result import FAIL, NOT_APPLICABLE, PASS, READ_FIX, WARN, Check

DEPLOY_RUNTIME = "deploy/trainjob-runtime.yaml"  # our ClusterTrainingRuntime, as render-runtime writes it by default

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
        f"apply {DEPLOY_RUNTIME}, or what `hyperpod-pretrain render-runtime` prints for this "
        "pipeline's settings (a cluster admin: ClusterTrainingRuntimes are cluster-scoped)"
    )
    try:
        found = ctx.kube.call(
            "get ClusterTrainingRuntime",
            ctx.custom.get_cluster_custom_object,
            ctx.api.group,
            ctx.api.version,
            ctx.api.runtime_plural,
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
