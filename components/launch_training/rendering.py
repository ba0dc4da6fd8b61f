"""What every job API's manifest is made of, built here once: the trainer's pod (resources, environment, volumes,
tolerations, the node-health affinity), and the job's metadata (our labels and annotations, Kueue's queue,
HyperPod's auto-resume, the launcher's pod as owner and the spec digest a re-attach compares).

pytorchjob.py and trainjob.py render their objects from these parts; manifest.py holds the `JobSpec` they are made of.
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from components.launch_training.manifest import JobSpec

SPEC_HASH_ANNOTATION = "hyperpod-pretrain.io/spec-sha256"
# Kueue (HyperPod task governance) queues a job labelled with its LocalQueue and priority class
# (kubernetes-sigs/kueue pkg/controller/constants: QueueLabel, WorkloadPriorityClassLabel).
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
PRIORITY_CLASS_LABEL = "kueue.x-k8s.io/priority-class"
AUTO_RESUME = "sagemaker.amazonaws.com/enable-job-auto-resume"
MAX_RETRY = "sagemaker.amazonaws.com/job-max-retry-count"
RDZV_STORE_OPT_OUT = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"  # torchrun: a rendezvous store address per round
HEALTH_LABEL = "sagemaker.amazonaws.com/node-health-status"
DEEP_HEALTH_LABEL = "sagemaker.amazonaws.com/deep-health-check-status"


def container_env(spec: JobSpec) -> list[dict[str, str]]:
    env = {"NCCL_DEBUG": "INFO", "TRAINER_GRACE_PERIOD_S": str(spec.grace_period_s)}
    if spec.min_nodes < spec.max_nodes:
        # A node that joins a running elastic job never gets in otherwise: by default the c10d rendezvous handler
        # builds the workers' store address once, in the first round, and rank 0 does not publish it again, so a
        # newcomer waits for MASTER_ADDR of the new round and both agents time out (torch 2.13,
        # torch/distributed/elastic/rendezvous/dynamic_rendezvous.py, DynamicRendezvousHandler.next_rendezvous;
        # experiments/elastic_membership.py shows both).
        env[RDZV_STORE_OPT_OUT] = "1"
    if spec.instance().efa:
        env |= {"FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1"}
    if spec.shutdown_timeout:  # the pinned torch's torchrun reads it (torch/distributed/launcher/api.py)
        env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] = str(spec.shutdown_timeout)
    env |= spec.env
    return [{"name": k, "value": v} for k, v in env.items()]


def resources(spec: JobSpec) -> dict[str, Any]:
    instance = spec.instance()
    amounts: dict[str, Any] = {}
    if instance.gpus:
        amounts["nvidia.com/gpu"] = instance.gpus
    if instance.efa:
        amounts["vpc.amazonaws.com/efa"] = instance.efa
    amounts |= {"memory": spec.memory, "cpu": spec.cpu}
    return {"requests": dict(amounts), "limits": dict(amounts)}  # requests == limits: Guaranteed QoS


def affinity() -> dict[str, Any]:
    """Only nodes HyperPod calls healthy; those that passed the deep health check first."""
    return {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [{"key": HEALTH_LABEL, "operator": "In", "values": ["Schedulable"]}]}
                ]
            },
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {
                    "weight": 100,
                    "preference": {
                        "matchExpressions": [{"key": DEEP_HEALTH_LABEL, "operator": "In", "values": ["Passed"]}]
                    },
                }
            ],
        }
    }


def pod_template(spec: JobSpec, container: str, command: list[str]) -> dict[str, Any]:
    """The trainer's pod: `container` named as the API wants it, running `command`."""
    pod: dict[str, Any] = {
        "terminationGracePeriodSeconds": spec.grace_period_s,  # time for the SIGTERM checkpoint
        # The trainer calls no Kubernetes API: no token in its pods unless the platform team compiles one in.
        "automountServiceAccountToken": spec.automount_service_account_token,
        "containers": [
            {
                "name": container,
                "image": spec.image,
                "command": command,
                "resources": resources(spec),
                "env": container_env(spec),
                # GPUs and EFA devices come from the device plugins: nothing here needs privilege or a way to it.
                "securityContext": {"privileged": False, "allowPrivilegeEscalation": False},
                "volumeMounts": [
                    {"name": "fsx-pvc", "mountPath": spec.mount_path},
                    {"name": "dshm", "mountPath": "/dev/shm"},
                ],
            }
        ],
        "volumes": [
            {"name": "fsx-pvc", "persistentVolumeClaim": {"claimName": spec.pvc_name}},
            {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": spec.shm_size}},
        ],
        "tolerations": spec.tolerations,
    }
    if spec.health_affinity:
        pod["affinity"] = affinity()
    if spec.node_selector:
        pod["nodeSelector"] = spec.node_selector
    if spec.service_account:
        pod["serviceAccountName"] = spec.service_account
    if spec.image_pull_secrets:
        pod["imagePullSecrets"] = [{"name": name} for name in spec.image_pull_secrets]
    return {
        "metadata": {
            "labels": dict(spec.labels),
            # Istio's sidecar never exits, so a job with one never finishes.
            "annotations": {"sidecar.istio.io/inject": "false"},
        },
        "spec": pod,
    }


def run_annotations(spec: JobSpec) -> dict[str, str]:
    annotations = dict(spec.annotations)
    if spec.auto_resumed:
        annotations |= {AUTO_RESUME: "true", MAX_RETRY: str(spec.max_retries)}
    return annotations


def job_labels(spec: JobSpec) -> dict[str, str]:
    """The job's own labels: ours, the run's, and Kueue's queue and priority class when the platform has a queue."""
    queue = {QUEUE_LABEL: spec.queue_name, PRIORITY_CLASS_LABEL: spec.priority_class}
    return {"app.kubernetes.io/managed-by": "hyperpod-pretrain"} | spec.labels | {k: v for k, v in queue.items() if v}


def job_metadata(spec: JobSpec) -> dict[str, Any]:
    """The job's metadata, whatever its API: name, namespace, our labels and annotations."""
    return {
        "name": spec.name,
        "namespace": spec.namespace,
        "labels": job_labels(spec),
        "annotations": run_annotations(spec),
    }


def owned_by_launcher(job: dict[str, Any], spec: JobSpec) -> dict[str, Any]:
    """The job with the launcher's pod as its owner (garbage-collected with it) and our spec digest."""
    if spec.owner is not None:
        name, uid = spec.owner
        job["metadata"]["ownerReferences"] = [
            {"apiVersion": "v1", "kind": "Pod", "name": name, "uid": uid, "blockOwnerDeletion": False}
        ]
    job["metadata"]["annotations"][SPEC_HASH_ANNOTATION] = spec_hash(job)
    return job


def spec_hash(job: dict[str, Any]) -> str:
    """A digest of what the job is asked to do: a retried step re-attaches only to a job with the same one."""
    return hashlib.sha256(json.dumps(job["spec"], sort_keys=True).encode()).hexdigest()
