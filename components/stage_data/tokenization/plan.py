"""Plan a snapshot (one process, under the staging lock): every file's format found and checked, the val split, the
tokenizer (trained on a bounded, deterministic sample of the train documents, or given), and the files cut into
`groups` contiguous, byte-balanced groups: plan.json, which every group's encoder (encode.py) then follows.

The val split is whole plain-text files (chosen at the dataset's first staging and kept in val_set.json, as before
documents had records) and, in record files, single documents chosen by a hash of (key, record number) at
val_fraction (snapshot.document_position).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from common.errors import InputError
from components.stage_data.formats import FileFormat, check_file, detect, reader_for
from components.stage_data.formats.reader import Skipped
from components.stage_data.mirror import checksum_field
from components.stage_data.progress import Progress, SampleProgress
from components.stage_data.settings import StageSettings
from components.stage_data.tokenization.snapshot import (
    BY_DOCUMENT,
    FORMAT,
    PLAN,
    SPLITS,
    Entry,
    Plan,
    building_dir,
    make_current,
    read_meta,
    sha256_text,
)
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
from trainer.atomic import atomic_open, write_json
from trainer.layout import TOKENIZER, DatasetPaths

log = logging.getLogger(__name__)

BLOCK_BYTES = 64 * 2**10  # plain text is read and encoded in blocks of about this size, cut at a line end
DOCUMENT_BYTES = 64 * 2**20  # ... or whole up to this size, for a tokenizer that marks the start of every string
STALE_BUILD_S = 24 * 3600  # a building directory untouched this long belongs to a staging that is gone


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


def remove_stale_builds(paths: DatasetPaths) -> None:
    """Building directories of other inputs, untouched for a day: left by stagings that were killed and not
    run again with the same inputs (a live one is touched at every journal flush)."""
    for stale in paths.snapshots.glob(".building.*"):
        newest = max((p.stat().st_mtime for p in stale.iterdir()), default=stale.stat().st_mtime)
        if time.time() - newest > STALE_BUILD_S:
            shutil.rmtree(stale, ignore_errors=True)
            log.info("removed %s, left by a staging run a day ago or more", stale.name)


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
