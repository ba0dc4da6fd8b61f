"""Encode one group of a planned snapshot (one process per group, in parallel pods): its documents read a part at a
time, encoded a batch at a time (the tokenizers library spreads a batch over every core), appended to the group's own
shard files as [BOS] tokens EOS; a journal records how far the group got (files, and Parquet row groups) with its
counts, so a killed group carries on there.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from common.errors import InputError
from components.stage_data import report
from components.stage_data.formats import reader_for
from components.stage_data.formats.reader import Piece, Skipped
from components.stage_data.progress import GroupProgress, Progress
from components.stage_data.shards import ShardWriter
from components.stage_data.tokenization.snapshot import (
    SPLITS,
    Entry,
    GroupResult,
    Plan,
    building_dir,
    group_prefix,
    planned,
    read_meta,
)
from trainer.atomic import write_json
from trainer.layout import TOKENIZER, DatasetPaths

log = logging.getLogger(__name__)

BATCH_BYTES = 16 * 2**20  # text per encode_batch call: enough work for every core, bounded memory
JOURNAL_EVERY_S = 5.0  # a killed group re-encodes at most this much work (and at most one Parquet row group)


def encode_in_order(
    items: Iterator[tuple[str | None, Any]], tokenizer: Tokenizer, write: Callable[[Any, list[int] | None], None]
) -> None:
    """For each (text, payload) in order, write(payload, the text's token ids), or write(payload, None) for an item
    without text; texts are encoded a batch at a time.

    The tokenizers library encodes a batch on every core without the GIL; this thread meanwhile writes out the
    previous batch and reads the next, so the cores are not left idle while Python copies tokens to the shards.
    """
    batch: list[str] = []
    payloads: list[tuple[bool, Any]] = []  # (has text, payload), in order
    size = 0
    in_flight: tuple[Future, list[tuple[bool, Any]]] | None = None

    def write_out(encoded: Future, batch_payloads: list[tuple[bool, Any]]) -> None:
        encodings = iter(encoded.result())
        for has_text, payload in batch_payloads:
            write(payload, next(encodings).ids if has_text else None)

    with ThreadPoolExecutor(1, thread_name_prefix="encode") as encoder:

        def submit() -> None:
            nonlocal in_flight, size
            previous = in_flight
            in_flight = (
                encoder.submit(tokenizer.encode_batch_fast, batch.copy(), add_special_tokens=False),
                payloads.copy(),
            )
            batch.clear()
            payloads.clear()
            size = 0
            if previous is not None:
                write_out(*previous)

        for text, payload in items:
            payloads.append((text is not None, payload))
            if text is not None:
                batch.append(text)
                size += len(text)
                if size >= BATCH_BYTES:
                    submit()
        if payloads:
            submit()
        if in_flight is not None:
            write_out(*in_flight)


@dataclass(frozen=True)
class FileStart:
    """A file's first part is about to be written (counted in order, like everything the journal's tally holds)."""

    format: str


@dataclass(frozen=True)
class PartDone:
    """Every document before this point of the group is written: (entry, part) is where a resumed group begins."""

    entry: int
    part: int
    replaced_bytes: int  # invalid UTF-8 replaced in the part just done


class GroupWriter:
    """Writes a group's documents into its split writers as [BOS] ids EOS, keeps its Tally, and journals how far it
    got every few seconds (after syncing the shards, so a journal line never promises tokens the disk lacks)."""

    def __init__(
        self, plan: Plan, group: int, writers: dict[str, ShardWriter], tally: report.Tally, journal_path: Path
    ):
        self.plan, self.group, self.writers, self.tally, self.journal_path = plan, group, writers, tally, journal_path
        self.dtype = np.dtype(plan.dtype)
        self.bos = plan.specials["bos_id"]
        self.eos = np.asarray([plan.specials["eos_id"]], dtype=self.dtype)
        self.document_tokens = 0
        self.pending: PartDone | None = None
        self.flushed = time.monotonic()
        self.files_done = 0  # by this attempt, written whole: for progress lines, as is text_written (characters)
        self.text_written = 0

    def write(self, payload: Any, ids: list[int] | None) -> None:
        if isinstance(payload, FileStart):
            self.tally.format(payload.format)["files"] += 1
            return
        if isinstance(payload, PartDone):
            self.tally.replaced_bytes += payload.replaced_bytes
            self.pending = payload
            if payload.part == 0:  # the next part is the next file's first: this one is written whole
                self.files_done += 1
            if time.monotonic() - self.flushed >= JOURNAL_EVERY_S:
                self.flush()
            return
        entry, split, item = payload
        if isinstance(item, Skipped):
            self.tally.skip(item.cause, item.where, item.bad)
            if item.bad and self.tally.bad_records > self.plan.max_bad_records:
                raise InputError(
                    f"source file {item.where}: {item.cause} (JSON Lines holds one JSON object per line); "
                    f"the staging allows {self.plan.max_bad_records} malformed records (max_bad_records)"
                    f" and this group has met {self.tally.bad_records}"
                )
            return
        writer = self.writers[split]
        if item.first:
            if split == "train" and entry.format.name not in self.tally.first:
                self.tally.first[entry.format.name] = {"group": self.group, "offset": writer.written}
            self.document_tokens = 0
            if self.bos is not None:
                writer.write(np.asarray([self.bos], dtype=self.dtype))
                self.document_tokens += 1
        writer.write(np.asarray(ids, dtype=self.dtype))
        self.document_tokens += len(ids)
        self.text_written += len(item.text)
        self.tally.format(entry.format.name)["text_bytes"] += len(item.text.encode())
        if item.last:
            writer.write(self.eos)
            self.tally.document(entry.format.name, split, self.document_tokens + 1)

    def tokens_written(self) -> int:
        return sum(w.written for w in self.writers.values())

    def flush(self) -> None:
        if self.pending is None:
            return
        for writer in self.writers.values():
            writer.sync()
        position = {s: w.position() for s, w in self.writers.items()}
        line = {"next": [self.pending.entry, self.pending.part], "position": position, "tally": self.tally.to_dict()}
        with open(self.journal_path, "a") as f:
            f.write(json.dumps(line) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.pending = None
        self.flushed = time.monotonic()


def group_items(
    raw: Path, plan: Plan, entries: list[Entry], start: tuple[int, int], progress: GroupProgress | None = None
) -> Iterator[tuple[str | None, Any]]:
    """The group's documents from `start` (entry, part) on, as (text, payload) for encode_in_order, with a PartDone
    after each part; `progress` is told which file is being read, and how much text."""
    first_entry, first_part = start
    for index in range(first_entry, len(entries)):
        entry = entries[index]
        reader = reader_for(raw / entry.key, entry.key, entry.format, plan.text_field, plan.block_bytes)
        if progress is not None:
            progress.reading(index, reader)
        begin = first_part if index == first_entry else 0
        if begin == 0:
            yield None, FileStart(entry.format.name)
        parts = reader.parts()
        for part in range(begin, parts):
            for item in reader.read(part):
                split = entry.split_of(item.record, plan.val_fraction)
                if progress is not None and isinstance(item, Piece):
                    progress.text_read += len(item.text)
                yield (item.text if isinstance(item, Piece) else None), (entry, split, item)
            replaced, reader.replaced_bytes = reader.replaced_bytes, 0
            yield None, PartDone(index, part + 1, replaced) if part + 1 < parts else PartDone(index + 1, 0, replaced)
        if not parts:
            yield None, PartDone(index + 1, 0, 0)


def encode_group(paths: DatasetPaths, snapshot: str, group: int) -> GroupResult:
    """Encode one group's files into its shards, carrying on where an earlier attempt's journal says it got.
    Two stagings of the same inputs may run at once: a lock per group makes the second wait, then find it done.
    A file that turns out not to be what it claims (a corrupt stream, malformed records past the allowance) fails
    the staging and removes the snapshot being built: nothing half-written stays."""
    started = time.perf_counter()
    building = building_dir(paths, snapshot)
    done_path = building / f".group-{group:03d}.json"
    if read_meta(paths.snapshot(snapshot)) is not None:
        log.info("snapshot %s is complete: group %d has nothing to do", snapshot, group)
        return GroupResult(group, 0, 0, 0, {}, {}, 0.0)
    plan = planned(paths, snapshot)
    if not 0 <= group < len(plan.groups):
        raise InputError(f"group {group}: snapshot {snapshot} is planned in {len(plan.groups)} groups")
    with open(building / f".lock-{group:03d}", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if done_path.is_file():
            return GroupResult(**json.loads(done_path.read_text()))
        try:
            result = _encode(paths, plan, group, building, started)
        except InputError:
            shutil.rmtree(building, ignore_errors=True)
            raise
        write_json(done_path, asdict(result))
    log.info(
        "group %d of snapshot %s: %d files (%d finished before), %d train + %d val tokens in %.1fs",
        group,
        snapshot,
        result.files,
        result.files_resumed,
        result.tokens["train"],
        result.tokens["val"],
        result.seconds,
    )
    return result


def _encode(paths: DatasetPaths, plan: Plan, group: int, building: Path, started: float) -> GroupResult:
    tokenizer = Tokenizer.from_file(str(building / TOKENIZER))
    tokenizer.no_truncation()
    tokenizer.no_padding()
    writers = {
        s: ShardWriter(building, group_prefix(s, group), np.dtype(plan.dtype), plan.shard_tokens) for s in SPLITS
    }
    journal_path = building / f".journal-{group:03d}.jsonl"
    journaled = read_journal(journal_path)
    last = journaled[-1] if journaled else {"next": [0, 0], "position": {s: [0, 0] for s in SPLITS}}
    for split, writer in writers.items():
        writer.resume(last["position"][split])
    tally = report.Tally.from_dict(last["tally"]) if "tally" in last else report.Tally()
    entries = [Entry.of(row) for row in plan.groups[group]]
    out = GroupWriter(plan, group, writers, tally, journal_path)
    sizes = [(paths.raw / e.key).stat().st_size for e in entries]
    name = f"group {group} of {paths.name!r} ({len(plan.groups)} groups)"
    progress = GroupProgress(name, sizes, last["next"][0], out)
    with Progress(progress.line):  # a line every PROGRESS_EVERY_S: a large group takes minutes
        encode_in_order(group_items(paths.raw, plan, entries, tuple(last["next"]), progress), tokenizer, out.write)
    out.flush()
    tokens = {s: w.close() for s, w in writers.items()}
    return GroupResult(
        group=group,
        files=len(entries),
        files_resumed=last["next"][0],
        text_bytes=sum(sizes),
        tokens=tokens,
        shards={s: w.shards for s, w in writers.items()},
        seconds=round(time.perf_counter() - started, 3),
        tally=tally.to_dict(),
    )


def read_journal(path: Path) -> list[dict[str, Any]]:
    """How far a group got, in order; a torn last line (the kill came mid-write) is not one."""
    entries = []
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return entries
    for line in lines:
        try:
            entries.append(json.loads(line))
        except ValueError:
            break
    return entries
