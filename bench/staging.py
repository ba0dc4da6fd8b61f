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

Then tokenization, each in a fresh process: the staging tokenizer (train a BPE vocabulary of 8192 and
encode into shards) on the first 25 MB and on 100 MB of a text corpus, with peak memory (ru_maxrss):
streaming means it stays flat as the corpus grows. The corpus is the Python standard library's own
source, repeated as needed (nothing is downloaded). It is a measurement, not a test: it never asserts.

    .venv/bin/python bench/staging.py [--repeats 3] [--write-results]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import boto3
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from machine import RESULTS, append_section, machine_lines

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # tests.s3_server: the test suite's S3 server, started the same way here

from components.stage_data.mirror import mirror  # noqa: E402
from components.stage_data.s3 import S3Settings, S3Source  # noqa: E402
from components.stage_data.sources import select  # noqa: E402
from tests.s3_server import S3Server  # noqa: E402
from trainer.layout import DatasetPaths  # noqa: E402

log = logging.getLogger("bench-staging")

BUCKET = "bench"
SMALL_FILES, SMALL_MIN, SMALL_MAX = 2000, 1024, 16 * 1024
LARGE_FILES, LARGE_SIZE = 3, 64 * 2**20
CHUNK = 8 * 2**20
THREADS = 16
TOKENIZE_MB = (25, 100)
TOKENIZE_VOCAB = 8192
SMALL_TARGET = LARGE_TARGET = 0.85

SEQUENTIAL, CEILING, STAGING, DOWNLOAD_FILE, STAGING_LARGE = (
    "sequential", "ceiling", "staging", "download_file", "staging large"
)  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3, help="time every variant this many times; report medians")
    p.add_argument("--write-results", action="store_true", help=f"append a dated section to {RESULTS.name}")
    p.add_argument("--tokenize-child", nargs=2, metavar=("CORPUS", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    return args


# -- the objects ------------------------------------------------------------------------------------------


def text_of(size: int, seed: int) -> bytes:
    """Text-like bytes of `size`, different for every seed."""
    line = f"object {seed} holds a line of the corpus for the staging benchmark.\n".encode()
    return (line * (size // len(line) + 1))[:size]


def upload(client, n_small: int) -> tuple[int, int]:
    sizes = [SMALL_MIN + (i * 7919) % (SMALL_MAX - SMALL_MIN) for i in range(n_small)]
    with ThreadPoolExecutor(THREADS) as pool:
        list(pool.map(lambda i: client.put_object(Bucket=BUCKET, Key=f"small/{i:05d}.txt", Body=text_of(sizes[i], i)),
                      range(n_small)))  # fmt: skip
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


def write_text_corpus(directory: Path, megabytes: int) -> int:
    """The standard library's .py files, copied round after round until `megabytes` of text; returns bytes."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    sources = sorted(p for p in stdlib.rglob("*.py") if "site-packages" not in p.parts and p.is_file())
    target, written, round_ = megabytes * 10**6, 0, 0
    while written < target:
        for path in sources:
            data = path.read_bytes()[: target - written]
            out = directory / f"round{round_}" / path.relative_to(stdlib)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(data)
            written += len(data)
            if written >= target:
                break
        round_ += 1
    return written


def tokenize_child(corpus: Path, out: Path) -> None:
    """In a fresh process: tokenize `corpus` (a mirror under raw/) and print seconds and peak memory as JSON."""
    from components.stage_data.tokenization import tokenize

    paths = DatasetPaths(corpus)
    keys_ = sorted(p.relative_to(paths.raw).as_posix() for p in paths.raw.rglob("*") if p.is_file())
    started = time.perf_counter()
    result = tokenize(paths, keys_, content_sha256=str(time.time()), vocab_size=TOKENIZE_VOCAB, val_fraction=0.01)
    seconds = time.perf_counter() - started
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    out.write_text(json.dumps({"seconds": seconds, "peak_mb": peak_mb, "tokens": result.train_tokens}))


def measure_tokenization(work: Path) -> list[dict[str, float]]:
    rows = []
    for megabytes in TOKENIZE_MB:
        dataset = work / f"tok{megabytes}"
        size = write_text_corpus(dataset / "raw", megabytes)
        out = work / f"tok{megabytes}.json"
        subprocess.run([sys.executable, __file__, "--tokenize-child", str(dataset), str(out)], check=True)
        row = {"mb": size / 1e6, **json.loads(out.read_text())}
        log.info("tokenized %.0f MB in %.1fs (%.2f MB/s), peak memory %.0f MB", row["mb"], row["seconds"],
                 row["mb"] / row["seconds"], row["peak_mb"])  # fmt: skip
        rows.append(row)
        shutil.rmtree(dataset)
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
        (SEQUENTIAL, SMALL_FILES, small_bytes), (CEILING, SMALL_FILES, small_bytes),
        (STAGING, SMALL_FILES, small_bytes), (DOWNLOAD_FILE, LARGE_FILES, large_bytes),
        (STAGING_LARGE, LARGE_FILES, large_bytes),
    ):  # fmt: skip
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


def tokenize_table(rows: list[dict[str, float]]) -> list[str]:
    lines = ["| corpus | seconds | MB/s | train tokens | peak memory (MB) |", "|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['mb']:.0f} MB | {r['seconds']:.1f} | {r['mb'] / r['seconds']:.2f} | {r['tokens']:,} | "
                     f"{r['peak_mb']:.0f} |")  # fmt: skip
    return lines


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.tokenize_child:
        logging.getLogger().setLevel(logging.WARNING)
        tokenize_child(Path(args.tokenize_child[0]), Path(args.tokenize_child[1]))
        return 0
    for name, value in (("AWS_ACCESS_KEY_ID", "bench"), ("AWS_SECRET_ACCESS_KEY", "bench"),
                        ("AWS_DEFAULT_REGION", "us-east-1")):  # fmt: skip
        os.environ.setdefault(name, value)
    logging.getLogger("components.stage_data.mirror").setLevel(logging.WARNING)
    (REPO / "local-runs").mkdir(exist_ok=True)  # gitignored, on the repository's disk
    work = Path(tempfile.mkdtemp(prefix="bench-staging-", dir=REPO / "local-runs"))
    try:
        with S3Server(work / "server.log") as server:
            # The baselines' client gets a connection per thread, as the staging client does.
            config = Config(max_pool_connections=2 * THREADS)
            client = boto3.client("s3", endpoint_url=server.endpoint, config=config)
            client.create_bucket(Bucket=BUCKET)
            log.info("uploading %d small and %d large objects", SMALL_FILES, LARGE_FILES)
            small_bytes, large_bytes = upload(client, SMALL_FILES)
            results = measure(server.endpoint, client, work, args.repeats)
        tokenized = measure_tokenization(work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows, _ = table(results, small_bytes, large_bytes)
    text = [
        f"S3 staging (`bench/staging.py`) against moto's standalone S3 server on loopback (its own process, on the "
        f"same {os.cpu_count()} cores): {SMALL_FILES} small objects ({small_bytes / 1e6:.1f} MB, 1-16 KB each) "
        f"and {LARGE_FILES} large ones of {LARGE_SIZE // 2**20} MB. Small files: a sequential boto3 `download_file` "
        f"loop; the server's ceiling ({THREADS} threads of `get_object` reading bodies into memory, writing "
        f"nothing); the staging mirror ({THREADS} workers; temp file, MD5 against the ETag, rename, journal, "
        f"syncfs and manifest included). Large files: s3transfer's `download_file` per object and the staging "
        f"mirror, both with {CHUNK // 2**20} MB parts and {THREADS} concurrent requests. Side by side in one run, "
        f"order reversed on every other repeat; medians of {args.repeats} repeats. Rerun with "
        f"`.venv/bin/python bench/staging.py --write-results`.",
        "",
        *rows,
        "",
        f"Tokenization (train a byte-level BPE vocabulary of {TOKENIZE_VOCAB}, encode into shards; each in a fresh "
        f"process) of the standard library's Python source, repeated to size; peak memory is the process's "
        f"ru_maxrss:",
        "",
        *tokenize_table(tokenized),
    ]
    print("\n".join(text))
    if args.write_results:
        append_section("S3 staging and tokenization", text, machine_lines("boto3", "s3transfer", "moto", "tokenizers"))
        log.info("appended results to %s", RESULTS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
