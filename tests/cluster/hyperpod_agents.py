"""The HyperPod training operator's side of the HyperPod elastic agent's HTTP API, played against real `hyperpodrun`
processes: what the operator does with each node's agent once the job's pods run.

The operator is closed source. What it does with the agents is drawn in the agent's own design notes (PyPI
hyperpod-elastic-agent 1.1.3, sdist `doc/unified_seq_diagram.wsd` and `doc/unified_state_machine.md`), and the
exchange itself is the agent's server (`server/server.py`, `server/api_models.py`):
- once every node's agent answers READY, each is sent /start with its node rank, the node count, the job's
  `faultCount` ("Total number of restarts encountered in the job"), the master's address and port, and the job's
  `log_monitoring_configuration` (`StartRequest`);
- /status is polled; when one agent reports FAULTED (its workers crashed: `WorkerCrash`; a log rule tripped:
  `LogHang_<rule>`, `LogSlow_<rule>`) the job is faulted and every node's agent is sent /stop; once all are READY
  again the job starts again "if remaining retries > 0", the agents /start-ed with the next faultCount (the agent
  makes it the workers' TORCHELASTIC_RESTART_COUNT and their log attempt: `hyperpod_elastic_agent.py`);
- when every agent reports COMPLETED the job is complete and cleaned up (/shutdown ends each agent with 0).
How many such in-place restarts come before the whole job is restarted is the job's
`runPolicy.restartPolicy.numRestartBeforeFullJobRestart` (AWS, "Using the training operator to run jobs": process
level restarts, then a full job restart); a full job restart is the pods' own, made anew
(tests/cluster/hyperpod_training_operator.py), so this player reports it and stops.

Not published, chosen here: the master's address is rank 0's pod address (loopback here) and its port a free one.
Each `hyperpodrun` here runs the rendered job's container command and environment, only its server port and log
directory made local (a pod's own port 8080 and /tmp are not a test's to take).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from components.launch_training.hyperpodpytorchjob import AGENT_LOG_DIR, AGENT_PORT

log = logging.getLogger(__name__)

HTTP_TIMEOUT_S = 10
READY, RUNNING, COMPLETED, FAULTED = "ready", "running", "completed", "faulted"  # /status's `status`


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def localized(command: list[str], port: int, log_dir: Path) -> list[str]:
    """The container's command with the agent's port and log directory this machine's: nothing else changed."""
    replaced = {
        f"--server-port={AGENT_PORT}": f"--server-port={port}",
        f"--log_dir={AGENT_LOG_DIR}": f"--log_dir={log_dir}",
    }
    missing = set(replaced) - set(command)
    assert not missing, f"the rendered command lacks {sorted(missing)}: {command}"
    return [replaced.get(arg, arg) for arg in command]


class NodeAgent:
    """One node's pod: its container's `hyperpodrun` command, run here in `bin_dir`'s environment with the pod's
    environment variables, its output in `workdir`/hyperpodrun.out."""

    def __init__(self, command: list[str], env: dict[str, str], workdir: Path, bin_dir: Path, cwd: Path) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.port, self.log_dir = free_port(), workdir / "hyperpod"
        argv = localized(command, self.port, self.log_dir)
        argv[0] = str(bin_dir / argv[0])
        path = f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"
        full_env = {**os.environ, **env, "PATH": path, "PYTHONPATH": str(cwd), "OMP_NUM_THREADS": "1"}
        self.output = workdir / "hyperpodrun.out"
        with self.output.open("w") as out:
            self.process = subprocess.Popen(
                argv, cwd=cwd, env=full_env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )

    def call(self, path: str, body: dict[str, Any] | None = None) -> Any:
        """GET (no body) or POST `path`; the answer's JSON (None when empty)."""
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}{path}",
            data=data,
            method="GET" if body is None else "POST",
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S) as response:
            text = response.read().decode()
        return json.loads(text) if text else None

    def status(self) -> dict[str, Any]:
        return self.call("/status")

    def wait_for(self, state: str, timeout_s: float) -> dict[str, Any]:
        """The agent's /status once it reads `state` (the server may not be up yet)."""
        deadline, last = time.monotonic() + timeout_s, None
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"hyperpodrun exited with {self.process.returncode}: {self.tail()}")
            try:
                last = self.status()
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                last = None
            if last and last.get("status") == state:
                return last
            time.sleep(0.2)
        raise AssertionError(f"the agent never read {state!r} within {timeout_s:.0f}s (last: {last}): {self.tail()}")

    def workers(self) -> dict[int, int]:
        """{local rank: pid} of the worker processes the agent runs now."""
        found = {}
        listing = subprocess.run(
            ["ps", "-o", "pid=", "--ppid", str(self.process.pid)], capture_output=True, text=True, check=False
        ).stdout
        for pid in map(int, listing.split()):
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            env = dict(item.decode(errors="replace").split("=", 1) for item in environ if b"=" in item)
            if "LOCAL_RANK" in env:
                found[int(env["LOCAL_RANK"])] = pid
        return found

    def attempt_dir(self, fault_count: int) -> Path:
        """Where the agent tees this attempt's workers' output: <log dir>/<run>_<random>/attempt_<faultCount>."""
        runs = sorted(self.log_dir.glob(f"*/attempt_{fault_count}"))
        assert len(runs) == 1, f"attempt {fault_count}'s log directory: {runs}"
        return runs[0]

    def tail(self, chars: int = 3000) -> str:
        return self.output.read_text(errors="replace")[-chars:] if self.output.exists() else ""

    def kill(self) -> None:
        """The kubelet's SIGKILL of the container (its process group)."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=30)


@dataclass
class Fault:
    """An agent's report of a fault: the attempt (the job's faultCount then) and the node, its reason and message."""

    fault_count: int
    node: int
    reason: str
    message: str


class AgentOperator:
    """The operator's exchange with one incarnation of the job's pods (module docstring), polled in a thread: starts
    every node's agent, restarts them in place on a fault while the job's numRestartBeforeFullJobRestart allows,
    shuts them down once all completed. `outcome` ends as "completed", "full job restart" (the process-level budget
    spent) or "agents gone" (a pod ended under it); `faults` lists what the agents reported."""

    def __init__(self, job: dict[str, Any], agents: list[NodeAgent], fault_count: int = 0, poll_s: float = 0.5):
        run_policy = job["spec"]["runPolicy"]
        self.in_place_budget = int(run_policy["restartPolicy"]["numRestartBeforeFullJobRestart"])
        self.rules = run_policy.get("logMonitoringConfiguration")
        self.agents, self.fault_count, self.poll_s = agents, fault_count, poll_s
        self.in_place_restarts = 0
        self.master_port = free_port()
        self.faults: list[Fault] = []
        self.outcome = ""
        self.done = threading.Event()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="hyperpod-operator")
        self._thread.start()

    def _start_all(self) -> None:
        for agent in self.agents:
            agent.wait_for(READY, timeout_s=120)
        for rank, agent in enumerate(self.agents):
            body = {
                "rank": rank,
                "nnodes": len(self.agents),
                "faultCount": self.fault_count,
                "master_addr": "127.0.0.1",
                "master_port": self.master_port,
            }
            if self.rules:
                body["log_monitoring_configuration"] = self.rules
            agent.call("/start", body)
        log.info("operator player: /start faultCount %d on %d node(s)", self.fault_count, len(self.agents))

    def _run(self) -> None:
        try:
            self._start_all()
            while not self._stopped.wait(self.poll_s):
                try:
                    states = [agent.status() for agent in self.agents]
                except (urllib.error.URLError, ConnectionError, TimeoutError):
                    self.outcome = "agents gone"
                    return
                faulted = [(node, s) for node, s in enumerate(states) if s["status"] == FAULTED]
                if faulted:
                    self._restart(faulted)
                    if self.outcome:
                        return
                elif all(s["status"] == COMPLETED for s in states):
                    for agent in self.agents:
                        agent.call("/shutdown", {})
                    self.outcome = "completed"
                    return
        except Exception as exc:  # noqa: BLE001 (the test reads it)
            log.exception("operator player")
            self.outcome = f"error: {exc!r}"
        finally:
            self.done.set()

    def _restart(self, faulted: list[tuple[int, dict[str, Any]]]) -> None:
        """Every agent stopped; then the job started again in place, or its process-level budget is spent."""
        for node, state in faulted:
            self.faults.append(Fault(self.fault_count, node, state.get("reason", ""), state.get("message", "")))
            log.info("operator player: node %d faulted: %s", node, state.get("reason"))
        for agent in self.agents:
            agent.call("/stop", {})
        for agent in self.agents:
            agent.wait_for(READY, timeout_s=120)
        if self.in_place_restarts >= self.in_place_budget:
            self.outcome = "full job restart"
            return
        self.in_place_restarts += 1
        self.fault_count += 1
        self._start_all()

    def wait(self, timeout_s: float) -> str:
        assert self.done.wait(timeout_s), f"the operator player did not finish within {timeout_s:.0f}s"
        return self.outcome

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=HTTP_TIMEOUT_S * 2)
