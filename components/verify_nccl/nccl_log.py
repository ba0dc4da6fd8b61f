"""Read NCCL's INFO/WARN lines from per-process NCCL_DEBUG_FILE output or pod logs.

Lines are streamed one at a time, so memory does not grow with the size of the logs.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

_VERSION = re.compile(r"NCCL version (\d+\.\d+\.\d+)", re.I)
_NETWORK = re.compile(r"Using network (AWS Libfabric|Libfabric|IB|Socket)", re.I)
_INIT = re.compile(r"Init COMPLETE", re.I)
_WARN = re.compile(r"NCCL WARN (.*)", re.I)
_RINGS = re.compile(r"Connected all rings", re.I)
_TREES = re.compile(r"Connected all trees", re.I)


@dataclass
class NcclSummary:
    lines: int = 0
    versions: set[str] = field(default_factory=set)
    networks: set[str] = field(default_factory=set)
    init_complete: int = 0
    rings_connected: int = 0
    trees_connected: int = 0
    warnings: list[str] = field(default_factory=list)

    MAX_WARNINGS = 50

    def feed(self, line: str) -> None:
        if "NCCL" not in line.upper():
            return
        self.lines += 1
        if m := _VERSION.search(line):
            self.versions.add(m.group(1))
        if m := _NETWORK.search(line):
            self.networks.add(m.group(1))
        self.init_complete += bool(_INIT.search(line))
        self.rings_connected += bool(_RINGS.search(line))
        self.trees_connected += bool(_TREES.search(line))
        if (m := _WARN.search(line)) and len(self.warnings) < self.MAX_WARNINGS:
            self.warnings.append(m.group(1).strip())


def read_lines(paths: Iterable[Path]) -> Iterator[str]:
    for path in paths:
        with open(path, encoding="utf-8", errors="replace") as f:
            yield from f


def summarize(paths: Iterable[Path]) -> NcclSummary:
    summary = NcclSummary()
    for line in read_lines(paths):
        summary.feed(line)
    return summary
