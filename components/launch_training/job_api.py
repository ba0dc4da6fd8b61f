"""What the launcher needs to know of a job API, and nothing more: the one seam between what it guarantees (create
or re-attach, watch, deadlines, logs, diagnosis, cancel; attach.py, follow.py, cancel.py, deadlines.py) and the
APIs it can drive. Each API is one small module: pytorchjob.py (Kubeflow Training Operator v1), trainjob.py
(Kubeflow Trainer v2) and hyperpodpytorchjob.py (the SageMaker HyperPod training operator); apis.py finds them by name
or by a job's kind. The platform team picks one at compile time
(Platform.job_api).

Conditions are read in the API's own words (the step's log shows them as the operator wrote them); the launcher's
decisions go through the questions below, which each API answers from its own status.
"""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING, Any

from common.errors import InputError

if TYPE_CHECKING:
    from components.launch_training.manifest import JobSpec

JOB_APIS = ("pytorchjob", "trainjob", "hyperpodpytorchjob")
DEFAULT_JOB_API = "pytorchjob"  # what HyperPod clusters run (and the only API HyperPod auto-resume covers)


def true_condition(job: dict[str, Any], type_: str) -> bool:
    conditions = job.get("status", {}).get("conditions") or []
    return any(c.get("type") == type_ and c.get("status") == "True" for c in conditions)


def seconds(stamp: str | None) -> float | None:
    """A Kubernetes timestamp (RFC 3339, whole seconds) as epoch seconds."""
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp() if stamp else None


class JobApi:
    """One job API. Subclasses set the names and answer the questions; nothing here knows either operator."""

    name = ""  # as --job-api spells it
    kind = ""
    group = ""
    version = ""
    plural = ""
    container = ""  # the trainer's container in every pod
    succeeded = ""  # the condition type of a finished, successful job
    failed = "Failed"
    operator = ""  # who runs the jobs, for messages
    crd = ""  # the CRD file a pruned field means is out of date, for messages
    trainer_repository = "hyperpod-pretrain-trainer"  # the trainer image's repository docker/build.sh pushes for it
    # Run options (platform.RUN_OPTIONS) this API has no place for, with why and where the setting lives instead.
    refused_options: dict[str, str] = {}
    # How the launcher deletes a job (cancel.delete_job): Foreground, the job going once its pods have gone, unless
    # the API's controller would act on a job that is being deleted.
    propagation = "Foreground"
    # What the job's controller makes under the job's own name and the garbage collector deletes after it, as
    # (group, version, plural): a new attempt of the job waits until they are gone (attach.wait_until_gone).
    children: tuple[tuple[str, str, str], ...] = ()
    # What those children make that makes the pods, found by the job's pod selector, as (group, version, plural): when
    # there is any, deleting a job returns only once the job is gone and they and its children are gone or being
    # deleted (cancel.wait_until_inert), as its controllers would otherwise still make pods.
    pod_makers: tuple[tuple[str, str, str], ...] = ()
    # A Failed job is deleted once the launcher has read why it failed, when its controller would run it again.
    delete_failed = False
    # The cluster-scoped runtime the job names, read at launch for what the job must agree with ("": none).
    runtime_plural = ""
    install = ""  # how to install the operator, one line for a fix
    kueue_framework = ""  # the name Kueue's integrations.frameworks lists this kind under
    # Kueue's integration writes an admitted job back whole with the API types it was built on, dropping the fields
    # they lack (else it merge-patches the job and keeps everything).
    kueue_writes_back_whole = False

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}"

    def render(self, spec: JobSpec) -> dict[str, Any]:
        raise NotImplementedError

    def validate(self, spec: JobSpec) -> None:
        """What this API cannot do, refused in one line before anything is sent."""

    def runtime_pod(self, spec: JobSpec) -> dict[str, Any] | None:
        """The pod template the job's runtime makes of `spec`; None where the job carries its own pods."""
        return None

    def runtime_manifest(self, spec: JobSpec) -> dict[str, Any] | None:
        """The cluster-scoped runtime the jobs of `spec` name, as the pipeline expects it; None where there is none."""
        return None

    def pod_selector(self, name: str) -> str:
        """A label selector for every pod of job `name`, of every restart."""
        raise NotImplementedError

    def node_selector(self, name: str, index: int) -> str:
        """A label selector for the pods of node `index` (rank `index` of the node group), of every restart."""
        raise NotImplementedError

    def pod_label(self, pod_name: str, job_name: str) -> str:
        """A pod's name without the job's, for one-line summaries ("worker-1", "node-0-1-x7k2p")."""
        return pod_name.removeprefix(job_name + "-")

    def nodes(self, job: dict[str, Any]) -> tuple[int, int]:
        """The job's minimum and maximum number of pods (nodes), from its manifest."""
        raise NotImplementedError

    def conditions(self, job: dict[str, Any]) -> list[dict[str, Any]]:
        return job.get("status", {}).get("conditions") or []

    def latest_condition(self, job: dict[str, Any]) -> dict[str, Any] | None:
        """The condition that says where the job is: a terminal one if any, else the last true one."""
        true = [c for c in self.conditions(job) if c.get("status") == "True"]
        terminal = [c for c in true if c["type"] in (self.succeeded, self.failed)]
        return (terminal or true or [None])[-1]

    def is_succeeded(self, job: dict[str, Any]) -> bool:
        return true_condition(job, self.succeeded)

    def is_failed(self, job: dict[str, Any]) -> bool:
        return true_condition(job, self.failed)

    def is_finished(self, job: dict[str, Any]) -> bool:
        return self.is_succeeded(job) or self.is_failed(job)

    def is_suspended(self, job: dict[str, Any]) -> bool:
        """Queued by Kueue (created suspended) or preempted by it: no pods, and none coming until admitted.

        Read from the spec's suspend field alone, the one Kueue writes. The operator's Suspended condition follows it
        a reconcile later, and from a stale cache it can be written True after Kueue's admission: read as well, that
        condition made an admitted job look queued again (seen on a loaded machine: "admitted" logged twice)."""
        raise NotImplementedError

    def is_running(self, job: dict[str, Any]) -> bool:
        """The operator counts the job as running (with its pods also Running, the job has started)."""
        raise NotImplementedError

    def restarts(self, job: dict[str, Any], pods: list[Any]) -> int:
        """Restarts so far: of containers, and of the whole group where the API restarts it."""
        raise NotImplementedError

    def restart_limit(self, job: dict[str, Any]) -> int | None:
        """The restarts the launcher fails the job at, counting pods made anew for a replica (restarts.py) where the
        operator's own count misses them; None where the operator counts every restart itself."""
        return None

    def times(self, job: dict[str, Any]) -> tuple[float | None, float | None]:
        """(queued, running) seconds from the job's own timestamps: creation to start, start to end."""
        raise NotImplementedError

    def faults(self, job: dict[str, Any]) -> str:
        """The operator's own account of the faults it restarted the job for, one line; "" where its status keeps
        none (the failure evidence: evidence.failure_evidence)."""
        return ""

    def refuse_options(self, options: dict[str, Any]) -> None:
        for key in options:
            if key in self.refused_options:
                raise InputError(f"job option {key!r} does not apply to a {self.kind}: {self.refused_options[key]}")
