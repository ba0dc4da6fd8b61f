"""The Kubeflow Trainer v2.3.0 and JobSet v0.12.0 players (tests/cluster/trainer/, jobset.py) and Kueue's TrainJob
integration (kueue.py) on the real API server, with the real Job controller and garbage collector. Each test names the
upstream behaviour it checks."""

from __future__ import annotations

import contextlib
import copy
import json
import re
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kubernetes
import pytest
import yaml
from kubernetes.client.exceptions import ApiException

from tests.cluster import jobset as jsp
from tests.cluster import trainer as tp
from tests.cluster.control_plane import TORCH_RUNTIME, ControlPlane, trainer_skip_reason
from tests.cluster.installed import Installed, unique_tag
from tests.cluster.kubelet import Kubelet

IMAGE = "public.ecr.aws/docker/library/python:3.11"


def wait_for(what: str, check: Callable[[], Any], timeout_s: float = 20) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if result := check():
                return result
        except ApiException as exc:  # not made yet
            if exc.status != 404:
                raise
        time.sleep(0.05)
    raise TimeoutError(f"{what}: not within {timeout_s:.0f}s")


@pytest.fixture(scope="module")
def plane(control_plane: ControlPlane) -> ControlPlane:
    if reason := trainer_skip_reason():
        pytest.skip(reason)
    return control_plane


def make_runtime(plane: ControlPlane, mutate: Callable[[dict[str, Any]], None] | None = None) -> str:
    """The default torch-distributed ClusterTrainingRuntime (v2.3.0) under a name of its own, applied as the admin."""
    runtime = yaml.safe_load(TORCH_RUNTIME.read_text())
    runtime["metadata"]["name"] = f"torch-distributed-{uuid.uuid4().hex[:6]}"
    if mutate is not None:
        mutate(runtime)
    custom = kubernetes.client.CustomObjectsApi(plane.admin)
    custom.create_cluster_custom_object(tp.GROUP, tp.VERSION, tp.CLUSTER_RUNTIMES, runtime)
    return runtime["metadata"]["name"]


@pytest.fixture(scope="module")
def runtime(plane: ControlPlane) -> str:
    return make_runtime(plane)


@pytest.fixture(scope="module")
def failing_runtime(plane: ControlPlane) -> str:
    """A runtime whose Jobs fail at the first container restart (backoffLimit 0) and whose JobSet restarts once."""

    def mutate(runtime: dict[str, Any]) -> None:
        spec = runtime["spec"]["template"]["spec"]
        spec["failurePolicy"] = {"maxRestarts": 1}
        spec["replicatedJobs"][0]["template"]["spec"]["backoffLimit"] = 0

    return make_runtime(plane, mutate)


@dataclass
class Namespace:
    plane: ControlPlane
    name: str
    kubelet: Kubelet
    jobsets: jsp.JobSetController
    trainer: tp.TrainJobController

    @property
    def custom(self) -> kubernetes.client.CustomObjectsApi:
        return kubernetes.client.CustomObjectsApi(self.plane.admin)

    @property
    def core(self) -> kubernetes.client.CoreV1Api:
        return kubernetes.client.CoreV1Api(self.plane.admin)

    def create(
        self,
        name: str,
        runtime: str,
        *,
        nodes: int = 2,
        env: list[dict[str, Any]] | None = None,
        labels: dict[str, str] | None = None,
        suspend: bool | None = None,
        pod_patch: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        body: dict[str, Any] = {
            "apiVersion": f"{tp.GROUP}/{tp.VERSION}",
            "kind": tp.KIND,
            "metadata": {"name": name, **({"labels": labels} if labels else {})},
            "spec": {
                "runtimeRef": {"name": runtime},
                "trainer": {
                    "image": IMAGE,
                    "command": ["torchrun", "train.py"],
                    "numNodes": nodes,
                    "env": env or [{"name": "RUN", "value": "one"}],
                },
            },
        }
        if suspend is not None:
            body["spec"]["suspend"] = suspend
        if pod_patch is not None:  # a runtime patch of the trainer's pods, as the launcher's
            body["spec"]["runtimePatches"] = [
                {
                    "manager": "example.com/test",
                    "trainingRuntimeSpec": {
                        "template": {
                            "spec": {
                                "replicatedJobs": [
                                    {"name": "node", "template": {"spec": {"template": {"spec": pod_patch}}}}
                                ]
                            }
                        }
                    },
                }
            ]
        return self.custom.create_namespaced_custom_object(tp.GROUP, tp.VERSION, self.name, tp.PLURAL, body)

    def get(self, plural: str, name: str, group: str = tp.GROUP, version: str = tp.VERSION) -> dict[str, Any] | None:
        try:
            return self.custom.get_namespaced_custom_object(group, version, self.name, plural, name)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def trainjob(self, name: str) -> dict[str, Any] | None:
        return self.get(tp.PLURAL, name)

    def jobset(self, name: str) -> dict[str, Any] | None:
        return self.get(jsp.PLURAL, name, jsp.GROUP, jsp.VERSION)

    def condition(self, name: str, kind: str) -> dict[str, Any] | None:
        trainjob = self.trainjob(name)
        return jsp.find_condition(trainjob, kind) if trainjob else None

    def jobs(self) -> list[dict[str, Any]]:
        batch = kubernetes.client.BatchV1Api(self.plane.admin)
        return json.loads(batch.list_namespaced_job(self.name, _preload_content=False).data)["items"]

    def pods(self, trainjob: str) -> dict[int, dict[str, Any]]:
        return tp.node_pods(self.core, self.name, trainjob)

    def start(self, trainjob: str, nodes: int, not_named: set[str] | frozenset[str] = frozenset()) -> list[str]:
        """Each node's pod (a new one, not in ``not_named``) scheduled and running; their names by rank."""
        names = [tp.wait_node_pod(self.core, self.name, trainjob, rank, not_named=not_named) for rank in range(nodes)]
        for pod in names:
            self.kubelet.start(pod)
        return names


@pytest.fixture
def ns(plane: ControlPlane, tmp_path: Path) -> Iterator[Namespace]:
    name = plane.test_namespace()
    kubelet = Kubelet(plane.admin, name, tmp_path)
    made = Namespace(
        plane, name, kubelet, jsp.JobSetController(plane.admin, name), tp.TrainJobController(plane.admin, name)
    )
    yield made
    made.trainer.stop()
    made.jobsets.stop()
    kubelet.stop()
    with contextlib.suppress(ApiException):  # pods left on the player's nodes: no kubelet would end them
        kubernetes.client.CoreV1Api(plane.admin).delete_collection_namespaced_pod(name, grace_period_seconds=0)
    plane.delete_namespace(name)
    assert not made.trainer.errors + made.jobsets.errors, made.trainer.errors + made.jobsets.errors


def test_webhook_refuses_reserved_env_and_missing_runtime(ns: Namespace, runtime: str) -> None:
    """``Torch.Validate`` (plugins/torch/torch.go) refuses torchrun's reserved env names in ``trainer.env``;
    ``ClusterTrainingRuntime.ValidateObjects`` (runtime/core/clustertrainingruntime.go) a runtime that does not exist;
    both as controller-runtime's Denied (403), as the API server words a webhook's denial."""
    with pytest.raises(ApiException) as refused:
        ns.create("reserved", runtime, env=[{"name": "PET_NNODES", "value": "4"}, {"name": "A", "value": "b"}])
    assert refused.value.status == 403
    message = json.loads(refused.value.body)["message"]
    assert message == (
        'admission webhook "validator.trainjob.trainer.kubeflow.org" denied the request: spec.trainer.env: Invalid '
        'value: []v1.EnvVar{v1.EnvVar{Name:"PET_NNODES", Value:"4", ValueFrom:(*v1.EnvVarSource)(nil)}, '
        'v1.EnvVar{Name:"A", Value:"b", ValueFrom:(*v1.EnvVarSource)(nil)}}: must not have reserved envs, invalid '
        "envs configured: [PET_NNODES]"
    )
    with pytest.raises(ApiException) as missing:
        ns.create("orphan", "no-such-runtime")
    assert missing.value.status == 403
    text = json.loads(missing.value.body)["message"]
    assert text.startswith(
        'admission webhook "validator.trainjob.trainer.kubeflow.org" denied the request: '
        "spec.RuntimeRef: Invalid value: v1alpha1.RuntimeRef{"
    )
    assert text.endswith(
        'clustertrainingruntimes.trainer.kubeflow.org "no-such-runtime" not found: specified '
        "clusterTrainingRuntime must be created before the TrainJob is created"
    )
    assert ns.trainjob("reserved") is None and ns.trainjob("orphan") is None


def test_jobset_jobs_pods_and_success(ns: Namespace, runtime: str) -> None:
    """``JobSet.Build`` / ``Torch.EnforceMLPolicy`` (Trainer): one JobSet named as the TrainJob, owned by it, the
    ``node`` replicatedJob with parallelism and completions from numNodes and the ``PET_*`` env; ``constructJob``
    (JobSet): the Job ``<jobset>-node-0`` with JobSet's labels and annotations, the headless Service; the real Job
    controller's pods ``<job>-<index>-<random>``; success (all pods exit 0) gives Completed on the JobSet
    (``AllJobsCompleted``) and Complete on the TrainJob, with the JobSet's reason and message."""
    trainjob = ns.create("tj", runtime, nodes=2)
    snapshot = wait_for("runtime snapshot", lambda: ns.core.read_namespaced_config_map("tj-runtime-snapshot", ns.name))
    assert snapshot.metadata.owner_references[0].uid == trainjob["metadata"]["uid"]
    jobset = wait_for("JobSet", lambda: ns.jobset("tj"))
    owner = jobset["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["name"], owner["controller"]) == ("TrainJob", "tj", True)
    assert jobset["spec"]["successPolicy"] == {"operator": "All"}  # JobSet's Default()
    rjob = jobset["spec"]["replicatedJobs"][0]
    assert (rjob["name"], rjob["replicas"]) == ("node", 1)
    assert (rjob["template"]["spec"]["parallelism"], rjob["template"]["spec"]["completions"]) == (2, 2)
    container = rjob["template"]["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == IMAGE and container["command"] == ["torchrun", "train.py"]
    assert container["env"] == [
        {"name": "RUN", "value": "one"},
        {"name": "PET_NNODES", "value": "2"},
        {"name": "PET_NPROC_PER_NODE", "value": "1"},
        {
            "name": "PET_NODE_RANK",
            "valueFrom": {
                "fieldRef": {  # no apiVersion: a CRD's template is not defaulted
                    "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"
                }
            },
        },
        {"name": "PET_MASTER_ADDR", "value": "tj-node-0-0.tj"},
        {"name": "PET_MASTER_PORT", "value": "29500"},
    ]
    assert container["ports"] == [{"containerPort": 29500, "protocol": "TCP"}]
    service = wait_for("headless Service", lambda: ns.core.read_namespaced_service("tj", ns.name))
    assert service.spec.cluster_ip == "None" and service.spec.selector == {jsp.JOBSET_NAME_KEY: "tj"}
    job = wait_for("Job", lambda: ns.jobs())[0]
    assert job["metadata"]["name"] == "tj-node-0"
    for key, value in {
        jsp.JOBSET_NAME_KEY: "tj",
        jsp.REPLICATED_JOB_NAME_KEY: "node",
        jsp.JOB_INDEX_KEY: "0",
        jsp.RESTARTS_KEY: "0",
        jsp.GLOBAL_REPLICAS_KEY: "1",
        jsp.GROUP_NAME_KEY: "default",
    }.items():
        assert job["metadata"]["labels"][key] == value == job["metadata"]["annotations"][key]
    names = ns.start("tj", 2)
    for rank, name in enumerate(names):
        assert re.fullmatch(rf"tj-node-0-{rank}-[a-z0-9]{{5}}", name), name
        pod = ns.kubelet.pod(name)
        assert pod["spec"]["hostname"] == f"tj-node-0-{rank}" and pod["spec"]["subdomain"] == "tj"
        assert pod["metadata"]["labels"][jsp.JOBSET_NAME_KEY] == "tj"
        assert pod["metadata"]["annotations"]["batch.kubernetes.io/job-completion-index"] == str(rank)
    wait_for(
        "jobsStatus ready",
        lambda: ((ns.trainjob("tj") or {}).get("status") or {}).get("jobsStatus", [{}])[0].get("ready") == 1,
    )
    for name in names:
        ns.kubelet.exit(name, 0)
    complete = wait_for("Complete", lambda: ns.condition("tj", tp.COMPLETE))
    assert (complete["status"], complete["reason"], complete["message"]) == (
        "True",
        "AllJobsCompleted",
        "jobset completed successfully",
    )
    assert ns.trainjob("tj")["status"]["jobsStatus"] == [
        {"name": "node", "ready": 0, "succeeded": 1, "failed": 0, "active": 0, "suspended": 0}
    ]
    assert jsp.find_condition(ns.jobset("tj"), jsp.COMPLETED)["status"] == "True"


def test_restart_then_failure_when_max_restarts_is_exhausted(ns: Namespace, failing_runtime: str) -> None:
    """``restartJobSetActionApplier`` (JobSet failure_policy.go): the first failed Job restarts the JobSet
    (``status.restarts`` 1, RestartingJobSet True, the Jobs of attempt 0 deleted in the foreground and made anew with
    ``restart-attempt: 1``, so every pod has a new name); once ``maxRestarts`` is used up, Failed
    ``ReachedMaxRestarts``, copied to the TrainJob. A Job fails when its pod's container restarts past backoffLimit 0
    (the real Job controller, which deletes the pods of a failed Job)."""
    ns.create("tj", failing_runtime, nodes=2)
    first = ns.start("tj", 2)
    ns.kubelet.exit(first[1], 1)  # OnFailure: the kubelet restarts it; the Job controller fails the Job
    restarted = wait_for("restart", lambda: (ns.jobset("tj") or {}).get("status", {}).get("restarts") == 1)
    assert restarted
    restarting = jsp.find_condition(ns.jobset("tj"), jsp.RESTARTING)
    assert restarting["reason"] == "DefaultFailurePolicy"
    assert restarting["message"] == "applying RestartJobSet failure policy action (first failed job: tj-node-0)"
    second = ns.start("tj", 2, not_named=set(first))
    assert not set(second) & set(first)
    job = wait_for("new Job", lambda: [j for j in ns.jobs() if j["metadata"]["labels"][jsp.RESTARTS_KEY] == "1"])[0]
    assert job["metadata"]["name"] == "tj-node-0"
    assert ns.kubelet.pod(second[0])["metadata"]["labels"][jsp.RESTARTS_KEY] == "1"
    ns.kubelet.exit(second[0], 1)
    failed = wait_for("Failed", lambda: ns.condition("tj", tp.FAILED))
    assert (failed["reason"], failed["message"]) == (
        "ReachedMaxRestarts",
        "jobset failed due to reaching max number of restarts (first failed job: tj-node-0)",
    )
    wait_for("pods of the failed Job deleted", lambda: not ns.pods("tj"))


def test_suspend_and_resume(ns: Namespace, runtime: str) -> None:
    """``spec.suspend`` passed down: Trainer re-applies the JobSet suspended (``Build``), JobSet suspends its Jobs
    (``suspendJobs``), the Job controller deletes their pods; Suspended True (``TrainJobSuspended``) on the TrainJob
    and ``SuspendedJobs`` on the JobSet. Resumed: the Jobs resumed (``resumeJob``), new pods, Suspended False
    (``Resumed`` / ``ResumeJobs``)."""
    ns.create("tj", runtime, nodes=2)
    first = ns.start("tj", 2)
    ns.custom.patch_namespaced_custom_object(
        tp.GROUP, tp.VERSION, ns.name, tp.PLURAL, "tj", {"spec": {"suspend": True}}
    )
    suspended = wait_for("Suspended", lambda: ns.condition("tj", tp.SUSPENDED))
    assert (suspended["status"], suspended["reason"], suspended["message"]) == (
        "True",
        "Suspended",
        "TrainJob is suspended",
    )
    wait_for("Jobs suspended", lambda: all(j["spec"].get("suspend") for j in ns.jobs()))
    wait_for("pods deleted", lambda: not ns.pods("tj"))
    wait_for("JobSet Suspended", lambda: jsp.condition_true(ns.jobset("tj") or {}, jsp.SUSPENDED_TYPE))
    ns.custom.patch_namespaced_custom_object(
        tp.GROUP, tp.VERSION, ns.name, tp.PLURAL, "tj", {"spec": {"suspend": False}}
    )
    second = ns.start("tj", 2, not_named=set(first))
    assert not set(second) & set(first)
    resumed = wait_for("resumed", lambda: (c := ns.condition("tj", tp.SUSPENDED)) and c["status"] == "False" and c)
    assert (resumed["reason"], resumed["message"]) == ("Resumed", "TrainJob is resumed")
    assert jsp.find_condition(ns.jobset("tj"), jsp.SUSPENDED_TYPE)["reason"] == "ResumeJobs"


def test_kueue_admits_and_preempts_a_trainjob(ns: Namespace, runtime: str) -> None:
    """Kueue v0.19.2's TrainJob integration: created suspended with its empty ``kueue.x-k8s.io/manager`` runtime patch
    (``TrainJobWebhook.Default``); admitted (``RunWithPodSetsInfo``) the patch carries the podset's labels, which
    reach the pods; preempted (``Stop``) the pods go and the patch is emptied again."""
    ns.create("tj", runtime, nodes=1, labels={"kueue.x-k8s.io/queue-name": "team-a"})
    trainjob = ns.trainjob("tj")
    assert trainjob["spec"]["suspend"] is True
    patch = next(p for p in trainjob["spec"]["runtimePatches"] if p["manager"] == "kueue.x-k8s.io/manager")
    assert patch["trainingRuntimeSpec"] == {"template": {"spec": {}}}
    wait_for("Suspended", lambda: ns.condition("tj", tp.SUSPENDED))
    ns.plane.kueue.admit(ns.name, "tj", cluster_queue="cq-a")
    (pod,) = ns.start("tj", 1)
    labels = ns.kubelet.pod(pod)["metadata"]["labels"]
    assert (labels["kueue.x-k8s.io/podset"], labels["kueue.x-k8s.io/cluster-queue-name"]) == ("node", "cq-a")
    ns.plane.kueue.preempt(ns.name, "tj")
    wait_for("pods deleted", lambda: not ns.pods("tj"))
    patch = next(p for p in ns.trainjob("tj")["spec"]["runtimePatches"] if p["manager"] == "kueue.x-k8s.io/manager")
    assert "replicatedJobs" not in patch["trainingRuntimeSpec"]["template"]["spec"]


def test_kueue_writes_back_what_trainer_v2_2_1_knows_and_jobsets_webhook_refuses_the_runtimes_grace_period(
    ns: Namespace, runtime: str
) -> None:
    """Kueue v0.19.2 (built on Trainer v2.2.1) admits with an ``Update`` of the TrainJob as v2.2.1 decodes it: the
    runtime patch's ``terminationGracePeriodSeconds`` (v2.3.0) is gone. Trainer re-applies the suspended JobSet with
    the runtime's grace period, which JobSet's ``ValidateUpdate`` refuses (422), again at every reconcile; Trainer
    records ``TrainJobResourcesCreationFailed`` (once, then one series update), the JobSet stays suspended, no pod."""
    ns.create(
        "tj",
        runtime,
        nodes=1,
        labels={"kueue.x-k8s.io/queue-name": "team-a"},
        pod_patch={"terminationGracePeriodSeconds": 77},
    )

    def pod() -> dict[str, Any]:
        jobset = ns.jobset("tj") or {"spec": {"replicatedJobs": [{"template": {"spec": {"template": {"spec": {}}}}}]}}
        return jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]

    wait_for(
        "the suspended JobSet with the patched grace period", lambda: pod().get("terminationGracePeriodSeconds") == 77
    )
    ns.plane.kueue.admit(ns.name, "tj", cluster_queue="cq-a")
    patches = ns.trainjob("tj")["spec"]["runtimePatches"]
    assert "terminationGracePeriodSeconds" not in json.dumps(patches), "dropped by the write-back"
    assert ns.trainjob("tj")["spec"]["suspend"] is False
    events = wait_for(
        "two failed reconciles' event",
        lambda: [
            e
            for e in ns.core.list_namespaced_event(ns.name, field_selector="involvedObject.name=tj").items
            if e.reason == "TrainJobResourcesCreationFailed" and e.series is not None
        ],
    )
    (event,) = events
    assert event.type == "Warning" and event.involved_object.kind == "TrainJob" and event.series.count == 2
    assert event.message.startswith(
        'TrainJob resources reconciliation failed: admission webhook "vjobset.kb.io" '
        'denied the request: JobSet.jobset.x-k8s.io "tj" is invalid: spec.replicatedJobs: '
        "Invalid value: "
    )
    assert event.message.endswith("field is immutable")
    time.sleep(1)
    assert len([m for m in ns.plane.jobset_webhook.denials if '"tj"' in m]) >= 3, "refused at every reconcile"
    assert ns.jobset("tj")["spec"]["suspend"] is True and pod()["terminationGracePeriodSeconds"] == 77
    assert not ns.pods("tj") and not tp.node_pods(ns.core, ns.name, "tj", True)


def test_jobsets_webhook_lets_a_suspended_jobsets_scheduling_fields_change_and_nothing_else() -> None:
    """``ValidateUpdate`` (JobSet v0.12.0): suspended (old or new), pod labels, annotations, nodeSelector,
    tolerations and schedulingGates may change; a grace period may not; running, not even a label."""
    pod = {"metadata": {"labels": {"a": "1"}}, "spec": {"terminationGracePeriodSeconds": 120, "containers": []}}
    old = {"spec": {"suspend": True, "replicatedJobs": [{"name": "node", "template": {"spec": {"template": pod}}}]}}

    def changed(suspend: bool, change: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
        new = copy.deepcopy({**old, "spec": {**old["spec"], "suspend": suspend}})
        change(new["spec"]["replicatedJobs"][0]["template"]["spec"]["template"])
        return new

    labels = lambda p: p["metadata"]["labels"].update(b="2")  # noqa: E731
    gates = lambda p: p["spec"].update(schedulingGates=[{"name": "g"}], tolerations=[{"key": "t"}])  # noqa: E731
    grace = lambda p: p["spec"].update(terminationGracePeriodSeconds=30)  # noqa: E731
    assert jsp.validate_update(old, changed(True, labels)) == []
    assert jsp.validate_update(old, changed(False, gates)) == [], "resumed in the same update: old was suspended"
    immutable = ["spec.replicatedJobs: Invalid value: []v1alpha2.ReplicatedJob{...}: field is immutable"]
    assert jsp.validate_update(old, changed(True, grace)) == immutable
    running = copy.deepcopy({**old, "spec": {**old["spec"], "suspend": False}})
    assert jsp.validate_update(running, changed(False, labels)) == immutable
    assert jsp.validate_update(running, changed(False, lambda p: p["spec"].update(containers=None))) == [], (
        "nil and empty are the same (Semantic.DeepEqual)"
    )


def test_a_failed_trainjob_runs_again_once_jobsets_ttl_removed_its_jobset(ns: Namespace, plane: ControlPlane) -> None:
    """JobSet's ``executeTTLAfterFinishedPolicy`` deletes a finished JobSet ``ttlSecondsAfterFinished`` after it
    finished; Trainer v2.3.0's ``Reconcile`` clears Failed (``removeFailedCondition``) before ``IsTrainJobFinished``
    and, the JobSet gone, builds a new one: the run starts again (kubeflow/trainer#3779)."""

    def mutate(runtime: dict[str, Any]) -> None:
        spec = runtime["spec"]["template"]["spec"]
        spec["failurePolicy"] = {"maxRestarts": 0}
        spec["ttlSecondsAfterFinished"] = 1
        spec["replicatedJobs"][0]["template"]["spec"]["backoffLimit"] = 0

    ns.create("tj", make_runtime(plane, mutate), nodes=1)
    (first,) = ns.start("tj", 1)
    old = ns.jobset("tj")["metadata"]["uid"]
    ns.kubelet.exit(first, 1)
    wait_for("Failed", lambda: ns.condition("tj", tp.FAILED))
    again = wait_for(
        "a new JobSet", lambda: (js := ns.jobset("tj")) and js["metadata"]["uid"] != old and js, timeout_s=15
    )
    assert not jsp.condition_true(again, jsp.FAILED)
    wait_for("a new pod", lambda: ns.pods("tj").get(0, {}).get("metadata", {}).get("name") not in (None, first))


def test_trainer_v2_3_0_builds_a_new_jobset_for_a_trainjob_being_deleted(ns: Namespace, runtime: str) -> None:
    """``Reconcile`` never reads ``deletionTimestamp``: a TrainJob held while being deleted (here by a finalizer, as a
    foreground deletion's holds it) whose JobSet is gone gets a new JobSet (JobSet fixed the same for itself in
    kubernetes-sigs/jobset#561)."""
    ns.create("tj", runtime, nodes=1)
    first = wait_for("JobSet", lambda: ns.jobset("tj"))["metadata"]["uid"]
    hold = {"metadata": {"finalizers": ["example.com/hold"]}}
    ns.custom.patch_namespaced_custom_object(tp.GROUP, tp.VERSION, ns.name, tp.PLURAL, "tj", hold)
    ns.custom.delete_namespaced_custom_object(tp.GROUP, tp.VERSION, ns.name, tp.PLURAL, "tj")
    ns.custom.delete_namespaced_custom_object(jsp.GROUP, jsp.VERSION, ns.name, jsp.PLURAL, "tj")
    try:
        wait_for("a new JobSet", lambda: (js := ns.jobset("tj")) and js["metadata"]["uid"] != first)
    finally:
        ns.custom.patch_namespaced_custom_object(
            tp.GROUP, tp.VERSION, ns.name, tp.PLURAL, "tj", {"metadata": {"finalizers": None}}
        )


def test_foreground_deletion_takes_jobset_jobs_and_pods_first(
    ns: Namespace, runtime: str, garbage_collector: None
) -> None:
    """A TrainJob deleted with propagationPolicy Foreground (the real garbage collector): it stays with the
    ``foregroundDeletion`` finalizer until its JobSet, the JobSet's Jobs and their pods are gone; a JobSet Trainer
    made again meanwhile (the test below) is collected after it, its owner gone."""
    ns.create("tj", runtime, nodes=2)
    ns.start("tj", 2)
    ns.custom.delete_namespaced_custom_object(
        tp.GROUP, tp.VERSION, ns.name, tp.PLURAL, "tj", propagation_policy="Foreground"
    )
    held = ns.trainjob("tj")
    assert held is not None and "foregroundDeletion" in held["metadata"]["finalizers"]
    wait_for("TrainJob gone", lambda: ns.trainjob("tj") is None, timeout_s=30)
    wait_for(
        "JobSet, Jobs and pods gone",
        lambda: ns.jobset("tj") is None and not ns.jobs() and not tp.node_pods(ns.core, ns.name, "tj", True),
        timeout_s=30,
    )


def test_strategic_merge_of_a_runtime_patch() -> None:
    """``mergeRuntimePatches`` (runtime/core/trainingruntime.go): replicatedJobs and containers merged by name, maps
    merged, tolerations replaced."""
    spec = {
        "replicatedJobs": [
            {
                "name": "node",
                "template": {
                    "spec": {
                        "template": {
                            "metadata": {"labels": {"a": "1"}},
                            "spec": {"containers": [{"name": "node", "image": "x"}], "tolerations": [{"key": "t"}]},
                        }
                    }
                },
            }
        ]
    }
    patch = {
        "replicatedJobs": [
            {
                "name": "node",
                "template": {
                    "spec": {
                        "template": {
                            "metadata": {"labels": {"b": "2"}},
                            "spec": {
                                "containers": [{"name": "node", "env": [{"name": "E", "value": "v"}]}],
                                "tolerations": [{"key": "u"}],
                            },
                        }
                    }
                },
            }
        ]
    }
    merged = tp.strategic_merge(copy.deepcopy(spec), patch)
    pod = merged["replicatedJobs"][0]["template"]["spec"]["template"]
    assert pod["metadata"]["labels"] == {"a": "1", "b": "2"}
    assert pod["spec"]["containers"] == [{"name": "node", "image": "x", "env": [{"name": "E", "value": "v"}]}]
    assert pod["spec"]["tolerations"] == [{"key": "u"}]


def test_trainer_install_as_a_client_sees_it(plane: ControlPlane) -> None:
    """What kubeflow/trainer v2.3.0 ``manifests/overlays/manager`` installs that a client can read: the controller
    manager's Deployment (labels, image) and the ``kubeflow-trainer-public`` ConfigMap naming the release; JobSet's
    controller manager beside it."""
    installed = Installed(plane, unique_tag())
    try:
        installed.add_trainer()
        apps, core = kubernetes.client.AppsV1Api(plane.admin), kubernetes.client.CoreV1Api(plane.admin)
        deployment = apps.read_namespaced_deployment("kubeflow-trainer-controller-manager", "kubeflow-system")
        assert deployment.metadata.labels["app.kubernetes.io/name"] == "trainer"
        assert deployment.spec.template.spec.containers[0].image == (
            "ghcr.io/kubeflow/trainer/trainer-controller-manager:v2.3.0"
        )
        assert core.read_namespaced_config_map("kubeflow-trainer-public", "kubeflow-system").data == {
            "kubeflow_trainer_version": "v2.3.0"
        }
        jobset = apps.read_namespaced_deployment("jobset-controller-manager", "kubeflow-system")
        assert jobset.spec.template.spec.containers[0].image == "registry.k8s.io/jobset/jobset:v0.12.0"
    finally:
        installed.close()
