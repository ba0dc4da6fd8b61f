"""The checkpoint-throughput check on the real control plane (tests/cluster/; the cluster each test writes: make_site
in tests/conftest.py): whether the FSx file system behind the PVC writes a SIGTERM's checkpoint within half the
preemption budget, from the tier its StorageClass records (the sizes it names: tests/test_preflight_fsx_tiers.py; the
model's size from a published config.json: tests/test_preflight_gpu_memory.py)."""

from __future__ import annotations

import inspect
import json
import math
from collections.abc import Callable
from decimal import Decimal
from pathlib import Path
from typing import Any

from components.preflight.context import ASSUMED_VOCAB
from components.preflight.fsx_tiers import fsx_size_gib
from components.preflight.result import NOT_APPLICABLE, PASS, WARN, Check
from tests.cluster.control_plane import deploy_grants
from tests.preflight_helpers import SCRATCH_2, Site, check, others_pass
from trainer.layout import META, DatasetPaths

LLAMA_1B = 989_923_328  # llama-1b's parameters with the pipeline's default vocabulary (8,192): issue 19's 11.9 GB

PERSISTENT_2 = {**SCRATCH_2, "deploymentType": "PERSISTENT_2"}


def checkpoint_mb(parameters: int) -> float:
    """What a SIGTERM's checkpoint writes, in MB: fp32 weights, exp_avg and exp_avg_sq (12 bytes a parameter), +10%."""
    return parameters * 12 * 1.1 / 1e6


def throughput(site: Site, **overrides: Any) -> Check:
    return check(site.run(**{"preset": "llama-1b", **overrides}), "checkpoint-throughput")


def test_an_fsx_fast_enough_for_the_sigterm_checkpoint_passes(make_site: Callable[..., Site]) -> None:
    site = make_site(pvc=False)
    p2 = site.hp.add_storage_class("fsx-p2", {**PERSISTENT_2, "perUnitStorageThroughput": "500"})
    pv = site.hp.add_pvc(site.namespace, "fsx-lustre-pvc", storage_class=p2)["spec"]["volumeName"]
    result = site.run(preset="llama-1b")
    got = check(result, "checkpoint-throughput")
    # 120 s grace period; the launcher gives torchrun's shutdown timeout 20 s less: 100 s, half of it for the save.
    assert round(checkpoint_mb(LLAMA_1B) / 50) == 261 and round(checkpoint_mb(LLAMA_1B) / 600) == 22
    assert got.status == PASS and got.reason == (
        "the llama-1b checkpoint, 989,923,328 parameters x 12 bytes = 11.9 GB (vocabulary 8,192 assumed: the "
        "pipeline's default, the dataset is not staged yet), 13.1 GB with a 10% margin, needs 261 MB/s to take at "
        "most half of the 100 s preemption budget (the smaller of the pod's 120 s grace period and torchrun's 100 s "
        "shutdown timeout; the other half is for the step in flight at SIGTERM, of a length unknown here); FSx "
        f"fs-0123456789abcdef0 (PV {pv}, 1,200 GiB), PERSISTENT_2, writes 500 MB/s/TiB = 600 MB/s: the save takes ~22 s"
    )
    others_pass(result, "checkpoint-throughput")


def test_a_slow_fsx_warns_naming_a_size_a_tier_and_a_budget_that_fit(make_site: Callable[..., Site]) -> None:
    site = make_site(pvc=False)
    p2 = site.hp.add_storage_class("fsx-p2", {**PERSISTENT_2, "perUnitStorageThroughput": "125"})
    site.hp.add_pvc(site.namespace, "fsx-lustre-pvc", storage_class=p2)
    result = site.run(preset="llama-1b")
    got = check(result, "checkpoint-throughput")
    has = 1.2 * 125  # MB/s: FSx counts 1,200 GiB as 1.2 TiB
    assert checkpoint_mb(LLAMA_1B) / 50 > has, "261 MB/s needed"
    assert got.status == WARN and result.passed and result.verdict() == "passed, 1 warning(s)"
    assert got.reason.endswith(
        f"PERSISTENT_2, writes 125 MB/s/TiB = 150 MB/s: the save would take ~{checkpoint_mb(LLAMA_1B) / has:.0f} s of "
        "the 100 s budget, so a preemption may lose the steps since the last periodic checkpoint (the run itself works)"
    ), got.reason
    budget = math.ceil(checkpoint_mb(LLAMA_1B) / has * 2)
    assert (2.4 * 125, 1.2 * 250) == (300, 300) and budget == 175  # each fits 261 MB/s; 87.1 s is half of 175 s
    assert got.fix == (
        "for this job: a file system of 2,400 GiB (2.4 TiB) at 125 MB/s/TiB (a larger PVC request where the "
        "StorageClass allows expansion, or aws fsx update-file-system --storage-capacity), or the 250 MB/s/TiB tier "
        "(300 MB/s at this size; aws fsx update-file-system --lustre-configuration PerUnitStorageThroughput=250), or "
        "a preemption budget of at least 175 s (job options grace_period_s and shutdown_timeout_s)"
    )
    others_pass(result, "checkpoint-throughput")
    # The budget it names fits: a 195 s grace period gives torchrun 175 s.
    assert throughput(site, job_options={"grace_period_s": 195}).status == PASS
    assert throughput(site, job_options={"grace_period_s": 194}).status == WARN


def test_scratch_is_counted_at_its_write_baseline(site: Site) -> None:
    """SCRATCH_2 reads 200 MB/s/TiB but writes 100: the healthy cluster's 1,200 GiB writes 120 MB/s, too slow."""
    got = throughput(site)
    assert got.status == WARN and "SCRATCH_2, writes 100 MB/s/TiB = 120 MB/s: the save would take ~109 s" in got.reason
    size = fsx_size_gib(Decimal(checkpoint_mb(LLAMA_1B) / 50 * 1000 / 100), "SCRATCH_2", "SSD", 100)
    assert size == 4800, "2,613 GiB rounds up to the driver's next 2,400 GiB step"
    assert got.fix.startswith("for this job: a file system of 4,800 GiB (4.8 TiB) at 100 MB/s/TiB")
    assert (
        ", or a PERSISTENT_2 file system of this size at 250 MB/s/TiB (300 MB/s), or a preemption budget of at "
        "least 218 s" in got.fix
    )


def test_the_budget_is_the_grace_period_capped_by_torchruns_shutdown_timeout(site: Site) -> None:
    longer = throughput(site, job_options={"grace_period_s": 300})
    assert (
        longer.status == PASS
        and "needs 93 MB/s to take at most half of the 280 s preemption budget (the smaller "
        "of the pod's 300 s grace period and torchrun's 280 s shutdown timeout;"
        in longer.reason
    )
    assert round(checkpoint_mb(LLAMA_1B) / 140) == 93
    default = throughput(site, job_options={"shutdown_timeout_s": 0})  # torchrun's own: 30 s
    assert (
        default.status == WARN
        and "needs 871 MB/s to take at most half of the 30 s preemption budget (the "
        "smaller of the pod's 120 s grace period and torchrun's 30 s shutdown timeout;"
        in default.reason
    )


def test_the_vocabulary_of_a_staged_dataset_is_used(site: Site, staged_root: Path) -> None:
    got = throughput(site, storage_root=str(staged_root))
    meta = json.loads((DatasetPaths.of(staged_root, "synthetic").current_snapshot() / META).read_text())
    assert meta["vocab_size"] < 512, "BPE on the small corpus stops short of the 512 asked for"
    vocab = meta["model_vocab_size"]  # the model's: the tokenizer's padded to a multiple of 64
    assert vocab % 64 == 0 and vocab - 64 < meta["vocab_size"] <= vocab
    smaller = LLAMA_1B - (ASSUMED_VOCAB - vocab) * 2048  # tied embeddings, 2048 wide
    assert f"the llama-1b checkpoint, {smaller:,} parameters x 12 bytes = 11.7 GB (vocabulary {vocab}), " in got.reason


def test_the_assumed_vocabulary_is_the_pipelines_default() -> None:
    from pipelines.pipeline import PlatformOptions, build_pipeline

    signature = inspect.signature(build_pipeline(PlatformOptions()).pipeline_func)
    assert signature.parameters["vocab_size"].default == ASSUMED_VOCAB


def test_a_static_pv_is_compared_with_the_slowest_tier(make_site: Callable[..., Site]) -> None:
    """A statically provisioned PV says nothing of its tier, even when it names a StorageClass to bind with."""
    site = make_site(pvc=False)
    pv = site.hp.name("fsx-static")
    for storage_class in ("", None):  # none, or this test's fsx-sc
        site.hp.add_pvc(site.namespace, "fsx-lustre-pvc", static_pv=pv, storage_class=storage_class, capacity="2400Gi")
        got = throughput(site)
        assert got.status == WARN and got.reason.endswith(
            f"; the write throughput of FSx fs-0123456789abcdef0 (PV {pv}, 2,400 GiB) is unknown here: its "
            "PersistentVolume was provisioned statically, so no StorageClass says how it was created"
        ), got.reason
        assert got.fix.startswith(
            "compare it yourself: aws fsx describe-file-systems --file-system-ids fs-0123456789abcdef0 "
        ) and got.fix.endswith("must reach 261 MB/s")
        small = throughput(site, preset="small")
        assert small.status == PASS and small.reason.endswith(
            f"(PV {pv}, 2,400 GiB) writes at least 29 MB/s at the slowest FSx for Lustre tier (12 MB/s/TiB; its "
            "PersistentVolume was provisioned statically, so no StorageClass says how it was created)"
        ), small.reason
        site.hp.remove_pvc(site.namespace, "fsx-lustre-pvc")


def test_a_storage_class_gone_or_without_a_known_tier_leaves_it_unknown(make_site: Callable[..., Site]) -> None:
    site = make_site(pvc=False)
    site.hp.add_pvc(site.namespace, "fsx-lustre-pvc", storage_class=site.hp.name("fsx-gone"))
    gone = throughput(site)
    assert gone.status == WARN and gone.reason.endswith(
        f"is unknown here: StorageClass {site.hp.name('fsx-gone')}, which provisioned it, no longer exists"
    )
    site.hp.remove_pvc(site.namespace, "fsx-lustre-pvc")
    p2 = site.hp.add_storage_class("fsx-p2", PERSISTENT_2)  # no perUnitStorageThroughput: the CSI driver refuses it
    site.hp.add_pvc(site.namespace, "fsx-lustre-pvc", storage_class=p2)
    assert throughput(site).reason.endswith(
        f"StorageClass {p2} has deploymentType PERSISTENT_2, storageType SSD, perUnitStorageThroughput none: no tier "
        "known here"
    )


def test_a_volume_that_is_not_fsx_is_not_applicable(make_site: Callable[..., Site]) -> None:
    site = make_site(pvc=False)
    efs = site.hp.name("efs-pv")
    pvc = site.hp.add_pvc(site.namespace, "fsx-lustre-pvc", static_pv=efs, storage_class="", pv=False)
    site.hp.add_pv(efs, driver="efs.csi.aws.com", volume_handle="fs-0abc", claim=pvc, dynamic=False)
    result = site.run(preset="llama-1b")
    got = check(result, "checkpoint-throughput")
    assert got.status == NOT_APPLICABLE and "needs 261 MB/s" in got.reason, "the platform team compares with that"
    assert got.reason.endswith(
        f"; PersistentVolume {efs} is not FSx for Lustre (CSI driver efs.csi.aws.com): "
        "compare its write throughput with that"
    )
    others_pass(result, "checkpoint-throughput")


def test_cannot_read_the_pv_or_storage_class_warns_with_what_it_needs(make_site: Callable[..., Site]) -> None:
    site = make_site(grants=deploy_grants(without=("get storageclasses",)))
    storage_class = throughput(site)
    assert storage_class.status == WARN and "needs 261 MB/s" in storage_class.reason
    assert storage_class.reason.endswith(
        f"is unknown here: cannot read StorageClass {site.hp.name('fsx-sc')}: the "
        "service account may not get storageclasses"
    )
    assert storage_class.fix.startswith(
        "grant the step's service account get on storageclasses.storage.k8s.io to run this check"
    )
    site = site.with_grants(deploy_grants(without=("get storageclasses", "get persistentvolumes")))
    result = site.run(preset="llama-1b")
    pv = check(result, "checkpoint-throughput")
    assert pv.status == WARN and result.passed and "needs 261 MB/s" in pv.reason
    assert pv.reason.split("; ")[-1].startswith("cannot read PersistentVolume pvc-") and pv.reason.endswith(
        ": the service account may not get persistentvolumes"
    )
    assert (
        pv.fix.startswith(
            "grant the step's service account get on persistentvolumes and "
            "storageclasses.storage.k8s.io to run this check"
        )
        and "kubectl apply -f deploy/rbac-cluster-read.yaml" in pv.fix
    )
    others_pass(result, "checkpoint-throughput")
