"""Verify that every rank could talk to every other, over the network it should: a gate, with the reasons.

Two sources: the trainer's comms self-test reports (every rank writes one at start-up: trainer/comms.py)
and NCCL's own debug output (the run's NCCL_DEBUG_FILE files on FSx, pod logs, any other files). Each
check is pass, fail or n/a with a one-line reason; the bandwidth floor warns by default. The silent
failure this exists for: on EFA hardware NCCL falls back to TCP sockets and the job runs, many times
slower, and nobody notices for days.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.errors import InputError
from components.verify_nccl.nccl_log import Comm, NcclLogs
from trainer.atomic import atomic_open
from trainer.layout import RunPaths

log = logging.getLogger(__name__)

PASS, FAIL, NOT_APPLICABLE, WARN = "pass", "fail", "n/a", "warn"
TRANSPORTS = ("efa", "ib", "socket", "any")
# NCCL's names for the network: its own IB and Socket, or aws-ofi-nccl ("AWS Libfabric" up to 1.11.0, "Libfabric"
# after, "OFI" when NCCL_NET asks for it), whose name says nothing of the libfabric provider under it.
OFI_NAMES = frozenset({"aws libfabric", "libfabric", "ofi"})
NETWORK_TRANSPORT = {"ib": "ib", "socket": "socket"}
# libfabric providers aws-ofi-nccl may select that are TCP underneath: a fallback on EFA hardware.
TCP_PROVIDERS = ("tcp", "sockets", "udp")


def process_transport(process: Any) -> str:
    """What one process talks over: efa only when aws-ofi-nccl selected libfabric's efa provider; tcp when it selected
    a TCP provider (still named "Libfabric" by NCCL); libfabric when it did not say which provider."""
    name = process.network.lower()
    if name in OFI_NAMES:
        if process.provider == "efa":
            return "efa"
        if process.provider.split(";")[0] in TCP_PROVIDERS:
            return "tcp"
        return "libfabric" if not process.provider else f"libfabric ({process.provider})"
    return NETWORK_TRANSPORT.get(name, name)


def channel_transport(name: str) -> str:
    return "ofi" if name.lower() in OFI_NAMES else NETWORK_TRANSPORT.get(name.lower(), name)


def line_transport(process: Any, name: str) -> str:
    """A channel line's transport: the network it names; for aws-ofi-nccl's, the provider its process selected."""
    kind = channel_transport(name)
    return process_transport(process) if kind == "ofi" and process.network.lower() in OFI_NAMES else kind


# Bus bandwidth floors (GB/s) for the trainer's 8 MiB start-up all_reduce across nodes: far below what the
# network does, far above a TCP fallback. A floor catches a broken network, it is not a tuning target.
BUSBW_FLOOR_GBPS = {
    "p5.48xlarge": 20.0,
    "p5e.48xlarge": 20.0,
    "p5en.48xlarge": 20.0,
    "p4d.24xlarge": 5.0,
    "p4de.24xlarge": 5.0,
    "g6e.48xlarge": 2.0,
    "g5.48xlarge": 1.0,
}
EFA_INSTANCES = frozenset(BUSBW_FLOOR_GBPS)


@dataclass
class Check:
    name: str
    status: str
    detail: str


@dataclass
class Expectations:
    world_size: int = 0  # 0: what the logs and reports claim (the attempt's own size)
    # An elastic job's size may be anything from its minimum to its maximum of nodes: the attempt's must be in it.
    min_world_size: int = 0
    max_world_size: int = 0
    transport: str = ""  # efa, ib, socket, any; "": efa on EFA instance types, else any
    instance_type: str = ""
    gdr: bool | None = None  # None: expected with efa
    bandwidth_fails: bool = False  # a bus bandwidth below the floor fails instead of warning

    @classmethod
    def for_job(
        cls,
        nnodes: int,
        max_nodes: int,
        nproc_per_node: int,
        instance_type: str,
        expect_transport: str,
        bandwidth_fails: bool,
    ) -> Expectations:
        """What the pipeline's verify step expects of a job of this size: the latest attempt is judged at the size it
        had, as an elastic job may run anywhere from its minimum to its maximum of nodes."""
        return cls(
            min_world_size=nnodes * nproc_per_node,
            max_world_size=max(max_nodes, nnodes) * nproc_per_node,
            transport=expect_transport,
            instance_type=instance_type,
            bandwidth_fails=bandwidth_fails,
        )

    def check(self) -> None:
        """Expectations that cannot be met fail before any log is read, one line each."""
        if self.transport and self.transport not in TRANSPORTS:
            raise InputError(f"expected transport {self.transport!r}: choose one of {', '.join(TRANSPORTS)}")
        if self.world_size < 0:
            raise InputError(f"expected world size must be 0 (from the logs) or positive, got {self.world_size}")

    def resolved_transport(self) -> str:
        if self.transport:
            return self.transport
        return "efa" if self.instance_type.removeprefix("ml.") in EFA_INSTANCES else "any"


@dataclass
class Verification:
    source: str
    world_size: int
    reports: list[dict[str, Any]]
    nccl: NcclLogs
    checks: list[Check] = field(default_factory=list)
    attempt: int = 0  # the attempt judged (0: a run from before attempts, or logs without a run)
    history: list[str] = field(default_factory=list)  # earlier attempts, one line each

    @property
    def passed(self) -> bool:
        return all(c.status != FAIL for c in self.checks)

    @property
    def failures(self) -> list[Check]:
        return [c for c in self.checks if c.status == FAIL]

    @property
    def warnings(self) -> list[str]:
        return [f"{c.name}: {c.detail}" for c in self.checks if c.status == WARN]

    def versions(self) -> list[str]:
        return sorted({p.version for p in self.nccl.processes.values() if p.version})

    def transports(self) -> list[str]:
        return sorted({process_transport(p) for p in self.nccl.processes.values() if p.network})

    def ranks_initialized(self) -> int:
        comm = self.nccl.world_comm()
        return len(comm.ranks) if comm else 0

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.passed,
            "world_size": self.world_size,
            "nccl_version": self.versions()[0] if len(self.versions()) == 1 else self.versions(),
            "transport": self.transports()[0] if len(self.transports()) == 1 else self.transports(),
            "ranks_initialized": self.ranks_initialized(),
            "checks": [{"name": c.name, "status": c.status, "detail": c.detail} for c in self.checks],
            "warnings": self.warnings,
            "files": self.nccl.files,
            "nccl_lines": self.nccl.lines,
            "truncated_files": self.nccl.truncated,
            "attempt": self.attempt,
            "history": self.history,
        }

    def metrics(self) -> dict[str, float]:
        busbw = [r["busbw_gbps"] for r in self.reports]
        return {
            "world_size": self.world_size,
            "ranks_reported": len(self.reports),
            "ranks_initialized": self.ranks_initialized(),
            "checks_failed": len(self.failures),
            "warnings": len(self.warnings),
            "busbw_min_gbps": round(min(busbw), 4) if busbw else 0.0,
            "nccl_lines": self.nccl.lines,
            "nccl_problems": self.nccl.problem_count,
        }

    def markdown(self) -> str:
        icon = {PASS: "PASS", FAIL: "**FAIL**", NOT_APPLICABLE: "n/a", WARN: "warn"}
        verdict = "passed" if self.passed else f"FAILED ({len(self.failures)} check(s))"
        judged = f", attempt {self.attempt}" if self.attempt else ""
        lines = [
            f"# Communication check: {verdict}",
            "",
            f"{self.source}{judged}: world size {self.world_size}, {len(self.reports)} self-test report(s), "
            f"{self.nccl.files} log file(s) with {self.nccl.lines} NCCL line(s).",
            "",
            "| check | result | detail |",
            "| --- | --- | --- |",
            *(f"| {c.name} | {icon[c.status]} | {c.detail} |" for c in self.checks),
        ]
        if self.nccl.processes:
            lines += [
                "",
                "| host | ranks | NCCL | network | provider | NICs | warnings and errors |",
                "| --- | --- | --- | --- | --- | --- | --- |",
                *self._host_rows(),
            ]
        if self.history:
            lines += ["", "Earlier attempts (not judged):", "", *(f"- {line}" for line in self.history)]
        if self.reports:
            lines += [
                "",
                "| rank | host | backend | all_reduce correct | bus bandwidth GB/s |",
                "| --- | --- | --- | --- | --- |",
            ]
            for r in sorted(self.reports, key=lambda r: r["rank"]):
                correct = "yes" if r["all_reduce_correct"] else "NO"
                lines.append(f"| {r['rank']} | {r['hostname']} | {r['backend']} | {correct} | {r['busbw_gbps']:.3f} |")
        return "\n".join(lines) + "\n"

    def _host_rows(self) -> list[str]:
        """One row per host: its ranks, NCCL version, network, EFA provider, NICs and problems."""
        problems = Counter(p.host for p in self.nccl.problems)
        rows = []
        for host in self.nccl.hosts():
            procs = [p for (h, _), p in self.nccl.processes.items() if h == host]
            ranks = sorted(r for p in procs if (r := self.nccl.global_rank(p.host, p.pid)) is not None)
            span = f"{ranks[0]}-{ranks[-1]} ({len(ranks)})" if ranks else "none initialised"

            def joined(values: Iterable[str]) -> str:
                return ", ".join(sorted({v for v in values if v})) or "-"

            provider = joined(p.provider + (f"/{p.fabric}" if p.fabric else "") for p in procs)
            nics = max((p.nics for p in procs), default=0) or "-"
            rows.append(
                f"| {host} | {span} | {joined(p.version for p in procs)} | {joined(p.network for p in procs)} "
                f"| {provider} | {nics} | {problems.get(host, 0)} |"
            )
        return rows


# -- the entry points -------------------------------------------------------------------------------------


def verify_logs(
    paths: Iterable[str],
    expect: Expectations,
    reports: list[dict[str, Any]] | None = None,
    source: str = "",
    quiet: bool = False,
) -> Verification:
    """Check NCCL logs (files or directories) and, when given, the trainer's self-test reports."""
    expect.check()
    files = [Path(p) for p in paths]
    for path in files:
        if not path.exists():
            raise InputError(f"log {path}: no such file or directory")
    nccl = NcclLogs().read(files)
    reports = reports or []
    world = expect.world_size or max(
        [r["world_size"] for r in reports] + [c.nranks for c in nccl.comms.values()], default=0
    )
    result = Verification(source or ", ".join(map(str, files)) or "no logs", world, reports, nccl)
    result.checks = (report_checks(reports, world) if reports else []) + nccl_checks(nccl, world, expect, reports)
    if expect.min_world_size or expect.max_world_size:
        result.checks.insert(0, size_in_range(world, expect))
    for c in [] if quiet else result.checks:
        level = {FAIL: logging.ERROR, WARN: logging.WARNING}.get(c.status, logging.INFO)
        log.log(level, "%s: %s (%s)", c.name, c.status, c.detail)
    return result


def verify_nccl(
    storage_root: str,
    run_id: str,
    world_size: int = 0,
    extra_logs: Iterable[str] = (),
    expect: Expectations | None = None,
    all_attempts: bool = False,
) -> Verification:
    """The run's latest attempt: its self-test reports and its NCCL_DEBUG_FILE output (plus `extra_logs`), at the
    size that attempt had; earlier attempts (an elastic resize, a restart after a failure) are history, one line
    each, unless `all_attempts` judges them too. The report goes to the run."""
    try:
        run = RunPaths.of(storage_root, run_id)
    except ValueError as exc:
        raise InputError(str(exc)) from None
    if not run.root.is_dir():
        raise InputError(f"run {run_id!r} does not exist under {storage_root}")
    expect = expect or Expectations()
    if world_size:
        expect.world_size = world_size
    attempts = run.attempts() or [0]  # 0: a run from before attempts
    result = verify_attempt(run, attempts[-1], expect, list(extra_logs))
    for attempt in attempts[:-1]:
        earlier = verify_attempt(run, attempt, expect, [], quiet=True)
        verdict = (
            "passed" if earlier.passed else "FAILED: " + "; ".join(f"{c.name}: {c.detail}" for c in earlier.failures)
        )
        result.history.append(
            f"attempt {attempt}: world size {earlier.world_size}, {len(earlier.reports)} report(s), {verdict}"
        )
        if all_attempts:
            result.checks += [Check(f"attempt {attempt}: {c.name}", FAIL, c.detail) for c in earlier.failures]
    with atomic_open(run.comms_verification, "w") as f:
        f.write(result.markdown())
    return result


def verify_attempt(
    run: RunPaths, attempt: int, expect: Expectations, extra_logs: list[str], quiet: bool = False
) -> Verification:
    report_dir = run.comms_report(0, attempt).parent
    reports = [json.loads(p.read_text()) for p in sorted(report_dir.glob("rank_*.json"))]
    nccl_dir = run.nccl_dir(attempt)
    logs = ([str(nccl_dir)] if nccl_dir.is_dir() else []) + extra_logs
    if not attempt and nccl_dir.is_dir():  # a run from before attempts: its NCCL files lie in nccl/ itself
        logs = [str(p) for p in nccl_dir.iterdir() if p.is_file()] + extra_logs
    result = verify_logs(logs, expect, reports, source=f"Run `{run.root}`", quiet=quiet)
    result.attempt = attempt
    if not reports:
        result.checks.insert(
            0, Check("all ranks reported", FAIL, "no self-test report at all: the trainer never reached start-up")
        )
    return result


def fetch_pod_logs(
    job_name: str, namespace: str, directory: Path, job_api: str = "pytorchjob", api_client: Any = None
) -> list[Path]:
    """The job's pods' logs (kubectl logs --timestamps), written to `directory`; [] when the pods are gone."""
    from kubernetes.client.exceptions import ApiException

    from components.kube import Kube, api_client_from_environment, describe
    from components.launch_training.apis import job_api as api_named

    api = api_named(job_api)
    kube = Kube(api_client or api_client_from_environment())
    pods = kube.call(
        "list pods", kube.core.list_namespaced_pod, namespace, label_selector=api.pod_selector(job_name)
    ).items
    if not pods:
        log.warning(
            "no pods of %s %s/%s (cleaned up?): only the NCCL_DEBUG_FILE output on the volume is read",
            api.kind,
            namespace,
            job_name,
        )
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for pod in pods:
        name = pod.metadata.name
        try:
            text = kube.call(
                "read log", kube.core.read_namespaced_pod_log, name, namespace, container=api.container, timestamps=True
            )
        except ApiException as exc:
            log.warning("cannot read %s's log: %s", name, describe(exc))
            continue
        path = directory / f"{name}.log"
        path.write_text(text)
        paths.append(path)
    log.info("read the logs of %d pod(s) of %s %s/%s", len(paths), api.kind, namespace, job_name)
    return paths


# -- the checks -------------------------------------------------------------------------------------------


def first_of(items: list[Any], describe) -> str:
    more = f" (and {len(items) - 1} more)" if len(items) > 1 else ""
    return describe(items[0]) + more


def size_in_range(world: int, expect: Expectations) -> Check:
    """An elastic job runs at any size from its minimum to its maximum: the judged attempt's must be one of them."""
    low, high = expect.min_world_size, expect.max_world_size or expect.min_world_size
    span = f"{low}" if low == high else f"{low} to {high}"
    if low <= world <= high:
        return Check("world size in range", PASS, f"{world} ranks (expected {span})")
    return Check("world size in range", FAIL, f"{world} ranks, expected {span}")


def report_checks(reports: list[dict[str, Any]], world_size: int) -> list[Check]:
    """The trainer's self-test: every rank reported, agrees on the world size, and summed right."""
    by_rank = {r["rank"]: r for r in reports}
    missing = [r for r in range(world_size) if r not in by_rank]
    wrong_world = [r for r in reports if r["world_size"] != world_size]
    wrong_sum = [r for r in reports if not r["all_reduce_correct"]]
    checks = [
        Check("all ranks reported", FAIL, first_of(missing, lambda r: f"rank {r}: no self-test report"))
        if missing
        else Check("all ranks reported", PASS, f"{world_size} of {world_size} ranks"),
        Check(
            "same world size",
            FAIL,
            first_of(
                wrong_world, lambda r: f"rank {r['rank']} reports world size {r['world_size']}, expected {world_size}"
            ),
        )
        if wrong_world
        else Check("same world size", PASS, f"every report says {world_size}"),
        Check(
            "all_reduce correct",
            FAIL,
            first_of(
                wrong_sum,
                lambda r: (
                    f"rank {r['rank']}: all_reduce gave "
                    f"{r['all_reduce_min']}..{r['all_reduce_max']}, expected {r['all_reduce_expected']}"
                ),
            ),
        )
        if wrong_sum
        else Check("all_reduce correct", PASS, "every rank got n(n+1)/2"),
    ]
    return checks


def nccl_checks(nccl: NcclLogs, world: int, expect: Expectations, reports: list[dict[str, Any]]) -> list[Check]:
    backends = {r["backend"] for r in reports}
    if not nccl.processes:
        if reports and "nccl" not in backends:
            return [Check("NCCL initialised", NOT_APPLICABLE, f"backend {', '.join(sorted(backends))}: NCCL not used")]
        return [Check("NCCL initialised", FAIL, "no NCCL lines found: was NCCL_DEBUG=INFO set, and the logs given?")]
    transport = expect.resolved_transport()
    return [
        initialised(nccl, world),
        one_version(nccl, reports),
        *network_checks(nccl, transport, expect),
        communicators_across_nodes(nccl, transport),
        connected(nccl),
        no_problems(nccl),
        *bandwidth(reports, expect, nccl),
    ]


def initialised(nccl: NcclLogs, world: int) -> Check:
    """Every rank of the world communicator, then every rank of each other one (HSDP's shard and replica groups): a
    group with a rank missing would look like one within a node, and need no network."""
    comm = nccl.world_comm()
    done = set(comm.ranks) if comm and comm.nranks == world else set()
    missing = [r for r in range(world) if r not in done]
    if missing:
        return Check(
            "all ranks initialised",
            FAIL,
            f"{len(done)} of {world} ranks reached Init COMPLETE; never: "
            f"{', '.join(f'rank {r}' for r in missing[:8])}{' ...' if len(missing) > 8 else ''}",
        )
    partial = [c for c in nccl.comms.values() if len(c.ranks) < c.nranks]
    if partial:
        return Check(
            "all ranks initialised",
            FAIL,
            first_of(
                partial,
                lambda c: f"{describe_comm(nccl, c)}: {len(c.ranks)} of its {c.nranks} ranks reached Init COMPLETE",
            ),
        )
    others = f", and all of {len(nccl.comms) - 1} other communicator(s)" if len(nccl.comms) > 1 else ""
    return Check("all ranks initialised", PASS, f"{world} of {world} ranks reached Init COMPLETE{others}")


def describe_comm(nccl: NcclLogs, comm: Comm) -> str:
    """A communicator by its id and its members' global ranks and hosts (the first four)."""
    members = [f"{nccl.rank_of(*key)} on {key[0]}" for _, key in sorted(comm.ranks.items())[:4]]
    more = " ..." if len(comm.ranks) > 4 else ""
    return f"communicator {comm.id} of {comm.nranks} ranks ({', '.join(members)}{more})"


def one_version(nccl: NcclLogs, reports: list[dict[str, Any]]) -> Check:
    """From the 'NCCL version' lines (only some processes print one) and every rank's self-test report."""
    by_version: dict[str, list[str]] = {}
    for (host, pid), process in nccl.processes.items():
        if process.version:
            by_version.setdefault(process.version, []).append(nccl.rank_of(host, pid) + f" on {host}")
    for report in sorted(reports, key=lambda r: r["rank"]):
        if report.get("nccl_version"):
            where = f"rank {report['rank']} on {report['hostname']}"
            places = by_version.setdefault(report["nccl_version"], [])
            if where not in places:
                places.append(where)
    if not by_version:
        return Check("one NCCL version", FAIL, "no 'NCCL version' line in the logs")
    if len(by_version) == 1:
        return Check("one NCCL version", PASS, next(iter(by_version)))
    seen = sorted(by_version.items(), key=lambda item: (-len(item[1]), item[0]))
    where = "; ".join(
        f"{v} on {places[0]}" + (f" and {len(places) - 1} more" if len(places) > 1 else "") for v, places in seen
    )
    return Check("one NCCL version", FAIL, f"{len(by_version)} versions: {where}")


def network_checks(nccl: NcclLogs, transport: str, expect: Expectations) -> list[Check]:
    inter = Counter()  # inter-node channels by transport ("ofi": aws-ofi-nccl, whichever provider)
    for t in (t for p in nccl.processes.values() for t in p.net.values()):
        inter.update({channel_transport(name): n for name, n in t.net.items()})
    announced = {key: process_transport(p) for key, p in nccl.processes.items() if p.network}
    if not inter and len(nccl.hosts()) <= 1:
        reason = "one node: no inter-node traffic"
        return [
            Check("inter-node transport", NOT_APPLICABLE, reason),
            Check("no TCP fallback", NOT_APPLICABLE, reason),
            Check("GPUDirect RDMA", NOT_APPLICABLE, reason),
        ]
    checks = []
    used = sorted(set(announced.values()))
    if transport == "any":
        checks.append(Check("inter-node transport", PASS, f"{', '.join(used)} (any accepted)"))
    else:
        accepted = {transport, "ofi"} if transport == "efa" else {transport}  # ofi channels: the provider decides
        wrong = [k for k, v in announced.items() if v != transport]
        wrong_channels = sum(n for name, n in inter.items() if name not in accepted)
        if wrong or wrong_channels:
            where = (
                nccl.rank_of(*wrong[0]) + f" on {wrong[0][0]} uses {announced[wrong[0]]}"
                if wrong
                else f"{wrong_channels} inter-node channel(s) over {', '.join(n for n in inter if n not in accepted)}"
            )
            checks.append(Check("inter-node transport", FAIL, f"expected {transport}: {where}"))
        else:
            checks.append(Check("inter-node transport", PASS, f"{transport} on every rank"))
    socket = [k for k, v in announced.items() if v == "socket"]
    tcp = [k for k, v in announced.items() if v == "tcp"]
    if transport == "socket":
        checks.append(Check("no TCP fallback", NOT_APPLICABLE, "TCP sockets are the expected transport"))
    elif socket or inter.get("socket"):
        where = nccl.rank_of(*socket[0]) + f" on {socket[0][0]}" if socket else "inter-node channels"
        checks.append(
            Check(
                "no TCP fallback",
                FAIL,
                f"{where} fell back to NCCL's Socket transport ({len(socket)} "
                "process(es)): many times slower; check the EFA device plugin and that the image "
                "carries aws-ofi-nccl",
            )
        )
    elif tcp:
        process = nccl.processes[tcp[0]]
        checks.append(
            Check(
                "no TCP fallback",
                FAIL,
                f"{nccl.rank_of(*tcp[0])} on {tcp[0][0]}: aws-ofi-nccl selected "
                f"libfabric's {process.provider} provider, not efa ({len(tcp)} process(es)): TCP under "
                "the Libfabric name; check FI_PROVIDER=efa and the EFA devices in the pod",
            )
        )
    else:
        checks.append(Check("no TCP fallback", PASS, "no process uses Socket or a TCP provider"))
    want_gdr = expect.gdr if expect.gdr is not None else transport == "efa"
    net_channels = sum(inter.values())
    gdr = sum(t.gdr for p in nccl.processes.values() for t in p.net.values())
    if not want_gdr:
        checks.append(Check("GPUDirect RDMA", NOT_APPLICABLE, f"not expected over {transport}"))
    elif not net_channels:
        checks.append(Check("GPUDirect RDMA", FAIL, "no inter-node channel lines: cannot tell"))
    elif gdr < net_channels:
        without = [key for key, p in nccl.processes.items() if any(sum(t.net.values()) > t.gdr for t in p.net.values())]
        first = min(without, key=lambda key: (nccl.global_rank(*key) is None, nccl.global_rank(*key) or 0))
        checks.append(
            Check(
                "GPUDirect RDMA",
                FAIL,
                f"{net_channels - gdr} of {net_channels} inter-node channels "
                f"without GDRDMA ({nccl.rank_of(*first)} on {first[0]} first)",
            )
        )
    else:
        checks.append(Check("GPUDirect RDMA", PASS, f"all {net_channels} inter-node channels"))
    return checks


def communicators_across_nodes(nccl: NcclLogs, transport: str) -> Check:
    """Every communicator with ranks on several nodes shows inter-node channels on each of them, over the network
    expected; one within a node needs none.

    Run-wide counts hide a broken group: under HSDP every rank holds the world communicator, its node's shard group
    (within the node: NVLink, P2P or SHM, never the network) and its replica group (one rank per node: nothing but
    network channels), and the world's channels would fill in for a replica group that never connected across the
    nodes. A process's "Connected all rings" does not say which communicator connected either. From NCCL 2.22 a
    communicator connects when a collective first uses an algorithm, after Init COMPLETE (NVIDIA/nccl v2.23.4-1,
    src/group.cc ncclCollPreconnectFunc, src/transport/generic.cc ncclTransportRingConnect), and PyTorch makes a
    group's communicator at its first collective unless the default group is bound to a device (torch 2.13,
    torch/distributed/distributed_c10d.py, init_process_group's device_id): one across nodes with no channel line
    never got its connections. Before 2.22 the channels are made before Init COMPLETE.
    """
    name = "communicators across nodes"
    if len(nccl.hosts()) <= 1:
        return Check(name, NOT_APPLICABLE, "one node: no inter-node traffic")
    accepted = {transport, "ofi"} if transport == "efa" else {transport}  # ofi: its process's provider was unknown
    channels = nccl.comm_channels()
    across, within, failures = Counter(), 0, []
    for comm in nccl.comms.values():
        hosts = {host for host, _ in comm.ranks.values()}
        if len(hosts) <= 1:
            within += 1
            continue
        across[comm.nranks] += 1
        lines = channels.get(comm.id, [])
        used = Counter()
        for process, t in lines:
            used.update({line_transport(process, network): n for network, n in t.net.items()})
        silent = sorted(hosts - {process.host for process, _ in lines})
        wrong = sorted(kind for kind in used if kind not in accepted and transport != "any")
        if not lines:
            failures.append(
                f"{describe_comm(nccl, comm)} spans {len(hosts)} nodes but has no inter-node channel: "
                "it never connected across them; look for a WARN or a watchdog timeout"
            )
        elif silent:
            failures.append(
                f"{describe_comm(nccl, comm)} spans {len(hosts)} nodes but has no inter-node channel "
                f"on {', '.join(silent)}"
            )
        elif wrong:
            failures.append(
                f"{describe_comm(nccl, comm)}: {sum(used[k] for k in wrong)} inter-node channel(s) over "
                f"{', '.join(wrong)}, expected {transport}"
            )
    if failures:
        more = f" (and {len(failures) - 1} more)" if len(failures) > 1 else ""
        return Check(name, FAIL, failures[0] + more)
    if not across:
        return Check(name, FAIL, "no communicator initialised across the nodes")
    sizes = ", ".join(f"{n} of {size} ranks" for size, n in sorted(across.items(), reverse=True))
    over = "" if transport == "any" else f" over {transport}"
    inside = f"; {within} within a node, which need none" if within else ""
    return Check(
        name,
        PASS,
        f"{sum(across.values())} across nodes ({sizes}), each with inter-node channels{over} on every node{inside}",
    )


def connected(nccl: NcclLogs) -> Check:
    """Every initialised process connected what its first collective used, and the nodes talked to each other.

    From NCCL 2.22 (NCCL_RUNTIME_CONNECT, on with cuMem) channels connect when an algorithm is first used, after
    Init COMPLETE, so a process prints only the algorithms it ran: rings, trees, or on NVLS-capable nodes "Connected
    NVLS tree" (src/transport/generic.cc, src/transport/nvls.cc). The trainer's start-up all_reduce runs on every
    rank, so each must have connected at least one; a multi-node run must show inter-node channels.
    """
    initialised = [(k, p) for k, p in nccl.processes.items() if p.comm_ranks]
    never = [k for k, p in initialised if not (p.rings or p.trees or p.nvls)]
    if never:
        return Check(
            "channels connected",
            FAIL,
            f"{nccl.rank_of(*never[0])} on {never[0][0]} initialised but never "
            f"connected a ring, tree or NVLS tree ({len(never)} process(es)): its first collective never "
            "got its connections; look for a WARN or a watchdog timeout",
        )
    if len(nccl.hosts()) > 1 and not any(p.net for p in nccl.processes.values()):
        return Check("channels connected", FAIL, "no inter-node channel was ever connected between the nodes")
    kinds = [
        name
        for name, count in (
            ("rings", sum(p.rings for _, p in initialised)),
            ("trees", sum(p.trees for _, p in initialised)),
            ("NVLS trees", sum(p.nvls for _, p in initialised)),
        )
        if count
    ]
    return Check("channels connected", PASS, f"on all {len(initialised)} initialised processes ({', '.join(kinds)})")


def no_problems(nccl: NcclLogs) -> Check:
    if not nccl.problems:
        return Check("no NCCL WARN or error", PASS, "none")
    first = nccl.problems[0]
    where = f"{nccl.rank_of(first.host, first.pid)} on {first.host}: " if first.host else ""
    more = f" ({nccl.problem_count} in all)" if nccl.problem_count > 1 else ""
    return Check("no NCCL WARN or error", FAIL, f"{where}{first.text}{more}")


def bandwidth(reports: list[dict[str, Any]], expect: Expectations, nccl: NcclLogs) -> list[Check]:
    floor = BUSBW_FLOOR_GBPS.get(expect.instance_type.removeprefix("ml."))
    hosts = {r["hostname"] for r in reports} | set(nccl.hosts())
    if not reports or floor is None or len(hosts) <= 1:  # one node: the all_reduce never left it
        return []
    slowest = min(reports, key=lambda r: r["busbw_gbps"])
    if slowest["busbw_gbps"] >= floor:
        return [Check("bus bandwidth", PASS, f"{slowest['busbw_gbps']:.1f} GB/s at least (floor {floor:.0f})")]
    status = FAIL if expect.bandwidth_fails else WARN
    return [
        Check(
            "bus bandwidth",
            status,
            f"rank {slowest['rank']}: {slowest['busbw_gbps']:.2f} GB/s, below the "
            f"{floor:.0f} GB/s floor of {expect.instance_type}",
        )
    ]
