"""Request and response bodies checked against ``kfp_server_api``'s models (kfp 2.17's REST layer): every JSON body
must deserialize into its model with no unknown key at any depth (keys are compared with each model's
``attribute_map``, recursing by ``openapi_types``), scalars of the right JSON type (int64 fields such as
``max_concurrency`` as a JSON number or a decimal string, as protobuf's JSON mapping allows), timestamps in RFC 3339
and enums among their values."""

from __future__ import annotations

import json
import re
from typing import Any

import kfp_server_api

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

RFC3339 = re.compile(r"\d{4}-\d{2}-\d{2}[Tt]\d{2}:\d{2}:\d{2}(\.\d{1,9})?([Zz]|[+-]\d{2}:\d{2})")
DECIMAL = re.compile(r"-?\d+")


def json_kind(value: Any) -> str:
    if value is None:
        return "null"
    return {bool: "boolean", int: "number", float: "number", str: "string", list: "array", dict: "object"}.get(
        type(value), type(value).__name__
    )


def is_enum(type_name: str) -> bool:
    model = getattr(kfp_server_api.models, type_name, None)
    return model is not None and hasattr(model, "openapi_types") and not model.openapi_types


def model_class(type_name: str) -> Any:
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
            return [f"{path}: expected an array, got {json_kind(value)}"]
        return [
            v for i, item in enumerate(value) for v in schema_violations(item, match[1], f"{path}[{i}]", int64=int64)
        ]
    if match := re.fullmatch(r"dict\(str, (.+)\)", type_name):
        if not isinstance(value, dict):
            return [f"{path}: expected an object, got {json_kind(value)}"]
        return [v for key, item in value.items() for v in schema_violations(item, match[1], f"{path}.{key}")]
    if type_name == "str":
        if int64:
            if (isinstance(value, int) and not isinstance(value, bool)) or (
                isinstance(value, str) and DECIMAL.fullmatch(value)
            ):
                return []
            return [f"{path}: expected an int64 (number or decimal string), got {json_kind(value)} {value!r}"]
        return [] if isinstance(value, str) else [f"{path}: expected a string, got {json_kind(value)}"]
    if type_name in ("int", "long"):
        if (isinstance(value, int) and not isinstance(value, bool)) or (
            isinstance(value, str) and DECIMAL.fullmatch(value)
        ):
            return []
        return [f"{path}: expected an integer, got {json_kind(value)} {value!r}"]
    if type_name == "float":
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        return [] if ok else [f"{path}: expected a number, got {json_kind(value)}"]
    if type_name == "bool":
        return [] if isinstance(value, bool) else [f"{path}: expected a boolean, got {json_kind(value)}"]
    if type_name in ("datetime", "date"):
        if isinstance(value, str) and RFC3339.fullmatch(value):
            return []
        return [f"{path}: expected an RFC 3339 timestamp, got {value!r}"]
    if type_name == "object":
        if struct and not isinstance(value, dict):
            return [f"{path}: expected an object (google.protobuf.Struct), got {json_kind(value)}"]
        return []
    model = model_class(type_name)
    if not model.openapi_types:  # an enum
        allowed = getattr(model, "allowable_values", [])
        if isinstance(value, str) and value in allowed:
            return []
        return [f"{path}: {value!r} is not a {type_name} (one of {', '.join(allowed)})"]
    if not isinstance(value, dict):
        return [f"{path}: expected a {type_name} object, got {json_kind(value)}"]
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
