"""Staging Parquet and .jsonl.zst corpora against the ceiling on the same files, and an encode's peak memory against
the size of a Parquet row group (issue 41, Performance and memory).

One synthetic corpus (generated with numpy from a fixed seed: documents of log-normal length clipped to
200..20,000 characters, words drawn by a Zipf law from a vocabulary of 4,000 made-up words, a few with accented
letters and capitals, with commas, full stops, other punctuation and newlines), written twice:

    parquet    FILES Parquet files, columns `id` (int64) and `text` (string), row groups of ROW_GROUP_ROWS rows,
               snappy-compressed (pyarrow's default, and what FineWeb's files use)
    jsonl.zst  FILES .jsonl.zst files of the same documents in the same order: one {"id", "text"} object per line,
               zstd level 3 (the zstd tool's default)

A byte-level BPE tokenizer (the project's train_tokenizer, vocabulary 8192) is trained once beforehand on the first
16 MB of the documents and given to staging as tokenizer_path, so no timing includes training. Staging plans each
corpus (mirror_and_plan: mirror, format detection, plan; not timed), then in a fresh process per run:

    ours      encode_group of the one group: the project's readers (ParquetReader, JsonLinesReader), the val split by
              document, encode_in_order, GroupWriter, shards written and fsynced, the journal
    ceiling   the same files read plainly in one process and fed to Tokenizer.encode_batch_fast(batch,
              add_special_tokens=False) in batches of BATCH_BYTES of text, ids counted and discarded, nothing
              written: Parquet by pyarrow (read_row_group of the text column, to_pylist), JSON Lines by zstandard's
              streaming reader, lines split, json.loads per line

alternately (ceiling, ours, ceiling, ours, ...), every process with the same rayon threads (RAYON_NUM_THREADS = the
cores available, as the pipeline sets it to a step's CPUs); the best run of each is compared, so that drift on a
shared machine does not decide the ratio. Both count the same tokens (ours adds one EOS per document). After the last
run, the snapshot is finalized (finish_snapshot, in its own process, for its peak memory).

Memory: two more Parquet files, each ONE row group, of MEMORY_MB and of MEMORY_MB / 10 of text; each is planned and
encoded (encode_group) in a fresh process that reports its peak resident memory (VmHWM); and each is read alone
(ParquetReader, nothing encoded) in another, to tell the reader's share. It is a measurement, not a test: it never
asserts.

    PYTHONPATH=. .venv/bin/python bench/formats.py [--quick] [--repeats 2] [--part all|throughput|memory]
        [--formats parquet,jsonl.zst] [--write-results]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
from machine import RESULTS, answer_child, append_section, machine_lines, memory_bytes

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from components.stage_data.tokenization.encode import BATCH_BYTES  # noqa: E402
from trainer.layout import DatasetPaths  # noqa: E402

log = logging.getLogger("bench-formats")

SEED = 41
FILES = 4  # files per format
ROW_GROUP_ROWS = 16_384  # Parquet rows per row group: about 50 MB of text here
VOCAB_WORDS = 4000
TOKENIZE_VOCAB = 8192
SAMPLE_BYTES = 16 * 10**6  # the tokenizer's training sample
CHUNK_BYTES = 64 * 10**6  # text generated at a time
TARGET = 0.9  # ours over the ceiling
MEMORY_TARGET = 0.10  # peak memory of the large row group over the small one, within this
PARQUET, JSONL = "parquet", "jsonl.zst"
SEPARATORS = (
    (" ", 0.80),
    (", ", 0.07),
    (". ", 0.06),
    (".\n", 0.025),
    (".\n\n", 0.015),
    ("? ", 0.005),
    ("! ", 0.003),
    (": ", 0.006),
    ("; ", 0.006),
)
WIDTH = 24  # bytes of the widest word and separator


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a smoke run: 64 MB corpora, 1 repeat, 200 MB row group")
    p.add_argument("--text-mb", type=int, help="text per corpus (MB; default 1000, --quick 64)")
    p.add_argument(
        "--memory-mb",
        type=int,
        help="text in the large row group (MB; the small one is a tenth; default 2000, --quick 200)",
    )
    p.add_argument("--repeats", type=int, help="runs of each variant, alternately (default 2, --quick 1)")
    p.add_argument("--part", choices=("all", "throughput", "memory"), default="all")
    p.add_argument("--formats", default=f"{PARQUET},{JSONL}", help="the corpora timed (throughput)")
    p.add_argument("--write-results", action="store_true", help=f"append a dated section to {RESULTS.name}")
    p.add_argument("--child", metavar="SPEC", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.text_mb = args.text_mb or (64 if args.quick else 1000)
    args.memory_mb = args.memory_mb or (200 if args.quick else 2000)
    args.repeats = args.repeats or (1 if args.quick else 2)
    if args.text_mb < 20 or args.memory_mb < 20 or args.repeats < 1:
        p.error("--text-mb and --memory-mb must be at least 20, --repeats at least 1")
    return args


# -- the corpus ------------------------------------------------------------------------------------------------------


class TextMaker:
    """Documents of made-up words, deterministic for a seed; generated in numpy a chunk of bytes at a time."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)
        letters = np.frombuffer(b"etaoinshrdlcumwfgypbvkjxqz", dtype=np.uint8)
        frequency = np.array(
            [
                12.7,
                9.1,
                8.2,
                7.5,
                7.0,
                6.7,
                6.3,
                6.1,
                6.0,
                4.3,
                4.0,
                2.8,
                2.8,
                2.4,
                2.4,
                2.2,
                2.0,
                2.0,
                1.9,
                1.5,
                1.0,
                0.8,
                0.15,
                0.15,
                0.1,
                0.07,
            ]
        )  # English's, in order
        seen: set[str] = set()
        words: list[str] = []
        while len(words) < VOCAB_WORDS:
            length = int(np.clip(self.rng.poisson(5) + 1, 1, 14))
            word = bytes(self.rng.choice(letters, length, p=frequency / frequency.sum())).decode()
            if self.rng.random() < 0.03:
                word = word[:-1] + "é"
            if self.rng.random() < 0.05:
                word = word.capitalize()
            if word not in seen:
                seen.add(word)
                words.append(word)
        self.rows = np.zeros((VOCAB_WORDS * len(SEPARATORS), WIDTH), dtype=np.uint8)  # word + separator, 0-padded
        for i, word in enumerate(words):
            for j, (sep, _) in enumerate(SEPARATORS):
                data = (word + sep).encode()
                self.rows[i * len(SEPARATORS) + j, : len(data)] = np.frombuffer(data, np.uint8)
        zipf = 1 / (np.arange(VOCAB_WORDS) + 2.7)
        self.word_cdf = np.cumsum(zipf / zipf.sum())
        sep_p = np.array([q for _, q in SEPARATORS])
        self.sep_cdf = np.cumsum(sep_p / sep_p.sum())

    def chunk(self, nbytes: int) -> tuple[np.ndarray, np.ndarray]:
        """About `nbytes` of text cut into documents: the bytes (no separators between documents) and the documents'
        offsets into them (len + 1, as Arrow's)."""
        n = int(nbytes / 6.2) + 1000
        words = np.minimum(np.searchsorted(self.word_cdf, self.rng.random(n)), VOCAB_WORDS - 1)
        seps = np.minimum(np.searchsorted(self.sep_cdf, self.rng.random(n)), len(SEPARATORS) - 1)
        flat = self.rows[words * len(SEPARATORS) + seps].ravel()
        data = flat[flat != 0]
        lengths = np.clip(self.rng.lognormal(np.log(2000), 1.0, len(data) // 200 + 1), 200, 20_000).astype(np.int64)
        targets = np.cumsum(lengths)
        targets = targets[targets < len(data)]
        blanks = np.flatnonzero((data == ord(" ")) | (data == ord("\n")))  # a document ends before one
        ends = np.unique(blanks[np.minimum(np.searchsorted(blanks, targets), len(blanks) - 1)])
        starts = np.concatenate([[0], ends[:-1] + 1])
        while True:  # a document begins after the whitespace that ended the one before
            white = (data[np.minimum(starts, len(data) - 1)] == ord(" ")) | (
                data[np.minimum(starts, len(data) - 1)] == ord("\n")
            )
            if not white.any():
                break
            starts = starts + white
        keep = ends > starts
        starts, ends = starts[keep], ends[keep]
        pieces = np.concatenate([data[a:b] for a, b in zip(starts.tolist(), ends.tolist(), strict=True)])
        offsets = np.concatenate([[0], np.cumsum(ends - starts)]).astype(np.int32)
        return pieces, offsets


def text_array(pieces: np.ndarray, offsets: np.ndarray) -> Any:
    import pyarrow as pa

    return pa.StringArray.from_buffers(len(offsets) - 1, pa.py_buffer(offsets), pa.py_buffer(pieces))


def write_corpus(work: Path, text_bytes: int, maker: TextMaker) -> dict[str, Any]:
    """FILES Parquet and FILES .jsonl.zst files of the same documents, and the tokenizer trained on their start."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    from components.stage_data.tokenizer import train_tokenizer

    (work / "src-parquet").mkdir()
    (work / "src-jsonl").mkdir()
    schema = pa.schema([("id", pa.int64()), ("text", pa.string())])
    per_file, total, documents, sample = text_bytes // FILES, 0, 0, []
    for f in range(FILES):
        name = f"part-{f:04d}"
        written = 0
        with (
            pq.ParquetWriter(work / "src-parquet" / f"{name}.parquet", schema, compression="snappy") as parquet,
            open(work / "src-jsonl" / f"{name}.jsonl.zst", "wb") as raw,
            zstandard.ZstdCompressor(level=3).stream_writer(raw) as jsonl,
        ):
            while written < per_file:
                pieces, offsets = maker.chunk(min(CHUNK_BYTES, per_file - written + 10_000))
                texts = text_array(pieces, offsets)
                ids = pa.array(np.arange(documents, documents + len(texts), dtype=np.int64))
                parquet.write_table(pa.table([ids, texts], schema=schema), row_group_size=ROW_GROUP_ROWS)
                strings = texts.to_pylist()
                jsonl.write(
                    "".join(
                        json.dumps({"id": documents + i, "text": t}, ensure_ascii=False) + "\n"
                        for i, t in enumerate(strings)
                    ).encode()
                )
                if len(sample) < 2 and sum(map(len, sample)) < SAMPLE_BYTES:
                    sample.append(bytes(pieces[: SAMPLE_BYTES - sum(map(len, sample))]).decode(errors="ignore"))
                written += len(pieces)
                documents += len(texts)
        total += written
        log.info("wrote %s: %.0f MB of text", name, written / 1e6)
    tokenizer = train_tokenizer(iter([s[i : i + 4000] for s in sample for i in range(0, len(s), 4000)]), TOKENIZE_VOCAB)
    tokenizer.save(str(work / "tokenizer.json"))
    pf = pq.ParquetFile(next((work / "src-parquet").iterdir()))
    return {
        "text_bytes": total,
        "documents": documents,
        "row_groups": pf.metadata.num_row_groups,
        PARQUET: sum(p.stat().st_size for p in (work / "src-parquet").iterdir()),
        JSONL: sum(p.stat().st_size for p in (work / "src-jsonl").iterdir()),
    }


def write_one_row_group(path: Path, text_bytes: int, maker: TextMaker) -> dict[str, Any]:
    """One Parquet file of `text_bytes` of text in a single row group (written from several Arrow chunks)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    chunks, written = [], 0
    while written < text_bytes:
        pieces, offsets = maker.chunk(min(CHUNK_BYTES, text_bytes - written + 10_000))
        chunks.append(text_array(pieces, offsets))
        written += len(pieces)
    texts = pa.chunked_array(chunks)
    table = pa.table({"id": pa.array(np.arange(len(texts), dtype=np.int64)), "text": texts})
    pq.write_table(table, path, compression="snappy", row_group_size=len(texts))
    groups = pq.ParquetFile(path).metadata.num_row_groups
    assert groups == 1, f"{path}: {groups} row groups"
    return {"text_bytes": written, "documents": len(texts), "file_bytes": path.stat().st_size}


# -- the children: each measurement in a fresh process ---------------------------------------------------------------


def peak_mb() -> float:
    """This process's peak resident memory (VmHWM)."""
    peak = memory_bytes("VmHWM")
    return peak / 2**20 if peak >= 0 else float("nan")


def cpu_now() -> dict[str, float]:
    """CPU seconds so far: the whole process (every thread: rayon's too) and the main thread alone (the serial
    Python work: reading, copying ids, writing; the caller of encode_batch_fast waits without using a core)."""
    return {
        "cpu_s": time.process_time(),
        "main_cpu_s": time.thread_time(),
        "machine_cpu_s": busy_jiffies() / os.sysconf("SC_CLK_TCK"),
    }


def cpu_used(before: dict[str, float]) -> dict[str, float]:
    return {k: v - before[k] for k, v in cpu_now().items()}


def ours_child(spec: dict[str, Any]) -> dict[str, Any]:
    from components.stage_data.tokenization.encode import encode_group

    paths = DatasetPaths.of(spec["storage"], spec["dataset"])
    cpu, started = cpu_now(), time.perf_counter()
    result = encode_group(paths, spec["snapshot"], 0)
    seconds = time.perf_counter() - started
    formats = result.tally["formats"]
    return {
        "seconds": seconds,
        "peak_mb": peak_mb(),
        **cpu_used(cpu),
        "text_bytes": sum(f["text_bytes"] for f in formats.values()),
        "tokens": sum(result.tokens.values()),
        "documents": sum(f["documents"] for f in formats.values()),
    }


def group_files(spec: dict[str, Any]) -> list[Path]:
    from components.stage_data.tokenization.snapshot import Plan, building_dir

    paths = DatasetPaths.of(spec["storage"], spec["dataset"])
    return [paths.raw / row[0] for row in Plan.read(building_dir(paths, spec["snapshot"])).groups[0]]


def parquet_texts(path: Path) -> Iterator[str]:
    import pyarrow.parquet as pq

    parquet = pq.ParquetFile(path)
    for group in range(parquet.metadata.num_row_groups):
        yield from parquet.read_row_group(group, columns=["text"]).column(0).to_pylist()


def jsonl_zst_texts(path: Path) -> Iterator[str]:
    import zstandard

    with open(path, "rb") as f, zstandard.ZstdDecompressor().stream_reader(f) as reader:
        carry = b""
        while chunk := reader.read(4 * 2**20):
            lines = (carry + chunk).split(b"\n")
            carry = lines.pop()
            for line in lines:
                if line:
                    yield json.loads(line)["text"]
        if carry:
            yield json.loads(carry)["text"]


def ceiling_child(spec: dict[str, Any]) -> dict[str, Any]:
    """Read the text plainly, encode_batch_fast in batches of BATCH_BYTES (characters, as encode_in_order counts),
    count the ids, write nothing."""
    from tokenizers import Tokenizer

    files = group_files(spec)
    cpu, started = cpu_now(), time.perf_counter()
    tokenizer = Tokenizer.from_file(spec["tokenizer"])
    texts = parquet_texts if spec["format"] == PARQUET else jsonl_zst_texts
    tokens, documents, batch, size = 0, 0, [], 0
    for path in files:
        for text in texts(path):
            if not text:
                continue
            batch.append(text)
            size += len(text)
            if size >= BATCH_BYTES:
                tokens += sum(map(len, tokenizer.encode_batch_fast(batch, add_special_tokens=False)))
                documents += len(batch)
                batch, size = [], 0
    if batch:
        tokens += sum(map(len, tokenizer.encode_batch_fast(batch, add_special_tokens=False)))
        documents += len(batch)
    return {
        "seconds": time.perf_counter() - started,
        "peak_mb": peak_mb(),
        **cpu_used(cpu),
        "text_bytes": spec["text_bytes"],
        "tokens": tokens,
        "documents": documents,
    }


def read_child(spec: dict[str, Any]) -> dict[str, Any]:
    """The project's Parquet reader alone over the group's files: every row group, every piece, nothing encoded."""
    from components.stage_data.formats.parquet import ParquetReader

    started = time.perf_counter()
    text_bytes = documents = 0
    for path in group_files(spec):
        reader = ParquetReader(path, path.name, "text")
        for part in range(reader.parts()):
            for item in reader.read(part):
                documents += 1
                text_bytes += len(item.text)
    return {
        "seconds": time.perf_counter() - started,
        "peak_mb": peak_mb(),
        "text_bytes": text_bytes,
        "documents": documents,
    }


def finish_child(spec: dict[str, Any]) -> dict[str, Any]:
    from components.stage_data.core import finish_snapshot

    started = time.perf_counter()
    result = finish_snapshot(spec["storage"], spec["dataset"], spec["snapshot"])
    return {
        "seconds": time.perf_counter() - started,
        "peak_mb": peak_mb(),
        "tokens": result.train_tokens + result.val_tokens,
    }


CHILDREN: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "ours": ours_child,
    "ceiling": ceiling_child,
    "read": read_child,
    "finish": finish_child,
}


def run_child(work: Path, spec: dict[str, Any]) -> dict[str, Any]:
    """A fresh process running CHILDREN[spec['kind']] with as many rayon threads as this process has cores."""
    spec_path, out = work / "child.spec.json", work / "child.out.json"
    spec_path.write_text(json.dumps({**spec, "out": str(out)}))
    out.unlink(missing_ok=True)
    threads = str(len(os.sched_getaffinity(0)))
    env = {
        **os.environ,
        "RAYON_NUM_THREADS": threads,
        "TOKENIZERS_PARALLELISM": "true",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")])),
    }
    os.sync()  # the previous run's shards on disk, not in this one's time
    subprocess.run([sys.executable, __file__, "--child", str(spec_path)], env=env, check=True)
    result = json.loads(out.read_text())
    if "cpu_s" in result:  # other processes' CPU use while it was timed, in cores: what sharing the machine took
        result["busy_elsewhere"] = max(0.0, result["machine_cpu_s"] - result["cpu_s"]) / result["seconds"]
    return result


def busy_jiffies() -> int:
    """CPU time the whole machine has spent busy (user, nice, system, irq, softirq, steal), in clock ticks."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return sum(fields) - fields[3] - fields[4]  # less idle and iowait


# -- planning --------------------------------------------------------------------------------------------------------


class Planned:
    """A corpus mirrored and planned as one group with the given tokenizer; reset() puts it back to planned."""

    def __init__(self, work: Path, source: Path, dataset: str, tokenizer: Path):
        from components.stage_data.core import mirror_and_plan
        from components.stage_data.settings import StageSettings
        from components.stage_data.tokenization.snapshot import building_dir

        self.storage = work / "storage"
        planned = mirror_and_plan(
            StageSettings(
                source=str(source),
                storage_root=str(self.storage),
                dataset=dataset,
                tokenizer_path=str(tokenizer),
                tokenize_groups=1,
            )
        )
        self.dataset, self.snapshot, self.tokenizer = dataset, planned.snapshot, tokenizer
        self.building = building_dir(DatasetPaths.of(self.storage, dataset), self.snapshot)
        self.pristine = work / f"planned-{dataset}"
        shutil.copytree(self.building, self.pristine)

    def spec(self, kind: str, **more: Any) -> dict[str, Any]:
        return {
            "kind": kind,
            "storage": str(self.storage),
            "dataset": self.dataset,
            "snapshot": self.snapshot,
            "tokenizer": str(self.tokenizer),
            **more,
        }

    def reset(self) -> None:
        shutil.rmtree(self.building)
        shutil.copytree(self.pristine, self.building)

    def drop_raw(self) -> None:
        shutil.rmtree(DatasetPaths.of(self.storage, self.dataset).root, ignore_errors=True)


# -- the parts -------------------------------------------------------------------------------------------------------


def throughput_part(work: Path, args: argparse.Namespace, maker: TextMaker) -> tuple[list[str], dict[str, Any]]:
    log.info("writing %d MB of text as Parquet and as .jsonl.zst", args.text_mb)
    corpus = write_corpus(work, args.text_mb * 10**6, maker)
    formats = [f for f in (PARQUET, JSONL) if f in args.formats.split(",")]
    planned = {
        fmt: Planned(work, work / f"src-{fmt.split('.')[0]}", fmt.replace(".", "-"), work / "tokenizer.json")
        for fmt in formats
    }
    for fmt in (PARQUET, JSONL):
        shutil.rmtree(work / f"src-{fmt.split('.')[0]}")  # the mirror holds the same files (or they are not timed)
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {fmt: {"ceiling": [], "ours": []} for fmt in planned}
    for fmt, plan in planned.items():
        for n in range(args.repeats):
            for kind in ("ceiling", "ours"):
                plan.reset()
                result = run_child(work, plan.spec(kind, format=fmt, text_bytes=corpus["text_bytes"]))
                runs[fmt][kind].append(result)
                log.info(
                    "%s repeat %d: %s %.1fs, %.2f MB/s, peak %.0f MB",
                    fmt,
                    n + 1,
                    kind,
                    result["seconds"],
                    result["text_bytes"] / result["seconds"] / 1e6,
                    result["peak_mb"],
                )
        runs[fmt]["finish"] = [run_child(work, plan.spec("finish"))]
        plan.drop_raw()  # the disk back: the mirrored corpus and its shards
    return throughput_lines(args, corpus, runs), {"corpus": corpus, "runs": runs}


def memory_part(work: Path, args: argparse.Namespace, maker: TextMaker) -> tuple[list[str], dict[str, Any]]:
    rows = {}
    for label, megabytes in (("small", args.memory_mb // 10), ("large", args.memory_mb)):
        source = work / f"src-{label}"
        source.mkdir()
        log.info("writing one row group of %d MB of text", megabytes)
        made = write_one_row_group(source / f"{label}.parquet", megabytes * 10**6, maker)
        plan = Planned(work, source, f"memory-{label}", work / "tokenizer.json")
        shutil.rmtree(source)
        read = run_child(work, plan.spec("read"))
        ours = run_child(work, plan.spec("ours"))
        log.info(
            "%s (%d MB): read alone peak %.0f MB; encode peak %.0f MB in %.0fs",
            label,
            megabytes,
            read["peak_mb"],
            ours["peak_mb"],
            ours["seconds"],
        )
        plan.drop_raw()
        rows[label] = {**made, "read": read, "ours": ours}
    return memory_lines(args, rows), rows


# -- the report ------------------------------------------------------------------------------------------------------


def mb_s(run: dict[str, Any]) -> float:
    return run["text_bytes"] / run["seconds"] / 1e6


def throughput_lines(
    args: argparse.Namespace, corpus: dict[str, Any], runs: dict[str, dict[str, list[dict[str, Any]]]]
) -> list[str]:
    cores = len(os.sched_getaffinity(0))
    lines = [
        f"Throughput (`bench/formats.py{' --quick' if args.quick else ''}`): one synthetic corpus of "
        f"{corpus['text_bytes'] / 1e6:,.0f} MB of text in {corpus['documents']:,} documents (log-normal lengths, "
        f"200-20,000 characters, median 2,000; Zipf-drawn made-up words from a vocabulary of {VOCAB_WORDS:,}, "
        f"punctuation, newlines, some accented letters), written as {FILES} Parquet files (`id`, `text`; "
        f"{corpus['row_groups']} row groups of {ROW_GROUP_ROWS:,} rows per file; snappy; "
        f"{corpus[PARQUET] / 1e6:,.0f} MB on disk) and as {FILES} .jsonl.zst files (zstd level 3; "
        f"{corpus[JSONL] / 1e6:,.0f} MB). Tokenizer: the project's byte-level BPE, vocabulary {TOKENIZE_VOCAB}, "
        f"trained once beforehand on the first {SAMPLE_BYTES // 10**6} MB and given as tokenizer_path. ours: "
        f"`encode_group` of the planned group (readers, val split by document, encode_in_order, GroupWriter, shards "
        f"and journal written and fsynced), timed in a fresh process after the plan; ceiling: the same files read "
        f"plainly (pyarrow `read_row_group(columns=['text']).to_pylist()`; zstandard `stream_reader` + "
        f"`json.loads` per line) into `encode_batch_fast(batch, add_special_tokens=False)`, batches of "
        f"{BATCH_BYTES // 2**20} MiB of text, ids counted, nothing written. Every process has RAYON_NUM_THREADS="
        f"{cores} (the cores) and TOKENIZERS_PARALLELISM=true. Runs alternate ceiling, ours, ceiling, ours "
        f"({args.repeats} of each); the best of each is compared. MB are 10^6 bytes of UTF-8 text.",
        "",
        "| format | variant | runs (s) | best (s) | MB/s of text (best) | MB/s per core | CPU s (best run) | "
        "main thread CPU s (best run) | cores busy elsewhere (runs) | tokens | peak memory (MB) |",
        "|---|---|---|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    summary = []
    for fmt, kinds in runs.items():
        for kind in ("ceiling", "ours"):
            best = min(kinds[kind], key=lambda r: r["seconds"])
            seconds = ", ".join(f"{r['seconds']:.1f}" for r in kinds[kind])
            elsewhere = ", ".join(f"{r['busy_elsewhere']:.2f}" for r in kinds[kind])
            lines.append(
                f"| {fmt} | {kind} | {seconds} | "
                f"{best['seconds']:.1f} | {mb_s(best):.2f} | {mb_s(best) / cores:.2f} | {best['cpu_s']:.1f} | "
                f"{best['main_cpu_s']:.1f} | {elsewhere} | {best['tokens']:,} | "
                f"{max(r['peak_mb'] for r in kinds[kind]):.0f} |"
            )
        ours = min(kinds["ours"], key=lambda r: r["seconds"])
        ceiling = min(kinds["ceiling"], key=lambda r: r["seconds"])
        ratio = mb_s(ours) / mb_s(ceiling)
        same = ours["tokens"] == ceiling["tokens"] + ours["documents"] and ours["text_bytes"] == corpus["text_bytes"]
        pairs = [c["seconds"] / o["seconds"] for c, o in zip(kinds["ceiling"], kinds["ours"], strict=True)]
        cpu = min(r["cpu_s"] for r in kinds["ceiling"]) / min(r["cpu_s"] for r in kinds["ours"])
        met = "met" if ratio >= TARGET else "NOT met"
        summary.append(
            f"{fmt}: ours / ceiling {ratio:.3f} (target >= {TARGET}: {met}"
            f"; per repeat {', '.join(f'{p:.3f}' for p in pairs)}; in CPU seconds, least of each: "
            f"{cpu:.3f}); same work: "
            f"{'yes' if same else 'NO'} (ours {ours['tokens']:,} tokens = ceiling's "
            f"{ceiling['tokens']:,} + one EOS per document ({ours['documents']:,}); text bytes "
            f"{ours['text_bytes']:,}). finish_snapshot after: {kinds['finish'][0]['seconds']:.2f} s, peak "
            f"{kinds['finish'][0]['peak_mb']:.0f} MB."
        )
    return lines + [""] + summary + [""] + projection_lines(runs)


PROJECTIONS = (  # (corpus, its format, GB of text)
    ("FineWeb-Edu sample-10BT (~27 GB of Parquet)", PARQUET, 45),
    ("100 GB of .jsonl.zst text", JSONL, 100),
)
PODS = ((1, 2), (16, 8), (16, 16))  # (pods, cores): this machine; the example; the pipeline's tokenize pods


def projection_lines(runs: dict[str, dict[str, list[dict[str, Any]]]]) -> list[str]:
    """Staging's encode time for larger corpora from this run's figures (labelled: not a measurement)."""
    cores = len(os.sched_getaffinity(0))
    lines = [
        "**Projection** (not a measurement): the encode step's wall time (tokenize_workers pods in parallel, one "
        "group each; the mirror, tokenizer training, pod start-up and finalize not included), from this run's best "
        "`ours` figures: per core = MB/s over the cores here; each pod's rate = min(cores x per core, the serial "
        "cap), the serial cap being text over the main thread's CPU seconds (reading, ids to numpy, writes: one "
        "Python thread, whatever the cores).",
        "",
        "| corpus | text (GB) | MB/s per core | serial cap of a pod (MB/s) | "
        + " | ".join(f"{p} pod{'s' * (p > 1)} x {c} cores (min)" for p, c in PODS)
        + " |",
        "|---|---:|---:|---:|" + "---:|" * len(PODS),
    ]
    for name, fmt, gigabytes in PROJECTIONS:
        if fmt not in runs:
            continue
        best = min(runs[fmt]["ours"], key=lambda r: r["seconds"])
        per_core = mb_s(best) / cores
        cap = best["text_bytes"] / 1e6 / max(best["main_cpu_s"], 1e-9)
        minutes = [gigabytes * 1000 / (pods * min(c * per_core, cap)) / 60 for pods, c in PODS]
        cells = " | ".join(f"{m:,.1f}" for m in minutes)
        lines.append(f"| {name} | {gigabytes} | {per_core:.2f} | {cap:.0f} | {cells} |")
    return lines


def memory_lines(args: argparse.Namespace, rows: dict[str, dict[str, Any]]) -> list[str]:
    small, large = rows["small"], rows["large"]
    ratio = large["ours"]["peak_mb"] / small["ours"]["peak_mb"]
    met = abs(ratio - 1) <= MEMORY_TARGET
    lines = [
        f"Memory (`bench/formats.py{' --quick' if args.quick else ''}`): two Parquet files of the same kind of "
        f"text, each ONE row group (snappy), staged with the same tokenizer; peak resident memory (VmHWM) of an "
        f"`encode_group` process over the whole file, and of a process that only reads it with the project's "
        f"ParquetReader (every document, nothing encoded).",
        "",
        "| row group | text (MB) | documents | file (MB) | encode peak (MB) | encode (s) | read alone peak (MB) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for label, row in rows.items():
        lines.append(
            f"| {label} | {row['text_bytes'] / 1e6:,.0f} | {row['documents']:,} | "
            f"{row['file_bytes'] / 1e6:,.0f} | {row['ours']['peak_mb']:.0f} | {row['ours']['seconds']:.1f} | "
            f"{row['read']['peak_mb']:.0f} |"
        )
    lines += [
        "",
        f"Encode peak, large / small: {ratio:.3f} (target: equal within {MEMORY_TARGET:.0%}: "
        f"{'met' if met else 'NOT met'}); read alone: "
        f"{large['read']['peak_mb'] / small['read']['peak_mb']:.3f}.",
    ]
    return lines


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.child:
        return answer_child(args.child, CHILDREN)
    for quiet in ("components.stage_data.mirror", "components.stage_data.tokenization", "components.stage_data.core"):
        logging.getLogger(quiet).setLevel(logging.WARNING)
    load_before = os.getloadavg()
    (REPO / "local-runs").mkdir(exist_ok=True)  # gitignored, on the repository's disk
    work = Path(tempfile.mkdtemp(prefix="bench-formats-", dir=REPO / "local-runs"))
    maker = TextMaker(SEED)
    text: list[str] = []
    started = time.perf_counter()
    try:
        if args.part != "memory":
            text += throughput_part(work, args, maker)[0]
        if args.part != "throughput":
            if not (work / "tokenizer.json").exists():
                write_corpus_tokenizer(work, maker)
            text += [""] * bool(text) + memory_part(work, args, maker)[0]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    load_after = os.getloadavg()
    before, after = (", ".join(f"{x:.2f}" for x in load) for load in (load_before, load_after))
    text += [
        "",
        f"Whole run {time.perf_counter() - started:.0f} s. Load average (1, 5, 15 min) at the start: "
        f"{before}; at the end: {after}.",
    ]
    print("\n".join(text))
    if args.write_results:
        append_section(
            "staging Parquet and .jsonl.zst against the ceiling; memory against row-group size",
            text,
            machine_lines("pyarrow", "zstandard", "tokenizers", "numpy"),
        )
        log.info("appended results to %s", RESULTS)
    return 0


def write_corpus_tokenizer(work: Path, maker: TextMaker) -> None:
    """The tokenizer alone (--part memory): trained on a sample as write_corpus trains it."""
    from components.stage_data.tokenizer import train_tokenizer

    pieces, _ = maker.chunk(SAMPLE_BYTES)
    sample = bytes(pieces).decode(errors="ignore")
    tokenizer = train_tokenizer(iter([sample[i : i + 4000] for i in range(0, len(sample), 4000)]), TOKENIZE_VOCAB)
    tokenizer.save(str(work / "tokenizer.json"))


if __name__ == "__main__":
    sys.exit(main())
