"""What one evaluation found, and how it reads in the reports: its own module, light (no torch), because every part
of the step uses it: measuring fills it in, the gate marks it, the history keeps it, the reports print it and the
export names its step."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

NOT_RECORDED = "not recorded"
WEIGHTING = (
    "Totals: each dataset weighted by its share of the mixture (as training drew them), not by its val tokens; bits "
    "per byte is that blend's nats over its bytes."
)
BENCHMARKS_NOTE = (
    "Scored by lm-evaluation-harness on the staged task data (each task's copy is named by its content hash in "
    "eval.json): acc is the share of items whose most likely choice is right, acc_norm the same with each choice's "
    "log-likelihood divided by its length in characters."
)
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
    # A mixture's datasets (dataset_results), in its order; the val figures above are then their totals, each
    # dataset weighted by its share of the mixture (WEIGHTING). [] for a run of one dataset.
    datasets: list[dict[str, Any]] = field(default_factory=list)
    # The trainer's own val figures at this step (its --eval-every row: measure.py training_eval), shown beside these:
    # val_loss, val_bits_per_byte, val_tokens, eval_tokens, batch_size, datasets (name: val_loss). None: no such row.
    training_eval: dict[str, Any] | None = None
    # The benchmarks run (benchmarks.py benchmark_rows): task, metric, value, stderr, shots, items, data_sha256, and
    # the starting model's and the baseline's value (None when the baseline did not measure the same).
    benchmarks: list[dict[str, Any]] = field(default_factory=list)

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
        values |= {f"{b['task']}_{b['metric']}": b["value"] for b in self.benchmarks}
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

    def benchmark_columns(self) -> list[str]:
        baseline = (
            [f"baseline {self.baseline_run_id}"]
            if any(b["baseline_value"] is not None for b in self.benchmarks)
            else []
        )
        return ["task", "shots", "items", "metric", "trained", "± stderr", self.start, *baseline]

    def benchmark_rows(self) -> list[tuple[str, ...]]:
        """Each benchmark metric of the trained model (with lm-eval's standard error), the starting model's and the
        baseline's (when it measured the same task, shots and data)."""

        def shown(value: float | None) -> str:
            return "" if value is None else f"{value:.4f}"

        baseline = len(self.benchmark_columns()) > 7
        return [
            (
                b["task"],
                str(b["shots"]),
                f"{b['items']:,}",
                b["metric"],
                shown(b["value"]),
                shown(b["stderr"]),
                shown(b["start_value"]),
                *([shown(b["baseline_value"])] if baseline else []),
            )
            for b in self.benchmarks
        ]

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
                *markdown_table(self.table_columns(), self.table_rows()),
                "",
                f"Evaluated on {self.val_tokens:,} held-out tokens{self.totals_note()}; training lowered the loss by "
                f"{self.loss_reduction:.4f} nats/token. {self.gate_line()}",
                "",
                *([self.training_line(), ""] if self.training_eval else []),
                *(
                    [
                        "Per dataset:",
                        "",
                        *markdown_table(self.dataset_columns(), self.dataset_rows()),
                        "",
                        WEIGHTING,
                        "",
                    ]
                    if self.datasets
                    else []
                ),
                *(
                    [
                        "## Benchmarks",
                        "",
                        *markdown_table(self.benchmark_columns(), self.benchmark_rows()),
                        "",
                        BENCHMARKS_NOTE,
                        "",
                    ]
                    if self.benchmarks
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
            f" of the {len(self.datasets)} datasets' val splits (the figures are their totals, weighted by the "
            "mixture's shares)"
        )

    def training_line(self) -> str:
        """The trainer's own val loss at this step (--eval-every) beside this evaluation's. Both read each val split's
        first windows with the same function, so over the same tokens they agree (exactly in fp32; on a GPU up to
        bf16 and the batches); over other tokens (--eval-tokens is not max_tokens) they differ as that text does."""
        theirs = self.training_eval or {}
        each = ", ".join(f"{name} {loss:.4f}" for name, loss in (theirs.get("datasets") or {}).items())
        tokens = theirs.get("val_tokens")
        budget = f", --eval-tokens {theirs['eval_tokens']:,} of each" if theirs.get("eval_tokens") else ""
        batch = f", batches of {theirs['batch_size']}" if theirs.get("batch_size") else ""
        if tokens == self.val_tokens:
            why = "the same val tokens as here: the same figures, up to the precision and batches each computed in"
        else:
            why = (
                f"not the {self.val_tokens:,} read here: each reads the first windows of the val split"
                f"{'s' if self.datasets else ''}, so the figures differ as that text does"
            )
        read = f"{tokens:,} tokens" if isinstance(tokens, int) else "tokens not recorded"
        return (
            f"Training measured step {self.step} too (--eval-every): val loss {theirs['val_loss']:.4f}"
            f"{f' ({each})' if each else ''} over {read}{budget}{batch}; {why}."
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


def markdown_table(columns: list[str], rows: list[tuple[str, ...]]) -> list[str]:
    return [
        "| " + " | ".join(columns) + " |",
        "|" + " --- |" * len(columns),
        *("| " + " | ".join(r) + " |" for r in rows),
    ]
