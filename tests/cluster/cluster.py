"""One test's part of the shared control plane: a namespace with deploy/rbac.yaml in it, and the players in it."""

from __future__ import annotations

import contextlib
import json
import logging
import threading
from pathlib import Path
from typing import Any

import kubernetes
from kubernetes.client.exceptions import ApiException

from tests.cluster.control_plane import ControlPlane
from tests.cluster.kubelet import Kubelet
from tests.cluster.kueue import Kueue
from tests.cluster.timelines import JobPlay, Timeline
from tests.cluster.training_operator import GROUP, JOB_NAME_LABEL, PLURAL, VERSION, TrainingOperator

log = logging.getLogger(__name__)


class Cluster:
    """The Training Operator and the kubelet played in a fresh namespace; ``timeline`` is played for each job created
    there. What went wrong inside a player is in :attr:`errors`."""

    def __init__(self, control_plane: ControlPlane, kueue: Kueue, workdir: Path, *, timeline: Timeline | None = None,
                 serve_logs: bool = True, grants: list[dict[str, Any]] | None = None):  # fmt: skip
        self.control_plane, self.kueue = control_plane, kueue
        self.admin = control_plane.admin
        self.namespace = control_plane.test_namespace(grants)
        self.timeline = timeline
        self.errors: list[str] = []
        self._closed = threading.Event()
        self.kubelet = Kubelet(self.admin, self.namespace, workdir, serve_logs=serve_logs)
        self.operator = TrainingOperator(self.admin, self.namespace, on_created=self._play)

    def close(self) -> None:
        self._closed.set()
        self.operator.stop()
        self.kubelet.stop()
        # Pods left on the nodes would stay Terminating with no kubelet to end them, and the namespace with them
        # (the namespace controller retrying in the background for the rest of the session): ended at once.
        core = kubernetes.client.CoreV1Api(self.admin)
        with contextlib.suppress(ApiException):
            core.delete_collection_namespaced_pod(self.namespace, grace_period_seconds=0)
        self.control_plane.delete_namespace(self.namespace)
        self.errors += self.operator.errors

    def _play(self, job: dict[str, Any]) -> None:
        name, uid = job["metadata"]["name"], job["metadata"]["uid"]
        timeline = self.timeline
        if timeline is None:
            return

        def gone() -> bool:
            current = self.job(name)
            return self._closed.is_set() or current is None or current["metadata"]["uid"] != uid

        try:
            timeline.play(JobPlay(self, name), self._closed, gone)
        except Exception as exc:  # noqa: BLE001 (a test reads it from errors)
            if not gone():
                log.exception("timeline of %s", name)
                self.errors.append(f"timeline of {name}: {exc!r}")

    # -- clients and reads ------------------------------------------------------------------------------------

    def runner(self, host: str = "") -> kubernetes.client.ApiClient:
        """The pipeline runner's client (its service-account token; only deploy/rbac*.yaml grant it anything), or the
        less-granted account's where the cluster was made with ``grants``."""
        return self.control_plane.runner_client(host, self.namespace)

    def job(self, name: str) -> dict[str, Any] | None:
        api = kubernetes.client.CustomObjectsApi(self.admin)
        try:
            return json.loads(api.get_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, name,
                                                               _preload_content=False).data)  # fmt: skip
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def create_job(self, job: dict[str, Any]) -> dict[str, Any]:
        """A job created by someone else (as the admin)."""
        api = kubernetes.client.CustomObjectsApi(self.admin)
        body = {**job, "metadata": {**job["metadata"], "namespace": self.namespace}}
        return api.create_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, body)

    def pods(self, job_name: str) -> list[dict[str, Any]]:
        core = kubernetes.client.CoreV1Api(self.admin)
        response = core.list_namespaced_pod(self.namespace, label_selector=f"{JOB_NAME_LABEL}={job_name}",
                                            _preload_content=False)  # fmt: skip
        return json.loads(response.data)["items"]

    def audit(self) -> list[dict[str, Any]]:
        """The requests of the runner (or the less-granted account) in this namespace (ResponseComplete events)."""
        return self.control_plane.audit_events(self.namespace)

    def requests(self, verb: str, resource: str, subresource: str = "") -> list[dict[str, Any]]:
        return [e for e in self.audit() if e["verb"] == verb and e["objectRef"].get("resource") == resource
                and e["objectRef"].get("subresource", "") == subresource]  # fmt: skip
