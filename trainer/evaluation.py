"""Loss on held-out text: one reader of the val windows for the evaluation step and the trainer's --eval-every.

Both measure the same windows the same way (the split's first windows, a batch at a time, mean next-token
cross-entropy in fp64, bits per byte from the bytes the target tokens stand for), so a val loss the trainer logged
at a step is the one the evaluation step reports for that step's checkpoint over the same tokens.
"""

from __future__ import annotations

import json
import math
import re
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F

from trainer.data import DataError, TokenSplit

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from trainer.config import TrainConfig


@torch.no_grad()
def mean_loss(
    model: torch.nn.Module,
    split: TokenSplit,
    seq_len: int,
    max_tokens: int,
    batch_size: int,
    device: torch.device,
    byte_lengths: np.ndarray,
) -> tuple[float, int, int]:
    """Mean next-token cross-entropy over the split's first windows (up to max_tokens targets), the number of
    targets, and the bytes of text they stand for. Windows are read a batch at a time from the shards. Leaves the
    model in eval mode; draws no random numbers."""
    model.eval()
    windows = min(split.num_windows(seq_len), max(1, max_tokens // seq_len))
    if windows == 0:
        raise DataError(f"the {split.name} split's {len(split.shards)} shard(s) hold no window of {seq_len + 1} tokens")
    total = torch.zeros((), dtype=torch.float64, device=device)
    count = n_bytes = 0
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    for start in range(0, windows, batch_size):
        inputs = torch.from_numpy(split.windows(np.arange(start, min(windows, start + batch_size)), seq_len))
        batch = inputs.to(device, non_blocking=True)
        with autocast:
            logits = model(input_ids=batch[:, :-1], use_cache=False).logits
        flat = logits.float().reshape(-1, logits.size(-1))
        total += F.cross_entropy(flat, batch[:, 1:].reshape(-1), reduction="sum")
        targets = inputs[:, 1:].numpy()
        count += targets.size
        n_bytes += int(byte_lengths[targets].sum())
    return total.item() / count, count, n_bytes


def bits_per_byte(loss: float, tokens: int, n_bytes: int) -> float:
    """Nats per token to bits per byte of text: comparable across tokenizers."""
    return loss * tokens / (n_bytes * math.log(2)) if n_bytes else float("nan")


BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")  # SentencePiece's byte fallback: one byte of text


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
            lengths[index] = len(token.replace("\u2581", " ").encode())
    return lengths


def validation(
    model: torch.nn.Module, val: dict[str, TokenSplit], byte_lengths: np.ndarray, cfg: TrainConfig, device: torch.device
) -> dict[str, Any]:
    """The trainer's --eval-every: the val loss over each split's first --eval-tokens tokens, as the evaluation step
    measures a checkpoint, in training batches; of a mixture, each dataset's too and the total over them all. No
    random numbers drawn and no training data read, so a run evaluated along the way trains exactly as one that is
    not."""
    training = model.training
    measured = {}
    for name, split in val.items():
        loss, tokens, n_bytes = mean_loss(
            model, split, cfg.seq_len, cfg.eval_tokens, cfg.batch_size, device, byte_lengths
        )
        measured[name] = (loss, tokens, n_bytes)
    model.train(training)
    tokens, n_bytes = sum(t for _, t, _ in measured.values()), sum(b for *_, b in measured.values())
    loss = (
        next(iter(measured.values()))[0]
        if len(measured) == 1
        else sum(loss * t for loss, t, _ in measured.values()) / tokens
    )
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
