"""A fake Kubeflow Pipelines API server (REST, ``/apis/v2beta1``) on loopback, for driving the real ``kfp.Client``.

It serves what ``kfp.Client`` (kfp 2.17, REST layer ``kfp_server_api``) sends for experiments, pipeline uploads and
versions, runs and recurring runs, and it is strict about it, so that a test catches what a real server would reject:

- every JSON request body must deserialize into its ``kfp_server_api`` model with no unknown key at any depth (keys
  are compared with each model's ``attribute_map``, recursing by ``openapi_types``), scalars of the right JSON type
  (int64 fields such as ``max_concurrency`` as a JSON number or a decimal string, as protobuf's JSON mapping allows),
  timestamps in RFC 3339 and enums among their values;
- ``filter`` query parameters must be a JSON ``Filter`` (``predicates`` with an ``operation``, a ``key`` of the listed
  resource and exactly one typed value); EQUALS, NOT_EQUALS, IN and IS_SUBSTRING are evaluated on string keys;
- unknown query parameters, unknown routes and methods are rejected too;
- uploads must be ``multipart/form-data`` with an ``uploadfile`` part holding a compiled pipeline (first YAML
  document: a ``PipelineSpec`` with ``pipelineInfo``, ``root`` and ``schemaVersion``; an optional second document: a
  ``PlatformSpec``), both parsed with the real protobuf messages;
- runs and recurring runs must reference an existing pipeline version (404 otherwise) or carry a pipeline spec, and
  (unless ``check_parameters=False``) their ``runtime_config.parameters`` must match the pipeline's declared inputs
  by name and JSON type, as the API server checks them when it creates the run or recurring run (kubeflow/pipelines,
  ``backend/src/apiserver/template/v2_template.go``, ``V2Spec.validatePipelineJobInputs``, called from
  ``RunWorkflow`` and ``ScheduledWorkflow``): any number passes for an integer input, and the first violation is
  answered, in its words, with 400 "invalid pipeline job inputs".

A rejected request gets the status a real server gives (400 INVALID_ARGUMENT, 404 NOT_FOUND, 409 ALREADY_EXISTS, ...)
with a ``google.rpc.Status``-like JSON body ``{"error", "code", "message", "details"}``; every 400 and every request
the fake has no route for is also appended to :attr:`FakeKfp.errors`, which a test asserts is empty.

Runs move on each ``GET /runs/{id}``: ``PENDING`` at creation, then through :attr:`FakeKfp.run_progression` (by
default ``RUNNING``), then :attr:`FakeKfp.run_outcome`. ``kfp.Client.wait_for_run_completion`` sleeps
``sleep_duration`` (5 s by default) between polls, so a test passes ``sleep_duration=0``. A run that ends SUCCEEDED or
FAILED gets ``run_details.task_details`` as a real backend reports them: one per Argo node, with a display name and a
state, and nothing else (no message, no outputs); a FAILED run fails in :attr:`FakeKfp.failed_task`.

``GET /healthz`` answers as a real backend does, with its version in ``tag_name`` (:attr:`FakeKfp.tag_name`).

Usage::

    with FakeKfp() as server:
        client = server.client()  # kfp.Client(host=server.url), with the token when one is required
        ...
        assert server.errors == []
"""

from __future__ import annotations

import email.parser
import email.policy
import graphlib
import json
import logging
import re
import secrets
import string
import threading
import uuid
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

import kfp
import kfp_server_api
import yaml
from google.protobuf import json_format
from kfp.pipeline_spec import pipeline_spec_pb2

log = logging.getLogger(__name__)

API = "/apis/v2beta1"

# google.rpc.Code for each HTTP status the fake answers with (grpc-gateway's mapping, inverted).
GRPC_CODES = {400: 3, 401: 16, 403: 7, 404: 5, 405: 12, 409: 6, 411: 3, 429: 8, 500: 13, 501: 12, 503: 14, 504: 4}

# Fields the models type as 'str' that are int64 in the protos: protobuf's JSON mapping takes a number or a string.
INT64_FIELDS = frozenset(
    {
        ("V2beta1RecurringRun", "max_concurrency"),
        ("V2beta1PeriodicSchedule", "interval_second"),
        ("V2beta1Predicate", "long_value"),
        ("PredicateLongValues", "values"),
        ("V2beta1PipelineTaskDetail", "execution_id"),
        ("V2beta1RunDetails", "pipeline_context_id"),
        ("V2beta1RunDetails", "pipeline_run_context_id"),
        ("V2beta1ArtifactList", "artifact_ids"),
    }
)
# Fields the models type as 'object' that are a google.protobuf.Struct (a JSON object), not any JSON value.
STRUCT_FIELDS = frozenset(
    {
        ("V2beta1Run", "pipeline_spec"),
        ("V2beta1RecurringRun", "pipeline_spec"),
        ("V2beta1PipelineVersion", "pipeline_spec"),
        ("InlineObject1", "pipeline_spec"),
    }
)

# Filter.Predicate.Operation by enum number (protobuf's JSON mapping accepts the number or the name).
PREDICATE_OPERATIONS = {
    0: "OPERATION_UNSPECIFIED",
    1: "EQUALS",
    2: "NOT_EQUALS",
    3: "GREATER_THAN",
    5: "GREATER_THAN_EQUALS",
    6: "LESS_THAN",
    7: "LESS_THAN_EQUALS",
    8: "IN",
    9: "IS_SUBSTRING",
}
# Predicate value fields (the oneof), by proto name and JSON name.
PREDICATE_VALUES = {
    "int_value": "int_value",
    "intValue": "int_value",
    "long_value": "long_value",
    "longValue": "long_value",
    "string_value": "string_value",
    "stringValue": "string_value",
    "timestamp_value": "timestamp_value",
    "timestampValue": "timestamp_value",
    "int_values": "int_values",
    "intValues": "int_values",
    "long_values": "long_values",
    "longValues": "long_values",
    "string_values": "string_values",
    "stringValues": "string_values",
}

RUN_STATES = tuple(kfp_server_api.V2beta1RuntimeState.allowable_values)
TERMINAL_STATES = frozenset({"SUCCEEDED", "FAILED", "SKIPPED", "CANCELED"})

# parameterType of a pipeline input -> the JSON types a runtime parameter value may have.
PARAMETER_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "STRING": (str,),
    "NUMBER_INTEGER": (int, float),  # any google.protobuf.Value number: the server does not ask for an integral one
    "NUMBER_DOUBLE": (int, float),
    "BOOLEAN": (bool,),
    "LIST": (list,),
    "STRUCT": (dict,),
}

RFC3339 = re.compile(r"\d{4}-\d{2}-\d{2}[Tt]\d{2}:\d{2}:\d{2}(\.\d{1,9})?([Zz]|[+-]\d{2}:\d{2})")
DECIMAL = re.compile(r"-?\d+")

# robfig/cron as the KFP scheduled-workflow controller configures it: seconds first, day of week optional.
CRON_FIELDS = ("second", "minute", "hour", "day_of_month", "month", "day_of_week")
CRON_RANGES = {
    "second": (0, 59),
    "minute": (0, 59),
    "hour": (0, 23),
    "day_of_month": (1, 31),
    "month": (1, 12),
    "day_of_week": (0, 6),
}
CRON_NAMES = {
    "month": {m: i + 1 for i, m in enumerate("JAN FEB MAR APR MAY JUN JUL AUG SEP OCT NOV DEC".split())},
    "day_of_week": {d: i for i, d in enumerate("SUN MON TUE WED THU FRI SAT".split())},
}
CRON_DESCRIPTORS = frozenset({"@yearly", "@annually", "@monthly", "@weekly", "@daily", "@midnight", "@hourly"})


class KfpError(Exception):
    """An error answer: HTTP status and message; ``violation`` puts it in :attr:`FakeKfp.errors` too."""

    def __init__(self, status: int, message: str, *, violation: bool | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.violation = status == 400 if violation is None else violation


def now_rfc3339() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    return {bool: "boolean", int: "number", float: "number", str: "string", list: "array", dict: "object"}.get(
        type(value), type(value).__name__
    )


def _is_enum(type_name: str) -> bool:
    model = getattr(kfp_server_api.models, type_name, None)
    return model is not None and hasattr(model, "openapi_types") and not model.openapi_types


def _model(type_name: str) -> Any:
    model = getattr(kfp_server_api.models, type_name, None)
    if model is None or not hasattr(model, "openapi_types"):
        raise KeyError(f"no kfp_server_api model {type_name!r}")
    return model


def schema_violations(
    value: Any, type_name: str, path: str = "$", *, int64: bool = False, struct: bool = False
) -> list[str]:
    """What keeps ``value`` (parsed JSON) from deserializing into ``type_name`` (an ``openapi_types`` type string)."""
    if value is None:  # protobuf's JSON mapping reads null as "not set"
        return []
    if match := re.fullmatch(r"list\[(.+)\]", type_name):
        if not isinstance(value, list):
            return [f"{path}: expected an array, got {_kind(value)}"]
        return [
            v for i, item in enumerate(value) for v in schema_violations(item, match[1], f"{path}[{i}]", int64=int64)
        ]
    if match := re.fullmatch(r"dict\(str, (.+)\)", type_name):
        if not isinstance(value, dict):
            return [f"{path}: expected an object, got {_kind(value)}"]
        return [v for key, item in value.items() for v in schema_violations(item, match[1], f"{path}.{key}")]
    if type_name == "str":
        if int64:
            if (isinstance(value, int) and not isinstance(value, bool)) or (
                isinstance(value, str) and DECIMAL.fullmatch(value)
            ):
                return []
            return [f"{path}: expected an int64 (number or decimal string), got {_kind(value)} {value!r}"]
        return [] if isinstance(value, str) else [f"{path}: expected a string, got {_kind(value)}"]
    if type_name in ("int", "long"):
        if (isinstance(value, int) and not isinstance(value, bool)) or (
            isinstance(value, str) and DECIMAL.fullmatch(value)
        ):
            return []
        return [f"{path}: expected an integer, got {_kind(value)} {value!r}"]
    if type_name == "float":
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        return [] if ok else [f"{path}: expected a number, got {_kind(value)}"]
    if type_name == "bool":
        return [] if isinstance(value, bool) else [f"{path}: expected a boolean, got {_kind(value)}"]
    if type_name in ("datetime", "date"):
        if isinstance(value, str) and RFC3339.fullmatch(value):
            return []
        return [f"{path}: expected an RFC 3339 timestamp, got {value!r}"]
    if type_name == "object":
        if struct and not isinstance(value, dict):
            return [f"{path}: expected an object (google.protobuf.Struct), got {_kind(value)}"]
        return []
    model = _model(type_name)
    if not model.openapi_types:  # an enum
        allowed = getattr(model, "allowable_values", [])
        if isinstance(value, str) and value in allowed:
            return []
        return [f"{path}: {value!r} is not a {type_name} (one of {', '.join(allowed)})"]
    if not isinstance(value, dict):
        return [f"{path}: expected a {type_name} object, got {_kind(value)}"]
    attributes = {json_key: attr for attr, json_key in model.attribute_map.items()}
    violations = []
    for key, item in value.items():
        attr = attributes.get(key)
        if attr is None:
            violations.append(f"{path}.{key}: unknown field of {type_name}")
            continue
        violations += schema_violations(
            item,
            model.openapi_types[attr],
            f"{path}.{key}",
            int64=(type_name, attr) in INT64_FIELDS,
            struct=(type_name, attr) in STRUCT_FIELDS,
        )
    return violations


class _Raw:
    """What ``ApiClient.deserialize`` reads from a response."""

    def __init__(self, data: Any) -> None:
        self.data = json.dumps(data)


_DESERIALIZER = kfp_server_api.ApiClient()


def deserialize(data: Any, type_name: str) -> Any:
    """``data`` as the ``kfp_server_api`` model the client would build from it."""
    return _DESERIALIZER.deserialize(_Raw(data), type_name)


# ---------------------------------------------------------------------------------------------------------- records


@dataclass
class Record:
    """A stored resource: ``resource`` is the JSON a GET returns (``record["state"]`` reads from it)."""

    resource: dict[str, Any]

    def __getitem__(self, key: str) -> Any:
        return self.resource[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.resource.get(key, default)


@dataclass
class ExperimentRecord(Record):
    @property
    def id(self) -> str:
        return self.resource["experiment_id"]


@dataclass
class PipelineRecord(Record):
    @property
    def id(self) -> str:
        return self.resource["pipeline_id"]


@dataclass
class VersionRecord(Record):
    """A pipeline version and the package it was uploaded from."""

    package: bytes  # the uploaded file, byte for byte
    filename: str
    pipeline_spec: dict[str, Any]  # the first YAML document
    platform_spec: dict[str, Any] | None  # the second one, if any

    @property
    def id(self) -> str:
        return self.resource["pipeline_version_id"]


def _spec_parameters(resource: Mapping[str, Any]) -> dict[str, Any]:
    return dict((resource.get("runtime_config") or {}).get("parameters") or {})


@dataclass
class RunRecord(Record):
    spec: dict[str, Any] | None = None  # the pipeline spec it runs
    outcome: str | None = None  # this run's final state; FakeKfp.run_outcome when None
    polls: int = 0  # GETs of this run so far

    @property
    def id(self) -> str:
        return self.resource["run_id"]

    @property
    def state(self) -> str:
        return self.resource["state"]

    @property
    def parameters(self) -> dict[str, Any]:
        """``runtime_config.parameters`` as received (JSON values)."""
        return _spec_parameters(self.resource)


@dataclass
class RecurringRunRecord(Record):
    @property
    def id(self) -> str:
        return self.resource["recurring_run_id"]

    @property
    def mode(self) -> str:
        return self.resource["mode"]

    @property
    def enabled(self) -> bool:
        return self.resource["mode"] == "ENABLE"

    @property
    def max_concurrency(self) -> int:
        return int(self.resource["max_concurrency"])

    @property
    def no_catchup(self) -> bool:
        return bool(self.resource.get("no_catchup", False))

    @property
    def cron(self) -> str | None:
        return (self.resource["trigger"].get("cron_schedule") or {}).get("cron")

    @property
    def cron_fields(self) -> dict[str, str] | None:
        """The cron expression by field, as the scheduler reads it (seconds first; 5 fields = no day of week)."""
        if self.cron is None or self.cron.startswith("@"):
            return None
        return dict(zip(CRON_FIELDS, [*self.cron.split(), "*"], strict=False))

    @property
    def interval_second(self) -> int | None:
        periodic = self.resource["trigger"].get("periodic_schedule")
        return None if periodic is None else int(periodic["interval_second"])

    @property
    def parameters(self) -> dict[str, Any]:
        return _spec_parameters(self.resource)


@dataclass(frozen=True)
class FormPart:
    name: str
    filename: str | None
    content_type: str
    data: bytes


@dataclass(frozen=True)
class RecordedRequest:
    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]  # names in lower case
    body: Any  # parsed JSON, {name: FormPart} for multipart, None when empty, raw bytes when unparseable
    raw_body: bytes


@dataclass
class _Fault:
    method: str
    path: re.Pattern[str]
    status: int
    remaining: int
    message: str


@dataclass
class _Call:
    """One routed request, for a handler."""

    params: dict[str, str]  # path parameters
    query: dict[str, str]
    body: Any
    headers: dict[str, str] = field(default_factory=dict)  # lower-cased names


Handler = Callable[[_Call], tuple[str | None, Any]]  # -> (response model name or None for '{}', JSON)


@dataclass(frozen=True)
class _Route:
    method: str
    pattern: re.Pattern[str]
    handler: Handler
    query: frozenset[str] = frozenset()
    body: str | None = None  # the model a JSON body must deserialize into
    multipart: bool = False


# -------------------------------------------------------------------------------------------------- validation


def _cron_violations(cron: str) -> list[str]:
    if cron.startswith("@"):
        if cron in CRON_DESCRIPTORS or re.fullmatch(r"@every (\d+(\.\d+)?(ns|us|µs|ms|s|m|h))+", cron):
            return []
        return [f"cron {cron!r}: unknown descriptor"]
    fields = cron.split()
    if len(fields) not in (5, 6):
        return [f"cron {cron!r}: expected 5 or 6 fields (seconds first, day of week optional), got {len(fields)}"]
    violations = []
    for name, text in zip(CRON_FIELDS, fields, strict=False):
        low, high = CRON_RANGES[name]
        names = CRON_NAMES.get(name, {})
        for part in text.split(","):
            match = re.fullmatch(r"(\*|\?|[0-9A-Za-z]+(?:-[0-9A-Za-z]+)?)(?:/(\d+))?", part)
            if match is None or (match[1] == "?" and name not in ("day_of_month", "day_of_week")):
                violations.append(f"cron {cron!r}: bad {name} {part!r}")
                continue
            if match[1] in ("*", "?"):
                continue
            for bound in match[1].split("-"):
                number = names.get(bound.upper()) if not bound.isdigit() else int(bound)
                if number is None or not low <= number <= high:
                    violations.append(f"cron {cron!r}: {name} {bound!r} is outside {low}-{high}")
    return violations


def _load_pipeline_package(data: bytes) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The pipeline spec and platform spec in a compiled package (YAML or JSON); KfpError(400) if it is not one."""
    try:
        docs = [doc for doc in yaml.safe_load_all(data.decode("utf-8")) if doc is not None]
    except (UnicodeDecodeError, yaml.YAMLError) as error:
        raise KfpError(400, f"Failed to parse the pipeline package: not YAML: {error}") from error
    if not docs or len(docs) > 2:
        raise KfpError(400, f"Invalid pipeline package: expected 1 or 2 YAML documents, got {len(docs)}")
    spec = docs[0]
    platform = docs[1] if len(docs) == 2 else None
    _check_pipeline_spec(spec, platform)
    return spec, platform


def _check_pipeline_spec(spec: Any, platform: Any | None) -> None:
    if not isinstance(spec, dict):
        raise KfpError(400, f"Invalid pipeline spec: expected a mapping, got {_kind(spec)}")
    missing = [key for key in ("pipelineInfo", "root", "schemaVersion") if key not in spec]
    if missing:
        raise KfpError(400, f"Invalid pipeline spec: missing {', '.join(missing)}")
    if not (spec["pipelineInfo"] or {}).get("name"):
        raise KfpError(400, "Invalid pipeline spec: pipelineInfo.name is empty")
    try:
        json_format.ParseDict(spec, pipeline_spec_pb2.PipelineSpec())
    except json_format.ParseError as error:
        raise KfpError(400, f"Invalid pipeline spec: {error}") from error
    if platform is not None:
        if not isinstance(platform, dict):
            raise KfpError(400, f"Invalid platform spec: expected a mapping, got {_kind(platform)}")
        try:
            json_format.ParseDict(platform, pipeline_spec_pb2.PlatformSpec())
        except json_format.ParseError as error:
            raise KfpError(400, f"Invalid platform spec: {error}") from error


def _split_inline_spec(body_spec: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """A run's ``pipeline_spec``: the spec itself or ``{"pipeline_spec": ..., "platform_spec": ...}`` (kfp's form)."""
    if "pipeline_spec" in body_spec:
        unknown = set(body_spec) - {"pipeline_spec", "platform_spec"}
        if unknown:
            raise KfpError(400, f"Invalid pipeline spec: unknown keys {sorted(unknown)} next to pipeline_spec")
        spec, platform = body_spec["pipeline_spec"], body_spec.get("platform_spec")
    else:
        spec, platform = body_spec, None
    _check_pipeline_spec(spec, platform)
    return spec, platform


def _parameter_violations(spec: Mapping[str, Any], parameters: Mapping[str, Any]) -> list[str]:
    """What validatePipelineJobInputs says of ``parameters``, in its words (it returns at the first)."""
    declared: dict[str, Any] = ((spec.get("root") or {}).get("inputDefinitions") or {}).get("parameters") or {}
    words = {
        "NUMBER_INTEGER": "double or integer",
        "NUMBER_DOUBLE": "double or integer",
        "STRING": "string",
        "BOOLEAN": "bool",
        "LIST": "list",
        "STRUCT": "struct",
    }
    for name, decl in declared.items():
        if name not in parameters:
            if "defaultValue" not in decl and not decl.get("isOptional"):
                return [f"parameter {name} is not optional, yet has neither default value nor user provided value"]
            continue
        kind, value = decl.get("parameterType"), parameters[name]
        json_types = PARAMETER_JSON_TYPES.get(kind)
        if json_types is None:
            continue
        if not isinstance(value, json_types) or (isinstance(value, bool) and bool not in json_types):
            return [
                f"input parameter {name} requires type {words[kind]}, but the parameter value is not of "
                f"{'number' if kind.startswith('NUMBER') else words[kind]} value type"
            ]
    extra = [name for name in parameters if name not in declared]
    return [f"parameter(s) provided are not required by pipeline: {', '.join(extra)}"] if extra else []


def _parse_filter(text: str, model_name: str) -> list[tuple[str, str, Any]]:
    """A ``filter`` query parameter as (operation, key, value) triples; KfpError(400) when it is not a valid Filter."""
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError as error:
        raise KfpError(400, f"Invalid filter: not JSON: {error}") from error
    if not isinstance(parsed, dict) or set(parsed) - {"predicates"}:
        raise KfpError(400, f"Invalid filter: expected {{'predicates': [...]}}, got {text}")
    predicates = parsed.get("predicates") or []
    if not isinstance(predicates, list):
        raise KfpError(400, "Invalid filter: predicates must be an array")
    model = _model(model_name)
    string_keys = {attr for attr, kind in model.openapi_types.items() if kind == "str" or _is_enum(kind)}
    if "name" not in string_keys and "display_name" in string_keys:
        string_keys.add("name")  # the server maps "name" to the display name
    triples = []
    for index, predicate in enumerate(predicates):
        where = f"predicates[{index}]"
        if not isinstance(predicate, dict):
            raise KfpError(400, f"Invalid filter: {where} is not an object")
        unknown = set(predicate) - {"operation", "key"} - set(PREDICATE_VALUES)
        if unknown:
            raise KfpError(400, f"Invalid filter: {where} has unknown fields {sorted(unknown)}")
        operation = predicate.get("operation")
        if isinstance(operation, int) and not isinstance(operation, bool):
            operation = PREDICATE_OPERATIONS.get(operation, operation)
        if operation not in PREDICATE_OPERATIONS.values() or operation == "OPERATION_UNSPECIFIED":
            raise KfpError(400, f"Invalid filter: {where} has an invalid operation {predicate.get('operation')!r}")
        key = predicate.get("key")
        if not isinstance(key, str) or not key:
            raise KfpError(400, f"Invalid filter: {where} has no key")
        values = {PREDICATE_VALUES[k]: v for k, v in predicate.items() if k in PREDICATE_VALUES}
        if len(values) != 1:
            raise KfpError(
                400, f"Invalid filter: {where} needs exactly one value field, got {sorted(values) or 'none'}"
            )
        ((value_field, value),) = values.items()
        value_type = _model("V2beta1Predicate").openapi_types[value_field]
        violations = schema_violations(
            value, value_type, f"filter.{where}.{value_field}", int64=value_field == "long_value"
        )
        if violations:
            raise KfpError(400, f"Invalid filter: {'; '.join(violations)}")
        if key not in string_keys:
            raise KfpError(400, f"Invalid filter: {where}: key {key!r} is not a string field of {model_name}")
        if operation in ("EQUALS", "NOT_EQUALS", "IS_SUBSTRING"):
            if value_field != "string_value":
                raise KfpError(400, f"Invalid filter: {where}: {operation} on {key!r} needs a string_value")
        elif operation == "IN":
            if value_field != "string_values":
                raise KfpError(400, f"Invalid filter: {where}: IN on {key!r} needs string_values")
            value = list(value.get("values") or [])
        else:
            raise KfpError(400, f"Invalid filter: {where}: operation {operation} is not supported by FakeKfp")
        triples.append(
            (operation, "display_name" if key == "name" and "name" not in model.openapi_types else key, value)
        )
    return triples


def _matches(resource: Mapping[str, Any], triples: Iterable[tuple[str, str, Any]]) -> bool:
    for operation, key, value in triples:
        actual = str(resource.get(key) or "")
        if operation == "EQUALS" and actual != value:
            return False
        if operation == "NOT_EQUALS" and actual == value:
            return False
        if operation == "IN" and actual not in value:
            return False
        if operation == "IS_SUBSTRING" and value not in actual:
            return False
    return True


def _query_int(query: Mapping[str, str], name: str, default: int) -> int:
    text = query.get(name, "")
    if text == "":
        return default
    if not DECIMAL.fullmatch(text) or int(text) < 0:
        raise KfpError(400, f"Invalid {name} {text!r}: expected a non-negative integer")
    return int(text)


def _parse_multipart(content_type: str, body: bytes) -> dict[str, FormPart]:
    if not content_type.lower().startswith("multipart/form-data"):
        raise KfpError(400, f"Expected multipart/form-data, got Content-Type {content_type!r}")
    message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(
        b"Content-Type: " + content_type.encode("latin-1") + b"\r\n\r\n" + body
    )
    if not message.is_multipart() or message.defects:
        raise KfpError(400, f"Malformed multipart/form-data body: {message.defects or 'no parts'}")
    parts: dict[str, FormPart] = {}
    for part in message.iter_parts():
        name = part.get_param("name", header="content-disposition")
        if part.get_content_disposition() != "form-data" or not isinstance(name, str):
            raise KfpError(400, "Malformed multipart/form-data body: a part without a form-data name")
        if name in parts:
            raise KfpError(400, f"Malformed multipart/form-data body: part {name!r} given twice")
        payload = part.get_payload(decode=True)
        data = payload if isinstance(payload, bytes) else b""
        parts[name] = FormPart(name, part.get_filename(), part.get_content_type(), data)
    return parts


def _argo_nodes(spec: Mapping[str, Any], failing: str) -> list[tuple[str, str]]:
    """(display name, state) of the Argo nodes a run of ``spec`` leaves when ``failing`` fails: a step, a task's
    "<task>-driver" or "root-driver" ("": none).

    kubeflow/pipelines 2.x, backend/src/v2/compiler/argocompiler: the workflow is named after the pipeline
    (argo.go, GenerateName from pipelineInfo.name), its entrypoint runs "root-driver" and the "root" DAG; every task
    of a DAG is a "<task>-driver" pod then a "<task>" node (dag.go), which for a step is the system-container-executor
    DAG around one "executor" pod (container.go, addContainerExecutorTemplate), and for a group its sub-DAG. A failure
    fails every node around it; what comes after a failed task is not started (the API shows no node for it), but an
    exit task (triggerPolicy ALL_UPSTREAM_TASKS_COMPLETED, an exit hook from 2.4.0) still runs.
    """
    components = spec.get("components") or {}
    nodes: list[tuple[str, str]] = []

    def run_dag(dag: Mapping[str, Any]) -> bool:
        tasks = dag.get("tasks") or {}
        graph = {name: sorted(set(task.get("dependentTasks") or ()) & set(tasks)) for name, task in tasks.items()}
        failed = False
        for name in graphlib.TopologicalSorter(graph).static_order():
            task = tasks[name]
            exit_task = (task.get("triggerPolicy") or {}).get("strategy") == "ALL_UPSTREAM_TASKS_COMPLETED"
            if failed and not exit_task:
                continue
            if failing == f"{name}-driver":
                nodes.append((failing, "FAILED"))
                failed = True
                continue
            nodes.append((f"{name}-driver", "SUCCEEDED"))
            component = components.get(task["componentRef"]["name"]) or {}
            if "dag" in component:
                task_failed = run_dag(component["dag"])
                nodes.append((name, "FAILED" if task_failed else "SUCCEEDED"))
            else:
                task_failed = name == failing
                state = "FAILED" if task_failed else "SUCCEEDED"
                nodes.extend([(name, state), ("executor", state)])
            failed = failed or task_failed
        return failed

    workflow = f"{spec['pipelineInfo']['name']}-{''.join(secrets.choice(string.ascii_lowercase) for _ in range(5))}"
    if failing == "root-driver":
        return [(workflow, "FAILED"), ("root-driver", "FAILED")]
    state = "FAILED" if run_dag(spec["root"]["dag"]) else "SUCCEEDED"
    return [(workflow, state), ("root-driver", "SUCCEEDED"), ("root", state), *nodes]


def _steps_in_order(spec: Mapping[str, Any]) -> list[str]:
    """The pipeline's steps (its container tasks) in the order a run reaches them: the nodes an "executor" follows."""
    names = [name for name, _ in _argo_nodes(spec, "")]
    return [name for name, after in zip(names, names[1:], strict=False) if after == "executor"]


# -------------------------------------------------------------------------------------------------------- server


class _RequestHandler(BaseHTTPRequestHandler):
    server: _HttpServer

    def _serve(self) -> None:
        length = self.headers.get("Content-Length")
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            status, payload = 411, {"error": "chunked bodies are not supported by FakeKfp"}
        else:
            body = self.rfile.read(int(length)) if length else b""
            status, payload = self.server.fake._dispatch(self.command, self.path, dict(self.headers.items()), body)
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = do_DELETE = do_PUT = do_PATCH = _serve

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("FakeKfp: " + format, *args)


class _HttpServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, fake: FakeKfp) -> None:
        super().__init__(("127.0.0.1", 0), _RequestHandler)
        self.fake = fake


class KubernetesAuthorizer:
    """KFP's multi-user authorization, against a real Kubernetes API server (kubeflow/pipelines 2.17.0):

    - the user is the bearer token's, as a TokenReview with the audience pipelines.kubeflow.org says
      (backend/src/apiserver/auth/authenticator_token_review.go, doTokenReview; the audience is
      common.DefaultTokenReviewAudience, TOKEN_REVIEW_AUDIENCE unset); no token, or one the review does not
      authenticate: 401 Unauthenticated (resource/resource_manager.go IsAuthorized: "User identity is empty in the
      request header"). The kubeflow-userid header the UI's Istio gateway sets is not played: the CLI never sends it.
    - then a SubjectAccessReview for that user of group pipelines.kubeflow.org, version v1beta1, the resource type
      (experiments, runs, jobs for recurring runs, pipelines), the verb and the namespace (IsAuthorized); not
      allowed: 403 PermissionDenied, "User '<user>' is not authorized with reason: <reason> (request: ...)".
    """

    GROUP, VERSION, AUDIENCE = "pipelines.kubeflow.org", "v1beta1", "pipelines.kubeflow.org"

    def __init__(self, api_client: Any) -> None:
        import kubernetes

        self.authn = kubernetes.client.AuthenticationV1Api(api_client)
        self.authz = kubernetes.client.AuthorizationV1Api(api_client)

    def user(self, headers: Mapping[str, str]) -> str:
        header = headers.get("authorization", "")
        if not header.startswith("Bearer "):
            raise KfpError(
                401,
                "Failed to check authorization. User identity is empty in the request header: Request "
                "header error: there is no user identity header.",
                violation=False,
            )
        review = self.authn.create_token_review(
            {"spec": {"token": header.removeprefix("Bearer "), "audiences": [self.AUDIENCE]}}
        )
        if not review.status.authenticated or self.AUDIENCE not in (review.status.audiences or []):
            raise KfpError(
                401,
                "Failed to check authorization. User identity is empty in the request header: "
                "Authentication failure: Review.Status.Authenticated is false. Error "
                f"{review.status.error or ''}",
                violation=False,
            )
        return review.status.user.username

    def authorize(self, headers: Mapping[str, str], resource: str, verb: str, namespace: str, name: str = "") -> None:
        user = self.user(headers)
        attributes = {
            "group": self.GROUP,
            "version": self.VERSION,
            "resource": resource,
            "verb": verb,
            "namespace": namespace,
            **({"name": name} if name else {}),
        }
        review = self.authz.create_subject_access_review({"spec": {"user": user, "resourceAttributes": attributes}})
        if not review.status.allowed:
            raise KfpError(
                403,
                f"User '{user}' is not authorized with reason: {review.status.reason or ''} "
                f"(request: {attributes}): Unauthorized access",
                violation=False,
            )


class FakeKfp:
    """The fake API server; a context manager that starts it on a free loopback port and stops it."""

    def __init__(
        self,
        *,
        require_token: str | None = None,
        multi_user: bool = False,
        tag_name: str = "2.17.0",
        run_outcome: str = "SUCCEEDED",
        run_progression: Sequence[str] = ("RUNNING",),
        failed_task: str = "",
        check_parameters: bool = True,
        path_prefix: str = "",
        authorizer: KubernetesAuthorizer | None = None,
    ) -> None:
        self.require_token = require_token
        # Multi-user mode's authorization (with multi_user): None, none at all.
        self.authorizer = authorizer
        # Served under this prefix too, as kfp.Client reaches KFP through a kubeconfig: the Kubernetes API
        # server's service proxy, e.g. /api/v1/namespaces/kubeflow/services/ml-pipeline:http/proxy.
        self.path_prefix = path_prefix.rstrip("/")
        self.multi_user = multi_user
        # What healthz reports as the backend's version: a release's tag ("2.17.0"), or "unknown" for an image built
        # without TAG_NAME (kubeflow/pipelines#11573).
        self.tag_name = tag_name
        self.run_outcome = run_outcome
        self.run_progression = run_progression
        # Where a FAILED run fails: a step, a task's "<task>-driver" or "root-driver" ("": its first step).
        self.failed_task = failed_task
        self.check_parameters = check_parameters
        self.errors: list[str] = []
        self.requests: list[RecordedRequest] = []
        self.experiments: dict[str, ExperimentRecord] = {}
        self.pipelines: dict[str, PipelineRecord] = {}
        self.versions: dict[str, VersionRecord] = {}
        self.runs: dict[str, RunRecord] = {}
        self.recurring_runs: dict[str, RecurringRunRecord] = {}
        self._faults: list[_Fault] = []
        self._lock = threading.RLock()
        self._server: _HttpServer | None = None
        self._thread: threading.Thread | None = None
        self._routes = self._make_routes()

    # ------------------------------------------------------------------------------------------- lifecycle

    def start(self) -> FakeKfp:
        self._server = _HttpServer(self)
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,), name="FakeKfp", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def __enter__(self) -> FakeKfp:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    @property
    def port(self) -> int:
        if self._server is None:
            raise RuntimeError("FakeKfp is not started")
        return self._server.server_address[1]

    @property
    def url(self) -> str:
        """The host to give ``kfp.Client(host=...)``."""
        return f"http://127.0.0.1:{self.port}"

    # ------------------------------------------------------------------------------------------- settings

    @property
    def run_outcome(self) -> str:
        """The state runs end in (any V2beta1RuntimeState; a non-terminal one makes them stay there)."""
        return self._run_outcome

    @run_outcome.setter
    def run_outcome(self, state: str) -> None:
        if state not in RUN_STATES:
            raise ValueError(f"run_outcome {state!r} is not a V2beta1RuntimeState ({', '.join(RUN_STATES)})")
        self._run_outcome = state

    @property
    def run_progression(self) -> tuple[str, ...]:
        """The states a run passes through, one per GET, between PENDING and the outcome."""
        return self._run_progression

    @run_progression.setter
    def run_progression(self, states: Sequence[str]) -> None:
        bad = [state for state in states if state not in RUN_STATES]
        if bad:
            raise ValueError(f"run_progression: {bad} are not V2beta1RuntimeState values")
        self._run_progression = tuple(states)

    # -------------------------------------------------------------------------------------------- helpers

    def client(self, **kwargs: Any) -> kfp.Client:
        """A real ``kfp.Client`` on this server (with ``existing_token`` when a token is required)."""
        if self.require_token is not None:
            kwargs.setdefault("existing_token", self.require_token)
        with warnings.catch_warnings():
            warnings.simplefilter(
                "ignore", FutureWarning
            )  # "This client only works with Kubeflow Pipeline v2.0.0-beta.2"
            return kfp.Client(host=self.url, **kwargs)

    def fail_next(
        self, method: str, path_regex: str, status: int = 503, times: int = 1, message: str | None = None
    ) -> None:
        """Answer the next ``times`` requests of ``method`` whose path matches ``path_regex`` (re.search) with
        ``status`` and a Status body, before authentication and routing."""
        with self._lock:
            self._faults.append(
                _Fault(method.upper(), re.compile(path_regex), status, times, message or f"injected failure ({status})")
            )

    def requests_to(self, method: str, path_regex: str) -> list[RecordedRequest]:
        """The recorded requests of ``method`` whose path matches ``path_regex`` (re.search)."""
        pattern = re.compile(path_regex)
        with self._lock:
            return [r for r in self.requests if r.method == method.upper() and pattern.search(r.path)]

    def pipeline_named(self, name: str) -> PipelineRecord | None:
        with self._lock:
            return next((p for p in self.pipelines.values() if p.get("display_name") == name), None)

    def versions_of(self, pipeline_id: str) -> list[VersionRecord]:
        with self._lock:
            return [v for v in self.versions.values() if v["pipeline_id"] == pipeline_id]

    # ------------------------------------------------------------------------------------------- dispatch

    def _dispatch(self, method: str, raw_path: str, headers: dict[str, str], raw_body: bytes) -> tuple[int, Any]:
        with self._lock:
            split = urlsplit(raw_path)
            path = split.path
            if self.path_prefix:  # only under the prefix: anything else finds no route (a 404, in .errors)
                path = unquote(path)  # the client sends the proxy path's ":" as %3A
                inside = path.startswith(self.path_prefix + "/")
                path = "/" + path[len(self.path_prefix) :].lstrip("/") if inside else "/outside-the-proxy" + path
            lower_headers = {name.lower(): value for name, value in headers.items()}
            pairs = parse_qsl(split.query, keep_blank_values=True)
            query = dict(pairs)
            try:
                body = self._parse_body(lower_headers.get("content-type", ""), raw_body)
                parse_error: KfpError | None = None
            except KfpError as error:
                body, parse_error = raw_body, error
            self.requests.append(RecordedRequest(method, path, query, lower_headers, body, raw_body))
            try:
                for fault in self._faults:
                    if fault.method == method and fault.path.search(path):
                        fault.remaining -= 1
                        if fault.remaining <= 0:
                            self._faults.remove(fault)
                        raise KfpError(fault.status, fault.message, violation=False)
                if self.require_token is not None:
                    if lower_headers.get("authorization") != f"Bearer {self.require_token}":
                        raise KfpError(401, "Unauthenticated: missing or wrong bearer token", violation=False)
                route, params = self._route(method, path)
                if len(pairs) != len(query):
                    raise KfpError(400, f"Repeated query parameters in {split.query!r}")
                unknown = set(query) - route.query
                if unknown:
                    raise KfpError(400, f"Unknown query parameters {sorted(unknown)} for {method} {path}")
                if parse_error is not None:
                    raise parse_error
                self._check_body(route, lower_headers, body)
                model_name, payload = route.handler(_Call(params, query, body, lower_headers))
                if model_name is not None:
                    violations = schema_violations(payload, model_name)
                    if violations:  # a bug in the fake, not in the client
                        raise KfpError(500, f"FakeKfp built an invalid {model_name}: {violations}", violation=True)
                    try:
                        deserialize(payload, model_name)
                    except (ValueError, TypeError) as error:
                        raise KfpError(
                            500, f"FakeKfp built an invalid {model_name}: {error}", violation=True
                        ) from error
                return 200, payload
            except KfpError as error:
                if error.violation:
                    self.errors.append(f"{method} {path}: {error.message}")
                    log.warning("FakeKfp rejected %s %s: %s", method, path, error.message)
                code = GRPC_CODES.get(error.status, 2)
                return error.status, {"error": error.message, "code": code, "message": error.message, "details": []}

    def _parse_body(self, content_type: str, raw_body: bytes) -> Any:
        if not raw_body:
            return None
        if content_type.lower().startswith("multipart/"):
            return _parse_multipart(content_type, raw_body)
        try:
            return json.loads(raw_body)
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise KfpError(400, f"The request body is not JSON: {error}") from error

    def _route(self, method: str, path: str) -> tuple[_Route, dict[str, str]]:
        allowed = []
        for route in self._routes:
            match = route.pattern.fullmatch(path)
            if match is None:
                continue
            if route.method == method:
                return route, match.groupdict()
            allowed.append(route.method)
        if allowed:
            raise KfpError(405, f"Method {method} not allowed on {path} (allowed: {allowed})", violation=True)
        raise KfpError(404, f"No route for {method} {path} in FakeKfp", violation=True)

    @staticmethod
    def _check_body(route: _Route, headers: Mapping[str, str], body: Any) -> None:
        if route.multipart:
            if not isinstance(body, dict) or not all(isinstance(p, FormPart) for p in body.values()):
                raise KfpError(400, "Expected a multipart/form-data body")
            return
        if route.body is None:
            if body not in (None, {}):
                raise KfpError(400, f"{route.method} takes no body here, got {body!r}")
            return
        if not headers.get("content-type", "").lower().startswith("application/json"):
            raise KfpError(400, f"Expected Content-Type application/json, got {headers.get('content-type')!r}")
        if not isinstance(body, dict):
            raise KfpError(400, f"Expected a JSON {route.body} object, got {_kind(body)}")
        violations = schema_violations(body, route.body)
        if violations:
            raise KfpError(400, f"Invalid {route.body}: {'; '.join(violations)}")
        try:
            deserialize(body, route.body)
        except (ValueError, TypeError) as error:
            raise KfpError(400, f"Invalid {route.body}: {error}") from error

    def _make_routes(self) -> list[_Route]:
        ident = r"[^/:]+"
        listing = frozenset({"page_token", "page_size", "sort_by", "filter"})

        def route(method: str, template: str, handler: Handler, **kwargs: Any) -> _Route:
            pieces = re.split(r"\{(\w+)\}", API + template)  # literal, name, literal, name, ...
            pattern = "".join(re.escape(p) if i % 2 == 0 else f"(?P<{p}>{ident})" for i, p in enumerate(pieces))
            return _Route(method, re.compile(pattern), handler, **kwargs)

        return [
            route("GET", "/healthz", self._healthz),
            route("POST", "/experiments", self._create_experiment, body="V2beta1Experiment"),
            route("GET", "/experiments", self._list_experiments, query=listing | {"namespace"}),
            route("GET", "/experiments/{experiment_id}", self._get_experiment),
            route("GET", "/pipelines", self._list_pipelines, query=listing | {"namespace"}),
            route(
                "POST",
                "/pipelines/upload",
                self._upload_pipeline,
                query=frozenset({"name", "display_name", "description", "namespace", "tags"}),
                multipart=True,
            ),
            route(
                "POST",
                "/pipelines/upload_version",
                self._upload_version,
                query=frozenset({"name", "display_name", "pipelineid", "description", "tags"}),
                multipart=True,
            ),
            route("GET", "/pipelines/{pipeline_id}", self._get_pipeline),
            route("GET", "/pipelines/{pipeline_id}/versions", self._list_versions, query=listing),
            route("GET", "/pipelines/{pipeline_id}/versions/{pipeline_version_id}", self._get_version),
            route("POST", "/runs", self._create_run, query=frozenset({"experiment_id"}), body="V2beta1Run"),
            route("GET", "/runs", self._list_runs, query=listing | {"namespace", "experiment_id"}),
            route("GET", "/runs/{run_id}", self._get_run, query=frozenset({"experiment_id"})),
            route("POST", "/recurringruns", self._create_recurring_run, body="V2beta1RecurringRun"),
            route("GET", "/recurringruns", self._list_recurring_runs, query=listing | {"namespace", "experiment_id"}),
            route("GET", "/recurringruns/{recurring_run_id}", self._get_recurring_run),
            route("POST", "/recurringruns/{recurring_run_id}:enable", self._enable_recurring_run),
            route("POST", "/recurringruns/{recurring_run_id}:disable", self._disable_recurring_run),
            route(
                "DELETE",
                "/recurringruns/{recurring_run_id}",
                self._delete_recurring_run,
                query=frozenset({"propagation_policy"}),
            ),
        ]

    # ---------------------------------------------------------------------------------------- listing

    def _page(
        self, records: Iterable[Record], query: Mapping[str, str], model_name: str, field_name: str
    ) -> dict[str, Any]:
        """Filter, sort and page ``records`` into a List*Response."""
        resources = [r.resource for r in records]
        if query.get("filter"):
            triples = _parse_filter(query["filter"], model_name)
            resources = [r for r in resources if _matches(r, triples)]
        sort_by = query.get("sort_by", "").strip()
        if sort_by:
            match = re.fullmatch(r"(\w+)(?: (asc|desc))?", sort_by)
            if match is None or match[1] not in _model(model_name).openapi_types:
                raise KfpError(400, f"Invalid sort_by {sort_by!r}: expected '<field of {model_name}> [asc|desc]'")
            resources.sort(key=lambda r: str(r.get(match[1], "")), reverse=match[2] == "desc")
        page_size = _query_int(query, "page_size", 20) or 20
        token = query.get("page_token", "")
        if token and not DECIMAL.fullmatch(token):
            raise KfpError(400, f"Invalid page_token {token!r}")
        start = int(token) if token else 0
        page = resources[start : start + page_size]
        response: dict[str, Any] = {"total_size": len(resources)}
        if page:
            response[field_name] = page
        if start + page_size < len(resources):
            response["next_page_token"] = str(start + page_size)
        return response

    # ---------------------------------------------------------------------------------------- handlers

    def _healthz(self, call: _Call) -> tuple[None, Any]:
        # kubeflow/pipelines backend/src/apiserver/main.go (2.x), startHTTPProxy: /apis/v2beta1/healthz is
        # a plain handler, not the gRPC gateway, writing commit_sha and tag_name (the image's COMMIT_SHA and TAG_NAME
        # build args, "unknown" when unset), multi_user and pipeline_store ("database" unless pipelines are stored
        # in Kubernetes). kfp_server_api's V2beta1GetHealthzResponse has only multi_user and pipeline_store, so the
        # answer is not checked against it: the client drops the other two.
        return None, {
            "commit_sha": "0123456789abcdef0123456789abcdef01234567",
            "tag_name": self.tag_name,
            "multi_user": self.multi_user,
            "pipeline_store": "database",
        }

    def _access(
        self, call: _Call, resource: str, verb: str, namespace: str, wrap: str, empty: str, name: str = ""
    ) -> None:
        """Multi-user mode's check of a call (the servers' canAccessExperiment, canAccessRun, canAccessJob): a
        namespace is required, then the authorizer decides; its refusal is wrapped as the server wraps it."""
        if not (self.multi_user and self.authorizer is not None):
            return
        if not namespace:
            raise KfpError(400, f"Invalid input error: {empty}", violation=False)
        try:
            self.authorizer.authorize(call.headers, resource, verb, namespace, name)
        except KfpError as error:
            raise KfpError(error.status, f"{wrap}: {error.message}", violation=False) from None

    def _create_experiment(self, call: _Call) -> tuple[str, Any]:
        body = call.body
        name = (body.get("display_name") or "").strip()
        if not name:
            raise KfpError(400, "Invalid input error: Experiment display_name is empty")
        namespace = body.get("namespace") or ""
        self._access(
            call,
            "experiments",
            "create",
            namespace,
            "Failed to authorize the request: Failed to authorize with API",
            "An experiment cannot have an empty namespace in multi-user mode",
            name,
        )
        if any(
            e.get("display_name") == name and e.get("namespace", "") == namespace for e in self.experiments.values()
        ):
            raise KfpError(409, f"Already exist error: experiment {name!r} already exists in namespace {namespace!r}")
        return "V2beta1Experiment", self._add_experiment(name, body.get("description"), namespace).resource

    def _add_experiment(self, name: str, description: str | None, namespace: str) -> ExperimentRecord:
        resource = {
            "experiment_id": str(uuid.uuid4()),
            "display_name": name,
            "created_at": now_rfc3339(),
            "storage_state": "AVAILABLE",
        }
        if description:
            resource["description"] = description
        if namespace:
            resource["namespace"] = namespace
        record = ExperimentRecord(resource)
        self.experiments[record.id] = record
        return record

    def _experiment(self, experiment_id: str) -> ExperimentRecord:
        record = self.experiments.get(experiment_id)
        if record is None:
            raise KfpError(404, f"Experiment {experiment_id} not found")
        return record

    def _get_experiment(self, call: _Call) -> tuple[str, Any]:
        record = self._experiment(call.params["experiment_id"])
        self._access(
            call,
            "experiments",
            "get",
            record.get("namespace", ""),
            "Failed to authorize the request: Failed to authorize with API",
            "An experiment cannot have an empty namespace in multi-user mode",
            record["display_name"],
        )
        return "V2beta1Experiment", record.resource

    def _list_experiments(self, call: _Call) -> tuple[str, Any]:
        namespace = call.query.get("namespace", "")
        self._access(
            call,
            "experiments",
            "list",
            namespace,
            "Failed to authorize with API: Failed to authorize with API",
            "An experiment cannot have an empty namespace in multi-user mode",
        )
        records = [e for e in self.experiments.values() if not namespace or e.get("namespace", "") == namespace]
        return "V2beta1ListExperimentsResponse", self._page(records, call.query, "V2beta1Experiment", "experiments")

    def _pipeline(self, pipeline_id: str) -> PipelineRecord:
        record = self.pipelines.get(pipeline_id)
        if record is None:
            raise KfpError(404, f"Pipeline {pipeline_id} not found")
        return record

    def _version(self, pipeline_id: str, version_id: str) -> VersionRecord:
        self._pipeline(pipeline_id)
        record = self.versions.get(version_id)
        if record is None or record["pipeline_id"] != pipeline_id:
            raise KfpError(404, f"Pipeline version {version_id} of pipeline {pipeline_id} not found")
        return record

    def _list_pipelines(self, call: _Call) -> tuple[str, Any]:
        namespace = call.query.get("namespace", "")
        records = [p for p in self.pipelines.values() if not namespace or p.get("namespace", "") == namespace]
        return "V2beta1ListPipelinesResponse", self._page(records, call.query, "V2beta1Pipeline", "pipelines")

    def _get_pipeline(self, call: _Call) -> tuple[str, Any]:
        return "V2beta1Pipeline", self._pipeline(call.params["pipeline_id"]).resource

    def _list_versions(self, call: _Call) -> tuple[str, Any]:
        records = self.versions_of(self._pipeline(call.params["pipeline_id"]).id)
        response = self._page(records, call.query, "V2beta1PipelineVersion", "pipeline_versions")
        return "V2beta1ListPipelineVersionsResponse", response

    def _get_version(self, call: _Call) -> tuple[str, Any]:
        return "V2beta1PipelineVersion", self._version(
            call.params["pipeline_id"], call.params["pipeline_version_id"]
        ).resource

    @staticmethod
    def _uploaded_file(call: _Call) -> FormPart:
        part = call.body.get("uploadfile")
        if part is None or part.filename is None:
            raise KfpError(400, f"The upload has no 'uploadfile' file part (parts: {sorted(call.body)})")
        return part

    @staticmethod
    def _upload_names(call: _Call, part: FormPart) -> tuple[str, str]:
        name = call.query.get("name") or call.query.get("display_name") or (part.filename or "").rsplit(".", 1)[0]
        display_name = call.query.get("display_name") or name
        if not name.strip():
            raise KfpError(400, "Invalid input error: the pipeline name is empty")
        return name, display_name

    def _upload_pipeline(self, call: _Call) -> tuple[str, Any]:
        part = self._uploaded_file(call)
        spec, platform = _load_pipeline_package(part.data)
        name, display_name = self._upload_names(call, part)
        namespace = call.query.get("namespace", "")
        if any(p["name"] == name and p.get("namespace", "") == namespace for p in self.pipelines.values()):
            raise KfpError(409, f"Already exist error: a pipeline named {name!r} already exists")
        resource = {
            "pipeline_id": str(uuid.uuid4()),
            "name": name,
            "display_name": display_name,
            "created_at": now_rfc3339(),
        }
        if call.query.get("description"):
            resource["description"] = call.query["description"]
        if namespace:
            resource["namespace"] = namespace
        record = PipelineRecord(resource)
        self.pipelines[record.id] = record
        # A real server stores the package as the pipeline's first version, under the pipeline's name.
        self._add_version(record, name, display_name, call.query.get("description"), part, spec, platform)
        return "V2beta1Pipeline", resource

    def _upload_version(self, call: _Call) -> tuple[str, Any]:
        part = self._uploaded_file(call)
        pipeline_id = call.query.get("pipelineid", "")
        if not pipeline_id:
            raise KfpError(400, "Invalid input error: pipelineid is required to upload a pipeline version")
        pipeline = self._pipeline(pipeline_id)
        spec, platform = _load_pipeline_package(part.data)
        name, display_name = self._upload_names(call, part)
        if any(v["name"] == name for v in self.versions_of(pipeline_id)):
            raise KfpError(409, f"Already exist error: pipeline {pipeline_id} already has a version named {name!r}")
        version = self._add_version(pipeline, name, display_name, call.query.get("description"), part, spec, platform)
        return "V2beta1PipelineVersion", version.resource

    def _add_version(
        self,
        pipeline: PipelineRecord,
        name: str,
        display_name: str,
        description: str | None,
        part: FormPart,
        spec: dict[str, Any],
        platform: dict[str, Any] | None,
    ) -> VersionRecord:
        resource: dict[str, Any] = {
            "pipeline_id": pipeline.id,
            "pipeline_version_id": str(uuid.uuid4()),
            "name": name,
            "display_name": display_name,
            "created_at": now_rfc3339(),
            "pipeline_spec": spec if platform is None else {"pipeline_spec": spec, "platform_spec": platform},
        }
        if description:
            resource["description"] = description
        record = VersionRecord(resource, part.data, part.filename or "", spec, platform)
        self.versions[record.id] = record
        return record

    def _resolve_source(self, body: Mapping[str, Any], what: str) -> dict[str, Any]:
        """The pipeline spec a run or recurring run uses: from its version reference or its inline spec."""
        reference = body.get("pipeline_version_reference")
        sources = [k for k in ("pipeline_version_reference", "pipeline_spec", "pipeline_version_id") if body.get(k)]
        if len(sources) != 1:
            raise KfpError(
                400,
                f"Invalid {what}: exactly one of pipeline_version_reference, pipeline_spec or pipeline_version_id "
                f"is required, got {sources or 'none'}",
            )
        if body.get("pipeline_spec"):
            return _split_inline_spec(body["pipeline_spec"])[0]
        reference = dict(reference or {"pipeline_version_id": body["pipeline_version_id"]})
        pipeline_id = reference.get("pipeline_id") or ""
        version_id = reference.get("pipeline_version_id") or ""
        if not pipeline_id and not version_id:
            raise KfpError(400, f"Invalid {what}: the pipeline version reference is empty")
        if not version_id:
            versions = self.versions_of(self._pipeline(pipeline_id).id)
            if not versions:
                raise KfpError(404, f"Pipeline {pipeline_id} has no versions")
            return versions[-1].pipeline_spec
        version = self.versions.get(version_id)
        if pipeline_id:
            version = self._version(pipeline_id, version_id)
        if version is None:
            raise KfpError(404, f"Pipeline version {version_id} not found")
        return version.pipeline_spec

    def _check_runtime_config(self, body: Mapping[str, Any], spec: Mapping[str, Any], what: str) -> None:
        if not self.check_parameters:
            return
        violations = _parameter_violations(spec, _spec_parameters(body))
        if violations:
            raise KfpError(400, f"Invalid {what}: invalid pipeline job inputs: {'; '.join(violations)}")

    def _experiment_for(self, body: Mapping[str, Any], query: Mapping[str, str]) -> str:
        experiment_id = body.get("experiment_id") or query.get("experiment_id") or ""
        if experiment_id:
            return self._experiment(experiment_id).id
        default = next((e for e in self.experiments.values() if e.get("display_name") == "Default"), None)
        return (default or self._add_experiment("Default", None, "")).id

    def _create_run(self, call: _Call) -> tuple[str, Any]:
        body = call.body
        if not (body.get("display_name") or "").strip():
            raise KfpError(400, "Invalid input error: the run's display_name is empty")
        spec = self._resolve_source(body, "run")
        self._check_runtime_config(body, spec, "run")
        experiment_id = self._experiment_for(body, call.query)
        namespace = self.experiments[experiment_id].get("namespace", "")
        self._access(
            call,
            "runs",
            "create",
            namespace,
            "Failed to create a run due to authorization error. Check if "
            f"you have write permissions to namespace {namespace}: Failed to authorize with API",
            "A run cannot have an empty namespace in multi-user mode",
        )
        created = now_rfc3339()
        resource = {
            **body,
            "run_id": str(uuid.uuid4()),
            "experiment_id": experiment_id,
            "storage_state": "AVAILABLE",
            "created_at": created,
            "scheduled_at": created,
            "state": "PENDING",
            "state_history": [{"update_time": created, "state": "PENDING"}],
        }
        record = RunRecord(resource, spec=spec)
        self.runs[record.id] = record
        return "V2beta1Run", resource

    def _run(self, run_id: str) -> RunRecord:
        record = self.runs.get(run_id)
        if record is None:
            raise KfpError(404, f"Run {run_id} not found")
        return record

    def _advance(self, record: RunRecord) -> None:
        if record.state in TERMINAL_STATES:
            return
        record.polls += 1
        states = (*self.run_progression, record.outcome or self.run_outcome)
        state = states[min(record.polls, len(states)) - 1]
        if state == record.state:
            return
        updated = now_rfc3339()
        # kubeflow/pipelines 2.x, backend/src/apiserver/server/api_converter.go (alike in an early 2.x copy and at
        # 010a6df2, which has plugins_input as kfp-server-api 2.17 does): toApiRun sets `error` only
        # when the stored run cannot be converted, never for a failed run; its task_details are the workflow's Argo
        # nodes (toModelTasks from Workflow.NodeStatuses, backend/src/common/util/workflow.go: display name, phase and
        # times; the node's message is not kept), and toApiPipelineTaskDetail gives no error and no outputs ("TODO:
        # parse input and output artifacts"), so a failed step shows neither, as the launcher uploads no outputs
        # for a step whose command failed (backend/src/v2/component/launcher_v2.go, executeV2). Nodes never started
        # are left out, and so are child_tasks, state_history and executor_detail.
        if state in ("SUCCEEDED", "FAILED") and record.spec is not None:
            steps = _steps_in_order(record.spec)
            failing = (self.failed_task or steps[0]) if state == "FAILED" else ""
            drivers = sorted(name for name, _ in _argo_nodes(record.spec, "") if name.endswith("-driver"))
            if failing and failing not in steps + drivers:
                message = f"FakeKfp.failed_task {failing!r} is not a step or a driver of the run's pipeline"
                raise KfpError(500, f"{message} ({', '.join(steps + drivers)})", violation=True)
            record.resource["run_details"] = {
                "task_details": [
                    {
                        "run_id": record.id,
                        "task_id": str(uuid.uuid4()),
                        "display_name": name,
                        "create_time": updated,
                        "start_time": updated,
                        "end_time": updated,
                        "state": node_state,
                    }
                    for name, node_state in _argo_nodes(record.spec, failing)
                ]
            }
        record.resource["state"] = state
        record.resource["state_history"].append({"update_time": updated, "state": state})
        if state in TERMINAL_STATES:
            record.resource["finished_at"] = updated

    def _get_run(self, call: _Call) -> tuple[str, Any]:
        record = self._run(call.params["run_id"])
        namespace = self.experiments[record["experiment_id"]].get("namespace", "")
        self._access(
            call,
            "runs",
            "get",
            namespace,
            "Failed to authorize the request: Failed to authorize with API",
            "A run cannot have an empty namespace in multi-user mode",
        )
        self._advance(record)
        return "V2beta1Run", record.resource

    def _list_runs(self, call: _Call) -> tuple[str, Any]:
        experiment_id = call.query.get("experiment_id", "")
        records = [r for r in self.runs.values() if not experiment_id or r["experiment_id"] == experiment_id]
        return "V2beta1ListRunsResponse", self._page(records, call.query, "V2beta1Run", "runs")

    def _create_recurring_run(self, call: _Call) -> tuple[str, Any]:
        body = call.body
        if not (body.get("display_name") or "").strip():
            raise KfpError(400, "Invalid input error: the recurring run's display_name is empty")
        trigger = body.get("trigger") or {}
        schedules = [k for k in ("cron_schedule", "periodic_schedule") if trigger.get(k)]
        if len(schedules) != 1:
            raise KfpError(400, f"Invalid recurring run: the trigger needs exactly one schedule, got {schedules}")
        trigger = {key: dict(value) for key, value in trigger.items() if value}
        if "cron_schedule" in trigger:
            violations = _cron_violations(trigger["cron_schedule"].get("cron") or "")
            if violations:
                raise KfpError(400, f"Invalid recurring run: {'; '.join(violations)}")
        else:
            interval = int(trigger["periodic_schedule"].get("interval_second") or 0)
            if interval <= 0:
                raise KfpError(400, f"Invalid recurring run: interval_second must be positive, got {interval}")
            trigger["periodic_schedule"]["interval_second"] = str(interval)
        max_concurrency = int(body.get("max_concurrency") or 0)
        if not 1 <= max_concurrency <= 10:
            raise KfpError(400, f"Invalid recurring run: max_concurrency must be in [1, 10], got {max_concurrency}")
        spec = self._resolve_source(body, "recurring run")
        self._check_runtime_config(body, spec, "recurring run")
        experiment_id = self._experiment_for(body, call.query)
        namespace = self.experiments[experiment_id].get("namespace", "")
        self._access(
            call,
            "jobs",
            "create",
            namespace,
            "Failed to create a recurring run due to authorization error. "
            f"Check if you have write permission to namespace {namespace}: failed to authorize with API",
            "a recurring run cannot have an empty namespace in multi-user mode",
        )
        mode = body.get("mode") or "MODE_UNSPECIFIED"
        created = now_rfc3339()
        resource = {
            **body,
            "recurring_run_id": str(uuid.uuid4()),
            "experiment_id": experiment_id,
            "trigger": trigger,
            "max_concurrency": str(max_concurrency),
            "no_catchup": bool(body.get("no_catchup", False)),
            "mode": mode,
            "status": "ENABLED" if mode == "ENABLE" else "DISABLED",
            "created_at": created,
            "updated_at": created,
        }
        record = RecurringRunRecord(resource)
        self.recurring_runs[record.id] = record
        return "V2beta1RecurringRun", resource

    def _recurring_run(self, recurring_run_id: str) -> RecurringRunRecord:
        record = self.recurring_runs.get(recurring_run_id)
        if record is None:
            raise KfpError(404, f"Recurring run {recurring_run_id} not found")
        return record

    def _get_recurring_run(self, call: _Call) -> tuple[str, Any]:
        return "V2beta1RecurringRun", self._recurring_run(call.params["recurring_run_id"]).resource

    def _list_recurring_runs(self, call: _Call) -> tuple[str, Any]:
        experiment_id = call.query.get("experiment_id", "")
        namespace = call.query.get("namespace", "")
        if experiment_id and not namespace:  # job_server.go listJobs: the experiment's namespace
            namespace = self._experiment(experiment_id).get("namespace", "")
        self._access(
            call,
            "jobs",
            "list",
            namespace,
            "Failed to list recurring runs due to authorization error. Check "
            f"if you have permission to access namespace {namespace}: failed to authorize with API",
            "a recurring run cannot have an empty namespace in multi-user mode",
        )
        records = [r for r in self.recurring_runs.values() if not experiment_id or r["experiment_id"] == experiment_id]
        # The proto field is literally named recurringRuns, so that is the JSON key (and the model's attribute_map).
        response = self._page(records, call.query, "V2beta1RecurringRun", "recurringRuns")
        return "V2beta1ListRecurringRunsResponse", response

    def _job_access(self, call: _Call, verb: str) -> RecurringRunRecord:
        record = self._recurring_run(call.params["recurring_run_id"])
        namespace = self.experiments[record["experiment_id"]].get("namespace", "")
        self._access(
            call,
            "jobs",
            verb,
            namespace,
            "Failed to authorize the request: failed to authorize with API",
            "a recurring run cannot have an empty namespace in multi-user mode",
            record["display_name"],
        )
        return record

    def _set_mode(self, recurring_run_id: str, mode: str) -> tuple[None, Any]:
        record = self._recurring_run(recurring_run_id)
        record.resource.update(
            mode=mode, status="ENABLED" if mode == "ENABLE" else "DISABLED", updated_at=now_rfc3339()
        )
        return None, {}

    def _enable_recurring_run(self, call: _Call) -> tuple[None, Any]:
        return self._set_mode(self._job_access(call, "enable").id, "ENABLE")

    def _disable_recurring_run(self, call: _Call) -> tuple[None, Any]:
        return self._set_mode(self._job_access(call, "disable").id, "DISABLE")

    def _delete_recurring_run(self, call: _Call) -> tuple[None, Any]:
        policy = call.query.get("propagation_policy")
        if policy is not None:
            violations = schema_violations(policy, "V2beta1DeletePropagationPolicy", "propagation_policy")
            if violations:
                raise KfpError(400, "; ".join(violations))
        del self.recurring_runs[self._job_access(call, "delete").id]
        return None, {}
