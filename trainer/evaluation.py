"""Loss on held-out text: one reader of the val windows for the evaluation step and the trainer's --eval-every.

Both measure the same windows the same way (the split's first windows, a batch at a time, the summed next-token
cross-entropy through the chunked loss of trainer/loss.py, accumulated in fp64; bits per byte from the bytes of text
the target tokens stand for), so a val loss the trainer logged at a step is the one the evaluation step reports for
that step's checkpoint over the same tokens: the same numbers in fp32 (the CPU); on a GPU up to the precision each
computed in (bf16) and its batches. A mixture's total weights each dataset by its share of the mixture.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from trainer.data import TokenSplit
from trainer.errors import DataError
from trainer.loss import summed_loss
from trainer.snapshot import model_vocab

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from trainer.config import TrainConfig

WORD_MARK = "\u2581"  # SentencePiece's '▁': a space, or (prepended to a document's first word) no byte of the text


@dataclass(frozen=True)
class TokenBytes:
    """The bytes of text target tokens stand for (bits per byte's denominator): each token's own, less one for a
    document's first token when the tokenizer prepended its word mark to the document: that '▁' stands for no byte
    of the text (the decoder drops it), so without this a SentencePiece-style tokenizer counts a byte too many per
    document."""

    lengths: np.ndarray  # token id -> bytes ('▁' as a space)
    prepended: np.ndarray | None  # token id -> its piece begins with '▁'; None: the tokenizer prepends nothing
    separators: tuple[int, ...]  # the ids between documents (EOS, BOS): the token after one begins a document

    def of(self, windows: np.ndarray) -> int:
        """The bytes that the targets of `windows` (rows of seq_len + 1 tokens: inputs, then targets shifted by one)
        stand for."""
        targets = windows[:, 1:]
        n_bytes = int(self.lengths[targets].sum())
        if self.prepended is not None:
            n_bytes -= int((np.isin(windows[:, :-1], self.separators) & self.prepended[targets]).sum())
        return n_bytes


@torch.no_grad()
def mean_loss(
    model: torch.nn.Module,
    split: TokenSplit,
    seq_len: int,
    max_tokens: int,
    batch_size: int,
    device: torch.device,
    text_bytes: TokenBytes,
) -> tuple[float, int, int]:
    """Mean next-token cross-entropy over the split's first windows (up to max_tokens targets), the number of
    targets, and the bytes of text they stand for. Windows are read a batch at a time from the shards; no batch's
    whole logits are made (trainer/loss.py summed_loss). Leaves the model in eval mode; draws no random numbers."""
    model.eval()
    windows = min(split.num_windows(seq_len), max(1, max_tokens // seq_len))
    if windows == 0:
        raise DataError(f"the {split.name} split's {len(split.shards)} shard(s) hold no window of {seq_len + 1} tokens")
    total = torch.zeros((), dtype=torch.float64, device=device)
    count = n_bytes = 0
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    for start in range(0, windows, batch_size):
        rows = split.windows(np.arange(start, min(windows, start + batch_size)), seq_len)
        batch = torch.from_numpy(rows).to(device, non_blocking=True)
        with autocast:
            loss = summed_loss(model, batch[:, :-1], batch[:, 1:])
        total += loss
        count += rows[:, 1:].size
        n_bytes += text_bytes.of(rows)
    return total.item() / count, count, n_bytes


def bits_per_byte(loss: float, tokens: int, n_bytes: float) -> float:
    """Nats per token to bits per byte of text: comparable across tokenizers."""
    return loss * tokens / (n_bytes * math.log(2)) if n_bytes else float("nan")


BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")  # SentencePiece's byte fallback: one byte of text


def token_bytes(tokenizer: Tokenizer, meta: dict[str, Any]) -> TokenBytes:
    """The bytes of text the tokens of a snapshot (its meta.json: the model's vocabulary, BOS and EOS) stand for."""
    lengths = token_byte_lengths(tokenizer, model_vocab(meta))
    prepended = None
    if prepends_word_mark(json.loads(tokenizer.to_str())):
        prepended = np.zeros(len(lengths), dtype=bool)
        for token, index in tokenizer.get_vocab().items():
            if index < len(lengths) and lengths[index] and token.startswith(WORD_MARK):  # not a special token
                prepended[index] = True
    separators = tuple(i for i in (meta.get("bos_id"), meta["eos_id"]) if i is not None)
    return TokenBytes(lengths, prepended, separators)


def prepends_word_mark(spec: Any) -> bool:
    """Whether a tokenizer (its JSON) puts '▁' before the first word of what it encodes: a Metaspace pre-tokenizer
    with prepend_scheme first or always (add_prefix_space before tokenizers 0.14), or a Prepend normalizer (Llama
    2's); nested in a Sequence or not. A ByteLevel tokenizer's space is a byte of the text: it prepends nothing."""
    if isinstance(spec, list):
        return any(prepends_word_mark(each) for each in spec)
    if not isinstance(spec, dict):
        return False
    if spec.get("type") == "Metaspace":
        scheme = spec.get("prepend_scheme", "always" if spec.get("add_prefix_space", True) else "never")
        return scheme in ("first", "always")
    if spec.get("type") == "Prepend":
        return spec.get("prepend") == WORD_MARK
    return any(
        prepends_word_mark(spec.get(key)) for key in ("normalizer", "normalizers", "pre_tokenizer", "pretokenizers")
    )


def token_byte_lengths(tokenizer: Tokenizer, vocab_size: int) -> np.ndarray:
    """Bytes of text each token id stands for: a byte-level BPE token (GPT-2's, Llama 3's) is one mapped character
    per byte; in a SentencePiece-style vocabulary a byte-fallback token is one byte and '▁' is a space; special
    tokens (BOS, EOS) and ids past the tokenizer's (the model's padding) stand for none."""
    special = {t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special}
    byte_level = '"ByteLevel"' in json.dumps(json.loads(tokenizer.to_str()).get("decoder"))
    lengths = np.zeros(vocab_size, dtype=np.int64)
    for token, index in tokenizer.get_vocab().items():
        if index >= vocab_size or token in special:
            continue
        if byte_level:
            lengths[index] = len(token)
        elif BYTE_TOKEN.fullmatch(token):
            lengths[index] = 1
        else:
            lengths[index] = len(token.replace(WORD_MARK, " ").encode())
    return lengths


def mixture_total(
    measured: Mapping[str, tuple[float, int, int]], weights: Mapping[str, float]
) -> tuple[float, int, float]:
    """Several val splits' (loss, tokens, bytes) as one, each dataset weighted by its share of the mixture (`weights`,
    normalised here), as Megatron blends its validation data with the training weights; not by the val tokens
    measured, which are capped per dataset (--eval-tokens, max_tokens), so a 0.99/0.01 mixture would count its two
    datasets alike. The loss is the share-weighted mean; the tokens are those measured; the bytes are those the
    measured tokens stand for at the blend's bytes per token (each dataset's, share-weighted), so bits per byte is
    the blend's nats over its bytes. One split's figures are its own, exactly."""
    if len(measured) == 1:
        return next(iter(measured.values()))
    whole = sum(weights[name] for name in measured)
    shares = {name: weights[name] / whole for name in measured}
    tokens = sum(t for _, t, _ in measured.values())
    loss = sum(shares[name] * each for name, (each, _, _) in measured.items())
    bytes_per_token = sum(shares[name] * b / t for name, (_, t, b) in measured.items())
    return loss, tokens, tokens * bytes_per_token


def validation(
    model: torch.nn.Module,
    val: dict[str, TokenSplit],
    text_bytes: TokenBytes,
    cfg: TrainConfig,
    device: torch.device,
    weights: Mapping[str, float],
) -> dict[str, Any]:
    """The trainer's --eval-every: the val loss over each split's first --eval-tokens tokens, as the evaluation step
    measures a checkpoint, in training batches; of a mixture (`weights`: each dataset's), each dataset's too and the
    total over them all, weighted by the mixture's shares. No random numbers drawn and no training data read, so a
    run evaluated along the way trains exactly as one that is not."""
    training = model.training
    measured = {
        name: mean_loss(model, split, cfg.seq_len, cfg.eval_tokens, cfg.batch_size, device, text_bytes)
        for name, split in val.items()
    }
    model.train(training)
    loss, tokens, n_bytes = mixture_total(measured, weights)
    row: dict[str, Any] = {"val_loss": loss, "val_bpb": bits_per_byte(loss, tokens, n_bytes), "val_tokens": tokens}
    if len(val) > 1:
        row["datasets"] = {
            name: {"val_loss": loss, "val_bpb": bits_per_byte(loss, t, b)} for name, (loss, t, b) in measured.items()
        }
    return row


def merge_rows(row: dict[str, Any], more: dict[str, Any]) -> dict[str, Any]:
    """`row` with `more`'s fields, each dataset's figures (row["datasets"]) merged rather than replaced."""
    datasets = {
        name: {**row.get("datasets", {}).get(name, {}), **figures} for name, figures in more.pop("datasets", {}).items()
    }
    merged = row | more
    if datasets:
        merged["datasets"] = {**row.get("datasets", {}), **datasets}
    return merged
