"""The TrainJob (trainer.kubeflow.org/v1alpha1, Kubeflow Trainer v2.3.0 on JobSet v0.12.0): the runtime the platform
team applies once, the TrainJob a run creates, and how its status reads.

What differs from a PyTorchJob, read in kubeflow/trainer v2.3.0 and kubernetes-sigs/jobset v0.12.0:
- The platform team's part is a ClusterTrainingRuntime (`render_runtime`, deploy/trainjob-runtime.yaml): the JobSet
  template with the pod (FSx volume and mount, /dev/shm, tolerations, affinity, service account), the torch ML policy,
  the failure policy. A TrainJob names it and sets only what a run may choose: image, arguments, environment, node
  count, processes and resources per node (`spec.trainer`), and through `spec.runtimePatches` the run's labels, the
  grace period and the size of /dev/shm (the patchable pod fields: trainer.kubeflow.org_trainjobs.v2.3.0.yaml).
- torchrun's settings come from the torch plugin as PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK (the pod's
  completion index), PET_MASTER_ADDR (<job>-node-0-0.<job>) and PET_MASTER_PORT 29500
  (pkg/runtime/framework/plugins/torch/torch.go, EnforceMLPolicy): a static rendezvous on node 0; there is no
  elastic training in v2.2+.
- Restarts are JobSet's (pkg/controllers/failure_policy.go): a failed pod fails its Job (backoffLimit 0 here), and
  `failurePolicy.maxRestarts` times the whole group is deleted and created again, every pod under a new name
  (<job>-node-0-<index>-<suffix>), so torchrun does not restart workers in place (--max-restarts=0). The old Jobs
  are deleted with foreground propagation (jobset_controller.go, deleteJobs) and the new ones created only once they
  are gone (shouldCreateJob): the old pods' SIGTERM checkpoints are written before the new attempt starts.
- Conditions are the TrainJob's own: Suspended, and the JobSet's Completed or Failed copied as Complete or Failed
  with the JobSet's reason and message (pkg/runtime/framework/plugins/jobset/jobset.go, Status); the child jobs'
  counts are in status.jobsStatus. Kueue suspends and resumes it through spec.suspend.

Three things of the released controllers decide how a TrainJob is made and removed:
- Trainer v2.3.0's `TrainJobReconciler.Reconcile` (pkg/controller/trainjob_controller.go) never looks at
  deletionTimestamp and calls `removeFailedCondition` before `IsTrainJobFinished`: a TrainJob that still exists
  without its JobSet gets a new one (a fresh run). That happens to a TrainJob deleted in the foreground (the garbage
  collector removes the JobSet first; JobSet fixed the same in jobset#561) and to a Failed one whose JobSet its
  ttlSecondsAfterFinished removed (trainer#3779, fixed after v2.3.0). So the launcher deletes TrainJobs in the
  background (no finalizer holds one: it is gone at once, and the collector then removes the JobSet, its Jobs and
  pods), waits for the JobSet and the pods before a new attempt, and deletes a Failed TrainJob once it has read why.
  A delete returns only once the JobSet and its Jobs are gone or being deleted (cancel.wait_until_inert): until the
  collector reaches them the Jobs still make pods, and a reconcile of Trainer's that read the TrainJob from its cache
  before it went applies a new JobSet if the old one is already gone (`Reconcile` reads through the manager's cache;
  the JobSet plugin's `Build` applies one whenever its cache has none), which the collector then removes too.
- Kueue up to v0.19.2 is built on Trainer v2.2.1's API (its go.mod) and writes an admitted or preempted TrainJob back
  whole (pkg/controller/jobs/trainjob/trainjob_controller.go, `RunWithPodSetsInfo` and `Stop`: `c.Update`), dropping
  what v2.2.1 does not know: a runtime patch's terminationGracePeriodSeconds (new in v2.3.0, trainer#3324). Trainer
  then applies the runtime's grace period to the suspended JobSet, which JobSet v0.12.0's webhook refuses
  (pkg/webhooks/jobset_webhook.go `ValidateUpdate`: only labels, annotations, nodeSelector, tolerations and
  schedulingGates of a suspended JobSet's pods may change): no pods, ever. So the grace period is patched only when
  it is not the runtime's own, and a queued TrainJob whose grace period is not the runtime's is refused.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from common.errors import InputError
from components.launch_training.job_api import JobApi, seconds
from components.launch_training.log_rules import NO_RULES, RULE_SETTINGS
from components.launch_training.rendering import (
    container_env,
    job_metadata,
    owned_by_launcher,
    pod_template,
    resources,
)

if TYPE_CHECKING:
    from components.launch_training.manifest import JobSpec

NODE = "node"  # the trainer's replicated job and its container (pkg/constants: Node)
ANCESTOR_LABEL = "trainer.kubeflow.org/trainjob-ancestor-step"  # LabelTrainJobAncestor; the trainer's is "trainer"
FRAMEWORK_LABEL = "trainer.kubeflow.org/framework"
PATCH_MANAGER = "hyperpod-pretrain.io/launcher"  # our entry in spec.runtimePatches (a domain-prefixed path)
# JobSet's labels on every Job and pod (api/jobset/v1alpha2/jobset_types.go), and the Job controller's index label.
JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"
RESTART_ATTEMPT_LABEL = "jobset.sigs.k8s.io/restart-attempt"
COMPLETION_INDEX_LABEL = "batch.kubernetes.io/job-completion-index"
DSHM = "dshm"
RUNTIME_KIND = "ClusterTrainingRuntime"


class TrainJobApi(JobApi):
    name = "trainjob"
    kind = "TrainJob"
    group, version, plural = "trainer.kubeflow.org", "v1alpha1", "trainjobs"
    container = NODE
    succeeded = "Complete"
    operator = "Kubeflow Trainer"
    crd = "the installed Kubeflow Trainer CRDs are older than v2.3.0; upgrade them"
    refused_options = {
        "restart_budget": "its restarts are its runtime's (JobSet failurePolicy.maxRestarts), set by the platform "
        "team with `hyperpod-pretrain render-runtime --restart-budget N`",
        "max_restarts": "torchrun does not restart workers in place under JobSet (--max-restarts=0): the whole group "
        "restarts, as often as the runtime's failurePolicy.maxRestarts allows",
        "restart_policy": "the runtime's pods never restart in place (restartPolicy Never): JobSet restarts the group",
        "rdzv_backend": "Kubeflow Trainer sets a static rendezvous on node 0 (PET_MASTER_ADDR)",
        "clean_pod_policy": "JobSet keeps a finished job's pods until the job is deleted",
        "ttl_after_finished_s": "the runtime's JobSet ttlSecondsAfterFinished applies (render-runtime)",
        "auto_resume": "HyperPod auto-resume covers PyTorchJobs only",
        "auto_resume_max_retries": "HyperPod auto-resume covers PyTorchJobs only",
        "auto_resume_wait_s": "HyperPod auto-resume covers PyTorchJobs only",
        **dict.fromkeys(RULE_SETTINGS, NO_RULES),
    }
    propagation = "Background"  # see the module's docstring: Trainer v2.3.0 rebuilds a deleting TrainJob's JobSet
    children = (("jobset.x-k8s.io", "v1alpha2", "jobsets"),)
    pod_makers = (("batch", "v1", "jobs"),)  # the JobSet's Jobs: the Job controller makes the pods
    delete_failed = True  # Trainer v2.3.0 runs a Failed TrainJob again once its JobSet is gone (trainer#3779)
    runtime_plural = "clustertrainingruntimes"
    install = (
        "install Kubeflow Trainer v2.3 (kubectl apply --server-side -k github.com/kubeflow/trainer.git/"
        "manifests/overlays/manager?ref=v2.3.0)"
    )
    kueue_framework = "trainer.kubeflow.org/trainjob"
    kueue_writes_back_whole = True  # see the module's docstring: Kueue drops a runtime patch's grace period

    def validate(self, spec: JobSpec) -> None:
        if spec.min_nodes != spec.max_nodes:
            raise InputError(
                f"max_nodes {spec.max_nodes} above nnodes {spec.min_nodes}: Kubeflow Trainer v2.2+ has "
                "no elastic training; give max_nodes 0 (a fixed size) or compile with --job-api "
                "pytorchjob"
            )
        if spec.auto_resume:
            raise InputError(
                "auto_resume: HyperPod auto-resume covers PyTorchJobs only, not TrainJobs (their "
                "restarts are the runtime's JobSet failurePolicy.maxRestarts)"
            )
        runtime_grace = spec.runtime_grace_period_s
        if why := queued_grace_conflict(spec.queue_name, spec.grace_period_s, spec.runtime_name, runtime_grace):
            raise InputError(why)

    def runtime_pod(self, spec: JobSpec) -> dict[str, Any] | None:
        """Our runtime's pod with this spec's TrainJob applied (`trainjob_pod`)."""
        return trainjob_pod(spec)

    def runtime_manifest(self, spec: JobSpec) -> dict[str, Any] | None:
        """Our ClusterTrainingRuntime for the platform's settings in `spec` (`render_runtime`)."""
        return render_runtime(spec)

    def render(self, spec: JobSpec) -> dict[str, Any]:
        pod_patch: dict[str, Any] = {
            "terminationGracePeriodSeconds": spec.grace_period_s,
            "volumes": [{"name": DSHM, "emptyDir": {"medium": "Memory", "sizeLimit": spec.shm_size}}],
        }
        labels = {"metadata": {"labels": dict(spec.labels)}} if spec.labels else {}  # the JobSet's, and its pods'
        patch = {
            "manager": PATCH_MANAGER,
            "trainingRuntimeSpec": {
                "template": {
                    **labels,
                    "spec": {
                        "replicatedJobs": [
                            {"name": NODE, "template": {"spec": {"template": {**labels, "spec": pod_patch}}}}
                        ]
                    },
                }
            },
        }
        job_spec: dict[str, Any] = {
            "runtimeRef": {"apiGroup": self.group, "kind": RUNTIME_KIND, "name": spec.runtime_name},
            "trainer": {
                "image": spec.image,
                "args": list(spec.trainer_args),
                "numNodes": spec.min_nodes,
                "numProcPerNode": spec.nproc,
                "resourcesPerNode": resources(spec),
                "env": container_env(spec),
            },
            "runtimePatches": [patch],
        }
        if spec.active_deadline_s:
            job_spec["activeDeadlineSeconds"] = spec.active_deadline_s
        job = {
            "apiVersion": self.api_version,
            "kind": self.kind,
            "metadata": job_metadata(spec),
            "spec": job_spec,
        }
        job = owned_by_launcher(job, spec)  # the digest is of the run's settings, whatever the runtime says
        if spec.grace_period_s == spec.runtime_grace_period_s:  # the runtime's own: nothing for Kueue to drop
            del pod_patch["terminationGracePeriodSeconds"]
        return job

    def pod_selector(self, name: str) -> str:
        return f"{JOBSET_NAME_LABEL}={name}"

    def node_selector(self, name: str, index: int) -> str:
        return f"{JOBSET_NAME_LABEL}={name},{COMPLETION_INDEX_LABEL}={index}"

    def nodes(self, job: dict[str, Any]) -> tuple[int, int]:
        count = int(job["spec"]["trainer"]["numNodes"])
        return count, count

    def is_suspended(self, job: dict[str, Any]) -> bool:
        return bool(job.get("spec", {}).get("suspend"))

    def is_running(self, job: dict[str, Any]) -> bool:
        """The TrainJob has no Running condition: admitted (not suspended) and not finished; its pods tell the rest."""
        return not self.is_suspended(job) and not self.is_finished(job)

    def restarts(self, job: dict[str, Any], pods: list[Any]) -> int:
        """The JobSet's restarts of the whole group (the newest pods' restart-attempt label), plus containers that
        restarted in place (none with the runtime's restartPolicy Never)."""
        attempts = [int((pod.metadata.labels or {}).get(RESTART_ATTEMPT_LABEL, 0)) for pod in pods]
        in_place = sum(c.restart_count or 0 for pod in pods for c in pod.status.container_statuses or [])
        return max(attempts, default=0) + in_place

    def times(self, job: dict[str, Any]) -> tuple[float | None, float | None]:
        """Queued: creation to the resume (the Suspended condition turned False), when Kueue held it; running: from
        then (or creation) to Complete or Failed."""
        created = seconds(job.get("metadata", {}).get("creationTimestamp"))
        by_type = {c["type"]: c for c in self.conditions(job)}
        suspended = by_type.get("Suspended")
        resumed = seconds(suspended.get("lastTransitionTime")) if suspended and suspended["status"] == "False" else None
        end = next(
            (
                seconds(by_type[t].get("lastTransitionTime"))
                for t in (self.succeeded, self.failed)
                if t in by_type and by_type[t]["status"] == "True"
            ),
            None,
        )
        start = resumed or created
        queued = resumed - created if resumed and created else (0.0 if suspended is None and created else None)
        return queued, (end - start if end and start else None)


def runtime_command() -> list[str]:
    """torchrun as the runtime runs it: every rendezvous setting from the torch plugin's PET_* environment (the
    kubelet expands $(VAR) from the container's env), no restarts in place."""
    return [
        "torchrun",
        "--nnodes=$(PET_NNODES)",
        "--nproc-per-node=$(PET_NPROC_PER_NODE)",
        "--node-rank=$(PET_NODE_RANK)",
        "--master-addr=$(PET_MASTER_ADDR)",
        "--master-port=$(PET_MASTER_PORT)",
        "--max-restarts=0",
        "-m",
        "trainer.train_ddp",
    ]


def render_runtime(spec: JobSpec) -> dict[str, Any]:
    """Our ClusterTrainingRuntime for the platform's settings in `spec` (its name is spec.runtime_name): the pod of
    every job, the torch policy, and JobSet's failure policy with the restart budget as maxRestarts. A TrainJob
    patches only what a run may choose."""
    spec.validate_pod()
    pod = pod_template(spec, NODE, runtime_command())
    pod["spec"]["restartPolicy"] = "Never"  # a failed trainer fails its pod, its Job, and JobSet restarts the group
    if not spec.image:
        del pod["spec"]["containers"][0]["image"]  # each TrainJob names its image
    jobset: dict[str, Any] = {
        "failurePolicy": {"maxRestarts": spec.restart_budget},
        "replicatedJobs": [
            {
                "name": NODE,
                "template": {
                    "metadata": {"labels": {ANCESTOR_LABEL: "trainer"}},
                    "spec": {"backoffLimit": 0, "template": pod},
                },
            }
        ],
    }
    if spec.ttl_after_finished_s:
        jobset["ttlSecondsAfterFinished"] = spec.ttl_after_finished_s
    return {
        "apiVersion": f"{TRAINJOB.group}/{TRAINJOB.version}",
        "kind": RUNTIME_KIND,
        "metadata": {
            "name": spec.runtime_name,
            "labels": {FRAMEWORK_LABEL: "torch", "app.kubernetes.io/managed-by": "hyperpod-pretrain"},
        },
        "spec": {"mlPolicy": {"numNodes": 1, "torch": {}}, "template": {"spec": jobset}},
    }


TRAINJOB = TrainJobApi()
DEFAULT_GRACE_PERIOD_S = 30  # a pod's terminationGracePeriodSeconds when its template has none (core/v1 defaults)


def runtime_grace_period(runtime: dict[str, Any]) -> int:
    """The grace period of the trainer's pods that a ClusterTrainingRuntime gives (its `node` replicated job)."""
    for rjob in runtime.get("spec", {}).get("template", {}).get("spec", {}).get("replicatedJobs") or []:
        if rjob.get("name") == NODE:
            pod = rjob.get("template", {}).get("spec", {}).get("template", {}).get("spec", {})
            return int(pod.get("terminationGracePeriodSeconds", DEFAULT_GRACE_PERIOD_S))
    return DEFAULT_GRACE_PERIOD_S


def queued_grace_conflict(queue: str, grace_s: int, runtime: str, runtime_grace_s: int | None) -> str:
    """Why a TrainJob in Kueue queue `queue` with this grace period would never start (module docstring), or ""."""
    if not queue or runtime_grace_s is None or grace_s == runtime_grace_s:
        return ""
    return (
        f"grace_period_s {grace_s} is not ClusterTrainingRuntime {runtime}'s {runtime_grace_s}, and a TrainJob "
        "queued by Kueue cannot change it: Kueue up to v0.19.2 writes the admitted TrainJob back with Trainer "
        "v2.2.1's API, which drops the grace period, and JobSet's webhook then refuses the runtime's one, so no "
        f"pod would ever start; run with job option grace_period_s={runtime_grace_s}, or have the platform team "
        f"render the runtime with --grace-period-s {grace_s}"
    )


def trainjob_pod(spec: JobSpec) -> dict[str, Any]:
    """The pod template our runtime and this spec's TrainJob make together (the runtime's pod with the run's
    resources, grace period, /dev/shm, labels, environment and arguments): what preflight checks the cluster for."""
    pod = pod_template(spec, NODE, [*runtime_command(), *spec.trainer_args])
    pod["spec"]["restartPolicy"] = "Never"
    return pod
