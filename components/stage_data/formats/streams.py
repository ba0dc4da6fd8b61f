"""A file's bytes, decompressed as they stream (gzip, zstd, several frames or members), never whole in memory; a
stream that ends early or is corrupt is refused by the file's name, not read as though it had ended there."""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

import zstandard

from common.errors import InputError

READ_BYTES = 256 * 2**10  # compressed bytes read at a time (text expands some 3-10x)

PARQUET_MAGIC = b"PAR1"
COMPRESSION_MAGIC = {b"\x1f\x8b": "gzip", b"\x28\xb5\x2f\xfd": "zstd"}
BINARY_MAGIC = (  # formats a source directory often holds beside text, named in the refusal
    (b"\x89PNG", "a PNG image"),
    (b"\xff\xd8\xff", "a JPEG image"),
    (b"GIF8", "a GIF image"),
    (b"%PDF-", "a PDF document"),
    (b"PK\x03\x04", "a zip archive"),
    (b"BZh", "a bzip2 stream (gzip and zstd are read)"),
    (b"\xfd7zXZ\x00", "an xz stream (gzip and zstd are read)"),
    (b"\x04\x22\x4d\x18", "an lz4 frame (gzip and zstd are read)"),
    (b"\x7fELF", "an executable"),
)


def byte_chunks(
    path: Path, compression: str, key: str, on_read: Callable[[int], None] | None = None
) -> Iterator[bytes]:
    """The file's content in chunks, decompressed; an InputError if a compressed stream is corrupt or cut short.
    `on_read` is told each read's size in the file (compressed), for progress lines."""
    if compression == "gzip":
        yield from _decompressed(path, key, "gzip", lambda: zlib.decompressobj(wbits=16 + zlib.MAX_WBITS), on_read)
    elif compression == "zstd":
        yield from _decompressed(path, key, "zstd", lambda: zstandard.ZstdDecompressor().decompressobj(), on_read)
    else:
        with open(path, "rb") as f:
            while chunk := f.read(READ_BYTES):
                if on_read is not None:
                    on_read(len(chunk))
                yield chunk


def _decompressed(
    path: Path, key: str, kind: str, new_decompressor, on_read: Callable[[int], None] | None
) -> Iterator[bytes]:
    """Members (gzip) or frames (zstd) one after another, as their tools write them when appending."""
    decompressor, complete = new_decompressor(), True
    with open(path, "rb") as f:
        while chunk := f.read(READ_BYTES):
            if on_read is not None:
                on_read(len(chunk))
            while chunk:
                complete = False
                try:
                    out = decompressor.decompress(chunk)
                except (zlib.error, zstandard.ZstdError) as exc:
                    raise InputError(f"source file {key}: corrupt {kind} data ({exc})") from None
                if out:
                    yield out
                if decompressor.eof:
                    chunk, decompressor, complete = decompressor.unused_data, new_decompressor(), True
                else:
                    chunk = b""
    if not complete:
        raise InputError(f"source file {key}: the {kind} stream ends early (the file is cut short): fetch it again")
