"""Evaluate a run's checkpoint on the held-out val split: numbers, a quality gate, reports, and an export.

- Numbers: mean loss, perplexity and bits per byte (tokenizer-independent: runs with different tokenizers
  compare) over up to `max_tokens` val tokens, beside the same model untrained; greedy samples from fixed
  prompts for a person to read. bf16 on a GPU, fp32 on the CPU.
- Gate: an absolute ceiling on the val loss and/or no worse than a baseline run's evaluation plus a
  margin in bits per byte (which survive a change of tokenizer); the baseline is a run id or "previous" (the
  newest other run of the same dataset evaluated on the same fixed val set; any other is refused), at its newest
  evaluated step unless a step is named; the verdict names the baseline's run and step. A failed gate fails the
  step with the numbers, or only warns.
- Reports: every evaluation is kept, per checkpoint: eval/step_<N>/{eval.json,report.md,report.html} (training
  curves as an embedded PNG, the eval table, the samples), a line in eval/history.jsonl, and a copy of the newest
  step's files at eval/eval.json, report.md and report.html, where readers looked before evaluations were kept.
- Export: the model in Hugging Face format (safetensors) with its tokenizer under <run>/export/.
"""

from __future__ import annotations

import base64
import fcntl
import html
import io
import json
import logging
import math
import shutil
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
from trainer.atomic import atomic_open, atomic_path, replace_dir, write_json
from trainer.checkpoint import (
    Checkpoint,
    CheckpointError,
    checked,
    committed_checkpoints,
    read_weights,
)
from trainer.data import DataError, load_meta, load_split
from trainer.evaluation import bits_per_byte, mean_loss, token_byte_lengths
from trainer.layout import META, TOKENIZER, DatasetPaths, RunPaths
from trainer.model import build_model, config_from_dict
from trainer.snapshot import config_snapshot

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
    skipped_steps: int = 0  # training steps whose update was skipped: the loss or gradient norm was not finite
    loss_spikes: list[dict[str, float]] = field(default_factory=list)  # logged steps marked as spikes (step, loss)
    export_dir: str = ""
    export_s3_uri: str = ""
    evaluated_at: str = ""  # UTC, ISO 8601: orders the history's evaluations of the same step
    report_dir: str = ""  # eval/step_<N>/: this evaluation's own files, whatever is evaluated after

    def metrics(self) -> dict[str, float]:
        values = {"val_loss": self.val_loss, "val_perplexity": self.val_perplexity,
                  "val_bits_per_byte": self.val_bits_per_byte, "train_tokens_seen": self.train_tokens_seen,
                  "untrained_val_loss": self.untrained_val_loss, "val_tokens": self.val_tokens,
                  "train_tokens_per_s": self.train_tokens_per_s, "train_mfu": self.train_mfu,
                  "gate_passed": float(self.gate_passed)}  # fmt: skip
        return {k: float(v) for k, v in values.items() if v is not None}

    def table_rows(self) -> list[tuple[str, str, str]]:
        return [
            ("val loss (nats/token)", f"{self.val_loss:.4f}", f"{self.untrained_val_loss:.4f}"),
            ("val perplexity", f"{self.val_perplexity:.2f}", f"{math.exp(self.untrained_val_loss):.2f}"),
            ("val bits per byte", f"{self.val_bits_per_byte:.4f}", ""),
        ]

    def gate_line(self) -> str:
        if not self.gate_reasons:
            return "Gate: none set."
        return f"Gate: {'passed' if self.gate_passed else 'FAILED'} ({'; '.join(self.gate_reasons)})."

    def markdown(self) -> str:
        return "\n".join([
            f"# Evaluation of run `{self.run_id}`",
            "",
            f"Checkpoint `{self.checkpoint}` at step {self.step} ({self.train_tokens_seen:,} training tokens).",
            "",
            "| metric | trained | untrained |",
            "| --- | --- | --- |",
            *(f"| {name} | {a} | {b} |" for name, a, b in self.table_rows()),
            "",
            f"Evaluated on {self.val_tokens:,} held-out tokens; training lowered the loss by "
            f"{self.loss_reduction:.4f} nats/token. {self.gate_line()}",
            "",
            self.health_line(),
            "",
        ])  # fmt: skip

    def health_line(self) -> str:
        """What the trainer's health checks saw (trainer/health.py): skipped steps and loss spikes."""
        spikes = ", ".join(f"step {s['step']} ({s['loss']:.3f})" for s in self.loss_spikes[:10])
        more = f" and {len(self.loss_spikes) - 10} more" if len(self.loss_spikes) > 10 else ""
        return (f"Training health: {self.skipped_steps} step(s) skipped for a non-finite loss or gradient norm; "
                f"{len(self.loss_spikes)} loss spike(s){': ' + spikes + more if spikes else ''}.")  # fmt: skip


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
    if max_tokens <= 0 or batch_size <= 0:
        raise InputError(f"max tokens and batch size must be positive, got {max_tokens} and {batch_size}")
    if export_s3_uri and (not export or not export_s3_uri.startswith("s3://")):
        raise InputError(f"export S3 URI {export_s3_uri!r}: give s3://bucket/prefix, with the export on")
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
    val_set = meta.get("val_set_sha256", "")
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
    try:
        val = load_split(snapshot_dir, "val")
    except DataError as exc:
        raise InputError(str(exc)) from None
    if len(val) < seq_len + 1:
        raise InputError(f"dataset {dataset!r}: the val split has {len(val)} tokens, fewer than one sequence of "
                         f"{seq_len}")  # fmt: skip

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = build_model(model_config)
    try:
        model.load_state_dict(weights)
    except RuntimeError as exc:
        raise InputError(f"checkpoint {path} does not fit the model in {run.config} (preset "
                         f"{state.get('preset')!r}): {str(exc).splitlines()[0]}") from None  # fmt: skip
    model.to(device)
    tokenizer = Tokenizer.from_file(str(snapshot_dir / TOKENIZER))
    byte_lengths = token_byte_lengths(tokenizer, meta["vocab_size"])
    try:
        val_loss, n_tokens, n_bytes = mean_loss(model, val, seq_len, max_tokens, batch_size, device, byte_lengths)
        torch.manual_seed(config["trainer"]["seed"])
        untrained, _, _ = mean_loss(build_model(model_config).to(device), val, seq_len, max_tokens, batch_size,
                                    device, byte_lengths)  # fmt: skip
    except DataError as exc:
        raise InputError(str(exc)) from None
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
        untrained_val_loss=round(untrained, 6),
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
    )
    apply_gate(result, gate, baseline)
    if export:
        result.export_dir = str(export_model(model, snapshot_dir / TOKENIZER, run.root / "export"))
    if export_s3_uri:
        from common.s3 import S3Settings, upload_directory

        upload_directory(Path(result.export_dir), export_s3_uri, S3Settings(endpoint_url=s3_endpoint_url))
        result.export_s3_uri = export_s3_uri
    save_evaluation(run, result, html_report(result, run))
    log.info("run %s step %d: val loss %.4f (perplexity %.2f, %.4f bits/byte), untrained %.4f; %s", run_id,
             result.step, val_loss, result.val_perplexity, result.val_bits_per_byte, untrained,
             result.gate_line())  # fmt: skip
    if not result.gate_passed and not gate.warn_only:
        raise StepFailed(
            f"quality gate failed for run {run_id} at step {result.step}: {'; '.join(result.gate_reasons)}"
        )
    return result


def run_snapshot(storage_root: str, config: dict[str, Any], run_id: str, dataset: str) -> Path:
    """The snapshot the run trained on (its config.json names it): its val split and tokenizer are the ones that
    measure this checkpoint, whatever was staged since."""
    trained_on, snapshot = config_snapshot(config)
    if trained_on != dataset:
        raise InputError(f"run {run_id!r} trained on dataset {trained_on!r}, not {dataset!r}: evaluate it with its "
                         "own dataset")  # fmt: skip
    directory = DatasetPaths.of(storage_root, dataset).resolve_snapshot(snapshot)
    if directory is None or not (directory / META).is_file():
        raise InputError(f"run {run_id!r} trained on snapshot {snapshot} of dataset {dataset!r}, which is gone "
                         f"({directory} has no {META}): it was pruned, or the run is incomplete")  # fmt: skip
    return directory


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
        raise InputError(f"{run.checkpoints} holds no committed checkpoint ({which}): run {run.root.name!r} is "
                         "incomplete")  # fmt: skip
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
        samples.append({"prompt": prompt, "text": tokenizer.decode(ids[0].tolist(), skip_special_tokens=False)})
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
    return {"skipped_steps": skipped,
            "loss_spikes": [{"step": r["step"], "loss": r["loss"]} for r in rows if r.get("loss_spike")]}  # fmt: skip


def read_metrics(run: RunPaths) -> list[dict[str, Any]]:
    try:
        return [json.loads(line) for line in run.metrics.read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        return []


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
            log.info("run %s: step %d evaluated; eval/eval.json keeps step %d, the newest evaluated", run.root.name,
                     result.step, newest)  # fmt: skip


def write_evaluation_files(directory: Path, result: EvalResult, report_html: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    with atomic_open(directory / "report.md", "w") as f:
        f.write(result.markdown())
    with atomic_open(directory / "report.html", "w") as f:
        f.write(report_html)
    write_json(directory / "eval.json", asdict(result))


def history_entry(result: EvalResult) -> dict[str, Any]:
    return {"step": result.step, "evaluated_at": result.evaluated_at, "checkpoint": result.checkpoint,
            "val_tokens": result.val_tokens, "val_loss": result.val_loss,
            "val_bits_per_byte": result.val_bits_per_byte, "gate_passed": result.gate_passed,
            "gate_reasons": result.gate_reasons, "baseline_run_id": result.baseline_run_id,
            "baseline_step": result.baseline_step, "report_dir": Path(result.report_dir).name}  # fmt: skip


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
    try:
        lines = run.eval_history.read_text().splitlines()
    except FileNotFoundError:
        return []
    entries = []
    for line in lines:
        try:
            entries.append(json.loads(line))
        except ValueError:
            continue
    return entries


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
        timespec="seconds")  # fmt: skip
    append_history(run, {"step": step, "evaluated_at": when, "checkpoint": evaluation.get("checkpoint", ""),
                         "val_tokens": evaluation.get("val_tokens"), "val_loss": evaluation.get("val_loss"),
                         "val_bits_per_byte": evaluation.get("val_bits_per_byte"),
                         "gate_passed": evaluation.get("gate_passed"), "gate_reasons": evaluation.get("gate_reasons"),
                         "baseline_run_id": evaluation.get("baseline_run_id", ""),
                         "baseline_step": evaluation.get("baseline_step"),
                         "report_dir": run.eval_step(step).name})  # fmt: skip
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
            raise InputError(f"baseline run {baseline!r}: no evaluation of {at} under {other.eval} (evaluated steps: "
                             f"{steps or 'none'})")  # fmt: skip
        theirs = json.loads(path.read_text())
        if theirs.get("val_set_sha256") != val_set or theirs.get("dataset") != dataset:
            recorded = f"dataset {theirs.get('dataset')!r}, val set {theirs.get('val_set_sha256')}"
            raise InputError(f"baseline run {baseline!r} was evaluated on another val set ({recorded}) than run "
                             f"{run_id!r} (dataset {dataset!r}, val set {val_set}): their losses do not compare; "
                             "choose a baseline of the same dataset and val set, or evaluate it again")  # fmt: skip
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
        raise InputError(f"baseline 'previous': no other run of dataset {dataset!r} evaluated on the same val set "
                         f"({val_set}){f' at step {step}' if step else ''} under {storage_root}")  # fmt: skip
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
        result.gate_reasons.append(f"baseline run {baseline.run_id} at step {baseline.step} ({baseline.which}): val "
                                   f"bits/byte {result.val_bits_per_byte:.4f} {'<=' if ok else '>'} "
                                   f"{theirs['val_bits_per_byte']:.4f} + margin {gate.baseline_margin:.4f} (bits per "
                                   f"byte compare across tokenizers{note})")  # fmt: skip
        result.gate_passed &= ok


# -- reports and export -----------------------------------------------------------------------------------


def curves_png(rows: list[dict[str, Any]]) -> bytes:
    """Loss, learning rate and tokens/s against step, as one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    figure, axes = plt.subplots(1, 3, figsize=(12, 3.2))
    steps = [r["step"] for r in rows]
    for axis, key, title in zip(axes, ("loss", "lr", "tokens_per_s"), ("train loss", "learning rate", "tokens/s"),
                                strict=True):  # fmt: skip
        axis.plot(steps, [r.get(key) for r in rows])
        axis.set_title(title)
        axis.set_xlabel("step")
        axis.grid(alpha=0.3)
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100)
    plt.close(figure)
    return buffer.getvalue()


def html_report(result: EvalResult, run: RunPaths) -> str:
    rows = read_metrics(run)
    plot = (f'<img id="curves" alt="training curves" src="data:image/png;base64,'
            f'{base64.b64encode(curves_png(rows)).decode()}">' if rows else "<p>No training metrics.</p>")  # fmt: skip
    table = "".join(f"<tr><td>{html.escape(n)}</td><td>{a}</td><td>{b}</td></tr>" for n, a, b in result.table_rows())
    samples = "".join(f"<li><b>{html.escape(s['prompt'])}</b><pre>{html.escape(s['text'])}</pre></li>"
                      for s in result.samples)  # fmt: skip
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>Evaluation of {html.escape(result.run_id)}</title>
<style>body{{font-family:sans-serif;margin:2em;max-width:72em}} table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:4px 10px}} pre{{white-space:pre-wrap;background:#f6f6f6;padding:6px}}</style>
</head><body>
<h1>Evaluation of run {html.escape(result.run_id)}</h1>
<p>Checkpoint {html.escape(result.checkpoint)} at step {result.step} ({result.train_tokens_seen:,} training tokens);
{result.val_tokens:,} held-out tokens evaluated. {html.escape(result.gate_line())}</p>
<h2>Training</h2>
{plot}
<p>{html.escape(result.health_line())}</p>
<h2>Validation</h2>
<table id="eval"><tr><th>metric</th><th>trained</th><th>untrained</th></tr>{table}</table>
<h2>Greedy samples</h2>
<ul id="samples">{samples}</ul>
</body></html>
"""


def export_model(model: torch.nn.Module, tokenizer_file: Path, directory: Path) -> Path:
    """save_pretrained (safetensors) with the tokenizer: AutoModelForCausalLM.from_pretrained(directory) loads it."""
    from transformers import PreTrainedTokenizerFast

    from components.stage_data.tokenization import EOS

    staging = directory.with_name(f".{directory.name}.new")
    shutil.rmtree(staging, ignore_errors=True)  # left by a killed run
    model.to("cpu").save_pretrained(staging, safe_serialization=True)
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_file), eos_token=EOS, bos_token=EOS)
    tokenizer.save_pretrained(staging)
    replace_dir(staging, directory)
    log.info("exported the model in Hugging Face format to %s", directory)
    return directory
