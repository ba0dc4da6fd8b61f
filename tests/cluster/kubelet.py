"""The node side a control plane does not run, played on the real API server: the scheduler's bindings and the kubelet.

What each part does, and its source (kubernetes/kubernetes, v1.36):
- Nodes register with ``status.addresses`` (InternalIP 127.0.0.1) and ``status.daemonEndpoints.kubeletEndpoint`` (the
  port this player serves), report Ready, and lift the ``node.kubernetes.io/not-ready:NoSchedule`` taint that
  admission puts on every new Node (the node lifecycle controller's job, ``pkg/controller/nodelifecycle``).
- Scheduling: ``pods/binding`` (the API server then sets PodScheduled True, ``pkg/registry/core/pod/storage``
  ``assignPod``), or PodScheduled False ``Unschedulable`` with a ``FailedScheduling`` event from
  ``default-scheduler`` (``pkg/scheduler/schedule_one.go`` ``handleSchedulingFailure``).
- Pod status through ``pods/status`` (container states, restart counts, ``lastState``; the phase as
  ``pkg/kubelet/kubelet_pods.go`` ``getPhase`` derives it: OnFailure keeps a pod Running while its container
  restarts, Never fails it). The API server validates each transition.
- A deleted pod stays Terminating until its kubelet has stopped it and deletes it with grace 0 and a UID precondition
  (``pkg/kubelet/status/status_manager.go`` ``syncPod``); the garbage collector's foreground deletion waits for that.
- ``/containerLogs/{ns}/{pod}/{container}`` over HTTPS (``pkg/kubelet/server/server.go`` ``getContainerLogs``): the
  API server passes ``follow``, ``previous``, ``timestamps``, ``sinceSeconds``, ``tailLines`` and ``limitBytes``
  through unapplied (``../shared/k8s/README.md``); they are applied here as ``pkg/kubelet/kuberuntime/logs/logs.go``
  ``ReadLogs`` does (RFC 3339 nanosecond timestamps, a followed stream that ends when its container stops). Errors are
  ``validateContainerLogStatus``'s texts with status 400 (``response.WriteError(http.StatusBadRequest, err)``).
- ``serve_logs=False``: no kubelet answers, and the API server's own 500 is what a client meets.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import kubernetes
from kubernetes.client.exceptions import ApiException

from tests.cluster.controller import POLL_S
from tests.cluster.tls import HttpsServer, loopback_cert

log = logging.getLogger(__name__)

NOT_READY_TAINT = "node.kubernetes.io/not-ready"
GPU, EFA = "nvidia.com/gpu", "vpc.amazonaws.com/efa"
P5 = {"cpu": "192", "memory": "2063937952Ki", GPU: "8", EFA: "32", "pods": "110"}  # ml.p5.48xlarge


def now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def rfc3339_nano(t_ns: int) -> str:
    """Go's time.RFC3339Nano in UTC: trailing zeros of the fraction cut (logs.go ``timeFormatOut``)."""
    seconds, nanos = divmod(t_ns, 1_000_000_000)
    base = datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%dT%H:%M:%S")
    fraction = f"{nanos:09d}".rstrip("0")
    return f"{base}.{fraction}Z" if fraction else f"{base}Z"


@dataclass
class ContainerLog:
    """One container instance's output: (time in ns, line), and whether it has stopped."""

    lines: list[tuple[int, str]] = field(default_factory=list)
    stopped: bool = False


@dataclass
class StreamFault:
    kind: str  # "cut": the stream ends after `after` lines; "stall": it falls silent and never closes
    after: int
    times: int


class Kubelet:
    """Nodes, bindings, container states and logs for the pods of one namespace."""

    def __init__(
        self,
        admin: kubernetes.client.ApiClient,
        namespace: str,
        workdir: Path,
        *,
        serve_logs: bool = True,
        node_resources: dict[str, str] | None = None,
        termination_s: float = 0.2,
    ):
        self.core = kubernetes.client.CoreV1Api(admin)
        self.namespace = namespace
        self.node_resources = dict(node_resources or P5)
        self.termination_s = termination_s
        self.nodes: list[str] = []
        self.lost_nodes: set[str] = set()  # gone with their kubelet: their pods' deletions never finish
        self._logs: dict[tuple[str, int], ContainerLog] = {}  # (pod uid, restart count)
        self._cond = threading.Condition()
        self._faults: list[StreamFault] = []
        self._stop = threading.Event()
        self._server: HttpsServer | None = None
        self.port = 0
        if serve_logs:
            self._server = HttpsServer(_handler(self), loopback_cert(workdir, "kubelet")).start()
            self.port = self._server.port
        self._reaper = threading.Thread(target=self._finish_deletions, daemon=True, name=f"kubelet-{namespace}")
        self._reaper.start()

    def stop(self) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        if self._server is not None:
            self._server.stop()
        for node in self.nodes:
            with contextlib.suppress(ApiException):
                self.core.delete_node(node)

    # -- nodes ------------------------------------------------------------------------------------------------

    def add_node(self, labels: dict[str, str] | None = None) -> str:
        """A Ready node (unique name) whose kubelet is this player; the not-ready taint lifted."""
        name = f"{self.namespace}-node-{len(self.nodes)}"
        labels = {
            "kubernetes.io/hostname": name,
            "node.kubernetes.io/instance-type": "ml.p5.48xlarge",
            "sagemaker.amazonaws.com/node-health-status": "Schedulable",
            **(labels or {}),
        }
        self.core.create_node({"metadata": {"name": name, "labels": labels}})
        self.nodes.append(name)
        status = {
            "capacity": self.node_resources,
            "allocatable": self.node_resources,
            # InternalIP only: the API server would look a Hostname address up in DNS (off this machine).
            "addresses": [{"type": "InternalIP", "address": "127.0.0.1"}],
            "conditions": [
                {
                    "type": "Ready",
                    "status": "True",
                    "reason": "KubeletReady",
                    "message": "kubelet is posting ready status",
                    "lastHeartbeatTime": now(),
                    "lastTransitionTime": now(),
                }
            ],
            "nodeInfo": {
                "kubeletVersion": "v1.36.2",
                "containerRuntimeVersion": "containerd://1.7.27",
                "operatingSystem": "linux",
                "architecture": "amd64",
                "machineID": "",
                "systemUUID": "",
                "bootID": "",
                "kernelVersion": "",
                "osImage": "",
                "kubeProxyVersion": "",
            },
        }
        if self.port:
            status["daemonEndpoints"] = {"kubeletEndpoint": {"Port": self.port}}
        self.core.patch_node_status(name, {"status": status})
        node = self.core.read_node(name)
        taints = [t for t in node.spec.taints or [] if t.key != NOT_READY_TAINT]
        self.core.patch_node(
            name, {"spec": {"taints": [self.core.api_client.sanitize_for_serialization(t) for t in taints] or None}}
        )
        return name

    # -- pods -------------------------------------------------------------------------------------------------

    def pod(self, name: str) -> dict[str, Any] | None:
        try:
            response = self.core.read_namespaced_pod(name, self.namespace, _preload_content=False)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        return json.loads(response.data)

    def wait_for_pod(self, name: str, timeout_s: float = 30) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if (pod := self.pod(name)) is not None and not pod["metadata"].get("deletionTimestamp"):
                return pod
            time.sleep(0.05)
        raise TimeoutError(f"pod {self.namespace}/{name} not created within {timeout_s:.0f}s")

    def _update_status(self, name: str, mutate: Callable[[dict[str, Any]], None]) -> dict[str, Any] | None:
        """Read, change and write the pod's status (again on a conflict); None when the pod is gone."""
        for _ in range(20):
            pod = self.pod(name)
            if pod is None:
                return None
            mutate(pod)
            try:
                response = self.core.replace_namespaced_pod_status(name, self.namespace, pod, _preload_content=False)
                return json.loads(response.data)
            except ApiException as exc:
                if exc.status == 409:
                    continue
                if exc.status == 404:
                    return None
                raise
        raise RuntimeError(f"pod {name}: status conflicts did not settle")

    def bind(self, name: str, node: str | None = None) -> None:
        """The scheduler's binding; a node is added when none is given."""
        node = node or self.add_node()
        body = {
            "apiVersion": "v1",
            "kind": "Binding",
            "metadata": {"name": name},
            "target": {"kind": "Node", "name": node},
        }
        self.core.create_namespaced_pod_binding(name, self.namespace, body, _preload_content=False)

    def unschedulable(self, name: str, message: str) -> None:
        """The scheduler found no node: PodScheduled False, Unschedulable, and its FailedScheduling event."""

        def mutate(pod: dict[str, Any]) -> None:
            _set_condition(pod["status"], "PodScheduled", "False", "Unschedulable", message)

        if (pod := self._update_status(name, mutate)) is not None:
            self.event(pod, "Warning", "FailedScheduling", message, component="default-scheduler")

    def start(self, name: str, *, node: str | None = None) -> None:
        """Bound (to a new node unless given), then its container created and running, the pod Ready."""
        pod = self.wait_for_pod(name)
        if not pod["spec"].get("nodeName"):
            self.bind(name, node)
        self.event(
            pod,
            "Normal",
            "Scheduled",
            f"Successfully assigned {self.namespace}/{name} to {self.pod(name)['spec']['nodeName']}",
            component="default-scheduler",
        )
        self._update_status(name, lambda p: self._container_running(p, restart=False))
        self.event(self.pod(name) or pod, "Normal", "Started", "Started container pytorch")

    def _container_running(self, pod: dict[str, Any], *, restart: bool) -> None:
        status = pod["status"]
        status.update(phase="Running", hostIP="127.0.0.1", podIP=_pod_ip(pod))
        status.setdefault("startTime", now())
        container = pod["spec"]["containers"][0]
        previous = (status.get("containerStatuses") or [{}])[0]
        count = previous.get("restartCount", 0) + (1 if restart else 0)
        last = previous.get("state", {}) if "terminated" in previous.get("state", {}) else previous.get("lastState", {})
        status["containerStatuses"] = [
            {
                "name": container["name"],
                "image": container["image"],
                "imageID": _image_id(container["image"]),
                "containerID": f"containerd://{uuid.uuid4().hex}{uuid.uuid4().hex}",
                "ready": True,
                "started": True,
                "restartCount": count,
                "state": {"running": {"startedAt": now()}},
                "lastState": last if restart or count else {},
            }
        ]
        for kind in ("Initialized", "PodReadyToStartContainers"):
            _set_condition(status, kind, "True")
        _set_ready(status, True)
        with self._cond:
            self._logs.setdefault((pod["metadata"]["uid"], count), ContainerLog())
            self._cond.notify_all()

    def wait(self, name: str, reason: str, message: str = "") -> None:
        """The container waits: ContainerCreating, ErrImagePull, ImagePullBackOff, CrashLoopBackOff."""

        def mutate(pod: dict[str, Any]) -> None:
            container = pod["spec"]["containers"][0]
            statuses = pod["status"].get("containerStatuses") or [
                {
                    "name": container["name"],
                    "image": container["image"],
                    "imageID": "",
                    "restartCount": 0,
                    "lastState": {},
                }
            ]
            waiting = {"reason": reason} | ({"message": message} if message else {})
            cs = statuses[0]
            if "terminated" in cs.get("state", {}):
                cs["lastState"] = cs["state"]
            cs.update(state={"waiting": waiting}, ready=False, started=False)
            pod["status"]["containerStatuses"] = statuses
            pod["status"].setdefault("phase", "Pending")
            _set_ready(pod["status"], False)

        self._update_status(name, mutate)

    def print(self, name: str, *lines: str) -> None:
        """Lines written by the pod's running container (timestamped now)."""
        pod = self.pod(name)
        if pod is None:
            return
        count = (pod["status"].get("containerStatuses") or [{}])[0].get("restartCount", 0)
        with self._cond:
            output = self._logs.setdefault((pod["metadata"]["uid"], count), ContainerLog())
            for line in lines:
                output.lines.append((time.time_ns(), line))
            self._cond.notify_all()

    def exit(self, name: str, exit_code: int, reason: str = "") -> None:
        """The container exits. As the kubelet goes on from there, by the pod's restartPolicy (getPhase): Never ends
        the pod (Succeeded or Failed); OnFailure with a non-zero code restarts it, at once the first time and after
        a CrashLoopBackOff from then on (the back-off's end is :meth:`restart`)."""
        reason = reason or ("Completed" if exit_code == 0 else "Error")
        pod = self.pod(name)
        if pod is None:
            return
        policy = pod["spec"].get("restartPolicy", "Always")
        restarts = policy == "Always" or (policy == "OnFailure" and exit_code != 0)

        def mutate(pod: dict[str, Any]) -> None:
            status = pod["status"]
            cs = status["containerStatuses"][0]
            started = cs.get("state", {}).get("running", {}).get("startedAt", now())
            cs.update(
                ready=False,
                started=False,
                state={
                    "terminated": {
                        "exitCode": exit_code,
                        "reason": reason,
                        "startedAt": started,
                        "finishedAt": now(),
                        "containerID": cs.get("containerID", ""),
                    }
                },
            )
            if not restarts:
                status["phase"] = "Succeeded" if exit_code == 0 else "Failed"
            _set_ready(status, False)

        self._stopped(pod)
        self._update_status(name, mutate)
        if not restarts:
            return
        first = (pod["status"].get("containerStatuses") or [{}])[0].get("restartCount", 0) == 0
        if first:
            self.restart(name)
        else:
            self.back_off(name)

    def pull_failed(self, name: str, error: str) -> None:
        """Bound, but the image cannot be pulled: ErrImagePull and the image manager's events
        (``pkg/kubelet/images/image_manager.go`` ``EnsureImageExists``: "Pulling image %q", "Failed to pull image %q:
        %v", then ``pkg/kubelet/kuberuntime`` "Error: ErrImagePull")."""
        pod = self.wait_for_pod(name)
        if not pod["spec"].get("nodeName"):
            self.bind(name)
        image = pod["spec"]["containers"][0]["image"]
        self.wait(name, "ErrImagePull", error)
        self.event(pod, "Normal", "Pulling", f'Pulling image "{image}"')
        self.event(pod, "Warning", "Failed", f'Failed to pull image "{image}": {error}')
        self.event(pod, "Warning", "Failed", "Error: ErrImagePull")

    def pull_back_off(self, name: str) -> None:
        """The image manager backs off: ImagePullBackOff ("Back-off pulling image %q")."""
        pod = self.pod(name)
        if pod is None:
            return
        image = pod["spec"]["containers"][0]["image"]
        self.wait(name, "ImagePullBackOff", f'Back-off pulling image "{image}"')
        self.event(pod, "Normal", "BackOff", f'Back-off pulling image "{image}"')
        self.event(pod, "Warning", "Failed", "Error: ImagePullBackOff")

    def back_off(self, name: str) -> None:
        pod = self.pod(name)
        if pod is None:
            return
        uid = pod["metadata"]["uid"]
        self.wait(
            name,
            "CrashLoopBackOff",
            f"back-off 10s restarting failed container=pytorch pod={name}_{self.namespace}({uid})",
        )
        self.event(
            pod,
            "Warning",
            "BackOff",
            f"Back-off restarting failed container pytorch in pod {name}_{self.namespace}({uid})",
        )

    def restart(self, name: str) -> None:
        """The kubelet starts the container again: restartCount + 1, the last instance in lastState."""
        self._update_status(name, lambda p: self._container_running(p, restart=True))

    def _stopped(self, pod: dict[str, Any]) -> None:
        count = (pod["status"].get("containerStatuses") or [{}])[0].get("restartCount", 0)
        with self._cond:
            self._logs.setdefault((pod["metadata"]["uid"], count), ContainerLog()).stopped = True
            self._cond.notify_all()

    def event(
        self, involved: dict[str, Any], type_: str, reason: str, message: str, component: str = "kubelet"
    ) -> None:
        """An event about a pod, as its reporter records it (core/v1, in the pod's namespace)."""
        meta = involved["metadata"]
        stamp = now()
        self.core.create_namespaced_event(
            self.namespace,
            {
                "metadata": {"name": f"{meta['name']}.{uuid.uuid4().hex[:16]}", "namespace": self.namespace},
                "involvedObject": {
                    "apiVersion": "v1",
                    "kind": involved.get("kind", "Pod"),
                    "name": meta["name"],
                    "namespace": meta.get("namespace", self.namespace),
                    "uid": meta["uid"],
                    "resourceVersion": meta.get("resourceVersion", ""),
                },
                "reason": reason,
                "message": message,
                "type": type_,
                "source": {"component": component},
                "firstTimestamp": stamp,
                "lastTimestamp": stamp,
                "count": 1,
                "reportingComponent": component,
            },
        )

    # -- faults of the node side ------------------------------------------------------------------------------

    def cut_log_after(self, lines: int, times: int = 1) -> None:
        """The next ``times`` followed streams end (cleanly) after ``lines`` lines: a kubelet restart, say."""
        self._faults.append(StreamFault("cut", lines, times))

    def stall_log_after(self, lines: int, times: int = 1) -> None:
        """The next ``times`` followed streams fall silent after ``lines`` lines and never close: a lost node."""
        self._faults.append(StreamFault("stall", lines, times))

    def _take_fault(self) -> StreamFault | None:
        with self._cond:
            for fault in self._faults:
                if fault.times > 0:
                    fault.times -= 1
                    return fault
        return None

    # -- terminating pods -------------------------------------------------------------------------------------

    def lose_node(self, pod_name: str) -> None:
        """The pod's node goes away with its kubelet: nothing stops its containers or makes the final delete, so a
        deleted pod there stays Terminating, in the phase it had, until someone force-deletes it (grace 0)."""
        node = (self.pod(pod_name) or {}).get("spec", {}).get("nodeName")
        if node:
            self.lost_nodes.add(node)

    def _finish_deletions(self) -> None:
        """A bound pod being deleted: its containers stopped, then the kubelet's final delete (grace 0, UID)."""
        seen: set[str] = set()
        while not self._stop.wait(POLL_S):
            try:
                pods = json.loads(self.core.list_namespaced_pod(self.namespace, _preload_content=False).data)
            except Exception:  # noqa: BLE001 (the control plane going away at the end)
                continue
            for pod in pods["items"]:
                meta = pod["metadata"]
                if not meta.get("deletionTimestamp") or meta["uid"] in seen or not pod["spec"].get("nodeName"):
                    continue
                if pod["spec"]["nodeName"] in self.lost_nodes:
                    continue
                seen.add(meta["uid"])
                self._stopped(pod)
                threading.Timer(self.termination_s, self._delete_finally, (meta["name"], meta["uid"])).start()

    def _delete_finally(self, name: str, uid: str) -> None:
        body = {"gracePeriodSeconds": 0, "preconditions": {"uid": uid}}
        with contextlib.suppress(Exception):  # gone already, or the control plane stopping at the end
            self.core.delete_namespaced_pod(name, self.namespace, body=body, grace_period_seconds=0)

    # -- logs -------------------------------------------------------------------------------------------------

    def _container_log(self, pod: dict[str, Any], container: str, previous: bool) -> tuple[ContainerLog | None, str]:
        """validateContainerLogStatus: which instance's log, or its error text."""
        statuses = [c for c in pod["status"].get("containerStatuses") or [] if c["name"] == container]
        name = pod["metadata"]["name"]
        if not statuses:
            return None, f'container "{container}" in pod "{name}" is not available'
        cs = statuses[0]
        count, state, last = cs.get("restartCount", 0), cs.get("state", {}), cs.get("lastState", {})
        uid = pod["metadata"]["uid"]
        if previous:
            if not last.get("terminated", {}).get("containerID"):
                return None, f'previous terminated container "{container}" in pod "{name}" not found'
            return self._logs.get((uid, count - 1 if "running" in state or "terminated" in state else count)), ""
        if "running" in state or "terminated" in state:
            return self._logs.get((uid, count)), ""
        if "terminated" in last:
            return self._logs.get((uid, count)), ""  # waiting to restart: the last instance's
        if "waiting" in state:
            reason = state["waiting"].get("reason", "")
            text = {
                "ErrImagePull": "image can't be pulled",
                "ImagePullBackOff": "trying and failing to pull image",
            }.get(reason, reason)
            return None, f'container "{container}" in pod "{name}" is waiting to start: {text}'
        return None, f'container "{container}" in pod "{name}" is waiting to start - no logs yet'


def _handler(kubelet: Kubelet) -> type[BaseHTTPRequestHandler]:
    class LogHandler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            log.debug("kubelet: " + format, *args)

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            url = urlsplit(self.path)
            parts = [unquote(p) for p in url.path.split("/") if p]
            if len(parts) != 4 or parts[0] != "containerLogs":
                return self._error(404, f"no handler for {url.path}")
            _, namespace, name, container = parts
            query = {k: v[-1] for k, v in parse_qs(url.query).items()}
            pod = kubelet.pod(name) if namespace == kubelet.namespace else None
            if pod is None:
                return self._error(404, f'pod "{name}" does not exist\n')
            output, error = kubelet._container_log(pod, container, query.get("previous") == "true")
            if error:
                return self._error(400, error)
            self._stream(output or ContainerLog(stopped=True), query)

        def _error(self, code: int, text: str) -> None:
            body = text.encode()
            self.send_response(code)
            self.send_header("Content-Type", "text/plain; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _stream(self, output: ContainerLog, query: dict[str, str]) -> None:
            follow, stamps = query.get("follow") == "true", query.get("timestamps") == "true"
            since_ns = (time.time_ns() - int(query["sinceSeconds"]) * 1_000_000_000) if "sinceSeconds" in query else 0
            limit = int(query["limitBytes"]) if "limitBytes" in query else None
            with kubelet._cond:
                lines = [(t, text) for t, text in output.lines if t >= since_ns]
            if "tailLines" in query:
                lines = lines[max(0, len(lines) - int(query["tailLines"])) :]
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            fault = kubelet._take_fault() if follow else None
            sent, written = 0, 0
            position = len(output.lines) if not lines else output.lines.index(lines[0])
            try:
                while True:
                    for t, text in lines:
                        if fault is not None and sent >= fault.after:
                            if fault.kind == "cut":
                                return self._end()
                            return self._stall()
                        data = ((rfc3339_nano(t) + " ") if stamps else "") + text + "\n"
                        chunk = data.encode()
                        if limit is not None and written + len(chunk) > limit:
                            chunk = chunk[: limit - written]
                        self._chunk(chunk)
                        written += len(chunk)
                        sent += 1
                        if limit is not None and written >= limit:
                            return self._end()
                    position += len(lines)
                    if not follow:
                        return self._end()
                    with kubelet._cond:
                        while len(output.lines) <= position and not output.stopped and not kubelet._stop.is_set():
                            kubelet._cond.wait(0.5)
                        lines = output.lines[position:]
                        if not lines and (output.stopped or kubelet._stop.is_set()):
                            return self._end()
            except (BrokenPipeError, ConnectionResetError):
                return

        def _stall(self) -> None:
            while not kubelet._stop.wait(0.2):
                pass

        def _chunk(self, data: bytes) -> None:
            if data:
                self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                self.wfile.flush()

        def _end(self) -> None:
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()

    return LogHandler


def _set_condition(status: dict[str, Any], kind: str, value: str, reason: str = "", message: str = "") -> None:
    conditions = status.setdefault("conditions", [])
    current = next((c for c in conditions if c["type"] == kind), None)
    if current is None:
        current = {"type": kind}
        conditions.append(current)
    if current.get("status") != value:
        current["lastTransitionTime"] = now()
    current["status"] = value
    current.pop("reason", None)
    current.pop("message", None)
    if reason:
        current["reason"] = reason
    if message:
        current["message"] = message


def _set_ready(status: dict[str, Any], ready: bool) -> None:
    for kind in ("Ready", "ContainersReady"):
        if ready:
            _set_condition(status, kind, "True")
        else:
            done = status.get("phase") in ("Succeeded", "Failed")
            _set_condition(
                status,
                kind,
                "False",
                "PodCompleted" if done else "ContainersNotReady",
                "" if done else "containers with unready status: [pytorch]",
            )


def _pod_ip(pod: dict[str, Any]) -> str:
    digest = uuid.UUID(pod["metadata"]["uid"]).bytes
    return f"10.3.{digest[0]}.{digest[1] % 250 + 2}"


def _image_id(image: str) -> str:
    return f"{image.split(':')[0]}@sha256:{uuid.uuid5(uuid.NAMESPACE_URL, image).hex * 2}"
