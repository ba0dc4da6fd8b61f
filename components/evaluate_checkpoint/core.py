"""Evaluate a run's checkpoint on the held-out val split: numbers, a quality gate, reports, and an export.

This module ties the step's parts together in their order; each part is a module of its own, for a reader of one:
measure.py (the checkpoint, the model and the numbers), gate.py (the baseline and the verdict), history.py (every
evaluation kept), report.py (the plots and the HTML page), export.py (the Hugging Face export) and results.py
(EvalResult, what they pass along).
"""

from __future__ import annotations

import json
import logging
import math
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from common.errors import InputError, StepFailed
from components.evaluate_checkpoint.export import export_model, export_record
from components.evaluate_checkpoint.gate import Gate, apply_gate, find_baseline
from components.evaluate_checkpoint.history import save_evaluation
from components.evaluate_checkpoint.inputs import check_inputs
from components.evaluate_checkpoint.measure import (
    checkpoint_model,
    dataset_results,
    greedy_samples,
    measure_splits,
    mixture_snapshots,
    mixture_val_set,
    read_checkpoint,
    run_snapshot,
    starting_model,
    total,
    training_health,
    training_throughput,
    val_split,
)
from components.evaluate_checkpoint.report import html_report
from components.evaluate_checkpoint.results import EvalResult
from trainer.data import load_meta
from trainer.evaluation import bits_per_byte, token_byte_lengths
from trainer.layout import TOKENIZER, DatasetPaths, RunPaths
from trainer.model import config_from_dict
from trainer.snapshot import model_vocab
from trainer.tracking import record_outcome

log = logging.getLogger(__name__)


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
    """Measure the run's checkpoint, gate it, export it and keep the evaluation: what is refused is refused before
    anything is written, and a failed gate fails the step (StepFailed) once everything is kept, unless it only
    warns."""
    gate = gate or Gate()
    check_inputs(max_tokens, batch_size, export, export_s3_uri)
    run, config = read_run(storage_root, dataset, run_id)
    snapshot_dir = run_snapshot(storage_root, config, run_id, dataset)
    meta = load_meta(snapshot_dir)
    mixture = mixture_snapshots(storage_root, config, run_id)
    val_set = mixture_val_set(mixture) if mixture else meta.get("val_set_sha256", "")
    baseline = find_baseline(storage_root, dataset, run_id, gate.baseline_run_id, val_set, gate.baseline_step)
    found, state, weights = read_checkpoint(run, checkpoint)
    model_config = config_from_dict(config["model"])
    seq_len = config["trainer"]["seq_len"]
    snapshots = {entry["dataset"]: directory for entry, directory in mixture} or {dataset: snapshot_dir}
    vals = {name: val_split(directory, name, seq_len) for name, directory in snapshots.items()}

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = checkpoint_model(model_config, weights, found, run, state)
    model.to(device)
    tokenizer = Tokenizer.from_file(str(snapshot_dir / TOKENIZER))  # a mixture's datasets share it
    byte_lengths = token_byte_lengths(tokenizer, model_vocab(meta))
    start, started_from = starting_model(model_config, config)
    start.to(device)
    measured = measure_splits(model, start, vals, seq_len, max_tokens, batch_size, device, byte_lengths)
    val_loss, n_tokens, n_bytes, untrained = total(list(measured.values()))
    throughput = training_throughput(run)
    result = EvalResult(
        run_id=run_id,
        checkpoint=str(found.path),
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
    export_evaluated(result, model, snapshot_dir, run, config, export, export_s3_uri, s3_endpoint_url)
    save_evaluation(run, result, html_report(result, run))
    record_evaluation(run, result, val_loss, untrained)
    if not result.gate_passed and not gate.warn_only:
        raise StepFailed(
            f"quality gate failed for run {run_id} at step {result.step}: {'; '.join(result.gate_reasons)}"
        )
    return result


def read_run(storage_root: str, dataset: str, run_id: str) -> tuple[RunPaths, dict[str, Any]]:
    """The run's directory and its config.json, refused in one line when a name is bad or the run is incomplete."""
    try:
        run = RunPaths.of(storage_root, run_id)
        DatasetPaths.of(storage_root, dataset)
    except ValueError as exc:
        raise InputError(str(exc)) from None
    if not run.config.is_file():
        raise InputError(f"{run.config} does not exist: run {run_id!r} is incomplete")
    return run, json.loads(run.config.read_text())


def export_evaluated(
    result: EvalResult,
    model: torch.nn.Module,
    snapshot_dir: Path,
    run: RunPaths,
    config: dict[str, Any],
    export: bool,
    export_s3_uri: str,
    s3_endpoint_url: str,
) -> None:
    """The evaluated weights exported under <run>/export/ (when `export`), and uploaded to `export_s3_uri` (if
    given); the result says where."""
    if export:
        dtype = (config.get("init_from") or {}).get("dtype", "float32")  # a published model's, kept
        exported = export_model(model, snapshot_dir, run.root / "export", export_record(result), dtype)
        result.export_dir, result.export_step = str(exported), result.step
    if export_s3_uri:
        from common.s3 import S3Settings, upload_directory

        upload_directory(Path(result.export_dir), export_s3_uri, S3Settings(endpoint_url=s3_endpoint_url))
        result.export_s3_uri = export_s3_uri


def record_evaluation(run: RunPaths, result: EvalResult, val_loss: float, untrained: float) -> None:
    """The evaluation's charts, reports and export in the run's tracking (TensorBoard, MLflow), and its log line;
    `val_loss` and `untrained` unrounded, as measured."""
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
        result.run_id,
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
