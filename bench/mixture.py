"""Data mixtures: the trainer's tokens/s on a 3-dataset mixture against the same tokens as one dataset, side by side;
the sampler's cost per global batch at cluster sizes; the memory it holds against the number and size of datasets.

1. Training: three corpora of the test grammar (tests.helpers.write_corpus, different seeds and sizes) are staged as
   datasets web, code and math with one tokenizer, and the same files once more as one dataset `one`. The same short
   run (preset tiny, 2 processes under torchrun through the local launcher, seq 64, batch 8, a metrics row every
   10 steps, the default) trains on `--mixture web=0.6,code=0.3,math=0.1` and on `one`, interleaved over rounds so
   that other work on the machine hits both alike; per run, the median tokens/s of the rows past the first 10 steps.
2. The sampler alone, in this process: `take` + `read` of one micro-batch of a rank of 64 (batch 8, seq 2048) from
   a mixture of 3 datasets of memory-mapped shards against the one-dataset sampler (trainer/data.py TokenBatches)
   over the same shards; microseconds per call, medians of repeats.
3. Memory: the bytes the mixture's sampler holds (tracemalloc: numpy's buffers included) after 1,000 global batches,
   for 2, 8 and 32 datasets of 4 and 64 MiB of tokens each: flat in their number and size means no per-sample index.

It is a measurement, not a test: it never asserts on times.

    .venv/bin/python bench/mixture.py [--rounds 3] [--steps 200] [--write-results]
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import statistics
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np
from machine import RESULTS, append_section, machine_lines

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # tests.helpers

from components.launch_training.core import launch  # noqa: E402
from components.stage_data.core import stage_data  # noqa: E402
from tests.helpers import snapshot_dir, tiny_launch, write_corpus  # noqa: E402
from trainer.data import TokenBatches, TokenSplit  # noqa: E402
from trainer.mixture import MixtureBatches  # noqa: E402

log = logging.getLogger("bench-mixture")

TARGET = 0.98  # mixture / one tokens/s
WARMUP = 10
WEIGHTS = {"web": 0.6, "code": 0.3, "math": 0.1}
CORPORA = {"web": (12, 120, 1), "code": (6, 120, 2), "math": (3, 120, 3)}  # files, sentences, seed


def stage(root: Path, scratch: Path) -> None:
    """web, code and math with web's tokenizer; `one`: all their files as one dataset, with the same tokenizer."""
    together = scratch / "one"
    for name, (files, sentences, seed) in CORPORA.items():
        corpus = write_corpus(scratch / name, files=files, sentences=sentences, seed=seed)
        tokenizer = {} if name == "web" else {"tokenizer_path": str(snapshot_dir(root, "web") / "tokenizer.json")}
        stage_data(str(corpus), str(root), name, vocab_size=512, val_fraction=0.1, **tokenizer)
        shutil.copytree(corpus, together / name)
    stage_data(
        str(together),
        str(root),
        "one",
        tokenizer_path=str(snapshot_dir(root, "web") / "tokenizer.json"),
        val_fraction=0.1,
    )


def train(root: Path, name: str, steps: int, mixture: bool) -> float:
    """One run; the median tokens/s of its rows past the warm-up."""
    data = (
        {"dataset": "web", "mixture": [{"dataset": d, "weight": w} for d, w in WEIGHTS.items()]}
        if mixture
        else {"dataset": "one"}
    )
    cfg = tiny_launch(root, name, max_steps=steps, log_every=10, checkpoint_every=steps, eval_every=0, **data)
    launch(cfg)
    rows = [json.loads(line) for line in cfg.run_paths.metrics.read_text().splitlines()]
    return statistics.median(r["tokens_per_s"] for r in rows if r["step"] > WARMUP)


def shards(directory: Path, name: str, tokens: int, count: int = 2) -> TokenSplit:
    """`count` memory-mapped uint16 shards of `tokens` tokens in all, written once (the real on-disk dtype)."""
    parts = []
    for i in range(count):
        path = directory / f"{name}_{i}.bin"
        if not path.exists():
            np.random.default_rng(i).integers(0, 50_000, tokens // count, dtype=np.uint16).tofile(path)
        parts.append(np.memmap(path, dtype=np.uint16, mode="r"))
    return TokenSplit(parts, name)


def sampler_cost(directory: Path, repeats: int = 2000) -> dict[str, float]:
    """Microseconds per micro-batch (take + read) of rank 5 of 64, batch 8, seq 2048: mixture of 3 vs one dataset."""
    seq, batch, world = 2048, 8, 64
    splits = [shards(directory, f"cost{k}", 8 << 20) for k in range(3)]
    one = TokenBatches(TokenSplit([s for split in splits for s in split.shards], "one"), seq, batch, 5, world, 1)
    mix = MixtureBatches(["a", "b", "c"], splits, [0.6, 0.3, 0.1], seq, batch, 5, world, 1)
    out = np.empty((batch, seq + 1), dtype=np.int32)
    timings: dict[str, list[float]] = {"one": [], "mixture": []}
    for _ in range(3):  # interleaved rounds
        for name, sampler in (("one", one), ("mixture", mix)):
            started = time.perf_counter()
            for _ in range(repeats):
                sampler.read(sampler.take(sampler.position), out)
            timings[name].append((time.perf_counter() - started) / repeats * 1e6)
    return {name: statistics.median(values) for name, values in timings.items()}


def held_bytes(directory: Path, datasets: int, mib: int, batches: int = 1000) -> int:
    """What a mixture's sampler holds after `batches` global batches of one rank (of 8): tracemalloc's peak of the
    allocations made since it was built, the batches' own buffers excluded (each is dropped after use)."""
    splits = [shards(directory, f"m{mib}-{k}", (mib << 20) // 2) for k in range(datasets)]
    tracemalloc.start()
    mix = MixtureBatches([f"d{k}" for k in range(datasets)], splits, [1.0] * datasets, 1024, 8, 0, 8, 1)
    for _ in range(batches):
        mix.take(mix.position)
    held, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    del mix
    return held


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--write-results", action="store_true", help=f"append the results to {RESULTS}")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="bench-mixture-") as tmp:
        scratch, root = Path(tmp), Path(tmp) / "fsx"
        stage(root, scratch)
        speeds: dict[str, list[float]] = {"mixture": [], "one": []}
        for r in range(args.rounds):
            order = ("mixture", "one") if r % 2 == 0 else ("one", "mixture")
            for kind in order:
                speeds[kind].append(train(root, f"{kind}-{r}", args.steps, kind == "mixture"))
                print(f"round {r}: {kind} {speeds[kind][-1]:,.0f} tokens/s", flush=True)
        config = json.loads((root / "runs" / "mixture-0" / "config.json").read_text())
        last = json.loads((root / "runs" / "mixture-0" / "metrics.jsonl").read_text().splitlines()[-1])
        cost = sampler_cost(scratch)
        held = {(n, mib): held_bytes(scratch, n, mib) for n in (2, 8, 32) for mib in (4, 64)}

    ratios = [m / o for m, o in zip(speeds["mixture"], speeds["one"], strict=True)]
    ratio = statistics.median(speeds["mixture"]) / statistics.median(speeds["one"])
    shares = {name: d["tokens"] / last["tokens"] for name, d in last["datasets"].items()}
    body = [
        "Data mixtures (`bench/mixture.py`). Training: the same run (preset tiny, 2 processes under torchrun, seq 64, "
        f"batch 8, {args.steps} steps, a metrics row every 10 steps as by default) on a mixture of three staged "
        "datasets (web=0.6,code=0.3,math=0.1; "
        + ", ".join(f"{m['dataset']} {m['train_tokens']:,} tokens" for m in config["dataset"]["mixture"])
        + ") and on the same files staged as one dataset, interleaved over "
        f"{args.rounds} rounds; median tokens/s of the rows past step {WARMUP}. Rerun with "
        "`.venv/bin/python bench/mixture.py --write-results`.",
        "",
        "| run | tokens/s (median of rounds) | each round |",
        "|---|---:|---|",
        *(
            f"| {kind} | {statistics.median(v):,.0f} | {', '.join(f'{x:,.0f}' for x in v)} |"
            for kind, v in speeds.items()
        ),
        "",
        f"mixture / one: **{ratio:.3f}** (target >= {TARGET}; per round {', '.join(f'{x:.3f}' for x in ratios)}). "
        "Shares of the tokens trained at the end of a mixture run: "
        + ", ".join(f"{name} {share:.1%}" for name, share in shares.items())
        + ".",
        "",
        f"The sampler alone (rank 5 of 64, batch 8, seq 2048, 3 datasets of 8 Mi tokens in 2 shards each): "
        f"take + read of a micro-batch {cost['mixture']:.0f} us for the mixture, {cost['one']:.0f} us for one dataset "
        f"(ratio {cost['mixture'] / cost['one']:.2f}); both run in the prefetch thread, beside the step.",
        "",
        "What the mixture's sampler holds after 1,000 global batches (tracemalloc, numpy's buffers included):",
        "",
        "| datasets | MiB of tokens each | held (KiB) |",
        "|---:|---:|---:|",
        *(f"| {n} | {mib} | {b / 1024:.1f} |" for (n, mib), b in held.items()),
    ]
    print("\n".join(body))
    if args.write_results:
        append_section(
            "Data mixtures: tokens/s, sampler cost, memory (bench/mixture.py)", body, machine_lines("torch", "numpy")
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
