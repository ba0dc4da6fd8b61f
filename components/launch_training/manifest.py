"""The job's manifest: a pure function of typed parameters, validated before anything is sent.

`JobSpec` holds what a job is made of, whatever API runs it; the pod's parts (resources, environment, volumes,
tolerations, the node-health affinity) are built once (rendering.py). Each job API renders its own object from them
(pytorchjob.py: a kubeflow.org/v1 PyTorchJob; trainjob.py: a trainer.kubeflow.org/v1alpha1 TrainJob and the
ClusterTrainingRuntime it refers to; hyperpodpytorchjob.py: a sagemaker.amazonaws.com/v1 HyperPodPyTorchJob);
`render_job` picks the spec's (apis.py).

It reproduces the seed's pod (8 GPUs and the EFA devices of the instance type, Guaranteed CPU/memory, NCCL/EFA
environment, /dev/shm in memory, the FSx PVC at /fsx, the GPU toleration, a 120 s grace period) and adds what the
seed leaves out: the node-health affinity, the Istio opt-out, torchrun's shutdown timeout, the trainer's flags, and
labels that tie the job to its pipeline run.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from typing import Any

from common.errors import InputError
from components.launch_training.apis import job_api
from components.launch_training.job_api import DEFAULT_JOB_API, JobApi
from components.launch_training.progress import STALL_FLOOR_S
from components.launch_training.rendering import AUTO_RESUME, MAX_RETRY
from trainer.config import TRAIN_DEFAULTS

ATTEMPT_ANNOTATION = "hyperpod-pretrain.io/attempt"  # 1, then +1 each time a failed job of the run is replaced
RUN_LABEL = "hyperpod-pretrain.io/run-id"
PIPELINE_RUN_LABEL = "hyperpod-pretrain.io/pipeline-run-id"
SHUTDOWN_MARGIN_S = 20  # of the grace period, left to torchrun after its workers' shutdown timeout
GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}  # the seed's
DEFAULT_RUNTIME = "hyperpod-pretrain"  # our ClusterTrainingRuntime (deploy/trainjob-runtime.yaml)
# PyTorchJob pods are named <job>-worker-<index>, and carry the job name as a label value (63 characters at most);
# a TrainJob's Jobs are <job>-node-<index> and its pods' hostnames <job>-node-0-<index> (a DNS label, 63 at most).
MAX_NAME = 63 - len("-worker-999")
_DNS_1123 = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$")


@dataclass(frozen=True)
class InstanceType:
    gpus: int
    efa: int  # EFA devices exposed to a pod that takes the whole node
    memory_gib: int = 0  # the instance's memory (0: unknown); a pod's memory limit and /dev/shm must fit in it


# GPUs, EFA devices and memory per node (HyperPod names them ml.<type>; both spellings are accepted).
INSTANCE_TYPES: dict[str, InstanceType] = {
    "p5.48xlarge": InstanceType(8, 32, 2048),
    "p5e.48xlarge": InstanceType(8, 32, 2048),
    "p5en.48xlarge": InstanceType(8, 16, 2048),
    "p4d.24xlarge": InstanceType(8, 4, 1152),
    "p4de.24xlarge": InstanceType(8, 4, 1152),
    "g5.48xlarge": InstanceType(8, 1, 768),
    "g6e.48xlarge": InstanceType(8, 4, 1536),
}


@dataclass
class JobSpec:
    """Everything the manifest is made of. None means: derive it (from the instance type, or the seed's value)."""

    name: str
    image: str
    trainer_args: list[str]
    job_api: str = DEFAULT_JOB_API  # the platform team's choice (Platform.job_api)
    runtime_name: str = DEFAULT_RUNTIME  # trainjob: the ClusterTrainingRuntime the TrainJob names
    namespace: str = "kubeflow"
    instance_type: str = "p5.48xlarge"
    min_nodes: int = 2
    max_nodes: int = 2
    gpus_per_node: int | None = None
    efa_per_node: int | None = None
    nproc_per_node: int | None = None  # must equal gpus_per_node on GPU nodes
    cpu: str = "96"
    memory: str = "512Gi"
    shm_size: str = "256Gi"
    pvc_name: str = "fsx-lustre-pvc"
    mount_path: str = "/fsx"
    grace_period_s: int = 120
    # torchrun's time between forwarding SIGTERM and SIGKILLing the workers (TORCH_ELASTIC_SHUTDOWN_TIMEOUT; 30 s if
    # unset): None derives it from the grace period (SHUTDOWN_MARGIN_S less, for torchrun to end before the
    # kubelet's SIGKILL), so that the trainer's SIGTERM checkpoint gets the grace period; 0: torchrun's default.
    shutdown_timeout_s: int | None = None
    restart_policy: str = "OnFailure"
    rdzv_backend: str = "c10d"
    max_restarts: int = 3  # torchrun's restarts of the worker group (elasticPolicy.maxRestarts)
    clean_pod_policy: str = "Running"  # finished pods stay for their logs; running ones go with the job
    # Whole-job restarts the job survives: every node's container restarting once (as when worker-0, which holds
    # the rendezvous store, is lost and every agent exits) is one. The API-neutral setting: the PyTorchJob's
    # job-wide backoffLimit and HyperPod's max-retry annotation are derived from it (backoff_limit below).
    restart_budget: int = 3
    active_deadline_s: int = 0  # 0: none
    ttl_after_finished_s: int = 7 * 24 * 3600
    auto_resume: bool | None = None  # None: on for a PyTorchJob; HyperPod auto-resume does not cover TrainJobs
    auto_resume_max_retries: int | None = None  # None: restart_budget
    # Not in the manifest: how long the launcher watches a Failed job for auto-resume to bring it back before the
    # step fails (HyperPod's restarter may update a PyTorchJob's status; what it does with a Failed one is unpublished).
    auto_resume_wait_s: int = 300
    health_affinity: bool = True
    tolerations: list[dict[str, Any]] = field(default_factory=lambda: [GPU_TOLERATION])
    node_selector: dict[str, str] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)  # the trainer's own (NCCL_DEBUG_FILE, TRAINER_*), then extras
    service_account: str = ""
    automount_service_account_token: bool = False  # the trainer calls no Kubernetes API
    image_pull_secrets: list[str] = field(default_factory=list)  # for a registry the nodes cannot pull from
    queue_name: str = ""  # Kueue LocalQueue (HyperPod task governance): the job waits, suspended, until admitted
    priority_class: str = ""  # Kueue WorkloadPriorityClass
    owner: tuple[str, str] | None = None  # (pod name, uid) of the launcher: the job is garbage-collected with it
    # trainjob: the grace period the runtime's pods have (read from the cluster at launch; None: not known). The
    # TrainJob patches its own only when it differs, and a queued one may not differ (trainjob.queued_grace_conflict).
    runtime_grace_period_s: int | None = None
    # hyperpodpytorchjob: Kueue's topology-aware placement of the pods, the platform's (Platform.topology_label): a
    # topology.k8s.aws/... node label ("": none), required or only preferred.
    topology_label: str = ""
    topology_required: bool = False
    # hyperpodpytorchjob: its log monitoring rules (log_rules.py). None: derived from the trainer's lines with the
    # settings below; the platform's own otherwise (compile --hyperpod-log-rules).
    log_rules: tuple[dict[str, Any], ...] | None = None
    log_every: int = TRAIN_DEFAULTS["log_every"]  # the trainer's steps between step lines
    startup_allowance_s: int = int(STALL_FLOOR_S)  # from the workers' start to the first step (loading, compiling)
    expected_step_ms: int = 0  # one optimizer step's expected time (0: not known: the launcher's stall floor)
    min_tokens_per_s: int = 0  # below this, SLOW_DATA_POINTS step lines in a row, the job is slow (0: no slow rule)

    def instance(self) -> InstanceType:
        key = self.instance_type.removeprefix("ml.")
        if key not in INSTANCE_TYPES and (self.gpus_per_node is None or self.efa_per_node is None):
            known = ", ".join(sorted(INSTANCE_TYPES))
            raise InputError(
                f"instance type {self.instance_type!r} is unknown ({known}): give gpus-per-node and efa-per-node"
            )
        base = INSTANCE_TYPES.get(key, InstanceType(0, 0))
        gpus = base.gpus if self.gpus_per_node is None else self.gpus_per_node
        return InstanceType(gpus, base.efa if self.efa_per_node is None else self.efa_per_node, base.memory_gib)

    @property
    def shutdown_timeout(self) -> int:
        """torchrun's shutdown timeout for this job (0: torchrun's own default, 30 s)."""
        if self.shutdown_timeout_s is None:
            return max(0, self.grace_period_s - SHUTDOWN_MARGIN_S)
        return self.shutdown_timeout_s

    @property
    def backoff_limit(self) -> int:
        """runPolicy.backoffLimit for `restart_budget` whole-job restarts. The Training Operator counts container
        restarts over all the job's Running pods and fails the job when they reach the limit (1.8.1,
        pkg/core/job.go PastBackoffLimit): each whole-job restart costs one per node."""
        return self.restart_budget * self.max_nodes + 1

    @property
    def max_retries(self) -> int:
        """HyperPod auto-resume's retries (its job-max-retry-count annotation): the restart budget unless set."""
        return self.restart_budget if self.auto_resume_max_retries is None else self.auto_resume_max_retries

    @property
    def api(self) -> JobApi:
        return job_api(self.job_api)

    @property
    def auto_resumed(self) -> bool:
        """Whether HyperPod auto-resume is asked for (its annotations on the job)."""
        return self.job_api == "pytorchjob" if self.auto_resume is None else self.auto_resume

    @property
    def nproc(self) -> int:
        return self.instance().gpus if self.nproc_per_node is None else self.nproc_per_node

    def validate(self) -> None:
        """Inconsistent inputs fail here, one line each, before the API server sees anything."""
        if len(self.name) > MAX_NAME or not _DNS_1123.match(self.name):
            raise InputError(
                f"job name {self.name!r} is not a DNS-1123 label of at most {MAX_NAME} characters "
                "(lowercase letters, digits, '-'; a letter or digit at each end)"
            )
        if len(self.namespace) > 63 or not _DNS_1123.match(self.namespace):
            raise InputError(f"namespace {self.namespace!r} is not a DNS-1123 label")
        if not self.image or any(c.isspace() for c in self.image):
            raise InputError(f"image {self.image!r} is not an image reference")
        if not 1 <= self.min_nodes <= self.max_nodes:
            raise InputError(f"min nodes {self.min_nodes} and max nodes {self.max_nodes}: need 1 <= min <= max")
        self.api.validate(self)
        instance = self.instance()
        if instance.gpus and self.nproc != instance.gpus:
            raise InputError(
                f"nproc-per-node {self.nproc} differs from the {instance.gpus} GPUs requested per node: "
                "each process drives one GPU"
            )
        if self.nproc < 1:
            raise InputError("nproc-per-node must be positive")
        self.validate_pod()
        if self.auto_resumed:
            if self.restart_policy != "OnFailure":
                raise InputError(f"HyperPod auto-resume needs restartPolicy OnFailure, not {self.restart_policy}")
            if not (self.namespace == "kubeflow" or self.namespace.startswith("hyperpod")):
                raise InputError(
                    f"namespace {self.namespace!r}: HyperPod auto-resumes jobs only in 'kubeflow' or a "
                    "namespace starting with 'hyperpod' (or turn auto-resume off)"
                )
            if self.max_retries < 1:
                raise InputError(
                    "auto-resume max retries must be at least 1 (with restart_budget 0, set "
                    "auto_resume_max_retries or turn auto-resume off)"
                )
        if self.queue_name and self.min_nodes < self.max_nodes:
            # Kueue admits a PyTorchJob for all its Worker replicas or not at all (kubernetes-sigs/kueue v0.19.2,
            # pkg/controller/jobs/kubeflow/kubeflowjob, KubeflowJob.PodSets: Count = replicas, no minimum).
            raise InputError(
                f"max_nodes {self.max_nodes} with Kueue queue {self.queue_name!r}: Kueue admits the job "
                f"only when all {self.max_nodes} nodes fit, never on nnodes {self.min_nodes}; give "
                f"max_nodes 0 (or equal to nnodes) on a queued cluster"
            )
        for name in ("queue_name", "priority_class"):
            value = getattr(self, name)
            if value and (len(value) > 63 or not _DNS_1123.match(value)):
                raise InputError(f"{name.replace('_', '-')} {value!r} is not a DNS-1123 label")
        for key in (AUTO_RESUME, MAX_RETRY):
            if key in self.annotations:
                raise InputError(f"annotation {key} is set by the auto-resume option, not by hand (both or neither)")

    def validate_pod(self) -> None:
        """The pod's settings, for a job and for a runtime alike."""
        instance = self.instance()
        if instance.gpus < 0 or instance.efa < 0:
            raise InputError("GPUs and EFA devices per node cannot be negative")
        for name in ("cpu", "memory", "shm_size"):
            if not _QUANTITY.match(getattr(self, name)):
                raise InputError(f"{name.replace('_', '-')} {getattr(self, name)!r} is not a Kubernetes quantity")
        if self.restart_policy not in ("OnFailure", "Never", "Always", "ExitCode"):
            raise InputError(f"restart policy {self.restart_policy!r}: choose OnFailure, Never, Always or ExitCode")
        if self.clean_pod_policy not in ("None", "Running", "All"):
            raise InputError(f"clean pod policy {self.clean_pod_policy!r}: choose None, Running or All")
        if self.rdzv_backend not in ("c10d", "etcd", "etcd-v2"):
            raise InputError(f"rdzv backend {self.rdzv_backend!r}: choose c10d, etcd or etcd-v2")
        if self.grace_period_s < 1:
            raise InputError(f"grace period {self.grace_period_s}s must be positive")
        if self.shutdown_timeout_s is not None and self.shutdown_timeout_s < 0:
            raise InputError(f"shutdown timeout {self.shutdown_timeout_s}s cannot be negative (0: torchrun's default)")
        if self.shutdown_timeout_s and not self.shutdown_timeout_s < self.grace_period_s:
            raise InputError(
                f"shutdown timeout {self.shutdown_timeout_s}s must be shorter than the "
                f"{self.grace_period_s}s grace period, or the kubelet kills torchrun first"
            )
        for name in (
            "max_restarts",
            "restart_budget",
            "active_deadline_s",
            "ttl_after_finished_s",
            "auto_resume_wait_s",
        ):
            if getattr(self, name) < 0:
                raise InputError(f"{name.replace('_', '-')} cannot be negative")


def render_job(spec: JobSpec) -> dict[str, Any]:
    """The job as a dict, in the spec's API (dump it with yaml.safe_dump); raises InputError on inconsistent
    inputs."""
    spec.validate()
    return spec.api.render(spec)


def label_value(text: str) -> str:
    """`text` as a label value: at most 63 of [A-Za-z0-9._-], alphanumeric at both ends."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text)[:63].strip("._-")


def job_name(pipeline_run_id: str, run_id: str, task: str = "train") -> str:
    """A DNS-1123 name that is the same for every retry of one pipeline run's step, and unique across runs."""
    readable = re.sub(r"[^a-z0-9-]+", "-", run_id.lower()).strip("-")[:24].strip("-") or "run"
    digest = hashlib.sha256(f"{pipeline_run_id}/{run_id}/{task}".encode()).hexdigest()[:10]
    return f"hpp-{readable}-{task}-{digest}"[:MAX_NAME].rstrip("-")
