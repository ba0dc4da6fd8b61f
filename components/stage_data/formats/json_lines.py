"""JSON Lines (optionally gzip or zstd): one JSON object per line, each a document whose text is one field (a dotted
path reaches into nested objects). Blank lines are not records; a line that is not a JSON object is malformed."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from common.errors import InputError
from components.stage_data.formats import Piece, Skipped
from components.stage_data.formats.streams import byte_chunks


def field_text(record: Any, path: list[str]) -> tuple[str | None, str]:
    """The text at `path` in a parsed record, or None and why not (the causes the staging report counts)."""
    value = record
    for name in path:
        if not isinstance(value, dict) or name not in value:
            return None, "missing"
        value = value[name]
    if value is None:
        return None, "null"
    if not isinstance(value, str):
        return None, "not a string"
    if not value:
        return None, "empty"
    return value, ""


def without_lone_surrogates(text: str) -> str:
    """JSON may escape half a surrogate pair (\\ud800), which is no character: U+FFFD instead, as for bad UTF-8."""
    return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


def numbered_lines(path: Path, compression: str, key: str) -> Iterator[tuple[int, bytes]]:
    carry, number = b"", 0
    for chunk in byte_chunks(path, compression, key):
        lines = (carry + chunk).split(b"\n")
        carry = lines.pop()
        for line in lines:
            number += 1
            yield number, line
    if carry:
        yield number + 1, carry


def parse(line: bytes) -> tuple[Any, str]:
    try:
        return json.loads(line), ""
    except UnicodeDecodeError:
        return None, "not UTF-8"
    except ValueError:
        return None, "not JSON"


def kind_of(value: Any) -> str:
    return {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(type(value), "a number")


class JsonLinesReader:
    def __init__(self, path: Path, key: str, compression: str, text_field: str):
        self.path, self.key, self.compression = path, key, compression
        self.field = text_field.split(".")
        self.replaced_bytes = 0  # here: lone surrogates replaced

    def parts(self) -> int:
        return 1

    def read(self, part: int = 0) -> Iterator[Piece | Skipped]:
        for number, line in numbered_lines(self.path, self.compression, self.key):
            if not line.strip():
                continue
            where = f"{self.key}:{number}"
            record, error = parse(line)
            if error:
                yield Skipped(number - 1, error, where, bad=True)
                continue
            if not isinstance(record, dict):
                yield Skipped(number - 1, "not an object", where, bad=True)
                continue
            text, cause = field_text(record, self.field)
            if text is None:
                yield Skipped(number - 1, cause, where)
                continue
            if b"\\ud" in line or b"\\uD" in line:
                clean = without_lone_surrogates(text)
                self.replaced_bytes += sum(a != b for a, b in zip(clean, text, strict=False)) if clean != text else 0
                text = clean
            yield Piece(text, number - 1, True, True)


def check_json_lines(path: Path, key: str, compression: str, text_field: str) -> None:
    """Refuse at once a file whose first record is not a JSON object (arrays, numbers: not this format), or not
    JSON at all (a plain-text file named .jsonl)."""
    for number, line in numbered_lines(path, compression, key):
        if not line.strip():
            continue
        record, error = parse(line)
        if error:
            raise InputError(f"source file {key}: line {number} is {error}, so this is not JSON Lines (one JSON "
                             f"object per line): {line[:80]!r}")  # fmt: skip
        if not isinstance(record, dict):
            raise InputError(f"source file {key}: its records are not JSON objects (line {number} is "
                             f"{kind_of(record)}): JSON Lines holds one object per line, with the text in field "
                             f"{text_field!r}")  # fmt: skip
        return
