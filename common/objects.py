"""One object of a listing, and what every source does with one: check its key, copy it hashing, read its ETag.

The S3 client (common.s3) and staging's local source (components.stage_data.sources) both fetch these; the
trainer's checkpoint copies (trainer/durable.py) list and fetch them through the S3 client.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from common.errors import InputError

READ_CHUNK = 1 * 2**20
_MD5_ETAG = re.compile(r'^"?([0-9a-fA-F]{32})"?$')  # a single-part upload's ETag is the MD5 of its bytes


@dataclass(frozen=True)
class SourceObject:
    """One file to stage. `key` is its path under the mirror ('/'-separated); `etag` is S3's, `mtime_ns` local."""

    key: str
    size: int
    etag: str = ""
    mtime_ns: int = 0
    location: str = ""  # the full S3 key, or the local path


def safe_key(key: str, source: str) -> str:
    """`key` as a relative path that stays under the destination, or an InputError naming it."""
    problem = None
    if "\x00" in key:
        problem = "contains a NUL byte"
    elif "\\" in key:
        problem = "contains a backslash"
    elif key.startswith("/"):
        problem = "is an absolute path"
    elif any(part in (".", "..") for part in key.split("/")):
        problem = "has a '.' or '..' segment"
    elif any(part == "" for part in key.split("/")):
        problem = "has an empty path segment ('//')"
    if problem:
        raise InputError(f"source {source}: object key {key!r} {problem}; refusing to stage it (nothing was written)")
    return key


def copy_hashing(reader: BinaryIO, out: BinaryIO, digest: Any, on_bytes: Callable[[int], None]) -> int:
    """Copy `reader` to `out`, feeding `digest` and reporting progress; returns the bytes copied."""
    copied = 0
    while chunk := reader.read(READ_CHUNK):
        out.write(chunk)
        digest.update(chunk)
        copied += len(chunk)
        on_bytes(len(chunk))
    return copied


def md5_of_etag(etag: str) -> str | None:
    """The MD5 an ETag stands for, or None (multipart uploads and SSE-KMS objects have other ETags)."""
    match = _MD5_ETAG.match(etag)
    return match.group(1).lower() if match else None


def sha256_of(path: Path) -> str:
    """A file's sha256, read a chunk at a time."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(READ_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()
