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
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kubernetes
from kubernetes.client.exceptions import ApiException

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


class Kueue:
    """The mutating webhook (registered for the whole control plane) and the admission decisions a test makes."""

    def __init__(self, admin: kubernetes.client.ApiClient, workdir: Path):
        self.admin = admin
        self.custom = kubernetes.client.CustomObjectsApi(admin)
        self.suspended_at_create: list[str] = []
        cert = loopback_cert(workdir, "kueue-webhook")
        self.server = HttpsServer(admission_handler(self.mutate), cert).start()
        registration = {
            "apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingWebhookConfiguration",
            "metadata": {"name": CONFIGURATION},
            "webhooks": [{
                "name": WEBHOOK_NAME, "admissionReviewVersions": ["v1"], "sideEffects": "None",
                "failurePolicy": "Fail", "timeoutSeconds": 10, "reinvocationPolicy": "Never",
                "clientConfig": {"url": f"https://127.0.0.1:{self.server.port}{WEBHOOK_PATH}",
                                 "caBundle": base64.b64encode(cert.pem).decode()},
                "rules": [{"apiGroups": [GROUP], "apiVersions": [VERSION], "operations": ["CREATE"],
                           "resources": [PLURAL]}],
                "namespaceSelector": {"matchExpressions": [{"key": "kubernetes.io/metadata.name", "operator": "NotIn",
                                                            "values": ["kube-system", "kueue-system"]}]},
            }],
        }  # fmt: skip
        kubernetes.client.AdmissionregistrationV1Api(admin).create_mutating_webhook_configuration(registration)

    def stop(self) -> None:
        with contextlib.suppress(ApiException):
            kubernetes.client.AdmissionregistrationV1Api(self.admin).delete_mutating_webhook_configuration(
                CONFIGURATION
            )
        self.server.stop()

    def mutate(self, request: dict[str, Any]) -> dict[str, Any]:
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

    def _patch_job(self, namespace: str, name: str, patch_for: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
        """Read the job and patch it with its resourceVersion; on a conflict (the operator wrote its status in
        between) read it again and retry, as a controller requeues."""
        for _ in range(20):
            job = self.custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
            patch = {"metadata": {"resourceVersion": job["metadata"]["resourceVersion"]}, **patch_for(job)}
            try:
                self.custom.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name, patch)
                return
            except ApiException as exc:
                if exc.status != 409:
                    raise
        raise RuntimeError(f"PyTorchJob {namespace}/{name}: 20 conflicts in a row")

    def admit(self, namespace: str, name: str, cluster_queue: str = "hyperpod-ns-team-a-clusterqueue") -> None:
        """The workload fits its ClusterQueue: the job is started, its pod templates carrying the admission."""
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

    def preempt(self, namespace: str, name: str) -> None:
        """A higher-priority workload needs the quota: the job is stopped (suspended) and its templates restored."""
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
