"""NCCL debug output as NCCL 2.18-2.30 and aws-ofi-nccl print it (see DESIGN.md), for tests and the benchmark.

One `Job` describes a run (nodes, GPUs, NCCL version, network); `process_lines` writes what one rank's
process prints at communicator start-up, in the order NCCL prints it: version, bootstrap, network and
provider, channels (ring and tree, inter-node over the network and intra-node over P2P/SHM), the
connected lines and Init COMPLETE. Variations (old/new wording, a Socket fallback, a WARN...) are fields.
"""

from __future__ import annotations

import gzip
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Job:
    nodes: int = 2
    gpus: int = 8
    version: str = "2.21.5+cuda12.4"
    network: str = "efa-old"  # efa-old (aws-ofi-nccl <= 1.12), efa-new (>= 1.13), ib, socket
    nics: int = 32
    channels: int = 8
    comm_id: str = "0x5f3c2a1b9e8d7c60"
    gdr: bool = True
    versions: dict[int, str] = field(default_factory=dict)  # rank -> another version
    socket_ranks: set[int] = field(default_factory=set)  # these ranks fall back to Socket
    silent_ranks: set[int] = field(default_factory=set)  # these never reach Init COMPLETE
    warn_ranks: dict[int, list[str]] = field(default_factory=dict)  # rank -> extra WARN/error lines
    filler: int = 0  # extra INFO lines per process (tuning chatter), to make logs big

    @property
    def world(self) -> int:
        return self.nodes * self.gpus

    def host(self, rank: int) -> str:
        return f"ip-10-1-{rank // self.gpus}-{17 + rank // self.gpus}"

    def pid(self, rank: int) -> int:
        return 4000 + rank * 7


def network_words(job: Job, rank: int) -> tuple[str, list[str]]:
    """The transport name in channel lines, and the lines announcing the network."""
    if rank in job.socket_ranks or job.network == "socket":
        return "Socket", ["NET/Socket : Using [0]eth0:10.1.0.17<0>", "Using network Socket"]
    if job.network == "ib":
        return "IB", ["NET/IB : Using [0]mlx5_0:1/IB ; OOB eth0:10.1.0.17<0>", "Using network IB"]
    if job.network == "efa-new":
        return "Libfabric", [
            f"NET/OFI Selected provider is efa, fabric is efa-direct (found {job.nics} nics)",
            "Using network Libfabric",
        ]
    return "AWS Libfabric", [f"NET/OFI Selected Provider is efa (found {job.nics} nics)", "Using network AWS Libfabric"]


def process_lines(job: Job, rank: int) -> list[str]:
    host, pid, local = job.host(rank), job.pid(rank), rank % job.gpus
    main, worker = f"{host}:{pid}:{pid}", f"{host}:{pid}:{pid + 60}"
    net, announce = network_words(job, rank)
    version = job.versions.get(rank, job.version)
    out = [f"{main} [{local}] NCCL INFO Bootstrap : Using eth0:10.1.{rank // job.gpus}.17<0>"]
    if local == 0:
        out.append(f"{main} [{local}] NCCL INFO NCCL version {version}")
    out += [f"{worker} [{local}] NCCL INFO {line}" for line in announce]
    out.append(f"{worker} [{local}] NCCL INFO comm 0x7f{rank:04x} rank {rank} nRanks {job.world} nNodes {job.nodes} "
               f"localRanks {job.gpus} localRank {local} MNNVL 0")  # fmt: skip
    right = (rank + 1) % job.world
    for channel in range(job.channels):
        gdr = "/GDRDMA" if job.gdr else ""
        if job.nodes > 1 and (local == job.gpus - 1 or local == 0):
            peer = (rank + job.gpus) % job.world
            out.append(f"{worker} [{local}] NCCL INFO Channel {channel:02d}/0 : {rank}[{local}] -> {peer}[{local}] "
                       f"[send] via NET/{net}/{local % 4}{gdr}")  # fmt: skip
            out.append(f"{worker} [{local}] NCCL INFO Channel {channel:02d}/0 : {peer}[{local}] -> {rank}[{local}] "
                       f"[receive] via NET/{net}/{local % 4}{gdr}")  # fmt: skip
        else:
            via = "P2P/IPC/read" if channel % 2 else "P2P/CUMEM/read"
            out.append(f"{worker} [{local}] NCCL INFO Channel {channel:02d}/0 : {rank}[{local}] -> "
                       f"{right}[{right % job.gpus}] via {via}")  # fmt: skip
    for i in range(job.filler):
        out.append(f"{worker} [{local}] NCCL INFO Channel {i % 32:02d}/1 : {rank}[{local}] -> "
                   f"{right}[{right % job.gpus}] via SHM/direct/direct")  # fmt: skip
        out.append(f"{worker} [{local}] NCCL INFO threadThresholds 8/8/64 | 128/8/64 | 512 | 512")
    if rank in job.silent_ranks:
        return out[: len(out) // 2]
    for line in job.warn_ranks.get(rank, []):
        out.append(f"{worker} [{local}] NCCL {line}")
    rings = "Connected all rings, use ring PXN 0 GDR 1" if job.network == "efa-new" else "Connected all rings"
    out += [
        f"{worker} [{local}] NCCL INFO {rings}",
        f"{worker} [{local}] NCCL INFO Connected all trees",
        f"{main} [{local}] NCCL INFO ncclCommInitRank comm 0x7f{rank:04x} rank {rank} nranks {job.world} cudaDev "
        f"{local} nvmlDev {local} busId {0x53000 + local * 0x10000:x} commId {job.comm_id} - Init COMPLETE",
    ]
    return out


def write_debug_files(job: Job, directory: Path, gz: bool = False) -> list[Path]:
    """One NCCL_DEBUG_FILE per process, named %h.%p.log as the launcher sets it."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for rank in range(job.world):
        text = "\n".join(process_lines(job, rank)) + "\n"
        path = directory / f"{job.host(rank)}.{job.pid(rank)}.log{'.gz' if gz else ''}"
        path.write_bytes(gzip.compress(text.encode()) if gz else text.encode())
        paths.append(path)
    return paths


def write_pod_logs(job: Job, directory: Path, prefix: bool = True, timestamps: bool = True, crlf: bool = False,
                   ansi: bool = False) -> list[Path]:  # fmt: skip
    """One pod log per node, its ranks' lines interleaved, as `kubectl logs [--prefix] [--timestamps]` shows it."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for node in range(job.nodes):
        per_rank = [process_lines(job, node * job.gpus + g) for g in range(job.gpus)]
        lines, i = [], 0
        while any(per_rank):
            for queue in per_rank:
                if queue:
                    line = queue.pop(0)
                    if ansi:
                        line = line.replace("NCCL INFO", "\x1b[32mNCCL INFO\x1b[0m")
                    if timestamps:
                        line = f"2026-11-30T10:00:{i // 1000:02d}.{i % 1000:03d}123456Z {line}"
                    if prefix:
                        line = f"[pod/pretrain-worker-{node}/pytorch] {line}"
                    lines.append(line)
                    i += 1
        path = directory / f"pretrain-worker-{node}.log"
        path.write_bytes(("\r\n" if crlf else "\n").join(lines).encode() + b"\n")
        paths.append(path)
    return paths
