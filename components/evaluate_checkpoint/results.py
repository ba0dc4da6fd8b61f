"""What one evaluation found, and how it reads in the reports: its own module, light (no torch), because every part
of the step uses it: measuring fills it in, the gate marks it, the history keeps it, the reports print it and the
export names its step."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

NOT_RECORDED = "not recorded"
EXPORT_RECORD = "export.json"  # in the export: which checkpoint its weights are


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
