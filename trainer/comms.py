"""The communication self-test every rank runs at start-up, and the report verify_nccl reads.

An all_reduce of known values proves the collective gives the right answer across every rank; a timed
all_reduce of a larger buffer gives the bus bandwidth (algbw * 2(n-1)/n, as nccl-tests reports it).
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

import torch
import torch.distributed as dist


def self_test(device: torch.device, size_mib: float = 8.0, iters: int = 5) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()

    # Rank r contributes r + 1 in every element: the sum is n(n+1)/2 everywhere.
    probe = torch.full((1024,), float(rank + 1), device=device)
    dist.all_reduce(probe)
    expected = world * (world + 1) / 2
    correct = bool(torch.all(probe == expected).item())

    numel = max(1, int(size_mib * 2**20) // 4)
    buf = torch.ones(numel, dtype=torch.float32, device=device)
    dist.all_reduce(buf)  # warm-up: first use sets up connections
    _sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(buf)
    _sync(device)
    seconds = (time.perf_counter() - start) / iters
    algbw = numel * 4 / seconds / 1e9
    busbw = algbw * 2 * (world - 1) / world if world > 1 else algbw

    return {
        "rank": rank,
        "world_size": world,
        "local_rank": int(os.environ.get("LOCAL_RANK", 0)),
        "hostname": socket.gethostname(),
        "pid": os.getpid(),
        "backend": dist.get_backend(),
        "device": str(device),
        "torch_version": torch.__version__,
        "nccl_version": ".".join(map(str, torch.cuda.nccl.version())) if device.type == "cuda" else None,
        "restart_count": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
        "all_reduce_expected": expected,
        "all_reduce_min": float(probe.min().item()),
        "all_reduce_max": float(probe.max().item()),
        "all_reduce_correct": correct,
        "bandwidth_bytes": numel * 4,
        "bandwidth_iters": iters,
        "all_reduce_seconds": seconds,
        "algbw_gbps": algbw,
        "busbw_gbps": busbw,
        "time": time.time(),
    }


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
