"""The memory estimate's constants at the target shape: Llama 3.1 8B's geometry (hidden 4,096, MLP 14,336, 8 KV
heads, vocabulary 128,256, an untied output layer) with a few blocks, on one GPU, as the trainer builds and steps it.

Run as `torchrun --nproc-per-node 1 -m bench.estimate_probe LAYERS BATCH SEQ_LEN CHECKPOINTING [VOCAB HIDDEN INNER]`
(bench/gpu_check.py; the last three shrink it for a CPU dry run). The model is spread under fsdp
(trainer/parallel.py), takes three steps on random tokens (the loss, backward, clipping, fused AdamW), and the
process prints one JSON line: the peak allocated and reserved GiB (torch.cuda's counters; on a CPU none) beside
trainer/memory.py's estimate for the same shape and settings, part by part. Random tokens: the memory does not
depend on what they say, and no tokenizer of 128k entries can be staged here.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict

import torch
import torch.distributed as dist

from trainer.memory import GIB, estimate, model_shape
from trainer.parallel import parallelize


def main(
    layers: int,
    batch: int,
    seq_len: int,
    checkpointing: str,
    vocab: int = 128256,
    hidden: int = 4096,
    inner: int = 14336,
) -> None:
    from transformers import AutoConfig

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    config = AutoConfig.for_model(
        "llama",
        num_hidden_layers=layers,
        hidden_size=hidden,
        intermediate_size=inner,
        num_attention_heads=hidden // 128 or 1,
        num_key_value_heads=max(1, hidden // 512),
        vocab_size=vocab,
        max_position_embeddings=seq_len,
        tie_word_embeddings=False,
    )
    parallel = parallelize(config, "fsdp", device, seed=1, local_world=1, activation_checkpointing=checkpointing)
    optimizer = torch.optim.AdamW(parallel.model.parameters(), lr=1e-4, fused=True)
    tokens = torch.randint(0, vocab, (batch, seq_len + 1), device=device)
    for _ in range(3):
        with parallel.compute_precision(device):
            loss = parallel.forward_loss(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        parallel.clip_grad_norm(1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    need = estimate(model_shape(config), "fsdp", 1, 1, batch, seq_len, checkpointing)
    measured = {
        "allocated_gib": torch.cuda.max_memory_allocated(device) / GIB if cuda else None,
        "reserved_gib": torch.cuda.max_memory_reserved(device) / GIB if cuda else None,
    }
    print(
        json.dumps(
            {
                **measured,
                "estimate_gib": need.total / GIB,
                "estimate_allocated_gib": need.allocated / GIB,
                "parts_gib": {k: v / GIB for k, v in asdict(need).items()},
                "loss": loss.item(),
                "device": torch.cuda.get_device_name(device) if cuda else "cpu",
            }
        )
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    layers, batch, seq_len, checkpointing, *rest = sys.argv[1:]
    main(int(layers), int(batch), int(seq_len), checkpointing, *map(int, rest))
