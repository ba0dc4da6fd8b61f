"""NCCL's and aws-ofi-nccl's own format strings for the lines verify_nccl reads, version by version.

The fixtures (tests/nccl_logs.py) are rendered from these, never typed by hand, and tests/test_nccl_formats.py
checks every NCCL string here against the strings compiled into that version's libnccl.so (the nvidia-nccl-cu12
wheel on PyPI), so that the generator cannot repeat a misreading of ours. Sources (repository NVIDIA/nccl, the
release's tag; files and functions):

- the line prefix: src/debug.cc, ncclDebugLog. Up to 2.25 one format per level, a WARN's starting with a newline
  and carrying the source location (`file.cc:LINE`); from 2.26 the prefix is assembled from pieces, with a
  `[%F %T] ` timestamp (NCCL_DEBUG_TIMESTAMP_FORMAT) on the levels of NCCL_DEBUG_TIMESTAMP_LEVELS (WARN by
  default); from 2.32 a WARN may name its function, `file.cc:LINE (func)`.
- "NCCL version": src/init.cc, showVersion (the version and CUDA are compiled into the literal).
- "Bootstrap : Using" (2.26: "Bootstrap: Using"): src/bootstrap.cc, bootstrapNetInit.
- "Using network %s": src/init.cc (the NET plugin's name).
- channel lines: src/transport/net.cc, sendSetup/recvSetup ("[%d]" after a rank is its nvmlDev).
- "Connected all rings/trees": src/init.cc initTransportsRank (2.18-2.21), src/transport/generic.cc
  ncclTransportRingConnect/ncclTransportTreeConnect (2.22+, connected when first used: lazy, NCCL_RUNTIME_CONNECT).
- "Init COMPLETE": src/init.cc, ncclCommInitRankFunc (2.23+: "%s" is the API function, ncclCommInitRankConfig
  under PyTorch). ncclCommSplit's communicators (PyTorch splits its groups when the default group is bound to a
  device) print the same line in 2.18 (their commId hashed from the parent's and the color), a line of their own
  from 2.21 ("parent %p ... color %d key %d", "%s" being ncclCommSplit from 2.23: its __func__).
- aws-ofi-nccl (repository aws/aws-ofi-nccl): src/nccl_ofi_net.c(pp), "Selected Provider is %s" (before 1.8),
  "... (found %d nics)" (1.8-1.10), "Selected provider is %s, fabric is %s (found %d nics)" (1.11+); the network
  name "AWS Libfabric" up to 1.11.0 and "Libfabric" after (PR #530, src/nccl_ofi_interface_nvidia.c); its WARNs
  go through NCCL's logger with __PRETTY_FUNCTION__ as the "file" (include/nccl_ofi_log.h, NCCL_OFI_WARN).
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class NcclFormats:
    version: str
    cuda: str
    # The prefix, as the library holds it: one literal per level before 2.26, pieces after.
    info_prefix: str
    warn_prefix: str
    warn_prefix_func: str  # 2.32+: with the function ("" before)
    host_prefix: str  # 2.26+: "%s:%d:%d " before the level's piece ("" before: it is in the level's literal)
    timestamp: str  # 2.26+: "[%F %T] " before WARN lines by default ("" before)
    bootstrap: str
    network: str
    send: str
    receive: str
    rings: str
    trees: str
    nvls: str
    init_complete: str
    init_function: str  # what "%s" of Init COMPLETE names (2.23+; "" before)
    split_complete: str  # ncclCommSplit's Init COMPLETE ("": the line of init_complete)
    lazy: bool  # 2.22+: connections are made when an algorithm is first used, after Init COMPLETE

    @property
    def version_line(self) -> str:
        return f"NCCL version {self.version}+cuda{self.cuda}"

    def library_strings(self) -> list[bytes]:
        """The literals that must be in this version's libnccl.so, byte for byte."""
        pieces = [
            self.info_prefix,
            self.warn_prefix,
            self.warn_prefix_func,
            self.host_prefix,
            self.timestamp,
            self.version_line,
            self.bootstrap,
            self.network,
            self.send,
            self.receive,
            self.rings,
            self.trees,
            self.nvls,
            self.init_complete,
            self.split_complete,
        ]
        return [p.encode() for p in pieces if p]


OLD_PREFIX = dict(
    info_prefix="%s:%d:%d [%d] NCCL INFO ",
    warn_prefix="\n%s:%d:%d [%d] %s:%d NCCL WARN ",
    warn_prefix_func="",
    host_prefix="",
    timestamp="",
)
OLD_CHANNELS = dict(
    send="Channel %02d/%d : %d[%d] -> %d[%d] [send] via NET/%s/%d%s%s",
    receive="Channel %02d/%d : %d[%d] -> %d[%d] [receive] via NET/%s/%d%s%s",
)
NEW_CHANNELS = dict(
    send="Channel %02d/%d : %d[%d] -> %d[%d] [send] via NET/%s/%d%s%s%s",
    receive="Channel %02d/%d : %d[%d] -> %d[%d] [receive] via NET/%s/%d%s%s%s",
)
INIT_SUFFIX = "comm %p rank %d nranks %d cudaDev %d nvmlDev %d busId %lx commId 0x%llx - Init COMPLETE"
SPLIT = "%s comm %p rank %d nranks %d cudaDev %d nvmlDev %d busId %lx {}parent %p {}color %d key %d - Init COMPLETE"
CONNECTED = dict(trees="Connected all trees", nvls="Connected NVLS tree", network="Using network %s")

NCCL_VERSIONS: dict[str, NcclFormats] = {
    f.version: f
    for f in (
        NcclFormats(
            "2.18.3",
            "12.1",
            **OLD_PREFIX,
            bootstrap="Bootstrap : Using%s",
            **OLD_CHANNELS,
            rings="Connected all rings",
            **CONNECTED,
            init_complete=INIT_SUFFIX,
            init_function="",
            split_complete="",
            lazy=False,
        ),
        NcclFormats(
            "2.21.5",
            "12.4",
            **OLD_PREFIX,
            bootstrap="Bootstrap : Using%s",
            **OLD_CHANNELS,
            rings="Connected all rings",
            **CONNECTED,
            init_complete="ncclCommInitRank " + INIT_SUFFIX,
            init_function="",
            split_complete="ncclCommSplit comm %p rank %d nranks %d cudaDev %d nvmlDev %d "
            "busId %lx parent %p color %d key %d commId 0x%llx - Init COMPLETE",
            lazy=False,
        ),
        NcclFormats(
            "2.23.4",
            "12.6",
            **OLD_PREFIX,
            bootstrap="Bootstrap : Using%s",
            **OLD_CHANNELS,
            rings="Connected all rings",
            **CONNECTED,
            init_complete="%s " + INIT_SUFFIX,
            init_function="ncclCommInitRankConfig",
            split_complete=SPLIT.format("", ""),
            lazy=True,
        ),
        NcclFormats(
            "2.27.7",
            "12.9",
            info_prefix="[%d] NCCL INFO ",
            warn_prefix="[%d] %s:%d NCCL WARN ",
            warn_prefix_func="",
            host_prefix="%s:%d:%d ",
            timestamp="[%F %T] ",
            bootstrap="Bootstrap: Using%s",
            **NEW_CHANNELS,
            rings="Connected all rings, use ring PXN %d GDR %d",
            **CONNECTED,
            init_complete="%s " + INIT_SUFFIX,
            init_function="ncclCommInitRankConfig",
            split_complete=SPLIT.format("", "splitCount %d "),
            lazy=True,
        ),
        NcclFormats(
            "2.32.3",
            "12.9",
            info_prefix="[%d] NCCL INFO %s",
            warn_prefix="[%d] %s:%d NCCL WARN %s",
            warn_prefix_func="[%d] %s:%d (%s) NCCL WARN %s",
            host_prefix="%s:%d:%d ",
            timestamp="[%F %T] ",
            bootstrap="Bootstrap: Using%s",
            send=NEW_CHANNELS["send"],
            receive="Channel %02d/%d : %d[%d] -> %d[%d] [receive] via NET/%s/%d%s%s%s%s%s",
            rings="Connected all rings, use ring PXN %d GDR %d",
            **CONNECTED,
            init_complete="%s " + INIT_SUFFIX,
            init_function="ncclCommInitRankConfig",
            split_complete=SPLIT.format("commId 0x%lx ", "childCount %d "),
            lazy=True,
        ),
    )
}
SUPPORTED = tuple(NCCL_VERSIONS)


@dataclass(frozen=True)
class OfiFormats:
    """aws-ofi-nccl's provider line and network name, by release."""

    release: str
    provider: str  # printed after "NET/OFI "
    network_name: str


OFI_RELEASES: dict[str, OfiFormats] = {
    f.release: f
    for f in (
        OfiFormats("1.7", "Selected Provider is %s", "AWS Libfabric"),
        OfiFormats("1.9", "Selected Provider is %s (found %d nics)", "AWS Libfabric"),
        OfiFormats("1.13", "Selected provider is %s, fabric is %s (found %d nics)", "Libfabric"),
    )
}
# aws-ofi-nccl's own WARNs name a function, in the C++ releases with its whole signature (include/nccl_ofi_log.h).
OFI_WARN_FUNCTION = "int nccl_net_ofi_create_plugin(nccl_net_ofi_plugin_t**)"
OFI_NO_PROTOCOL = "NET/OFI Unable to find a protocol that worked.  Failing initialization."


def c_format(fmt: str, *args: object) -> str:
    """A C printf format applied as C would, for the conversions NCCL's lines use (%p, %lx, %llx, %02d, ...)."""
    python = fmt.replace("%llx", "%x").replace("%lx", "%x").replace("%p", "%s")
    return python % args


def c_format_named(fmt: str, **values: object) -> str:
    """A format whose every conversion follows the word that names it (`rank %d`, `commId 0x%llx`; a leading `%s` is
    the API function), applied by those names: the order of each release's arguments needs no list of its own."""
    names = re.findall(r"(?:(\w+) (?:0x)?)?%(?:l{0,2}[dx]|[sp])", fmt)
    return c_format(fmt, *(values[name or "function"] for name in names))
