"""A fake Kubernetes API server on loopback that speaks enough of the real REST API to drive a PyTorchJob launcher.

Being retired: the launcher's tests run on the real control plane (tests/cluster/); what is left here serves the
preflight's and RBAC's tests until they move there too.

It serves, through the official ``kubernetes`` client, what a launcher does against a real cluster:

- ``kubeflow.org/v1`` PyTorchJobs (create, get, list, watch, delete) validated against the CRD's schema the way the
  API server does it: unknown fields are pruned (and reported), schema defaults applied, the rest validated (422),
  then storage (409 on an existing name);
- pods (list, watch, get) and their ``log`` subresource (follow, timestamps, sinceSeconds, tailLines, previous);
- core/v1 events (list, watch), optionally forbidden (403) as for a service account without the RBAC rule;
- what a preflight check reads about the cluster: nodes, pods on nodes (across namespaces, field selectors on
  ``spec.nodeName`` and ``status.phase``), PersistentVolumeClaims, the PersistentVolumes they are bound to and
  storage.k8s.io/v1 StorageClasses, namespaces, apps/v1 DaemonSets and Deployments,
  apiextensions.k8s.io/v1 CustomResourceDefinitions (the PyTorchJob CRD installed, removable: then the PyTorchJob
  endpoints answer 404 as a real API server does) and authorization.k8s.io/v1 SelfSubjectAccessReviews.

Every resource request is authorized the way the API server's RBAC authorizer does it: by default the user is bound
to ``cluster-admin``; :meth:`FakeKubernetes.use_rbac` puts the Roles and bindings of a manifest (``deploy/rbac.yaml``)
in its place, :meth:`FakeKubernetes.grant` adds rules and :meth:`FakeKubernetes.deny` takes permissions away. A
forbidden request gets the API server's 403, and a SelfSubjectAccessReview answers from the same decision.

A :class:`Lifecycle` plays the training operator's and the kubelet's part for each created job: conditions, replica
statuses, pods, container states, log lines and events on a timeline. :class:`Faults` injects error statuses,
dropped connections and watch or log streams cut mid-way. Everything the server saw is recorded for assertions.
"""

from __future__ import annotations

import copy
import functools
import json
import logging
import os
import re
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl, unquote, urlsplit

import jsonschema
import yaml

if TYPE_CHECKING:
    import kubernetes

log = logging.getLogger(__name__)

JOB_NAME_LABEL = "training.kubeflow.org/job-name"
REPLICA_TYPE_LABEL = "training.kubeflow.org/replica-type"
REPLICA_INDEX_LABEL = "training.kubeflow.org/replica-index"
OPERATOR_NAME_LABEL = "training.kubeflow.org/operator-name"
OPERATOR_NAME = "pytorchjob-controller"
CONTAINER = "pytorch"
DEFAULT_USER = "system:serviceaccount:kubeflow:pipeline-runner"
INSUFFICIENT_GPU = "0/4 nodes are available: 4 Insufficient nvidia.com/gpu."
DEFAULT_LOG_LINES = ("step 10 loss 4.2", "step 20 loss 3.1", "step 30 loss 2.5")

HOSTNAME_LABEL = "kubernetes.io/hostname"
INSTANCE_TYPE_LABEL = "node.kubernetes.io/instance-type"
NODE_HEALTH_LABEL = "sagemaker.amazonaws.com/node-health-status"
DEEP_HEALTH_LABEL = "sagemaker.amazonaws.com/deep-health-check-status"
GPU_RESOURCE = "nvidia.com/gpu"
EFA_RESOURCE = "vpc.amazonaws.com/efa"

# Allocatable resources of HyperPod instance types (8 GPUs each; EFA devices as in DESIGN.md).
INSTANCE_RESOURCES: dict[str, dict[str, str]] = {
    "ml.p5.48xlarge": {"cpu": "192", "memory": "2063937952Ki", GPU_RESOURCE: "8", EFA_RESOURCE: "32"},
    "ml.p5en.48xlarge": {"cpu": "192", "memory": "2063937952Ki", GPU_RESOURCE: "8", EFA_RESOURCE: "16"},
    "ml.p4d.24xlarge": {"cpu": "96", "memory": "1176338588Ki", GPU_RESOURCE: "8", EFA_RESOURCE: "4"},
}
CPU_NODE_RESOURCES = {"cpu": "8", "memory": "31669808Ki"}

# The device plugins a GPU/EFA cluster runs (HyperPod installs both in kube-system).
EFA_DEVICE_PLUGIN = "aws-efa-k8s-device-plugin-daemonset"
EFA_DEVICE_PLUGIN_IMAGE = "602401143452.dkr.ecr.us-west-2.amazonaws.com/eks/aws-efa-k8s-device-plugin:v0.5.6"
NVIDIA_DEVICE_PLUGIN = "nvidia-device-plugin-daemonset"
NVIDIA_DEVICE_PLUGIN_IMAGE = "nvcr.io/nvidia/k8s-device-plugin:v0.16.2"

TRAINING_OPERATOR = "training-operator"
TRAINING_OPERATOR_NAMESPACE = "kubeflow"
TRAINING_OPERATOR_LABELS = {"control-plane": "kubeflow-training-operator"}

# What the kubelet reports when containerd cannot pull an image ({ref}, {registry}, {repository}, {tag}, {image}).
# The fields of metav1.ObjectMeta: the API server keeps only these under a resource's root metadata.
OBJECT_META_FIELDS = frozenset(
    {
        "name",
        "generateName",
        "namespace",
        "selfLink",
        "uid",
        "resourceVersion",
        "generation",
        "creationTimestamp",
        "deletionTimestamp",
        "deletionGracePeriodSeconds",
        "labels",
        "annotations",
        "ownerReferences",
        "finalizers",
        "managedFields",
    }
)

REASONS = {
    400: "BadRequest",
    401: "Unauthorized",
    403: "Forbidden",
    404: "NotFound",
    405: "MethodNotAllowed",
    409: "Conflict",
    410: "Expired",
    422: "Invalid",
    429: "TooManyRequests",
    500: "InternalError",
    503: "ServiceUnavailable",
    504: "Timeout",
}
DEFAULT_MESSAGES = {
    401: "Unauthorized",
    429: "the server has received too many requests and has asked us to try again later",
    500: "Internal error occurred: injected fault",
    503: "the server is currently unable to handle the request",
    504: "the server was unable to return a response in the time allotted, but may still be processing the request",
}

DNS1123_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
DNS1035_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")
QUALIFIED_NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")


# --------------------------------------------------------------------------------------------------------------------
# Time, JSON and Status helpers


def now_rfc3339() -> str:
    """The current time the way metav1.Time serializes: RFC 3339, UTC, whole seconds."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def rfc3339(at: datetime | float | str | None = None) -> str:
    """A metav1.Time: ``at`` as a datetime, seconds since the epoch or an RFC 3339 string (None: now)."""
    if at is None:
        return now_rfc3339()
    if isinstance(at, str):
        parse_rfc3339_ns(at)  # reject what is not a time
        return at
    if isinstance(at, datetime):
        moment = at if at.tzinfo else at.replace(tzinfo=UTC)
        return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return datetime.fromtimestamp(at, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def rfc3339_nano(t_ns: int) -> str:
    """A kubelet log timestamp: RFC 3339 with exactly nine fractional digits, UTC."""
    seconds, nanos = divmod(t_ns, 1_000_000_000)
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%dT%H:%M:%S") + f".{nanos:09d}Z"


def parse_rfc3339_ns(text: str) -> int:
    """Nanoseconds since the epoch of an RFC 3339 time (fractional digits beyond microseconds are kept)."""
    match = re.fullmatch(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d+))?(Z|[+-]\d\d:\d\d)", text)
    if not match:
        raise ValueError(f"not an RFC 3339 time: {text!r}")
    zone = "+00:00" if match.group(3) == "Z" else match.group(3)
    base = datetime.fromisoformat(match.group(1) + zone)
    fraction = (match.group(2) or "").ljust(9, "0")[:9]
    return int(base.timestamp()) * 1_000_000_000 + int(fraction)


def dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def status_body(code: int, message: str, reason: str | None = None, details: dict | None = None) -> dict[str, Any]:
    """A metav1.Status failure, as the API server writes it."""
    body: dict[str, Any] = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason or REASONS.get(code, ""),
    }
    if details is not None:
        body["details"] = details
    body["code"] = code
    return body


class ApiError(Exception):
    """An error answered as a Status body."""

    def __init__(self, code: int, message: str, reason: str | None = None, details: dict | None = None):
        super().__init__(message)
        self.body = status_body(code, message, reason, details)
        self.code = code
        self.headers: dict[str, str] = {}


def parse_bool(text: str) -> bool:
    """Go's strconv.ParseBool, which the API server uses for boolean query parameters."""
    if text in ("1", "t", "T", "TRUE", "true", "True"):
        return True
    if text in ("0", "f", "F", "FALSE", "false", "False"):
        return False
    raise ApiError(400, f'strconv.ParseBool: parsing "{text}": invalid syntax')


def flag(params: dict[str, str], name: str) -> bool:
    """A boolean query parameter (absent or empty: false)."""
    return parse_bool(params.get(name) or "false")


def parse_int(params: dict[str, str], name: str) -> int | None:
    if name not in params or params[name] == "":
        return None
    try:
        return int(params[name])
    except ValueError:
        raise ApiError(400, f'strconv.ParseInt: parsing "{params[name]}": invalid syntax') from None


# --------------------------------------------------------------------------------------------------------------------
# The CRD schema: pruning, defaulting and validation as the API server does them


@functools.lru_cache(maxsize=8)
def _parse_crd(path: str, mtime_ns: int) -> dict[str, Any]:
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml parses the 8000-line CRD ~10x faster
    for doc in yaml.load_all(Path(path).read_text(), Loader=loader):
        if isinstance(doc, dict) and doc.get("kind") == "CustomResourceDefinition":
            return doc
    raise ValueError(f"{path}: no CustomResourceDefinition in the file")


def load_crd(path: Path) -> dict[str, Any]:
    """The CustomResourceDefinition document in a YAML file (a private copy; parsed once per file version)."""
    path = Path(path).resolve()
    return copy.deepcopy(_parse_crd(str(path), path.stat().st_mtime_ns))


def crd_version(crd: dict[str, Any], version: str = "v1") -> dict[str, Any]:
    for entry in crd["spec"]["versions"]:
        if entry["name"] == version:
            return entry
    raise ValueError(f"the CRD {crd['metadata']['name']} has no version {version!r}")


# The Training Operator's CRD lives beside the repository (../shared/reference), never inside it; another copy
# can be named by PYTORCHJOB_CRD. Tests that need it skip, saying so, where it is absent.
CRD_PATH = Path(
    os.environ.get("PYTORCHJOB_CRD")
    or Path(__file__).resolve().parents[2] / "shared/reference/crds/kubeflow.org_pytorchjobs.v1.8.1.yaml"
)


def load_crd_schema(path: Path, version: str = "v1") -> dict[str, Any]:
    """``spec.versions[?name==version].schema.openAPIV3Schema`` of the CRD in the file at ``path``."""
    return crd_version(load_crd(path), version)["schema"]["openAPIV3Schema"]


def _walk_unknown(obj: Any, schema: dict[str, Any], path: str, out: list[str], prune: bool, resource: bool) -> None:
    """Collect (and optionally remove) the fields structural pruning drops; see :func:`unknown_fields`."""
    if isinstance(obj, list):
        items = schema.get("items")
        if isinstance(items, dict):
            for i, value in enumerate(obj):
                _walk_unknown(value, items, f"{path}[{i}]", out, prune, False)
        return
    if not isinstance(obj, dict):
        return
    embedded = resource or schema.get("x-kubernetes-embedded-resource") is True
    props = schema.get("properties")
    additional = schema.get("additionalProperties")
    preserve = schema.get("x-kubernetes-preserve-unknown-fields") is True
    for key in list(obj):
        child = f"{path}.{key}" if path else key
        if embedded and key == "metadata" and isinstance(obj[key], dict):
            for meta_key in list(obj[key]):  # metadata is typed as ObjectMeta whatever the schema says
                if meta_key not in OBJECT_META_FIELDS:
                    out.append(f"{child}.{meta_key}")
                    if prune:
                        del obj[key][meta_key]
        elif embedded and key in ("apiVersion", "kind"):
            continue
        elif isinstance(props, dict) and key in props:
            _walk_unknown(obj[key], props[key], child, out, prune, False)
        elif isinstance(additional, dict):
            _walk_unknown(obj[key], additional, child, out, prune, False)
        elif additional is True or preserve:
            continue
        else:
            out.append(child)
            if prune:
                del obj[key]


def unknown_fields(obj: Any, schema: dict[str, Any], *, resource: bool = True) -> list[str]:
    """The dotted paths of the fields the API server would silently prune from ``obj`` under the structural ``schema``.

    A field is pruned when its object's schema lists ``properties`` without it, has no ``additionalProperties`` and no
    ``x-kubernetes-preserve-unknown-fields: true`` (an object schema with none of the three keeps no field at all).
    With ``resource`` (the default) ``obj`` is a whole resource: ``apiVersion`` and ``kind`` are kept and root
    ``metadata`` is checked against ObjectMeta's fields, as the API server does. List items read ``a.b[0].c``.
    """
    out: list[str] = []
    _walk_unknown(obj, schema, "", out, False, resource)
    return out


def prune_unknown_fields(obj: Any, schema: dict[str, Any], *, resource: bool = True) -> list[str]:
    """Remove in place what :func:`unknown_fields` reports, and return those paths."""
    out: list[str] = []
    _walk_unknown(obj, schema, "", out, True, resource)
    return out


def apply_defaults(obj: Any, schema: dict[str, Any]) -> None:
    """Structural defaulting: drop null fields whose schema is not nullable, then fill in ``default`` values."""
    if isinstance(obj, list):
        items = schema.get("items")
        if isinstance(items, dict):
            for value in obj:
                apply_defaults(value, items)
        return
    if not isinstance(obj, dict):
        return
    props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    additional = schema.get("additionalProperties")
    for key in list(obj):
        child_schema = props.get(key) or (additional if isinstance(additional, dict) else None)
        if obj[key] is None and child_schema is not None and not child_schema.get("nullable"):
            del obj[key]
        elif child_schema is not None:
            apply_defaults(obj[key], child_schema)
    for key, child_schema in props.items():
        if key not in obj and "default" in child_schema:
            obj[key] = copy.deepcopy(child_schema["default"])


def _jsonschema_view(schema: Any) -> Any:
    """The OpenAPI v3 schema with ``nullable`` turned into a JSON Schema type union (for jsonschema's Draft 4)."""
    if isinstance(schema, list):
        return [_jsonschema_view(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    view = {key: _jsonschema_view(value) for key, value in schema.items() if key != "default"}
    if schema.get("nullable") is True and isinstance(schema.get("type"), str):
        view["type"] = [schema["type"], "null"]
    return view


def _go_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return "null"


def _field_path(parts: Iterable[Any]) -> str:
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


@dataclass(frozen=True)
class FieldError:
    """One field.Error of the API server: its cause reason, the field path and the rendered message."""

    reason: str  # FieldValueInvalid, FieldValueTypeInvalid, FieldValueRequired, FieldValueNotSupported, ...
    field: str
    detail: str

    def __str__(self) -> str:
        return f"{self.field}: {self.detail}" if self.field else self.detail


def schema_errors(obj: Any, validator: jsonschema.protocols.Validator) -> list[FieldError]:
    """Validation errors in the API server's wording (kube-openapi's messages wrapped in field errors)."""
    errors: list[FieldError] = []
    for error in sorted(validator.iter_errors(obj), key=lambda e: (list(map(str, e.absolute_path)), e.validator)):
        path = _field_path(error.absolute_path)
        value = error.instance
        shown = path or "<root>"
        if error.validator == "required":
            match = re.match(r"^'(.*)' is a required property$", error.message)
            missing = match.group(1) if match else str(error.validator_value)
            errors.append(FieldError("FieldValueRequired", f"{path}.{missing}" if path else missing, "Required value"))
        elif error.validator == "type":
            expected = error.validator_value
            expected = ",".join(expected) if isinstance(expected, list) else expected
            got = _go_type(value)
            errors.append(
                FieldError(
                    "FieldValueTypeInvalid",
                    path,
                    f'Invalid value: "{got}": {shown} in body must be of type {expected}: "{got}"',
                )
            )
        elif error.validator == "anyOf" and error.schema.get("x-kubernetes-int-or-string"):
            got = _go_type(value)
            errors.append(
                FieldError(
                    "FieldValueTypeInvalid",
                    path,
                    f'Invalid value: "{got}": {shown} in body must be of type integer,string: "{got}"',
                )
            )
        elif error.validator == "enum":
            supported = ", ".join(json.dumps(v) for v in error.validator_value)
            errors.append(
                FieldError(
                    "FieldValueNotSupported",
                    path,
                    f"Unsupported value: {json.dumps(value)}: supported values: {supported}",
                )
            )
        elif error.validator == "pattern":
            errors.append(
                FieldError(
                    "FieldValueInvalid",
                    path,
                    f"Invalid value: {json.dumps(value)}: {shown} in body should match '{error.validator_value}'",
                )
            )
        else:
            errors.append(
                FieldError("FieldValueInvalid", path, f"Invalid value: {json.dumps(value)}: {shown} {error.message}")
            )
    return errors


def list_map_errors(obj: Any, schema: dict[str, Any], path: str = "") -> list[FieldError]:
    """Duplicate keys in ``x-kubernetes-list-type: map`` and ``set`` lists (the API server answers 422 Duplicate)."""
    errors: list[FieldError] = []
    if isinstance(obj, list):
        items = schema.get("items") if isinstance(schema.get("items"), dict) else {}
        list_type = schema.get("x-kubernetes-list-type")
        seen: set[str] = set()
        for i, value in enumerate(obj):
            if list_type == "map" and isinstance(value, dict):
                key = json.dumps({k: value.get(k) for k in schema.get("x-kubernetes-list-map-keys", [])})
            elif list_type == "set":
                key = json.dumps(value, sort_keys=True)
            else:
                key = None
            if key is not None:
                if key in seen:
                    errors.append(FieldError("FieldValueDuplicate", f"{path}[{i}]", f"Duplicate value: {key}"))
                seen.add(key)
            errors += list_map_errors(value, items, f"{path}[{i}]")
    elif isinstance(obj, dict):
        props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
        additional = schema.get("additionalProperties")
        for key, value in obj.items():
            child = props.get(key) or (additional if isinstance(additional, dict) else None)
            if child is not None:
                errors += list_map_errors(value, child, f"{path}.{key}" if path else key)
    return errors


def _qualified_name_errors(key: str) -> list[str]:
    prefix, _, name = key.rpartition("/")
    problems = []
    if prefix and (len(prefix) > 253 or not DNS1123_SUBDOMAIN.fullmatch(prefix)):
        problems.append("prefix part must be a lowercase RFC 1123 subdomain")
    if not name or len(name) > 63 or not QUALIFIED_NAME.fullmatch(name):
        problems.append(
            "name part must consist of alphanumeric characters, '-', '_' or '.', and must start and end with an "
            "alphanumeric character (e.g. 'MyName',  or 'my.name',  or '123-abc', regex used for validation is "
            "'([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]')"
        )
    return problems


def object_meta_errors(meta: dict[str, Any]) -> list[FieldError]:
    """ObjectMeta validation of a namespaced custom resource: name, labels, annotations."""
    errors: list[FieldError] = []
    name = meta.get("name")
    if not name:
        errors.append(
            FieldError("FieldValueRequired", "metadata.name", "Required value: name or generateName is required")
        )
    elif len(name) > 253 or not DNS1123_SUBDOMAIN.fullmatch(name):
        errors.append(
            FieldError(
                "FieldValueInvalid",
                "metadata.name",
                f'Invalid value: "{name}": a lowercase RFC 1123 subdomain must consist of lower case alphanumeric '
                "characters, '-' or '.', and must start and end with an alphanumeric character (e.g. 'example.com', "
                "regex used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')",
            )
        )
    for key, value in (meta.get("labels") or {}).items():
        for problem in _qualified_name_errors(key):
            errors.append(FieldError("FieldValueInvalid", "metadata.labels", f'Invalid value: "{key}": {problem}'))
        if not isinstance(value, str):
            continue
        if len(value) > 63:
            errors.append(
                FieldError(
                    "FieldValueInvalid",
                    "metadata.labels",
                    f'Invalid value: "{value}": must be no more than 63 characters',
                )
            )
        if not LABEL_VALUE.fullmatch(value):
            errors.append(
                FieldError(
                    "FieldValueInvalid",
                    "metadata.labels",
                    f'Invalid value: "{value}": a valid label must be an empty string or consist of alphanumeric '
                    "characters, '-', '_' or '.', and must start and end with an alphanumeric character (e.g. "
                    "'MyValue',  or 'my_value',  or '12345', regex used for validation is "
                    "'(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?')",
                )
            )
    annotations = meta.get("annotations") or {}
    for key in annotations:
        for problem in _qualified_name_errors(key):
            errors.append(FieldError("FieldValueInvalid", "metadata.annotations", f'Invalid value: "{key}": {problem}'))
    if sum(len(k) + len(str(v)) for k, v in annotations.items()) > 262144:
        errors.append(
            FieldError("FieldValueTooLong", "metadata.annotations", "Too long: must have at most 262144 bytes")
        )
    return errors


# --------------------------------------------------------------------------------------------------------------------
# Selectors


def _split_top_level(text: str) -> list[str]:
    parts, depth, current = [], 0, ""
    for char in text:
        if char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    parts.append(current)
    return [p.strip() for p in parts if p.strip()]


def label_matcher(selector: str | None) -> Callable[[dict[str, str]], bool]:
    """A label selector as a predicate: ``a=b``, ``a==b``, ``a!=b``, ``a``, ``!a``, ``a in (x,y)``, ``a notin (x)``."""
    if not selector:
        return lambda labels: True
    tests: list[Callable[[dict[str, str]], bool]] = []
    for term in _split_top_level(selector):
        if m := re.fullmatch(r"([^\s!=]+)\s+(in|notin)\s+\((.*)\)", term):
            key, op, values = m.group(1), m.group(2), {v.strip() for v in m.group(3).split(",") if v.strip()}
            if op == "in":
                tests.append(lambda labels, k=key, vs=values: labels.get(k) in vs)
            else:
                tests.append(lambda labels, k=key, vs=values: labels.get(k) not in vs)
        elif m := re.fullmatch(r"([^\s!=]+)\s*(==|=|!=)\s*([^\s,]*)", term):
            key, op, value = m.groups()
            if op == "!=":
                tests.append(lambda labels, k=key, v=value: labels.get(k) != v)
            else:
                tests.append(lambda labels, k=key, v=value: labels.get(k) == v)
        elif m := re.fullmatch(r"!\s*([^\s!=]+)", term):
            absent = m.group(1)
            tests.append(lambda labels, k=absent: k not in labels)
        elif re.fullmatch(r"[^\s!=(),]+", term):
            tests.append(lambda labels, k=term: k in labels)
        else:
            raise ApiError(400, f"unable to parse requirement: found '{term}', expected: in, notin, =, ==, !=, gt, lt")
    return lambda labels: all(test(labels) for test in tests)


def _dig(obj: dict[str, Any], dotted: str) -> str:
    value: Any = obj
    for part in dotted.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    if value is None:
        return ""
    return str(value).lower() if isinstance(value, bool) else str(value)


def field_matcher(
    selector: str | None, supported: frozenset[str], defaults: dict[str, str] | None = None
) -> Callable[[dict[str, Any]], bool]:
    """A field selector (``a=b``, ``a==b``, ``a!=b``, comma-joined) over the fields the resource supports.

    ``defaults`` are the values fields left out of the JSON have (``spec.unschedulable``: ``"false"``), as the API
    server compares the Go struct's fields, not the serialized object.
    """
    if not selector:
        return lambda obj: True
    defaults = defaults or {}

    def value_of(obj: dict[str, Any], key: str) -> str:
        return _dig(obj, key) or defaults.get(key, "")

    tests: list[Callable[[dict[str, Any]], bool]] = []
    for term in _split_top_level(selector):
        m = re.fullmatch(r"([^=!]+?)\s*(==|=|!=)\s*(.*)", term)
        if not m:
            raise ApiError(400, f"invalid selector: '{selector}'; can't understand '{term}'")
        key, op, value = m.group(1).strip(), m.group(2), m.group(3).strip()
        if key not in supported:
            raise ApiError(400, f"field label not supported: {key}")
        if op == "!=":
            tests.append(lambda obj, k=key, v=value: value_of(obj, k) != v)
        else:
            tests.append(lambda obj, k=key, v=value: value_of(obj, k) == v)
    return lambda obj: all(test(obj) for test in tests)


# --------------------------------------------------------------------------------------------------------------------
# Resources


@dataclass(frozen=True)
class Kind:
    """What the server needs to know about one resource type."""

    resource: str  # plural, as in the URL
    group: str  # "" for the core group
    version: str
    kind: str
    fields: frozenset[str]  # field selectors it supports
    typed_items: bool  # built-in lists leave kind/apiVersion out of their items
    namespaced: bool = True
    verbs: frozenset[str] = frozenset({"get", "list", "watch"})  # what the fake serves
    subresources: frozenset[str] = frozenset()  # served for GET (``status`` answers the object itself)
    field_defaults: tuple[tuple[str, str], ...] = ()  # see field_matcher

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def qualified(self) -> str:
        return f"{self.resource}.{self.group}" if self.group else self.resource

    def not_found(self, name: str) -> ApiError:
        details = {"name": name, "kind": self.resource} | ({"group": self.group} if self.group else {})
        return ApiError(404, f'{self.qualified} "{name}" not found', details=details)


POD_FIELDS = frozenset(
    {
        "metadata.name",
        "metadata.namespace",
        "spec.nodeName",
        "spec.hostNetwork",
        "spec.restartPolicy",
        "spec.schedulerName",
        "spec.serviceAccountName",
        "status.phase",
        "status.podIP",
        "status.nominatedNodeName",
    }
)
EVENT_FIELDS = frozenset(
    {
        "metadata.name",
        "metadata.namespace",
        "involvedObject.kind",
        "involvedObject.namespace",
        "involvedObject.name",
        "involvedObject.uid",
        "involvedObject.apiVersion",
        "involvedObject.resourceVersion",
        "involvedObject.fieldPath",
        "reason",
        "reportingComponent",
        "source",
        "type",
    }
)
NAME_FIELDS = frozenset({"metadata.name"})
NAMESPACED_FIELDS = frozenset({"metadata.name", "metadata.namespace"})
PODS = Kind(
    "pods",
    "",
    "v1",
    "Pod",
    POD_FIELDS,
    True,
    subresources=frozenset({"log", "status"}),
    field_defaults=(("spec.hostNetwork", "false"),),
)
EVENTS = Kind("events", "", "v1", "Event", EVENT_FIELDS, True)
NODES = Kind(
    "nodes",
    "",
    "v1",
    "Node",
    NAME_FIELDS | {"spec.unschedulable"},
    True,
    namespaced=False,
    subresources=frozenset({"status"}),
    field_defaults=(("spec.unschedulable", "false"),),
)
NAMESPACES = Kind("namespaces", "", "v1", "Namespace", NAME_FIELDS | {"status.phase"}, True, namespaced=False)
PVCS = Kind(
    "persistentvolumeclaims",
    "",
    "v1",
    "PersistentVolumeClaim",
    NAMESPACED_FIELDS,
    True,
    subresources=frozenset({"status"}),
)
# Cluster-scoped, as the API serves them: GET /api/v1/persistentvolumes/{name} and
# /apis/storage.k8s.io/v1/storageclasses/{name} (kubernetes/kubernetes pkg/registry/core/persistentvolume and
# pkg/registry/storage/storageclass: NamespaceScoped() false). A StorageClass has no spec or status: provisioner and
# parameters are top-level fields.
PVS = Kind("persistentvolumes", "", "v1", "PersistentVolume", NAME_FIELDS, True, namespaced=False,
           subresources=frozenset({"status"}))  # fmt: skip
STORAGE_CLASSES = Kind("storageclasses", "storage.k8s.io", "v1", "StorageClass", NAME_FIELDS, True, namespaced=False)
DAEMONSETS = Kind("daemonsets", "apps", "v1", "DaemonSet", NAMESPACED_FIELDS, True, subresources=frozenset({"status"}))
DEPLOYMENTS = Kind(
    "deployments", "apps", "v1", "Deployment", NAMESPACED_FIELDS, True, subresources=frozenset({"status"})
)
CRDS = Kind(
    "customresourcedefinitions",
    "apiextensions.k8s.io",
    "v1",
    "CustomResourceDefinition",
    NAME_FIELDS,
    True,
    namespaced=False,
    subresources=frozenset({"status"}),
)
SSARS = Kind(
    "selfsubjectaccessreviews",
    "authorization.k8s.io",
    "v1",
    "SelfSubjectAccessReview",
    frozenset(),
    True,
    namespaced=False,
    verbs=frozenset({"create"}),
)
BUILTIN_KINDS = (PODS, EVENTS, NODES, NAMESPACES, PVCS, PVS, STORAGE_CLASSES, DAEMONSETS, DEPLOYMENTS, CRDS, SSARS)


@dataclass
class Change:
    """One entry of the watch history."""

    rv: int
    resource: str
    namespace: str
    type: str  # ADDED, MODIFIED, DELETED
    obj: dict[str, Any]
    prev: dict[str, Any] | None


@dataclass
class ContainerLog:
    """The log of one pod's container: lines of the running instance and of the previous one."""

    current: list[tuple[int, str]] = field(default_factory=list)
    previous: list[tuple[int, str]] | None = None


# --------------------------------------------------------------------------------------------------------------------
# Faults


@dataclass
class FaultRule:
    kind: str  # "fail", "drop", "drop_watch"
    method: str
    pattern: re.Pattern[str]
    times: int
    status: int = 500
    message: str | None = None
    retry_after: int | None = None
    after: int = 0


class Faults:
    """Faults to inject, each for a number of matching requests (``times``), consumed in the order they were added.

    ``method`` is an HTTP method or ``"*"``; ``path_regex`` is searched (``re.search``) in the path with its query.
    Note that urllib3 (under the kubernetes client) retries idempotent requests (GET, DELETE) by itself: up to 3
    times on a dropped connection, and on 429/503 answers that carry a ``Retry-After`` header.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.rules: list[FaultRule] = []
        self.injected: list[tuple[str, str, str]] = []  # (kind, method, path) of every fault served

    def fail_next(
        self,
        method: str,
        path_regex: str,
        status: int = 500,
        times: int = 1,
        *,
        message: str | None = None,
        retry_after: int | None = None,
    ) -> None:
        """Answer the next ``times`` matching requests with ``status`` and a Status body.

        429 answers carry ``Retry-After: 0`` unless ``retry_after`` says otherwise; others carry it only if given.
        """
        if status == 429 and retry_after is None:
            retry_after = 0
        self._add(FaultRule("fail", method, re.compile(path_regex), times, status, message, retry_after))

    def drop_next(self, method: str, path_regex: str, times: int = 1) -> None:
        """Close the connection of the next ``times`` matching requests without writing any response."""
        self._add(FaultRule("drop", method, re.compile(path_regex), times))

    def drop_watch_after(self, n_events: int, times: int = 1, path_regex: str = "") -> None:
        """Cut the next ``times`` watch streams (closing the socket mid-chunked-stream) after ``n_events`` events."""
        self._add(FaultRule("drop_watch", "GET", re.compile(path_regex), times, after=n_events))

    def clear(self) -> None:
        with self._lock:
            self.rules.clear()

    def _add(self, rule: FaultRule) -> None:
        if rule.times < 1:
            raise ValueError("times must be at least 1")
        with self._lock:
            self.rules.append(rule)

    def take(self, kinds: tuple[str, ...], method: str, path: str) -> FaultRule | None:
        """The first rule of one of ``kinds`` matching the request, with one use consumed; None if none matches."""
        with self._lock:
            for rule in self.rules:
                if rule.kind in kinds and rule.method in ("*", method) and rule.pattern.search(path):
                    rule.times -= 1
                    if rule.times == 0:
                        self.rules.remove(rule)
                    self.injected.append((rule.kind, method, path))
                    return rule
        return None


# --------------------------------------------------------------------------------------------------------------------
# Authorization: RBAC as the API server's authorizer evaluates it


@dataclass(frozen=True)
class Attributes:
    """What a request asks to do (the authorizer's Attributes): a resource request, or a non-resource ``path``."""

    verb: str
    group: str = ""
    resource: str = ""
    subresource: str = ""
    namespace: str = ""  # "" for cluster-scoped resources and for requests across all namespaces
    name: str = ""
    path: str = ""  # non-resource requests only

    @property
    def resource_request(self) -> bool:
        return not self.path


@dataclass(frozen=True)
class Decision:
    """An authorizer's answer, the way a SubjectAccessReview's status carries it."""

    allowed: bool
    denied: bool = False  # an explicit denial (RBAC never gives one: it only fails to allow)
    reason: str = ""


@dataclass(frozen=True)
class Grant:
    """The rules one binding gives the user.

    ``namespace`` is None for a ClusterRoleBinding (every namespace and the cluster scope), else the RoleBinding's
    namespace (its rules never reach cluster-scoped resources or requests across all namespaces). ``source`` names the
    binding the way RBAC's reasons do; ``{subject}`` in it is replaced by the requesting user.
    """

    source: str
    rules: tuple[dict[str, Any], ...]
    namespace: str | None = None


@dataclass(frozen=True)
class Denial:
    """A permission taken away by :meth:`FakeKubernetes.deny` (``*`` matches anything; namespace None: all)."""

    verb: str
    resource: str
    group: str
    subresource: str
    namespace: str | None
    reason: str
    explicit: bool

    def matches(self, attrs: Attributes) -> bool:
        return (
            attrs.resource_request
            and self.verb in ("*", attrs.verb)
            and self.group in ("*", attrs.group)
            and self.resource in ("*", attrs.resource)
            and self.subresource in ("*", attrs.subresource)
            and (self.namespace is None or self.namespace == attrs.namespace)
        )


CLUSTER_ADMIN = Grant(
    'ClusterRoleBinding "fake-cluster-admin" of ClusterRole "cluster-admin" to {subject}',
    (
        {"apiGroups": ["*"], "resources": ["*"], "verbs": ["*"]},
        {"nonResourceURLs": ["*"], "verbs": ["*"]},
    ),
)


def rule_allows(rule: dict[str, Any], attrs: Attributes) -> bool:
    """rbac/v1 ``RuleAllows``: verbs, API groups, resources (``*``, ``pods/log``, ``*/log``) and resourceNames, or
    nonResourceURLs (``*`` and ``/prefix*``) for a non-resource request."""
    verbs = rule.get("verbs") or []
    if "*" not in verbs and attrs.verb not in verbs:
        return False
    if not attrs.resource_request:
        return any(
            url in ("*", attrs.path) or (url.endswith("*") and attrs.path.startswith(url[:-1]))
            for url in rule.get("nonResourceURLs") or []
        )
    groups = rule.get("apiGroups") or []
    if "*" not in groups and attrs.group not in groups:
        return False
    combined = f"{attrs.resource}/{attrs.subresource}" if attrs.subresource else attrs.resource
    if not any(
        r in ("*", combined) or (attrs.subresource and r == f"*/{attrs.subresource}")
        for r in rule.get("resources") or []
    ):
        return False
    names = rule.get("resourceNames") or []
    return not names or attrs.name in names


def _service_account(user: str) -> tuple[str, str] | None:
    """(namespace, name) of a ``system:serviceaccount:<ns>:<name>`` user."""
    parts = user.split(":")
    if len(parts) == 4 and parts[:2] == ["system", "serviceaccount"]:
        return parts[2], parts[3]
    return None


def user_groups(user: str) -> set[str]:
    """The groups the authenticator puts the user in."""
    groups = {"system:authenticated"}
    sa = _service_account(user)
    if sa is not None:
        groups |= {"system:serviceaccounts", f"system:serviceaccounts:{sa[0]}"}
    return groups


def describe_user(user: str) -> str:
    """The user as RBAC's reasons name a subject: ``ServiceAccount "name/ns"`` or ``User "name"``."""
    sa = _service_account(user)
    return f'ServiceAccount "{sa[1]}/{sa[0]}"' if sa else f'User "{user}"'


def _subject_matches(subject: dict[str, Any], user: str, binding_namespace: str) -> bool:
    kind, name = subject.get("kind"), subject.get("name")
    if kind == "ServiceAccount":
        return user == f"system:serviceaccount:{subject.get('namespace') or binding_namespace}:{name}"
    if kind == "User":
        return user == name
    if kind == "Group":
        return name in user_groups(user)
    return False


def _describe_subject(subject: dict[str, Any], binding_namespace: str) -> str:
    if subject.get("kind") == "ServiceAccount":
        return f'ServiceAccount "{subject.get("name")}/{subject.get("namespace") or binding_namespace}"'
    return f'{subject.get("kind")} "{subject.get("name")}"'


def rbac_grants(
    documents: Iterable[dict[str, Any]] | Path | str, user: str, *, namespace: str = "default"
) -> list[Grant]:
    """What the Roles, ClusterRoles and bindings in ``documents`` (or a YAML file) give ``user``.

    Namespaced documents without a namespace land in ``namespace``, as ``kubectl apply -n`` would put them.
    ClusterRoleBindings come first, as the RBAC authorizer visits them; a binding whose role is missing gives nothing.
    Of the API server's bootstrap ClusterRoles only ``cluster-admin`` is known (``admin``, ``edit`` and ``view``,
    when bound, must be in ``documents``).
    """
    if isinstance(documents, (str, Path)):
        documents = list(yaml.safe_load_all(Path(documents).read_text()))
    docs: list[dict[str, Any]] = []
    for doc in documents:
        if isinstance(doc, dict) and doc.get("kind") == "List":
            docs += [item for item in doc.get("items") or [] if isinstance(item, dict)]
        elif isinstance(doc, dict):
            docs.append(doc)

    def ns_of(doc: dict[str, Any]) -> str:
        return (doc.get("metadata") or {}).get("namespace") or namespace

    roles = {(ns_of(d), d["metadata"]["name"]): d.get("rules") or [] for d in docs if d.get("kind") == "Role"}
    cluster_roles = {"cluster-admin": list(CLUSTER_ADMIN.rules)}
    cluster_roles |= {d["metadata"]["name"]: d.get("rules") or [] for d in docs if d.get("kind") == "ClusterRole"}
    grants: list[Grant] = []
    for kind in ("ClusterRoleBinding", "RoleBinding"):
        for binding in (d for d in docs if d.get("kind") == kind):
            name, ref = binding["metadata"]["name"], binding.get("roleRef") or {}
            bound_ns = ns_of(binding) if kind == "RoleBinding" else ""
            if ref.get("kind") == "Role" and kind == "RoleBinding":
                rules = roles.get((bound_ns, ref.get("name")))
            elif ref.get("kind") == "ClusterRole":
                rules = cluster_roles.get(ref.get("name"))
            else:
                rules = None
            subject = next((s for s in binding.get("subjects") or [] if _subject_matches(s, user, bound_ns)), None)
            if rules is None or subject is None:
                continue
            shown = f"{name}/{bound_ns}" if kind == "RoleBinding" else name
            source = f'{kind} "{shown}" of {ref["kind"]} "{ref["name"]}" to {_describe_subject(subject, bound_ns)}'
            grants.append(Grant(source, tuple(rules), bound_ns if kind == "RoleBinding" else None))
    return grants


def forbidden(attrs: Attributes, user: str, reason: str = "") -> ApiError:
    """The API server's 403 for a request its authorizer did not allow (responsewriters.ForbiddenStatusError)."""
    if not attrs.resource_request:
        message = f'forbidden: User "{user}" cannot {attrs.verb} path "{attrs.path}"'
        return ApiError(403, message + (f": {reason}" if reason else ""), details={})
    resource = f"{attrs.resource}/{attrs.subresource}" if attrs.subresource else attrs.resource
    scope = f'in the namespace "{attrs.namespace}"' if attrs.namespace else "at the cluster scope"
    why = f'User "{user}" cannot {attrs.verb} resource "{resource}" in API group "{attrs.group}" {scope}'
    if reason:
        why += f": {reason}"
    qualified = f"{attrs.resource}.{attrs.group}" if attrs.group else attrs.resource
    subject = f'{qualified} "{attrs.name}"' if attrs.name else qualified
    details: dict[str, Any] = {"name": attrs.name} if attrs.name else {}
    if attrs.group:
        details["group"] = attrs.group
    details["kind"] = attrs.resource
    return ApiError(403, f"{subject} is forbidden: {why}", details=details)


# --------------------------------------------------------------------------------------------------------------------
# Lifecycles: the training operator's and the kubelet's part


Action = Callable[["JobHandle"], None]


@dataclass
class Lifecycle:
    """Steps ``(delay_s, action)`` played in order for a created job; each delay is counted from the previous step.

    An action receives a :class:`JobHandle`. The playback stops when the job is deleted or the server stops.
    """

    steps: list[tuple[float, Action]] = field(default_factory=list)

    def then(self, delay_s: float, action: Action) -> Lifecycle:
        """A copy with one more step."""
        return Lifecycle([*self.steps, (delay_s, action)])

    @classmethod
    def success(cls, workers: int = 2, log_lines: Iterable[str] | None = None, tick_s: float = 0.05) -> Lifecycle:
        """Created, pods Pending, Running (lines appended to every pod, one per tick), Succeeded (exit codes 0)."""
        lines = list(DEFAULT_LOG_LINES if log_lines is None else log_lines)
        steps = _start_steps(workers, tick_s)
        steps += [(tick_s, lambda job, line=line: job.log_all(line)) for line in lines]
        steps.append((tick_s, lambda job: job.succeed_all()))
        return cls(steps)

    @classmethod
    def failure(
        cls,
        workers: int = 2,
        reason: str = "PyTorchJobFailed",
        message: str = "PyTorchJob {namespace}/{name} has failed because 1 Worker replica(s) failed.",
        failing_pod_lines: Iterable[str] | None = None,
        events: Iterable[tuple[str, str, str]] | None = None,
        log_lines: Iterable[str] | None = None,
        failing_index: int = 1,
        exit_code: int = 1,
        tick_s: float = 0.05,
    ) -> Lifecycle:
        """Runs, then worker ``failing_index`` exits with ``exit_code`` (phase Failed) and the job turns Failed.

        ``events`` are ``(type, reason, message)`` recorded on the failing pod (``{pod}`` is replaced by its name);
        by default a kubelet BackOff warning. The other workers keep running (cleanPodPolicy None).
        """
        lines = list(DEFAULT_LOG_LINES[:1] if log_lines is None else log_lines)
        failing = list(
            ["Traceback (most recent call last):", "RuntimeError: CUDA error: an illegal memory access was encountered"]
            if failing_pod_lines is None
            else failing_pod_lines
        )
        pod_events = list(
            [("Warning", "BackOff", "Back-off restarting failed container pytorch in pod {pod}")]
            if events is None
            else events
        )
        steps = _start_steps(workers, tick_s)
        steps += [(tick_s, lambda job, line=line: job.log_all(line)) for line in lines]
        steps += [(tick_s, lambda job, line=line: job.log(failing_index, line)) for line in failing]

        def fail(job: JobHandle) -> None:
            job.terminate(failing_index, exit_code)
            pod = job.pod_name(failing_index)
            for type_, event_reason, event_message in pod_events:
                job.event(event_reason, event_message.format(pod=pod), type_=type_, pod_index=failing_index)
            job.set_replica_status(active=workers - 1, failed=1)
            job.event(reason, message, type_="Normal")
            job.set_condition("Failed", reason, message)

        steps.append((tick_s, fail))
        return cls(steps)

    @classmethod
    def running(cls, workers: int = 2, tick_s: float = 0.05) -> Lifecycle:
        """Created, pods scheduled and running, the job Running: and so it stays until it is deleted."""
        return cls(_start_steps(workers, tick_s))

    @classmethod
    def crash_loop(
        cls,
        workers: int = 2,
        log_lines: Iterable[str] | None = None,
        failing_index: int = 1,
        exit_code: int = 1,
        reason: str = "Error",
        crashes: int = 2,
        tick_s: float = 0.05,
    ) -> Lifecycle:
        """Running; worker ``failing_index``'s container prints ``log_lines`` and exits ``exit_code``, ``crashes``
        times.

        The kubelet and the operator react as :meth:`JobHandle.container_failed` says: with restartPolicy OnFailure
        (the default) the first crash restarts the container at once and the second leaves it in CrashLoopBackOff
        (``lastState.terminated`` holds the exit code and ``reason``; both the current and the ``previous`` log give
        the last instance's lines); the job stays Running unless the restarts reach ``runPolicy.backoffLimit``.
        """
        lines = list(
            ["Traceback (most recent call last):", "ModuleNotFoundError: No module named 'trainer'"]
            if log_lines is None
            else log_lines
        )
        return cls(_crashes(workers, lines, failing_index, crashes, tick_s,
                            lambda job: job.container_failed(failing_index, exit_code, reason)))  # fmt: skip


def _crashes(workers: int, lines: list[str], index: int, crashes: int, tick_s: float,
             fail: Action) -> list[tuple[float, Action]]:  # fmt: skip
    """Start, then worker ``index`` prints ``lines`` and ``fail``s, ``crashes`` times (from the third, after its
    back-off ends)."""
    steps = _start_steps(workers, tick_s)
    for crash in range(crashes):
        if crash >= 2:
            steps.append((tick_s, lambda job: job.restart_after_back_off(index)))
        steps += [(tick_s, lambda job, line=line: job.log(index, line)) for line in lines]
        steps.append((tick_s, fail))
    return steps


def _replica_spec(job: dict[str, Any], replica_type: str) -> dict[str, Any]:
    return ((job.get("spec") or {}).get("pytorchReplicaSpecs") or {}).get(replica_type) or {}


def _created(job: JobHandle) -> None:
    job.set_condition("Created", "PyTorchJobCreated", "PyTorchJob {name} is created.")
    job.set_status(startTime=now_rfc3339())


def _start_steps(workers: int, tick_s: float, unschedulable: int = 0) -> list[tuple[float, Action]]:
    """Created, ``workers`` pods scheduled (and ``unschedulable`` more that find no room), those ``workers`` run."""
    message = f"0/{workers} nodes are available: {workers} Insufficient nvidia.com/gpu."

    def pods(job: JobHandle) -> None:
        job.create_pods(workers)
        for i in range(workers, workers + unschedulable):
            job.create_pod(i, scheduled=False, message=message)
            job.event("FailedScheduling", message, type_="Warning", pod_index=i, component="default-scheduler")
        job.set_replica_status(active=0)

    def running(job: JobHandle) -> None:
        for i in range(workers):
            job.run(i)
        job.set_replica_status(active=workers)
        job.set_condition("Running", "PyTorchJobRunning", "PyTorchJob {namespace}/{name} is running.")

    return [(0.0, _created), (tick_s, pods), (tick_s, running)]


class JobHandle:
    """What a lifecycle action can do to one job, its pods, their logs and the events about them.

    Every change bumps the resourceVersion and emits a watch event; a handle whose job is gone does nothing.
    Messages of conditions and events may use ``{name}`` and ``{namespace}``.
    """

    def __init__(self, server: FakeKubernetes, namespace: str, name: str, uid: str):
        self.server, self.namespace, self.name, self.uid = server, namespace, name, uid

    def job(self) -> dict[str, Any] | None:
        job = self.server.job(self.namespace, self.name)
        return job if job and job["metadata"]["uid"] == self.uid else None

    def pod_name(self, index: int, replica_type: str = "worker") -> str:
        return f"{self.name}-{replica_type}-{index}"

    def _fmt(self, text: str) -> str:
        return text.replace("{name}", self.name).replace("{namespace}", self.namespace)

    def _update_job(self, mutate: Callable[[dict[str, Any]], None]) -> None:
        self.server._update(self.server.kind, self.namespace, self.name, mutate, uid=self.uid)

    def set_condition(
        self, type_: str, reason: str | None = None, message: str | None = None, status: str = "True"
    ) -> None:
        """Set a job condition the way the training operator's ``UpdateJobConditions`` does."""
        now = now_rfc3339()
        condition = {
            "type": type_,
            "status": status,
            "reason": reason or f"PyTorchJob{type_}",
            "message": self._fmt(message or f"PyTorchJob {{namespace}}/{{name}} is {type_.lower()}."),
            "lastUpdateTime": now,
            "lastTransitionTime": now,
        }

        def mutate(job: dict[str, Any]) -> None:
            status_ = job.setdefault("status", {})
            conditions = status_.setdefault("conditions", [])
            if any(c["type"] == "Failed" and c["status"] == "True" for c in conditions):
                return  # the operator never changes a failed job's conditions
            current = next((c for c in conditions if c["type"] == type_), None)
            if current and current["status"] == condition["status"] and current.get("reason") == condition["reason"]:
                return
            if current and current["status"] == condition["status"]:
                condition["lastTransitionTime"] = current["lastTransitionTime"]
            kept = []
            for c in conditions:
                if (type_, c["type"]) in (("Restarting", "Running"), ("Running", "Restarting")) or c["type"] == type_:
                    continue
                if type_ in ("Failed", "Succeeded") and c["type"] == "Running":
                    c = {**c, "status": "False"}
                kept.append(c)
            status_["conditions"] = [*kept, condition]
            if type_ in ("Succeeded", "Failed") and status == "True":
                status_.setdefault("completionTime", now)
            status_["lastReconcileTime"] = now

        self._update_job(mutate)

    def set_status(self, **fields: Any) -> None:
        """Set top-level ``status`` fields (startTime, completionTime, ...)."""
        self._update_job(lambda job: job.setdefault("status", {}).update(fields))

    def set_replica_status(
        self, replica_type: str = "Worker", *, active: int = 0, succeeded: int = 0, failed: int = 0
    ) -> None:
        """``status.replicaStatuses[replica_type]`` as the operator writes it (zero counts left out)."""
        labels = {
            JOB_NAME_LABEL: self.name,
            OPERATOR_NAME_LABEL: OPERATOR_NAME,
            REPLICA_TYPE_LABEL: replica_type.lower(),
        }
        entry: dict[str, Any] = {
            "labelSelector": {"matchLabels": labels},
            "selector": ",".join(f"{k}={v}" for k, v in sorted(labels.items())),
        }
        entry |= {k: v for k, v in (("active", active), ("succeeded", succeeded), ("failed", failed)) if v}
        self._update_job(
            lambda job: job.setdefault("status", {}).setdefault("replicaStatuses", {}).update({replica_type: entry})
        )

    def create_pods(self, workers: int, *, scheduled: bool = True, message: str = INSUFFICIENT_GPU) -> None:
        """Create ``<job>-worker-<i>`` pods, Pending: scheduled with the container being created, or unschedulable."""
        job = self.job()
        if job is None:
            return
        for i in range(workers):
            self.server._create_pod(job, "Worker", i, scheduled=scheduled, unschedulable_message=message)
            self.event(
                "SuccessfulCreatePod", f"Created pod: {self.pod_name(i)}", type_="Normal", component=OPERATOR_NAME
            )
            if scheduled:
                self.event(
                    "Scheduled",
                    f"Successfully assigned {self.namespace}/{self.pod_name(i)} to node-{i}",
                    pod_index=i,
                    component="default-scheduler",
                )

    def create_pod(self, index: int, *, scheduled: bool = True, message: str = INSUFFICIENT_GPU) -> None:
        """Create worker ``index``'s pod alone (the operator creates the missing ones on each reconcile)."""
        job = self.job()
        if job is None:
            return
        self.server._create_pod(job, "Worker", index, scheduled=scheduled, unschedulable_message=message)
        self.event("SuccessfulCreatePod", f"Created pod: {self.pod_name(index)}", type_="Normal",
                   component=OPERATOR_NAME)  # fmt: skip

    def run(self, index: int) -> None:
        """The pod turns Running, its container running and ready."""
        now = now_rfc3339()

        def mutate(pod: dict[str, Any]) -> None:
            status = pod["status"]
            status["phase"] = "Running"
            cs = status["containerStatuses"][0]
            cs.update(ready=True, started=True, state={"running": {"startedAt": now}})
            cs["containerID"] = f"containerd://{uuid.uuid4().hex}{uuid.uuid4().hex}"
            cs["imageID"] = cs["imageID"] or f"{cs['image'].split(':')[0]}@sha256:{uuid.uuid4().hex}{uuid.uuid4().hex}"
            _set_pod_ready(status, True, now)

        self._update_pod(index, mutate)
        for reason, message in (
            ("Pulled", f'Container image "{self._image(index)}" already present on machine'),
            ("Created", f"Created container {CONTAINER}"),
            ("Started", f"Started container {CONTAINER}"),
        ):
            self.event(reason, message, pod_index=index, component="kubelet")

    def terminate(self, index: int, exit_code: int, reason: str | None = None, phase: str | None = None) -> None:
        """The container ends with ``exit_code``; the pod's phase becomes ``phase`` (Succeeded if 0, else Failed)."""
        now = now_rfc3339()
        reason = reason or ("Completed" if exit_code == 0 else "Error")
        phase = phase or ("Succeeded" if exit_code == 0 else "Failed")

        def mutate(pod: dict[str, Any]) -> None:
            status = pod["status"]
            status["phase"] = phase
            cs = status["containerStatuses"][0]
            started = (cs.get("state") or {}).get("running", {}).get("startedAt", now)
            terminated = {
                "exitCode": exit_code,
                "reason": reason,
                "startedAt": started,
                "finishedAt": now,
                "containerID": cs.get("containerID", ""),
            }
            cs.update(ready=False, started=False, state={"terminated": terminated})
            _set_pod_ready(status, False, now)

        self._update_pod(index, mutate)

    def restart_container(self, index: int) -> None:
        """The kubelet restarts the (terminated) container: restartCount + 1, the old state in lastState, running."""
        now = now_rfc3339()

        def mutate(pod: dict[str, Any]) -> None:
            status = pod["status"]
            status["phase"] = "Running"
            cs = status["containerStatuses"][0]
            if "terminated" in cs.get("state", {}):
                cs["lastState"] = cs["state"]
            elif "terminated" not in cs.get("lastState", {}):  # out of a back-off, the last instance stays there
                cs["lastState"] = {}
            cs["restartCount"] = cs.get("restartCount", 0) + 1
            cs.update(ready=True, started=True, state={"running": {"startedAt": now}})
            cs["containerID"] = f"containerd://{uuid.uuid4().hex}{uuid.uuid4().hex}"
            _set_pod_ready(status, True, now)

        self.server._rotate_log(self.namespace, self.pod_name(index))
        self._update_pod(index, mutate)

    def wait_container(self, index: int, reason: str, message: str = "") -> None:
        """The container waits (ContainerCreating, CrashLoopBackOff, ImagePullBackOff, ...)."""

        def mutate(pod: dict[str, Any]) -> None:
            cs = pod["status"]["containerStatuses"][0]
            cs.update(
                ready=False,
                started=False,
                state={"waiting": {"reason": reason} | ({"message": message} if message else {})},
            )
            _set_pod_ready(pod["status"], False, now_rfc3339())

        self._update_pod(index, mutate)

    def succeed_all(self) -> None:
        """Every pod exits 0 and the job turns Succeeded."""
        pods = self.server.pods(self.namespace, self.name)
        for pod in pods:
            self.terminate(int(pod["metadata"]["labels"][REPLICA_INDEX_LABEL]), 0)
        self.set_replica_status(succeeded=len(pods))
        message = "PyTorchJob {namespace}/{name} successfully completed."
        self.event("PyTorchJobSucceeded", message)
        self.set_condition("Succeeded", "PyTorchJobSucceeded", message)

    def log(self, index: int, *lines: str) -> None:
        """Append lines to the log of worker ``index``'s container (timestamped now)."""
        self.server.append_log(self.namespace, self.pod_name(index), *lines)

    def log_all(self, *lines: str) -> None:
        """Append lines to the log of every pod of the job."""
        for pod in self.server.pods(self.namespace, self.name):
            self.server.append_log(self.namespace, pod["metadata"]["name"], *lines)

    def event(
        self,
        reason: str,
        message: str,
        *,
        type_: str = "Normal",
        pod_index: int | None = None,
        component: str | None = None,
        at: datetime | float | str | None = None,
        count: int = 1,
    ) -> None:
        """Record an event about the job, or about worker ``pod_index`` (``at``: when; see FakeKubernetes.add_event)."""
        if pod_index is None:
            job = self.job()
            if job is None:
                return
            involved, component = job, component or OPERATOR_NAME
        else:
            pod = self.server._get(PODS, self.namespace, self.pod_name(pod_index))
            if pod is None:
                return
            involved, component = pod, component or "kubelet"
        self.server.add_event(
            involved, reason, self._fmt(message), type_=type_, component=component, at=at, count=count
        )

    # ------------------------------------------------------------ failures, as the kubelet and the operator see them

    def back_off(self, index: int) -> None:
        """The kubelet waits before restarting worker ``index``'s terminated container: CrashLoopBackOff.

        The terminated state moves to ``lastState``; restartCount is unchanged (it counts restarts done).
        """
        pod = self.server._get(PODS, self.namespace, self.pod_name(index))
        if pod is None or not pod["status"].get("containerStatuses"):
            return
        uid = pod["metadata"]["uid"]
        message = (
            f"back-off 10s restarting failed container={CONTAINER} pod={self.pod_name(index)}_{self.namespace}({uid})"
        )

        def mutate(pod: dict[str, Any]) -> None:
            cs = pod["status"]["containerStatuses"][0]
            if "terminated" in cs.get("state", {}):
                cs["lastState"] = cs["state"]
            cs.update(ready=False, started=False, state={"waiting": {"reason": "CrashLoopBackOff", "message": message}})
            _set_pod_ready(pod["status"], False, now_rfc3339())

        self._update_pod(index, mutate)
        self.event(
            "BackOff",
            f"Back-off restarting failed container {CONTAINER} in pod {self.pod_name(index)}_{self.namespace}({uid})",
            type_="Warning",
            pod_index=index,
        )

    def container_failed(self, index: int, exit_code: int, reason: str = "Error") -> None:
        """Worker ``index``'s container exits with ``exit_code``; the kubelet and the Training Operator react.

        As the pod's restartPolicy says: with OnFailure/Always the kubelet restarts the container in place (at once
        the first time, else after a CrashLoopBackOff; the pod stays Running) and the operator fails the job once the
        restarts of its Running pods reach ``runPolicy.backoffLimit`` (deleting all its pods, as it does then). With
        Never the pod fails: a replica policy ExitCode and a retryable code (>= 128) make the operator recreate the
        pod (Restarting, then Running again); otherwise the job fails (past the backoff limit, or a replica failed).
        """
        pod = self.server._get(PODS, self.namespace, self.pod_name(index))
        job = self.job()
        if pod is None or job is None or not pod["status"].get("containerStatuses"):
            return
        if pod["status"].get("phase") in ("Succeeded", "Failed") or _is_finished(job):
            return
        if pod["spec"].get("restartPolicy") in ("OnFailure", "Always"):
            cs = pod["status"]["containerStatuses"][0]
            first = cs.get("restartCount", 0) == 0 and "terminated" not in cs.get("lastState", {})
            self.terminate(index, exit_code, reason, phase="Running")
            if first:  # the kubelet's back-off starts with the first restart
                self.restart_container(index)
            else:
                self.back_off(index)
            self._sync_replicas()
            return
        self.terminate(index, exit_code, reason, phase="Failed")
        rspec = _replica_spec(job, "Worker")
        backoff_limit = ((job.get("spec") or {}).get("runPolicy") or {}).get("backoffLimit")
        if backoff_limit is not None and backoff_limit < 1:  # exceedsBackoffLimit: a new failure, no requeue yet
            self._fail_past_backoff_limit()
            return
        if rspec.get("restartPolicy") == "ExitCode" and exit_code >= 128:
            message = "PyTorchJob {namespace}/{name} is restarting because 1 Worker replica(s) failed."
            self.event("PyTorchJobRestarting", message, type_="Warning")
            self.set_condition("Restarting", "PyTorchJobRestarting", message)
            self.server._remove(PODS, self.namespace, self.pod_name(index))
            self.server._create_pod(job, "Worker", index, scheduled=True, unschedulable_message="")
            self.run(index)
            self._sync_replicas()
            self.set_condition("Running", "PyTorchJobRunning", "PyTorchJob {namespace}/{name} is running.")
            return
        self._sync_replicas()
        message = "PyTorchJob {namespace}/{name} has failed because 1 Worker replica(s) failed."
        self.event("PyTorchJobFailed", message)
        self.set_condition("Failed", "PyTorchJobFailed", message)
        self.clean_pods()

    def restart_after_back_off(self, index: int) -> None:
        """The back-off is over: the kubelet restarts the container; the operator checks its backoff limit."""
        pod = self.server._get(PODS, self.namespace, self.pod_name(index))
        statuses = (pod or {}).get("status", {}).get("containerStatuses") or [{}]
        if statuses[0].get("state", {}).get("waiting", {}).get("reason") != "CrashLoopBackOff":
            return
        self.restart_container(index)
        self._sync_replicas()

    def clean_pods(self) -> None:
        """The operator's clean-up of a finished job's pods, as ``runPolicy.cleanPodPolicy`` says (None by default)."""
        job = self.job()
        if job is None:
            return
        policy = ((job.get("spec") or {}).get("runPolicy") or {}).get("cleanPodPolicy") or "None"
        for pod in self.server.pods(self.namespace, self.name):
            if policy == "All" or (policy == "Running" and pod["status"].get("phase") in ("Running", "Pending")):
                self.server._remove(PODS, self.namespace, pod["metadata"]["name"])

    def _sync_replicas(self) -> None:
        """``replicaStatuses`` from the pods' phases, and the backoff-limit check, as the operator's reconcile does."""
        job = self.job()
        if job is None or _is_finished(job):
            return
        pods = self.server.pods(self.namespace, self.name)
        phases = [p["status"].get("phase") for p in pods]
        self.set_replica_status(
            active=phases.count("Running"), succeeded=phases.count("Succeeded"), failed=phases.count("Failed")
        )
        backoff_limit = ((job.get("spec") or {}).get("runPolicy") or {}).get("backoffLimit")
        if backoff_limit is None or _replica_spec(job, "Worker").get("restartPolicy", "OnFailure") not in (
            "OnFailure",
            "Always",
            "ExitCode",
        ):
            return
        restarts = sum(
            cs.get("restartCount", 0)
            for p in pods
            if p["status"].get("phase") == "Running"
            for cs in p["status"].get("containerStatuses", []) + p["status"].get("initContainerStatuses", [])
        )
        if (restarts > 0) if backoff_limit == 0 else (restarts >= backoff_limit):
            self._fail_past_backoff_limit()

    def _fail_past_backoff_limit(self) -> None:
        """PastBackoffLimit: the operator deletes all the job's pods (whatever cleanPodPolicy) and fails the job."""
        message = "Job {name} has failed because it has reached the specified backoff limit"
        for pod in self.server.pods(self.namespace, self.name):
            self.server._remove(PODS, self.namespace, pod["metadata"]["name"])
        self.event("PyTorchJobFailed", message)
        self.set_condition("Failed", "PyTorchJobFailed", message)

    def _image(self, index: int) -> str:
        pod = self.server._get(PODS, self.namespace, self.pod_name(index))
        return pod["status"]["containerStatuses"][0]["image"] if pod and pod["status"].get("containerStatuses") else ""

    def _update_pod(self, index: int, mutate: Callable[[dict[str, Any]], None]) -> None:
        if self.job() is not None:
            self.server._update(PODS, self.namespace, self.pod_name(index), mutate)


def _taint(taint: dict[str, str] | str) -> dict[str, str]:
    """A taint from a dict or a ``key=value:Effect`` / ``key:Effect`` string."""
    if isinstance(taint, dict):
        return dict(taint)
    key_value, _, effect = taint.rpartition(":")
    if not key_value or effect not in ("NoSchedule", "PreferNoSchedule", "NoExecute"):
        raise ValueError(f"a taint is key=value:Effect (NoSchedule, PreferNoSchedule, NoExecute), not {taint!r}")
    key, _, value = key_value.partition("=")
    return {"key": key, "effect": effect} | ({"value": value} if value else {})


def _qos_class(containers: list[dict[str, Any]]) -> str:
    """The pod's QoS class: Guaranteed (cpu and memory limits equal requests everywhere), BestEffort (no resources)."""
    resources = [c.get("resources") or {} for c in containers]
    if not any(r.get("requests") or r.get("limits") for r in resources):
        return "BestEffort"
    for r in resources:
        limits, requests = r.get("limits") or {}, {**(r.get("limits") or {}), **(r.get("requests") or {})}
        if any(limits.get(name) is None or limits[name] != requests.get(name) for name in ("cpu", "memory")):
            return "Burstable"
    return "Guaranteed"


def _is_finished(job: dict[str, Any]) -> bool:
    return any(
        c.get("type") in ("Succeeded", "Failed") and c.get("status") == "True"
        for c in (job.get("status") or {}).get("conditions", [])
    )


def _set_pod_ready(status: dict[str, Any], ready: bool, now: str) -> None:
    for condition in status.get("conditions", []):
        if condition["type"] in ("Ready", "ContainersReady"):
            condition["status"] = "True" if ready else "False"
            condition["lastTransitionTime"] = now
            if ready:
                condition.pop("reason", None)
                condition.pop("message", None)
            else:
                condition["reason"] = (
                    "PodCompleted" if status["phase"] in ("Succeeded", "Failed") else "ContainersNotReady"
                )
                if condition["reason"] == "ContainersNotReady":
                    condition["message"] = f"containers with unready status: [{CONTAINER}]"


# --------------------------------------------------------------------------------------------------------------------
# The server


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False
    fake: FakeKubernetes


class FakeKubernetes:
    """The fake API server; a context manager that starts it on ``127.0.0.1`` (a free port) and stops it.

    ``lifecycle`` plays for every created job, unless ``lifecycles`` has one for the job's name. Attributes to read
    after (or set before) the requests: ``requests`` ((method, path with query)), ``deletions`` ((namespace, name,
    propagationPolicy or None)), ``validation_errors`` (str of each schema/metadata error answered with 422),
    ``pruned_fields`` (paths pruned from created jobs),
    ``forbid_events``, ``faults``, ``delete_delay_s`` (how long the garbage collector takes to start on a deletion),
    ``pod_termination_s`` (how long a deleted pod stays Terminating, holding a foreground-deleted job),
    ``history_limit`` (watch history kept, in changes; None: all until :meth:`compact`), ``bookmark_interval_s``
    (BOOKMARK events to watches that allow them),
    ``user`` (who makes the requests: RBAC decisions and 403 messages), ``access_reviews`` ((resourceAttributes or
    nonResourceAttributes, Decision) of every SelfSubjectAccessReview answered).

    A new server holds the namespaces ``default``, ``kube-system``, ``kube-public``, ``kube-node-lease`` and
    ``kubeflow``, the PyTorchJob CRD read from ``crd_path`` and, unless ``training_operator`` is None, the Training
    Operator's Deployment (``kubeflow/training-operator``, image ``kubeflow/training-operator:<training_operator>``).
    No nodes, device plugins or PVCs: a test adds what its cluster has (:meth:`add_node`, :meth:`add_device_plugins`,
    :meth:`add_pvc`, ...).
    """

    # The image tag of a standard Training Operator v1.8.1 install: release images are tagged v1-<commit>, not with the
    # version (project-codeflare/appwrapper hack/e2e-util.sh pins this one beside KUBEFLOW_VERSION=v1.8.1).
    def __init__(self, crd_path: Path, lifecycle: Lifecycle | None = None, *,
                 training_operator: str | None = "v1-5170a36"):  # fmt: skip
        crd = load_crd(crd_path)
        version = crd_version(crd, "v1")
        names = crd["spec"]["names"]
        self.schema: dict[str, Any] = version["schema"]["openAPIV3Schema"]
        self.kind = Kind(
            names["plural"],
            crd["spec"]["group"],
            "v1",
            names["kind"],
            NAMESPACED_FIELDS,
            False,
            verbs=frozenset({"create", "get", "list", "watch", "delete"}),
        )
        self.list_kind: str = names.get("listKind", names["kind"] + "List")
        self.status_subresource = "status" in (version.get("subresources") or {})
        self._validator = jsonschema.Draft4Validator(_jsonschema_view(self.schema))

        self.lifecycle = lifecycle
        self.lifecycles: dict[str, Lifecycle] = {}
        self.requests: list[tuple[str, str]] = []
        self.deletions: list[tuple[str, str, str | None]] = []
        self.validation_errors: list[str] = []
        self.pruned_fields: list[str] = []
        self.warnings: list[str] = []
        self.forbid_events = False
        self.faults = Faults()
        self.delete_delay_s = 0.0
        self.pod_termination_s = 0.2
        self.history_limit: int | None = None
        self.bookmark_interval_s: float | None = None
        self.user = DEFAULT_USER
        self.access_reviews: list[tuple[dict[str, Any], Decision]] = []
        self._grants: list[Grant] = [CLUSTER_ADMIN]
        self._denials: list[Denial] = []

        self._cond = threading.Condition(threading.RLock())
        self._rv = 1
        self._floor = 0  # changes with rv <= floor are forgotten
        self._objects: dict[tuple[str, str, str], dict[str, Any]] = {}
        self._history: list[Change] = []
        self._logs: dict[tuple[str, str], ContainerLog] = {}
        self._job_stops: dict[str, threading.Event] = {}  # by job uid
        self._stopping = threading.Event()
        self._connections: set[socket.socket] = set()
        self._httpd: _Server | None = None
        self._thread: threading.Thread | None = None
        self._node_count = 0
        self.url = ""

        for namespace in ("default", "kube-system", "kube-public", "kube-node-lease", "kubeflow"):
            self.add_namespace(namespace)
        self.add_crd(crd)
        if training_operator is not None:
            self.add_deployment(
                TRAINING_OPERATOR_NAMESPACE,
                TRAINING_OPERATOR,
                image=f"kubeflow/training-operator:{training_operator}",
                labels=TRAINING_OPERATOR_LABELS,
            )

    # ---------------------------------------------------------------- lifecycle of the server

    def __enter__(self) -> FakeKubernetes:
        self._httpd = _Server(("127.0.0.1", 0), _Handler)
        self._httpd.fake = self
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()
        log.info("fake Kubernetes API server on %s", self.url)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stopping.set()
        with self._cond:
            for stop in self._job_stops.values():
                stop.set()
            self._cond.notify_all()
        if self._httpd is not None:
            self._httpd.shutdown()
            with self._cond:
                connections = list(self._connections)
            for conn in connections:
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            self._httpd.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def write_kubeconfig(self, path: Path) -> Path:
        """A kubeconfig pointing at this server (for a launcher or CLI in another process)."""
        path.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "fake",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "fake", "user": {}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}],
        }))  # fmt: skip
        return path

    def client_configuration(self) -> kubernetes.client.Configuration:
        """A ``kubernetes.client.Configuration`` pointing at this server."""
        import kubernetes

        cfg = kubernetes.client.Configuration()
        cfg.host = self.url
        return cfg

    # ---------------------------------------------------------------- state, for tests

    @property
    def resource_version(self) -> int:
        with self._cond:
            return self._rv

    def job(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self._get(self.kind, namespace, name)

    def pods(self, namespace: str, job_name: str | None = None) -> list[dict[str, Any]]:
        """The pods of a namespace (of one job if ``job_name``), by name."""
        with self._cond:
            return [
                copy.deepcopy(obj)
                for (resource, ns, _), obj in sorted(self._objects.items())
                if resource == "pods"
                and ns == namespace
                and (job_name is None or (obj["metadata"].get("labels") or {}).get(JOB_NAME_LABEL) == job_name)
            ]

    def events(self, namespace: str) -> list[dict[str, Any]]:
        with self._cond:
            return [
                copy.deepcopy(obj)
                for (resource, ns, _), obj in sorted(self._objects.items())
                if resource == "events" and ns == namespace
            ]

    def handle(self, namespace: str, name: str) -> JobHandle:
        """A handle to drive an existing job by hand (as a lifecycle action would)."""
        job = self.job(namespace, name)
        if job is None:
            raise KeyError(f"no job {namespace}/{name}")
        return JobHandle(self, namespace, name, job["metadata"]["uid"])

    def put_job(self, obj: dict[str, Any], lifecycle: Lifecycle | None = None) -> dict[str, Any]:
        """Store a job as is (no validation, status kept), e.g. one existing before the test; plays ``lifecycle``."""
        obj = copy.deepcopy(obj)
        meta = obj.setdefault("metadata", {})
        meta.setdefault("namespace", "default")
        obj.setdefault("apiVersion", self.kind.api_version)
        obj.setdefault("kind", self.kind.kind)
        meta.setdefault("uid", str(uuid.uuid4()))
        meta.setdefault("creationTimestamp", now_rfc3339())
        meta.setdefault("generation", 1)
        with self._cond:
            exists = (self.kind.resource, meta["namespace"], meta.get("name")) in self._objects
            stored = self._put(self.kind, obj, "MODIFIED" if exists else "ADDED")
            self._job_stops[meta["uid"]] = threading.Event()
        if lifecycle is not None:
            self._play(lifecycle, stored)
        return stored

    def append_log(self, namespace: str, pod: str, *lines: str) -> None:
        """Append lines (timestamped now) to the running container's log of a pod."""
        with self._cond:
            if ("pods", namespace, pod) not in self._objects:
                return
            entry = self._logs.setdefault((namespace, pod), ContainerLog())
            for line in lines:
                entry.current.append((time.time_ns(), line))
            self._cond.notify_all()

    def add_event(
        self,
        involved: dict[str, Any],
        reason: str,
        message: str,
        *,
        type_: str = "Normal",
        component: str = "kubelet",
        at: datetime | float | str | None = None,
        count: int = 1,
    ) -> None:
        """Record a core/v1 Event about an object (aggregated: the same reason and message bump ``count``).

        ``at`` sets when it happened (``lastTimestamp``; also ``firstTimestamp`` of a new event): a datetime, seconds
        since the epoch or an RFC 3339 string; None is now. ``count`` is how many times it happened by then.
        Events about a cluster-scoped object (a Node: :meth:`node`) go to the ``default`` namespace, as the
        kubelet's do; events about pods come from the kubelet with the container's ``fieldPath``, other components'
        (the scheduler's) without.
        """
        meta = involved["metadata"]
        when = rfc3339(at)
        namespace = meta.get("namespace") or "default"
        uid = meta.get("uid") or meta["name"]
        if involved.get("kind") == "Node":
            uid = meta["name"]  # the kubelet's and node-problem-detector's node reference
        with self._cond:
            for (resource, ns, name), event in self._objects.items():
                if (
                    resource == "events"
                    and ns == namespace
                    and event["involvedObject"]["uid"] == uid
                    and event["reason"] == reason
                    and event["message"] == message
                ):

                    def bump(e: dict[str, Any]) -> None:
                        e["count"] += count
                        e["lastTimestamp"] = when

                    self._update(EVENTS, ns, name, bump)
                    return
            reference = {
                "apiVersion": involved.get("apiVersion", "v1"),
                "kind": involved.get("kind", ""),
                "name": meta["name"],
            }
            if meta.get("namespace"):
                reference["namespace"] = meta["namespace"]
            reference |= {"uid": uid, "resourceVersion": meta.get("resourceVersion", "")}
            if involved.get("kind") == "Pod" and component == "kubelet":
                containers = [c["name"] for c in (involved.get("spec") or {}).get("containers", [])]
                container = CONTAINER if CONTAINER in containers or not containers else containers[0]
                reference["fieldPath"] = f"spec.containers{{{container}}}"
            event = {
                "apiVersion": "v1",
                "kind": "Event",
                "metadata": {
                    "name": f"{meta['name']}.{uuid.uuid4().hex[:16]}",
                    "namespace": namespace,
                    "uid": str(uuid.uuid4()),
                    "creationTimestamp": when,
                },
                "involvedObject": reference,
                "reason": reason,
                "message": message,
                "source": {"component": component},
                "firstTimestamp": when,
                "lastTimestamp": when,
                "count": count,
                "type": type_,
                "eventTime": None,
                "reportingComponent": component,
                "reportingInstance": "",
            }
            self._put(EVENTS, event, "ADDED")

    def compact(self) -> None:
        """Forget the watch history: a watch from any earlier resourceVersion now gets 410 Expired."""
        with self._cond:
            self._history.clear()
            self._floor = self._rv

    # ---------------------------------------------------------------- the cluster a preflight check reads, for tests

    def _add(self, kind: Kind, obj: dict[str, Any], namespace: str = "") -> dict[str, Any]:
        """Store a built-in object as the API server would hold it (uid, creationTimestamp, ...; replaces one)."""
        obj = copy.deepcopy(obj)
        obj.setdefault("apiVersion", kind.api_version)
        obj.setdefault("kind", kind.kind)
        meta = obj.setdefault("metadata", {})
        if kind.namespaced:
            meta["namespace"] = namespace or meta.get("namespace") or "default"
        meta.setdefault("uid", str(uuid.uuid4()))
        meta.setdefault("creationTimestamp", now_rfc3339())
        if kind.group in ("apps", "apiextensions.k8s.io"):  # their objects carry a generation (StorageClasses none)
            meta.setdefault("generation", 1)
        with self._cond:
            exists = (kind.resource, meta.get("namespace", ""), meta["name"]) in self._objects
            return self._put(kind, obj, "MODIFIED" if exists else "ADDED")

    def add_namespace(self, name: str, *, labels: dict[str, str] | None = None) -> dict[str, Any]:
        """An Active namespace (labelled ``kubernetes.io/metadata.name`` as the API server does)."""
        meta = {"name": name, "labels": {"kubernetes.io/metadata.name": name} | (labels or {})}
        body = {"metadata": meta, "spec": {"finalizers": ["kubernetes"]}, "status": {"phase": "Active"}}
        return self._add(NAMESPACES, body)

    def add_node(
        self,
        name: str,
        *,
        instance_type: str = "ml.p5.48xlarge",
        labels: dict[str, str | None] | None = None,
        allocatable: dict[str, str] | None = None,
        capacity: dict[str, str] | None = None,
        taints: Iterable[dict[str, str] | str] | None = None,
        unschedulable: bool = False,
        ready: bool | str = True,
        health_status: str | None = "Schedulable",
        deep_health_check: str | None = None,
        annotations: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        """A node as the kubelet (and, on HyperPod, the health agent) reports it; returns the stored object.

        Labels: ``kubernetes.io/hostname``, ``node.kubernetes.io/instance-type`` (``instance_type``), os/arch,
        ``sagemaker.amazonaws.com/node-health-status`` (``health_status``; None: no label),
        ``sagemaker.amazonaws.com/deep-health-check-status`` (``deep_health_check``, e.g. ``"Passed"``), the HyperPod
        compute-type label for ``ml.*`` types; ``labels`` override them (a None value removes one). ``allocatable``
        defaults to the instance type's (:data:`INSTANCE_RESOURCES`, 110 pods), ``capacity`` to ``allocatable``.
        ``taints`` are dicts (key, value, effect) or ``"key=value:Effect"`` strings; the node controller's own taints
        follow ``unschedulable`` and ``ready`` (False, or ``"Unknown"`` for a node that stopped reporting).
        """
        with self._cond:
            self._node_count += 1
            number = self._node_count
        node_labels: dict[str, str] = {
            "beta.kubernetes.io/arch": "amd64",
            "beta.kubernetes.io/instance-type": instance_type,
            "beta.kubernetes.io/os": "linux",
            "kubernetes.io/arch": "amd64",
            HOSTNAME_LABEL: name,
            "kubernetes.io/os": "linux",
            INSTANCE_TYPE_LABEL: instance_type,
            "topology.kubernetes.io/region": "us-west-2",
            "topology.kubernetes.io/zone": "us-west-2a",
        }
        if instance_type.startswith("ml."):
            node_labels["sagemaker.amazonaws.com/compute-type"] = "hyperpod"
        if health_status is not None:
            node_labels[NODE_HEALTH_LABEL] = health_status
        if deep_health_check is not None:
            node_labels[DEEP_HEALTH_LABEL] = deep_health_check
        for key, value in (labels or {}).items():
            if value is None:
                node_labels.pop(key, None)
            else:
                node_labels[key] = value
        alloc = (
            dict(allocatable)
            if allocatable is not None
            else dict(INSTANCE_RESOURCES.get(instance_type, CPU_NODE_RESOURCES)) | {"pods": "110"}
        )
        now = now_rfc3339()
        node_taints = [_taint(t) for t in taints or ()]
        if unschedulable:
            node_taints.append({"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule", "timeAdded": now})
        if ready is not True:
            key = "node.kubernetes.io/not-ready" if ready is False else "node.kubernetes.io/unreachable"
            node_taints += [
                {"key": key, "effect": "NoSchedule", "timeAdded": now},
                {"key": key, "effect": "NoExecute", "timeAdded": now},
            ]
        if ready is True:
            ready_condition = ("True", "KubeletReady", "kubelet is posting ready status")
        elif ready is False:
            ready_condition = (
                "False",
                "KubeletNotReady",
                "container runtime network not ready: NetworkReady=false reason:NetworkPluginNotReady message:"
                "Network plugin returns error: cni plugin not initialized",
            )
        else:
            ready_condition = ("Unknown", "NodeStatusUnknown", "Kubelet stopped posting node status.")
        pressure = [
            ("MemoryPressure", "KubeletHasSufficientMemory", "kubelet has sufficient memory available"),
            ("DiskPressure", "KubeletHasNoDiskPressure", "kubelet has no disk pressure"),
            ("PIDPressure", "KubeletHasSufficientPID", "kubelet has sufficient PID available"),
        ]
        conditions = [
            {
                "type": type_,
                "status": "False" if ready_condition[0] != "Unknown" else "Unknown",
                "lastHeartbeatTime": now,
                "lastTransitionTime": now,
                "reason": reason if ready_condition[0] != "Unknown" else "NodeStatusUnknown",
                "message": message if ready_condition[0] != "Unknown" else "Kubelet stopped posting node status.",
            }
            for type_, reason, message in pressure
        ]
        conditions.append(
            {
                "type": "Ready",
                "status": ready_condition[0],
                "lastHeartbeatTime": now,
                "lastTransitionTime": now,
                "reason": ready_condition[1],
                "message": ready_condition[2],
            }
        )
        ip = f"10.2.{number // 250}.{number % 250 + 4}"
        instance_id = f"i-{uuid.uuid5(uuid.NAMESPACE_DNS, name).hex[:17]}"
        spec: dict[str, Any] = {"providerID": f"aws:///us-west-2a/{instance_id}"}
        if node_taints:
            spec["taints"] = node_taints
        if unschedulable:
            spec["unschedulable"] = True
        node = {
            "metadata": {"name": name, "labels": node_labels, "annotations": dict(annotations or {})},
            "spec": spec,
            "status": {
                "capacity": dict(capacity) if capacity is not None else dict(alloc),
                "allocatable": alloc,
                "conditions": conditions,
                "addresses": [
                    {"type": "InternalIP", "address": ip},
                    {"type": "InternalDNS", "address": f"ip-{ip.replace('.', '-')}.us-west-2.compute.internal"},
                    {"type": "Hostname", "address": f"ip-{ip.replace('.', '-')}.us-west-2.compute.internal"},
                ],
                "daemonEndpoints": {"kubeletEndpoint": {"Port": 10250}},
                "nodeInfo": {
                    "architecture": "amd64",
                    "bootID": str(uuid.uuid5(uuid.NAMESPACE_URL, f"boot/{name}")),
                    "containerRuntimeVersion": "containerd://1.7.22",
                    "kernelVersion": "5.10.227-219.884.amzn2.x86_64",
                    "kubeProxyVersion": "v1.30.4-eks-a737599",
                    "kubeletVersion": "v1.30.4-eks-a737599",
                    "machineID": uuid.uuid5(uuid.NAMESPACE_URL, f"machine/{name}").hex,
                    "operatingSystem": "linux",
                    "osImage": "Amazon Linux 2",
                    "systemUUID": str(uuid.uuid5(uuid.NAMESPACE_URL, f"system/{name}")),
                },
            },
        }
        return self._add(NODES, node)

    def node(self, name: str) -> dict[str, Any] | None:
        return self._get(NODES, "", name)

    def update_node(self, name: str, mutate: Callable[[dict[str, Any]], None]) -> dict[str, Any] | None:
        """Change a node in place (a watch sees MODIFIED); None if there is no such node."""
        return self._update(NODES, "", name, mutate)

    def remove_node(self, name: str) -> None:
        self._remove(NODES, "", name)

    def add_pod(
        self,
        namespace: str,
        name: str,
        *,
        node_name: str | None = None,
        phase: str = "Running",
        requests: dict[str, str] | None = None,
        limits: dict[str, str] | None = None,
        image: str = "public.ecr.aws/docker/library/busybox:1.36",
        labels: dict[str, str] | None = None,
        containers: list[dict[str, Any]] | None = None,
        init_containers: list[dict[str, Any]] | None = None,
        message: str = INSUFFICIENT_GPU,
    ) -> dict[str, Any]:
        """A pod that is not a job's (another team's training, a daemon), with a status consistent with ``phase``.

        One container ``main`` with ``requests``/``limits`` unless ``containers`` (container dicts) are given.
        ``phase`` Running (bound to ``node_name``, containers running and ready), Pending (ContainerCreating on
        ``node_name``, or unschedulable with ``message`` when there is none), Succeeded (exit 0) or Failed (exit 1).
        """
        if phase not in ("Pending", "Running", "Succeeded", "Failed"):
            raise ValueError(f"phase must be Pending, Running, Succeeded or Failed, not {phase!r}")
        if phase != "Pending" and not node_name:
            raise ValueError(f"a {phase} pod runs on a node: give node_name")
        if containers is None:
            resources: dict[str, Any] = {}
            if requests:
                resources["requests"] = dict(requests)
            if limits:
                resources["limits"] = dict(limits)
            containers = [{"name": "main", "image": image, "resources": resources}]
        spec: dict[str, Any] = {
            "containers": copy.deepcopy(containers),
            "restartPolicy": "Always" if phase in ("Pending", "Running") else "Never",
            "schedulerName": "default-scheduler",
            "serviceAccountName": "default",
            "terminationGracePeriodSeconds": 30,
            "priority": 0,
        }
        if init_containers:
            spec["initContainers"] = copy.deepcopy(init_containers)
        if node_name:
            spec["nodeName"] = node_name
        now = now_rfc3339()
        status: dict[str, Any] = {"phase": phase, "qosClass": _qos_class(containers + (init_containers or []))}
        if not node_name:
            status["conditions"] = [
                {
                    "type": "PodScheduled",
                    "status": "False",
                    "lastProbeTime": None,
                    "lastTransitionTime": now,
                    "reason": "Unschedulable",
                    "message": message,
                }
            ]
        else:
            running = phase == "Running"
            node = self.node(node_name)
            host_ip = next(
                (
                    a["address"]
                    for a in (node or {}).get("status", {}).get("addresses", [])
                    if a["type"] == "InternalIP"
                ),
                "10.2.0.4",
            )
            digest = uuid.uuid5(uuid.NAMESPACE_URL, f"{namespace}/{name}").bytes
            status |= {"hostIP": host_ip, "podIP": f"10.3.{digest[0]}.{digest[1] % 250 + 2}", "startTime": now}
            status["conditions"] = [
                {"type": t, "status": v, "lastProbeTime": None, "lastTransitionTime": now}
                for t, v in (
                    ("Initialized", "True"),
                    ("Ready", "True" if running else "False"),
                    ("ContainersReady", "True" if running else "False"),
                    ("PodScheduled", "True"),
                )
            ]
            states = {
                "Pending": {"waiting": {"reason": "ContainerCreating"}},
                "Running": {"running": {"startedAt": now}},
                "Succeeded": {
                    "terminated": {"exitCode": 0, "reason": "Completed", "startedAt": now, "finishedAt": now}
                },
                "Failed": {"terminated": {"exitCode": 1, "reason": "Error", "startedAt": now, "finishedAt": now}},
            }
            status["containerStatuses"] = []
            for c in containers:
                state = copy.deepcopy(states[phase])
                cid = f"containerd://{uuid.uuid4().hex}{uuid.uuid4().hex}" if phase != "Pending" else ""
                if "terminated" in state:
                    state["terminated"]["containerID"] = cid
                entry = {
                    "name": c["name"],
                    "state": state,
                    "lastState": {},
                    "ready": running,
                    "restartCount": 0,
                    "image": c.get("image", image),
                    "imageID": ""
                    if phase == "Pending"
                    else f"{c.get('image', image).split(':')[0]}@sha256:{uuid.uuid4().hex}{uuid.uuid4().hex}",
                    "started": running,
                }
                if cid:
                    entry["containerID"] = cid
                status["containerStatuses"].append(entry)
            _set_pod_ready(status, running, now)
        pod = {
            "metadata": {"name": name, "labels": dict(labels or {}), "annotations": {}},
            "spec": spec,
            "status": status,
        }
        stored = self._add(PODS, pod, namespace)
        with self._cond:
            self._logs.setdefault((namespace, name), ContainerLog())
        return stored

    def pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self._get(PODS, namespace, name)

    def update_pod(self, namespace: str, name: str, mutate: Callable[[dict[str, Any]], None]) -> dict[str, Any] | None:
        """Change a pod in place (status scripting: conditions, container states); None if there is no such pod."""
        return self._update(PODS, namespace, name, mutate)

    def delete_pod(self, namespace: str, name: str) -> None:
        self._remove(PODS, namespace, name)

    def add_pvc(
        self,
        namespace: str,
        name: str,
        *,
        phase: str = "Bound",
        access_modes: Iterable[str] = ("ReadWriteMany",),
        storage_class: str | None = "fsx-sc",
        capacity: str = "1200Gi",
        volume_name: str | None = None,
        request: str | None = None,
        pv: bool = True,
    ) -> dict[str, Any]:
        """A PersistentVolumeClaim (an FSx for Lustre one by default); ``request`` defaults to ``capacity``.

        Bound: ``spec.volumeName`` (``volume_name``, else ``pvc-<uid>`` as dynamic provisioning names it), status
        access modes and capacity, and (unless ``pv`` is False) that PersistentVolume, bound to it (:meth:`add_pv`).
        Pending or Lost: no volume, status phase only (Lost keeps the volume name).
        """
        uid = str(uuid.uuid4())
        modes = list(access_modes)
        spec: dict[str, Any] = {
            "accessModes": modes,
            "resources": {"requests": {"storage": request or capacity}},
            "volumeMode": "Filesystem",
        }
        if storage_class is not None:
            spec["storageClassName"] = storage_class
        annotations: dict[str, str] = {}
        status: dict[str, Any] = {"phase": phase}
        if phase in ("Bound", "Lost"):
            spec["volumeName"] = volume_name or f"pvc-{uid}"
        if phase == "Bound":
            annotations = {"pv.kubernetes.io/bind-completed": "yes", "pv.kubernetes.io/bound-by-controller": "yes"}
            if volume_name is None:
                annotations |= {
                    "volume.beta.kubernetes.io/storage-provisioner": "fsx.csi.aws.com",
                    "volume.kubernetes.io/storage-provisioner": "fsx.csi.aws.com",
                }
            status |= {"accessModes": modes, "capacity": {"storage": capacity}}
        pvc = {
            "metadata": {
                "name": name,
                "uid": uid,
                "annotations": annotations,
                "finalizers": ["kubernetes.io/pvc-protection"],
            },
            "spec": spec,
            "status": status,
        }
        added = self._add(PVCS, pvc, namespace)
        if phase == "Bound" and pv:
            self.add_pv(spec["volumeName"], capacity=capacity, storage_class=storage_class or None,
                        access_modes=modes, claim=added, dynamic=volume_name is None)  # fmt: skip
        return added

    def add_pv(
        self,
        name: str,
        *,
        capacity: str = "1200Gi",
        storage_class: str | None = "fsx-sc",
        driver: str = "fsx.csi.aws.com",
        volume_handle: str = "fs-0123456789abcdef0",
        access_modes: Iterable[str] = ("ReadWriteMany",),
        claim: dict[str, Any] | None = None,
        dynamic: bool = True,
    ) -> dict[str, Any]:
        """A CSI PersistentVolume, an FSx for Lustre file system by default, Bound to ``claim`` (a PVC as stored) or
        Available. Its ``volumeAttributes`` are the FSx CSI driver's volume context (``dnsname``, ``mountname``:
        kubernetes-sigs/aws-fsx-csi-driver pkg/driver/controller.go): nothing of the file system's throughput."""
        region = "us-east-1"
        attributes = {"dnsname": f"{volume_handle}.fsx.{region}.amazonaws.com", "mountname": "abcdefgh"}
        meta: dict[str, Any] = {"name": name, "finalizers": ["kubernetes.io/pv-protection"]}
        if dynamic:
            meta["annotations"] = {"pv.kubernetes.io/provisioned-by": driver}
            meta["finalizers"].append("external-provisioner.volume.kubernetes.io/finalizer")
        spec: dict[str, Any] = {
            "accessModes": list(access_modes),
            "capacity": {"storage": capacity},
            "csi": {"driver": driver, "volumeHandle": volume_handle, "volumeAttributes": attributes},
            "persistentVolumeReclaimPolicy": "Delete" if dynamic else "Retain",
            "volumeMode": "Filesystem",
        }
        if storage_class is not None:
            spec["storageClassName"] = storage_class
        if claim is not None:
            claim_meta = claim["metadata"]
            spec["claimRef"] = {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "name": claim_meta["name"],
                                "namespace": claim_meta["namespace"], "uid": claim_meta["uid"],
                                "resourceVersion": claim_meta["resourceVersion"]}  # fmt: skip
        return self._add(PVS, {"metadata": meta, "spec": spec, "status": {"phase": "Bound" if claim else "Available"}})

    def add_storage_class(
        self, name: str, parameters: dict[str, str] | None = None, *, provisioner: str = "fsx.csi.aws.com"
    ) -> dict[str, Any]:
        """A StorageClass; ``parameters`` as the provisioner reads them (the FSx CSI driver's: ``deploymentType``,
        ``perUnitStorageThroughput``, ``storageType``, ...: kubernetes-sigs/aws-fsx-csi-driver
        pkg/driver/filesystem_provisioner.go, Provision)."""
        body = {"metadata": {"name": name}, "provisioner": provisioner, "parameters": dict(parameters or {}),
                "reclaimPolicy": "Delete", "volumeBindingMode": "Immediate"}  # fmt: skip
        return self._add(STORAGE_CLASSES, body)

    def add_daemonset(
        self,
        namespace: str,
        name: str,
        *,
        image: str,
        labels: dict[str, str] | None = None,
        node_selector: dict[str, str] | None = None,
        tolerations: list[dict[str, Any]] | None = None,
        desired: int = 0,
        ready: int | None = None,
        available: int | None = None,
        updated: int | None = None,
        misscheduled: int = 0,
        container_name: str | None = None,
        resources: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """A DaemonSet with the status its controller would write.

        ``labels`` (default ``{"name": name}``) label it, select its pods and label their template. ``ready``
        defaults to ``desired``, ``available`` to ``ready``, ``updated`` to ``desired``; ``numberUnavailable`` is
        ``desired - available`` (left out when 0, as the API server omits zero counts).
        """
        labels = dict(labels or {"name": name})
        ready = desired if ready is None else ready
        available = ready if available is None else available
        updated = desired if updated is None else updated
        container: dict[str, Any] = {"name": container_name or name, "image": image, "imagePullPolicy": "IfNotPresent"}
        if resources:
            container["resources"] = resources
        pod_spec: dict[str, Any] = {"containers": [container], "restartPolicy": "Always"}
        if node_selector:
            pod_spec["nodeSelector"] = dict(node_selector)
        if tolerations:
            pod_spec["tolerations"] = copy.deepcopy(tolerations)
        status: dict[str, Any] = {
            "currentNumberScheduled": desired,
            "desiredNumberScheduled": desired,
            "numberMisscheduled": misscheduled,
            "numberReady": ready,
            "observedGeneration": 1,
        }
        status |= {k: v for k, v in (("updatedNumberScheduled", updated), ("numberAvailable", available)) if v}
        if desired - available > 0:
            status["numberUnavailable"] = desired - available
        daemonset = {
            "metadata": {
                "name": name,
                "labels": labels,
                "annotations": {"deprecated.daemonset.template.generation": "1"},
            },
            "spec": {
                "selector": {"matchLabels": labels},
                "template": {"metadata": {"labels": labels}, "spec": pod_spec},
                "updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1, "maxSurge": 0}},
                "revisionHistoryLimit": 10,
            },
            "status": status,
        }
        return self._add(DAEMONSETS, daemonset, namespace)

    def add_device_plugins(
        self, *, desired: int | None = None, ready: int | None = None, efa: bool = True, nvidia: bool = True
    ) -> None:
        """The EFA and NVIDIA device plugin DaemonSets in kube-system, as HyperPod installs them.

        ``desired`` defaults to the number of nodes with GPUs (``nvidia.com/gpu`` allocatable), ``ready`` to it.
        """
        if desired is None:
            with self._cond:
                desired = sum(
                    1
                    for (resource, _, _), obj in self._objects.items()
                    if resource == "nodes" and obj["status"].get("allocatable", {}).get(GPU_RESOURCE, "0") != "0"
                )
        gpu_toleration = [{"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}]
        if efa:
            self.add_daemonset(
                "kube-system",
                EFA_DEVICE_PLUGIN,
                image=EFA_DEVICE_PLUGIN_IMAGE,
                labels={"name": "aws-efa-k8s-device-plugin"},
                container_name="aws-efa-k8s-device-plugin",
                tolerations=[{"key": "CriticalAddonsOnly", "operator": "Exists"}, *gpu_toleration],
                desired=desired,
                ready=ready,
            )
        if nvidia:
            self.add_daemonset(
                "kube-system",
                NVIDIA_DEVICE_PLUGIN,
                image=NVIDIA_DEVICE_PLUGIN_IMAGE,
                labels={"name": "nvidia-device-plugin-ds"},
                container_name="nvidia-device-plugin-ctr",
                tolerations=gpu_toleration,
                desired=desired,
                ready=ready,
            )

    def add_deployment(
        self,
        namespace: str,
        name: str,
        *,
        image: str,
        labels: dict[str, str] | None = None,
        replicas: int = 1,
        ready_replicas: int | None = None,
        container_name: str | None = None,
    ) -> dict[str, Any]:
        """A Deployment with the status its controller would write (``ready_replicas`` defaults to ``replicas``).

        ``labels`` (default ``{"app": name}``) label it, select its pods and label their template; the container is
        named ``container_name`` (default: the Deployment's name).
        """
        labels = dict(labels or {"app": name})
        ready = replicas if ready_replicas is None else ready_replicas
        now = now_rfc3339()
        available = ready >= replicas
        status: dict[str, Any] = {"observedGeneration": 1, "replicas": replicas, "updatedReplicas": replicas}
        status |= {k: v for k, v in (("readyReplicas", ready), ("availableReplicas", ready)) if v}
        if replicas - ready > 0:
            status["unavailableReplicas"] = replicas - ready
        template_hash = uuid.uuid5(uuid.NAMESPACE_URL, f"{namespace}/{name}/{image}").hex[:10]
        status["conditions"] = [
            {
                "type": "Available",
                "status": "True" if available else "False",
                "lastUpdateTime": now,
                "lastTransitionTime": now,
                "reason": "MinimumReplicasAvailable" if available else "MinimumReplicasUnavailable",
                "message": "Deployment has minimum availability."
                if available
                else "Deployment does not have minimum availability.",
            },
            {
                "type": "Progressing",
                "status": "True",
                "lastUpdateTime": now,
                "lastTransitionTime": now,
                "reason": "NewReplicaSetAvailable",
                "message": f'ReplicaSet "{name}-{template_hash}" has successfully progressed.',
            },
        ]
        deployment = {
            "metadata": {"name": name, "labels": labels, "annotations": {"deployment.kubernetes.io/revision": "1"}},
            "spec": {
                "replicas": replicas,
                "selector": {"matchLabels": labels},
                "template": {
                    "metadata": {"labels": labels, "annotations": {"sidecar.istio.io/inject": "false"}},
                    "spec": {
                        "containers": [
                            {"name": container_name or name, "image": image, "imagePullPolicy": "IfNotPresent"}
                        ],
                        "restartPolicy": "Always",
                    },
                },
                "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": "25%", "maxSurge": "25%"}},
                "revisionHistoryLimit": 10,
                "progressDeadlineSeconds": 600,
            },
            "status": status,
        }
        return self._add(DEPLOYMENTS, deployment, namespace)

    def add_crd(self, crd: dict[str, Any]) -> dict[str, Any]:
        """Install a CustomResourceDefinition (Established, names accepted). Only the PyTorchJob CRD's resources are
        served; installing it again (after :meth:`remove_crd`) brings the PyTorchJob endpoints back."""
        crd = copy.deepcopy(crd)
        now = now_rfc3339()
        names = crd["spec"]["names"]
        crd["status"] = {
            "acceptedNames": {
                k: v
                for k, v in names.items()
                if k in ("kind", "listKind", "plural", "singular", "shortNames", "categories")
            },
            "conditions": [
                {
                    "type": "NamesAccepted",
                    "status": "True",
                    "lastTransitionTime": now,
                    "reason": "NoConflicts",
                    "message": "no conflicts found",
                },
                {
                    "type": "Established",
                    "status": "True",
                    "lastTransitionTime": now,
                    "reason": "InitialNamesAccepted",
                    "message": "the initial names have been accepted",
                },
            ],
            "storedVersions": [v["name"] for v in crd["spec"]["versions"] if v.get("storage")],
        }
        meta = crd.setdefault("metadata", {})
        meta["name"] = f"{names['plural']}.{crd['spec']['group']}"
        for key in ("uid", "resourceVersion", "creationTimestamp", "generation"):
            meta.pop(key, None)
        return self._add(CRDS, crd)

    def remove_crd(self, name: str | None = None) -> None:
        """Uninstall a CRD (default: the PyTorchJob one): its resources are deleted with it, and their endpoints
        answer 404 ("the server could not find the requested resource") until it is installed again."""
        name = name or self.kind.qualified
        with self._cond:
            removed = self._remove(CRDS, "", name)
            if removed is None or name != self.kind.qualified:
                return
            jobs = [(ns, n) for (resource, ns, n) in self._objects if resource == self.kind.resource]
            for ns, job_name in jobs:
                job = self._remove(self.kind, ns, job_name)
                if job is not None:
                    uid = job["metadata"]["uid"]
                    if uid in self._job_stops:
                        self._job_stops[uid].set()
                    self._collect(ns, job_name, uid, "Background")

    @property
    def crd_installed(self) -> bool:
        """Whether the PyTorchJob CRD is installed (and its endpoints served)."""
        with self._cond:
            return (CRDS.resource, "", self.kind.qualified) in self._objects

    # ---------------------------------------------------------------- authorization, for tests

    def use_rbac(self, source: Iterable[dict[str, Any]] | Path | str, *, namespace: str = "default") -> list[Grant]:
        """Authorize as the RBAC manifests in ``source`` (documents, or a YAML file such as deploy/rbac.yaml) say.

        The bindings naming :attr:`user` (or one of its groups) replace the default ``cluster-admin`` binding; rules
        given by :meth:`grant` are dropped, denials kept. Returns the grants found (empty: the user may do nothing).
        """
        grants = rbac_grants(source, self.user, namespace=namespace)
        with self._cond:
            self._grants = list(grants)
        return grants

    def grant(
        self,
        verbs: Iterable[str] | str,
        resources: Iterable[str] | str,
        *,
        groups: Iterable[str] | str = ("",),
        namespace: str | None = None,
        resource_names: Iterable[str] = (),
    ) -> Grant:
        """Give the user one more PolicyRule: in ``namespace`` (a RoleBinding's reach) or everywhere (None)."""

        def as_list(value: Iterable[str] | str) -> list[str]:
            return [value] if isinstance(value, str) else list(value)

        rule: dict[str, Any] = {"apiGroups": as_list(groups), "resources": as_list(resources), "verbs": as_list(verbs)}
        if resource_names:
            rule["resourceNames"] = list(resource_names)
        with self._cond:
            n = len(self._grants)
            if namespace is None:
                source = f'ClusterRoleBinding "fake-grant-{n}" of ClusterRole "fake-grant-{n}" to {{subject}}'
            else:
                source = f'RoleBinding "fake-grant-{n}/{namespace}" of Role "fake-grant-{n}" to {{subject}}'
            grant = Grant(source, (rule,), namespace)
            self._grants.append(grant)
        return grant

    def deny(
        self,
        verb: str,
        resource: str,
        group: str = "",
        subresource: str = "",
        *,
        namespace: str | None = None,
        reason: str = "",
        explicit: bool = False,
    ) -> None:
        """Take a permission away: requests with this verb on this resource get 403, and access reviews say no.

        ``"*"`` matches any verb, resource, group or subresource; ``resource`` may be written ``"pods/log"``;
        ``namespace`` None matches every namespace and the cluster scope. Without ``explicit`` the answer is RBAC's
        (``allowed: false`` and no reason unless one is given); with it, an authorizer's explicit ``denied: true``.
        """
        if "/" in resource and not subresource:
            resource, subresource = resource.split("/", 1)
        with self._cond:
            self._denials.append(Denial(verb, resource, group, subresource, namespace, reason, explicit))

    def allow_all(self) -> None:
        """Back to the default: the user is bound to ``cluster-admin``, nothing denied, events allowed."""
        with self._cond:
            self._grants = [CLUSTER_ADMIN]
            self._denials.clear()
            self.forbid_events = False

    def authorize(self, attrs: Attributes) -> Decision:
        """The authorizer's decision on a request: denials first, ``forbid_events``, then the RBAC grants."""
        with self._cond:
            denials, grants, user = list(self._denials), list(self._grants), self.user
            forbid_events = self.forbid_events
        for denial in denials:
            if denial.matches(attrs):
                return Decision(False, denial.explicit, denial.reason)
        if forbid_events and attrs.resource_request and attrs.group == "" and attrs.resource == "events":
            return Decision(False)
        for grant in sorted(grants, key=lambda g: g.namespace is not None):  # ClusterRoleBindings first
            if grant.namespace is not None and grant.namespace != attrs.namespace:
                continue
            if any(rule_allows(rule, attrs) for rule in grant.rules):
                return Decision(
                    True, reason="RBAC: allowed by " + grant.source.replace("{subject}", describe_user(user))
                )
        return Decision(False)

    def _served_kind(self, group: str, version: str, resource: str) -> Kind | None:
        """The resource type a URL names, if the server serves it (PyTorchJobs only while their CRD is installed)."""
        if (group, version, resource) == (self.kind.group, self.kind.version, self.kind.resource):
            return self.kind if self.crd_installed else None
        return next((k for k in BUILTIN_KINDS if (k.group, k.version, k.resource) == (group, version, resource)), None)

    # ---------------------------------------------------------------- storage (callers hold the lock or take it)

    def _get(self, kind: Kind, namespace: str, name: str) -> dict[str, Any] | None:
        with self._cond:
            obj = self._objects.get((kind.resource, namespace, name))
            return copy.deepcopy(obj) if obj is not None else None

    def _record(self, kind: Kind, type_: str, obj: dict[str, Any], prev: dict[str, Any] | None) -> None:
        self._history.append(Change(self._rv, kind.resource, obj["metadata"].get("namespace", ""), type_, obj, prev))
        if self.history_limit is not None and len(self._history) > self.history_limit:
            dropped = self._history[: len(self._history) - self.history_limit]
            del self._history[: len(dropped)]
            self._floor = dropped[-1].rv
        self._cond.notify_all()

    def _put(self, kind: Kind, obj: dict[str, Any], type_: str) -> dict[str, Any]:
        with self._cond:
            self._rv += 1
            obj = copy.deepcopy(obj)
            obj["metadata"]["resourceVersion"] = str(self._rv)
            key = (kind.resource, obj["metadata"].get("namespace", ""), obj["metadata"]["name"])
            prev = self._objects.get(key)
            self._objects[key] = obj
            self._record(kind, type_, copy.deepcopy(obj), copy.deepcopy(prev) if prev else None)
            return copy.deepcopy(obj)

    def _update(
        self,
        kind: Kind,
        namespace: str,
        name: str,
        mutate: Callable[[dict[str, Any]], None],
        uid: str | None = None,
    ) -> dict[str, Any] | None:
        with self._cond:
            current = self._objects.get((kind.resource, namespace, name))
            if current is None or (uid is not None and current["metadata"]["uid"] != uid):
                return None
            obj = copy.deepcopy(current)
            mutate(obj)
            if obj == current:
                return copy.deepcopy(current)
            return self._put(kind, obj, "MODIFIED")

    def _remove(self, kind: Kind, namespace: str, name: str) -> dict[str, Any] | None:
        with self._cond:
            obj = self._objects.pop((kind.resource, namespace, name), None)
            if obj is None:
                return None
            self._rv += 1
            obj["metadata"]["resourceVersion"] = str(self._rv)
            self._record(kind, "DELETED", copy.deepcopy(obj), copy.deepcopy(obj))
            if kind is PODS:
                self._logs.pop((namespace, name), None)
            return obj

    def _rotate_log(self, namespace: str, pod: str) -> None:
        with self._cond:
            entry = self._logs.setdefault((namespace, pod), ContainerLog())
            entry.previous, entry.current = entry.current, []
            self._cond.notify_all()

    def _create_pod(
        self, job: dict[str, Any], replica_type: str, index: int, *, scheduled: bool, unschedulable_message: str
    ) -> None:
        meta = job["metadata"]
        rspec = (job.get("spec") or {}).get("pytorchReplicaSpecs", {}).get(replica_type) or {}
        template = copy.deepcopy(rspec.get("template") or {})
        spec = template.get("spec") or {"containers": [{"name": CONTAINER, "image": "x"}]}
        container = next((c for c in spec.get("containers", []) if c.get("name") == CONTAINER), None)
        image = (container or {}).get("image") or "x"
        policy = rspec.get("restartPolicy") or "OnFailure"  # the operator's default for PyTorchJob replicas
        spec["restartPolicy"] = "Never" if policy == "ExitCode" else policy  # ExitCode: the operator restarts pods
        spec.setdefault("schedulerName", "default-scheduler")
        spec.setdefault("serviceAccountName", "default")
        now = now_rfc3339()
        name = f"{meta['name']}-{replica_type.lower()}-{index}"
        labels = (template.get("metadata") or {}).get("labels", {}) | {
            JOB_NAME_LABEL: meta["name"],
            OPERATOR_NAME_LABEL: OPERATOR_NAME,
            REPLICA_TYPE_LABEL: replica_type.lower(),
            REPLICA_INDEX_LABEL: str(index),
        }
        status: dict[str, Any] = {"phase": "Pending", "qosClass": "Burstable"}
        if scheduled:
            spec["nodeName"] = f"node-{index}"
            status |= {
                "hostIP": f"10.0.0.{index + 10}",
                "podIP": f"10.1.0.{index + 10}",
                "startTime": now,
                "conditions": [
                    {"type": t, "status": s, "lastProbeTime": None, "lastTransitionTime": now}
                    for t, s in (
                        ("Initialized", "True"),
                        ("Ready", "False"),
                        ("ContainersReady", "False"),
                        ("PodScheduled", "True"),
                    )
                ],
                "containerStatuses": [
                    {
                        "name": CONTAINER,
                        "state": {"waiting": {"reason": "ContainerCreating"}},
                        "lastState": {},
                        "ready": False,
                        "restartCount": 0,
                        "image": image,
                        "imageID": "",
                        "started": False,
                    }
                ],
            }
            _set_pod_ready(status, False, now)
        else:
            status["conditions"] = [
                {
                    "type": "PodScheduled",
                    "status": "False",
                    "lastProbeTime": None,
                    "lastTransitionTime": now,
                    "reason": "Unschedulable",
                    "message": unschedulable_message,
                }
            ]
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": name,
                "namespace": meta["namespace"],
                "uid": str(uuid.uuid4()),
                "creationTimestamp": now,
                "labels": labels,
                "annotations": (template.get("metadata") or {}).get("annotations", {}),
                "ownerReferences": [
                    {
                        "apiVersion": job.get("apiVersion", self.kind.api_version),
                        "kind": self.kind.kind,
                        "name": meta["name"],
                        "uid": meta["uid"],
                        "controller": True,
                        "blockOwnerDeletion": True,
                    }
                ],
            },
            "spec": spec,
            "status": status,
        }
        with self._cond:
            if ("pods", meta["namespace"], name) not in self._objects:
                self._put(PODS, pod, "ADDED")
                self._logs[(meta["namespace"], name)] = ContainerLog()

    # ---------------------------------------------------------------- lifecycles and deletion

    def _play(self, lifecycle: Lifecycle, job: dict[str, Any]) -> None:
        meta = job["metadata"]
        handle = JobHandle(self, meta["namespace"], meta["name"], meta["uid"])
        stop = self._job_stops.setdefault(meta["uid"], threading.Event())

        def run() -> None:
            for delay, action in lifecycle.steps:
                if stop.wait(delay) or self._stopping.is_set():
                    return
                if handle.job() is None:
                    return
                try:
                    action(handle)
                except Exception:
                    log.exception("lifecycle step of %s/%s failed", handle.namespace, handle.name)
                    return

        threading.Thread(target=run, name=f"lifecycle-{meta['name']}", daemon=True).start()

    def _owned_pods(self, namespace: str, uid: str) -> list[str]:
        return [
            name
            for (resource, ns, name), obj in self._objects.items()
            if resource == "pods"
            and ns == namespace
            and any(ref.get("uid") == uid for ref in obj["metadata"].get("ownerReferences", []))
        ]

    def _collect(self, namespace: str, name: str, uid: str, policy: str) -> None:
        """The garbage collector's part of a deletion, after ``delete_delay_s``.

        As kubernetes v1.36's garbage collector does it (pkg/controller/garbagecollector/garbagecollector.go,
        ``attemptToDeleteItem`` and ``processDeletingDependentsItem``): with Foreground propagation the owner keeps its
        ``foregroundDeletion`` finalizer, and stays readable (a create under its name answers 409), until every
        dependent is gone; the dependents, the job's pods, are deleted gracefully: they carry a ``deletionTimestamp``
        and stay Terminating while the kubelet stops their containers (``pod_termination_s`` here stands for the
        trainer's SIGTERM checkpoint within terminationGracePeriodSeconds). With Background the owner is already gone
        and the pods follow the same way; Orphan strips their ownerReferences.
        """

        def run() -> None:
            if self._stopping.wait(self.delete_delay_s):
                return
            with self._cond:
                pods = self._owned_pods(namespace, uid)
                for pod in pods:
                    if policy == "Orphan":
                        self._update(PODS, namespace, pod, lambda p: p["metadata"].pop("ownerReferences", None))
                    else:
                        self._update(PODS, namespace, pod, _mark_terminating)
            if policy != "Orphan" and pods and self._stopping.wait(self.pod_termination_s):
                return
            with self._cond:
                if policy != "Orphan":
                    for pod in pods:
                        self._remove(PODS, namespace, pod)
                job = self._objects.get((self.kind.resource, namespace, name))
                if job is not None and job["metadata"]["uid"] == uid:
                    self._remove(self.kind, namespace, name)

        threading.Thread(target=run, name=f"gc-{name}", daemon=True).start()


def _mark_terminating(pod: dict[str, Any]) -> None:
    """A graceful delete of a pod: the API server sets deletionTimestamp (now + grace) and the grace period."""
    grace = (pod.get("spec") or {}).get("terminationGracePeriodSeconds", 30)
    meta = pod["metadata"]
    meta.setdefault("deletionTimestamp", rfc3339(time.time() + grace))
    meta.setdefault("deletionGracePeriodSeconds", grace)


# --------------------------------------------------------------------------------------------------------------------
# HTTP


@dataclass(frozen=True)
class RequestInfo:
    """A request as the API server's RequestInfo parser reads it (k8s.io/apiserver/pkg/endpoints/request)."""

    attrs: Attributes
    version: str = ""
    resource_path: bool = True  # under /api/v1 or /apis/<group>/<version>, with a resource
    named_namespace: bool = False  # /namespaces/<name>[/status]: the Namespace object itself


def request_info(method: str, path: str, params: dict[str, str]) -> RequestInfo:
    """Verb, API group, version, namespace, resource, subresource and name of a request (the authorizer's input)."""
    segments = [unquote(part) for part in path.strip("/").split("/")] if path.strip("/") else []
    if segments[:2] == ["api", "v1"]:
        group, version, rest = "", "v1", segments[2:]
    elif len(segments) >= 3 and segments[0] == "apis":
        group, version, rest = segments[1], segments[2], segments[3:]
    else:
        rest = []
    if not rest:
        verb = {"GET": "get", "HEAD": "get", "POST": "post", "PUT": "put", "DELETE": "delete", "PATCH": "patch"}
        return RequestInfo(Attributes(verb.get(method, method.lower()), path=path or "/"), resource_path=False)
    namespace, named_namespace = "", False
    if rest[0] == "namespaces" and len(rest) > 1:
        namespace = rest[1]
        if len(rest) > 2 and rest[2] not in ("status", "finalize"):
            rest = rest[2:]
        else:
            named_namespace = True
    resource = rest[0]
    name = rest[1] if len(rest) > 1 else ""
    subresource = rest[2] if len(rest) > 2 else ""
    watching = params.get("watch", "") in ("1", "t", "T", "TRUE", "true", "True")
    if method in ("GET", "HEAD"):
        verb = "get" if name else ("watch" if watching else "list")
    elif method == "DELETE":
        verb = "delete" if name else "deletecollection"
    else:
        verb = {"POST": "create", "PUT": "update", "PATCH": "patch"}.get(method, method.lower())
    attrs = Attributes(verb, group, resource, subresource, namespace, name)
    return RequestInfo(attrs, version, len(rest) <= 3, named_namespace)


NO_RESOURCE = "the server could not find the requested resource"


REVIEW_RESOURCE_FIELDS = ("namespace", "verb", "group", "version", "resource", "subresource", "name")
REVIEW_SELECTOR_FIELDS = ("fieldSelector", "labelSelector")  # authorization.k8s.io/v1 since Kubernetes 1.31


def _review_shape(obj: dict[str, Any]) -> tuple[list[str], list[str]]:
    """Type errors (as Go's JSON decoder words them) and unknown fields of a SelfSubjectAccessReview body."""
    type_errors: list[str] = []
    unknown: list[str] = []

    def expect_object(value: Any, parent: str, path: str, target: str) -> bool:
        if value is None or isinstance(value, dict):
            return isinstance(value, dict)
        type_errors.append(
            f"json: cannot unmarshal {_go_type(value)} into Go struct field {parent}.{path} of type v1.{target}"
        )
        return False

    def strings(value: dict[str, Any], allowed: Iterable[str], go_type: str, path: str) -> None:
        allowed = tuple(allowed)
        for key, item in value.items():
            into = f"into Go struct field {go_type}.{path}.{key}"
            if key in REVIEW_SELECTOR_FIELDS and path.endswith("resourceAttributes"):
                if item is not None and not isinstance(item, dict):
                    target = f"v1.{key[0].upper()}{key[1:]}Attributes"
                    type_errors.append(f"json: cannot unmarshal {_go_type(item)} {into} of type {target}")
            elif key not in allowed:
                unknown.append(f"{path}.{key}")
            elif item is not None and not isinstance(item, str):
                type_errors.append(f"json: cannot unmarshal {_go_type(item)} {into} of type string")

    for key in obj:
        if key not in ("apiVersion", "kind", "metadata", "spec", "status"):
            unknown.append(key)
    if isinstance(obj.get("metadata"), dict):
        unknown += [f"metadata.{k}" for k in obj["metadata"] if k not in OBJECT_META_FIELDS]
    spec = obj.get("spec")
    if expect_object(spec, "SelfSubjectAccessReview", "spec", "SelfSubjectAccessReviewSpec"):
        for key in spec:
            if key not in ("resourceAttributes", "nonResourceAttributes"):
                unknown.append(f"spec.{key}")
        for key, target, fields in (
            ("resourceAttributes", "ResourceAttributes", REVIEW_RESOURCE_FIELDS),
            ("nonResourceAttributes", "NonResourceAttributes", ("path", "verb")),
        ):
            if expect_object(spec.get(key), "SelfSubjectAccessReviewSpec", f"spec.{key}", target):
                strings(spec[key], fields, target, f"spec.{key}")
    return type_errors, unknown


class _Abort(Exception):
    """End the handler by closing the connection abruptly."""


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # Headers and body are written apart: without TCP_NODELAY each request on a kept-alive connection waits ~40 ms
    # for a delayed ACK.
    disable_nagle_algorithm = True
    server: _Server
    streaming = False  # a chunked response has begun: errors can only cut it

    # ---------------------------------------------------------------- plumbing

    @property
    def fake(self) -> FakeKubernetes:
        return self.server.fake

    def setup(self) -> None:
        super().setup()
        with self.fake._cond:
            self.fake._connections.add(self.connection)

    def finish(self) -> None:
        try:
            super().finish()
        except OSError:
            pass
        with self.fake._cond:
            self.fake._connections.discard(self.connection)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s %s", self.address_string(), format % args)

    def do_GET(self) -> None:
        self._dispatch()

    def do_POST(self) -> None:
        self._dispatch()

    def do_DELETE(self) -> None:
        self._dispatch()

    def do_PUT(self) -> None:
        self._dispatch()

    def do_PATCH(self) -> None:
        self._dispatch()

    def _read_body(self) -> bytes:
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _send_json(
        self, code: int, obj: Any, headers: dict[str, str] | None = None, warnings: Iterable[str] = ()
    ) -> None:
        data = dumps(obj)
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Cache-Control", "no-cache, private")
        self.send_header("Audit-Id", str(uuid.uuid4()))
        for warning in warnings:
            self.send_header("Warning", f"299 - {json.dumps(warning)}")
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(data)

    def _start_chunked(self, content_type: str) -> None:
        self.streaming = True
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header("Cache-Control", "no-cache, private")
        self.send_header("Audit-Id", str(uuid.uuid4()))
        self.end_headers()

    def _chunk(self, data: bytes) -> None:
        if data:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.wfile.flush()

    def _end_chunked(self) -> None:
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    def _abort(self) -> None:
        """Close the connection now: no response, or a response cut mid-stream."""
        self.close_connection = True
        try:
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _dispatch(self) -> None:
        method = self.command
        self.streaming = False
        with self.fake._cond:
            self.fake.requests.append((method, self.path))
        body = self._read_body()
        split = urlsplit(self.path)
        params = dict(parse_qsl(split.query, keep_blank_values=True))
        fault = self.fake.faults.take(("fail", "drop"), method, self.path)
        if fault is not None and fault.kind == "drop":
            log.info("fault: dropping %s %s", method, self.path)
            self._abort()
            return
        if fault is not None:
            log.info("fault: answering %s %s with %d", method, self.path, fault.status)
            error = ApiError(fault.status, fault.message or DEFAULT_MESSAGES.get(fault.status, "injected fault"))
            headers = {}
            if fault.retry_after is not None:
                headers["Retry-After"] = str(fault.retry_after)
                error.body["details"] = {"retryAfterSeconds": fault.retry_after}
                error.body["code"] = error.body.pop("code")
            self._send_json(fault.status, error.body, headers)
            return
        try:
            self._route(method, split.path, params, body)
        except _Abort:
            self._abort()
        except ApiError as error:
            self._send_json(error.code, error.body, error.headers)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        except Exception as error:  # a bug of the fake: answer like the API server would, and log it
            log.exception("fake Kubernetes API server: %s %s failed", method, self.path)
            if self.streaming:
                self._abort()
            else:
                self._send_json(500, status_body(500, f"Internal error occurred: {error}"))

    def _route(self, method: str, path: str, params: dict[str, str], body: bytes) -> None:
        fake = self.fake
        info = request_info(method, path, params)
        attrs = info.attrs
        ssar = (attrs.group, attrs.resource) == (SSARS.group, SSARS.resource) and not attrs.name
        if not ssar:  # system:basic-user lets every authenticated user review its own access
            decision = fake.authorize(attrs)
            if not decision.allowed:
                raise forbidden(attrs, fake.user, decision.reason)
        if not attrs.resource_request or not info.resource_path:
            raise ApiError(404, NO_RESOURCE, details={})
        kind = fake._served_kind(attrs.group, info.version, attrs.resource)
        if kind is None:
            raise ApiError(404, NO_RESOURCE, details={})
        ns = attrs.namespace if kind.namespaced else ""
        name, sub = attrs.name, attrs.subresource
        if (kind.namespaced and name and not ns) or (
            not kind.namespaced and attrs.namespace and not info.named_namespace
        ):
            raise ApiError(404, NO_RESOURCE, details={})
        if sub and sub not in kind.subresources:
            raise ApiError(404, NO_RESOURCE, details={})
        if sub:
            allowed = ("GET",)
        elif name:
            allowed = tuple(m for m, v in (("GET", "get"), ("DELETE", "delete")) if v in kind.verbs)
        else:
            allowed = tuple(m for m, v in (("GET", "list"), ("POST", "create")) if v in kind.verbs)
        if method not in allowed:
            raise ApiError(405, "the server does not allow this method on the requested resource", details={})
        if kind is SSARS:
            self._access_review(params, body)
        elif kind is fake.kind and method == "POST":
            self._create(ns, params, body)
        elif kind is fake.kind and method == "DELETE":
            self._delete(ns, name, params, body)
        elif sub == "log":
            self._pod_log(ns, name, params)
        elif name:
            self._send_json(200, self._must_get(kind, ns, name))
        else:
            self._list_or_watch(kind, ns or None, params)

    def _must_get(self, kind: Kind, ns: str, name: str) -> dict[str, Any]:
        obj = self.fake._get(kind, ns, name)
        if obj is None:
            raise kind.not_found(name)
        return obj

    # ---------------------------------------------------------------- SelfSubjectAccessReview

    def _access_review(self, params: dict[str, str], body: bytes) -> None:
        """Answer a SelfSubjectAccessReview from the decision the server would take on that request.

        Unknown fields are a 400 unless ``fieldValidation`` is Warn (a warning) or Ignore: stricter than a real API
        server, which warns by default (kubectl asks for Strict), so that a misspelled field cannot pass a test.
        """
        fake, kind = self.fake, SSARS
        directive = params.get("fieldValidation") or "Strict"
        if directive not in ("Ignore", "Warn", "Strict"):
            raise ApiError(400, f"fieldValidation: Unsupported value: {json.dumps(directive)}")
        cannot = f'{kind.kind} in version "{kind.version}" cannot be handled as a {kind.kind}'
        try:
            obj = json.loads(body or b"null")
        except ValueError as error:
            raise ApiError(400, f"{cannot}: json parse error: {error}") from None
        if not isinstance(obj, dict):
            raise ApiError(
                400, f"{cannot}: json: cannot unmarshal {_go_type(obj)} into Go value of type v1.{kind.kind}"
            )
        if obj.get("apiVersion") not in (None, kind.api_version):
            raise ApiError(
                400,
                f"the API version in the data ({obj['apiVersion']}) does not match the expected API version "
                f"({kind.api_version})",
            )
        if obj.get("kind") not in (None, kind.kind):
            raise ApiError(400, f"the kind in the data ({obj['kind']}) does not match the expected kind ({kind.kind})")
        type_errors, unknown = _review_shape(obj)
        if type_errors:
            raise ApiError(400, f"{cannot}: {type_errors[0]}")
        warnings: list[str] = []
        if unknown and directive == "Strict":
            fields = ", ".join(f'unknown field "{u}"' for u in unknown)
            raise ApiError(400, f"{cannot}: strict decoding error: {fields}")
        if directive == "Warn":
            warnings = [f'unknown field "{u}"' for u in unknown]
        spec = obj.get("spec") or {}
        resource_attrs = spec.get("resourceAttributes")
        non_resource_attrs = spec.get("nonResourceAttributes")
        invalid = f'{kind.kind}.{kind.group} "" is invalid: '
        if resource_attrs is None and non_resource_attrs is None:
            raise ApiError(
                422,
                invalid + 'spec.resourceAttributes: Invalid value: "null": exactly one of nonResourceAttributes or '
                "resourceAttributes must be specified",
                details={"group": kind.group, "kind": kind.kind, "causes": []},
            )
        if resource_attrs is not None and non_resource_attrs is not None:
            raise ApiError(
                422,
                invalid + f"spec.nonResourceAttributes: Invalid value: {json.dumps(non_resource_attrs)}: cannot be "
                "specified in combination with resourceAttributes",
                details={"group": kind.group, "kind": kind.kind, "causes": []},
            )
        if resource_attrs is not None:
            asked = {k: v for k, v in resource_attrs.items() if k in REVIEW_RESOURCE_FIELDS}
            attrs = Attributes(
                asked.get("verb") or "",
                asked.get("group") or "",
                asked.get("resource") or "",
                asked.get("subresource") or "",
                asked.get("namespace") or "",
                asked.get("name") or "",
            )
            clean_spec: dict[str, Any] = {"resourceAttributes": asked}
        else:
            asked = {k: v for k, v in non_resource_attrs.items() if k in ("path", "verb")}
            attrs = Attributes(asked.get("verb") or "", path=asked.get("path") or "/")
            clean_spec = {"nonResourceAttributes": asked}
        decision = fake.authorize(attrs)
        with fake._cond:
            fake.access_reviews.append((copy.deepcopy(asked), decision))
        status: dict[str, Any] = {"allowed": decision.allowed}
        if decision.denied:
            status["denied"] = True
        if decision.reason:
            status["reason"] = decision.reason
        review = {
            "kind": kind.kind,
            "apiVersion": kind.api_version,
            "metadata": {"creationTimestamp": None},
            "spec": clean_spec,
            "status": status,
        }
        self._send_json(201, review, warnings=warnings)

    # ---------------------------------------------------------------- create

    def _create(self, ns: str, params: dict[str, str], body: bytes) -> None:
        fake, kind = self.fake, self.fake.kind
        directive = params.get("fieldValidation", "Warn") or "Warn"
        if directive not in ("Ignore", "Warn", "Strict"):
            raise ApiError(400, f"fieldValidation: Unsupported value: {json.dumps(directive)}")
        try:
            obj = json.loads(body or b"null")
        except ValueError as error:
            raise ApiError(400, f"the object provided is unrecognized (must be of type {kind.kind}): {error}") from None
        if not isinstance(obj, dict):
            raise ApiError(400, f"the object provided is unrecognized (must be of type {kind.kind})")
        if not obj.get("kind"):
            raise ApiError(400, f"Object 'Kind' is missing in '{body.decode(errors='replace')[:200]}'")
        if obj.get("apiVersion") != kind.api_version or obj["kind"] != kind.kind:
            raise ApiError(
                400,
                f"the API version in the data ({obj.get('apiVersion')}) does not match the expected API version "
                f"({kind.api_version})"
                if obj.get("apiVersion") != kind.api_version
                else f"the kind in the data ({obj['kind']}) does not match the expected kind ({kind.kind})",
            )
        meta = obj.get("metadata")
        if not isinstance(meta, dict):
            meta = obj["metadata"] = {}
        if meta.get("namespace") not in (None, "", ns):
            raise ApiError(400, "the namespace of the provided object does not match the namespace sent on the request")
        if meta.get("resourceVersion"):
            raise ApiError(500, "Internal error occurred: resourceVersion should not be set on objects to be created")

        pruned = prune_unknown_fields(obj, fake.schema)
        if pruned and directive == "Strict":
            fields = ", ".join(f'unknown field "{p}"' for p in pruned)
            raise ApiError(
                400,
                f'{kind.kind} in version "{kind.version}" cannot be handled as a {kind.kind}: '
                f"strict decoding error: {fields}",
            )
        warnings = [f'unknown field "{p}"' for p in pruned] if directive == "Warn" else []
        with fake._cond:
            fake.pruned_fields.extend(pruned)
        if fake.status_subresource:
            obj.pop("status", None)
        meta = obj["metadata"]
        meta["namespace"] = ns
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        apply_defaults(obj, fake.schema)

        errors = object_meta_errors(meta) + schema_errors(obj, fake._validator) + list_map_errors(obj, fake.schema)
        name = meta.get("name") or ""
        if errors:
            with fake._cond:
                fake.validation_errors.extend(str(e) for e in errors)
            rendered = [str(e) for e in errors]
            message = rendered[0] if len(rendered) == 1 else "[" + ", ".join(rendered) + "]"
            causes = [{"reason": e.reason, "message": e.detail, "field": e.field} for e in errors]
            raise ApiError(
                422,
                f'{kind.kind}.{kind.group} "{name}" is invalid: {message}',
                details={"name": name, "group": kind.group, "kind": kind.kind, "causes": causes},
            )
        now = now_rfc3339()
        manager = (self.headers.get("User-Agent") or "unknown").split("/")[0]
        meta.update(uid=str(uuid.uuid4()), creationTimestamp=now, generation=1)
        meta["managedFields"] = [
            {
                "manager": params.get("fieldManager") or manager,
                "operation": "Update",
                "apiVersion": kind.api_version,
                "time": now,
                "fieldsType": "FieldsV1",
                "fieldsV1": {},
            }
        ]
        for key in ("deletionTimestamp", "deletionGracePeriodSeconds", "selfLink"):
            meta.pop(key, None)
        dry_run = params.get("dryRun") == "All"
        with fake._cond:
            if (kind.resource, ns, name) in fake._objects:
                raise ApiError(
                    409,
                    f'{kind.qualified} "{name}" already exists',
                    "AlreadyExists",
                    details={"name": name, "group": kind.group, "kind": kind.resource},
                )
            if dry_run:
                stored = copy.deepcopy(obj)
            else:
                stored = fake._put(kind, obj, "ADDED")
                fake._job_stops[meta["uid"]] = threading.Event()
            fake.warnings.extend(warnings)
        lifecycle = fake.lifecycles.get(name, fake.lifecycle)
        if lifecycle is not None and not dry_run:
            fake._play(lifecycle, stored)
        self._send_json(201, stored, warnings=warnings)

    # ---------------------------------------------------------------- delete

    def _delete(self, ns: str, name: str, params: dict[str, str], body: bytes) -> None:
        fake, kind = self.fake, self.fake.kind
        options: dict[str, Any] = {}
        if body.strip():
            try:
                options = json.loads(body)
            except ValueError as error:
                raise ApiError(400, f"invalid DeleteOptions: {error}") from None
        policy = params.get("propagationPolicy") or options.get("propagationPolicy")
        if policy is None and options.get("orphanDependents") is not None:
            policy = "Orphan" if options["orphanDependents"] else "Background"
        if policy not in (None, "Foreground", "Background", "Orphan"):
            raise ApiError(
                422,
                f'DeleteOptions.meta.k8s.io "" is invalid: propagationPolicy: Unsupported value: "{policy}": supported '
                'values: "Foreground", "Background", "Orphan"',
            )
        with fake._cond:
            job = fake._objects.get((kind.resource, ns, name))
            if job is None:
                raise kind.not_found(name)
            fake.deletions.append((ns, name, policy))
            uid = job["metadata"]["uid"]
            if uid in fake._job_stops:
                fake._job_stops[uid].set()
            if job["metadata"].get("deletionTimestamp"):
                self._send_json(200, copy.deepcopy(job))
                return
            effective = policy or "Background"
            if effective in ("Foreground", "Orphan"):
                finalizer = "foregroundDeletion" if effective == "Foreground" else "orphan"

                def mark(obj: dict[str, Any]) -> None:
                    obj["metadata"]["deletionTimestamp"] = now_rfc3339()
                    obj["metadata"]["deletionGracePeriodSeconds"] = 0
                    obj["metadata"]["finalizers"] = [*obj["metadata"].get("finalizers", []), finalizer]

                marked = fake._update(kind, ns, name, mark)
                fake._collect(ns, name, uid, effective)
                self._send_json(200, marked)
                return
            fake._remove(kind, ns, name)
            fake._collect(ns, name, uid, effective)
        self._send_json(
            200,
            {
                "kind": "Status",
                "apiVersion": "v1",
                "metadata": {},
                "status": "Success",
                "details": {"name": name, "group": kind.group, "kind": kind.resource, "uid": uid},
            },
        )

    # ---------------------------------------------------------------- list and watch

    def _selected(self, kind: Kind, namespace: str | None, params: dict[str, str]) -> Callable[[dict[str, Any]], bool]:
        """The objects a list or watch selects: in ``namespace`` (None: every namespace, or cluster-scoped)."""
        labels = label_matcher(params.get("labelSelector"))
        fields = field_matcher(params.get("fieldSelector"), kind.fields, dict(kind.field_defaults))
        return lambda obj: (
            (namespace is None or obj["metadata"].get("namespace", "") == namespace)
            and labels(obj["metadata"].get("labels") or {})
            and fields(obj)
        )

    def _list_or_watch(self, kind: Kind, ns: str | None, params: dict[str, str]) -> None:
        selected = self._selected(kind, ns, params)
        if flag(params, "watch"):
            self._watch(kind, ns, params, selected)
            return
        fake = self.fake
        with fake._cond:
            items = [
                copy.deepcopy(obj)
                for (resource, _, _), obj in sorted(fake._objects.items())
                if resource == kind.resource and selected(obj)
            ]
            rv = fake._rv
        if kind.typed_items:
            for item in items:
                item.pop("kind", None)
                item.pop("apiVersion", None)
        list_kind = fake.list_kind if kind is fake.kind else f"{kind.kind}List"
        self._send_json(
            200,
            {
                "apiVersion": kind.api_version,
                "kind": list_kind,
                "metadata": {"resourceVersion": str(rv)},
                "items": items,
            },
        )

    def _watch(
        self, kind: Kind, ns: str | None, params: dict[str, str], selected: Callable[[dict[str, Any]], bool]
    ) -> None:
        fake = self.fake
        timeout = parse_int(params, "timeoutSeconds")
        deadline = time.monotonic() + (timeout if timeout is not None else 1800)
        bookmarks = flag(params, "allowWatchBookmarks") and fake.bookmark_interval_s
        requested = params.get("resourceVersion", "")
        try:
            since = int(requested) if requested not in ("", "0") else None
        except ValueError:
            raise ApiError(400, f'invalid resource version: "{requested}"') from None
        cut = fake.faults.take(("drop_watch",), "GET", self.path)
        self._start_chunked("application/json")
        sent = 0

        def check_cut() -> None:
            if cut is not None and sent >= cut.after:
                log.info("fault: cutting the watch %s after %d events", self.path, sent)
                raise _Abort

        def send(event: dict[str, Any]) -> None:
            nonlocal sent
            self._chunk(dumps(event) + b"\n")
            sent += 1
            check_cut()

        check_cut()

        with fake._cond:
            if since is not None and since < fake._floor:
                error = status_body(410, f"too old resource version: {since} ({fake._floor})", "Expired")
                self._chunk(dumps({"type": "ERROR", "object": error}) + b"\n")
                self._end_chunked()
                return
            pending: list[dict[str, Any]] = []
            if since is None:  # the current state first, as synthetic ADDED events
                pending = [
                    {"type": "ADDED", "object": copy.deepcopy(obj)}
                    for (resource, _, _), obj in sorted(fake._objects.items())
                    if resource == kind.resource and selected(obj)
                ]
                since = fake._rv
        for event in pending:
            send(event)
        last_bookmark = time.monotonic()
        while True:
            with fake._cond:
                events = [
                    self._event_for(c, selected) for c in fake._history if c.rv > since and c.resource == kind.resource
                ]
                events = [e for e in events if e is not None]
                since = fake._rv  # every change up to here is in the history (or was compacted away)
                if not events:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0 or fake._stopping.is_set():
                        break
                    fake._cond.wait(min(remaining, 0.25))
            for event in events:
                send(event)
            if bookmarks and time.monotonic() - last_bookmark >= fake.bookmark_interval_s:
                last_bookmark = time.monotonic()
                marker = {
                    "kind": kind.kind,
                    "apiVersion": kind.api_version,
                    "metadata": {"resourceVersion": str(since)},
                }
                send({"type": "BOOKMARK", "object": marker})
        if fake._stopping.is_set():
            raise _Abort
        self._end_chunked()

    @staticmethod
    def _event_for(change: Change, selected: Callable[[dict[str, Any]], bool]) -> dict[str, Any] | None:
        """The watch event a change makes for this watch (objects entering or leaving the selection included)."""
        now_in = selected(change.obj)
        was_in = change.prev is not None and selected(change.prev)
        if change.type == "DELETED":
            return {"type": "DELETED", "object": copy.deepcopy(change.obj)} if now_in else None
        if now_in and (change.type == "ADDED" or was_in):
            return {"type": change.type, "object": copy.deepcopy(change.obj)}
        if now_in:
            return {"type": "ADDED", "object": copy.deepcopy(change.obj)}
        if was_in:
            return {"type": "DELETED", "object": copy.deepcopy(change.obj)}
        return None

    # ---------------------------------------------------------------- logs

    def _pod_log(self, ns: str, name: str, params: dict[str, str]) -> None:
        fake = self.fake
        pod = self._must_get(PODS, ns, name)
        containers = [c["name"] for c in pod["spec"].get("containers", [])]
        container = params.get("container") or ""
        if not container:
            if len(containers) != 1:
                raise ApiError(
                    400,
                    f"a container name must be specified for pod {name}, choose one of: [{' '.join(containers)}]",
                )
            container = containers[0]
        elif container not in containers:
            raise ApiError(400, f"container {container} is not valid for pod {name}")
        follow, timestamps, previous = flag(params, "follow"), flag(params, "timestamps"), flag(params, "previous")
        since_seconds = parse_int(params, "sinceSeconds")
        tail = parse_int(params, "tailLines")
        limit = parse_int(params, "limitBytes")
        since_ns: int | None = None
        if since_seconds is not None:
            if since_seconds < 1:
                raise ApiError(422, 'PodLogOptions "" is invalid: sinceSeconds: Invalid value: must be greater than 0')
            since_ns = time.time_ns() - since_seconds * 1_000_000_000
        elif params.get("sinceTime"):
            try:
                since_ns = parse_rfc3339_ns(params["sinceTime"])
            except ValueError as error:
                raise ApiError(400, str(error)) from None
        if not pod["spec"].get("nodeName"):  # not scheduled: the API server has no kubelet to ask, and answers empty
            self._start_chunked("text/plain")
            self._end_chunked()
            return
        status = next((c for c in pod["status"].get("containerStatuses", []) if c["name"] == container), None)
        state = (status or {}).get("state", {})
        # In a back-off the kubelet serves the last (terminated) instance's log, with or without ``previous``.
        backing_off = "waiting" in state and "terminated" in (status or {}).get("lastState", {})
        source = "current"
        if previous:
            with fake._cond:
                entry = fake._logs.get((ns, name))
                has_previous = entry is not None and entry.previous is not None
            if not backing_off and not has_previous:
                raise ApiError(400, f'previous terminated container "{container}" in pod "{name}" not found')
            source = "current" if backing_off else "previous"
            follow = False
        elif status is None or ("waiting" in state and not backing_off):
            reason = state.get("waiting", {}).get("reason", "ContainerCreating")
            detail = {"ErrImagePull": "image can't be pulled", "ImagePullBackOff": "trying and failing to pull image"}
            raise ApiError(
                400, f'container "{container}" in pod "{name}" is waiting to start: {detail.get(reason, reason)}'
            )
        restarts = status.get("restartCount", 0) if status else 0

        def render(entries: list[tuple[int, str]]) -> bytes:
            return b"".join(
                ((rfc3339_nano(t) + " " + text) if timestamps else text).encode() + b"\n" for t, text in entries
            )

        written = 0

        def send(entries: list[tuple[int, str]]) -> bool:
            """Write lines; False once limitBytes is reached."""
            nonlocal written
            for entry in entries:
                data = render([entry])
                if limit is not None and written + len(data) >= limit:
                    self._chunk(data[: limit - written])
                    written = limit
                    return False
                self._chunk(data)
                written += len(data)
            return True

        with fake._cond:
            entry = fake._logs.get((ns, name), ContainerLog())
            lines = list(entry.previous or []) if source == "previous" else list(entry.current)
        offset = len(lines)
        if since_ns is not None:
            lines = [line for line in lines if line[0] >= since_ns]
        if tail is not None and tail >= 0:
            lines = lines[len(lines) - tail :] if tail else []
        self._start_chunked("text/plain")
        if not send(lines) or not follow:
            self._end_chunked()
            return
        while True:
            with fake._cond:
                current = fake._objects.get(("pods", ns, name))
                entry = fake._logs.get((ns, name))
                cs = next(
                    (
                        c
                        for c in (current or {}).get("status", {}).get("containerStatuses", [])
                        if c["name"] == container
                    ),
                    None,
                )
                new = (
                    list(entry.current[offset:])
                    if entry is not None and cs and cs.get("restartCount", 0) == restarts
                    else []
                )
                offset += len(new)
                ended = (
                    current is None
                    or cs is None
                    or cs.get("restartCount", 0) != restarts
                    or "terminated" in cs.get("state", {})
                    or "waiting" in cs.get("state", {})
                )
                if not new and not ended:
                    if fake._stopping.is_set():
                        raise _Abort
                    fake._cond.wait(0.25)
                    continue
            if not send(new) or ended:
                break
        self._end_chunked()
