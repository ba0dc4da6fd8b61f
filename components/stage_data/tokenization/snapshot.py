"""What the three stages of a snapshot's build hand one another on the volume, and where: the plan (plan.json: the
files of each group as Entry rows), a group's result, the finished snapshot's meta.json and current.json.

A snapshot is named by a hash of its inputs (sha256_text of them, plan.py); it is built under
snapshots/.building.<id>/ (building_dir) and renamed into place whole by the finalize step (finalize.py).
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.errors import StepFailed
from components.stage_data.formats import FileFormat
from trainer.atomic import write_json
from trainer.layout import META, DatasetPaths

FORMAT = 3  # of the shards and meta.json; a change re-tokenizes everything
PLAN = "plan.json"
SPLITS = ("train", "val")
BY_DOCUMENT = "documents"  # a record file's split in the plan: each document's own


@dataclass
class TokenizeResult:
    train_tokens: int
    val_tokens: int
    vocab_size: int
    val_files: int
    seconds: float
    skipped: bool
    snapshot: str  # its id: the directory's name under <dataset>/snapshots/
    snapshot_dir: str
    model_vocab_size: int = 0
    documents: dict[str, Any] = field(default_factory=dict)  # report.summary: formats, skipped, first documents


@dataclass
class Plan:
    """What every group's encoder reads (plan.json): the same tokenizer, dtype and shard size for all."""

    snapshot: str
    inputs: dict[str, Any]
    groups: list[list[list[str]]]  # per group: [key, format, split ("train", "val" or "documents")] in order
    dtype: str
    specials: dict[str, Any]  # Specials.to_dict(): bos, bos_id, eos, eos_id
    vocab_size: int  # the tokenizer's
    model_vocab_size: int  # the model's embedding rows: the tokenizer's padded to a multiple of 64
    shard_tokens: int
    files: int
    val_files: int  # plain-text files held out whole
    val_fraction: float  # of each record file's documents
    text_field: str
    max_bad_records: int
    block_bytes: int  # plain text's pieces

    @classmethod
    def read(cls, building: Path) -> Plan:
        return cls(**json.loads((building / PLAN).read_text()))


@dataclass
class GroupResult:
    group: int
    files: int
    files_resumed: int  # finished by an earlier, killed attempt: not encoded again
    text_bytes: int
    tokens: dict[str, int]
    shards: dict[str, list[dict[str, Any]]]
    seconds: float
    tally: dict[str, Any] = field(default_factory=dict)


def document_position(key: str, record: int) -> float:
    """Where a record file's document falls in [0, 1): below val_fraction, it is held out."""
    return int.from_bytes(hashlib.sha256(f"{key}\0{record}".encode()).digest()[:8], "big") / 2**64


@dataclass(frozen=True)
class Entry:
    """One file of a plan: its key, format and split ("documents": each record's own)."""

    key: str
    format: FileFormat
    split: str

    @classmethod
    def of(cls, row: list[str]) -> Entry:
        return cls(row[0], FileFormat.parse(row[1]), row[2])

    def split_of(self, record: int, val_fraction: float) -> str:
        if self.split != BY_DOCUMENT:
            return self.split
        return "val" if document_position(self.key, record) < val_fraction else "train"


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def building_dir(paths: DatasetPaths, snapshot: str) -> Path:
    return paths.snapshots / f".building.{snapshot}"


def planned(paths: DatasetPaths, snapshot: str) -> Plan:
    """The plan the encoders and the finalize step follow; without one, the staging step did not finish."""
    building = building_dir(paths, snapshot)
    try:
        return Plan.read(building)
    except (OSError, ValueError, TypeError) as exc:
        raise StepFailed(
            f"snapshot {snapshot} of {paths.name!r} has no plan in {building} ({exc}): stage again"
        ) from exc


def group_prefix(split: str, group: int) -> str:
    return f"{split}_g{group:03d}"


def read_meta(tokenized: Path) -> dict[str, Any] | None:
    try:
        return json.loads((tokenized / META).read_text())
    except (OSError, ValueError):
        return None


def make_current(paths: DatasetPaths, snapshot: str) -> None:
    """Point the dataset's current.json at `snapshot` (an atomic replace): the next run that stages nothing
    (skip_staging) trains on it; runs already training keep theirs."""
    write_json(paths.current, {"snapshot": snapshot, "time": time.time()})


def current_snapshot_id(paths: DatasetPaths) -> str:
    directory = paths.current_snapshot()
    if directory is None:
        raise StepFailed(f"dataset {paths.name!r} has no current snapshot")
    return directory.name
