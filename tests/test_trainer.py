"""The trainer under a real torchrun with 2 processes (gloo, CPU), through the local launcher."""

import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from components.errors import StepFailed
from components.launch_pytorchjob.core import launch
from components.launch_pytorchjob.local_backend import torchrun_command
from components.launch_pytorchjob.manifest import JobSpec, render_job
from tests.helpers import snapshot_dir, tiny_launch
from trainer.checkpoint import load_checkpoint
from trainer.data import TokenBatches, load_split
from trainer.layout import RunPaths
from trainer.preemption import ExitCode


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

    state = load_checkpoint(run.latest_checkpoint)
    assert state["step"] == 60 and state["world_size"] == 2 and state["preset"] == "tiny"
    assert state["data"]["offset"] > 0
    assert not list(run.checkpoints.glob(".*")), "no temporary checkpoint files left"
    config = json.loads(run.config.read_text())
    assert config["trainer"]["max_steps"] == 60 and config["model"]["n_layer"] == 2
    assert "step 60 loss" in run.rank_log(0).read_text()
    assert "comms self-test" in run.rank_log(1).read_text()
    assert run.attempts() == [1], "one start, one attempt, agreed by both ranks"
    for rank in (0, 1):
        report = json.loads(run.comms_report(rank, 1).read_text())
        assert report["all_reduce_correct"] is True and report["attempt"] == 1


def test_resumes_from_checkpoint(trained_root: Path, tmp_path: Path) -> None:
    root = tmp_path / "fsx"
    shutil.copytree(trained_root, root)
    launch(tiny_launch(root, "run-1", max_steps=80))
    run = RunPaths.of(root, "run-1")
    records = read_metrics(run)
    assert [r["step"] for r in records] == [10, 20, 30, 40, 50, 60, 70, 80]
    assert records[-1]["tokens"] == 80 * 8 * 64 * 2
    assert "resumed at step 60" in run.rank_log(0).read_text()
    assert load_checkpoint(run.latest_checkpoint)["step"] == 80


def test_a_resume_with_another_architecture_is_refused_naming_the_fields(trained_root: Path, tmp_path: Path) -> None:
    root = tmp_path / "fsx"
    shutil.copytree(trained_root, root)
    with pytest.raises(StepFailed, match=r"n_positions: 64 -> 128"):
        launch(tiny_launch(root, "run-1", max_steps=80, seq_len=128))
    status = json.loads(RunPaths.of(root, "run-1").status.read_text())
    assert status["state"] == "bad-input" and "another architecture" in status["error"]


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

EXACT = dict(max_steps=40, log_every=1, checkpoint_every=10)


def start_torchrun(cfg) -> subprocess.Popen:
    """The trainer under torchrun exactly as the local launcher starts it, but left for the test to signal."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", **cfg.trainer_env()}
    cfg.run_paths.logs.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(torchrun_command(cfg), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)  # fmt: skip


def wait_for_step(run: RunPaths, step: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if run.metrics.exists() and any(json.loads(r)["step"] >= step for r in run.metrics.read_text().splitlines()):
            return
        time.sleep(0.05)
    raise AssertionError(f"training never reached step {step}")


@pytest.fixture(scope="module")
def uninterrupted(staged_root: Path, tmp_path_factory: pytest.TempPathFactory) -> RunPaths:
    root = tmp_path_factory.mktemp("uninterrupted")
    shutil.copytree(staged_root, root, dirs_exist_ok=True)
    launch(tiny_launch(root, "straight", **EXACT))
    return RunPaths.of(root, "straight")


def test_sigterm_checkpoints_and_resume_is_bit_identical(staged_copy: Path, uninterrupted: RunPaths) -> None:
    cfg = tiny_launch(staged_copy, "preempted", **EXACT)
    run = cfg.run_paths
    at = random.Random().randint(3, 30)
    proc = start_torchrun(cfg)
    wait_for_step(run, at, proc)
    os.kill(proc.pid, signal.SIGTERM)  # as the kubelet does to the container's torchrun
    output, _ = proc.communicate(timeout=60)

    status = json.loads(run.status.read_text())
    assert status["state"] == "preempted" and status["exit_code"] == ExitCode.PREEMPTED, output[-2000:]
    stopped = status["step"]
    assert at <= stopped < 40, f"signalled at step >= {at}, stopped at {stopped}"
    assert load_checkpoint(run.latest_checkpoint)["step"] == stopped
    assert f"stopped by SIGTERM at step {stopped}: checkpoint committed" in output

    launch(cfg)  # resume to the end
    resumed = read_metrics(run)
    assert [r["step"] for r in resumed] == list(range(1, 41))
    for mine, reference in zip(resumed, read_metrics(uninterrupted), strict=True):
        assert (mine["loss"], mine["grad_norm"], mine["lr"]) == (
            reference["loss"], reference["grad_norm"], reference["lr"]
        ), f"step {mine['step']} differs after a SIGTERM at step {stopped}"  # fmt: skip


def test_the_sigterm_budget_is_the_shutdown_timeout_the_job_gives_torchrun(staged_copy: Path) -> None:
    """The rendered job sets torchrun's shutdown timeout from the pod's grace period (120 s less a margin); the
    trainer, started by torchrun with the job's environment, takes that as its save budget."""
    pod = render_job(JobSpec(name="budget", image="img:1", trainer_args=[]))["spec"]["pytorchReplicaSpecs"]["Worker"]
    env = {e["name"]: e["value"] for e in pod["template"]["spec"]["containers"][0]["env"]}
    timing = {k: env[k] for k in ("TRAINER_GRACE_PERIOD_S", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT")}
    assert timing == {"TRAINER_GRACE_PERIOD_S": "120", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "100"}
    cfg = tiny_launch(staged_copy, "budget", **EXACT, extra_env=timing)
    proc = start_torchrun(cfg)
    wait_for_step(cfg.run_paths, 3, proc)
    os.kill(proc.pid, signal.SIGTERM)
    output, _ = proc.communicate(timeout=60)
    assert re.search(r"stopped by SIGTERM at step \d+: checkpoint committed [\d.]+s after the signal \(budget 100s\)",
                     output), output[-2000:]  # fmt: skip


def test_async_checkpoints_hold_exactly_their_step(staged_copy: Path, uninterrupted: RunPaths) -> None:
    """The background copy overlaps the next forward/backward; the weights it saves are still its step's own."""
    cfg = tiny_launch(staged_copy, "async", **EXACT, extra_env={"TRAINER_ASYNC_CHECKPOINT": "true"})
    launch(cfg)
    losses = [r["loss"] for r in read_metrics(cfg.run_paths)]
    assert losses == [r["loss"] for r in read_metrics(uninterrupted)]
    for step in (20, 30):  # saved asynchronously, while training went on
        mine = load_checkpoint(cfg.run_paths.checkpoints / f"checkpoint_step_{step:08d}.pt")
        theirs = load_checkpoint(uninterrupted.checkpoints / f"checkpoint_step_{step:08d}.pt")
        for name, tensor in theirs["model"].items():
            assert torch.equal(mine["model"][name], tensor), f"{name} of the async step-{step} checkpoint differs"


def test_workers_exit_with_the_preempted_code(staged_copy: Path) -> None:
    """Signalled directly (not through torchrun), each worker's own exit code shows in torchrun's summary."""
    cfg = tiny_launch(staged_copy, "direct", max_steps=100000, log_every=1)
    proc = start_torchrun(cfg)
    wait_for_step(cfg.run_paths, 3, proc)
    trainer_pids = worker_pids(proc.pid)
    assert len(trainer_pids) == 2
    for pid in trainer_pids:
        os.kill(pid, signal.SIGTERM)
    output, _ = proc.communicate(timeout=60)
    assert output.count(f"exitcode  : {int(ExitCode.PREEMPTED)}") == 2, output[-3000:]


def worker_pids(torchrun_pid: int) -> list[int]:
    return [
        int(p.name) for p in Path("/proc").iterdir()
        if p.name.isdigit() and "trainer.train_ddp" in _cmdline(p) and _ppid(p) == torchrun_pid
    ]  # fmt: skip


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
    shutil.copytree(trained_root, root)
    run = RunPaths.of(root, "run-1")
    # The latest is a hard link to the step-60 file (copytree made them two files): truncate both.
    for path in (run.latest_checkpoint, run.checkpoints / "checkpoint_step_00000060.pt"):
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    launch(tiny_launch(root, "run-1", max_steps=70))
    log_text = run.rank_log(0).read_text()
    assert "is truncated or altered" in log_text and "trying an older checkpoint" in log_text
    assert "resumed at step 40" in log_text
    assert load_checkpoint(run.latest_checkpoint)["step"] == 70


def test_world_size_2_to_1_repeats_and_skips_no_sample(staged_copy: Path) -> None:
    samples = {"TRAINER_LOG_SAMPLES": "true"}
    launch(tiny_launch(staged_copy, "elastic", max_steps=5, extra_env=samples))
    launch(tiny_launch(staged_copy, "elastic", max_steps=10, nproc_per_node=1, extra_env=samples))
    run = RunPaths.of(staged_copy, "elastic")
    seen = []
    for rank_file in sorted(run.logs.glob("samples_rank_*.txt")):
        for line in rank_file.read_text().splitlines():
            seen += [int(w) for w in line.split()[2:]]
    # 5 steps x 8 x 2 ranks, then 5 steps x 8 x 1 rank: the first 120 windows of epoch 0's order, once each.
    batches = TokenBatches(load_split(snapshot_dir(staged_copy, "synthetic"), "train"), 64, 8, 0, 1,
                           seed=1234)  # fmt: skip
    assert batches.num_windows >= 120
    assert sorted(seen) == sorted(batches.epoch_order(0)[:120].tolist())
    assert "world size changed from 2 to 1" in run.rank_log(0).read_text()


def test_incompatible_preset_is_one_clear_error(trained_root: Path, tmp_path: Path) -> None:
    root = tmp_path / "fsx"
    shutil.copytree(trained_root, root)
    with pytest.raises(StepFailed) as failure:
        launch(tiny_launch(root, "run-1", preset="small", max_steps=70))
    first_line = str(failure.value).splitlines()[0]
    assert "exit code" in first_line and "is of preset 'tiny'" in first_line
    assert json.loads(RunPaths.of(root, "run-1").status.read_text())["state"] == "bad-input"


def test_gradient_accumulation_matches_one_big_batch(staged_copy: Path, uninterrupted: RunPaths) -> None:
    """4 sequences x 2 micro-steps per rank is the same 16 sequences per step as 8 x 1: the same training."""
    launch(tiny_launch(staged_copy, "accum", batch_size=4, extra_env={"TRAINER_GRAD_ACCUM_STEPS": "2"}, **EXACT))
    accumulated, reference_rows = read_metrics(RunPaths.of(staged_copy, "accum")), read_metrics(uninterrupted)
    assert [r["tokens"] for r in accumulated] == [r["tokens"] for r in reference_rows]
    for mine, reference in zip(accumulated, reference_rows, strict=True):
        assert mine["loss"] == pytest.approx(reference["loss"], rel=1e-4), mine["step"]


def test_metrics_rows_and_stopping_by_tokens_and_by_time(staged_copy: Path) -> None:
    by_tokens = {"TRAINER_MAX_TOKENS": "20000", "TRAINER_GRACE_PERIOD_S": "0.01"}
    launch(tiny_launch(staged_copy, "by-tokens", max_steps=1000, log_every=5, extra_env=by_tokens))
    run = RunPaths.of(staged_copy, "by-tokens")
    rows = read_metrics(run)
    assert rows[-1]["step"] == 20 and rows[-1]["tokens"] == 20 * 8 * 64 * 2  # the first step past 20000 tokens
    for row in rows:
        assert row.keys() >= {"step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "step_time_s", "mfu"}
        assert row["mfu"] is None and row["gpu_mem_gb"] is None  # CPU: no peak FLOP/s to compare with
        assert 0.1 < row["rss_gb"] < 64  # the largest worker process's resident memory
    assert json.loads(run.status.read_text())["reason"] == "max-tokens"
    assert "PREEMPTION WOULD LOSE WORK" in run.rank_log(0).read_text()  # 0.01 s cannot hold a step and a save

    launch(tiny_launch(staged_copy, "by-time", max_steps=100000, extra_env={"TRAINER_MAX_TIME_S": "3"}))
    status = json.loads(RunPaths.of(staged_copy, "by-time").status.read_text())
    assert status["state"] == "done" and status["reason"] == "max-time" and status["step"] > 0
    assert load_checkpoint(RunPaths.of(staged_copy, "by-time").latest_checkpoint)["step"] == status["step"]


def test_elastic_torchrun_restarts_preempted_workers_which_resume(staged_copy: Path) -> None:
    """torchrun --nnodes=1:2 (c10d): workers signalled directly exit 75, torchrun restarts them, they resume."""
    cfg = tiny_launch(staged_copy, "restarted", max_steps=30, log_every=1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2", "--nproc-per-node=2", "--max-restarts=1",
        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-conf=last_call_timeout=1",
        "-m", "trainer.train_ddp", *cfg.trainer_args(),
    ]  # fmt: skip
    proc = subprocess.Popen(command, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)  # fmt: skip
    wait_for_step(cfg.run_paths, 5, proc)
    for pid in worker_pids(proc.pid):
        os.kill(pid, signal.SIGTERM)
    output, _ = proc.communicate(timeout=180)
    assert proc.returncode == 0, output[-3000:]
    log_text = cfg.run_paths.rank_log(0).read_text()
    assert "restart count 1" in log_text and "resumed at step" in log_text
    assert [r["step"] for r in read_metrics(cfg.run_paths)] == list(range(1, 31))
    assert json.loads(cfg.run_paths.status.read_text())["state"] == "done"
