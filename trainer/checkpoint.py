"""Checkpoints: complete or absent, verified on load, with the previous good one to fall back on.

    checkpoints/checkpoint_step_00000100.pt   one file per saved step, the newest `keep` kept
    checkpoints/checkpoint_latest.pt          a hard link to the newest step file (a copy where links fail)
    checkpoints/index.json                    step, size and CRC32 of each file, written after each commit

Each step file is written under a temporary name in the same directory, fsynced, and renamed. Loading
checks the file's size and step against the index, every record against the CRC32 that torch.save
stores in its zip container, and loads with weights_only=True; a file that fails any of these is
skipped, with a warning, for the next older one. Asynchronous saving copies the state to CPU memory
and writes it in a background thread; the copy itself runs there too, overlapping the next forward and
backward pass, and the trainer waits for it (wait_until_staged) before the optimizer changes the weights.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import threading
import time
import zipfile
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from trainer.atomic import atomic_open, fsync_dir, write_json

log = logging.getLogger(__name__)

LATEST = "checkpoint_latest.pt"
INDEX = "index.json"
_STEP_FILE = re.compile(r"^checkpoint_step_(\d+)\.pt$")
# The layout of the trainer's saved state, under "schema"; a checkpoint without one is schema 1.
# 2: the learning-rate schedule (trainer/schedule.py) under "schedule", instead of a LambdaLR's state under "scheduler".
SCHEMA = 2
# What a resume checks that a checkpoint records only from some schema on: an older checkpoint resumes unchecked.
RECORDED_SINCE = {
    "its learning-rate schedule (this run's flags set it)": 2,
    "its dataset snapshot (it goes on with --data-dir's)": 2,
}


class CheckpointError(Exception):
    """No usable checkpoint, or one that does not fit this run."""


class _EarlyWriteback:
    """A file object that has the kernel start writing each chunk to disk as soon as it is written.

    A plain torch.save returns when the bytes are in the page cache; a checkpoint must also be on disk
    before it is renamed into place. Starting the disk writes during serialisation overlaps the two, so
    the final fsync waits only for the tail. (POSIX_FADV_DONTNEED starts writeback without waiting for
    it, and keeps gigabytes of checkpoint out of the page cache.)
    """

    CHUNK = 64 * 2**20

    def __init__(self, f: Any):
        self.f, self.written, self.started_to = f, 0, 0

    def write(self, data: bytes) -> int:
        n = self.f.write(data)
        self.written += n
        if self.written - self.started_to >= self.CHUNK and hasattr(os, "posix_fadvise"):
            self.f.flush()
            os.posix_fadvise(self.f.fileno(), self.started_to, self.written - self.started_to, os.POSIX_FADV_DONTNEED)
            self.started_to = self.written
        return n

    def flush(self) -> None:
        self.f.flush()


def step_file_name(step: int) -> str:
    return f"checkpoint_step_{step:08d}.pt"


def cpu_copy(obj: Any, reuse: Any = None, _shared: dict | None = None) -> Any:
    """A copy with every tensor on the CPU, detached from what training keeps changing.

    Tensors that share storage (tied embeddings) stay shared in the copy, so the file is no bigger than
    a synchronous save's. With `reuse` (an earlier copy of the same structure), tensors are copied into
    its buffers: no new memory to allocate and fault in at every save.
    """
    shared = {} if _shared is None else _shared
    if isinstance(obj, torch.Tensor):
        key = (obj.untyped_storage().data_ptr(), obj.storage_offset(), obj.shape, obj.stride(), obj.dtype)
        if key not in shared:
            fits = isinstance(reuse, torch.Tensor) and reuse.shape == obj.shape and reuse.dtype == obj.dtype
            shared[key] = reuse.copy_(obj.detach()) if fits else obj.detach().to("cpu", copy=True)
        return shared[key]
    if isinstance(obj, dict):
        old = reuse if isinstance(reuse, dict) else {}
        return {k: cpu_copy(v, old.get(k), shared) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        old = reuse if isinstance(reuse, list | tuple) and len(reuse) == len(obj) else [None] * len(obj)
        return type(obj)(cpu_copy(v, r, shared) for v, r in zip(obj, old, strict=True))
    return obj


def _lower_priority() -> None:
    """Nice the writer thread: where training runs on the CPU, its cores go to training first."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):  # not Linux, or not allowed: the thread runs at normal priority
        pass


class CheckpointManager:
    def __init__(self, directory: Path, keep: int = 3, async_save: bool = False):
        self.directory = directory
        self.keep = keep
        self.async_save = async_save
        # One background thread, in order: asynchronous writes, and deleting checkpoints past `keep`.
        self._background = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="checkpoint", initializer=_lower_priority
        )
        self._pending: Future[float] | None = None
        self._staged: Future[None] | None = None  # the pending save's copy of the live state
        self._buffers: Any = None  # CPU copies of the state for asynchronous saves, reused across saves
        self.last_commit_s: float | None = None  # how long the latest commit took (serialise, write, fsync)

    @property
    def latest(self) -> Path:
        return self.directory / LATEST

    # -- saving ---------------------------------------------------------------------------------------

    def save(self, state: dict[str, Any], step: int, blocking: bool = True) -> float:
        """Commit `state` as the checkpoint of `step`; returns the seconds the caller was held up.

        An asynchronous save reads the tensors of `state` in the background: nothing may change them until
        wait_until_staged() has returned.
        """
        started = time.perf_counter()
        self.wait()  # one write at a time, in order; the buffers are free again
        if blocking or not self.async_save:
            self._commit(state, step)
        else:
            self._staged = Future()
            self._pending = self._background.submit(self._stage_and_commit, state, step, self._staged)
        return time.perf_counter() - started

    def wait_until_staged(self) -> float:
        """Block until the pending asynchronous save has its own copy of the state; returns the seconds waited."""
        if self._staged is None:
            return 0.0
        started = time.perf_counter()
        staged, self._staged = self._staged, None
        staged.result()
        return time.perf_counter() - started

    def wait(self) -> None:
        """Block until the pending asynchronous write is committed; raise if it failed."""
        self.wait_until_staged()
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def _stage_and_commit(self, state: dict[str, Any], step: int, staged: Future[None]) -> float:
        try:
            self._buffers = cpu_copy(state, reuse=self._buffers)
        except BaseException as exc:
            staged.set_exception(exc)
            raise
        staged.set_result(None)
        return self._commit(self._buffers, step)

    def close(self) -> None:
        self.wait()
        self._background.shutdown(wait=True)

    def _commit(self, state: dict[str, Any], step: int) -> float:
        started = time.perf_counter()
        self.directory.mkdir(parents=True, exist_ok=True)
        for stale in self.directory.glob(".*.tmp"):  # left by a writer killed mid-save (this is the only writer)
            stale.unlink(missing_ok=True)
            log.info("removed %s, left by an interrupted save", stale.name)
        name = step_file_name(step)
        with atomic_open(self.directory / name, "wb") as f:
            torch.save(state, _EarlyWriteback(f))  # torch's zip writer stores a CRC32 per record
        size = (self.directory / name).stat().st_size
        self._point_latest_at(name)
        index = self._read_index()
        entries = [e for e in index.get("checkpoints", []) if e["file"] != name]
        entries.append({"file": name, "step": step, "size": size, "time": time.time()})
        entries.sort(key=lambda e: e["step"])
        write_json(self.directory / INDEX, {"checkpoints": entries[-self.keep :], "latest": entries[-1]})
        seconds = self.last_commit_s = time.perf_counter() - started
        # Freeing a multi-GB file takes a while and nothing waits for it: leave it to the background.
        self._background.submit(self._delete, [self.directory / old["file"] for old in entries[: -self.keep]])
        log.info("checkpoint of step %d committed: %s (%.1f MB in %.2fs)", step, name, size / 1e6, seconds)
        return seconds

    @staticmethod
    def _delete(paths: list[Path]) -> None:
        for path in paths:
            path.unlink(missing_ok=True)

    def _point_latest_at(self, name: str) -> None:
        tmp = self.directory / f".{LATEST}.{os.getpid()}.tmp"
        tmp.unlink(missing_ok=True)
        try:
            os.link(self.directory / name, tmp)
        except OSError:  # a filesystem without hard links: copy (and fsync) instead
            with atomic_open(tmp, "wb") as out, open(self.directory / name, "rb") as src:
                shutil.copyfileobj(src, out, 16 * 2**20)
        os.replace(tmp, self.latest)
        fsync_dir(self.directory)

    # -- loading --------------------------------------------------------------------------------------

    def _read_index(self) -> dict[str, Any]:
        try:
            return json.loads((self.directory / INDEX).read_text())
        except (OSError, ValueError):
            return {}

    def load(self) -> dict[str, Any] | None:
        """The newest checkpoint that verifies, or None if there is none at all."""
        index = self._read_index()
        by_file = {e["file"]: e for e in index.get("checkpoints", [])}
        candidates: list[tuple[Path, dict[str, Any] | None]] = []
        if self.latest.exists():
            candidates.append((self.latest, index.get("latest")))
        step_files = sorted(
            (p for p in self.directory.glob("checkpoint_step_*.pt") if _STEP_FILE.match(p.name)),
            key=lambda p: int(_STEP_FILE.match(p.name).group(1)),
            reverse=True,
        )
        candidates += [(p, by_file.get(p.name)) for p in step_files]
        if not candidates:
            return None
        problems = []
        for path, entry in candidates:
            try:
                state = verified_load(path, entry)
            except CheckpointError as exc:
                problems.append(str(exc))
                log.warning("%s; trying an older checkpoint", exc)
                continue
            if problems:
                log.warning("resuming from %s (step %d) because a newer checkpoint was unusable", path, state["step"])
            return state
        raise CheckpointError(f"no usable checkpoint in {self.directory}: {'; '.join(problems)}")


def verified_load(path: Path, entry: dict[str, Any] | None = None) -> dict[str, Any]:
    """Check the file (size and step against its index entry, when it has one; every record's CRC32), then load."""
    if entry is not None and (size := path.stat().st_size) != entry["size"]:
        raise CheckpointError(
            f"checkpoint {path} is truncated or altered ({size} bytes, the index says {entry['size']})"
        )
    try:
        with zipfile.ZipFile(path) as archive:
            bad_record = archive.testzip()
    except (zipfile.BadZipFile, OSError) as exc:
        raise CheckpointError(f"checkpoint {path} is not a complete checkpoint ({exc})") from None
    if bad_record is not None:
        raise CheckpointError(f"checkpoint {path} is corrupt: record {bad_record} fails its CRC32")
    state = load_checkpoint(path)
    if entry is not None and state["step"] != entry["step"]:
        raise CheckpointError(f"checkpoint {path} holds step {state['step']}, the index says {entry['step']}")
    return state


def load_checkpoint(path: Path) -> dict[str, Any]:
    """Load with weights_only=True: a checkpoint holds tensors and plain values, never code."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # garbage bytes surface as any of a dozen error types from the unpickler
        raise CheckpointError(
            f"checkpoint {path} is corrupt or not a plain-tensor checkpoint ({type(exc).__name__} from torch.load)"
        ) from exc
    if not isinstance(state, dict) or "model" not in state or "step" not in state:
        raise CheckpointError(f"checkpoint {path} is not a hyperpod-pretrain checkpoint (no model/step entries)")
    return state


# -- schema -----------------------------------------------------------------------------------------------


def schema_of(state: dict[str, Any]) -> int:
    return int(state.get("schema", 1))


def check_schema(state: dict[str, Any]) -> None:
    """A checkpoint of a newer trainer holds what this one cannot read correctly: refused."""
    if schema_of(state) > SCHEMA:
        raise CheckpointError(
            f"the checkpoint of step {state['step']} has schema {schema_of(state)}, newer than this trainer's "
            f"{SCHEMA}: resume it with the trainer that wrote it or a newer one"
        )


def unchecked_by_old_checkpoint(state: dict[str, Any]) -> list[str]:
    """What a resume cannot check because the checkpoint's schema predates its recording (empty: nothing)."""
    return [what for what, since in RECORDED_SINCE.items() if schema_of(state) < since]


def old_checkpoint_warning(unchecked: list[str]) -> str:
    """One line for unchecked_by_old_checkpoint's list."""
    verb = "is" if len(unchecked) == 1 else "are"
    return f"the checkpoint predates schema {SCHEMA}: {' and '.join(unchecked)} {verb} not recorded, so not checked"


# -- RNG state ------------------------------------------------------------------------------------------


def rng_state() -> dict[str, Any]:
    """Every random generator this process uses, in a form weights_only loading accepts."""
    py = random.getstate()
    np_state = np.random.get_state()
    state: dict[str, Any] = {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *map(float, np_state[2:])],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), int(pos), int(has_gauss), cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
