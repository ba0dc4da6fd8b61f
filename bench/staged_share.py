"""Host memory an asynchronous checkpoint stages per rank: this rank's share against the whole replicated state.

DCP's stager copies to host memory everything it is handed, before the planner decides who writes what. The trainer
used to hand it the whole DDP state on every rank; it now hands each rank only the tensors that rank writes
(trainer/dcp_io.py, `share`). This script sizes both for the GPU presets with their AdamW state (exp_avg,
exp_avg_sq and step per parameter, fp32, as torch.distributed.checkpoint.state_dict names them), built on the meta
device so that nothing is allocated, at 8, 16 and 64 ranks: the largest share against the whole state, and the
bound the issue sets (the state over the ranks plus the largest tensor). Sizes, not times: deterministic.

    .venv/bin/python bench/staged_share.py [--vocab-size 50304] [--seq-len 1024] [--write-results]
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from machine import RESULTS, append_section, machine_lines  # noqa: E402

from trainer.dcp_io import MODEL, OPTIM, share  # noqa: E402
from trainer.model import build_model, model_config  # noqa: E402

log = logging.getLogger("bench-staged-share")

PRESETS = ("gpt2-124m", "llama-1b")
RANKS = (8, 16, 64)


def training_state(preset: str, vocab_size: int, seq_len: int) -> dict[str, torch.Tensor]:
    """The model and AdamW tensors a checkpoint holds, by their checkpoint names, on the meta device."""
    with torch.device("meta"):
        model = build_model(model_config(preset, vocab_size, seq_len, 0))
    tensors = {}
    for name, parameter in model.named_parameters():  # a tied weight once, as the checkpoint writes it
        tensors[MODEL + name] = parameter
        for moment in ("exp_avg", "exp_avg_sq"):
            tensors[f"{OPTIM}state.{name}.{moment}"] = torch.empty_like(parameter, dtype=torch.float32)
        tensors[f"{OPTIM}state.{name}.step"] = torch.empty((), dtype=torch.float32, device="meta")
    return tensors


def rows(vocab_size: int, seq_len: int) -> list[str]:
    lines = [
        "| preset | ranks | state (GB) | largest tensor (MB) | staged per rank before (GB) | largest share now (GB) "
        "| bound: state / ranks + largest (GB) | now / before |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for preset in PRESETS:
        tensors = training_state(preset, vocab_size, seq_len)
        state = sum(t.nbytes for t in tensors.values())
        largest = max(t.nbytes for t in tensors.values())
        for world in RANKS:
            shares = [sum(t.nbytes for t in share(tensors, rank, world).values()) for rank in range(world)]
            if sum(shares) != state or max(shares) > state / world + largest:
                raise SystemExit(f"{preset} on {world} ranks: the shares ({max(shares)} bytes at most) break the bound")
            lines.append(
                f"| {preset} | {world} | {state / 1e9:.2f} | {largest / 1e6:.0f} | {state / 1e9:.2f} "
                f"| {max(shares) / 1e9:.3f} | {(state / world + largest) / 1e9:.3f} "
                f"| {max(shares) / state:.3f} |"
            )
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab-size", type=int, default=50304, help="the tokenizer's vocabulary (GPT-2-sized by default)")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--write-results", action="store_true", help=f"append a dated section to {RESULTS.name}")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    table = rows(args.vocab_size, args.seq_len)
    if args.write_results:
        caption = (
            "Staged bytes per rank of an asynchronous checkpoint (`bench/staged_share.py`): what DCP's stager copied "
            "to host memory on every rank before (the whole replicated state: model weights and AdamW's two moments "
            "and step, fp32) against the largest share a rank stages now (`trainer/dcp_io.share`: the tensors that "
            f"rank writes), vocabulary {args.vocab_size}, sequence {args.seq_len}. Sizes of the state built on the "
            "meta device, not times; every share is checked against the bound. With 8 GPUs per node, a node's "
            "pinned host memory for the staged copies goes from eight whole states to about one."
        )
        append_section("async checkpoint: staged bytes per rank", [caption, "", *table], machine_lines("torch"))
        log.info("appended results to %s", RESULTS)
    print("\n".join(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
