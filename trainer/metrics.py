"""Training metrics: the metrics.jsonl rows, throughput, model FLOPs utilisation (MFU), and rank 0's console lines.

The console lines are for a person watching a run (torchtitan's shape): where it is, how fast, and when it ends,

    model 12.3M params; 8,192 tokens per step x 200 steps = 1.6M tokens, 4.5 epochs of the train split (364k tokens)
    step 1 took 2.3s (includes compile/warm-up)
    step 40/200  loss 4.2113  lr 2.9e-3  gnorm 0.83  tok/s 7.1k  mfu —  eta 1m20s

metrics.jsonl keeps the exact numbers; these are rounded for reading.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections import deque
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from trainer.atomic import atomic_open

log = logging.getLogger(__name__)

# Dense bf16 peak of one accelerator, FLOP/s, by its exact name as torch.cuda.get_device_name() gives it (NVIDIA's
# data sheets; the sparse figures halved; torchtitan's tools/utils.py get_peak_flops agrees). A name not here gets
# no MFU, rather than the peak of a relative: an H100 NVL is not an SXM H100.
PEAK_BF16_FLOPS: dict[str, float] = {
    "NVIDIA H100 80GB HBM3": 989e12,  # SXM5: p5
    "NVIDIA H100 PCIe": 756e12,
    "NVIDIA H100 NVL": 835e12,
    "NVIDIA H200": 989e12,  # SXM: p5e, p5en
    "NVIDIA H200 NVL": 835e12,
    "NVIDIA B200": 2250e12,  # p6-b200
    "NVIDIA A100-SXM4-40GB": 312e12,  # p4d
    "NVIDIA A100-SXM4-80GB": 312e12,  # p4de
}


def rss_gib() -> float:
    """This process's private memory, GiB: the launcher quotes it when a worker is OOMKilled.

    RssAnon (Linux): the anonymous pages the process holds, not the file pages a memory-mapped shard maps,
    which the kernel can drop at any time and would make the figure grow with the corpus read. Without
    RssAnon (kernels before 4.5), resident minus shared pages; 0 where there is no /proc (unknown).
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024 / 2**30  # in kB
        with open("/proc/self/statm") as f:
            _, resident, shared, *_ = (int(v) for v in f.read().split())
        return (resident - shared) * os.sysconf("SC_PAGE_SIZE") / 2**30
    except (OSError, ValueError):
        return 0.0


def peak_flops(device: torch.device, given_tflops: float) -> float | None:
    """The peak to measure MFU against: given, or looked up for the GPU; None when unknown (a CPU, a GPU not in
    PEAK_BF16_FLOPS: said once)."""
    if given_tflops:
        return given_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    if name not in PEAK_BF16_FLOPS:
        log.warning(
            "no MFU: no peak FLOP/s known for %r (known: %s); pass --peak-tflops", name, ", ".join(PEAK_BF16_FLOPS)
        )
    return PEAK_BF16_FLOPS.get(name)


def flops_per_token(model: torch.nn.Module, seq_len: int) -> float:
    """Training FLOPs per token: 6 per weight (forward and backward) plus attention over the context.

    The PaLM paper's estimate, 6N + 12 * layers * heads * head_dim * seq_len (heads * head_dim is the width unless a
    config sets head_dim apart, as some published Llamas do), with N the weights that take part in a matmul:
    not the position embeddings nor an untied token embedding (lookups); a tied one counts once, as the output
    projection (torchtitan counts the same way). At llama-8b (untied) counting the token embedding overstated MFU by
    about 5% at seq 8192.
    """
    config = model.config
    lookup = model.get_input_embeddings().weight
    tied = bool(getattr(config, "tie_word_embeddings", False))  # the config's word, whatever sharding did to the tie
    n = sum(p.numel() for name, p in model.named_parameters() if "wpe" not in name and (tied or p is not lookup))
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads  # a Llama may set it apart
    return 6 * n + 12 * config.num_hidden_layers * heads * head_dim * seq_len


class MetricsLog:
    """Rank 0's metrics.jsonl: one row per logged step; rows past a resumed step are dropped."""

    def __init__(self, path: Path, enabled: bool):
        self.path, self.enabled = path, enabled

    def truncate_after(self, step: int) -> None:
        """After a resume from `step`, rows logged beyond it (before a crash) would be logged again."""
        if not (self.enabled and self.path.exists()):
            return
        rows = self.path.read_text().splitlines()
        kept = [r for r in rows if r.strip() and json.loads(r)["step"] <= step]
        if len(kept) != len(rows):
            with atomic_open(self.path, "w") as f:
                f.writelines(r + "\n" for r in kept)
            log.info("dropped %d metrics rows logged after step %d", len(rows) - len(kept), step)

    def write(self, row: dict[str, Any]) -> None:
        if self.enabled:
            with open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")


class Throughput:
    """Tokens/s and step time over the steps since the last report."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.started, self.tokens, self.steps = time.perf_counter(), 0, 0

    def add(self, tokens: int) -> None:
        self.tokens += tokens
        self.steps += 1

    def report(self) -> tuple[float, float]:
        """(tokens per second, seconds per step) since the last report, then start a new window."""
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        result = self.tokens / elapsed, elapsed / max(self.steps, 1)
        self.reset()
        return result


class StepTimes:
    """Seconds per step over the recent steps, for the ETA: from the times at which steps ended where the host waited
    for the device (the first step of the process, then each logged step), so that a queue of asynchronous work does
    not pass for speed. The first step's own time (compile, warm-up) is left out: it is measured from its end."""

    def __init__(self, windows: int = 5) -> None:
        self.marks: deque[tuple[int, float]] = deque(maxlen=windows + 1)

    def mark(self, step: int, now: float) -> None:
        if not self.marks or step > self.marks[-1][0]:
            self.marks.append((step, now))

    def seconds_per_step(self) -> float | None:
        """The mean over the last few marked windows; None before two marks."""
        if len(self.marks) < 2:
            return None
        (first_step, first_time), (last_step, last_time) = self.marks[0], self.marks[-1]
        return (last_time - first_time) / (last_step - first_step)

    def eta_s(self, step: int, max_steps: int) -> float | None:
        per_step = self.seconds_per_step()
        return None if per_step is None else per_step * max(0, max_steps - step)


class StepMetrics:
    """What a metrics.jsonl row says of the steps since the previous row: the loss and gradient norm of its own step,
    throughput and MFU, the loop's waits (for input, for the ranks' agreement: sync_wait_s, added by the loop) and
    the checkpoint saves' stall (save_stall_s, likewise), memory peaks; and the step times for the ETA."""

    def __init__(self, rank: int, world: int, device: torch.device, flops_per_step: float, peak: float | None):
        self.rank, self.world, self.device = rank, world, device
        self.flops_per_step, self.peak = flops_per_step, peak  # MFU's numerator per step, and its denominator per rank
        self.throughput, self.step_times = Throughput(), StepTimes()
        self.steps, self.sync_wait_s, self.save_stall_s = 0, 0.0, 0.0

    def stepped(self, tokens: int) -> None:
        """A step of `tokens` (over all ranks) is done."""
        self.throughput.add(tokens)
        self.steps += 1

    def row(
        self,
        step: int,
        tokens_seen: int,
        loss: torch.Tensor,
        grad_norm: torch.Tensor,
        lr: float,
        input_wait_s: float,
        skipped_steps: int,
        first_step: bool,
    ) -> tuple[dict[str, Any], float]:
        """Collective: the row of `step` (`loss`: this rank's mean over its micro-batches), and the tokens per second
        since the last row (unrounded, for the console); then a new interval begins."""
        world, device, cuda = self.world, self.device, self.device.type == "cuda"
        # One collective for the row: the loss summed over the ranks, each rank's private memory in its own slot
        # (gloo has no average, and a sum of slots gives every rank's, for the maximum).
        row_values = torch.zeros(1 + world, device=device)
        row_values[0] = loss
        row_values[1 + self.rank] = rss_gib()
        dist.all_reduce(row_values)
        loss_total, *rss_all, norm = torch.cat([row_values, grad_norm.reshape(1).float()]).tolist()
        tokens_per_s, seconds_per_step = self.throughput.report()
        row = {
            "step": step,
            "loss": loss_total / world,
            "lr": lr,
            "grad_norm": norm,
            "tokens": tokens_seen,
            "tokens_per_s": round(tokens_per_s, 1),
            "step_time_s": round(seconds_per_step, 4),
            "input_wait_s": round(input_wait_s / self.steps, 4),
            "sync_wait_s": round(self.sync_wait_s / self.steps, 4),
            "checkpoint_stall_s": round(self.save_stall_s, 4),  # the saves' hold on training since the last row
            # Not for the first step alone: its time is mostly compilation and warm-up.
            "mfu": round(self.flops_per_step / seconds_per_step / (self.peak * world), 4)
            if self.peak and not first_step
            else None,
            "gpu_mem_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if cuda else None,
            "gpu_reserved_gib": round(torch.cuda.max_memory_reserved(device) / 2**30, 2) if cuda else None,
            "rss_gib": round(max(rss_all), 2),
            "skipped_steps": skipped_steps,
            "time": time.time(),
        }
        self.steps, self.sync_wait_s, self.save_stall_s = 0, 0.0, 0.0
        return row, tokens_per_s


NO_VALUE = "—"  # a figure this run cannot have (MFU on a CPU) or does not have yet (the ETA before two marks)
_UNITS = ((1e3, "k"), (1e6, "M"), (1e9, "B"), (1e12, "T"))


def human_count(value: float) -> str:
    """950, 7.1k, 364k, 1.6M, 12.3M, 2.1B: three significant figures at most, one decimal below 100 of the unit; the
    smallest unit in which the rounded figure stays below 1000."""
    if round(abs(value)) < 1000:
        return f"{value:.0f}"
    size, unit = next(((size, unit) for size, unit in _UNITS if round(abs(value) / size) < 1000), _UNITS[-1])
    scaled = value / size
    return f"{scaled:.1f}{unit}" if round(abs(scaled), 1) < 100 else f"{scaled:.0f}{unit}"


def human_duration(seconds: float | None) -> str:
    """45s, 1m20s, 1h02m, 3d04h; the unknown as NO_VALUE."""
    if seconds is None or not math.isfinite(seconds):
        return NO_VALUE
    whole = round(max(0.0, seconds))
    minutes, secs = divmod(whole, 60)
    hours, minutes = divmod(minutes, 60)
    days, hours = divmod(hours, 24)
    if days:
        return f"{days}d{hours:02d}h"
    if hours:
        return f"{hours}h{minutes:02d}m"
    if minutes:
        return f"{minutes}m{secs:02d}s"
    return f"{secs}s"


def short_float(value: float) -> str:
    """A learning rate as people write it: 2.9e-3, not 2.90e-03."""
    mantissa, exponent = f"{value:.1e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def step_line(
    step: int,
    max_steps: int,
    loss: float,
    lr: float,
    grad_norm: float,
    tokens_per_s: float,
    mfu: float | None,
    eta_s: float | None,
) -> str:
    """Rank 0's line at a logged step: position, loss, learning rate, gradient norm, throughput, MFU, time left."""
    return "  ".join(
        [
            f"step {step}/{max_steps}",
            f"loss {loss:.4f}",
            f"lr {short_float(lr)}",
            f"gnorm {grad_norm:.2f}",
            f"tok/s {human_count(tokens_per_s)}",
            f"mfu {NO_VALUE if mfu is None else f'{mfu:.1%}'}",
            f"eta {human_duration(eta_s)}",
        ]
    )


def eval_line(step: int, row: dict[str, Any]) -> str:
    """An eval step's line: the val loss, bits per byte and tokens; of a mixture each dataset's val loss too."""
    datasets = row.get("datasets", {})
    each = "".join(f"; {name} {figures['val_loss']:.4f}" for name, figures in datasets.items() if "val_loss" in figures)
    return (
        f"eval step {step}: val loss {row['val_loss']:.4f} ({row['val_bpb']:.4f} bits per byte, "
        f"{row['val_tokens']:,} tokens){each}"
    )


def plan_line(parameters: int, tokens_per_step: int, max_steps: int, train_tokens: int) -> str:
    """What the run is about to do, in one line: its size, its tokens, and how many passes over the train split
    they make (a run of many epochs over a small split memorises it)."""
    total = tokens_per_step * max_steps
    epochs = total / train_tokens if train_tokens else math.inf
    passes = f"{epochs:.0f}" if epochs >= 10 else f"{epochs:.1f}" if epochs >= 0.1 else f"{epochs:.2g}"
    return (
        f"model {human_count(parameters)} params; {tokens_per_step:,} tokens per step x {max_steps:,} steps = "
        f"{human_count(total)} tokens, {passes} epochs of the train split "
        f"({human_count(train_tokens)} tokens)"
    )
