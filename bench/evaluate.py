"""Eval tokens/s of the evaluation component's loop against a minimal hand-written eval loop, in one run.

Both evaluate the same model (a preset, built from its config with a fixed seed) on the same val tokens
(the standard library's email package, staged and tokenized as run-local does), the same windows and
batch size: the component's `mean_loss` (bits-per-byte accounting, autocast, one device sync at the end)
against the plain loop a person would write (forward, cross-entropy, `.item()` per batch). The two
alternate, one warm-up each; medians over repeats and the median of the per-repeat ratios. It is a
measurement, not a test: it never asserts.

    .venv/bin/python bench/evaluate.py [--preset small] [--repeats 7] [--write-results]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from machine import RESULTS, append_section, machine_lines
from tokenizers import Tokenizer

from components.stage_data.core import stage_data
from trainer.data import load_meta, load_split
from trainer.evaluation import mean_loss, token_bytes
from trainer.layout import TOKENIZER
from trainer.model import build_model, model_config

log = logging.getLogger("bench-evaluate")
TARGET = 0.9


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=65536)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--write-results", action="store_true", help=f"append a dated section to {RESULTS.name}")
    return p.parse_args(argv)


@torch.no_grad()
def minimal_eval(model: torch.nn.Module, tokens: np.ndarray, seq_len: int, max_tokens: int, batch_size: int) -> float:
    """The loop a person writes: consecutive windows, forward, summed cross-entropy, .item() per batch."""
    model.eval()
    windows = min((len(tokens) - 1) // seq_len, max(1, max_tokens // seq_len))
    total, count = 0.0, 0
    for start in range(0, windows, batch_size):
        rows = [tokens[w * seq_len : w * seq_len + seq_len + 1] for w in range(start, min(windows, start + batch_size))]
        batch = torch.from_numpy(np.stack(rows).astype(np.int64))
        logits = model(input_ids=batch[:, :-1]).logits
        total += F.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1), reduction="sum").item()
        count += batch[:, 1:].numel()
    return total / count


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("components").setLevel(logging.WARNING)
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(sysconfig.get_paths()["stdlib"]) / "email"
        snapshot = Path(
            stage_data(str(source), tmp, "email", vocab_size=2048, val_fraction=0.3, include=["*.py"]).tokenized_dir
        )
        meta = load_meta(snapshot)
        val = load_split(snapshot, "val")
        lengths = token_bytes(Tokenizer.from_file(str(snapshot / TOKENIZER)), meta)
        torch.manual_seed(0)
        model = build_model(model_config(args.preset, meta["vocab_size"], args.seq_len, meta["eos_id"])).eval()
        device = torch.device("cpu")

        def component() -> tuple[float, int]:
            loss, count, _ = mean_loss(model, val, args.seq_len, args.max_tokens, args.batch_size, device, lengths)
            return loss, count

        def minimal() -> tuple[float, int]:
            return minimal_eval(model, val, args.seq_len, args.max_tokens, args.batch_size), 0

        tokens = component()[1]
        component(), minimal()  # warm-up
        runs: dict[str, list[float]] = {"component": [], "minimal": []}
        losses = {}
        for n in range(args.repeats):
            for name, call in (
                (("component", component), ("minimal", minimal))
                if n % 2 == 0
                else (("minimal", minimal), ("component", component))
            ):
                started = time.perf_counter()
                losses[name] = call()[0]
                runs[name].append(time.perf_counter() - started)
            log.info("repeat %d: component %.3fs, minimal %.3fs", n + 1, runs["component"][-1], runs["minimal"][-1])
    ratio = statistics.median(m / c for c, m in zip(runs["component"], runs["minimal"], strict=True))
    rate = {k: tokens / statistics.median(v) for k, v in runs.items()}
    text = [
        f"Evaluation loop (`bench/evaluate.py`): preset {args.preset}, sequence length {args.seq_len}, batch "
        f"{args.batch_size}, {tokens:,} val tokens of the stdlib email package (vocabulary 2048), CPU; the component's "
        f"`mean_loss` against a minimal hand-written loop on the same model, windows and batches, alternating; medians "
        f"of {args.repeats} repeats. Both give val loss {losses['component']:.5f} / {losses['minimal']:.5f}. Rerun "
        f"with `.venv/bin/python bench/evaluate.py --write-results`.",
        "",
        "| loop | median (s) | tokens/s |",
        "|---|---:|---:|",
        *(f"| {k} | {statistics.median(v):.3f} | {rate[k]:,.0f} |" for k, v in runs.items()),
        "",
        f"component / minimal tokens/s: {ratio:.3f} (target >= {TARGET}: {'met' if ratio >= TARGET else 'not met'})",
    ]
    print("\n".join(text))
    if args.write_results:
        append_section("evaluation loop", text, machine_lines("torch", "transformers"))
        log.info("appended results to %s", RESULTS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
