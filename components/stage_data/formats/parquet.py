"""Parquet: each row is a document whose text is one string column (a dotted path reaches into a struct column).
Only that column is read, a bounded batch of rows at a time through a buffered stream, so a row group of several GB
costs the memory of one batch, not of the row group; each row group is a part, journaled when it is done."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from common.errors import InputError
from components.stage_data.formats.reader import Piece, Skipped

BATCH_BYTES = 8 * 2**20  # text decoded into Python at a time
STREAM_BUFFER = 4 * 2**20  # pyarrow reads column chunks through a buffer this size instead of whole


def open_parquet(path: Path, key: str) -> pq.ParquetFile:
    try:
        return pq.ParquetFile(path, buffer_size=STREAM_BUFFER, pre_buffer=False)
    except (pa.ArrowException, OSError) as exc:
        raise InputError(
            f"source file {key}: begins like Parquet but cannot be read as it ({exc}): the file is "
            "truncated or damaged; fetch it again"
        ) from None


def text_column_type(schema: pa.Schema, key: str, text_field: str) -> pa.DataType:
    """The type at the dotted path, or an InputError naming the columns there are."""
    names = text_field.split(".")
    fields: Any = schema
    found: pa.Field | None = None
    for depth, name in enumerate(names):
        index = fields.get_field_index(name) if hasattr(fields, "get_field_index") else -1
        if index < 0:
            where = "columns" if depth == 0 else f"fields of {'.'.join(names[:depth])}"
            have = [f.name for f in (fields if isinstance(fields, pa.Schema) else list(fields))]
            raise InputError(
                f"source file {key}: no column {text_field!r}; its {where} are {', '.join(have)}: "
                "name the text column with text_field"
            )
        found = fields.field(index)
        fields = found.type if pa.types.is_struct(found.type) else None
        if fields is None and depth < len(names) - 1:
            raise InputError(
                f"source file {key}: column {'.'.join(names[: depth + 1])} is {found.type}, not a "
                f"struct, so {text_field!r} does not name a field in it"
            )
    assert found is not None
    return found.type


def is_text(kind: pa.DataType) -> bool:
    if pa.types.is_dictionary(kind):
        kind = kind.value_type
    return pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)


def check_parquet(path: Path, key: str, text_field: str) -> dict[str, Any]:
    parquet = open_parquet(path, key)
    kind = text_column_type(parquet.schema_arrow, key, text_field)
    if not is_text(kind):
        raise InputError(
            f"source file {key}: column {text_field!r} is {kind}, not a string type: name the text "
            "column with text_field"
        )
    metadata = parquet.metadata
    return {"row_groups": metadata.num_row_groups, "rows": metadata.num_rows}


def leaf(column: pa.Array, names: list[str]) -> pa.Array:
    """The text values of a column selected by a dotted path (a struct holding only that path), nulls where any
    struct on the way is null."""
    for name in names[1:]:
        valid = column.is_valid()
        column = pc.if_else(valid, column.field(name), pa.scalar(None, column.type.field(name).type))
    return column


class ParquetReader:
    def __init__(self, path: Path, key: str, text_field: str):
        self.path, self.key, self.text_field = path, key, text_field
        self.names = text_field.split(".")
        self.file = open_parquet(path, key)
        self.metadata = self.file.metadata
        self.replaced_bytes = 0
        self.bytes_read = 0  # of the file: the row groups read, by their compressed size (for progress lines)

    def parts(self) -> int:
        return self.metadata.num_row_groups

    def read(self, part: int) -> Iterator[Piece | Skipped]:
        group = self.metadata.row_group(part)
        first_row = sum(self.metadata.row_group(g).num_rows for g in range(part))
        self.bytes_read += sum(group.column(c).total_compressed_size for c in range(group.num_columns))
        if not group.num_rows:
            return
        column_bytes = sum(
            group.column(c).total_uncompressed_size
            for c in range(group.num_columns)
            if group.column(c).path_in_schema == self.text_field
        )
        rows_per_batch = max(1, min(group.num_rows, BATCH_BYTES * group.num_rows // max(column_bytes, 1)))
        row = first_row
        try:
            batches = self.file.iter_batches(
                rows_per_batch, row_groups=[part], columns=[self.text_field], use_threads=False
            )
            for batch in batches:
                for value in leaf(batch.column(0), self.names).to_pylist():
                    if value is None:
                        yield Skipped(row, "null", f"{self.key} row {row}")
                    elif not value:
                        yield Skipped(row, "empty", f"{self.key} row {row}")
                    else:
                        yield Piece(value, row, True, True)
                    row += 1
        except (pa.ArrowException, OSError) as exc:
            raise InputError(
                f"source file {self.key}: row group {part} cannot be read ({exc}): the file is damaged; fetch it again"
            ) from None
