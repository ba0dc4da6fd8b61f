"""The crd check: the compiled job API is served by the cluster (its CRD installed, its version served,
Established), which release of its operator runs it and, where the operator's publisher lists the Kubernetes versions
it supports (the HyperPod training operator), whether the cluster's is one. A missing CRD names another job API when
the cluster has that one instead, as a cluster with Kubeflow Trainer alone needs a pipeline compiled for TrainJobs."""

from __future__ import annotations

import json
import re
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from components.launch_training.apis import job_api
from components.launch_training.job_api import JOB_APIS, JobApi
from components.preflight.context import Context, forbidden, not_found
from components.preflight.operator_versions import (
    AUTO_RESUME_OPERATOR_VERSIONS,
    OPERATOR_READERS,
    SupportedKubernetes,
)
from components.preflight.result import FAIL, PASS, READ_FIX, WARN, Check
from components.preflight.runtime import DEPLOY_RUNTIME

MINOR_VERSION = re.compile(r"v?(\d+)\.(\d+)")  # gitVersion: "v1.31.2", EKS's "v1.31.4-eks-2d5f260"


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
    """When the compiled API's CRD is missing: what the cluster has instead (the first other job API whose CRD is
    there, in JOB_APIS' order), and the one thing to do."""
    other = next((api for api in (job_api(n) for n in JOB_APIS if n != ctx.api.name) if _has_crd(ctx, api)), None)
    if other is None:
        return ""
    installed = OPERATOR_READERS[other.name].installed(ctx)
    apply = f" and apply {DEPLOY_RUNTIME}" if other.runtime_plural else ""
    return f"this cluster has {installed} and no {ctx.api.kind} CRD: compile with --job-api {other.name}{apply}"


def _has_crd(ctx: Context, api: JobApi) -> bool:
    try:
        return read_crd(ctx, api) is not None
    except ApiException:  # not readable: not known to be there
        return False


def kubernetes_version(git_version: str) -> tuple[int, int] | None:
    """(major, minor) of the API server's gitVersion; None where it does not start with one."""
    match = MINOR_VERSION.match(git_version)
    return (int(match[1]), int(match[2])) if match else None


def judge_kubernetes(git_version: str, supported: SupportedKubernetes) -> tuple[str, str, str]:
    """(status, reason, fix) of the cluster's Kubernetes version against the versions the operator supports: outside
    them warns, not fails (the publisher's list trails its releases: the job may well run)."""
    version = kubernetes_version(git_version)
    if version is not None and version in supported:
        return PASS, f"Kubernetes {git_version}, within what the operator supports ({supported})", ""
    minor = f"{version[0]}.{version[1]}" if version is not None else repr(git_version)
    return (
        WARN,
        f"Kubernetes {git_version} is outside what the operator supports ({supported}; {supported.source})",
        f"run on a cluster of Kubernetes {supported}, or check whether that page lists {minor} by now",
    )


def check_crd(ctx: Context) -> Check:
    """The compiled job API is served (its CRD installed, v-served and Established), its operator's version and,
    where the operator's publisher lists them, whether the cluster's Kubernetes is one it supports."""
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
    reader = OPERATOR_READERS[api.name]
    operator = reader.version(ctx)
    shown = f"{operator.operator} {operator.version or 'version unknown'} ({operator.where})"
    # Only a PyTorchJob carries the auto-resume annotation: the other APIs refuse it (their JobApi.validate).
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
    if reader.kubernetes is not None:  # /version: every user may read it (the bootstrap system:public-info-viewer)
        info = ctx.kube.call("read the Kubernetes version", client.VersionApi(ctx.apps.api_client).get_code)
        judged, line, fix = judge_kubernetes(info.git_version, reader.kubernetes)
        reasons.append(line)
        if judged == WARN:
            status = WARN
            fixes.append(fix)
    return Check("crd", status, "; ".join(reasons), "; ".join(fixes))
