"""The fake Kubernetes API server (tests/k8s_server.py), driven through the official kubernetes client."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import kubernetes
import pytest
import urllib3
from kubernetes.client.rest import ApiException

from tests.k8s_server import (
    CRD_PATH,
    INSUFFICIENT_GPU,
    FakeKubernetes,
    Lifecycle,
    load_crd,
    load_crd_schema,
    unknown_fields,
)

NS = "team-a"
GROUP, VERSION, PLURAL = "kubeflow.org", "v1", "pytorchjobs"
TIMESTAMPED = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{9}Z (.*)$")

pytestmark = pytest.mark.skipif(
    not CRD_PATH.exists(),
    reason=f"the PyTorchJob CRD is not at {CRD_PATH} (the ../shared reference checkout is missing)",
)


def job_body(name: str, **spec_overrides: Any) -> dict[str, Any]:
    """A small valid PyTorchJob."""
    spec: dict[str, Any] = {
        "runPolicy": {"cleanPodPolicy": "None", "backoffLimit": 0},
        "pytorchReplicaSpecs": {
            "Worker": {
                "replicas": 2,
                "restartPolicy": "OnFailure",
                "template": {
                    "metadata": {"annotations": {"sidecar.istio.io/inject": "false"}},
                    "spec": {"containers": [{"name": "pytorch", "image": "trainer:1"}]},
                },
            }
        },
    }
    spec.update(spec_overrides)
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "PyTorchJob", "metadata": {"name": name}, "spec": spec}


def wait_for(predicate: Callable[[], Any], timeout: float = 5.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.01)
    raise AssertionError("timed out waiting")


def conditions(job: dict[str, Any] | None) -> dict[str, str]:
    return {c["type"]: c["status"] for c in ((job or {}).get("status") or {}).get("conditions", [])}


@pytest.fixture
def server() -> Iterator[FakeKubernetes]:
    with FakeKubernetes(CRD_PATH) as fake:
        yield fake


@pytest.fixture
def api_client(server: FakeKubernetes) -> Iterator[Any]:
    client = kubernetes.client.ApiClient(server.client_configuration())
    yield client
    client.close()


@pytest.fixture
def crs(api_client: Any) -> Any:
    return kubernetes.client.CustomObjectsApi(api_client)


@pytest.fixture
def core(api_client: Any) -> Any:
    return kubernetes.client.CoreV1Api(api_client)


def test_create_get_list_delete(server: FakeKubernetes, crs: Any) -> None:
    created = crs.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, job_body("job-a"))
    meta = created["metadata"]
    assert meta["namespace"] == NS and meta["uid"] and meta["generation"] == 1
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", meta["creationTimestamp"])
    assert created["spec"]["runPolicy"]["suspend"] is False  # the schema's default, applied by the server
    assert crs.get_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, "job-a")["metadata"]["uid"] == meta["uid"]

    listed = crs.list_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, field_selector="metadata.name=job-a")
    assert listed["kind"] == "PyTorchJobList" and listed["apiVersion"] == "kubeflow.org/v1"
    assert [item["metadata"]["name"] for item in listed["items"]] == ["job-a"]
    assert int(listed["metadata"]["resourceVersion"]) >= int(meta["resourceVersion"])
    assert (
        crs.list_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, field_selector="metadata.name=other")["items"]
        == []
    )

    options = kubernetes.client.V1DeleteOptions(propagation_policy="Foreground")
    deleting = crs.delete_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, "job-a", body=options)
    assert deleting["metadata"]["deletionTimestamp"] and "foregroundDeletion" in deleting["metadata"]["finalizers"]
    assert server.deletions == [(NS, "job-a", "Foreground")]

    def gone() -> bool:
        try:
            crs.get_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, "job-a")
        except ApiException as error:
            assert error.status == 404
            body = json.loads(error.body)
            assert body["kind"] == "Status" and body["reason"] == "NotFound"
            assert body["message"] == 'pytorchjobs.kubeflow.org "job-a" not found'
            return True
        return False

    wait_for(gone)
    with pytest.raises(ApiException) as error:
        crs.delete_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, "job-a", body=options)
    assert error.value.status == 404
    assert ("POST", f"/apis/kubeflow.org/v1/namespaces/{NS}/pytorchjobs") in server.requests


def test_duplicate_create_is_409(server: FakeKubernetes, crs: Any) -> None:
    server.put_job({**job_body("job-b"), "metadata": {"name": "job-b", "namespace": NS}})
    with pytest.raises(ApiException) as error:
        crs.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, job_body("job-b"))
    body = json.loads(error.value.body)
    assert error.value.status == 409 and body["reason"] == "AlreadyExists" and body["code"] == 409
    assert body["message"] == 'pytorchjobs.kubeflow.org "job-b" already exists'


def test_schema_invalid_body_is_422(server: FakeKubernetes, crs: Any) -> None:
    body = job_body("job-c")
    body["spec"]["runPolicy"]["backoffLimit"] = "x"
    with pytest.raises(ApiException) as error:
        crs.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, body)
    status = json.loads(error.value.body)
    assert error.value.status == 422
    assert {k: status[k] for k in ("kind", "apiVersion", "status", "reason", "code")} == {
        "kind": "Status",
        "apiVersion": "v1",
        "status": "Failure",
        "reason": "Invalid",
        "code": 422,
    }
    assert status["message"].startswith('PyTorchJob.kubeflow.org "job-c" is invalid: spec.runPolicy.backoffLimit')
    assert status["details"]["causes"][0]["field"] == "spec.runPolicy.backoffLimit"
    assert any(e.startswith("spec.runPolicy.backoffLimit: Invalid value") for e in server.validation_errors)
    assert server.job(NS, "job-c") is None


def test_unknown_fields_are_pruned_and_reported(server: FakeKubernetes, crs: Any) -> None:
    body = job_body("job-d")
    body["spec"]["cleanPodPolicy"] = "None"  # belongs under spec.runPolicy: the old KFP launcher's bug
    assert unknown_fields(body, load_crd_schema(CRD_PATH)) == ["spec.cleanPodPolicy"]
    created = crs.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, body)
    assert server.pruned_fields == ["spec.cleanPodPolicy"]
    assert "cleanPodPolicy" not in created["spec"] and "cleanPodPolicy" not in server.job(NS, "job-d")["spec"]
    assert server.warnings == ['unknown field "spec.cleanPodPolicy"']


def test_watch_sees_a_successful_job(server: FakeKubernetes, crs: Any) -> None:
    server.lifecycle = Lifecycle.success(workers=2, log_lines=["step 10 loss 4.2"], tick_s=0.02)
    rv = crs.list_namespaced_custom_object(GROUP, VERSION, NS, PLURAL)["metadata"]["resourceVersion"]
    crs.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, job_body("job-e"))
    seen: list[tuple[str, dict[str, str]]] = []
    watch = kubernetes.watch.Watch()
    for event in watch.stream(
        crs.list_namespaced_custom_object,
        GROUP,
        VERSION,
        NS,
        PLURAL,
        field_selector="metadata.name=job-e",
        resource_version=rv,
        timeout_seconds=10,
    ):
        seen.append((event["type"], conditions(event["object"])))
        if conditions(event["object"]).get("Succeeded") == "True":
            watch.stop()
    assert seen[0] == ("ADDED", {})
    assert {t for t, _ in seen[1:]} == {"MODIFIED"}
    assert seen[-1][1] == {"Created": "True", "Running": "False", "Succeeded": "True"}
    assert any(c.get("Running") == "True" for _, c in seen)
    status = server.job(NS, "job-e")["status"]
    assert status["replicaStatuses"]["Worker"]["succeeded"] == 2 and status["completionTime"]
    assert any("watch=True" in path and "resourceVersion=" in path for _, path in server.requests)


def test_watch_from_a_compacted_resource_version_gets_410(server: FakeKubernetes, crs: Any) -> None:
    created = crs.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, job_body("job-f"))
    server.put_job({**job_body("job-g"), "metadata": {"name": "job-g", "namespace": NS}})
    server.compact()
    watch = kubernetes.watch.Watch()
    with pytest.raises(ApiException) as error:
        for _ in watch.stream(
            crs.list_namespaced_custom_object,
            GROUP,
            VERSION,
            NS,
            PLURAL,
            resource_version=created["metadata"]["resourceVersion"],
            timeout_seconds=2,
        ):
            pass
    assert error.value.status == 410 and error.value.reason.startswith("Expired: too old resource version:")


def test_pods_logs_and_follow(server: FakeKubernetes, crs: Any, core: Any) -> None:
    lines = ["step 10 loss 4.2", "step 20 loss 3.1", "step 30 loss 2.5"]
    server.lifecycle = Lifecycle.success(workers=2, log_lines=lines, tick_s=0.05)
    crs.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, job_body("job-h"))
    selector = "training.kubeflow.org/job-name=job-h"

    def running() -> bool:
        pods = core.list_namespaced_pod(NS, label_selector=selector).items
        return len(pods) == 2 and all(p.status.phase == "Running" for p in pods)

    wait_for(running)
    resp = core.read_namespaced_pod_log(
        "job-h-worker-0", NS, container="pytorch", follow=True, timestamps=True, _preload_content=False
    )
    got = resp.read().decode().splitlines()  # the stream ends when the container terminates
    resp.release_conn()
    assert [TIMESTAMPED.match(line).group(1) for line in got] == lines

    pods = core.list_namespaced_pod(NS, label_selector=f"{selector},training.kubeflow.org/replica-type=worker")
    assert sorted(p.metadata.name for p in pods.items) == ["job-h-worker-0", "job-h-worker-1"]
    pod = pods.items[0]
    assert pod.metadata.labels["training.kubeflow.org/replica-index"] == "0"
    assert pod.status.phase == "Succeeded"
    assert pod.status.container_statuses[0].state.terminated.exit_code == 0
    plain = core.read_namespaced_pod_log("job-h-worker-1", NS, container="pytorch", tail_lines=1)
    assert plain == "step 30 loss 2.5\n"


def test_log_of_a_pending_pod_is_400(server: FakeKubernetes, crs: Any, core: Any) -> None:
    server.lifecycles["job-i"] = Lifecycle([(0.0, lambda job: job.create_pods(1))])
    crs.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, job_body("job-i"))
    wait_for(lambda: server.pods(NS, "job-i"))
    with pytest.raises(ApiException) as error:
        core.read_namespaced_pod_log("job-i-worker-0", NS, container="pytorch", follow=True)
    assert error.value.status == 400
    assert json.loads(error.value.body)["message"] == (
        'container "pytorch" in pod "job-i-worker-0" is waiting to start: ContainerCreating'
    )


def test_failure_lifecycle(server: FakeKubernetes, crs: Any, core: Any) -> None:
    server.lifecycle = Lifecycle.failure(workers=2, reason="PyTorchJobFailed", message="worker 1 died", tick_s=0.02)
    crs.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, job_body("job-j"))
    job = wait_for(lambda: (j := server.job(NS, "job-j")) and conditions(j).get("Failed") == "True" and j)
    failed = [c for c in job["status"]["conditions"] if c["type"] == "Failed"][0]
    assert (failed["reason"], failed["message"]) == ("PyTorchJobFailed", "worker 1 died")
    pod = core.read_namespaced_pod("job-j-worker-1", NS)
    assert pod.status.phase == "Failed" and pod.status.container_statuses[0].state.terminated.exit_code == 1
    events = core.list_namespaced_event(NS, field_selector="involvedObject.name=job-j-worker-1").items
    assert "BackOff" in {e.reason for e in events}


def test_faults(server: FakeKubernetes, crs: Any, core: Any) -> None:
    server.faults.fail_next("POST", r"/pytorchjobs$", 500)
    with pytest.raises(ApiException) as error:
        crs.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, job_body("job-m"))
    assert error.value.status == 500 and json.loads(error.value.body)["reason"] == "InternalError"

    server.faults.drop_next("POST", r"/pytorchjobs$")
    with pytest.raises(urllib3.exceptions.ProtocolError):
        crs.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, job_body("job-m"))
    crs.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, job_body("job-m"))

    # urllib3 retries a GET answered 429 with Retry-After on its own: the client sees only the second answer.
    server.faults.fail_next("GET", r"/pytorchjobs/job-m$", 429)
    before = len(server.requests)
    assert crs.get_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, "job-m")["metadata"]["name"] == "job-m"
    assert len(server.requests) - before == 2

    server.faults.drop_watch_after(1)
    with pytest.raises(urllib3.exceptions.ProtocolError):
        for _ in kubernetes.watch.Watch().stream(
            crs.list_namespaced_custom_object, GROUP, VERSION, NS, PLURAL, timeout_seconds=2
        ):
            pass
    assert server.faults.rules == []


# ----------------------------------------------------------------------------------------------------------------------
# What a preflight check reads: nodes, pods on nodes, PVCs, DaemonSets, Deployments, CRDs, access reviews


@pytest.fixture
def apps(api_client: Any) -> Any:
    return kubernetes.client.AppsV1Api(api_client)


@pytest.fixture
def apiext(api_client: Any) -> Any:
    return kubernetes.client.ApiextensionsV1Api(api_client)


@pytest.fixture
def authz(api_client: Any) -> Any:
    return kubernetes.client.AuthorizationV1Api(api_client)


def pod_when(core: Any, name: str, predicate: Callable[[Any], Any]) -> Any:
    """The pod, read through the client, once ``predicate(pod)`` holds (it may not exist yet)."""

    def check() -> Any:
        try:
            pod = core.read_namespaced_pod(name, NS)
        except ApiException as error:
            if error.status == 404:
                return None
            raise
        return predicate(pod) and pod

    return wait_for(check)


def waiting_reason(pod: Any) -> str | None:
    statuses = pod.status.container_statuses or []
    waiting = statuses[0].state.waiting if statuses else None
    return waiting.reason if waiting else None


def status_of(error: pytest.ExceptionInfo[ApiException]) -> dict[str, Any]:
    body = json.loads(error.value.body)
    assert body["kind"] == "Status" and body["status"] == "Failure" and body["code"] == error.value.status
    return body


def review(authz: Any, verb: str, resource: str, group: str = "", namespace: str = "", **extra: str) -> Any:
    attrs = kubernetes.client.V1ResourceAttributes(
        verb=verb, resource=resource, group=group, namespace=namespace or None, **extra
    )
    body = kubernetes.client.V1SelfSubjectAccessReview(
        spec=kubernetes.client.V1SelfSubjectAccessReviewSpec(resource_attributes=attrs)
    )
    return authz.create_self_subject_access_review(body).status


def test_nodes_list_get_and_selectors(server: FakeKubernetes, core: Any) -> None:
    server.add_node("hyperpod-i-0a", deep_health_check="Passed")
    server.add_node("hyperpod-i-0b", allocatable={"cpu": "192", "memory": "2063937952Ki", "nvidia.com/gpu": "8"})
    server.add_node("hyperpod-i-0c", health_status="UnschedulablePendingReplacement", unschedulable=True, ready=False)
    server.add_node("cpu-1", instance_type="ml.m5.2xlarge", health_status=None, taints=["dedicated=system:NoSchedule"])

    nodes = core.list_node().items
    assert [n.metadata.name for n in nodes] == ["cpu-1", "hyperpod-i-0a", "hyperpod-i-0b", "hyperpod-i-0c"]
    a = core.read_node("hyperpod-i-0a")
    assert a.metadata.labels["kubernetes.io/hostname"] == "hyperpod-i-0a"
    assert a.metadata.labels["node.kubernetes.io/instance-type"] == "ml.p5.48xlarge"
    assert a.metadata.labels["sagemaker.amazonaws.com/node-health-status"] == "Schedulable"
    assert a.metadata.labels["sagemaker.amazonaws.com/deep-health-check-status"] == "Passed"
    assert a.status.allocatable == {
        "cpu": "192",
        "memory": "2063937952Ki",
        "nvidia.com/gpu": "8",
        "vpc.amazonaws.com/efa": "32",
        "pods": "110",
    }
    assert a.status.capacity == a.status.allocatable
    assert {c.type: c.status for c in a.status.conditions}["Ready"] == "True"
    assert a.spec.taints is None and a.spec.unschedulable is None and a.status.node_info.kubelet_version
    b = core.read_node("hyperpod-i-0b")
    assert "vpc.amazonaws.com/efa" not in b.status.allocatable
    c = core.read_node("hyperpod-i-0c")
    assert c.spec.unschedulable is True
    assert {c.type: (c.status, c.reason) for c in c.status.conditions}["Ready"] == ("False", "KubeletNotReady")
    assert {(t.key, t.effect) for t in c.spec.taints} == {
        ("node.kubernetes.io/unschedulable", "NoSchedule"),
        ("node.kubernetes.io/not-ready", "NoSchedule"),
        ("node.kubernetes.io/not-ready", "NoExecute"),
    }
    cpu = core.read_node("cpu-1")
    assert "sagemaker.amazonaws.com/node-health-status" not in cpu.metadata.labels
    assert [(t.key, t.value, t.effect) for t in cpu.spec.taints] == [("dedicated", "system", "NoSchedule")]

    healthy = core.list_node(label_selector="sagemaker.amazonaws.com/node-health-status=Schedulable").items
    assert [n.metadata.name for n in healthy] == ["hyperpod-i-0a", "hyperpod-i-0b"]
    p5 = core.list_node(label_selector="node.kubernetes.io/instance-type in (ml.p5.48xlarge,ml.p5en.48xlarge)")
    assert len(p5.items) == 3
    schedulable = core.list_node(field_selector="spec.unschedulable=false").items  # a left-out field is false
    assert [n.metadata.name for n in schedulable] == ["cpu-1", "hyperpod-i-0a", "hyperpod-i-0b"]
    assert [n.metadata.name for n in core.list_node(field_selector="metadata.name=cpu-1").items] == ["cpu-1"]
    with pytest.raises(ApiException) as error:
        core.list_node(field_selector="status.phase=Running")
    assert error.value.status == 400 and status_of(error)["message"] == "field label not supported: status.phase"

    with pytest.raises(ApiException) as error:
        core.read_node("nope")
    body = status_of(error)
    assert error.value.status == 404 and body["reason"] == "NotFound"
    assert body["message"] == 'nodes "nope" not found' and body["details"] == {"name": "nope", "kind": "nodes"}
    with pytest.raises(ApiException) as error:  # nodes are cluster-scoped
        core.api_client.call_api("/api/v1/namespaces/default/nodes", "GET", _preload_content=False)
    assert error.value.status == 404

    # a watch sees a node turn unhealthy
    rv = core.list_node().metadata.resource_version
    server.update_node(
        "hyperpod-i-0b",
        lambda n: n["metadata"]["labels"].update({"sagemaker.amazonaws.com/node-health-status": "Unschedulable"}),
    )
    watch = kubernetes.watch.Watch()
    events = [
        (e["type"], e["object"].metadata.name)
        for e in watch.stream(core.list_node, resource_version=rv, timeout_seconds=1)
    ]
    assert events == [("MODIFIED", "hyperpod-i-0b")]


def test_pods_on_nodes_across_namespaces(server: FakeKubernetes, core: Any) -> None:
    gpu8 = {"cpu": "90", "memory": "1000Gi", "nvidia.com/gpu": "8", "vpc.amazonaws.com/efa": "32"}
    server.add_node("node-a")
    server.add_node("node-b")
    server.add_pod("team-b", "big-train-0", node_name="node-a", requests=gpu8, limits=gpu8)
    server.add_pod("kube-system", "aws-node-x", node_name="node-a", requests={"cpu": "25m"})
    server.add_pod("team-b", "done", node_name="node-a", phase="Succeeded", requests=gpu8)
    server.add_pod("team-b", "crashed", node_name="node-a", phase="Failed", requests=gpu8)
    server.add_pod("team-c", "starting", node_name="node-b", phase="Pending", requests={"nvidia.com/gpu": "4"})
    server.add_pod("team-c", "waiting", phase="Pending", requests={"nvidia.com/gpu": "8"})

    active = core.list_pod_for_all_namespaces(
        field_selector="spec.nodeName=node-a,status.phase!=Succeeded,status.phase!=Failed"
    )
    assert active.kind == "PodList" and active.api_version == "v1"
    assert [(p.metadata.namespace, p.metadata.name) for p in active.items] == [
        ("kube-system", "aws-node-x"),
        ("team-b", "big-train-0"),
    ]
    big = active.items[1]
    assert big.spec.node_name == "node-a" and big.status.phase == "Running" and big.status.qos_class == "Guaranteed"
    assert big.spec.containers[0].resources.requests == gpu8
    assert big.status.container_statuses[0].state.running is not None and big.status.container_statuses[0].ready

    assert [p.metadata.name for p in core.list_pod_for_all_namespaces(field_selector="spec.nodeName=").items] == [
        "waiting"
    ]
    waiting = core.read_namespaced_pod("waiting", "team-c")
    scheduled = next(c for c in waiting.status.conditions if c.type == "PodScheduled")
    assert (scheduled.status, scheduled.reason) == ("False", "Unschedulable")
    assert scheduled.message == "0/4 nodes are available: 4 Insufficient nvidia.com/gpu."
    starting = core.read_namespaced_pod("starting", "team-c")
    assert starting.status.container_statuses[0].state.waiting.reason == "ContainerCreating"
    done = core.read_namespaced_pod("done", "team-b").status.container_statuses[0].state.terminated
    assert (done.exit_code, done.reason) == (0, "Completed")
    assert len(core.list_pod_for_all_namespaces(label_selector="nothing=here").items) == 0
    assert [
        p.metadata.name for p in core.list_namespaced_pod("team-b", field_selector="status.phase=Failed").items
    ] == ["crashed"]
    with pytest.raises(ApiException) as error:
        core.list_pod_for_all_namespaces(field_selector="spec.nodeNames=node-a")
    assert error.value.status == 400 and status_of(error)["message"] == "field label not supported: spec.nodeNames"


def test_persistent_volume_claims(server: FakeKubernetes, core: Any) -> None:
    server.add_pvc("kubeflow", "fsx-claim")
    server.add_pvc("kubeflow", "static-claim", volume_name="fsx-pv", storage_class="", capacity="2400Gi")
    server.add_pvc("kubeflow", "pending-claim", phase="Pending", access_modes=("ReadWriteOnce",))

    pvc = core.read_namespaced_persistent_volume_claim("fsx-claim", "kubeflow")
    assert pvc.status.phase == "Bound" and pvc.status.access_modes == ["ReadWriteMany"]
    assert pvc.status.capacity == {"storage": "1200Gi"} and pvc.spec.storage_class_name == "fsx-sc"
    assert pvc.spec.volume_name == f"pvc-{pvc.metadata.uid}" and pvc.spec.resources.requests == {"storage": "1200Gi"}
    static = core.read_namespaced_persistent_volume_claim("static-claim", "kubeflow")
    assert static.spec.volume_name == "fsx-pv" and static.spec.storage_class_name == ""
    pending = core.read_namespaced_persistent_volume_claim("pending-claim", "kubeflow")
    assert pending.status.phase == "Pending" and pending.spec.volume_name is None and pending.status.capacity is None

    listed = core.list_namespaced_persistent_volume_claim("kubeflow")
    assert listed.kind == "PersistentVolumeClaimList"
    assert [p.metadata.name for p in listed.items] == ["fsx-claim", "pending-claim", "static-claim"]
    assert len(core.list_persistent_volume_claim_for_all_namespaces().items) == 3
    assert core.list_namespaced_persistent_volume_claim("default").items == []
    with pytest.raises(ApiException) as error:
        core.read_namespaced_persistent_volume_claim("fsx-claim", "default")
    assert error.value.status == 404
    assert status_of(error)["message"] == 'persistentvolumeclaims "fsx-claim" not found'


def test_persistent_volumes_and_storage_classes(server: FakeKubernetes, api_client: Any, core: Any) -> None:
    """Cluster-scoped, 404 and 403 as the API server answers them; a Bound claim's volume comes with it."""
    storage = kubernetes.client.StorageV1Api(api_client)
    server.add_storage_class("fsx-sc", {"subnetId": "subnet-1", "deploymentType": "PERSISTENT_2",
                                        "perUnitStorageThroughput": "250"})  # fmt: skip
    claim = server.add_pvc("kubeflow", "fsx-claim", capacity="2400Gi")
    server.add_pvc("kubeflow", "static-claim", volume_name="fsx-pv", storage_class="")
    server.add_pvc("kubeflow", "pending-claim", phase="Pending")

    pv = core.read_persistent_volume(claim["spec"]["volumeName"])
    assert pv.kind == "PersistentVolume" and pv.metadata.namespace is None and pv.status.phase == "Bound"
    assert pv.spec.capacity == {"storage": "2400Gi"} and pv.spec.storage_class_name == "fsx-sc"
    assert (pv.spec.csi.driver, pv.spec.csi.volume_handle) == ("fsx.csi.aws.com", "fs-0123456789abcdef0")
    assert set(pv.spec.csi.volume_attributes) == {"dnsname", "mountname"}, "the FSx CSI driver's volume context"
    assert pv.metadata.annotations == {"pv.kubernetes.io/provisioned-by": "fsx.csi.aws.com"}
    ref = pv.spec.claim_ref
    assert (ref.namespace, ref.name, ref.uid) == ("kubeflow", "fsx-claim", claim["metadata"]["uid"])
    static = core.read_persistent_volume("fsx-pv")
    assert static.spec.storage_class_name is None and static.metadata.annotations is None
    assert static.spec.persistent_volume_reclaim_policy == "Retain"
    assert len(core.list_persistent_volume().items) == 2, "a Pending claim has no volume"

    sc = storage.read_storage_class("fsx-sc")
    assert (sc.kind, sc.api_version, sc.provisioner) == ("StorageClass", "storage.k8s.io/v1", "fsx.csi.aws.com")
    assert sc.parameters["perUnitStorageThroughput"] == "250" and sc.metadata.generation is None

    for read, name, message in (
        (core.read_persistent_volume, "nope", 'persistentvolumes "nope" not found'),
        (storage.read_storage_class, "nope", 'storageclasses.storage.k8s.io "nope" not found'),
    ):
        with pytest.raises(ApiException) as error:
            read(name)
        assert error.value.status == 404 and status_of(error)["message"] == message
    with pytest.raises(ApiException) as error:  # not a namespaced resource
        api_client.call_api("/api/v1/namespaces/kubeflow/persistentvolumes/fsx-pv", "GET", _preload_content=False)
    assert error.value.status == 404

    server.use_rbac(LAUNCHER_RBAC)  # no rule for either
    for read, name, resource, group in (
        (core.read_persistent_volume, "fsx-pv", "persistentvolumes", ""),
        (storage.read_storage_class, "fsx-sc", "storageclasses", "storage.k8s.io"),
    ):
        with pytest.raises(ApiException) as error:
            read(name)
        assert error.value.status == 403 and status_of(error)["message"].endswith(
            f'cannot get resource "{resource}" in API group "{group}" at the cluster scope'
        )
    server.grant("get", "persistentvolumes")
    server.grant("get", "storageclasses", groups="storage.k8s.io")
    assert core.read_persistent_volume("fsx-pv").metadata.name == "fsx-pv"
    assert storage.read_storage_class("fsx-sc").metadata.name == "fsx-sc"


def test_daemonsets_and_deployments(server: FakeKubernetes, apps: Any) -> None:
    for i in range(3):
        server.add_node(f"gpu-{i}")
    server.add_device_plugins(ready=2)
    server.add_daemonset("kube-system", "aws-node", image="amazon-k8s-cni:v1.18.5", labels={"k8s-app": "aws-node"})

    listed = apps.list_daemon_set_for_all_namespaces()
    assert listed.kind == "DaemonSetList" and listed.api_version == "apps/v1"
    assert [d.metadata.name for d in listed.items] == [
        "aws-efa-k8s-device-plugin-daemonset",
        "aws-node",
        "nvidia-device-plugin-daemonset",
    ]
    efa = apps.read_namespaced_daemon_set("aws-efa-k8s-device-plugin-daemonset", "kube-system")
    assert efa.spec.template.spec.containers[0].image.startswith(
        "602401143452.dkr.ecr.us-west-2.amazonaws.com/eks/aws-efa-k8s-device-plugin:"
    )
    s = efa.status
    assert (s.desired_number_scheduled, s.current_number_scheduled, s.number_ready, s.number_available) == (3, 3, 2, 2)
    assert (s.updated_number_scheduled, s.number_misscheduled, s.number_unavailable) == (3, 0, 1)
    nvidia = apps.list_namespaced_daemon_set("kube-system", label_selector="name=nvidia-device-plugin-ds").items
    assert [d.spec.template.spec.containers[0].image for d in nvidia] == ["nvcr.io/nvidia/k8s-device-plugin:v0.16.2"]
    assert apps.read_namespaced_daemon_set("aws-node", "kube-system").status.number_unavailable is None

    operator = apps.read_namespaced_deployment("training-operator", "kubeflow")
    assert operator.spec.template.spec.containers[0].image == "kubeflow/training-operator:v1-5170a36"
    assert operator.spec.template.spec.containers[0].name == "training-operator"
    assert operator.metadata.labels == {"control-plane": "kubeflow-training-operator"}
    assert (operator.status.replicas, operator.status.ready_replicas, operator.status.available_replicas) == (1, 1, 1)
    assert {c.type: c.status for c in operator.status.conditions} == {"Available": "True", "Progressing": "True"}

    server.add_deployment(
        "kubeflow",
        "training-operator",
        image="kubeflow/training-operator:v1-855e096",
        labels={"control-plane": "kubeflow-training-operator", "app.kubernetes.io/version": "v1.8.0"},
        ready_replicas=0,
    )
    replaced = apps.list_namespaced_deployment(
        "kubeflow", label_selector="control-plane=kubeflow-training-operator"
    ).items
    assert len(replaced) == 1 and replaced[0].metadata.labels["app.kubernetes.io/version"] == "v1.8.0"
    assert replaced[0].status.ready_replicas is None and replaced[0].status.unavailable_replicas == 1
    available = next(c for c in replaced[0].status.conditions if c.type == "Available")
    assert (available.status, available.reason) == ("False", "MinimumReplicasUnavailable")
    assert len(apps.list_deployment_for_all_namespaces().items) == 1
    with pytest.raises(ApiException) as error:
        apps.read_namespaced_deployment("training-operator", "default")
    assert status_of(error)["message"] == 'deployments.apps "training-operator" not found'
    assert status_of(error)["details"] == {"name": "training-operator", "group": "apps", "kind": "deployments"}


def test_no_training_operator_deployment_when_told_not_to() -> None:
    with FakeKubernetes(CRD_PATH, training_operator=None) as fake:
        client = kubernetes.client.ApiClient(fake.client_configuration())
        with pytest.raises(ApiException) as error:
            kubernetes.client.AppsV1Api(client).read_namespaced_deployment("training-operator", "kubeflow")
        client.close()
    assert error.value.status == 404


def test_namespaces(server: FakeKubernetes, core: Any) -> None:
    assert core.read_namespace("kubeflow").status.phase == "Active"
    names = [n.metadata.name for n in core.list_namespace().items]
    assert names == ["default", "kube-node-lease", "kube-public", "kube-system", "kubeflow"]
    server.add_namespace("hyperpod-team", labels={"team": "a"})
    assert core.read_namespace("hyperpod-team").metadata.labels == {
        "kubernetes.io/metadata.name": "hyperpod-team",
        "team": "a",
    }
    with pytest.raises(ApiException) as error:
        core.read_namespace("team-z")
    assert status_of(error)["message"] == 'namespaces "team-z" not found'


def test_custom_resource_definitions(server: FakeKubernetes, apiext: Any, crs: Any) -> None:
    crd = apiext.read_custom_resource_definition("pytorchjobs.kubeflow.org")
    assert crd.spec.group == "kubeflow.org" and crd.spec.names.kind == "PyTorchJob" and crd.spec.scope == "Namespaced"
    assert [(v.name, v.served, v.storage) for v in crd.spec.versions] == [("v1", True, True)]
    assert "elasticPolicy" in crd.spec.versions[0].schema.open_apiv3_schema.properties["spec"].properties
    assert {c.type: c.status for c in crd.status.conditions} == {"NamesAccepted": "True", "Established": "True"}
    assert crd.status.accepted_names.plural == "pytorchjobs" and crd.status.stored_versions == ["v1"]
    assert [c.metadata.name for c in apiext.list_custom_resource_definition().items] == ["pytorchjobs.kubeflow.org"]

    crs.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, job_body("job-crd"))
    server.remove_crd()
    assert not server.crd_installed and server.job(NS, "job-crd") is None  # its resources went with it
    with pytest.raises(ApiException) as error:
        apiext.read_custom_resource_definition("pytorchjobs.kubeflow.org")
    body = status_of(error)
    assert error.value.status == 404
    assert body["message"] == 'customresourcedefinitions.apiextensions.k8s.io "pytorchjobs.kubeflow.org" not found'
    for call in (
        lambda: crs.list_namespaced_custom_object(GROUP, VERSION, NS, PLURAL),
        lambda: crs.get_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, "job-crd"),
        lambda: crs.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, job_body("job-crd")),
    ):
        with pytest.raises(ApiException) as error:
            call()
        assert error.value.status == 404
        assert status_of(error)["message"] == "the server could not find the requested resource"
    assert apiext.list_custom_resource_definition().items == []

    server.add_crd(load_crd(CRD_PATH))
    assert crs.list_namespaced_custom_object(GROUP, VERSION, NS, PLURAL)["items"] == []
    crs.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, job_body("job-crd"))
    assert len(crs.list_cluster_custom_object(GROUP, VERSION, PLURAL)["items"]) == 1


def test_access_reviews_default_to_cluster_admin(server: FakeKubernetes, authz: Any) -> None:
    status = review(authz, "create", "pytorchjobs", "kubeflow.org", "kubeflow")
    assert status.allowed is True and status.denied is None
    assert status.reason == (
        'RBAC: allowed by ClusterRoleBinding "fake-cluster-admin" of ClusterRole "cluster-admin" to '
        'ServiceAccount "pipeline-runner/kubeflow"'
    )
    assert review(authz, "list", "nodes").allowed
    assert server.access_reviews[0][0] == {
        "namespace": "kubeflow",
        "verb": "create",
        "group": "kubeflow.org",
        "resource": "pytorchjobs",
    }


def test_deny_forbids_requests_and_access_reviews(server: FakeKubernetes, authz: Any, core: Any, crs: Any) -> None:
    server.add_node("node-a")
    server.deny("list", "nodes")
    server.deny("get", "pods/log", namespace="kubeflow")
    server.deny("create", "pytorchjobs", "kubeflow.org", reason="blocked by policy", explicit=True)

    status = review(authz, "list", "nodes")
    assert (status.allowed, status.denied, status.reason) == (False, None, None)
    with pytest.raises(ApiException) as error:
        core.list_node()
    body = status_of(error)
    assert error.value.status == 403 and body["reason"] == "Forbidden" and body["details"] == {"kind": "nodes"}
    assert body["message"] == (
        'nodes is forbidden: User "system:serviceaccount:kubeflow:pipeline-runner" cannot list resource "nodes" '
        'in API group "" at the cluster scope'
    )
    assert core.read_node("node-a").metadata.name == "node-a"  # only list was taken away

    assert not review(authz, "get", "pods", namespace="kubeflow", subresource="log").allowed
    assert review(authz, "get", "pods", namespace="kubeflow").allowed
    assert review(authz, "get", "pods", namespace="team-a", subresource="log").allowed

    status = review(authz, "create", "pytorchjobs", "kubeflow.org", NS)
    assert (status.allowed, status.denied, status.reason) == (False, True, "blocked by policy")
    with pytest.raises(ApiException) as error:
        crs.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, job_body("job-denied"))
    body = status_of(error)
    assert body["message"] == (
        'pytorchjobs.kubeflow.org is forbidden: User "system:serviceaccount:kubeflow:pipeline-runner" cannot create '
        f'resource "pytorchjobs" in API group "kubeflow.org" in the namespace "{NS}": blocked by policy'
    )
    assert body["details"] == {"group": "kubeflow.org", "kind": "pytorchjobs"}

    server.forbid_events = True  # the older switch answers reviews too
    assert not review(authz, "list", "events", namespace=NS).allowed
    server.allow_all()
    assert review(authz, "list", "nodes").allowed and review(authz, "list", "events", namespace=NS).allowed


LAUNCHER_RBAC = [
    {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": {"name": "launcher", "namespace": "kubeflow"},
        "rules": [
            {"apiGroups": ["kubeflow.org"], "resources": ["pytorchjobs"], "verbs": ["create", "get", "list", "watch"]},
            {"apiGroups": [""], "resources": ["pods", "pods/log"], "verbs": ["get", "list"]},
        ],
    },
    {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": {"name": "launcher", "namespace": "kubeflow"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "launcher"},
        "subjects": [{"kind": "ServiceAccount", "name": "pipeline-runner", "namespace": "kubeflow"}],
    },
    {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": {"name": "node-reader"},
        "rules": [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list"]}],
    },
    {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRoleBinding",
        "metadata": {"name": "node-reader"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "node-reader"},
        "subjects": [{"kind": "Group", "name": "system:serviceaccounts:kubeflow"}],
    },
    {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": {"name": "someone-else", "namespace": "kubeflow"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "cluster-admin"},
        "subjects": [{"kind": "ServiceAccount", "name": "other", "namespace": "kubeflow"}],
    },
]


def test_rbac_rules_decide_requests_and_reviews(server: FakeKubernetes, authz: Any, core: Any, crs: Any) -> None:
    grants = server.use_rbac(LAUNCHER_RBAC)
    assert [(g.namespace, len(g.rules)) for g in grants] == [(None, 1), ("kubeflow", 2)]

    status = review(authz, "create", "pytorchjobs", "kubeflow.org", "kubeflow")
    assert status.allowed and status.reason == (
        'RBAC: allowed by RoleBinding "launcher/kubeflow" of Role "launcher" to ServiceAccount '
        '"pipeline-runner/kubeflow"'
    )
    assert review(authz, "list", "nodes").reason == (
        'RBAC: allowed by ClusterRoleBinding "node-reader" of ClusterRole "node-reader" to Group '
        '"system:serviceaccounts:kubeflow"'
    )
    assert review(authz, "get", "pods", namespace="kubeflow", subresource="log").allowed
    for denied in (
        review(authz, "delete", "pytorchjobs", "kubeflow.org", "kubeflow"),  # not in the Role
        review(authz, "create", "pytorchjobs", "kubeflow.org", "team-a"),  # another namespace
        review(authz, "list", "pods"),  # across all namespaces: a RoleBinding does not reach
        review(authz, "list", "daemonsets", "apps"),
    ):
        assert (denied.allowed, denied.denied, denied.reason) == (False, None, None)

    core.list_node()
    core.list_namespaced_pod("kubeflow")
    crs.create_namespaced_custom_object(GROUP, VERSION, "kubeflow", PLURAL, job_body("job-rbac"))
    with pytest.raises(ApiException) as error:
        crs.delete_namespaced_custom_object(GROUP, VERSION, "kubeflow", PLURAL, "job-rbac")
    assert status_of(error)["message"] == (
        'pytorchjobs.kubeflow.org "job-rbac" is forbidden: User "system:serviceaccount:kubeflow:pipeline-runner" '
        'cannot delete resource "pytorchjobs" in API group "kubeflow.org" in the namespace "kubeflow"'
    )
    with pytest.raises(ApiException) as error:
        core.list_pod_for_all_namespaces()
    assert error.value.status == 403 and "at the cluster scope" in status_of(error)["message"]
    with pytest.raises(ApiException) as error:
        core.list_namespaced_event("kubeflow")
    assert error.value.status == 403

    server.grant(["list", "watch"], "events", namespace="kubeflow")
    assert [e.reason for e in core.list_namespaced_event("kubeflow").items] == []
    assert review(authz, "watch", "events", namespace="kubeflow").reason.startswith(
        'RBAC: allowed by RoleBinding "fake-grant-2/kubeflow" of Role "fake-grant-2" to ServiceAccount'
    )


def test_a_rolebinding_to_cluster_admin_reaches_one_namespace(server: FakeKubernetes, authz: Any) -> None:
    server.user = "system:serviceaccount:kubeflow:other"
    (grant,) = server.use_rbac(LAUNCHER_RBAC)[1:]  # the node-reader group binding, then this one
    assert grant.namespace == "kubeflow"
    assert review(authz, "delete", "pytorchjobs", "kubeflow.org", "kubeflow").reason == (
        'RBAC: allowed by RoleBinding "someone-else/kubeflow" of ClusterRole "cluster-admin" to ServiceAccount '
        '"other/kubeflow"'
    )
    assert not review(authz, "delete", "pytorchjobs", "kubeflow.org", "default").allowed
    assert not review(authz, "list", "daemonsets", "apps").allowed


def test_the_projects_rbac_manifest_is_understood(server: FakeKubernetes, authz: Any) -> None:
    rbac = Path(__file__).resolve().parents[1] / "deploy/rbac.yaml"
    assert server.use_rbac(rbac), f"no binding in {rbac} names {server.user}"
    assert review(authz, "create", "pytorchjobs", "kubeflow.org", "kubeflow").allowed
    assert not review(authz, "create", "pytorchjobs", "kubeflow.org", "default").allowed


def test_access_review_body_is_validated(server: FakeKubernetes, authz: Any) -> None:
    def post(body: Any) -> pytest.ExceptionInfo[ApiException]:
        with pytest.raises(ApiException) as error:
            authz.create_self_subject_access_review(body)
        return error

    base = {"apiVersion": "authorization.k8s.io/v1", "kind": "SelfSubjectAccessReview"}
    error = post({**base, "spec": {"resourceAttributes": {"verb": "list", "resources": "nodes"}}})
    assert error.value.status == 400 and status_of(error)["message"] == (
        'SelfSubjectAccessReview in version "v1" cannot be handled as a SelfSubjectAccessReview: strict decoding '
        'error: unknown field "spec.resourceAttributes.resources"'
    )
    error = post({**base, "spec": {"resourceAttributes": {"verb": ["list"], "resource": "nodes"}}})
    assert error.value.status == 400 and status_of(error)["message"].endswith(
        "json: cannot unmarshal array into Go struct field ResourceAttributes.spec.resourceAttributes.verb of type "
        "string"
    )
    error = post({**base, "spec": {}})
    assert error.value.status == 422 and status_of(error)["message"] == (
        'SelfSubjectAccessReview.authorization.k8s.io "" is invalid: spec.resourceAttributes: Invalid value: "null": '
        "exactly one of nonResourceAttributes or resourceAttributes must be specified"
    )
    both = {"resourceAttributes": {"verb": "get"}, "nonResourceAttributes": {"verb": "get", "path": "/healthz"}}
    assert post({**base, "spec": both}).value.status == 422
    assert post({**base, "kind": "SubjectAccessReview", "spec": both}).value.status == 400

    # fieldValidation=Warn: the unknown field is reported in a Warning header and dropped
    answer = authz.api_client.call_api(
        "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews",
        "POST",
        query_params=[("fieldValidation", "Warn")],
        header_params={"Content-Type": "application/json"},
        body={**base, "spec": {"resourceAttributes": {"verb": "list", "resource": "nodes", "extra": "x"}}},
        _preload_content=False,
    )[0]
    assert answer.status == 201 and 'unknown field \\"spec.resourceAttributes.extra\\"' in answer.headers["Warning"]
    assert json.loads(answer.data)["status"] == {
        "allowed": True,
        "reason": 'RBAC: allowed by ClusterRoleBinding "fake-cluster-admin" of ClusterRole "cluster-admin" to '
        'ServiceAccount "pipeline-runner/kubeflow"',
    }
    non_resource = kubernetes.client.V1SelfSubjectAccessReview(
        spec=kubernetes.client.V1SelfSubjectAccessReviewSpec(
            non_resource_attributes=kubernetes.client.V1NonResourceAttributes(path="/healthz", verb="get")
        )
    )
    assert authz.create_self_subject_access_review(non_resource).status.allowed
    with pytest.raises(ApiException) as error:
        authz.api_client.call_api("/apis/authorization.k8s.io/v1/selfsubjectaccessreviews", "GET")
    assert error.value.status == 405


def test_faults_apply_to_the_new_endpoints(server: FakeKubernetes, core: Any, apps: Any, authz: Any) -> None:
    server.add_node("node-a")
    server.faults.fail_next("GET", r"^/api/v1/nodes", 500)
    with pytest.raises(ApiException) as error:
        core.list_node()
    assert error.value.status == 500 and status_of(error)["reason"] == "InternalError"
    assert len(core.list_node().items) == 1

    server.faults.fail_next("POST", r"/selfsubjectaccessreviews$", 503, message="etcd is away")
    with pytest.raises(ApiException) as error:
        review(authz, "list", "nodes")
    assert error.value.status == 503 and status_of(error)["message"] == "etcd is away"

    server.faults.drop_next("GET", r"/apis/apps/v1/namespaces/kubeflow/deployments/training-operator$", times=4)
    with pytest.raises(urllib3.exceptions.MaxRetryError):  # urllib3 retries a dropped GET 3 times, then gives up
        apps.read_namespaced_deployment("training-operator", "kubeflow")
    assert [k for k, *_ in server.faults.injected].count("drop") == 4


# ----------------------------------------------------------------------------------------------------------------------
# Pod troubles: scheduling, image pulls, crash loops, OOM kills


def test_events_at_chosen_times(server: FakeKubernetes, core: Any) -> None:
    server.add_node("node-a")
    pod = server.add_pod(NS, "p", phase="Pending")
    earlier = datetime(2025, 1, 2, 3, 4, 5, tzinfo=UTC)
    server.add_event(
        pod, "FailedScheduling", INSUFFICIENT_GPU, type_="Warning", component="default-scheduler", at=earlier
    )
    server.add_event(pod, "FailedScheduling", INSUFFICIENT_GPU, type_="Warning", component="default-scheduler", count=3)
    server.add_event(server.node("node-a"), "OOMKilling", "Memory cgroup out of memory", type_="Warning", at=0)
    (event,) = core.list_namespaced_event(NS, field_selector="involvedObject.name=p,reason=FailedScheduling").items
    assert event.count == 4 and event.first_timestamp == earlier and event.last_timestamp > earlier
    assert event.involved_object.field_path is None and event.source.component == "default-scheduler"
    (oom,) = core.list_namespaced_event("default", field_selector="involvedObject.kind=Node").items
    assert oom.involved_object.name == oom.involved_object.uid == "node-a" and oom.involved_object.namespace is None
    assert oom.last_timestamp == datetime(1970, 1, 1, tzinfo=UTC)
    assert len(core.list_event_for_all_namespaces().items) == 2


def test_crash_loop_lifecycle(server: FakeKubernetes, crs: Any, core: Any) -> None:
    lines = ["Traceback (most recent call last):", "ImportError: libnccl.so.2: cannot open shared object file"]
    server.lifecycle = Lifecycle.crash_loop(workers=2, log_lines=lines, tick_s=0.02)
    crs.create_namespaced_custom_object(
        GROUP, VERSION, NS, PLURAL, job_body("job-crash", runPolicy={"backoffLimit": 3})
    )

    pod = pod_when(core, "job-crash-worker-1", lambda p: waiting_reason(p) == "CrashLoopBackOff")
    cs = pod.status.container_statuses[0]
    assert pod.status.phase == "Running" and cs.restart_count == 1 and not cs.ready
    assert (cs.last_state.terminated.exit_code, cs.last_state.terminated.reason) == (1, "Error")
    assert cs.state.waiting.message.startswith(
        "back-off 10s restarting failed container=pytorch pod=job-crash-worker-1_"
    )
    expected = "".join(f"{line}\n" for line in lines)
    assert core.read_namespaced_pod_log("job-crash-worker-1", NS, container="pytorch") == expected
    assert core.read_namespaced_pod_log("job-crash-worker-1", NS, container="pytorch", previous=True) == expected
    (backoff,) = core.list_namespaced_event(
        NS, field_selector="involvedObject.name=job-crash-worker-1,reason=BackOff"
    ).items
    assert backoff.type == "Warning" and backoff.message.startswith(
        "Back-off restarting failed container pytorch in pod job-crash-worker-1_team-a("
    )
    job = server.job(NS, "job-crash")
    assert conditions(job)["Running"] == "True" and "Failed" not in conditions(job)
    assert job["status"]["replicaStatuses"]["Worker"]["active"] == 2  # the pod is Running, as the operator counts
    assert core.read_namespaced_pod("job-crash-worker-0", NS).status.phase == "Running"


def test_crash_loop_past_the_backoff_limit_fails_the_job(server: FakeKubernetes, crs: Any, core: Any) -> None:
    server.lifecycle = Lifecycle.crash_loop(workers=2, crashes=3, tick_s=0.01)
    crs.create_namespaced_custom_object(
        GROUP, VERSION, NS, PLURAL, job_body("job-limit", runPolicy={"backoffLimit": 2})
    )
    job = wait_for(lambda: (j := server.job(NS, "job-limit")) and conditions(j).get("Failed") == "True" and j)
    failed = next(c for c in job["status"]["conditions"] if c["type"] == "Failed")
    assert (failed["reason"], failed["message"]) == (
        "PyTorchJobFailed",
        "Job job-limit has failed because it has reached the specified backoff limit",
    )
    assert server.pods(NS, "job-limit") == []  # the operator deletes every pod then, whatever cleanPodPolicy says
    assert job["status"]["completionTime"]


def test_pod_status_scripting(server: FakeKubernetes, core: Any) -> None:
    server.add_node("node-a")
    server.add_pod(NS, "script", node_name="node-a")

    def image_pull_back_off(pod: dict[str, Any]) -> None:
        pod["status"]["phase"] = "Pending"
        pod["status"]["containerStatuses"][0]["state"] = {
            "waiting": {"reason": "ImagePullBackOff", "message": 'Back-off pulling image "x"'}
        }

    server.update_pod(NS, "script", image_pull_back_off)
    pod = core.read_namespaced_pod("script", NS)
    assert pod.status.container_statuses[0].state.waiting.reason == "ImagePullBackOff"
    server.delete_pod(NS, "script")
    assert core.list_namespaced_pod(NS).items == []
