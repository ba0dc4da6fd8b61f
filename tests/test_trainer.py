"""The trainer under a real torchrun with 2 processes (gloo, CPU), through the local launcher."""

import json
import math
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from common.errors import InputError, StepFailed
from components.evaluate_checkpoint.report import Resume, resumes
from components.launch_training.core import launch
from components.launch_training.local_backend import torchrun_command
from components.launch_training.manifest import JobSpec, render_job
from components.launch_training.progress import TrainingWatch
from tests.helpers import EXACT, snapshot_dir, tiny_launch, write_single_file_checkpoint
from tests.test_schedule import legacy_lr_factor
from trainer.checkpoint import SCHEMA, read_checkpoint
from trainer.config import parse_config
from trainer.data import TokenBatches, load_meta, load_split
from trainer.dcp_io import MODEL, OPTIM, apply_state
from trainer.layout import RunPaths
from trainer.metrics import plan_line
from trainer.model import architecture_differences, build_model, config_from_dict, model_config
from trainer.preemption import ExitCode
from trainer.schedule import LRSchedule, ScheduleSettings


def read_metrics(run: RunPaths) -> list[dict]:
    return [json.loads(line) for line in run.metrics.read_text().splitlines()]


def test_trains_logs_and_checkpoints(trained_root: Path) -> None:
    run = RunPaths.of(trained_root, "run-1")
    records = read_metrics(run)
    assert [r["step"] for r in records] == [10, 20, 30, 40, 50, 60]
    for r in records:
        assert {"step", "loss", "lr", "tokens", "tokens_per_s"} <= r.keys()
    assert records[-1]["tokens"] == 60 * 8 * 64 * 2  # steps x batch x seq_len x ranks
    assert records[-1]["loss"] < records[0]["loss"] - 1.0

    state = read_checkpoint(run.latest_checkpoint)
    assert state["step"] == 60 and state["world_size"] == 2 and state["preset"] == "tiny"
    assert state["data"]["offset"] > 0
    # Both ranks wrote a share of the (replicated, deduplicated) tensors; each kept its own random generators.
    shares = sorted(p.stat().st_size for p in run.latest_checkpoint.glob("__*_*.distcp"))
    assert len(shares) == 2 and shares[0] > 0.3 * shares[1], shares
    first, second = state["rng"]
    assert not torch.equal(first["torch"], second["torch"]), "each rank's own RNG state, not one deduplicated copy"
    assert not list(run.checkpoints.glob(".*")), "no temporary checkpoint files left"
    config = json.loads(run.config.read_text())
    assert config["trainer"]["max_steps"] == 60 and config["model"]["n_layer"] == 2
    # Rank 0's console lines (trainer/metrics.py): the plan once, the first step's time once, a line per logged step.
    log_text = run.rank_log(0).read_text()
    parameters = sum(p.numel() for p in build_model(config_from_dict(config["model"])).parameters())
    train_tokens = len(load_split(snapshot_dir(trained_root, "synthetic"), "train"))
    assert log_text.count(f"INFO trainer: {plan_line(parameters, 8 * 64 * 2, 60, train_tokens)}\n") == 1
    assert len(re.findall(r"INFO trainer: step 1 took \d+\.\ds \(includes compile/warm-up\)\n", log_text)) == 1
    shape = (
        r"INFO trainer: step (\d+)/60  loss \d\.\d{4}  lr \d\.\de-\d  gnorm \d+\.\d\d  tok/s [\d.]+k?  mfu —  "
        r"eta (\d+m\d\ds|\d+s)\n"
    )
    logged = re.findall(shape, log_text)
    assert [int(step) for step, _ in logged] == [10, 20, 30, 40, 50, 60] and logged[-1][1] == "0s", logged
    assert "INFO trainer: step " not in run.rank_log(1).read_text(), "rank 0 alone says how training goes"
    assert "comms self-test" in run.rank_log(1).read_text()
    assert run.attempts() == [1], "one start, one attempt, agreed by both ranks"
    for rank in (0, 1):
        report = json.loads(run.comms_report(rank, 1).read_text())
        assert report["all_reduce_correct"] is True and report["attempt"] == 1


def test_a_resume_with_another_architecture_is_refused_naming_the_fields(trained_root: Path, tmp_path: Path) -> None:
    """The same preset with another sequence length: the fields that differ are named in the step's first line (another
    preset differs in more fields, the same check: trainer/train_ddp.py Trainer.resume), the run exits 2, nothing is
    trained or saved. A resume under another learning-rate schedule is refused by the same path (Trainer.resume, the
    schedule's own check: tests/test_schedule.py names each difference)."""
    root = tmp_path / "fsx"
    shutil.copytree(trained_root, root, symlinks=True)
    with pytest.raises(StepFailed) as failure:
        launch(tiny_launch(root, "run-1", max_steps=80, seq_len=128, nproc_per_node=1))  # a refusal: one rank
    first_line = str(failure.value).splitlines()[0]
    assert "exit code" in first_line and "is of preset 'tiny'" in first_line and "n_positions: 64 -> 128" in first_line
    run = RunPaths.of(root, "run-1")
    status = json.loads(run.status.read_text())
    assert status["state"] == "bad-input" and status["exit_code"] == ExitCode.BAD_INPUT
    assert "another architecture" in status["error"] and "\n" not in status["error"]
    assert read_checkpoint(run.latest_checkpoint)["step"] == 60, "nothing trained, nothing saved"


def test_sample_order_does_not_depend_on_world_size() -> None:
    """One global batch at world size 2 is the same windows as two ranks' batches at world size 1, halved."""
    tokens = np.arange(10_000, dtype=np.uint16)
    one = TokenBatches(tokens, seq_len=16, batch_size=8, rank=0, world_size=1, seed=3)
    two = [TokenBatches(tokens, seq_len=16, batch_size=4, rank=r, world_size=2, seed=3) for r in (0, 1)]
    for _ in range(5):
        x1, _ = one.next_batch()
        x2 = torch.cat([b.next_batch()[0] for b in two])
        assert torch.equal(x1, x2)
    assert one.position == two[0].position == two[1].position


# -- preemption, exact resume, elasticity -------------------------------------------------------------


def start_torchrun(cfg) -> subprocess.Popen:
    """The trainer under torchrun exactly as the local launcher starts it, but left for the test to signal."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", **cfg.trainer_env()}
    cfg.run_paths.logs.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(
        torchrun_command(cfg),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def preempt_at_random_step(cfg, low: int, high: int) -> dict:
    """Start the trainer under torchrun, SIGTERM torchrun once a random step in [low, high] is logged, as the kubelet
    does to the container; the run's status, which must say preempted."""
    at = random.Random().randint(low, high)
    proc = start_torchrun(cfg)
    wait_for_step(cfg.run_paths, at, proc)
    os.kill(proc.pid, signal.SIGTERM)
    output, _ = proc.communicate(timeout=60)
    status = json.loads(cfg.run_paths.status.read_text())
    assert status["state"] == "preempted" and status["exit_code"] == ExitCode.PREEMPTED, output[-2000:]
    assert at <= status["step"], f"signalled at step >= {at}, stopped at {status['step']}"
    assert read_checkpoint(cfg.run_paths.latest_checkpoint)["step"] == status["step"]
    status["output"] = output
    return status


def assert_same_rows(rows: list[dict], reference: list[dict], context: str) -> None:
    """Every step's loss, gradient norm and learning rate, to the bit."""
    assert [r["step"] for r in rows] == [r["step"] for r in reference]
    for mine, theirs in zip(rows, reference, strict=True):
        assert (mine["loss"], mine["grad_norm"], mine["lr"]) == (theirs["loss"], theirs["grad_norm"], theirs["lr"]), (
            f"step {mine['step']} differs {context}"
        )


def wait_for_step(run: RunPaths, step: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if run.metrics.exists() and any(json.loads(r)["step"] >= step for r in run.metrics.read_text().splitlines()):
            return
        time.sleep(0.05)
    raise AssertionError(f"training never reached step {step}")


def test_sigterm_checkpoints_within_the_jobs_budget_and_resume_is_bit_identical_and_watched(
    staged_copy: Path, uninterrupted: RunPaths, mlflow_server
) -> None:
    """With the environment the rendered job gives torchrun (its shutdown timeout from the pod's grace period, 120 s
    less a margin, which the trainer takes as its save budget) and asynchronous periodic saves, a SIGTERM at a random
    step: the checkpoint committed within that budget; resumed to the end, every row repeats the uninterrupted run's,
    and each checkpoint saved in the background holds exactly its step's weights (the copy overlaps the next steps),
    each rank having staged only the share it writes. The run is watched in TensorBoard and MLflow through the stop,
    the resume and the evaluation: each logged step once, with its value; the evaluation's reports as artifacts."""
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from components.evaluate_checkpoint.core import evaluate_checkpoint
    from trainer.tracking import RUN_TAG, flat_params

    pod = render_job(JobSpec(name="budget", image="img:1", trainer_args=[]))["spec"]["pytorchReplicaSpecs"]["Worker"]
    env = {e["name"]: e["value"] for e in pod["template"]["spec"]["containers"][0]["env"]}
    timing = {k: env[k] for k in ("TRAINER_GRACE_PERIOD_S", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT")}
    assert timing == {"TRAINER_GRACE_PERIOD_S": "120", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "100"}
    tracking = {"TRAINER_MLFLOW_TRACKING_URI": mlflow_server.url, "TRAINER_MLFLOW_EXPERIMENT": "sigterm"}
    cfg = tiny_launch(
        staged_copy, "preempted", **EXACT, extra_env=timing | tracking | {"TRAINER_ASYNC_CHECKPOINT": "true"}
    )
    status = preempt_at_random_step(cfg, 3, 30)
    assert status["step"] < 40
    assert re.search(
        rf"stopped by SIGTERM at step {status['step']}: checkpoint committed [\d.]+s after the signal "
        r"\(budget 100s\)",
        status["output"],
    ), status["output"][-2000:]
    launch(cfg)  # resume to the end
    rows = read_metrics(cfg.run_paths)
    assert_same_rows(rows, read_metrics(uninterrupted), f"after a SIGTERM at {status['step']}")
    for step in {10, 20, 30} - {status["step"]}:  # saved in the background (the stop's own save is blocking)
        if (cfg.run_paths.checkpoints / f"step_{step:08d}").is_dir():  # the 3 newest are kept
            mine = read_checkpoint(cfg.run_paths.checkpoints / f"step_{step:08d}")
            theirs = read_checkpoint(uninterrupted.checkpoints / f"step_{step:08d}")
            for name, tensor in theirs["model"].items():
                assert torch.equal(mine["model"][name], tensor), f"{name} of the async step-{step} checkpoint differs"
    shares = []
    for rank in (0, 1):
        line = re.search(
            r"this rank writes ([\d.]+) MB of the ([\d.]+) MB state \(2 ranks; the largest tensor is "
            r"([\d.]+) MB\)",
            cfg.run_paths.rank_log(rank).read_text(),
        )
        staged, state, largest = map(float, line.groups())
        assert 0 < staged <= state / 2 + largest, line.group(0)
        shares.append(staged)
    assert abs(sum(shares) - state) <= 0.002, "the two shares make the state, once"
    evaluated = evaluate_checkpoint(str(staged_copy), "synthetic", "preempted")

    # TensorBoard's own reader: every chart's points at the rows' steps, each step once, the rows' values.
    events = EventAccumulator(str(cfg.run_paths.tensorboard), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    expected = charted(rows)
    assert set(expected) <= set(events.Tags()["scalars"])
    for chart, series in expected.items():
        assert_series([(e.step, e.value) for e in events.Scalars(chart)], series, chart)
    notes = [e.step for e in events.Tensors("events/text_summary")]
    assert notes == [0, status["step"], status["step"], 40], "started, stopped, resumed, stopped"
    assert {e.step for e in events.Scalars("checkpoint/seconds")} == {10, 20, 30, 40} | {status["step"]}
    assert [(e.step, e.value) for e in events.Scalars("evaluation/val_loss")] == [
        (40, pytest.approx(evaluated.val_loss, rel=1e-6))
    ]

    # MLflow: one run for both starts, found by its tag, with config.json's settings and every chart's full history.
    client = MlflowClient(mlflow_server.url)
    experiment = client.get_experiment_by_name("sigterm")
    (found,) = client.search_runs(
        [experiment.experiment_id], filter_string=f"tags.`{RUN_TAG}` = '{cfg.run_paths.root}'"
    )
    record = json.loads(cfg.run_paths.mlflow_run.read_text())
    assert record["run_id"] == found.info.run_id and record["url"].startswith(mlflow_server.url + "/#/experiments/")
    assert found.data.params == flat_params(json.loads(cfg.run_paths.config.read_text()))
    for chart, series in expected.items():
        history = sorted((m.step, m.value) for m in client.get_metric_history(found.info.run_id, chart))
        assert_series(history, series, chart)
    assert f"MLflow: continuing run {found.info.run_id}" in cfg.run_paths.rank_log(0).read_text()
    assert [m.value for m in client.get_metric_history(found.info.run_id, "evaluation/val_loss")] == [
        pytest.approx(evaluated.val_loss, rel=1e-6)
    ]
    artifacts = {a.path for a in client.list_artifacts(found.info.run_id, "evaluation")}
    assert artifacts == {"evaluation/report.html", "evaluation/report.md", "evaluation/eval.json"}
    assert client.get_run(found.info.run_id).data.tags["export"] == evaluated.export_dir


def assert_series(points: list[tuple[int, float]], expected: list[tuple[int, float]], chart: str) -> None:
    """The same steps, in order, and the same values to float32's precision (TensorBoard keeps float32)."""
    assert [step for step, _ in points] == [step for step, _ in expected], chart
    assert [value for _, value in points] == pytest.approx([value for _, value in expected], rel=1e-6), chart


def charted(rows: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """The metrics rows as TensorBoard and MLflow should chart them: {chart: [(step, value)]}."""
    from trainer.tracking import chart_points

    series: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        for chart, value in chart_points(row).items():
            series.setdefault(chart, []).append((row["step"], value))
    return series


def test_the_val_loss_of_an_eval_step_is_the_evaluations_of_that_steps_checkpoint(uninterrupted: RunPaths) -> None:
    """The uninterrupted run measured its val loss every 10 steps (--eval-every 10): in those rows only, with the value
    the evaluation step's function gives for that step's checkpoint over the same tokens, and below the untrained
    model's. (Its rows equal those of runs that evaluate not: test_sigterm_checkpoints_and_resume_is_bit_identical.)"""
    from tokenizers import Tokenizer

    from components.evaluate_checkpoint.measure import find_checkpoint
    from trainer.checkpoint import read_weights
    from trainer.evaluation import bits_per_byte, mean_loss, token_bytes
    from trainer.layout import TOKENIZER

    rows = {r["step"]: r for r in read_metrics(uninterrupted)}
    assert [s for s, r in rows.items() if "val_loss" in r] == [10, 20, 30, 40]
    config = json.loads(uninterrupted.config.read_text())
    snapshot = Path(config["dataset"]["tokenized_dir"])
    val = load_split(snapshot, "val")
    lengths = token_bytes(Tokenizer.from_file(str(snapshot / TOKENIZER)), load_meta(snapshot))
    model = build_model(config_from_dict(config["model"]))
    model.load_state_dict(read_weights(find_checkpoint(uninterrupted, "40")))
    loss, tokens, n_bytes = mean_loss(model, val, 64, 16384, 8, torch.device("cpu"), lengths)
    assert rows[40]["val_tokens"] == tokens == min(16384, val.num_windows(64) * 64)
    assert rows[40]["val_loss"] == loss and math.isfinite(loss), "the same weights, windows, batches: the same sum"
    assert rows[40]["val_bpb"] == bits_per_byte(loss, tokens, n_bytes)
    torch.manual_seed(1234)
    untrained, _, _ = mean_loss(
        build_model(config_from_dict(config["model"])), val, 64, 16384, 8, torch.device("cpu"), lengths
    )
    assert rows[10]["val_loss"] > rows[40]["val_loss"] and rows[40]["val_loss"] < untrained - 1.0
    log_text = uninterrupted.rank_log(0).read_text()
    assert re.search(
        r"INFO trainer: eval step 40: val loss \d\.\d{4} \(\d\.\d{4} bits per byte, [\d,]+ tokens\)\n", log_text
    ), log_text[-2000:]
    assert "eval step" not in uninterrupted.rank_log(1).read_text()


def test_a_full_volume_under_a_background_save_crashes_the_run_and_keeps_the_last_checkpoint(
    staged_copy: Path, trained_root: Path
) -> None:
    """A tmpfs with room for one and a half checkpoints is mounted over the run's checkpoints, so the step-10 save
    fits and the step-20 save, in the background, runs out of space part-way. The run ends as crashed, naming the step
    and the full volume, marked permanent (a restart will not help: the launcher stops the job on it); the step-10
    checkpoint stays the latest and reads back. Where no tmpfs can be mounted (it needs root or CAP_SYS_ADMIN), DCP's
    writer fails with ENOSPC from step 20 instead (--fault-save-at-step)."""
    one_checkpoint = sum(f.stat().st_size for f in RunPaths.of(trained_root, "run-1").latest_checkpoint.iterdir())
    volume = RunPaths.of(staged_copy, "full").checkpoints
    volume.mkdir(parents=True)
    size = (one_checkpoint * 3 // 2 // 4096 + 4) * 4096  # whole pages: each of the ~6 files rounds up
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(volume)], capture_output=True, text=True
    )
    settings, cause = {"TRAINER_ASYNC_CHECKPOINT": "true"}, r"the volume is full \("
    if mounted.returncode != 0:
        settings, cause = {**settings, "TRAINER_FAULT_SAVE_AT_STEP": "20"}, r"OSError: .Errno 28"
    cfg = tiny_launch(staged_copy, "full", max_steps=40, checkpoint_every=10, extra_env=settings)
    try:
        with pytest.raises(StepFailed, match=rf"the checkpoint of step 20 could not be written: {cause}"):
            launch(cfg)
        status = json.loads(cfg.run_paths.status.read_text())
        assert (status["state"], status["exit_code"], status["permanent"]) == ("crashed", ExitCode.CRASHED, True)
        assert "a restart will not help" in status["error"]
        assert read_checkpoint(cfg.run_paths.latest_checkpoint)["step"] == 10
        assert TrainingWatch(cfg.run_paths, since=0).check() == status["error"], "the launcher stops the job on it"
    finally:
        if mounted.returncode == 0:
            subprocess.run(["umount", "--lazy", str(volume)], check=True)


def test_a_preemption_save_that_fails_exits_76_and_leaves_the_last_checkpoint(staged_copy: Path) -> None:
    """The SIGTERM save fails (a full volume from step 11 on, signalled at step 12, before the next periodic save at
    step 20): every worker exits 76 as torchrun reports it (signalled directly, not through torchrun: each worker's
    own exit code shows in torchrun's summary, as a saved preemption's 75 does), status.json says preempted-unsaved
    with the reason, and the step-10 checkpoint stays the latest."""
    cfg = tiny_launch(
        staged_copy,
        "unsaved",
        max_steps=100000,
        log_every=1,
        checkpoint_every=10,
        extra_env={"TRAINER_FAULT_SAVE_AT_STEP": "11"},
    )
    proc = start_torchrun(cfg)
    wait_for_step(cfg.run_paths, 12, proc)
    for pid in worker_pids(proc.pid):
        os.kill(pid, signal.SIGTERM)
    output, _ = proc.communicate(timeout=60)
    assert output.count(f"exitcode  : {int(ExitCode.PREEMPTED_UNSAVED)}") == 2, output[-3000:]
    status = json.loads(cfg.run_paths.status.read_text())
    assert status["state"] == "preempted-unsaved" and status["exit_code"] == ExitCode.PREEMPTED_UNSAVED
    assert "final checkpoint failed: the checkpoint of step" in status["error"] and "Errno 28" in status["error"]
    assert read_checkpoint(cfg.run_paths.latest_checkpoint)["step"] == 10


def worker_pids(torchrun_pid: int) -> list[int]:
    return [
        int(p.name)
        for p in Path("/proc").iterdir()
        if p.name.isdigit() and "trainer.train_ddp" in _cmdline(p) and _ppid(p) == torchrun_pid
    ]


def _cmdline(proc_dir: Path) -> str:
    try:
        return (proc_dir / "cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return ""


def _ppid(proc_dir: Path) -> int:
    try:
        return int((proc_dir / "stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1


def test_truncated_latest_falls_back_to_the_previous_checkpoint(trained_root: Path, tmp_path: Path) -> None:
    root = tmp_path / "fsx"
    shutil.copytree(trained_root, root, symlinks=True)
    run = RunPaths.of(root, "run-1")
    share = run.checkpoints / "step_00000060" / "__1_0.distcp"  # rank 1's share of the newest checkpoint
    share.write_bytes(share.read_bytes()[: share.stat().st_size // 2])
    launch(tiny_launch(root, "run-1", max_steps=70, extend_schedule="continue"))
    log_text = run.rank_log(0).read_text()
    assert "is truncated or altered: __1_0.distcp is" in log_text and "trying an older checkpoint" in log_text
    assert "resumed at step 40" in log_text
    state = read_checkpoint(run.latest_checkpoint)
    assert state["step"] == 70
    # Resumed mid-decay with --extend-schedule continue: from step 40's lr (its row, logged before the resume) the
    # cosine goes on down to the end lr at the new max, with no jump and no re-warm.
    records = read_metrics(run)
    rows = {r["step"]: r["lr"] for r in records}
    assert list(rows) == [10, 20, 30, 40, 50, 60, 70] and records[-1]["tokens"] == 70 * 8 * 64 * 2
    assert resumes(run, records) == [Resume(2, 40)], "the second start's report records the step it went on from"
    assert rows[40] > rows[50] > rows[60] > rows[70] == pytest.approx(5e-4)
    schedule = LRSchedule(ScheduleSettings(1.0, 1, 2, 0.0))
    schedule.load_state_dict(state["schedule"])
    assert [(e.start_step, e.kind) for e in schedule.extensions] == [(40, "continue")]
    assert rows == {step: schedule.lr_at(step) for step in rows}, "the checkpoint's schedule reproduces every lr"
    assert "learning-rate schedule extended at step 40 (max_steps: 60 -> 70): cosine from lr 0.00" in log_text
    # TensorBoard's reader drops the events logged past step 40 before the resume (the writer's purge step): each
    # step once, with the resumed run's values (its lr at 50 and 60 is not the first schedule's).
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run.tensorboard), size_guidance={"scalars": 0})
    events.Reload()
    assert_series([(e.step, e.value) for e in events.Scalars("train/lr")], list(rows.items()), "train/lr")


def assert_the_metrics_rows_fields(rows: list[dict]) -> None:
    """Every row has the step's figures; on a CPU no MFU or GPU memory (no peak FLOP/s to compare with)."""
    for row in rows:
        assert row.keys() >= {
            "step",
            "loss",
            "lr",
            "grad_norm",
            "tokens",
            "tokens_per_s",
            "step_time_s",
            "mfu",
            "input_wait_s",
            "sync_wait_s",
        }
        assert 0 <= row["input_wait_s"] < row["step_time_s"] and 0 <= row["sync_wait_s"] < row["step_time_s"]
        assert row["mfu"] is None and row["gpu_mem_gib"] is None
        assert 0.1 < row["rss_gib"] < 64  # the largest worker process's resident memory


def test_stopping_by_time_with_an_mlflow_server_that_goes_away(staged_copy: Path, mlflow_server) -> None:
    """Stopped by --max-time-s, watched by an MLflow server that goes away midway (the relay in front of it stops
    answering once the MLflow run is open): the run trains to the end and says how many points were not sent."""
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from tests.mlflow_server import Relay
    from trainer.tracking import MlflowFeed

    relay = Relay(mlflow_server.port)
    by_time = tiny_launch(
        staged_copy,
        "by-time",
        max_steps=100000,
        log_every=2,
        extra_env={
            "TRAINER_MAX_TIME_S": "8",
            "TRAINER_MLFLOW_TRACKING_URI": relay.url,
            "TRAINER_MLFLOW_EXPERIMENT": "server-gone",
        },
    )
    client = MlflowClient(mlflow_server.url)
    proc = start_torchrun(by_time)

    def points_arrived() -> bool:
        if not by_time.run_paths.mlflow_run.exists():
            return False
        return bool(
            client.get_metric_history(json.loads(by_time.run_paths.mlflow_run.read_text())["run_id"], "train/loss")
        )

    deadline = time.monotonic() + 60
    while not points_arrived() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    relay.stop()
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, output[-3000:]
    status = json.loads(by_time.run_paths.status.read_text())
    assert status["state"] == "done" and status["reason"] == "max-time" and status["step"] > 0
    assert read_checkpoint(by_time.run_paths.latest_checkpoint)["step"] == status["step"]
    events = EventAccumulator(str(by_time.run_paths.tensorboard), size_guidance={"scalars": 0})
    events.Reload()
    made = {chart: len(events.Scalars(chart)) for chart in events.Tags()["scalars"]}  # every point, on the volume
    run_id = json.loads(by_time.run_paths.mlflow_run.read_text())["run_id"]
    sent = sum(len(client.get_metric_history(run_id, chart)) for chart in made)
    log_text = by_time.run_paths.rank_log(0).read_text()
    said = re.search(r"MLflow: (\d+) metric points of this run were not sent", log_text)
    assert said, log_text[-3000:]
    # A batch the server took as the relay stopped, its answer lost, counts as not sent: at most one batch over (what
    # the feed gathers in its 2 s, up to MlflowFeed.BATCH points).
    missing = sum(made.values()) - sent
    assert 0 < missing <= int(said.group(1)) <= missing + MlflowFeed.BATCH, (made, sent, said.group(0))


def test_elastic_torchrun_restarts_preempted_workers_which_resume(staged_copy: Path) -> None:
    """torchrun --nnodes=1:2 (c10d): workers signalled directly exit 75, torchrun restarts them, they resume."""
    cfg = tiny_launch(staged_copy, "restarted", max_steps=30, log_every=1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1:2",
        "--nproc-per-node=2",
        "--max-restarts=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        "--rdzv-conf=last_call_timeout=1",
        "-m",
        "trainer.train_ddp",
        *cfg.trainer_args(),
    ]
    proc = subprocess.Popen(
        command,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    wait_for_step(cfg.run_paths, 5, proc)
    for pid in worker_pids(proc.pid):
        os.kill(pid, signal.SIGTERM)
    output, _ = proc.communicate(timeout=180)
    assert proc.returncode == 0, output[-3000:]
    log_text = cfg.run_paths.rank_log(0).read_text()
    assert "restart count 1" in log_text and "resumed at step" in log_text
    assert [r["step"] for r in read_metrics(cfg.run_paths)] == list(range(1, 31))
    assert json.loads(cfg.run_paths.status.read_text())["state"] == "done"


# -- the learning-rate schedule on resume, old checkpoints, dropout -----------------------------------------


def test_an_extended_schedule_continues_the_lr_without_a_jump(trained_root: Path, tmp_path: Path) -> None:
    """Resumed at step 60 (the end of its decay, lr 5e-4) with --extend-schedule rewarm to a new peak of 2e-3 at step
    80: the lr climbs from where it was over the 5 warm-up steps, and the extension is in the checkpoint. (Without a
    re-warm, --extend-schedule continue: test_truncated_latest_falls_back_to_the_previous_checkpoint.)"""
    root = tmp_path / "fsx"
    shutil.copytree(trained_root, root, symlinks=True)
    extended = dict(max_steps=80, lr=2e-3, extend_schedule="rewarm", weight_decay=0.05)
    launch(tiny_launch(root, "run-1", log_every=1, **extended))
    run = RunPaths.of(root, "run-1")
    rows = {r["step"]: r["lr"] for r in read_metrics(run)}
    assert list(rows) == [10, 20, 30, 40, 50, 60, *range(61, 81)]
    assert rows[60] == pytest.approx(5e-4)
    ramp = (2e-3 - rows[60]) / 5
    assert 0 < rows[61] - rows[60] <= ramp * (1 + 1e-9), "the first lr after the resume is one ramp step on"
    assert rows[65] == 2e-3 and rows[80] == pytest.approx(2e-4)

    state = read_checkpoint(run.latest_checkpoint)
    assert state["schema"] == SCHEMA and "scheduler" not in state
    schedule = LRSchedule(ScheduleSettings(1.0, 1, 2, 0.0))
    schedule.load_state_dict(state["schedule"])
    assert [e.start_step for e in schedule.extensions] == [60]
    assert rows == {step: schedule.lr_at(step) for step in rows}, "the checkpoint's schedule reproduces every lr"
    log_text = run.rank_log(0).read_text()
    assert "learning-rate schedule extended at step 60 (lr: 0.005 -> 0.002; max_steps: 60 -> 80)" in log_text
    assert "schedule extended" not in run.rank_log(1).read_text()
    assert "weight decay 0.1 -> 0.05 (this start's --weight-decay)" in log_text, "a resume's own weight decay applies"
    decays = {value for key, value in state["optimizer_groups"].items() if key.endswith(".weight_decay")}
    assert decays == {0.05, 0.0}, "the matrices' group decays at the new rate, the vectors' not at all"

    launch(tiny_launch(root, "run-1", max_steps=80, lr=2e-3, nproc_per_node=1))  # its own settings: no flag needed
    assert "nothing to do: the run already reached step 80" in run.rank_log(0).read_text()


def save_as_schema_1(state: dict, directory: Path, settings: ScheduleSettings) -> None:
    """`state` as the trainer saved it before schema 2: an optimizer wrapped by a LambdaLR of the old factor, whose
    state_dict is under "scheduler", and no "schema" key."""
    model = build_model(config_from_dict(state["model_config"]))
    optimizer = torch.optim.AdamW(
        [
            {"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=settings.lr,
        betas=(0.9, 0.95),
    )
    tensors = {MODEL + k: v for k, v in state["model"].items()} | {OPTIM + k: v for k, v in state["optimizer"].items()}
    apply_state(model, optimizer, tensors, state["optimizer_groups"])  # the moments of the run
    for group in optimizer.param_groups:
        group["lr"] = settings.lr  # as the old trainer built it, before its LambdaLR took over
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, legacy_lr_factor(**vars(settings)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "lr_scheduler.step() before optimizer.step()": the steps were taken
        for _ in range(state["step"]):
            scheduler.step()
    legacy = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}
    legacy |= {k: state[k] for k in ("progress", "data", "rng", "step", "preset", "model_config", "world_size")}
    write_single_file_checkpoint(directory, legacy)


@pytest.mark.parametrize("parallelism", ["ddp", "fsdp"])
def test_a_schema_1_single_file_checkpoint_resumes_exactly_with_one_warning(
    staged_copy: Path, uninterrupted: RunPaths, parallelism: str
) -> None:
    """The uninterrupted run's step-20 checkpoint, saved again as the trainer before schema 2 did, resumes to the
    same losses; its schedule comes from the flags, and rank 0 warns once that it could not be checked. Under fsdp
    too, each rank keeping its shard of the whole state (to the same losses within fp32 rounding: test_parallel.py)."""
    state = read_checkpoint(uninterrupted.checkpoints / "step_00000020")
    cfg = tiny_launch(staged_copy, "legacy", **EXACT, extra_env={"TRAINER_PARALLELISM": parallelism})
    schedule = ScheduleSettings(cfg.train["lr"], cfg.train["warmup_steps"], cfg.train["max_steps"], 0.1)
    save_as_schema_1(state, cfg.run_paths.checkpoints, schedule)
    old = read_checkpoint(cfg.run_paths.latest_checkpoint)
    assert "schema" not in old and old["scheduler"]["last_epoch"] == 20
    launch(cfg)
    resumed = read_metrics(cfg.run_paths)
    assert [r["step"] for r in resumed] == list(range(21, 41))
    for mine, reference in zip(resumed, read_metrics(uninterrupted)[20:], strict=True):
        if parallelism == "ddp":
            assert (mine["loss"], mine["grad_norm"], mine["lr"]) == (
                reference["loss"],
                reference["grad_norm"],
                reference["lr"],
            ), mine["step"]
        else:
            assert abs(mine["loss"] - reference["loss"]) <= 1e-4 * reference["loss"], mine["step"]
    warning = "WARNING trainer: the checkpoint predates schema 2: its learning-rate schedule"
    assert cfg.run_paths.rank_log(0).read_text().count(warning) == 1
    assert warning not in cfg.run_paths.rank_log(1).read_text()
    assert read_checkpoint(cfg.run_paths.latest_checkpoint)["schema"] == SCHEMA


def test_dropout_is_set_per_family_is_no_architecture_change_and_is_bounded(capsys) -> None:
    """(A resume with dropout is bit-identical: tests/test_mixture.py's SIGTERM test trains with it.) The model the
    trainer builds drops: in training mode two passes over the same batch differ, in eval mode they do not."""
    gpt2, llama = model_config("tiny", 512, 64, 0, dropout=0.2), model_config("llama-1b", 512, 64, 0, dropout=0.2)
    assert (gpt2.resid_pdrop, gpt2.embd_pdrop, gpt2.attn_pdrop, llama.attention_dropout) == (0.2, 0.2, 0.2, 0.2)
    model, batch = build_model(gpt2), torch.randint(0, 512, (2, 16))
    model.train()
    assert not torch.equal(model(batch).logits, model(batch).logits)
    model.eval()
    assert torch.equal(model(batch).logits, model(batch).logits)
    assert architecture_differences(model_config("tiny", 512, 64, 0).to_dict(), gpt2.to_dict()) == []
    with pytest.raises(SystemExit) as exit_info:
        parse_config(["--data-dir", "d", "--run-dir", "r", "--dropout", "1"], {})
    assert exit_info.value.code == 2
    assert "argument --dropout: must be at least 0 and below 1, got 1.0" in capsys.readouterr().err.splitlines()[-1]
    with pytest.raises(InputError, match="dropout must be at least 0 and below 1, got 1.5"):
        tiny_launch(Path("/nonexistent"), "r", dropout=1.5).validate(check_storage=False)
    args = tiny_launch(Path("/fsx"), "r", dropout=0.1, extend_schedule="rewarm").trainer_args()
    assert args[args.index("--dropout") + 1] == "0.1" and args[args.index("--extend-schedule") + 1] == "rewarm"
    assert "--extend-schedule" not in tiny_launch(Path("/fsx"), "r").trainer_args(), "none: the trainer's default"
    with pytest.raises(InputError, match="extend-schedule 'true' is unknown: choose one of '', continue, rewarm"):
        tiny_launch(Path("/nonexistent"), "r", extend_schedule="true").validate(check_storage=False)


@pytest.mark.usefixtures("aws_env")
def test_a_run_stopped_by_tokens_resumes_from_its_s3_copy_when_its_volume_lost_it(
    staged_copy: Path, uninterrupted: RunPaths, s3_endpoint: str
) -> None:
    """Stopped by --max-tokens (at step 20, the first past 20000 tokens), with each committed checkpoint copied to the
    S3 test server; the run's checkpoints on the volume are then lost, and the resumed run fetches step 20 from S3
    and goes on exactly."""
    import boto3

    boto3.client("s3", endpoint_url=s3_endpoint).create_bucket(Bucket="durable-resume")
    durable = dict(**EXACT, checkpoint_s3_uri="s3://durable-resume/runs", s3_endpoint_url=s3_endpoint)
    by_tokens = {"TRAINER_MAX_TOKENS": "20000", "TRAINER_GRACE_PERIOD_S": "0.01"}
    stopped = tiny_launch(staged_copy, "durable", **durable, extra_env=by_tokens)
    launch(stopped)
    rows = read_metrics(stopped.run_paths)
    assert rows[-1]["step"] == 20 and rows[-1]["tokens"] == 20 * 8 * 64 * 2
    assert_the_metrics_rows_fields(rows)
    assert json.loads(stopped.run_paths.status.read_text())["reason"] == "max-tokens"
    assert "PREEMPTION WOULD LOSE WORK" in stopped.run_paths.rank_log(0).read_text()  # 0.01 s holds no step and save
    listed = boto3.client("s3", endpoint_url=s3_endpoint).list_objects_v2(Bucket="durable-resume", Prefix="runs/")
    keys = {o["Key"] for o in listed["Contents"]}
    assert {"runs/durable/step_00000020/commit.json", "runs/durable/step_00000010/commit.json"} <= keys

    shutil.rmtree(stopped.run_paths.checkpoints)  # the file system was recreated, or the run moved
    launch(tiny_launch(staged_copy, "durable", **durable))
    log_text = stopped.run_paths.rank_log(0).read_text()
    assert "fetching step_00000020 from the durable copy" in log_text and "resumed at step 20" in log_text
    resumed = read_metrics(stopped.run_paths)
    assert [r["step"] for r in resumed] == list(range(1, 41))
    for mine, reference in zip(resumed, read_metrics(uninterrupted), strict=True):
        assert (mine["loss"], mine["grad_norm"], mine["lr"]) == (
            reference["loss"],
            reference["grad_norm"],
            reference["lr"],
        ), f"step {mine['step']} differs after a resume from S3"


@pytest.mark.parametrize("parallelism", ["ddp", "fsdp"])
def test_accumulated_micro_batches_train_as_one_batch_and_quiet_steps_wait_for_nothing(
    staged_copy: Path, uninterrupted: RunPaths, parallelism: str
) -> None:
    """4 sequences x 2 micro-steps per rank is the same 16 sequences per step as the uninterrupted run's 8 x 1: the
    same training (its losses within fp32's reduction-order tolerance, under FSDP too).

    tests/sync_probe.py counts, per step, what makes the training thread wait for a value (Tensor.__bool__, item,
    tolist, __float__, __int__, numpy, cpu; Work.wait) and the token rows' host-to-device copies. A step with nothing
    to log or save, after one that had none either, waits for nothing of its own: its only read is the previous
    step's stop/non-finite flags, which that step's all-reduce finished while this one ran. Each micro-batch is one
    asynchronous copy of int32 rows. The same under FSDP (trainer/parallel.py), whose all-gathers and
    reduce-scatters wait for themselves inside c10d: on the host under gloo, only on the stream under NCCL (not
    counted here; bench/gpu_check.sh runs a GPU's steps under CUDA's sync debug mode)."""
    cfg = tiny_launch(
        staged_copy,
        "probed",
        batch_size=4,
        max_steps=EXACT["max_steps"],
        log_every=4,
        checkpoint_every=100,
        extra_env={"TRAINER_GRAD_ACCUM_STEPS": "2", "TRAINER_PARALLELISM": parallelism},
    )
    out = staged_copy / "probe"
    command = ["tests.sync_probe" if part == "trainer.train_ddp" else part for part in torchrun_command(cfg)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SYNC_PROBE_OUT": str(out), **cfg.trainer_env()}
    cfg.run_paths.logs.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parent.parent
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    last = EXACT["max_steps"]
    accumulated = read_metrics(cfg.run_paths)
    reference = {r["step"]: r for r in read_metrics(uninterrupted)}
    assert [r["step"] for r in accumulated] == list(range(4, last + 1, 4))
    for mine in accumulated:
        assert mine["tokens"] == reference[mine["step"]]["tokens"]
        assert mine["loss"] == pytest.approx(reference[mine["step"]]["loss"], rel=1e-4), mine["step"]

    sync_steps = {1, *range(4, last + 1, 4)}  # the first (timed on its own) and the logged (log_every 4)
    quiet = [s for s in range(2, last + 1) if s not in sync_steps and s - 1 not in sync_steps]
    for rank in (0, 1):
        steps: dict[int, list[dict]] = {}
        for event in json.loads((out / f"rank_{rank}.json").read_text()):
            steps.setdefault(event["step"], []).append(event)
        waits = {
            s: [e for e in events if e["kind"] not in ("h2d", "stepped") and not e.get("collective_itself")]
            for s, events in steps.items()
        }
        for step in quiet:
            assert [e for e in waits[step] if not e["earlier"]] == [], f"rank {rank} step {step}: {waits[step]}"
            assert sorted(e["kind"] for e in waits[step]) == ["Work.wait", "tolist"], f"rank {rank} step {step}"
        for step in sync_steps:  # the counters count: a logged step reads its values
            assert any(not e["earlier"] for e in waits[step] + waits.get(step + 1, [])), f"rank {rank} step {step}"
        for step in range(1, last + 1):
            copies = [e for e in steps[step] if e["kind"] == "h2d"]
            assert copies == [{"step": step, "kind": "h2d", "shape": [4, 65], "non_blocking": True}] * 2, copies


def test_the_bf16_comm_hook_on_a_cpu_is_bad_input_in_one_line(tmp_path: Path) -> None:
    """DDP accepts the bf16 compression hook only with NCCL: on a CPU the trainer says so before it starts (exit 2),
    not with DDP's TypeError from every rank. (On GPUs bench/gpu_check.sh runs it.)"""
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainer.train_ddp",
            "--data-dir",
            str(tmp_path),
            "--run-dir",
            str(tmp_path / "run"),
            "--ddp-comm-hook",
            "bf16",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "RANK": "0"},
    )
    assert result.returncode == ExitCode.BAD_INPUT
    assert (
        result.stderr.strip()
        .splitlines()[-1]
        .endswith("--ddp-comm-hook bf16 compresses NCCL's gradient all-reduce and needs GPUs; on a CPU (gloo) use none")
    )
    assert json.loads((tmp_path / "run" / "status.json").read_text())["state"] == "bad-input"


def test_torch_2_11_refuses_background_checkpoints_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """The HyperPodPyTorchJob's image runs torch 2.11 (trainer/stack-hyperpod.txt), whose checkpoint stager fails a
    save after a background one: the trainer refuses --async-checkpoint there before it joins anything."""
    from contextlib import ExitStack

    from trainer.config import SettingError
    from trainer.train_ddp import Trainer

    cfg = parse_config(["--data-dir", "d", "--run-dir", "r", "--async-checkpoint", "true"], {})
    monkeypatch.setattr(torch, "__version__", "2.11.0+cu130")
    with pytest.raises(SettingError, match=r"--async-checkpoint needs torch 2\.12 or newer, this is 2\.11\.0\+cu130"):
        Trainer(cfg, ExitStack())
