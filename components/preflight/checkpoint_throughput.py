"""The checkpoint-throughput check: on SIGTERM (a preemption, a HyperPod node replaced) the trainer writes a
checkpoint in the pod's grace period; this compares what it writes with what the job's FSx file system can write in
that time (its tier and size: fsx_tiers.py), and names a size, a tier or a budget that would fit."""

from __future__ import annotations

import math
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from kubernetes.client.exceptions import ApiException

from components.preflight.context import Context, forbidden, not_found
from components.preflight.fsx_tiers import (
    FSX_DRIVER,
    FSX_GIB_PER_TIB,
    MB,
    PER_UNIT_TIERS,
    PROVISIONED_BY,
    SCRATCH_WRITE,
    SLOWEST_TIER,
    STATIC_DEPLOYMENT_TYPE,
    STATIC_PER_UNIT_THROUGHPUT,
    FsxFileSystem,
    fsx_size_gib,
    write_tier,
)
from components.preflight.quantities import GI, quantity
from components.preflight.result import NOT_APPLICABLE, PASS, READ_FIX, WARN, Check
from trainer.config import TRAIN_DEFAULTS
from trainer.model import build_model

# What the trainer checkpoints per parameter: fp32 weights and AdamW's exp_avg and exp_avg_sq, 4 bytes each (bf16
# autocast keeps the weights in fp32). The ranks write their shares in parallel (torch.distributed.checkpoint), each
# tensor once, so the save runs at the file system's throughput, not one client's.
STATE_BYTES_PER_PARAMETER = 12
# On top of those bytes. The rest of the checkpoint (schedule, RNG states, data position, the format's metadata) is
# well under 1% of them; the margin is for creating, syncing and renaming the files on Lustre's metadata server,
# which take time but no throughput.
STATE_MARGIN = Decimal("0.10")
# The share of the preemption budget the save may take. SIGTERM lands mid-step and the step in flight finishes first
# (how long a step takes is unknown here); the processes must still exit after the save. Half is left for both.
SAVE_SHARE = Decimal("0.5")
DEFAULT_GRACE_S = 30  # a pod's terminationGracePeriodSeconds when it sets none (the Kubernetes default)


@dataclass
class CheckpointNeed:
    """What a SIGTERM's checkpoint writes and the time it has for it."""

    model: str  # the preset's name, or "the published llama model"
    parameters: int
    vocab: int
    vocab_assumed: bool
    grace_s: int  # the pod's terminationGracePeriodSeconds
    shutdown_s: int  # torchrun's shutdown timeout: it SIGKILLs the workers this long after forwarding SIGTERM

    @property
    def budget_s(self) -> int:
        return min(self.grace_s, self.shutdown_s)

    @property
    def state_bytes(self) -> int:
        return self.parameters * STATE_BYTES_PER_PARAMETER

    @property
    def write_bytes(self) -> Decimal:
        return self.state_bytes * (1 + STATE_MARGIN)

    @property
    def mbps(self) -> Decimal:
        return self.write_bytes / MB / (self.budget_s * SAVE_SHARE)

    def seconds_at(self, mbps: Decimal) -> Decimal:
        return self.write_bytes / MB / mbps

    def describe(self) -> str:
        vocab = f"vocabulary {self.vocab:,}" + (
            " assumed: the pipeline's default, the dataset is not staged yet" if self.vocab_assumed else ""
        )
        model = self.model if self.model.startswith("the ") else f"the {self.model}"
        return (
            f"{model} checkpoint, {self.parameters:,} parameters x {STATE_BYTES_PER_PARAMETER} bytes = "
            f"{size_text(self.state_bytes)} ({vocab}), {size_text(self.write_bytes)} with a "
            f"{STATE_MARGIN * 100:.0f}% margin, needs {rate_text(self.mbps)} to take at most half of the "
            f"{self.budget_s} s preemption budget (the smaller of the pod's {self.grace_s} s grace period and "
            f"torchrun's {self.shutdown_s} s shutdown timeout; the other half is for the step in flight at "
            "SIGTERM, of a length unknown here)"
        )


def size_text(n: Decimal | int) -> str:
    return f"{Decimal(n) / 10**9:.1f} GB" if n >= 10**8 else f"{Decimal(n) / MB:.1f} MB"


def rate_text(mbps: Decimal) -> str:
    return f"{mbps:,.0f} MB/s" if mbps >= 10 else f"{mbps:.2f} MB/s"


def checkpoint_need(ctx: Context) -> CheckpointNeed:
    """The job's checkpoint size (its model built on the meta device: shapes only, no memory) and save budget."""
    # Here, not at the top: torch (and trainer.preemption, which imports it) take 1.5 s to import, for this check only.
    import torch

    from trainer.preemption import TORCHRUN_DEFAULT_SHUTDOWN_S

    config, name, vocab, assumed = ctx.model_config(int(ctx.trainer_flag("--seq-len", TRAIN_DEFAULTS["seq_len"])))
    with torch.device("meta"):
        model = build_model(config)
    parameters = sum(p.numel() for p in model.parameters())  # tied embeddings once, as the state_dict saves them
    env = {e["name"]: e.get("value", "") for e in ctx.container.get("env") or []}
    grace = int(ctx.pod.get("terminationGracePeriodSeconds", DEFAULT_GRACE_S))
    shutdown = int(env.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT") or TORCHRUN_DEFAULT_SHUTDOWN_S)
    return CheckpointNeed(name, parameters, vocab, assumed, grace, shutdown)


def fitting_choices(need: CheckpointNeed, fsx: FsxFileSystem) -> list[str]:
    """What would fit: this tier at a larger size, a faster tier at this size, a longer budget."""
    size = fsx_size_gib(need.mbps * FSX_GIB_PER_TIB / fsx.per_unit, fsx.deployment, fsx.storage_type, fsx.per_unit)
    choices = [
        f"a file system of {size:,} GiB ({Decimal(size) / FSX_GIB_PER_TIB:.1f} TiB) at {fsx.per_unit} "
        "MB/s/TiB (a larger PVC request where the StorageClass allows expansion, or aws fsx "
        "update-file-system --storage-capacity)"
    ]
    scratch = fsx.deployment in SCRATCH_WRITE
    tiers = PER_UNIT_TIERS[("PERSISTENT_2", "SSD")] if scratch else PER_UNIT_TIERS[(fsx.deployment, fsx.storage_type)]
    faster = next((u for u in tiers if u > fsx.per_unit and fsx.tib * u >= need.mbps), None)
    if faster is not None:
        rate = rate_text(fsx.tib * faster)
        choices.append(
            f"a PERSISTENT_2 file system of this size at {faster} MB/s/TiB ({rate})"
            if scratch
            else f"the {faster} MB/s/TiB tier ({rate} at this size; aws fsx update-file-system "
            f"--lustre-configuration PerUnitStorageThroughput={faster})"
        )
    budget = math.ceil(need.seconds_at(fsx.mbps) / SAVE_SHARE)
    choices.append(f"a preemption budget of at least {budget} s (job options grace_period_s and shutdown_timeout_s)")
    return choices


def check_checkpoint_throughput(ctx: Context) -> Check:
    name = "checkpoint-throughput"
    volume = ctx.volume(lambda v: "persistentVolumeClaim" in v)
    if volume is None:
        return Check(name, NOT_APPLICABLE, "the job mounts no PersistentVolumeClaim to checkpoint to")
    need = checkpoint_need(ctx)
    claim = volume["persistentVolumeClaim"]["claimName"]
    pv_name = ctx.pvc.spec.volume_name if ctx.pvc is not None else None
    if not pv_name:
        why = "could not be read" if ctx.pvc is None else "is bound to no PersistentVolume"
        return Check(
            name, NOT_APPLICABLE, f"{need.describe()}; PVC {claim} {why} (see fsx-pvc): its file system is unknown"
        )
    try:
        pv = ctx.kube.call("read PV", ctx.kube.core.read_persistent_volume, pv_name)
    except ApiException as exc:
        if forbidden(exc):
            return Check(
                name,
                WARN,
                f"{need.describe()}; cannot read PersistentVolume {pv_name}: the service account "
                "may not get persistentvolumes",
                READ_FIX.format(what="get on persistentvolumes and storageclasses.storage.k8s.io"),
            )
        if not_found(exc):
            return Check(
                name,
                WARN,
                f"{need.describe()}; PersistentVolume {pv_name} of PVC {claim} does not exist",
                f"kubectl -n {ctx.namespace} describe pvc {claim}",
            )
        raise
    csi = pv.spec.csi
    if csi is None or csi.driver != FSX_DRIVER:
        what = f"CSI driver {csi.driver}" if csi is not None else "not a CSI volume"
        return Check(
            name,
            NOT_APPLICABLE,
            f"{need.describe()}; PersistentVolume {pv_name} is not FSx for Lustre "
            f"({what}): compare its write throughput with that",
        )
    fsx = FsxFileSystem(pv_name, csi.volume_handle, quantity((pv.spec.capacity or {})["storage"]) / GI)
    unknown, fix = read_tier(ctx, fsx, pv)
    if unknown:
        floor = fsx.tib * SLOWEST_TIER
        if need.mbps <= floor:
            return Check(
                name,
                PASS,
                f"{need.describe()}; {fsx.name()} writes at least {rate_text(floor)} at the "
                f"slowest FSx for Lustre tier ({SLOWEST_TIER} MB/s/TiB; {unknown})",
            )
        return Check(
            name,
            WARN,
            f"{need.describe()}; the write throughput of {fsx.name()} is unknown here: {unknown}",
            fix
            or f"compare it yourself: aws fsx describe-file-systems --file-system-ids {fsx.handle} "
            "gives StorageCapacity (GiB) and LustreConfiguration's DeploymentType and "
            "PerUnitStorageThroughput; StorageCapacity / 1000 x the MB/s per TiB it writes (the "
            "PerUnitStorageThroughput; SCRATCH_2 100, SCRATCH_1 200) must reach "
            f"{rate_text(need.mbps)}",
        )
    tier = f"{fsx.deployment}" + (f" {fsx.storage_type}" if fsx.storage_type != "SSD" else "")
    has = f"{fsx.name()}, {tier}, writes {fsx.per_unit} MB/s/TiB = {rate_text(fsx.mbps)}"
    seconds = need.seconds_at(fsx.mbps)
    took = f"~{seconds:.0f} s" if seconds >= 10 else f"~{seconds:.1f} s"
    if fsx.mbps >= need.mbps:
        return Check(name, PASS, f"{need.describe()}; {has}: the save takes {took}")
    return Check(
        name,
        WARN,
        f"{need.describe()}; {has}: the save would take {took} of the "
        f"{need.budget_s} s budget, so a preemption may lose the steps since the last periodic checkpoint "
        "(the run itself works)",
        "for this job: " + ", or ".join(fitting_choices(need, fsx)),
    )


def read_tier(ctx: Context, fsx: FsxFileSystem, pv: Any) -> tuple[str, str]:
    """Fill in `fsx`'s deployment type and write throughput from the StorageClass that provisioned its PV; else
    (why they are unknown, the fix when there is one)."""
    storage_class = pv.spec.storage_class_name
    annotations = pv.metadata.annotations or {}
    if annotations.get(PROVISIONED_BY) != FSX_DRIVER:
        if STATIC_DEPLOYMENT_TYPE in annotations:  # as render-storage recorded it
            fsx.deployment, fsx.storage_type, fsx.per_unit = write_tier(
                {
                    "deploymentType": annotations[STATIC_DEPLOYMENT_TYPE],
                    "perUnitStorageThroughput": annotations.get(STATIC_PER_UNIT_THROUGHPUT, ""),
                }
            )
            if fsx.per_unit:
                return "", ""
        return "its PersistentVolume was provisioned statically, so no StorageClass says how it was created", ""
    if not storage_class:
        return "its PersistentVolume names no StorageClass", ""
    try:
        found = ctx.kube.call("read StorageClass", ctx.storage.read_storage_class, storage_class)
    except ApiException as exc:
        if forbidden(exc):
            why = f"cannot read StorageClass {storage_class}: the service account may not get storageclasses"
            return why, READ_FIX.format(what="get on storageclasses.storage.k8s.io")
        if not_found(exc):
            return f"StorageClass {storage_class}, which provisioned it, no longer exists", ""
        raise
    fsx.deployment, fsx.storage_type, fsx.per_unit = write_tier(found.parameters or {})
    if not fsx.per_unit:
        per_unit = (found.parameters or {}).get("perUnitStorageThroughput") or "none"
        return (
            f"StorageClass {storage_class} has deploymentType {fsx.deployment}, storageType {fsx.storage_type}, "
            f"perUnitStorageThroughput {per_unit}: no tier known here",
            "",
        )
    return "", ""
