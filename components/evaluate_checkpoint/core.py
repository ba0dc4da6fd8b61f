"""Evaluate a run's checkpoint on the held-out val split: numbers, a quality gate, reports, and an export.

- Numbers: mean loss, perplexity and bits per byte (tokenizer-independent: runs with different tokenizers
  compare) over up to `max_tokens` val tokens, beside the same model untrained; greedy samples from fixed
  prompts for a person to read. bf16 on a GPU, fp32 on the CPU. A run trained on a mixture: each dataset on its own
  val split (up to `max_tokens` of each), and the totals over them, as the trainer's --eval-every measures them.
- Gate: an absolute ceiling on the val loss and/or no worse than a baseline run's evaluation plus a
  margin in bits per byte (which survive a change of tokenizer); the baseline is a run id or "previous" (the
  newest other run of the same dataset evaluated on the same fixed val set; any other is refused), at its newest
  evaluated step unless a step is named; the verdict names the baseline's run and step. A failed gate fails the
  step with the numbers, or only warns.
- Reports: every evaluation is kept, per checkpoint: eval/step_<N>/{eval.json,report.md,report.html} (the eval
  table beside the untrained model and the baseline; plots of loss with checkpoints, resumes and the baseline's
  curves, learning rate, gradient norm and throughput as embedded PNGs; the run's settings; the samples), a line
  in eval/history.jsonl, and a copy of the newest step's files at eval/eval.json, report.md and report.html, where
  readers looked before evaluations were kept.
- Export: the model in Hugging Face format (safetensors) with its tokenizer under <run>/export/, and
  export/export.json saying which checkpoint it holds: the evaluated one, which need not be the newest evaluated
  (evaluate --checkpoint N replaces the export, while eval/eval.json keeps the newest step's evaluation).
"""

from __future__ import annotations

import base64
import fcntl
import hashlib
import html
import io
import json
import logging
import math
import shutil
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tokenizers import Tokenizer

from common.errors import InputError, StepFailed
from components.evaluate_checkpoint.inputs import check_inputs
from trainer.atomic import atomic_open, atomic_path, file_mode, read_json_lines, replace_dir, write_json
from trainer.checkpoint import (
    Checkpoint,
    CheckpointError,
    checked,
    committed_checkpoints,
    read_weights,
)
from trainer.data import DataError, TokenSplit, load_meta, load_split
from trainer.evaluation import bits_per_byte, mean_loss, token_byte_lengths
from trainer.layout import CHECKPOINT_COMMIT, META, TOKENIZER, DatasetPaths, RunPaths
from trainer.model import build_model, config_from_dict
from trainer.snapshot import config_snapshot, model_vocab
from trainer.tracking import record_outcome

log = logging.getLogger(__name__)

PROMPTS = ("The", "def ", "import ", "In the")
SAMPLE_TOKENS = 32
PREVIOUS = "previous"


@dataclass
class Gate:
    max_val_loss: float = 0.0  # 0: no ceiling
    baseline_run_id: str = ""  # a run id, "previous", or "" for none
    baseline_margin: float = 0.0  # bits per byte the run may exceed the baseline's by
    baseline_step: int = 0  # the baseline's evaluation of this step; 0: its newest evaluated step
    warn_only: bool = False


@dataclass(frozen=True)
class Baseline:
    """The evaluation a run is gated against: whose, of which step, and why that step (for the verdict's words)."""

    run_id: str
    step: int
    evaluation: dict[str, Any]
    which: str  # "its newest evaluation" (and of a newer checkpoint not evaluated, if so) or "as asked"


@dataclass
class EvalResult:
    run_id: str
    checkpoint: str
    step: int
    train_tokens_seen: int
    val_tokens: int
    val_loss: float
    val_perplexity: float
    val_bits_per_byte: float
    untrained_val_loss: float
    untrained_bits_per_byte: float | None  # the same windows' bytes: None in evaluations from before it was kept
    loss_reduction: float  # untrained loss minus trained loss, in nats per token
    train_tokens_per_s: float | None
    train_mfu: float | None
    gate_passed: bool = True
    gate_reasons: list[str] = field(default_factory=list)
    baseline_run_id: str = ""
    baseline_step: int | None = None  # the step of the baseline's evaluation the gate compared with
    baseline_val_loss: float | None = None
    baseline_bits_per_byte: float | None = None
    dataset: str = ""
    snapshot: str = ""  # the dataset snapshot the run trained on, and whose val split this evaluation read
    val_set_sha256: str = ""  # the val text's identity (files, sizes, checksums): evaluations with the same compare
    tokenizer_sha256: str = ""
    samples: list[dict[str, str]] = field(default_factory=list)
    start: str = "untrained"  # what the run started from, the "untrained" columns' model: random weights, or a
    # published model (trainer/published.py), whose loss shows what the continued pretraining gained or lost
    skipped_steps: int = 0  # training steps whose update was skipped: the loss or gradient norm was not finite
    loss_spikes: list[dict[str, float]] = field(default_factory=list)  # logged steps marked as spikes (step, loss)
    export_dir: str = ""
    export_step: int | None = None  # the step this evaluation exported; export/export.json: what it holds now
    export_s3_uri: str = ""
    evaluated_at: str = ""  # UTC, ISO 8601: orders the history's evaluations of the same step
    report_dir: str = ""  # eval/step_<N>/: this evaluation's own files, whatever is evaluated after
    parameters: int = 0  # the model's weights (tied ones once)
    train_split_tokens: int = 0  # the snapshot's train split (a mixture's: all its datasets'): gives the epochs
    # A mixture's datasets (dataset_results), in its order; the val figures above are then their totals (the
    # token-weighted mean loss; bits per byte of the summed nats and bytes). [] for a run of one dataset.
    datasets: list[dict[str, Any]] = field(default_factory=list)

    def metrics(self) -> dict[str, float]:
        values = {
            "val_loss": self.val_loss,
            "val_perplexity": self.val_perplexity,
            "val_bits_per_byte": self.val_bits_per_byte,
            "train_tokens_seen": self.train_tokens_seen,
            "untrained_val_loss": self.untrained_val_loss,
            "val_tokens": self.val_tokens,
            "train_tokens_per_s": self.train_tokens_per_s,
            "train_mfu": self.train_mfu,
            "gate_passed": float(self.gate_passed),
        }
        values |= {f"val_loss_{d['dataset']}": d["val_loss"] for d in self.datasets}
        return {k: float(v) for k, v in values.items() if v is not None}

    def table_columns(self) -> list[str]:
        baseline = [f"baseline {self.baseline_run_id} at step {self.baseline_step}"] if self.has_baseline() else []
        return ["metric", "trained", self.start, *baseline]

    def has_baseline(self) -> bool:
        return self.baseline_val_loss is not None and self.baseline_bits_per_byte is not None

    def table_rows(self) -> list[tuple[str, ...]]:
        """Loss, perplexity and bits per byte of the trained model, the untrained one and the baseline (if any)."""
        bpb = self.untrained_bits_per_byte
        untrained_bpb = f"{bpb:.4f}" if bpb is not None else NOT_RECORDED
        rows: list[tuple[str, ...]] = [
            ("val loss (nats/token)", f"{self.val_loss:.4f}", f"{self.untrained_val_loss:.4f}"),
            ("val perplexity", f"{self.val_perplexity:.2f}", f"{math.exp(self.untrained_val_loss):.2f}"),
            ("val bits per byte", f"{self.val_bits_per_byte:.4f}", untrained_bpb),
        ]
        if not self.has_baseline():
            return rows
        theirs = (
            f"{self.baseline_val_loss:.4f}",
            f"{math.exp(self.baseline_val_loss):.2f}",
            f"{self.baseline_bits_per_byte:.4f}",
        )
        return [(*row, value) for row, value in zip(rows, theirs, strict=True)]

    def dataset_columns(self) -> list[str]:
        return ["dataset", "share", "tokens trained", "epochs", "val loss", "val bits per byte", f"{self.start} loss"]

    def dataset_rows(self) -> list[tuple[str, ...]]:
        """Each dataset of a mixture: its share of the mixture, the tokens trained on from it (and their fraction of
        all trained) and the epochs they make of its train split, its own val figures and the starting model's."""
        rows = []
        for d in self.datasets:
            tokens = NOT_RECORDED if d["tokens_trained"] is None else f"{d['tokens_trained']:,}"
            if d["tokens_trained"] is not None and d["trained_fraction"] is not None:
                tokens += f" ({d['trained_fraction']:.1%})"
            rows.append(
                (
                    d["dataset"],
                    f"{d['share']:.1%}",
                    tokens,
                    f"{d['epochs']:.2f}" if d["epochs"] is not None else NOT_RECORDED,
                    f"{d['val_loss']:.4f}",
                    f"{d['val_bits_per_byte']:.4f}",
                    f"{d['untrained_val_loss']:.4f}",
                )
            )
        return rows

    def gate_line(self) -> str:
        if not self.gate_reasons:
            return "Gate: none set."
        return f"Gate: {'passed' if self.gate_passed else 'FAILED'} ({'; '.join(self.gate_reasons)})."

    def markdown(self) -> str:
        return "\n".join(
            [
                f"# Evaluation of run `{self.run_id}`",
                "",
                f"Checkpoint `{self.checkpoint}` at step {self.step} ({self.train_tokens_seen:,} training tokens).",
                "",
                "| " + " | ".join(self.table_columns()) + " |",
                "|" + " --- |" * len(self.table_columns()),
                *("| " + " | ".join(row) + " |" for row in self.table_rows()),
                "",
                f"Evaluated on {self.val_tokens:,} held-out tokens{self.totals_note()}; training lowered the loss by "
                f"{self.loss_reduction:.4f} nats/token. {self.gate_line()}",
                "",
                *(
                    [
                        "Per dataset:",
                        "",
                        "| " + " | ".join(self.dataset_columns()) + " |",
                        "|" + " --- |" * len(self.dataset_columns()),
                        *("| " + " | ".join(row) + " |" for row in self.dataset_rows()),
                        "",
                    ]
                    if self.datasets
                    else []
                ),
                self.health_line(),
                "",
                *([self.export_line(), ""] if self.export_dir else []),
                *(["## Samples", "", "Greedy continuations of each prompt:", ""] if self.samples else []),
                *(f"- **{s['prompt']!r}**: {s['text']!r}" for s in self.samples),
            ]
        )

    def totals_note(self) -> str:
        """What the val figures of a mixture are: totals over each dataset's val split."""
        if not self.datasets:
            return ""
        return (
            f" of the {len(self.datasets)} datasets' val splits (the figures are their totals, the loss their "
            "token-weighted mean)"
        )

    def export_line(self) -> str:
        """Which weights the export holds: an evaluation of another checkpoint replaces them later."""
        uploaded = f" and to {self.export_s3_uri}" if self.export_s3_uri else ""
        return (
            f"Exported step {self.export_step}'s weights to `{self.export_dir}`{uploaded} ({EXPORT_RECORD} there "
            "names the step it holds now)."
        )

    def health_line(self) -> str:
        """What the trainer's health checks saw (trainer/health.py): skipped steps and loss spikes."""
        spikes = ", ".join(f"step {s['step']} ({s['loss']:.3f})" for s in self.loss_spikes[:10])
        more = f" and {len(self.loss_spikes) - 10} more" if len(self.loss_spikes) > 10 else ""
        return (
            f"Training health: {self.skipped_steps} step(s) skipped for a non-finite loss or gradient norm; "
            f"{len(self.loss_spikes)} loss spike(s){': ' + spikes + more if spikes else ''}."
        )


# -- evaluation -------------------------------------------------------------------------------------------


def evaluate_checkpoint(
    storage_root: str,
    dataset: str,
    run_id: str,
    max_tokens: int = 65536,
    batch_size: int = 8,
    checkpoint: str = "latest",
    gate: Gate | None = None,
    export: bool = True,
    export_s3_uri: str = "",
    s3_endpoint_url: str = "",
) -> EvalResult:
    gate = gate or Gate()
    check_inputs(max_tokens, batch_size, export, export_s3_uri)
    try:
        run = RunPaths.of(storage_root, run_id)
        DatasetPaths.of(storage_root, dataset)
    except ValueError as exc:
        raise InputError(str(exc)) from None
    if not run.config.is_file():
        raise InputError(f"{run.config} does not exist: run {run_id!r} is incomplete")
    config = json.loads(run.config.read_text())
    snapshot_dir = run_snapshot(storage_root, config, run_id, dataset)
    meta = load_meta(snapshot_dir)
    mixture = mixture_snapshots(storage_root, config, run_id)
    val_set = mixture_val_set(mixture) if mixture else meta.get("val_set_sha256", "")
    baseline = find_baseline(storage_root, dataset, run_id, gate.baseline_run_id, val_set, gate.baseline_step)
    try:
        found = find_checkpoint(run, checkpoint)
        state = found.trainer_state()
        weights = read_weights(found)  # the optimizer state is never read
    except CheckpointError as exc:
        raise InputError(str(exc)) from None
    path = found.path
    model_config = config_from_dict(config["model"])
    seq_len = config["trainer"]["seq_len"]
    snapshots = {entry["dataset"]: directory for entry, directory in mixture} or {dataset: snapshot_dir}
    vals = {name: val_split(directory, name, seq_len) for name, directory in snapshots.items()}

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = build_model(model_config)
    try:
        model.load_state_dict(weights)
    except RuntimeError as exc:
        raise InputError(
            f"checkpoint {path} does not fit the model in {run.config} (preset "
            f"{state.get('preset')!r}): {str(exc).splitlines()[0]}"
        ) from None
    model.to(device)
    tokenizer = Tokenizer.from_file(str(snapshot_dir / TOKENIZER))  # a mixture's datasets share it
    byte_lengths = token_byte_lengths(tokenizer, model_vocab(meta))
    start, started_from = starting_model(model_config, config)
    start.to(device)
    try:  # up to max_tokens of each dataset's val split
        measured = {
            name: measure(model, start, split, seq_len, max_tokens, batch_size, device, byte_lengths)
            for name, split in vals.items()
        }
    except DataError as exc:
        raise InputError(str(exc)) from None
    val_loss, n_tokens, n_bytes, untrained = total(list(measured.values()))
    throughput = training_throughput(run)
    result = EvalResult(
        run_id=run_id,
        checkpoint=str(path),
        step=int(state["step"]),
        train_tokens_seen=int(state["progress"]["tokens_seen"]),
        val_tokens=n_tokens,
        val_loss=round(val_loss, 6),
        val_perplexity=round(math.exp(val_loss), 4),
        val_bits_per_byte=round(bits_per_byte(val_loss, n_tokens, n_bytes), 6),
        start=started_from,
        untrained_val_loss=round(untrained, 6),
        untrained_bits_per_byte=round(bits_per_byte(untrained, n_tokens, n_bytes), 6),
        loss_reduction=round(untrained - val_loss, 6),
        train_tokens_per_s=throughput[0],
        train_mfu=throughput[1],
        **training_health(run),
        samples=greedy_samples(model, tokenizer, device),
        dataset=dataset,
        snapshot=snapshot_dir.name,
        val_set_sha256=val_set,
        tokenizer_sha256=meta.get("tokenizer_sha256", ""),
        evaluated_at=datetime.now(UTC).isoformat(timespec="seconds"),
        report_dir=str(run.eval_step(int(state["step"]))),
        parameters=sum(p.numel() for p in model.parameters()),
        train_split_tokens=int(meta.get("tokens", {}).get("train", 0)),
    )
    if mixture:
        result.datasets = dataset_results(mixture, measured, state, seq_len)
        result.train_split_tokens = sum(d["train_split_tokens"] for d in result.datasets)
    apply_gate(result, gate, baseline)
    if export:
        dtype = (config.get("init_from") or {}).get("dtype", "float32")  # a published model's, kept
        exported = export_model(model, snapshot_dir, run.root / "export", export_record(result), dtype)
        result.export_dir, result.export_step = str(exported), result.step
    if export_s3_uri:
        from common.s3 import S3Settings, upload_directory

        upload_directory(Path(result.export_dir), export_s3_uri, S3Settings(endpoint_url=s3_endpoint_url))
        result.export_s3_uri = export_s3_uri
    save_evaluation(run, result, html_report(result, run))
    charts = {"evaluation/val_loss": val_loss, "evaluation/bits_per_byte": result.val_bits_per_byte}
    for each in result.datasets:
        charts[f"evaluation/{each['dataset']}/val_loss"] = each["val_loss"]
        charts[f"evaluation/{each['dataset']}/bits_per_byte"] = each["val_bits_per_byte"]
    reports = [run.eval_step(result.step) / name for name in ("report.html", "report.md", "eval.json")]
    export = {"export": result.export_s3_uri or result.export_dir, "export_step": str(result.export_step)}
    record_outcome(run.root, result.step, charts, reports, export if result.export_dir else {}, "evaluation")
    export_note = f"; exported step {result.export_step} to {result.export_dir}" if result.export_dir else ""
    each = ", ".join(f"{d['dataset']} {d['val_loss']:.4f}" for d in result.datasets)
    per_dataset = f"; val loss per dataset: {each}" if each else ""
    log.info(
        "run %s step %d: val loss %.4f (perplexity %.2f, %.4f bits/byte), %s %.4f%s; %s%s",
        run_id,
        result.step,
        val_loss,
        result.val_perplexity,
        result.val_bits_per_byte,
        result.start,
        untrained,
        per_dataset,
        result.gate_line(),
        export_note,
    )
    if not result.gate_passed and not gate.warn_only:
        raise StepFailed(
            f"quality gate failed for run {run_id} at step {result.step}: {'; '.join(result.gate_reasons)}"
        )
    return result


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
    """A mixture's val text's identity: a digest over each dataset's name and val set (in name order: the totals do
    not depend on the order), so a baseline compares only with a run evaluated on the same datasets' val sets; ""
    when a dataset's val set was not recorded (staged before), as for one such dataset."""
    sets = {entry["dataset"]: load_meta(directory).get("val_set_sha256", "") for entry, directory in mixture}
    if not all(sets.values()):
        return ""
    return hashlib.sha256("".join(f"{name}\n{sets[name]}\n" for name in sorted(sets)).encode()).hexdigest()


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


def measure(
    model: torch.nn.Module,
    start: torch.nn.Module,
    val: TokenSplit,
    seq_len: int,
    max_tokens: int,
    batch_size: int,
    device: torch.device,
    byte_lengths: np.ndarray,
) -> tuple[float, int, int, float]:
    """The trained and the starting model's mean loss over the same val windows: (loss, tokens, bytes, the starting
    model's loss)."""
    loss, tokens, n_bytes = mean_loss(model, val, seq_len, max_tokens, batch_size, device, byte_lengths)
    untrained, _, _ = mean_loss(start, val, seq_len, max_tokens, batch_size, device, byte_lengths)
    return loss, tokens, n_bytes, untrained


def total(measured: list[tuple[float, int, int, float]]) -> tuple[float, int, int, float]:
    """Several val splits' measures as one, as the trainer's --eval-every totals a mixture's (train_ddp.validation):
    the token-weighted mean losses, the summed tokens and bytes (so bits per byte are the summed nats over the
    summed bytes). One split's are its own, exactly."""
    if len(measured) == 1:
        return measured[0]
    tokens = sum(t for _, t, _, _ in measured)
    loss = sum(loss * t for loss, t, _, _ in measured) / tokens
    untrained = sum(u * t for _, t, _, u in measured) / tokens
    return loss, tokens, sum(b for _, _, b, _ in measured), untrained


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


def starting_model(model_config: Any, config: dict[str, Any]) -> tuple[torch.nn.Module, str]:
    """The model the run started from, and its name in the report: a published model's weights when the run began
    from one (its config.json's init_from) and the directory is still there; otherwise the untrained model, drawn
    from the run's seed."""
    origin = config.get("init_from") or {}
    if origin.get("model"):
        from trainer.published import PublishedModel, load_weights

        path = Path(origin["model"])
        if (path / "config.json").is_file():
            model = build_model(model_config)
            load_weights(model, PublishedModel.read(path))
            return model, f"start ({origin.get('name', path.name)})"
        log.warning(
            "the run started from the published model in %s, which is gone: its baseline is the untrained "
            "model instead",
            path,
        )
    torch.manual_seed(config["trainer"]["seed"])
    return build_model(model_config), "untrained"


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


def read_metrics(run: RunPaths) -> list[dict[str, Any]]:
    """Rank 0's metrics rows (metrics.jsonl), a row being appended as this reads skipped."""
    return read_json_lines(run.metrics)


# -- keeping every evaluation -----------------------------------------------------------------------------


@contextmanager
def eval_lock(run: RunPaths) -> Iterator[None]:
    """Two evaluations of one run (a pipeline's and a person's) never interleave the history or the newest-step
    copies: each writes its files under an exclusive flock."""
    run.eval.mkdir(parents=True, exist_ok=True)
    with open(run.eval_lock, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def save_evaluation(run: RunPaths, result: EvalResult, report_html: str) -> None:
    """Write the evaluation to its step's directory, add it to the history, and copy it to the run's eval/ top
    when its step is the newest evaluated (ties: the newer evaluation wins), so evaluating an older checkpoint
    never hides the run's furthest result from the readers of eval/eval.json. Every file is written whole
    (trainer/atomic.py); eval.json last in each place, so a reader of it never finds reports older than it."""
    with eval_lock(run):
        adopt_unkept_evaluation(run)
        write_evaluation_files(run.eval_step(result.step), result, report_html)
        append_history(run, history_entry(result))
        newest = evaluated_step(run.eval_result)
        if newest is None or result.step >= newest:
            write_evaluation_files(run.eval, result, report_html)
        else:
            log.info(
                "run %s: step %d evaluated; eval/eval.json keeps step %d, the newest evaluated",
                run.root.name,
                result.step,
                newest,
            )


def write_evaluation_files(directory: Path, result: EvalResult, report_html: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    with atomic_open(directory / "report.md", "w") as f:
        f.write(result.markdown())
    with atomic_open(directory / "report.html", "w") as f:
        f.write(report_html)
    write_json(directory / "eval.json", asdict(result))


def history_entry(result: EvalResult) -> dict[str, Any]:
    return {
        "step": result.step,
        "evaluated_at": result.evaluated_at,
        "checkpoint": result.checkpoint,
        "val_tokens": result.val_tokens,
        "val_loss": result.val_loss,
        "val_bits_per_byte": result.val_bits_per_byte,
        "gate_passed": result.gate_passed,
        "gate_reasons": result.gate_reasons,
        "baseline_run_id": result.baseline_run_id,
        "baseline_step": result.baseline_step,
        "report_dir": Path(result.report_dir).name,
    }


def append_history(run: RunPaths, entry: dict[str, Any]) -> None:
    """Add one line to eval/history.jsonl. The file is rewritten whole under the run's eval lock rather than
    appended to, so a crash mid-write leaves the old history, never a torn last line."""
    try:
        old = run.eval_history.read_text()
    except FileNotFoundError:
        old = ""
    if old and not old.endswith("\n"):
        old += "\n"
    with atomic_open(run.eval_history, "w") as f:
        f.write(old + json.dumps(entry, sort_keys=True) + "\n")


def read_history(run: RunPaths) -> list[dict[str, Any]]:
    """The run's evaluations in the order they ran (eval/history.jsonl); unreadable lines are skipped."""
    return read_json_lines(run.eval_history)


def evaluated_step(eval_json: Path) -> int | None:
    try:
        return int(json.loads(eval_json.read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def adopt_unkept_evaluation(run: RunPaths) -> None:
    """A run evaluated before evaluations were kept per step has only eval/eval.json and its reports: copy them to
    their step's directory and the history first, so the next evaluation (of another step) does not lose them."""
    step = evaluated_step(run.eval_result)
    if step is None or run.eval_step(step).exists():
        return
    for name in ("report.md", "report.html", "eval.json"):
        if (run.eval / name).is_file():
            with atomic_path(run.eval_step(step) / name) as tmp:
                shutil.copyfile(run.eval / name, tmp)
    evaluation = json.loads(run.eval_result.read_text())
    when = evaluation.get("evaluated_at") or datetime.fromtimestamp(run.eval_result.stat().st_mtime, UTC).isoformat(
        timespec="seconds"
    )
    append_history(
        run,
        {
            "step": step,
            "evaluated_at": when,
            "checkpoint": evaluation.get("checkpoint", ""),
            "val_tokens": evaluation.get("val_tokens"),
            "val_loss": evaluation.get("val_loss"),
            "val_bits_per_byte": evaluation.get("val_bits_per_byte"),
            "gate_passed": evaluation.get("gate_passed"),
            "gate_reasons": evaluation.get("gate_reasons"),
            "baseline_run_id": evaluation.get("baseline_run_id", ""),
            "baseline_step": evaluation.get("baseline_step"),
            "report_dir": run.eval_step(step).name,
        },
    )
    log.info("run %s: its earlier evaluation (step %d) kept in %s", run.root.name, step, run.eval_step(step))


def evaluation_of(run: RunPaths, step: int = 0) -> Path | None:
    """The eval.json of a run's evaluation of `step` (0: its newest evaluated step), or None. A run evaluated
    before evaluations were kept per step has only eval/eval.json, which serves for its own step."""
    if not step:
        return run.eval_result if run.eval_result.is_file() else None
    kept = run.eval_step(step) / "eval.json"
    if kept.is_file():
        return kept
    return run.eval_result if evaluated_step(run.eval_result) == step else None


# -- the gate ---------------------------------------------------------------------------------------------


def find_baseline(
    storage_root: str, dataset: str, run_id: str, baseline: str, val_set: str, step: int = 0
) -> Baseline | None:
    """The baseline's evaluation: a named run's, or the newest other run evaluated on the same val set; of `step`,
    or by default of the baseline's newest evaluated step (its latest checkpoint, when that was evaluated).

    Evaluations compare only on the same held-out text (the dataset's fixed val set), in bits per byte, which a
    change of tokenizer does not move; one on another val set, or from before val sets were recorded, is refused.
    """
    if not baseline:
        return None
    if step < 0:
        raise InputError(f"baseline step {step}: give a step number, or 0 for the baseline's newest evaluation")
    at = f"step {step}" if step else "any step"
    if baseline != PREVIOUS:
        try:
            other = RunPaths.of(storage_root, baseline)
        except ValueError as exc:
            raise InputError(str(exc)) from None
        path = evaluation_of(other, step)
        if path is None:
            evaluated = set(other.eval_steps()) | {evaluated_step(other.eval_result)}
            steps = ", ".join(str(s) for s in sorted(s for s in evaluated if s is not None))
            raise InputError(
                f"baseline run {baseline!r}: no evaluation of {at} under {other.eval} (evaluated steps: "
                f"{steps or 'none'})"
            )
        theirs = json.loads(path.read_text())
        if theirs.get("val_set_sha256") != val_set or theirs.get("dataset") != dataset:
            recorded = f"dataset {theirs.get('dataset')!r}, val set {theirs.get('val_set_sha256')}"
            raise InputError(
                f"baseline run {baseline!r} was evaluated on another val set ({recorded}) than run "
                f"{run_id!r} (dataset {dataset!r}, val set {val_set}): their losses do not compare; "
                "choose a baseline of the same dataset and val set, or evaluate it again"
            )
        return baseline_of(other, theirs, step)
    candidates = []
    for latest in Path(storage_root, "runs").glob("*/eval/eval.json"):
        other = RunPaths(latest.parent.parent)
        path = evaluation_of(other, step)
        if other.root.name == run_id or path is None:
            continue
        try:
            theirs = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if theirs.get("dataset") == dataset and theirs.get("val_set_sha256") == val_set:
            candidates.append((path.stat().st_mtime, other.root.name, other, theirs))
    if not candidates:
        raise InputError(
            f"baseline 'previous': no other run of dataset {dataset!r} evaluated on the same val set "
            f"({val_set}){f' at step {step}' if step else ''} under {storage_root}"
        )
    _, _, other, theirs = max(candidates, key=lambda c: c[:2])
    return baseline_of(other, theirs, step)


def baseline_of(run: RunPaths, evaluation: dict[str, Any], asked: int) -> Baseline:
    """Say which of the baseline's evaluations the gate uses: the one asked for, or its newest, and whether the
    baseline has a newer committed checkpoint that nobody evaluated (then the comparison is with an older state)."""
    step = int(evaluation["step"])
    if asked:
        return Baseline(run.root.name, step, evaluation, "as asked")
    committed = committed_checkpoints(run.checkpoints)
    newer = committed[0].step if committed and committed[0].step > step else None
    which = "its newest evaluation" + (f"; its checkpoint of step {newer} is not evaluated" if newer else "")
    return Baseline(run.root.name, step, evaluation, which)


def apply_gate(result: EvalResult, gate: Gate, baseline: Baseline | None) -> None:
    if gate.max_val_loss:
        ok = result.val_loss <= gate.max_val_loss
        result.gate_reasons.append(
            f"val loss {result.val_loss:.4f} {'<=' if ok else '>'} ceiling {gate.max_val_loss:.4f}"
        )
        result.gate_passed &= ok
    if baseline is not None:
        theirs = baseline.evaluation
        limit = theirs["val_bits_per_byte"] + gate.baseline_margin
        ok = result.val_bits_per_byte <= limit
        result.baseline_run_id, result.baseline_step = baseline.run_id, baseline.step
        result.baseline_val_loss, result.baseline_bits_per_byte = theirs["val_loss"], theirs["val_bits_per_byte"]
        other_data = (theirs.get("snapshot"), theirs.get("tokenizer_sha256")) != (
            result.snapshot,
            result.tokenizer_sha256,
        )
        note = f"; snapshot {theirs.get('snapshot')} vs {result.snapshot}, same val set" if other_data else ""
        result.gate_reasons.append(
            f"baseline run {baseline.run_id} at step {baseline.step} ({baseline.which}): val "
            f"bits/byte {result.val_bits_per_byte:.4f} {'<=' if ok else '>'} "
            f"{theirs['val_bits_per_byte']:.4f} + margin {gate.baseline_margin:.4f} (bits per "
            f"byte compare across tokenizers{note})"
        )
        result.gate_passed &= ok


# -- reports and export -----------------------------------------------------------------------------------


FIGURE_INCHES = (6.4, 3.6)  # 960 x 540 px at FIGURE_DPI; the page scales each plot to its column's width
FIGURE_DPI = 150
SAMPLE_MAX_HEIGHT = "16em"  # a greedy sample taller than this (one of newlines, say) scrolls inside its box
NOT_RECORDED = "not recorded"


@dataclass(frozen=True)
class Resume:
    """A start of the trainer after the run's first (an attempt), and the step it went on from."""

    attempt: int
    step: int


@dataclass
class Curves:
    """What the report's plots draw, read from the run directory and the baseline's: gathered apart from the
    drawing, so a test checks what is plotted without reading pixels."""

    run_id: str
    rows: list[dict[str, Any]]  # metrics.jsonl
    evaluations: list[tuple[int, float]]  # (step, val loss) of each evaluated checkpoint, this evaluation included
    checkpoints: list[int]  # the steps of the checkpoints kept on the volume, and of those evaluated
    resumes: list[Resume]
    grad_clip: float  # the clipping threshold (0: none), drawn on the gradient norm's plot
    baseline_run_id: str = ""
    baseline_rows: list[dict[str, Any]] = field(default_factory=list)
    baseline_evaluations: list[tuple[int, float]] = field(default_factory=list)
    datasets: list[str] = field(default_factory=list)  # a mixture's, in its order: their own plots
    dataset_evaluations: dict[str, list[tuple[int, float]]] = field(default_factory=dict)  # name: (step, val loss)

    @classmethod
    def of(cls, run: RunPaths, result: EvalResult, config: dict[str, Any]) -> Curves:
        rows = read_metrics(run)
        evaluations = evaluated_losses(run, result)
        curves = cls(
            result.run_id,
            rows,
            evaluations,
            sorted(set(checkpoint_times(run)) | {s for s, _ in evaluations}),
            resumes(run, rows),
            float(config.get("trainer", {}).get("grad_clip", 0.0)),
        )
        if result.datasets:
            curves.datasets = [d["dataset"] for d in result.datasets]
            curves.dataset_evaluations = evaluated_dataset_losses(run, result)
        if result.baseline_run_id:
            baseline = RunPaths(run.root.parent / result.baseline_run_id)
            curves.baseline_run_id = result.baseline_run_id
            curves.baseline_rows = read_metrics(baseline)
            curves.baseline_evaluations = evaluated_losses(baseline)
        return curves

    @staticmethod
    def points(rows: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
        """(steps, values) of the rows with a finite `key`: a skipped step's NaN loss or infinite gradient norm would
        break the axis' scaling, and rows from before a column existed (val_loss: --eval-every) lack it."""
        found = [
            (r["step"], float(r[key])) for r in rows if isinstance(r.get(key), int | float) and math.isfinite(r[key])
        ]
        return [s for s, _ in found], [v for _, v in found]

    @staticmethod
    def dataset_points(rows: list[dict[str, Any]], name: str, key: str) -> tuple[list[int], list[float]]:
        """(steps, values) of one dataset's `key` in a mixture's rows (row["datasets"][name]), where finite."""
        return Curves.points(
            [
                {"step": r["step"], **r["datasets"][name]}
                for r in rows
                if isinstance(r.get("datasets"), dict) and isinstance(r["datasets"].get(name), dict)
            ],
            key,
        )


def evaluated_dataset_losses(run: RunPaths, result: EvalResult) -> dict[str, list[tuple[int, float]]]:
    """A mixture's datasets' val losses per evaluated step kept (eval/step_<N>/eval.json), this evaluation's (not yet
    written) for its step: dataset -> [(step, val loss)]."""
    losses: dict[str, dict[int, float]] = {name: {} for name in (d["dataset"] for d in result.datasets)}
    for step in run.eval_steps():
        try:
            kept = json.loads((run.eval_step(step) / "eval.json").read_text())
        except (OSError, ValueError):
            continue
        for each in (kept.get("datasets") or []) if isinstance(kept, dict) else []:
            if isinstance(each, dict) and each.get("dataset") in losses and isinstance(each.get("val_loss"), float):
                losses[each["dataset"]][step] = each["val_loss"]
    for each in result.datasets:
        losses[each["dataset"]][result.step] = each["val_loss"]
    return {name: sorted(found.items()) for name, found in losses.items()}


def evaluated_losses(run: RunPaths, result: EvalResult | None = None) -> list[tuple[int, float]]:
    """(step, val loss) per evaluated step, from eval/history.jsonl and eval/eval.json (a run evaluated before the
    history was kept has only that), plus `result`, this evaluation, not yet written; a step evaluated again: its
    latest evaluation."""
    losses: dict[int, float] = {}
    try:
        newest = json.loads(run.eval_result.read_text())
        entries = [newest, *read_history(run)]
    except (OSError, ValueError):
        entries = read_history(run)
    for entry in entries:
        if isinstance(entry, dict) and isinstance(entry.get("step"), int) and isinstance(entry.get("val_loss"), float):
            losses[entry["step"]] = entry["val_loss"]
    if result is not None:
        losses[result.step] = result.val_loss
    return sorted(losses.items())


def checkpoint_times(run: RunPaths) -> dict[int, float]:
    """The committed checkpoints kept on the volume: step -> commit time (commit.json's; 0 when unreadable). Older
    ones were deleted as newer ones came (--keep-checkpoints): the evaluated ones are in the eval history."""
    times = {}
    for checkpoint in committed_checkpoints(run.checkpoints):
        try:
            times[checkpoint.step] = float(json.loads((checkpoint.path / CHECKPOINT_COMMIT).read_text())["time"])
        except (OSError, ValueError, KeyError, TypeError):
            times[checkpoint.step] = 0.0
    return times


def resumes(run: RunPaths, rows: list[dict[str, Any]]) -> list[Resume]:
    """Each start of the trainer after the first, at the step it went on from.

    Every start is an attempt (comms/attempt-NNNN/, numbered by rank 0), whose rank-0 self-test report holds the
    start's time and, once the checkpoint is read, the step it went on from (`start_step`; 0: from scratch).

    Runs trained before `start_step` was recorded have it derived: a start resumes from its newest checkpoint and
    drops the metrics rows logged past it (MetricsLog.truncate_after), so the step is the furthest of the rows
    logged and the checkpoints committed before the start's time that lie below the first step logged after it. That
    is the checkpoint's step when a row at it or the checkpoint itself is still there, else (its rows not on a logged
    step, the checkpoint deleted since) up to log_every steps short of it."""
    timed = [r for r in rows if isinstance(r.get("time"), int | float) and isinstance(r.get("step"), int)]
    commits = checkpoint_times(run)
    found = []
    for attempt in run.attempts()[1:]:
        try:
            report = json.loads(run.comms_report(0, attempt).read_text())
            started = float(report["time"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if isinstance(report.get("start_step"), int):
            found.append(Resume(attempt, report["start_step"]))
            continue
        first = next((r["step"] for r in timed if r["time"] >= started), math.inf)
        before = [r["step"] for r in timed if r["time"] < started] + [s for s, t in commits.items() if 0 < t < started]
        found.append(Resume(attempt, max((s for s in before if s < first), default=0)))
    return found


def curve_figures(curves: Curves) -> list[tuple[str, str, Any]]:
    """The report's plots as (element id, description, matplotlib Figure): loss (train, val, evaluations, the
    baseline's, checkpoints and resumes), learning rate, gradient norm, tokens/s. Every magnitude's axis starts at
    zero, so a dip reads at its true size. Figures without pyplot: no global state, no GUI backend."""
    from matplotlib.figure import Figure

    def figure(title: str) -> tuple[Figure, Any]:
        made = Figure(figsize=FIGURE_INCHES, layout="constrained")
        axis = made.subplots()
        axis.set_title(title)
        axis.set_xlabel("step")
        axis.grid(alpha=0.3)
        return made, axis

    loss, axis = figure("loss (nats/token)")
    if curves.baseline_run_id:  # first, so the run's own lines are drawn over it
        name = curves.baseline_run_id
        axis.plot(
            *Curves.points(curves.baseline_rows, "loss"), color="C2", lw=2.5, alpha=0.6, label=f"baseline {name}: train"
        )
        if curves.baseline_evaluations:
            axis.plot(
                *zip(*curves.baseline_evaluations, strict=True),
                "s--",
                ms=6,
                mfc="none",
                color="C2",
                label=f"baseline {name}: val",
            )
    axis.plot(*Curves.points(curves.rows, "loss"), color="C0", label=f"train ({curves.run_id})")
    if during := Curves.points(curves.rows, "val_loss")[0]:
        axis.plot(during, Curves.points(curves.rows, "val_loss")[1], "o-", ms=3, color="C1", label="val (training)")
    if curves.evaluations:
        axis.plot(*zip(*curves.evaluations, strict=True), "s--", ms=5, color="C1", label="val (evaluations)")
    for i, step in enumerate(curves.checkpoints):
        axis.axvline(step, color="0.55", ls=":", lw=1, label="checkpoint" if i == 0 else "_nolegend_")
    for i, resume in enumerate(curves.resumes):
        axis.axvline(resume.step, color="C3", ls="--", lw=1.2, label="resume" if i == 0 else "_nolegend_")
    # The loss keeps its natural range, not zero: it falls from about ln(vocab) toward the text's entropy, never to
    # zero, and an axis from zero would squeeze the late steps, where checkpoints and runs differ, into a thin band.
    axis.legend(fontsize="small")
    figures = [("curve-loss", "loss against step", loss), *dataset_figures(curves, figure)]
    for key, title in (
        ("lr", "learning rate"),
        ("grad_norm", "gradient norm (before clipping)"),
        ("tokens_per_s", "throughput (tokens/s)"),
    ):
        steps, values = Curves.points(curves.rows, key)
        if not steps:
            continue
        made, axis = figure(title)
        axis.plot(steps, values, color="C0")
        if key == "grad_norm" and curves.grad_clip:
            axis.axhline(curves.grad_clip, color="C3", ls="--", lw=1, label=f"clipped to {curves.grad_clip:g}")
            axis.legend(fontsize="small")
        axis.set_ylim(bottom=0)
        figures.append((f"curve-{key.replace('_', '-')}", f"{title} against step", made))
    return figures


def dataset_figures(curves: Curves, figure: Any) -> list[tuple[str, str, Any]]:
    """A mixture's plots: each dataset's val loss (the rows' --eval-every measures, the evaluations' marked) and the
    tokens trained on from it, against step; none for a run of one dataset."""
    if not curves.datasets:
        return []
    made, axis = figure("val loss per dataset (nats/token)")
    for k, name in enumerate(curves.datasets):
        if during := Curves.dataset_points(curves.rows, name, "val_loss")[0]:
            axis.plot(
                during,
                Curves.dataset_points(curves.rows, name, "val_loss")[1],
                "o-",
                ms=3,
                color=f"C{k}",
                label=f"{name} (training)",
            )
        if marks := curves.dataset_evaluations.get(name):
            axis.plot(*zip(*marks, strict=True), "s", ms=6, mfc="none", color=f"C{k}", label=f"{name} (evaluations)")
    axis.legend(fontsize="small")  # the loss keeps its natural range, as on the loss plot
    figures = [("curve-dataset-val-loss", "val loss per dataset against step", made)]
    drawn = [(name, Curves.dataset_points(curves.rows, name, "tokens")) for name in curves.datasets]
    if any(steps for _, (steps, _) in drawn):
        made, axis = figure("tokens trained per dataset")
        for k, (name, (steps, values)) in enumerate(drawn):
            axis.plot(steps, values, color=f"C{k}", label=name)
        axis.set_ylim(bottom=0)
        axis.legend(fontsize="small")
        figures.append(("curve-dataset-tokens", "tokens trained per dataset against step", made))
    return figures


def figure_png(figure: Any) -> bytes:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=FIGURE_DPI)
    return buffer.getvalue()


def attempt_reports(run: RunPaths) -> list[dict[str, Any]]:
    """The comms self-test reports of the run's newest start, one per rank (its host, its torch)."""
    attempts = run.attempts()
    directory = run.comms / run.attempt(attempts[-1]) if attempts else run.comms
    reports = []
    for path in sorted(directory.glob("rank_*.json")):
        try:
            reports.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return reports


def run_settings(result: EvalResult, run: RunPaths, config: dict[str, Any]) -> list[tuple[str, str]]:
    """The run's settings as its config.json records them (written at each start of the trainer: the newest start's),
    with what follows from them. config.json has the world size only: its shape in nodes and processes per node is
    counted from that start's self-test reports, which name each rank's host."""
    import transformers

    from common.version import tool_version

    trainer = config.get("trainer", {})
    world = config.get("world_size")
    reports = attempt_reports(run)
    hosts = Counter(r.get("hostname") for r in reports)
    shape = ""
    if world and len(reports) == world and len(set(hosts.values())) == 1:
        shape = f" ({len(hosts)} node(s) x {next(iter(hosts.values()))} process(es) per node)"
    batch, accum, seq_len = trainer.get("batch_size"), trainer.get("grad_accum_steps"), trainer.get("seq_len")
    lr, max_steps = trainer.get("lr"), trainer.get("max_steps")
    trained_on, all_of = f"{result.dataset}, snapshot {result.snapshot}", ""
    if result.datasets:  # a mixture: its datasets' train splits together; each one's epochs are in its own table
        trained_on = "mixture of " + ", ".join(
            f"{d['dataset']} (snapshot {d['snapshot']}, weight {d['weight']:g})" for d in result.datasets
        )
        all_of = " of all the datasets; each one's: Per dataset"
    preset = str(trainer.get("preset", NOT_RECORDED))
    if not preset:  # a published model's architecture instead
        preset = f"none: the architecture of {result.start.removeprefix('start ').strip('()')}"
    settings = [
        ("preset", preset),
        ("parameters", f"{result.parameters:,}" if result.parameters else NOT_RECORDED),
        ("world size", f"{world}{shape}" if world else NOT_RECORDED),
        ("parallelism", str(trainer.get("parallelism", NOT_RECORDED))),
    ]
    if batch and accum and world and seq_len:
        settings += [
            (
                "batch",
                f"{batch} sequences per rank x {accum} micro-step(s) x {world} ranks = "
                f"{batch * accum * world} sequences per step",
            ),
            ("sequence length", f"{seq_len} tokens"),
            ("tokens per step", f"{batch * accum * world * seq_len:,}"),
        ]
    if max_steps:
        tokens = trainer.get("max_tokens")
        settings.append(
            ("max steps", f"{max_steps:,}" + (f" (or {tokens:,} tokens, the first reached)" if tokens else ""))
        )
    if lr is not None:
        floor = lr * trainer.get("min_lr_ratio", 0.0)
        settings += [
            ("learning rate", f"{lr:g} peak, cosine decay to {floor:g} at step {max_steps}"),
            ("warm-up", f"{trainer.get('warmup_steps')} steps, linear"),
        ]
    settings += [
        ("dropout", f"{trainer['dropout']:g}" if "dropout" in trainer else NOT_RECORDED),
        ("seed", str(trainer.get("seed", NOT_RECORDED))),
        ("dataset", trained_on),
        (
            "epochs over the train split",
            f"{result.train_tokens_seen / result.train_split_tokens:.2f} "
            f"({result.train_tokens_seen:,} tokens trained / {result.train_split_tokens:,} train tokens{all_of})"
            if result.train_split_tokens
            else NOT_RECORDED,
        ),
        (
            "hyperpod-pretrain",
            f"{config.get('hyperpod_pretrain') or NOT_RECORDED} (training, config.json); "
            f"{tool_version()} (this evaluation)",
        ),
        (
            "torch",
            f"{(reports[0].get('torch_version') if reports else None) or NOT_RECORDED} (training, the "
            f"self-test report); {torch.__version__} (this evaluation)",
        ),
        (
            "transformers",
            f"{config.get('model', {}).get('transformers_version') or NOT_RECORDED} (training, the "
            f"model config); {transformers.__version__} (this evaluation)",
        ),
    ]
    return settings


def html_table(table_id: str, header: list[str], rows: list[tuple[str, ...]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f'<table id="{table_id}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def html_report(result: EvalResult, run: RunPaths) -> str:
    """One page that reads on its own (plots embedded as PNG): fits any window from 1280 px wide up, plots scaled to
    their column, long sample lines wrapped and tall samples scrolled in a box of capped height."""
    try:
        config = json.loads(run.config.read_text())
    except (OSError, ValueError):
        config = {}
    curves = Curves.of(run, result, config)
    figures = curve_figures(curves) if curves.rows else []
    plots = "".join(
        f'<figure><img id="{name}" alt="{html.escape(alt)}" src="data:image/png;base64,'
        f'{base64.b64encode(figure_png(figure)).decode()}"></figure>'
        for name, alt, figure in figures
    )
    resumed = "; ".join(f"attempt {r.attempt} went on from step {r.step}" for r in curves.resumes) or "none"
    per_dataset = (
        f"<h3>Per dataset</h3>\n{html_table('datasets', result.dataset_columns(), result.dataset_rows())}\n"
        if result.datasets
        else ""
    )
    samples = "".join(
        f'<li><b>{html.escape(s["prompt"])}</b><pre class="sample">{html.escape(s["text"])}</pre></li>'
        for s in result.samples
    )
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>Evaluation of {html.escape(result.run_id)}</title>
<style>
*{{box-sizing:border-box}}
body{{font-family:sans-serif;margin:0 auto;padding:1em 2em;max-width:100em;overflow-wrap:anywhere}}
.plots{{display:grid;grid-template-columns:repeat(auto-fill,minmax(min(100%,34em),1fr));gap:1em}}
figure{{margin:0;min-width:0}} figure img{{display:block;width:100%;max-width:100%;height:auto}}
table{{border-collapse:collapse;max-width:100%;margin-bottom:1em}}
td,th{{border:1px solid #ccc;padding:4px 10px;text-align:left;vertical-align:top}}
pre.sample{{white-space:pre-wrap;overflow-wrap:anywhere;max-height:{SAMPLE_MAX_HEIGHT};overflow:auto;
background:#f6f6f6;padding:6px;margin:0.3em 0 1em}}
</style>
</head><body>
<h1>Evaluation of run {html.escape(result.run_id)}</h1>
<p>Checkpoint {html.escape(result.checkpoint)} at step {result.step} ({result.train_tokens_seen:,} training tokens);
{result.val_tokens:,} held-out tokens evaluated. {html.escape(result.gate_line())}</p>
<h2>Validation</h2>
{html_table("eval", result.table_columns(), result.table_rows())}
{per_dataset}<h2>Training</h2>
<div class="plots">{plots or "<p>No training metrics.</p>"}</div>
<p>Checkpoints (dotted): those kept and those evaluated. Resumes (dashed): {html.escape(resumed)}.</p>
<p>{html.escape(result.health_line())}</p>
<h2>Run settings</h2>
{html_table("settings", ["setting", "value"], run_settings(result, run, config))}
<h2>Greedy samples</h2>
<ul id="samples">{samples}</ul>
</body></html>
"""


EXPORT_RECORD = "export.json"  # in the export: which checkpoint its weights are


def export_record(result: EvalResult) -> dict[str, Any]:
    """What export.json says: the checkpoint exported and the data it was trained on, so that an export replaced by
    an evaluation of an older checkpoint is not taken for the newest one."""
    return {
        "run_id": result.run_id,
        "step": result.step,
        "checkpoint": result.checkpoint,
        "dataset": result.dataset,
        "snapshot": result.snapshot,
        "exported_at": datetime.now(UTC).isoformat(timespec="seconds"),
    }


def export_model(
    model: torch.nn.Module, snapshot_dir: Path, directory: Path, record: dict[str, Any], dtype: str = "float32"
) -> Path:
    """save_pretrained (safetensors) in `dtype` (a published model's own, so the export is its size and says its
    dtype) with the snapshot's tokenizer: AutoModelForCausalLM.from_pretrained(directory) loads it, and AutoTokenizer
    encodes as training did (the snapshot keeps its post-processor so: [BOS] text), with the snapshot's own BOS and
    EOS named; `record` (export_record) goes in beside them as export.json, so the directory says which checkpoint
    it holds. The model's other config fields (rope scaling, special token ids) are the run's, so a published
    model's, in the keys both transformers 4.x and 5.x read (transformers_4_rope)."""
    from transformers import PreTrainedTokenizerFast

    from components.stage_data.tokenizer import EOS

    meta = load_meta(snapshot_dir)
    staging = directory.with_name(f".{directory.name}.new")
    shutil.rmtree(staging, ignore_errors=True)  # left by a killed run
    model.to("cpu", getattr(torch, dtype)).save_pretrained(staging)  # safetensors: transformers 5 writes no other
    write_json(staging / "config.json", transformers_4_rope(json.loads((staging / "config.json").read_text())))
    bos = meta["bos"] if "bos" in meta else EOS  # a snapshot staged before BOS: the trained tokenizer's one token
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_file=str(snapshot_dir / TOKENIZER), eos_token=meta.get("eos", EOS), bos_token=bos
    )
    tokenizer.save_pretrained(staging)
    write_json(staging / EXPORT_RECORD, record)
    readable_by_the_team(staging)
    replace_dir(staging, directory)
    log.info(
        "exported step %s (%s) in Hugging Face format to %s", record.get("step"), record.get("checkpoint"), directory
    )
    return directory


def transformers_4_rope(config: dict[str, Any]) -> dict[str, Any]:
    """A config.json of transformers 5 with the rope keys transformers 4 reads beside `rope_parameters`: 5.x writes
    only rope_parameters (rope_theta inside it), which 4.57 does not read (its LlamaConfig takes `rope_theta`, default
    10000.0, and `rope_scaling`, default None), so a serving stack on 4.x would run a Llama 3 export with the wrong
    positions, silently. 5.x reads `rope_scaling` in place of rope_parameters and `rope_theta` into it
    (modeling_rope_utils.py, convert_rope_params_to_dict): both keys say what rope_parameters says, so both versions
    build the same rotary frequencies. A config without rope (GPT-2), or with rope per layer type, is left as it is."""
    rope = config.get("rope_parameters")
    if not isinstance(rope, dict) or "rope_theta" not in rope or any(isinstance(v, dict) for v in rope.values()):
        return config
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}  # 4.x warns on a key its rope type does not take
    legacy = None if scaling.get("rope_type", "default") == "default" else scaling  # what 4.x writes for no scaling
    return config | {"rope_theta": rope["rope_theta"], "rope_scaling": legacy}


def readable_by_the_team(directory: Path) -> None:
    """Give every file under `directory` the mode open() gives under the umask (0644 under 022): safetensors writes
    model.safetensors 0600, which teammates reading the volume, and a copy made from it, could not read."""
    mode = file_mode()
    for path in directory.rglob("*"):
        if path.is_file() and not path.is_symlink():
            path.chmod(mode)
