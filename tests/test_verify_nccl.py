import json
import shutil
from pathlib import Path

import pytest

from components.errors import InputError
from components.verify_nccl.core import FAIL, NOT_APPLICABLE, PASS, verify_nccl
from components.verify_nccl.nccl_log import summarize
from trainer.layout import RunPaths

# ruff: noqa: E501 - log lines are kept whole
# Lines in the forms NCCL 2.18-2.30 and aws-ofi-nccl print them (see DESIGN.md), as two ranks on two hosts.
NCCL_LINES = """\
node-a:101:101 [0] NCCL INFO Bootstrap : Using eth0:10.1.2.3<0>
node-a:101:101 [0] NCCL INFO NCCL version 2.21.5+cuda12.4
node-a:101:180 [0] NCCL INFO NET/OFI Selected Provider is efa (found 32 nics)
node-a:101:180 [0] NCCL INFO Using network AWS Libfabric
node-a:101:180 [0] NCCL INFO Channel 00/0 : 1[0] -> 0[0] [send] via NET/AWS Libfabric/0/GDRDMA
node-a:101:180 [0] NCCL INFO Connected all rings
node-a:101:180 [0] NCCL INFO Connected all trees
node-a:101:180 [0] NCCL INFO ncclCommInitRank comm 0x7f01 rank 0 nranks 2 cudaDev 0 nvmlDev 0 busId 53000 commId 0xabc - Init COMPLETE
node-b:202:202 [0] NCCL INFO NCCL version 2.21.5+cuda12.4
node-b:202:260 [0] NCCL INFO Using network AWS Libfabric
node-b:202:260 [0] NCCL INFO ncclCommInitRank comm 0x7f02 rank 1 nranks 2 cudaDev 0 nvmlDev 0 busId 53000 commId 0xabc - Init COMPLETE
"""


def copy_run(trained_root: Path, tmp_path: Path) -> tuple[Path, RunPaths]:
    root = tmp_path / "fsx"
    shutil.copytree(trained_root, root)
    return root, RunPaths.of(root, "run-1")


def statuses(result) -> dict[str, str]:
    return {c.name: c.status for c in result.checks}


def test_passes_on_a_real_two_process_run(trained_root: Path, tmp_path: Path) -> None:
    root, run = copy_run(trained_root, tmp_path)
    result = verify_nccl(str(root), "run-1", world_size=2)
    assert result.passed, result.markdown()
    assert statuses(result)["NCCL initialised"] == NOT_APPLICABLE  # gloo on CPU
    assert result.metrics()["ranks_reported"] == 2 and result.metrics()["busbw_min_gbps"] > 0
    assert "| 1 |" in run.comms_verification.read_text()


def test_missing_rank_is_named(trained_root: Path, tmp_path: Path) -> None:
    root, run = copy_run(trained_root, tmp_path)
    run.comms_report(1).unlink()
    result = verify_nccl(str(root), "run-1", world_size=2)
    assert not result.passed
    assert result.failures[0].reason == "rank 1: no self-test report"


def test_wrong_world_size_and_wrong_sum(trained_root: Path, tmp_path: Path) -> None:
    root, run = copy_run(trained_root, tmp_path)
    report = json.loads(run.comms_report(1).read_text())
    report.update(world_size=3, all_reduce_correct=False, all_reduce_min=2.0)
    run.comms_report(1).write_text(json.dumps(report))
    result = verify_nccl(str(root), "run-1", world_size=2)
    reasons = {c.name: c.reason for c in result.failures}
    assert reasons["same world size"] == "rank 1 reports world size 3, expected 2"
    assert reasons["all_reduce correct"].startswith("rank 1: all_reduce gave 2.0")


def test_no_reports_at_all(trained_root: Path, tmp_path: Path) -> None:
    root, run = copy_run(trained_root, tmp_path)
    for report in run.comms.glob("rank_*.json"):
        report.unlink()
    result = verify_nccl(str(root), "run-1")
    assert [(c.name, c.status) for c in result.failures] == [("all ranks reported", FAIL)]
    assert "never reached start-up" in result.failures[0].reason


def test_expected_world_size_larger_than_reported(trained_root: Path, tmp_path: Path) -> None:
    root, _ = copy_run(trained_root, tmp_path)
    result = verify_nccl(str(root), "run-1", world_size=4)
    assert statuses(result)["all ranks reported"] == FAIL
    assert "rank 2" in result.failures[0].reason


def test_reads_nccl_lines_and_flags_warnings(trained_root: Path, tmp_path: Path) -> None:
    root, run = copy_run(trained_root, tmp_path)
    (run.nccl / "node-a.101.log").write_text(NCCL_LINES)
    result = verify_nccl(str(root), "run-1", world_size=2)
    assert statuses(result)["NCCL initialised"] == PASS
    assert statuses(result)["one NCCL version"] == PASS
    assert result.passed

    pod_log = tmp_path / "worker-1.log"
    pod_log.write_text(
        "2026-11-30T01:02:03.000Z node-b:202:260 [0] NCCL WARN NET/OFI Unable to find a protocol that worked\r\n"
    )
    result = verify_nccl(str(root), "run-1", world_size=2, extra_logs=[str(pod_log)])
    assert {c.name: c.reason for c in result.failures} == {
        "no NCCL warnings": "NET/OFI Unable to find a protocol that worked"
    }


def test_nccl_summary_reads_versions_and_networks(tmp_path: Path) -> None:
    log = tmp_path / "a.log"
    log.write_text(
        NCCL_LINES
        + "node-c:1:1 [3] NCCL INFO NCCL version 2.18.1+cuda12.1\nnode-c:1:1 [3] nccl info Using network Socket\n"
    )
    summary = summarize([log])
    assert summary.versions == {"2.21.5", "2.18.1"}
    assert summary.networks == {"AWS Libfabric", "Socket"}
    assert (summary.init_complete, summary.rings_connected, summary.trees_connected) == (2, 1, 1)


def test_bad_inputs(trained_root: Path, tmp_path: Path) -> None:
    with pytest.raises(InputError, match="does not exist"):
        verify_nccl(str(trained_root), "no-such-run")
    with pytest.raises(InputError, match="no such file"):
        verify_nccl(str(trained_root), "run-1", extra_logs=[str(tmp_path / "missing.log")])
