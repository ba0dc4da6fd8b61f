"""Mirror a source under <dataset>/raw/: only what changed, verified, and never half-written.

Each object is fetched into a temporary file beside its final name and renamed once its size (and
checksum) is verified. A journal records every object as it lands, so a run killed at any moment and
started again copies only what is still missing; the manifest is written last, after the filesystem has
been flushed, and then the journal goes. Files never get an fsync of their own: thousands of fsyncs are
most of the time of a small-file copy, and a process that is killed loses nothing the kernel holds. One
syncfs before the manifest makes everything it lists durable.

Include/exclude filters choose what is copied and tokenized, not what the mirror keeps: narrowing them must not
throw away a 100 GB mirror. A mirrored file outside the filter stays while its source object is unchanged, and
the manifest lists it as `retained` (entries like those of `files`), so widening the filter again copies nothing.
One whose source changed is removed, so the mirror never holds bytes the source no longer has; it is copied
again if ever selected. Only files gone from the source are otherwise removed, and `keep_deleted` keeps those.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import json
import logging
import os
import re
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Protocol

from common.objects import SourceObject, sha256_of
from trainer.atomic import write_json
from trainer.layout import MirrorPaths

log = logging.getLogger(__name__)

PROGRESS_EVERY_S = 5.0
_PARTIAL = re.compile(r"^\..+\.[0-9a-f]{16}\.part$")


class Source(Protocol):
    uri: str

    def fetch(self, obj: SourceObject, out: BinaryIO, on_bytes: Callable[[int], None]) -> str: ...


@dataclass
class MirrorResult:
    files: int
    bytes: int
    files_copied: int
    files_skipped: int
    files_deleted: int  # removed from the mirror: gone from the source, or changed there while outside the filter
    files_retained: int  # outside the filter, kept (unchanged in the source): widening the filter copies none
    bytes_copied: int
    mirror_seconds: float
    content_sha256: str  # of the staged keys, sizes and checksums: what tokenization depends on


class ProgressLog:
    """A line every few seconds (files and bytes done, rate, ETA), safe to feed from many threads."""

    def __init__(self, files: int, total_bytes: int, every_s: float = PROGRESS_EVERY_S):
        self.files, self.total_bytes, self.every_s = files, total_bytes, every_s
        self.files_done = self.bytes_done = 0
        self.started = self.last = time.monotonic()
        self._lock = threading.Lock()

    def add_bytes(self, n: int) -> None:
        with self._lock:
            self.bytes_done += n
            self._maybe_log()

    def file_done(self) -> None:
        with self._lock:
            self.files_done += 1
            self._maybe_log()

    def _maybe_log(self) -> None:
        now = time.monotonic()
        if now - self.last < self.every_s:
            return
        self.last = now
        rate = self.bytes_done / max(now - self.started, 1e-9)
        eta = (self.total_bytes - self.bytes_done) / rate if rate > 0 else float("inf")
        log.info(
            "staged %d/%d files, %.1f/%.1f MB, %.1f MB/s, ETA %.0fs",
            self.files_done,
            self.files,
            self.bytes_done / 1e6,
            self.total_bytes / 1e6,
            rate / 1e6,
            eta,
        )


def checksum_field(entry: dict[str, Any]) -> str:
    return entry.get("etag") or entry.get("sha256", "")


def content_sha256(entries: list[dict[str, Any]]) -> str:
    listing = [[e["key"], e["size"], checksum_field(e)] for e in sorted(entries, key=lambda e: e["key"])]
    return hashlib.sha256(json.dumps(listing).encode()).hexdigest()


def previous_entries(paths: MirrorPaths) -> dict[str, dict[str, Any]]:
    """What earlier runs staged: the manifest (selected and retained files), then the journal of an unfinished run."""
    entries: dict[str, dict[str, Any]] = {}
    try:
        manifest = json.loads(paths.manifest.read_text())
        entries = {e["key"]: e for e in [*manifest.get("retained", []), *manifest["files"]]}
    except FileNotFoundError:
        pass
    except (OSError, ValueError, KeyError, TypeError):
        log.warning("%s is unreadable: every file is checked and copied again", paths.manifest)
    try:
        lines = paths.staging_journal.read_text().splitlines()
    except FileNotFoundError:
        lines = []
    for line in lines:
        try:
            entry = json.loads(line)
            entries[entry["key"]] = entry
        except (ValueError, KeyError, TypeError):  # the line being written when the run was killed
            continue
    if lines:
        log.info("carrying on from an interrupted staging run: %d files it finished are not copied again", len(lines))
    return entries


def unchanged(obj: SourceObject, old: dict[str, Any] | None, dest: Path) -> dict[str, Any] | None:
    """The manifest entry to keep when `obj` needs no copy (same size and checksum, mirror intact), else None."""
    if old is None or old.get("size") != obj.size:
        return None
    try:
        if dest.stat().st_size != obj.size:
            return None
    except OSError:
        return None
    if obj.etag:
        return old if old.get("etag") == obj.etag else None
    if old.get("mtime_ns") == obj.mtime_ns:
        return old
    # Touched but perhaps not changed: the content decides.
    if old.get("sha256") == sha256_of(Path(obj.location)):
        return {**old, "mtime_ns": obj.mtime_ns}
    return None


def entry_of(obj: SourceObject, checksum: str) -> dict[str, Any]:
    if obj.etag:
        return {"key": obj.key, "size": obj.size, "etag": checksum}
    return {"key": obj.key, "size": obj.size, "sha256": checksum, "mtime_ns": obj.mtime_ns}


def fetch_into(source: Source, obj: SourceObject, dest: Path, progress: ProgressLog) -> dict[str, Any]:
    """Fetch one object to a temporary name beside `dest`, rename it into place, and return its manifest entry."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = dest.with_name(f".{dest.name}.{secrets.token_hex(8)}.part")
    try:
        with open(partial, "w+b") as out:  # read back where a checksum needs the whole file
            checksum = source.fetch(obj, out, progress.add_bytes)
        os.replace(partial, dest)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    progress.file_done()
    return entry_of(obj, checksum)


def sweep(raw: Path, keep: set[str], listed: set[str], keep_deleted: bool) -> list[str]:
    """Remove every mirrored file not in `keep` that the source still lists (it changed there, so the mirror cannot
    vouch for it), files gone from the source unless `keep_deleted`, and partial files an interrupted run left.
    Returns the keys removed (partial files aside). `listed` is the source's listing before include/exclude, so a
    narrower filter removes nothing the source still has unchanged."""
    deleted = []
    if not raw.is_dir():
        return deleted
    for path in raw.rglob("*"):
        if not path.is_file() and not path.is_symlink():
            continue
        key = path.relative_to(raw).as_posix()
        if key in keep:
            continue
        if _PARTIAL.match(path.name):
            path.unlink()
        elif key in listed or not keep_deleted:
            path.unlink()
            deleted.append(key)
    for directory in sorted((d for d in raw.rglob("*") if d.is_dir()), key=lambda d: -len(d.parts)):
        if not any(directory.iterdir()):
            directory.rmdir()
    return deleted


def syncfs(directory: Path) -> None:
    """Flush every dirty page of the filesystem holding `directory` (Linux); elsewhere, all filesystems."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if getattr(libc, "syncfs", None) is None or libc.syncfs(fd) != 0:
            os.sync()
    finally:
        os.close(fd)


def retained_entries(
    listed: list[SourceObject], selected: set[str], previous: dict[str, dict[str, Any]], raw: Path
) -> list[dict[str, Any]]:
    """Manifest entries of the mirrored files outside the filter whose source is unchanged, in key order."""
    retained = []
    for obj in sorted(listed, key=lambda o: o.key):
        if obj.key not in selected and obj.key in previous:
            kept = unchanged(obj, previous[obj.key], raw / obj.key)
            if kept is not None:
                retained.append(kept)
    return retained


def mirror(
    source: Source,
    objects: list[SourceObject],
    paths: MirrorPaths,
    workers: int,
    keep_deleted: bool,
    *,
    listed: list[SourceObject],
) -> MirrorResult:
    """Bring the mirror up to date with `objects` (the selected ones); `listed` is the source's whole listing,
    before include/exclude: what it has that is not selected is kept, not deleted."""
    started = time.perf_counter()
    previous = previous_entries(paths)
    selected = {o.key for o in objects}
    retained = retained_entries(listed, selected, previous, paths.raw)
    keep = selected | {e["key"] for e in retained}
    deleted = sweep(paths.raw, keep, {o.key for o in listed}, keep_deleted)
    entries: dict[str, dict[str, Any]] = {}
    to_copy: list[SourceObject] = []
    for obj in objects:
        kept = unchanged(obj, previous.get(obj.key), paths.raw / obj.key)
        if kept is None:
            to_copy.append(obj)
        else:
            entries[obj.key] = kept
    total = sum(o.size for o in to_copy)
    log.info(
        "%d files to copy (%.1f MB), %d unchanged, %d removed from the mirror, %d kept outside the filter",
        len(to_copy),
        total / 1e6,
        len(entries),
        len(deleted),
        len(retained),
    )
    progress = ProgressLog(len(to_copy), total)
    paths.root.mkdir(parents=True, exist_ok=True)
    with Journal(paths.staging_journal) as journal, ThreadPoolExecutor(workers, "stage") as pool:
        futures = [pool.submit(fetch_into, source, o, paths.raw / o.key, progress) for o in to_copy]
        for future in futures:
            future.add_done_callback(journal.record)
        done, _ = wait(futures, return_when=FIRST_EXCEPTION)
        failed = next((f.exception() for f in done if f.exception() is not None), None)
        if failed is not None:
            pool.shutdown(cancel_futures=True)  # what is in flight finishes (and is journaled); nothing new starts
            raise failed
    for future in futures:
        entries[future.result()["key"]] = future.result()

    syncfs(paths.root)  # everything the manifest will list is on disk before the manifest is
    ordered = [entries[o.key] for o in objects]
    manifest = {
        "source": source.uri,
        "staged_at": time.time(),
        "files": ordered,
        "retained": retained,
        "total_bytes": sum(e["size"] for e in ordered),
        "copied": len(to_copy),
        "skipped": len(objects) - len(to_copy),
        "deleted": deleted,
        "kept_deleted": keep_deleted,
        "content_sha256": content_sha256(ordered),
    }
    write_json(paths.manifest, manifest)
    paths.staging_journal.unlink(missing_ok=True)
    result = MirrorResult(
        files=len(objects),
        bytes=manifest["total_bytes"],
        files_copied=len(to_copy),
        files_skipped=manifest["skipped"],
        files_deleted=len(deleted),
        files_retained=len(retained),
        bytes_copied=total,
        mirror_seconds=round(time.perf_counter() - started, 3),
        content_sha256=manifest["content_sha256"],
    )
    rate = total / max(result.mirror_seconds, 1e-9) / 1e6
    log.info(
        "mirrored %d files (%.1f MB): %d copied (%.1f MB, %.1f MB/s), %d unchanged, %d removed, %d kept outside "
        "the filter, in %.1fs",
        result.files,
        result.bytes / 1e6,
        result.files_copied,
        total / 1e6,
        rate,
        result.files_skipped,
        result.files_deleted,
        result.files_retained,
        result.mirror_seconds,
    )
    return result


class Journal:
    """Append-only record of the objects this run has landed, one JSON line each, flushed every second.

    A run killed between flushes fetches those last objects again: a second of work, not a wrong mirror.
    """

    FLUSH_EVERY_S = 1.0

    def __init__(self, path: Path):
        self.path = path
        self._lock = threading.Lock()
        self._flushed = time.monotonic()

    def __enter__(self) -> Journal:
        self._file = open(self.path, "a")
        return self

    def __exit__(self, *exc: object) -> None:
        self._file.close()

    def record(self, future: Future) -> None:
        if future.cancelled() or future.exception() is not None:
            return
        with self._lock:
            self._file.write(json.dumps(future.result()) + "\n")
            if time.monotonic() - self._flushed >= self.FLUSH_EVERY_S:
                self._file.flush()
                self._flushed = time.monotonic()


@contextmanager
def staging_lock(paths: MirrorPaths) -> Iterator[None]:
    """One staging run per dataset (or model copy) at a time (two pipeline runs may stage the same one); the next
    one waits."""
    paths.root.mkdir(parents=True, exist_ok=True)
    with open(paths.staging_lock, "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("another staging run of %s holds its lock; waiting for it to finish", paths.root)
            fcntl.flock(lock, fcntl.LOCK_EX)
        except OSError as exc:  # a filesystem mounted without lock support
            log.warning("cannot lock %s (%s): make sure no other run stages this dataset now", paths.root, exc)
        yield
