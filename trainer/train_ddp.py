"""DDP pretraining of a causal LM: the program torchrun starts in every PyTorchJob pod.

    torchrun --nproc_per_node=N -m trainer.train_ddp --data-dir DIR --run-dir DIR --preset small ...

NCCL on GPUs, gloo on CPU. Rank 0 writes config.json, metrics.jsonl and checkpoint_latest.pt under the
run directory; every rank writes its comms self-test report and its log. A run directory that already
holds a checkpoint is resumed from it.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel

from trainer import comms
from trainer.atomic import write_json
from trainer.checkpoint import CheckpointError, load_checkpoint, rng_state, save_checkpoint, set_rng_state
from trainer.config import TrainConfig
from trainer.data import TokenBatches, load_meta, load_split
from trainer.layout import RunPaths
from trainer.model import PRESETS, build_model, model_config

log = logging.getLogger("trainer")


def lr_lambda(cfg: TrainConfig):
    """Linear warm-up, then cosine decay to min_lr_ratio of the peak at max_steps."""

    def factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def train(cfg: TrainConfig) -> None:
    use_cuda = torch.cuda.is_available()
    dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device(f"cuda:{local_rank}") if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    run = RunPaths(Path(cfg.run_dir))
    setup_logging(rank, run.rank_log(rank))
    log.info(
        "rank %d/%d on %s, restart count %s", rank, world, device, os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    )

    report = comms.self_test(device)
    write_json(run.comms_report(rank), report)
    log.info(
        "comms self-test: all_reduce %s, bus bandwidth %.3f GB/s",
        "correct" if report["all_reduce_correct"] else "WRONG",
        report["busbw_gbps"],
    )

    tokenized = Path(cfg.data_dir)
    meta = load_meta(tokenized)
    batches = TokenBatches(load_split(tokenized, "train"), cfg.seq_len, cfg.batch_size, rank, world, cfg.seed)
    mcfg = model_config(cfg.preset, meta["vocab_size"], cfg.seq_len, meta["eos_id"])
    torch.manual_seed(cfg.seed)  # same initial weights on every rank (DDP also broadcasts rank 0's)
    model = build_model(mcfg).to(device)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=(0.9, 0.95),
        fused=use_cuda,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
    step, tokens_seen = 0, 0

    if run.latest_checkpoint.exists():
        state = load_checkpoint(run.latest_checkpoint)
        if state["preset"] != cfg.preset:
            raise CheckpointError(
                f"{run.latest_checkpoint} was trained with preset {state['preset']!r}, not {cfg.preset!r}"
            )
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        batches.position.load_state_dict(state["data"])
        step, tokens_seen = state["step"], state["tokens_seen"]
        set_rng_state(state["rng"])
        log.info(
            "resumed from %s at step %d (%d tokens seen, saved by %d ranks, now %d)",
            run.latest_checkpoint,
            step,
            tokens_seen,
            state["world_size"],
            world,
        )
    else:
        np.random.seed(cfg.seed + rank)

    if rank == 0:
        write_json(
            run.config,
            {
                "trainer": asdict(cfg),
                "world_size": world,
                "model": mcfg.to_dict(),
                "dataset": {
                    "tokenized_dir": str(tokenized),
                    "vocab_size": meta["vocab_size"],
                    "train_tokens": meta["tokens"]["train"],
                },
            },
        )
    ddp = DistributedDataParallel(model, device_ids=[local_rank] if use_cuda else None)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=use_cuda)

    def checkpoint() -> None:
        if rank == 0:
            started = time.perf_counter()
            save_checkpoint(
                run.latest_checkpoint,
                {
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(),
                    "data": batches.position.state_dict(),
                    "step": step,
                    "tokens_seen": tokens_seen,
                    "rng": rng_state(),
                    "preset": cfg.preset,
                    "world_size": world,
                },
            )
            log.info("saved %s at step %d in %.2fs", run.latest_checkpoint, step, time.perf_counter() - started)
        dist.barrier()

    window_start, window_tokens = time.perf_counter(), 0
    while step < cfg.max_steps:
        inputs, targets = (t.to(device, non_blocking=True) for t in batches.next_batch())
        with autocast:
            logits = ddp(input_ids=inputs).logits
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        scheduler.step()
        step += 1
        step_tokens = inputs.numel() * world
        tokens_seen += step_tokens
        window_tokens += step_tokens

        if step % cfg.log_every == 0 or step == cfg.max_steps:
            mean_loss = loss.detach().clone()
            dist.all_reduce(mean_loss)  # SUM: gloo has no AVG
            mean_loss /= world
            elapsed = time.perf_counter() - window_start
            record = {
                "step": step,
                "loss": round(mean_loss.item(), 6),
                "lr": scheduler.get_last_lr()[0],
                "tokens": tokens_seen,
                "tokens_per_s": round(window_tokens / elapsed, 1),
                "time": time.time(),
            }
            if rank == 0:
                with open(run.metrics, "a") as f:
                    f.write(json.dumps(record) + "\n")
                log.info(
                    "step %d loss %.4f lr %.2e tokens/s %.0f",
                    step,
                    record["loss"],
                    record["lr"],
                    record["tokens_per_s"],
                )
            window_start, window_tokens = time.perf_counter(), 0
        if step % cfg.checkpoint_every == 0 or step == cfg.max_steps:
            checkpoint()

    log.info("training done at step %d, %d tokens", step, tokens_seen)
    dist.destroy_process_group()


def setup_logging(rank: int, log_file: Path) -> None:
    log_file.parent.mkdir(parents=True, exist_ok=True)
    fmt = logging.Formatter(f"%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s")
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    for handler in (logging.StreamHandler(sys.stderr), logging.FileHandler(log_file)):
        handler.setFormatter(fmt)
        root.addHandler(handler)


def positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    d = TrainConfig(data_dir="", run_dir="")
    p = argparse.ArgumentParser(prog="train_ddp", description=__doc__.splitlines()[0])
    p.add_argument("--data-dir", required=True, help="tokenized dataset directory (<root>/datasets/<name>/tokenized)")
    p.add_argument("--run-dir", required=True, help="run directory (<root>/runs/<run_id>)")
    p.add_argument("--preset", default=d.preset, choices=sorted(PRESETS))
    p.add_argument("--max-steps", type=positive_int, default=d.max_steps)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--batch-size", type=positive_int, default=d.batch_size, help="sequences per rank per step")
    p.add_argument("--seq-len", type=positive_int, default=d.seq_len)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--warmup-steps", type=positive_int, default=d.warmup_steps)
    p.add_argument("--checkpoint-every", type=positive_int, default=d.checkpoint_every)
    p.add_argument("--log-every", type=positive_int, default=d.log_every)
    a = p.parse_args(argv)
    if not (Path(a.data_dir) / "meta.json").is_file():
        p.error(f"--data-dir {a.data_dir}: no meta.json there; stage the dataset first")
    return TrainConfig(
        data_dir=a.data_dir,
        run_dir=a.run_dir,
        preset=a.preset,
        max_steps=a.max_steps,
        seed=a.seed,
        batch_size=a.batch_size,
        seq_len=a.seq_len,
        lr=a.lr,
        warmup_steps=a.warmup_steps,
        checkpoint_every=a.checkpoint_every,
        log_every=a.log_every,
    )


@record  # a worker's exception reaches torchrun's failure summary, which the launcher shows
def main() -> None:
    train(parse_args())


if __name__ == "__main__":
    main()
