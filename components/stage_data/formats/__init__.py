"""What a corpus file holds, and its documents: one reader per format behind one small interface.

A file's format is found from its first bytes (magic numbers), not trusted from its name: Parquet, gzip and zstd
streams, and anything else binary, are told apart by content; within a text stream (plain or decompressed) the
name's extension says JSON Lines (.jsonl, .json, .ndjson) and the first line confirms it. A binary file of no format
we read (a truncated Parquet file, an image, a tarball) is refused by name: it is never tokenized as text.

A reader gives a file's documents as pieces of text, in order, one part at a time: a part is what a killed encode
redoes at most (a Parquet row group; the whole file for the streamed formats). Records without text are yielded as
Skipped with their cause, so the encoder counts them; malformed ones (not JSON, not an object) are Skipped(bad=True),
which the staging refuses unless the run allows that many (max_bad_records).

Adding a format is one module with a Reader and one line in `reader_for`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.errors import InputError
from components.stage_data.formats.json_lines import JsonLinesReader, check_json_lines
from components.stage_data.formats.plain_text import PlainTextReader
from components.stage_data.formats.reader import Reader
from components.stage_data.formats.streams import BINARY_MAGIC, COMPRESSION_MAGIC, PARQUET_MAGIC, byte_chunks

SNIFF_BYTES = 64 * 2**10  # read to tell text from binary, and to check a JSON Lines file's first record
JSON_LINES_SUFFIXES = (".jsonl", ".json", ".ndjson")
COMPRESSION_SUFFIXES = {"gzip": (".gz",), "zstd": (".zst", ".zstd")}


@dataclass(frozen=True)
class FileFormat:
    kind: str  # "text", "jsonl" or "parquet"
    compression: str = ""  # "", "gzip" or "zstd"

    @property
    def name(self) -> str:
        """As a report groups files: text, text.gz, jsonl, jsonl.zst, parquet."""
        suffix = {"gzip": ".gz", "zstd": ".zst"}.get(self.compression, "")
        return self.kind + suffix

    @property
    def records(self) -> bool:
        """Each record is a document, split between train and val by itself (plain text: each file)."""
        return self.kind != "text"

    @classmethod
    def parse(cls, name: str) -> FileFormat:
        kind, _, suffix = name.partition(".")
        return cls(kind, {"gz": "gzip", "zst": "zstd"}.get(suffix, ""))


def detect(path: Path, key: str) -> FileFormat:
    """The file's format, from its first bytes and its name; an InputError naming the file for what we do not read."""
    with open(path, "rb") as f:
        head = f.read(SNIFF_BYTES)
    if head.startswith(PARQUET_MAGIC):
        return FileFormat("parquet")
    compression = next((c for magic, c in COMPRESSION_MAGIC.items() if head.startswith(magic)), "")
    name = key.lower()
    if compression:
        for suffix in COMPRESSION_SUFFIXES[compression]:
            name = name.removesuffix(suffix)
        head = b"".join(_bounded(byte_chunks(path, compression, key), SNIFF_BYTES))
    else:
        for magic, what in BINARY_MAGIC:
            if head.startswith(magic):
                raise InputError(f"source file {key}: {what}, not text: leave it out with --exclude")
        if name.endswith(".parquet"):
            raise InputError(
                f"source file {key}: named .parquet but it does not begin with Parquet's magic bytes "
                "(PAR1): not a Parquet file"
            )
    if len(head) > 262 and head[257:262] == b"ustar":
        raise InputError(f"source file {key}: a tar archive, not text: unpack it into the source")
    if b"\x00" in head:
        raise InputError(
            f"source file {key}: binary data (NUL bytes in its first {len(head):,} bytes), not text: "
            "leave it out with --exclude"
        )
    return FileFormat("jsonl" if name.endswith(JSON_LINES_SUFFIXES) else "text", compression)


def may_hold_records(key: str) -> bool:
    """By its name alone, whether a file may be JSON Lines or Parquet (before it is fetched and its bytes tell)."""
    name = key.lower()
    for suffixes in COMPRESSION_SUFFIXES.values():
        for suffix in suffixes:
            name = name.removesuffix(suffix)
    return name.endswith((*JSON_LINES_SUFFIXES, ".parquet"))


def _bounded(chunks: Iterator[bytes], limit: int) -> Iterator[bytes]:
    taken = 0
    for chunk in chunks:
        yield chunk[: limit - taken]
        taken += len(chunk)
        if taken >= limit:
            return


def reader_for(path: Path, key: str, fmt: FileFormat, text_field: str, block_bytes: int) -> Reader:
    """The reader of one file of a known format (detect's)."""
    if fmt.kind == "parquet":
        from components.stage_data.formats.parquet import ParquetReader  # pyarrow, loaded for Parquet files only

        return ParquetReader(path, key, text_field)
    if fmt.kind == "jsonl":
        return JsonLinesReader(path, key, fmt.compression, text_field)
    return PlainTextReader(path, key, fmt.compression, block_bytes)


def check_file(path: Path, key: str, fmt: FileFormat, text_field: str, dataset: str = "") -> dict[str, Any]:
    """What planning needs of a file beyond its format (Parquet: its row groups), refusing at once what cannot be
    read as the run asks (a Parquet file without the text column, a JSON Lines file of arrays or whose records lack
    the text field; `dataset` names the file's dataset there, which a mixture needs)."""
    if fmt.kind == "parquet":
        from components.stage_data.formats.parquet import check_parquet  # pyarrow, loaded for Parquet files only

        return check_parquet(path, key, text_field)
    if fmt.kind == "jsonl":
        check_json_lines(path, key, fmt.compression, text_field, dataset)
    return {}
