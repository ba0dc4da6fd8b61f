"""NCCL debug output rendered from NCCL's and aws-ofi-nccl's own format strings (tests/nccl_formats.py), per version.

One `Job` describes a run (nodes, GPUs, NCCL version, network and libfabric provider); `process_lines` writes what
one rank's process prints around communicator start-up and the first collective, in the order that version prints
it: version, bootstrap, network and provider, then (before 2.22) channels and the connected lines before Init
COMPLETE, or (2.22+, lazy connection) Init COMPLETE first and the channels and connected lines when the first
all_reduce runs. With `hsdp`, each process then does the same for its other communicators (FSDP2's 2-D mesh:
its node's shard group, its replica group), each printing its own "Using network" (src/init.cc commAlloc, once per
communicator) and its ranks within it. Variations (a Socket or tcp-provider fallback, a WARN, a rank that never
initialises or never connects, a replica group that never connects) are fields. Every line a check reads (prefixes,
WARN, version, bootstrap, network, provider, inter-node channels, connected, Init COMPLETE) comes from a format
string of its version; the rest is chatter in NCCL's shape (intra-node channels, the communicator's info line, the
NET transport's own announcement, tuning lines).
"""

from __future__ import annotations

import gzip
from dataclasses import dataclass, field
from pathlib import Path

from tests.nccl_formats import NCCL_VERSIONS, OFI_RELEASES, OFI_WARN_FUNCTION, NcclFormats, c_format, c_format_named

# NCCL's own WARNs carry __FILE__:__LINE__; these are real call sites (src/transport/net.cc, src/misc/socket.cc).
NCCL_WARN_SITES = ("transport/net.cc", 845), ("misc/socket.cc", 484)
WARN_TIMESTAMP = "[2026-11-30 10:00:03] "  # strftime("[%F %T] ") of NCCL 2.26+ on WARN lines


@dataclass(frozen=True)
class Communicator:
    """One NCCL communicator of a job: its members (global ranks, in the order of their ranks in it)."""

    name: str  # world, shard, replica
    members: tuple[int, ...]
    serial: int  # 0 for the world's, then one per group of the job
    all_reduce: bool  # runs all_reduce (rings and trees); HSDP's shard groups only all-gather and reduce-scatter

    def color(self) -> int:
        """PyTorch's split color for the group: a hash of its ranks, as a non-negative C int (torch 2.13,
        torch/distributed/distributed_c10d.py, _process_group_color)."""
        return abs(hash(self.members)) % 2**31


@dataclass
class Job:
    nodes: int = 2
    gpus: int = 8
    nccl: str = "2.21.5"  # a key of NCCL_VERSIONS
    network: str = "efa"  # efa (aws-ofi-nccl), ib, socket
    ofi: str = "1.9"  # aws-ofi-nccl release (a key of OFI_RELEASES): how it names itself and its provider
    nics: int = 32
    channels: int = 8
    comm_id: str = "0x5f3c2a1b9e8d7c60"
    gdr: bool = True
    nvls: bool = False  # H100/H200 with NVLS: "Connected NVLS tree" where trees would be
    versions: dict[int, str] = field(default_factory=dict)  # rank -> another NCCL version
    socket_ranks: set[int] = field(default_factory=set)  # these ranks fall back to NCCL's Socket transport
    tcp_ranks: set[int] = field(default_factory=set)  # these ranks' aws-ofi-nccl picks libfabric's tcp provider
    silent_ranks: set[int] = field(default_factory=set)  # these never reach Init COMPLETE
    unconnected_ranks: set[int] = field(default_factory=set)  # initialised, but never connect (lazy, 2.22+)
    warn_ranks: dict[int, list[str]] = field(default_factory=dict)  # rank -> WARN messages it prints
    filler: int = 0  # extra INFO lines per process (tuning chatter), to make logs big
    # FSDP2's HSDP (trainer/parallel.py): a (replicate, shard) mesh of nodes x GPUs, so a shard group per node and a
    # replica group per local rank beside the world. PyTorch makes a group's communicator at its first collective
    # through ncclCommInitRankConfig with an id of its own, or, when the default group is bound to a device, splits
    # them from the world's (`split`: ncclCommSplit) as the mesh is made, dimension by dimension, replicate first
    # (torch 2.13: torch/distributed/distributed_c10d.py init_process_group's device_id; device_mesh.py
    # _init_process_groups).
    hsdp: bool = False
    split: bool = False
    unconnected_replicas: set[int] = field(default_factory=set)  # these replica groups (by local rank) never connect

    @property
    def world(self) -> int:
        return self.nodes * self.gpus

    def host(self, rank: int) -> str:
        return f"ip-10-1-{rank // self.gpus}-{17 + rank // self.gpus}"

    def pid(self, rank: int) -> int:
        return 4000 + rank * 7

    def communicators(self, rank: int) -> list[Communicator]:
        """The rank's communicators in the order its process makes them: the world's at the self-test all_reduce,
        then its shard group's at FSDP2's first all-gather and its replica group's at the first gradient all-reduce
        (or, split, in the mesh's order of dimensions)."""
        world = Communicator("world", tuple(range(self.world)), 0, all_reduce=True)
        if not self.hsdp:
            return [world]
        node, local = divmod(rank, self.gpus)
        shard = Communicator("shard", tuple(node * self.gpus + g for g in range(self.gpus)), 1 + node, all_reduce=False)
        replica = Communicator(
            "replica", tuple(n * self.gpus + local for n in range(self.nodes)), 1 + self.nodes + local, all_reduce=True
        )
        return [world, replica, shard] if self.split else [world, shard, replica]

    def comm_hash(self, comm: Communicator) -> int:
        """Its commId (a hash in NCCL): the job's for the world, one of its own for each group."""
        return int(self.comm_id, 16) ^ (comm.serial * 0x9E3779B97F4A7C15 % 2**64)


def network_words(job: Job, rank: int) -> tuple[str, list[str]]:
    """The NET name in channel lines, and the INFO messages announcing the network."""
    using = NCCL_VERSIONS[job.nccl].network
    if rank in job.socket_ranks or job.network == "socket":
        return "Socket", ["NET/Socket : Using [0]eth0:10.1.0.17<0>", c_format(using, "Socket")]
    if job.network == "ib":
        return "IB", ["NET/IB : Using [0]mlx5_0:1/IB ; OOB eth0:10.1.0.17<0>", c_format(using, "IB")]
    ofi = OFI_RELEASES[job.ofi]
    provider, fabric = ("tcp", "10.1.0.0/16") if rank in job.tcp_ranks else ("efa", "efa-direct")
    args = {1: (provider,), 2: (provider, job.nics), 3: (provider, fabric, job.nics)}[ofi.provider.count("%")]
    return ofi.network_name, ["NET/OFI " + c_format(ofi.provider, *args), c_format(using, ofi.network_name)]


def process_lines(job: Job, rank: int) -> list[str]:
    version = job.versions.get(rank, job.nccl)
    f = NCCL_VERSIONS[version]
    host, pid, local = job.host(rank), job.pid(rank), rank % job.gpus
    main, worker = (host, pid, pid), (host, pid, pid + 60)

    def with_message(fmt: str) -> str:  # 2.29+ prints the message through the prefix's own "%s"
        return fmt if fmt.endswith("%s") else fmt + "%s"

    def info(thread: tuple[str, int, int], message: str) -> str:
        if f.host_prefix:  # 2.26+: the pieces; no timestamp on INFO by default
            return c_format(f.host_prefix, *thread) + c_format(with_message(f.info_prefix), local, message)
        return c_format(f.info_prefix, *thread, local) + message

    def warn(thread: tuple[str, int, int], message: str, index: int) -> list[str]:
        """A WARN is preceded by an empty line (its format starts with a newline) and carries its source."""
        where, line = (OFI_WARN_FUNCTION, 259) if message.startswith("NET/OFI") else NCCL_WARN_SITES[index % 2]
        if not f.host_prefix:
            return ["", c_format(f.warn_prefix.lstrip("\n"), *thread, local, where, line) + message]
        if f.warn_prefix_func and not message.startswith("NET/OFI"):  # 2.32+: the function, where NCCL names one
            level = c_format(f.warn_prefix_func, local, where, line, "ncclProxyConnect", message)
        else:
            level = c_format(with_message(f.warn_prefix), local, where, line, message)
        return ["", WARN_TIMESTAMP + c_format(f.host_prefix, *thread) + level]

    net, announce = network_words(job, rank)
    out = [info(main, c_format(f.bootstrap, f" eth0:10.1.{rank // job.gpus}.17<0>"))]
    if local == 0:
        out.append(info(main, f.version_line))
    out += [info(worker, line) for line in announce[:-1]]
    for made, comm in enumerate(job.communicators(rank)):
        me = comm.members.index(rank)
        pointer = f"0x7f{comm.serial or ''}{rank:04x}"
        on_my_node = [m for m in comm.members if m // job.gpus == rank // job.gpus]
        nodes = len({m // job.gpus for m in comm.members})
        out.append(info(worker, announce[-1]))  # "Using network %s": once per communicator
        out.append(
            info(
                worker,
                f"comm {pointer} rank {me} nRanks {len(comm.members)} nNodes {nodes} localRanks "
                f"{len(on_my_node)} localRank {on_my_node.index(rank)} MNNVL 0",
            )
        )
        if rank in job.silent_ranks:
            return out
        split = job.split and comm.serial > 0
        values = dict(
            comm=pointer,
            rank=me,
            nranks=len(comm.members),
            cudaDev=local,
            nvmlDev=local,
            busId=0x53000 + local * 0x10000,
            commId=job.comm_hash(comm),
            parent=f"0x7f{rank:04x}",
            splitCount=made,
            childCount=made,
            color=comm.color(),
            key=rank,
        )
        init = (
            c_format_named(f.split_complete, **values, function="ncclCommSplit")
            if split and f.split_complete
            else c_format_named(f.init_complete, **values, function=f.init_function)
        )
        never = rank in job.unconnected_ranks or (comm.name == "replica" and local in job.unconnected_replicas)
        connections = [] if never else connection_lines(job, f, comm, rank, net)
        if f.lazy:  # NCCL_RUNTIME_CONNECT: channels connect when the communicator's first collective runs
            out.append(info(main, init))
            out += [info(worker, line) for line in connections]
        else:
            out += [info(worker, line) for line in connections]
            out.append(info(main, init))
    for i, message in enumerate(job.warn_ranks.get(rank, [])):
        out += warn(worker, message, i)
    for i in range(job.filler):
        right = (rank + 1) % job.world
        out.append(
            info(
                worker, f"Channel {i % 32:02d}/1 : {rank}[{local}] -> {right}[{right % job.gpus}] via SHM/direct/direct"
            )
        )
        out.append(info(worker, "threadThresholds 8/8/64 | 128/8/64 | 512 | 512"))
    return out


def connection_lines(job: Job, f: NcclFormats, comm: Communicator, rank: int, net: str) -> list[str]:
    """The channel lines and the connected lines of one process in one communicator, as its version words them.

    Ranks are the communicator's (src/transport/net.cc prints myInfo->rank and peerInfo->rank), each followed by
    its GPU. Its members on a node are consecutive; the first and the last of them on each node connect across
    nodes (to the member as far along as there are members per node), the others to the next member, within the
    node. A communicator within one node has no inter-node channel; one of a rank per node has nothing else.
    """
    local, n = rank % job.gpus, len(comm.members)
    me, per_node = comm.members.index(rank), sum(1 for m in comm.members if m // job.gpus == rank // job.gpus)
    across = any(m // job.gpus != rank // job.gpus for m in comm.members)
    lines = []
    extra = f.send.count("%s") - 1  # the suffixes after the device: GDRDMA, then (PCI), /Shared, ...
    for channel in range(job.channels):
        if across and me % per_node in (0, per_node - 1):
            peer = (me + per_node) % n
            gpu = comm.members[peer] % job.gpus
            # No GPUDirect RDMA over NCCL's Socket net: it takes host memory only (NVIDIA/nccl v2.21.5-1,
            # src/transport/net_socket.cc, ncclNetSocketGetProperties: ptrSupport NCCL_PTR_HOST).
            suffix = ("/GDRDMA" if job.gdr and net != "Socket" else "",) + ("",) * (extra - 1)
            lines.append(c_format(f.send, channel, 0, me, local, peer, gpu, net, local % 4, *suffix))
            receive_suffix = suffix + ("",) * (f.receive.count("%s") - 1 - extra)
            lines.append(c_format(f.receive, channel, 0, peer, gpu, me, local, net, local % 4, *receive_suffix))
        else:
            via = "P2P/IPC/read" if channel % 2 else "P2P/CUMEM/read"
            right = (me + 1) % n
            right_gpu = comm.members[right] % job.gpus
            lines.append(f"Channel {channel:02d}/0 : {me}[{local}] -> {right}[{right_gpu}] via {via}")
    rings = c_format(f.rings, 0, 1) if "%d" in f.rings else f.rings
    lines.append(rings)
    if comm.all_reduce or not f.lazy:  # before 2.22 trees connect at init too (src/init.cc initTransportsRank)
        lines.append(f.nvls if job.nvls and across and per_node > 1 else f.trees)
    return lines


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


def write_pod_logs(
    job: Job, directory: Path, prefix: bool = True, timestamps: bool = True, crlf: bool = False, ansi: bool = False
) -> list[Path]:
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
