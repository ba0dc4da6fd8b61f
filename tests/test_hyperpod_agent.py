"""The trainer under the real HyperPod elastic agent: the HyperPodPyTorchJob's rendered container command (`hyperpodrun`
as PID 1, its log rules, its shutdown timeout) run here with 2 CPU workers in .venv-hyperpod, the stack of the image
this job API runs (trainer/stack-hyperpod.txt), driven over the agent's HTTP API by the operator's player
(tests/cluster/hyperpod_agents.py).

One run carries every path, as the pod would live through them: a worker killed, restarted in place (a process-level
restart); a worker that stops printing steps, caught by the rendered hang rule as the agent's log agent evaluates it,
restarted in place; the pod stopped (SIGTERM from the kubelet), the preemption checkpoint saved within the agent's
shutdown timeout; a new pod (the job's pods made anew) resuming to the end. Every step's loss, gradient norm and
learning rate equal, to the bit, those of the same run uninterrupted under plain torchrun; the lines the rules read
(trainer/monitor.py) are in the files the agent reads, from local rank 0 alone; the NCCL verification reads the run
as it reads any other.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from components.launch_training.hyperpodpytorchjob import HYPERPODPYTORCHJOB
from components.launch_training.log_rules import HANG_RULE, STEP_PATTERN, STOP_PATTERN, TOKENS_PER_S_PATTERN
from components.launch_training.platform import Platform
from components.verify_nccl.core import verify_nccl
from tests.cluster.hyperpod_agents import AgentOperator, NodeAgent
from tests.helpers import EXACT, tiny_launch
from tests.launcher_helpers import wait_for
from tests.test_trainer import assert_same_rows, read_metrics, wait_for_step
from trainer.checkpoint import read_checkpoint
from trainer.layout import RunPaths

REPO = Path(__file__).resolve().parent.parent
HYPERPOD_BIN = REPO / ".venv-hyperpod" / "bin"
pytestmark = pytest.mark.skipif(
    not (REPO / ".venv-hyperpod" / "installed").exists(),
    reason=".venv-hyperpod is not built (make test builds it: trainer/stack-hyperpod.txt)",
)

# The run's settings for the job: a step line every step, expected every 500 ms (so the hang rule's interval is
# 10 x that: 5 s), the least start-up allowance a run may give, 2 process-level restarts before a full one, and a
# shutdown timeout of 3 s that the preemption checkpoint (a tiny model's: 0.1 s here) must fit.
JOB_OPTIONS = {"expected_step_ms": 500, "startup_allowance_s": 60, "max_restarts": 2, "shutdown_timeout_s": 3}


def rendered_job(root: Path, run_id: str) -> tuple[dict, list[str], dict[str, str]]:
    """The HyperPodPyTorchJob the launcher renders for the run (one node of 2 processes, the storage root where the
    pods mount it), its container's command and environment."""
    cfg = tiny_launch(
        root,
        run_id,
        **EXACT,
        backend="kubernetes",
        image="img:1",
        nnodes=1,
        job_options=JOB_OPTIONS,
        platform=Platform(job_api="hyperpodpytorchjob"),
    )
    job = HYPERPODPYTORCHJOB.render(cfg.job_spec())
    container = job["spec"]["replicaSpecs"][0]["template"]["spec"]["containers"][0]
    return job, container["command"], {e["name"]: e["value"] for e in container["env"] if "value" in e}


def logged_step(run, proc: subprocess.Popen, step: int) -> None:
    wait_for_step(run, step, proc, timeout=180)
    assert proc.poll() is None, "hyperpodrun exited"


def test_process_level_restarts_a_hang_rule_and_a_stop_under_hyperpodrun_resume_exactly(
    staged_copy: Path, tmp_path: Path, uninterrupted: RunPaths
) -> None:
    job, command, env = rendered_job(staged_copy, "hpto")
    rules = job["spec"]["runPolicy"]["logMonitoringConfiguration"]
    hang = next(rule for rule in rules if rule["name"] == HANG_RULE)
    assert hang["expectedRecurringFrequencyInSeconds"] == 5
    run = tiny_launch(staged_copy, "hpto").run_paths

    # 1. A worker killed after the step-10 checkpoint: the agent reports the crash, the operator restarts in place.
    pod = NodeAgent(command, env, tmp_path / "pod-1", HYPERPOD_BIN, REPO)
    operator = AgentOperator(job, [pod])
    try:
        logged_step(run, pod.process, 12)
        os.kill(pod.workers()[1], signal.SIGKILL)
        wait_for(lambda: len(operator.faults) == 1 and operator.fault_count == 1, 120, "the process-level restart")
        crash = operator.faults[0]
        assert crash.reason == "WorkerCrash" and "Local Rank 1 exited with code -9" in crash.message, crash

        # 2. Rank 0 stops (SIGSTOP: no more step lines, rank 1 waits in its collective): the rendered hang rule trips.
        wait_for(lambda: resumed_past(run, 2, 22), 120, "the first restart's step 22")
        os.kill(pod.workers()[0], signal.SIGSTOP)
        wait_for(lambda: len(operator.faults) == 2 and operator.fault_count == 2, 60, "the hang rule's restart")
        hang_fault = operator.faults[1]
        assert hang_fault.reason == f"LogHang_{HANG_RULE}", hang_fault
        assert f"'{HANG_RULE}': 'monitor: step" in hang_fault.message, hang_fault
        agent_log = (pod.attempt_dir(1) / "0" / "stdout.log").read_text()
        assert re.search(r"^monitor: step 2\d tokens_per_s \d+$", agent_log, re.M), agent_log[-500:]

        # 3. The kubelet stops the pod (SIGTERM to hyperpodrun): the workers save within the shutdown timeout.
        wait_for(lambda: resumed_past(run, 3, 25), 120, "the second restart's step 25")
        os.kill(pod.process.pid, signal.SIGTERM)
        wait_for(lambda: not pod.workers(), 30, "the workers' exit after SIGTERM")
        # hyperpodrun 1.1.3 itself does not exit while log rules are on (its log agent's thread is never stopped on
        # this path: docs/deploy.md): the pod ends at the kubelet's SIGKILL, at the grace period's end.
        time.sleep(2)
        assert pod.process.poll() is None, "hyperpodrun exited by itself: the lingering documented is gone"
    finally:
        operator.stop()
        pod.kill()  # the kubelet's SIGKILL at the grace period's end, brought forward
    status = json.loads(run.status.read_text())
    assert status["state"] == "preempted", status
    stop_line = re.search(
        r"stopped by SIGTERM at step (\d+): checkpoint committed ([\d.]+)s after the signal \(budget 3s\)",
        (pod.attempt_dir(2) / "0" / "stderr.log").read_text(),
    )
    assert stop_line and float(stop_line[2]) < 3, pod.tail()
    assert read_checkpoint(run.latest_checkpoint)["step"] == int(stop_line[1]) == status["step"]

    # 4. The job's pods made anew (the whole job restarted: faultCount carries the job's restarts): resumed to the end.
    pod = NodeAgent(command, env, tmp_path / "pod-2", HYPERPOD_BIN, REPO)
    operator = AgentOperator(job, [pod], fault_count=3)
    try:
        assert operator.wait(240) == "completed", pod.tail()
        assert pod.process.wait(timeout=30) == 0
    finally:
        operator.stop()
        pod.kill()
    assert operator.faults == []
    assert json.loads(run.status.read_text())["state"] == "done"
    # The reference is the uninterrupted run on the pinned stack (torch 2.13, conftest.py): the two torches' arithmetic
    # gave the same bits on 2026-12-07. After a change of either torch, a difference here may be theirs, not the
    # agent's: run the same config under .venv-hyperpod's torchrun to tell.
    assert_same_rows(read_metrics(run), read_metrics(uninterrupted), "under hyperpodrun on torch 2.11")

    # The lines the rendered rules read, in the file the agent's log agent reads (its --tee=3 --log_dir): the last
    # start's local rank 0 has a step line for each step it trained, then the stop line; rank 1's file has nothing
    # (one monitor per node); the console lines (loss, lr, ...) stay on stderr.
    stopped_at = int(stop_line[1])
    lines = (pod.attempt_dir(3) / "0" / "stdout.log").read_text().splitlines(keepends=True)
    steps = [line for line in lines if re.match(STEP_PATTERN, line)]
    assert [int(re.search(r"monitor: step (\d+) ", line)[1]) for line in steps] == list(range(stopped_at + 1, 41))
    assert all(float(re.match(TOKENS_PER_S_PATTERN, line)[1]) > 0 for line in steps)  # type: ignore[index]
    stops = [i for i, line in enumerate(lines) if re.match(STOP_PATTERN, line)]
    assert len(stops) == 1 and "step 40 (max-steps)" in lines[stops[0]] and stops[0] > lines.index(steps[-1])
    assert not any("loss" in line for line in lines), "the console lines stay on stderr"
    assert not (pod.attempt_dir(3) / "1" / "stdout.log").read_text().strip(), "one monitor per node: local rank 0"

    # 5. The NCCL verification reads what the run left under the agent: the trainer's reports on the volume, one
    # attempt per start of the workers (four), and the last pod's log as hyperpodrun tees it ([default<rank>]: lines).
    result = verify_nccl(str(staged_copy), "hpto", world_size=2, extra_logs=[str(pod.output)])
    assert result.passed and result.attempt == 4, result.markdown()
    assert [line.split(":")[0] for line in result.history] == ["attempt 1", "attempt 2", "attempt 3"], result.history


def resumed_past(run, attempt: int, step: int) -> bool:
    """The trainer's status says its `attempt` (the first start's is 1: agree_on_attempt) reached `step`."""
    try:
        status = json.loads(run.status.read_text())
    except (OSError, ValueError):
        return False
    return status.get("attempt") == attempt and status.get("step", 0) >= step
