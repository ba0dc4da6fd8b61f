"""FSDP's benches (issue 27): what `--parallelism fsdp` costs in throughput, saves in memory, changes in the loss, and
a PROJECTION of llama-8b under hsdp on p5.48xlarge nodes.

In one invocation, after staging the corpus once (as bench/trainer_overhead.py does, whose machinery this reuses):

  throughput  tokens/s of `trainer/train_ddp.py --parallelism fsdp` against bench/minimal_fsdp.py, a plain FSDP2 loop
              doing the same math, over the same timed steps, in interleaved repeats (the order reversed every other
              repeat); medians with their spread. Target >= 0.95.
  memory      private memory per rank (RssAnon) after the first optimizer step of a 277M-parameter llama-shaped model,
              fsdp against ddp, from bench/fsdp_memory_probe.py under torchrun, the fixed cost measured before the
              build subtracted. Target <= 0.55 on 2 ranks (half the state, plus what is not sharded).
  loss        the trainer's loss at each of 50 steps under fsdp and under ddp, from the same initial weights and data:
              the largest relative difference (fp32 reduction order only; tests/test_parallel.py allows 1e-4).
  PROJECTION  computed, not measured: llama-8b's memory per GPU (trainer/memory.py's estimate), step time (from a
              published H100 throughput) and checkpoint save (the preflight's rule) on 2 and 8 nodes under hsdp.

CPU, gloo, 2 processes. It is a measurement, not a test: it never asserts on times or memory; it fails (BenchFailed)
when the sides did different work.

    .venv/bin/python bench/fsdp.py [--steps 120] [--warmup 20] [--repeats 8] [--write-results]
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path

from trainer_overhead import (
    BATCH_SIZE,
    LOG_EVERY,
    LOSS_RTOL,
    SEQ_LEN,
    TARGET,
    BenchFailed,
    Pair,
    check_same_work,
    cpus,
    noise_note,
    parse_timing,
    result_line,
    run_bench,
    run_minimal,
    run_trainer,
    summary_rows,
    timing_parser,
    torchrun,
    trainer_rows,
)

log = logging.getLogger("bench-fsdp")

BENCH = Path(__file__).resolve().parent
MINIMAL_FSDP = BENCH / "minimal_fsdp.py"
PROBE = BENCH / "fsdp_memory_probe.py"
MEMORY_TARGET = 0.55  # fsdp's private memory growth over ddp's, 2 ranks
MMAP_THRESHOLD = "MALLOC_MMAP_THRESHOLD_"
LOSS_STEPS = 50
# tests/test_parallel.py's tolerance for fsdp's loss against ddp's: FSDP reduce-scatters each gradient where DDP
# all-reduces buckets of them, the same sums in another order; fp32 rounding (~1e-7 relative per step) compounds
# through AdamW's updates (1.5e-6 at most over 40 steps of tiny, measured there). A wrong gradient or a missed update
# shows as 1e-2 and more.
LOSS_EXPECTED_RTOL = 1e-4

# The PROJECTION: llama-8b under hsdp on p5.48xlarge nodes, a micro-batch of 2 x 4096 tokens.
PROJECTION_PRESET, PROJECTION_VOCAB, PROJECTION_BATCH, PROJECTION_SEQ = "llama-8b", 128256, 2, 4096
PROJECTION_NODES = (2, 8)
INSTANCE = "p5.48xlarge"
# torchtitan's published Llama 3.1 8B training throughput on H100s (FSDP2, bf16, local batch 2 x 8192 tokens,
# selective activation checkpointing), tokens/s per GPU: Table 1 on 8 GPUs (5,762 eager, 6,667 compiled), Table 3 on
# 128 GPUs (5,605 eager, 6,514 compiled). Table 3's, the lower, is used for both node counts.
TORCHTITAN = "https://github.com/pytorch/torchtitan/blob/eaea6f6a2fa940f03a10906be1df3489cf30af85/docs/performance.md"
PUBLISHED_TPS = {"compiled": 6514, "eager": 5605}
# Step time by activation checkpointing, relative to the published (selective) figure: full runs each block's forward
# again (2 of the 6 FLOPs per parameter and token: 8/6); none saves selective's elementwise recompute only (taken as 1).
RECOMPUTE_FACTOR = {"none": 1.0, "selective": 1.0, "full": 8 / 6}
# The file system the save is projected on: FSx for Lustre PERSISTENT_2 SSD, 4,800 GiB at 1,000 MB/s per TiB.
FSX_GIB, FSX_MBPS_PER_TIB = 4800, 1000


@dataclass
class Memory:
    """One side's readings of bench/fsdp_memory_probe.py, the rank that grew most."""

    parallelism: str
    parameters: int
    loss: float
    baseline_gib: float
    growth_gib: float  # RssAnon after the step less before the build
    live_growth_gib: float | None  # the same once the C allocator returned its free pages; None without glibc
    shards: int  # the ranks the state is split over

    @property
    def state_gib(self) -> float:
        """Weights, gradients and AdamW's two moments, fp32: 16 bytes a parameter, over the shards."""
        return 16 * self.parameters / self.shards / 2**30


@dataclass
class LossCurves:
    """The trainer's loss at each step under ddp and fsdp."""

    ddp: dict[int, float]
    fsdp: dict[int, float]

    def relative(self, step: int) -> float:
        return abs(self.fsdp[step] - self.ddp[step]) / abs(self.ddp[step])

    @property
    def largest(self) -> tuple[int, float]:
        step = max(self.ddp, key=self.relative)
        return step, self.relative(step)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return parse_timing(timing_parser(__doc__.split("\n\n")[0]), argv)


# -- throughput ---------------------------------------------------------------------------------------------------


def measure_throughput(root: Path, data_dir: Path, n: int, args: argparse.Namespace) -> Pair:
    """One repeat: the trainer under fsdp and the minimal FSDP loop, the order reversed every other repeat."""
    log.info("throughput, repeat %d/%d", n + 1, args.repeats)
    if n % 2 == 0:
        trainer = run_trainer(root, data_dir, n, args, parallelism="fsdp")
        minimal = run_minimal(root, data_dir, n, args, MINIMAL_FSDP)
    else:
        minimal = run_minimal(root, data_dir, n, args, MINIMAL_FSDP)
        trainer = run_trainer(root, data_dir, n, args, parallelism="fsdp")
    check_same_work(trainer, minimal)
    pair = Pair("trainer" if n % 2 == 0 else "minimal", trainer, minimal)
    log.info("  ratio %.3f (from median step times %.3f)", pair.ratio, pair.median_ratio)
    return pair


def throughput_table(pairs: list[Pair]) -> str:
    lines = [
        "| repeat | first | train_ddp.py --parallelism fsdp (tokens/s) | minimal_fsdp.py (tokens/s) "
        "| trainer / minimal | same, from median step times | CPUs busy elsewhere |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for n, r in enumerate(pairs, 1):
        lines.append(
            f"| {n} | {r.first} | {r.trainer.tokens_per_s:.0f} | {r.minimal.tokens_per_s:.0f} | "
            f"{r.ratio:.3f} | {r.median_ratio:.3f} | {cpus(r.busy_elsewhere)} |"
        )
    columns = [
        [r.trainer.tokens_per_s for r in pairs],
        [r.minimal.tokens_per_s for r in pairs],
        [r.ratio for r in pairs],
        [r.median_ratio for r in pairs],
    ]
    return "\n".join(lines + summary_rows(columns, ["{:.0f}", "{:.0f}", "{:.3f}", "{:.3f}"]))


def throughput_caption(pairs: list[Pair], args: argparse.Namespace) -> str:
    ratio = statistics.median(r.ratio for r in pairs)
    median_ratio = statistics.median(r.median_ratio for r in pairs)
    threads = max(1, (os.cpu_count() or 1) // args.nproc)
    return (
        f"Throughput: tokens/s of `trainer/train_ddp.py --parallelism fsdp` against `bench/minimal_fsdp.py`, a plain "
        f"FSDP2 loop doing the same math (the model built on the meta device, `fully_shard` on each block and the "
        f"root, `trainer.parallel.initialize`'s initial weights, the same data order, fused AdamW with the trainer's "
        f"groups, schedule and clipping; checked by both ending at the same loss). Preset {args.preset}, batch "
        f"{BATCH_SIZE} x {SEQ_LEN} tokens per rank, {args.nproc} processes under torchrun as the local launcher starts "
        f"them (gloo, CPU, fp32, OMP_NUM_THREADS={threads}); {args.steps} steps, of which steps {args.warmup}-"
        f"{args.steps} are timed: the trainer's from its metrics.jsonl rows (every {LOG_EVERY} steps, its default; one "
        f"checkpoint, after the window), the minimal loop's by its own clock. {len(pairs)} repeat(s), the order "
        f"reversed every other repeat; medians of per-repeat ratios, their spread (min-max) in the last row. "
        f"Target: ratio >= {TARGET}; median {ratio:.3f}, {'met' if ratio >= TARGET else 'not met'} (from median "
        f"step times: {median_ratio:.3f}).{noise_note(pairs)} Rerun with `.venv/bin/python bench/fsdp.py "
        f"--write-results` (a smoke run: `--repeats 1 --steps 30 --warmup 10`)."
    )


# -- memory -------------------------------------------------------------------------------------------------------


def measure_memory(root: Path, parallelism: str, args: argparse.Namespace) -> Memory:
    """bench/fsdp_memory_probe.py under `parallelism`: the readings of the rank whose RssAnon grew most."""
    # glibc gives blocks of 128 KiB and more back to the system when they are freed (its documented tunable; by
    # default its mmap threshold grows to 32 MB and keeps the blocks FSDP frees for reuse): RssAnon is then the
    # memory the process holds, on both sides alike. tests/test_parallel.py measures the same way.
    os.environ[MMAP_THRESHOLD], saved = "131072", os.environ.get(MMAP_THRESHOLD)
    try:
        output, _ = torchrun([str(PROBE), parallelism], root / "memory" / parallelism, args.nproc)
    finally:
        os.environ.pop(MMAP_THRESHOLD) if saved is None else os.environ.__setitem__(MMAP_THRESHOLD, saved)
    result = result_line(output, "parameters")
    ranks = result["ranks"]
    grown = max(ranks, key=lambda r: r["after_step_gib"] - r["baseline_gib"])
    live = None if grown["live_gib"] is None else grown["live_gib"] - grown["baseline_gib"]
    memory = Memory(
        result["parallelism"],
        result["parameters"],
        result["loss"],
        grown["baseline_gib"],
        grown["after_step_gib"] - grown["baseline_gib"],
        live,
        1 if parallelism == "ddp" else len(ranks),
    )
    log.info(
        "  %s: RssAnon grew %.2f GiB (%s live) on the rank that grew most; its state: %.2f GiB",
        parallelism,
        memory.growth_gib,
        gib(memory.live_growth_gib),
        memory.state_gib,
    )
    return memory


def check_same_model(ddp: Memory, fsdp: Memory) -> None:
    """Fail unless both probes built the same model and took the same first step."""
    if ddp.parameters != fsdp.parameters or fsdp.parallelism != "fsdp":
        raise BenchFailed(f"the memory probes differ: {ddp} against {fsdp}")
    if abs(ddp.loss - fsdp.loss) > LOSS_RTOL * abs(ddp.loss):
        raise BenchFailed(f"the memory probes' steps differ: loss {ddp.loss!r} (ddp) against {fsdp.loss!r} (fsdp)")


def gib(value: float | None) -> str:
    return "unknown" if value is None else f"{value:.2f}"


def live_ratio(ddp: Memory, fsdp: Memory) -> str:
    """fsdp's live growth over ddp's, or '' where the allocator could not be trimmed."""
    if ddp.live_growth_gib is None or fsdp.live_growth_gib is None:
        return ""
    return f"{fsdp.live_growth_gib / ddp.live_growth_gib:.3f}"


def memory_table(ddp: Memory, fsdp: Memory) -> str:
    lines = [
        "| parallelism | RssAnon before the build (GiB) | RssAnon growth after the first step (GiB) | the same, live "
        "(GiB) | weights, gradients and AdamW: 16 bytes a parameter / shards (GiB) |",
        "|---|---:|---:|---:|---:|",
    ]
    for m in (ddp, fsdp):
        lines.append(
            f"| {m.parallelism} | {m.baseline_gib:.2f} | {m.growth_gib:.2f} | {gib(m.live_growth_gib)} "
            f"| {m.state_gib:.2f} |"
        )
    live = live_ratio(ddp, fsdp)
    lines.append(
        f"| fsdp / ddp | | {fsdp.growth_gib / ddp.growth_gib:.3f} | {live} | {fsdp.state_gib / ddp.state_gib:.3f} |"
    )
    return "\n".join(lines)


def memory_caption(ddp: Memory, fsdp: Memory, args: argparse.Namespace) -> str:
    from fsdp_memory_probe import BATCH, SEQ_LEN, SHAPE, VOCAB

    ratio = fsdp.growth_gib / ddp.growth_gib
    live = live_ratio(ddp, fsdp)
    return (
        f"Memory: private memory per rank (RssAnon, trainer/metrics.py's rss_gib) after the first optimizer step, "
        f"from `bench/fsdp_memory_probe.py` under torchrun ({args.nproc} processes, gloo, CPU, fp32): a llama-shaped "
        f"model of {ddp.parameters / 1e6:.0f}M parameters ({SHAPE['num_hidden_layers']} blocks of hidden "
        f"{SHAPE['hidden_size']}, vocabulary {VOCAB:,}, untied) built by `trainer.parallel.parallelize` and taking "
        f"one step as the trainer does (a batch of {BATCH} x {SEQ_LEN} tokens: the activations stay small), with the "
        f"trainer's fused AdamW. Growth: RssAnon after the step less RssAnon before "
        f"the build (after the same steps on a small model, so that what they cost whatever the size is in the "
        f"baseline); the rank that grew most. Both sides run with MALLOC_MMAP_THRESHOLD_=131072 (glibc's tunable: "
        f"freed blocks of 128 KiB and more go back to the system; by default its threshold grows to 32 MB and the "
        f"unsharded gradients and all-gathered weights FSDP frees block by block stay in its heap, which put fsdp at "
        f"0.58 of ddp in a smoke run). Live: the same once glibc's malloc_trim has returned any other free pages. "
        f"The step's loss: {ddp.loss:.6f} (ddp), {fsdp.loss:.6f} "
        f"(fsdp). Target: fsdp / ddp <= {MEMORY_TARGET} on {args.nproc} ranks; {ratio:.3f}, "
        f"{'met' if ratio <= MEMORY_TARGET else 'not met'}" + (f" (live: {live})." if live else ".")
    )


# -- loss ---------------------------------------------------------------------------------------------------------


def measure_losses(root: Path, data_dir: Path, args: argparse.Namespace) -> LossCurves:
    """The trainer under ddp and under fsdp for LOSS_STEPS steps, a row every step."""
    curves = {}
    for parallelism in ("ddp", "fsdp"):
        rows, _ = trainer_rows(
            root, data_dir, f"loss-{parallelism}", args, LOSS_STEPS, 1, ["--parallelism", parallelism]
        )
        curves[parallelism] = rows
    ddp, fsdp = curves["ddp"], curves["fsdp"]
    steps = list(range(1, LOSS_STEPS + 1))
    if sorted(ddp) != steps or sorted(fsdp) != steps or any(ddp[s]["tokens"] != fsdp[s]["tokens"] for s in steps):
        raise BenchFailed(f"the loss runs did not log the same {LOSS_STEPS} steps over the same tokens")
    losses = LossCurves({s: ddp[s]["loss"] for s in steps}, {s: fsdp[s]["loss"] for s in steps})
    step, largest = losses.largest
    if largest > LOSS_RTOL:
        raise BenchFailed(
            f"fsdp and ddp did different math: loss {losses.fsdp[step]!r} against {losses.ddp[step]!r} at step {step}"
        )
    log.info("  largest relative loss difference %.2e (step %d)", largest, step)
    return losses


def loss_table(losses: LossCurves) -> str:
    shown = sorted({1, *range(10, LOSS_STEPS + 1, 10), losses.largest[0]})
    lines = ["| step | ddp loss | fsdp loss | relative difference |", "|---:|---:|---:|---:|"]
    for s in shown:
        lines.append(f"| {s} | {losses.ddp[s]:.7f} | {losses.fsdp[s]:.7f} | {losses.relative(s):.2e} |")
    return "\n".join(lines)


def loss_caption(losses: LossCurves, args: argparse.Namespace) -> str:
    step, largest = losses.largest
    steps = sorted(losses.ddp)
    identical = next((s - 1 for s in steps if losses.ddp[s] != losses.fsdp[s]), steps[-1])
    median = statistics.median(losses.relative(s) for s in steps)
    beyond = sum(losses.relative(s) > LOSS_EXPECTED_RTOL for s in steps)
    return (
        f"Loss: the trainer under `--parallelism fsdp` against `--parallelism ddp` for {LOSS_STEPS} steps from the "
        f"same initial weights and data (preset {args.preset}, batch {BATCH_SIZE} x {SEQ_LEN} per rank, {args.nproc} "
        f"processes, a metrics row every step; shown: the first step, every tenth and the largest difference). "
        f"Expected: the same losses to the bit at first, then apart by fp32 rounding only: FSDP reduce-scatters each "
        f"gradient where DDP all-reduces buckets of them, the same sums in another order, so the gradients differ in "
        f"the last bits (about 1e-7 relative) and the difference compounds through AdamW's updates, most where the "
        f"loss is steep; tests/test_parallel.py measured 1.5e-6 over 40 steps of tiny and holds fsdp to "
        f"{LOSS_EXPECTED_RTOL:.0e}. A wrong gradient or a missed update would show as 1e-2 and more (over "
        f"{LOSS_RTOL:.0e} fails this bench). Here: bit-identical for the first {identical} step(s); relative "
        f"difference median {median:.1e}, largest {largest:.2e} at step {step}; {beyond} of {len(steps)} steps over "
        f"{LOSS_EXPECTED_RTOL:.0e}."
    )


# -- the PROJECTION -----------------------------------------------------------------------------------------------


def projection() -> str:
    """A PROJECTION, not a measurement: llama-8b under hsdp on p5.48xlarge nodes."""
    from components.launch_training.manifest import INSTANCE_TYPES, JobSpec
    from components.preflight.checkpoint_throughput import STATE_BYTES_PER_PARAMETER, STATE_MARGIN, CheckpointNeed
    from components.preflight.gpu_memory import GPU_MEMORY_GIB, GPU_MEMORY_TIGHT, GPU_MEMORY_USABLE
    from trainer.memory import GIB, estimate, model_shape
    from trainer.model import model_config

    shape = model_shape(model_config(PROJECTION_PRESET, PROJECTION_VOCAB, PROJECTION_SEQ, eos_token_id=0))
    gpus, gpu_gb = INSTANCE_TYPES[INSTANCE].gpus, GPU_MEMORY_GIB[INSTANCE]
    job = JobSpec(name="projection", image="", trainer_args=[])  # the launcher's defaults: the grace period
    need = CheckpointNeed(
        PROJECTION_PRESET, shape.parameters, PROJECTION_VOCAB, False, job.grace_period_s, job.shutdown_timeout
    )
    fsx_mbps = FSX_GIB / 1000 * FSX_MBPS_PER_TIB  # FSx counts 1,000 GiB per TiB of throughput
    save_s = float(need.seconds_at(Decimal(fsx_mbps)))
    tokens = PROJECTION_BATCH * PROJECTION_SEQ  # per GPU and step: one micro-batch, no accumulation
    lines = [
        "| nodes x GPUs | activation checkpointing | memory per GPU (GiB, PROJECTION) | of the 80 GiB GPU "
        "| step time, compiled (eager) (s, PROJECTION) | tokens/s, all GPUs (PROJECTION) "
        "| two steps + the save (s, PROJECTION) against the budget |",
        "|---|---|---|---|---:|---:|---|",
    ]
    for nodes in PROJECTION_NODES:
        for recompute in ("none", "selective", "full"):
            memory = estimate(shape, "hsdp", nodes * gpus, gpus, PROJECTION_BATCH, PROJECTION_SEQ, recompute)
            share = memory.total / (gpu_gb * GIB)
            fits = "does not fit" if share > GPU_MEMORY_USABLE else "tight" if share > GPU_MEMORY_TIGHT else "fits"
            step = {k: tokens / tps * RECOMPUTE_FACTOR[recompute] for k, tps in PUBLISHED_TPS.items()}
            total_s = 2 * step["compiled"] + save_s
            lines.append(
                f"| {nodes} x {gpus} | {recompute} | {memory.describe()} | {share:.0%}, {fits} "
                f"| {step['compiled']:.2f} ({step['eager']:.2f}) | {nodes * gpus * tokens / step['compiled']:,.0f} "
                f"| {total_s:.0f} of {need.budget_s}: {'fits' if total_s <= need.budget_s else 'does NOT fit'} |"
            )
    text = (
        f"PROJECTION (computed, not measured; every figure in this table and paragraph is derived): "
        f"{PROJECTION_PRESET} (trainer/model.py's preset, vocabulary {PROJECTION_VOCAB:,}: {shape.parameters:,} "
        f"parameters) under hsdp on {' and '.join(map(str, PROJECTION_NODES))} {INSTANCE} nodes ({gpus} H100 "
        f"{gpu_gb} GiB each), a micro-batch of {PROJECTION_BATCH} x {PROJECTION_SEQ} tokens per GPU. Memory per GPU: "
        f"trainer/memory.py's `estimate` (the preflight's gpu-memory check), fitting when under "
        f"{GPU_MEMORY_USABLE:.0%} of the GPU, tight above {GPU_MEMORY_TIGHT:.0%}; hsdp shards within a node, so it is "
        f"the same on 2 and 8 nodes. Step time: {tokens:,} tokens per GPU over torchtitan's published Llama 3.1 8B "
        f"tokens/s per H100 with FSDP2, selective activation checkpointing and a local batch of 2 x 8192 tokens "
        f"({TORCHTITAN}, Table 3, 128 GPUs: {PUBLISHED_TPS['compiled']:,} with torch.compile, which the trainer uses "
        f"for llama-8b on GPUs, and {PUBLISHED_TPS['eager']:,} eager; Table 1's 8 GPUs: 6,667 and 5,762), for none "
        f"taken as selective's and for full x 8/6 (each block's forward again). torchtitan's H100s were 96 GB HBM2e "
        f"at 500 W, the p5's are 80 GB HBM3 at 700 W; at 4,096 tokens attention is a smaller share of the work than "
        f"at 8,192. Checkpoint: the preflight's checkpoint-throughput rule, {shape.parameters:,} parameters x "
        f"{STATE_BYTES_PER_PARAMETER} bytes (fp32 weights and AdamW's two moments; gradients are not saved) = "
        f"{need.state_bytes / 1e9:.1f} GB, {float(need.write_bytes) / 1e9:.1f} GB with its {STATE_MARGIN:.0%} "
        f"margin, written once whatever the node count (DCP writes each replica's shard once); at {fsx_mbps:,.0f} "
        f"MB/s (FSx for Lustre PERSISTENT_2, {FSX_GIB:,} GiB at {FSX_MBPS_PER_TIB:,} MB/s per TiB) it takes "
        f"{save_s:.0f} s. Budget: {need.budget_s} s (the launcher's {job.grace_period_s} s grace period less "
        f"{job.grace_period_s - job.shutdown_timeout} s for torchrun, docs/running.md, Restarts); the trainer warns "
        f"when two steps plus a save exceed it; the preflight fails below {float(need.mbps):,.0f} MB/s (the save in "
        f"half the budget)."
    )
    return text + "\n\n" + "\n".join(lines)


# -- the run ------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    def measure(root: Path, data_dir: Path) -> list[str]:
        pairs = [measure_throughput(root, data_dir, n, args) for n in range(args.repeats)]
        log.info("memory after the first step")
        ddp, fsdp = measure_memory(root, "ddp", args), measure_memory(root, "fsdp", args)
        check_same_model(ddp, fsdp)
        log.info("loss over %d steps", LOSS_STEPS)
        losses = measure_losses(root, data_dir, args)
        return [
            throughput_caption(pairs, args),
            "",
            throughput_table(pairs),
            "",
            memory_caption(ddp, fsdp, args),
            "",
            memory_table(ddp, fsdp),
            "",
            loss_caption(losses, args),
            "",
            loss_table(losses),
            "",
            projection(),
        ]

    return run_bench("fsdp", "FSDP (issue 27)", args, measure)


if __name__ == "__main__":
    sys.exit(main())
