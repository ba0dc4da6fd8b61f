"""Private memory per rank after the first optimizer step, for bench/fsdp.py: what sharding saves where it matters.

Run as `torchrun --nproc-per-node 2 bench/fsdp_memory_probe.py ddp|fsdp`. A llama-shaped model of 277M parameters
(4.4 GB of weights, gradients and AdamW state in fp32: enough to dominate a process of a few hundred MB) is built
as the trainer builds it (trainer.parallel.parallelize: on the meta device, spread, initialised), and takes one step
as the trainer takes it on a tiny batch (the loss, backward, clipping, fused AdamW with the trainer's groups): after
it, every rank holds its weights, gradients and both AdamW moments. RssAnon (trainer.metrics.rss_gib: the process's
private pages, not the page cache) is read before the build and after the step; the same steps on a small model come
first, so that what they cost whatever the model's size (code paths run once, caches, the allocator's arenas) is in
the baseline, not in the growth (as tests/memory_probe.py does for the peak). After the step RssAnon is read twice:
as the process holds it, then once the C allocator has returned its free pages (what is live). Rank 0 prints one
JSON line: each rank's readings (GiB), the model's parameters and the mean loss of the step (the same on both
sides: the same initial weights and batches).
"""

from __future__ import annotations

import ctypes
import gc
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

if __package__ in (None, ""):  # run as a script, as torchrun does: make the trainer package importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from minimal_ddp import param_groups

from trainer.config import TRAIN_DEFAULTS as D
from trainer.metrics import rss_gib
from trainer.parallel import Parallelized, parallelize

# Llama-shaped, 16 blocks of hidden 1024 and an untied vocabulary of 16,384: 277M parameters. Under DDP each of
# 2 ranks holds 4.4 GB of state (8.9 GB for both: within a 16 GB machine); small blocks (61 MB) keep what FSDP
# all-gathers at once small beside a rank's share.
SHAPE = {
    "num_hidden_layers": 16,
    "hidden_size": 1024,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "intermediate_size": 4096,
    "tie_word_embeddings": False,
}
VOCAB = 16384
SMALL = {**SHAPE, "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128}
BATCH, SEQ_LEN = 1, 64  # a tiny batch: the activations stay small beside the state


def one_step(config: Any, parallelism: str) -> tuple[Parallelized, torch.optim.Optimizer, torch.Tensor]:
    """The model as the trainer spreads it, after one training step; the step's loss."""
    world = dist.get_world_size()
    parallel = parallelize(config, parallelism, torch.device("cpu"), D["seed"], local_world=world)
    optimizer = torch.optim.AdamW(
        param_groups(parallel.model, D["weight_decay"]), lr=D["lr"], betas=(0.9, 0.95), fused=True
    )
    generator = torch.Generator().manual_seed(dist.get_rank())
    tokens = torch.randint(config.vocab_size, (BATCH, SEQ_LEN + 1), generator=generator)
    loss = parallel.forward_loss(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    parallel.clip_grad_norm(D["grad_clip"])
    optimizer.step()
    return parallel, optimizer, loss.detach()


def release_free_memory() -> bool:
    """Hand the C allocator's free pages back to the kernel (glibc's malloc_trim), so that RssAnon counts only what
    is live: glibc keeps freed heap chunks below its mmap threshold (32 MB at most), such as the gradients and
    all-gathered weights FSDP frees block by block. False where there is no glibc."""
    try:
        trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return False
    trim(0)
    return True


def main(parallelism: str) -> None:
    from transformers import AutoConfig

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    one_step(AutoConfig.for_model("llama", vocab_size=512, max_position_embeddings=SEQ_LEN, **SMALL), parallelism)
    gc.collect()  # FSDP's hooks hold the module in reference cycles
    baseline = rss_gib()
    config = AutoConfig.for_model("llama", vocab_size=VOCAB, max_position_embeddings=SEQ_LEN, **SHAPE)
    parallel, _optimizer, loss = one_step(config, parallelism)  # the optimizer holds AdamW's state: kept
    after = rss_gib()
    live = rss_gib() if release_free_memory() else None
    parameters = sum(p.numel() for p in parallel.model.parameters())  # a DTensor counts its whole size
    ranks: list[Any] = [None] * world
    dist.all_gather_object(ranks, {"baseline_gib": baseline, "after_step_gib": after, "live_gib": live})
    dist.all_reduce(loss)
    if rank == 0:
        result = {"parallelism": parallel.kind, "parameters": parameters, "loss": loss.item() / world, "ranks": ranks}
        print(json.dumps(result), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
