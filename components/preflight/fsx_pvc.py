"""The fsx-pvc check: the job's claim exists, is Bound and ReadWriteMany (every node and step mounts it at once),
and is the same FSx file system this step sees at the storage root, so the job trains on the data staged there."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kubernetes.client.exceptions import ApiException

from components.preflight.context import Context, forbidden, not_found
from components.preflight.fsx_tiers import FSX_DRIVER
from components.preflight.result import FAIL, NOT_APPLICABLE, PASS, READ_FIX, WARN, Check


def check_pvc(ctx: Context) -> Check:
    volume = ctx.volume(lambda v: "persistentVolumeClaim" in v)
    if volume is None:
        return Check("fsx-pvc", NOT_APPLICABLE, "the job mounts no PersistentVolumeClaim")
    claim, ns = volume["persistentVolumeClaim"]["claimName"], ctx.namespace
    try:
        pvc = ctx.kube.call("read PVC", ctx.kube.core.read_namespaced_persistent_volume_claim, claim, ns)
    except ApiException as exc:
        if not_found(exc):
            return Check(
                "fsx-pvc",
                FAIL,
                f"PVC {claim} does not exist in namespace {ns}: the pods would stay Pending",
                f"hyperpod-pretrain render-storage --namespace {ns} --pvc-name {claim} --file-system-id "
                "<fs-id> --dns-name <its DNSName> --mount-name <its MountName> --capacity <its size> | "
                "kubectl apply -f - (the file system the other namespaces' runs use: aws fsx "
                "describe-file-systems), or a PVC of the FSx CSI driver's StorageClass",
            )
        if forbidden(exc):
            return Check(
                "fsx-pvc",
                WARN,
                f"cannot read PVC {claim}: the service account may not get persistentvolumeclaims in {ns}",
                READ_FIX.format(what=f"get on persistentvolumeclaims in {ns}"),
            )
        raise
    ctx.pvc = pvc
    phase = (pvc.status.phase if pvc.status else None) or "unknown"
    modes = (pvc.status.access_modes if pvc.status and pvc.status.access_modes else None) or pvc.spec.access_modes
    modes = list(modes or [])
    problems, fixes = [], []
    if phase != "Bound":
        problems.append(f"PVC {claim} is {phase}, not Bound")
        fixes.append(
            f"kubectl -n {ns} describe pvc {claim}: check the FSx CSI driver, the StorageClass or the "
            "static PV's claimRef"
        )
    if "ReadWriteMany" not in modes:
        problems.append(
            f"PVC {claim} is {', '.join(modes) or 'without access modes'}, not ReadWriteMany: the "
            f"{ctx.max_nodes} nodes and the pipeline's steps must mount it at once"
        )
        fixes.append("use an FSx for Lustre PV/PVC with accessModes [ReadWriteMany]")
    if problems:
        return Check("fsx-pvc", FAIL, "; ".join(problems), "; ".join(fixes))
    capacity = (pvc.status.capacity or {}).get("storage", "?")
    if other := other_file_system(ctx, pvc):
        return Check(
            "fsx-pvc",
            FAIL,
            other,
            f"give namespace {ns} a PVC {claim} on the steps' file system: "
            f"hyperpod-pretrain render-storage --namespace {ns} --pvc-name {claim} ... for that file "
            "system",
        )
    return Check("fsx-pvc", PASS, f"{claim} in {ns}: Bound, ReadWriteMany, {capacity}")


MOUNTINFO = Path("/proc/self/mountinfo")  # this process's mounts (proc(5)): where the step sees the storage root


def lustre_mount(path: str, mountinfo: Path | None = None) -> tuple[str, str] | None:
    """(mount point, source) of the Lustre file system ``path`` lies on in this process, or None (not Lustre, not
    mounted here: the preflight run from a laptop). proc(5): the mount point is field 5, the file system type and
    source follow the "-" separator; a space in a path is written \\040."""
    try:
        lines = (mountinfo or MOUNTINFO).read_text().splitlines()
    except OSError:
        return None
    best: tuple[str, str, str] | None = None
    for line in lines:
        fields = line.split()
        if "-" not in fields[6:]:
            continue
        point = fields[4].replace("\\040", " ")
        rest = fields[fields.index("-", 6) + 1 :]
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and len(rest) >= 2 and (best is None or len(point) > len(best[0])):
            best = (point, rest[0], rest[1])
    return (best[0], best[2]) if best and best[1] == "lustre" else None


def other_file_system(ctx: Context, pvc: Any) -> str:
    """Why the job's volume is another file system than the one this step has where the job mounts it, or "". A Lustre
    mount's source is <NID>@tcp:/<mount name> (the client shows the server's address, not the FSx DNS name the CSI
    driver mounted: aws-fsx-csi-driver pkg/driver/node.go NodePublishVolume), so file systems are told apart by mount
    name, which FSx makes unique per file system."""
    volume = ctx.volume(lambda v: "persistentVolumeClaim" in v) or {}
    path = next(
        (m["mountPath"] for m in ctx.container.get("volumeMounts") or [] if m["name"] == volume.get("name")), ""
    )
    mounted = lustre_mount(path) if path else None  # one volume, one path: the steps have it there too
    if mounted is None or not pvc.spec.volume_name:
        return ""
    try:
        pv = ctx.kube.call("read PV", ctx.kube.core.read_persistent_volume, pvc.spec.volume_name)
    except ApiException as exc:
        if forbidden(exc) or not_found(exc):  # checkpoint-throughput says so
            return ""
        raise
    csi = pv.spec.csi
    if csi is None or csi.driver != FSX_DRIVER:
        return ""
    attributes = csi.volume_attributes or {}
    mount_name = attributes.get("mountname") or "fsx"  # the driver's default (NodePublishVolume)
    point, source = mounted
    if source.rpartition(":/")[2].split("/")[0] == mount_name:
        return ""
    return (
        f"this step has {source} at {point}, where the job mounts PVC {pvc.metadata.name}, but that PVC in "
        f"{ctx.namespace} is FSx {csi.volume_handle} ({attributes.get('dnsname', '?')}@tcp:/{mount_name}): the "
        "job would train on and checkpoint to another file system than the one the data is staged on"
    )
