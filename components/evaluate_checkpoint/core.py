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
from common.s3 import S3Settings
from components.evaluate_checkpoint.benchmarks import (
    BenchmarkSettings,
    benchmark_rows,
    check_benchmark_gates,
    run_benchmarks,
)
from components.evaluate_checkpoint.export import export_model, export_record, hf_tokenizer
from components.evaluate_checkpoint.gate import Gate, apply_gate, find_baseline
from components.evaluate_checkpoint.history import save_evaluation
from components.evaluate_checkpoint.inputs import check_inputs
from components.evaluate_checkpoint.loading import (
    checkpoint_model,
    evaluation_device,
    evaluation_dtype,
    release_memory,
    starting_model,
)
from components.evaluate_checkpoint.measure import (
    beside_start,
    dataset_results,
    greedy_samples,
    measure_splits,
    mixture_snapshots,
    mixture_val_set,
    mixture_weights,
    read_checkpoint,
    run_snapshot,
    total,
    training_eval,
    training_health,
    training_throughput,
    val_split,
)
from components.evaluate_checkpoint.report import html_report
from components.evaluate_checkpoint.results import EvalResult
from trainer.data import load_meta
from trainer.evaluation import bits_per_byte, token_bytes
from trainer.layout import TOKENIZER, DatasetPaths, RunPaths
from trainer.model import config_from_dict
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
    dtype: str = "auto",
    benchmarks: BenchmarkSettings | None = None,
) -> EvalResult:
    """Measure the run's checkpoint (its val loss; the benchmarks asked for), gate it, export it and keep the
    evaluation: what is refused is refused before anything is written, and a failed gate fails the step
    (StepFailed) once everything is kept, unless it only warns."""
    evaluated_at = datetime.now(UTC).isoformat(timespec="seconds")
    gate, benchmarks = gate or Gate(), benchmarks or BenchmarkSettings()
    check_inputs(max_tokens, batch_size, export, export_s3_uri, dtype)
    run, config = read_run(storage_root, dataset, run_id)
    benchmarks.checked(gate.benchmarks)
    snapshot_dir, meta, mixture, val_set = trained_on(storage_root, config, run_id, dataset)
    baseline = find_baseline(storage_root, dataset, run_id, gate.baseline_run_id, val_set, gate.baseline_step)
    found, state = read_checkpoint(run, checkpoint)
    s3 = S3Settings(endpoint_url=s3_endpoint_url)
    tasks, benchmark_gates, task_data = benchmarks.ready(storage_root, gate.benchmarks, s3)  # staged, then read
    model_config = config_from_dict(config["model"])
    seq_len = config["trainer"]["seq_len"]
    snapshots = {entry["dataset"]: directory for entry, directory in mixture} or {dataset: snapshot_dir}
    vals = {name: val_split(directory, name, seq_len) for name, directory in snapshots.items()}
    tokenizer = Tokenizer.from_file(str(snapshot_dir / TOKENIZER))  # a mixture's datasets share it
    text_bytes = token_bytes(tokenizer, meta)

    # One model at a time: the checkpoint's is measured, sampled, benchmarked and exported, then dropped before the
    # starting model is built (loading.py).
    device = evaluation_device()
    precision = evaluation_dtype(device, dtype)
    model = checkpoint_model(model_config, found, run, state, device, precision)
    parameters = sum(p.numel() for p in model.parameters())
    trained = measure_splits(model, vals, seq_len, max_tokens, batch_size, device, text_bytes)
    samples = greedy_samples(model, tokenizer, device)
    lm_tokenizer, limit = hf_tokenizer(snapshot_dir), benchmarks.limit or None
    scores = run_benchmarks(model, lm_tokenizer, tasks, task_data, batch_size, device, limit, f"step {state['step']}")
    record = export_record(run_id, int(state["step"]), str(found.path), (dataset, snapshot_dir.name))
    exported = export_evaluated(model, precision, record, snapshot_dir, run, config, export)
    del model
    release_memory()
    start, started_from = starting_model(model_config, config, device, precision)
    measured = beside_start(trained, measure_splits(start, vals, seq_len, max_tokens, batch_size, device, text_bytes))
    start_scores = run_benchmarks(start, lm_tokenizer, tasks, task_data, batch_size, device, limit, started_from)
    del start
    val_loss, n_tokens, n_bytes, untrained = total(measured, mixture_weights(mixture))
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
        samples=samples,
        dataset=dataset,
        snapshot=snapshot_dir.name,
        val_set_sha256=val_set,
        tokenizer_sha256=meta.get("tokenizer_sha256", ""),
        evaluated_at=evaluated_at,
        report_dir=str(run.eval_step(int(state["step"]))),
        parameters=parameters,
        train_split_tokens=int(meta.get("tokens", {}).get("train", 0)),
        training_eval=training_eval(run, int(state["step"])),
        benchmarks=benchmark_rows(scores, start_scores, baseline.evaluation if baseline else None),
    )
    if mixture:
        result.datasets = dataset_results(mixture, measured, state, seq_len)
        result.train_split_tokens = sum(d["train_split_tokens"] for d in result.datasets)
    if exported:
        result.export_dir, result.export_step = str(exported), result.step
    if export_s3_uri:
        upload_export(result, export_s3_uri, s3)
    apply_gate(result, gate, baseline, check_benchmark_gates(benchmark_gates, scores))
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


def trained_on(
    storage_root: str, config: dict[str, Any], run_id: str, dataset: str
) -> tuple[Path, dict[str, Any], list[tuple[dict[str, Any], Path]], str]:
    """What the run trained on, as its config.json records it: the snapshot (of a mixture: its first dataset's), its
    meta.json, a mixture's datasets ([] for one dataset) and the val set's identity, which a baseline must share."""
    snapshot_dir = run_snapshot(storage_root, config, run_id, dataset)
    meta = load_meta(snapshot_dir)
    mixture = mixture_snapshots(storage_root, config, run_id)
    return snapshot_dir, meta, mixture, mixture_val_set(mixture) if mixture else meta.get("val_set_sha256", "")


def check_gate(storage_root: str, dataset: str, run_id: str, gate: Gate, benchmarks: BenchmarkSettings) -> None:
    """The gate refused as evaluate_checkpoint refuses it (its benchmark thresholds against the tasks, the baseline's
    evaluation), without measuring anything: for evaluations of several checkpoints, whose gate only the last one
    applies, after the others were kept."""
    benchmarks.checked(gate.benchmarks)
    _, config = read_run(storage_root, dataset, run_id)
    _, _, _, val_set = trained_on(storage_root, config, run_id, dataset)
    find_baseline(storage_root, dataset, run_id, gate.baseline_run_id, val_set, gate.baseline_step)


def export_evaluated(
    model: torch.nn.Module,
    precision: torch.dtype,
    record: dict[str, Any],
    snapshot_dir: Path,
    run: RunPaths,
    config: dict[str, Any],
    export: bool,
) -> Path | None:
    """The evaluated weights exported under <run>/export/ (when `export`), in the published model's dtype when the
    run began from one, else the dtype they were evaluated in (bf16 on a GPU: upcasting them would add nothing but
    bytes; fp32 on a CPU, the master weights' own)."""
    if not export:
        return None
    dtype = (config.get("init_from") or {}).get("dtype") or str(precision).removeprefix("torch.")
    return export_model(model, snapshot_dir, run.root / "export", record, dtype)


def upload_export(result: EvalResult, export_s3_uri: str, s3: S3Settings) -> None:
    """The export uploaded to `export_s3_uri`; the result says where."""
    from common.s3 import upload_directory

    upload_directory(Path(result.export_dir), export_s3_uri, s3)
    result.export_s3_uri = export_s3_uri


def record_evaluation(run: RunPaths, result: EvalResult, val_loss: float, untrained: float) -> None:
    """The evaluation's charts, reports and export in the run's tracking (TensorBoard, MLflow), and its log line;
    `val_loss` and `untrained` unrounded, as measured."""
    charts = {"evaluation/val_loss": val_loss, "evaluation/bits_per_byte": result.val_bits_per_byte}
    charts |= {f"benchmarks/{b['task']}/{b['metric']}": b["value"] for b in result.benchmarks}
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
