"""Tokenize the mirrored corpus into a snapshot: the train/val shards the trainer memory-maps, and its tokenizer.

A snapshot is named by a hash of its inputs (staged content, val set, tokenizer and document settings, shard size,
groups): built under snapshots/.building.<id>/, renamed into place whole and never changed after; current.json then
points at it. Staging the same inputs again finds the snapshot and skips all of it; staging changed ones writes a new
snapshot beside the old, which the runs that trained on it keep reading.

Documents: a plain-text file is one document; a JSON Lines line or a Parquet row is one (formats/). Each is written
as [BOS] tokens EOS (tokenizer.py says which tokens). The val split is whole plain-text files (chosen at the dataset's
first staging and kept in val_set.json, as before documents had records) and, in record files, single documents
chosen by a hash of (key, record number) at val_fraction: a corpus of a few large Parquet files is split properly,
and a document keeps its split across re-stagings and as other files come and go.

Three stages, so that a corpus larger than one pod fans out:
- plan (one process, under the staging lock): every file's format found and checked, the val split, the tokenizer
  (trained on a bounded, deterministic sample of the train documents, or given), and the files cut into `groups`
  contiguous, byte-balanced groups: plan.json;
- encode a group (one process per group, in parallel pods): its documents read a part at a time, encoded a batch at a
  time (the tokenizers library spreads a batch over every core), appended to the group's own shard files; a journal
  records how far the group got (files, and Parquet row groups) with its counts, so a killed group carries on there;
- finalize: meta.json lists every group's shards in order with the documents' report, and the snapshot is renamed
  into place.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from common.errors import InputError, StepFailed
from components.stage_data import report
from components.stage_data.formats import FileFormat, Piece, Skipped, check_file, detect, reader_for
from components.stage_data.mirror import checksum_field
from components.stage_data.progress import GroupProgress, Progress, SampleProgress
from components.stage_data.settings import StageSettings
from components.stage_data.shards import ShardWriter
from components.stage_data.tokenizer import (
    EOS,
    GivenTokenizer,
    Specials,
    as_trained,
    block_safe,
    check_encodes,
    model_vocab_size,
    special_tokens,
    train_tokenizer,
)
from trainer.atomic import atomic_open, fsync_dir, write_json
from trainer.layout import META, TOKENIZER, DatasetPaths

log = logging.getLogger(__name__)

FORMAT = 3  # of the shards and meta.json; a change re-tokenizes everything
BLOCK_BYTES = 64 * 2**10  # plain text is read and encoded in blocks of about this size, cut at a line end
DOCUMENT_BYTES = 64 * 2**20  # ... or whole up to this size, for a tokenizer that marks the start of every string
BATCH_BYTES = 16 * 2**20  # text per encode_batch call: enough work for every core, bounded memory
JOURNAL_EVERY_S = 5.0  # a killed group re-encodes at most this much work (and at most one Parquet row group)
STALE_BUILD_S = 24 * 3600  # a building directory untouched this long belongs to a staging that is gone
PREVIEW_TOKENS = 2048  # read back from the shards for a format's first document
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


def val_keys(keys: list[str], val_fraction: float) -> set[str]:
    """Whole files for the val split, by a hash of each key: deterministic, and stable as files come and go."""
    if len(keys) < 2:
        raise InputError(
            f"the corpus has {len(keys)} plain-text file: the val split holds out whole files of plain "
            "text, so stage at least 2 (or documents in JSON Lines or Parquet files)"
        )

    def position(key: str) -> float:
        return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") / 2**64

    chosen = {k for k in keys if position(k) < val_fraction}
    if not chosen:
        chosen = {min(keys, key=position)}
    if len(chosen) == len(keys):
        chosen.discard(max(keys, key=position))
    return chosen


# -- reading documents ---------------------------------------------------------------------------------------------


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


def sample_texts(raw: Path, entries: list[Entry], plan_settings: StageSettings, sample_bytes: int) -> Iterator[str]:
    """About `sample_bytes` of train text for training a tokenizer: the documents of whole files in the order of a
    hash of their keys (deterministic, and a spread over the corpus rather than its first directory)."""
    taken = 0
    for entry in sorted(entries, key=lambda e: hashlib.sha256(e.key.encode()).digest()):
        if entry.split == "val":
            continue
        reader = reader_for(raw / entry.key, entry.key, entry.format, plan_settings.field_path, BLOCK_BYTES)
        for part in range(reader.parts()):
            for item in reader.read(part):
                if isinstance(item, Skipped) or entry.split_of(item.record, plan_settings.val_fraction) != "train":
                    continue
                if taken >= sample_bytes:
                    return
                taken += len(item.text.encode())
                yield item.text


# -- encoding --------------------------------------------------------------------------------------------------------


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


# -- planning --------------------------------------------------------------------------------------------------------


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def detect_formats(raw: Path, keys: list[str], text_field: str, dataset: str = "") -> dict[str, FileFormat]:
    """Every file's format, checked as the run will read it; refused by name at the first that cannot be."""

    def one(key: str) -> FileFormat:
        fmt = detect(raw / key, key)
        check_file(raw / key, key, fmt, text_field, dataset)
        return fmt

    with ThreadPoolExecutor(8, thread_name_prefix="detect") as pool:
        return dict(zip(keys, pool.map(one, keys), strict=True))


def plan_snapshot(
    paths: DatasetPaths,
    settings: StageSettings,
    keys: list[str],
    content_sha256: str,
    given: GivenTokenizer | None = None,
) -> Plan | None:
    """Plan the snapshot of these inputs: None when it exists already (it is made current); else its Plan, with
    the tokenizer in place. A killed plan or encode left its building directory: the same inputs carry on in it."""
    formats = detect_formats(paths.raw, keys, settings.field_path, paths.name)
    plain = [k for k in keys if not formats[k].records]
    records = [k for k in keys if formats[k].records]
    if settings.text_field and not records:
        raise InputError(
            f"text field {settings.text_field!r}: the corpus is plain text ({len(plain)} files), where "
            "a whole file is the document: leave text_field out, or stage JSON Lines or "
            "Parquet"
        )
    held_out = fixed_val_keys(paths, plain, settings.val_fraction, by_document=bool(records))
    tokenizer, specials = load_given(given) if given is not None else (None, Specials(EOS, -1))
    inputs = snapshot_inputs(paths, settings, held_out, records, content_sha256, given, specials)
    snapshot = sha256_text(json.dumps(inputs, sort_keys=True))[:16]
    if read_meta(paths.snapshot(snapshot)) is not None:
        log.info("snapshot %s is up to date (same staged content, tokenizer and settings): not re-tokenizing", snapshot)
        make_current(paths, snapshot)
        return None
    paths.snapshots.mkdir(parents=True, exist_ok=True)
    remove_stale_builds(paths)
    building = building_dir(paths, snapshot)
    try:
        plan = Plan.read(building)
        log.info("carrying on with snapshot %s, planned by an earlier staging run", snapshot)
        os.utime(building / PLAN)
        return plan
    except (OSError, ValueError, TypeError):
        shutil.rmtree(building, ignore_errors=True)  # a plan killed before its plan.json, or of an older version
    building.mkdir()
    entries = [Entry(k, formats[k], "val" if k in held_out else "train" if k in plain else BY_DOCUMENT) for k in keys]
    try:
        return _plan(paths, settings, building, snapshot, inputs, entries, tokenizer, specials)
    except InputError:  # a file found bad while the tokenizer trained on it: nothing of this snapshot stays
        shutil.rmtree(building, ignore_errors=True)
        raise


def _plan(
    paths: DatasetPaths,
    settings: StageSettings,
    building: Path,
    snapshot: str,
    inputs: dict[str, Any],
    entries: list[Entry],
    tokenizer: Tokenizer | None,
    specials: Specials,
) -> Plan:
    keys = [e.key for e in entries]
    if tokenizer is None:
        started = time.perf_counter()
        sample = SampleProgress(settings.tokenizer_sample_mb)
        texts = sample_texts(paths.raw, entries, settings, settings.tokenizer_sample_mb * 2**20)
        with Progress(sample.line):  # its merges alone take minutes on a large sample
            tokenizer = train_tokenizer(sample.counted(texts), settings.vocab_size)
        specials = Specials(EOS, tokenizer.token_to_id(EOS))
        got = tokenizer.get_vocab_size()
        short = f" ({settings.vocab_size} asked: the sample holds no more merges)" if got < settings.vocab_size else ""
        log.info(
            "trained a BPE vocabulary of %d%s on a sample of up to %d MB in %.1fs",
            got,
            short,
            settings.tokenizer_sample_mb,
            time.perf_counter() - started,
        )
    with atomic_open(building / TOKENIZER, "w") as f:
        f.write(tokenizer.to_str())
    vocab = tokenizer.get_vocab_size()
    plan = Plan(
        snapshot=snapshot,
        inputs=inputs,
        groups=split_into_groups(entries, {k: (paths.raw / k).stat().st_size for k in keys}, settings.tokenize_groups),
        dtype=np.dtype(np.uint16 if model_vocab_size(vocab) <= 2**16 else np.uint32).name,
        specials=specials.to_dict(),
        vocab_size=vocab,
        model_vocab_size=model_vocab_size(vocab),
        shard_tokens=settings.shard_tokens,
        files=len(keys),
        val_files=sum(e.split == "val" for e in entries),
        val_fraction=settings.val_fraction,
        text_field=settings.field_path,
        max_bad_records=settings.max_bad_records,
        block_bytes=BLOCK_BYTES if block_safe(tokenizer) else DOCUMENT_BYTES,
    )
    write_json(building / PLAN, asdict(plan))  # last: a plan.json means the tokenizer is in place
    return plan


def load_given(given: GivenTokenizer) -> tuple[Tokenizer, Specials]:
    """The given tokenizer as the snapshot keeps it (tokenizer.as_trained), and its special tokens."""
    tokenizer = given.load()
    check_encodes(tokenizer, given.where)
    specials = special_tokens(tokenizer, given.config, given.where)
    log.info(
        "tokenizer %s: %d tokens; documents are written as %sEOS %s",
        given.where,
        tokenizer.get_vocab_size(),
        f"BOS {specials.bos} + text + " if specials.bos else "text + ",
        specials.eos,
    )
    return as_trained(tokenizer, specials), specials


def snapshot_inputs(
    paths: DatasetPaths,
    settings: StageSettings,
    held_out: set[str],
    records: list[str],
    content_sha256: str,
    given: GivenTokenizer | None,
    specials: Specials,
) -> dict[str, Any]:
    """What a snapshot's content follows from (its id is their hash). Keys that only a corpus with records or a
    tokenizer with other special tokens needs are added only then, so that a plain-text corpus staged before them
    keeps its snapshot id."""
    if given is None:
        tokenizer = {"trained_vocab_size": settings.vocab_size, "sample_mb": settings.tokenizer_sample_mb}
    else:
        tokenizer = {"given_sha256": sha256_text(given.tokenizer_json)}  # its configuration counts by its specials
        if specials.bos is not None or specials.eos != EOS:
            tokenizer["specials"] = [specials.bos, specials.eos]
    inputs = {
        "format": FORMAT,
        "content_sha256": content_sha256,
        "val_set_sha256": val_set_sha256(paths, held_out, records, settings.val_fraction),
        "shard_tokens": settings.shard_tokens,
        "groups": settings.tokenize_groups,
        "tokenizer": tokenizer,
    }
    if records:
        inputs["documents"] = {"text_field": settings.field_path, "max_bad_records": settings.max_bad_records}
    return inputs


def split_into_groups(entries: list[Entry], sizes: dict[str, int], groups: int) -> list[list[list[str]]]:
    """Each split's files cut into `groups` contiguous runs of about equal bytes: group g holds the g-th run of the
    train files, of the val files and of the record files, so the shards of groups 0, 1, ... in turn keep the files'
    order."""
    result: list[list[list[str]]] = [[] for _ in range(groups)]
    for split in (*SPLITS, BY_DOCUMENT):
        chosen = [e for e in entries if e.split == split]
        total = sum(sizes[e.key] for e in chosen) or 1
        done = 0
        for entry in chosen:
            result[min(groups - 1, done * groups // total)].append([entry.key, entry.format.name, entry.split])
            done += sizes[entry.key]
    return result


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


def remove_stale_builds(paths: DatasetPaths) -> None:
    """Building directories of other inputs, untouched for a day: left by stagings that were killed and not
    run again with the same inputs (a live one is touched at every journal flush)."""
    for stale in paths.snapshots.glob(".building.*"):
        newest = max((p.stat().st_mtime for p in stale.iterdir()), default=stale.stat().st_mtime)
        if time.time() - newest > STALE_BUILD_S:
            shutil.rmtree(stale, ignore_errors=True)
            log.info("removed %s, left by a staging run a day ago or more", stale.name)


def group_prefix(split: str, group: int) -> str:
    return f"{split}_g{group:03d}"


# -- finalizing ------------------------------------------------------------------------------------------------------


def finalize_snapshot(
    paths: DatasetPaths, snapshot: str, started: float | None = None, skipped: bool = False
) -> TokenizeResult:
    """Gather the groups' shards into meta.json, rename the snapshot into place and make it current."""
    started = time.perf_counter() if started is None else started
    directory = paths.snapshot(snapshot)
    meta = read_meta(directory)
    if meta is None:
        meta = write_snapshot(paths, snapshot)
        skipped = False
    make_current(paths, snapshot)
    seconds = round(time.perf_counter() - started, 3)
    if not skipped:
        log.info("%s", tokenized_line(meta, snapshot, seconds))
    return TokenizeResult(
        meta["tokens"]["train"],
        meta["tokens"]["val"],
        meta["vocab_size"],
        meta["val_files"],
        seconds,
        skipped=skipped,
        snapshot=snapshot,
        snapshot_dir=str(directory),
        model_vocab_size=meta.get("model_vocab_size", meta["vocab_size"]),
        documents=meta.get("document_report", {}),
    )


def tokenized_line(meta: dict[str, Any], snapshot: str, seconds: float) -> str:
    """The finalize step's line: what the snapshot holds, and how its val split was held out (plain-text files whole,
    a fraction of the record files' documents, or both), so that its figures agree with one another. A snapshot
    staged before documents had records has no document report (and counted its files as documents)."""
    held_out = []
    if meta["val_files"]:
        held_out.append(f"{meta['val_files']:,} plain-text file{'s' if meta['val_files'] != 1 else ''} whole")
    if "documents" in meta.get("inputs", {}):  # record files: each document by itself
        held_out.append(f"{meta['val_fraction'] * 100:g}% of the records' documents")
    counts = (meta.get("document_report") or {}).get("documents")
    documents = f", {counts['val']:,} of {counts['train'] + counts['val']:,} documents" if counts else ""
    files, tokens = meta.get("files", meta["documents"]), meta["tokens"]
    of = f" of {meta['dataset']!r}" if meta.get("dataset") else ""
    return (
        f"tokenized {files:,} files{of} into snapshot {snapshot}: {tokens['train']:,} train + {tokens['val']:,} val "
        f"tokens (val: {' and '.join(held_out)}{documents}), vocabulary {meta['vocab_size']:,}, in {seconds:.1f}s"
    )


def group_results(building: Path, plan: Plan) -> list[GroupResult]:
    results = []
    for group in range(len(plan.groups)):
        try:
            results.append(GroupResult(**json.loads((building / f".group-{group:03d}.json").read_text())))
        except (OSError, ValueError, TypeError):
            raise StepFailed(
                f"snapshot {plan.snapshot}: group {group} of {len(plan.groups)} has not finished "
                "encoding; rerun staging (each group carries on where it stopped)"
            ) from None
    return results


def first_documents(building: Path, plan: Plan, results: list[GroupResult], tally: report.Tally) -> dict[str, str]:
    """Each format's first train document, read back from the shards and decoded: what the model will read."""
    tokenizer = Tokenizer.from_file(str(building / TOKENIZER))
    previews = {}
    for name, where in tally.first.items():
        ids = read_tokens(
            building, results[where["group"]].shards["train"], plan.dtype, where["offset"], PREVIEW_TOKENS
        )
        end = ids.index(plan.specials["eos_id"]) + 1 if plan.specials["eos_id"] in ids else len(ids)
        previews[name] = report.preview(tokenizer.decode(ids[:end], skip_special_tokens=False))
    return previews


def read_tokens(directory: Path, shards: list[dict[str, Any]], dtype: str, offset: int, count: int) -> list[int]:
    """`count` tokens from `offset` of the stream these shards hold in turn, memory-mapped: only those pages read."""
    ids: list[int] = []
    for shard in shards:
        if offset >= shard["tokens"]:
            offset -= shard["tokens"]
            continue
        if shard["tokens"]:
            tokens = np.memmap(directory / shard["file"], dtype=dtype, mode="r", shape=(shard["tokens"],))
            ids += tokens[offset : offset + count - len(ids)].tolist()
        offset = 0
        if len(ids) >= count:
            break
    return ids


def write_snapshot(paths: DatasetPaths, snapshot: str) -> dict[str, Any]:
    building = building_dir(paths, snapshot)
    plan = planned(paths, snapshot)
    results = group_results(building, plan)
    tally = report.Tally()
    for result in results:
        tally.add(report.Tally.from_dict(result.tally) if result.tally else report.Tally(), result.group)
    if tally.bad_records > plan.max_bad_records:
        shutil.rmtree(building, ignore_errors=True)
        raise InputError(
            f"{tally.bad_records} malformed records (first: {'; '.join(tally.examples)}), more than the "
            f"{plan.max_bad_records} the staging allows (max_bad_records)"
        )
    tokens = {s: sum(r.tokens[s] for r in results) for s in SPLITS}
    for split in SPLITS:
        if tokens[split] < 2:
            shutil.rmtree(building, ignore_errors=True)
            hint = " (raise val_fraction, or stage more documents)" if split == "val" else ""
            causes = ", ".join(f"{n:,} {cause}" for cause, n in sorted(tally.skipped.items()))
            skipped = f" (skipped records, text field {plan.text_field!r}: {causes})" if causes else ""
            raise InputError(
                f"dataset {paths.name!r}: the {split} split has only {tokens[split]} tokens{skipped}: the corpus is "
                f"too small{hint}"
            )
    tokenizer_json = (building / TOKENIZER).read_text()
    documents = report.summary(tally, first_documents(building, plan, results, tally))
    meta = {
        "format": FORMAT,
        "dataset": paths.name,
        "snapshot": snapshot,
        "vocab_size": plan.vocab_size,
        "model_vocab_size": plan.model_vocab_size,
        "dtype": plan.dtype,
        "eos_id": plan.specials["eos_id"],
        "bos_id": plan.specials["bos_id"],
        "eos": plan.specials["eos"],
        "bos": plan.specials["bos"],
        "tokenizer": TOKENIZER,
        "tokenizer_sha256": sha256_text(tokenizer_json),
        "manifest_content_sha256": plan.inputs["content_sha256"],
        "tokens": tokens,
        "shards": {s: [shard for r in results for shard in r.shards[s]] for s in SPLITS},
        "files": plan.files,
        "documents": sum(tally.documents.values()),
        "val_files": plan.val_files,
        "val_fraction": plan.val_fraction,
        "val_set_sha256": plan.inputs["val_set_sha256"],
        "text_bytes": sum(r.text_bytes for r in results),
        "document_report": documents,
        "groups": len(plan.groups),
        "inputs": plan.inputs,
        "created": time.time(),
    }
    for pattern in (PLAN, ".journal-*", ".group-*", ".lock-*"):  # the builders' bookkeeping
        for internal in building.glob(pattern):
            internal.unlink()
    write_json(building / META, meta)
    fsync_dir(building)
    os.replace(building, paths.snapshot(snapshot))  # a snapshot appears whole or not at all, and never changes after
    fsync_dir(paths.snapshots)
    return meta


def current_snapshot_id(paths: DatasetPaths) -> str:
    directory = paths.current_snapshot()
    if directory is None:
        raise StepFailed(f"dataset {paths.name!r} has no current snapshot")
    return directory.name


def fixed_val_keys(paths: DatasetPaths, keys: list[str], val_fraction: float, by_document: bool = False) -> set[str]:
    """The plain-text files of the val split: chosen at the dataset's first staging and kept, so that every snapshot
    (and so every run's evaluation) holds out the same text; files added later go to train. With record files
    (`by_document`), these hold out documents of their own, and fewer than 2 plain-text files go to train."""
    try:
        stored = json.loads(paths.val_set.read_text())
    except FileNotFoundError:
        chosen = val_keys(keys, val_fraction) if len(keys) >= 2 or not by_document else set()
        write_json(paths.val_set, {"val_fraction": val_fraction, "keys": sorted(chosen), "created": time.time()})
        return chosen
    except (OSError, ValueError) as exc:
        raise InputError(
            f"{paths.val_set} is unreadable ({exc}): restore it, or delete it to choose a new val set "
            "(evaluations before and after then do not compare)"
        ) from None
    if stored["val_fraction"] != val_fraction:
        chosen = stored["val_fraction"]
        raise InputError(
            f"val fraction {val_fraction}: dataset {paths.name!r} holds out a fixed val set chosen with "
            f"{chosen} ({paths.val_set}), kept so that evaluations compare on the same text; stage with "
            f"{chosen}, or delete that file to choose a new one"
        )
    present = set(keys)
    kept = {k for k in stored["keys"] if k in present}
    if not by_document and (not kept or kept == present):
        raise InputError(
            f"{paths.val_set}: {len(kept)} of its {len(stored['keys'])} val files are among the "
            f"{len(keys)} staged files, which leaves no {'val' if not kept else 'train'} split; delete "
            "it to choose a new val set"
        )
    if len(kept) < len(stored["keys"]):
        log.warning(
            "%d of the %d files of the fixed val set are gone from the source: the val text changes, and "
            "evaluations from now on do not compare with earlier ones",
            len(stored["keys"]) - len(kept),
            len(stored["keys"]),
        )
    return kept


def val_set_sha256(paths: DatasetPaths, held_out: set[str], records: list[str], val_fraction: float) -> str:
    """The val text's identity: its files' keys, sizes and checksums (from the manifest staging just wrote), and
    with record files, theirs and the fraction of their documents held out; so two evaluations with the same
    identity measured the same text, whatever the tokenizer."""
    entries = {e["key"]: e for e in json.loads(paths.manifest.read_text())["files"]}
    listing = [[k, entries[k]["size"], checksum_field(entries[k])] for k in sorted(held_out)]
    if records:
        documents = [[k, entries[k]["size"], checksum_field(entries[k])] for k in sorted(records)]
        return sha256_text(json.dumps({"files": listing, "documents": documents, "val_fraction": val_fraction}))
    return sha256_text(json.dumps(listing))


def make_current(paths: DatasetPaths, snapshot: str) -> None:
    """Point the dataset's current.json at `snapshot` (an atomic replace): the next run that stages nothing
    (skip_staging) trains on it; runs already training keep theirs."""
    write_json(paths.current, {"snapshot": snapshot, "time": time.time()})


def read_meta(tokenized: Path) -> dict[str, Any] | None:
    try:
        return json.loads((tokenized / META).read_text())
    except (OSError, ValueError):
        return None
