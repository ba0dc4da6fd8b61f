"""Measure a checkpoint: which checkpoint and which snapshot, and the numbers over the val split of the models
loading.py builds (the checkpoint's, then the one the run started from); apart from the gate, reports and export
that only read them.

Mean loss, perplexity and bits per byte (tokenizer-independent: runs with different tokenizers compare) over up to
`max_tokens` val tokens, beside the same model untrained; greedy samples from fixed prompts for a person to read. bf16
on a GPU, fp32 on the CPU. A run trained on a mixture: each dataset on its own val split (up to `max_tokens` of each),
and the totals over them, weighted by the mixture's shares, as the trainer's --eval-every measures them. And what the
trainer's metrics rows say of the training: its throughput, its health marks and its own val loss at the step.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tokenizers import Tokenizer

from common.errors import InputError
from trainer.atomic import read_json_lines
from trainer.checkpoint import Checkpoint, checked, committed_checkpoints
from trainer.data import TokenSplit, load_meta, load_split
from trainer.errors import CheckpointError, DataError
from trainer.evaluation import TokenBytes, bits_per_byte, mean_loss, mixture_total
from trainer.layout import META, DatasetPaths, RunPaths
from trainer.snapshot import config_snapshot

log = logging.getLogger(__name__)

PROMPTS = ("The", "def ", "import ", "In the")
SAMPLE_TOKENS = 32


def run_snapshot(storage_root: str, config: dict[str, Any], run_id: str, dataset: str) -> Path:
    """The snapshot the run trained on (its config.json names it): its val split and tokenizer are the ones that
    measure this checkpoint, whatever was staged since. Of a mixture: its first dataset's."""
    trained_on, snapshot = config_snapshot(config)
    if trained_on != dataset:
        raise InputError(
            f"run {run_id!r} trained on dataset {trained_on!r}, not {dataset!r}: evaluate it with its own dataset"
        )
    return recorded_snapshot(storage_root, run_id, dataset, snapshot)


def recorded_snapshot(storage_root: str, run_id: str, dataset: str, snapshot: str) -> Path:
    """A snapshot a run's config.json names, refused in one line naming the dataset when it is gone."""
    try:
        directory = DatasetPaths.of(storage_root, dataset).resolve_snapshot(snapshot)
    except ValueError as exc:
        raise InputError(str(exc)) from None
    if directory is None or not (directory / META).is_file():
        raise InputError(
            f"run {run_id!r} trained on snapshot {snapshot} of dataset {dataset!r}, which is gone "
            f"({directory} has no {META}): it was pruned, or the run is incomplete"
        )
    return directory


def mixture_snapshots(storage_root: str, config: dict[str, Any], run_id: str) -> list[tuple[dict[str, Any], Path]]:
    """A mixture run's datasets as its config.json records them (dataset, snapshot, weight, share, train_tokens), in
    the mixture's order, each with the snapshot it trained on, whose val split measures the checkpoint on that
    dataset; [] for a run of one dataset."""
    return [
        (entry, recorded_snapshot(storage_root, run_id, entry["dataset"], entry["snapshot"]))
        for entry in (config.get("dataset") or {}).get("mixture") or []
    ]


def mixture_val_set(mixture: list[tuple[dict[str, Any], Path]]) -> str:
    """A mixture's val text's identity: a digest over each dataset's name, val set and share (in name order: the
    totals do not depend on the order), so a baseline compares only with a run evaluated on the same blend of the
    same datasets' val sets (the totals weigh each by its share; an evaluation from before they did has no share in
    its digest); "" when a dataset's val set was not recorded (staged before), as for one such dataset."""
    sets = {entry["dataset"]: load_meta(directory).get("val_set_sha256", "") for entry, directory in mixture}
    if not all(sets.values()):
        return ""
    shares = {entry["dataset"]: entry["share"] for entry, _ in mixture}
    blend = "".join(f"{name}\n{sets[name]}\n{shares[name]}\n" for name in sorted(sets))
    return hashlib.sha256(blend.encode()).hexdigest()


def mixture_weights(mixture: list[tuple[dict[str, Any], Path]]) -> dict[str, float]:
    """A mixture's weights by dataset, as its config.json records them (the trainer's own): they weigh the totals."""
    return {entry["dataset"]: entry["weight"] for entry, _ in mixture}


def val_split(snapshot_dir: Path, dataset: str, seq_len: int) -> TokenSplit:
    try:
        val = load_split(snapshot_dir, "val")
    except DataError as exc:
        raise InputError(str(exc)) from None
    if len(val) < seq_len + 1:
        raise InputError(
            f"dataset {dataset!r}: the val split has {len(val)} tokens, fewer than one sequence of {seq_len}"
        )
    return val


def total(
    measured: dict[str, tuple[float, int, int, float]], weights: dict[str, float]
) -> tuple[float, int, float, float]:
    """Several val splits' measures (dataset -> loss, tokens, bytes, the starting model's loss) as one, as the
    trainer's --eval-every totals a mixture's (trainer/evaluation.py mixture_total): the losses weighted by the
    mixture's `weights` (mixture_weights), the tokens measured, and the bytes the blend's tokens stand for, which
    give bits per byte. One split's are its own, exactly."""
    loss, tokens, n_bytes = mixture_total({name: m[:3] for name, m in measured.items()}, weights)
    untrained, _, _ = mixture_total({name: (u, t, b) for name, (_, t, b, u) in measured.items()}, weights)
    return loss, tokens, n_bytes, untrained


def dataset_results(
    mixture: list[tuple[dict[str, Any], Path]],
    measured: dict[str, tuple[float, int, int, float]],
    state: dict[str, Any],
    seq_len: int,
) -> list[dict[str, Any]]:
    """EvalResult.datasets: each dataset's share of the mixture, the tokens the checkpoint trained on from it (its
    trainer state's sequences, data.consumed) and the epochs they make of its train split (over its windows, as the
    trainer's metrics rows count them), and its own val figures. Tokens and epochs are None when the state does not
    record the dataset's sequences."""
    consumed = (state.get("data") or {}).get("consumed") or {}
    trained = int(state["progress"]["tokens_seen"])
    results = []
    for entry, directory in mixture:
        name = entry["dataset"]
        loss, tokens, n_bytes, untrained = measured[name]
        try:
            train = load_split(directory, "train")
        except DataError as exc:
            raise InputError(f"dataset {name!r}: {exc}") from None
        sequences = consumed.get(name)
        windows = train.num_windows(seq_len)
        results.append(
            {
                "dataset": name,
                "snapshot": directory.name,
                "weight": entry["weight"],
                "share": entry["share"],
                "tokens_trained": int(sequences) * seq_len if sequences is not None else None,
                "trained_fraction": round(int(sequences) * seq_len / trained, 6)
                if sequences is not None and trained
                else None,
                "epochs": round(int(sequences) / windows, 4) if sequences is not None and windows else None,
                "train_split_tokens": len(train),
                "val_set_sha256": load_meta(directory).get("val_set_sha256", ""),
                "val_tokens": tokens,
                "val_loss": round(loss, 6),
                "val_bits_per_byte": round(bits_per_byte(loss, tokens, n_bytes), 6),
                "untrained_val_loss": round(untrained, 6),
                "untrained_bits_per_byte": round(bits_per_byte(untrained, tokens, n_bytes), 6),
            }
        )
    return results


def find_checkpoint(run: RunPaths, checkpoint: str) -> Checkpoint:
    """'latest' (the newest committed: a damaged one is an error here, not a reason to measure an older one), or a
    step number: that step's checkpoint."""
    if checkpoint not in ("", "latest") and not checkpoint.isdigit():
        raise InputError(f"checkpoint {checkpoint!r}: give 'latest' or a step number")
    committed = committed_checkpoints(run.checkpoints)
    if checkpoint in ("", "latest"):
        found = committed[0] if committed else None
    else:
        found = next((c for c in committed if c.step == int(checkpoint)), None)
    if found is None:
        which = "any" if checkpoint in ("", "latest") else f"step {checkpoint}'s"
        raise InputError(
            f"{run.checkpoints} holds no committed checkpoint ({which}): run {run.root.name!r} is incomplete"
        )
    return checked(found)


def read_checkpoint(run: RunPaths, checkpoint: str) -> tuple[Checkpoint, dict[str, Any]]:
    """The checkpoint asked for (find_checkpoint) and its trainer state; its weights are read into the model
    (loading.py), and its optimizer state never."""
    try:
        found = find_checkpoint(run, checkpoint)
        return found, found.trainer_state()
    except CheckpointError as exc:
        raise InputError(str(exc)) from None


def measure_splits(
    model: torch.nn.Module,
    vals: dict[str, TokenSplit],
    seq_len: int,
    max_tokens: int,
    batch_size: int,
    device: torch.device,
    text_bytes: TokenBytes,
) -> dict[str, tuple[float, int, int]]:
    """One model's measure of each dataset over up to max_tokens of its val split: dataset -> (loss, tokens,
    bytes)."""
    try:
        return {
            name: mean_loss(model, split, seq_len, max_tokens, batch_size, device, text_bytes)
            for name, split in vals.items()
        }
    except DataError as exc:
        raise InputError(str(exc)) from None


def beside_start(
    trained: dict[str, tuple[float, int, int]], start: dict[str, tuple[float, int, int]]
) -> dict[str, tuple[float, int, int, float]]:
    """The trained model's measures with the starting model's loss over the same windows: dataset -> (loss,
    tokens, bytes, the starting model's loss)."""
    return {name: (*figures, start[name][0]) for name, figures in trained.items()}


@torch.no_grad()
def greedy_samples(model: torch.nn.Module, tokenizer: Tokenizer, device: torch.device) -> list[dict[str, str]]:
    samples = []
    for prompt in PROMPTS:
        ids = torch.tensor([tokenizer.encode(prompt).ids], device=device)
        for _ in range(SAMPLE_TOKENS):
            context = getattr(model.config, "n_positions", None) or model.config.max_position_embeddings
            window = ids[:, -context:]
            next_id = model(input_ids=window).logits[0, -1].argmax()
            ids = torch.cat([ids, next_id.view(1, 1)], dim=1)
        # the prompt is encoded as training saw a document ([BOS] text); the BOS is not part of the text
        samples.append({"prompt": prompt, "text": tokenizer.decode(ids[0].tolist(), skip_special_tokens=True)})
    return samples


def training_throughput(run: RunPaths) -> tuple[float | None, float | None]:
    """The training's median tokens/s and MFU over its logged steps (metrics.jsonl)."""
    rows = read_metrics(run)
    rates = [r["tokens_per_s"] for r in rows if r.get("tokens_per_s")]
    mfus = [r["mfu"] for r in rows if r.get("mfu") is not None]
    return (float(np.median(rates)) if rates else None, float(np.median(mfus)) if mfus else None)


def training_health(run: RunPaths) -> dict[str, Any]:
    """The health checks' marks in metrics.jsonl: the last count of skipped steps, and the spikes."""
    rows = read_metrics(run)
    skipped = max((int(r.get("skipped_steps", 0)) for r in rows), default=0)
    return {
        "skipped_steps": skipped,
        "loss_spikes": [{"step": r["step"], "loss": r["loss"]} for r in rows if r.get("loss_spike")],
    }


def training_eval(run: RunPaths, step: int) -> dict[str, Any] | None:
    """The trainer's own val figures at `step` (its --eval-every row, if it logged one), for the reports to show
    beside this evaluation's: the same weights, over the first --eval-tokens of each val split (config.json's
    eval_tokens) in training's batches. None when no row at that step measured the val loss."""
    row = next((r for r in reversed(read_metrics(run)) if r.get("step") == step and "val_loss" in r), None)
    if row is None:
        return None
    try:
        trainer = json.loads(run.config.read_text()).get("trainer", {})
    except (OSError, ValueError):
        trainer = {}
    return {
        "val_loss": row["val_loss"],
        "val_bits_per_byte": row.get("val_bpb"),
        "val_tokens": row.get("val_tokens"),
        "eval_tokens": trainer.get("eval_tokens"),
        "batch_size": trainer.get("batch_size"),
        "datasets": {name: d["val_loss"] for name, d in (row.get("datasets") or {}).items() if "val_loss" in d},
    }


def read_metrics(run: RunPaths) -> list[dict[str, Any]]:
    """Rank 0's metrics rows (metrics.jsonl), a row being appended as this reads skipped."""
    return read_json_lines(run.metrics)
