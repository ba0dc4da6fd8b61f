"""The HyperPod elastic agent's cost: a 2-worker run of the trainer under `hyperpodrun` (the HyperPodPyTorchJob's
rendered container command, started by the operator's player over HTTP: tests/cluster/hyperpod_agents.py) against
the same run under plain torchrun, side by side, both in .venv-hyperpod (the stack of that job API's image, so the
torch is the same).

Per repeat, in alternating order, each launcher runs the tiny preset on the staged corpus, a metrics row every step,
no checkpoint until the end. Two figures each:
- start-up: from the launcher's process starting to the trainer's first metrics row (for hyperpodrun this includes its
  HTTP server coming up and the operator's /start, which the player sends the moment the agent reads READY);
- tokens/s: the median of the trainer's per-step tokens/s over the steps after the warm-up (the agent's log agent
  reads local rank 0's output meanwhile, with the job's rendered rules).
It prints both side by side with their ratios (hyperpodrun / torchrun) per repeat and their medians. It is a
measurement, not a test: it never asserts on times.

    make .venv-hyperpod/installed && .venv/bin/python bench/hyperpodrun.py [--repeats 3] [--steps 60] [--write-results]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.machine import append_section, machine_lines  # noqa: E402
from components.launch_training.hyperpodpytorchjob import HYPERPODPYTORCHJOB  # noqa: E402
from components.launch_training.platform import Platform  # noqa: E402
from components.stage_data.core import stage_data  # noqa: E402
from tests.cluster.hyperpod_agents import AgentOperator, NodeAgent  # noqa: E402
from tests.helpers import tiny_launch, write_corpus  # noqa: E402

HYPERPOD_BIN = REPO / ".venv-hyperpod" / "bin"


def hyperpod_versions() -> str:
    """The versions the runs used: .venv-hyperpod's, not this interpreter's."""
    code = (
        "import importlib.metadata as m, platform; "
        "print(f\"python {platform.python_version()}, torch {m.version('torch')}, "
        "hyperpod-elastic-agent {m.version('hyperpod-elastic-agent')}\")"
    )
    answer = subprocess.run(
        [str(HYPERPOD_BIN / "python"), "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    return answer.stdout.strip()


def first_row_s(metrics: Path, started: float, process: subprocess.Popen, timeout_s: float = 300) -> float:
    """Seconds from `started` to the first metrics row."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if metrics.exists() and metrics.read_text().strip():
            return time.monotonic() - started
        if process.poll() is not None:
            raise RuntimeError(f"the launcher exited with {process.returncode} before the first step")
        time.sleep(0.02)
    raise RuntimeError("no first step")


def tokens_per_s(metrics: Path, warmup: int) -> float:
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    return statistics.median(r["tokens_per_s"] for r in rows if r["step"] > warmup)


def under_torchrun(root: Path, run_id: str, steps: int, warmup: int) -> tuple[float, float]:
    cfg = tiny_launch(root, run_id, max_steps=steps, log_every=1, checkpoint_every=steps)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    command = [str(HYPERPOD_BIN / "torchrun"), "--standalone", "--nproc-per-node=2", "-m", "trainer.train_ddp"]
    started = time.monotonic()
    process = subprocess.Popen(
        command + cfg.trainer_args(), cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    startup = first_row_s(cfg.run_paths.metrics, started, process)
    if process.wait(timeout=600) != 0:
        raise RuntimeError(f"torchrun exited with {process.returncode}")
    return startup, tokens_per_s(cfg.run_paths.metrics, warmup)


def under_hyperpodrun(root: Path, run_id: str, steps: int, warmup: int, workdir: Path) -> tuple[float, float]:
    cfg = tiny_launch(
        root,
        run_id,
        max_steps=steps,
        log_every=1,
        checkpoint_every=steps,
        backend="kubernetes",
        image="img:1",
        nnodes=1,
        job_options={"expected_step_ms": 1000},
        platform=Platform(job_api="hyperpodpytorchjob"),
    )
    job = HYPERPODPYTORCHJOB.render(cfg.job_spec())
    container = job["spec"]["replicaSpecs"][0]["template"]["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    started = time.monotonic()
    pod = NodeAgent(container["command"], env, workdir / run_id, HYPERPOD_BIN, REPO)
    operator = AgentOperator(job, [pod])
    try:
        startup = first_row_s(cfg.run_paths.metrics, started, pod.process)
        outcome = operator.wait(600)
        if outcome != "completed":
            raise RuntimeError(f"hyperpodrun: {outcome}: {pod.tail()}")
    finally:
        operator.stop()
        pod.kill()
    return startup, tokens_per_s(cfg.run_paths.metrics, warmup)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--write-results", action="store_true")
    args = parser.parse_args()
    if not (REPO / ".venv-hyperpod" / "installed").exists():
        print("bench/hyperpodrun.py: .venv-hyperpod is not built: make .venv-hyperpod/installed", file=sys.stderr)
        return 2
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-hyperpodrun-") as tmp:
        root = Path(tmp) / "fsx"
        stage_data(str(write_corpus(Path(tmp) / "corpus")), str(root), "synthetic", vocab_size=512, val_fraction=0.1)
        for repeat in range(args.repeats):
            runs = {}
            order = ("torchrun", "hyperpodrun") if repeat % 2 == 0 else ("hyperpodrun", "torchrun")
            for launcher in order:
                run_id = f"{launcher}-{repeat}"
                if launcher == "torchrun":
                    runs[launcher] = under_torchrun(root, run_id, args.steps, args.warmup)
                else:
                    runs[launcher] = under_hyperpodrun(root, run_id, args.steps, args.warmup, Path(tmp))
            (t_start, t_tps), (h_start, h_tps) = runs["torchrun"], runs["hyperpodrun"]
            rows.append((repeat + 1, t_start, h_start, h_start / t_start, t_tps, h_tps, h_tps / t_tps))
            print(f"repeat {repeat + 1}: {rows[-1]}", file=sys.stderr)
    table = [
        "| repeat | start-up torchrun (s) | start-up hyperpodrun (s) | ratio | tokens/s torchrun | tokens/s "
        "hyperpodrun | ratio |",
        "| --- | --- | --- | --- | --- | --- | --- |",
        *(f"| {r[0]} | {r[1]:.2f} | {r[2]:.2f} | {r[3]:.2f} | {r[4]:.0f} | {r[5]:.0f} | {r[6]:.3f} |" for r in rows),
        f"| median | {statistics.median(r[1] for r in rows):.2f} | {statistics.median(r[2] for r in rows):.2f} | "
        f"{statistics.median(r[3] for r in rows):.2f} | {statistics.median(r[4] for r in rows):.0f} | "
        f"{statistics.median(r[5] for r in rows):.0f} | {statistics.median(r[6] for r in rows):.3f} |",
    ]
    print("\n".join(table))
    if args.write_results:
        body = [
            f"`bench/hyperpodrun.py --repeats {args.repeats} --steps {args.steps} --warmup {args.warmup}`: the tiny "
            "preset, 2 CPU workers, one node, in .venv-hyperpod; start-up = launcher start to the first metrics row; "
            f"tokens/s = median per-step figure after step {args.warmup}; ratio = hyperpodrun / torchrun.",
            "",
            *table,
        ]
        machine = [*machine_lines(), f".venv-hyperpod: {hyperpod_versions()}"]
        append_section("hyperpodrun against torchrun: start-up and tokens/s", body, machine)
    return 0


if __name__ == "__main__":
    sys.exit(main())
