"""Memory per rank against corpus size: the shard reader against the old concatenating loader, in one run.

Datasets of 1, 4 and 16 train shards (and as many val shards) of the same size, written in the real
on-disk format (`ShardWriter` shards and a meta.json with the keys the trainer reads) from synthetic token
ids: staging this much text would take far too long on a small machine. Each (loader, shard count) runs in
a fresh process that imports torch and builds the tiny model (the same floor for both), then:

    new       load_split (memory-mapped shards) -> TokenBatches through one full epoch of batches (the keyed
              order evaluated per batch) -> the evaluation's mean_loss over load_split("val")
    baseline  what the code did before issue 18: np.concatenate of the shard memmaps, a materialised
              permutation of every window, the same full epoch of batches read from the copy, and the same
              mean_loss loop over the concatenated val split

and reports its private memory (RssAnon) and its resident memory (VmRSS, which also counts the memory-mapped
file pages read: the page cache, which the kernel drops under pressure). Then the trainer itself: a short
2-process torchrun training of the tiny preset (trainer/train_ddp.py through the launcher's local backend) on
the 1- and the 16-shard dataset, reading rss_gib (the largest rank's private memory) from metrics.jsonl. It is
a measurement, not a test: it never asserts.

    PYTHONPATH=. .venv/bin/python bench/data_memory.py [--shard-tokens 8388608] [--write-results]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from machine import RESULTS, append_section, machine_lines

from components.stage_data.shards import ShardWriter
from components.stage_data.tokenization.snapshot import FORMAT
from trainer.atomic import write_json
from trainer.layout import DatasetPaths

ROOT = Path(__file__).resolve().parent.parent
log = logging.getLogger("bench-data-memory")
SHARD_COUNTS = (1, 4, 16)
VOCAB = 4096
SEQ_LEN, BATCH, EVAL_TOKENS, SEED = 1024, 8, 65536, 1234
TORCHRUN = dict(seq_len=256, batch_size=8, max_steps=30, log_every=10)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shard-tokens", type=int, default=8 * 2**20, help="tokens per shard (uint16: 2 bytes each)")
    p.add_argument("--write-results", action="store_true", help=f"append a dated section to {RESULTS.name}")
    p.add_argument("--measure", choices=("new", "baseline"), help=argparse.SUPPRESS)  # one measurement, in a child
    p.add_argument("--data", type=Path, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# -- the datasets ------------------------------------------------------------------------------------------


def write_dataset(tokenized: Path, shards: int, shard_tokens: int, seed: int) -> None:
    """`shards` full shards per split of uniform random token ids, with the meta.json trainer/data.py reads."""
    tokenized.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    meta_shards, tokens = {}, {}
    for split in ("train", "val"):
        writer = ShardWriter(tokenized, split, np.dtype(np.uint16), shard_tokens)
        for _ in range(shards):
            writer.write(rng.integers(0, VOCAB, size=shard_tokens, dtype=np.uint16))
        tokens[split], meta_shards[split] = writer.close(), writer.shards
    meta = {
        "format": FORMAT,
        "vocab_size": VOCAB,
        "dtype": "uint16",
        "eos_id": VOCAB - 1,
        "shards": meta_shards,
        "tokens": tokens,
    }
    (tokenized / "meta.json").write_text(json.dumps(meta, indent=1))


# -- one measurement, in a fresh process -------------------------------------------------------------------


def memory_mib() -> dict[str, float]:
    """Private (RssAnon), resident (VmRSS) and peak resident (VmHWM) memory of this process, MiB.

    The C allocator first returns the free memory it keeps (malloc_trim), so the figure is what the process
    holds, not what a forward pass freed a moment ago.
    """
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("RssAnon", "VmRSS", "VmHWM"):
            fields[name] = int(value.split()[0]) / 1024
    return fields


def concatenated_split(tokenized: Path, split: str) -> np.ndarray:
    """The baseline: trainer/data.py's load_split before issue 18, verbatim."""
    meta = json.loads((tokenized / "meta.json").read_text())
    shards = [np.memmap(tokenized / s["file"], dtype=meta["dtype"], mode="r") for s in meta["shards"][split]]
    return shards[0] if len(shards) == 1 else np.concatenate(shards)


def baseline_epoch(tokens: np.ndarray) -> int:
    """The baseline: the old TokenBatches' epoch (a materialised permutation, windows sliced from the copy)."""
    num_windows = (len(tokens) - 1) // SEQ_LEN
    order = np.random.default_rng([SEED, 0]).permutation(num_windows)
    for start in range(0, num_windows - BATCH + 1, BATCH):
        rows = np.stack([tokens[w * SEQ_LEN : w * SEQ_LEN + SEQ_LEN + 1] for w in order[start : start + BATCH]])
        rows.astype(np.int64)
    return num_windows // BATCH


def measure(kind: str, tokenized: Path) -> dict[str, object]:
    import torch

    from trainer.data import TokenBatches, TokenSplit, load_split
    from trainer.evaluation import TokenBytes, mean_loss
    from trainer.model import build_model, model_config

    torch.set_num_threads(1)
    torch.manual_seed(SEED)
    model = build_model(model_config("tiny", VOCAB, SEQ_LEN, VOCAB - 1))
    result: dict[str, object] = {"floor": memory_mib()}
    started = time.perf_counter()
    if kind == "new":
        split = load_split(tokenized, "train")
        batches = TokenBatches(split, SEQ_LEN, BATCH, rank=0, world_size=1, seed=SEED)
        steps = batches.num_windows // BATCH
        for _ in range(steps):
            batches.next_batch()
        val = load_split(tokenized, "val")
    else:
        tokens = concatenated_split(tokenized, "train")
        steps = baseline_epoch(tokens)
        val = TokenSplit([concatenated_split(tokenized, "val")])  # the same mean_loss loop over the copy
    result["batch_us"] = (time.perf_counter() - started) / steps * 1e6
    result["train"] = memory_mib()
    ones = TokenBytes(np.ones(VOCAB, dtype=np.int64), None, ())
    mean_loss(model, val, SEQ_LEN, EVAL_TOKENS, BATCH, torch.device("cpu"), ones)
    result["eval"] = memory_mib()
    return result


def run_child(kind: str, tokenized: Path) -> dict[str, dict[str, float]]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
    }
    out = subprocess.run(
        [sys.executable, __file__, "--measure", kind, "--data", str(tokenized)],
        env=env,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def train_rss(root: Path, dataset: str) -> float:
    """The largest rank's rss_gib (GiB) over a short 2-process torchrun training of the tiny preset."""
    from components.launch_training.config import LaunchConfig
    from components.launch_training.core import launch
    from trainer.layout import RunPaths

    run_id = f"rss-{dataset}"
    launch(
        LaunchConfig.of(
            storage_root=str(root),
            dataset=dataset,
            run_id=run_id,
            nproc_per_node=2,
            preset="tiny",
            checkpoint_every=10**6,
            timeout_s=600,
            **TORCHRUN,
        )
    )
    rows = [json.loads(line) for line in RunPaths.of(root, run_id).metrics.read_text().splitlines() if line.strip()]
    return max(r["rss_gib"] for r in rows)


# -- the report --------------------------------------------------------------------------------------------


def report(args: argparse.Namespace, results: dict, trained: dict[int, float]) -> list[str]:
    shard_mb = args.shard_tokens * 2 / 2**20
    lines = [
        f"Memory per rank against corpus size (`bench/data_memory.py`): 1, 4 and 16 train shards (and as many val "
        f"shards) of {args.shard_tokens:,} uint16 tokens ({shard_mb:.0f} MiB) each, synthetic ids in the real on-disk "
        f"format; each loader in a fresh process with torch and the tiny model built (the same floor). new: "
        f"load_split + TokenBatches through one full epoch (sequence {SEQ_LEN}, batch {BATCH}) + the evaluation's "
        f"mean_loss over the val split ({EVAL_TOKENS:,} tokens); baseline: the loader before issue 18 "
        f"(np.concatenate of the shards, a materialised permutation) through the same epoch and mean_loss loop. "
        f"Private = RssAnon (what the process holds); resident = VmRSS (adds the mapped shard pages read, page "
        f"cache the kernel can drop). Rerun with `PYTHONPATH=. .venv/bin/python bench/data_memory.py "
        f"--write-results`.",
        "",
        "| shards | corpus (MiB) | new private (MiB) | baseline private (MiB) | new / baseline | new resident (MiB) "
        "| baseline resident (MiB) | new batch (us) | baseline batch (us) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n in SHARD_COUNTS:
        new, old = results[n]["new"], results[n]["baseline"]
        lines.append(
            f"| {n} | {2 * n * shard_mb:,.0f} | {new['eval']['RssAnon']:,.0f} | {old['eval']['RssAnon']:,.0f} | "
            f"{new['eval']['RssAnon'] / old['eval']['RssAnon']:.3f} | {new['eval']['VmRSS']:,.0f} | "
            f"{old['eval']['VmRSS']:,.0f} | {new['batch_us']:.0f} | {old['batch_us']:.0f} |"
        )
    first, last = SHARD_COUNTS[0], SHARD_COUNTS[-1]

    def growth(kind: str) -> str:
        a, b = results[first][kind]["eval"]["RssAnon"], results[last][kind]["eval"]["RssAnon"]
        return f"{b / a:.3f} ({b - a:+,.0f} MiB)"

    floor = results[last]["new"]["floor"]["RssAnon"]
    lines += [
        "",
        f"Private memory at {last} shards / at {first} shard: new {growth('new')}, baseline {growth('baseline')}. "
        f"Floor (torch imported, tiny model built, no data): {floor:,.0f} MiB. Time per batch is one epoch's wall "
        f"time over its batches, once, on a machine shared with other work (load average "
        f"{os.getloadavg()[0]:.1f} at the end): indicative only; the new one includes evaluating the keyed order "
        f"(a Feistel network in numpy, tens to a few hundred us per batch), the price of holding no permutation.",
        "",
        f"The trainer (2 ranks under torchrun, tiny preset, sequence {TORCHRUN['seq_len']}, batch "
        f"{TORCHRUN['batch_size']}, {TORCHRUN['max_steps']} steps): rss_gib of metrics.jsonl (the largest rank's "
        f"private memory) {trained[first]:.2f} GiB on {first} shard, {trained[last]:.2f} GiB on {last} shards "
        f"(ratio {trained[last] / trained[first]:.3f}).",
    ]
    return lines


def projection(results: dict) -> list[str]:
    """Per-rank memory for a 100 GB text corpus, from the measured figures: labelled as a projection."""
    tokens = 25e9  # ~4 bytes of text per token: ~25 G tokens, ~50 GB of uint16 shards
    windows = tokens / SEQ_LEN
    new = results[SHARD_COUNTS[-1]]["new"]["eval"]["RssAnon"] / 1024
    old = results[SHARD_COUNTS[-1]]["baseline"]["floor"]["RssAnon"] / 1024 + tokens * 2 / 2**30 + windows * 8 / 2**30
    return [
        "",
        f"Projection (not a measurement) for a 100 GB text corpus, ~{tokens / 1e9:.0f} G tokens (~4 bytes of text "
        f"per token) = ~{tokens * 2 / 1e9:.0f} GB of uint16 shards, {tokens / 2**26:,.0f} shards of 64 Mi tokens, "
        f"sequence {SEQ_LEN}: the old loader holds a copy of the split ({tokens * 2 / 2**30:,.1f} GiB) and an int64 "
        f"permutation of {windows / 1e6:,.1f} M windows ({windows * 8 / 2**30:.2f} GiB) in every rank, ~{old:,.1f} "
        f"GiB per rank with the floor, ~{8 * old:,.0f} GiB for 8 ranks of a node; the new reader holds a window "
        f"offset per shard and a few round keys: flat, as measured, ~{new:.2f} GiB per rank with the floor at any "
        f"corpus size. (At ~50 G tokens, double the old figures.)",
    ]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.measure:
        print(json.dumps(measure(args.measure, args.data)))
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("components").setLevel(logging.WARNING)
    results: dict[int, dict[str, dict]] = {}
    trained: dict[int, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for n in SHARD_COUNTS:
            paths = DatasetPaths.of(root, f"shards-{n}")
            tokenized = paths.snapshot(f"bench-{n}")  # a snapshot as staging lays it out, made current
            write_dataset(tokenized, n, args.shard_tokens, seed=n)
            write_json(paths.current, {"snapshot": tokenized.name})
            results[n] = {}
            for kind in ("new", "baseline") if n % 2 else ("baseline", "new"):
                results[n][kind] = run_child(kind, tokenized)
                log.info(
                    "%d shard(s), %s: private %.0f MiB, resident %.0f MiB",
                    n,
                    kind,
                    results[n][kind]["eval"]["RssAnon"],
                    results[n][kind]["eval"]["VmRSS"],
                )
        for n in (SHARD_COUNTS[0], SHARD_COUNTS[-1]):
            trained[n] = train_rss(root, f"shards-{n}")
            log.info("torchrun on %d shard(s): rss_gib %.2f", n, trained[n])
    text = report(args, results, trained) + projection(results)
    print("\n".join(text))
    if args.write_results:
        append_section("data memory against corpus size", text, machine_lines("numpy", "torch"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
