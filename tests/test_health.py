"""Training health (trainer/health.py, components/launch_training/progress.py): a diverged run stops and is not
restarted, a silent rank is named within the collective timeout, a stalled job is deleted."""

import io
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import datetime
from pathlib import Path

import pytest
import torch

from common.errors import StepFailed
from components.launch_training.core import launch
from components.launch_training.progress import STALL_FLOOR_S, TrainingWatch
from tests.helpers import snapshot_dir, tiny_launch
from tests.servers import free_port
from tests.test_trainer import read_metrics, start_torchrun, wait_for_step, worker_pids
from trainer.checkpoint import newest_checkpoint, read_weights
from trainer.health import Divergence, Heartbeat, SpikeWatch, announce_failure, collective_failed
from trainer.layout import RunPaths
from trainer.preemption import ExitCode
from trainer.train_ddp import write_status


def test_a_nonfinite_streak_past_the_limit_is_divergence_and_a_finite_step_resets_it() -> None:
    divergence = Divergence(limit=2)
    assert [divergence.record(s, finite) for s, finite in [(1, True), (2, False), (3, False), (4, True)]] == [
        False,
        False,
        False,
        False,
    ]
    assert divergence.skipped == 2 and divergence.streak == 0
    assert [divergence.record(s, False) for s in (5, 6, 7)] == [False, False, True]
    assert divergence.reason().startswith("diverged at step 5: the loss or gradient norm was not finite for 3 steps")


def test_a_spike_is_a_loss_above_k_times_the_recent_median() -> None:
    spikes = SpikeWatch(factor=3.0)
    assert not any(spikes.is_spike(step, loss) for step, loss in enumerate([4.0, 3.5, 3.0, 2.9, 2.8, 2.7]))
    assert spikes.is_spike(7, 9.5) and not spikes.is_spike(8, 2.6)
    assert not SpikeWatch(factor=0).is_spike(1, 1e9)


def test_a_resumed_run_counts_its_streak_and_judges_spikes_as_the_uninterrupted_one() -> None:
    """The streak and the spike window ride in the checkpoint (TrainState): restored, they go on where they were."""
    divergence, spikes = Divergence(limit=2), SpikeWatch(factor=3.0)
    for step, loss in enumerate([4.0, 3.5, 3.0, 2.9, 2.8], start=1):
        spikes.is_spike(step, loss)
    divergence.record(6, finite=False), divergence.record(7, finite=False)
    resumed_divergence, resumed_spikes = Divergence(limit=2), SpikeWatch(factor=3.0)
    resumed_divergence.load_state_dict(torch_round_trip(divergence.state_dict()))
    resumed_spikes.load_state_dict(torch_round_trip(spikes.state_dict()))
    assert resumed_divergence.record(8, finite=False) and resumed_divergence.first_bad_step == 6
    assert resumed_spikes.is_spike(9, 9.5) and spikes.is_spike(9, 9.5)


def torch_round_trip(state: dict) -> dict:
    """Through torch.save and a weights-only load, as a checkpoint's trainer state goes."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def test_an_out_of_memory_or_a_shape_error_is_not_taken_for_a_collectives_failure() -> None:
    """Those are reported at once, not after three heartbeats spent looking for silent ranks."""
    gloo_timeout = RuntimeError(
        "[/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out "
        "waiting 2000ms for recv operation to complete"
    )
    assert collective_failed(gloo_timeout) and collective_failed(torch.distributed.DistBackendError("NCCL error"))
    assert not collective_failed(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert not collective_failed(RuntimeError("mat1 and mat2 shapes cannot be multiplied (8x64 and 32x64)"))


def test_a_run_that_diverges_stops_with_its_code_and_keeps_the_last_good_checkpoint(staged_copy: Path) -> None:
    """NaN from step 25 (--fault-nan-at-step): steps 25-28 are skipped, the fourth in a row stops the run; the
    step-20 checkpoint stays the newest (the periodic one at 30 is never reached), with finite weights."""
    cfg = tiny_launch(
        staged_copy,
        "diverges",
        max_steps=60,
        log_every=1,
        checkpoint_every=10,
        extra_env={"TRAINER_FAULT_NAN_AT_STEP": "25"},
    )
    with pytest.raises(StepFailed) as failure:
        launch(cfg)
    first_line, message = str(failure.value).splitlines()[0], str(failure.value)
    assert "failed with exit code 1" in first_line and ": diverged at step 25: the loss or gradient" in first_line
    assert f"exitcode  : {int(ExitCode.DIVERGED)}" in message, "each worker's own code, in torchrun's summary"
    status = json.loads(cfg.run_paths.status.read_text())
    assert (status["state"], status["step"], status["exit_code"]) == ("diverged", 25, ExitCode.DIVERGED)
    rows = read_metrics(cfg.run_paths)
    assert [r["step"] for r in rows] == list(range(1, 29))
    assert all(math.isnan(r["loss"]) for r in rows[24:]) and rows[-1]["skipped_steps"] == 4
    latest = newest_checkpoint(cfg.run_paths.checkpoints)
    assert latest.step == 20 and RunPaths.of(staged_copy, "diverges").latest_checkpoint.resolve() == latest.path
    assert all(torch.isfinite(w).all() for w in read_weights(latest).values())


def test_a_stopped_worker_is_named_within_the_collective_timeout(staged_copy: Path) -> None:
    """Rank 1 is stopped with SIGSTOP mid-run: rank 0's next collective times out after 5 s and it names rank 1,
    from the heartbeat counters in the rendezvous store (rank 1's stopped moving); its heartbeat thread named it
    already, before the timeout, in its log and in status.json."""
    cfg = tiny_launch(
        staged_copy, "silent", max_steps=100000, log_every=1, extra_env={"TRAINER_COLLECTIVE_TIMEOUT_S": "5"}
    )
    proc = start_torchrun(cfg)
    try:
        wait_for_step(cfg.run_paths, 3, proc)
        rank_1 = next(pid for pid in worker_pids(proc.pid) if "RANK=1\0" in Path(f"/proc/{pid}/environ").read_text())
        os.kill(rank_1, signal.SIGSTOP)
        stopped_at = time.monotonic()
        deadline, hung_before_the_collective_failed = stopped_at + 60, None
        while time.monotonic() < deadline and "a collective failed" not in cfg.run_paths.rank_log(0).read_text():
            status = json.loads(cfg.run_paths.status.read_text())
            if status["state"] == "hung" and hung_before_the_collective_failed is None:
                hung_before_the_collective_failed = status
            time.sleep(0.1)
        failed_after = time.monotonic() - stopped_at
    finally:
        for pid in worker_pids(proc.pid):
            os.kill(pid, signal.SIGKILL)
        proc.communicate(timeout=60)
    lines = [x for x in cfg.run_paths.rank_log(0).read_text().splitlines() if "stopped answering" in x]
    # First the heartbeat thread, at 80% of the timeout (on GPUs NCCL's watchdog ends the process at the timeout);
    # then the collective's own failure, caught in the training loop.
    assert "ERROR trainer.health: no step completed for" in lines[0] and "rank(s) 1 stopped answering" in lines[0]
    assert "ERROR trainer: a collective failed at step" in lines[1] and "rank(s) 1 stopped answering" in lines[1]
    assert 5 <= failed_after < 5 + 15, f"failed after {failed_after:.0f}s, the timeout is 5 s"
    status = json.loads(cfg.run_paths.status.read_text())
    assert status["state"] == "hung" and status["silent_ranks"] == [1]
    # Written by the heartbeat thread already: on GPUs the process may not live to the collective's failure.
    assert hung_before_the_collective_failed is not None and hung_before_the_collective_failed["silent_ranks"] == [1]
    assert "no step completed after step" in hung_before_the_collective_failed["error"]


def test_a_local_run_that_stalls_is_stopped_with_every_ranks_last_lines(staged_copy: Path) -> None:
    """Both workers stopped (SIGSTOP) after step 3: no step for the 4 s stall timeout, the launcher stops torchrun
    and fails the step with what each rank last logged."""
    cfg = tiny_launch(
        staged_copy,
        "stalls",
        max_steps=100000,
        log_every=1,
        stall_timeout_s=4,
        extra_env={"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "2"},
    )

    def stop_workers_at_step_3() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if cfg.run_paths.metrics.exists() and len(cfg.run_paths.metrics.read_text().splitlines()) >= 3:
                for proc_dir in Path("/proc").iterdir():
                    command = _cmdline(proc_dir) if proc_dir.name.isdigit() else ""
                    if f"--run-dir {cfg.run_paths.root} " in command and "torch.distributed.run" not in command:
                        os.kill(int(proc_dir.name), signal.SIGSTOP)  # a worker, not torchrun
                return
            time.sleep(0.05)

    threading.Thread(target=stop_workers_at_step_3, daemon=True).start()
    started = time.monotonic()
    with pytest.raises(StepFailed) as failure:
        launch(cfg)
    message = str(failure.value)
    assert "stalled: no training step completed for" in message and "(stall timeout 4s)" in message
    assert "rank 0: " in message and "rank 1: " in message, message
    assert time.monotonic() - started < 120


def _cmdline(proc_dir: Path) -> str:
    try:
        return (proc_dir / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def test_the_derived_stall_timeout_follows_the_gaps_between_steps_with_a_floor(tmp_path: Path) -> None:
    run = RunPaths(tmp_path / "run")
    clock = [1000.0]
    watch = TrainingWatch(run, now=lambda: clock[0], since=0)
    assert watch.check() is None and watch.stall_limit() == STALL_FLOOR_S
    for step, at in [(10, 1000), (20, 1200), (30, 1300)]:
        clock[0] = at
        write_status(run, 0, "running", step=step, attempt=1)
        assert watch.check() is None
    assert watch.stall_limit() == max(STALL_FLOOR_S, 10 * 200)
    clock[0] = 1300 + 2000 - 1
    assert watch.check() is None
    clock[0] = 1300 + 2000 + 1
    assert watch.check().startswith("stalled: no training step completed for 2001s (stall timeout 2000s)")
    write_status(run, 0, "diverged", step=30, error="diverged at step 30: ...", attempt=1)
    assert watch.check() == "diverged at step 30: ..."
    assert TrainingWatch(run, since=time.time() + 60).check() is None, "a status from before this launch"


def test_the_evaluation_report_counts_skipped_steps_and_lists_the_spikes(tmp_path: Path) -> None:
    from components.evaluate_checkpoint.measure import training_health
    from trainer.metrics import MetricsLog

    run = RunPaths(tmp_path / "run")
    run.root.mkdir()
    metrics = MetricsLog(run.metrics, enabled=True)
    spikes = SpikeWatch(factor=3.0)
    for step, loss, skipped in [
        (10, 4.0, 0),
        (20, 3.0, 0),
        (30, 2.5, 0),
        (40, 2.4, 0),
        (50, 2.3, 1),
        (60, 9.0, 1),
        (70, 2.2, 1),
    ]:
        row = {"step": step, "loss": loss, "skipped_steps": skipped}
        if spikes.is_spike(step, loss):
            row["loss_spike"] = True
        metrics.write(row)
    assert training_health(run) == {"skipped_steps": 1, "loss_spikes": [{"step": 60, "loss": 9.0}]}


def test_the_stall_clock_starts_again_when_training_resumes_at_the_same_step(tmp_path: Path) -> None:
    run = RunPaths(tmp_path / "run")
    clock = [0.0]
    watch = TrainingWatch(run, stall_timeout_s=10, now=lambda: clock[0], since=0)
    write_status(run, 0, "running", step=5, attempt=1)
    assert watch.check() is None
    write_status(run, 0, "preempted", step=5, attempt=1)
    clock[0] = 100.0
    assert watch.check() is None, "not training: no stall"
    write_status(run, 0, "running", step=5, attempt=1)
    assert watch.check() is None
    clock[0] = 111.0
    assert watch.check().startswith("stalled: no training step completed for 11s (stall timeout 10s) after step 5")


REPO = Path(__file__).resolve().parent.parent


def test_a_rank_that_raises_ends_the_rank_waiting_for_it(staged_root: Path, tmp_path: Path) -> None:
    """As on separate nodes: two trainer processes started without torchrun (whose agent would end a failed worker's
    local peers itself), the last rank raising at the start of step 3 while rank 0 goes on into that step's gradient
    all-reduce. gloo sees the peer's socket close and fails the collective; the peer's announcement names why."""
    run_dir = tmp_path / "run"
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "trainer.train_ddp",
        "--data-dir",
        str(snapshot_dir(staged_root, "synthetic")),
        "--run-dir",
        str(run_dir),
        "--preset",
        "tiny",
        "--batch-size",
        "4",
        "--seq-len",
        "64",
        "--max-steps",
        "50",
        "--log-every",
        "100",
        "--checkpoint-every",
        "100",
        "--fault-crash-at-step",
        "3",
        "--collective-timeout-s",
        "300",
    ]
    node = {
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "OMP_NUM_THREADS": "1",
    }
    ranks = [
        subprocess.Popen(
            command,
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, **node, "RANK": str(rank)},
        )
        for rank in (0, 1)
    ]
    outputs = [process.communicate(timeout=120)[0] for process in ranks]
    ended = time.time()
    status = json.loads(RunPaths(run_dir).status.read_text())
    assert [process.returncode for process in ranks] == [ExitCode.CRASHED, ExitCode.CRASHED], outputs
    assert status["state"] == "crashed" and status["failed_rank"] == 1, status
    assert status["error"].startswith(
        "rank 1 failed: RuntimeError: fault injection (--fault-crash-at-step): rank 1 fails at step 3"
    ), status
    logs = [RunPaths(run_dir).rank_log(rank).read_text() for rank in (0, 1)]
    assert "ending this rank: rank 1 failed (RuntimeError: fault injection" in logs[0]
    crashed = next(line for line in logs[1].splitlines() if "training crashed" in line)
    raised = datetime.strptime(crashed[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()  # the log's local time
    assert ended - raised < 30, f"both ranks ended {ended - raised:.1f}s after rank 1 raised"


def test_the_heartbeat_ends_a_rank_whose_peer_announced_a_failure_after_a_grace() -> None:
    """What ends a rank that NCCL leaves waiting (a dead peer is not seen until the collective timeout): the
    heartbeat thread reads the announcement from the store and, after its grace, calls the ending function."""
    store = torch.distributed.HashStore()
    ended: list[tuple[int, str]] = []
    done = threading.Event()
    heartbeat = Heartbeat(
        store,
        0,
        2,
        timeout_s=600,
        on_peer_failure=lambda *failed: (ended.append(failed), done.set()),
        failure_grace_s=0.5,
    )
    announce_failure(store, 0, "its own failure is not a peer's")
    assert heartbeat.peer_failure() is None
    store.delete_key("hyperpod-pretrain/failed")
    announced = time.monotonic()
    announce_failure(store, 1, "OutOfMemoryError: CUDA out of memory")
    announce_failure(store, 2, "a later failure is not the first")
    assert done.wait(10) and ended == [(1, "OutOfMemoryError: CUDA out of memory")]
    assert 0.5 <= time.monotonic() - announced < 3
    heartbeat.stop()
