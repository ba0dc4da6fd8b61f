"""Evaluate a run's latest checkpoint on the held-out val split, against the same model untrained."""

from __future__ import annotations

import json
import logging
import math
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.nn.functional as F

from components.errors import InputError
from trainer.atomic import atomic_open, write_json
from trainer.checkpoint import CheckpointError, load_checkpoint
from trainer.data import load_split
from trainer.layout import DatasetPaths, RunPaths
from trainer.model import build_model, config_from_dict

log = logging.getLogger(__name__)


@dataclass
class EvalResult:
    run_id: str
    checkpoint: str
    step: int
    train_tokens_seen: int
    val_tokens: int
    val_loss: float
    val_perplexity: float
    untrained_val_loss: float
    loss_reduction: float  # untrained loss minus trained loss, in nats per token

    def markdown(self) -> str:
        return "\n".join(
            [
                f"# Evaluation of run `{self.run_id}`",
                "",
                f"Checkpoint `{self.checkpoint}` at step {self.step} ({self.train_tokens_seen:,} training tokens).",
                "",
                "| metric | trained | untrained |",
                "| --- | --- | --- |",
                f"| val loss (nats/token) | {self.val_loss:.4f} | {self.untrained_val_loss:.4f} |",
                f"| val perplexity | {self.val_perplexity:.2f} | {math.exp(self.untrained_val_loss):.2f} |",
                "",
                f"Evaluated on {self.val_tokens:,} held-out tokens; training lowered the loss by "
                f"{self.loss_reduction:.4f} nats/token.",
                "",
            ]
        )


def evaluate_checkpoint(
    storage_root: str, dataset: str, run_id: str, max_tokens: int = 65536, batch_size: int = 8
) -> EvalResult:
    if max_tokens <= 0 or batch_size <= 0:
        raise InputError(f"max tokens and batch size must be positive, got {max_tokens} and {batch_size}")
    try:
        run, data = RunPaths.of(storage_root, run_id), DatasetPaths.of(storage_root, dataset)
    except ValueError as exc:
        raise InputError(str(exc)) from None
    for required in (run.config, run.latest_checkpoint, data.meta):
        if not required.is_file():
            raise InputError(f"{required} does not exist: run {run_id!r} or dataset {dataset!r} is incomplete")
    try:
        state = load_checkpoint(run.latest_checkpoint)
    except CheckpointError as exc:
        raise InputError(str(exc)) from None
    config = json.loads(run.config.read_text())
    model_config = config_from_dict(config["model"])
    seq_len = config["trainer"]["seq_len"]
    val = load_split(data.tokenized, "val")
    if len(val) < seq_len + 1:
        raise InputError(
            f"dataset {dataset!r}: the val split has {len(val)} tokens, fewer than one sequence of {seq_len}"
        )

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = build_model(model_config)
    try:
        model.load_state_dict(state["model"])
    except RuntimeError as exc:
        raise InputError(
            f"checkpoint {run.latest_checkpoint} does not fit the model in {run.config} "
            f"(preset {state.get('preset')!r}): {str(exc).splitlines()[0]}"
        ) from None
    val_loss, n_tokens = mean_loss(model.to(device), val, seq_len, max_tokens, batch_size, device)
    torch.manual_seed(config["trainer"]["seed"])
    untrained_loss, _ = mean_loss(build_model(model_config).to(device), val, seq_len, max_tokens, batch_size, device)

    result = EvalResult(
        run_id=run_id,
        checkpoint=str(run.latest_checkpoint),
        step=int(state["step"]),
        train_tokens_seen=int(state["progress"]["tokens_seen"]),
        val_tokens=n_tokens,
        val_loss=round(val_loss, 6),
        val_perplexity=round(math.exp(val_loss), 4),
        untrained_val_loss=round(untrained_loss, 6),
        loss_reduction=round(untrained_loss - val_loss, 6),
    )
    write_json(run.eval_result, asdict(result))
    with atomic_open(run.eval_report, "w") as f:
        f.write(result.markdown())
    log.info(
        "run %s step %d: val loss %.4f (perplexity %.2f), untrained %.4f",
        run_id,
        result.step,
        val_loss,
        result.val_perplexity,
        untrained_loss,
    )
    return result


@torch.no_grad()
def mean_loss(
    model: torch.nn.Module, tokens: np.ndarray, seq_len: int, max_tokens: int, batch_size: int, device: torch.device
) -> tuple[float, int]:
    """Mean next-token cross-entropy over consecutive windows of the split, up to max_tokens targets."""
    model.eval()
    windows = min((len(tokens) - 1) // seq_len, max(1, max_tokens // seq_len))
    total, count = 0.0, 0
    for start in range(0, windows, batch_size):
        rows = np.stack(
            [tokens[w * seq_len : w * seq_len + seq_len + 1] for w in range(start, min(windows, start + batch_size))]
        ).astype(np.int64)
        batch = torch.from_numpy(rows).to(device)
        logits = model(input_ids=batch[:, :-1]).logits.float()
        total += F.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1), reduction="sum").item()
        count += batch[:, 1:].numel()
    return total / count, count
