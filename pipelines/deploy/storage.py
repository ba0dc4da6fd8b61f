"""`render-storage`: one FSx for Lustre file system made available in several namespaces, a static PV and its PVC
per namespace, each PV pre-bound to its claim.

A PersistentVolume binds one claim, and a claim lives in one namespace, so a file system shared by several Kubeflow
profiles (or jobs' namespaces) needs one PV per namespace, all naming the same file system. The FSx CSI driver mounts
what the volume context names (kubernetes-sigs/aws-fsx-csi-driver v1.9.0 pkg/driver/node.go NodePublishVolume:
``<dnsname>@tcp:/<mountname>``, type lustre; the volume handle is the file system's id and serves only as the
operation's key), and its CSIDriver needs no attach, so two PVs with the same handle mount side by side, on one node
too. The other way, a StorageClass that provisions a file system per namespace, isolates teams but shares nothing:
each namespace stages its own copy of a corpus and pays for its own file system (docs/storage-contract.md says
which to choose).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import yaml

from common.errors import InputError
from components.preflight.fsx_tiers import STATIC_DEPLOYMENT_TYPE, STATIC_PER_UNIT_THROUGHPUT

_DNS_1123 = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_FILE_SYSTEM = re.compile(r"^fs-[0-9a-f]{8,17}$")
_MOUNT_NAME = re.compile(r"^[a-z0-9]{8}$|^fsx$")  # FSx's 8-character MountName; "fsx" on SCRATCH_1
_CAPACITY = re.compile(r"^[1-9][0-9]*(Gi|Ti)$")
FSX_DRIVER = "fsx.csi.aws.com"
DEPLOYMENT_TYPES = ("SCRATCH_1", "SCRATCH_2", "PERSISTENT_1", "PERSISTENT_2")


@dataclass(frozen=True)
class FileSystem:
    """An FSx for Lustre file system as `aws fsx describe-file-systems` describes it."""

    file_system_id: str
    dns_name: str
    mount_name: str
    capacity: str  # the PV's and PVC's storage, e.g. 1200Gi (the file system's StorageCapacity in GiB)
    deployment_type: str = ""
    per_unit_throughput: int = 0  # MB/s per TiB, for PERSISTENT_* (0: not given)

    def __post_init__(self) -> None:
        if not _FILE_SYSTEM.match(self.file_system_id):
            raise InputError(f"--file-system-id {self.file_system_id!r} is not an FSx file system id (fs-...)")
        if not self.dns_name.startswith(f"{self.file_system_id}.fsx.") or not self.dns_name.endswith(".amazonaws.com"):
            raise InputError(
                f"--dns-name {self.dns_name!r} is not {self.file_system_id}'s DNS name "
                f"({self.file_system_id}.fsx.<region>.amazonaws.com)"
            )
        if not _MOUNT_NAME.match(self.mount_name):
            raise InputError(
                f"--mount-name {self.mount_name!r} is not an FSx mount name (8 lowercase characters, or "
                "fsx for a SCRATCH_1 file system)"
            )
        if not _CAPACITY.match(self.capacity):
            raise InputError(f"--capacity {self.capacity!r} is not a size in Gi or Ti (e.g. 1200Gi)")
        if self.deployment_type and self.deployment_type not in DEPLOYMENT_TYPES:
            raise InputError(f"--deployment-type {self.deployment_type!r}: one of {', '.join(DEPLOYMENT_TYPES)}")
        if self.per_unit_throughput and not self.deployment_type.startswith("PERSISTENT"):
            raise InputError(
                "--per-unit-storage-throughput is a PERSISTENT_1 or PERSISTENT_2 file system's: give "
                "--deployment-type with it"
            )


def pv_name(file_system: FileSystem, namespace: str) -> str:
    return f"{file_system.file_system_id}-{namespace}"[:253]


def documents(file_system: FileSystem, namespaces: list[str], pvc_name: str) -> list[dict]:
    """Per namespace, a static PV (Retain: deleting a namespace never touches the file system) pre-bound to the claim
    ``pvc_name`` there (claimRef), and that claim naming it (volumeName), so that no other claim can take it."""
    for namespace in namespaces:
        if len(namespace) > 63 or not _DNS_1123.match(namespace):
            raise InputError(f"--namespace {namespace!r} is not a namespace name (a DNS-1123 label)")
    if len(pvc_name) > 253 or not re.match(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$", pvc_name):
        raise InputError(f"--pvc-name {pvc_name!r} is not a PVC name")
    if len(set(namespaces)) != len(namespaces):
        raise InputError("--namespace: each namespace once")
    labels = {
        "app.kubernetes.io/part-of": "hyperpod-pretrain",
        "hyperpod-pretrain/file-system": file_system.file_system_id,
    }
    # the file system's tier, which a static PV has no StorageClass to say (the preflight's checkpoint-throughput)
    annotations = {STATIC_DEPLOYMENT_TYPE: file_system.deployment_type} if file_system.deployment_type else {}
    if file_system.per_unit_throughput:
        annotations[STATIC_PER_UNIT_THROUGHPUT] = str(file_system.per_unit_throughput)
    docs: list[dict] = []
    for namespace in namespaces:
        name = pv_name(file_system, namespace)
        docs.append(
            {
                "apiVersion": "v1",
                "kind": "PersistentVolume",
                "metadata": {"name": name, "labels": labels, **({"annotations": annotations} if annotations else {})},
                "spec": {
                    "capacity": {"storage": file_system.capacity},
                    "volumeMode": "Filesystem",
                    "accessModes": ["ReadWriteMany"],
                    "persistentVolumeReclaimPolicy": "Retain",
                    "storageClassName": "",
                    "mountOptions": ["flock"],
                    "claimRef": {
                        "apiVersion": "v1",
                        "kind": "PersistentVolumeClaim",
                        "namespace": namespace,
                        "name": pvc_name,
                    },
                    "csi": {
                        "driver": FSX_DRIVER,
                        "volumeHandle": file_system.file_system_id,
                        "volumeAttributes": {"dnsname": file_system.dns_name, "mountname": file_system.mount_name},
                    },
                },
            }
        )
        docs.append(
            {
                "apiVersion": "v1",
                "kind": "PersistentVolumeClaim",
                "metadata": {"name": pvc_name, "namespace": namespace, "labels": labels},
                "spec": {
                    "accessModes": ["ReadWriteMany"],
                    "storageClassName": "",
                    "volumeName": name,
                    "resources": {"requests": {"storage": file_system.capacity}},
                },
            }
        )
    return docs


def render(file_system: FileSystem, namespaces: list[str], pvc_name: str) -> str:
    head = (
        f"# FSx for Lustre {file_system.file_system_id} ({file_system.dns_name}@tcp:/{file_system.mount_name}) as "
        f"PVC {pvc_name} in {', '.join(namespaces)}: one static PV per namespace, all on the same file system.\n"
        "# Rendered by: hyperpod-pretrain render-storage; apply with kubectl apply -f - (as a cluster admin: "
        "PersistentVolumes are cluster-scoped).\n"
    )
    return head + yaml.safe_dump_all(documents(file_system, namespaces, pvc_name), sort_keys=False)
