"""The SageMaker HyperPod training operator's HyperPodPyTorchJob controller, played on the real API server: the job's
pods and its status at the job level. Process-level restarts (the operator driving each pod's hyperpodrun agent over
HTTP) are not played here: the pods are the kubelet player's, and no agent runs in them.

The operator is closed source (EKS add-on amazon-sagemaker-hyperpod-training-operator, namespace aws-hyperpod) and no
CRD of it is published (tests/cluster/crds/ holds ours). What is played follows what AWS publishes:
- [sdk] PyPI sagemaker-hyperpod 3.12.0: ``training/config/hyperpod_pytorch_job_unified_config.py`` (the status as
  ``HyperPodPytorchJobStatus``, ``RestartStatus`` and ``FaultyPodInstanceList`` model it; ``RunPolicy`` and
  ``RestartPolicy``: what each setting does, in their field descriptions) and ``training/hyperpod_pytorch_job.py``
  (``HyperPodPytorchJob.list_pods``: the job's pods are those labelled ``HPJob=<job>``).
- [cli] aws/sagemaker-hyperpod-cli 011ca92: ``src/sagemaker/hyperpod/cli/service/list_pods.py`` (``HPJob=<job>``);
  ``hyperpod-pytorch-job-template/.../v1_1/model.py`` ``to_domain`` (one replica group named ``pod``) with
  ``examples/end_to_end_walkthrough/01-training-job-submission/00-pytorch-training-job.md`` (that job's pods
  ``<job>-pod-0``, ``<job>-pod-1``): a pod is named ``<job>-<group>-<index>``; ``cli/commands/training.py`` reads a
  job's ``Created`` condition for its start.
- [agent] PyPI hyperpod-elastic-agent 1.1.3, sdist: ``doc/unified_state_machine.md`` (the job's states Created,
  Starting, Running, Faulted, Completed: "Job runs when all pods and managers good", "All managers complete so job is
  complete"), ``k8s/fetch_pod_logs_parallel.py`` (every pod labelled ``HPJob``).

Played, per job of the namespace (every POLL_S, as a controller's informers would deliver):
- Pods: for each ``spec.replicaSpecs[]`` group, ``replicas`` pods ``<job>-<group>-<index>`` [cli], labelled
  ``HPJob=<job>`` [sdk] [agent] beside the template's labels and annotations, with a controller ownerReference to the
  job, so that the garbage collector deletes them with it (a foreground delete of the job ends when they are gone).
  Unpublished, so the simplest: no other label (nothing published tells one node's pod from another's), no
  environment added, and ``restartPolicy: Never`` (neither AWS's guide, its sample nor the CLI's template sets one;
  a pod's end must reach the operator, which restarts, not the kubelet).
- Conditions ([sdk] ``Conditions``: type, status, reason, message, lastTransitionTime; the types are not published):
  ``Created`` when the job is first seen [cli] [agent]; ``Running`` once every pod runs [agent]; ``Faulted`` during a
  job-level restart [agent]; ``Completed`` once every pod succeeded ([agent]'s "Job Completed"; the launcher reads
  Completed, Complete or Succeeded: hyperpodpytorchjob.py); ``Failed`` ([sdk]'s condition type: "Complete or
  Failed"). Reasons and messages are not published: ours, below.
- A pod whose container exited non-zero (phase Failed) is a job-level restart, JLR (``FaultyPodInstanceList.
  restartType`` "PLR or JLR"; ``RestartPolicy.maxFullJobRestarts``: "The max allowed number of full job restarts
  before failing the job"): every pod is deleted and made again, ``restartCount`` + 1, ``restartStatus.
  fullJobRestartCount`` + 1 in the ``evalPeriodSeconds`` window (``currentEvalPeriod``, counted from startTime), and
  ``latestFaultyPodInstanceList`` names the restart type, the failed pods and their ranks (ranks are given to each
  pod's agent with /start, unpublished: here pod order, ``nprocPerNode`` per pod). With the window's full restarts
  spent: ``Failed``. ``jobMaxRetryCount`` is not played: the launcher sets it above what the two limits allow.
- ``runPolicy.suspend`` ([sdk] "Suspend suspends HyperPodPytorchJob", Kueue's handle): the pods deleted, Running
  False, nothing made until it is resumed; then the pods are made again. No Suspended condition (none published).
- ``startTime`` ([sdk] "first acknowledged by the controller. When using kueue, the job is also admitted"): set once,
  when the job is first seen unsuspended, and kept. ``activeDeadlineSeconds`` ([sdk] "relative to the startTime that
  the job may be active before the system tries to terminate it"): past it, every pod deleted and ``Failed``.
- ``cleanPodPolicy`` ([sdk] "the policy to kill pods after the job completes"; AWS's guide, "Using the training
  operator to run jobs": All, OnlyComplete or None; OnlyComplete read as the Succeeded pods):
  applied once the job is Completed or Failed. ``ttlSecondsAfterFinished`` is not played (the tests end sooner).
- A job being deleted is left alone: the garbage collector deletes its pods (ownerReferences).
"""

from __future__ import annotations

import calendar
import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import kubernetes
from kubernetes.client.exceptions import ApiException

from tests.cluster.controller import POLL_S, PolledController, controller_reference

log = logging.getLogger(__name__)

GROUP, VERSION, PLURAL, KIND = "sagemaker.amazonaws.com", "v1", "hyperpodpytorchjobs", "HyperPodPyTorchJob"
JOB_LABEL = "HPJob"
RESTART_TYPE = "JLR"  # a job-level (full) restart; process-level ones (PLR) are the agents'


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def pod_name(job: str, group: str, index: int) -> str:
    """A pod's name, as the CLI's example shows them (module docstring)."""
    return f"{job}-{group}-{index}"


def pod_order(job: dict[str, Any]) -> list[str]:
    """The job's pods, group by group, by index: the order its ranks follow (module docstring)."""
    name = job["metadata"]["name"]
    return [
        pod_name(name, group["name"], index)
        for group in job["spec"]["replicaSpecs"]
        for index in range(int(group.get("replicas") or 0))
    ]


def is_true(status: dict[str, Any], kind: str) -> bool:
    return any(c["type"] == kind and c["status"] == "True" for c in status.get("conditions") or [])


def set_condition(status: dict[str, Any], kind: str, state: str, reason: str, message: str) -> None:
    """One condition of each type; its lastTransitionTime kept while its status stays. A Failed or Completed job's
    conditions never change again."""
    conditions = status.setdefault("conditions", [])
    if is_true(status, "Failed") or is_true(status, "Completed"):
        return
    current = next((c for c in conditions if c["type"] == kind), None)
    if current is None and state == "False":
        return  # a condition is written False only once it was True
    if current and (current["status"], current.get("reason")) == (state, reason):
        return
    stamp = current["lastTransitionTime"] if current and current["status"] == state else now()
    new = {"type": kind, "status": state, "reason": reason, "message": message, "lastTransitionTime": stamp}
    status["conditions"] = [c for c in conditions if c["type"] != kind] + [new]


def ranks(nproc: str, index: int) -> list[str]:
    """The ranks of the pod at `index` in the job's pod order (module docstring: pod order, nprocPerNode each)."""
    per_pod = int(nproc) if nproc.isdigit() else 1
    return [str(rank) for rank in range(index * per_pod, (index + 1) * per_pod)]


class HyperPodTrainingOperator(PolledController):
    """The HyperPodPyTorchJob controller for one namespace. ``on_created(job)`` runs (in its own thread) when a job is
    first seen: the test's timeline for it."""

    def __init__(
        self,
        admin: kubernetes.client.ApiClient,
        namespace: str,
        on_created: Callable[[dict[str, Any]], None] | None = None,
        poll_s: float = POLL_S,
    ):
        super().__init__(f"hyperpod-operator-{namespace}", poll_s)
        self.custom = kubernetes.client.CustomObjectsApi(admin)
        self.core = kubernetes.client.CoreV1Api(admin)
        self.namespace, self.on_created = namespace, on_created
        self.seen: set[str] = set()  # job uids
        self.faults_handled: set[str] = set()  # uids of failed pods a restart (or the failure) was decided for
        self.start()

    def reconcile_all(self) -> None:
        jobs = json.loads(
            self.custom.list_namespaced_custom_object(
                GROUP, VERSION, self.namespace, PLURAL, _preload_content=False
            ).data
        )["items"]
        pods = json.loads(self.core.list_namespaced_pod(self.namespace, _preload_content=False).data)["items"]
        for job in jobs:
            uid = job["metadata"]["uid"]
            mine = [p for p in pods if any(o.get("uid") == uid for o in p["metadata"].get("ownerReferences") or [])]
            self.reconcile(job, mine)

    def reconcile(self, job: dict[str, Any], pods: list[dict[str, Any]]) -> None:
        meta = job["metadata"]
        if meta.get("deletionTimestamp"):
            return  # the garbage collector deletes its pods
        name, status = meta["name"], json.loads(json.dumps(job.get("status") or {}))
        if meta["uid"] not in self.seen:
            self.seen.add(meta["uid"])
            set_condition(status, "Created", "True", "JobCreated", f"HyperPodPyTorchJob {name} is created.")
            if self.on_created is not None:
                threading.Thread(target=self.on_created, args=(job,), daemon=True, name=f"timeline-{name}").start()
        run_policy = job["spec"].get("runPolicy") or {}
        live = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
        if is_true(status, "Completed") or is_true(status, "Failed"):
            self._clean_up(live, run_policy.get("cleanPodPolicy") or "All")
            return self._write(job, status)
        if run_policy.get("suspend"):
            self._delete(live)
            set_condition(status, "Running", "False", "Suspended", f"HyperPodPyTorchJob {name} is suspended.")
            return self._write(job, status)
        status.setdefault("startTime", now())
        if self._past_deadline(run_policy, status):
            self._delete(live)
            status["completionTime"] = now()
            message = f"HyperPodPyTorchJob {name} was active longer than its activeDeadlineSeconds."
            set_condition(status, "Running", "False", "DeadlineExceeded", message)
            set_condition(status, "Failed", "True", "DeadlineExceeded", message)
            return self._write(job, status)
        failed = [p for p in live if p["status"].get("phase") == "Failed"]
        if failed:
            return self._fault(job, status, live, failed)
        by_name = {p["metadata"]["name"]: p for p in live}
        wanted = pod_order(job)
        for group in job["spec"]["replicaSpecs"]:
            for index in range(int(group.get("replicas") or 0)):
                if pod_name(name, group["name"], index) not in by_name:
                    self._create_pod(job, group["name"], index, group.get("template") or {})
        phases = [by_name[n]["status"].get("phase") for n in wanted if n in by_name]
        if len(phases) == len(wanted) and all(phase == "Succeeded" for phase in phases):
            status["completionTime"] = now()
            set_condition(status, "Running", "False", "JobCompleted", f"HyperPodPyTorchJob {name} completed.")
            set_condition(status, "Completed", "True", "JobCompleted", f"HyperPodPyTorchJob {name} completed.")
        elif len(phases) == len(wanted) and all(phase == "Running" for phase in phases):
            set_condition(status, "Faulted", "False", "JobRestarted", f"HyperPodPyTorchJob {name} was restarted.")
            set_condition(status, "Running", "True", "AllPodsRunning", f"HyperPodPyTorchJob {name} is running.")
        self._write(job, status)

    def _past_deadline(self, run_policy: dict[str, Any], status: dict[str, Any]) -> bool:
        deadline = run_policy.get("activeDeadlineSeconds")
        return deadline is not None and time.time() - calendar.timegm(
            time.strptime(status["startTime"], "%Y-%m-%dT%H:%M:%SZ")
        ) >= int(deadline)

    def _fault(
        self, job: dict[str, Any], status: dict[str, Any], live: list[dict[str, Any]], failed: list[dict[str, Any]]
    ) -> None:
        """A failed pod: a job-level restart while the window's full restarts last, else Failed (module docstring).
        The status is written before the pods are deleted, and the failed pods' uids kept: a pass that meets them
        again (its write refused, or the delete not yet seen) does not count them twice."""
        name = job["metadata"]["name"]
        new = [p for p in failed if p["metadata"]["uid"] not in self.faults_handled]
        if new:
            policy = (job["spec"].get("runPolicy") or {}).get("restartPolicy") or {}
            window = self._window(policy, status)
            restarts = status.get("restartStatus") or {}
            full = restarts.get("fullJobRestartCount", 0) if restarts.get("currentEvalPeriod") == window else 0
            pods = sorted(p["metadata"]["name"] for p in new)
            if full >= int(policy.get("maxFullJobRestarts") or 0):
                status["completionTime"] = now()
                message = (
                    f"HyperPodPyTorchJob {name} failed: {', '.join(pods)} failed with its {full} full job "
                    "restart(s) spent."
                )
                set_condition(status, "Running", "False", "MaxFullJobRestartsReached", message)
                set_condition(status, "Failed", "True", "MaxFullJobRestartsReached", message)
                self._write(job, status)
                self.faults_handled.update(p["metadata"]["uid"] for p in new)
                return self._clean_up(live, (job["spec"].get("runPolicy") or {}).get("cleanPodPolicy") or "All")
            order = pod_order(job)
            nproc = str(job["spec"].get("nprocPerNode") or "auto")
            status["restartCount"] = int(status.get("restartCount") or 0) + 1
            status["restartStatus"] = {"currentEvalPeriod": window, "fullJobRestartCount": full + 1, "restartCount": 0}
            status["latestFaultyPodInstanceList"] = {
                "restartType": RESTART_TYPE,
                "faultyPodList": pods,
                "faultyRankList": [r for pod in pods if pod in order for r in ranks(nproc, order.index(pod))],
            }
            message = f"HyperPodPyTorchJob {name} is restarting: {', '.join(pods)} failed."
            set_condition(status, "Running", "False", "JobLevelRestart", message)
            set_condition(status, "Faulted", "True", "JobLevelRestart", message)
            self._write(job, status)
            self.faults_handled.update(p["metadata"]["uid"] for p in new)
        if not is_true(status, "Failed"):
            self._delete(live)

    @staticmethod
    def _window(policy: dict[str, Any], status: dict[str, Any]) -> int:
        """The evalPeriodSeconds window the job is in, counted from its startTime."""
        period = int(policy.get("evalPeriodSeconds") or 0)
        started = calendar.timegm(time.strptime(status["startTime"], "%Y-%m-%dT%H:%M:%SZ"))
        return int((time.time() - started) // period) if period > 0 else 0

    def _create_pod(self, job: dict[str, Any], group: str, index: int, template: dict[str, Any]) -> None:
        meta = job["metadata"]
        template = json.loads(json.dumps(template))
        template_meta = template.get("metadata") or {}
        pod = {
            "metadata": {
                "name": pod_name(meta["name"], group, index),
                "labels": {**template_meta.get("labels", {}), JOB_LABEL: meta["name"]},
                "annotations": template_meta.get("annotations", {}),
                "ownerReferences": [controller_reference(f"{GROUP}/{VERSION}", KIND, meta)],
            },
            "spec": {**(template.get("spec") or {}), "restartPolicy": "Never"},
        }
        try:
            self.core.create_namespaced_pod(self.namespace, pod, _preload_content=False)
        except ApiException as exc:
            if exc.status != 409:  # 409: the pod of the last incarnation is still terminating: made at a later pass
                raise

    def _clean_up(self, live: list[dict[str, Any]], policy: str) -> None:
        """cleanPodPolicy: All deletes every pod, OnlyComplete the Succeeded ones, None none."""
        if policy == "None":
            return
        self._delete([p for p in live if policy == "All" or p["status"].get("phase") == "Succeeded"])

    def _delete(self, pods: list[dict[str, Any]]) -> None:
        for pod in pods:
            with contextlib.suppress(ApiException):  # 404: gone meanwhile
                self.core.delete_namespaced_pod(pod["metadata"]["name"], self.namespace, _preload_content=False)

    def _write(self, job: dict[str, Any], status: dict[str, Any]) -> None:
        if status == (job.get("status") or {}):
            return
        self.custom.replace_namespaced_custom_object_status(
            GROUP, VERSION, self.namespace, PLURAL, job["metadata"]["name"], {**job, "status": status}
        )
