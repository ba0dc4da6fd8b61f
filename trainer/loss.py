"""The causal-LM loss, computed without the whole batch's logits.

The logits are tokens x vocabulary: 4.2 GB in bf16 for 16k tokens of a 128k vocabulary, twice that upcast to fp32
for the softmax, and autograd would keep them for backward. Here the output layer and the cross-entropy run
together, a chunk of tokens at a time (`linear_cross_entropy`): forward keeps only the hidden states, backward
computes each chunk's logits again and turns them into the gradients in place, so one chunk's logits (256 MB in
fp32) exist at a time, and the output layer's weight gradient is summed in fp32 over the chunks. The gradients are
the plain form's (tests/test_loss.py). Under torch.compile the plain form is used: inductor fuses the upcast into its
softmax kernels. A batch whose logits fit in one chunk takes the plain form too: there is nothing to save.

The output layer is an `OutputHead`: a Linear (same weight, same checkpoint key) that, while training, returns the
loss instead of the logits. Called once, as the model calls it, it is one FSDP forward (one all-gather of its
weight) and one backward (one reduce-scatter), however many chunks it runs. The val loss takes the same path, summed
(`summed_loss`), so evaluating holds no more than a training step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

CHUNK_ELEMENTS = 2**26  # fp32 logits per chunk: 256 MB
IGNORE_INDEX = -100  # a target that takes no part in the loss: F.cross_entropy's default ignore_index


class _LinearCrossEntropy(torch.autograd.Function):
    """sum over tokens of cross_entropy(hidden @ weight.T, targets), in fp32, `rows` tokens at a time."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")  # backward runs under the forward's autocast state (ddp on a GPU)
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, rows: int) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for h, t in zip(hidden.split(rows), targets.split(rows), strict=True):
            total += F.cross_entropy((h @ weight.T).float(), t, reduction="sum")
        ctx.save_for_backward(hidden, weight, targets)
        ctx.rows = rows
        return total

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx: Any, grad_total: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, targets = ctx.saved_tensors
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for start in range(0, hidden.size(0), ctx.rows):
            rows = slice(start, start + ctx.rows)
            h, t = hidden[rows], targets[rows]
            grad = (h @ weight.T).float()  # the chunk's logits, turned into d(loss)/d(logits) in place:
            grad -= grad.logsumexp(-1, keepdim=True)
            grad.exp_()  # softmax
            kept = t != IGNORE_INDEX
            grad[kept.nonzero().squeeze(1), t[kept]] -= 1.0
            grad *= kept.unsqueeze(1) * grad_total  # an ignored target's row has no gradient
            grad_hidden[rows] = grad.to(weight.dtype) @ weight
            grad_weight.addmm_(grad.T, h.float())
            del grad
        return grad_hidden, grad_weight.to(weight.dtype), None, None


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    chunk_elements: int = CHUNK_ELEMENTS,
    reduction: str = "mean",
) -> torch.Tensor:
    """The mean next-token cross-entropy (fp32) of the logits `hidden` [..., h] @ `weight` [vocab, h].T against
    `targets` [...], one chunk of at most `chunk_elements` fp32 logits at a time (the plain form when they all fit
    in one). Targets equal to `IGNORE_INDEX` take no part, as in `F.cross_entropy`: the mean is over the others.
    `reduction="sum"`: their sum instead, for a mean over several batches (the val loss)."""
    flat_hidden, flat_targets = hidden.reshape(-1, hidden.size(-1)), targets.reshape(-1)
    vocab = weight.size(0)
    if flat_targets.numel() * vocab <= chunk_elements:
        return plain_cross_entropy(F.linear(flat_hidden, weight), flat_targets, reduction)
    rows = max(1, chunk_elements // vocab)
    total = _LinearCrossEntropy.apply(flat_hidden, weight, flat_targets, rows)
    return total if reduction == "sum" else total / (flat_targets != IGNORE_INDEX).sum()


def plain_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1), reduction=reduction)


class OutputHead(torch.nn.Linear):
    """The model's output layer: the logits, as a Linear gives them; or, inside `loss_against(targets)`, the mean
    (or summed) loss over them, computed without them (`linear_cross_entropy`)."""

    targets: torch.Tensor | None = None
    reduction: str = "mean"
    chunk_elements: int = CHUNK_ELEMENTS  # fp32 logits per chunk (a test sets fewer to run many chunks)

    @contextlib.contextmanager
    def loss_against(self, targets: torch.Tensor, reduction: str = "mean") -> Iterator[None]:
        self.targets, self.reduction = targets, reduction
        try:
            yield
        finally:
            self.targets, self.reduction = None, "mean"

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.targets is None:
            return super().forward(hidden)
        assert self.bias is None, "the causal LMs built here have no output bias"
        return linear_cross_entropy(hidden, self.weight, self.targets, self.chunk_elements, self.reduction)


def with_output_head(model: torch.nn.Module) -> torch.nn.Module:
    """Replace the transformers model's output Linear with an `OutputHead` of the same shape (on the meta device,
    before the model has storage; the weight's name, and a tie to the input embedding, stay as they were)."""
    head = model.get_output_embeddings()
    new = OutputHead(
        head.in_features,
        head.out_features,
        bias=head.bias is not None,
        device=head.weight.device,
        dtype=head.weight.dtype,
    )
    model.set_output_embeddings(new)
    if model.config.tie_word_embeddings:
        model.tie_weights()
    return model


class CausalLMLoss(torch.nn.Module):
    """The model and its loss as one module, so that DDP wraps, and torch.compile compiles, the loss too. The model
    runs as a whole (FSDP's root unit sees its forward), its output head returning the loss instead of the logits;
    under torch.compile the plain form: inductor fuses the upcast into its softmax kernels."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return plain_cross_entropy(self.model(input_ids=inputs, use_cache=False).logits, targets)
        with self.model.get_output_embeddings().loss_against(targets):
            return self.model(input_ids=inputs, use_cache=False).logits  # no KV cache; the "logits" are the loss


def summed_loss(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The summed next-token cross-entropy (fp32) of a transformers causal LM over a batch, without the batch's logits
    (the val loss: a 128k vocabulary's logits of 4 x 1,024 tokens are 2 GB in fp32). A model whose output layer is an
    `OutputHead` runs whole, as in training (under FSDP the root's forward gathers every unit), the head returning
    the loss; a plain one (a published model as transformers loads it) runs its base model, and its output layer's
    weight goes through the same chunked loss: the same numbers either way."""
    head = model.get_output_embeddings()
    if isinstance(head, OutputHead):
        with head.loss_against(targets, reduction="sum"):
            return model(input_ids=inputs, use_cache=False).logits  # the "logits" are the loss
    assert head.bias is None, "the causal LMs evaluated here have no output bias"
    hidden = model.base_model(input_ids=inputs, use_cache=False).last_hidden_state
    return linear_cross_entropy(hidden, head.weight, targets, OutputHead.chunk_elements, "sum")
