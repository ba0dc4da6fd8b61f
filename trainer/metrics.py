"""Training metrics: the metrics.jsonl rows, throughput and model FLOPs utilisation (MFU)."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch

from trainer.atomic import atomic_open

log = logging.getLogger(__name__)

# Dense bf16 peak of one accelerator, FLOP/s, by a name fragment of torch.cuda.get_device_name();
# the first match wins, so the more specific names come first.
PEAK_BF16_FLOPS: list[tuple[str, float]] = [
    ("H100 PCIe", 756e12),
    ("H200", 989e12),
    ("H100", 989e12),
    ("A100", 312e12),
]


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
    """The peak to measure MFU against: given, or looked up for the GPU; None when unknown (CPU)."""
    if given_tflops:
        return given_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for fragment, flops in PEAK_BF16_FLOPS:
        if fragment in name:
            return flops
    log.warning("no peak FLOP/s known for %s: pass --peak-tflops to get MFU", name)
    return None


def flops_per_token(model: torch.nn.Module, seq_len: int) -> float:
    """Training FLOPs per token: 6 per weight (forward and backward) plus attention over the context.

    The PaLM paper's estimate, 6N + 12 * layers * width * seq_len, with N the weights less the position
    embeddings (a lookup, not a matmul).
    """
    config = model.config
    n = sum(p.numel() for name, p in model.named_parameters() if "wpe" not in name)
    return 6 * n + 12 * config.num_hidden_layers * config.hidden_size * seq_len


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
