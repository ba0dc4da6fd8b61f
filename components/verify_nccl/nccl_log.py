"""A streaming parser of NCCL's debug output: per-process files, pod logs, any mix, any size.

Input: NCCL_DEBUG_FILE files (`host:pid:tid [localrank] NCCL INFO ...`) and pod logs, also with the
`[pod/name/container] ` and timestamp prefixes `kubectl logs --prefix --timestamps` adds, ANSI colour,
CRLF line ends, a truncated last line, gzip. Files are read in large blocks cut at line ends; each block
is scanned in C, never line by line in Python: the channel lines (most of any NCCL log) by one regex
whose matches are counted by a Counter, the rare lines by fast substring search, each hit then parsed on
its own. Memory is bounded by the number of processes, ranks and communicators, not the size of the logs.

The wording is that of NCCL 2.18 to 2.32 and aws-ofi-nccl 1.7 to the newest, each pattern below beside the
source it follows (repository NVIDIA/nccl or aws/aws-ofi-nccl, the release, file and function); the tests render
their fixtures from those releases' format strings (tests/nccl_formats.py) and check the strings against the
compiled libnccl.so of each release.

A process may hold several communicators (FSDP2's HSDP: the world's, its node's shard group, its replica group), and
NCCL names ranks within a communicator, never globally: a channel line says neither which communicator it belongs to
nor the global ranks. So each process keeps its rank in every communicator it initialised, and its inter-node channel
lines by the (its rank, peer rank) pair they name; `comm_channels` then gives each line to its communicator.
"""

from __future__ import annotations

import gzip
import os
import re
import zlib
from collections import Counter
from collections.abc import Iterable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

BLOCK = 8 * 2**20
MAX_PROBLEMS = 200  # WARN and error lines kept (all are counted)

_ANSI = re.compile(rb"\x1b\[[0-9;]*[A-Za-z]")
# src/transport/net.cc sendSetup/recvSetup, 2.18-2.32: "Channel %02d/%d : %d[%d] -> %d[%d] [send] via NET/%s/%d%s%s"
# (2.26+: one more "%s"; the "[%d]" after a rank is its nvmlDev; "%d(%d)" names a PXN proxy rank). The ranks are
# myInfo->rank and peerInfo->rank: ranks within the communicator. Matched with the process's prefix, "%s:%d:%d [%d]
# NCCL INFO " in every release (src/debug.cc ncclDebugLog), as one search: these are the many of the rare lines.
_NET_CHANNEL = re.compile(
    rb"([^\s:\[\]]+):(\d+):\d+ \[(\d+)\] NCCL INFO Channel \d+/\d+ ?: (\d+)\[\d+\] -> "
    rb"(\d+)\[\d+\](?: \[(\w+)\])? via NET/([^/\r\n]+)([^\r\n]*)"
)
# src/debug.cc ncclDebugLog: "%s:%d:%d [%d] NCCL INFO " and "\n%s:%d:%d [%d] %s:%d NCCL WARN " (2.18-2.25: host,
# pid, tid, cudaDev, then a WARN's __FILE__:__LINE__); 2.26+ the same from pieces, "[%F %T] " first on WARN lines
# (NCCL_DEBUG_TIMESTAMP_LEVELS); 2.32+ "%s:%d (%s) NCCL WARN" with the function. aws-ofi-nccl's WARNs put
# __PRETTY_FUNCTION__ where the file is (include/nccl_ofi_log.h NCCL_OFI_WARN): a C++ signature, spaces and all.
# kubectl's "--timestamps" prefix may come first.
_PREFIX = re.compile(
    rb"(?:\[[^\]\r\n]*\] )?(?:\d{4}-\d\d-\d\dT[^ \r\n]+ )?(?:\[[^\]\r\n]*\] )?([^\s:\[\]]+):(\d+):\d+ \[(\d+)\] "
    rb"(?:[^\r\n]*?:\d+(?: \([^)\r\n]*\))? )?NCCL (INFO|WARN) ([^\r\n]*)"
)
# src/init.cc showVersion: "NCCL version 2.21.5+cuda12.4" (2.26+ also "... compiled with CUDA 12.9").
_VERSION = re.compile(
    r"NCCL version (\d+\.\d+\.\d+)(?:[+-]cuda(\d+(?:\.\d+)*)| compiled with CUDA (\d+(?:\.\d+)*))?", re.I
)
_NETWORK = re.compile(r"Using network (.+?)\s*$", re.I)  # src/init.cc: "Using network %s", the NET plugin's name
# aws-ofi-nccl src/nccl_ofi_net.c(pp): "Selected Provider is %s" (1.7), "... (found %d nics)" (1.8-1.10),
# "Selected provider is %s, fabric is %s (found %d nics)" (1.11+; a tcp fabric is a subnet, e.g. 10.1.0.0/16).
_PROVIDER = re.compile(r"Selected provider is ([\w;-]+)(?:, fabric is ([^\s(]+))?(?: \(found (\d+) nics\))?", re.I)
# src/init.cc ncclCommInitRankFunc: "comm %p rank %d nranks %d ... busId %lx commId 0x%llx - Init COMPLETE" (2.18,
# where ncclCommSplit prints the same line, its commId hashed from the parent's commHash and the color); prefixed by
# "ncclCommInitRank " (2.21) or "%s " (2.23+, the API function). ncclCommSplit's own line (PyTorch splits its groups
# when the default group is bound to a device) has "parent %p color %d key %d": v2.21.5-1 with "commId 0x%llx" after
# the key, v2.23.4-1 to v2.30.7-1 with no commId ("splitCount %d" before the color from 2.27, "childCount %d" from
# 2.29), 2.32.3 with "commId 0x%lx" before the parent (its libnccl.so's string). The rank is the one in that
# communicator.
_INIT = re.compile(
    r"comm (?:0x[0-9a-f]+|\(nil\)) rank (\d+) nranks (\d+) cudaDev \d+ nvmlDev \d+ busId [0-9a-f]+"
    r"(?: commId (0x[0-9a-f]+))?(?: parent \S+(?: \w+ -?\d+)? color (-?\d+) key -?\d+"
    r"(?: commId (0x[0-9a-f]+))?)? ?- Init COMPLETE",
    re.I,
)

# Lines worth a full parse, found by substring search (as NCCL prints them; a shared part where wording changed).
MARKERS = (
    b"NCCL version ",
    b"Using network ",
    b"NET/OFI ",
    b"Init COMPLETE",
    b"Connected all ",
    b"Connected NVLS",
    b" NCCL WARN ",
    b" via NET/",
    b"Watchdog caught collective operation timeout",
    b"fi_getinfo",
)
# Known error lines that are INFO-level, or not NCCL lines at all (the PyTorch watchdog, libfabric's log).
KNOWN_ERRORS = (
    "Unable to find a protocol that worked",
    "Failed to initialize any NET plugin",
    "Watchdog caught collective operation timeout",
)
INTRA = (b" via P2P/IPC", b" via P2P/CUMEM", b" via SHM")
PARALLEL_BYTES = 64 * 2**20  # from this much log on, files are read by a process per core


@dataclass
class Process:
    """What one NCCL process (host, pid) said of itself."""

    host: str
    pid: int
    local_rank: int
    version: str = ""
    cuda: str = ""
    network: str = ""  # as NCCL names it: AWS Libfabric, Libfabric, IB, Socket
    provider: str = ""
    fabric: str = ""
    nics: int = 0
    rings: int = 0
    trees: int = 0
    nvls: int = 0  # "Connected NVLS tree" (NVLS-capable nodes, instead of or beside the trees)
    comm_ranks: dict[str, int] = field(default_factory=dict)  # communicator -> its rank there, at Init COMPLETE
    # Its inter-node channel lines, by the (its rank, peer rank) they name: ranks within an unnamed communicator.
    net: dict[tuple[int, int], Transport] = field(default_factory=dict)


@dataclass
class Comm:
    id: str  # its commId (a split's with its color), or for a split without one (2.23-2.31) its color and size
    nranks: int
    ranks: dict[int, tuple[str, int]] = field(default_factory=dict)  # rank -> (host, pid), at Init COMPLETE


@dataclass
class Transport:
    """Inter-node channel lines: by network name, and how many with GPUDirect RDMA."""

    net: Counter[str] = field(default_factory=Counter)
    gdr: int = 0

    def add(self, other: Transport) -> None:
        self.net.update(other.net)
        self.gdr += other.gdr


@dataclass
class Problem:
    host: str
    pid: int
    text: str


@dataclass
class NcclLogs:
    files: int = 0
    lines: int = 0  # NCCL INFO and WARN lines
    truncated: list[str] = field(default_factory=list)  # files that ended mid-line or mid-stream
    processes: dict[tuple[str, int], Process] = field(default_factory=dict)
    comms: dict[str, Comm] = field(default_factory=dict)
    intra: dict[str, set[str]] = field(default_factory=dict)  # intra-node transports, by source file
    channels: dict[str, int] = field(default_factory=dict)  # channels, by source file
    problems: list[Problem] = field(default_factory=list)
    problem_count: int = 0

    # -- reading ------------------------------------------------------------------------------------------

    def read(self, paths: Iterable[Path], workers: int = 0) -> NcclLogs:
        """Files and directories (recursively); large inputs are split over `workers` processes (0: one per core)."""
        files = [f for p in paths for f in (sorted(x for x in p.rglob("*") if x.is_file()) if p.is_dir() else [p])]
        workers = workers or os.cpu_count() or 1
        if workers == 1 or len(files) < 2 or sum(f.stat().st_size for f in files) < PARALLEL_BYTES:
            for path in files:
                self.read_file(path)
            return self
        groups: list[list[Path]] = [[] for _ in range(min(workers, len(files)))]
        sizes = [0] * len(groups)
        for path in sorted(files, key=lambda f: -f.stat().st_size):  # largest first, onto the lightest group
            lightest = sizes.index(min(sizes))
            groups[lightest].append(path)
            sizes[lightest] += path.stat().st_size
        with ProcessPoolExecutor(len(groups)) as pool:
            for part in pool.map(_read_group, groups):
                self.merge(part)
        return self

    def merge(self, other: NcclLogs) -> None:
        """Add what another reader found (of other files) to this one."""
        self.files += other.files
        self.lines += other.lines
        self.truncated += other.truncated
        for key, theirs in other.processes.items():
            mine = self.processes.setdefault(key, theirs)
            if mine is not theirs:
                for name in ("version", "cuda", "network", "provider", "fabric"):
                    setattr(mine, name, getattr(mine, name) or getattr(theirs, name))
                mine.nics = max(mine.nics, theirs.nics)
                mine.rings += theirs.rings
                mine.trees += theirs.trees
                mine.nvls += theirs.nvls
                mine.comm_ranks.update(theirs.comm_ranks)
                for pair, transport in theirs.net.items():
                    mine.net.setdefault(pair, Transport()).add(transport)
        for comm_id, comm in other.comms.items():
            self.comms.setdefault(comm_id, Comm(comm_id, comm.nranks)).ranks.update(comm.ranks)
        for source, kinds in other.intra.items():
            self.intra.setdefault(source, set()).update(kinds)
        for source, channels in other.channels.items():
            self.channels[source] = max(self.channels.get(source, 0), channels)
        self.problems += other.problems[: MAX_PROBLEMS - len(self.problems)]
        self.problem_count += other.problem_count

    def read_file(self, path: Path) -> None:
        self.files += 1
        with open(path, "rb") as raw:
            gzipped = raw.read(2) == b"\x1f\x8b"
        stream = gzip.open(path, "rb") if gzipped else open(path, "rb")
        carry = b""
        try:
            with stream:
                while block := stream.read(BLOCK):
                    data = carry + block
                    cut = data.rfind(b"\n") + 1
                    carry = data[cut:]
                    self.feed(data[:cut], str(path))
        except (EOFError, zlib.error, gzip.BadGzipFile):  # a gzip file cut short: keep what came through
            self.truncated.append(str(path))
        if carry:  # a last line without its newline (the process died mid-write): parse what is there
            if str(path) not in self.truncated:
                self.truncated.append(str(path))
            self.feed(carry + b"\n", str(path))

    def feed(self, data: bytes, source: str = "") -> None:
        """A block of complete lines from `source` (a file: one process's, or one pod's)."""
        if b"\x1b" in data:
            data = _ANSI.sub(b"", data)
        self.lines += data.count(b" NCCL INFO ") + data.count(b" NCCL WARN ")
        self._intra(data, source)
        seen: set[int] = set()  # a line holding two markers is parsed once
        for marker in MARKERS:
            start = data.find(marker)
            while start >= 0:
                begin = data.rfind(b"\n", 0, start) + 1
                end = data.find(b"\n", start)
                if begin not in seen:
                    seen.add(begin)
                    self._line(data[begin:end])
                start = data.find(marker, end)

    def _intra(self, data: bytes, source: str) -> None:
        """Intra-node transports and the channel count, per source: a few searches that stop at the first hit."""
        seen = self.intra.setdefault(source, set())
        for marker in INTRA:
            if marker.decode().strip().removeprefix("via ") not in seen and marker in data:
                seen.add(marker.decode().strip().removeprefix("via "))
        channels = self.channels.get(source, 0)
        while b"Channel %02d/" % channels in data:
            channels += 1
        self.channels[source] = channels

    def _net_channel(self, line: bytes) -> None:
        """An inter-node channel line: its network and GPUDirect RDMA, by its process and the ranks it names."""
        match = _NET_CHANNEL.search(line)
        if match is None:
            return
        host, pid, local, src, dst, direction, network, rest = match.groups()
        key = (host.decode(errors="replace"), int(pid))
        process = self.processes.get(key) or self.processes.setdefault(key, Process(*key, int(local)))
        # The process printed it as the receiver of a [receive] line, else as the sender.
        pair = (int(dst), int(src)) if direction == b"receive" else (int(src), int(dst))
        transport = process.net.get(pair) or process.net.setdefault(pair, Transport())
        transport.net[network.decode(errors="replace").strip()] += 1
        transport.gdr += b"/GDRDMA" in rest

    def _line(self, line: bytes) -> None:
        if b" via NET/" in line:
            self._net_channel(line)
            return
        match = _PREFIX.search(line)
        if match is None:  # not an NCCL line: PyTorch's watchdog and libfabric's own log matter among those
            text = line.decode(errors="replace").strip()
            if "Watchdog caught collective operation timeout" in text or (
                "fi_getinfo" in text and "empty list" in text
            ):
                self._problem("", 0, text)
            return
        host, pid, local, level, message = (g.decode(errors="replace") for g in match.groups())
        key = (host, int(pid))
        process = self.processes.get(key) or self.processes.setdefault(key, Process(host, int(pid), int(local)))
        if level == "WARN":
            self._problem(host, int(pid), f"NCCL WARN {message.strip()}")
            return
        if m := _VERSION.search(message):
            process.version, process.cuda = m.group(1), m.group(2) or m.group(3) or ""
        elif m := _NETWORK.search(message):
            process.network = m.group(1)
        elif m := _PROVIDER.search(message):
            process.provider, process.fabric = m.group(1).lower(), m.group(2) or ""
            process.nics = int(m.group(3) or 0)
        elif m := _INIT.search(message):
            rank, nranks, comm_id, color, split_id = int(m.group(1)), int(m.group(2)), *m.group(3, 4, 5)
            if color is not None:  # a split: its color sets it apart from its siblings (2.21's commId hashes the
                # parent's and the color; of 2.32's only the format string was at hand, not the source)
                named = comm_id or split_id
                comm_id = f"{named} color {color}" if named else f"split color {color} of {nranks}"
            self.comms.setdefault(comm_id, Comm(comm_id, nranks)).ranks[rank] = key
            process.comm_ranks[comm_id] = rank
        elif "Connected all rings" in message:
            process.rings += 1
        elif "Connected all trees" in message:
            process.trees += 1
        elif "Connected NVLS tree" in message:
            process.nvls += 1
        if any(e in message for e in KNOWN_ERRORS) or ("fi_getinfo" in message and "empty list" in message):
            self._problem(host, int(pid), message.strip())

    def _problem(self, host: str, pid: int, text: str) -> None:
        self.problem_count += 1
        if len(self.problems) < MAX_PROBLEMS:
            self.problems.append(Problem(host, pid, text))

    # -- what it adds up to -------------------------------------------------------------------------------

    def global_rank(self, host: str, pid: int) -> int | None:
        """Its rank in the world communicator: its ranks in the others are within a group (a shard, a replica)."""
        world = self.world_comm()
        process = self.processes.get((host, pid))
        return process.comm_ranks.get(world.id) if world and process else None

    def rank_of(self, host: str, pid: int) -> str:
        rank = self.global_rank(host, pid)
        return f"rank {rank}" if rank is not None else f"{host}:{pid}"

    def world_comm(self) -> Comm | None:
        """The communicator with the most ranks: the default process group's."""
        return max(self.comms.values(), key=lambda c: (c.nranks, len(c.ranks)), default=None)

    def comm_channels(self) -> dict[str, list[tuple[Process, Transport]]]:
        """Each communicator's inter-node channel lines, with the process that printed them.

        A line's communicator is the one of its process in which the process has the rank the line names and the
        peer rank sits on another host (or never initialised): under HSDP exactly one (rank 0 is rank 0 of the
        world, its shard group and its replica group, but only in the replica group is its peer 1 on another node).
        A line that fits several counts for each; one that fits none (its process never reached Init COMPLETE)
        for none.
        """
        out: dict[str, list[tuple[Process, Transport]]] = {}
        for process in self.processes.values():
            for (mine, peer), transport in process.net.items():
                for comm_id, rank in process.comm_ranks.items():
                    comm = self.comms[comm_id]
                    where = comm.ranks.get(peer)
                    if rank == mine and peer < comm.nranks and (where is None or where[0] != process.host):
                        out.setdefault(comm_id, []).append((process, transport))
        return out

    def hosts(self) -> list[str]:
        return sorted({host for host, _ in self.processes})


def _read_group(paths: list[Path]) -> NcclLogs:
    """One worker process's share of the files."""
    logs = NcclLogs()
    for path in paths:
        logs.read_file(path)
    return logs
