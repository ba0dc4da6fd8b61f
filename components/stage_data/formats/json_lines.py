"""JSON Lines (optionally gzip or zstd): one JSON object per line, each a document whose text is one field (a dotted
path reaches into nested objects). Blank lines are not records; a line that is not a JSON object is malformed."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from common.errors import InputError
from components.stage_data.formats.reader import Piece, Skipped
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


def numbered_lines(
    path: Path, compression: str, key: str, on_read: Callable[[int], None] | None = None
) -> Iterator[tuple[int, bytes]]:
    carry, number = b"", 0
    for chunk in byte_chunks(path, compression, key, on_read):
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
        self.bytes_read = 0  # of the file (compressed), for progress lines

    def parts(self) -> int:
        return 1

    def _count(self, size: int) -> None:
        self.bytes_read += size

    def read(self, part: int = 0) -> Iterator[Piece | Skipped]:
        for number, line in numbered_lines(self.path, self.compression, self.key, self._count):
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


FIELD_CHECK_BYTES = 2**20  # of a file's first records read for one with the text field (a good file: its first)
FIELDS_SHOWN = 12  # field names a refusal lists


def check_json_lines(path: Path, key: str, compression: str, text_field: str, dataset: str = "") -> None:
    """Refuse at once a file whose first record is not a JSON object (arrays, numbers: not this format), or not
    JSON at all (a plain-text file named .jsonl); and one whose first records (up to FIELD_CHECK_BYTES) all lack the
    text field, naming the fields they have: a corpus whose text is in another field would otherwise stage nothing
    and fail far later, at the finalize step. Reading stops at the first record that has the field, so a good file
    costs its first line; records that now and then lack it are skipped and counted by the encoder, as before."""
    names = text_field.split(".")
    seen = FieldsSeen()
    records = read = 0
    cut = False  # stopped before the file's end
    for number, line in numbered_lines(path, compression, key):
        if not line.strip():
            continue
        record, error = parse(line)
        if not records and error:
            raise InputError(
                f"source file {key}: line {number} is {error}, so this is not JSON Lines (one JSON object per line): "
                f"{line[:80]!r}"
            )
        if not records and not isinstance(record, dict):
            raise InputError(
                f"source file {key}: its records are not JSON objects (line {number} is {kind_of(record)}): JSON "
                f"Lines holds one object per line, with the text in field {text_field!r}"
            )
        read += len(line) + 1
        if isinstance(record, dict):  # a malformed line further on is the encoder's to count (max_bad_records)
            records += 1
            if field_text(record, names)[1] != "missing":
                return
            seen.note(record, names)
        if read >= FIELD_CHECK_BYTES:
            cut = True
            break
    if records:  # none with the field (an empty file has none at all: nothing to say)
        raise InputError(seen.refusal(key, dataset, text_field, records, cut))


class FieldsSeen:
    """The fields of records that lack the text field, where the text field's path breaks off (its dotted names),
    and how much text each holds: a refusal names them and the likeliest text field. Bounded: a few hundred names."""

    def __init__(self) -> None:
        self.text: dict[str, int] = {}  # field -> characters of string values, in order of first appearance

    def note(self, record: dict[str, Any], names: list[str]) -> None:
        value: Any = record
        prefix: list[str] = []
        for name in names:
            if not isinstance(value, dict) or name not in value:
                break
            prefix.append(name)
            value = value[name]
        if not isinstance(value, dict):  # the path runs into a value that is no object: name it and what it is
            self._add(f"{'.'.join(prefix)} ({kind_of(value)})", 0)
            return
        for field, inner in value.items():
            self._add(".".join([*prefix, field]), len(inner) if isinstance(inner, str) else 0)

    def _add(self, field: str, characters: int) -> None:
        if field in self.text or len(self.text) < 256:
            self.text[field] = self.text.get(field, 0) + characters

    def refusal(self, key: str, dataset: str, text_field: str, records: int, cut: bool) -> str:
        """One line: the file and dataset, the field asked for, the fields there are and how to name the text."""
        of = f" of dataset {dataset!r}" if dataset else ""
        read = f"{'first ' if cut else ''}{records:,} record{'s' if records > 1 else ''}"
        shown = list(self.text)[:FIELDS_SHOWN]
        more = f" and {len(self.text) - len(shown):,} more" if len(self.text) > len(shown) else ""
        have = f"{', '.join(shown)}{more}" if shown else "no fields"
        best = max(self.text, key=lambda f: self.text[f]) if any(self.text.values()) else ""
        where = f"{dataset}=" if dataset else "DATASET="
        give = (
            f"--text-field {best}; a mixture entry's own: --mixture-text-field {where}{best}"
            if best
            else f"--text-field FIELD; a mixture entry's own: --mixture-text-field {where}FIELD"
        )
        return (
            f"source file {key}{of}: none of its {read} has the text field {text_field!r}; they have {have}: name "
            f"the text field with text_field ({give})"
        )
