"""Parse NCCL logs of 1,024 ranks against `grep -c "NCCL INFO"` on the same files, in one run.

It writes generated NCCL_DEBUG_FILE output (tests/nccl_logs.py: 128 nodes x 8 GPUs, start-up lines plus
channel and tuning chatter, about 1 GB in all) under local-runs/, reads it once to warm the page cache,
then times, side by side: grep counting the NCCL INFO lines of every file (the ceiling: no parsing at
all), and verify_logs (every line parsed, every check computed) in a fresh process that reports its
peak memory. It does the same on the first quarter of the files, to show that time grows linearly
with the size of the logs. It is a measurement, not a test: it never asserts.

    .venv/bin/python bench/nccl_parse.py [--gb 1.0] [--write-results]
"""

from __future__ import annotations

import argparse
import json
import logging
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from machine import RESULTS, append_section, machine_lines

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # tests.nccl_logs: the tests' log generator

from tests.nccl_logs import Job, process_lines  # noqa: E402

log = logging.getLogger("bench-nccl-parse")

NODES, GPUS = 128, 8
TARGET_RATIO, TARGET_PEAK_MB = 0.10, 200


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gb", type=float, default=1.0, help="size of the generated logs")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--write-results", action="store_true", help=f"append a dated section to {RESULTS.name}")
    p.add_argument("--parse-child", nargs="+", metavar="PATH", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def generate(directory: Path, gigabytes: float) -> list[Path]:
    """One file per rank, `filler` chatter lines sized so that the whole is about `gigabytes`."""
    job = Job(nodes=NODES, gpus=GPUS, channels=16)
    base = sum(len(line) + 1 for line in process_lines(job, 9))
    per_filler = (
        sum(len(line) + 1 for line in process_lines(Job(nodes=NODES, gpus=GPUS, channels=16, filler=1), 9)) - base
    )
    job.filler = max(0, int((gigabytes * 1e9 / job.world - base) / per_filler))
    directory.mkdir(parents=True)
    paths = []
    for rank in range(job.world):
        path = directory / f"{job.host(rank)}.{job.pid(rank)}.log"
        path.write_text("\n".join(process_lines(job, rank)) + "\n")
        paths.append(path)
    return paths


def parse_child(paths: list[str]) -> None:
    from components.verify_nccl.core import Expectations, verify_logs

    logging.getLogger("components").setLevel(logging.WARNING)
    started = time.perf_counter()
    result = verify_logs(paths, Expectations(instance_type="p5.48xlarge"))
    seconds = time.perf_counter() - started
    # The reader's worker processes count too: the larger of this process's peak and any child's.
    peak_mb = max(resource.getrusage(who).ru_maxrss for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)) / 1024
    print(
        json.dumps(
            {
                "seconds": seconds,
                "peak_mb": peak_mb,
                "passed": result.passed,
                "lines": result.nccl.lines,
                "ranks": result.ranks_initialized(),
            }
        )
    )


def grep_seconds(paths: list[Path]) -> float:
    started = time.perf_counter()
    # Not to /dev/null: GNU grep notices and stops at the first match.
    subprocess.run(["grep", "-c", "NCCL INFO", *map(str, paths)], check=True, capture_output=True)
    return time.perf_counter() - started


def parse_run(paths: list[Path]) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--parse-child", *map(str, paths)], check=True, capture_output=True, text=True
    ).stdout
    return json.loads(out)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.parse_child:
        parse_child(args.parse_child)
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    (REPO / "local-runs").mkdir(exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench-nccl-", dir=REPO / "local-runs"))
    try:
        started = time.perf_counter()
        paths = generate(work / "logs", args.gb)
        size = sum(p.stat().st_size for p in paths)
        log.info("generated %d files, %.2f GB, in %.0fs", len(paths), size / 1e9, time.perf_counter() - started)
        quarter = paths[: len(paths) // 4]
        quarter_size = sum(p.stat().st_size for p in quarter)
        grep_seconds(paths)  # warm the page cache
        rows = {"all": [], "quarter": []}
        for n in range(args.repeats):
            for name, subset in (("all", paths), ("quarter", quarter)):
                grep_s = grep_seconds(subset)
                parsed = parse_run(subset)
                rows[name].append({"grep": grep_s, **parsed})
                log.info(
                    "repeat %d, %s: grep %.2fs, parse %.2fs (peak %.0f MB, %d lines, passed %s)",
                    n + 1,
                    name,
                    grep_s,
                    parsed["seconds"],
                    parsed["peak_mb"],
                    parsed["lines"],
                    parsed["passed"],
                )
    finally:
        shutil.rmtree(work, ignore_errors=True)

    def med(name: str, key: str) -> float:
        return statistics.median(r[key] for r in rows[name])

    ratio = statistics.median(r["grep"] / r["seconds"] for r in rows["all"])
    peak = max(r["peak_mb"] for r in rows["all"])
    per_gb = {name: med(name, "seconds") / (s / 1e9) for name, s in (("all", size), ("quarter", quarter_size))}
    text = [
        f"NCCL log parsing (`bench/nccl_parse.py`): generated NCCL_DEBUG_FILE output of {NODES * GPUS} ranks "
        f"({NODES} nodes x {GPUS} GPUs; tests/nccl_logs.py), {size / 1e9:.2f} GB in {len(paths)} files, from the "
        f'page cache. grep: `grep -c "NCCL INFO"` over the files; parse: `verify_logs` (every line parsed, every '
        f"check computed) in a fresh process; medians of {args.repeats} repeats, side by side. Rerun with "
        f"`.venv/bin/python bench/nccl_parse.py --write-results`.",
        "",
        "| logs | grep (s) | grep MB/s | parse (s) | parse MB/s | parse / grep | peak memory (MB) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, s in (("all", size), ("quarter", quarter_size)):
        text.append(
            f"| {name} ({s / 1e9:.2f} GB) | {med(name, 'grep'):.2f} | {s / 1e6 / med(name, 'grep'):,.0f} | "
            f"{med(name, 'seconds'):.2f} | {s / 1e6 / med(name, 'seconds'):,.0f} | "
            f"{statistics.median(r['grep'] / r['seconds'] for r in rows[name]):.3f} | "
            f"{max(r['peak_mb'] for r in rows[name]):.0f} |"
        )
    text += [
        "",
        f"Targets: parse / grep >= {TARGET_RATIO} ({'met' if ratio >= TARGET_RATIO else 'not met'}: {ratio:.3f}); "
        f"peak memory < {TARGET_PEAK_MB} MB ({'met' if peak < TARGET_PEAK_MB else 'not met'}: {peak:.0f} MB); "
        f"linear: {per_gb['quarter']:.2f} s/GB on a quarter of the logs, {per_gb['all']:.2f} s/GB on all of them.",
    ]
    print("\n".join(text))
    if args.write_results:
        append_section("NCCL log parsing", text, machine_lines())
        log.info("appended results to %s", RESULTS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
