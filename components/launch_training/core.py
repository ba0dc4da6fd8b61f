"""Launch the trainer: what the job runs is decided by its config (config.py), where it runs is the backend's
business.

backend="local" runs torchrun as a subprocess on this machine (CPU and gloo, or local GPUs; local_backend.py);
backend="kubernetes" creates a job in the API the platform compiled in (a kubeflow.org/v1 PyTorchJob or a
trainer.kubeflow.org/v1alpha1 TrainJob; manifest.py) and follows it (k8s_backend.py).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import replace
from pathlib import Path
from typing import Any

from components.launch_training.config import LaunchConfig, LaunchResult
from components.launch_training.k8s_backend import launch_on_kubernetes
from components.launch_training.local_backend import run_torchrun
from trainer.atomic import read_json_lines
from trainer.layout import RunPaths
from trainer.tracking import watch_line, where_to_look


def launch(cfg: LaunchConfig, api_client: Any = None) -> LaunchResult:
    """Train; `api_client` (a kubernetes ApiClient) replaces the in-cluster/kubeconfig one, for tests."""
    cfg.validate()
    if cfg.backend == "kubernetes":
        result = launch_on_kubernetes(cfg, api_client)
    else:
        for directory in (cfg.run_paths.root, cfg.run_paths.logs):
            Path(directory).mkdir(parents=True, exist_ok=True)
        result = run_torchrun(cfg)
    result.trainer_attempt = trainer_attempt(cfg.run_paths)
    return replace(result, **training_figures(cfg.run_paths))


def training_figures(run: RunPaths) -> dict[str, float | int]:
    """The training in a few numbers, from rank 0's metrics.jsonl: the last logged step's loss and tokens seen, the
    last val loss, and the median tokens/s and MFU of the logged steps (none of them when nothing was logged)."""
    logged = read_json_lines(run.metrics)
    rows = [r for r in logged if r.get("loss") is not None and r.get("tokens") is not None]
    figures: dict[str, float | int] = {}
    if rows:
        figures |= {"final_loss": rows[-1]["loss"], "tokens_seen": rows[-1]["tokens"]}
    if evaluated := [r["val_loss"] for r in logged if r.get("val_loss") is not None]:
        figures["val_loss"] = evaluated[-1]
    for key in ("tokens_per_s", "mfu"):
        if values := [r[key] for r in rows if r.get(key) is not None]:
            figures[key] = statistics.median(values)
    return figures


def trainer_attempt(run: RunPaths) -> int:
    """The attempt the trainer last started as (its status.json), the one verify_nccl judges."""
    try:
        return int(json.loads(run.status.read_text()).get("attempt", 0))
    except (OSError, ValueError, TypeError, AttributeError):
        return 0


def summary_markdown(result: LaunchResult) -> str:
    """The launcher's report in the KFP UI."""

    def seconds(value: float | None) -> str:
        return "-" if value is None else f"{value:,.0f} s"

    rows = [
        ("run", f"`{result.run_id}` ({result.run_dir})"),
        ("backend", result.backend),
        ("world size", str(result.world_size)),
        ("wall time", seconds(result.seconds)),
    ]
    if result.backend == "kubernetes":
        rows += [
            (
                result.job_kind,
                f"`{result.namespace}/{result.job_name}`" + (" (re-attached)" if result.reattached else ""),
            ),
            ("attempt", f"{result.attempt} (trainer's attempt {result.trainer_attempt})"),
            ("final state", result.state),
            ("queued", seconds(result.queued_s)),
            ("running", seconds(result.running_s)),
            ("restarts", str(result.restarts)),
        ]
    if result.final_loss is not None:
        rows += [
            ("final loss", f"{result.final_loss:.4f} after {result.tokens_seen:,} tokens"),
            ("val loss", "-" if result.val_loss is None else f"{result.val_loss:.4f}"),
            ("tokens/s (median)", "-" if result.tokens_per_s is None else f"{result.tokens_per_s:,.0f}"),
            ("MFU (median)", "-" if result.mfu is None else f"{result.mfu:.1%}"),
        ]
    lines = ["## Training", "", "| | |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows)]
    if watch := watch_line(where_to_look(Path(result.run_dir))):
        lines += ["", watch]
    if result.diagnosis:
        lines += ["", "### Seen on the way", "", *(f"- {line}" for line in result.diagnosis)]
    return "\n".join(lines)
