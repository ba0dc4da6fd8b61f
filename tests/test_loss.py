"""The loss without the whole batch's logits in fp32 (trainer/loss.py) is the fp32 loss, and so are its gradients."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from trainer.loss import cross_entropy


def test_the_chunked_loss_of_bf16_logits_equals_the_fp32_loss_and_keeps_one_chunk_in_fp32() -> None:
    torch.manual_seed(0)
    logits = (torch.randn(4, 96, 1000) * 3).to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, 1000, (4, 96))
    expected = F.cross_entropy(logits.float().view(-1, 1000), targets.view(-1))
    (expected_grad,) = torch.autograd.grad(expected, logits)

    upcasts: list[int] = []  # elements of each fp32 copy made from the logits, forward and backward
    original_float = torch.Tensor.float

    def counted_float(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.dtype == torch.bfloat16:
            upcasts.append(tensor.numel())
        return original_float(tensor)

    torch.Tensor.float = counted_float  # type: ignore[method-assign]
    try:
        chunked = cross_entropy(logits, targets, chunk_elements=50 * 1000)  # 50 rows a chunk: 8 chunks
        (chunked_grad,) = torch.autograd.grad(chunked, logits)
    finally:
        torch.Tensor.float = original_float  # type: ignore[method-assign]
    assert chunked.dtype == torch.float32
    torch.testing.assert_close(chunked, expected, rtol=1e-6, atol=0)
    torch.testing.assert_close(chunked_grad, expected_grad, rtol=1e-6, atol=0)
    assert max(upcasts) == 50 * 1000 and len(upcasts) == 2 * 8  # each chunk in forward, again in backward


def test_fp32_logits_take_the_plain_loss() -> None:
    logits, targets = torch.randn(2, 8, 50), torch.randint(0, 50, (2, 8))
    assert torch.equal(cross_entropy(logits, targets), F.cross_entropy(logits.view(-1, 50), targets.view(-1)))
