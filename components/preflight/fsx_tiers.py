"""FSx for Lustre's write throughput per deployment type and the sizes the FSx CSI driver provisions: the tables the
checkpoint-throughput check compares a SIGTERM checkpoint with, and what render-storage records on a static PV."""

from __future__ import annotations

import math
from dataclasses import dataclass
from decimal import Decimal

FSX_DRIVER = "fsx.csi.aws.com"
PROVISIONED_BY = "pv.kubernetes.io/provisioned-by"  # set on a PV its StorageClass's provisioner created
# What render-storage writes on a static PV, which has no StorageClass to say how its file system was made.
STATIC_DEPLOYMENT_TYPE = "hyperpod-pretrain/fsx-deployment-type"
STATIC_PER_UNIT_THROUGHPUT = "hyperpod-pretrain/fsx-per-unit-storage-throughput"
MB = Decimal(10**6)  # FSx throughput is in MB/s of 10^6 bytes
# FSx for Lustre counts throughput per "TiB" of 1,000 GiB: "for a 2.4-TiB file system, provisioning 50 MB/s/TiB of
# PerUnitStorageThroughput yields 120 MB/s" (FSx API Reference, CreateFileSystemLustreConfiguration), and 2.4 TiB is
# the 2,400 GiB size step.
FSX_GIB_PER_TIB = 1000
# Baseline disk throughput of writes, MB/s per TiB: a checkpoint is all writes, and bursts are not counted on. The FSx
# for Lustre User Guide, "Performance characteristics of SSD and HDD storage classes": SCRATCH_2 writes 100 (reads
# 200); a persistent file system writes its PerUnitStorageThroughput, PERSISTENT_1 SSD 50, 100 or 200, HDD 12 or 40,
# PERSISTENT_2 125, 250, 500 or 1000 (API Reference, LustreFileSystemConfiguration). SCRATCH_1, the API's default
# deploymentType and the FSx CSI driver's when a StorageClass names none (pkg/util/util.go, RoundUpVolumeSize), is
# counted at the 200 MB/s/TiB scratch baseline ("Deployment options for FSx for Lustre file systems"). The CSI driver
# puts none of this on the PV (its volumeAttributes are dnsname and mountname only), so it comes from the StorageClass
# that provisioned it: a throughput changed since (aws fsx update-file-system) is not seen.
SCRATCH_WRITE = {"SCRATCH_1": 200, "SCRATCH_2": 100}
PER_UNIT_TIERS: dict[tuple[str, str], tuple[int, ...]] = {
    ("PERSISTENT_1", "SSD"): (50, 100, 200),
    ("PERSISTENT_1", "HDD"): (12, 40),
    ("PERSISTENT_2", "SSD"): (125, 250, 500, 1000),
}
SLOWEST_TIER = 12  # MB/s per TiB: no FSx for Lustre file system writes slower (PERSISTENT_1 HDD at 12)


@dataclass
class FsxFileSystem:
    """An FSx for Lustre file system as its PersistentVolume and the StorageClass that provisioned it say."""

    pv: str
    handle: str  # the file system's id, fs-...
    capacity_gib: Decimal
    deployment: str = ""  # "": unknown
    storage_type: str = "SSD"
    per_unit: int = 0  # MB/s written per TiB; 0: unknown

    @property
    def tib(self) -> Decimal:
        return self.capacity_gib / FSX_GIB_PER_TIB

    @property
    def mbps(self) -> Decimal:
        return self.tib * self.per_unit

    def name(self) -> str:
        return f"FSx {self.handle} (PV {self.pv}, {self.capacity_gib:,.0f} GiB)"


def write_tier(parameters: dict[str, str]) -> tuple[str, str, int]:
    """(deploymentType, storageType, MB/s written per TiB) from an FSx StorageClass's parameters; 0 MB/s: unknown."""
    deployment = parameters.get("deploymentType") or "SCRATCH_1"
    storage_type = (parameters.get("storageType") or "SSD").upper()
    if deployment in SCRATCH_WRITE:
        return deployment, storage_type, SCRATCH_WRITE[deployment]
    try:
        per_unit = int(parameters.get("perUnitStorageThroughput") or 0)
    except ValueError:
        per_unit = 0
    return deployment, storage_type, per_unit if per_unit in PER_UNIT_TIERS.get((deployment, storage_type), ()) else 0


def fsx_size_gib(at_least_gib: Decimal, deployment: str, storage_type: str, per_unit: int) -> int:
    """The size the FSx CSI driver provisions for a request of `at_least_gib` (kubernetes-sigs/aws-fsx-csi-driver
    pkg/util/util.go, RoundUpVolumeSize): HDD in steps of 6,000 GiB (12 MB/s/TiB) or 1,800 GiB (40); SCRATCH_1 1,200,
    2,400, then steps of 3,600; the others 1,200, then steps of 2,400."""
    if storage_type == "HDD":
        step = 6000 if per_unit == 12 else 1800
        return step * max(1, math.ceil(at_least_gib / step))
    step = 3600 if deployment == "SCRATCH_1" else 2400
    if at_least_gib < step:
        return 1200 * max(1, math.ceil(at_least_gib / 1200))
    return step * math.ceil(at_least_gib / step)
