"""Checkpoints: written by every rank in parallel, committed whole, verified on load, with older ones to fall back on.

    checkpoints/step_00000100/            one directory per saved step, the newest `keep` kept:
        __0_0.distcp, __1_0.distcp, ...   the model and optimizer tensors, each rank's share (trainer/dcp_io.py)
        .metadata                         DCP's index of them
        trainer_state.pt                  the rest: step, schedule, progress, data position, snapshot, settings
        rng_rank_00000.pt, ...            each rank's random generators (a rank's own, so never deduplicated)
        commit.json                       written last: step, world size, every file's size
    checkpoints/checkpoint_latest         a symbolic link to the newest committed step directory
    checkpoints/.step_00000110.attempt-3.tmp/   a save in progress; renamed to step_00000110 when complete

A save is a collective: each rank writes its files into the temporary directory, DCP writes .metadata once every
rank's share is on disk, then rank 0 writes commit.json and renames the directory into place, and only then moves
checkpoint_latest. A save killed at any point leaves the previous checkpoint as the newest committed one. Loading
takes the newest committed directory whose files have the sizes commit.json lists (else the next older), reads the
tensors once across the ranks with every record's CRC32 checked, and accepts a different world size.

Asynchronous saves hand DCP's stager a view of this rank's share of the live state: it copies it to host memory
(pinned, on a side stream, on GPU) while the next forward and backward run, and the trainer waits for that copy
before the optimizer changes the weights (wait_until_staged); the write, the commit and the durable copy to S3
happen in the background.

Checkpoints of the trainer before DCP, single files `checkpoint_step_00000100.pt` with `checkpoint_latest.pt` and
`index.json`, still load (the run goes on in the new format).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import random
import re
import shutil
import threading
import time
import zipfile
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from trainer import dcp_io
from trainer.atomic import atomic_open, fsync_dir, replace_dir, write_json
from trainer.errors import CheckpointError
from trainer.layout import CHECKPOINT_COMMIT, CHECKPOINT_LATEST, CHECKPOINT_STEP_DIR

log = logging.getLogger(__name__)

LATEST, COMMIT, STEP_DIR = CHECKPOINT_LATEST, CHECKPOINT_COMMIT, CHECKPOINT_STEP_DIR
TRAINER_STATE = "trainer_state.pt"
# Single-file checkpoints, before DCP.
LEGACY_LATEST = "checkpoint_latest.pt"
INDEX = "index.json"
_STEP_FILE = re.compile(r"^checkpoint_step_(\d+)\.pt$")
# The layout of the trainer's saved state, under "schema"; a checkpoint without one is schema 1.
# 2: the learning-rate schedule (trainer/schedule.py) under "schedule", instead of a LambdaLR's state under "scheduler".
# 3: a DCP directory (model and optimizer by parameter name, each rank's RNG in its own file).
SCHEMA = 3
# What a resume checks that a checkpoint records only from some schema on: an older checkpoint resumes unchecked.
RECORDED_SINCE = {
    "its learning-rate schedule (this run's flags set it)": 2,
    "its dataset snapshot (it goes on with --data-dir's)": 2,
}


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def step_file_name(step: int) -> str:
    """A single-file checkpoint's name (before DCP)."""
    return f"checkpoint_step_{step:08d}.pt"


def rng_file_name(rank: int) -> str:
    return f"rng_rank_{rank:05d}.pt"


class Mirror(Protocol):
    """A durable copy of committed checkpoints elsewhere (trainer/durable.py: S3)."""

    def upload(self, committed: Path) -> None: ...
    def newest_complete(self) -> str | None: ...
    def download(self, name: str, into: Path) -> Path: ...
    def prune(self, keep: set[str]) -> None: ...


@dataclass
class Checkpoint:
    """One committed checkpoint: a DCP directory, or a single file from before DCP (its state read whole)."""

    path: Path
    step: int
    legacy_state: dict[str, Any] | None = field(default=None, repr=False)

    @property
    def sharded(self) -> bool:
        return self.path.is_dir()

    def trainer_state(self) -> dict[str, Any]:
        """Everything but the model and optimizer tensors (for a single file: everything, read once)."""
        if self.sharded:
            return _load_plain(self.path / TRAINER_STATE)
        if self.legacy_state is None:
            self.legacy_state = verified_load(self.path)
        return self.legacy_state

    def rng_of(self, rank: int) -> dict[str, Any] | None:
        """The random generators `rank` had at the save, or None if the saved run had no such rank."""
        if not self.sharded:
            rngs = self.trainer_state()["rng"]
            return rngs[rank] if rank < len(rngs) else None
        path = self.path / rng_file_name(rank)
        return _load_plain(path) if path.exists() else None


def _load_plain(path: Path) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # garbage bytes surface as any of a dozen error types from the unpickler
        raise CheckpointError(
            f"checkpoint {path} is corrupt or not a plain-tensor checkpoint ({type(exc).__name__} from torch.load)"
        ) from exc


def _lower_priority() -> None:
    """Nice the writer thread: where training runs on the CPU, its cores go to training first."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):  # not Linux, or not allowed: the thread runs at normal priority
        pass


@dataclass
class SaveReport:
    """What the latest commit took: for the budget check and the log."""

    step: int
    seconds: float
    total_bytes: int
    largest_share: int
    writers: int

    @property
    def parallel_speedup(self) -> float:
        """How much faster than one process writing everything at the same rate: total over the largest share."""
        return self.total_bytes / max(self.largest_share, 1)


# Errors a restart cannot fix: the next attempt meets the same full or read-only volume, or the same permissions.
PERMANENT_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM})


class SaveFailed(Exception):
    """A checkpoint could not be written or committed (DCP's CheckpointException, which is a BaseException, or an
    OSError of our own files), as one error of the trainer's: the last committed checkpoint is untouched.
    `permanent`: a restart would meet the same wall."""

    def __init__(self, step: int, cause: BaseException, volume: Path | None = None, share_bytes: int = 0):
        causes = [cause, *_failures(cause)]
        self.step = step
        self.permanent = any(isinstance(c, OSError) and c.errno in PERMANENT_ERRNOS for c in causes)
        # A full volume does not always say so: torch.save's zip writer reports a short write as "unexpected pos".
        free = shutil.disk_usage(volume).free if volume is not None and volume.exists() else None
        full = free is not None and free < share_bytes
        if full:
            self.permanent = True
        what = (
            f"the volume is full ({free / 1e6:.1f} MB free, less than this rank's {share_bytes / 1e6:.1f} MB "
            f"share; {_first_failure(cause)})"
            if full
            else _first_failure(cause)
        )
        advice = "; a restart will not help: free space on the volume or fix its permissions" if self.permanent else ""
        super().__init__(f"the checkpoint of step {step} could not be written: {what}{advice}")


@contextlib.contextmanager
def _save_failure(step: int, volume: Path | None = None, share_bytes: int = 0) -> Iterator[None]:
    """Whatever fails inside (DCP's CheckpointException, an OSError of our own files) comes out as SaveFailed."""
    try:
        yield
    except (CheckpointException, OSError) as exc:
        raise SaveFailed(step, exc, volume, share_bytes) from exc


class CheckpointManager:
    """Saves and finds the checkpoints of one run. Every rank makes one, with the same arguments; saving and
    restoring are collectives over `group` (a gloo group of its own: DCP's planning runs in a background thread
    for asynchronous saves and must not interleave with training's collectives)."""

    def __init__(
        self,
        directory: Path,
        keep: int = 3,
        async_save: bool = False,
        attempt: int = 0,
        group: dist.ProcessGroup | None = None,
        mirror: Mirror | None = None,
        fail_from_step: int = 0,
    ):
        self.directory = directory
        self.fail_from_step = fail_from_step  # fault injection: saves of this step or later fail (ENOSPC)
        self.keep = keep
        self.async_save = async_save
        self.attempt = attempt
        self.group = group
        self.mirror = mirror
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        # One background thread, in order: the commit after an asynchronous write, deleting old checkpoints.
        self._background = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="checkpoint", initializer=_lower_priority
        )
        self._uploads = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="checkpoint-mirror", initializer=_lower_priority
        )
        self._pending: Future[SaveReport | None] | None = None
        self._pending_step = 0
        self._staged: Future[Any] | None = None  # the pending save's copy of the live state
        self._upload: Future[None] | None = None
        self._stager: DefaultStager | None = None
        self._swept = False
        self._share_logged = False
        self._share_bytes = 0  # what this rank writes in a save: a volume with less free failed for want of space
        self.last_save: SaveReport | None = None
        self._committed: deque[SaveReport] = deque()  # committed since the last take_committed (background ones too)

    def take_committed(self) -> list[SaveReport]:
        """The saves committed since the last call, oldest first: each is reported once, also a background one
        that committed while the final save waited for it."""
        reports = []
        while self._committed:
            reports.append(self._committed.popleft())
        return reports

    @property
    def latest(self) -> Path:
        return self.directory / LATEST

    # -- saving ---------------------------------------------------------------------------------------

    def save(
        self,
        step: int,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        trainer_state: dict[str, Any],
        rng: dict[str, Any],
        blocking: bool = True,
    ) -> float:
        """Commit the state of `step` (collective); returns the seconds the caller was held up.

        `trainer_state` is the same on every rank (rank 0's is written); `rng` is this rank's. An asynchronous save
        reads the live tensors in the background: nothing may change them until wait_until_staged() has returned.
        """
        started = time.perf_counter()
        self.wait()  # one save at a time, in order
        with _save_failure(step, self.directory, self._share_bytes):
            self._save(step, model, optimizer, trainer_state, rng, blocking, started)
        return time.perf_counter() - started

    def _save(
        self,
        step: int,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        trainer_state: dict[str, Any],
        rng: dict[str, Any],
        blocking: bool,
        started: float,
    ) -> None:
        tmp = self.directory / f".{step_dir_name(step)}.attempt-{self.attempt}.tmp"
        self._sweep()
        tmp.mkdir(parents=True, exist_ok=True)
        writer = dcp_io.writer(tmp, full=bool(self.fail_from_step) and step >= self.fail_from_step)
        tensors, optimizer_groups = dcp_io.split_state(model, optimizer)
        mine = dcp_io.share(tensors, self.rank, dist.get_world_size(self.group) if dist.is_initialized() else 1)
        self._share_bytes = sum(t.nbytes for t in mine.values())
        if not self._share_logged:
            self._share_logged = True
            largest = max(t.nbytes for t in tensors.values())
            log.info(
                "this rank writes %.3f MB of the %.3f MB state (%d ranks; the largest tensor is %.3f MB)",
                sum(t.nbytes for t in mine.values()) / 1e6,
                sum(t.nbytes for t in tensors.values()) / 1e6,
                dist.get_world_size(self.group) if dist.is_initialized() else 1,
                largest / 1e6,
            )
        with atomic_open(tmp / rng_file_name(self.rank)) as f:
            torch.save(rng, f)
        if self.rank == 0:
            tied = dcp_io.tied_aliases(model.state_dict())  # left out of the tensors; a reader puts them back
            with atomic_open(tmp / TRAINER_STATE) as f:
                torch.save({**trainer_state, "optimizer_groups": optimizer_groups, "tied": tied}, f)
        if blocking or not self.async_save:
            dcp.save(mine, storage_writer=writer, process_group=self.group, no_dist=not dist.is_initialized())
            self.last_save = self._commit(tmp, step, started)
        else:
            if torch.cuda.is_available():  # the side stream's copy must not start before this step's updates end
                torch.cuda.current_stream().synchronize()
            response = dcp.async_save(
                mine,
                storage_writer=writer,
                process_group=self.group,
                async_stager=self._get_stager(),
                no_dist=not dist.is_initialized(),
            )
            self._staged, self._pending_step = response.staging_completion, step
            self._pending = self._background.submit(
                self._commit_when_written, response.upload_completion, tmp, step, started
            )

    def _get_stager(self) -> DefaultStager:
        """One stager for the run: it keeps its host buffers (pinned on GPU) from one save to the next."""
        if self._stager is None:
            cuda = torch.cuda.is_available()
            options = StagingOptions(
                use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=True, use_non_blocking_copy=cuda
            )
            self._stager = DefaultStager(options)
        return self._stager

    def wait_until_staged(self) -> float:
        """Block until the pending asynchronous save has its own copy of the state; returns the seconds waited."""
        if self._staged is None:
            return 0.0
        started = time.perf_counter()
        staged, self._staged = self._staged, None
        with _save_failure(self._pending_step, self.directory, self._share_bytes):
            staged.result()
        return time.perf_counter() - started

    def wait(self) -> None:
        """Block until the pending asynchronous save is committed; SaveFailed if it failed."""
        self.wait_until_staged()
        if self._pending is not None:
            pending, self._pending = self._pending, None
            with _save_failure(self._pending_step, self.directory, self._share_bytes):
                report = pending.result()
            if report is not None:
                self.last_save = report

    def close(self, wait_for_mirror: bool = True) -> None:
        """Finish the pending save; with `wait_for_mirror`, also its durable copy (a preempted run has no time)."""
        try:
            self.wait()
            if wait_for_mirror and self._upload is not None:
                self._upload.result()
        finally:
            self._background.shutdown(wait=True)
            self._uploads.shutdown(wait=wait_for_mirror, cancel_futures=not wait_for_mirror)
            if self._stager is not None:
                self._stager.close()

    def _commit_when_written(self, written: Future[Any], tmp: Path, step: int, started: float) -> SaveReport | None:
        written.result()
        return self._commit(tmp, step, started)

    def _commit(self, tmp: Path, step: int, started: float) -> SaveReport | None:
        """Rank 0, once DCP has written .metadata (every rank's share is on disk): commit.json, rename, link."""
        if self.rank != 0:
            return None
        files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file()}
        shares = dcp_io.written_bytes(tmp)
        world = len(list(tmp.glob("rng_rank_*.pt")))
        write_json(tmp / COMMIT, {"step": step, "world_size": world, "files": files, "time": time.time()})
        fsync_dir(tmp)
        final = self.directory / step_dir_name(step)
        replace_dir(tmp, final)
        self._point_latest_at(final.name)
        report = SaveReport(
            step, time.perf_counter() - started, sum(shares.values()), max(shares.values(), default=0), len(shares)
        )
        log.info(
            "checkpoint of step %d committed: %s, %.1f MB written by %d ranks in %.2fs (%.0f MB/s; the largest "
            "share is 1/%.1f of the state)",
            step,
            final.name,
            report.total_bytes / 1e6,
            report.writers,
            report.seconds,
            report.total_bytes / 1e6 / max(report.seconds, 1e-9),
            report.parallel_speedup,
        )
        committed = committed_checkpoints(self.directory)
        kept, old = committed[: self.keep], [c.path for c in committed[self.keep :]]
        # Freeing gigabytes takes a while and nothing waits for it: leave it to the background.
        self._background.submit(self._delete, old)
        if self.mirror is not None:
            self._upload = self._uploads.submit(self._mirror, final, {c.path.name for c in kept})
        self.last_save = report  # also when committed in the background: the budget check reads it
        self._committed.append(report)
        return report

    def _mirror(self, committed: Path, keep: set[str]) -> None:
        """The durable copy of one commit; a failure is logged, not raised: training goes on with the FSx copy."""
        try:
            if committed.exists():  # not already replaced by newer ones past `keep`
                self.mirror.upload(committed)
                self.mirror.prune(keep)
        except Exception:
            log.exception("the durable copy of %s failed; the checkpoint on the volume is unaffected", committed.name)

    @staticmethod
    def _delete(paths: list[Path]) -> None:
        for path in paths:
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)

    def _sweep(self) -> None:
        """Once per manager, rank 0: remove what saves of earlier attempts left half-written (this attempt's own
        temporary directories are saves in progress)."""
        if self._swept or self.rank != 0:
            return
        self._swept = True
        for stale in self.directory.glob(".*.tmp"):
            if f".attempt-{self.attempt}." not in stale.name:
                self._delete([stale])
                log.info("removed %s, left by an interrupted save", stale.name)

    def _point_latest_at(self, name: str) -> None:
        tmp = self.directory / f".{LATEST}.{os.getpid()}.tmp"
        tmp.unlink(missing_ok=True)
        os.symlink(name, tmp)
        if self.latest.is_dir() and not self.latest.is_symlink():  # a copy of the run made without symlinks (cp -r)
            shutil.rmtree(self.latest)
        os.replace(tmp, self.latest)
        (self.directory / LEGACY_LATEST).unlink(missing_ok=True)  # a single-file run's link, superseded
        fsync_dir(self.directory)

    # -- finding and loading ------------------------------------------------------------------------------

    def newest(self) -> Checkpoint | None:
        """The newest good checkpoint (newest_checkpoint), fetched from the durable copy when the volume has none, as
        rank 0 finds it and tells every rank (collective): the ranks cannot disagree, however slow the file system
        or whatever an old pod left, and one process, not every rank, reads the directory and checks the files."""
        if not dist.is_initialized():
            return self._find()
        found: list[Any] = [None]
        if self.rank == 0:
            try:
                checkpoint = self._find()
                found = [None if checkpoint is None else (str(checkpoint.path), checkpoint.step)]
            except Exception as exc:  # every rank raises it, not only rank 0 while the others wait
                found = [exc]
        dist.broadcast_object_list(found, src=0, group=self.group)
        if isinstance(found[0], Exception):
            raise found[0]
        return None if found[0] is None else Checkpoint(Path(found[0][0]), found[0][1])

    def _find(self) -> Checkpoint | None:
        if self.mirror is not None and not committed_checkpoints(self.directory):
            self._fetch_from_mirror()
        return newest_checkpoint(self.directory)

    def _fetch_from_mirror(self) -> None:
        name = self.mirror.newest_complete()
        if name is None:
            return
        log.info("no checkpoint on the volume: fetching %s from the durable copy", name)
        self.mirror.download(name, self.directory)
        self._point_latest_at(name)

    def restore(self, checkpoint: Checkpoint, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Load the model and optimizer state of `checkpoint` into `model` and `optimizer` (collective for DCP)."""
        state = checkpoint.trainer_state()
        if not checkpoint.sharded:
            dcp_io.apply_whole_state(model, optimizer, state["model"], state["optimizer"])
            return
        tensors, _ = dcp_io.split_state(model, optimizer)
        try:
            if dist.is_initialized():
                dcp_io.load_shared(checkpoint.path, tensors, self.group)
            else:
                dcp.load(tensors, storage_reader=dcp_io.VerifyingReader(checkpoint.path), no_dist=True)
        except (CheckpointException, dcp_io.CorruptCheckpoint) as exc:
            raise CheckpointError(
                f"checkpoint {checkpoint.path} cannot be read: {_first_failure(exc)}; move the "
                "directory aside to resume from the one before"
            ) from None
        dcp_io.apply_state(model, optimizer, tensors, state["optimizer_groups"])


def _failures(exc: BaseException) -> list[BaseException]:
    """The exceptions DCP gathered from the ranks (CheckpointException.failures: rank -> (exception, traceback))."""
    failures = getattr(exc, "failures", None) or {}
    return [f[0] if isinstance(f, tuple) else f for f in failures.values()]


def _first_failure(exc: BaseException) -> str:
    """DCP gathers each rank's exception; the first says what was wrong (an OSError, if any: it names the cause)."""
    failures = _failures(exc)
    exc = next((f for f in failures if isinstance(f, OSError)), next(iter(failures), exc))
    return f"{exc}" if isinstance(exc, dcp_io.CorruptCheckpoint) else f"{type(exc).__name__}: {str(exc)[:300]}"


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def check_files(path: Path) -> dict[str, Any]:
    """A DCP checkpoint directory is complete: commit.json lists every file, and each has its size. Cheap (no data
    read); the records' CRC32 are checked as they are read."""
    commit = _read_json(path / COMMIT)
    if not commit.get("files"):
        raise CheckpointError(f"checkpoint {path} has no readable {COMMIT}: it was never committed")
    for name, size in commit["files"].items():
        actual = (path / name).stat().st_size if (path / name).is_file() else None
        if actual != size:
            found = "missing" if actual is None else f"{actual} bytes"
            raise CheckpointError(f"checkpoint {path} is truncated or altered: {name} is {found}, {COMMIT} says {size}")
    return commit


def committed_checkpoints(directory: Path) -> list[Checkpoint]:
    """The committed checkpoints of a run, newest first (DCP directories and single files alike), unverified."""
    found = []
    if directory.is_dir():
        for path in directory.iterdir():
            if (m := STEP_DIR.match(path.name)) and (path / COMMIT).exists():
                found.append(Checkpoint(path, int(m.group(1))))
            elif m := _STEP_FILE.match(path.name):
                found.append(Checkpoint(path, int(m.group(1))))
    return sorted(found, key=lambda c: (c.step, c.sharded), reverse=True)


def newest_checkpoint(directory: Path) -> Checkpoint | None:
    """The newest checkpoint of a run that passes its checks, else the next older; None when there is none at all."""
    candidates = committed_checkpoints(directory)
    if not candidates:
        return None
    problems = []
    for candidate in candidates:
        try:
            checkpoint = checked(candidate)
        except CheckpointError as exc:
            problems.append(str(exc))
            log.warning("%s; trying an older checkpoint", exc)
            continue
        if problems:
            log.warning(
                "resuming from %s (step %d) because a newer checkpoint was unusable", checkpoint.path, checkpoint.step
            )
        return checkpoint
    raise CheckpointError(f"no usable checkpoint in {directory}: {'; '.join(problems)}")


def checked(candidate: Checkpoint) -> Checkpoint:
    """A DCP directory: its files are all there at their sizes (cheap; the records' CRC32 are checked as they are
    read). A single file: read whole and checked (its index entry, every record's CRC32)."""
    if candidate.sharded:
        check_files(candidate.path)
        return candidate
    entries = {e["file"]: e for e in _read_json(candidate.path.parent / INDEX).get("checkpoints", [])}
    state = verified_load(candidate.path, entries.get(candidate.path.name))
    return Checkpoint(candidate.path, candidate.step, state)


def read_weights(checkpoint: Checkpoint) -> dict[str, torch.Tensor]:
    """The model's weights by parameter name, without reading the optimizer state (a single file: read whole)."""
    if not checkpoint.sharded:
        return checkpoint.trainer_state()["model"]
    tensors = _read_alone(checkpoint.path, dcp_io.MODEL)
    return _with_tied({k.removeprefix(dcp_io.MODEL): v for k, v in tensors.items()}, checkpoint.trainer_state())


def read_weights_into(checkpoint: Checkpoint, model: torch.nn.Module) -> None:
    """Fill `model`'s weights (any dtype, any device) from the checkpoint in place, a piece at a time, each converted
    as it is copied in: no second copy of the model exists. A weight the checkpoint lacks, or holds in another
    shape, is a CheckpointError naming it."""
    if not checkpoint.sharded:
        try:
            model.load_state_dict(checkpoint.trainer_state()["model"])
        except RuntimeError as exc:
            raise CheckpointError(str(exc).splitlines()[0]) from None
        return
    state = model.state_dict()
    tied = dcp_io.tied_aliases(state)  # the save left them out; filling the first fills both
    targets = {dcp_io.MODEL + name: tensor for name, tensor in state.items() if name not in tied}
    shapes = dcp_io.saved_shapes(checkpoint.path)
    for key, tensor in targets.items():
        if key not in shapes:
            raise CheckpointError(f"the checkpoint has no {key.removeprefix(dcp_io.MODEL)}")
        if shapes[key] != tuple(tensor.shape):
            raise CheckpointError(
                f"{key.removeprefix(dcp_io.MODEL)} is {list(shapes[key])} in the checkpoint and "
                f"{list(tensor.shape)} in the model"
            )
    try:
        dcp_io.load_into(checkpoint.path, targets)
    except (CheckpointException, dcp_io.CorruptCheckpoint) as exc:
        raise CheckpointError(f"checkpoint {checkpoint.path} cannot be read: {_first_failure(exc)}") from None


def _with_tied(weights: dict[str, torch.Tensor], trainer_state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The tied names the save left out, back beside the tensor they share."""
    return weights | {alias: weights[first] for alias, first in trainer_state.get("tied", {}).items()}


def _read_alone(path: Path, prefix: str = "") -> dict[str, torch.Tensor]:
    try:
        return dcp_io.load_alone(path, prefix)
    except (CheckpointException, dcp_io.CorruptCheckpoint) as exc:
        raise CheckpointError(f"checkpoint {path} cannot be read: {_first_failure(exc)}") from None


def read_checkpoint(path: Path) -> dict[str, Any]:
    """Everything a checkpoint holds, in the single-file layout ("model", "optimizer" (flat), "rng" per rank, and
    the trainer state), read by this process alone: for tests and tools."""
    if path.is_file():
        return verified_load(path)
    check_files(path)
    checkpoint = Checkpoint(path, 0)
    state = checkpoint.trainer_state()
    tensors = _read_alone(path)
    state["model"] = _with_tied(
        {k.removeprefix(dcp_io.MODEL): v for k, v in tensors.items() if k.startswith(dcp_io.MODEL)}, state
    )
    state["optimizer"] = {k.removeprefix(dcp_io.OPTIM): v for k, v in tensors.items() if k.startswith(dcp_io.OPTIM)}
    state["rng"] = [_load_plain(p) for p in sorted(path.glob("rng_rank_*.pt"))]
    return state


# -- single-file checkpoints (before DCP) ---------------------------------------------------------------------


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
    state = _load_plain(path)
    if not isinstance(state, dict) or "model" not in state or "step" not in state:
        raise CheckpointError(f"checkpoint {path} is not a hyperpod-pretrain checkpoint (no model/step entries)")
    if entry is not None and state["step"] != entry["step"]:
        raise CheckpointError(f"checkpoint {path} holds step {state['step']}, the index says {entry['step']}")
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
    since = min(RECORDED_SINCE[what] for what in unchecked)
    return f"the checkpoint predates schema {since}: {' and '.join(unchecked)} {verb} not recorded, so not checked"


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
    if torch.cuda.is_available():  # this process's device only: reading every GPU's would open a context on each
        state["cuda_device"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), int(pos), int(has_gauss), cached))
    torch.set_rng_state(state["torch"])
    if not torch.cuda.is_available():
        return
    if "cuda_device" in state:
        torch.cuda.set_rng_state(state["cuda_device"])
    elif "cuda" in state and torch.cuda.current_device() < len(state["cuda"]):  # written before: every GPU's
        torch.cuda.set_rng_state(state["cuda"][torch.cuda.current_device()])
