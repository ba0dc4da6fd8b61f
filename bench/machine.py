"""What every benchmark records beside its numbers: the machine it ran on, appended to RESULTS.md."""

from __future__ import annotations

import datetime as dt
import importlib.metadata
import json
import logging
import os
import platform
from collections.abc import Callable
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"


def proc_field(path: Path, key: str) -> str:
    """The value of the first `key: value` line of a /proc file, or '' where the file or key is missing."""
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(":")
            if name.strip() == key:
                return value.strip()
    except OSError:
        pass
    return ""


def memory_bytes(key: str) -> int:
    """A memory figure of this process from /proc/self/status (VmRSS, VmHWM...), in bytes; -1 where not readable.
    For a child's peak read VmHWM, which starts afresh at exec: getrusage's ru_maxrss carries the parent's peak
    across fork (or vfork) and exec (Linux's exec_mmap keeps the old mm's high-water mark)."""
    kb = proc_field(Path("/proc/self/status"), key).removesuffix("kB").strip()
    return int(kb) * 1024 if kb.isdigit() else -1


def machine_lines(*packages: str) -> list[str]:
    """Platform, CPUs, memory, and the versions of Python and `packages` (from metadata: nothing imported)."""
    mem_kb = proc_field(Path("/proc/meminfo"), "MemTotal").removesuffix("kB").strip()
    versions = ", ".join(f"{p} {importlib.metadata.version(p)}" for p in packages)
    return [
        f"platform: {platform.platform()}",
        f"CPUs: {os.cpu_count()} ({proc_field(Path('/proc/cpuinfo'), 'model name') or 'model unknown'})",
        f"memory: {int(mem_kb) / 2**20:.1f} GiB" if mem_kb.isdigit() else "memory: unknown",
        f"python {platform.python_version()}" + (f", {versions}" if versions else ""),
    ]


def append_section(title: str, body: list[str], machine: list[str]) -> None:
    """Append a dated section (re-reading the file first: another benchmark may have appended meanwhile)."""
    stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    section = [f"## {stamp}: {title}", "", *body, "", "Machine:", "", *(f"- {line}" for line in machine)]
    text = RESULTS.read_text() if RESULTS.is_file() else "# Benchmark results\n"
    RESULTS.write_text(text.rstrip("\n") + "\n\n" + "\n".join(section) + "\n")


def answer_child(spec_path: str, children: dict[str, Callable[[dict[str, Any]], dict[str, Any]]]) -> int:
    """In a bench's child process: run the measurement its spec file names and write the result where it says."""
    logging.getLogger().setLevel(logging.WARNING)
    spec = json.loads(Path(spec_path).read_text())
    Path(spec["out"]).write_text(json.dumps(children[spec["kind"]](spec)))
    return 0
