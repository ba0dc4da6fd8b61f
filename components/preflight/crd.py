"""The crd check: the compiled job API is served by the cluster (its CRD installed, its version served,
Established), and which release of its operator runs it. A missing CRD names the other job API when the cluster has
that one instead, as a cluster with Kubeflow Trainer alone needs a pipeline compiled for TrainJobs."""

from __future__ import annotations

import json
from typing import Any

from kubernetes.client.exceptions import ApiException

from components.launch_training.apis import job_api
from components.launch_training.job_api import JOB_APIS, JobApi
from components.preflight.context import Context, forbidden, not_found
from components.preflight.operator_versions import AUTO_RESUME_OPERATOR_VERSIONS, OPERATOR_READERS
from components.preflight.result import FAIL, PASS, READ_FIX, WARN, Check
from components.preflight.runtime import DEPLOY_RUNTIME


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
    other = next(job_api(name) for name in JOB_APIS if name != ctx.api.name)
    try:
        found = read_crd(ctx, other) is not None
    except ApiException:
        found = False
    if not found:
        return ""
    reader = OPERATOR_READERS.get(other.name)
    installed = reader.installed(ctx) if reader is not None else other.operator
    apply = f" and apply {DEPLOY_RUNTIME}" if other.runtime_plural else ""
    return f"this cluster has {installed} and no {ctx.api.kind} CRD: compile with --job-api {other.name}{apply}"


def check_crd(ctx: Context) -> Check:
    """The compiled job API is served (its CRD installed, v-served and Established) and its operator's version."""
    api = ctx.api
    name = crd_name(api)
    try:
        crd = read_crd(ctx, api)
        if crd is None:
            instead = other_api_line(ctx)
            return Check(
                "crd",
                FAIL,
                instead or f"the {api.kind} CRD {name} is not installed: no job can be created",
                "" if instead else api.install,
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
            return Check(
                "crd", FAIL, f"{name} serves {', '.join(served) or 'no version'}, not {api.version}", api.install
            )
        if established is None or established.get("status") != "True":
            why = f": {established['message']}" if established is not None and established.get("message") else ""
            return Check(
                "crd", FAIL, f"{name} is not Established{why}", f"kubectl describe crd {name}; reinstall {api.operator}"
            )
        reasons.append(f"{name} {api.version} installed")
    reader = OPERATOR_READERS.get(api.name)
    if reader is None:  # the HyperPod training operator: its version is not read yet (issue 59)
        reasons.append(f"{api.operator}: its version is not checked")
        return Check("crd", status, "; ".join(reasons), "; ".join(fixes))
    operator = reader.version(ctx)
    shown = f"{operator.operator} {operator.version or 'version unknown'} ({operator.where})"
    # Only a PyTorchJob carries the auto-resume annotation: the TrainJob API refuses it (TrainJobApi.validate).
    if ctx.auto_resume and operator.version.removeprefix("v") not in AUTO_RESUME_OPERATOR_VERSIONS:
        status = WARN
        reasons.append(
            f"{shown}: HyperPod auto-resume needs {', '.join(AUTO_RESUME_OPERATOR_VERSIONS[:-1])} or "
            f"{AUTO_RESUME_OPERATOR_VERSIONS[-1]}"
        )
        if not operator.version and operator.how_to_check:
            fixes.append(operator.how_to_check)
        fixes.append("install Training Operator v1.8.1, or turn auto-resume off (job option auto_resume: false)")
    else:
        reasons.append(shown)
    return Check("crd", status, "; ".join(reasons), "; ".join(fixes))
