"""The evaluation's reports: the curves of the run (and its baseline's) as plots, the HTML page with the eval table, the
run's settings and the samples. Apart from the measuring: a report is drawn from what the run directory recorded.

eval/step_<N>/report.html holds the eval table beside the untrained model and the baseline; plots of loss with
checkpoints, resumes and the baseline's curves, learning rate, gradient norm and throughput, and the benchmarks of every
evaluated step as embedded PNGs; the run's settings; the samples.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from components.evaluate_checkpoint.history import read_history
from components.evaluate_checkpoint.measure import read_metrics
from components.evaluate_checkpoint.results import BENCHMARKS_NOTE, NOT_RECORDED, WEIGHTING, EvalResult
from trainer.checkpoint import committed_checkpoints
from trainer.layout import CHECKPOINT_COMMIT, RunPaths

FIGURE_INCHES = (6.4, 3.6)  # 960 x 540 px at FIGURE_DPI; the page scales each plot to its column's width
FIGURE_DPI = 150
SAMPLE_MAX_HEIGHT = "16em"  # a greedy sample taller than this (one of newlines, say) scrolls inside its box
ACCURACIES = ("acc", "acc_norm")  # the benchmark metrics that are shares of items, plotted together from 0 to 1


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
    # "task:metric": (step, value) of each evaluated step that scored it, this evaluation included
    benchmarks: dict[str, list[tuple[int, float]]] = field(default_factory=dict)

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
            benchmarks=evaluated_benchmarks(run, result),
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


def evaluated_benchmarks(run: RunPaths, result: EvalResult) -> dict[str, list[tuple[int, float]]]:
    """Each benchmark metric's value per evaluated step, from eval/history.jsonl (a step evaluated again: its latest
    evaluation's, which may have scored other tasks or none) and `result`, this evaluation, not yet written:
    "task:metric" -> [(step, value)], the names in order."""
    by_step: dict[int, dict[str, float]] = {}
    for entry in read_history(run):
        if isinstance(entry, dict) and isinstance(entry.get("step"), int):
            scores = entry.get("benchmarks")
            by_step[entry["step"]] = scores if isinstance(scores, dict) else {}
    by_step[result.step] = {f"{b['task']}:{b['metric']}": b["value"] for b in result.benchmarks}
    points: dict[str, dict[int, float]] = {}
    for step, scores in by_step.items():
        for name, value in scores.items():
            if isinstance(value, int | float) and math.isfinite(value):
                points.setdefault(str(name), {})[step] = float(value)
    return {name: sorted(points[name].items()) for name in sorted(points)}


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
    baseline's, checkpoints and resumes), a mixture's datasets, the benchmarks of the evaluated steps, learning rate,
    gradient norm, tokens/s. Every magnitude's axis starts at
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
    figures = [
        ("curve-loss", "loss against step", loss),
        *dataset_figures(curves, figure),
        *benchmark_figures(curves, figure),
    ]
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


def benchmark_figures(curves: Curves, figure: Any) -> list[tuple[str, str, Any]]:
    """The benchmarks against step, one marked line per task and metric over the evaluated steps: the accuracies
    (shares of items, 0 to 1) on one plot, a task's metrics in its colour (acc solid, acc_norm dashed); perplexities
    on their own, on a log axis (they fall by orders of magnitude as a model learns). None without benchmarks."""
    accuracies = {n: p for n, p in curves.benchmarks.items() if n.rpartition(":")[2] in ACCURACIES}
    perplexities = {n: p for n, p in curves.benchmarks.items() if n.rpartition(":")[2] == "perplexity"}
    tasks = list(dict.fromkeys(n.partition(":")[0] for n in curves.benchmarks))
    figures = []
    if accuracies:
        made, axis = figure("benchmarks (accuracy)")
        for name, points in accuracies.items():
            task, _, metric = name.partition(":")
            style = "s--" if metric == "acc_norm" else "o-"
            axis.plot(*zip(*points, strict=True), style, ms=4, color=f"C{tasks.index(task) % 10}", label=name)
        axis.set_ylim(0, 1)
        axis.legend(fontsize="small", ncols=2)
        figures.append(("curve-benchmarks", "benchmarks against step", made))
    if perplexities:
        made, axis = figure("benchmark perplexity")
        for name, points in perplexities.items():
            shown = [(step, value) for step, value in points if value > 0]  # a log axis
            if shown:
                color = f"C{tasks.index(name.partition(':')[0]) % 10}"
                axis.plot(*zip(*shown, strict=True), "o-", ms=4, color=color, label=name)
        axis.set_yscale("log")
        axis.legend(fontsize="small")
        figures.append(("curve-benchmark-perplexity", "benchmark perplexity against step", made))
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
        f'<p id="weighting">{html.escape(WEIGHTING)}</p>\n'
        if result.datasets
        else ""
    )
    training = f'<p id="training-eval">{html.escape(result.training_line())}</p>\n' if result.training_eval else ""
    benchmarks = (
        f"<h2>Benchmarks</h2>\n{html_table('benchmarks', result.benchmark_columns(), result.benchmark_rows())}\n"
        f"<p>{html.escape(BENCHMARKS_NOTE)}</p>\n"
        if result.benchmarks
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
{training}{per_dataset}{benchmarks}<h2>Training</h2>
<div class="plots">{plots or "<p>No training metrics.</p>"}</div>
<p>Checkpoints (dotted): those kept and those evaluated. Resumes (dashed): {html.escape(resumed)}.</p>
<p>{html.escape(result.health_line())}</p>
<h2>Run settings</h2>
{html_table("settings", ["setting", "value"], run_settings(result, run, config))}
<h2>Greedy samples</h2>
<ul id="samples">{samples}</ul>
</body></html>
"""
