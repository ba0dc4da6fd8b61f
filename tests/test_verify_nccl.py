"""verify_nccl: NCCL logs in the exact forms NCCL and aws-ofi-nccl print them, and the trainer's self-test."""

from __future__ import annotations

import gzip
import json
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from common.errors import InputError
from components.verify_nccl.core import FAIL, NOT_APPLICABLE, PASS, WARN, Expectations, verify_logs, verify_nccl
from components.verify_nccl.nccl_log import NcclLogs
from tests.cluster.timelines import Timeline
from tests.nccl_formats import NCCL_VERSIONS, OFI_NO_PROTOCOL, OFI_RELEASES, SUPPORTED
from tests.nccl_logs import Job, write_debug_files, write_pod_logs
from trainer.layout import RunPaths

P5 = Expectations(instance_type="p5.48xlarge")


def verdicts(result) -> dict[str, tuple[str, str]]:
    return {c.name: (c.status, c.detail) for c in result.checks}


def status_of(result) -> dict[str, str]:
    return {c.name: c.status for c in result.checks}


@pytest.mark.parametrize("ofi", list(OFI_RELEASES))
@pytest.mark.parametrize("version", SUPPORTED)
def test_two_p5_nodes_over_efa_pass(tmp_path: Path, version: str, ofi: str) -> None:
    write_debug_files(Job(nccl=version, ofi=ofi), tmp_path / "nccl")
    result = verify_logs([str(tmp_path / "nccl")], P5)
    assert result.passed, result.markdown()
    assert set(status_of(result).values()) == {PASS}
    assert (result.world_size, result.ranks_initialized(), result.transports()) == (16, 16, ["efa"])
    provider = {p.provider for p in result.nccl.processes.values() if p.provider}
    assert provider == {"efa"} and result.nccl.files == 16
    assert f"| ip-10-1-0-17 | 0-7 (8) | {version} |" in result.markdown()


@pytest.mark.parametrize("version", SUPPORTED)
def test_a_warn_after_init_complete_fails_naming_its_rank(tmp_path: Path, version: str) -> None:
    """NCCL's WARN carries its source location (`file.cc:LINE NCCL WARN`), aws-ofi-nccl's a function signature."""
    job = Job(
        nccl=version,
        warn_ranks={
            3: [
                "NET/OFI Request 0x7f completed with error. RC: 21. Error: unknown error.",
                "Call to ibv_post_send failed",
            ]
        },
    )
    write_debug_files(job, tmp_path)
    status, detail = verdicts(verify_logs([str(tmp_path)], P5))["no NCCL WARN or error"]
    assert status == FAIL
    assert detail.startswith("rank 3 on ip-10-1-0-17: NCCL WARN NET/OFI Request 0x7f completed with error.")
    assert detail.endswith("(2 in all)")


@pytest.mark.parametrize("version", SUPPORTED)
def test_a_socket_fallback_on_an_efa_instance_fails(tmp_path: Path, version: str) -> None:
    write_debug_files(Job(nccl=version, socket_ranks={9}), tmp_path)
    result = verify_logs([str(tmp_path)], P5)
    v = verdicts(result)
    assert v["inter-node transport"] == (FAIL, "expected efa: rank 9 on ip-10-1-1-18 uses socket")
    assert v["no TCP fallback"][0] == FAIL
    assert "rank 9 on ip-10-1-1-18 fell back to NCCL's Socket transport" in v["no TCP fallback"][1]
    assert v["GPUDirect RDMA"] == (PASS, "all 64 inter-node channels")  # rank 9 has no inter-node channel


def test_an_ofi_plugin_that_finds_no_protocol_and_falls_back_to_socket_fails_naming_both(tmp_path: Path) -> None:
    """aws-ofi-nccl's WARN when no libfabric provider works, then NCCL's Socket transport on that rank."""
    write_debug_files(Job(nccl="2.27.7", socket_ranks={9}, warn_ranks={9: [OFI_NO_PROTOCOL]}), tmp_path)
    v = verdicts(verify_logs([str(tmp_path)], P5))
    assert v["no NCCL WARN or error"] == (FAIL, f"rank 9 on ip-10-1-1-18: NCCL WARN {OFI_NO_PROTOCOL}")
    assert v["no TCP fallback"][0] == FAIL and "rank 9 on ip-10-1-1-18 fell back" in v["no TCP fallback"][1]


@pytest.mark.parametrize("version", SUPPORTED)
def test_a_tcp_provider_under_the_libfabric_name_fails(tmp_path: Path, version: str) -> None:
    """aws-ofi-nccl on libfabric's tcp provider still says "Using network Libfabric": the provider line tells."""
    write_debug_files(Job(nccl=version, ofi="1.13", tcp_ranks={8, 9}, gdr=False), tmp_path)
    v = verdicts(verify_logs([str(tmp_path)], P5))
    assert v["inter-node transport"] == (FAIL, "expected efa: rank 8 on ip-10-1-1-18 uses tcp")
    assert v["no TCP fallback"][0] == FAIL
    assert v["no TCP fallback"][1].startswith("rank 8 on ip-10-1-1-18: aws-ofi-nccl selected libfabric's tcp provider")


@pytest.mark.parametrize("version", SUPPORTED)
def test_a_rank_that_never_initialises_is_named(tmp_path: Path, version: str) -> None:
    write_debug_files(Job(nccl=version, silent_ranks={5}), tmp_path)
    result = verify_logs([str(tmp_path)], Expectations(world_size=16, instance_type="p5.48xlarge"))
    assert verdicts(result)["all ranks initialised"] == (FAIL, "15 of 16 ranks reached Init COMPLETE; never: rank 5")
    assert not result.passed


@pytest.mark.parametrize("version", SUPPORTED)
def test_mixed_nccl_versions(tmp_path: Path, version: str) -> None:
    other = next(v for v in SUPPORTED if v != version)
    write_debug_files(Job(nccl=version, versions={8: other}), tmp_path)
    status, detail = verdicts(verify_logs([str(tmp_path)], P5))["one NCCL version"]
    assert status == FAIL
    assert detail.startswith("2 versions: ") and f"{other} on rank 8 on ip-10-1-1-18" in detail
    assert f"{version} on rank 0 on ip-10-1-0-17" in detail


@pytest.mark.parametrize("version", [v for v in SUPPORTED if NCCL_VERSIONS[v].lazy])
def test_lazy_connection_and_nvls_pass_and_a_rank_that_never_connects_fails(tmp_path: Path, version: str) -> None:
    """2.22+: channels connect at the first collective, after Init COMPLETE; H100/H200 print "Connected NVLS tree"
    where trees would be. A rank that initialised but never connected fails."""
    write_debug_files(Job(nccl=version, nvls=True), tmp_path / "nvls")
    healthy = verify_logs([str(tmp_path / "nvls")], P5)
    assert healthy.passed, healthy.markdown()
    assert verdicts(healthy)["channels connected"][1].endswith("(rings, NVLS trees)")
    write_debug_files(Job(nccl=version, unconnected_ranks={8}), tmp_path / "stuck")
    status, detail = verdicts(verify_logs([str(tmp_path / "stuck")], P5))["channels connected"]
    assert status == FAIL and detail.startswith("rank 8 on ip-10-1-1-18 initialised but never connected")


# -- HSDP: every rank in three communicators (the world's, its node's shard group, its replica group) ------------

HSDP_PASS = (
    "9 across nodes (1 of 16 ranks, 8 of 2 ranks), each with inter-node channels over efa on every node; "
    "2 within a node, which need none"
)


def replica_group(result) -> str:
    """How the check names replica group 3: its id, then its members by global rank."""
    comm = next(c for c in result.nccl.comms.values() if c.nranks == 2 and c.ranks[0] == ("ip-10-1-0-17", 4021))
    return f"communicator {comm.id} of 2 ranks (rank 3 on ip-10-1-0-17, rank 11 on ip-10-1-1-18)"


@pytest.mark.parametrize("split", [False, True], ids=["own-ids", "split"])
@pytest.mark.parametrize("version", SUPPORTED)
def test_an_hsdp_run_passes_with_shard_groups_inside_nodes_and_replica_groups_across(
    tmp_path: Path, version: str, split: bool
) -> None:
    """2 nodes x 8 GPUs: the world's communicator (16 ranks), 2 shard groups (8 ranks within a node: no network
    channel at all) and 8 replica groups (a rank per node: network channels only), each rank's log holding its three,
    each naming its ranks within the group. The groups come from ncclCommInitRankConfig with ids of their own (the
    trainer: no device bound to the default group), or from ncclCommSplit (2.21's split line puts its commId after
    the key). A rank is named by its global rank, not by its rank in a group."""
    write_debug_files(
        Job(nccl=version, hsdp=True, split=split, warn_ranks={9: ["Call to ibv_post_send failed"]}), tmp_path
    )
    result = verify_logs([str(tmp_path)], P5)
    assert sorted(c.nranks for c in result.nccl.comms.values()) == [2] * 8 + [8] * 2 + [16]
    assert {name: status for name, status in status_of(result).items() if status != PASS} == {
        "no NCCL WARN or error": FAIL
    }
    assert verdicts(result)["no NCCL WARN or error"][1].startswith("rank 9 on ip-10-1-1-18: NCCL WARN Call to ibv")
    assert verdicts(result)["communicators across nodes"] == (PASS, HSDP_PASS)
    assert verdicts(result)["all ranks initialised"] == (
        PASS,
        "16 of 16 ranks reached Init COMPLETE, and all of 10 other communicator(s)",
    )
    assert "| ip-10-1-0-17 | 0-7 (8) |" in result.markdown() and "| ip-10-1-1-18 | 8-15 (8) |" in result.markdown()


@pytest.mark.parametrize("version", SUPPORTED)
def test_an_hsdp_replica_group_that_never_connects_across_nodes_fails_naming_it(tmp_path: Path, version: str) -> None:
    """Replica group 3 (ranks 3 and 11) initialised but printed no channel (from 2.22: its first all-reduce never got
    its connections). Every run-wide check passes: its processes connected their other groups, and the world's
    network channels count for the run; only the check by communicator sees it."""
    write_debug_files(Job(nccl=version, hsdp=True, unconnected_replicas={3}), tmp_path)
    result = verify_logs([str(tmp_path)], P5)
    assert [c.name for c in result.failures] == ["communicators across nodes"]
    assert result.failures[0].detail == (
        f"{replica_group(result)} spans 2 nodes but has no inter-node channel: "
        "it never connected across them; look for a WARN or a watchdog timeout"
    )


def test_an_hsdp_replica_group_without_channels_on_one_node_fails_naming_the_node(tmp_path: Path) -> None:
    """Rank 11's side of replica group 3 lost its network channel lines (rank 3 still shows its own)."""
    paths = write_debug_files(Job(nccl="2.27.7", hsdp=True), tmp_path)
    rank_11 = paths[11].read_text().splitlines(keepends=True)
    paths[11].write_text("".join(line for line in rank_11 if " via NET/" not in line))
    result = verify_logs([str(tmp_path)], P5)
    assert verdicts(result)["communicators across nodes"] == (
        FAIL,
        f"{replica_group(result)} spans 2 nodes but has no inter-node channel on ip-10-1-1-18",
    )


@pytest.mark.parametrize("version", SUPPORTED)
def test_an_hsdp_replica_group_over_sockets_on_p5_fails_naming_it(tmp_path: Path, version: str) -> None:
    """Ranks 3 and 11 fell back to NCCL's Socket transport: their replica group's channels go over TCP, while their
    shard groups and the world's boundary ranks stay on NVLink and EFA."""
    write_debug_files(Job(nccl=version, hsdp=True, socket_ranks={3, 11}), tmp_path)
    result = verify_logs([str(tmp_path)], P5)
    assert verdicts(result)["communicators across nodes"] == (
        FAIL,
        f"{replica_group(result)}: 32 inter-node channel(s) over socket, expected efa",
    )
    assert verdicts(result)["no TCP fallback"][1].startswith("rank 3 on ip-10-1-0-17 fell back to NCCL's Socket")
    assert verdicts(result)["GPUDirect RDMA"] == (
        FAIL,
        "32 of 320 inter-node channels without GDRDMA (rank 3 on ip-10-1-0-17 first)",
    )
    as_sockets = verify_logs([str(tmp_path)], Expectations(transport="socket"))
    assert verdicts(as_sockets)["communicators across nodes"][0] == FAIL  # the other groups are on EFA


def test_infiniband_passes_when_expected_and_fails_as_efa(tmp_path: Path) -> None:
    write_debug_files(Job(network="ib", gdr=True), tmp_path)
    ib = verify_logs([str(tmp_path)], Expectations(transport="ib"))
    assert ib.passed and verdicts(ib)["inter-node transport"] == (PASS, "ib on every rank")
    assert verdicts(ib)["GPUDirect RDMA"][0] == NOT_APPLICABLE
    as_efa = verify_logs([str(tmp_path)], P5)
    assert (
        verdicts(as_efa)["inter-node transport"][0] == FAIL and "uses ib" in verdicts(as_efa)["inter-node transport"][1]
    )


def test_a_single_node_has_no_inter_node_checks(tmp_path: Path) -> None:
    write_debug_files(Job(nodes=1), tmp_path)
    result = verify_logs([str(tmp_path)], P5)
    assert result.passed
    for name in ("inter-node transport", "no TCP fallback", "GPUDirect RDMA"):
        assert verdicts(result)[name] == (NOT_APPLICABLE, "one node: no inter-node traffic")


def test_error_lines_outside_nccl_are_caught(tmp_path: Path) -> None:
    write_debug_files(Job(), tmp_path / "nccl")
    (tmp_path / "pod.log").write_text(
        "libfabric:4021:1764496800::core:core:fi_getinfo_():1138<warn> fi_getinfo: provider efa output empty list\n"
        "[rank3]:[E1130 10:00:00.000 ProcessGroupNCCL.cpp:616] Watchdog caught collective operation timeout: "
        "WorkNCCL(SeqNum=12, OpType=ALLREDUCE) ran for 600000 milliseconds before timing out.\n"
    )
    result = verify_logs([str(tmp_path)], P5)
    status, detail = verdicts(result)["no NCCL WARN or error"]
    assert status == FAIL and detail.endswith("(2 in all)")
    texts = " | ".join(p.text for p in result.nccl.problems)
    assert "fi_getinfo: provider efa output empty list" in texts and "Watchdog caught collective operation" in texts


def test_gdr_missing_fails(tmp_path: Path) -> None:
    write_debug_files(Job(gdr=False), tmp_path)
    status, detail = verdicts(verify_logs([str(tmp_path)], P5))["GPUDirect RDMA"]
    assert status == FAIL and detail.startswith("64 of 64 inter-node channels without GDRDMA")


@pytest.mark.parametrize(
    "crlf, ansi, hsdp", [(False, False, False), (True, True, True)], ids=["plain", "crlf-ansi-hsdp"]
)
def test_prefixed_timestamped_pod_logs_read_the_same(tmp_path: Path, crlf: bool, ansi: bool, hsdp: bool) -> None:
    job = Job(hsdp=hsdp)
    write_debug_files(job, tmp_path / "files")
    write_pod_logs(job, tmp_path / "pods", crlf=crlf, ansi=ansi)
    from_files = verify_logs([str(tmp_path / "files")], P5)
    from_pods = verify_logs([str(tmp_path / "pods")], P5)
    assert from_pods.passed, from_pods.markdown()
    assert [(c.name, c.status, c.detail) for c in from_pods.checks] == [
        (c.name, c.status, c.detail) for c in from_files.checks
    ]
    assert from_pods.nccl.lines == from_files.nccl.lines


def test_truncated_and_gzip_files(tmp_path: Path) -> None:
    job = Job()
    paths = write_debug_files(job, tmp_path / "gz", gz=True)
    assert verify_logs([str(tmp_path / "gz")], P5).passed
    # A process killed mid-write: its file ends mid-line; a gzip stream cut short.
    cut = paths[3].read_bytes()
    paths[3].write_bytes(cut[: len(cut) * 2 // 3])
    plain = write_debug_files(job, tmp_path / "plain")
    text = plain[5].read_bytes()
    plain[5].write_bytes(text[: text.rindex(b"Init COMPLETE") + 5])
    for directory in ("gz", "plain"):
        result = verify_logs([str(tmp_path / directory)], P5)
        assert result.nccl.truncated, directory
        assert verdicts(result)["all ranks initialised"][0] == FAIL, directory


def test_memory_does_not_depend_on_log_size(tmp_path: Path) -> None:
    """What the parser keeps is per process, rank and communicator: 10x the lines, the same state."""
    small, large = NcclLogs(), NcclLogs()
    write_debug_files(Job(filler=10), tmp_path / "small")
    write_debug_files(Job(filler=1000), tmp_path / "large")
    small.read([tmp_path / "small"])
    large.read([tmp_path / "large"])
    assert large.lines > 20 * small.lines

    def state(logs: NcclLogs) -> tuple[int, int, int]:
        return len(logs.processes), len(logs.comms), sum(len(p.net) for p in logs.processes.values())

    assert state(large) == state(small)


def test_reading_in_parallel_gives_what_reading_in_order_does(tmp_path: Path, monkeypatch) -> None:
    job = Job(hsdp=True, socket_ranks={3}, warn_ranks={5: ["NET/OFI something broke"]})
    write_debug_files(job, tmp_path / "files")
    write_pod_logs(job, tmp_path / "pods")
    in_order = NcclLogs().read([tmp_path], workers=1)
    monkeypatch.setattr("components.verify_nccl.nccl_log.PARALLEL_BYTES", 0)
    in_parallel = NcclLogs().read([tmp_path], workers=2)
    for name in ("files", "lines", "processes", "comms", "intra", "channels", "problem_count"):
        assert getattr(in_parallel, name) == getattr(in_order, name), name
    assert sorted(p.text for p in in_parallel.problems) == sorted(p.text for p in in_order.problems)


def test_cli_json_and_exit_codes(tmp_path: Path) -> None:
    write_debug_files(Job(), tmp_path / "good")
    write_debug_files(Job(socket_ranks={0}), tmp_path / "bad")
    cli = [sys.executable, "-m", "pipelines.cli", "verify-nccl", "--instance-type", "p5.48xlarge", "--json"]
    good = subprocess.run([*cli, str(tmp_path / "good")], capture_output=True, text=True, timeout=120)
    assert good.returncode == 0, good.stderr
    report = json.loads(good.stdout)
    expected = {"ok": True, "world_size": 16, "nccl_version": "2.21.5", "transport": "efa", "ranks_initialized": 16}
    assert {k: report[k] for k in expected} == expected
    assert {c["name"] for c in report["checks"]} >= {"all ranks initialised", "no TCP fallback"}
    assert report["warnings"] == []
    bad = subprocess.run(
        [*cli, "--expect-world-size", "16", str(tmp_path / "bad")], capture_output=True, text=True, timeout=120
    )
    assert bad.returncode == 1 and json.loads(bad.stdout)["ok"] is False
    assert "no TCP fallback: rank 0 on ip-10-1-0-17 fell back" in bad.stderr.strip().splitlines()[-1]
    missing = subprocess.run([*cli, str(tmp_path / "nope")], capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2 and "no such file or directory" in missing.stderr.strip().splitlines()[-1]


# -- with a real run's self-test reports (2 processes, gloo, CPU) ------------------------------------------


def copy_run(trained_root: Path, tmp_path: Path) -> tuple[Path, RunPaths]:
    root = tmp_path / "fsx"
    shutil.copytree(trained_root, root, symlinks=True)
    return root, RunPaths.of(root, "run-1")


def latest_report(run: RunPaths, rank: int) -> Path:
    return run.comms_report(rank, run.attempts()[-1])


def test_passes_on_a_real_two_process_run(trained_root: Path, tmp_path: Path) -> None:
    root, run = copy_run(trained_root, tmp_path)
    result = verify_nccl(str(root), "run-1", world_size=2)
    assert result.passed, result.markdown()
    assert status_of(result)["NCCL initialised"] == NOT_APPLICABLE  # gloo on CPU
    assert result.metrics()["ranks_reported"] == 2 and result.metrics()["busbw_min_gbps"] > 0
    assert "| 1 |" in run.comms_verification.read_text()


def test_self_test_failures_are_named(trained_root: Path, tmp_path: Path) -> None:
    root, run = copy_run(trained_root, tmp_path)
    report = json.loads(latest_report(run, 1).read_text())
    report.update(world_size=3, all_reduce_correct=False, all_reduce_min=2.0)
    latest_report(run, 1).write_text(json.dumps(report))
    reasons = {c.name: c.detail for c in verify_nccl(str(root), "run-1", world_size=2).failures}
    assert reasons["same world size"] == "rank 1 reports world size 3, expected 2"
    assert reasons["all_reduce correct"].startswith("rank 1: all_reduce gave 2.0")
    latest_report(run, 1).unlink()
    assert verify_nccl(str(root), "run-1", world_size=2).failures[0].detail == "rank 1: no self-test report"
    for path in run.comms.rglob("rank_*.json"):
        path.unlink()
    result = verify_nccl(str(root), "run-1")
    assert "never reached start-up" in result.failures[0].detail


def test_bandwidth_below_the_floor_warns_or_fails(trained_root: Path, tmp_path: Path) -> None:
    root, run = copy_run(trained_root, tmp_path)
    write_debug_files(Job(nodes=1, gpus=2), run.nccl_dir(run.attempts()[-1]))  # its two ranks, as if on GPUs
    report = json.loads(latest_report(run, 1).read_text())
    latest_report(run, 1).write_text(json.dumps({**report, "hostname": "other-host"}))  # two nodes
    expect = Expectations(world_size=2, instance_type="p5.48xlarge", transport="any")
    warned = verdicts(verify_nccl(str(root), "run-1", expect=expect))["bus bandwidth"]
    assert warned[0] == WARN and "below the 20 GB/s floor of p5.48xlarge" in warned[1]
    expect.bandwidth_fails = True
    assert verdicts(verify_nccl(str(root), "run-1", expect=expect))["bus bandwidth"][0] == FAIL


def test_every_ranks_self_test_report_tells_its_nccl_version(trained_root: Path, tmp_path: Path) -> None:
    """Only some processes print 'NCCL version'; the self-test reports of all ranks fill the gap."""
    root, run = copy_run(trained_root, tmp_path)
    write_debug_files(Job(nodes=1, gpus=2), run.nccl_dir(run.attempts()[-1]))  # only rank 0 prints its version
    for rank, version in ((0, "2.21.5"), (1, "2.19.3")):
        report = json.loads(latest_report(run, rank).read_text())
        latest_report(run, rank).write_text(json.dumps({**report, "nccl_version": version}))
    status, detail = verdicts(verify_nccl(str(root), "run-1", world_size=2))["one NCCL version"]
    assert status == FAIL and "2.19.3 on rank 1 on" in detail


# -- attempts: a job grown past its minimum, a restart after a failed attempt --------------------------------------
# (A real shrink from 2 ranks to 1: tests/test_parallel.py, test_fsdps_checkpoint_goes_on_in_one_process_....)


def write_attempt(run: RunPaths, attempt: int, template: dict, world: int, job: Job | None = None) -> None:
    """An attempt's self-test reports (the real trainer's, at another size) and, with `job`, its NCCL files."""
    for rank in range(world):
        path = run.comms_report(rank, attempt)
        path.parent.mkdir(parents=True, exist_ok=True)
        expected = world * (world + 1) / 2
        path.write_text(
            json.dumps(
                {
                    **template,
                    "rank": rank,
                    "world_size": world,
                    "attempt": attempt,
                    "all_reduce_expected": expected,
                    "all_reduce_min": expected,
                    "all_reduce_max": expected,
                }
            )
        )
    if job is not None:
        write_debug_files(job, run.nccl_dir(attempt))


def test_a_job_grown_past_its_minimum_verifies_at_the_size_it_had(trained_root: Path, tmp_path: Path) -> None:
    root, run = copy_run(trained_root, tmp_path)
    template = json.loads(latest_report(run, 0).read_text())
    write_attempt(run, 2, template, 4)  # a 2:4 job that grew to 4
    grown = verify_nccl(str(root), "run-1", expect=Expectations(min_world_size=2, max_world_size=4))
    assert grown.passed and grown.world_size == 4, grown.markdown()
    too_big = verify_nccl(str(root), "run-1", expect=Expectations(min_world_size=2, max_world_size=3))
    assert verdicts(too_big)["world size in range"] == (FAIL, "4 ranks, expected 2 to 3")


def test_a_restart_after_a_failed_attempt_verifies_on_the_latest(trained_root: Path, tmp_path: Path) -> None:
    root, run = copy_run(trained_root, tmp_path)
    template = json.loads(latest_report(run, 0).read_text()) | {"backend": "nccl"}
    failed = Job(nodes=2, gpus=8, silent_ranks={5}, warn_ranks={9: ["NET/OFI Request 0x7f completed with error."]})
    write_attempt(run, 2, template, 16, failed)
    write_attempt(run, 3, template, 16, Job(nodes=2, gpus=8))
    expect = Expectations(min_world_size=16, max_world_size=16, instance_type="p5.48xlarge")
    latest = verify_nccl(str(root), "run-1", expect=expect)
    assert latest.passed and latest.attempt == 3, latest.markdown()
    assert latest.history[1].startswith(
        "attempt 2: world size 16, 16 report(s), FAILED: all ranks initialised: "
        "15 of 16 ranks reached Init COMPLETE; never: rank 5"
    )
    assert "Earlier attempts (not judged)" in run.comms_verification.read_text()
    judged = verify_nccl(str(root), "run-1", expect=expect, all_attempts=True)
    assert not judged.passed
    assert {c.name for c in judged.failures} >= {"attempt 2: all ranks initialised", "attempt 2: no NCCL WARN or error"}


def test_bad_inputs(trained_root: Path, tmp_path: Path) -> None:
    with pytest.raises(InputError, match="does not exist"):
        verify_nccl(str(trained_root), "no-such-run")
    with pytest.raises(InputError, match="no such file"):
        verify_nccl(str(trained_root), "run-1", extra_logs=[str(tmp_path / "missing.log")])
    with pytest.raises(InputError, match="expected transport 'tcp'"):
        verify_logs([str(tmp_path)], Expectations(transport="tcp"))


def test_gzip_helper_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "x.log.gz"
    path.write_bytes(gzip.compress(b"h:1:1 [0] NCCL INFO NCCL version 2.30.1+cuda13.0\n"))
    logs = NcclLogs().read([path])
    assert logs.processes[("h", 1)].version == "2.30.1" and logs.processes[("h", 1)].cuda == "13.0"


def test_reads_the_jobs_pod_logs_through_the_kubernetes_api(tmp_path: Path, make_cluster) -> None:
    """Given a job name, the pods' logs (kubectl logs --timestamps) are read through the real API server from the
    kubelet player, as the pipeline runner, and checked."""
    from components.launch_training.manifest import JobSpec, render_job
    from components.verify_nccl.core import fetch_pod_logs
    from tests.nccl_logs import process_lines

    job = Job(nodes=2, gpus=2)
    printed = threading.Event()

    def run(play) -> None:
        for node in (0, 1):
            play.start(node)
            for g in range(job.gpus):
                play.print(node, *process_lines(job, node * job.gpus + g))
        printed.set()

    cluster = make_cluster(timeline=Timeline([(0.0, run)]))
    manifest = render_job(
        JobSpec(
            name="nccl-check",
            namespace=cluster.namespace,
            image="img:1",
            trainer_args=[],
            instance_type="p5.48xlarge",
            gpus_per_node=2,
            nproc_per_node=2,
        )
    )
    cluster.create_job(manifest)
    assert printed.wait(30), "the pods ran and printed"
    paths = fetch_pod_logs("nccl-check", cluster.namespace, tmp_path, api_client=cluster.runner())
    assert [p.name for p in paths] == ["nccl-check-worker-0.log", "nccl-check-worker-1.log"]
    result = verify_logs([str(tmp_path)], P5)
    assert result.passed and result.ranks_initialized() == 4, result.markdown()
