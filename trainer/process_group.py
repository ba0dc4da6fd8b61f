"""Joining torchrun's process group, and the attempt number every rank of a start agrees on.

torchrun (or the PyTorchJob's pods under it) sets the env:// variables; each start of the workers (a torchelastic
restart, a new pod) is an attempt, numbered on the volume so that its logs, NCCL's files and comms reports stay apart.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from trainer.layout import RunPaths
from trainer.private_api import default_store

ATTEMPT_KEY = "hyperpod-pretrain/attempt"


def join(run: RunPaths, use_cuda: bool, timeout: timedelta) -> tuple[int, int, int, torch.device]:
    """Join the process group (NCCL on GPUs, gloo on CPUs); this rank, the world size, this start's attempt number
    and this rank's device. `timeout`: a silent rank fails the others' collectives after it."""
    init_distributed("nccl" if use_cuda else "gloo", timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = agree_on_attempt(run, rank)
    if use_cuda and "NCCL_DEBUG" in os.environ:  # NCCL's lines on the volume, past the pod's life, per attempt
        os.environ["NCCL_DEBUG_FILE"] = str(run.nccl_dir(attempt) / "%h.%p.log")  # read at the first collective
        run.nccl_dir(attempt).mkdir(parents=True, exist_ok=True)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device(f"cuda:{local_rank}") if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    return rank, world, attempt, device


def agree_on_attempt(run: RunPaths, rank: int) -> int:
    """This start's attempt number, the same on every rank: rank 0 takes the next after those on the volume and
    publishes it in the process group's store, the others wait for it there.

    torchrun's restart count is per node and starts again with a new container, and the rendezvous id never
    changes, so neither tells two starts apart. The store is used, not a collective: with NCCL the first collective
    creates the communicator, which must already know its (per-attempt) NCCL_DEBUG_FILE.
    """
    store = default_store()
    if rank == 0:
        attempt = max(run.attempts(), default=0) + 1
        (run.comms / run.attempt(attempt)).mkdir(parents=True, exist_ok=True)
        store.set(ATTEMPT_KEY, str(attempt))
        return attempt
    return int(store.get(ATTEMPT_KEY))


def init_distributed(backend: str, timeout: timedelta) -> None:
    """env:// as torchrun sets it up, with each torchelastic restart's keys apart in the store.

    Without the prefix, a group restarted by torchrun (--max-restarts) can read the previous attempt's
    gloo addresses from the agent's store and fail with "connectFullMesh ... Connection refused".
    """
    if "TORCHELASTIC_RESTART_COUNT" not in os.environ:
        dist.init_process_group(backend, timeout=timeout)
        return
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent_hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world_size=world,
        is_master=rank == 0 and not agent_hosts_store,
        multi_tenant=not agent_hosts_store,
        timeout=timedelta(minutes=15),
    )
    attempt = dist.PrefixStore(f"attempt-{os.environ['TORCHELASTIC_RESTART_COUNT']}", store)
    dist.init_process_group(backend, store=attempt, rank=rank, world_size=world, timeout=timeout)
