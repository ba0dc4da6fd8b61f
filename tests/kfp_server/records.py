"""What the fake keeps and is handed: a stored resource (the JSON a GET returns), a request as received, a routed
call as a handler sees it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any


def now_rfc3339() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class Record:
    """A stored resource: ``resource`` is the JSON a GET returns (``record["state"]`` reads from it)."""

    resource: dict[str, Any]

    def __getitem__(self, key: str) -> Any:
        return self.resource[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.resource.get(key, default)


def spec_parameters(resource: Mapping[str, Any]) -> dict[str, Any]:
    return dict((resource.get("runtime_config") or {}).get("parameters") or {})


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
class Call:
    """One routed request, for a handler."""

    params: dict[str, str]  # path parameters
    query: dict[str, str]
    body: Any
    headers: dict[str, str] = field(default_factory=dict)  # lower-cased names
