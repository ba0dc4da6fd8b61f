"""Kubeflow Training Operator v1.8.1's PyTorchJob controller and validating webhook, played on the real API server.

Sources, kubeflow/training-operator at tag v1.8.1 (each function below names its own):
- ``pkg/controller.v1/pytorch/pytorchjob_controller.go``: ``onOwnerCreateFunc`` (Created), ``UpdateJobStatus``
  (Running, Succeeded, Restarting, Failed for a Worker-only job; an elastic job succeeds when one worker did,
  kubeflow/training-operator#1752), ``SetClusterSpec`` / ``envvar.go`` (the ``PET_*`` environment).
- ``pkg/controller.v1/common/job.go`` ``ReconcileJobs``: a finished job's clean-up by ``cleanPodPolicy``; the
  ``IsJobSuspended`` branch (pods and services deleted, Suspended True, Running False; on resume Suspended False with
  reason ``PyTorchJobResumed`` and ``startTime`` reset); past ``backoffLimit`` the pods and services are deleted
  (``DeletePodsAndServices``, whatever cleanPodPolicy says) *before* the Failed condition is written;
  ``PastBackoffLimit`` sums the container restarts of the job's Running pods (job-wide).
- ``pkg/controller.v1/common/pod.go`` ``ReconcilePods`` / ``createNewPod``: ``<job>-<type>-<index>`` pods with the
  ``training.kubeflow.org/*`` labels and a controller ownerReference; restartPolicy ExitCode becomes Never on the pod;
  a Failed pod with a retryable exit code (ExitCode: >= 128, ``pkg/util/train/train_util.go``
  ``IsRetryableExitCode``; OnFailure/Always: any) is deleted and made anew, a new pod with a restartCount of 0;
  ``pkg/controller.v1/control/pod_control.go`` ``createPods``: a refused create is a Warning event ``FailedCreate``
  ("Error creating: <the API's error>") on the job;
  ``pkg/controller.v1/common/service.go``: a headless Service per pod, port ``pytorchjob-port`` 23456.
- ``pkg/util/status.go`` ``UpdateJobConditions`` / ``setCondition`` / ``filterOutCondition``: a Failed job's
  conditions never change again; Running and Restarting replace each other; Succeeded or Failed set Running False.
- ``pkg/webhooks/pytorch/pytorchjob_webhook.go`` ``validatePyTorchJob``: what is refused at create, served here as a
  ``ValidatingWebhookConfiguration`` named ``validator.pytorchjob.training-operator.kubeflow.org``.

The controller polls the namespace's jobs and pods every POLL_S and reconciles a job when it or one of its pods
changed (what its informers would deliver), or when a queued timer is due: the one ``UpdateJobStatus`` queues with
``WorkQueue.AddAfter`` for ``activeDeadlineSeconds`` when it first sets ``startTime``. After a suspend and resume
``ReconcileJobs`` sets ``startTime`` anew and no timer is queued, so a resumed job passes its deadline only at its
next change, as in 1.8.1.
"""

from __future__ import annotations

import base64
import calendar
import contextlib
import json
import logging
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kubernetes
from kubernetes.client.exceptions import ApiException

from tests.cluster.controller import POLL_S, PolledController, controller_reference
from tests.cluster.tls import HttpsServer, admission_handler, loopback_cert

log = logging.getLogger(__name__)

GROUP, VERSION, PLURAL, KIND = "kubeflow.org", "v1", "pytorchjobs", "PyTorchJob"
JOB_NAME_LABEL = "training.kubeflow.org/job-name"
OPERATOR_NAME_LABEL = "training.kubeflow.org/operator-name"
REPLICA_TYPE_LABEL = "training.kubeflow.org/replica-type"
REPLICA_INDEX_LABEL = "training.kubeflow.org/replica-index"
JOB_ROLE_LABEL = "training.kubeflow.org/job-role"
OPERATOR_NAME = "pytorchjob-controller"
CONTAINER, PORT_NAME, PORT = "pytorch", "pytorchjob-port", 23456
WEBHOOK_NAME = "validator.pytorchjob.training-operator.kubeflow.org"
WEBHOOK_PATH = "/validate-kubeflow-org-v1-pytorchjob"
DNS1035_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


# -- the webhook ------------------------------------------------------------------------------------------------


def validate_pytorchjob(job: dict[str, Any]) -> tuple[list[str], list[str]]:
    """``validatePyTorchJob``: (warnings, field errors as ``field.Error.Error()`` renders them)."""
    errors: list[str] = []
    warnings: list[str] = []
    name = job.get("metadata", {}).get("name", "")
    if len(name) > 63 or not DNS1035_LABEL.fullmatch(name):
        errors.append(
            f'metadata.name: Invalid value: "{name}": should match: a DNS-1035 label must consist of lower case '
            "alphanumeric characters or '-', start with an alphabetic character, and end with an alphanumeric "
            "character (e.g. 'my-name',  or 'abc-123', regex used for validation is '[a-z]([-a-z0-9]*[a-z0-9])?')"
        )
    spec = job.get("spec") or {}
    replicas = spec.get("pytorchReplicaSpecs")
    if spec.get("elasticPolicy") is not None:
        if "Worker" not in (replicas or {}):
            errors.append(
                "spec.pytorchReplicaSpecs[Worker]: Required value: must be configured if elastic policy is used"
            )
        if spec["elasticPolicy"].get("nProcPerNode") is not None:
            warnings.append("spec.elasticPolicy.nProcPerNode is deprecated, use spec.nprocPerNode instead")
            if spec.get("nprocPerNode") is not None:
                errors.append("spec.elasticPolicy.nProcPerNode: Forbidden: must not be used with spec.nprocPerNode")
    if replicas is None:
        errors.append("spec.pytorchReplicaSpecs: Required value: must be required")
    for rtype, rspec in (replicas or {}).items():
        role = f"spec.pytorchReplicaSpecs[{rtype}]"
        if rtype not in ("Master", "Worker"):
            errors.append(f'{role}: Unsupported value: "{rtype}": supported values: "Master", "Worker"')
        containers = ((rspec or {}).get("template") or {}).get("spec", {}).get("containers") or []
        if not containers:
            errors.append(f"{role}.template.spec.containers: Required value: must be specified")
        for i, container in enumerate(containers):
            if not container.get("image"):
                errors.append(f"{role}.template.spec.containers[{i}].image: Required value: must be required")
        if not any(c.get("name") == CONTAINER for c in containers):
            errors.append(
                f"{role}.template.spec.containers: Required value: must have at least one container with "
                f"name {CONTAINER}"
            )
        count = (rspec or {}).get("replicas")
        if rtype == "Master" and count != 1:
            errors.append(f"{role}.replicas: Forbidden: must be 1")
        elif count is not None and count < 1:
            errors.append(f"{role}.replicas: Forbidden: must be at least 1")
    return warnings, errors


class ValidatingWebhook:
    """The operator's webhook server on loopback, registered with the API server for PyTorchJob CREATE/UPDATE."""

    def __init__(self, admin: kubernetes.client.ApiClient, workdir: Path):
        self.admin = admin
        self.denials: list[str] = []
        cert = loopback_cert(workdir, "training-operator-webhook")
        self.server = HttpsServer(admission_handler(self.review), cert).start()
        registration = {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "ValidatingWebhookConfiguration",
            "metadata": {"name": "validator.training-operator.kubeflow.org"},
            "webhooks": [
                {
                    "name": WEBHOOK_NAME,
                    "admissionReviewVersions": ["v1"],
                    "sideEffects": "None",
                    "failurePolicy": "Fail",
                    "timeoutSeconds": 10,
                    "clientConfig": {
                        "url": f"https://127.0.0.1:{self.server.port}{WEBHOOK_PATH}",
                        "caBundle": base64.b64encode(cert.pem).decode(),
                    },
                    "rules": [
                        {
                            "apiGroups": [GROUP],
                            "apiVersions": [VERSION],
                            "operations": ["CREATE", "UPDATE"],
                            "resources": [PLURAL],
                        }
                    ],
                }
            ],
        }
        kubernetes.client.AdmissionregistrationV1Api(admin).create_validating_webhook_configuration(registration)

    def review(self, request: dict[str, Any]) -> dict[str, Any]:
        job = request.get("object") or {}
        warnings, errors = validate_pytorchjob(job)
        response: dict[str, Any] = {"uid": request["uid"], "allowed": not errors}
        if warnings:
            response["warnings"] = warnings
        if errors:
            # errs.ToAggregate(), which controller-runtime v0.17 (validator_custom.go) answers as Denied: 403
            message = errors[0] if len(errors) == 1 else "[" + ", ".join(errors) + "]"
            self.denials.append(message)
            response["status"] = {"code": 403, "reason": "Forbidden", "message": message}
        return response

    def stop(self) -> None:
        with contextlib.suppress(ApiException):
            kubernetes.client.AdmissionregistrationV1Api(self.admin).delete_validating_webhook_configuration(
                "validator.training-operator.kubeflow.org"
            )
        self.server.stop()


# -- the controller ---------------------------------------------------------------------------------------------


def exit_code(pod: dict[str, Any]) -> int:
    """The ``pytorch`` container's exit code, 0xbeef when it has none (``ReconcilePods``)."""
    for cs in pod["status"].get("containerStatuses") or []:
        if cs["name"] == CONTAINER and "terminated" in cs.get("state", {}):
            return cs["state"]["terminated"]["exitCode"]
    return 0xBEEF


def calendar_seconds(stamp: str) -> float:
    return calendar.timegm(time.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ"))


def condition(job: dict[str, Any], kind: str) -> dict[str, Any] | None:
    return next((c for c in (job.get("status") or {}).get("conditions") or [] if c["type"] == kind), None)


def is_true(job: dict[str, Any], kind: str) -> bool:
    return (condition(job, kind) or {}).get("status") == "True"


def set_condition(status: dict[str, Any], kind: str, state: str, reason: str, message: str) -> None:
    """``setCondition`` with ``filterOutCondition``."""
    conditions = status.setdefault("conditions", [])
    if any(c["type"] == "Failed" and c["status"] == "True" for c in conditions):
        return
    current = next((c for c in conditions if c["type"] == kind), None)
    if current and current["status"] == state and current.get("reason") == reason:
        return
    stamp = now()
    new = {
        "type": kind,
        "status": state,
        "reason": reason,
        "message": message,
        "lastUpdateTime": stamp,
        "lastTransitionTime": current["lastTransitionTime"] if current and current["status"] == state else stamp,
    }
    kept = []
    for c in conditions:
        if c["type"] == kind or {kind, c["type"]} == {"Running", "Restarting"}:
            continue
        if kind in ("Failed", "Succeeded") and c["type"] == "Running":
            c = {**c, "status": "False"}
        kept.append(c)
    status["conditions"] = [*kept, new]


class TrainingOperator(PolledController):
    """The PyTorchJob controller for one namespace. ``on_created(job)`` runs (in its own thread) when a job is first
    seen: the test's timeline for it."""

    def __init__(
        self,
        admin: kubernetes.client.ApiClient,
        namespace: str,
        on_created: Callable[[dict[str, Any]], None] | None = None,
        poll_s: float = POLL_S,
    ):
        super().__init__(f"operator-{namespace}", poll_s)
        self.custom = kubernetes.client.CustomObjectsApi(admin)
        self.core = kubernetes.client.CoreV1Api(admin)
        self.namespace, self.on_created = namespace, on_created
        self.seen: set[str] = set()  # job uids
        self._versions: dict[str, tuple[str, ...]] = {}  # job uid -> the job's and its pods' versions reconciled
        self._deadline_timers: dict[str, float] = {}  # job uid -> when its activeDeadlineSeconds reconcile is due
        self._services: set[str] = set()  # job uids whose services exist
        self._failed_creates: set[tuple[str, str]] = set()  # (job uid, message) of the FailedCreate events made
        self.start()

    def reconcile_all(self) -> None:
        jobs = self._list_jobs()
        pods = json.loads(self.core.list_namespaced_pod(self.namespace, _preload_content=False).data)["items"]
        for job in jobs:
            mine = [p for p in pods if p["metadata"].get("labels", {}).get(JOB_NAME_LABEL) == job["metadata"]["name"]]
            self.reconcile(job, mine)

    def _list_jobs(self) -> list[dict[str, Any]]:
        response = self.custom.list_namespaced_custom_object(
            GROUP, VERSION, self.namespace, PLURAL, _preload_content=False
        )
        return json.loads(response.data)["items"]

    # ReconcileJobs --------------------------------------------------------------------------------------------

    def reconcile(self, job: dict[str, Any], pods: list[dict[str, Any]]) -> None:
        """Reconcile the job if it or its pods changed since the last time, or its deadline timer is due."""
        uid = job["metadata"]["uid"]
        versions = (job["metadata"]["resourceVersion"], *sorted(p["metadata"]["resourceVersion"] for p in pods))
        due = self._deadline_timers.get(uid)
        timer = due is not None and time.monotonic() >= due
        if versions == self._versions.get(uid) and not timer:
            return
        if timer:
            del self._deadline_timers[uid]
        self._reconcile(job, pods)
        self._versions[uid] = versions  # after success only: an API error is retried at the next pass

    def _reconcile(self, job: dict[str, Any], pods: list[dict[str, Any]]) -> None:
        meta = job["metadata"]
        if meta.get("deletionTimestamp"):
            return  # the garbage collector deletes its pods (ownerReferences)
        status = json.loads(json.dumps(job.get("status") or {}))
        name = meta["name"]
        first = meta["uid"] not in self.seen
        if first:  # onOwnerCreateFunc: reaches the server with the first status write
            self.seen.add(meta["uid"])
            set_condition(status, "Created", "True", "PyTorchJobCreated", f"PyTorchJob {name} is created.")
            if self.on_created is not None:
                threading.Thread(target=self.on_created, args=(job,), daemon=True, name=f"timeline-{name}").start()
        run_policy = job["spec"].get("runPolicy") or {}
        replicas = job["spec"]["pytorchReplicaSpecs"]
        if is_true(job, "Succeeded") or is_true(job, "Failed"):
            self._delete_pods_and_services(pods, run_policy.get("cleanPodPolicy") or "None")
            if is_true(job, "Succeeded"):
                for entry in status.get("replicaStatuses", {}).values():
                    if entry.get("active"):
                        entry["succeeded"] = entry.get("succeeded", 0) + entry.pop("active")
            return self._write(job, status)
        if run_policy.get("suspend"):
            self._delete_pods_and_services(pods, "All")  # not finished: cleanPodPolicy does not apply
            for entry in status.get("replicaStatuses", {}).values():
                entry.pop("active", None)
            message = f"PyTorchJob {name} is suspended."
            if is_true(job, "Running"):
                set_condition(status, "Running", "False", "PyTorchJobSuspended", message)
            if not is_true(job, "Suspended"):
                set_condition(status, "Suspended", "True", "PyTorchJobSuspended", message)
            return self._write(job, status)
        if is_true(job, "Suspended"):
            set_condition(status, "Suspended", "False", "PyTorchJobResumed", f"PyTorchJob {name} is resumed.")
            status["startTime"] = now()
        if failure := self._past_limits(job, status, pods):
            status.setdefault("completionTime", now())
            self._delete_pods_and_services(pods, "All")
            set_condition(status, "Failed", "True", "PyTorchJobFailed", failure)
            return self._write(job, status)
        status["replicaStatuses"] = {}
        for rtype, rspec in replicas.items():
            self._reconcile_pods(job, status, rtype, rspec, pods)
            self._reconcile_services(job, rtype, rspec, pods)
        if "startTime" not in status:
            status["startTime"] = now()
            if (deadline := run_policy.get("activeDeadlineSeconds")) is not None:
                self._deadline_timers[meta["uid"]] = time.monotonic() + deadline
        self._update_job_status(job, status)
        self._write(job, status)

    def _past_limits(self, job: dict[str, Any], status: dict[str, Any], pods: list[dict[str, Any]]) -> str:
        """The backoff limit (``exceedsBackoffLimit`` with no requeue count, ``PastBackoffLimit``) or the active
        deadline, as the failure message; '' when neither."""
        name, run_policy = job["metadata"]["name"], job["spec"].get("runPolicy") or {}
        replicas = job["spec"]["pytorchReplicaSpecs"]
        limit = run_policy.get("backoffLimit")
        if limit is not None:
            active = sum(
                1
                for p in pods
                if p["status"].get("phase") not in ("Succeeded", "Failed")
                and not p["metadata"].get("deletionTimestamp")
            )
            failed = sum(1 for p in pods if p["status"].get("phase") == "Failed")
            previously_failed = sum(e.get("failed", 0) for e in (status.get("replicaStatuses") or {}).values())
            total = sum(int(r.get("replicas") or 1) for r in replicas.values())
            exceeds = failed > previously_failed and active != total and 1 > limit
            restarts = sum(
                cs.get("restartCount", 0)
                for rtype, rspec in replicas.items()
                if (rspec.get("restartPolicy") or "OnFailure") in ("OnFailure", "Always", "ExitCode")
                for p in pods
                if p["metadata"]["labels"].get(REPLICA_TYPE_LABEL) == rtype.lower()
                and p["status"].get("phase") == "Running"
                for cs in (p["status"].get("initContainerStatuses") or [])
                + (p["status"].get("containerStatuses") or [])
            )
            if exceeds or (restarts > 0 if limit == 0 else restarts >= limit):
                return f"Job {name} has failed because it has reached the specified backoff limit"
        deadline, started = run_policy.get("activeDeadlineSeconds"), status.get("startTime")
        if deadline is not None and started:
            if time.time() - calendar_seconds(started) >= deadline:
                return f"Job {name} has failed because it was active longer than specified deadline"
        return ""

    def _reconcile_pods(
        self, job: dict[str, Any], status: dict[str, Any], rtype: str, rspec: dict[str, Any], pods: list[dict[str, Any]]
    ) -> None:
        """ReconcilePods: a pod for each missing index; a Failed pod restarted (deleted, Restarting) or failing the
        job, by restartPolicy and exit code; the replica counts (UpdateJobReplicaStatuses)."""
        name, policy = job["metadata"]["name"], rspec.get("restartPolicy") or "OnFailure"
        mine = {
            p["metadata"]["labels"].get(REPLICA_INDEX_LABEL): p
            for p in pods
            if p["metadata"]["labels"].get(REPLICA_TYPE_LABEL) == rtype.lower()
        }
        counts = {"active": 0, "succeeded": 0, "failed": 0}
        for index in range(int(rspec.get("replicas") or 1)):
            pod = mine.get(str(index))
            if pod is None:
                self._create_pod(job, rtype, rspec, index)
                continue
            phase, deleting = pod["status"].get("phase"), bool(pod["metadata"].get("deletionTimestamp"))
            if phase == "Running":
                counts["failed" if deleting else "active"] += 1
            elif phase == "Succeeded":
                counts["succeeded"] += 1
            elif phase == "Failed":
                counts["failed"] += 1
                code = exit_code(pod)
                if policy in ("OnFailure", "Always") or (policy == "ExitCode" and code >= 128):
                    self._delete_pods_and_services([pod], "All")
                    set_condition(
                        status,
                        "Restarting",
                        "True",
                        "PyTorchJobRestarting",
                        f"job {name} is restarting because {rtype} replica(s) failed.",
                    )
                elif policy == "ExitCode":
                    set_condition(
                        status,
                        "Failed",
                        "True",
                        "PyTorchJobFailed",
                        f'job "{name}" is failing because "{rtype}" replica(s) failed.',
                    )
        selector = {JOB_NAME_LABEL: name, OPERATOR_NAME_LABEL: OPERATOR_NAME, REPLICA_TYPE_LABEL: rtype.lower()}
        status["replicaStatuses"][rtype] = {
            "labelSelector": {"matchLabels": selector},
            "selector": ",".join(f"{k}={v}" for k, v in sorted(selector.items())),
            **{k: v for k, v in counts.items() if v},
        }

    def _labels(self, job: dict[str, Any], rtype: str, index: int) -> dict[str, str]:
        return {
            OPERATOR_NAME_LABEL: OPERATOR_NAME,
            JOB_NAME_LABEL: job["metadata"]["name"],
            REPLICA_TYPE_LABEL: rtype.lower(),
            REPLICA_INDEX_LABEL: str(index),
        }

    def _owner(self, job: dict[str, Any]) -> dict[str, Any]:
        return controller_reference(f"{GROUP}/{VERSION}", KIND, job["metadata"])

    def _create_pod(self, job: dict[str, Any], rtype: str, rspec: dict[str, Any], index: int) -> None:
        replicas = job["spec"]["pytorchReplicaSpecs"]
        template = json.loads(json.dumps(rspec.get("template") or {}))
        labels = {**(template.get("metadata") or {}).get("labels", {}), **self._labels(job, rtype, index)}
        if rtype == "Master" or ("Master" not in replicas and rtype == "Worker" and index == 0):  # IsMasterRole
            labels[JOB_ROLE_LABEL] = "master"
        spec = template.get("spec") or {}
        policy = rspec.get("restartPolicy") or "OnFailure"
        spec["restartPolicy"] = "Never" if policy == "ExitCode" else policy
        for container in spec.get("containers", []):
            container["env"] = [*container.get("env", []), *self._env(job)]
            if container.get("name") == CONTAINER and not any(
                p.get("name") == PORT_NAME for p in container.get("ports", [])
            ):
                container["ports"] = [*container.get("ports", []), {"name": PORT_NAME, "containerPort": PORT}]
        pod = {
            "metadata": {
                "name": f"{job['metadata']['name']}-{rtype.lower()}-{index}",
                "labels": labels,
                "ownerReferences": [self._owner(job)],
                "annotations": (template.get("metadata") or {}).get("annotations", {}),
            },
            "spec": spec,
        }
        try:
            self.core.create_namespaced_pod(self.namespace, pod, _preload_content=False)
        except ApiException as exc:
            if exc.status != 409:  # 409: created by the previous pass
                self._failed_create(job, f"Error creating: {json.loads(exc.body or '{}').get('message', exc.reason)}")

    def _failed_create(self, job: dict[str, Any], message: str) -> None:
        """The recorder's Warning event on the job, once per message (client-go's correlator counts repeats)."""
        key = (job["metadata"]["uid"], message)
        if key in self._failed_creates:
            return
        self._failed_creates.add(key)
        meta, stamp = job["metadata"], now()
        self.core.create_namespaced_event(
            self.namespace,
            {
                "metadata": {"name": f"{meta['name']}.{time.time_ns():x}", "namespace": self.namespace},
                "involvedObject": {
                    "apiVersion": f"{GROUP}/{VERSION}",
                    "kind": KIND,
                    "name": meta["name"],
                    "namespace": self.namespace,
                    "uid": meta["uid"],
                },
                "reason": "FailedCreate",
                "message": message,
                "type": "Warning",
                "source": {"component": "pytorchjob-controller"},
                "firstTimestamp": stamp,
                "lastTimestamp": stamp,
                "count": 1,
            },
            _preload_content=False,
        )

    def _reconcile_services(
        self, job: dict[str, Any], rtype: str, rspec: dict[str, Any], pods: list[dict[str, Any]]
    ) -> None:
        """A headless Service per index, named as its pod (created once; a 409 means it exists)."""
        if job["metadata"]["uid"] in self._services:
            return
        for index in range(int(rspec.get("replicas") or 1)):
            labels = self._labels(job, rtype, index)
            service = {
                "metadata": {
                    "name": f"{job['metadata']['name']}-{rtype.lower()}-{index}",
                    "labels": labels,
                    "ownerReferences": [self._owner(job)],
                },
                "spec": {"clusterIP": "None", "selector": labels, "ports": [{"name": PORT_NAME, "port": PORT}]},
            }
            with contextlib.suppress(ApiException):
                self.core.create_namespaced_service(self.namespace, service, _preload_content=False)
        self._services.add(job["metadata"]["uid"])

    def _env(self, job: dict[str, Any]) -> list[dict[str, str]]:
        """``setPodEnv`` for a Worker-only job, after ``SetDefaults_PyTorchJob`` (nprocPerNode "auto")."""
        spec, name = job["spec"], job["metadata"]["name"]
        elastic = spec.get("elasticPolicy")
        nproc = spec.get("nprocPerNode") or ((elastic or {}).get("nProcPerNode") and None) or "auto"
        env = [{"name": "PYTHONUNBUFFERED", "value": "1"}, {"name": "PET_NPROC_PER_NODE", "value": str(nproc)}]
        total = sum(int(r.get("replicas") or 1) for r in spec["pytorchReplicaSpecs"].values())
        if elastic is None:
            return [*env, {"name": "PET_NNODES", "value": str(total)}]
        low, high = elastic.get("minReplicas", total), elastic.get("maxReplicas", total)
        env += [
            {
                "name": "PET_RDZV_ENDPOINT",
                "value": f"{elastic.get('rdzvHost') or name + '-worker-0'}:{elastic.get('rdzvPort') or PORT}",
            },
            {"name": "PET_RDZV_BACKEND", "value": elastic.get("rdzvBackend") or "c10d"},
            {"name": "PET_NNODES", "value": f"{low}:{high}"},
        ]
        if elastic.get("maxRestarts") is not None:
            env.append({"name": "PET_MAX_RESTARTS", "value": str(elastic["maxRestarts"])})
        return env

    def _update_job_status(self, job: dict[str, Any], status: dict[str, Any]) -> None:
        """``UpdateJobStatus`` for a Worker-only job."""
        name, ns = job["metadata"]["name"], self.namespace
        worker_spec = job["spec"]["pytorchReplicaSpecs"].get("Worker") or {}
        worker = status["replicaStatuses"].get("Worker", {})
        succeeded, running, failed = worker.get("succeeded", 0), worker.get("active", 0), worker.get("failed", 0)
        replicas = int(worker_spec.get("replicas") or 1)
        if replicas - succeeded == 0 or (job["spec"].get("elasticPolicy") is not None and succeeded > 0):
            status.setdefault("completionTime", now())
            set_condition(
                status, "Succeeded", "True", "PyTorchJobSucceeded", f"PyTorchJob {ns}/{name} successfully completed."
            )
        elif running > 0:
            set_condition(status, "Running", "True", "PyTorchJobRunning", f"PyTorchJob {ns}/{name} is running.")
        if failed > 0 and replicas > succeeded + running:
            if (worker_spec.get("restartPolicy") or "OnFailure") != "Never":
                set_condition(
                    status,
                    "Restarting",
                    "True",
                    "PyTorchJobRestarting",
                    f"PyTorchJob {name} is restarting because {failed} Worker replica(s) failed.",
                )
            else:
                status.setdefault("completionTime", now())
                set_condition(
                    status,
                    "Failed",
                    "True",
                    "PyTorchJobFailed",
                    f"PyTorchJob {name} is failed because {failed} Worker replica(s) failed.",
                )

    def _delete_pods_and_services(self, pods: list[dict[str, Any]], policy: str) -> None:
        """DeletePodsAndServices: by cleanPodPolicy (All; Running: the Running and Pending pods; None: none), each
        pod and the service of its name."""
        for pod in pods:
            if pod["metadata"].get("deletionTimestamp"):
                continue
            if policy == "None" or (policy == "Running" and pod["status"].get("phase") not in ("Running", "Pending")):
                continue
            for delete in (self.core.delete_namespaced_pod, self.core.delete_namespaced_service):
                with contextlib.suppress(ApiException):
                    delete(pod["metadata"]["name"], self.namespace, _preload_content=False)

    def _write(self, job: dict[str, Any], status: dict[str, Any]) -> None:
        if status == (job.get("status") or {}):
            return
        status["lastReconcileTime"] = now()
        body = {**job, "status": status}
        self.custom.replace_namespaced_custom_object_status(
            GROUP, VERSION, self.namespace, PLURAL, job["metadata"]["name"], body, _preload_content=False
        )
