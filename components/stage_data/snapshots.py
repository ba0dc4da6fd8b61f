"""Which tokenized snapshots of a dataset runs still use, and removing the others.

A snapshot is in use while it is the dataset's current one, or a run names it: in its config.json (the trainer
writes the snapshot it trains on at every start) or in its stage-data step record (written when the pipeline's
staging ends, so a run whose job still waits in a queue holds its snapshot too). Runs started from the command
line hold theirs from the trainer's first start: prune while such a run is queued and it finds its snapshot gone.
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from common.errors import InputError
from trainer.layout import TOKENIZER, DatasetPaths, RunPaths
from trainer.snapshot import config_snapshot

log = logging.getLogger(__name__)


@dataclass
class PruneResult:
    dataset: str
    current: str
    removed: list[str] = field(default_factory=list)
    in_use: dict[str, list[str]] = field(default_factory=dict)  # snapshot -> the runs that use it
    bytes_freed: int = 0


def snapshot_dirs(paths: DatasetPaths) -> list[Path]:
    """Every snapshot of the dataset, and the one directory of a dataset staged before snapshots."""
    found = sorted(p for p in paths.snapshots.glob("*") if p.is_dir() and not p.name.startswith("."))
    return found + ([paths.legacy_tokenized] if paths.legacy_tokenized.is_dir() else [])


def runs_by_snapshot(storage_root: str | Path, paths: DatasetPaths) -> dict[str, list[str]]:
    """Snapshot id -> the run ids that use it (see the module docstring)."""
    users: dict[str, list[str]] = {}
    for run_dir in sorted(Path(storage_root, "runs").glob("*")):
        run = RunPaths(run_dir)
        for dataset, snapshot in filter(None, (_config_snapshot(run), _staged_snapshot(run))):
            if dataset == paths.name and run_dir.name not in users.setdefault(snapshot, []):
                users[snapshot].append(run_dir.name)
    return users


def _config_snapshot(run: RunPaths) -> tuple[str, str] | None:
    try:
        return config_snapshot(json.loads(run.config.read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _staged_snapshot(run: RunPaths) -> tuple[str, str] | None:
    try:
        details = json.loads(run.step_record("stage-data").read_text()).get("details", {})
        return details["dataset"], details["snapshot"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def directory_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


def unused_snapshots(storage_root: str | Path, paths: DatasetPaths) -> list[Path]:
    current = paths.current_snapshot()
    users = runs_by_snapshot(storage_root, paths)
    return [d for d in snapshot_dirs(paths) if d != current and d.name not in users]


def prune_snapshots(storage_root: str, dataset: str, dry_run: bool = False) -> PruneResult:
    """Remove the snapshots of `dataset` that are not current and that no run uses."""
    try:
        paths = DatasetPaths.of(storage_root, dataset)
        current = paths.current_snapshot()
    except ValueError as exc:
        raise InputError(str(exc)) from None
    if current is None:
        raise InputError(f"dataset {dataset!r} is not staged under {storage_root}: nothing to prune")
    result = PruneResult(dataset, current.name, in_use=runs_by_snapshot(storage_root, paths))
    for directory in unused_snapshots(storage_root, paths):
        size = directory_bytes(directory)
        if not dry_run:
            # Renamed first, so that a prune killed midway leaves a hidden directory, never a half snapshot.
            doomed = directory.with_name(f".pruning.{directory.name}")
            directory.rename(doomed)
            shutil.rmtree(doomed)
        result.removed.append(directory.name)
        result.bytes_freed += size
        log.info(
            "%s snapshot %s of %s (%.1f MB)",
            "would remove" if dry_run else "removed",
            directory.name,
            dataset,
            size / 1e6,
        )
    if not dry_run:
        for leftover in [*paths.snapshots.glob(".pruning.*"), *paths.root.glob(".pruning.*")]:  # a killed prune's
            shutil.rmtree(leftover, ignore_errors=True)
    return result


PREVIOUS = "previous"


def resolve_init_run(storage_root: str, dataset: str, init_from: str, run_id: str) -> str:
    """The run a warm start begins from: the one named, or "previous", the newest other run of `dataset` whose
    training finished (status.json says done)."""
    if not init_from:
        return ""
    if init_from != PREVIOUS:
        try:
            origin = RunPaths.of(storage_root, init_from)
        except ValueError as exc:
            raise InputError(f"init_from_run_id: {exc}") from None
        if init_from == run_id:
            raise InputError(f"init_from_run_id {init_from!r} is this run: to continue it, resume it instead")
        if not origin.has_checkpoint():
            raise InputError(f"init_from_run_id {init_from!r}: {origin.checkpoints} holds no checkpoint")
        return init_from
    finished = []
    for status in Path(storage_root, "runs").glob("*/status.json"):
        run = RunPaths(status.parent)
        try:
            done = json.loads(status.read_text()).get("state") == "done"
        except (OSError, ValueError):
            continue
        used = _config_snapshot(run)
        if done and run.root.name != run_id and used is not None and used[0] == dataset:
            finished.append((status.stat().st_mtime, run.root.name))
    if not finished:
        raise InputError(f"init_from_run_id 'previous': no finished run of dataset {dataset!r} under {storage_root}")
    return max(finished)[1]


def run_tokenizer(storage_root: str, run_id: str) -> Path:
    """The tokenizer a run trained with (its snapshot's): a warm start from it stages with the same one."""
    run = RunPaths.of(storage_root, run_id)
    used = _config_snapshot(run)
    if used is None:
        raise InputError(f"init_from_run_id {run_id!r}: {run.config} is missing or unreadable")
    directory = DatasetPaths.of(storage_root, used[0]).resolve_snapshot(used[1])
    if directory is None or not (directory / TOKENIZER).is_file():
        raise InputError(
            f"init_from_run_id {run_id!r}: its snapshot {used[1]} of dataset {used[0]!r} is gone, and "
            "its tokenizer with it: that run cannot be continued with the same token ids"
        )
    return directory / TOKENIZER
