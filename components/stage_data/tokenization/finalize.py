"""Finalize a snapshot: meta.json lists every group's shards in order with the documents' report (each format's
first train document read back from the shards), the snapshot is renamed into place whole, and current.json points
at it.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from common.errors import InputError, StepFailed
from components.stage_data import report
from components.stage_data.tokenization.snapshot import (
    FORMAT,
    PLAN,
    SPLITS,
    GroupResult,
    Plan,
    TokenizeResult,
    building_dir,
    make_current,
    planned,
    read_meta,
    sha256_text,
)
from trainer.atomic import fsync_dir, write_json
from trainer.layout import META, TOKENIZER, DatasetPaths

log = logging.getLogger(__name__)

PREVIEW_TOKENS = 2048  # read back from the shards for a format's first document


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
