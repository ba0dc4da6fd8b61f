"""The causal-LM loss, computed without the whole batch's logits in fp32.

Under bf16 autocast the model's logits are bf16: batch x sequence x vocabulary of them (0.27 GB per micro-batch at
16 x 1024 x 8,192; 4.2 GB with a 128k vocabulary). Upcasting them all to fp32 for the softmax would double that and
keep the fp32 copy for backward. Here the rows go through the fp32 cross-entropy a chunk at a time, each chunk
recomputed in backward (activation checkpointing), so at most one chunk's fp32 logits exist at once. Under
torch.compile the plain form is used: inductor fuses the upcast into its softmax kernels and keeps no fp32 copy.
fp32 logits (training on a CPU) take the plain form too: there is no upcast to save.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

CHUNK_ELEMENTS = 2**26  # fp32 logits per chunk: 256 MB


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, chunk_elements: int = CHUNK_ELEMENTS) -> torch.Tensor:
    """The mean next-token cross-entropy (fp32) of `logits` [..., vocab] against `targets` [...]."""
    flat_logits, flat_targets = logits.reshape(-1, logits.size(-1)), targets.reshape(-1)
    if logits.dtype == torch.float32 or torch.compiler.is_compiling():
        return F.cross_entropy(flat_logits.float(), flat_targets)
    rows = max(1, chunk_elements // logits.size(-1))
    total = torch.zeros((), dtype=torch.float32, device=logits.device)
    for chunk, chunk_targets in zip(flat_logits.split(rows), flat_targets.split(rows), strict=True):
        total = total + checkpoint(_summed_cross_entropy, chunk, chunk_targets, use_reentrant=False)
    return total / flat_targets.numel()


def _summed_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float(), targets, reduction="sum")


class CausalLMLoss(torch.nn.Module):
    """The model and its loss as one module, so that DDP wraps, and torch.compile compiles, the loss too."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.model(input_ids=inputs, use_cache=False).logits  # no KV cache to build in training
        return cross_entropy(logits, targets)
