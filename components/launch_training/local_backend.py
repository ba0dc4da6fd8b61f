"""The local backend: torchrun as a subprocess, its output streamed into this step's log.

A SIGTERM to this process (KFP terminating the run) is passed on to torchrun, which passes it to the
workers: nothing keeps training after the step is gone.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from common.errors import StepFailed
from components.launch_training.config import LaunchConfig, LaunchResult
from components.launch_training.evidence import last_lines_of_every_rank
from components.launch_training.progress import PERMANENT, TrainingWatch

log = logging.getLogger(__name__)

TAIL_LINES = 40
# torchrun gives its workers 30 s after SIGTERM before it SIGKILLs them; past this, we kill the whole group.
STOP_GRACE_S = 45
WATCH_EVERY_S = 1.0  # how often the trainer's status.json is read


def torchrun_log_dir(cfg: LaunchConfig) -> Path:
    return cfg.run_paths.logs / "torchrun"


def root_cause(log_dir: Path) -> str:
    """The first failing rank's exception, from the error.json that torchrun's @record writes per worker."""
    launches = sorted(log_dir.glob("*/"), key=lambda d: d.stat().st_mtime)  # torchrun makes one per start
    errors = []
    for path in launches[-1].glob("attempt_*/*/error.json") if launches else ():
        try:
            error = json.loads(path.read_text())["message"]
            errors.append((error["extraInfo"]["timestamp"], path.parent.name, error["message"]))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    if not errors:
        return ""
    _, rank, message = min(errors)
    return f"local rank {rank}: {message.splitlines()[0]}"


def trainer_outcome(cfg: LaunchConfig) -> str:
    """What the trainer's status.json says of how it ended, in words."""
    try:
        status = json.loads(cfg.run_paths.status.read_text())
    except (OSError, ValueError):
        return "the trainer left no status"
    if status["state"] == "preempted":
        return (
            f"the trainer committed a checkpoint of step {status['step']} "
            f"{status['seconds_to_commit']}s after the signal: rerun to resume"
        )
    if status["state"] == "preempted-unsaved":
        return f"the trainer could not commit its checkpoint of step {status['step']}: {status.get('error')}"
    if status["state"] in (*PERMANENT, "hung", "crashed") and status.get("error"):
        return status["error"]
    return f"the trainer's last status is {status['state']!r} at step {status.get('step')}"


def torchrun_command(cfg: LaunchConfig) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nnodes=1",
        f"--nproc-per-node={cfg.nproc_per_node}",
        "--tee=3",
        f"--log-dir={torchrun_log_dir(cfg)}",  # each line prefixed [default<rank>]:
        "-m",
        "trainer.train_ddp",
        *cfg.trainer_args(),
    ]


def run_torchrun(cfg: LaunchConfig) -> LaunchResult:
    command = torchrun_command(cfg)
    threads = max(1, (os.cpu_count() or 1) // cfg.nproc_per_node)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1", **cfg.trainer_env()}
    log.info("launching %d local processes for run %s: %s", cfg.nproc_per_node, cfg.run_id, " ".join(command))
    started = time.monotonic()
    tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
    # Its own process group, so that a stuck torchrun can be killed with all its workers.
    proc = subprocess.Popen(
        command,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        start_new_session=True,
    )
    stop_reasons: list[str] = []
    timers: list[threading.Timer] = []

    def stop(reason: str) -> None:
        """SIGTERM torchrun (it passes it to the workers); SIGKILL the group if it lingers past the grace period."""
        if stop_reasons:
            return
        stop_reasons.append(reason)
        log.warning("%s: stopping torchrun and its workers", reason)
        proc.send_signal(signal.SIGTERM)
        timers.append(_timer(STOP_GRACE_S, lambda: _kill_group(proc)))

    previous = {}
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGTERM, signal.SIGINT):
            previous[signum] = signal.signal(signum, lambda n, _f: stop(f"this step received {signal.Signals(n).name}"))
    if cfg.timeout_s:
        timers.append(_timer(cfg.timeout_s, lambda: stop(f"the timeout of {cfg.timeout_s}s passed")))
    watching = threading.Event()
    watcher = threading.Thread(
        target=_watch_training, args=(TrainingWatch(cfg.run_paths, cfg.stall_timeout_s), stop, watching), daemon=True
    )
    watcher.start()
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip("\n")
            tail.append(line)
            log.info("%s", line)
        exit_code = proc.wait()
    finally:
        watching.set()
        watcher.join(timeout=10)  # a check under way ends first: its verdict is in stop_reasons before they are read
        for timer in timers:
            timer.cancel()
        if proc.poll() is None:
            _kill_group(proc)
            proc.wait()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    seconds = time.monotonic() - started
    if stop_reasons:
        lines = f"; last lines: {last_lines_of_every_rank(cfg.run_paths)}" if "stalled" in stop_reasons[0] else ""
        raise StepFailed(
            f"training of run {cfg.run_id} was stopped after {seconds:.0f}s because {stop_reasons[0]}; "
            f"{trainer_outcome(cfg)}{lines}"
        )
    if exit_code != 0:
        cause = root_cause(torchrun_log_dir(cfg))
        outcome = trainer_outcome(cfg)
        if any(outcome.startswith(state) for state in ("diverged", "a collective failed")):
            cause = outcome  # the trainer's own words: diverged at step N, or which rank stopped answering
        last = "\n".join(tail)
        raise StepFailed(
            f"training of run {cfg.run_id} failed with exit code {exit_code} after {seconds:.0f}s"
            f"{': ' + cause if cause else ''}\nlast {len(tail)} lines of output:\n{last}"
        )
    log.info("training of run %s finished in %.1fs", cfg.run_id, seconds)
    return LaunchResult(
        run_id=cfg.run_id,
        run_dir=str(cfg.run_paths.root),
        backend="local",
        world_size=cfg.world_size,
        seconds=round(seconds, 3),
    )


def _watch_training(watch: TrainingWatch, stop: Callable[[str], None], done: threading.Event) -> None:
    """Stop torchrun when training stalled (progress.py): a stalled run would hold the step until its timeout. A
    permanent failure needs nothing here: torchrun restarts no worker (no --max-restarts), the trainer just exits."""
    while not done.wait(WATCH_EVERY_S):
        if reason := watch.check(permanent=False):
            stop(reason)
            return


def _timer(seconds: float, action: Callable[[], None]) -> threading.Timer:
    timer = threading.Timer(seconds, action)
    timer.daemon = True
    timer.start()
    return timer


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
