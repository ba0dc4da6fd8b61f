"""The local launcher: fails loudly, validates first, and leaves nothing running when it is stopped."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from common.errors import InputError
from components.launch_training.core import launch
from tests.helpers import tiny_launch
from trainer.layout import RunPaths

CLI = str(Path(sys.executable).parent / "hyperpod-pretrain")


@pytest.mark.parametrize(
    "override, message",
    [
        ({"max_steps": 0}, "max-steps must be a positive integer"),
        ({"nproc_per_node": -1}, "nproc-per-node must be a positive integer"),
        ({"preset": "gpt5"}, "preset 'gpt5' is unknown: choose one of tiny"),
        ({"backend": "slurm"}, "backend 'slurm' is unknown"),
        ({"dataset": "not-staged"}, "is not staged"),
        ({"run_id": "../../etc"}, "not a valid name"),
        ({"checkpoint_s3_uri": "s3://Bad_Bucket/x"}, "checkpoint_s3_uri 's3://Bad_Bucket/x': 'Bad_Bucket' is not"),
        ({"s3_endpoint_url": "minio:9000"}, "s3_endpoint_url 'minio:9000' is not an http:// or https:// URL"),
    ],
)
def test_bad_launch_inputs_fail_before_anything_starts(staged_copy: Path, override: dict, message: str) -> None:
    with pytest.raises(InputError, match=message):
        launch(tiny_launch(staged_copy, **{"run_id": "r", **override}))
    assert not (staged_copy / "runs").exists()


def test_the_local_trainer_gets_its_runs_checkpoint_copies_prefix_and_the_endpoint(staged_copy: Path) -> None:
    from components.launch_training.local_backend import torchrun_command

    cfg = tiny_launch(
        staged_copy, "copied", checkpoint_s3_uri="s3://bucket/ckpts", s3_endpoint_url="http://127.0.0.1:9"
    )
    command = torchrun_command(cfg)
    assert command[command.index("--checkpoint-s3-uri") + 1] == "s3://bucket/ckpts/copied"
    assert cfg.trainer_env()["AWS_ENDPOINT_URL"] == "http://127.0.0.1:9"  # run_torchrun's env: the workers'
    plain = tiny_launch(staged_copy, "plain")
    assert "--checkpoint-s3-uri" not in torchrun_command(plain) and "AWS_ENDPOINT_URL" not in plain.trainer_env()


def processes_mentioning(text: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and text in (entry / "cmdline").read_bytes().decode(errors="replace"):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def test_sigterm_stops_torchrun_and_every_worker(staged_copy: Path) -> None:
    """KFP terminates a run by signalling the step: nothing of the training may outlive it."""
    run = RunPaths.of(staged_copy, "cancelled")
    launcher = subprocess.Popen(
        [
            CLI,
            "launch",
            "--storage-root",
            str(staged_copy),
            "--dataset",
            "synthetic",
            "--run-id",
            "cancelled",
            "--preset",
            "tiny",
            "--nproc-per-node",
            "2",
            "--max-steps",
            "100000",
            "--seq-len",
            "64",
            "--log-every",
            "1",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120
    while not run.metrics.exists() and time.monotonic() < deadline and launcher.poll() is None:
        time.sleep(0.2)
    assert run.metrics.exists(), "training never started"
    workers = processes_mentioning(str(run.root))
    assert len(workers) >= 3  # torchrun and two workers

    launcher.send_signal(signal.SIGTERM)
    _, stderr = launcher.communicate(timeout=90)
    assert launcher.returncode == 1
    last = stderr.splitlines()[-1]
    assert "was stopped" in last and "received SIGTERM" in last
    assert "the trainer committed a checkpoint of step" in last and "rerun to resume" in last
    time.sleep(0.5)
    assert [p for p in workers if os.path.exists(f"/proc/{p}")] == []
    assert processes_mentioning(str(run.root)) == []


def test_the_step_gives_kfps_run_comparison_the_training_in_a_few_numbers(
    uninterrupted: RunPaths, tmp_path: Path
) -> None:
    """The launch step's metrics (KFP's run comparison) and report: the last logged loss and tokens seen, the last
    val loss, the median tokens/s and MFU (none on a CPU), from rank 0's metrics.jsonl."""
    import statistics
    from dataclasses import replace

    from kfp import dsl

    from components.kfp_support import log_numbers
    from components.launch_training.config import LaunchResult
    from components.launch_training.core import summary_markdown, training_figures
    from trainer.atomic import read_json_lines

    rows = read_json_lines(uninterrupted.metrics)
    figures = training_figures(uninterrupted)
    assert figures == {
        "final_loss": rows[-1]["loss"],
        "tokens_seen": rows[-1]["tokens"],
        "val_loss": [r["val_loss"] for r in rows if "val_loss" in r][-1],
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rows),
    }
    result = replace(LaunchResult("straight", str(uninterrupted.root), "local", 2, 1.0), **figures)
    metrics = dsl.Metrics(uri=str(tmp_path / "metrics"))
    log_numbers(metrics, result)
    assert {k: metrics.metadata[k] for k in figures} == {k: float(v) for k, v in figures.items()}
    assert f"| final loss | {rows[-1]['loss']:.4f} after {rows[-1]['tokens']:,} tokens |" in summary_markdown(result)
    assert training_figures(RunPaths(tmp_path / "never-ran")) == {}
