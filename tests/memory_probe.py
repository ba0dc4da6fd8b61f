"""Peak memory of building, initialising, saving and resuming a model too large to copy, under torchrun.

Run as `torchrun --nproc-per-node 2 -m tests.memory_probe OUT PARALLELISM` (tests/test_parallel.py): a llama-shaped
model of 1.7 GB (fp32) is built on the meta device, spread (trainer/parallel.py), initialised, its weights saved
with DCP, then a second copy is spread and loaded from that checkpoint (trainer/dcp_io.py). Each rank writes
OUT/rank_<r>.json: the model's bytes and its process's peak resident memory (getrusage's ru_maxrss) before and
after, so the test sees how much any step of it ever held at once.
"""

from __future__ import annotations

import gc
import json
import os
import resource
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from trainer import dcp_io
from trainer.parallel import parallelize

# Llama-shaped, 24 blocks of hidden 1024: 436M parameters, 1.74 GB in fp32. Many small blocks keep the one unit an
# initialisation holds whole (a block, 67 MB) small beside a rank's share.
SHAPE = {
    "num_hidden_layers": 24,
    "hidden_size": 1024,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "intermediate_size": 4096,
    "tie_word_embeddings": False,
}
VOCAB = 16384


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux


def cycle(config: object, parallelism: str, checkpoint: Path) -> None:
    """Build, initialise, save and load a model, keeping nothing."""
    model = parallelize(config, parallelism, torch.device("cpu"), seed=1, local_world=dist.get_world_size()).model
    dcp.save(get_model_state_dict(model), storage_writer=dcp_io.writer(checkpoint))
    dcp_io.load_shared(checkpoint, get_model_state_dict(model), None)
    del model
    gc.collect()


def main(out: Path, parallelism: str) -> None:
    from transformers import AutoConfig

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    config = AutoConfig.for_model("llama", vocab_size=VOCAB, max_position_embeddings=256, **SHAPE)
    # The same steps on a small model first: what they cost whatever the model's size (code paths run once, caches,
    # the allocator's arenas) is in the baseline, not in the growth.
    small = AutoConfig.for_model(
        "llama",
        vocab_size=512,
        max_position_embeddings=256,
        **{**SHAPE, "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128},
    )
    cycle(small, parallelism, out / "warm-up")
    before = peak_rss_bytes()
    model = parallelize(config, parallelism, torch.device("cpu"), seed=1, local_world=dist.get_world_size()).model
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # a DTensor counts its whole size
    after_build = peak_rss_bytes()
    checkpoint = out / "checkpoint"
    dcp.save(get_model_state_dict(model), storage_writer=dcp_io.writer(checkpoint))
    expected = {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v)[:2].clone()
        for k, v in get_model_state_dict(model).items()
        if k.endswith("q_proj.weight")
    }
    after_save = peak_rss_bytes()
    del model
    gc.collect()  # FSDP's hooks hold the module in reference cycles
    resumed = parallelize(config, parallelism, torch.device("cpu"), seed=2, local_world=dist.get_world_size()).model
    state = get_model_state_dict(resumed)
    dcp_io.load_shared(checkpoint, state, None)
    loaded = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v)[:2] for k, v in state.items() if k in expected}
    assert all(torch.equal(loaded[k], expected[k]) for k in expected), "the resumed weights are the saved ones"
    record = {
        "model_bytes": model_bytes,
        "before": before,
        "after_build": after_build,
        "after_save": after_save,
        "after_resume": peak_rss_bytes(),
    }
    (out / f"rank_{rank}.json").write_text(json.dumps(record))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
    os._exit(0)
