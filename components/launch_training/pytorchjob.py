"""The PyTorchJob (kubeflow.org/v1, Kubeflow Training Operator v1.8.1): its manifest and how its status reads.

The manifest is the seed's (elastic Worker replicas under c10d, restartPolicy OnFailure) with spec.runPolicy,
spec.nprocPerNode and HyperPod's auto-resume annotations. Where the seed is wrong it differs on purpose
(tests/test_manifest.py lists each difference): a Worker-only elastic job gets no MASTER_ADDR/MASTER_PORT from the
Training Operator, which sets PET_RDZV_ENDPOINT (<job>-worker-0:<port>) instead; and torchrun's --nnodes must be
MIN:MAX when the elastic policy lets the node count vary.

Status, as the operator writes it (pkg/util/status.go UpdateJobConditions): conditions Created, Running,
Restarting, Succeeded, Failed and Suspended; pods labelled training.kubeflow.org/job-name, replica-type and
replica-index, named <job>-worker-<index>, recreated under the same name.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from components.launch_training.job_api import JobApi, seconds, true_condition
from components.launch_training.log_rules import NO_RULES, RULE_SETTINGS
from components.launch_training.rendering import job_metadata, owned_by_launcher, pod_template

if TYPE_CHECKING:
    from components.launch_training.manifest import JobSpec

JOB_LABEL = "training.kubeflow.org/job-name"
REPLICA_TYPE_LABEL = "training.kubeflow.org/replica-type"
REPLICA_INDEX_LABEL = "training.kubeflow.org/replica-index"


class PyTorchJobApi(JobApi):
    name = "pytorchjob"
    kind = "PyTorchJob"
    group, version, plural = "kubeflow.org", "v1", "pytorchjobs"
    container = "pytorch"  # the Training Operator requires this container name
    succeeded = "Succeeded"
    operator = "the Kubeflow Training Operator"
    crd = "the installed Training Operator CRD is older than v1.8.1; upgrade it"
    install = (
        "install the Kubeflow Training Operator 1.8.x (kubectl apply --server-side -k github.com/"
        "kubeflow/training-operator.git/manifests/overlays/standalone?ref=v1.8.1)"
    )
    kueue_framework = "kubeflow.org/pytorchjob"
    refused_options = dict.fromkeys(RULE_SETTINGS, NO_RULES)

    def render(self, spec: JobSpec) -> dict[str, Any]:
        run_policy: dict[str, Any] = {
            "cleanPodPolicy": spec.clean_pod_policy,
            "backoffLimit": spec.backoff_limit,
            "ttlSecondsAfterFinished": spec.ttl_after_finished_s,
        }
        if spec.active_deadline_s:
            run_policy["activeDeadlineSeconds"] = spec.active_deadline_s
        job: dict[str, Any] = {
            "apiVersion": self.api_version,
            "kind": self.kind,
            "metadata": job_metadata(spec),
            "spec": {
                "elasticPolicy": {
                    "rdzvBackend": spec.rdzv_backend,
                    "minReplicas": spec.min_nodes,
                    "maxReplicas": spec.max_nodes,
                    "maxRestarts": spec.max_restarts,
                },
                "nprocPerNode": str(spec.nproc),
                "runPolicy": run_policy,
                "pytorchReplicaSpecs": {
                    "Worker": {
                        "replicas": spec.max_nodes,
                        "restartPolicy": spec.restart_policy,
                        "template": pod_template(spec, self.container, torchrun_command(spec)),
                    }
                },
            },
        }
        return owned_by_launcher(job, spec)

    def pod_selector(self, name: str) -> str:
        return f"{JOB_LABEL}={name}"

    def node_selector(self, name: str, index: int) -> str:
        return f"{JOB_LABEL}={name},{REPLICA_TYPE_LABEL}=worker,{REPLICA_INDEX_LABEL}={index}"

    def nodes(self, job: dict[str, Any]) -> tuple[int, int]:
        workers = int(job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"])
        return int(job["spec"].get("elasticPolicy", {}).get("minReplicas") or workers), workers

    def is_suspended(self, job: dict[str, Any]) -> bool:
        return bool(job.get("spec", {}).get("runPolicy", {}).get("suspend"))

    def is_running(self, job: dict[str, Any]) -> bool:
        return true_condition(job, "Running")

    def restarts(self, job: dict[str, Any], pods: list[Any]) -> int:
        """Container restarts in place (OnFailure), plus the operator's Restarting of failed pods (Never)."""
        in_place = sum(c.restart_count or 0 for pod in pods for c in pod.status.container_statuses or [])
        return in_place + sum(1 for c in self.conditions(job) if c["type"] == "Restarting")

    def restart_limit(self, job: dict[str, Any]) -> int | None:
        """The job's backoffLimit: the operator's own count misses the pods it makes anew (restartPolicy ExitCode)."""
        limit = (job["spec"].get("runPolicy") or {}).get("backoffLimit")
        return None if limit is None else int(limit)

    def times(self, job: dict[str, Any]) -> tuple[float | None, float | None]:
        created = seconds(job.get("metadata", {}).get("creationTimestamp"))
        by_type = {c["type"]: seconds(c.get("lastTransitionTime")) for c in self.conditions(job)}
        running = by_type.get("Running")
        end = by_type.get("Succeeded") or by_type.get("Failed")
        return (running - created if running and created else None), (end - running if end and running else None)


def torchrun_command(spec: JobSpec) -> list[str]:
    nnodes = str(spec.min_nodes) if spec.min_nodes == spec.max_nodes else f"{spec.min_nodes}:{spec.max_nodes}"
    return [
        "torchrun",
        f"--nnodes={nnodes}",
        f"--nproc-per-node={spec.nproc}",
        f"--rdzv-backend={spec.rdzv_backend}",
        # The operator sets PET_RDZV_ENDPOINT=<job>-worker-0:<port> for a Worker-only elastic job (no MASTER_ADDR).
        "--rdzv-endpoint=$(PET_RDZV_ENDPOINT)",
        f"--rdzv-id={spec.name}",
        f"--max-restarts={spec.max_restarts}",
        "-m",
        "trainer.train_ddp",
        *spec.trainer_args,
    ]


PYTORCHJOB = PyTorchJobApi()
