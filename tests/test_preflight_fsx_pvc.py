"""The fsx-pvc check on the real control plane (tests/cluster/; the cluster each test writes: make_site in
tests/conftest.py, with its FSx PVC, PV and StorageClass as the CSI driver provisions them): the PVC missing, unbound or
not ReadWriteMany, the one the compiled platform settings name, and the volumes render-storage makes for Kubeflow
profiles sharing one file system."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from common.errors import InputError
from components.launch_training.platform import Platform
from components.preflight import fsx_pvc
from components.preflight.result import FAIL, NOT_APPLICABLE, PASS
from pipelines.deploy.storage import FileSystem
from pipelines.deploy.storage import documents as volume_documents
from tests.cluster.installed import FILE_SYSTEM
from tests.preflight_helpers import Site, all_pass, check, others_pass, statuses


@pytest.mark.parametrize(
    ("pvc", "reason", "fix", "throughput"),
    [
        (
            None,
            "PVC fsx-lustre-pvc does not exist in namespace {ns}: the pods would stay Pending",
            "hyperpod-pretrain render-storage --namespace {ns} --pvc-name fsx-lustre-pvc ",
            "could not be read",
        ),
        (
            {"phase": "Pending"},
            "PVC fsx-lustre-pvc is Pending, not Bound",
            "kubectl -n {ns} describe pvc fsx-lustre-pvc: check the FSx CSI driver",
            "is bound to no PersistentVolume",
        ),
        (
            {"access_modes": ("ReadWriteOnce",)},
            "PVC fsx-lustre-pvc is ReadWriteOnce, not ReadWriteMany: the 2 nodes and the "
            "pipeline's steps must mount it "
            "at once",
            "use an FSx for Lustre PV/PVC with accessModes [ReadWriteMany]",
            "",
        ),
    ],
)
def test_pvc_problems_fail(
    make_site: Callable[..., Site], pvc: dict[str, Any] | None, reason: str, fix: str, throughput: str
) -> None:
    site = make_site(pvc=False)
    if pvc is not None:
        site.hp.add_pvc(site.namespace, "fsx-lustre-pvc", **pvc)
    result = site.run()
    got = check(result, "fsx-pvc")
    ns = site.namespace
    assert (got.status, got.reason) == (FAIL, reason.format(ns=ns)) and got.fix.startswith(fix.format(ns=ns))
    others_pass(result, "fsx-pvc", "checkpoint-throughput")
    checkpoint = check(result, "checkpoint-throughput")
    if throughput:  # no volume to compare with: fsx-pvc says why, this check only what the checkpoint needs
        assert checkpoint.status == NOT_APPLICABLE, checkpoint
        assert (
            checkpoint.reason.endswith(f"; PVC fsx-lustre-pvc {throughput} (see fsx-pvc): its file system is unknown")
            and "needs 0.49 MB/s" in checkpoint.reason
        )
    else:
        assert checkpoint.status == PASS, checkpoint


def test_profiles_share_one_file_system_through_the_volumes_render_storage_makes(
    make_site: Callable[..., Site], kubeflow: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """render-storage's PV and PVC per namespace give two profiles one FSx file system: the preflight passes in both
    (the checkpoint's throughput from the tier render-storage records on the PV); a third profile without a PVC is
    told the command; a step whose storage root is on another Lustre file system is told the job would not see its
    data (the step's mounts: /proc/self/mountinfo, here a file of the same format)."""
    first = make_site(profile="pytorchjob", pvc=False)
    second, third = first.in_profile("pytorchjob"), first.in_profile("pytorchjob")
    fsx = FileSystem(
        FILE_SYSTEM, f"{FILE_SYSTEM}.fsx.us-east-1.amazonaws.com", "abcdefgh", "2400Gi", "PERSISTENT_2", 250
    )
    first.hp.apply_volumes(volume_documents(fsx, [first.namespace, second.namespace], "fsx-lustre-pvc"))
    mountinfo = tmp_path / "mountinfo"
    monkeypatch.setattr(fsx_pvc, "MOUNTINFO", mountinfo)
    root = "22 1 0:20 / / rw,relatime - overlay overlay rw\n"
    mountinfo.write_text(root + "36 22 0:50 / /fsx rw,relatime shared:5 - lustre 10.0.1.5@tcp:/abcdefgh rw,flock\n")
    for site in (first, second):
        result = site.run()
        assert statuses(result) == all_pass(), result.markdown()
        assert check(result, "fsx-pvc").reason == f"fsx-lustre-pvc in {site.namespace}: Bound, ReadWriteMany, 2400Gi"
        assert "PERSISTENT_2" in check(result, "checkpoint-throughput").reason
    missing = check(third.run(), "fsx-pvc")
    assert missing.status == FAIL and missing.fix.startswith(
        f"hyperpod-pretrain render-storage --namespace {third.namespace} --pvc-name fsx-lustre-pvc --file-system-id "
    )
    mountinfo.write_text(root + "36 22 0:50 / /fsx rw,relatime - lustre 10.0.9.9@tcp:/zyxwvut1 rw,flock\n")
    other = check(first.run(), "fsx-pvc")
    assert (other.status, other.reason) == (
        FAIL,
        (
            "this step has 10.0.9.9@tcp:/zyxwvut1 at /fsx, where the job mounts PVC fsx-lustre-pvc, but that PVC in "
            f"{first.namespace} is FSx {FILE_SYSTEM} ({FILE_SYSTEM}.fsx.us-east-1.amazonaws.com@tcp:/abcdefgh): "
            "the job would train on and checkpoint to another file system than the one the data is staged on"
        ),
    )


def test_pvc_name_from_the_compiled_platform_settings(site: Site) -> None:
    """The PVC is the platform team's (compile time): the preflight checks the one the job and the steps mount."""
    site.hp.add_pvc(site.namespace, "team-fsx", access_modes=("ReadWriteOnce", "ReadWriteMany"), capacity="2400Gi")
    assert check(site.run(platform=Platform(pvc_name="team-fsx")), "fsx-pvc").reason == (
        f"team-fsx in {site.namespace}: Bound, ReadWriteMany, 2400Gi"
    )
    with pytest.raises(InputError, match="job option 'pvc_name' is not a run option"):
        site.run(job_options={"pvc_name": "team-fsx"})
