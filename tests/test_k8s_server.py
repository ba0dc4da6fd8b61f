"""The fake Kubernetes API server (tests/k8s_server.py), driven through the official kubernetes client."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterator
from typing import Any

import kubernetes
import pytest
import urllib3
from kubernetes.client.rest import ApiException

from tests.k8s_server import CRD_PATH, FakeKubernetes, Lifecycle, load_crd_schema, unknown_fields

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


def test_webhook_denies_a_job_without_a_pytorch_container(server: FakeKubernetes, crs: Any) -> None:
    body = job_body("job-w")
    body["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["name"] = "main"
    with pytest.raises(ApiException) as error:
        crs.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, body)
    assert error.value.status == 403
    assert "must have at least one container with name pytorch" in json.loads(error.value.body)["message"]


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


def test_restart_lifecycle(server: FakeKubernetes, crs: Any, core: Any) -> None:
    server.lifecycle = Lifecycle.restart(workers=2, tick_s=0.02)
    crs.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, job_body("job-k"))
    job = wait_for(lambda: (j := server.job(NS, "job-k")) and conditions(j).get("Succeeded") == "True" and j)
    assert "Restarting" not in conditions(job)  # Running replaced it again
    assert core.read_namespaced_pod("job-k-worker-1", NS).status.container_statuses[0].restart_count == 1
    previous = core.read_namespaced_pod_log("job-k-worker-1", NS, container="pytorch", previous=True)
    assert previous.endswith("RuntimeError: NCCL communicator was aborted\n")


def test_events_and_forbidden_events(server: FakeKubernetes, crs: Any, core: Any) -> None:
    server.lifecycle = Lifecycle.stuck_pending(workers=2, tick_s=0.01)
    crs.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, job_body("job-l"))

    def scheduling_failed() -> list[Any]:
        return core.list_namespaced_event(NS, field_selector="involvedObject.name=job-l-worker-0").items

    event = wait_for(scheduling_failed)[0]
    assert (event.reason, event.type) == ("FailedScheduling", "Warning")
    assert event.message == "0/4 nodes are available: 4 Insufficient nvidia.com/gpu."
    assert event.involved_object.kind == "Pod" and event.count == 1

    server.forbid_events = True
    with pytest.raises(ApiException) as error:
        core.list_namespaced_event(NS, field_selector="involvedObject.name=job-l-worker-0")
    body = json.loads(error.value.body)
    assert error.value.status == 403 and body["reason"] == "Forbidden"
    assert body["message"].startswith(
        'events is forbidden: User "system:serviceaccount:kubeflow:pipeline-runner" cannot list resource "events"'
    )


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
