"""Listing: the ``filter`` query parameter, a JSON ``Filter`` (``predicates`` with an ``operation``, a ``key`` of the
listed resource and exactly one typed value; EQUALS, NOT_EQUALS, IN and IS_SUBSTRING evaluated on string keys), then
``sort_by`` and the page (``page_size``, ``page_token``) of a List*Response."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from typing import Any

from tests.kfp_server.errors import KfpError
from tests.kfp_server.records import Record
from tests.kfp_server.schema import DECIMAL, is_enum, model_class, schema_violations

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


def parse_filter(text: str, model_name: str) -> list[tuple[str, str, Any]]:
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
    model = model_class(model_name)
    string_keys = {attr for attr, kind in model.openapi_types.items() if kind == "str" or is_enum(kind)}
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
        value_type = model_class("V2beta1Predicate").openapi_types[value_field]
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


def matches(resource: Mapping[str, Any], triples: Iterable[tuple[str, str, Any]]) -> bool:
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


def query_int(query: Mapping[str, str], name: str, default: int) -> int:
    text = query.get(name, "")
    if text == "":
        return default
    if not DECIMAL.fullmatch(text) or int(text) < 0:
        raise KfpError(400, f"Invalid {name} {text!r}: expected a non-negative integer")
    return int(text)


def page(records: Iterable[Record], query: Mapping[str, str], model_name: str, field_name: str) -> dict[str, Any]:
    """Filter, sort and page ``records`` into a List*Response."""
    resources = [r.resource for r in records]
    if query.get("filter"):
        triples = parse_filter(query["filter"], model_name)
        resources = [r for r in resources if matches(r, triples)]
    sort_by = query.get("sort_by", "").strip()
    if sort_by:
        match = re.fullmatch(r"(\w+)(?: (asc|desc))?", sort_by)
        if match is None or match[1] not in model_class(model_name).openapi_types:
            raise KfpError(400, f"Invalid sort_by {sort_by!r}: expected '<field of {model_name}> [asc|desc]'")
        resources.sort(key=lambda r: str(r.get(match[1], "")), reverse=match[2] == "desc")
    page_size = query_int(query, "page_size", 20) or 20
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
