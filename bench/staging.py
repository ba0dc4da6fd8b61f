"""Time S3 staging against a plain boto3 loop and the server's own ceiling, and time tokenization.

Against one local S3-compatible server (moto's standalone server, in its own process on loopback), in
one run, side by side, the order of the variants reversed on every other repeat:

    small files (2,000 of 1-16 KB)
      sequential  a plain loop of boto3 `download_file`, one object after another
      ceiling     16 threads that only `get_object` and read the bodies into memory, writing nothing:
                  what the server can serve
      staging     the staging mirror (components.stage_data.mirror) with 16 workers: temp file, MD5
                  against the ETag, rename, journal, syncfs and the manifest included
    large files (3 of 64 MB, above the multipart threshold)
      download_file  s3transfer's own `download_file` per object (8 MB parts, 16 concurrent requests)
      staging        the staging mirror with the same part size and concurrency

Then tokenization (staging's plan / encode per group, components.stage_data.tokenization), every timed part in
a fresh process, on a text corpus: the Python standard library's own source, repeated to size (nothing is
downloaded):

    encoding (100 MB, one tokenizer trained by the plan; variants interleaved, order reversed every other repeat)
      encode_group, 1 group            the project's encode of the whole corpus as one group: blocks, batches,
                                       shards written, journal and fsyncs (the plan is made before, not timed)
      encode_batch_fast                the library's ceiling: the same files, blocks and batches, ids discarded
      2 groups at once                 the corpus planned in 2 groups, each encoded by its own process at the
                                       same time (as 2 pods would); on this machine the two share its cores
      2 groups at once, 1 thread each  the same with RAYON_NUM_THREADS=1: a core per group
    tokenizer training (train_tokenizer on sample_blocks, as the plan calls them) with the sample fixed while the
      corpus grows, and for contrast with the whole corpus as the sample

and from these figures a projection (labelled so) of the tokenization of a 100 GB corpus over 1, 2 and 4 pods of
16 CPUs. It is a measurement, not a test: it never asserts.

    .venv/bin/python bench/staging.py [--repeats 3] [--part all|s3|tokenization] [--write-results]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from machine import RESULTS, answer_child, append_section, machine_lines, memory_bytes
from tokenizers import Tokenizer

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # tests.s3_server: the test suite's S3 server, started the same way here

from common.s3 import S3Settings, S3Source  # noqa: E402
from components.stage_data.mirror import mirror  # noqa: E402
from components.stage_data.sources import select  # noqa: E402
from tests.s3_server import S3Server  # noqa: E402
from trainer.layout import TOKENIZER, DatasetPaths  # noqa: E402

log = logging.getLogger("bench-staging")

BUCKET = "bench"
SMALL_FILES, SMALL_MIN, SMALL_MAX = 2000, 1024, 16 * 1024
LARGE_FILES, LARGE_SIZE = 3, 64 * 2**20
CHUNK = 8 * 2**20
THREADS = 16
TOKENIZE_VOCAB = 8192
ENCODE_TARGET = 0.9  # encode_group's throughput over the library's encode_batch_fast
PROJECT_GB = 100  # the corpus the projection is for
SMALL_TARGET = LARGE_TARGET = 0.85

SEQUENTIAL, CEILING, STAGING, DOWNLOAD_FILE, STAGING_LARGE = (
    "sequential",
    "ceiling",
    "staging",
    "download_file",
    "staging large",
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3, help="time every variant this many times; report medians")
    p.add_argument("--write-results", action="store_true", help=f"append a dated section to {RESULTS.name}")
    p.add_argument("--part", choices=("all", "s3", "tokenization"), default="all", help="what to measure")
    p.add_argument("--encode-mb", type=int, default=100, help="the corpus encoded (MB)")
    p.add_argument(
        "--train-mb",
        default="25,50,100",
        help="corpus sizes the tokenizer is trained on (MB, each at most --encode-mb)",
    )
    p.add_argument("--sample-mb", type=int, default=16, help="the fixed tokenizer sample (MiB)")
    p.add_argument("--child", metavar="SPEC", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    try:
        args.train_mb = [int(x) for x in args.train_mb.split(",")]
    except ValueError:
        p.error(f"--train-mb {args.train_mb}: give comma-separated whole megabytes")
    if len(args.train_mb) < 2 or not all(0 < mb <= args.encode_mb for mb in args.train_mb):
        p.error(f"--train-mb {args.train_mb}: give at least 2 sizes, each between 1 and --encode-mb")
    if args.sample_mb < 1 or args.encode_mb < 1:
        p.error("--sample-mb and --encode-mb must be at least 1")
    return args


# -- the objects ------------------------------------------------------------------------------------------


def text_of(size: int, seed: int) -> bytes:
    """Text-like bytes of `size`, different for every seed."""
    line = f"object {seed} holds a line of the corpus for the staging benchmark.\n".encode()
    return (line * (size // len(line) + 1))[:size]


def upload(client, n_small: int) -> tuple[int, int]:
    sizes = [SMALL_MIN + (i * 7919) % (SMALL_MAX - SMALL_MIN) for i in range(n_small)]
    with ThreadPoolExecutor(THREADS) as pool:
        list(
            pool.map(
                lambda i: client.put_object(Bucket=BUCKET, Key=f"small/{i:05d}.txt", Body=text_of(sizes[i], i)),
                range(n_small),
            )
        )
    config = TransferConfig(multipart_threshold=CHUNK, multipart_chunksize=CHUNK, max_concurrency=THREADS)
    for i in range(LARGE_FILES):
        with tempfile.NamedTemporaryFile() as f:
            f.write(text_of(LARGE_SIZE, 10_000 + i))
            f.flush()
            client.upload_file(f.name, BUCKET, f"large/{i}.txt", Config=config)
    return sum(sizes), LARGE_FILES * LARGE_SIZE


# -- the variants -----------------------------------------------------------------------------------------


def keys(client, prefix: str) -> list[str]:
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
    return [o["Key"] for page in pages for o in page.get("Contents", [])]


def sequential(client, prefix: str, out: Path) -> None:
    for key in keys(client, prefix):
        client.download_file(BUCKET, key, str(out / key.replace("/", "_")))


def ceiling(client, prefix: str, out: Path) -> None:
    def read(key: str) -> int:
        return len(client.get_object(Bucket=BUCKET, Key=key)["Body"].read())

    with ThreadPoolExecutor(THREADS) as pool:
        list(pool.map(read, keys(client, prefix)))


def download_file(client, prefix: str, out: Path) -> None:
    config = TransferConfig(multipart_threshold=CHUNK, multipart_chunksize=CHUNK, max_concurrency=THREADS)
    for key in keys(client, prefix):
        client.download_file(BUCKET, key, str(out / key.replace("/", "_")), Config=config)


def staging(endpoint: str, prefix: str, out: Path) -> None:
    uri = f"s3://{BUCKET}/{prefix}"
    source = S3Source(uri, S3Settings(endpoint_url=endpoint, workers=THREADS, chunk_size=CHUNK))
    try:
        objects = select(source.list(), uri, ("*",), ())
        mirror(source, objects, DatasetPaths(out / "dataset"), THREADS, keep_deleted=False, listed=objects)
    finally:
        source.close()


def timed(call: Callable[[], None]) -> float:
    started = time.perf_counter()
    call()
    return time.perf_counter() - started


def measure(endpoint: str, client, work: Path, repeats: int) -> list[dict[str, float]]:
    variants: dict[str, Callable[[Path], None]] = {
        SEQUENTIAL: lambda out: sequential(client, "small/", out),
        CEILING: lambda out: ceiling(client, "small/", out),
        STAGING: lambda out: staging(endpoint, "small", out),
        DOWNLOAD_FILE: lambda out: download_file(client, "large/", out),
        STAGING_LARGE: lambda out: staging(endpoint, "large", out),
    }
    results = []
    for n in range(repeats):
        order = list(variants) if n % 2 == 0 else list(reversed(variants))
        seconds = {}
        for name in order:
            out = work / name.replace(" ", "-")
            out.mkdir()
            os.sync()
            seconds[name] = timed(lambda: variants[name](out))  # noqa: B023 - called right here
            shutil.rmtree(out)
            log.info("repeat %d: %s %.2fs", n + 1, name, seconds[name])
        results.append(seconds)
    return results


# -- tokenization -----------------------------------------------------------------------------------------


def write_text_corpus(directory: Path, megabytes: int) -> list[tuple[str, int]]:
    """The standard library's .py files, copied round after round until `megabytes` of text; returns each file's
    key and size, in the order written (a corpus of fewer megabytes is a prefix of it)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    sources = sorted(p for p in stdlib.rglob("*.py") if "site-packages" not in p.parts and p.is_file())
    target, written, round_, files = megabytes * 10**6, 0, 0, []
    while written < target:
        for path in sources:
            data = path.read_bytes()[: target - written]
            key = f"round{round_}/{path.relative_to(stdlib).as_posix()}"
            (directory / key).parent.mkdir(parents=True, exist_ok=True)
            (directory / key).write_bytes(data)
            files.append((key, len(data)))
            written += len(data)
            if written >= target:
                break
        round_ += 1
    return files


def prefix(files: list[tuple[str, int]], megabytes: float) -> list[str]:
    """The first files of the corpus, up to `megabytes`."""
    keys, size = [], 0
    for key, length in files:
        if size >= megabytes * 10**6:
            break
        keys.append(key)
        size += length
    return keys


def child_result(started_wall: float, seconds: float, **fields: Any) -> dict[str, Any]:
    """The child's timings, and its peak memory (VmHWM)."""
    peak = memory_bytes("VmHWM")
    return {
        "start": started_wall,
        "end": started_wall + seconds,
        "seconds": seconds,
        "peak_mb": peak / 2**20 if peak >= 0 else float("nan"),
        **fields,
    }


def train_child(spec: dict[str, Any]) -> dict[str, Any]:
    """Train the BPE vocabulary on the sample staging takes of these files (sample_texts, train_tokenizer)."""
    from components.stage_data.formats import FileFormat
    from components.stage_data.settings import StageSettings
    from components.stage_data.tokenization.plan import sample_texts
    from components.stage_data.tokenization.snapshot import Entry
    from components.stage_data.tokenizer import train_tokenizer

    corpus = Path(spec["corpus"])
    entries = [Entry(key, FileFormat("text"), "train") for key in spec["keys"]]
    taken = 0

    def counted() -> Iterator[str]:
        nonlocal taken
        for block in sample_texts(corpus, entries, StageSettings("-", "-", "-"), spec["sample_bytes"]):
            taken += len(block.encode())
            yield block

    wall, started = time.time(), time.perf_counter()
    train_tokenizer(counted(), spec["vocab"])
    return child_result(wall, time.perf_counter() - started, sample_bytes=taken)


def encode_child(spec: dict[str, Any]) -> dict[str, Any]:
    """The project's encode of one planned group: shards written, journal and fsyncs included."""
    from components.stage_data.tokenization.encode import encode_group

    paths = DatasetPaths.of(spec["storage"], spec["dataset"])
    wall, started = time.time(), time.perf_counter()
    result = encode_group(paths, spec["snapshot"], spec["group"])
    return child_result(
        wall, time.perf_counter() - started, text_bytes=result.text_bytes, tokens=sum(result.tokens.values())
    )


def baseline_child(spec: dict[str, Any]) -> dict[str, Any]:
    """The library's ceiling on the same group: the same files cut into the same blocks (the plain-text reader), the
    same batches of BATCH_BYTES, `encode_batch_fast`; the ids are only counted (len), never copied out or written."""
    from components.stage_data.formats.plain_text import PlainTextReader
    from components.stage_data.tokenization.encode import BATCH_BYTES
    from components.stage_data.tokenization.plan import BLOCK_BYTES
    from components.stage_data.tokenization.snapshot import Plan, building_dir

    paths = DatasetPaths.of(spec["storage"], spec["dataset"])
    building = building_dir(paths, spec["snapshot"])
    files = [paths.raw / key for key, _, _ in Plan.read(building).groups[spec["group"]]]
    wall, started = time.time(), time.perf_counter()
    tokenizer = Tokenizer.from_file(str(building / TOKENIZER))
    tokens, batch, size, text_bytes = len(files), [], 0, 0  # one EOS per file, as staging appends
    for path in files:
        for block in (piece.text for piece in PlainTextReader(path, path.name, "", BLOCK_BYTES).read()):
            batch.append(block)
            size += len(block)
            if size >= BATCH_BYTES:
                tokens += sum(map(len, tokenizer.encode_batch_fast(batch, add_special_tokens=False)))
                batch, size = [], 0
        text_bytes += path.stat().st_size
    if batch:
        tokens += sum(map(len, tokenizer.encode_batch_fast(batch, add_special_tokens=False)))
    return child_result(wall, time.perf_counter() - started, text_bytes=text_bytes, tokens=tokens)


CHILDREN: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "train": train_child,
    "encode": encode_child,
    "baseline": baseline_child,
}


def start_child(work: Path, name: str, spec: dict[str, Any], threads: int) -> tuple[subprocess.Popen, Path]:
    """A fresh process running CHILDREN[spec['kind']] with `threads` rayon threads; it writes its result JSON."""
    spec_path, out = work / f"{name}.spec.json", work / f"{name}.out.json"
    spec_path.write_text(json.dumps({**spec, "out": str(out)}))
    out.unlink(missing_ok=True)
    env = {**os.environ, "RAYON_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "true"}
    return subprocess.Popen([sys.executable, __file__, "--child", str(spec_path)], env=env), out


def run_children(work: Path, specs: dict[str, dict[str, Any]], threads: int) -> dict[str, dict[str, Any]]:
    """Run these children at the same time (as parallel pods would) and gather their results."""
    os.sync()  # the previous variant's shards on disk, not in this one's time
    started = {name: start_child(work, name, spec, threads) for name, spec in specs.items()}
    for name, (process, _) in started.items():
        if process.wait() != 0:
            raise SystemExit(f"bench child {name} failed with exit status {process.returncode}")
    return {name: json.loads(out.read_text()) for name, (_, out) in started.items()}


@dataclass
class Planned:
    storage: str
    dataset: str
    snapshot: str
    building: Path
    pristine: Path  # the building directory as planned: restored before every encode

    def spec(self, kind: str, group: int) -> dict[str, Any]:
        return {
            "kind": kind,
            "storage": self.storage,
            "dataset": self.dataset,
            "snapshot": self.snapshot,
            "group": group,
        }

    def reset(self) -> None:
        """Back to planned and not encoded: encode_group does the whole work again."""
        shutil.rmtree(self.building)
        shutil.copytree(self.pristine, self.building)


def plan(work: Path, corpus: Path, dataset: str, groups: int, sample_mb: int, tokenizer: str = "") -> Planned:
    """Mirror the local corpus and plan its snapshot in `groups` groups, as the staging step does."""
    from components.stage_data.core import mirror_and_plan
    from components.stage_data.settings import StageSettings
    from components.stage_data.tokenization.snapshot import building_dir

    storage = work / "storage"
    planned = mirror_and_plan(
        StageSettings(
            str(corpus),
            str(storage),
            dataset,
            vocab_size=TOKENIZE_VOCAB,
            tokenizer_path=tokenizer,
            tokenize_groups=groups,
            tokenizer_sample_mb=sample_mb,
        )
    )
    building = building_dir(DatasetPaths.of(storage, dataset), planned.snapshot)
    pristine = work / f"planned-{dataset}"
    shutil.copytree(building, pristine)
    return Planned(str(storage), dataset, planned.snapshot, building, pristine)


ONE_GROUP, BASELINE, TWO_GROUPS, TWO_GROUPS_1T = (
    "encode_group, 1 group",
    "encode_batch_fast",
    "2 groups at once",
    "2 groups at once, 1 thread each",
)


def measure_encoding(work: Path, corpus: Path, sample_mb: int, repeats: int) -> tuple[list[dict[str, Any]], int]:
    """The encode variants, interleaved (order reversed every other repeat); each child a fresh process."""
    cores = len(os.sched_getaffinity(0))
    one = plan(work, corpus, "one", 1, sample_mb)
    tokenizer = work / "tokenizer.json"
    shutil.copy(one.building / TOKENIZER, tokenizer)
    two = plan(work, corpus, "two", 2, sample_mb, str(tokenizer))  # the same tokenizer, the files in 2 groups

    def fan_out(threads: int) -> dict[str, dict[str, Any]]:
        two.reset()
        return run_children(work, {f"g{g}": two.spec("encode", g) for g in range(2)}, threads)

    def one_group() -> dict[str, dict[str, Any]]:
        one.reset()
        return run_children(work, {"g0": one.spec("encode", 0)}, cores)

    variants: dict[str, Callable[[], dict[str, dict[str, Any]]]] = {
        ONE_GROUP: one_group,
        BASELINE: lambda: run_children(work, {"g0": one.spec("baseline", 0)}, cores),
        TWO_GROUPS: lambda: fan_out(cores),
        TWO_GROUPS_1T: lambda: fan_out(1),
    }
    results = []
    for n in range(repeats):
        order = list(variants) if n % 2 == 0 else list(reversed(variants))
        repeat = {}
        for name in order:
            repeat[name] = variants[name]()
            wall = wall_seconds(repeat[name])
            log.info("repeat %d: %s %.2fs (%.2f MB/s)", n + 1, name, wall, text_mb(repeat[name]) / wall)
        results.append(repeat)
    return results, cores


def wall_seconds(groups: dict[str, dict[str, Any]]) -> float:
    """From the first group's start to the last one's end: the fan-out's wall time."""
    return max(g["end"] for g in groups.values()) - min(g["start"] for g in groups.values())


def text_mb(groups: dict[str, dict[str, Any]]) -> float:
    return sum(g["text_bytes"] for g in groups.values()) / 1e6


def measure_training(
    work: Path, files: list[tuple[str, int]], corpus: Path, train_mb: list[int], sample_mb: int
) -> list[dict[str, Any]]:
    """Train on a fixed sample as the corpus grows, then on the whole corpus; each a fresh process."""
    rows = []
    for whole in (False, True):
        for megabytes in train_mb:
            keys = prefix(files, megabytes)
            sample_bytes = sum(dict(files)[k] for k in keys) if whole else sample_mb * 2**20
            spec = {
                "kind": "train",
                "corpus": str(corpus),
                "keys": keys,
                "sample_bytes": sample_bytes,
                "vocab": TOKENIZE_VOCAB,
            }
            result = run_children(work, {"train": spec}, len(os.sched_getaffinity(0)))["train"]
            row = {"corpus_mb": sum(dict(files)[k] for k in keys) / 1e6, "whole": whole, **result}
            log.info(
                "trained on %.0f MB of a %.0f MB corpus in %.1fs, peak memory %.0f MB",
                row["sample_bytes"] / 1e6,
                row["corpus_mb"],
                row["seconds"],
                row["peak_mb"],
            )
            rows.append(row)
    return rows


# -- summary ----------------------------------------------------------------------------------------------


def table(results: list[dict[str, float]], small_bytes: int, large_bytes: int) -> tuple[list[str], dict[str, float]]:
    def med(key: str) -> float:
        return statistics.median(r[key] for r in results)

    def ratio(a: str, b: str) -> float:  # throughput of a over b = time of b over time of a, per repeat
        return statistics.median(r[b] / r[a] for r in results)

    ratios = {
        "small vs ceiling": ratio(STAGING, CEILING),
        "small vs sequential": ratio(STAGING, SEQUENTIAL),
        "ceiling vs sequential": ratio(CEILING, SEQUENTIAL),
        "large vs download_file": ratio(STAGING_LARGE, DOWNLOAD_FILE),
    }
    rows = [
        "| variant | files | median (s) | MB/s | files/s |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, files, size in (
        (SEQUENTIAL, SMALL_FILES, small_bytes),
        (CEILING, SMALL_FILES, small_bytes),
        (STAGING, SMALL_FILES, small_bytes),
        (DOWNLOAD_FILE, LARGE_FILES, large_bytes),
        (STAGING_LARGE, LARGE_FILES, large_bytes),
    ):
        rows.append(f"| {name} | {files} | {med(name):.2f} | {size / 1e6 / med(name):.1f} | {files / med(name):.0f} |")
    rows += [
        "",
        "| ratio (throughput, median of per-repeat ratios) | value | target | met |",
        "|---|---:|---:|:---:|",
        f"| staging / ceiling, small files | {ratios['small vs ceiling']:.2f} | ≥ {SMALL_TARGET} | "
        f"{'yes' if ratios['small vs ceiling'] >= SMALL_TARGET else 'no'} |",
        f"| staging / download_file, large files | {ratios['large vs download_file']:.2f} | ≥ {LARGE_TARGET} | "
        f"{'yes' if ratios['large vs download_file'] >= LARGE_TARGET else 'no'} |",
        f"| staging / sequential loop, small files | {ratios['small vs sequential']:.2f} | | |",
        f"| ceiling / sequential loop, small files | {ratios['ceiling vs sequential']:.2f} | | |",
    ]
    return rows, ratios


def encode_table(results: list[dict[str, Any]], cores: int) -> tuple[list[str], dict[str, float]]:
    def med(name: str, value: Callable[[dict[str, dict[str, Any]]], float]) -> float:
        return statistics.median(value(r[name]) for r in results)

    def rate(groups: dict[str, dict[str, Any]]) -> float:
        return text_mb(groups) / wall_seconds(groups)

    def group_rate(groups: dict[str, dict[str, Any]]) -> float:  # the slower group's own MB/s
        return min(g["text_bytes"] / 1e6 / g["seconds"] for g in groups.values())

    def peak(groups: dict[str, dict[str, Any]]) -> float:
        return max(g["peak_mb"] for g in groups.values())

    layout = {ONE_GROUP: (1, cores), BASELINE: (1, cores), TWO_GROUPS: (2, cores), TWO_GROUPS_1T: (2, 1)}
    lines = [
        "| variant | processes x threads | text (MB) | tokens | median wall (s) | MB/s | MB/s per core | "
        "MB/s of each group (slower) | peak memory of a process (MB) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    figures: dict[str, float] = {}
    for name, (processes, threads) in layout.items():
        mb_s = med(name, rate)
        figures[name] = mb_s
        tokens = int(med(name, lambda g: sum(x["tokens"] for x in g.values())))
        lines.append(
            f"| {name} | {processes} x {threads} | {med(name, text_mb):.1f} | {tokens:,} | "
            f"{med(name, wall_seconds):.2f} | {mb_s:.2f} | {mb_s / cores:.2f} | "
            f"{med(name, group_rate):.2f} | {med(name, peak):.0f} |"
        )
    ratios = {
        "encode_group / encode_batch_fast": statistics.median(
            wall_seconds(r[BASELINE]) / wall_seconds(r[ONE_GROUP]) for r in results
        ),
        "2 groups / 1 group": statistics.median(rate(r[TWO_GROUPS]) / rate(r[ONE_GROUP]) for r in results),
        "2 groups of 1 thread / 1 group": statistics.median(
            rate(r[TWO_GROUPS_1T]) / rate(r[ONE_GROUP]) for r in results
        ),
    }
    met = "met" if ratios["encode_group / encode_batch_fast"] >= ENCODE_TARGET else "NOT met"
    lines += [
        "",
        f"encode_group / encode_batch_fast throughput (median of per-repeat ratios): "
        f"{ratios['encode_group / encode_batch_fast']:.3f} (target >= {ENCODE_TARGET}: {met}). "
        f"2 groups at once / 1 group: {ratios['2 groups / 1 group']:.2f} (2 threads each), "
        f"{ratios['2 groups of 1 thread / 1 group']:.2f} (1 thread each).",
    ]
    figures.update(ratios)
    figures["tokens_per_byte"] = med(ONE_GROUP, lambda g: g["g0"]["tokens"] / g["g0"]["text_bytes"])
    return lines, figures


def training_table(rows: list[dict[str, Any]], sample_mb: int) -> tuple[list[str], float]:
    lines = ["| corpus (MB) | sample | sample read (MB) | seconds | peak memory (MB) |", "|---:|---|---:|---:|---:|"]
    for r in rows:
        sample = "whole corpus" if r["whole"] else f"fixed, {sample_mb} MiB"
        lines.append(
            f"| {r['corpus_mb']:.0f} | {sample} | {r['sample_bytes'] / 1e6:.1f} | {r['seconds']:.1f} | "
            f"{r['peak_mb']:.0f} |"
        )
    fixed = [r["seconds"] for r in rows if not r["whole"]]
    whole = [r for r in rows if r["whole"]]
    fit = statistics.linear_regression([r["sample_bytes"] / 1e6 for r in whole], [r["seconds"] for r in whole])
    seconds_1gb = fit.slope * 2**30 / 1e6 + fit.intercept
    lines += [
        "",
        f"Fixed sample: {min(fixed):.1f}-{max(fixed):.1f} s as the corpus grows "
        f"{rows[0]['corpus_mb']:.0f} -> {rows[len(fixed) - 1]['corpus_mb']:.0f} MB "
        f"(max/min {max(fixed) / min(fixed):.2f}). "
        f"Whole corpus as the sample: {whole[0]['seconds']:.1f} -> {whole[-1]['seconds']:.1f} s; least squares "
        f"{fit.slope:.3f} s/MB + {fit.intercept:.1f} s, so {seconds_1gb:.0f} s for a 1 GiB sample.",
    ]
    return lines, seconds_1gb


def projection(figures: dict[str, float], cores: int, train_1gb_s: float) -> list[str]:
    """The wall time of staging's tokenization of PROJECT_GB, from the measured per-core rate (labelled so)."""
    per_core = figures[ONE_GROUP] / cores
    shard_bytes = figures["tokens_per_byte"] * 2  # uint16 ids: any vocabulary up to 65,536
    corpus_mb = PROJECT_GB * 1000
    lines = [
        "| pods x CPUs | encode (min) | tokenizer, 1 GiB sample (min) | tokenization wall (min) | "
        "FSx read needed (MB/s) | FSx write (MB/s) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for pods in (1, 2, 4):
        encode_s = corpus_mb / (per_core * 16 * pods)
        lines.append(
            f"| {pods} x 16 | {encode_s / 60:.0f} | {train_1gb_s / 60:.1f} | "
            f"{(encode_s + train_1gb_s) / 60:.0f} | {corpus_mb / encode_s:.0f} | "
            f"{corpus_mb * shard_bytes / encode_s:.0f} |"
        )
    four = corpus_mb / (per_core * 64) + train_1gb_s
    old_pod = corpus_mb / (per_core * 4) + train_1gb_s
    return [
        f"**Projection** (not a measurement) of staging's tokenization of a {PROJECT_GB} GB corpus (plan's tokenizer "
        f"training, then the groups encoded in parallel pods; the mirror from S3 and pod start-up not included), "
        f"from this run's figures: encode_group's {per_core:.2f} MB/s per core (1 group on {cores} cores) and the "
        f"training time fitted above for a 1 GiB sample (the default tokenizer_sample_mb).",
        "",
        *lines,
        "",
        f"Assumptions: (1) encoding scales per core within a 16-CPU pod as the tokenizers library's batch encode "
        f"spreads a batch over its threads (measured here on {cores} cores only: 2 groups of 1 thread against 1 group "
        f"of {cores} threads, {figures['2 groups of 1 thread / 1 group']:.2f}x); (2) groups are byte-balanced, so the "
        f"pods finish together; (3) FSx for Lustre is not the bottleneck: it must serve the read rate above and "
        f"take {shard_bytes:.2f} bytes of shards per byte of text; (4) the tokenizer trains on the fixed 1 GiB sample "
        f"in the time fitted on {cores} cores, taken as is on the stage-data pod's 4 CPUs (its merge phase is "
        f"serial), and the text is Python source repeated (a real 1 GiB sample has more distinct words, so more "
        f"merge work); (5) the text tokenizes like Python source ({figures['tokens_per_byte']:.3f} tokens per byte "
        f"with this vocabulary of {TOKENIZE_VOCAB}).",
        "",
        f"So 4 pods x 16 CPUs: about {four / 60:.0f} minutes ({'under' if four < 3600 else 'OVER'} the 1 hour goal). "
        f"The issue's earlier projection was about 6 hours, with training and encoding in the staging step's one "
        f"4-CPU pod (2.37 MB/s on 2 cores in the 2026-11-30 10:30 run: 100,000 MB / 4.7 MB/s); at this run's rate "
        f"that pod alone would take about {old_pod / 3600:.1f} hours.",
    ]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.child:
        return answer_child(args.child, CHILDREN)
    for name, value in (
        ("AWS_ACCESS_KEY_ID", "bench"),
        ("AWS_SECRET_ACCESS_KEY", "bench"),
        ("AWS_DEFAULT_REGION", "us-east-1"),
    ):
        os.environ.setdefault(name, value)
    for quiet in ("components.stage_data.mirror", "components.stage_data.tokenization", "components.stage_data.core"):
        logging.getLogger(quiet).setLevel(logging.WARNING)
    load_before = os.getloadavg()
    (REPO / "local-runs").mkdir(exist_ok=True)  # gitignored, on the repository's disk
    work = Path(tempfile.mkdtemp(prefix="bench-staging-", dir=REPO / "local-runs"))
    text: list[str] = []
    try:
        if args.part in ("all", "s3"):
            text += s3_part(work, args.repeats)
        if args.part in ("all", "tokenization"):
            text += [""] * bool(text) + tokenization_part(work, args)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    load_after = os.getloadavg()
    text += [
        "",
        f"Load average (1, 5, 15 min) at the start: {', '.join(f'{x:.2f}' for x in load_before)}; at the "
        f"end: {', '.join(f'{x:.2f}' for x in load_after)}.",
    ]
    print("\n".join(text))
    if args.write_results:
        title = {
            "all": "S3 staging and tokenization at scale",
            "s3": "S3 staging",
            "tokenization": "tokenization at scale",
        }[args.part]
        append_section(title, text, machine_lines("boto3", "s3transfer", "moto", "tokenizers"))
        log.info("appended results to %s", RESULTS)
    return 0


def s3_part(work: Path, repeats: int) -> list[str]:
    with S3Server(work / "server.log") as server:
        # The baselines' client gets a connection per thread, as the staging client does.
        config = Config(max_pool_connections=2 * THREADS)
        client = boto3.client("s3", endpoint_url=server.endpoint, config=config)
        client.create_bucket(Bucket=BUCKET)
        log.info("uploading %d small and %d large objects", SMALL_FILES, LARGE_FILES)
        small_bytes, large_bytes = upload(client, SMALL_FILES)
        results = measure(server.endpoint, client, work, repeats)
    rows, _ = table(results, small_bytes, large_bytes)
    return [
        f"S3 staging (`bench/staging.py`) against moto's standalone S3 server on loopback (its own process, on the "
        f"same {os.cpu_count()} cores): {SMALL_FILES} small objects ({small_bytes / 1e6:.1f} MB, 1-16 KB each) "
        f"and {LARGE_FILES} large ones of {LARGE_SIZE // 2**20} MB. Small files: a sequential boto3 `download_file` "
        f"loop; the server's ceiling ({THREADS} threads of `get_object` reading bodies into memory, writing "
        f"nothing); the staging mirror ({THREADS} workers; temp file, MD5 against the ETag, rename, journal, "
        f"syncfs and manifest included). Large files: s3transfer's `download_file` per object and the staging "
        f"mirror, both with {CHUNK // 2**20} MB parts and {THREADS} concurrent requests. Side by side in one run, "
        f"order reversed on every other repeat; medians of {repeats} repeats. Rerun with "
        f"`.venv/bin/python bench/staging.py --write-results`.",
        "",
        *rows,
    ]


def tokenization_part(work: Path, args: argparse.Namespace) -> list[str]:
    corpus = work / "corpus"
    log.info("writing a %d MB text corpus", args.encode_mb)
    files = write_text_corpus(corpus, args.encode_mb)
    distinct = sum(n for key, n in files if key.startswith("round0/"))
    training = measure_training(work, files, corpus, args.train_mb, args.sample_mb)
    encoding, cores = measure_encoding(work, corpus, args.sample_mb, args.repeats)
    encode_lines, figures = encode_table(encoding, cores)
    train_lines, train_1gb_s = training_table(training, args.sample_mb)
    return [
        f"Tokenization at scale (`bench/staging.py --part tokenization`): the Python standard library's source "
        f"({len(files):,} files, {sum(n for _, n in files) / 1e6:.0f} MB; {distinct / 1e6:.1f} MB distinct, repeated "
        f"beyond that), a byte-level BPE "
        f"vocabulary of {TOKENIZE_VOCAB}. Every timed part runs in a fresh process; rayon threads are set with "
        f"RAYON_NUM_THREADS ({cores} = the cores available, or 1 where stated). Every encode variant gives the same "
        f"token count (the same files and tokenizer): the same work.",
        "",
        f"Encoding: staging's plan (`mirror_and_plan` of the local corpus, tokenizer trained on a {args.sample_mb} MiB "
        f"sample; not timed), then `encode_group` timed alone against the tokenizers library's `encode_batch_fast` "
        f"on the same files, blocks and batches with the ids discarded (its ceiling); and the corpus planned as 2 "
        f"groups (same tokenizer) encoded by 2 processes at once, as 2 pods would. On this {cores}-core machine the "
        f"two groups contend for the same cores, so their per-core figures, not their per-group ones, are the "
        f"comparable rate. Wall time of a fan-out: first group's start to last group's end. Variants interleaved, "
        f"order reversed every other repeat; medians of {args.repeats} repeats.",
        "",
        *encode_lines,
        "",
        "Tokenizer training (`train_tokenizer(sample_blocks(files, sample))` called directly, as the plan calls it, "
        "on the first files of the corpus; one run each; peak memory is the process's VmHWM):",
        "",
        *train_lines,
        "",
        *projection(figures, cores, train_1gb_s),
    ]


if __name__ == "__main__":
    sys.exit(main())
