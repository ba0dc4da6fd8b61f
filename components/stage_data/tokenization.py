"""Tokenize the mirrored corpus into a snapshot: the train/val shards the trainer memory-maps, and its tokenizer.

A snapshot is named by a hash of its inputs (staged content, val set, tokenizer settings, shard size, groups):
built under snapshots/.building.<id>/, renamed into place whole and never changed after; current.json then points
at it. Staging the same inputs again finds the snapshot and skips all of it; staging changed ones writes a new
snapshot beside the old, which the runs that trained on it keep reading.

Three stages, so that a corpus larger than one pod fans out:
- plan (one process, under the staging lock): the val split (whole files, chosen once and kept in val_set.json),
  the tokenizer (trained on a bounded, deterministic sample of the train files, so its time stops growing with
  the corpus; or given), and the files cut into `groups` contiguous, byte-balanced groups: plan.json;
- encode a group (one process per group, in parallel pods): its files read in blocks cut at line ends, encoded a
  batch of blocks at a time (the tokenizers library spreads a batch over every core), appended to the group's own
  shard files; a journal records each finished file, so a killed group starts again after its last finished file;
- finalize: meta.json lists every group's shards in order, and the snapshot is renamed into place.
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
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from common.errors import InputError, StepFailed
from components.stage_data import SAMPLE_MB, SHARD_TOKENS
from components.stage_data.mirror import checksum_field
from trainer.atomic import atomic_open, fsync_dir, write_json
from trainer.layout import META, TOKENIZER, DatasetPaths

log = logging.getLogger(__name__)

EOS = "<|endoftext|>"
FORMAT = 3  # of the shards and meta.json; a change re-tokenizes everything
BLOCK_BYTES = 64 * 2**10  # text is read and encoded in blocks of about this size, cut at a line end
BATCH_BYTES = 16 * 2**20  # blocks per encode_batch call: enough work for every core, bounded memory
JOURNAL_EVERY_S = 5.0  # a killed group re-encodes at most this much work
STALE_BUILD_S = 24 * 3600  # a building directory untouched this long belongs to a staging that is gone
PLAN = "plan.json"
SPLITS = ("train", "val")


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


@dataclass
class Plan:
    """What every group's encoder reads (plan.json): the same tokenizer, dtype and shard size for all."""

    snapshot: str
    inputs: dict[str, Any]
    groups: list[list[list[str]]]  # per group: [key, split] in order
    dtype: str
    eos_id: int
    vocab_size: int
    shard_tokens: int
    documents: int
    val_files: int

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


def sample_blocks(files: dict[str, Path], sample_bytes: int) -> Iterator[str]:
    """About `sample_bytes` of text: whole files in the order of a hash of their keys (deterministic, and a spread
    over the corpus rather than its first directory), the last one cut at a block."""
    taken = 0
    for key in sorted(files, key=lambda k: hashlib.sha256(k.encode()).digest()):
        for block in text_blocks(files[key]):
            if taken >= sample_bytes:
                return
            taken += len(block.encode())
            yield block


def train_tokenizer(blocks: Iterator[str], vocab_size: int) -> Tokenizer:
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
    tokenizer.train_from_iterator(blocks, trainer=trainer)
    return tokenizer


class ShardWriter:
    """Appends token ids to <prefix>_NNNN.bin files of at most `shard_tokens` tokens each."""

    def __init__(self, directory: Path, split: str, dtype: np.dtype, shard_tokens: int = SHARD_TOKENS):
        self.directory, self.split, self.dtype, self.shard_tokens = directory, split, dtype, shard_tokens
        self.shards: list[dict[str, Any]] = []
        self._file: Any = None

    def position(self) -> list[int]:
        """[shards, tokens in the last]: with every earlier shard full, enough to cut the files back to this point."""
        return [len(self.shards), self.shards[-1]["tokens"] if self.shards else 0]

    def resume(self, position: list[int]) -> None:
        """Cut the shard files back to `position` (what the journal recorded), dropping what came after it."""
        count, last_tokens = position
        self.shards = [{"file": self._name(i), "tokens": self.shard_tokens} for i in range(count)]
        for stale in self.directory.glob(f"{self.split}_*.bin"):
            if stale.name not in {s["file"] for s in self.shards}:
                stale.unlink()
        if count:
            self.shards[-1]["tokens"] = last_tokens
            self._file = open(self.directory / self.shards[-1]["file"], "r+b")
            self._file.truncate(last_tokens * self.dtype.itemsize)
            self._file.seek(0, os.SEEK_END)

    def sync(self) -> None:
        """Make what was written durable, before a journal says it was."""
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())

    def _name(self, index: int) -> str:
        return f"{self.split}_{index:04d}.bin"

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
        name = self._name(len(self.shards))
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


def encode_files(
    files: list[tuple[Path, ShardWriter]], tokenizer: Tokenizer, eos: int, file_done: Callable[[int], None]
) -> None:
    """Encode each file followed by EOS into its writer, a batch of blocks at a time; after a file's last tokens
    are written, file_done(its index) is called.

    The tokenizers library encodes a batch on every core without the GIL; this thread meanwhile writes out the
    previous batch and reads the next, so the cores are not left idle while Python copies tokens to the shards.
    """
    batch: list[str] = []
    owners: list[tuple[int, bool]] = []  # each block's file, and whether it is that file's last
    size = 0
    in_flight: tuple[Future, list[tuple[int, bool]]] | None = None

    def write_out(encoded: Future, blocks: list[tuple[int, bool]]) -> None:
        for encoding, (index, last) in zip(encoded.result(), blocks, strict=True):
            writer = files[index][1]
            writer.write(np.asarray(encoding.ids, dtype=writer.dtype))
            if last:
                writer.write(np.asarray([eos], dtype=writer.dtype))
                file_done(index)

    with ThreadPoolExecutor(1, thread_name_prefix="encode") as encoder:

        def submit() -> None:
            nonlocal in_flight, size
            previous = in_flight
            in_flight = (encoder.submit(tokenizer.encode_batch_fast, batch.copy(), add_special_tokens=False),
                         owners.copy())  # fmt: skip
            batch.clear()
            owners.clear()
            size = 0
            if previous is not None:
                write_out(*previous)

        for index, (path, _) in enumerate(files):
            blocks = text_blocks(path)
            block = next(blocks, "")  # an empty file is still a document: its EOS alone
            while block is not None:
                following = next(blocks, None)
                batch.append(block)
                owners.append((index, following is None))
                size += len(block)
                block = following
                if size >= BATCH_BYTES:
                    submit()
        if batch:
            submit()
        if in_flight is not None:
            write_out(*in_flight)


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def snapshot_inputs(
    paths: DatasetPaths, keys: list[str], content_sha256: str, vocab_size: int, val_fraction: float, given: str,
    shard_tokens: int, groups: int, sample_mb: int,
) -> tuple[dict[str, Any], set[str]]:  # fmt: skip
    """What a snapshot's content follows from (its id is their hash), and the val split's keys."""
    held_out = fixed_val_keys(paths, keys, val_fraction)
    tokenizer = {"given_sha256": sha256_text(given)} if given else {"trained_vocab_size": vocab_size,
                                                                     "sample_mb": sample_mb}  # fmt: skip
    inputs = {
        "format": FORMAT,
        "content_sha256": content_sha256,
        "val_set_sha256": val_set_sha256(paths, held_out),
        "shard_tokens": shard_tokens,
        "groups": groups,
        "tokenizer": tokenizer,
    }
    return inputs, held_out


def plan_snapshot(
    paths: DatasetPaths,
    keys: list[str],
    content_sha256: str,
    vocab_size: int,
    val_fraction: float,
    tokenizer_path: str = "",
    shard_tokens: int = SHARD_TOKENS,
    groups: int = 1,
    sample_mb: int = SAMPLE_MB,
) -> Plan | None:
    """Plan the snapshot of these inputs: None when it exists already (it is made current); else its Plan, with
    the tokenizer in place. A killed plan or encode left its building directory: the same inputs carry on in it."""
    given = Path(tokenizer_path).read_text() if tokenizer_path else ""
    inputs, held_out = snapshot_inputs(paths, keys, content_sha256, vocab_size, val_fraction, given, shard_tokens,
                                       groups, sample_mb)  # fmt: skip
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
        pass
    building.mkdir(exist_ok=True)
    started = time.perf_counter()
    if given:
        tokenizer = Tokenizer.from_str(given)
    else:
        train = {k: paths.raw / k for k in keys if k not in held_out}
        tokenizer = train_tokenizer(sample_blocks(train, sample_mb * 2**20), vocab_size)
        log.info("trained a BPE vocabulary of %d on a sample of up to %d MB in %.1fs", vocab_size, sample_mb,
                 time.perf_counter() - started)  # fmt: skip
    eos = tokenizer.token_to_id(EOS)
    if eos is None:
        raise InputError(f"tokenizer {tokenizer_path}: it has no {EOS} token")
    with atomic_open(building / TOKENIZER, "w") as f:
        f.write(tokenizer.to_str())
    vocab = tokenizer.get_vocab_size()
    files = [[k, "train"] for k in keys if k not in held_out] + [[k, "val"] for k in keys if k in held_out]
    plan = Plan(
        snapshot=snapshot,
        inputs=inputs,
        groups=split_into_groups(files, {k: (paths.raw / k).stat().st_size for k in keys}, groups),
        dtype=np.dtype(np.uint16 if vocab <= 2**16 else np.uint32).name,
        eos_id=eos,
        vocab_size=vocab,
        shard_tokens=shard_tokens,
        documents=len(keys),
        val_files=len(held_out),
    )
    write_json(building / PLAN, asdict(plan))  # last: a plan.json means the tokenizer is in place
    return plan


def split_into_groups(files: list[list[str]], sizes: dict[str, int], groups: int) -> list[list[list[str]]]:
    """Each split's files cut into `groups` contiguous runs of about equal bytes: group g holds the g-th run of the
    train files and of the val files, so the shards of groups 0, 1, ... in turn keep the files' order."""
    result: list[list[list[str]]] = [[] for _ in range(groups)]
    for split in SPLITS:
        chosen = [f for f in files if f[1] == split]
        total = sum(sizes[k] for k, _ in chosen) or 1
        done = 0
        for entry in chosen:
            result[min(groups - 1, done * groups // total)].append(entry)
            done += sizes[entry[0]]
    return result


def building_dir(paths: DatasetPaths, snapshot: str) -> Path:
    return paths.snapshots / f".building.{snapshot}"


def planned(paths: DatasetPaths, snapshot: str) -> Plan:
    """The plan the encoders and the finalize step follow; without one, the staging step did not finish."""
    building = building_dir(paths, snapshot)
    try:
        return Plan.read(building)
    except (OSError, ValueError, TypeError) as exc:
        raise StepFailed(f"snapshot {snapshot} of {paths.name!r} has no plan in {building} ({exc}): stage "
                         "again") from exc  # fmt: skip


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


def encode_group(paths: DatasetPaths, snapshot: str, group: int) -> GroupResult:
    """Encode one group's files into its shards, carrying on after the last file an earlier attempt finished.
    Two stagings of the same inputs may run at once: a lock per group makes the second wait, then find it done."""
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
        tokenizer = Tokenizer.from_file(str(building / TOKENIZER))
        dtype = np.dtype(plan.dtype)
        writers = {s: ShardWriter(building, group_prefix(s, group), dtype, plan.shard_tokens) for s in SPLITS}
        journal_path = building / f".journal-{group:03d}.jsonl"
        finished = read_journal(journal_path)
        for split, writer in writers.items():
            writer.resume(finished[-1]["position"][split] if finished else [0, 0])
        files = plan.groups[group][len(finished) :]
        journal = GroupJournal(journal_path, writers)
        encode_files([(paths.raw / key, writers[split]) for key, split in files], tokenizer, plan.eos_id,
                     lambda i: journal.file_done(files[i][0]))  # fmt: skip
        journal.flush()
        tokens = {s: w.close() for s, w in writers.items()}
        text_bytes = sum((paths.raw / key).stat().st_size for key, _ in plan.groups[group])
        shards = {s: w.shards for s, w in writers.items()}
        result = GroupResult(group, len(plan.groups[group]), len(finished), text_bytes, tokens, shards,
                             round(time.perf_counter() - started, 3))  # fmt: skip
        write_json(done_path, asdict(result))
    log.info("group %d of snapshot %s: %d files (%d finished before), %d train + %d val tokens in %.1fs", group,
             snapshot, result.files, result.files_resumed, tokens["train"], tokens["val"], result.seconds)  # fmt: skip
    return result


def read_journal(path: Path) -> list[dict[str, Any]]:
    """The files a group finished, in order; a torn last line (the kill came mid-write) is not one."""
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


class GroupJournal:
    """One line per finished file with the writers' positions, written every few seconds after an fsync of the
    shards, so that a line never promises tokens the disk does not hold."""

    def __init__(self, path: Path, writers: dict[str, ShardWriter]):
        self.path, self.writers = path, writers
        self.pending: list[str] = []
        self.flushed = time.monotonic()

    def file_done(self, key: str) -> None:
        position = {s: w.position() for s, w in self.writers.items()}
        self.pending.append(json.dumps({"key": key, "position": position}))
        if time.monotonic() - self.flushed >= JOURNAL_EVERY_S:
            self.flush()

    def flush(self) -> None:
        for writer in self.writers.values():
            writer.sync()
        with open(self.path, "a") as f:
            f.write("".join(line + "\n" for line in self.pending))
            f.flush()
            os.fsync(f.fileno())
        self.pending.clear()
        self.flushed = time.monotonic()


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
        log.info("tokenized %d files (%d held out for val) into snapshot %s: %d train + %d val tokens, vocabulary "
                 "%d, in %.1fs", meta["documents"], meta["val_files"], snapshot, meta["tokens"]["train"],
                 meta["tokens"]["val"], meta["vocab_size"], seconds)  # fmt: skip
    return TokenizeResult(meta["tokens"]["train"], meta["tokens"]["val"], meta["vocab_size"], meta["val_files"],
                          seconds, skipped=skipped, snapshot=snapshot, snapshot_dir=str(directory))  # fmt: skip


def write_snapshot(paths: DatasetPaths, snapshot: str) -> dict[str, Any]:
    building = building_dir(paths, snapshot)
    plan = planned(paths, snapshot)
    results = []
    for group in range(len(plan.groups)):
        try:
            results.append(GroupResult(**json.loads((building / f".group-{group:03d}.json").read_text())))
        except (OSError, ValueError, TypeError):
            raise StepFailed(f"snapshot {snapshot}: group {group} of {len(plan.groups)} has not finished encoding; "
                             "rerun staging (each group carries on where it stopped)") from None  # fmt: skip
    tokens = {s: sum(r.tokens[s] for r in results) for s in SPLITS}
    for split in SPLITS:
        if tokens[split] < 2:
            raise InputError(f"the {split} split has only {tokens[split]} tokens: the corpus is too small")
    tokenizer_json = (building / TOKENIZER).read_text()
    meta = {
        "format": FORMAT,
        "dataset": paths.name,
        "snapshot": snapshot,
        "vocab_size": plan.vocab_size,
        "dtype": plan.dtype,
        "eos_id": plan.eos_id,
        "tokenizer": TOKENIZER,
        "tokenizer_sha256": sha256_text(tokenizer_json),
        "manifest_content_sha256": plan.inputs["content_sha256"],
        "tokens": tokens,
        "shards": {s: [shard for r in results for shard in r.shards[s]] for s in SPLITS},
        "documents": plan.documents,
        "val_files": plan.val_files,
        "val_set_sha256": plan.inputs["val_set_sha256"],
        "text_bytes": sum(r.text_bytes for r in results),
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


def val_set_sha256(paths: DatasetPaths, held_out: set[str]) -> str:
    """The val text's identity: its files' keys, sizes and checksums (from the manifest staging just wrote), so
    two evaluations with the same identity measured the same bytes, whatever the tokenizer."""
    entries = {e["key"]: e for e in json.loads(paths.manifest.read_text())["files"]}
    listing = [[k, entries[k]["size"], checksum_field(entries[k])] for k in sorted(held_out)]
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
