"""Time the trainer's checkpoint save against a plain torch.save of the same state, and the stall of an async save.

The state is what trainer/train_ddp.py saves for a preset (gpt2-124m by default, with a GPT-2 vocabulary of
50304 and 1024-token sequences): the model's and an AdamW optimizer's state dicts after one optimizer step,
so that every exp_avg and exp_avg_sq exists, plus the schedule, progress, data position, RNG states, step
and model config. In one invocation it times, side by side in one directory:

    plain         torch.save(state, path)
    plain+fsync   the same, then an fsync of the file: what durability itself costs
    trainer       CheckpointManager(dir, keep=2).save(state, step, blocking=True): temp name, torch.save with
                  early writeback, fsync, rename, hard link of checkpoint_latest.pt, index.json
    async         the training stall of an asynchronous save: a training step (forward/backward of the real
                  model, optimizer step) that begins with CheckpointManager(dir, keep=2, async_save=True)
                  .save(state, step, blocking=False) and waits in wait_until_staged() before its optimizer
                  step, as train_ddp's does, against the median of the training steps just before it
                  without a save; the background copy overlaps the forward/backward pass. After a first async
                  save, so the CPU buffers exist. Informative: how much slower the next steps are while the
                  writer thread serialises the file (on a CPU-only machine it competes with training for the
                  cores), and the wait() for the write to commit

Every timed call is preceded by os.sync(), so no earlier write's dirty pages are flushed while it runs;
the order of the variants is reversed on every other repeat; each variant's files are deleted after it is
timed. It reports medians over repeats and the medians of the per-repeat ratios. It is a measurement, not
a test: it never asserts on times.

    .venv/bin/python bench/checkpoint.py [--preset gpt2-124m] [--repeats 3] [--dir DIR] [--write-results]
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from machine import RESULTS, append_section, machine_lines

from trainer.checkpoint import LATEST, SCHEMA, CheckpointManager, rng_state
from trainer.config import TrainConfig
from trainer.data import DataPosition
from trainer.model import build_model, model_config
from trainer.schedule import LRSchedule, ScheduleSettings
from trainer.train_ddp import Progress

log = logging.getLogger("bench-checkpoint")

REPO = Path(__file__).resolve().parent.parent
# The CLI's default storage root (gitignored): where run-local writes its checkpoints.
DEFAULT_PARENT = REPO / "local-runs"

VOCAB_SIZE = 50304  # GPT-2's 50257 rounded up to a multiple of 64, as GPT-2 reproductions train with
EOS_ID = 50256
SEQ_LEN = 1024
STEP_TOKENS = 128  # each training step is one sequence this long: on 2 CPU cores, about a second of forward/backward
PLAIN_STEPS = 3  # training steps without a save before each save step: the stall's baseline
AFTER_STEPS = 2  # training steps after the save step, while the writer thread runs
KEEP = 2

PLAIN, PLAIN_FSYNC, TRAINER = "plain", "plain+fsync", "trainer"
BLOCKED, SLOWER, AFTER, WAIT, STEP = "async blocked", "async slower", "async after", "async wait", "training step"
VARIANTS: tuple[str, ...] = (PLAIN, PLAIN_FSYNC, TRAINER, "async")  # the order of even repeats
STALL_TARGET = 0.10
RATIO_TARGET = 1.15


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="gpt2-124m", help="model preset (see trainer.model.PRESETS); tiny: a smoke run")
    p.add_argument("--repeats", type=int, default=3, help="time every variant this many times; report medians")
    p.add_argument(
        "--dir",
        default="",
        help=f"where to make the fresh (and at the end removed) benchmark directory; default {DEFAULT_PARENT}, "
        "on the repository's disk (the system temp dir may be another filesystem, such as tmpfs)",
    )
    p.add_argument("--write-results", action="store_true", help=f"append a dated section to {RESULTS.name}")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    return args


# -- the state --------------------------------------------------------------------------------------------


@dataclass
class Training:
    """The trainer's model, optimizer and schedule for a preset, as train_ddp builds them on a CPU."""

    preset: str
    cfg: TrainConfig = field(init=False)
    model: torch.nn.Module = field(init=False)
    optimizer: torch.optim.Optimizer = field(init=False)
    schedule: LRSchedule = field(init=False)
    progress: Progress = field(default_factory=Progress)

    def __post_init__(self) -> None:
        self.cfg = TrainConfig(data_dir="", run_dir="", preset=self.preset, seq_len=SEQ_LEN)
        self.mconfig = model_config(self.preset, VOCAB_SIZE, SEQ_LEN, EOS_ID)
        torch.manual_seed(self.cfg.seed)
        self.model = build_model(self.mconfig)
        matrices = [p for p in self.model.parameters() if p.dim() >= 2]
        vectors = [p for p in self.model.parameters() if p.dim() < 2]
        self.optimizer = torch.optim.AdamW(  # fused is for CUDA
            [{"params": matrices, "weight_decay": self.cfg.weight_decay}, {"params": vectors, "weight_decay": 0.0}],
            lr=self.cfg.lr,
            betas=(0.9, 0.95),
        )
        self.schedule = LRSchedule(ScheduleSettings.of(self.cfg))
        self.step()  # every exp_avg and exp_avg_sq exists from here on

    def step(self, checkpoints: CheckpointManager | None = None) -> float:
        """One training step, with train_ddp's barrier before the optimizer changes what a save may be copying.

        Returns the seconds the step waited at that barrier.
        """
        tokens = torch.randint(0, VOCAB_SIZE, (1, STEP_TOKENS))
        self.model(input_ids=tokens, labels=tokens).loss.backward()
        waited = checkpoints.wait_until_staged() if checkpoints is not None else 0.0
        for group in self.optimizer.param_groups:
            group["lr"] = self.schedule.lr_at(self.progress.step)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.progress.step += 1
        self.progress.tokens_seen += self.cfg.tokens_per_step
        return waited

    def state(self) -> dict[str, Any]:
        """What train_ddp's save() hands to CheckpointManager on rank 0 of a one-process run."""
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "schedule": self.schedule.state_dict(),
            "schema": SCHEMA,
            "progress": self.progress.state_dict(),
            "data": DataPosition(epoch=0, offset=self.progress.step * self.cfg.batch_size).state_dict(),
            "rng": [rng_state()],
            "step": self.progress.step,
            "preset": self.preset,
            "model_config": self.mconfig.to_dict(),
            "world_size": 1,
        }


def tensors(obj: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """(dotted name, tensor) for every tensor in a nested state."""
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from tensors(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(obj, list | tuple):
        for i, v in enumerate(obj):
            yield from tensors(v, f"{prefix}.{i}")


def tensor_bytes(state: dict[str, Any]) -> tuple[int, dict[str, int]]:
    """Bytes of the distinct storages (torch.save writes a shared one once), and the tensors sharing an earlier one.

    cpu_copy copies each tensor on its own, so an async save writes every shared storage again: in GPT-2 the
    output layer's weight is the input embedding's.
    """
    seen: set[int] = set()
    total, shared = 0, {}
    for name, tensor in tensors(state):
        storage = tensor.untyped_storage()
        if storage.data_ptr() in seen and storage.nbytes():
            shared[name] = storage.nbytes()
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total, shared


# -- the variants -----------------------------------------------------------------------------------------


def timed(call: Callable[[], Any]) -> float:
    """Seconds `call` takes, after os.sync() has flushed every earlier write's dirty pages."""
    started = time.perf_counter()
    os.sync()
    log.debug("  os.sync() before it took %.2fs", time.perf_counter() - started)
    started = time.perf_counter()
    call()
    return time.perf_counter() - started


def clear(directory: Path) -> None:
    """Delete what a variant wrote (outside the timed region), leaving the directory empty for the next one."""
    for entry in directory.iterdir():
        if entry.is_dir():
            shutil.rmtree(entry)
        else:
            entry.unlink()


def plain_save(state: dict[str, Any], path: Path, fsync: bool) -> None:
    torch.save(state, str(path))  # by name, like the trainer
    if fsync:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def timed_step(training: Training, checkpoints: CheckpointManager | None = None) -> float:
    started = time.perf_counter()
    training.step(checkpoints)
    return time.perf_counter() - started


def async_stall(directory: Path, training: Training) -> dict[str, float]:
    """Seconds a training step with an asynchronous save takes beyond one without, and what follows it."""
    manager = CheckpointManager(directory, keep=KEEP, async_save=True)
    try:
        # Training saves many times: the first save allocates the CPU buffers the later ones copy into.
        manager.save(training.state(), training.progress.step, blocking=False)
        manager.wait()
        clear(directory)
        plain = statistics.median(timed_step(training) for _ in range(PLAIN_STEPS))
        os.sync()
        started = time.perf_counter()
        blocked = manager.save(training.state(), training.progress.step, blocking=False)
        blocked += training.step(manager)
        slower = time.perf_counter() - started - plain
        after = sum(timed_step(training, manager) - plain for _ in range(AFTER_STEPS))
        started = time.perf_counter()
        manager.wait()  # the write completes before anything else is measured
        return {BLOCKED: blocked, SLOWER: slower, AFTER: after, WAIT: time.perf_counter() - started, STEP: plain}
    finally:
        manager.close()


def run_variant(name: str, directory: Path, training: Training) -> tuple[dict[str, float], int]:
    """Time one variant into `directory` (empty before, emptied after): seconds per measurement, bytes written."""
    state, step = training.state(), training.progress.step
    if name in (PLAIN, PLAIN_FSYNC):
        path = directory / f"{'plain_fsync' if name == PLAIN_FSYNC else 'plain'}.pt"
        seconds = {name: timed(lambda: plain_save(state, path, fsync=name == PLAIN_FSYNC))}
    elif name == TRAINER:
        manager = CheckpointManager(directory, keep=KEEP)
        seconds = {TRAINER: timed(lambda: manager.save(state, step, blocking=True))}
    else:
        seconds = async_stall(directory, training)
    written = sum(p.stat().st_size for p in directory.glob("*.pt") if p.name != LATEST)
    log.info("  %s (%.1f MB)", ", ".join(f"{k} {v:.3f}s" for k, v in seconds.items()), written / 1e6)
    clear(directory)
    return seconds, written


def measure_once(directory: Path, training: Training, n: int, sizes: dict[str, int]) -> dict[str, float]:
    """One repeat of every variant; the order is reversed on odd repeats so drift on a shared box evens out."""
    order = VARIANTS if n % 2 == 0 else tuple(reversed(VARIANTS))
    seconds: dict[str, float] = {}
    for name in order:
        timings, sizes[name] = run_variant(name, directory, training)
        seconds.update(timings)
    return seconds


# -- summary ----------------------------------------------------------------------------------------------


@dataclass
class Row:
    name: str
    values: list[float]  # one per repeat
    unit: str  # "s", "x" or "%"
    target: str = ""
    met: bool | None = None

    @property
    def median(self) -> float:
        return statistics.median(self.values)

    def cell(self, value: float) -> str:
        if self.unit == "%":
            return f"{100 * value:.1f}%"
        return f"{value:.3f} s" if self.unit == "s" else f"{value:.2f}"


def summarise(repeats: list[dict[str, float]]) -> list[Row]:
    """Median seconds of each measurement, and the median of each per-repeat ratio (measured side by side)."""

    def each(key: str) -> list[float]:
        return [r[key] for r in repeats]

    rows = [
        Row("plain `torch.save`", each(PLAIN), "s"),
        Row("plain `torch.save` + fsync of the file", each(PLAIN_FSYNC), "s"),
        Row("trainer `CheckpointManager.save(blocking=True)`", each(TRAINER), "s"),
        Row("training step without a save (the stall's baseline)", each(STEP), "s"),
        Row("async: the training stall (`save(blocking=False)` + `wait_until_staged()`)", each(BLOCKED), "s"),
        Row("async: how much longer the step with the save took (informative)", each(SLOWER), "s"),
        Row(f"async: the next {AFTER_STEPS} steps' slowdown while the writer runs (informative)", each(AFTER), "s"),
        Row("async: `wait()` for the background write after them (informative)", each(WAIT), "s"),
    ]
    trainer_plain = Row("trainer / plain", [r[TRAINER] / r[PLAIN] for r in repeats], "x", f"≤ {RATIO_TARGET}")
    trainer_plain.met = trainer_plain.median <= RATIO_TARGET
    trainer_fsync = Row("trainer / plain+fsync", [r[TRAINER] / r[PLAIN_FSYNC] for r in repeats], "x")
    stall = Row("async stall / trainer save", [r[BLOCKED] / r[TRAINER] for r in repeats], "%", f"≤ {STALL_TARGET:.0%}")
    stall.met = stall.median <= STALL_TARGET
    return rows + [trainer_plain, trainer_fsync, stall]


def table(rows: list[Row]) -> str:
    lines = ["| measurement | median | each repeat | target | met |", "|---|---:|---:|---:|:---:|"]
    for r in rows:
        met = "" if r.met is None else ("yes" if r.met else "no")
        each = ", ".join(r.cell(v) for v in r.values)
        lines.append(f"| {r.name} | {r.cell(r.median)} | {each} | {r.target} | {met} |")
    return "\n".join(lines)


# -- the machine ------------------------------------------------------------------------------------------


def unescape_mount(text: str) -> str:
    """/proc/mounts writes space, tab, newline and backslash in paths as octal escapes."""
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        text = text.replace(code, char)
    return text


def filesystem(path: Path) -> str:
    """'ext4 on /dev/vda (mounted at /, rw,relatime)': the /proc/mounts entry of the mount holding `path`."""
    path = path.resolve()
    best: tuple[str, str, str, str] | None = None
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return "unknown filesystem"
    for line in mounts:
        parts = line.split()
        if len(parts) < 4:
            continue
        device, mount, kind, options = unescape_mount(parts[0]), unescape_mount(parts[1]), parts[2], parts[3]
        if not path.is_relative_to(mount):
            continue
        try:
            same_device = os.stat(mount).st_dev == os.stat(path).st_dev
        except OSError:
            continue
        # The longest matching mount point wins; among equals, the later line (a mount over another).
        if same_device and (best is None or len(mount) >= len(best[1])):
            best = (device, mount, kind, options)
    if best is None:
        return "unknown filesystem"
    device, mount, kind, options = best
    return f"{kind} on {device} (mounted at {mount}, {options})"


def check_directory(directory: Path) -> str:
    """Log which filesystem the benchmark writes to, and whether the system temp dir is the same one."""
    where = filesystem(directory)
    log.info("benchmark directory %s: %s", directory, where)
    temp = Path(tempfile.gettempdir())
    try:
        same = os.stat(temp).st_dev == os.stat(directory).st_dev
    except OSError:
        same = False
    log.info("%s is %s (%s)", temp, "the same filesystem" if same else "another filesystem", filesystem(temp))
    return where


@dataclass
class CpuSample:
    """Jiffies the whole machine spent busy, and this process's own CPU seconds, at one moment."""

    wall: float
    busy_s: float
    own_s: float

    @classmethod
    def now(cls) -> CpuSample:
        busy = 0.0
        try:
            fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
            # user nice system idle iowait irq softirq steal: all but idle and iowait are busy
            busy = sum(int(v) for i, v in enumerate(fields[:8]) if i not in (3, 4)) / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, IndexError):
            pass
        times = os.times()
        return cls(time.monotonic(), busy, times.user + times.system)


def others_cpus(start: CpuSample, end: CpuSample) -> float:
    """CPUs busy outside this process on average: other processes, and the kernel writing our files back."""
    wall = end.wall - start.wall
    return max(0.0, (end.busy_s - start.busy_s) - (end.own_s - start.own_s)) / wall if wall > 0 else 0.0


def loadavg() -> float | None:
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


def loads(conditions: Conditions) -> str:
    start, end = (f"{x:.2f}" if x is not None else "unknown" for x in (conditions.load_start, conditions.load_end))
    return f"{start} at the start, {end} at the end"


@dataclass
class Conditions:
    """What a run measured besides times, and what the machine was doing meanwhile."""

    directory: str = ""  # the filesystem, from /proc/mounts
    state_bytes: int = 0
    shared: dict[str, int] = field(default_factory=dict)  # tensors whose storage an earlier one already holds
    written: dict[str, int] = field(default_factory=dict)  # bytes of the checkpoint file each variant wrote
    load_start: float | None = None  # 1-minute load average
    load_end: float | None = None
    others_cpus: float = 0.0


def machine(conditions: Conditions) -> list[str]:
    dirty = []
    for name in ("dirty_ratio", "dirty_background_ratio", "dirty_bytes", "dirty_background_bytes"):
        try:
            dirty.append(f"{name} {Path('/proc/sys/vm', name).read_text().strip()}")
        except OSError:
            pass
    return [
        *machine_lines("torch"),
        f"benchmark directory: {conditions.directory}",
        f"page cache writeback (vm.*): {', '.join(dirty) or 'unknown'}",
        f"1-minute load average: {loads(conditions)}; CPUs busy outside this process during the measurements: "
        f"{conditions.others_cpus:.2f} on average",
    ]


# -- results ----------------------------------------------------------------------------------------------


def gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB"


def caption(args: argparse.Namespace, conditions: Conditions) -> str:
    how = "one run" if args.repeats == 1 else f"medians of {args.repeats} repeats (ratios: of per-repeat ratios)"
    written = conditions.written
    text = (
        f"Checkpoint save (`bench/checkpoint.py`): preset {args.preset}, vocabulary {VOCAB_SIZE}, sequence length "
        f"{SEQ_LEN}; the state train_ddp saves after one AdamW step (model, optimizer with exp_avg and exp_avg_sq, "
        f"schedule, progress, data position, RNG, config), {gb(conditions.state_bytes)} of tensors, a "
        f"{gb(written[TRAINER])} file. Side by side in one directory: a plain `torch.save`, the same plus an fsync "
        f"of the file, the trainer's `CheckpointManager(dir, keep=2).save(blocking=True)` (temp file written with "
        f"early writeback, fsync, rename, hard link of checkpoint_latest.pt, index.json), and the training stall "
        f"of an async save (`async_save=True`, `blocking=False`, after a first one that allocated its CPU buffers): "
        f"a training step of the same model ({STEP_TOKENS} tokens of forward/backward, the AdamW step) that starts "
        f"with the save call and waits in `wait_until_staged()` before its optimizer step, as train_ddp's does, "
        f"minus the median of the {PLAIN_STEPS} steps just before it; the background copy to CPU memory overlaps "
        f"the forward/backward pass. Each timed save follows an `os.sync()`, the order of the variants is reversed "
        f"on every other repeat, and each variant's files are deleted after it is timed (so every trainer save is "
        f"a first one: its unlinking of step files beyond `keep` is not in its time); {how}. Rerun with "
        f"`.venv/bin/python bench/checkpoint.py --write-results` (`--preset tiny --repeats 1`: a smoke run)."
    )
    extra = written["async"] - written[TRAINER]
    if abs(extra) > 0.01 * written[TRAINER]:
        text += (
            f" The async save wrote a file of {gb(written['async'])}, the trainer's sync save one of "
            f"{gb(written[TRAINER])}."
        )
    cpus = os.cpu_count() or 1
    if conditions.others_cpus >= 0.25:
        text += (
            f" Another process was busy during this run ({conditions.others_cpus:.2f} of {cpus} CPUs on average "
            f"outside the benchmark; load average {loads(conditions)}): expect more noise."
        )
    elif max(x or 0.0 for x in (conditions.load_start, conditions.load_end)) >= cpus:
        text += (
            f" The load average was high ({loads(conditions)}, on {cpus} CPUs), but CPU time outside the "
            f"benchmark was {conditions.others_cpus:.2f} CPUs on average during the measurements (the load average "
            f"also counts tasks waiting on the disk, and lags by a minute)."
        )
    return text


def contention(repeats: list[dict[str, float]]) -> str:
    """What the async save cost training here besides the stall: the writer thread's share of the CPU."""
    extra = [r[SLOWER] + r[AFTER] for r in repeats]
    share = statistics.median(e / r[TRAINER] for e, r in zip(extra, repeats, strict=True))
    return (
        f"The stall is the time training is held up; it is not all an async save costs where training runs on "
        f"the CPU. Here the writer thread's serialisation competes with training for the {os.cpu_count()} cores "
        f"(and the memory bandwidth): the step with the save and the {AFTER_STEPS} after it took "
        f"{statistics.median(extra):.2f} s longer together (median), {share:.0%} of the sync save. On a GPU node "
        f"training runs on the GPU and the writer on otherwise idle host cores; `bench/gpu_check.sh` measures it "
        f"there."
    )


def write_results(
    rows: list[Row], repeats: list[dict[str, float]], args: argparse.Namespace, conditions: Conditions
) -> None:
    text = [caption(args, conditions), "", table(rows), "", contention(repeats)]
    append_section("checkpoint save", text, machine(conditions))
    log.info("appended results to %s", RESULTS)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    parent = Path(args.dir or DEFAULT_PARENT).resolve()
    made_parent = not parent.exists()
    parent.mkdir(parents=True, exist_ok=True)
    directory = Path(tempfile.mkdtemp(prefix="bench-checkpoint-", dir=parent))
    conditions = Conditions(load_start=loadavg())
    try:
        conditions.directory = check_directory(directory)
        log.info("building the %s state (vocabulary %d, sequence length %d)", args.preset, VOCAB_SIZE, SEQ_LEN)
        training = Training(args.preset)
        state = training.state()
        conditions.state_bytes, conditions.shared = tensor_bytes(state)
        log.info("state: %s of tensors; sharing an earlier tensor's storage: %s", gb(conditions.state_bytes),
                 ", ".join(f"{k} ({gb(v)})" for k, v in conditions.shared.items()) or "none")  # fmt: skip
        warm_up = directory / "warm-up.pt"
        seconds = timed(lambda: plain_save(state, warm_up, fsync=False))
        log.info("warm-up (untimed): plain torch.save of %s in %.2fs", gb(warm_up.stat().st_size), seconds)
        clear(directory)
        start = CpuSample.now()
        repeats = []
        for n in range(args.repeats):
            log.info("repeat %d/%d", n + 1, args.repeats)
            repeats.append(measure_once(directory, training, n, conditions.written))
        conditions.others_cpus = others_cpus(start, CpuSample.now())
        conditions.load_end = loadavg()
        log.info("CPUs busy outside this process: %.2f on average; load average %s",
                 conditions.others_cpus, loads(conditions))  # fmt: skip
        rows = summarise(repeats)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
        if made_parent and not any(parent.iterdir()):
            parent.rmdir()
    if args.write_results:
        write_results(rows, repeats, args, conditions)
    print(table(rows))
    print(contention(repeats))
    return 0


if __name__ == "__main__":
    sys.exit(main())
