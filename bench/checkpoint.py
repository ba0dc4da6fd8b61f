"""Checkpoint saves and loads: the old single writer against DCP's parallel writers, and the stall of an async save.

Two processes (torch.multiprocessing, gloo, CPU, one thread each) hold the same state, as DDP ranks do: a preset's
model (gpt2-124m by default, GPT-2 vocabulary 50304, 1024-token sequences) and its AdamW optimizer after one step,
so every exp_avg and exp_avg_sq exists. In one invocation, side by side in one directory, every repeat times:

    single   the trainer before DCP: rank 0 alone torch.save's {model, optimizer, trainer state, RNG} to a
             temporary file, fsyncs it, os.replace's it into place and fsyncs the directory; the other rank waits
    dcp      CheckpointManager(dir, group=<a gloo group>).save(blocking=True) on both ranks: each writes its
             share (DCP's writer fsyncs it), rank 0 commits (commit.json, fsync, rename); the time is rank 0's
    async    the training stall of an asynchronous save, as train_ddp takes it: save(blocking=False) after an
             optimizer step, then the next step's forward/backward, wait_until_staged() and optimizer step; the
             stall is the save call plus that wait. Also: that step and the ones after it against the median of
             steps without a save, and the seconds until the background write is committed (wait())
    loads    single: both ranks torch.load the whole file at once and load it into the model and optimizer; dcp:
             CheckpointManager.restore on both ranks (each reads its share, then broadcasts). The slower rank's time

Every timed save is preceded by os.sync(), so no earlier write's dirty pages are flushed while it runs; the order
of the variants is reversed on every other repeat; each variant's files are deleted after it is timed. Loads read
what was just written, so mostly from the page cache, for both alike (dropping it needs root). It reports medians
over repeats and the medians of the per-repeat ratios, and a PROJECTION of llama-1b's preemption save on 16 ranks
on FSx for Lustre from the rates measured here. It is a measurement, not a test: it never asserts on times.

    .venv/bin/python bench/checkpoint.py [--preset gpt2-124m] [--repeats 3] [--dir DIR] [--write-results]
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from machine import RESULTS, append_section, machine_lines

from trainer.atomic import fsync_dir
from trainer.checkpoint import SCHEMA, CheckpointManager, newest_checkpoint, rng_state
from trainer.config import TrainConfig
from trainer.model import build_model, model_config
from trainer.schedule import LRSchedule, ScheduleSettings
from trainer.train_ddp import Progress

log = logging.getLogger("bench-checkpoint")

REPO = Path(__file__).resolve().parent.parent
# The CLI's default storage root (gitignored): where run-local writes its checkpoints.
DEFAULT_PARENT = REPO / "local-runs"

WORLD = 2
VOCAB_SIZE = 50304  # GPT-2's 50257 rounded up to a multiple of 64, as GPT-2 reproductions train with
EOS_ID = 50256
SEQ_LEN = 1024
STEP_TOKENS = 128  # each training step is one sequence this long: on one CPU core, about a second or two
PLAIN_STEPS = 3  # training steps without a save before each async save: the stall's baseline
AFTER_STEPS = 2  # training steps after the one with the save, while the writer runs
KEEP = 2

SINGLE, DCP, ASYNC, HALVES = "single", "dcp", "async", "halves"
VARIANTS: tuple[str, ...] = (SINGLE, DCP, ASYNC, HALVES)  # the order of even repeats
# What each repeat measures (seconds), by key.
SINGLE_SAVE, DCP_SAVE, DCP_SHARE = "single save", "dcp save", "dcp largest share"  # the share is bytes
SINGLE_LOAD, DCP_LOAD = "single load", "dcp load"
HALVES_SAVE = "halves save"  # each rank torch.save's half of the tensors: this machine's ceiling for 2 writers
STALL, CALL, STAGED = "async stall", "async save call", "async staged wait"
SLOWER, AFTER, COMMITTED, STEP = "async slower", "async after", "async committed", "training step"
THROUGHPUT_TARGET = 1.5
STALL_TARGET = 0.10

# The PROJECTION: llama-1b's SIGTERM save on 16 ranks, on FSx for Lustre.
PROJECTION_PRESET, PROJECTION_VOCAB, PROJECTION_RANKS = "llama-1b", 32000, 16
BYTES_PER_PARAMETER = 12  # fp32 weights, exp_avg, exp_avg_sq (components/preflight/checkpoint_throughput.py)
CAPACITIES_GIB = (1200, 2400, 4800, 9600)  # FSx's size steps; it counts 1,000 GiB per TiB of throughput
FSX_GIB_PER_TIB = 1000
# Baseline write MB/s per TiB.
TIERS = (
    ("SCRATCH_2", 100),
    ("PERSISTENT_2", 125),
    ("PERSISTENT_2", 250),
    ("PERSISTENT_2", 500),
    ("PERSISTENT_2", 1000),
)
MARGIN_S = 20  # of the launcher's grace period, kept for the step in flight and the exit


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


# -- the state (one per rank) -----------------------------------------------------------------------------


@dataclass
class Training:
    """One rank's model, optimizer and schedule for a preset, as train_ddp builds them on a CPU."""

    preset: str
    cfg: TrainConfig = field(init=False)
    model: torch.nn.Module = field(init=False)
    optimizer: torch.optim.Optimizer = field(init=False)
    schedule: LRSchedule = field(init=False)
    progress: Progress = field(default_factory=Progress)

    def __post_init__(self) -> None:
        self.cfg = TrainConfig(data_dir="", run_dir="", preset=self.preset, seq_len=SEQ_LEN)
        self.mconfig = model_config(self.preset, VOCAB_SIZE, SEQ_LEN, EOS_ID)
        torch.manual_seed(self.cfg.seed)  # the same weights on every rank, as DDP's broadcast makes them
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
        """One training step, waiting where train_ddp waits for an async save's copy; returns that wait's seconds.

        Every rank trains on the same tokens, so the replicas stay equal without DDP's all-reduce (which would
        only add gloo traffic to what is timed).
        """
        tokens = torch.randint(
            0, VOCAB_SIZE, (1, STEP_TOKENS), generator=torch.Generator().manual_seed(self.progress.step)
        )
        self.model(input_ids=tokens, labels=tokens).loss.backward()
        waited = checkpoints.wait_until_staged() if checkpoints is not None else 0.0
        for group in self.optimizer.param_groups:
            group["lr"] = self.schedule.lr_at(self.progress.step)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.progress.step += 1
        self.progress.tokens_seen += self.cfg.tokens_per_step
        return waited

    def trainer_state(self) -> dict[str, Any]:
        """What train_ddp hands CheckpointManager besides the model and optimizer (no dataset here)."""
        return {
            "schedule": self.schedule.state_dict(),
            "progress": self.progress.state_dict(),
            "schema": SCHEMA,
            "step": self.progress.step,
            "preset": self.preset,
            "model_config": self.mconfig.to_dict(),
            "world_size": WORLD,
        }

    def single_file_state(self) -> dict[str, Any]:
        """What the trainer before DCP saved on rank 0: everything in one dictionary."""
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            **self.trainer_state(),
            "rng": [rng_state()],
        }


def tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from tensors(v)
    elif isinstance(obj, list | tuple):
        for v in obj:
            yield from tensors(v)


def state_bytes(training: Training) -> int:
    """Bytes of the model's and optimizer's distinct tensor storages (a tied embedding counts once): the state
    whose commit every variant's throughput divides."""
    seen: set[int] = set()
    total = 0
    for tensor in tensors([training.model.state_dict(), training.optimizer.state_dict()]):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def files_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file() and not p.is_symlink())


# -- one rank's measurements ------------------------------------------------------------------------------


def clear(directory: Path) -> None:
    """Delete what a variant wrote (outside the timed region), leaving the directory empty for the next one."""
    for entry in directory.iterdir():
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


def synced_start() -> float:
    """os.sync() on every rank (no earlier write's dirty pages flushed while a save runs), then a common start."""
    os.sync()
    dist.barrier()
    return time.perf_counter()


def single_save(state: dict[str, Any], path: Path) -> None:
    """The old commit: torch.save to a temporary name, fsync, rename into place, fsync the directory."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def slowest(seconds: float) -> float:
    """The largest of every rank's `seconds` (collective)."""
    every: list[float] = [0.0] * WORLD
    dist.all_gather_object(every, seconds)
    return max(every)


@dataclass
class Rank:
    """What one rank measures with: its state, the checkpoints' gloo group, the benchmark directory."""

    training: Training
    group: dist.ProcessGroup
    directory: Path
    asynchronous: CheckpointManager  # one for the run: its stager keeps its host buffers from save to save

    @property
    def rank(self) -> int:
        return dist.get_rank()

    def done(self) -> None:
        """Every rank has finished with the files: rank 0 deletes them."""
        dist.barrier()
        if self.rank == 0:
            clear(self.directory)
        dist.barrier()

    def single(self) -> dict[str, float]:
        path = self.directory / "checkpoint_step.pt"
        started = synced_start()
        if self.rank == 0:
            single_save(self.training.single_file_state(), path)
        saved = time.perf_counter() - started
        written = files_bytes(self.directory)
        dist.barrier()
        started = time.perf_counter()
        state = torch.load(path, map_location="cpu", weights_only=True)  # every rank reads the whole file
        self.training.model.load_state_dict(state["model"])
        self.training.optimizer.load_state_dict(state["optimizer"])
        loaded = slowest(time.perf_counter() - started)
        del state
        self.done()
        return {SINGLE_SAVE: saved, SINGLE_LOAD: loaded, "single bytes": written}

    def dcp(self) -> dict[str, float]:
        t = self.training
        manager = CheckpointManager(self.directory, keep=KEEP, group=self.group)
        try:
            started = synced_start()
            manager.save(t.progress.step, t.model, t.optimizer, t.trainer_state(), rng_state(), blocking=True)
            saved = time.perf_counter() - started  # rank 0's: it returns after the commit
            report = manager.last_save
            dist.barrier()
            written = files_bytes(self.directory)
            checkpoint = newest_checkpoint(self.directory)
            if checkpoint is None:
                raise RuntimeError(f"no committed checkpoint in {self.directory} after a blocking save")
            dist.barrier()
            started = time.perf_counter()
            manager.restore(checkpoint, t.model, t.optimizer)
            loaded = slowest(time.perf_counter() - started)
        finally:
            manager.close()
        self.done()
        share = report.largest_share if report is not None else 0
        return {DCP_SAVE: saved, DCP_LOAD: loaded, DCP_SHARE: share, "dcp bytes": written}

    def halves(self) -> dict[str, float]:
        """No DCP at all: each rank torch.save's every other tensor of the single-file state (by size), fsynced, at
        the same time. What any 2-writer save could gain over one writer on this machine's cores, memory and disk."""
        ordered = sorted(tensors(self.training.single_file_state()), key=lambda t: -t.numel())
        mine = {str(i): t for i, t in enumerate(ordered) if i % WORLD == self.rank}
        started = synced_start()
        single_save(mine, self.directory / f"half_{self.rank}.pt")
        saved = slowest(time.perf_counter() - started)
        self.done()
        return {HALVES_SAVE: saved}

    def timed_step(self, manager: CheckpointManager | None = None) -> float:
        started = time.perf_counter()
        self.training.step(manager)
        return time.perf_counter() - started

    def asynchronous_save(self) -> dict[str, float]:
        """The stall of a save(blocking=False) at the end of a step, through the next step's wait_until_staged."""
        t, manager = self.training, self.asynchronous
        plain = statistics.median(self.timed_step() for _ in range(PLAIN_STEPS))
        started = synced_start()
        call = manager.save(t.progress.step, t.model, t.optimizer, t.trainer_state(), rng_state(), blocking=False)
        staged = t.step(manager)
        slower = time.perf_counter() - started - plain
        after = sum(self.timed_step(manager) - plain for _ in range(AFTER_STEPS))
        manager.wait()
        committed = time.perf_counter() - started  # rank 0's: the commit runs there
        self.done()
        return {
            STALL: call + staged,
            CALL: call,
            STAGED: staged,
            SLOWER: slower,
            AFTER: after,
            COMMITTED: committed,
            STEP: plain,
        }

    def warm_up(self) -> None:
        """Untimed: a first single-file save, and a first async save (which allocates the stager's buffers)."""
        t = self.training
        if self.rank == 0:
            single_save(t.single_file_state(), self.directory / "warm-up.pt")
        self.asynchronous.save(t.progress.step, t.model, t.optimizer, t.trainer_state(), rng_state(), blocking=False)
        t.step(self.asynchronous)
        self.asynchronous.wait()
        self.done()

    def measure_once(self, n: int) -> dict[str, float]:
        """One repeat of every variant; the order is reversed on odd repeats so drift on a shared box evens out."""
        order = VARIANTS if n % 2 == 0 else tuple(reversed(VARIANTS))
        measured: dict[str, float] = {}
        for name in order:
            got = {SINGLE: self.single, DCP: self.dcp, ASYNC: self.asynchronous_save, HALVES: self.halves}[name]()
            if self.rank == 0:
                log.info("  %s: %s", name, ", ".join(f"{k} {v:.3f}" for k, v in got.items()))
            measured.update(got)
        return measured


def worker(rank: int, preset: str, repeats: int, directory: str, port: int, results: Any) -> None:
    """One process of the benchmark; rank 0 puts (state bytes, [one dict per repeat]) on `results`."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank {rank} %(name)s: %(message)s")
    logging.getLogger("trainer").setLevel(logging.WARNING)  # the commit's log line per save
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        group = dist.new_group(backend="gloo")  # the checkpoints' own, as train_ddp makes it
        training = Training(preset)
        me = Rank(
            training,
            group,
            Path(directory),
            CheckpointManager(Path(directory), keep=KEEP, async_save=True, group=group),
        )
        try:
            me.warm_up()
            measured = []
            for n in range(repeats):
                if rank == 0:
                    log.info("repeat %d/%d", n + 1, repeats)
                measured.append(me.measure_once(n))
        finally:
            me.asynchronous.close()
        if rank == 0:
            results.put((state_bytes(training), measured))
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(preset: str, repeats: int, directory: Path) -> tuple[int, list[dict[str, float]]]:
    """Start the WORLD processes, one thread each, and collect rank 0's measurements."""
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the spawned processes before torch starts there
    results = mp.get_context("spawn").SimpleQueue()
    mp.spawn(worker, args=(preset, repeats, str(directory), free_port(), results), nprocs=WORLD, join=True)
    return results.get()


# -- summary ----------------------------------------------------------------------------------------------


@dataclass
class Row:
    name: str
    values: list[float]  # one per repeat
    unit: str  # "s", "GB/s", "x" or "%"
    target: str = ""
    met: bool | None = None

    @property
    def median(self) -> float:
        return statistics.median(self.values)

    def cell(self, value: float) -> str:
        if self.unit == "%":
            return f"{100 * value:.1f}%"
        if self.unit == "x":
            return f"{value:.2f}"
        return f"{value:.3f} {self.unit}"


def summarise(state: int, repeats: list[dict[str, float]]) -> list[Row]:
    """Median of each measurement, and the median of each per-repeat ratio (measured side by side)."""

    def each(key: str) -> list[float]:
        return [r[key] for r in repeats]

    def rate(key: str) -> list[float]:
        return [state / 1e9 / r[key] for r in repeats]

    throughput = Row(
        "DCP sync throughput / single-writer throughput",
        [r[SINGLE_SAVE] / r[DCP_SAVE] for r in repeats],
        "x",
        f">= {THROUGHPUT_TARGET}",
    )
    throughput.met = throughput.median >= THROUGHPUT_TARGET
    stall = Row("async stall / DCP sync save", [r[STALL] / r[DCP_SAVE] for r in repeats], "%", f"<= {STALL_TARGET:.0%}")
    stall.met = stall.median <= STALL_TARGET
    share_rate = [r[DCP_SHARE] / 1e9 / r[DCP_SAVE] for r in repeats]
    return [
        Row("single writer: rank 0 `torch.save` + fsync + rename, committed", each(SINGLE_SAVE), "s"),
        Row("single writer: throughput", rate(SINGLE_SAVE), "GB/s"),
        Row(f"DCP sync, {WORLD} writers: `save(blocking=True)`, committed", each(DCP_SAVE), "s"),
        Row("DCP sync: throughput", rate(DCP_SAVE), "GB/s"),
        Row("DCP sync: per-rank write rate (largest share / save time)", share_rate, "GB/s"),
        Row("training step without a save (the stall's baseline)", each(STEP), "s"),
        Row("async: the training stall (`save(blocking=False)` + `wait_until_staged()`)", each(STALL), "s"),
        Row("async: of which the save call", each(CALL), "s"),
        Row("async: how much longer the step with the save took (informative)", each(SLOWER), "s"),
        Row(f"async: the next {AFTER_STEPS} steps' slowdown while the writer runs (informative)", each(AFTER), "s"),
        Row("async: save call to committed (informative)", each(COMMITTED), "s"),
        Row("async: throughput to committed (informative)", rate(COMMITTED), "GB/s"),
        Row("load, single file: both ranks `torch.load` the whole file (slower rank)", each(SINGLE_LOAD), "s"),
        Row("load, DCP: `restore()`, each rank reads its share, broadcast (slower rank)", each(DCP_LOAD), "s"),
        throughput,
        stall,
        Row("DCP load / single-file load", [r[DCP_LOAD] / r[SINGLE_LOAD] for r in repeats], "x"),
        Row(f"{WORLD} plain `torch.save` writers, half the tensors each (no DCP), committed", each(HALVES_SAVE), "s"),
        Row(
            f"this machine's ceiling for {WORLD} writers: single-writer time / {WORLD} plain writers' time",
            [r[SINGLE_SAVE] / r[HALVES_SAVE] for r in repeats],
            "x",
        ),
    ]


def table(rows: list[Row]) -> str:
    lines = ["| measurement | median | each repeat | target | met |", "|---|---:|---:|---:|:---:|"]
    for r in rows:
        met = "" if r.met is None else ("yes" if r.met else "no")
        each = ", ".join(r.cell(v) for v in r.values)
        lines.append(f"| {r.name} | {r.cell(r.median)} | {each} | {r.target} | {met} |")
    return "\n".join(lines)


# -- the PROJECTION ---------------------------------------------------------------------------------------


def projection_parameters() -> int:
    """llama-1b's parameters, built on the meta device (shapes only); a tied embedding counts once."""
    with torch.device("meta"):
        model = build_model(model_config(PROJECTION_PRESET, PROJECTION_VOCAB, SEQ_LEN, eos_token_id=0))
    return sum(p.numel() for p in model.parameters())


def projection(state: int, repeats: list[dict[str, float]]) -> str:
    """A PROJECTION, not a measurement: llama-1b's preemption save on FSx for Lustre from the rates measured here."""
    per_rank = statistics.median(r[DCP_SHARE] / r[DCP_SAVE] for r in repeats)  # bytes/s
    single = statistics.median(state / r[SINGLE_SAVE] for r in repeats)
    parameters = projection_parameters()
    nbytes = parameters * BYTES_PER_PARAMETER
    budget = TrainConfig.__dataclass_fields__["grace_period_s"].default - MARGIN_S
    clients = PROJECTION_RANKS * per_rank
    header = "| capacity | " + " | ".join(f"{kind} {mbps} MB/s/TiB" for kind, mbps in TIERS) + " |"
    lines = [header, "|---|" + "---:|" * len(TIERS)]

    def seconds(rate: float) -> str:
        return f"{nbytes / rate:.0f} s" + ("" if nbytes / rate <= budget else " (over)")

    for gib in CAPACITIES_GIB:
        cells = []
        for _, mbps in TIERS:
            fs = gib / FSX_GIB_PER_TIB * mbps * 1e6
            cells.append(f"{fs / 1e9:.2f} GB/s: DCP {seconds(min(fs, clients))}, single {seconds(min(fs, single))}")
        lines.append(f"| {gib:,} GiB | " + " | ".join(cells) + " |")
    text = (
        f"PROJECTION (computed, not measured): the preemption save of {PROJECTION_PRESET} on {PROJECTION_RANKS} "
        f"ranks. State: {parameters:,} parameters (built on the meta device, vocabulary {PROJECTION_VOCAB:,}, "
        f"Llama's; the pipeline's default is 8,192) x {BYTES_PER_PARAMETER} bytes = {nbytes / 1e9:.1f} GB. "
        f"Time = bytes / min(file-system throughput, writers' rate); file-system throughput = capacity / "
        f"{FSX_GIB_PER_TIB:,} GiB per TiB x the tier's baseline write MB/s per TiB. DCP: {PROJECTION_RANKS} ranks x "
        f"the per-rank write rate measured here ({per_rank / 1e9:.2f} GB/s, so {clients / 1e9:.1f} GB/s); "
        f"single: one writer at rank 0's rate measured here ({single / 1e9:.2f} GB/s). Budget: {budget:.0f} s "
        f"(the launcher's {budget + MARGIN_S:.0f} s grace period less {MARGIN_S} s); (over) marks a save that "
        f"does not fit. The local disk's rates stand in for one FSx client's, which they may exceed; the "
        f"commit's metadata operations on Lustre are not counted."
    )
    return text + "\n\n" + "\n".join(lines)


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
    """Jiffies the whole machine spent busy, and this process's and its finished children's CPU seconds."""

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
        times = os.times()  # the workers' time counts once they have been waited for
        return cls(time.monotonic(), busy, times.user + times.system + times.children_user + times.children_system)


def others_cpus(start: CpuSample, end: CpuSample) -> float:
    """CPUs busy outside the benchmark's processes on average: others', and the kernel writing our files back."""
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
        f"1-minute load average: {loads(conditions)}; CPUs busy outside the benchmark during the measurements: "
        f"{conditions.others_cpus:.2f} on average",
    ]


# -- results ----------------------------------------------------------------------------------------------


def gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def caption(args: argparse.Namespace, conditions: Conditions, repeats: list[dict[str, float]]) -> str:
    how = "one run" if args.repeats == 1 else f"medians of {args.repeats} repeats (ratios: of per-repeat ratios)"
    single = statistics.median(r["single bytes"] for r in repeats)
    sharded = statistics.median(r["dcp bytes"] for r in repeats)
    text = (
        f"Checkpoint save and load (`bench/checkpoint.py`), {WORLD} processes (torch.multiprocessing, gloo, CPU, "
        f"one thread each), preset {args.preset}, vocabulary {VOCAB_SIZE}, sequence length {SEQ_LEN}: the model "
        f"and AdamW state after a step, {gb(conditions.state_bytes)} of tensors, the same on both ranks. Side by "
        f"side in one directory: the single writer of the trainer before DCP (rank 0 `torch.save`s model, "
        f"optimizer, trainer state and RNG to a temporary file, fsync, `os.replace`, fsync of the directory; a "
        f"{gb(single)} file), DCP's sync save (`CheckpointManager.save(blocking=True)` on both ranks over a gloo "
        f"group: each rank writes and fsyncs its share, rank 0 commits; {gb(sharded)} of files; rank 0's time, "
        f"to the commit) and the stall of its async save (`async_save=True`, `blocking=False` after a step, then "
        f"the next step's forward/backward of {STEP_TOKENS} tokens, `wait_until_staged()` and AdamW step, as "
        f"train_ddp does; the stall is the save call plus that wait; after an untimed first async save that "
        f"allocated the stager's buffers). Loads: both ranks `torch.load` the whole file at once and load it, "
        f"against `restore()` (each rank reads its share, then broadcasts); the slower rank's time; the files were "
        f"just written, so mostly read from the page cache, for both alike. Throughput is the state's tensor bytes "
        f"over the time to commit. Each timed save follows an `os.sync()`, the order of the variants is reversed "
        f"on every other repeat, and each variant's files are deleted after it is timed; {how}. Rerun with "
        f"`.venv/bin/python bench/checkpoint.py --write-results` (`--preset tiny --repeats 1`: a smoke run)."
    )
    cpus = os.cpu_count() or 1
    if conditions.others_cpus >= 0.25:
        text += (
            f" Another process was busy during this run ({conditions.others_cpus:.2f} of {cpus} CPUs on average "
            f"outside the benchmark; load average {loads(conditions)}): expect more noise."
        )
    return text


def verdict(rows: list[Row]) -> str:
    """The targets in words, met or not."""
    parts = []
    for row in rows:
        if row.met is not None:
            parts.append(f"{row.name}: {row.cell(row.median)}, target {row.target}, {'met' if row.met else 'NOT met'}")
    return "Targets: " + "; ".join(parts) + "."


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
        start = CpuSample.now()
        conditions.state_bytes, repeats = measure(args.preset, args.repeats, directory)
        conditions.others_cpus = others_cpus(start, CpuSample.now())
        conditions.load_end = loadavg()
        log.info(
            "CPUs busy outside the benchmark: %.2f on average; load average %s",
            conditions.others_cpus,
            loads(conditions),
        )
    finally:
        shutil.rmtree(directory, ignore_errors=True)
        if made_parent and not any(parent.iterdir()):
            parent.rmdir()
    rows = summarise(conditions.state_bytes, repeats)
    projected = projection(conditions.state_bytes, repeats)
    if args.write_results:
        text = [caption(args, conditions, repeats), "", table(rows), "", verdict(rows), "", projected]
        append_section("checkpoint save and load, single writer against DCP", text, machine(conditions))
        log.info("appended results to %s", RESULTS)
    print(table(rows))
    print(verdict(rows))
    print(projected)
    return 0


if __name__ == "__main__":
    sys.exit(main())
