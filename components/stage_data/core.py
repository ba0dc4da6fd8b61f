"""Stage a corpus onto the shared volume: mirror it (incrementally, verified), then tokenize it for the trainer.

Nothing half-done is ever visible to a later step: mirrored files land under temporary names, the
manifest is written last, and a tokenized snapshot is built under a temporary name and renamed into place whole,
beside the older snapshots that runs may still be training on.
"""

from __future__ import annotations

import logging
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from common.errors import InputError
from components.stage_data import report
from components.stage_data.formats import may_hold_records
from components.stage_data.mirror import MirrorResult, mirror, staging_lock
from components.stage_data.models import check_tokenizer, own_tokenizer, published_model
from components.stage_data.settings import StageSettings, check_source
from components.stage_data.snapshots import directory_bytes, resolve_init_run, run_tokenizer, unused_snapshots
from components.stage_data.sources import LocalSource, select
from components.stage_data.tokenization.encode import encode_group
from components.stage_data.tokenization.finalize import finalize_snapshot
from components.stage_data.tokenization.plan import plan_snapshot
from components.stage_data.tokenization.snapshot import TokenizeResult, current_snapshot_id, read_meta
from components.stage_data.tokenizer import read_given, snapshot_tokenizer
from trainer.layout import DatasetPaths
from trainer.published import PublishedModel

log = logging.getLogger(__name__)


@dataclass
class PlanResult(MirrorResult):
    dataset_dir: str
    snapshot: str
    groups: int  # groups to encode; 0: the snapshot exists already
    mirror_mb_per_s: float
    init_from_run_id: str  # a warm start's origin, resolved ("previous" named); its tokenizer was used
    init_from_model: str  # the published model to start from, on the volume (copied there from S3); "": none


@dataclass
class StageResult(PlanResult):
    tokenized_dir: str  # the snapshot's directory
    train_tokens: int
    val_tokens: int
    vocab_size: int  # the tokenizer's
    model_vocab_size: int  # the model's: the tokenizer's padded to a multiple of 64
    val_files: int
    tokenized: bool  # False: the snapshot existed already
    seconds: float
    documents: dict[str, Any]  # formats, skipped records, tokens per document, each format's first document


def stage_data(source: str, storage_root: str, dataset: str, **settings: Any) -> StageResult:
    """Mirror, plan, encode every group in turn and finalize, in this process (the command line, the tests); the
    pipeline runs the groups in parallel pods. `settings` are StageSettings' fields."""
    started = time.perf_counter()
    planned = mirror_and_plan(StageSettings.of_step(source, storage_root, dataset, **settings))
    paths = DatasetPaths.of(storage_root, dataset)
    for group in range(planned.groups):
        encode_group(paths, planned.snapshot, group)
    tokens = finish_snapshot(storage_root, dataset, planned.snapshot, skipped=not planned.groups)
    result = StageResult(
        **asdict(planned),
        tokenized_dir=tokens.snapshot_dir,
        train_tokens=tokens.train_tokens,
        val_tokens=tokens.val_tokens,
        vocab_size=tokens.vocab_size,
        model_vocab_size=tokens.model_vocab_size,
        val_files=tokens.val_files,
        tokenized=not tokens.skipped,
        seconds=round(time.perf_counter() - started, 3),
        documents=tokens.documents,
    )
    log.info("staged %s into %s (snapshot %s) in %.1fs", source, paths.root, result.snapshot, result.seconds)
    return result


def finish_snapshot(storage_root: str, dataset: str, snapshot: str, skipped: bool = False) -> TokenizeResult:
    """Finalize the snapshot (every group encoded) under the staging lock and make it current."""
    try:
        paths = DatasetPaths.of(storage_root, dataset)
        paths.snapshot(snapshot)
    except ValueError as exc:
        raise InputError(str(exc)) from None
    with staging_lock(paths):
        result = finalize_snapshot(paths, snapshot, skipped=skipped)
    report_unused_snapshots(storage_root, paths)
    return result


def mirror_and_plan(settings: StageSettings) -> PlanResult:
    """Mirror the source and plan its snapshot (val split, tokenizer, groups), under the dataset's staging lock.
    With `init_from_run_id` (a run, or "previous"), the snapshot uses that run's tokenizer, for a warm start."""
    paths = settings.check()
    model = starting_model(settings)
    tokenizer_path = settings.tokenizer_path or (own_tokenizer(model, settings.init_from_model) if model else "")
    given = read_given(tokenizer_path, settings.endpoint_url) if tokenizer_path else None
    if model is not None and given is not None:
        check_tokenizer(model, settings.init_from_model, given.load(), settings.tokenizer_path or "(the model's)")
        given_as = f"tokenizer {settings.tokenizer_path} (its vocabulary)" if settings.tokenizer_path else "its own"
        log.info("starting from the published model %s: staging with %s", settings.init_from_model, given_as)
    init_from = resolve_init_run(settings.storage_root, settings.dataset, settings.init_from_run_id, settings.run_id)
    if init_from:
        tokenizer_path = str(run_tokenizer(settings.storage_root, init_from))
        given = snapshot_tokenizer(Path(tokenizer_path))
        log.info("warm start from run %s: staging with its tokenizer %s", init_from, tokenizer_path)

    src = open_source(settings.source, settings.endpoint_url, settings.workers, settings.chunk_size_mb)
    try:
        listed = src.list()  # the whole source: the mirror keeps what the filters leave out, if it is unchanged
        objects = select(listed, settings.source, settings.include, settings.exclude)
        if len(objects) == 1 and not may_hold_records(objects[0].key):  # refused before anything is written
            raise InputError(
                f"source {settings.source}: 1 plain-text file to stage; the val split holds out "
                "whole files of plain text, so give at least 2 (or documents in JSON Lines or "
                "Parquet files)"
            )
        prepare_storage_root(settings.storage_root)
        with staging_lock(paths):
            mirrored = mirror(src, objects, paths, settings.workers, settings.keep_deleted, listed=listed)
            plan = plan_snapshot(paths, settings, [o.key for o in objects], mirrored.content_sha256, given)
    finally:
        src.close()
    return PlanResult(
        **asdict(mirrored),
        dataset_dir=str(paths.root),
        snapshot=plan.snapshot if plan is not None else current_snapshot_id(paths),
        groups=len(plan.groups) if plan is not None else 0,
        mirror_mb_per_s=round(mirrored.bytes_copied / max(mirrored.mirror_seconds, 1e-9) / 1e6, 2),
        init_from_run_id=init_from,
        init_from_model=str(model.path) if model is not None else "",
    )


def starting_model(settings: StageSettings) -> PublishedModel | None:
    """init_from_model checked, on the volume (copied from S3 once), or None."""
    if not settings.init_from_model:
        return None
    return published_model(
        settings.init_from_model, settings.storage_root, settings.endpoint_url, settings.workers, settings.chunk_size_mb
    )


def report_unused_snapshots(storage_root: str, paths: DatasetPaths) -> None:
    unused = unused_snapshots(storage_root, paths)
    if unused:
        log.info(
            "%d older snapshots of %s (%.1f GB) are used by no run: 'hyperpod-pretrain prune-snapshots' removes them",
            len(unused),
            paths.name,
            sum(map(directory_bytes, unused)) / 1e9,
        )


def staged_dataset(storage_root: str, dataset: str) -> tuple[Path, dict[str, Any]]:
    """The current snapshot's directory and meta.json, for a run that skips staging; fails if there is none."""
    try:
        paths = DatasetPaths.of(storage_root, dataset)
        directory = paths.current_snapshot()
    except ValueError as exc:
        raise InputError(str(exc)) from None
    meta = read_meta(directory) if directory is not None else None
    if directory is None or meta is None:
        raise InputError(
            f"skip_staging: dataset {dataset!r} is not staged under {storage_root} (no snapshot at "
            f"{directory or paths.current}): stage it first"
        )
    return directory, meta


def open_source(source: str, endpoint_url: str, workers: int, chunk_size_mb: int):
    check_source(source)
    if source.startswith("s3://"):
        from common.s3 import S3Settings, S3Source

        return S3Source(
            source, S3Settings(endpoint_url=endpoint_url, workers=workers, chunk_size=chunk_size_mb * 2**20)
        )
    return LocalSource(source)


def prepare_storage_root(storage_root: str) -> None:
    root = Path(storage_root)
    try:
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=root):
            pass
    except OSError as exc:
        raise InputError(f"storage root {storage_root}: not writable ({exc.strerror or exc})") from None


def plan_markdown(source: str, result: PlanResult) -> str:
    """The staging step's report in the KFP UI: the mirror, and the snapshot it planned."""
    planned = f"{result.groups} groups to encode" if result.groups else "exists already: nothing to tokenize"
    return "\n".join(
        [
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
            f"| snapshot | `{result.snapshot}` ({planned}) |",
        ]
    )


def snapshot_markdown(result: TokenizeResult) -> str:
    """The finalize step's report: what the snapshot holds."""
    made = "tokenized now" if not result.skipped else "existed already"
    return "\n".join(
        [
            "## Dataset snapshot",
            "",
            f"Snapshot `{result.snapshot}` at `{result.snapshot_dir}` ({made}).",
            "",
            "| | |",
            "|---|---:|",
            f"| tokens | {result.train_tokens:,} train + {result.val_tokens:,} val |",
            f"| vocabulary | {result.vocab_size:,} tokens (the model's: {result.model_vocab_size:,}) |",
            f"| time | {result.seconds:.1f} s |",
            *([""] + report.markdown(result.documents) if result.documents else []),
        ]
    )
