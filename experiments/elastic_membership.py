"""Does a running elastic job take in a late node, and survive losing one? An experiment, not a test.

The PyTorchJob's pods each run one torchrun agent with the command and environment the launcher renders
(manifest.render_job) and the ``PET_*`` variables the Training Operator adds to a Worker-only elastic job
(``PET_RDZV_ENDPOINT=<job>-worker-0:23456``, c10d). Here several such agents run on this host, ``localhost`` standing
for worker-0's Service, one process per agent, on CPU with gloo.

Scenarios (each from a fresh run directory):
- ``join``: one agent starts a 1:2 job alone; once it trains, a second agent arrives (a late pod, a node that
  freed up).
- ``leave``: two agents train a 1:2 job; the second is SIGKILLed with its workers (a node lost).
- ``leave-store``: the same, but the first is lost: the one holding the rendezvous store (worker-0's pod).
Workers (``--worker``): ``trainer`` is ours (trainer.train_ddp, the job's arguments); ``minimal`` is a bare gloo
all-reduce loop, to tell torch's behaviour from the trainer's.

Run: ``.venv/bin/python experiments/elastic_membership.py`` (about 4 minutes per scenario and worker on 2 cores);
it prints what each agent and worker said that decides the outcome, and one verdict line per scenario.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from components.launch_training.config import LaunchConfig  # noqa: E402
from components.launch_training.manifest import JobSpec, render_job  # noqa: E402
from components.launch_training.rendering import RDZV_STORE_OPT_OUT  # noqa: E402
from components.stage_data.core import stage_data  # noqa: E402
from pipelines.local_run import default_corpus  # noqa: E402

log = logging.getLogger("elastic_membership")

RDZV_PORT = 29533
# What decides the outcome, as torchrun and the trainer print it.
TELLING = re.compile(
    r"Rendezvous complete|group_world_size=|num_nodes_waiting|restarting worker|Stopping worker|DistStoreError|"
    r"RendezvousTimeoutError|RendezvousClosedError|wait timeout|resumed at step|world size changed|"
    r"committed|ChildFailedError|Traceback|Error:|MINIMAL rank"
)

MINIMAL_WORKER = """
import os, sys, time, torch, torch.distributed as dist
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
print(f"MINIMAL rank {rank} world {world} restart {os.environ.get('TORCHELASTIC_RESTART_COUNT')}", flush=True)
for step in range(100000):
    t = torch.ones(1)
    dist.all_reduce(t)
    if step % 50 == 0:
        print(f"MINIMAL rank {rank} world {world} step {step} sum {int(t.item())}", flush=True)
    time.sleep(0.05)
"""


@dataclass
class Agent:
    name: str
    proc: subprocess.Popen
    log_path: Path

    def lines(self) -> list[str]:
        return self.log_path.read_text(errors="replace").splitlines() if self.log_path.exists() else []


def job_command(
    cfg: LaunchConfig, min_nodes: int, max_nodes: int, worker: str, workdir: Path, with_fix: bool
) -> tuple[list, dict]:
    """The container's command and environment as the launcher renders them, with what the operator adds."""
    spec = JobSpec(
        name="elastic-exp",
        image="local",
        trainer_args=cfg.trainer_args(),
        gpus_per_node=0,
        efa_per_node=0,
        nproc_per_node=1,
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        auto_resume=False,
        env=cfg.trainer_env(),
    )
    container = render_job(spec)["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    endpoint = f"localhost:{RDZV_PORT}"  # <job>-worker-0:23456 on the cluster
    command = [endpoint if part == "--rdzv-endpoint=$(PET_RDZV_ENDPOINT)" else part for part in container["command"]]
    command = [f"--rdzv-endpoint={endpoint}" if part == endpoint else part for part in command]
    assert command[0] == "torchrun"
    command = [sys.executable, "-m", "torch.distributed.run", *command[1:]]
    if worker == "minimal":
        script = workdir / "minimal_worker.py"
        script.write_text(MINIMAL_WORKER)
        cut = command.index("-m", 3)
        command = [*command[:cut], str(script)]
    env = {e["name"]: e["value"] for e in container["env"]}
    if not with_fix:
        env.pop(RDZV_STORE_OPT_OUT, None)
    env |= {
        "PET_NPROC_PER_NODE": "1",
        "PET_NNODES": f"{min_nodes}:{max_nodes}",
        "PET_RDZV_ENDPOINT": endpoint,
        "PET_RDZV_BACKEND": "c10d",
        "PET_MAX_RESTARTS": str(spec.max_restarts),
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": "1",
    }
    return command, env


def start_agent(name: str, command: list[str], env: dict[str, str], workdir: Path) -> Agent:
    path = workdir / f"{name}.log"
    out = path.open("w")
    proc = subprocess.Popen(
        command, env={**os.environ, **env}, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True
    )
    log.info("started %s (pid %d)", name, proc.pid)
    return Agent(name, proc, path)


def store_is_up() -> bool:
    with socket.socket() as probe:
        probe.settimeout(1)
        return probe.connect_ex(("localhost", RDZV_PORT)) == 0


def trained_step(run_dir: Path, worker: str, agents: list[Agent]) -> tuple[int, int]:
    """(last step logged, world size) of the training as it is now."""
    if worker == "minimal":
        found = [re.search(r"world (\d+) step (\d+)", line) for line in agents[0].lines()]  # the first in play
        found = [m for m in found if m]
        return (int(found[-1].group(2)), int(found[-1].group(1))) if found else (-1, 0)
    try:
        rows = (run_dir / "metrics.jsonl").read_text().splitlines()
        status = json.loads((run_dir / "status.json").read_text())
        return (json.loads(rows[-1])["step"] if rows else -1), int(status.get("world_size", 0))
    except (OSError, ValueError, KeyError):
        return -1, 0


def wait_for(condition, timeout_s: float, agents: list[Agent], what: str) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        if all(a.proc.poll() is not None for a in agents):
            log.info("every agent exited while waiting for %s", what)
            return False
        time.sleep(1)
    log.info("%s: not within %.0fs", what, timeout_s)
    return False


def lose_node(agent: Agent) -> None:
    """SIGKILL the agent and every process under it, as a node that goes away: torchrun starts each worker in a
    session of its own, so the agent's process group alone would leave them running."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            pid, ppid = stat.parent.name, stat.read_text().rsplit(")", 1)[1].split()[1]
        except (OSError, IndexError):
            continue
        children.setdefault(int(ppid), []).append(int(pid))
    doomed, queue = [], [agent.proc.pid]
    while queue:
        pid = queue.pop()
        doomed.append(pid)
        queue += children.get(pid, [])
    for pid in doomed:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    agent.proc.wait()


def stop(agents: list[Agent]) -> None:
    for agent in agents:
        if agent.proc.poll() is None:
            os.killpg(agent.proc.pid, signal.SIGTERM)
    for agent in agents:
        try:
            agent.proc.wait(timeout=150)
        except subprocess.TimeoutExpired:
            os.killpg(agent.proc.pid, signal.SIGKILL)
            agent.proc.wait()


def scenario(kind: str, worker: str, root: Path, workdir: Path, settle_s: float, with_fix: bool) -> str:
    run_id = f"{kind}-{worker}" + ("" if with_fix else "-torch-default")
    cfg = LaunchConfig.of(
        storage_root=str(root),
        dataset="email",
        run_id=run_id,
        nproc_per_node=1,
        preset="tiny",
        max_steps=100000,
        batch_size=8,
        seq_len=64,
        lr=3e-3,
        warmup_steps=5,
        checkpoint_every=25,
        log_every=5,
    )
    run_dir = cfg.run_paths.root
    command, env = job_command(cfg, 1, 2, worker, workdir, with_fix)
    log.info("[%s] the agents' command: %s", run_id, " ".join(command))
    log.info("[%s] TORCH_DISABLE_SHARE_RDZV_TCP_STORE=%s", run_id, env.get(RDZV_STORE_OPT_OUT, "-"))
    agents = [start_agent(f"{run_id}-agent-0", command, env, workdir)]
    # Agent 0 holds the rendezvous store, as worker-0 does on the cluster (the endpoint names its Service).
    if not wait_for(lambda: store_is_up(), 60, agents, "agent 0's rendezvous store"):
        stop(agents)
        return f"{run_id}: agent 0 never opened the rendezvous store"
    if kind != "join":
        agents.append(start_agent(f"{run_id}-agent-1", command, env, workdir))
    want_world = 1 if kind == "join" else 2

    def training_at(world: int, step: int) -> bool:
        now_step, now_world = trained_step(run_dir, worker, agents)
        return now_world == world and now_step >= step

    if not wait_for(lambda: training_at(want_world, 20), 240, agents, f"training at world size {want_world}"):
        stop(agents)
        return f"{run_id}: never trained at world size {want_world}"
    step_before = trained_step(run_dir, worker, agents)[0]
    if kind == "join":
        log.info("[%s] training at step %d with one agent: a second agent arrives", run_id, step_before)
        agents.append(start_agent(f"{run_id}-agent-1", command, env, workdir))
        target = 2
    else:
        lost = 0 if kind == "leave-store" else 1
        log.info(
            "[%s] training at step %d with two agents: agent %d and its worker are SIGKILLed", run_id, step_before, lost
        )
        lose_node(agents[lost])
        agents = [agents[1 - lost], agents[lost]]
        target = 1
    ok = wait_for(lambda: training_at(target, step_before + 20), settle_s, agents[:1], f"training at {target}")
    step_after, world_after = trained_step(run_dir, worker, agents)
    codes = [a.proc.poll() for a in agents]
    stop(agents)
    verdict = "carried on" if ok else "did not carry on"
    return (
        f"{run_id}: {verdict} at world size {target} (step {step_before} before, {step_after} after at "
        f"world size {world_after}; agents' exit codes while it ran: {codes})"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", choices=("join", "leave", "leave-store"), action="append")
    parser.add_argument("--worker", choices=("trainer", "minimal"), action="append")
    parser.add_argument("--workdir", type=Path, help="where logs and the staged corpus go (default: a temp dir)")
    parser.add_argument("--settle-s", type=float, default=240, help="how long the job may take to carry on")
    parser.add_argument(
        "--torch-default",
        action="store_true",
        help="drop TORCH_DISABLE_SHARE_RDZV_TCP_STORE from the job's environment (torch's default)",
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="elastic-"))
    workdir.mkdir(parents=True, exist_ok=True)
    root = workdir / "fsx"
    if not (root / "datasets").exists():
        stage_data(default_corpus(), str(root), "email", vocab_size=512, val_fraction=0.1)
    import torch

    log.info("torch %s; logs in %s", torch.__version__, workdir)
    verdicts = []
    for kind in args.scenario or ["join", "leave", "leave-store"]:
        for worker in args.worker or ["minimal", "trainer"]:
            verdicts.append(scenario(kind, worker, root, workdir, args.settle_s, not args.torch_default))
            variant = "-torch-default" if args.torch_default else ""
            for path in sorted(workdir.glob(f"{kind}-{worker}{variant}-agent-*.log")):
                print(f"--- {path.name}: the lines that decide")
                for line in path.read_text(errors="replace").splitlines():
                    if TELLING.search(line):
                        print(f"    {line[:220]}")
    print("\n".join(["", "verdicts:", *verdicts]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
