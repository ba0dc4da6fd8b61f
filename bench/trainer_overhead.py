"""Measure the trainer's throughput overhead: trainer/train_ddp.py against a minimal DDP loop, side by side.

Everything train_ddp.py does beyond the math (the per-step stop-signal agreement, a metrics row and log line
per step, status and config files, the data-position bookkeeping) costs time; bench/minimal_ddp.py does the
same math on the same model, data and batch with none of it. In one invocation this script stages a corpus
once (the standard library's email package, as run-local does), then runs, per repeat and in alternating
order, the real trainer and the minimal loop under torchrun (gloo on CPU, the local launcher's command line
and environment). Both are measured over the same steps [warmup, steps): the trainer from the "time" and
"tokens" of its metrics.jsonl rows at those steps (logged every step; its one checkpoint is written after the
last row, outside the window), the minimal loop by its own clock. It prints one table: tokens/s of each and
their ratio per repeat, the same ratio from median step times (less moved by a burst of other work), the CPUs
other processes kept busy meanwhile, and the medians with their spread. The trainer logs every 10 steps, its
default, so most of its steps are the ones without a host synchronisation.

Each repeat also runs the trainer with a read latency injected before every batch (--fault-read-latency-s: a
cold file system), half a step's time (the median step of the first repeat's trainer run, unless given): with the
input read ahead in the background (trainer/prefetch.py) its tokens/s should stay within 5% of the run without.
It is a measurement, not a test: it never asserts on times. On a small shared machine runs vary by several
percent: use enough repeats to resolve a 5% target.

    .venv/bin/python bench/trainer_overhead.py [--steps 120] [--warmup 20] [--repeats 8] [--write-results]
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import os
import re
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from machine import RESULTS, append_section, machine_lines

log = logging.getLogger("bench-trainer-overhead")

REPO = Path(__file__).resolve().parent.parent
MINIMAL = Path(__file__).resolve().parent / "minimal_ddp.py"

# The corpus and tokenizer run-local stages by default (see bench_run_local.py), and the batch of the
# trainer's defaults, given explicitly to both sides.
DATASET = "stdlib-email"
INCLUDE = ("*.py",)
VOCAB_SIZE = 2048
BATCH_SIZE = 8
SEQ_LEN = 128
TARGET = 0.95  # the target for trainer tokens/s over minimal-loop tokens/s, and with latency over without
LOG_EVERY = 10  # the trainer's default; the timed window's ends are logged steps
# The last loss of both sides must agree this closely (relative), or they did not do the same math.
LOSS_RTOL = 1e-3
TAIL_LINES = 40
RUN_TIMEOUT_S = 3600
BUSY_ELSEWHERE = 0.1  # CPUs kept busy by other processes, above which the caption warns of noise


class CpuMeter:
    """CPUs kept busy by other processes while a run lasts: all CPU time (/proc/stat) less this process's and
    its waited-for children's (torchrun and its workers), over the wall time. None where /proc is missing."""

    def __init__(self) -> None:
        self.start = self._sample()

    @staticmethod
    def _sample() -> tuple[float, float, float] | None:
        try:
            fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
        except (OSError, ValueError):
            return None
        user, nice, system, _idle, _iowait, irq, softirq, steal = fields
        busy = (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")
        ours = sum(
            u.ru_utime + u.ru_stime for u in map(resource.getrusage, (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
        )
        return busy, ours, time.monotonic()

    def elsewhere(self) -> float | None:
        end = self._sample()
        if self.start is None or end is None:
            return None
        busy, ours, wall = (b - a for a, b in zip(self.start, end, strict=True))
        return max(0.0, busy - ours) / max(wall, 1e-9)


class BenchFailed(Exception):
    """A benchmarked run failed or its output could not be read; carries the output's tail."""


@dataclass
class Side:
    """One run of one side over the timed window."""

    tokens: int
    seconds: float
    final_loss: float
    median_step_s: float  # the median wall time of one timed step: less sensitive to other processes
    busy_elsewhere: float | None  # CPUs other processes kept busy during the run, on average

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


@dataclass
class Pair:
    """One repeat of the trainer and its minimal loop (bench/fsdp.py measures such pairs too)."""

    first: str  # "trainer" or "minimal"
    trainer: Side
    minimal: Side

    @property
    def ratio(self) -> float:
        return self.trainer.tokens_per_s / self.minimal.tokens_per_s

    @property
    def median_ratio(self) -> float:
        """The ratio from median step times (the same tokens per step on both sides)."""
        return self.minimal.median_step_s / self.trainer.median_step_s

    @property
    def busy_elsewhere(self) -> float | None:
        both = [s.busy_elsewhere for s in (self.trainer, self.minimal) if s.busy_elsewhere is not None]
        return max(both) if both else None


@dataclass
class Repeat(Pair):
    delayed: Side  # the trainer with a read latency injected before every batch

    @property
    def latency_ratio(self) -> float:
        """Tokens/s with the injected read latency over without: 1 when the input is fully off the critical path."""
        return self.delayed.tokens_per_s / self.trainer.tokens_per_s


def timing_parser(description: str) -> argparse.ArgumentParser:
    """The options of a benchmark that times the trainer against a minimal loop (bench/fsdp.py's too)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--preset", default="small", help="model preset (see trainer.model.PRESETS)")
    p.add_argument("--steps", type=int, default=120, help="optimizer steps per run (the trainer's --max-steps)")
    p.add_argument("--warmup", type=int, default=20, help="untimed steps at the start of each run")
    p.add_argument("--repeats", type=int, default=8, help="run every side this many times; report medians")
    p.add_argument("--nproc", type=int, default=2, help="processes per run (torchrun --nproc-per-node)")
    p.add_argument("--keep", action="store_true", help="keep the temporary storage root instead of removing it")
    p.add_argument("--write-results", action="store_true", help=f"append a dated section to {RESULTS.name}")
    return p


def parse_timing(p: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Parse, and refuse a timed window whose ends are not logged steps."""
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    if args.nproc < 1:
        p.error("--nproc must be at least 1")
    if not 1 <= args.warmup < args.steps or args.warmup % LOG_EVERY or args.steps % LOG_EVERY:
        p.error(f"--warmup and --steps must be multiples of {LOG_EVERY} (logged steps), warmup below steps")
    return args


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = timing_parser(__doc__.split("\n\n")[0])
    p.add_argument(
        "--read-latency-s",
        type=float,
        default=0.0,
        help="latency injected before each batch's read (default: half the first trainer run's step)",
    )
    return parse_timing(p, argv)


def tail(output: str, lines: int = TAIL_LINES) -> str:
    return "\n".join(output.splitlines()[-lines:])


def stage(root: Path) -> Path:
    """Stage and tokenize the corpus once; both sides of every repeat read it."""
    from components.stage_data.core import stage_data
    from pipelines.local_run import default_corpus

    result = stage_data(default_corpus(), str(root), DATASET, vocab_size=VOCAB_SIZE, include=INCLUDE)
    log.info("staged %d files: %d train tokens in %.1fs", result.files, result.train_tokens, result.seconds)
    return Path(result.tokenized_dir)


def torchrun(entry: list[str], log_dir: Path, nproc: int) -> tuple[str, float | None]:
    """One torchrun to completion, with the local launcher's command line and environment; its output.

    As components/launch_training/local_backend.py: --standalone, --tee=3 into a log directory,
    OMP_NUM_THREADS = cpu_count // nproc, PYTHONUNBUFFERED=1. A failure raises with the output's tail.
    Also returns the CPUs that other processes kept busy meanwhile (see CpuMeter).
    """
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nnodes=1",
        f"--nproc-per-node={nproc}",
        "--tee=3",
        f"--log-dir={log_dir}",
        *entry,
    ]
    threads = max(1, (os.cpu_count() or 1) // nproc)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
    log.info("running %s", " ".join(command[1:]))
    started, meter = time.perf_counter(), CpuMeter()
    # Its own process group, so that a stuck run can be killed with all its workers.
    proc = subprocess.Popen(
        command,
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        start_new_session=True,
    )
    lines: collections.deque[str] = collections.deque(maxlen=2000)
    timed_out: list[bool] = []

    def kill() -> None:
        timed_out.append(True)
        _kill_group(proc)

    timer = threading.Timer(RUN_TIMEOUT_S, kill)
    timer.daemon = True
    timer.start()
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
        code = proc.wait()
    finally:
        timer.cancel()
        if proc.poll() is None:
            _kill_group(proc)
            proc.wait()
    output = "\n".join(lines)
    if timed_out:
        raise BenchFailed(f"{' '.join(command)} ran past {RUN_TIMEOUT_S}s and was killed\n{tail(output)}")
    if code != 0:
        raise BenchFailed(f"{' '.join(command)} exited {code}\n{tail(output)}")
    busy = meter.elsewhere()
    log.info(
        "  done in %.1fs%s", time.perf_counter() - started, "" if busy is None else f", {busy:.2f} CPUs busy elsewhere"
    )
    return output, busy


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def trainer_rows(
    root: Path, data_dir: Path, name: str, args: argparse.Namespace, steps: int, log_every: int, flags: list[str]
) -> tuple[dict[int, dict], float | None]:
    """The real trainer in a fresh run directory `name`, with the benchmark's model and batch, a metrics row every
    `log_every` steps and one checkpoint at the very end, and `flags`: its rows by step, once it finished all `steps`,
    and the CPUs busy elsewhere meanwhile."""
    from trainer.layout import RunPaths

    run = RunPaths.of(root, name)
    if run.root.exists():
        raise BenchFailed(f"{run.root} exists (training would resume from it)")
    _, busy = torchrun(
        ["-m", "trainer.train_ddp", "--data-dir", str(data_dir), "--run-dir", str(run.root)]
        + ["--preset", args.preset, "--batch-size", str(BATCH_SIZE), "--seq-len", str(SEQ_LEN)]
        + ["--max-steps", str(steps), "--log-every", str(log_every), "--checkpoint-every", str(steps), *flags],
        run.logs / "torchrun",
        args.nproc,
    )
    try:
        status = json.loads(run.status.read_text())
        rows = {row["step"]: row for row in map(json.loads, filter(str.strip, run.metrics.read_text().splitlines()))}
    except (OSError, ValueError, KeyError) as exc:
        raise BenchFailed(f"cannot read the trainer's records in {run.root}: {exc!r}") from None
    if status.get("state") != "done" or status.get("step") != steps:
        raise BenchFailed(f"the trainer did not finish its {steps} steps: status {status}")
    return rows, busy


def run_trainer(
    root: Path, data_dir: Path, n: int, args: argparse.Namespace, read_latency_s: float = 0.0, parallelism: str = "ddp"
) -> Side:
    """The trainer over the timed window, a metrics row every LOG_EVERY steps; with `read_latency_s`, that much
    injected before every batch's read."""
    name = f"trainer-{n}{'-delayed' if read_latency_s else ''}{'' if parallelism == 'ddp' else '-' + parallelism}"
    flags = ["--fault-read-latency-s", str(read_latency_s), "--parallelism", parallelism]
    rows, busy = trainer_rows(root, data_dir, name, args, args.steps, LOG_EVERY, flags)
    try:
        first, last = rows[args.warmup], rows[args.steps]
        step_seconds = [rows[step]["step_time_s"] for step in range(args.warmup + LOG_EVERY, args.steps + 1, LOG_EVERY)]
    except KeyError as exc:
        raise BenchFailed(f"the trainer's run {name} has no metrics row for step {exc}") from None
    tokens, seconds = last["tokens"] - first["tokens"], last["time"] - first["time"]
    side = Side(tokens, seconds, last["loss"], statistics.median(step_seconds), busy)
    log.info(
        "  train_ddp.py --parallelism %s%s: %.0f tokens/s over steps %d-%d",
        parallelism,
        f" (read latency {read_latency_s:.3f}s)" if read_latency_s else "",
        side.tokens_per_s,
        args.warmup,
        args.steps,
    )
    return side


RESULT_LINE = re.compile(r"(\{.*\})\s*$")


def result_line(output: str, key: str) -> dict:
    """The one JSON line holding `key` that a torchrun entry printed (torchrun's --tee prefixes each line)."""
    found = [m[1] for line in output.splitlines() if (m := RESULT_LINE.search(line)) and f'"{key}"' in m[1]]
    if len(found) != 1:
        raise BenchFailed(f"expected one result line with {key!r}, found {len(found)}\n{tail(output)}")
    return json.loads(found[0])


def run_minimal(root: Path, data_dir: Path, n: int, args: argparse.Namespace, script: Path = MINIMAL) -> Side:
    """A minimal loop (`script`) over the same steps, timed by its own clock."""
    output, busy = torchrun(
        [str(script), "--data-dir", str(data_dir), "--preset", args.preset]
        + ["--batch-size", str(BATCH_SIZE), "--seq-len", str(SEQ_LEN)]
        + ["--max-steps", str(args.steps), "--warmup", str(args.warmup)],
        root / script.stem / f"{script.stem}-{n}",
        args.nproc,
    )
    result = result_line(output, "tokens_per_s")
    side = Side(result["tokens"], result["seconds"], result["final_loss"], result["median_step_s"], busy)
    log.info("  %s: %.0f tokens/s over steps %d-%d", script.name, side.tokens_per_s, args.warmup, args.steps)
    return side


def check_same_work(trainer: Side, minimal: Side) -> None:
    """Fail unless both sides trained on as many tokens and ended at the same loss; else the ratio would mislead."""
    if trainer.tokens != minimal.tokens:
        raise BenchFailed(f"the sides timed different work: {trainer.tokens} tokens vs {minimal.tokens}")
    if abs(trainer.final_loss - minimal.final_loss) > LOSS_RTOL * abs(minimal.final_loss):
        raise BenchFailed(
            f"the sides did different math: last loss {trainer.final_loss:.6f} (train_ddp.py) vs "
            f"{minimal.final_loss:.6f} (minimal loop)"
        )
    log.info("  same work on both sides: last loss %.5f / %.5f", trainer.final_loss, minimal.final_loss)


def measure_once(root: Path, data_dir: Path, n: int, args: argparse.Namespace) -> Repeat:
    """One repeat of every side; the order is reversed every other repeat so drift on a shared box evens out."""
    log.info("repeat %d/%d", n + 1, args.repeats)
    if n % 2 == 0:
        trainer = run_trainer(root, data_dir, n, args)
        if not args.read_latency_s:  # half a step, from the first run
            args.read_latency_s = round(trainer.median_step_s / 2, 4)
        delayed = run_trainer(root, data_dir, n, args, args.read_latency_s)
        minimal = run_minimal(root, data_dir, n, args)
    else:
        minimal = run_minimal(root, data_dir, n, args)
        delayed = run_trainer(root, data_dir, n, args, args.read_latency_s)
        trainer = run_trainer(root, data_dir, n, args)
    check_same_work(trainer, minimal)
    check_same_work(delayed, minimal)
    repeat = Repeat("trainer" if n % 2 == 0 else "minimal", trainer, minimal, delayed)
    log.info(
        "  ratio %.3f (from median step times %.3f); with read latency / without %.3f",
        repeat.ratio,
        repeat.median_ratio,
        repeat.latency_ratio,
    )
    return repeat


def table(repeats: list[Repeat]) -> str:
    lines = [
        "| repeat | first | train_ddp.py (tokens/s) | minimal loop (tokens/s) | train_ddp.py / minimal "
        "| same, from median step times | trainer, read latency (tokens/s) | latency / none "
        "| CPUs busy elsewhere |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n, r in enumerate(repeats, 1):
        lines.append(
            f"| {n} | {r.first} | {r.trainer.tokens_per_s:.0f} | {r.minimal.tokens_per_s:.0f} | {r.ratio:.3f} "
            f"| {r.median_ratio:.3f} | {r.delayed.tokens_per_s:.0f} | {r.latency_ratio:.3f} "
            f"| {cpus(r.busy_elsewhere)} |"
        )
    columns = [
        [r.trainer.tokens_per_s for r in repeats],
        [r.minimal.tokens_per_s for r in repeats],
        [r.ratio for r in repeats],
        [r.median_ratio for r in repeats],
        [r.delayed.tokens_per_s for r in repeats],
        [r.latency_ratio for r in repeats],
    ]
    formats = ["{:.0f}", "{:.0f}", "{:.3f}", "{:.3f}", "{:.0f}", "{:.3f}"]
    return "\n".join(lines + summary_rows(columns, formats))


def summary_rows(columns: list[list[float]], formats: list[str]) -> list[str]:
    """The last rows of a table of repeats (| repeat | first | columns... | CPUs |): each column's median, then its
    spread (min-max)."""
    medians = [f.format(statistics.median(c)) for f, c in zip(formats, columns, strict=True)]
    spreads = [f"{f.format(min(c))}-{f.format(max(c))}" for f, c in zip(formats, columns, strict=True)]
    return [f"| median | | {' | '.join(medians)} | |", f"| spread (min-max) | | {' | '.join(spreads)} | |"]


def cpus(value: float | None) -> str:
    return "unknown" if value is None else f"{value:.2f}"


def noise_note(pairs: list[Pair]) -> str:
    """A caption's warning when other processes kept the CPUs busy during the runs; empty when they did not."""
    busy = [r.busy_elsewhere for r in pairs if r.busy_elsewhere is not None]
    if not busy or max(busy) <= BUSY_ELSEWHERE:
        return ""
    return (
        f" Other processes shared the CPUs during the measurement (up to {max(busy):.2f} of {os.cpu_count()} CPUs "
        "busy outside the benchmark): the absolute figures are noisy, and so is each ratio, though its two runs "
        "were made back to back."
    )


def caption(repeats: list[Repeat], args: argparse.Namespace) -> str:
    ratio = statistics.median(r.ratio for r in repeats)
    median_ratio = statistics.median(r.median_ratio for r in repeats)
    latency_ratio = statistics.median(r.latency_ratio for r in repeats)
    verdict = "met" if ratio >= TARGET else "not met"
    latency_verdict = "met" if latency_ratio >= TARGET else "not met"
    threads = max(1, (os.cpu_count() or 1) // args.nproc)
    noise = noise_note(repeats)
    return (
        f"Trainer overhead (`bench/trainer_overhead.py`): tokens/s of `trainer/train_ddp.py` against "
        f"`bench/minimal_ddp.py`, a plain DDP loop doing the same math (same model, initial weights, data order, "
        f"AdamW, schedule, clipping; checked by both ending at the same loss). Preset {args.preset}, batch "
        f"{BATCH_SIZE} x {SEQ_LEN} tokens per rank, {args.nproc} processes under torchrun as the local launcher "
        f"starts them (gloo, CPU, OMP_NUM_THREADS={threads}, --tee=3); {args.steps} steps, of which steps "
        f"{args.warmup}-{args.steps} are timed: the trainer's from the time and tokens of its metrics.jsonl rows "
        f"(it logs a row every {LOG_EVERY} steps, its default, and checkpoints once, after the window), the minimal "
        f"loop's by its own clock. "
        f"{args.repeats} repeat(s), the order of the runs reversed every other repeat; medians of ratios are of "
        f"per-repeat ratios, with their spread (min-max) in the last row. "
        f"The second ratio compares the two sides' median step times (the trainer's step_time_s rows, the minimal "
        f"loop's per-step clock), which a burst of other work moves less. CPUs busy elsewhere: the most, of the "
        f"repeat's two runs, that other processes kept busy on average (/proc/stat less the benchmark's own CPU "
        f"time). Target: tokens/s ratio >= {TARGET}; median {ratio:.3f}, {verdict} (from median step times: "
        f"{median_ratio:.3f}). Read latency: the trainer again with {args.read_latency_s:.3f}s injected before every "
        f"batch's read (--fault-read-latency-s; half the median step time of the first trainer run, a cold file "
        f"system), against the trainer without: median {latency_ratio:.3f}, target >= {TARGET}, {latency_verdict}."
        f"{noise} Rerun with `.venv/bin/python bench/trainer_overhead.py --write-results` "
        f"(a smoke run: `--steps 30 --warmup 5 --repeats 1`)."
    )


def loadavg() -> tuple[float, float, float] | None:
    return os.getloadavg() if hasattr(os, "getloadavg") else None


def write_results(title: str, body: list[str], load_before: tuple[float, float, float] | None) -> None:
    """Append a dated section to RESULTS.md: `body`, then the machine and its load before the first run and now."""

    def loads(x: tuple[float, float, float] | None) -> str:
        return " ".join(f"{v:.2f}" for v in x) if x else "unknown"

    machine = machine_lines("torch", "transformers")
    machine.append(f"load average before the first run: {loads(load_before)}; at the end: {loads(loadavg())}")
    append_section(title, body, machine)
    log.info("appended results to %s", RESULTS)


def run_bench(name: str, title: str, args: argparse.Namespace, measure: Callable[[Path, Path], list[str]]) -> int:
    """Stage the corpus in a temporary root under /work (kept with --keep), run `measure(root, data_dir)`, which
    returns the section's text, print it and, with --write-results, append it to RESULTS.md as `title`. 1 when a run
    failed or did other work than its baseline (BenchFailed)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    sys.path.insert(0, str(REPO))
    root = Path(tempfile.mkdtemp(prefix=f"bench-{name.replace('_', '-')}-", dir="/work")).resolve()
    log.info("storage root %s", root)
    try:
        data_dir = stage(root)
        load_before = loadavg()
        body = measure(root, data_dir)
    except BenchFailed as exc:
        print(f"{name}: failed: {exc}", file=sys.stderr)
        return 1
    finally:
        if args.keep:
            log.info("kept %s", root)
        else:
            shutil.rmtree(root, ignore_errors=True)
    if args.write_results:
        write_results(title, body, load_before)
    print("\n".join(body))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    def measure(root: Path, data_dir: Path) -> list[str]:
        repeats = [measure_once(root, data_dir, n, args) for n in range(args.repeats)]
        return [caption(repeats, args), "", table(repeats)]

    return run_bench("trainer_overhead", "trainer overhead", args, measure)


if __name__ == "__main__":
    sys.exit(main())
