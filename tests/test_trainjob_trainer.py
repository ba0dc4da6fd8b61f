"""The trainer runs unchanged under a Kubeflow Trainer v2 TrainJob: its rendezvous comes from the torch plugin's PET_*
environment, and its SIGTERM checkpoint and resume work under JobSet's restart of the whole group.

Each "node" is what one pod of the TrainJob runs (components/launch_training/trainjob.py): the runtime's command,
`runtime_command()`, with the TrainJob's arguments (`trainjob_pod`), `$(VAR)` expanded by the kubelet from the
container's environment, which is the TrainJob's `spec.trainer.env` with the PET_* variables the torch plugin upserts
over it (kubeflow/trainer v2.3.0 pkg/runtime/framework/plugins/torch/torch.go, EnforceMLPolicy). Two such nodes run
here as two torchrun agents on loopback, one process each.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any

from components.launch_training.platform import Platform
from components.launch_training.trainjob import TRAINJOB, runtime_command, trainjob_pod
from tests.helpers import EXACT, tiny_launch
from tests.test_trainer import assert_same_rows, read_metrics
from trainer.layout import RunPaths
from trainer.preemption import ExitCode

REPO = Path(__file__).resolve().parent.parent
NODES = 2
POLL_S = 0.1
# The image's `torchrun` is this Python's torch.distributed.run (as local_backend.torchrun_command starts it).
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def kubelet_expand(text: str, env: Mapping[str, str]) -> str:
    """`text` as the kubelet passes it to the container: every `$(VAR)` replaced by VAR's value from the container's
    environment (left as it is when VAR is not there), `$$` made `$`, any other `$` kept.

    kubernetes third_party/forked/golang/expansion/expand.go (Expand, tryReadVariableName, with MappingFuncFor's
    mapping), which the kubelet applies to each command and argument (pkg/kubelet/container/helpers.go,
    ExpandContainerCommandAndArgs)."""
    out: list[str] = []
    cursor = 0
    while cursor < len(text):
        if text[cursor] != "$" or cursor + 1 == len(text):  # a lone `$` at the end stays
            out.append(text[cursor])
            cursor += 1
            continue
        rest = text[cursor + 1 :]
        if rest[0] == "$":  # escaped operator
            out.append("$")
            cursor += 2
        elif rest[0] == "(" and (close := rest.find(")")) != -1:
            name = rest[1:close]
            out.append(env[name] if name in env else f"$({name})")
            cursor += close + 2
        elif rest[0] == "(":  # incomplete reference: `$(` kept, the rest read on
            out.append("$(")
            cursor += 2
        else:  # not an expression: the operator and the next character kept
            out.append("$" + rest[0])
            cursor += 2
    return "".join(out)


# Cases of kubernetes' expand_test.go (doExpansionTest), with its mapping: what the expander above must agree on.
EXPANSION_CONTEXT = {"VAR_A": "A", "VAR_B": "B", "VAR_C": "C", "VAR_REF": "$(VAR_A)", "VAR_EMPTY": ""}
EXPANSION_CASES = {
    "$(VAR_A)-$(VAR_A)": "A-A",
    "___$(VAR_B)___": "___B___",
    "$$(VAR_B)_$(VAR_A)": "$(VAR_B)_A",
    "f000-$$VAR_A": "f000-$VAR_A",
    "$(VAR_A$(VAR_B))": "$(VAR_A$(VAR_B))",
    "$(VAR_REF)": "$(VAR_A)",
    "foo$(VAR_EMPTY)bar": "foobar",
    "foo$(VAR_Awhoops!": "foo$(VAR_Awhoops!",
    "$?_boo_$!": "$?_boo_$!",
    "$(VAR_DNE)": "$(VAR_DNE)",
    "$$$$$$$(VAR_A)": "$$$A",
    "$$$$$$(BIG_MONEY)": "$$$(BIG_MONEY)",
    "${VAR_A}": "${VAR_A}",
    "$(VAR_C)_______$(": "C_______$(",
    "$(VAR_A)foobarzab$": "Afoobarzab$",
    "$($($($($--foo$(": "$($($($($--foo$(",
    "$(foo$$var)": "$(foo$$var)",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torch_plugin_env(
    trainjob_env: list[dict[str, str]], nnodes: int, nproc: int, node_rank: int, port: int
) -> dict[str, str]:
    """The trainer container's environment on node `node_rank`: the TrainJob's env, then the torch plugin's PET_*
    upserted over it (torch.go, EnforceMLPolicy). PET_NODE_RANK is the pod's completion index and PET_MASTER_ADDR
    node 0's hostname (<job>-node-0-0.<job>): loopback here; PET_MASTER_PORT is 29500 there, a free port here."""
    env = {e["name"]: e["value"] for e in trainjob_env}
    return env | {
        "PET_NNODES": str(nnodes),
        "PET_NPROC_PER_NODE": str(nproc),
        "PET_NODE_RANK": str(node_rank),
        "PET_MASTER_ADDR": "127.0.0.1",
        "PET_MASTER_PORT": str(port),
    }


class Node:
    """One pod of the TrainJob: its container's command as the kubelet runs it, in a process group of its own,
    its output in a file (the container's log)."""

    def __init__(self, index: int, command: list[str], container_env: dict[str, str], log_dir: Path):
        expanded = [kubelet_expand(part, container_env) for part in command]
        assert expanded[0] == "torchrun", expanded
        self.index, self.command = index, [*TORCHRUN, *expanded[1:]]
        # The image's environment (this interpreter's), the local backend's CPU thread count for each of the world's
        # processes on this one host, then the container's env.
        threads = max(1, (os.cpu_count() or 1) // NODES)
        self.env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1", **container_env}
        self.log_dir = log_dir
        self.proc: subprocess.Popen[bytes] | None = None
        self.log: IO[bytes] | None = None
        self.attempt = 0

    def start(self) -> None:
        self.attempt += 1
        self.log = (self.log_dir / f"node-{self.index}-attempt-{self.attempt}.log").open("wb")
        self.proc = subprocess.Popen(
            self.command, env=self.env, cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def output(self) -> str:
        return (self.log_dir / f"node-{self.index}-attempt-{self.attempt}.log").read_text(errors="replace")

    def wait(self, timeout: float) -> int:
        assert self.proc is not None and self.log is not None
        try:
            code = self.proc.wait(timeout=timeout)
        finally:
            self.log.close()
        return code


def outputs(nodes: list[Node]) -> str:
    return "\n".join(f"--- node {n.index}, attempt {n.attempt}:\n{n.output()[-3000:]}" for n in nodes)


def wait_until(what: str, check: Callable[[], Any], nodes: list[Node], timeout: float) -> Any:
    """Poll `check` until it gives something true; fail naming `what` (with the nodes' output) on a timeout or
    when a node ends first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if result := check():
            return result
        if any(n.proc is not None and n.proc.poll() is not None for n in nodes):
            raise AssertionError(f"a node ended before {what}:\n{outputs(nodes)}")
        time.sleep(POLL_S)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}:\n{outputs(nodes)}")


def latest_checkpoint_step(run: RunPaths) -> int:
    """The step of the newest committed checkpoint (0: none), from checkpoint_latest's target's name."""
    try:
        return int(os.readlink(run.latest_checkpoint).rsplit("_", 1)[1])
    except (OSError, IndexError, ValueError):
        return 0


def last_logged_step(run: RunPaths) -> int:
    try:
        lines = run.metrics.read_text().splitlines()
    except OSError:
        return 0
    return max((json.loads(line)["step"] for line in lines if line.endswith("}")), default=0)


def reports(run: RunPaths, attempt: int) -> list[dict[str, Any]] | None:
    """Every rank's comms self-test report of `attempt`, once all are written."""
    try:
        return [json.loads(run.comms_report(rank, attempt).read_text()) for rank in range(NODES)]
    except (OSError, ValueError):
        return None


def parent_pid(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1


def assert_one_rank_per_node(run: RunPaths, attempt: int, nodes: list[Node]) -> list[dict[str, Any]]:
    """World size 2 across the 2 nodes: rank r is the only process (local rank 0) of node r's torchrun (its child,
    read while it runs); the self-test's all-reduce was right."""
    found = wait_until(f"attempt {attempt}'s comms reports", lambda: reports(run, attempt), nodes, timeout=120)
    for rank, report in enumerate(found):
        assert (report["rank"], report["world_size"], report["local_rank"], report["attempt"]) == (rank, 2, 0, attempt)
        assert report["all_reduce_correct"] is True and report["backend"] == "gloo"
        node = nodes[rank]
        assert node.proc is not None and parent_pid(report["pid"]) == node.proc.pid, f"rank {rank} is not node {rank}'s"
    return found


def kill_leftovers(nodes: list[Node], worker_pids: set[int]) -> None:
    """SIGKILL whatever of the nodes is still there: each torchrun's process group, and its workers (torchrun
    starts them in sessions of their own) while they are still the trainer."""
    for node in nodes:
        if node.proc is not None and node.proc.poll() is None:
            os.killpg(node.proc.pid, signal.SIGKILL)
            node.proc.wait(timeout=10)
        if node.log is not None:
            node.log.close()
    for pid in worker_pids:
        try:
            if b"trainer.train_ddp" in Path(f"/proc/{pid}/cmdline").read_bytes():
                os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def test_trainjob_nodes_train_stop_on_sigterm_and_resume_exactly(
    staged_copy: Path, uninterrupted: RunPaths, tmp_path: Path
) -> None:
    """The `uninterrupted` fixture's run (40 steps of the tiny preset, 2 ranks, every step logged, a checkpoint every
    10) as a TrainJob of 2 nodes x 1 process.

    Once the step-10 checkpoint is committed and training is past it, both nodes get SIGTERM together, as when JobSet
    deletes the failed group (its Jobs, foreground: kubernetes-sigs/jobset v0.12.0 pkg/controllers/jobset_controller.go
    deleteJobs) and the kubelet stops every pod: the container runtime signals the container's main process, torchrun
    (the runtime's command, no shell). Signalling each torchrun's process group is the same thing, since torchrun
    starts its worker in a session of its own (torch/distributed/elastic/multiprocessing/subprocess_handler/
    subprocess_handler.py): torchrun forwards the signal, the ranks agree on a step and commit its checkpoint. Only
    once both nodes have exited do they start again with the same command, as JobSet creates the new Jobs only after
    the old ones are gone (shouldCreateJob). The new attempt resumes from that checkpoint, and every logged row (loss,
    gradient norm, learning rate) equals the uninterrupted run's: the layout (2 x 1 here, 1 x 2 there) does not
    change the training, as each global rank reads the same windows, gloo's all-reduce adds the same two gradients,
    and each process computes with as many threads as the fixture's."""
    expanded = {text: kubelet_expand(text, EXPANSION_CONTEXT) for text in EXPANSION_CASES}
    assert expanded == EXPANSION_CASES, "the expander differs from kubernetes' on its own test cases"
    cfg = tiny_launch(
        staged_copy,
        "trainjob",
        **EXACT,
        nnodes=NODES,
        nproc_per_node=1,
        image="img:1",
        platform=Platform(job_api="trainjob"),
    )
    spec = cfg.job_spec()
    trainjob = TRAINJOB.render(spec)["spec"]["trainer"]
    assert trainjob["args"] == cfg.trainer_args() and (trainjob["numNodes"], trainjob["numProcPerNode"]) == (2, 1)
    container = trainjob_pod(spec)["spec"]["containers"][0]
    assert container["command"] == [*runtime_command(), *cfg.trainer_args()]
    assert container["env"] == trainjob["env"]
    port = free_port()
    nodes = [
        Node(i, container["command"], torch_plugin_env(trainjob["env"], NODES, 1, i, port), tmp_path)
        for i in range(NODES)
    ]
    assert nodes[1].command[len(TORCHRUN) : len(TORCHRUN) + 5] == [
        "--nnodes=2",
        "--nproc-per-node=1",
        "--node-rank=1",
        "--master-addr=127.0.0.1",
        f"--master-port={port}",
    ]
    run = cfg.run_paths
    run.logs.mkdir(parents=True, exist_ok=True)
    worker_pids: set[int] = set()
    try:
        for node in nodes:
            node.start()
        first = assert_one_rank_per_node(run, 1, nodes)
        worker_pids |= {r["pid"] for r in first}
        saved = wait_until("a committed checkpoint", lambda: latest_checkpoint_step(run), nodes, timeout=120)
        wait_until(f"a step past the step-{saved} checkpoint", lambda: last_logged_step(run) > saved, nodes, 60)
        for node in nodes:  # the group deleted: every pod's container signalled at once
            assert node.proc is not None
            os.killpg(node.proc.pid, signal.SIGTERM)  # torchrun alone: its worker is in a session of its own
        for node in nodes:  # torchrun exits 1 on a signal (SignalException); status.json says how the run ended
            node.wait(timeout=60)
        status = json.loads(run.status.read_text())
        assert (status["state"], status["exit_code"], status["attempt"]) == ("preempted", ExitCode.PREEMPTED, 1), (
            f"{status}\n{outputs(nodes)}"
        )
        stopped = status["step"]
        assert saved < stopped < EXACT["max_steps"] and latest_checkpoint_step(run) == stopped, (saved, stopped)
        for rank in range(NODES):
            log_text = run.rank_log(rank).read_text()
            assert f"stopped by SIGTERM at step {stopped}: checkpoint committed" in log_text, f"rank {rank}"

        for node in nodes:  # JobSet's new attempt: the same pods' spec, started after the old ones are gone
            node.start()
        second = assert_one_rank_per_node(run, 2, nodes)
        worker_pids |= {r["pid"] for r in second}
        codes = [node.wait(timeout=120) for node in nodes]
        assert codes == [0, 0], outputs(nodes)
    finally:
        kill_leftovers(nodes, worker_pids)

    status = json.loads(run.status.read_text())
    assert (status["state"], status["step"], status["attempt"]) == ("done", 40, 2), status
    assert f"resumed at step {stopped}" in run.rank_log(0).read_text()
    assert run.attempts() == [1, 2]
    assert_same_rows(read_metrics(run), read_metrics(uninterrupted), f"after a SIGTERM of both nodes at {stopped}")
