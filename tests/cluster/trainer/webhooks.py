"""Trainer v2.3.0's TrainJob webhooks (``pkg/webhooks/trainjob_webhook.go``): ``TrainJobDefaulter.Default`` (runtime
patch times) and ``TrainJobValidator`` with the runtime's ``ValidateObjects`` and the plugins' ``Validate`` (JobSet,
Torch), registered as in ``manifests/base/webhook`` (configurations ``defaulter.trainer.kubeflow.org`` and
``validator.trainer.kubeflow.org``); a denial is controller-runtime's ``Denied``: 403 with the error's text
(``field.ErrorList.ToAggregate``: one error as itself, several as ``[a, b]``)."""

from __future__ import annotations

import base64
import contextlib
import copy
import json
import re
from pathlib import Path
from typing import Any

import kubernetes
from kubernetes.client.exceptions import ApiException

from tests.cluster import jobset as js_player
from tests.cluster.tls import HttpsServer, admission_handler, loopback_cert
from tests.cluster.trainer.api import (
    CLUSTER_RUNTIME_KEY,
    CLUSTER_RUNTIMES,
    DATASET_INITIALIZER,
    DEFAULTER_PATH,
    DEFAULTER_WEBHOOK,
    DEPRECATION_POLICY_URL,
    GROUP,
    INITIALIZER_VOLUME,
    MODEL_INITIALIZER,
    MUTATING_CONFIGURATION,
    NODE,
    PLURAL,
    RUNTIME_KEY,
    RUNTIMES,
    SUPPORT_DEPRECATED,
    SUPPORT_LABEL,
    TORCH_RESERVED_ENVS,
    VALIDATING_CONFIGURATION,
    VALIDATOR_PATH,
    VALIDATOR_WEBHOOK,
    VERSION,
    now,
)
from tests.cluster.trainer.build import pod_spec
from tests.cluster.trainer.runtime import read_runtime, runtime_key


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
        runtime = read_runtime(custom, new)
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
            for c in (pod_spec(copy.deepcopy(r)).get("initContainers") or [])
            + (pod_spec(copy.deepcopy(r)).get("containers") or [])
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
                for c in pod_spec(copy.deepcopy(rjob)).get("containers") or []
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
        pod = pod_spec(copy.deepcopy(rjob)) if rjob else {}
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
