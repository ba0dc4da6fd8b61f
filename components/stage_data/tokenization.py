"""Tokenize the mirrored corpus into the train/val shards the trainer memory-maps.

Streaming throughout: files are read in blocks cut at line ends, encoded a batch of blocks at a time (the
tokenizers library spreads a batch over every core) and appended to shard files, so memory does not grow
with the corpus. The val split is whole files, chosen by a hash of their keys: the same files on every
run, whatever else changes. The shards are built in a fresh directory and swapped in whole; a run whose
inputs (staged content, tokenizer, settings) match the existing meta.json skips all of it.
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
from trainer.atomic import replace_dir, write_json
from trainer.layout import DatasetPaths

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
    started = time.perf_counter()
    given = Path(tokenizer_path).read_text() if tokenizer_path else ""
    inputs = {
        "format": FORMAT,
        "content_sha256": content_sha256,
        "val_fraction": val_fraction,
        "shard_tokens": shard_tokens,
        "tokenizer": {"given_sha256": sha256_text(given)} if given else {"trained_vocab_size": vocab_size},
    }
    existing = read_meta(paths.tokenized)
    if existing is not None and existing.get("inputs") == inputs:
        log.info("tokenized shards are up to date (same staged content, tokenizer and settings): not re-tokenizing")
        return TokenizeResult(existing["tokens"]["train"], existing["tokens"]["val"], existing["vocab_size"],
                              existing["val_files"], round(time.perf_counter() - started, 3), skipped=True)  # fmt: skip

    held_out = val_keys(keys, val_fraction)
    train_files = [paths.raw / k for k in keys if k not in held_out]
    val_files = [paths.raw / k for k in keys if k in held_out]
    tokenizer = Tokenizer.from_str(given) if given else train_tokenizer(train_files, vocab_size)
    eos = tokenizer.token_to_id(EOS)
    if eos is None:
        raise InputError(f"tokenizer {tokenizer_path}: it has no {EOS} token")
    vocab = tokenizer.get_vocab_size()
    dtype = np.dtype(np.uint16 if vocab <= 2**16 else np.uint32)

    paths.root.mkdir(parents=True, exist_ok=True)
    for stale in paths.root.glob(".tokenized.*"):  # left by a killed run (the staging lock keeps out live ones)
        shutil.rmtree(stale, ignore_errors=True)
    building = Path(tempfile.mkdtemp(prefix=".tokenized.", dir=paths.root))
    try:
        tokens, shards, text_bytes = {}, {}, 0
        for split, files in (("train", train_files), ("val", val_files)):
            writer = ShardWriter(building, split, dtype, shard_tokens)
            text_bytes += encode_files(files, tokenizer, writer, eos)
            tokens[split], shards[split] = writer.close(), writer.shards
            if tokens[split] < 2:
                raise InputError(f"the {split} split has only {tokens[split]} tokens: the corpus is too small")
        tokenizer_json = tokenizer.to_str()
        (building / "tokenizer.json").write_text(tokenizer_json)
        meta = {
            "format": FORMAT,
            "vocab_size": vocab,
            "dtype": dtype.name,
            "eos_id": eos,
            "tokenizer": "tokenizer.json",
            "tokenizer_sha256": sha256_text(tokenizer_json),
            "manifest_content_sha256": content_sha256,
            "tokens": tokens,
            "shards": shards,
            "documents": len(keys),
            "val_files": len(val_files),
            "val_keys_sha256": sha256_text(json.dumps(sorted(held_out))),
            "text_chars": text_bytes,
            "val_fraction": val_fraction,
            "inputs": inputs,
        }
        write_json(building / "meta.json", meta)
        replace_dir(building, paths.tokenized)
    except BaseException:
        shutil.rmtree(building, ignore_errors=True)
        raise
    seconds = round(time.perf_counter() - started, 3)
    log.info("tokenized %d files (%d held out for val) into %d train + %d val tokens, vocabulary %d, in %.1fs",
             len(keys), len(val_files), tokens["train"], tokens["val"], vocab, seconds)  # fmt: skip
    return TokenizeResult(tokens["train"], tokens["val"], vocab, len(val_files), seconds, skipped=False)


def read_meta(tokenized: Path) -> dict[str, Any] | None:
    try:
        return json.loads((tokenized / "meta.json").read_text())
    except (OSError, ValueError):
        return None
