"""What a training run needs in each GPU's memory, estimated from the model's shapes before anything is allocated.

The preflight's `gpu-memory` check compares it with the instance type's GPU memory before a job is created, and the
trainer logs it at start beside the device's real free memory (bench/gpu_check.sh compares it with the measured
peak). It is an estimate, made of four parts:

    weights      fp32, 4 bytes a parameter: all of them under ddp, 1/N of them under fsdp and hsdp (N: the ranks a
                 parameter is sharded over: every rank for fsdp, a node's GPUs for hsdp)
    gradients    fp32, 4 bytes a parameter, sharded as the weights (DDP's gradients are views into its buckets)
    optimizer    AdamW's two fp32 moments, 8 bytes a parameter, sharded as the weights
    working set  what is not sharded: under ddp the bf16 copies autocast makes of the weights (2 bytes a
                 parameter); under fsdp and hsdp two blocks' bf16 weights all-gathered (the one computing and the
                 next, prefetched) and one block's fp32 gradients before their reduce-scatter
    activations  per micro-batch, bf16: what each block keeps for backward (`none`), only its input plus one
                 block's worth while it is recomputed (`full`), or the matmuls' outputs (`selective`); plus the
                 logits in bf16 and one 256 MB chunk of them in fp32 (trainer/loss.py)

Each block keeps, per token, about 2 bytes x (10 h + 3 i) without checkpointing (h the hidden size, i the MLP's
inner size: the norms' and attention's inputs and outputs, q, k, v, and the MLP's three inner tensors), and
2 bytes x (5 h + 3 i) of matmul outputs under selective checkpointing; SDPA keeps no attention matrix. The
CUDA caching allocator's fragmentation and NCCL's buffers are not in it: the check leaves 10% of the GPU free.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

GB = 10**9
LOGITS_FP32_CHUNK = 2**26 * 4  # trainer/loss.py's chunk of fp32 logits


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per GPU, by part."""

    weights: int
    gradients: int
    optimizer: int
    working_set: int
    activations: int

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.working_set + self.activations

    def describe(self) -> str:
        parts = ", ".join(f"{name} {getattr(self, name) / GB:.1f}" for name in
                          ("weights", "gradients", "optimizer", "working_set", "activations"))  # fmt: skip
        return f"{self.total / GB:.1f} GB per GPU ({parts.replace('_', ' ')} GB)"


@dataclass(frozen=True)
class ModelShape:
    """What the estimate needs of a model: counted on the meta device, nothing allocated."""

    parameters: int
    largest_block: int  # parameters of one transformer block
    layers: int
    hidden: int
    inner: int  # the MLP's inner size
    vocab: int


def model_shape(config: Any) -> ModelShape:
    """The shape of the transformers model `config` describes (built on the meta device)."""
    import torch

    from trainer.model import build_model
    from trainer.parallel import blocks

    with torch.device("meta"):
        model = build_model(config)
    block_sizes = [sum(p.numel() for p in block.parameters()) for block in blocks(model).values()]
    hidden = getattr(config, "hidden_size", None) or config.n_embd
    inner = getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * hidden
    return ModelShape(sum(p.numel() for p in model.parameters()), max(block_sizes), len(block_sizes), hidden, inner,
                      config.vocab_size)  # fmt: skip


def shard_ranks(parallelism: str, world: int, gpus_per_node: int) -> int:
    """Over how many ranks each parameter is split: 1 for ddp, every rank for fsdp on one node, a node's GPUs for
    hsdp (and for fsdp on several nodes, which becomes hsdp: trainer/parallel.py)."""
    if parallelism == "ddp":
        return 1
    if parallelism == "fsdp" and world <= gpus_per_node:
        return world
    return min(gpus_per_node, world)


def estimate(shape: ModelShape, parallelism: str, world: int, gpus_per_node: int, batch_size: int, seq_len: int,
             activation_checkpointing: str = "none") -> MemoryEstimate:  # fmt: skip
    """Bytes per GPU for one micro-batch of `batch_size` x `seq_len` tokens (see the module docstring)."""
    n = shard_ranks(parallelism, world, gpus_per_node)
    p = shape.parameters
    if parallelism == "ddp":
        working = 2 * p
    else:
        working = 2 * shape.largest_block * 2 + shape.largest_block * 4
    tokens = batch_size * seq_len
    kept_per_token = {"none": 2 * (10 * shape.hidden + 3 * shape.inner),
                      "selective": 2 * (5 * shape.hidden + 3 * shape.inner),
                      "full": 2 * shape.hidden}[activation_checkpointing]  # fmt: skip
    recomputed = 2 * (10 * shape.hidden + 3 * shape.inner) * tokens if activation_checkpointing != "none" else 0
    logits = 2 * tokens * shape.vocab + min(LOGITS_FP32_CHUNK, 4 * tokens * shape.vocab)
    activations = shape.layers * kept_per_token * tokens + recomputed + logits
    return MemoryEstimate(4 * p // n, 4 * p // n, 8 * p // n, working, activations)
