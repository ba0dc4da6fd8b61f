"""The loss without the whole batch's logits (trainer/loss.py): the plain loss and its gradients, in a fraction of
the memory."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tests.allocations import LiveBytes
from trainer.loss import CHUNK_ELEMENTS, IGNORE_INDEX, OutputHead, linear_cross_entropy
from trainer.memory import LOSS_BYTES_PER_CHUNK_ELEMENT, LOSS_CHUNK_ELEMENTS


def plain_loss(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy((hidden @ weight.T).float(), targets)


def loss_and_grads(loss_fn, hidden, weight, targets):  # noqa: ANN001, ANN201
    hidden, weight = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
    with LiveBytes() as held:
        loss = loss_fn(hidden, weight, targets)
        grads = torch.autograd.grad(loss, (hidden, weight))
    return loss, grads, held.peak


def test_the_chunked_loss_at_8192_tokens_of_a_32k_vocabulary_holds_about_one_bf16_logits() -> None:
    tokens, vocab, width = 8192, 32768, 32
    torch.manual_seed(0)
    hidden = torch.randn(tokens, width, dtype=torch.bfloat16)
    weight = (torch.randn(vocab, width) / width**0.5).to(torch.bfloat16)
    _, _, peak = loss_and_grads(linear_cross_entropy, hidden, weight, torch.randint(0, vocab, (tokens,)))
    # Measured: 1.00x (one chunk's fp32 logits and logsumexp's temporary, in backward); the plain eager form 6.0x
    assert peak <= 1.5 * tokens * vocab * 2, f"{peak / (tokens * vocab * 2):.2f}x the bf16 logits"
    expected = LOSS_BYTES_PER_CHUNK_ELEMENT * LOSS_CHUNK_ELEMENTS + 2 * tokens * width  # the memory estimate's term
    assert abs(peak - expected) <= 0.1 * expected, (peak, expected)


def test_the_chunked_loss_has_the_plain_loss_and_gradients_in_bf16() -> None:
    tokens, vocab, width = 1024, 8192, 64
    torch.manual_seed(0)
    hidden = torch.randn(tokens, width, dtype=torch.bfloat16)
    weight = (torch.randn(vocab, width) / width**0.5).to(torch.bfloat16)
    targets = torch.randint(0, vocab, (tokens,))

    def chunked(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return linear_cross_entropy(hidden, weight, targets, chunk_elements=100 * vocab)  # 11 chunks, the last short

    loss, grads, peak = loss_and_grads(chunked, hidden, weight, targets)
    plain, plain_grads, plain_peak = loss_and_grads(plain_loss, hidden, weight, targets)
    _, exact_grads, _ = loss_and_grads(plain_loss, hidden.float(), weight.float(), targets)
    assert peak < plain_peak / 3
    torch.testing.assert_close(loss, plain, rtol=1e-5, atol=0)
    for name, ours, theirs, truth in zip(("hidden", "weight"), grads, plain_grads, exact_grads, strict=True):
        torch.testing.assert_close(ours, theirs, msg=f"d loss / d {name}")  # bf16 tolerances: the same gradients
        ours_error, theirs_error = (ours.float() - truth).norm(), (theirs.float() - truth).norm()
        assert ours_error <= 1.01 * theirs_error, f"d loss / d {name}: {ours_error} from fp32, plain {theirs_error}"


def test_the_memory_estimate_knows_the_loss_chunk() -> None:
    assert LOSS_CHUNK_ELEMENTS == CHUNK_ELEMENTS


def test_the_output_head_gives_logits_without_targets_and_the_chunked_loss_with_them() -> None:
    torch.manual_seed(1)
    head = OutputHead(16, 500, bias=False)
    hidden, targets = torch.randn(3, 40, 16, requires_grad=True), torch.randint(0, 500, (3, 40))
    assert torch.equal(head(hidden), F.linear(hidden, head.weight))
    chunked = torch.autograd.grad(
        linear_cross_entropy(hidden, head.weight, targets, chunk_elements=7 * 500), (hidden, head.weight)
    )
    with head.loss_against(targets):
        loss = head(hidden)  # one chunk holds them all: the plain form
    assert head.targets is None
    torch.testing.assert_close(loss, plain_loss(hidden.view(-1, 16), head.weight, targets.view(-1)))
    for ours, plain in zip(chunked, torch.autograd.grad(loss, (hidden, head.weight)), strict=True):
        torch.testing.assert_close(ours, plain, rtol=1e-5, atol=1e-7)  # fp32: 18 chunks of 7 rows, the same sums


def test_ignored_targets_in_many_chunks_have_the_plain_loss_and_gradients() -> None:
    """IGNORE_INDEX (-100) as F.cross_entropy takes it: the mean over the other targets, no gradient from the
    ignored rows, whatever the chunking (before: 24.59 against 29.51 with 50 of 300 ignored)."""
    tokens, vocab, width = 300, 500, 16
    torch.manual_seed(2)
    hidden, weight = torch.randn(tokens, width) * 4, torch.randn(vocab, width)
    targets = torch.randint(0, vocab, (tokens,))
    targets[torch.randperm(tokens)[:50]] = IGNORE_INDEX

    def chunked(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return linear_cross_entropy(hidden, weight, targets, chunk_elements=7 * vocab)  # 43 chunks of 7 rows

    loss, grads, _ = loss_and_grads(chunked, hidden, weight, targets)
    plain, plain_grads, _ = loss_and_grads(plain_loss, hidden, weight, targets)
    torch.testing.assert_close(loss, plain, rtol=1e-5, atol=0)
    for name, ours, theirs in zip(("hidden", "weight"), grads, plain_grads, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6, msg=f"d loss / d {name}")
    assert grads[0][targets == IGNORE_INDEX].abs().max() == 0
