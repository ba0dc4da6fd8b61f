"""JobSet v0.12.0 (``jobset.x-k8s.io/v1alpha2``), the controller Kubeflow Trainer v2.3.0 runs its TrainJobs through,
played on the real API server; the batch Jobs it creates are run by the real Job controller of kube-controller-manager
(pods, completion indexes, backoffLimit, a failed or suspended Job's pods deleted).

Sources, kubernetes-sigs/jobset at tag v0.12.0 (each function below names its own):
- ``pkg/webhooks/jobset_webhook.go`` ``Default``: served as the MutatingWebhookConfiguration
  ``jobset-mutating-webhook-configuration`` (``config/components/webhook/manifests.yaml`` with ``config/default``'s
  ``namePrefix: jobset-``), webhook ``mjobset.kb.io``, CREATE only.
- ``pkg/controllers/jobset_controller.go``: ``reconcile``, ``getChildJobs``, ``calculateReplicatedJobStatuses``,
  ``constructJob`` / ``labelAndAnnotateObject``, ``createHeadlessSvcIfNecessary``, ``suspendJobs``,
  ``resumeJobsIfNecessary`` / ``resumeJob``, ``deleteJobs`` (foreground), ``updateCondition``.
- ``pkg/controllers/failure_policy.go`` ``executeFailurePolicy`` and its action appliers;
  ``pkg/controllers/success_policy.go`` ``executeSuccessPolicy``; ``pkg/constants/constants.go`` (reasons, messages).
- ``pkg/webhooks/jobset_webhook.go`` ``ValidateUpdate``: served as the ValidatingWebhookConfiguration
  ``jobset-validating-webhook-configuration``, webhook ``vjobset.kb.io``, CREATE and UPDATE, failurePolicy Fail.
  Only the update's checks are played (a suspended JobSet's pod template may change only its labels, annotations,
  nodeSelector, tolerations and schedulingGates; ``managedBy`` never); a create is allowed.
- ``pkg/controllers/ttl_after_finished.go`` ``executeTTLAfterFinishedPolicy``: a finished JobSet with
  ``ttlSecondsAfterFinished`` is deleted (``deleteJobSet``: propagation Foreground) once that long has passed since
  its Completed or Failed condition turned True, and requeued for then before it.
- ``pkg/features/features.go``: every gate that changes this path (RestartJob, InPlaceRestart, ElasticJobSet) is off by
  default at v0.12.0, so the ``job-restart-attempt`` label, in-place restarts and elastic scaling are not played.

The controller polls the namespace's JobSets and Jobs every POLL_S and reconciles a JobSet when it or one of its Jobs
changed (what ``Owns(&batchv1.Job{})`` would deliver), or its TTL timer is due. Not played: the validating webhook's
checks on create, ``InOrder`` startup, ``dependsOn``, volume claim policies, exclusive placement, events.
"""

from __future__ import annotations

import base64
import calendar
import contextlib
import copy
import hashlib
import json
import logging
import re
import time
from pathlib import Path
from typing import Any

import kubernetes
from kubernetes.client.exceptions import ApiException

from tests.cluster.controller import POLL_S, PolledController, controller_reference
from tests.cluster.tls import HttpsServer, admission_handler, loopback_cert

log = logging.getLogger(__name__)

GROUP, VERSION, PLURAL, KIND = "jobset.x-k8s.io", "v1alpha2", "jobsets", "JobSet"
# api/jobset/v1alpha2/jobset_types.go
JOBSET_NAME_KEY = "jobset.sigs.k8s.io/jobset-name"
JOBSET_UID_KEY = "jobset.sigs.k8s.io/jobset-uid"
REPLICATED_JOB_REPLICAS = "jobset.sigs.k8s.io/replicatedjob-replicas"
GLOBAL_REPLICAS_KEY = "jobset.sigs.k8s.io/global-replicas"
REPLICATED_JOB_NAME_KEY = "jobset.sigs.k8s.io/replicatedjob-name"
JOB_INDEX_KEY = "jobset.sigs.k8s.io/job-index"
JOB_GLOBAL_INDEX_KEY = "jobset.sigs.k8s.io/job-global-index"
JOB_KEY = "jobset.sigs.k8s.io/job-key"
GROUP_NAME_KEY = "jobset.sigs.k8s.io/group-name"
GROUP_REPLICAS_KEY = "jobset.sigs.k8s.io/group-replicas"
JOB_GROUP_INDEX_KEY = "jobset.sigs.k8s.io/job-group-index"
COORDINATOR_KEY = "jobset.sigs.k8s.io/coordinator"
EXCLUSIVE_KEY = "alpha.jobset.sigs.k8s.io/exclusive-topology"
JOBSET_CONTROLLER_NAME = "jobset.sigs.k8s.io/jobset-controller"
# pkg/constants/constants.go
RESTARTS_KEY = "jobset.sigs.k8s.io/restart-attempt"
REACHED_MAX_RESTARTS = ("ReachedMaxRestarts", "jobset failed due to reaching max number of restarts")
FAILED_JOBS = ("FailedJobs", "jobset failed due to one or more job failures")
ALL_JOBS_COMPLETED = ("AllJobsCompleted", "jobset completed successfully")
SUSPENDED = ("SuspendedJobs", "jobset is suspended")
RESUMED = ("ResumeJobs", "jobset is resumed")
FAIL_JOBSET_ACTION = ("FailJobSetFailurePolicyAction", "applying FailJobSet failure policy action")
RESTART_JOBSET_ACTION_MESSAGE = "applying RestartJobSet failure policy action"
RESTART_IGNORE_MAX_ACTION_MESSAGE = "applying RestartJobSetAndIgnoreMaxRestarts failure policy action"
RESTARTING_DEFAULT_FAILURE_POLICY = "DefaultFailurePolicy"
RESTARTING_JOBS_READY = ("JobsReady", "all jobs are ready")
RESTARTING_JOBSET_FAILED = ("JobSetFailed", "jobset failed")
RESTARTING_JOBSET_COMPLETED = "JobSetCompleted"
RESTARTING_JOBSET_SUSPENDED = "JobSetSuspended"
# Condition types (JobSetConditionType)
COMPLETED, FAILED, SUSPENDED_TYPE, RESTARTING = "Completed", "Failed", "Suspended", "RestartingJobSet"
STARTUP_IN_PROGRESS, STARTUP_COMPLETED = "StartupPolicyInProgress", "StartupPolicyCompleted"

WEBHOOK_CONFIGURATION = "jobset-mutating-webhook-configuration"
WEBHOOK_NAME = "mjobset.kb.io"
WEBHOOK_PATH = "/mutate-jobset-x-k8s-io-v1alpha2-jobset"
VALIDATING_CONFIGURATION = "jobset-validating-webhook-configuration"
VALIDATING_NAME = "vjobset.kb.io"
VALIDATING_PATH = "/validate-jobset-x-k8s-io-v1alpha2-jobset"
# Pod template fields Kueue may change on a suspended JobSet (ValidateUpdate, after kueue's workload_types.go).
MUTABLE_WHILE_SUSPENDED = (
    ("metadata", "annotations"),
    ("metadata", "labels"),
    ("spec", "nodeSelector"),
    ("spec", "tolerations"),
    ("spec", "schedulingGates"),
)


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


# -- the defaulting webhook -------------------------------------------------------------------------------------


def default_jobset(jobset: dict[str, Any]) -> dict[str, Any]:
    """``jobSetWebhook.Default`` (pkg/webhooks/jobset_webhook.go, v0.12.0): successPolicy All, startupPolicy
    AnyOrder, completionMode Indexed and pod restartPolicy OnFailure in each replicatedJob, network
    enableDNSHostnames and publishNotReadyAddresses true, failure policy rules named ``failurePolicyRule<i>``, volume
    claim policies retained ``Delete``. Returns the defaulted spec."""
    spec = copy.deepcopy(jobset.get("spec") or {})
    spec.setdefault("successPolicy", {"operator": "All"})
    spec.setdefault("startupPolicy", {"startupPolicyOrder": "AnyOrder"})
    for rjob in spec.get("replicatedJobs") or []:
        job_spec = rjob.setdefault("template", {}).setdefault("spec", {})
        job_spec.setdefault("completionMode", "Indexed")
        pod_spec = job_spec.setdefault("template", {}).setdefault("spec", {})
        if not pod_spec.get("restartPolicy"):
            pod_spec["restartPolicy"] = "OnFailure"
    network = spec.setdefault("network", {})
    network.setdefault("enableDNSHostnames", True)
    network.setdefault("publishNotReadyAddresses", True)
    for i, rule in enumerate((spec.get("failurePolicy") or {}).get("rules") or []):
        if not rule.get("name"):
            rule["name"] = f"failurePolicyRule{i}"
    for policy in spec.get("volumeClaimPolicies") or []:
        policy.setdefault("retentionPolicy", {"whenDeleted": "Delete"})
    return spec


def semantic(value: Any) -> Any:
    """A value as ``apiequality.Semantic.DeepEqual`` compares it: nil and empty slices and maps are equal."""
    if isinstance(value, dict):
        kept = {k: semantic(v) for k, v in value.items()}
        return {k: v for k, v in kept.items() if v not in (None, {}, [])}
    if isinstance(value, list):
        return [semantic(v) for v in value]
    return value


def validate_update(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """``jobSetWebhook.ValidateUpdate`` (ElasticJobSet off): with the old or the new JobSet suspended, each replicated
    job's pod template labels, annotations, nodeSelector, tolerations and schedulingGates are taken from the old one;
    then ``spec.replicatedJobs`` and ``spec.managedBy`` must be unchanged (``ValidateImmutableField``). The errors as
    ``field.Invalid`` words them (the value, a ``%#v`` dump there, is shortened here)."""
    old_spec, new_spec = old.get("spec") or {}, copy.deepcopy(new.get("spec") or {})
    old_rjobs = {r.get("name"): r for r in old_spec.get("replicatedJobs") or []}
    if old_spec.get("suspend") or new_spec.get("suspend"):
        for rjob in new_spec.get("replicatedJobs") or []:
            if rjob.get("name") not in old_rjobs:
                continue
            old_pod = ((old_rjobs[rjob["name"]].get("template") or {}).get("spec") or {}).get("template") or {}
            pod = rjob.setdefault("template", {}).setdefault("spec", {}).setdefault("template", {})
            for part, key in MUTABLE_WHILE_SUSPENDED:
                if key in (old_pod.get(part) or {}):
                    pod.setdefault(part, {})[key] = old_pod[part][key]
                else:
                    (pod.get(part) or {}).pop(key, None)
    errors = []
    if semantic(new_spec.get("replicatedJobs")) != semantic(old_spec.get("replicatedJobs")):
        errors.append("spec.replicatedJobs: Invalid value: []v1alpha2.ReplicatedJob{...}: field is immutable")
    if new_spec.get("managedBy") != old_spec.get("managedBy"):
        errors.append(f"spec.managedBy: Invalid value: {json.dumps(new_spec.get('managedBy'))}: field is immutable")
    return errors


class JobSetWebhook:
    """JobSet's defaulting webhook (CREATE) and validating webhook (CREATE and UPDATE) on loopback, registered once per
    control plane. :attr:`denials` keeps what the validating one refused."""

    def __init__(self, admin: kubernetes.client.ApiClient, workdir: Path):
        self.admin = admin
        self.denials: list[str] = []
        cert = loopback_cert(workdir, "jobset-webhook")
        self.server = HttpsServer(admission_handler(self.mutate), cert).start()
        self.validator = HttpsServer(admission_handler(self.validate), cert).start()
        ca = base64.b64encode(cert.pem).decode()

        def configuration(kind: str, name: str, webhook: str, url: str, operations: list[str]) -> dict[str, Any]:
            return {
                "apiVersion": "admissionregistration.k8s.io/v1",
                "kind": kind,
                "metadata": {"name": name},
                "webhooks": [
                    {
                        "name": webhook,
                        "admissionReviewVersions": ["v1"],
                        "sideEffects": "None",
                        "failurePolicy": "Fail",
                        "timeoutSeconds": 10,
                        "clientConfig": {"url": url, "caBundle": ca},
                        "rules": [
                            {
                                "apiGroups": [GROUP],
                                "apiVersions": [VERSION],
                                "operations": operations,
                                "resources": [PLURAL],
                            }
                        ],
                    }
                ],
            }

        api = kubernetes.client.AdmissionregistrationV1Api(admin)
        api.create_mutating_webhook_configuration(
            configuration(
                "MutatingWebhookConfiguration",
                WEBHOOK_CONFIGURATION,
                WEBHOOK_NAME,
                f"https://127.0.0.1:{self.server.port}{WEBHOOK_PATH}",
                ["CREATE"],
            )
        )
        api.create_validating_webhook_configuration(
            configuration(
                "ValidatingWebhookConfiguration",
                VALIDATING_CONFIGURATION,
                VALIDATING_NAME,
                f"https://127.0.0.1:{self.validator.port}{VALIDATING_PATH}",
                ["CREATE", "UPDATE"],
            )
        )

    def validate(self, request: dict[str, Any]) -> dict[str, Any]:
        """controller-runtime's validator: a denial is ``apierrors.NewInvalid``'s status (422, Invalid)."""
        response: dict[str, Any] = {"uid": request["uid"], "allowed": True}
        if request.get("operation") != "UPDATE":
            return response
        new = request.get("object") or {}
        errors = validate_update(request.get("oldObject") or {}, new)
        if errors:
            name = (new.get("metadata") or {}).get("name", "")
            message = f'JobSet.jobset.x-k8s.io "{name}" is invalid: ' + ", ".join(errors)
            if len(errors) > 1:
                message = f'JobSet.jobset.x-k8s.io "{name}" is invalid: [' + ", ".join(errors) + "]"
            self.denials.append(message)
            response |= {"allowed": False, "status": {"code": 422, "reason": "Invalid", "message": message}}
        return response

    def mutate(self, request: dict[str, Any]) -> dict[str, Any]:
        """controller-runtime's defaulter answers with a JSON patch from the object to the defaulted one: here one
        replace of ``/spec``."""
        jobset = request.get("object") or {}
        spec = default_jobset(jobset)
        response: dict[str, Any] = {"uid": request["uid"], "allowed": True}
        if spec != jobset.get("spec"):
            patch = [{"op": "add", "path": "/spec", "value": spec}]
            response |= {"patchType": "JSONPatch", "patch": base64.b64encode(json.dumps(patch).encode()).decode()}
        return response

    def stop(self) -> None:
        api = kubernetes.client.AdmissionregistrationV1Api(self.admin)
        with contextlib.suppress(ApiException):
            api.delete_mutating_webhook_configuration(WEBHOOK_CONFIGURATION)
        with contextlib.suppress(ApiException):
            api.delete_validating_webhook_configuration(VALIDATING_CONFIGURATION)
        self.server.stop()
        self.validator.stop()


# -- helpers shared with the Trainer player -----------------------------------------------------------------------


def find_condition(obj: dict[str, Any], kind: str) -> dict[str, Any] | None:
    return next((c for c in (obj.get("status") or {}).get("conditions") or [] if c["type"] == kind), None)


def condition_true(obj: dict[str, Any], kind: str) -> bool:
    return (find_condition(obj, kind) or {}).get("status") == "True"


def gen_job_name(jobset: str, rjob: str, index: int) -> str:
    """``placement.GenJobName``: ``<jobset>-<replicatedJob>-<jobIndex>``."""
    return f"{jobset}-{rjob}-{index}"


def job_finished(job: dict[str, Any]) -> str:
    """``JobFinished``: "Complete", "Failed" or "" (a condition of that type with status True)."""
    for c in (job.get("status") or {}).get("conditions") or []:
        if c["type"] in ("Complete", "Failed") and c["status"] == "True":
            return c["type"]
    return ""


def _merge_maps(old: dict[str, str] | None, new: dict[str, str] | None) -> dict[str, str] | None:
    """``collections.MergeMaps``: ``new``'s entries over ``old``'s."""
    if not old and not new:
        return old
    return {**(old or {}), **(new or {})}


def _merge_slices(old: list[Any] | None, new: list[Any] | None) -> list[Any] | None:
    """``collections.MergeSlices``: ``old`` then the elements of ``new`` it lacks."""
    merged = list(old or [])
    for item in new or []:
        if item not in merged:
            merged.append(item)
    return merged or old


# -- the controller -----------------------------------------------------------------------------------------------


class JobSetController(PolledController):
    """The JobSet controller for one namespace."""

    def __init__(self, admin: kubernetes.client.ApiClient, namespace: str, poll_s: float = POLL_S):
        super().__init__(f"jobset-{namespace}", poll_s)
        self.custom = kubernetes.client.CustomObjectsApi(admin)
        self.batch = kubernetes.client.BatchV1Api(admin)
        self.core = kubernetes.client.CoreV1Api(admin)
        self.namespace = namespace
        self._versions: dict[str, tuple[str, ...]] = {}
        self._timers: dict[str, float] = {}  # JobSet uid -> when its TTL is due (requeueJobSetAfter)
        self.start()

    def reconcile_all(self) -> None:
        jobsets = json.loads(
            self.custom.list_namespaced_custom_object(
                GROUP, VERSION, self.namespace, PLURAL, _preload_content=False
            ).data
        )["items"]
        jobs = json.loads(self.batch.list_namespaced_job(self.namespace, _preload_content=False).data)["items"]
        for jobset in jobsets:
            uid = jobset["metadata"]["uid"]
            mine = [
                j
                for j in jobs
                if any(o.get("uid") == uid and o.get("controller") for o in j["metadata"].get("ownerReferences") or [])
            ]
            versions = (jobset["metadata"]["resourceVersion"], *sorted(j["metadata"]["resourceVersion"] for j in mine))
            due = self._timers.get(uid)
            if versions == self._versions.get(uid) and (due is None or time.monotonic() < due):
                continue
            self._timers.pop(uid, None)
            self.reconcile(jobset, mine)
            self._versions[uid] = versions  # after success only: an API error is retried at the next pass

    # reconcile ----------------------------------------------------------------------------------------------------

    def reconcile(self, js: dict[str, Any], jobs: list[dict[str, Any]]) -> None:
        """``JobSetReconciler.Reconcile`` / ``reconcile`` (jobset_controller.go), one pass, one status write."""
        if js["metadata"].get("deletionTimestamp"):
            return  # jobSetMarkedForDeletion: the garbage collector takes its Jobs and Service
        spec = js["spec"]
        if (manager := spec.get("managedBy")) and manager != JOBSET_CONTROLLER_NAME:
            return  # managedByExternalController
        status = copy.deepcopy(js.get("status") or {})
        before = copy.deepcopy(status)
        owned = self._child_jobs(status, jobs)
        statuses = self._replicated_job_statuses(js, owned)
        if sorted(statuses, key=lambda s: s["name"]) != sorted(
            status.get("replicatedJobsStatus") or [], key=lambda s: s["name"]
        ):
            status["replicatedJobsStatus"] = statuses
        view = {**js, "status": status}
        suspended = bool(spec.get("suspend"))
        if condition_true(view, COMPLETED) or condition_true(view, FAILED):  # jobSetFinished
            self._delete_jobs(owned["active"])
            self._ttl_after_finished(view)
            return self._write(js, status, before)
        self._delete_jobs(owned["previous"])
        if not suspended and self._all_jobs_ready(js, statuses):
            self._set_condition(status, RESTARTING, "False", *RESTARTING_JOBS_READY)
        if owned["failed"]:
            self._execute_failure_policy(js, status, owned["failed"])
            return self._write(js, status, before)
        if owned["successful"] and self._execute_success_policy(js, status, owned["successful"]):
            return self._write(js, status, before)
        self._create_headless_service(js)
        self._create_jobs(js, status, owned)
        if suspended:
            self._suspend_jobs(owned["active"])
            self._set_condition(status, SUSPENDED_TYPE, "True", *SUSPENDED)
            self._set_condition(status, RESTARTING, "False", RESTARTING_JOBSET_SUSPENDED, SUSPENDED[1])
        else:
            self._resume_jobs(js, owned["active"])
            self._set_condition(status, SUSPENDED_TYPE, "False", *RESUMED)
        self._write(js, status, before)

    @staticmethod
    def _child_jobs(status: dict[str, Any], jobs: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
        """``getChildJobs``: a Job of an earlier restart attempt (its ``restart-attempt`` label below
        ``status.restarts``) is ``previous``; the rest active, successful or failed by ``JobFinished``."""
        owned: dict[str, list[dict[str, Any]]] = {"active": [], "successful": [], "failed": [], "previous": []}
        for job in jobs:
            if int(job["metadata"].get("labels", {}).get(RESTARTS_KEY, "0")) < status.get("restarts", 0):
                owned["previous"].append(job)
                continue
            owned[{"": "active", "Complete": "successful", "Failed": "failed"}[job_finished(job)]].append(job)
        return owned

    @staticmethod
    def _replicated_job_statuses(js: dict[str, Any], owned: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
        """``calculateReplicatedJobStatuses``: per replicatedJob, active Jobs whose succeeded+ready pods reach
        min(parallelism, completions) are ready; ``active`` counts Jobs with an active pod; ``suspended`` the
        suspended ones; ``succeeded`` / ``failed`` the finished Jobs."""
        counts = {
            r["name"]: dict.fromkeys(("ready", "succeeded", "failed", "active", "suspended"), 0)
            for r in js["spec"].get("replicatedJobs") or []
        }
        for kind, jobs in (
            ("active", owned["active"]),
            ("succeeded", owned["successful"]),
            ("failed", owned["failed"]),
        ):
            for job in jobs:
                name = (job["metadata"].get("labels") or {}).get(REPLICATED_JOB_NAME_KEY, "")
                if name not in counts:
                    continue
                if kind != "active":
                    counts[name][kind] += 1
                    continue
                job_status, job_spec = job.get("status") or {}, job["spec"]
                pods = job_spec.get("parallelism", 1)
                if job_spec.get("completions") is not None and job_spec["completions"] < pods:
                    pods = job_spec["completions"]
                if job_status.get("succeeded", 0) + job_status.get("ready", 0) >= pods:
                    counts[name]["ready"] += 1
                if job_status.get("active", 0) > 0:
                    counts[name]["active"] += 1
                if job_spec.get("suspend"):
                    counts[name]["suspended"] += 1
        return [{"name": name, **c} for name, c in counts.items()]

    @staticmethod
    def _all_jobs_ready(js: dict[str, Any], statuses: list[dict[str, Any]]) -> bool:
        """``allJobsReady``: ready + succeeded Jobs equal the replicas of every replicatedJob."""
        total = sum(r.get("replicas", 1) for r in js["spec"].get("replicatedJobs") or [])
        return total == sum(s["ready"] + s["succeeded"] for s in statuses)

    def _ttl_after_finished(self, js: dict[str, Any]) -> None:
        """``executeTTLAfterFinishedPolicy``: past ``ttlSecondsAfterFinished`` after the finishing condition's
        transition, the JobSet is deleted in the foreground (``deleteJobSet``); before it, a timer for then."""
        ttl = js["spec"].get("ttlSecondsAfterFinished")
        if ttl is None:
            return
        finished = next(
            c for c in js["status"]["conditions"] if c["type"] in (COMPLETED, FAILED) and c["status"] == "True"
        )
        remaining = (
            calendar.timegm(time.strptime(finished["lastTransitionTime"], "%Y-%m-%dT%H:%M:%SZ")) + ttl - time.time()
        )
        if remaining > 0:
            self._timers[js["metadata"]["uid"]] = time.monotonic() + remaining
            return
        with contextlib.suppress(ApiException):  # 404: gone meanwhile
            self.custom.delete_namespaced_custom_object(
                GROUP, VERSION, self.namespace, PLURAL, js["metadata"]["name"], propagation_policy="Foreground"
            )

    # conditions ---------------------------------------------------------------------------------------------------

    @staticmethod
    def _set_condition(status: dict[str, Any], kind: str, state: str, reason: str, message: str) -> None:
        """``updateCondition``: a new status replaces the condition (new transition time); the same status with another
        reason or message keeps its transition time; a missing condition is added only when True; a True
        StartupPolicyInProgress and StartupPolicyCompleted exclude each other."""
        new = {"type": kind, "status": state, "reason": reason, "message": message, "lastTransitionTime": now()}
        conditions = status.setdefault("conditions", [])
        found = False
        for i, current in enumerate(conditions):
            if current["type"] == kind:
                found = True
                if current["status"] != state:
                    conditions[i] = new
                elif current.get("reason") != reason or current.get("message") != message:
                    conditions[i] = {**new, "lastTransitionTime": current["lastTransitionTime"]}
            elif (
                {current["type"], kind} == {STARTUP_IN_PROGRESS, STARTUP_COMPLETED}
                and current["status"] == "True"
                and state == "True"
            ):
                conditions[i] = {**current, "status": "False"}
        if not found and state == "True":
            conditions.append(new)
        if not conditions:
            del status["conditions"]

    def _set_failed(self, status: dict[str, Any], reason: str, message: str) -> None:
        """``setJobSetFailedCondition``: Failed, RestartingJobSet False, terminalState Failed."""
        self._set_condition(status, FAILED, "True", reason, message)
        self._set_condition(status, RESTARTING, "False", *RESTARTING_JOBSET_FAILED)
        status["terminalState"] = FAILED

    # failure and success ------------------------------------------------------------------------------------------

    @staticmethod
    def _failure(job: dict[str, Any]) -> dict[str, Any]:
        return next(c for c in job["status"]["conditions"] if c["type"] == "Failed" and c["status"] == "True")

    def _first_failed(self, jobs: list[dict[str, Any]]) -> dict[str, Any]:
        """``findFirstFailedJob``: the Job whose Failed condition is oldest."""
        return min(jobs, key=lambda j: self._failure(j).get("lastTransitionTime", ""))

    def _execute_failure_policy(self, js: dict[str, Any], status: dict[str, Any], failed: list[dict[str, Any]]) -> None:
        """``executeFailurePolicy`` (failure_policy.go): without a failure policy the JobSet fails (FailedJobs);
        otherwise the first rule matching a failed Job decides (default action RestartJobSet): FailJobSet fails it,
        RestartJobSet restarts it until ``restartsCountTowardsMax`` reaches ``maxRestarts`` (then ReachedMaxRestarts),
        RestartJobSetAndIgnoreMaxRestarts restarts it without counting. The RestartJob actions need the RestartJob
        gate, off at v0.12.0: an error, as there."""
        policy = js["spec"].get("failurePolicy")
        if policy is None:
            first = self._first_failed(failed)["metadata"]["name"]
            return self._set_failed(status, FAILED_JOBS[0], f"{FAILED_JOBS[1]} (first failed job: {first})")
        rule, job = None, None
        for candidate in policy.get("rules") or []:
            matching = [j for j in failed if self._rule_applies(candidate, j)]
            if matching:
                rule, job = candidate, self._first_failed(matching)
                break
        action = rule["action"] if rule else "RestartJobSet"
        job = job or self._first_failed(failed)
        name = job["metadata"]["name"]
        if action == "FailJobSet":
            message = f"{FAIL_JOBSET_ACTION[1]} (first failed job: {name})"
            return self._set_failed(status, FAIL_JOBSET_ACTION[0], message)
        if action not in ("RestartJobSet", "RestartJobSetAndIgnoreMaxRestarts"):
            raise RuntimeError(
                f"{action} failure policy action cannot be used when the feature gate RestartJob is disabled"
            )
        counted = action == "RestartJobSet"
        if counted and status.get("restartsCountTowardsMax", 0) >= policy.get("maxRestarts", 0):
            message = f"{REACHED_MAX_RESTARTS[1]} (first failed job: {name})"
            return self._set_failed(status, REACHED_MAX_RESTARTS[0], message)
        base = RESTART_JOBSET_ACTION_MESSAGE if counted else RESTART_IGNORE_MAX_ACTION_MESSAGE
        reason = f"FailurePolicy_{rule['name']}" if rule else RESTARTING_DEFAULT_FAILURE_POLICY
        # failurePolicyRecreateAll: the next pass deletes the Jobs of the attempt before and creates them anew
        status["restarts"] = status.get("restarts", 0) + 1
        if counted:
            status["restartsCountTowardsMax"] = status.get("restartsCountTowardsMax", 0) + 1
        self._set_condition(status, RESTARTING, "True", reason, f"{base} (first failed job: {name})")

    def _rule_applies(self, rule: dict[str, Any], job: dict[str, Any]) -> bool:
        """``ruleIsApplicable``: the Job's failure reason, message (regular expressions) and replicatedJob."""
        failure = self._failure(job)
        if rule.get("onJobFailureReasons") and failure.get("reason") not in rule["onJobFailureReasons"]:
            return False
        patterns = rule.get("onJobFailureMessagePatterns") or []
        if patterns and not any(re.search(p, failure.get("message", "")) for p in patterns):
            return False
        parent = (job["metadata"].get("labels") or {}).get(REPLICATED_JOB_NAME_KEY, "")
        targets = rule.get("targetReplicatedJobs") or []
        return bool(parent) and (not targets or parent in targets)

    def _execute_success_policy(
        self, js: dict[str, Any], status: dict[str, Any], successful: list[dict[str, Any]]
    ) -> bool:
        """``executeSuccessPolicy`` / ``setJobSetCompletedCondition``: enough successful Jobs of the targeted
        replicatedJobs (operator All: all their replicas; Any: one) complete the JobSet."""
        policy = js["spec"].get("successPolicy") or {"operator": "All"}
        targets = policy.get("targetReplicatedJobs") or []
        matching = sum(
            1
            for j in successful
            if not targets or (j["metadata"].get("labels") or {}).get(REPLICATED_JOB_NAME_KEY) in targets
        )
        if policy.get("operator") == "Any":
            expected = 1
        else:
            expected = sum(
                r.get("replicas", 1) for r in js["spec"]["replicatedJobs"] if not targets or r["name"] in targets
            )
        if matching < expected:
            return False
        self._set_condition(status, COMPLETED, "True", *ALL_JOBS_COMPLETED)
        self._set_condition(status, RESTARTING, "False", RESTARTING_JOBSET_COMPLETED, ALL_JOBS_COMPLETED[1])
        status["terminalState"] = COMPLETED
        return True

    # children -----------------------------------------------------------------------------------------------------

    def _owner(self, js: dict[str, Any]) -> dict[str, Any]:
        """``ctrl.SetControllerReference``."""
        return controller_reference(f"{GROUP}/{VERSION}", KIND, js["metadata"])

    def _create_headless_service(self, js: dict[str, Any]) -> None:
        """``createHeadlessSvcIfNecessary``: with DNS hostnames, a headless Service named after the subdomain
        (``GetSubdomain``: network.subdomain, else the JobSet's name) selecting the JobSet's pods."""
        network = js["spec"].get("network") or {}
        if not network.get("enableDNSHostnames"):
            return
        name = network.get("subdomain") or js["metadata"]["name"]
        try:
            self.core.read_namespaced_service(name, self.namespace, _preload_content=False)
            return
        except ApiException as exc:
            if exc.status != 404:
                raise
        service = {
            "metadata": {"name": name, "namespace": self.namespace, "ownerReferences": [self._owner(js)]},
            "spec": {
                "clusterIP": "None",
                "selector": {JOBSET_NAME_KEY: js["metadata"]["name"]},
                "publishNotReadyAddresses": network.get("publishNotReadyAddresses", True),
            },
        }
        self.core.create_namespaced_service(self.namespace, service, _preload_content=False)

    def _create_jobs(self, js: dict[str, Any], status: dict[str, Any], owned: dict[str, list[dict[str, Any]]]) -> None:
        """``reconcileReplicatedJobs`` / ``constructJobsFromTemplate`` for AnyOrder startup: each Job of each
        replicatedJob that does not exist (of this attempt or, until deleted, of the one before) is created; with
        BlockingRecreate, none while a Job of the attempt before remains."""
        policy = js["spec"].get("failurePolicy") or {}
        if owned["previous"] and policy.get("restartStrategy") == "BlockingRecreate":
            return
        existing = {j["metadata"]["name"] for group in owned.values() for j in group}
        for rjob in js["spec"].get("replicatedJobs") or []:
            for index in range(rjob.get("replicas", 1)):
                if gen_job_name(js["metadata"]["name"], rjob["name"], index) in existing:
                    continue
                job = self.construct_job(js, status, rjob, index)
                try:
                    self.batch.create_namespaced_job(self.namespace, job, _preload_content=False)
                except ApiException as exc:
                    if exc.status != 409:  # a Job of the attempt before still being deleted: the next pass
                        raise

    @staticmethod
    def label_and_annotate(
        meta: dict[str, Any], js: dict[str, Any], status: dict[str, Any], rjob: dict[str, Any], index: int
    ) -> None:
        """``labelAndAnnotateObject``: the same keys as labels and as annotations, on the Job and its pod template."""
        name = js["metadata"]["name"]
        rjobs = js["spec"]["replicatedJobs"]
        group = rjob.get("groupName", "default")
        global_index, group_index = 0, 0
        for other in rjobs:
            if other["name"] == rjob["name"]:
                break
            global_index += other.get("replicas", 1)
        for other in rjobs:
            if other.get("groupName", "default") == group:
                if other["name"] == rjob["name"]:
                    break
                group_index += other.get("replicas", 1)
        job_name = gen_job_name(name, rjob["name"], index)
        values = {
            JOBSET_NAME_KEY: name,
            JOBSET_UID_KEY: js["metadata"]["uid"],
            REPLICATED_JOB_NAME_KEY: rjob["name"],
            RESTARTS_KEY: str(status.get("restarts", 0)),
            REPLICATED_JOB_REPLICAS: str(rjob.get("replicas", 1)),
            GLOBAL_REPLICAS_KEY: str(sum(r.get("replicas", 1) for r in rjobs)),
            JOB_INDEX_KEY: str(index),
            JOB_KEY: hashlib.sha1(f"{js['metadata']['namespace']}/{job_name}".encode()).hexdigest(),
            JOB_GLOBAL_INDEX_KEY: str(global_index + index),
            GROUP_NAME_KEY: group,
            GROUP_REPLICAS_KEY: str(sum(r.get("replicas", 1) for r in rjobs if r.get("groupName", "default") == group)),
            JOB_GROUP_INDEX_KEY: str(group_index + index),
        }
        if coordinator := js["spec"].get("coordinator"):
            values[COORDINATOR_KEY] = (
                f"{name}-{coordinator['replicatedJob']}-{coordinator.get('jobIndex', 0)}-"
                f"{coordinator.get('podIndex', 0)}."
                f"{(js['spec'].get('network') or {}).get('subdomain') or name}"
            )
        annotations = {**(meta.get("annotations") or {}), **values}
        if EXCLUSIVE_KEY in (js["metadata"].get("annotations") or {}):
            annotations[EXCLUSIVE_KEY] = js["metadata"]["annotations"][EXCLUSIVE_KEY]
        if EXCLUSIVE_KEY in ((rjob.get("template") or {}).get("metadata") or {}).get("annotations", {}):
            annotations[EXCLUSIVE_KEY] = rjob["template"]["metadata"]["annotations"][EXCLUSIVE_KEY]
        meta["labels"] = {**(meta.get("labels") or {}), **values}
        meta["annotations"] = annotations

    def construct_job(
        self, js: dict[str, Any], status: dict[str, Any], rjob: dict[str, Any], index: int
    ) -> dict[str, Any]:
        """``constructJob``: the replicatedJob's template as a Job named ``<jobset>-<replicatedJob>-<index>``, labelled
        and annotated (Job and pod template), the subdomain set with DNS hostnames, suspended as the JobSet is, owned
        by it (controller)."""
        template = copy.deepcopy(rjob.get("template") or {})
        meta = {
            "name": gen_job_name(js["metadata"]["name"], rjob["name"], index),
            "namespace": self.namespace,
            "labels": dict((template.get("metadata") or {}).get("labels") or {}),
            "annotations": dict((template.get("metadata") or {}).get("annotations") or {}),
            "ownerReferences": [self._owner(js)],
        }
        spec = template.get("spec") or {}
        pod_template = spec.setdefault("template", {})
        pod_meta = pod_template.setdefault("metadata", {})
        self.label_and_annotate(meta, js, status, rjob, index)
        self.label_and_annotate(pod_meta, js, status, rjob, index)
        network = js["spec"].get("network") or {}
        if network.get("enableDNSHostnames"):
            pod_template.setdefault("spec", {})["subdomain"] = network.get("subdomain") or js["metadata"]["name"]
        spec["suspend"] = bool(js["spec"].get("suspend"))
        return {"apiVersion": "batch/v1", "kind": "Job", "metadata": meta, "spec": spec}

    def _suspend_jobs(self, active: list[dict[str, Any]]) -> None:
        """``suspendJobs``: each active Job not suspended is updated with ``suspend: true`` (the Job controller then
        deletes its pods)."""
        for job in active:
            if not job["spec"].get("suspend"):
                job = copy.deepcopy(job)
                job["spec"]["suspend"] = True
                self.batch.replace_namespaced_job(job["metadata"]["name"], self.namespace, job, _preload_content=False)

    def _resume_jobs(self, js: dict[str, Any], active: list[dict[str, Any]]) -> None:
        """``resumeJobsIfNecessary`` / ``resumeJob`` (AnyOrder): each suspended active Job has its ``startTime``
        cleared (a status update: a started Job's template is immutable), the replicatedJob's pod template labels,
        annotations, nodeSelector, tolerations and schedulingGates merged into its own (what Kueue may have changed
        while it was suspended), and ``suspend: false``."""
        templates = {
            r["name"]: (r.get("template") or {}).get("spec", {}).get("template") or {}
            for r in js["spec"].get("replicatedJobs") or []
        }
        for job in active:
            if not job["spec"].get("suspend"):
                continue
            job = copy.deepcopy(job)
            if (job.get("status") or {}).get("startTime"):
                del job["status"]["startTime"]
                job = json.loads(
                    self.batch.replace_namespaced_job_status(
                        job["metadata"]["name"], self.namespace, job, _preload_content=False
                    ).data
                )
            rjob_name = (job["metadata"].get("labels") or {}).get(REPLICATED_JOB_NAME_KEY, "")
            if rjob_name:
                source = templates.get(rjob_name, {})
                target = job["spec"]["template"]
                target_meta = target.setdefault("metadata", {})
                for key in ("labels", "annotations"):
                    merged = _merge_maps(target_meta.get(key), (source.get("metadata") or {}).get(key))
                    if merged is not None:
                        target_meta[key] = merged
                source_spec, target_spec = source.get("spec") or {}, target.setdefault("spec", {})
                if (
                    selector := _merge_maps(target_spec.get("nodeSelector"), source_spec.get("nodeSelector"))
                ) is not None:
                    target_spec["nodeSelector"] = selector
                for key in ("tolerations", "schedulingGates"):
                    if (merged_list := _merge_slices(target_spec.get(key), source_spec.get(key))) is not None:
                        target_spec[key] = merged_list
            job["spec"]["suspend"] = False
            self.batch.replace_namespaced_job(job["metadata"]["name"], self.namespace, job, _preload_content=False)

    def _delete_jobs(self, jobs: list[dict[str, Any]]) -> None:
        """``deleteJobs``: each Job not already being deleted, with propagation policy Foreground."""
        for job in jobs:
            if job["metadata"].get("deletionTimestamp"):
                continue
            with contextlib.suppress(ApiException):  # 404: gone meanwhile
                self.batch.delete_namespaced_job(
                    job["metadata"]["name"], self.namespace, propagation_policy="Foreground", _preload_content=False
                )

    def _write(self, js: dict[str, Any], status: dict[str, Any], before: dict[str, Any]) -> None:
        """``updateJobSetStatus``: one status update (optimistic: a conflict is retried at the next pass)."""
        if status == before:
            return
        body = {**js, "status": status}
        self.custom.replace_namespaced_custom_object_status(
            GROUP, VERSION, self.namespace, PLURAL, js["metadata"]["name"], body, _preload_content=False
        )
