"""Evaluating a run trained on a mixture: each dataset on its own val split, the totals, the report's per-dataset
table and plots, and the baseline of a mixture."""

import html
import json
import logging
import math
import re
import shutil
from pathlib import Path

import pytest
import torch

from common.errors import InputError
from components.evaluate_checkpoint.core import evaluate_checkpoint
from components.evaluate_checkpoint.results import WEIGHTING, EvalResult
from tests.evaluate_helpers import QUICK, table
from trainer.layout import RunPaths


class Messages(logging.Handler):
    """The log lines of a module-scoped fixture's evaluation (caplog is per test)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture(scope="module")
def mixture_eval(
    mixture_run: RunPaths, tmp_path_factory: pytest.TempPathFactory
) -> tuple[RunPaths, EvalResult, list[str]]:
    """The mixed run (conftest's mixture_run, copied: evaluation writes into the run) evaluated once at its newest
    checkpoint (step 20) over up to 16384 tokens of each val split in batches of 8, as its --eval-every rows were
    measured: (the copy's run, the result, the evaluation's log lines). Samples of 2 tokens (not read here)."""
    root = tmp_path_factory.mktemp("mixture-eval")
    shutil.copytree(mixture_run.root.parent.parent, root, symlinks=True, dirs_exist_ok=True)
    messages, logger = Messages(), logging.getLogger("components.evaluate_checkpoint.core")
    logger.addHandler(messages)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr("components.evaluate_checkpoint.measure.SAMPLE_TOKENS", 2)
            result = evaluate_checkpoint(str(root), "synthetic", "mixed", max_tokens=16384, batch_size=8, export=False)
    finally:
        logger.removeHandler(messages)
        logger.setLevel(level)
    return RunPaths.of(root, "mixed"), result, messages.lines


MIXED = ["synthetic", "code", "math"]


def test_a_mixture_is_evaluated_on_each_datasets_val_split(
    mixture_eval: tuple[RunPaths, EvalResult, list[str]],
) -> None:
    """eval.json has each dataset's share, tokens trained and epochs (the checkpoint's and the rows' accounting), and
    its own val figures; the top-level ones are their totals, weighted by the mixture's shares. Each dataset's loss is
    the one the trainer measured at step 20 over the same tokens, and so are the totals."""
    from components.evaluate_checkpoint.measure import find_checkpoint, read_metrics

    run, result, lines = mixture_eval
    saved = json.loads((run.eval_step(20) / "eval.json").read_text())
    assert saved == json.loads(run.eval_result.read_text()) and saved["step"] == result.step == 20
    datasets = saved["datasets"]
    assert [d["dataset"] for d in datasets] == MIXED
    assert [d["weight"] for d in datasets] == [0.6, 0.3, 0.1] and [d["share"] for d in datasets] == [0.6, 0.3, 0.1]
    mixture = {m["dataset"]: m for m in json.loads(run.config.read_text())["dataset"]["mixture"]}
    assert all(d["snapshot"] == mixture[d["dataset"]]["snapshot"] for d in datasets)
    assert all(d["train_split_tokens"] == mixture[d["dataset"]]["train_tokens"] for d in datasets)
    losses = [d["val_loss"] for d in datasets]
    assert all(math.isfinite(d["val_loss"]) and 0 < d["val_loss"] < d["untrained_val_loss"] - 1.0 for d in datasets)
    assert len(set(losses)) == 3, "three val splits of different text: three losses"
    tokens = sum(d["val_tokens"] for d in datasets)
    assert saved["val_tokens"] == tokens
    assert min(losses) <= saved["val_loss"] <= max(losses)
    assert saved["val_loss"] == pytest.approx(sum(d["val_loss"] * d["share"] for d in datasets), abs=2e-6)
    assert saved["untrained_val_loss"] == pytest.approx(
        sum(d["untrained_val_loss"] * d["share"] for d in datasets), abs=2e-6
    )
    assert (
        min(d["val_bits_per_byte"] for d in datasets)
        <= saved["val_bits_per_byte"]
        <= max(d["val_bits_per_byte"] for d in datasets)
    )

    # the tokens trained on from each dataset: the checkpoint's sequences of it, together all the tokens trained
    state = find_checkpoint(run, "20").trainer_state()
    seq_len = json.loads(run.config.read_text())["trainer"]["seq_len"]
    assert [d["tokens_trained"] for d in datasets] == [state["data"]["consumed"][n] * seq_len for n in MIXED]
    assert sum(d["tokens_trained"] for d in datasets) == saved["train_tokens_seen"] == 20 * 8 * 2 * seq_len
    assert sum(d["trained_fraction"] for d in datasets) == pytest.approx(1.0, abs=1e-5)

    # the trainer's row at step 20 (--eval-every 10: over eval_tokens = 16384 tokens, batches of 8): the same
    row = {r["step"]: r for r in read_metrics(run)}[20]
    for d in datasets:
        theirs = row["datasets"][d["dataset"]]
        assert d["val_loss"] == pytest.approx(theirs["val_loss"], rel=1e-5), d["dataset"]
        assert d["val_bits_per_byte"] == pytest.approx(theirs["val_bpb"], rel=1e-5), d["dataset"]
        assert (d["tokens_trained"], d["epochs"]) == (theirs["tokens"], theirs["epochs"]), d["dataset"]
    assert (saved["val_loss"], saved["val_tokens"]) == (pytest.approx(row["val_loss"], rel=1e-5), row["val_tokens"])
    assert saved["val_bits_per_byte"] == pytest.approx(row["val_bpb"], rel=1e-5)

    assert {k: v for k, v in result.metrics().items() if k.startswith("val_loss_")} == {
        f"val_loss_{d['dataset']}": d["val_loss"] for d in datasets
    }
    (line,) = [line for line in lines if line.startswith("run mixed step 20: val loss ")]
    assert "; val loss per dataset: " + ", ".join(f"{d['dataset']} {d['val_loss']:.4f}" for d in datasets) in line


def test_each_dataset_of_a_mixture_measures_as_its_val_split_alone(
    mixture_eval: tuple[RunPaths, EvalResult, list[str]],
) -> None:
    """mean_loss of the step-20 weights and of the untrained model (the trainer's initial weights for the run's seed)
    on each dataset's val split alone: each dataset's figures, and the totals computed from them."""
    from tokenizers import Tokenizer

    from components.evaluate_checkpoint.loading import starting_model
    from components.evaluate_checkpoint.measure import find_checkpoint
    from trainer.checkpoint import read_weights
    from trainer.data import load_meta, load_split
    from trainer.evaluation import bits_per_byte, mean_loss, token_bytes
    from trainer.layout import TOKENIZER, DatasetPaths
    from trainer.model import build_model, config_from_dict

    run, result, _ = mixture_eval
    config = json.loads(run.config.read_text())
    root, cpu = run.root.parent.parent, torch.device("cpu")
    snapshots = {
        m["dataset"]: DatasetPaths.of(root, m["dataset"]).snapshot(m["snapshot"]) for m in config["dataset"]["mixture"]
    }
    lengths = token_bytes(Tokenizer.from_file(str(snapshots["code"] / TOKENIZER)), load_meta(snapshots["code"]))
    model = build_model(config_from_dict(config["model"]))
    model.load_state_dict(read_weights(find_checkpoint(run, "20")))
    untrained, _ = starting_model(config_from_dict(config["model"]), config, cpu, torch.float32)
    measured = {}
    for name, directory in snapshots.items():
        val = load_split(directory, "val")
        measured[name] = mean_loss(model, val, 64, 16384, 8, cpu, lengths)
        assert measured[name][1] == min(16384, val.num_windows(64) * 64)
        mine = {d["dataset"]: d for d in result.datasets}[name]
        assert (mine["val_loss"], mine["val_tokens"]) == (pytest.approx(measured[name][0], abs=1e-6), measured[name][1])
        assert mine["val_bits_per_byte"] == pytest.approx(bits_per_byte(*measured[name]), abs=1e-6)
        assert mine["untrained_val_loss"] == pytest.approx(
            mean_loss(untrained, val, 64, 16384, 8, cpu, lengths)[0], abs=1e-6
        )
    shares = {
        m["dataset"]: m["weight"] / sum(n["weight"] for n in config["dataset"]["mixture"])
        for m in config["dataset"]["mixture"]
    }
    loss = sum(shares[name] * x for name, (x, _, _) in measured.items())
    bytes_per_token = sum(shares[name] * b / t for name, (_, t, b) in measured.items())
    assert result.val_loss == pytest.approx(loss, abs=1e-6)
    assert result.val_bits_per_byte == pytest.approx(loss / bytes_per_token / math.log(2), abs=1e-6)


def test_the_report_of_a_mixture_has_each_dataset(mixture_eval: tuple[RunPaths, EvalResult, list[str]]) -> None:
    """report.md and report.html: the per-dataset table with eval.json's figures; the HTML's per-dataset plots; the
    settings name the mixture. TensorBoard has each dataset's evaluation charts at the step."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run, result, _ = mixture_eval
    datasets = json.loads(run.eval_result.read_text())["datasets"]
    expected = [
        [
            d["dataset"],
            f"{d['share']:.1%}",
            f"{d['tokens_trained']:,} ({d['trained_fraction']:.1%})",
            f"{d['epochs']:.2f}",
            f"{d['val_loss']:.4f}",
            f"{d['val_bits_per_byte']:.4f}",
            f"{d['untrained_val_loss']:.4f}",
        ]
        for d in datasets
    ]
    assert expected[0][:3] == ["synthetic", "60.0%", f"{datasets[0]['tokens_trained']:,} (60.0%)"]
    header = ["dataset", "share", "tokens trained", "epochs", "val loss", "val bits per byte", "untrained loss"]
    page = (run.eval_step(20) / "report.html").read_text()
    assert table(page, "datasets") == [header, *expected]
    markdown = (run.eval_step(20) / "report.md").read_text()
    assert "| " + " | ".join(header) + " |" in markdown
    assert all("| " + " | ".join(row) + " |" in markdown for row in expected), markdown
    assert "1,984 held-out tokens of the 3 datasets' val splits" in markdown
    assert WEIGHTING in markdown and f'<p id="weighting">{html.escape(WEIGHTING)}</p>' in page
    # the trainer's own row at step 20 beside it: the same tokens (--eval-tokens 16384 = max_tokens), the same loss
    assert result.training_eval is not None and result.training_eval["val_loss"] == pytest.approx(result.val_loss)
    assert (
        f"val loss {result.training_eval['val_loss']:.4f} (" in markdown and "the same val tokens as here" in markdown
    )
    assert '<p id="training-eval">Training measured step 20 too (--eval-every)' in page
    for name in ("curve-loss", "curve-dataset-val-loss", "curve-dataset-tokens"):
        assert re.search(f'<img id="{name}" alt="[^"]+" src="data:image/png;base64,iVBORw0KGgo', page), name
    settings = dict(table(page, "settings")[1:])
    assert settings["dataset"] == "mixture of " + ", ".join(
        f"{d['dataset']} (snapshot {d['snapshot']}, weight {d['weight']:g})" for d in datasets
    )
    split_tokens = sum(d["train_split_tokens"] for d in datasets)
    assert result.train_split_tokens == split_tokens
    assert settings["epochs over the train split"].startswith(f"{result.train_tokens_seen / split_tokens:.2f} (")
    events = EventAccumulator(str(run.tensorboard), size_guidance={"scalars": 0})
    events.Reload()
    for d in datasets:
        for chart, key in (("val_loss", "val_loss"), ("bits_per_byte", "val_bits_per_byte")):
            found = [(e.step, e.value) for e in events.Scalars(f"evaluation/{d['dataset']}/{chart}")]
            assert found == [(20, pytest.approx(d[key], rel=1e-6))], (d["dataset"], chart)


def test_the_mixture_plots_are_what_the_rows_and_the_evaluations_recorded(
    mixture_eval: tuple[RunPaths, EvalResult, list[str]], tmp_path: Path
) -> None:
    """Each dataset's val loss: the rows' (steps 10 and 20) and the kept evaluations' marks (step 20, and a step-10
    evaluation kept beside it in a copy); each dataset's tokens at every logged step."""
    from components.evaluate_checkpoint.measure import read_metrics
    from components.evaluate_checkpoint.report import Curves, curve_figures

    run, result, _ = mixture_eval
    copy = RunPaths(tmp_path / "runs" / "mixed")
    shutil.copytree(run.root, copy.root, symlinks=True)
    rows = {r["step"]: r for r in read_metrics(copy)}
    older = {
        "step": 10,
        "datasets": [{"dataset": n, "val_loss": rows[10]["datasets"][n]["val_loss"] + 0.5} for n in MIXED],
    }
    copy.eval_step(10).mkdir(parents=True)
    (copy.eval_step(10) / "eval.json").write_text(json.dumps(older))
    curves = Curves.of(copy, result, json.loads(copy.config.read_text()))
    assert curves.datasets == MIXED
    assert curves.dataset_evaluations == {
        d["dataset"]: [(10, rows[10]["datasets"][d["dataset"]]["val_loss"] + 0.5), (20, d["val_loss"])]
        for d in result.datasets
    }
    figures = {name: figure.axes[0] for name, _, figure in curve_figures(curves)}
    assert list(figures) == [
        "curve-loss",
        "curve-dataset-val-loss",
        "curve-dataset-tokens",
        "curve-lr",
        "curve-grad-norm",
        "curve-tokens-per-s",
    ]
    losses = figures["curve-dataset-val-loss"]
    assert [t.get_text() for t in losses.get_legend().get_texts()] == [
        f"{n} ({what})" for n in MIXED for what in ("training", "evaluations")
    ]
    drawn = {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in losses.get_lines()}
    for name in MIXED:
        assert drawn[f"{name} (training)"] == ([10, 20], [rows[s]["datasets"][name]["val_loss"] for s in (10, 20)])
        assert drawn[f"{name} (evaluations)"] == tuple(map(list, zip(*curves.dataset_evaluations[name], strict=True)))
    tokens = figures["curve-dataset-tokens"]
    assert tokens.get_ylim()[0] == 0
    drawn = {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in tokens.get_lines()}
    assert drawn == {n: (sorted(rows), [rows[s]["datasets"][n]["tokens"] for s in sorted(rows)]) for n in MIXED}
    assert drawn["math"][1][-1] == {d["dataset"]: d for d in result.datasets}["math"]["tokens_trained"]


def test_a_mixture_is_compared_only_with_evaluations_on_the_same_datasets_val_sets(
    mixture_eval: tuple[RunPaths, EvalResult, list[str]],
) -> None:
    """A mixture's val set is none of its datasets' alone: an evaluation of its first dataset alone is no baseline for
    it, one of the same mixture is (find_baseline, as the gate calls it)."""
    from components.evaluate_checkpoint.gate import find_baseline

    run, result, _ = mixture_eval
    root = run.root.parent.parent
    per_dataset = {d["dataset"]: d["val_set_sha256"] for d in result.datasets}
    assert all(per_dataset.values()) and result.val_set_sha256 not in per_dataset.values()
    single = RunPaths.of(root, "single")
    single.eval.mkdir(parents=True)
    alone = {
        "step": 20,
        "dataset": "synthetic",
        "val_loss": 2.5,
        "val_bits_per_byte": 0.8,
        "val_set_sha256": per_dataset["synthetic"],
    }
    single.eval_result.write_text(json.dumps(alone))
    with pytest.raises(
        InputError,
        match="baseline 'previous': no other run of dataset 'synthetic' evaluated on the "
        f"same val set \\({result.val_set_sha256}\\)",
    ):
        find_baseline(str(root), "synthetic", "mixed", "previous", result.val_set_sha256)
    with pytest.raises(InputError, match="baseline run 'single' was evaluated on another val set"):
        find_baseline(str(root), "synthetic", "mixed", "single", result.val_set_sha256)
    shutil.copytree(run.eval, root / "runs" / "mixed-0" / "eval")
    found = find_baseline(str(root), "synthetic", "mixed", "previous", result.val_set_sha256)
    assert (found.run_id, found.step, found.evaluation["val_loss"]) == ("mixed-0", 20, result.val_loss)


def test_a_mixture_whose_snapshot_is_gone_is_refused_naming_the_dataset(mixture_run: RunPaths, tmp_path: Path) -> None:
    root = tmp_path / "fsx"
    shutil.copytree(mixture_run.root.parent.parent, root, symlinks=True)
    code = next(m for m in json.loads(mixture_run.config.read_text())["dataset"]["mixture"] if m["dataset"] == "code")
    shutil.rmtree(root / "datasets" / "code" / "snapshots" / code["snapshot"])
    with pytest.raises(
        InputError, match=f"run 'mixed' trained on snapshot {code['snapshot']} of dataset 'code', which is gone"
    ) as refused:
        evaluate_checkpoint(str(root), "synthetic", "mixed", **QUICK)
    assert "\n" not in str(refused.value)
    assert not RunPaths.of(root, "mixed").eval.exists(), "refused before anything was written"
