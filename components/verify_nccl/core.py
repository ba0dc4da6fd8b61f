"""Verify that every rank of a run could talk to every other: self-test reports first, NCCL's own lines second.

Every trainer rank writes a comms self-test report at start-up (trainer/comms.py). This step checks
that all of them are there, agree on the world size, and computed the right all_reduce; then it reads
whatever NCCL INFO/WARN lines the run left (NCCL_DEBUG_FILE output, pod logs) and checks those.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from components.errors import InputError
from components.verify_nccl.nccl_log import NcclSummary, summarize
from trainer.atomic import atomic_open
from trainer.layout import RunPaths

log = logging.getLogger(__name__)

PASS, FAIL, NOT_APPLICABLE = "pass", "fail", "n/a"


@dataclass
class Check:
    name: str
    status: str
    reason: str


@dataclass
class Verification:
    run_dir: str
    world_size: int
    reports: list[dict[str, Any]]
    nccl: NcclSummary
    checks: list[Check] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(c.status != FAIL for c in self.checks)

    @property
    def failures(self) -> list[Check]:
        return [c for c in self.checks if c.status == FAIL]

    def metrics(self) -> dict[str, float]:
        busbw = [r["busbw_gbps"] for r in self.reports]
        return {
            "world_size": self.world_size,
            "ranks_reported": len(self.reports),
            "checks_failed": len(self.failures),
            "busbw_min_gbps": round(min(busbw), 4) if busbw else 0.0,
            "busbw_mean_gbps": round(sum(busbw) / len(busbw), 4) if busbw else 0.0,
            "nccl_lines": self.nccl.lines,
            "nccl_warnings": len(self.nccl.warnings),
        }

    def markdown(self) -> str:
        icon = {PASS: "PASS", FAIL: "**FAIL**", NOT_APPLICABLE: "n/a"}
        rows = [f"| {c.name} | {icon[c.status]} | {c.reason} |" for c in self.checks]
        ranks = [
            f"| {r['rank']} | {r['hostname']} | {r['local_rank']} | {r['backend']} | {r['device']} | "
            f"{'yes' if r['all_reduce_correct'] else 'NO'} | {r['busbw_gbps']:.3f} |"
            for r in sorted(self.reports, key=lambda r: r["rank"])
        ]
        verdict = "passed" if self.passed else f"FAILED ({len(self.failures)} check(s))"
        return "\n".join(
            [
                f"# Communication check: {verdict}",
                "",
                f"Run `{self.run_dir}`, world size {self.world_size}, {len(self.reports)} rank report(s), "
                f"{self.nccl.lines} NCCL line(s).",
                "",
                "| check | result | detail |",
                "| --- | --- | --- |",
                *rows,
                "",
                "| rank | host | local rank | backend | device | all_reduce correct | bus bandwidth GB/s |",
                "| --- | --- | --- | --- | --- | --- | --- |",
                *ranks,
                "",
            ]
        )


def verify_nccl(storage_root: str, run_id: str, world_size: int = 0, extra_logs: Iterable[str] = ()) -> Verification:
    try:
        run = RunPaths.of(storage_root, run_id)
    except ValueError as exc:
        raise InputError(str(exc)) from None
    if not run.root.is_dir():
        raise InputError(f"run {run_id!r} does not exist under {storage_root}")
    if world_size < 0:
        raise InputError(f"world size must be 0 (take it from the reports) or positive, got {world_size}")
    logs = [Path(p) for p in extra_logs]
    for p in logs:
        if not p.is_file():
            raise InputError(f"log {p}: no such file")

    reports = [json.loads(p.read_text()) for p in sorted(run.comms.glob("rank_*.json"))]
    if not world_size:
        claimed = {r["world_size"] for r in reports}
        world_size = max(claimed) if claimed else 0
    nccl = summarize(sorted(run.nccl.glob("*")) + logs) if run.nccl.is_dir() or logs else NcclSummary()
    result = Verification(str(run.root), world_size, reports, nccl)
    result.checks = report_checks(reports, world_size) + nccl_checks(nccl, reports, world_size)

    with atomic_open(run.comms_verification, "w") as f:
        f.write(result.markdown())
    for c in result.checks:
        log.log(logging.ERROR if c.status == FAIL else logging.INFO, "%s: %s (%s)", c.name, c.status, c.reason)
    return result


def report_checks(reports: list[dict[str, Any]], world_size: int) -> list[Check]:
    """One check per property of the self-test reports; a failure names the first rank at fault."""
    by_rank = {r["rank"]: r for r in reports}
    missing = [r for r in range(world_size) if r not in by_rank]
    wrong_world = [r for r in reports if r["world_size"] != world_size]
    wrong_sum = [r for r in reports if not r["all_reduce_correct"]]

    if not reports:
        return [Check("all ranks reported", FAIL, "no self-test report at all: the trainer never reached start-up")]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        reported = Check("all ranks reported", FAIL, f"rank {missing[0]}: no self-test report{more}")
    else:
        reported = Check("all ranks reported", PASS, f"{world_size} of {world_size} ranks")
    if wrong_world:
        r = wrong_world[0]
        same_world = Check(
            "same world size", FAIL, f"rank {r['rank']} reports world size {r['world_size']}, expected {world_size}"
        )
    else:
        same_world = Check("same world size", PASS, f"every report says {world_size}")
    if wrong_sum:
        r = wrong_sum[0]
        correct = Check(
            "all_reduce correct",
            FAIL,
            f"rank {r['rank']}: all_reduce gave {r['all_reduce_min']}.."
            f"{r['all_reduce_max']}, expected {r['all_reduce_expected']}",
        )
    else:
        correct = Check("all_reduce correct", PASS, "every rank got n(n+1)/2")
    return [reported, same_world, correct]


def nccl_checks(nccl: NcclSummary, reports: list[dict[str, Any]], world_size: int) -> list[Check]:
    backends = {r["backend"] for r in reports}
    if not nccl.lines:
        reason = (
            f"backend {', '.join(sorted(backends))}: NCCL not in use"
            if "nccl" not in backends
            else "no NCCL lines found: was NCCL_DEBUG=INFO set?"
        )
        status = FAIL if "nccl" in backends else NOT_APPLICABLE
        return [Check("NCCL initialised", status, reason)]
    checks = [
        Check(
            "NCCL initialised",
            PASS if nccl.init_complete >= world_size else FAIL,
            f"{nccl.init_complete} 'Init COMPLETE' line(s) for {world_size} rank(s)",
        ),
        Check(
            "one NCCL version",
            PASS if len(nccl.versions) == 1 else FAIL,
            ", ".join(sorted(nccl.versions)) or "no version line",
        ),
        Check("no NCCL warnings", FAIL if nccl.warnings else PASS, nccl.warnings[0] if nccl.warnings else "none"),
    ]
    if nccl.networks:
        checks.append(Check("network", PASS, "using " + ", ".join(sorted(nccl.networks))))
    return checks
