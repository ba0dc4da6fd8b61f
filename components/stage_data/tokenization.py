"""Tokenize the mirrored corpus into a snapshot: the train/val shards the trainer memory-maps, and its tokenizer.

Streaming throughout: files are read in blocks cut at line ends, encoded a batch of blocks at a time (the
tokenizers library spreads a batch over every core) and appended to shard files, so memory does not grow
with the corpus. The val split is whole files, chosen by a hash of their keys: the same files on every
run, whatever else changes (the set is kept in val_set.json). A snapshot is named by a hash of its inputs (staged
content, val set, tokenizer, settings): it is built under a temporary name, renamed into place whole and never
changed after, and current.json then points at it. Staging the same inputs again finds the snapshot and skips all of
it; staging changed ones writes a new snapshot beside the old, which the runs that trained on it keep reading.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from components.errors import InputError
from trainer.atomic import fsync_dir, write_json
from trainer.layout import META, TOKENIZER, DatasetPaths

log = logging.getLogger(__name__)

EOS = "<|endoftext|>"
FORMAT = 2  # of the shards and meta.json; a change re-tokenizes everything
SHARD_TOKENS = 64 * 2**20  # tokens per shard file by default (about 250 MB of text)
BLOCK_BYTES = 64 * 2**10  # text is read and encoded in blocks of about this size, cut at a line end
BATCH_BYTES = 16 * 2**20  # blocks per encode_batch call: enough work for every core, bounded memory


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


def text_blocks(path: Path) -> Iterator[str]:
    """The file's text in blocks of about BLOCK_BYTES, each ending at a newline (UTF-8 safe: '\\n' is one byte)."""
    carry = b""
    with open(path, "rb") as f:
        while chunk := f.read(BLOCK_BYTES):
            data = carry + chunk
            cut = data.rfind(b"\n") + 1
            if cut == 0:  # no line end yet: a very long line
                cut = len(data) if len(data) >= 4 * BLOCK_BYTES else 0
            carry, block = data[cut:], data[:cut]
            if block:
                yield block.decode("utf-8", errors="replace")
    if carry:
        yield carry.decode("utf-8", errors="replace")


def val_keys(keys: list[str], val_fraction: float) -> set[str]:
    """Whole files for the val split, by a hash of each key: deterministic, and stable as files come and go."""
    if len(keys) < 2:
        raise InputError(f"the corpus has {len(keys)} file: the val split is held out by file, so stage at least 2")

    def position(key: str) -> float:
        return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") / 2**64

    chosen = {k for k in keys if position(k) < val_fraction}
    if not chosen:
        chosen = {min(keys, key=position)}
    if len(chosen) == len(keys):
        chosen.discard(max(keys, key=position))
    return chosen


def train_tokenizer(files: list[Path], vocab_size: int) -> Tokenizer:
    """A byte-level BPE tokenizer trained on the staged corpus itself: nothing is downloaded."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator((block for path in files for block in text_blocks(path)), trainer=trainer)
    return tokenizer


class ShardWriter:
    """Appends token ids to <split>_NNNN.bin files of at most `shard_tokens` tokens each."""

    def __init__(self, directory: Path, split: str, dtype: np.dtype, shard_tokens: int = SHARD_TOKENS):
        self.directory, self.split, self.dtype, self.shard_tokens = directory, split, dtype, shard_tokens
        self.shards: list[dict[str, Any]] = []
        self._file: Any = None

    def write(self, ids: np.ndarray) -> None:
        ids = ids.astype(self.dtype, copy=False)
        while len(ids):
            if self._file is None or self.shards[-1]["tokens"] == self.shard_tokens:
                self._next_shard()
            room = self.shard_tokens - self.shards[-1]["tokens"]
            self._file.write(ids[:room].tobytes())
            self.shards[-1]["tokens"] += min(room, len(ids))
            ids = ids[room:]

    def _next_shard(self) -> None:
        self._close_file()
        name = f"{self.split}_{len(self.shards):04d}.bin"
        self._file = open(self.directory / name, "wb")
        self.shards.append({"file": name, "tokens": 0})

    def _close_file(self) -> None:
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            self._file = None

    def close(self) -> int:
        self._close_file()
        return sum(s["tokens"] for s in self.shards)


def encode_files(files: list[Path], tokenizer: Tokenizer, writer: ShardWriter, eos: int) -> int:
    """Encode each file followed by EOS into `writer`, a batch of blocks at a time; returns the bytes read."""
    batch: list[str] = []
    ends: list[bool] = []  # whether each block is its file's last: EOS follows it
    size = read = 0

    def flush() -> None:
        encodings = tokenizer.encode_batch_fast(batch, add_special_tokens=False)  # fast: no character offsets
        for encoding, last in zip(encodings, ends, strict=True):
            writer.write(np.asarray(encoding.ids + [eos] if last else encoding.ids, dtype=np.int64))
        batch.clear()
        ends.clear()

    for path in files:
        blocks = text_blocks(path)
        block = next(blocks, None)
        if block is None:  # an empty file is still a document
            writer.write(np.asarray([eos]))
            continue
        while block is not None:
            following = next(blocks, None)
            batch.append(block)
            ends.append(following is None)
            size += len(block)
            read += len(block)
            block = following
            if size >= BATCH_BYTES:
                flush()
                size = 0
    if batch:
        flush()
    return read


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def tokenize(
    paths: DatasetPaths,
    keys: list[str],
    content_sha256: str,
    vocab_size: int,
    val_fraction: float,
    tokenizer_path: str = "",
    shard_tokens: int = SHARD_TOKENS,
) -> TokenizeResult:
    """Tokenize the staged files into the snapshot their inputs name, unless it exists, and make it current."""
    started = time.perf_counter()
    given = Path(tokenizer_path).read_text() if tokenizer_path else ""
    held_out = fixed_val_keys(paths, keys, val_fraction)
    inputs = {
        "format": FORMAT,
        "content_sha256": content_sha256,
        "val_keys_sha256": sha256_text(json.dumps(sorted(held_out))),
        "shard_tokens": shard_tokens,
        "tokenizer": {"given_sha256": sha256_text(given)} if given else {"trained_vocab_size": vocab_size},
    }
    snapshot = sha256_text(json.dumps(inputs, sort_keys=True))[:16]
    directory = paths.snapshot(snapshot)
    existing = read_meta(directory)
    if existing is not None:
        log.info("snapshot %s is up to date (same staged content, tokenizer and settings): not re-tokenizing", snapshot)
        make_current(paths, snapshot)
        return TokenizeResult(existing["tokens"]["train"], existing["tokens"]["val"], existing["vocab_size"],
                              existing["val_files"], round(time.perf_counter() - started, 3), skipped=True,
                              snapshot=snapshot, snapshot_dir=str(directory))  # fmt: skip

    train_files = [paths.raw / k for k in keys if k not in held_out]
    val_files = [paths.raw / k for k in keys if k in held_out]
    tokenizer = Tokenizer.from_str(given) if given else train_tokenizer(train_files, vocab_size)
    eos = tokenizer.token_to_id(EOS)
    if eos is None:
        raise InputError(f"tokenizer {tokenizer_path}: it has no {EOS} token")
    vocab = tokenizer.get_vocab_size()
    dtype = np.dtype(np.uint16 if vocab <= 2**16 else np.uint32)

    paths.snapshots.mkdir(parents=True, exist_ok=True)
    for stale in paths.snapshots.glob(".building.*"):  # left by a killed run (the staging lock keeps out live ones)
        shutil.rmtree(stale, ignore_errors=True)
    building = Path(tempfile.mkdtemp(prefix=".building.", dir=paths.snapshots))
    try:
        tokens, shards, text_bytes = {}, {}, 0
        for split, files in (("train", train_files), ("val", val_files)):
            writer = ShardWriter(building, split, dtype, shard_tokens)
            text_bytes += encode_files(files, tokenizer, writer, eos)
            tokens[split], shards[split] = writer.close(), writer.shards
            if tokens[split] < 2:
                raise InputError(f"the {split} split has only {tokens[split]} tokens: the corpus is too small")
        tokenizer_json = tokenizer.to_str()
        (building / TOKENIZER).write_text(tokenizer_json)
        meta = {
            "format": FORMAT,
            "dataset": paths.name,
            "snapshot": snapshot,
            "vocab_size": vocab,
            "dtype": dtype.name,
            "eos_id": eos,
            "tokenizer": TOKENIZER,
            "tokenizer_sha256": sha256_text(tokenizer_json),
            "manifest_content_sha256": content_sha256,
            "tokens": tokens,
            "shards": shards,
            "documents": len(keys),
            "val_files": len(val_files),
            "val_keys_sha256": inputs["val_keys_sha256"],
            "text_chars": text_bytes,
            "val_fraction": val_fraction,
            "inputs": inputs,
            "created": time.time(),
        }
        write_json(building / META, meta)
        fsync_dir(building)
        os.replace(building, directory)  # a snapshot appears whole or not at all, and never changes after
        fsync_dir(paths.snapshots)
    except BaseException:
        shutil.rmtree(building, ignore_errors=True)
        raise
    make_current(paths, snapshot)
    seconds = round(time.perf_counter() - started, 3)
    log.info("tokenized %d files (%d held out for val) into snapshot %s: %d train + %d val tokens, vocabulary %d, "
             "in %.1fs", len(keys), len(val_files), snapshot, tokens["train"], tokens["val"], vocab,
             seconds)  # fmt: skip
    return TokenizeResult(tokens["train"], tokens["val"], vocab, len(val_files), seconds, skipped=False,
                          snapshot=snapshot, snapshot_dir=str(directory))  # fmt: skip


def fixed_val_keys(paths: DatasetPaths, keys: list[str], val_fraction: float) -> set[str]:
    """The val split: chosen at the dataset's first staging and kept, so that every snapshot (and so every run's
    evaluation) holds out the same text; files added later go to train."""
    try:
        stored = json.loads(paths.val_set.read_text())
    except FileNotFoundError:
        chosen = val_keys(keys, val_fraction)
        write_json(paths.val_set, {"val_fraction": val_fraction, "keys": sorted(chosen), "created": time.time()})
        return chosen
    except (OSError, ValueError) as exc:
        raise InputError(f"{paths.val_set} is unreadable ({exc}): restore it, or delete it to choose a new val set "
                         "(evaluations before and after then do not compare)") from None  # fmt: skip
    if stored["val_fraction"] != val_fraction:
        chosen = stored["val_fraction"]
        raise InputError(f"val fraction {val_fraction}: dataset {paths.name!r} holds out a fixed val set chosen with "
                         f"{chosen} ({paths.val_set}), kept so that evaluations compare on the same text; stage with "
                         f"{chosen}, or delete that file to choose a new one")  # fmt: skip
    present = set(keys)
    kept = {k for k in stored["keys"] if k in present}
    if not kept or kept == present:
        raise InputError(f"{paths.val_set}: {len(kept)} of its {len(stored['keys'])} val files are among the "
                         f"{len(keys)} staged files, which leaves no {'val' if not kept else 'train'} split; delete "
                         "it to choose a new val set")  # fmt: skip
    if len(kept) < len(stored["keys"]):
        log.warning("%d of the %d files of the fixed val set are gone from the source: the val text changes, and "
                    "evaluations from now on do not compare with earlier ones", len(stored["keys"]) - len(kept),
                    len(stored["keys"]))  # fmt: skip
    return kept


def make_current(paths: DatasetPaths, snapshot: str) -> None:
    """Point the dataset's current.json at `snapshot` (an atomic replace): the next run that stages nothing
    (skip_staging) trains on it; runs already training keep theirs."""
    write_json(paths.current, {"snapshot": snapshot, "time": time.time()})


def read_meta(tokenized: Path) -> dict[str, Any] | None:
    try:
        return json.loads((tokenized / META).read_text())
    except (OSError, ValueError):
        return None
