"""One test's part of the shared control plane: a namespace with deploy/rbac*.yaml in it, and the players in it: the
Training Operator for a PyTorchJob test, Kubeflow Trainer and JobSet (with the real Job controller) for a TrainJob
test, the SageMaker HyperPod training operator for a HyperPodPyTorchJob test, and the kubelet for each."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import threading
from pathlib import Path
from typing import Any

import kubernetes
import yaml
from kubernetes.client.exceptions import ApiException

from components.launch_training.apis import job_api
from components.launch_training.hyperpodpytorchjob import HYPERPODPYTORCHJOB
from components.launch_training.job_api import JobApi
from components.launch_training.manifest import GPU_TOLERATION, JobSpec
from components.launch_training.trainjob import TRAINJOB, render_runtime
from components.preflight.access import runtime_read
from pipelines.deploy.rbac import Subject, render, role_documents
from tests.cluster.control_plane import ControlPlane
from tests.cluster.hyperpod_training_operator import HyperPodTrainingOperator
from tests.cluster.jobset import JobSetController
from tests.cluster.kubeflow import EDITOR, make_profile
from tests.cluster.kubelet import Kubelet
from tests.cluster.kueue import Kueue
from tests.cluster.timelines import JobPlay, Timeline
from tests.cluster.trainer import TrainJobController
from tests.cluster.training_operator import TrainingOperator

RUNTIMES = "clustertrainingruntimes"

log = logging.getLogger(__name__)


def profile_namespace(plane: ControlPlane, api_name: str, cluster_read: bool = False) -> str:
    """A fresh Kubeflow profile (tests/cluster/kubeflow.py: Kubeflow's roles must be installed) whose default-editor
    the tests in it run as, granted what `render-rbac --kubeflow-profile [--cluster-read]` renders for it and nothing
    more."""
    profile = make_profile(plane, plane.namespace_name())
    rendered = render(Subject(profile.namespace, EDITOR), api_name, cluster_read=cluster_read, kubeflow_profile=True)
    made = []
    rbac = kubernetes.client.RbacAuthorizationV1Api(plane.admin)
    for doc in yaml.safe_load_all(rendered):
        if doc["kind"].endswith("Binding") and doc["metadata"].get("namespace") != profile.namespace:
            made.append(doc)  # named after the profile's account: removed with its namespace
        try:
            plane.apply(doc)
        except ApiException as exc:  # a role the runner's deploy/ files made already (the same rules)
            if exc.status != 409 or doc["kind"].endswith("Binding"):
                raise
            current = plane.admin.sanitize_for_serialization(
                rbac.read_cluster_role(doc["metadata"]["name"])
                if doc["kind"] == "ClusterRole"
                else rbac.read_namespaced_role(doc["metadata"]["name"], doc["metadata"]["namespace"])
            )
            assert current["rules"] == doc["rules"], f"{doc['metadata']['name']}: rendered unlike deploy/"
    plane.run_as(profile.namespace, profile.editor_token, made)
    return profile.namespace


class Cluster:
    """The job API's operator (``api``: pytorchjob, trainjob or hyperpodpytorchjob) and the kubelet played in a fresh
    namespace; ``timeline`` is played for each job created there. What went wrong inside a player is in
    :attr:`errors`.

    A TrainJob test gets its own ClusterTrainingRuntime (cluster-scoped, so named after the namespace), rendered by
    the launcher's own `render_runtime` with ``restart_budget`` as JobSet's maxRestarts: the real API server
    validates it against the v2.3.0 CRD when it is created."""

    def __init__(
        self,
        control_plane: ControlPlane,
        kueue: Kueue,
        workdir: Path,
        *,
        timeline: Timeline | None = None,
        serve_logs: bool = True,
        grants: list[dict[str, Any]] | None = None,
        api: str = "pytorchjob",
        restart_budget: int = 3,
        profile: bool = False,
        runtime_options: dict[str, Any] | None = None,
    ) -> None:
        self.control_plane, self.kueue = control_plane, kueue
        self.admin = control_plane.admin
        self.api: JobApi = job_api(api)
        self.namespace = profile_namespace(control_plane, api) if profile else control_plane.test_namespace(grants)
        self.timeline = timeline
        self.errors: list[str] = []
        self._closed = threading.Event()
        self.kubelet = Kubelet(self.admin, self.namespace, workdir, serve_logs=serve_logs)
        self.custom = kubernetes.client.CustomObjectsApi(self.admin)
        self.controllers: list[Any] = []
        self.runtime_name = ""
        self._runtime_read: list[dict[str, Any]] = []
        if self.api is TRAINJOB:
            self.runtime_name = f"hpp-{self.namespace}"
            self.custom.create_cluster_custom_object(
                TRAINJOB.group, TRAINJOB.version, RUNTIMES, self.runtime(restart_budget, **runtime_options or {})
            )
            if grants is None and not profile:  # deploy/rbac-trainjob.yaml's runtime read, for this runtime's name
                self._runtime_read = self._grant_runtime_read()
            self.controllers = [
                JobSetController(self.admin, self.namespace),
                TrainJobController(self.admin, self.namespace, on_created=self._play),
            ]
        elif self.api is HYPERPODPYTORCHJOB:
            self.controllers = [HyperPodTrainingOperator(self.admin, self.namespace, on_created=self._play)]
        else:
            self.controllers = [TrainingOperator(self.admin, self.namespace, on_created=self._play)]

    def _grant_runtime_read(self) -> list[dict[str, Any]]:
        """What `render-rbac --runtime-name <this runtime>` binds the runner to: a get of this runtime only."""
        name = f"hyperpod-pretrain-runtime-read-{self.namespace}"
        spec = dataclasses.replace(runtime_read(self.runtime_name), name=name)
        docs = [yaml.safe_load(text) for text in role_documents(spec, Subject())]
        for doc in docs:
            self.control_plane.apply(doc)
        return docs

    def runtime(self, restart_budget: int, **options: Any) -> dict[str, Any]:
        """Our ClusterTrainingRuntime as `hyperpod-pretrain render-runtime` makes it, named for this test; `options`:
        other platform settings it renders (grace_period_s, ttl_after_finished_s)."""
        spec = JobSpec(
            name=self.runtime_name,
            image="",
            trainer_args=[],
            job_api=TRAINJOB.name,
            runtime_name=self.runtime_name,
            restart_budget=restart_budget,
            tolerations=[GPU_TOLERATION],
            **options,
        )
        return render_runtime(spec)

    def close(self) -> None:
        self._closed.set()
        for controller in self.controllers:
            controller.stop()
        self.kubelet.stop()
        if self.runtime_name:
            with contextlib.suppress(ApiException):
                self.custom.delete_cluster_custom_object(TRAINJOB.group, TRAINJOB.version, RUNTIMES, self.runtime_name)
        rbac = kubernetes.client.RbacAuthorizationV1Api(self.admin)
        for doc in self._runtime_read:
            with contextlib.suppress(ApiException):
                if doc["kind"] == "ClusterRole":
                    rbac.delete_cluster_role(doc["metadata"]["name"])
                else:
                    rbac.delete_cluster_role_binding(doc["metadata"]["name"])
        # Pods left on the nodes would stay Terminating with no kubelet to end them, and the namespace with them
        # (the namespace controller retrying in the background for the rest of the session): ended at once.
        core = kubernetes.client.CoreV1Api(self.admin)
        with contextlib.suppress(ApiException):
            core.delete_collection_namespaced_pod(self.namespace, grace_period_seconds=0)
        self.control_plane.delete_namespace(self.namespace)
        self.errors += [e for controller in self.controllers for e in controller.errors]

    def _play(self, job: dict[str, Any]) -> None:
        name, uid = job["metadata"]["name"], job["metadata"]["uid"]
        timeline = self.timeline
        if timeline is None:
            return

        def gone() -> bool:
            """Closed, or the job deleted, replaced, or being deleted (its pods going: the timeline's writes to them
            may fail, as the real kubelet's would)."""
            current = self.job(name)
            return (
                self._closed.is_set()
                or current is None
                or current["metadata"]["uid"] != uid
                or bool(current["metadata"].get("deletionTimestamp"))
            )

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
        api = self.api
        try:
            return json.loads(
                self.custom.get_namespaced_custom_object(
                    api.group, api.version, self.namespace, api.plural, name, _preload_content=False
                ).data
            )
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def create_job(self, job: dict[str, Any]) -> dict[str, Any]:
        """A job created by someone else (as the admin)."""
        body = {**job, "metadata": {**job["metadata"], "namespace": self.namespace}}
        return self.custom.create_namespaced_custom_object(
            self.api.group, self.api.version, self.namespace, self.api.plural, body
        )

    def pods(self, job_name: str) -> list[dict[str, Any]]:
        core = kubernetes.client.CoreV1Api(self.admin)
        response = core.list_namespaced_pod(
            self.namespace, label_selector=self.api.pod_selector(job_name), _preload_content=False
        )
        return json.loads(response.data)["items"]

    def audit(self) -> list[dict[str, Any]]:
        """The requests of the runner (or the less-granted account) in this namespace (ResponseComplete events)."""
        return self.control_plane.audit_events(self.namespace)

    def requests(self, verb: str, resource: str, subresource: str = "") -> list[dict[str, Any]]:
        return [
            e
            for e in self.audit()
            if e["verb"] == verb
            and e["objectRef"].get("resource") == resource
            and e["objectRef"].get("subresource", "") == subresource
        ]
