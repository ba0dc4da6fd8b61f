"""Where a corpus comes from: a local directory (or file) or an S3 prefix, listed and fetched one object at a time.

A source lists its objects with what the incremental check compares (size and ETag on S3; size, mtime and,
on demand, sha256 locally) and fetches one object into an open temporary file, returning the checksum it
verified on the way. Keys become paths under the mirror, so every key is checked before anything is
written: a key that could escape the destination is refused by name. The S3 source is common.s3's S3Source and
the object and its key check are common.objects', shared with the trainer's checkpoint copies; here is the local
source and the filters.
"""

from __future__ import annotations

import fnmatch
import hashlib
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

from common.errors import InputError
from common.objects import SourceObject, copy_hashing, safe_key

log = logging.getLogger(__name__)

DEFAULT_EXCLUDE = ("__pycache__/*", "*.pyc", ".*")


def matches(key: str, patterns: tuple[str, ...]) -> bool:
    """A glob matches the whole key ('part-a/*.txt') or its file name alone ('*.txt')."""
    name = key.rsplit("/", 1)[-1]
    return any(fnmatch.fnmatchcase(key, p) or fnmatch.fnmatchcase(name, p) for p in patterns)


def select(
    objects: list[SourceObject], source: str, include: tuple[str, ...], exclude: tuple[str, ...]
) -> list[SourceObject]:
    """What to copy and tokenize: the objects the filters keep, sorted by key, every listed key checked (the mirror
    keeps the others unchanged); an InputError when none is left."""
    for obj in objects:
        safe_key(obj.key, source)
    chosen = sorted(
        (o for o in objects if matches(o.key, include) and not matches(o.key, exclude)), key=lambda o: o.key
    )
    if not chosen:
        raise InputError(f"source {source}: no files to stage (include {list(include)}, exclude {list(exclude)})")
    if not any(o.size for o in chosen):
        raise InputError(f"source {source}: all {len(chosen)} files are empty")
    return chosen


def files_under(root: Path) -> Iterator[Path]:
    """Every file under `root`, through symlinked directories as through symlinked files (Path.rglob follows neither
    before Python 3.13); a directory reached twice (a link back up the tree) is read once."""
    seen: set[str] = set()
    for directory, subdirectories, names in os.walk(root, followlinks=True):
        real = os.path.realpath(directory)
        if real in seen:
            subdirectories.clear()
            continue
        seen.add(real)
        yield from (path for name in names if (path := Path(directory, name)).is_file())


class LocalSource:
    """A directory (every file under it) or a single file, given as a path or a file:// URI."""

    def __init__(self, uri: str):
        self.uri = uri
        self.root = Path(uri.removeprefix("file://")).expanduser()
        if not self.root.exists():
            raise InputError(f"source {uri}: does not exist")

    def list(self) -> list[SourceObject]:
        if self.root.is_file():
            paths = [(self.root.name, self.root)]
        else:
            paths = [(p.relative_to(self.root).as_posix(), p) for p in files_under(self.root)]
        objects = []
        for key, path in paths:
            stat = path.stat()
            objects.append(SourceObject(key, stat.st_size, mtime_ns=stat.st_mtime_ns, location=str(path)))
        return objects

    def fetch(self, obj: SourceObject, out: BinaryIO, on_bytes: Callable[[int], None]) -> str:
        """Copy the file into `out`; returns its sha256, taken from the bytes copied."""
        digest = hashlib.sha256()
        with open(obj.location, "rb") as f:
            copied = copy_hashing(f, out, digest, on_bytes)
        if copied != obj.size:
            raise OSError(f"{obj.location} changed while it was copied ({copied} bytes, listed at {obj.size})")
        return digest.hexdigest()

    def close(self) -> None:
        pass
