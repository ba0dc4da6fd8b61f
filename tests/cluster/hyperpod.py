"""HyperPod's job auto-restart for PyTorchJobs, played on the real API server: what is published, and one assumption.

Published:
- Its grants (aws/sagemaker-hyperpod-cli, ``helm_chart/HyperPodHelmChart/charts/job-auto-restart/templates/
  job-auto-restart-rbac.yaml``, ClusterRole ``job-auto-restart``): get, list, watch, delete, patch and update on
  ``pytorchjobs`` and ``pytorchjobs/status``; delete and deletecollection on pods; patch on nodes. No ``create`` on
  pytorchjobs: it brings a job back in place, never as a new object.
- What a person sees (AWS, "Running jobs using kubectl", "To check the job auto-resume status"): the same job, either
  with the operator's ``PyTorchJobRestarting`` event and its pods created again, or with its pods created again and
  no event; the pods wait (Pending) until the faulty node is replaced (awsome-distributed-training's resiliency
  guide). The watcher acts on jobs annotated ``sagemaker.amazonaws.com/enable-job-auto-resume: "true"``, at most
  ``sagemaker.amazonaws.com/job-max-retry-count`` times.

Not published: what it does with a job the Training Operator has already marked Failed (its backoff limit reached,
its pods deleted). This player takes the one course its grants allow that brings such a job back: after ``delay_s``
it updates the job's status, dropping the Failed condition and the completion time and adding Restarting (reason
``JobAutoResumed``: ours, the real one is not published); the operator then reconciles the job as unfinished and
creates its pods. A test that relies on it says so.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import kubernetes

from tests.cluster.controller import POLL_S, PolledController
from tests.cluster.training_operator import GROUP, PLURAL, VERSION, is_true, now

log = logging.getLogger(__name__)

AUTO_RESUME = "sagemaker.amazonaws.com/enable-job-auto-resume"
MAX_RETRY = "sagemaker.amazonaws.com/job-max-retry-count"


class JobAutoRestart(PolledController):
    """Brings the namespace's Failed auto-resume jobs back, ``delay_s`` after they failed, up to their max retries."""

    def __init__(
        self, admin: kubernetes.client.ApiClient, namespace: str, delay_s: float = 1.0, poll_s: float = POLL_S
    ):
        super().__init__(f"hyperpod-{namespace}", poll_s)
        self.custom = kubernetes.client.CustomObjectsApi(admin)
        self.namespace, self.delay_s = namespace, delay_s
        self.retries: dict[str, int] = {}  # job uid -> retries done
        self.failed_seen: dict[str, float] = {}  # job uid -> when its current failure was first seen
        self.start()

    def reconcile_all(self) -> None:
        response = self.custom.list_namespaced_custom_object(
            GROUP, VERSION, self.namespace, PLURAL, _preload_content=False
        )
        for job in json.loads(response.data)["items"]:
            self._reconcile(job)

    def _reconcile(self, job: dict[str, Any]) -> None:
        meta = job["metadata"]
        uid, annotations = meta["uid"], meta.get("annotations") or {}
        if annotations.get(AUTO_RESUME) != "true" or meta.get("deletionTimestamp") or not is_true(job, "Failed"):
            self.failed_seen.pop(uid, None)
            return
        first_seen = self.failed_seen.setdefault(uid, time.monotonic())
        if self.retries.get(uid, 0) >= int(annotations.get(MAX_RETRY, "1")):
            return
        if time.monotonic() - first_seen < self.delay_s:
            return
        status = json.loads(json.dumps(job["status"]))
        status["conditions"] = [c for c in status.get("conditions", []) if c["type"] not in ("Failed", "Restarting")]
        status["conditions"].append(
            {
                "type": "Restarting",
                "status": "True",
                "reason": "JobAutoResumed",
                "message": f"PyTorchJob {meta['name']} is restarted by job auto-resume.",
                "lastUpdateTime": now(),
                "lastTransitionTime": now(),
            }
        )
        status.pop("completionTime", None)
        self.custom.replace_namespaced_custom_object_status(
            GROUP, VERSION, self.namespace, PLURAL, meta["name"], {**job, "status": status}
        )
        self.retries[uid] = self.retries.get(uid, 0) + 1
        self.failed_seen.pop(uid, None)
        log.info("job auto-restart player: %s brought back (retry %d)", meta["name"], self.retries[uid])
