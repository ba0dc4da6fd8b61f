"""The smallest honest DDP training loop: the baseline that bench/trainer_overhead.py holds the trainer to.

It does the math trainer/train_ddp.py does, on the same model, data and batch (the same preset and initial
weights, fused AdamW with the same two parameter groups, the same warm-up + cosine schedule, clipping at 1.0, the
same cross-entropy, the same per-rank sequences in the same order), and nothing else: no checkpoints, no
metrics file, no stop-signal agreement, no per-step logging. It times steps [warmup, max_steps) on rank 0
and prints one JSON line (also the median step time). gloo on CPU, fp32 (the trainer's CPU path).
bench/minimal_fsdp.py runs the same loop on an FSDP2 model. Run it under torchrun:

    python -m torch.distributed.run --standalone --nproc-per-node=2 bench/minimal_ddp.py \\
        --data-dir <root>/datasets/<name>/tokenized --preset small --max-steps 120 --warmup 20
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

if __package__ in (None, ""):  # run as a script, as torchrun does: make the trainer package importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trainer.config import TRAIN_DEFAULTS as D
from trainer.data import TokenBatches  # the sampler: which windows each rank trains on
from trainer.model import build_model, model_config
from trainer.parallel import initialize


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data-dir", required=True, help="tokenized dataset directory (holds meta.json)")
    p.add_argument("--preset", default=D["preset"])
    p.add_argument("--seed", type=int, default=D["seed"])
    p.add_argument("--max-steps", type=int, default=D["max_steps"])
    p.add_argument("--warmup", type=int, default=20, help="untimed steps before the timed window")
    p.add_argument("--batch-size", type=int, default=D["batch_size"])
    p.add_argument("--seq-len", type=int, default=D["seq_len"])
    p.add_argument("--lr", type=float, default=D["lr"])
    p.add_argument("--min-lr-ratio", type=float, default=D["min_lr_ratio"])
    p.add_argument("--warmup-steps", type=int, default=D["warmup_steps"], help="steps of LR warm-up")
    p.add_argument("--weight-decay", type=float, default=D["weight_decay"])
    args = p.parse_args(argv)
    if not 0 <= args.warmup < args.max_steps:
        p.error("--warmup must be at least 0 and below --max-steps")
    return args


def token_batches(args: argparse.Namespace, rank: int, world: int) -> tuple[TokenBatches, dict]:
    """This rank's batches of the training split, in the trainer's order, and the dataset's meta.json."""
    data_dir = Path(args.data_dir)
    meta = json.loads((data_dir / "meta.json").read_text())
    shards = [np.memmap(data_dir / s["file"], dtype=meta["dtype"], mode="r") for s in meta["shards"]["train"]]
    tokens = shards[0] if len(shards) == 1 else np.concatenate(shards)
    return TokenBatches(tokens, args.seq_len, args.batch_size, rank, world, args.seed), meta


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """The trainer's two AdamW groups: weight decay on the matrices, none on the vectors (norms, biases)."""
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    vectors = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": matrices, "weight_decay": weight_decay}, {"params": vectors, "weight_decay": 0.0}]


def train(
    forward: Callable[[torch.Tensor], torch.Tensor],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: TokenBatches,
    args: argparse.Namespace,
) -> None:
    """The loop: `forward` (inputs -> logits), the cross-entropy, backward, clipping at 1.0, the optimizer step at the
    schedule's learning rate. Times steps [warmup, max_steps); rank 0 prints the result line."""
    rank, world = dist.get_rank(), dist.get_world_size()

    def lr_factor(step: int) -> float:  # the fresh shape of trainer.schedule.LRSchedule
        if step < args.warmup_steps:
            return (step + 1) / args.warmup_steps
        progress = min(1.0, (step - args.warmup_steps) / max(1, args.max_steps - args.warmup_steps))
        return args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    started = last = 0.0
    step_seconds = []  # each timed step's wall time on this rank, for a median robust to other processes
    for step in range(args.max_steps):
        if step == args.warmup:
            dist.barrier()
            started = last = time.perf_counter()
        inputs, targets = batches.next_batch()
        logits = forward(inputs)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if step >= args.warmup:
            now = time.perf_counter()
            step_seconds.append(now - last)
            last = now
    seconds = last - started

    # Outside the timed window: the last step's loss, averaged over ranks, to check both sides did the same math.
    loss = loss.detach()
    dist.all_reduce(loss)
    steps = args.max_steps - args.warmup
    tokens_timed = steps * args.batch_size * args.seq_len * world
    if rank == 0:
        result = {
            "steps": steps,
            "tokens": tokens_timed,
            "seconds": round(seconds, 4),
            "tokens_per_s": round(tokens_timed / seconds, 1),
            "median_step_s": round(statistics.median(step_seconds), 6),
            "final_loss": loss.item() / world,
            "world_size": world,
        }
        print(json.dumps(result), flush=True)
    dist.barrier()  # every rank past its last collective before any leaves (see leave())


def leave(code: int) -> None:
    """Exit without the process group's teardown: gloo's once hung rank 0 after rank 1 had exited
    (destroy_process_group, threads in futex waits), stalling the benchmark for its timeout."""
    sys.stdout.flush()
    os._exit(code)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    dist.init_process_group("gloo")
    batches, meta = token_batches(args, dist.get_rank(), dist.get_world_size())

    # The trainer's initial weights (trainer/parallel.py draws them unit by unit from the seed, the same on every rank).
    with torch.device("meta"):
        model = build_model(model_config(args.preset, meta["vocab_size"], args.seq_len, meta["eos_id"]))
    template = copy.deepcopy(model)
    model.to_empty(device="cpu")
    model.tie_weights()
    initialize(model, template, args.seed)
    optimizer = torch.optim.AdamW(param_groups(model, args.weight_decay), lr=args.lr, betas=(0.9, 0.95), fused=True)
    ddp = DistributedDataParallel(model)
    train(lambda inputs: ddp(input_ids=inputs).logits, model, optimizer, batches, args)
    return 0


if __name__ == "__main__":
    leave(main())
