"""Stage a corpus onto the shared volume: mirror it (incrementally, verified), then tokenize it for the trainer.

Nothing half-done is ever visible to a later step: mirrored files land under temporary names, the
manifest is written last, and a tokenized snapshot is built under a temporary name and renamed into place whole,
beside the older snapshots that runs may still be training on.
"""

from __future__ import annotations

import fcntl
import logging
import tempfile
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from components.errors import InputError
from components.stage_data.mirror import MirrorResult, mirror
from components.stage_data.snapshots import directory_bytes, unused_snapshots
from components.stage_data.sources import DEFAULT_EXCLUDE, LocalSource, select
from components.stage_data.tokenization import SHARD_TOKENS, read_meta, tokenize
from trainer.layout import DatasetPaths

log = logging.getLogger(__name__)


@dataclass
class StageResult(MirrorResult):
    dataset_dir: str
    tokenized_dir: str  # the snapshot's directory
    snapshot: str
    mirror_mb_per_s: float
    train_tokens: int
    val_tokens: int
    vocab_size: int
    val_files: int
    tokenized: bool  # False: the shards were already up to date
    seconds: float


def stage_data(
    source: str,
    storage_root: str,
    dataset: str,
    vocab_size: int = 4096,
    val_fraction: float = 0.05,
    tokenizer_path: str = "",
    include: Iterable[str] = ("*",),
    exclude: Iterable[str] = DEFAULT_EXCLUDE,
    endpoint_url: str = "",
    workers: int = 16,
    chunk_size_mb: int = 8,
    keep_deleted: bool = False,
    shard_tokens: int = SHARD_TOKENS,
) -> StageResult:
    started = time.perf_counter()
    if not 256 < vocab_size <= 2**32:
        raise InputError(f"vocab size {vocab_size} is out of range: it must be above 256 (the byte alphabet)")
    if not 0 < val_fraction < 0.5:
        raise InputError(f"val fraction {val_fraction} is out of range: it must be between 0 and 0.5")
    if not 1 <= workers <= 256:
        raise InputError(f"workers {workers} is out of range: it must be between 1 and 256")
    if not 1 <= chunk_size_mb <= 5 * 1024:
        raise InputError(f"chunk size {chunk_size_mb} MB is out of range: it must be between 1 MB and 5 GB")
    if not 1024 <= shard_tokens <= 2**31:
        raise InputError(f"shard tokens {shard_tokens} is out of range: it must be between 1024 and 2**31")
    if tokenizer_path and not Path(tokenizer_path).is_file():
        raise InputError(f"tokenizer {tokenizer_path}: no such file")
    try:
        paths = DatasetPaths.of(storage_root, dataset)
    except ValueError as exc:
        raise InputError(str(exc)) from None

    src = open_source(source, endpoint_url, workers, chunk_size_mb)
    try:
        listed = src.list()  # the whole source: the mirror keeps what the filters leave out, if it is unchanged
        objects = select(listed, source, tuple(include), tuple(exclude))
        if len(objects) < 2:
            raise InputError(f"source {source}: 1 file to stage; the val split is held out by file, so give at least 2")
        prepare_storage_root(storage_root)
        with staging_lock(paths):
            mirrored = mirror(src, objects, paths, workers, keep_deleted, listed=listed)
            tokens = tokenize(paths, [o.key for o in objects], mirrored.content_sha256, vocab_size, val_fraction,
                              tokenizer_path, shard_tokens)  # fmt: skip
    finally:
        src.close()
    result = StageResult(
        **asdict(mirrored),
        dataset_dir=str(paths.root),
        tokenized_dir=tokens.snapshot_dir,
        snapshot=tokens.snapshot,
        mirror_mb_per_s=round(mirrored.bytes_copied / max(mirrored.mirror_seconds, 1e-9) / 1e6, 2),
        train_tokens=tokens.train_tokens,
        val_tokens=tokens.val_tokens,
        vocab_size=tokens.vocab_size,
        val_files=tokens.val_files,
        tokenized=not tokens.skipped,
        seconds=round(time.perf_counter() - started, 3),
    )
    log.info("staged %s into %s (snapshot %s) in %.1fs", source, paths.root, result.snapshot, result.seconds)
    unused = unused_snapshots(storage_root, paths)
    if unused:
        log.info("%d older snapshots of %s (%.1f GB) are used by no run: 'hyperpod-pretrain prune-snapshots' removes "
                 "them", len(unused), dataset, sum(map(directory_bytes, unused)) / 1e9)  # fmt: skip
    return result


def staged_dataset(storage_root: str, dataset: str) -> tuple[Path, dict[str, Any]]:
    """The current snapshot's directory and meta.json, for a run that skips staging; fails if there is none."""
    try:
        paths = DatasetPaths.of(storage_root, dataset)
        directory = paths.current_snapshot()
    except ValueError as exc:
        raise InputError(str(exc)) from None
    meta = read_meta(directory) if directory is not None else None
    if directory is None or meta is None:
        raise InputError(f"skip_staging: dataset {dataset!r} is not staged under {storage_root} (no snapshot at "
                         f"{directory or paths.current}): stage it first")  # fmt: skip
    return directory, meta


@contextmanager
def staging_lock(paths: DatasetPaths) -> Iterator[None]:
    """One staging run per dataset at a time (two pipeline runs may stage the same dataset); the next one waits."""
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


def open_source(source: str, endpoint_url: str, workers: int, chunk_size_mb: int):
    if source.startswith("s3://"):
        from components.stage_data.s3 import S3Settings, S3Source

        return S3Source(source, S3Settings(endpoint_url=endpoint_url, workers=workers,
                                           chunk_size=chunk_size_mb * 2**20))  # fmt: skip
    if "://" in source and not source.startswith("file://"):
        raise InputError(f"source {source}: unsupported scheme (use s3://, file:// or a local path)")
    return LocalSource(source)


def prepare_storage_root(storage_root: str) -> None:
    root = Path(storage_root)
    try:
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=root):
            pass
    except OSError as exc:
        raise InputError(f"storage root {storage_root}: not writable ({exc.strerror or exc})") from None


def summary_markdown(source: str, result: StageResult) -> str:
    """The step's report in the KFP UI."""
    tokenized = "re-tokenized" if result.tokenized else "unchanged, not re-tokenized"
    return "\n".join([
        "## Data staging",
        "",
        f"Source `{source}` mirrored to `{result.dataset_dir}`.",
        "",
        "| | |",
        "|---|---:|",
        f"| files | {result.files:,} ({result.bytes / 1e6:,.1f} MB) |",
        f"| copied | {result.files_copied:,} ({result.bytes_copied / 1e6:,.1f} MB) |",
        f"| unchanged (skipped) | {result.files_skipped:,} |",
        f"| removed from the mirror (gone from the source, or changed there while filtered out) | "
        f"{result.files_deleted:,} |",
        f"| kept outside the filter (unchanged in the source) | {result.files_retained:,} |",
        f"| mirror time | {result.mirror_seconds:.1f} s ({result.mirror_mb_per_s:.1f} MB/s) |",
        f"| tokens | {result.train_tokens:,} train + {result.val_tokens:,} val ({result.val_files} val files) |",
        f"| vocabulary | {result.vocab_size:,} ({tokenized}) |",
        f"| snapshot | `{result.snapshot}` |",
        f"| total time | {result.seconds:.1f} s |",
    ])  # fmt: skip
