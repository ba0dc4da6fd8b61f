"""What a training run needs in each GPU's memory, estimated from the model's shapes before anything is allocated.

The preflight's `gpu-memory` check compares it with the instance type's GPU memory before a job is created, and the
trainer logs it at start beside the device's real free memory (bench/gpu_check.sh compares it with the measured
peaks). All in GiB. It models what trainer/parallel.py and trainer/loss.py run, at the moment memory peaks: the end
of the forward, when every block's activations are kept and the loss's backward begins.

    weights      fp32, 4 bytes a parameter: all of them under ddp, 1/N of them under fsdp and hsdp (N: the ranks a
                 parameter is sharded over: every rank for fsdp, a node's GPUs for hsdp)
    gradients    fp32, 4 bytes a parameter, sharded as the weights (DDP's are views into its buckets). Gradient
                 accumulation adds nothing: fsdp reduce-scatters every micro-batch, hsdp keeps its partial sums in
                 place of the gradients, ddp accumulates in its buckets (tests/test_parallel.py measures it)
    optimizer    AdamW's two fp32 moments, 8 bytes a parameter, sharded as the weights
    working set  what is not sharded: under ddp the bf16 copies autocast makes of the weights (2 bytes a parameter);
                 under fsdp and hsdp two blocks' bf16 weights all-gathered (the one computing and the next,
                 prefetched) and the output unit (final norm and output layer: the root's embedding too when they
                 are tied) while its backward runs: bf16 weights, their gradient summed in fp32 and cast to bf16
                 (8 bytes a parameter)
    activations  per micro-batch, what the blocks keep for backward (per token and block, measured on CPU in bf16 at
                 small sizes, tests/test_memory.py: `none` 20h + 8i + 4kv + 4 heads bytes, `selective` 10h + 4i +
                 4kv + 4 heads, `full` 2h; h the hidden size, i the MLP's, kv the key/value width), one block's
                 whole set again while it is recomputed, and 8h outside the blocks (embedding output, final norm)
    loss         the loss's backward: one chunk's logits in fp32 and its softmax's temporary (8 bytes an element
                 of at most 2^26, trainer/loss.py) and the gradient of the hidden states
    reserve      the CUDA caching allocator's fragmentation and rounding: 10% of the rest

Checked against torchtitan's published Llama 3.1 8B figure (tests/test_memory.py); NCCL's buffers and the CUDA
context are not in it: the preflight leaves 10% of the GPU for them.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

GIB = 2**30
LOSS_CHUNK_ELEMENTS = 2**26  # trainer/loss.py's CHUNK_ELEMENTS (not imported: this module stays free of torch)
LOSS_BYTES_PER_CHUNK_ELEMENT = 8  # the chunk's fp32 logits, made the gradient in place, and logsumexp's temporary
ALLOCATOR_RESERVE = 0.10


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per GPU, by part."""

    weights: int
    gradients: int
    optimizer: int
    working_set: int
    activations: int
    loss: int

    @property
    def allocated(self) -> int:
        return sum(getattr(self, part.name) for part in fields(self))

    @property
    def reserve(self) -> int:
        return int(self.allocated * ALLOCATOR_RESERVE)

    @property
    def total(self) -> int:
        return self.allocated + self.reserve

    def describe(self) -> str:
        parts = ", ".join(f"{p.name.replace('_', ' ')} {getattr(self, p.name) / GIB:.1f}" for p in fields(self))
        return f"{self.total / GIB:.1f} GiB per GPU ({parts}, allocator reserve {self.reserve / GIB:.1f} GiB)"


@dataclass(frozen=True)
class ModelShape:
    """What the estimate needs of a model: counted on the meta device, nothing allocated."""

    parameters: int
    largest_block: int  # parameters of one transformer block
    layers: int
    hidden: int
    inner: int  # the MLP's inner size
    vocab: int
    heads: int = 0
    kv_width: int = 0  # the keys' (and values') width: hidden under multi-head attention, less under GQA
    output_unit: int = 0  # parameters gathered with the output layer: the final norm and it (and a tied embedding)
    largest_tensor: int = 0  # elements of the largest parameter: the largest piece a checkpoint is read in


def model_shape(config: Any) -> ModelShape:
    """The shape of the transformers model `config` describes (built on the meta device)."""
    import torch

    from trainer.model import build_model
    from trainer.parallel import blocks, output_units

    with torch.device("meta"):
        model = build_model(config)
    block_sizes = [sum(p.numel() for p in block.parameters()) for block in blocks(model).values()]
    hidden = getattr(config, "hidden_size", None) or config.n_embd
    inner = getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * hidden
    heads = getattr(config, "num_attention_heads", None) or config.n_head
    kv_width = hidden * (getattr(config, "num_key_value_heads", None) or heads) // heads
    output = {id(p): p.numel() for unit in output_units(model) for p in unit.parameters()}
    if config.tie_word_embeddings:  # the root unit: everything outside the blocks
        inside = {id(p) for block in blocks(model).values() for p in block.parameters()}
        output = {id(p): p.numel() for p in model.parameters() if id(p) not in inside}
    return ModelShape(
        sum(p.numel() for p in model.parameters()),
        max(block_sizes),
        len(block_sizes),
        hidden,
        inner,
        config.vocab_size,
        heads,
        kv_width,
        sum(output.values()),
        max(p.numel() for p in model.parameters()),
    )


def shard_ranks(parallelism: str, world: int, gpus_per_node: int) -> int:
    """Over how many ranks each parameter is split: 1 for ddp, every rank for fsdp on one node, a node's GPUs for
    hsdp (and for fsdp on several nodes, which becomes hsdp: trainer/parallel.py)."""
    if parallelism == "ddp":
        return 1
    if parallelism == "fsdp" and world <= gpus_per_node:
        return world
    return min(gpus_per_node, world)


def block_activation_bytes(shape: ModelShape, activation_checkpointing: str) -> int:
    """Bytes one block keeps for backward per token, in bf16 (the module docstring)."""
    h, i = shape.hidden, shape.inner
    attention = 4 * shape.kv_width + 4 * shape.heads  # keys and values, SDPA's fp32 log-sum-exp per head
    return {"none": 20 * h + 8 * i + attention, "selective": 10 * h + 4 * i + attention, "full": 2 * h}[
        activation_checkpointing
    ]


def estimate(
    shape: ModelShape,
    parallelism: str,
    world: int,
    gpus_per_node: int,
    batch_size: int,
    seq_len: int,
    activation_checkpointing: str = "none",
) -> MemoryEstimate:
    """Bytes per GPU for a micro-batch of `batch_size` x `seq_len` tokens (see the module docstring). Gradient
    accumulation's steps do not change it."""
    n = shard_ranks(parallelism, world, gpus_per_node)
    p = shape.parameters
    if parallelism == "ddp":
        working = 2 * p + 4 * shape.output_unit  # autocast's bf16 copies; the output layer's fp32 gradient in the loss
    else:
        working = 2 * 2 * shape.largest_block + 8 * shape.output_unit
    tokens = batch_size * seq_len
    activations = tokens * (shape.layers * block_activation_bytes(shape, activation_checkpointing) + 8 * shape.hidden)
    if activation_checkpointing != "none":
        activations += tokens * block_activation_bytes(shape, "none")
    loss = LOSS_BYTES_PER_CHUNK_ELEMENT * min(LOSS_CHUNK_ELEMENTS, tokens * shape.vocab) + 2 * tokens * shape.hidden
    return MemoryEstimate(4 * p // n, 4 * p // n, 8 * p // n, working, activations, loss)
