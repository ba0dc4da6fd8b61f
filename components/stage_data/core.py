"""Stage a corpus onto the shared volume: mirror it, record what was staged, tokenize it for the trainer.

Nothing half-done is ever visible: each file lands under a temporary name and is renamed when complete,
the manifest is written last, and the tokenized directory is built beside the old one and swapped in.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from components.errors import InputError
from trainer.atomic import atomic_open, fsync_dir, write_json
from trainer.layout import DatasetPaths

log = logging.getLogger(__name__)

EOS = "<|endoftext|>"
DEFAULT_EXCLUDE = ("__pycache__/*", "*.pyc", ".*")
SHARD_TOKENS = 64 * 2**20  # tokens per shard file
_CHUNK = 4 * 2**20


@dataclass(frozen=True)
class SourceFile:
    key: str  # path relative to the source root, '/'-separated
    path: Path
    size: int


@dataclass
class StageResult:
    dataset_dir: str
    tokenized_dir: str
    files: int
    bytes: int
    files_copied: int
    files_skipped: int
    train_tokens: int
    val_tokens: int
    vocab_size: int
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
) -> StageResult:
    started = time.perf_counter()
    if not 256 < vocab_size <= 2**32:
        raise InputError(f"vocab size {vocab_size} is out of range: it must be above 256 (the byte alphabet)")
    if not 0 < val_fraction < 0.5:
        raise InputError(f"val fraction {val_fraction} is out of range: it must be between 0 and 0.5")
    if tokenizer_path and not Path(tokenizer_path).is_file():
        raise InputError(f"tokenizer {tokenizer_path}: no such file")
    try:
        paths = DatasetPaths.of(storage_root, dataset)
    except ValueError as exc:
        raise InputError(str(exc)) from None
    files = list_source(source, tuple(include), tuple(exclude))
    prepare_storage_root(storage_root)

    copied, skipped = mirror(files, paths, source)
    texts = [(paths.raw / f.key).read_text(encoding="utf-8", errors="replace") for f in files]
    tokenizer = Tokenizer.from_file(tokenizer_path) if tokenizer_path else train_tokenizer(texts, vocab_size)
    meta = tokenize(texts, tokenizer, paths, val_fraction)
    result = StageResult(
        dataset_dir=str(paths.root),
        tokenized_dir=str(paths.tokenized),
        files=len(files),
        bytes=sum(f.size for f in files),
        files_copied=copied,
        files_skipped=skipped,
        train_tokens=meta["tokens"]["train"],
        val_tokens=meta["tokens"]["val"],
        vocab_size=meta["vocab_size"],
        seconds=round(time.perf_counter() - started, 3),
    )
    log.info(
        "staged %d files (%d bytes; %d copied, %d unchanged) into %s: %d train + %d val tokens in %.1fs",
        result.files,
        result.bytes,
        copied,
        skipped,
        paths.root,
        result.train_tokens,
        result.val_tokens,
        result.seconds,
    )
    return result


def local_source_root(source: str) -> Path:
    if source.startswith("s3://"):
        raise InputError(f"source {source}: S3 sources are not supported yet; stage from a local path or file:// URI")
    root = Path(source.removeprefix("file://")).expanduser()
    if not root.exists():
        raise InputError(f"source {source}: does not exist")
    return root


def list_source(source: str, include: tuple[str, ...], exclude: tuple[str, ...]) -> list[SourceFile]:
    """The files to stage, sorted by key so that every later step sees them in the same order."""
    root = local_source_root(source)
    if root.is_file():
        candidates = [(root.name, root)]
    else:
        candidates = [(p.relative_to(root).as_posix(), p) for p in root.rglob("*") if p.is_file()]

    def wanted(key: str) -> bool:
        return matches(key, include) and not matches(key, exclude)

    files = sorted((SourceFile(key, p, p.stat().st_size) for key, p in candidates if wanted(key)), key=lambda f: f.key)
    if not files:
        raise InputError(f"source {source}: no files to stage (include {list(include)}, exclude {list(exclude)})")
    if not any(f.size for f in files):
        raise InputError(f"source {source}: all {len(files)} files are empty")
    return files


def matches(key: str, patterns: tuple[str, ...]) -> bool:
    """A glob matches the whole key ('part-a/*.txt') or its file name alone ('*.txt')."""
    name = key.rsplit("/", 1)[-1]
    return any(fnmatch.fnmatchcase(key, p) or fnmatch.fnmatchcase(name, p) for p in patterns)


def prepare_storage_root(storage_root: str) -> None:
    root = Path(storage_root)
    try:
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=root):
            pass
    except OSError as exc:
        raise InputError(f"storage root {storage_root}: not writable ({exc.strerror or exc})") from None


def mirror(files: list[SourceFile], paths: DatasetPaths, source: str) -> tuple[int, int]:
    """Copy the source under raw/, skipping files the previous manifest already has; write the manifest last."""
    previous = {}
    if paths.manifest.is_file():
        previous = {e["key"]: e for e in json.loads(paths.manifest.read_text())["files"]}
    entries, copied, skipped = [], 0, 0
    for f in files:
        dest = paths.raw / f.key
        old = previous.get(f.key)
        digest = sha256_of(f.path)
        if (
            old
            and old["size"] == f.size
            and old["sha256"] == digest
            and dest.is_file()
            and dest.stat().st_size == f.size
        ):
            skipped += 1
        else:
            with atomic_open(dest, "wb") as out, open(f.path, "rb") as src:
                shutil.copyfileobj(src, out, _CHUNK)
            copied += 1
        entries.append({"key": f.key, "size": f.size, "sha256": digest})
    keep = {f.key for f in files}
    for stale in [p for p in paths.raw.rglob("*") if p.is_file() and p.relative_to(paths.raw).as_posix() not in keep]:
        stale.unlink()
    write_json(
        paths.manifest,
        {
            "source": source,
            "staged_at": time.time(),
            "files": entries,
            "total_bytes": sum(e["size"] for e in entries),
            "copied": copied,
            "skipped": skipped,
        },
    )
    return copied, skipped


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
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
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def tokenize(texts: list[str], tokenizer: Tokenizer, paths: DatasetPaths, val_fraction: float) -> dict:
    """Encode every document followed by EOS; the last val_fraction of the stream is the val split."""
    eos = tokenizer.token_to_id(EOS)
    if eos is None:
        raise InputError(f"tokenizer has no {EOS} token")
    vocab = tokenizer.get_vocab_size()
    dtype = np.uint16 if vocab <= 2**16 else np.uint32
    stream = np.fromiter((t for enc in tokenizer.encode_batch(texts) for t in (*enc.ids, eos)), dtype=dtype)
    n_val = int(len(stream) * val_fraction)
    if n_val < 2 or len(stream) - n_val < 2:
        raise InputError(f"the corpus has only {len(stream)} tokens: too few to split into train and val")
    splits = {"train": stream[: len(stream) - n_val], "val": stream[len(stream) - n_val :]}

    paths.root.mkdir(parents=True, exist_ok=True)
    building = Path(tempfile.mkdtemp(prefix=".tokenized.", dir=paths.root))
    try:
        shards: dict[str, list[dict]] = {}
        for split, tokens in splits.items():
            shards[split] = []
            for i, start in enumerate(range(0, len(tokens), SHARD_TOKENS)):
                name = f"{split}_{i:04d}.bin"
                with open(building / name, "wb") as f:
                    f.write(tokens[start : start + SHARD_TOKENS].tobytes())
                    os.fsync(f.fileno())
                shards[split].append({"file": name, "tokens": int(min(SHARD_TOKENS, len(tokens) - start))})
        tokenizer.save(str(building / "tokenizer.json"))
        meta = {
            "vocab_size": vocab,
            "dtype": np.dtype(dtype).name,
            "eos_id": eos,
            "tokenizer": "tokenizer.json",
            "tokens": {s: int(len(t)) for s, t in splits.items()},
            "shards": shards,
            "documents": len(texts),
            "bytes": int(sum(len(t.encode("utf-8")) for t in texts)),
            "val_fraction": val_fraction,
        }
        write_json(building / "meta.json", meta)
        swap_in(building, paths.tokenized)
    except BaseException:
        shutil.rmtree(building, ignore_errors=True)
        raise
    return meta


def swap_in(new_dir: Path, final: Path) -> None:
    """Replace `final` by `new_dir` so that readers see the old or the new directory, never a mix."""
    old = None
    if final.exists():
        old = final.with_name(f".{final.name}.old.{os.getpid()}")
        os.replace(final, old)
    os.replace(new_dir, final)
    fsync_dir(final.parent)
    if old:
        shutil.rmtree(old)
