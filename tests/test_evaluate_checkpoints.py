"""Several checkpoints of a run evaluated in turn (components/evaluate_checkpoint/checkpoints.py): which ones, each
kept, only the newest gated and exported; and the benchmark curves the reports draw from them (report.py)."""

import json
from pathlib import Path
from typing import Any

import pytest

from common.errors import InputError, StepFailed
from components.evaluate_checkpoint.benchmarks import BenchmarkSettings
from components.evaluate_checkpoint.checkpoints import checkpoints_to_evaluate, evaluate_checkpoints
from components.evaluate_checkpoint.core import evaluate_checkpoint
from components.evaluate_checkpoint.gate import Gate
from components.evaluate_checkpoint.inputs import check_checkpoints
from tests.benchmark_data import write_task_data
from tests.evaluate_helpers import QUICK, short_samples  # noqa: F401 (short_samples: a fixture the tests name)
from trainer.layout import CHECKPOINT_COMMIT, RunPaths


def history_steps(run: RunPaths) -> list[int]:
    return [json.loads(line)["step"] for line in run.eval_history.read_text().splitlines()]


def test_which_checkpoints_a_value_names(tmp_path: Path) -> None:
    """Committed checkpoints 20, 40 and 60 (30 not committed), 40 evaluated: what each value selects, oldest first,
    and what is refused, in one line."""
    run = RunPaths(tmp_path / "runs" / "run-1")
    for step in (20, 30, 40, 60):
        (run.checkpoints / f"step_{step:08d}").mkdir(parents=True)
        if step != 30:
            (run.checkpoints / f"step_{step:08d}" / CHECKPOINT_COMMIT).write_text("{}")
    run.eval_step(40).mkdir(parents=True)
    (run.eval_step(40) / "eval.json").write_text(json.dumps({"step": 40}))

    assert checkpoints_to_evaluate(run) == checkpoints_to_evaluate(run, "latest") == [60]
    assert checkpoints_to_evaluate(run, "") == [60]
    assert checkpoints_to_evaluate(run, "unevaluated") == [20, 60]
    assert checkpoints_to_evaluate(run, "60, 20,20") == [20, 60]
    for step in (20, 60):
        run.eval_step(step).mkdir()
        (run.eval_step(step) / "eval.json").write_text(json.dumps({"step": step}))
    assert checkpoints_to_evaluate(run, "unevaluated") == [60], "all evaluated: the newest again"

    with pytest.raises(InputError) as missing:
        checkpoints_to_evaluate(run, "20,30,80")
    assert str(missing.value) == (
        f"run 'run-1' holds no committed checkpoint of step 30, 80 under {run.checkpoints} (committed: 20, 40, 60)"
    )
    empty = RunPaths(tmp_path / "runs" / "run-2")
    with pytest.raises(InputError, match=r"holds no committed checkpoint \(any\): run 'run-2' is incomplete"):
        checkpoints_to_evaluate(empty, "unevaluated")


@pytest.mark.parametrize("text", ["newest", "0", "-20", "20,", "20;40", "latest,20", "2e3", "²"])
def test_a_malformed_value_is_refused(text: str) -> None:
    with pytest.raises(InputError) as refused:
        check_checkpoints(text)
    assert str(refused.value) == (
        f"checkpoint {text!r}: give 'latest', 'unevaluated', or step numbers separated by commas (e.g. 100,200)"
    )


def test_the_submission_check_refuses_a_malformed_value() -> None:
    from pipelines.package import _check_evaluation

    inputs: dict[str, Any] = {
        "max_tokens": 1024,
        "checkpoint": "unevaluated",
        "export_s3_uri": "",
        "benchmarks": "",
        "benchmark_data_uri": "",
        "benchmark_limit": 0,
        "benchmark_gate": "",
    }
    _check_evaluation(inputs)
    _check_evaluation(inputs | {"checkpoint": "100,200"})
    with pytest.raises(InputError, match="checkpoint 'every': give 'latest'"):
        _check_evaluation(inputs | {"checkpoint": "every"})


def test_run_local_passes_the_checkpoints_on_and_refuses_a_malformed_value(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--eval-checkpoints is the eval_checkpoints parameter ('latest' by default); a malformed one is refused before
    the pipeline starts, in one line, nothing written."""
    from pipelines.cli import build_parser, main
    from pipelines.cli.run_settings import run_local_arguments

    root = tmp_path / "fsx"
    given = ["run-local", "--storage-root", str(root)]
    assert run_local_arguments(build_parser().parse_args(given))["eval_checkpoints"] == "latest"
    chosen = build_parser().parse_args([*given, "--eval-checkpoints", "unevaluated"])
    assert run_local_arguments(chosen)["eval_checkpoints"] == "unevaluated"
    assert main([*given, "--eval-checkpoints", "20,x"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "hyperpod-pretrain run-local: error: eval_checkpoints: checkpoint '20,x': give 'latest', 'unevaluated', or "
        "step numbers separated by commas (e.g. 100,200)"
    ]
    assert not root.exists()


@pytest.mark.usefixtures("short_samples")
def test_unevaluated_checkpoints_are_evaluated_oldest_first(trained_copy: Path) -> None:
    """Step 40 evaluated first; 'unevaluated' then evaluates 20 and 60, in that order, each kept; again, with all
    three evaluated, it evaluates the newest, 60, once more. The run's eval/eval.json is 60's throughout."""
    run = RunPaths.of(trained_copy, "run-1")
    [forty] = evaluate_checkpoints(str(trained_copy), "synthetic", "run-1", checkpoints="40", **QUICK)
    assert forty.step == 40 and run.eval_steps() == [40]

    results = evaluate_checkpoints(str(trained_copy), "synthetic", "run-1", checkpoints="unevaluated", **QUICK)
    assert [r.step for r in results] == [20, 60] and run.eval_steps() == [20, 40, 60]
    assert history_steps(run) == [40, 20, 60]
    for result in (forty, *results):
        kept = json.loads((run.eval_step(result.step) / "eval.json").read_text())
        assert (kept["step"], kept["val_loss"]) == (result.step, result.val_loss)
        assert kept["checkpoint"].endswith(f"step_{result.step:08d}")
    assert json.loads(run.eval_result.read_text())["step"] == 60

    [again] = evaluate_checkpoints(str(trained_copy), "synthetic", "run-1", checkpoints="unevaluated", **QUICK)
    assert again.step == 60 and history_steps(run) == [40, 20, 60, 60]
    assert json.loads(run.eval_result.read_text())["evaluated_at"] == again.evaluated_at


def test_what_is_refused_is_refused_before_anything_is_written(trained_copy: Path) -> None:
    """A step not on the volume, the newest's gate (its baseline), a damaged older checkpoint and the export's
    settings: one line each, and no evaluation written, not even of the older steps."""
    run = RunPaths.of(trained_copy, "run-1")

    def refused(checkpoints: str, **settings: Any) -> str:
        with pytest.raises(InputError) as error:
            evaluate_checkpoints(str(trained_copy), "synthetic", "run-1", checkpoints=checkpoints, **settings)
        assert not run.eval.exists(), f"{checkpoints}: something was written"
        return str(error.value)

    assert refused("20,50", **QUICK) == (
        f"run 'run-1' holds no committed checkpoint of step 50 under {run.checkpoints} (committed: 20, 40, 60)"
    )
    assert refused("20,60", gate=Gate(baseline_run_id="run-0"), **QUICK).startswith(
        "baseline run 'run-0': no evaluation of any step"
    )
    assert refused("20,60", gate=Gate(benchmarks="piqa:acc>0.5"), **QUICK).startswith("benchmark gate")
    assert refused("unevaluated", export=False, export_s3_uri="s3://bucket/models").startswith(
        "export S3 URI 's3://bucket/models': give s3://bucket/prefix, with the export on"
    )
    assert refused("20,40", benchmarks=BenchmarkSettings(tasks="piqa:x"), **QUICK).startswith("benchmark 'piqa:x'")
    damaged = run.checkpoints / "step_00000020" / "__0_0.distcp"
    damaged.write_bytes(b"\x00garbage")
    assert refused("unevaluated", **QUICK).startswith(f"checkpoint {damaged.parent} is truncated or altered")


@pytest.mark.usefixtures("short_samples")
def test_only_the_newest_is_gated_and_exported(trained_copy: Path) -> None:
    """Steps 20 and 60 with the export on and a gate every checkpoint fails: 20 is evaluated and kept without a gate
    or an export; 60 is exported (export.json names it) and fails the step, once kept."""
    run = RunPaths.of(trained_copy, "run-1")
    with pytest.raises(StepFailed, match="quality gate failed for run run-1 at step 60: val loss"):
        evaluate_checkpoints(
            str(trained_copy), "synthetic", "run-1", max_tokens=128, checkpoints="20,60", gate=Gate(max_val_loss=0.01)
        )
    assert run.eval_steps() == [20, 60] and history_steps(run) == [20, 60]
    old, newest = (json.loads((run.eval_step(s) / "eval.json").read_text()) for s in (20, 60))
    assert (old["gate_passed"], old["gate_reasons"], old["export_dir"]) == (True, [], "")
    assert newest["gate_passed"] is False and newest["gate_reasons"][0].startswith("val loss ")
    assert newest["export_step"] == 60 and newest["export_dir"] == str(run.root / "export")
    assert json.loads((run.root / "export" / "export.json").read_text())["step"] == 60


@pytest.mark.usefixtures("short_samples")
def test_the_benchmarks_of_each_evaluated_step_are_plotted(
    trained_copy: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Steps 40 and 60 scored on piqa (4 items): its data staged once, by the first; each step's acc and acc_norm
    in the history; the report's curves hold both steps' values, one marked line per metric from 0 to 1, and no
    perplexity plot (piqa measures none)."""
    from components.evaluate_checkpoint import benchmarks
    from components.evaluate_checkpoint.report import Curves, curve_figures

    mirror = write_task_data(tmp_path / "mirror", items=4)["piqa"].parent
    staged: list[str] = []
    stage = benchmarks.stage_benchmark_data
    monkeypatch.setattr(
        benchmarks, "stage_benchmark_data", lambda tasks, uri, *rest: staged.append(uri) or stage(tasks, uri, *rest)
    )
    settings = BenchmarkSettings(tasks="piqa", data_uri=str(mirror), limit=4)
    results = evaluate_checkpoints(
        str(trained_copy), "synthetic", "run-1", checkpoints="40,60", benchmarks=settings, **QUICK
    )
    assert [r.step for r in results] == [40, 60] and staged == [str(mirror)]
    run = RunPaths.of(trained_copy, "run-1")
    scores = {
        (r.step, f"{b['task']}:{b['metric']}"): b["value"] for r in results for b in r.benchmarks if b["items"] == 4
    }
    assert sorted(scores) == [(40, "piqa:acc"), (40, "piqa:acc_norm"), (60, "piqa:acc"), (60, "piqa:acc_norm")]
    history = [json.loads(line) for line in run.eval_history.read_text().splitlines()]
    assert [(h["step"], h["benchmarks"]) for h in history] == [
        (s, {n: v for (step, n), v in scores.items() if step == s}) for s in (40, 60)
    ]

    curves = Curves.of(run, results[-1], json.loads(run.config.read_text()))
    assert curves.benchmarks == {
        name: [(s, scores[s, name]) for s in (40, 60)] for name in ("piqa:acc", "piqa:acc_norm")
    }
    figures = {name: figure.axes[0] for name, _, figure in curve_figures(curves)}
    assert "curve-benchmarks" in figures and "curve-benchmark-perplexity" not in figures
    axis = figures["curve-benchmarks"]
    assert axis.get_ylim() == (0, 1)
    drawn = {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in axis.get_lines()}
    assert drawn == {name: ([40, 60], [v for _, v in points]) for name, points in curves.benchmarks.items()}
    assert all(line.get_marker() not in ("None", "", None) for line in axis.get_lines())
    assert '<img id="curve-benchmarks" ' in (run.eval_step(60) / "report.html").read_text()

    # step 60 evaluated again without benchmarks: its latest evaluation counts, and 40's points remain
    evaluate_checkpoint(str(trained_copy), "synthetic", "run-1", checkpoint="60", **QUICK)
    again = Curves.of(run, results[0], json.loads(run.config.read_text()))
    assert again.benchmarks == {name: [(40, scores[40, name])] for name in ("piqa:acc", "piqa:acc_norm")}


def test_perplexity_has_a_plot_of_its_own() -> None:
    """lambada's perplexity is left out of the accuracies' plot (0 to 1) and drawn on its own, on a log axis."""
    from components.evaluate_checkpoint.report import Curves, curve_figures

    points = {
        "lambada_openai:acc": [(100, 0.05), (200, 0.12)],
        "lambada_openai:perplexity": [(100, 3000.0), (200, 80.0)],
        "piqa:acc": [(200, 0.6)],
    }
    curves = Curves("run-1", [{"step": 100, "loss": 3.0}], [], [], [], 0.0, benchmarks=points)
    figures = {name: figure.axes[0] for name, _, figure in curve_figures(curves)}
    assert [line.get_label() for line in figures["curve-benchmarks"].get_lines()] == ["lambada_openai:acc", "piqa:acc"]
    perplexity = figures["curve-benchmark-perplexity"]
    assert [(line.get_label(), list(line.get_ydata())) for line in perplexity.get_lines()] == [
        ("lambada_openai:perplexity", [3000.0, 80.0])
    ]
    assert perplexity.get_yscale() == "log"
