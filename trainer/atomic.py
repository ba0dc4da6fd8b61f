"""Write files so that a reader never sees half of one: temp name in the same directory, fsync, rename."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any


def current_umask() -> int:
    """The process's umask, read without changing it where Linux says it (/proc/self/status, 4.7+): setting it to
    read it back would race with threads creating files meanwhile."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def file_mode() -> int:
    """The mode open() would give a new file: 0666 less the umask (0644 under the usual 022)."""
    return 0o666 & ~current_umask()


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_path(path: str | Path, fsync: bool = True) -> Iterator[Path]:
    """Yield a temporary path beside `path` to write by name; on clean exit it is fsynced and renamed onto it.

    Without `fsync`, readers still see the old or the new file, never a mix; only a crash of the machine may lose
    the new one (for what is rewritten often and matters only while running: progress)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, file_mode())  # mkstemp makes it 0600 whatever the umask: teammates on the volume read it too
    finally:
        os.close(fd)
    try:
        yield Path(tmp)
        if fsync:
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        os.replace(tmp, path)
        if fsync:
            fsync_dir(path.parent)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@contextmanager
def atomic_open(path: str | Path, mode: str = "wb", fsync: bool = True) -> Iterator[IO[Any]]:
    """Yield a file object; on clean exit its content replaces `path` in one rename, else it vanishes."""
    with atomic_path(path, fsync) as tmp, open(tmp, mode) as f:
        yield f


def write_json(path: str | Path, obj: Any, fsync: bool = True) -> None:
    with atomic_open(path, "w", fsync) as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")


def read_json_lines(path: str | Path) -> list[dict[str, Any]]:
    """The objects of a JSON-lines file (metrics.jsonl, eval/history.jsonl), [] when there is none. A line that does
    not parse is skipped, not fatal: an appended file's last line may be half-written while it is read."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError:
        return []
    rows = []
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def replace_dir(new_dir: Path, final: Path) -> None:
    """Put `new_dir` where `final` is, so that readers see the old or the new directory, never a mix."""
    old = None
    if final.exists():
        old = final.with_name(f".{final.name}.old.{os.getpid()}")
        os.replace(final, old)
    os.replace(new_dir, final)
    fsync_dir(final.parent)
    if old:
        shutil.rmtree(old)
