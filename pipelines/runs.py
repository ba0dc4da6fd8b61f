"""`hyperpod-pretrain runs`: one line per run under a storage root, like `kubectl get`.

Everything is read from the run directories (trainer/layout.py), never from KFP or the cluster, so the listing
works on a laptop's local-runs/ and on the FSx volume mounted anywhere. It imports no torch: it answers at once.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.errors import InputError
from components.run_summary.core import PIPELINE_RUN_MARKER, current_pipeline_run, read_step
from trainer.atomic import read_json_lines
from trainer.layout import META, DatasetPaths, RunPaths
from trainer.snapshot import config_snapshot
from trainer.tracking import where_to_look

COLUMNS = ("RUN", "DATASET", "STATE", "STEP", "VAL LOSS", "TRAINED", "UPDATED", "MLFLOW RUN")
SNAPSHOT_SHOWN = 8  # characters of a snapshot id in the table: enough to tell a dataset's snapshots apart


@dataclass(frozen=True)
class RunRow:
    run_id: str
    dataset: str | None  # what the run trains on: its config.json, else its staging's record; None: not known yet
    snapshot: str | None
    state: str  # the newest of the pipeline's summary and the trainer's status
    step: int | None
    max_steps: int | None
    val_loss: float | None  # the newest evaluation's
    val_step: int | None  # the step that evaluation was of
    trained_s: float  # time in training steps (the metrics rows' step times): no start-ups, no gaps between resumes
    updated: float | None  # when the run's state last changed (epoch seconds)
    mlflow_run_id: str | None = None  # its MLflow run, when the trainer sent its metrics to one

    def cells(self, now: float) -> tuple[str, ...]:
        step = "-" if self.step is None else f"{self.step}/{self.max_steps}" if self.max_steps else str(self.step)
        val = "-" if self.val_loss is None else f"{self.val_loss:.3f}@{self.val_step}"
        updated = "-" if self.updated is None else f"{duration(now - self.updated)} ago"
        if self.dataset is None:
            data = "-"
        elif self.snapshot:
            data = f"{self.dataset}@{self.snapshot[:SNAPSHOT_SHOWN]}"
        else:  # its staging failed before the snapshot was written
            data = f"{self.dataset} (no snapshot)"
        trained = duration(self.trained_s) if self.trained_s else "-"
        return self.run_id, data, self.state, step, val, trained, updated, self.mlflow_run_id or "-"


def duration(seconds: float) -> str:
    """kubectl's AGE style: 45s, 12m, 3h20m, 2d4h."""
    s = max(int(seconds), 0)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600}h"


def list_runs(storage_root: str | Path) -> list[RunRow]:
    """Every run under `storage_root`/runs, the most recently updated first."""
    runs_dir = Path(storage_root) / "runs"
    if not runs_dir.is_dir():
        raise InputError(f"--storage-root {storage_root}: no runs/ directory there (is it the volume's root?)")
    rows = [read_run(RunPaths(d)) for d in runs_dir.iterdir() if d.is_dir() and not d.name.startswith(".")]
    return sorted(rows, key=lambda r: (r.updated or 0, r.run_id), reverse=True)


def read_run(run: RunPaths) -> RunRow:
    status = _read_json(run.status)
    config = _read_json(run.config)
    state, updated = str(status.get("state", "")), _float(status.get("time"))
    pipeline = _pipeline_state(run)
    if pipeline and (updated is None or pipeline["time"] >= updated):
        state, updated = pipeline["state"], pipeline["time"]
    evaluations = [e for e in read_json_lines(run.eval_history) if isinstance(e.get("val_loss"), int | float)]
    newest = evaluations[-1] if evaluations else {}
    step, max_steps = status.get("step"), config.get("trainer", {}).get("max_steps")
    dataset, snapshot = trained_on(run, config) or (None, None)
    return RunRow(
        run_id=run.root.name,
        dataset=dataset,
        snapshot=snapshot,
        state=(state or "no status").lower(),
        step=step if isinstance(step, int) else None,
        max_steps=max_steps if isinstance(max_steps, int) else None,
        val_loss=newest.get("val_loss"),
        val_step=newest.get("step"),
        trained_s=training_seconds(read_json_lines(run.metrics)),
        updated=updated,
        mlflow_run_id=where_to_look(run.root).get("mlflow_run_id"),
    )


def trained_on(run: RunPaths, config: dict[str, Any]) -> tuple[str, str] | None:
    """(dataset, snapshot) of the run, so that runs on different data are not compared as if alike: what the trainer
    recorded in config.json (a resumed run keeps its snapshot), else, before the trainer started, what the pipeline's
    staging recorded it would train on; None when neither says."""
    found: Any = None
    if config:
        try:
            found = config_snapshot(config)
            if mixture := config["dataset"].get("mixture"):  # each dataset's name, the first's snapshot
                found = ("+".join(m["dataset"] for m in mixture), found[1])
        except (KeyError, TypeError, AttributeError):  # a config.json from another tool, or half of one
            found = None
    if found is None:
        details = read_step(run, "stage-data").get("details")
        found = (details.get("dataset"), details.get("snapshot")) if isinstance(details, dict) else None
        if found is not None and not snapshot_written(run, *found):
            found = (found[0], "")  # planned, and its staging failed before the snapshot was written
    ok = found is not None and isinstance(found[0], str) and found[0] and isinstance(found[1], str)
    return (found[0], found[1]) if ok else None


def snapshot_written(run: RunPaths, dataset: Any, snapshot: Any) -> bool:
    """Whether staging finished the snapshot its record names (its meta.json, written last, is there)."""
    try:
        return (DatasetPaths.of(run.root.parent.parent, str(dataset)).snapshot(str(snapshot)) / META).is_file()
    except InputError:  # a name that is no dataset's or snapshot's
        return False


def training_seconds(rows: list[dict[str, Any]]) -> float:
    """Time spent in training steps: each row's mean step time times the steps since the row before it."""
    total, previous = 0.0, 0
    for row in sorted(rows, key=lambda r: r.get("step", 0)):
        step, step_time = row.get("step"), row.get("step_time_s")
        if isinstance(step, int) and isinstance(step_time, int | float):
            total += step_time * max(step - previous, 0)
            previous = step
    return total


def _pipeline_state(run: RunPaths) -> dict[str, Any]:
    """What the pipeline run now marked on the run directory says, and when: its summary's state once it ended,
    'started' while its steps before the trainer run (an older pipeline run's summary describes that run only)."""
    marker = run.steps / PIPELINE_RUN_MARKER
    marked, summary = current_pipeline_run(marker), _read_json(run.summary)
    try:
        if summary and (not marked or summary.get("pipeline_run_id") == marked):
            return {"state": str(summary["state"]), "time": run.summary.stat().st_mtime}
        if marked:
            return {"state": "started", "time": marker.stat().st_mtime}
    except (KeyError, OSError):
        pass
    return {}


def render_table(rows: list[RunRow], now: float | None = None) -> str:
    """Columns padded to their widest cell, as kubectl prints them."""
    now = time.time() if now is None else now
    table = [COLUMNS, *(row.cells(now) for row in rows)]
    widths = [max(len(line[i]) for line in table) for i in range(len(COLUMNS))]
    return "\n".join("   ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip() for line in table)


def _read_json(path: Path) -> dict[str, Any]:
    """A run file as a dict; {} when it is missing or half-readable (a listing never fails on one run)."""
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _float(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) else None
