"""`hyperpod-pretrain runs`: the listing of a storage root's runs, from files the real writers wrote."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from components.evaluate_checkpoint.core import evaluate_checkpoint
from components.run_summary.core import recorded_step
from pipelines.cli import main
from pipelines.runs import duration, list_runs, render_table, training_seconds
from trainer.layout import DatasetPaths, RunPaths
from trainer.train_ddp import write_status


def test_runs_lists_each_run_with_its_state_step_val_loss_and_time(
    trained_copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    finished = RunPaths.of(trained_copy, "run-1")
    evaluate_checkpoint(str(trained_copy), "synthetic", "run-1", export=False)
    # A second run, mid-training: the trainer's status at step 30 (its rows cut there).
    running = RunPaths.of(trained_copy, "run-2")
    shutil.copytree(finished.root, running.root, ignore=shutil.ignore_patterns("eval", "steps", "summar*"))
    rows = [json.loads(line) for line in running.metrics.read_text().splitlines()]
    running.metrics.write_text("".join(json.dumps(r) + "\n" for r in rows if r["step"] <= 30))
    write_status(running, 0, "running", step=30, world_size=2)
    run_2_mlflow = {
        "tracking_uri": "http://mlflow:5000",
        "experiment": "hyperpod-pretrain",
        "run_id": "6b1f0c2d",
        "url": "http://mlflow:5000/#/experiments/1/runs/6b1f0c2d",
    }  # as trainer/tracking.py records it
    running.mlflow_run.write_text(json.dumps(run_2_mlflow))
    # ...whose pipeline staged the dataset again since: the trainer keeps its snapshot, and so does the listing.
    with recorded_step(str(trained_copy), "run-2", "stage-data", {}) as record:
        record.details = {"dataset": "synthetic", "snapshot": "0123456789abcdef"}
    # A third: a pipeline run that has started its steps (preflight ran) but not its trainer.
    started = RunPaths.of(trained_copy, "run-3")
    started.root.mkdir(parents=True)
    with recorded_step(str(trained_copy), "run-3", "preflight", {}, pipeline_run_id="kfp-run-3"):
        pass
    # A fourth: its staging ended, its trainer has not started: the dataset is the one staging recorded.
    RunPaths.of(trained_copy, "run-4").root.mkdir(parents=True)
    with recorded_step(str(trained_copy), "run-4", "stage-data", {}, pipeline_run_id="kfp-run-4") as record:
        record.details = {"files_copied": 3, "groups": 1, "dataset": "web", "snapshot": "3f2a9c1d0e4b5a69"}
    written = DatasetPaths.of(trained_copy, "web").snapshot("3f2a9c1d0e4b5a69")
    written.mkdir(parents=True)
    (written / "meta.json").write_text("{}")
    # A fifth: its staging planned a snapshot and failed before writing it (the finalize step refused the corpus).
    RunPaths.of(trained_copy, "run-5").root.mkdir(parents=True)
    with recorded_step(str(trained_copy), "run-5", "stage-data", {}, pipeline_run_id="kfp-run-5") as record:
        record.details = {"dataset": "web", "snapshot": "77aa00bb11cc22dd"}

    assert main(["runs", "--storage-root", str(trained_copy)]) == 0
    header, *lines = capsys.readouterr().out.splitlines()
    assert header.split() == ["RUN", "DATASET", "STATE", "STEP", "VAL", "LOSS", "TRAINED", "UPDATED", "MLFLOW", "RUN"]
    table = {line.split()[0]: line.split() for line in lines}
    assert [line.split()[0] for line in lines] == ["run-5", "run-4", "run-3", "run-2", "run-1"]  # newest first
    assert "web (no snapshot)" in lines[0], "its dataset, and no snapshot that was never written"
    evaluation = json.loads(finished.eval_result.read_text())
    trained_on = json.loads(finished.config.read_text())["dataset"]
    assert len(trained_on["snapshot"]) > 8, "a snapshot id the table cuts"
    shown = f"synthetic@{trained_on['snapshot'][:8]}"
    assert table["run-1"][1:5] == [shown, "done", "60/60", f"{evaluation['val_loss']:.3f}@60"]
    assert table["run-2"][1:5] == [shown, "running", "30/60", "-"]
    assert table["run-3"][1:6] == ["-", "started", "-", "-", "-"]
    assert table["run-4"][1:3] == ["web@3f2a9c1d", "started"]
    assert table["run-2"][6].endswith("s") and table["run-2"][7] == "ago"
    assert (table["run-2"][-1], table["run-1"][-1]) == ("6b1f0c2d", "-")

    assert main(["runs", "--storage-root", str(trained_copy), "--json"]) == 0
    listed = {r["run_id"]: r for r in json.loads(capsys.readouterr().out)}
    full = training_seconds([json.loads(line) for line in finished.metrics.read_text().splitlines()])
    assert listed["run-1"]["trained_s"] == pytest.approx(full) and 0 < listed["run-2"]["trained_s"] < full
    assert {run: (r["dataset"], r["snapshot"]) for run, r in listed.items()} == {
        "run-1": ("synthetic", trained_on["snapshot"]),
        "run-2": ("synthetic", trained_on["snapshot"]),
        "run-3": (None, None),
        "run-4": ("web", "3f2a9c1d0e4b5a69"),
        "run-5": ("web", ""),
    }
    assert (listed["run-2"]["mlflow_run_id"], listed["run-1"]["mlflow_run_id"]) == ("6b1f0c2d", None)


def test_a_half_written_or_foreign_run_directory_does_not_break_the_listing(tmp_path: Path) -> None:
    broken = RunPaths.of(tmp_path, "broken")
    broken.root.mkdir(parents=True)
    broken.status.write_text('{"state": "runn')  # a reader racing a writer on a volume without rename
    broken.metrics.write_text('{"step": 10, "step_time_s": 0.5}\n{"step": 2')
    (tmp_path / "runs" / "notes.txt").write_text("not a run")
    [row] = list_runs(tmp_path)
    assert (row.run_id, row.dataset, row.state, row.step, row.trained_s) == ("broken", None, "no status", None, 5.0)
    assert render_table([row], now=time.time()).splitlines()[1].split()[:4] == ["broken", "-", "no", "status"]


def test_durations_read_like_kubectl_ages() -> None:
    assert [duration(s) for s in (0, 59, 61, 3599, 3600 + 125, 2 * 86400 + 4 * 3600)] == [
        "0s",
        "59s",
        "1m",
        "59m",
        "1h02m",
        "2d4h",
    ]


def test_runs_on_a_root_without_runs_is_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["runs", "--storage-root", str(tmp_path / "nowhere")]) == 2
    assert capsys.readouterr().err.strip().count("\n") == 0


def test_the_listing_loads_no_torch() -> None:
    """`runs` answers at once: reading which snapshot a run trained on (trainer/snapshot.py) must not load torch."""
    probe = "import sys, pipelines.runs; print(sorted({'torch', 'numpy'} & set(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert result.stdout.strip() == "[]", result.stderr
