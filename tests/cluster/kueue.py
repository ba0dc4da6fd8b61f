"""Kueue, as HyperPod task governance runs it, played on the real API server: its PyTorchJob webhook, admission and
preemption as a job's owner sees them.

Sources, kubernetes-sigs/kueue (the release is named in :data:`RELEASE`):
- ``pkg/controller/jobframework/defaults.go`` ``ApplyDefaultForSuspend`` (called from the PyTorchJob webhook,
  ``pkg/controller/jobs/kubeflow/jobs/pytorchjob``): a job carrying the ``kueue.x-k8s.io/queue-name`` label is
  created with ``runPolicy.suspend: true`` (jobs without it are left alone: ``manageJobsWithoutQueueName`` is off).
- ``pkg/controller/jobframework/reconciler.go`` ``startJob`` / ``kubeflowjob.RunWithPodSetsInfo`` and
  ``pkg/podset/podset.go`` ``Merge``: admission is one merge patch: suspend false, and into each replica's template the
  labels ``kueue.x-k8s.io/podset``, ``local-queue-name``, ``cluster-queue-name``, the annotation
  ``kueue.x-k8s.io/workload`` and the flavor's node labels (none here). Preemption (``pkg/scheduler/preemption``,
  then ``stopJob``): suspend true and the templates restored as they were; nothing is added to the job.
- ``pkg/controller/jobs/trainjob`` (alpha since v0.14.0), for a Kubeflow Trainer ``TrainJob``: its webhook
  (``TrainJobWebhook.Default``, ``mtrainjob.kb.io``, CREATE) suspends a TrainJob carrying the queue label and appends
  to *every* TrainJob an empty runtime patch of manager ``kueue.x-k8s.io/manager``. Admission
  (``RunWithPodSetsInfo`` inside ``startJob``'s ``clientutil.Patch``) is two writes: an update that fills that patch's
  ``replicatedJobs`` with each podset's pod template labels and annotations (and nodeSelector, tolerations,
  schedulingGates: none here) while the TrainJob is still suspended, as Trainer's webhook requires, then a patch of
  ``suspend: false``. Preemption (``Stop``): an update to ``suspend: true``; once no Job of it is active
  (``IsActive`` on ``status.jobsStatus``), a patch emptying the patch's ``replicatedJobs``
  (``RestorePodSetsInfo``).
- Both updates send the TrainJob as Kueue decoded it: with the Trainer API its ``go.mod`` pins (v0.19.2:
  ``github.com/kubeflow/trainer/v2 v2.2.1``), so what v2.3.0 added is gone from what it writes back
  (:func:`as_trainer_v2_2_1`). The merge patches after them are computed from those same decoded objects
  (``clientutil.Patch``, ``client.MergeFrom``): they never name the dropped field, whose loss the update already
  made, except RestorePodSetsInfo's: a merge patch replaces a list whole, so it sends the whole runtimePatches list
  in v2.2.1's form again.
- A SageMaker ``HyperPodPyTorchJob``: how task governance's Kueue manages it is not published (no Kueue release has
  an integration for it; the HyperPod training operator's is closed source). What is: the SDK's model of it (PyPI
  sagemaker-hyperpod 3.12.0, ``hyperpod_pytorch_job_unified_config.py``) has ``spec.runPolicy.suspend`` ("Suspend
  suspends HyperPodPytorchJob") and status fields "used by Kueue" (``podSets``, ``podSetInfos``). Played as the
  simplest job of Kueue's ``jobframework`` would be: a webhook (ours: ``mhyperpodpytorchjob.kb.io``, at the path
  controller-runtime would give it) applying ``ApplyDefaultForSuspend`` as above, admission a merge patch of
  ``runPolicy.suspend: false``, preemption one of ``true``. Kueue's pod-set labels, which would reach the pods
  through ``status.podSetInfos`` and the operator, are not played.
"""

from __future__ import annotations

import base64
import contextlib
import copy
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kubernetes
from kubernetes.client.exceptions import ApiException

from tests.cluster import hyperpod_training_operator as hyperpod_player
from tests.cluster import trainer as trainer_player
from tests.cluster.tls import HttpsServer, admission_handler, loopback_cert
from tests.cluster.training_operator import GROUP, PLURAL, VERSION

log = logging.getLogger(__name__)

# What SageMaker HyperPod task governance installs: add-on amazon-sagemaker-hyperpod-taskgovernance v1.6.0-eksbuild.1
# "packages Kueue v0.19.2" (AWS, "Upgrade the task governance add-on"). Its PyTorchJob integration is commented out in
# Kueue's default configuration at that tag: task governance enables it.
RELEASE = "v0.19.2"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
PODSET_LABEL = "kueue.x-k8s.io/podset"
LOCAL_QUEUE_LABEL = "kueue.x-k8s.io/local-queue-name"
CLUSTER_QUEUE_LABEL = "kueue.x-k8s.io/cluster-queue-name"
WORKLOAD_ANNOTATION = "kueue.x-k8s.io/workload"
WEBHOOK_NAME = "mpytorchjob.kb.io"
WEBHOOK_PATH = "/mutate-kubeflow-org-v1-pytorchjob"
CONFIGURATION = "kueue-mutating-webhook-configuration"
TRAINJOB_WEBHOOK_NAME = "mtrainjob.kb.io"
TRAINJOB_WEBHOOK_PATH = "/mutate-trainer-kubeflow-org-v1alpha1-trainjob"
RUNTIME_PATCH_MANAGER = "kueue.x-k8s.io/manager"  # pkg/controller/jobs/trainjob: runtimePatchManagerName
HYPERPOD_WEBHOOK_NAME = "mhyperpodpytorchjob.kb.io"  # ours: no integration of this kind is published (docstring)
HYPERPOD_WEBHOOK_PATH = "/mutate-sagemaker-amazonaws-com-v1-hyperpodpytorchjob"
PYTORCHJOB = (GROUP, VERSION, PLURAL)


# kubeflow/trainer v2.2.1 pkg/apis/trainer/v1alpha1/trainjob_types.go, PodSpecPatch: the pod fields a runtime patch
# may carry in the types Kueue v0.19.2 is built on. v2.3.0 added terminationGracePeriodSeconds (kubeflow/trainer#3324);
# nothing else of a TrainJob's spec is new between the two tags.
V2_2_1_POD_SPEC_PATCH = (
    "serviceAccountName",
    "volumes",
    "initContainers",
    "containers",
    "imagePullSecrets",
    "securityContext",
    "nodeSelector",
    "affinity",
    "tolerations",
    "schedulingGates",
)


def as_trainer_v2_2_1(trainjob: dict[str, Any]) -> dict[str, Any]:
    """The TrainJob as Kueue v0.19.2 holds it after decoding it into Trainer v2.2.1's Go types: each runtime patch's pod
    spec patch keeps only the fields v2.2.1 knows (an unknown JSON field is dropped by encoding/json)."""
    trainjob = copy.deepcopy(trainjob)
    for patch in (trainjob.get("spec") or {}).get("runtimePatches") or []:
        template = ((patch.get("trainingRuntimeSpec") or {}).get("template") or {}).get("spec") or {}
        for rjob in template.get("replicatedJobs") or []:
            pod = (((rjob.get("template") or {}).get("spec") or {}).get("template") or {}).get("spec")
            if isinstance(pod, dict):
                for key in [k for k in pod if k not in V2_2_1_POD_SPEC_PATCH]:
                    del pod[key]
    return trainjob


class Kueue:
    """The mutating webhook (registered for the whole control plane) and the admission decisions a test makes."""

    def __init__(self, admin: kubernetes.client.ApiClient, workdir: Path, *, trainjob: bool = False):
        """``trainjob``: the TrainJob integration enabled too (its CRD installed)."""
        self.admin = admin
        self.custom = kubernetes.client.CustomObjectsApi(admin)
        self.suspended_at_create: list[str] = []
        cert = loopback_cert(workdir, "kueue-webhook")
        self.server = HttpsServer(admission_handler(self.mutate), cert).start()
        selector = {
            "matchExpressions": [
                {"key": "kubernetes.io/metadata.name", "operator": "NotIn", "values": ["kube-system", "kueue-system"]}
            ]
        }
        ca = base64.b64encode(cert.pem).decode()

        def webhook(name: str, path: str, group: str, version: str, plural: str) -> dict[str, Any]:
            """One of Kueue's per-kind mutating webhooks (on CREATE, outside kube-system and kueue-system)."""
            return {
                "name": name,
                "admissionReviewVersions": ["v1"],
                "sideEffects": "None",
                "failurePolicy": "Fail",
                "timeoutSeconds": 10,
                "reinvocationPolicy": "Never",
                "clientConfig": {"url": f"https://127.0.0.1:{self.server.port}{path}", "caBundle": ca},
                "rules": [
                    {"apiGroups": [group], "apiVersions": [version], "operations": ["CREATE"], "resources": [plural]}
                ],
                "namespaceSelector": selector,
            }

        webhooks = [
            webhook(WEBHOOK_NAME, WEBHOOK_PATH, GROUP, VERSION, PLURAL),
            webhook(
                HYPERPOD_WEBHOOK_NAME,
                HYPERPOD_WEBHOOK_PATH,
                hyperpod_player.GROUP,
                hyperpod_player.VERSION,
                hyperpod_player.PLURAL,
            ),
        ]
        if trainjob:
            webhooks.append(
                webhook(
                    TRAINJOB_WEBHOOK_NAME,
                    TRAINJOB_WEBHOOK_PATH,
                    trainer_player.GROUP,
                    trainer_player.VERSION,
                    trainer_player.PLURAL,
                )
            )
        registration = {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "MutatingWebhookConfiguration",
            "metadata": {"name": CONFIGURATION},
            "webhooks": webhooks,
        }
        kubernetes.client.AdmissionregistrationV1Api(admin).create_mutating_webhook_configuration(registration)

    def stop(self) -> None:
        with contextlib.suppress(ApiException):
            kubernetes.client.AdmissionregistrationV1Api(self.admin).delete_mutating_webhook_configuration(
                CONFIGURATION
            )
        self.server.stop()

    def mutate(self, request: dict[str, Any]) -> dict[str, Any]:
        if (request.get("resource") or {}).get("resource") == trainer_player.PLURAL:
            return self._mutate_trainjob(request)
        job = request.get("object") or {}
        response: dict[str, Any] = {"uid": request["uid"], "allowed": True}
        if not ((job.get("metadata") or {}).get("labels") or {}).get(QUEUE_LABEL):
            return response
        patch = [{"op": "add", "path": "/spec/runPolicy/suspend", "value": True}]
        if "runPolicy" not in (job.get("spec") or {}):
            patch = [{"op": "add", "path": "/spec/runPolicy", "value": {"suspend": True}}]
        self.suspended_at_create.append(f"{request.get('namespace')}/{(job.get('metadata') or {}).get('name')}")
        response |= {"patchType": "JSONPatch", "patch": base64.b64encode(json.dumps(patch).encode()).decode()}
        return response

    def _mutate_trainjob(self, request: dict[str, Any]) -> dict[str, Any]:
        """``TrainJobWebhook.Default``: suspended when it carries the queue label (``WorkloadShouldBeSuspended`` with
        ``manageJobsWithoutQueueName`` off); an empty Kueue runtime patch appended whatever the label."""
        trainjob = request.get("object") or {}
        spec = trainjob.get("spec") or {}
        patches = [
            *(spec.get("runtimePatches") or []),
            {"manager": RUNTIME_PATCH_MANAGER, "trainingRuntimeSpec": {"template": {"spec": {}}}},
        ]
        ops: list[dict[str, Any]] = [{"op": "add", "path": "/spec/runtimePatches", "value": patches}]
        if ((trainjob.get("metadata") or {}).get("labels") or {}).get(QUEUE_LABEL):
            ops.append({"op": "add", "path": "/spec/suspend", "value": True})
            name = (trainjob.get("metadata") or {}).get("name")
            self.suspended_at_create.append(f"{request.get('namespace')}/{name}")
        return {
            "uid": request["uid"],
            "allowed": True,
            "patchType": "JSONPatch",
            "patch": base64.b64encode(json.dumps(ops).encode()).decode(),
        }

    def _kind(self, namespace: str, name: str) -> str:
        """ "PyTorchJob" or "TrainJob": which of them ``name`` is in ``namespace``."""
        try:
            self.custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
            return "PyTorchJob"
        except ApiException as exc:
            if exc.status != 404:
                raise
        return "TrainJob"

    def _trainjob(self, namespace: str, name: str) -> dict[str, Any]:
        return self.custom.get_namespaced_custom_object(
            trainer_player.GROUP, trainer_player.VERSION, namespace, trainer_player.PLURAL, name
        )

    def _write_trainjob(self, trainjob: dict[str, Any], patch: dict[str, Any] | None = None) -> None:
        """An update of the whole TrainJob (``c.Update``, through Trainer v2.2.1's types), or with ``patch`` a merge
        patch carrying its resourceVersion (``clientutil.Patch``, strict)."""
        meta = trainjob["metadata"]
        args = (trainer_player.GROUP, trainer_player.VERSION, meta["namespace"], trainer_player.PLURAL, meta["name"])
        if patch is None:  # c.Update of the object as Kueue decoded it
            self.custom.replace_namespaced_custom_object(*args, as_trainer_v2_2_1(trainjob))
        else:
            self.custom.patch_namespaced_custom_object(
                *args, {"metadata": {"resourceVersion": meta["resourceVersion"]}, **patch}
            )

    def _retry(self, what: str, step: Callable[[], bool], timeout_s: float = 30) -> None:
        """``step`` until it says done, again on a conflict (the controllers write in between), as Kueue requeues."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if step():
                    return
            except ApiException as exc:
                if exc.status != 409:
                    raise
            time.sleep(0.05)
        raise TimeoutError(f"Kueue: {what} not done within {timeout_s:.0f}s")

    def _admit_trainjob(self, namespace: str, name: str, cluster_queue: str) -> None:
        """``startJob`` with ``TrainJob.RunWithPodSetsInfo``: the Kueue runtime patch filled with one entry per podset
        (each replicatedJob of the runtime) while suspended, then ``suspend: false``."""

        def fill() -> bool:
            trainjob = self._trainjob(namespace, name)
            runtime = trainer_player.read_runtime(self.custom, trainjob)
            rjobs = (runtime["spec"].get("template") or {}).get("spec", {}).get("replicatedJobs") or []
            queue = (trainjob["metadata"].get("labels") or {}).get(QUEUE_LABEL, "")
            workload = f"trainjob-{name}-{trainjob['metadata']['uid'][:5]}"
            patches = copy.deepcopy(trainjob["spec"].get("runtimePatches") or [])
            mine = next((p for p in patches if p.get("manager") == RUNTIME_PATCH_MANAGER), None)
            if mine is None:
                raise RuntimeError(f"TrainJob {namespace}/{name}: kueue runtime patch not found")
            mine.setdefault("trainingRuntimeSpec", {}).setdefault("template", {}).setdefault("spec", {})
            mine["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"] = [
                {
                    "name": rjob["name"],
                    "template": {
                        "spec": {
                            "template": {
                                "metadata": {
                                    "labels": {
                                        PODSET_LABEL: rjob["name"],
                                        LOCAL_QUEUE_LABEL: queue,
                                        CLUSTER_QUEUE_LABEL: cluster_queue,
                                    },
                                    "annotations": {WORKLOAD_ANNOTATION: workload},
                                },
                                "spec": {},
                            }
                        }
                    },
                }
                for rjob in rjobs
            ]
            self._write_trainjob({**trainjob, "spec": {**trainjob["spec"], "runtimePatches": patches}})
            return True

        self._retry(f"admission of TrainJob {namespace}/{name}", fill)
        self._retry(
            f"start of TrainJob {namespace}/{name}",
            lambda: self._write_trainjob(self._trainjob(namespace, name), {"spec": {"suspend": False}}) or True,
        )

    def _preempt_trainjob(self, namespace: str, name: str) -> None:
        """``TrainJob.Stop``: suspended (an update); once none of its Jobs is active, the Kueue runtime patch's
        ``replicatedJobs`` removed (``RestorePodSetsInfo``, a patch)."""

        def suspend() -> bool:
            trainjob = self._trainjob(namespace, name)
            if not trainjob["spec"].get("suspend"):
                self._write_trainjob({**trainjob, "spec": {**trainjob["spec"], "suspend": True}})
            return True

        def restore() -> bool:
            trainjob = self._trainjob(namespace, name)
            if any(s.get("active", 0) > 0 for s in (trainjob.get("status") or {}).get("jobsStatus") or []):
                return False  # "jobs are still active": requeued
            # A merge patch replaces a list whole: the whole runtimePatches list goes back, as v2.2.1 decoded it (when
            # Stop found the TrainJob already suspended and sent no update, this is what drops the grace period).
            patches = as_trainer_v2_2_1(trainjob)["spec"].get("runtimePatches") or []
            for patch in patches:
                if patch.get("manager") == RUNTIME_PATCH_MANAGER:
                    ((patch.get("trainingRuntimeSpec") or {}).get("template") or {}).get("spec", {}).pop(
                        "replicatedJobs", None
                    )
            try:
                self._write_trainjob(trainjob, {"spec": {"runtimePatches": patches}})
            except ApiException as exc:
                if exc.status != 403:  # Trainer's webhook: the JobSet's status still counts an active Job
                    raise
                return False  # an error there too: requeued
            return True

        self._retry(f"suspension of TrainJob {namespace}/{name}", suspend)
        self._retry(f"restoring TrainJob {namespace}/{name}", restore)

    def _patch_job(
        self,
        namespace: str,
        name: str,
        patch_for: Callable[[dict[str, Any]], dict[str, Any]],
        resource: tuple[str, str, str] = PYTORCHJOB,
    ) -> None:
        """Read the job (a PyTorchJob, or ``resource``'s) and patch it with its resourceVersion; on a conflict (the
        operator wrote its status in between) read it again and retry, as a controller requeues."""
        group, version, plural = resource
        for _ in range(20):
            job = self.custom.get_namespaced_custom_object(group, version, namespace, plural, name)
            patch = {"metadata": {"resourceVersion": job["metadata"]["resourceVersion"]}, **patch_for(job)}
            try:
                self.custom.patch_namespaced_custom_object(group, version, namespace, plural, name, patch)
                return
            except ApiException as exc:
                if exc.status != 409:
                    raise
        raise RuntimeError(f"{plural} {namespace}/{name}: 20 conflicts in a row")

    def _suspend_hyperpod_job(self, namespace: str, name: str, suspend: bool) -> None:
        """A HyperPodPyTorchJob admitted (False) or preempted (True): its runPolicy.suspend (module docstring)."""
        resource = (hyperpod_player.GROUP, hyperpod_player.VERSION, hyperpod_player.PLURAL)
        self._patch_job(namespace, name, lambda job: {"spec": {"runPolicy": {"suspend": suspend}}}, resource)

    def admit(
        self, namespace: str, name: str, cluster_queue: str = "hyperpod-ns-team-a-clusterqueue", kind: str = ""
    ) -> None:
        """The workload fits its ClusterQueue: the job is started, its pod templates carrying the admission. ``kind``:
        "PyTorchJob", "TrainJob" or "HyperPodPyTorchJob" ("": whichever of the first two ``name`` is)."""
        if kind == hyperpod_player.KIND:
            return self._suspend_hyperpod_job(namespace, name, False)
        if (kind or self._kind(namespace, name)) == "TrainJob":
            return self._admit_trainjob(namespace, name, cluster_queue)
        self._patch_job(namespace, name, lambda job: self._admission(job, cluster_queue))

    def _admission(self, job: dict[str, Any], cluster_queue: str) -> dict[str, Any]:
        name = job["metadata"]["name"]
        workload = f"pytorchjob-{name}-{job['metadata']['uid'][:5]}"
        queue = job["metadata"]["labels"].get(QUEUE_LABEL, "")
        templates = {}
        for rtype in job["spec"]["pytorchReplicaSpecs"]:
            labels = {PODSET_LABEL: rtype.lower(), LOCAL_QUEUE_LABEL: queue, CLUSTER_QUEUE_LABEL: cluster_queue}
            templates[rtype] = {
                "template": {"metadata": {"labels": labels, "annotations": {WORKLOAD_ANNOTATION: workload}}}
            }
        return {"spec": {"runPolicy": {"suspend": False}, "pytorchReplicaSpecs": templates}}

    def preempt(self, namespace: str, name: str, kind: str = "") -> None:
        """A higher-priority workload needs the quota: the job is stopped (suspended) and its templates restored. For a
        TrainJob this returns once its Jobs are no longer active and the restore is written."""
        if kind == hyperpod_player.KIND:
            return self._suspend_hyperpod_job(namespace, name, True)
        if (kind or self._kind(namespace, name)) == "TrainJob":
            return self._preempt_trainjob(namespace, name)
        self._patch_job(namespace, name, self._preemption)

    @staticmethod
    def _preemption(job: dict[str, Any]) -> dict[str, Any]:
        templates = {}
        for rtype in job["spec"]["pytorchReplicaSpecs"]:
            labels = dict.fromkeys((PODSET_LABEL, LOCAL_QUEUE_LABEL, CLUSTER_QUEUE_LABEL))
            templates[rtype] = {
                "template": {"metadata": {"labels": labels, "annotations": {WORKLOAD_ANNOTATION: None}}}
            }
        return {"spec": {"runPolicy": {"suspend": True}, "pytorchReplicaSpecs": templates}}
