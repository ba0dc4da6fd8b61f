"""deploy/rbac.yaml and deploy/rbac-cluster-read.yaml grant exactly what the code calls.

Representative runs of the launcher, the exit step's clean-up and the preflight go end to end through the real
`kubernetes` client against the fake API server, which enforces the deploy files' RBAC. Every request it recorded is
mapped to the authorizer's attributes the way the API server's request-info resolver maps it; every one must be
granted, and every rule of the files (each verb x resource x resourceName) must be used by one.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import kubernetes
import pytest
import yaml

from components.errors import StepFailed
from components.kube import Kube, KubeSettings
from components.launch_pytorchjob.cancel import Cancelled, ImmediateDelete
from components.launch_pytorchjob.core import LaunchConfig, launch
from components.launch_pytorchjob.k8s_backend import WatchSettings, run_job
from components.launch_pytorchjob.manifest import render_job
from components.preflight.core import LAUNCHER_ACCESS, PASS, WARN, PreflightResult, preflight
from components.run_summary.core import job_cleanup
from components.verify_nccl.core import fetch_pod_logs
from tests.k8s_server import (
    CRD_PATH,
    DAEMONSETS,
    DEFAULT_USER,
    DEPLOYMENTS,
    SSARS,
    TRAINING_OPERATOR_LABELS,
    Attributes,
    FakeKubernetes,
    Grant,
    Lifecycle,
    rbac_grants,
    request_info,
    rule_allows,
)

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
RBAC, CLUSTER_READ = DEPLOY / "rbac.yaml", DEPLOY / "rbac-cluster-read.yaml"
BOTH = (RBAC, CLUSTER_READ)
LINES = [f"step {i} loss {5 - i / 10:.2f}" for i in range(1, 7)]
IMAGE = "registry.example.com/ml/hyperpod-pretrain-trainer:1.0"
SECRET = "hunter2-wJalrXUtnFEMI-K7MDENG-bPxRfiCYEXAMPLEKEY"
FAST_KUBE = KubeSettings(request_timeout_s=5, attempts=3, backoff_s=0.01, max_backoff_s=0.02)
EVENT = "Back-off restarting failed container pytorch in pod {pod}"

pytestmark = pytest.mark.skipif(not CRD_PATH.is_file(), reason=f"the PyTorchJob CRD is not here ({CRD_PATH})")


# -- the authorizer's view of a request -------------------------------------------------------------------------


def attributes(method: str, path: str) -> Attributes:
    """A recorded request as the API server's RequestInfoFactory resolves it (k8s.io/apiserver/pkg/endpoints/request/
    requestinfo.go): the fake's resolver, plus the name a list or watch takes from a `metadata.name` field selector
    (`fieldSelector.RequiresExactMatch("metadata.name")`), which RBAC's resourceNames would then match."""
    split = urlsplit(path)
    params = dict(parse_qsl(split.query, keep_blank_values=True))
    attrs = request_info(method, split.path, params).attrs
    if attrs.verb in ("list", "watch") and not attrs.name:
        for term in params.get("fieldSelector", "").split(","):
            key, _, value = term.partition("==") if "==" in term else term.partition("=")
            if key.strip() == "metadata.name" and value and "/" not in value:  # "!=" leaves "metadata.name!"
                return replace(attrs, name=value)
    return attrs


def self_review(attrs: Attributes) -> bool:
    """A SelfSubjectAccessReview: the bootstrap ClusterRole system:basic-user lets every authenticated user create one,
    so it needs no rule in the deploy files."""
    return (attrs.verb, attrs.group, attrs.resource, attrs.name) == ("create", SSARS.group, SSARS.resource, "")


def granted(attrs: Attributes, grants: list[Grant]) -> bool:
    """RBAC's decision: a ClusterRoleBinding's rules apply everywhere, a RoleBinding's in its namespace only."""
    return self_review(attrs) or any(
        (grant.namespace is None or grant.namespace == attrs.namespace)
        and any(rule_allows(r, attrs) for r in grant.rules)
        for grant in grants
    )


def documents(*files: Path) -> list[dict[str, Any]]:
    return [doc for path in files for doc in yaml.safe_load_all(path.read_text()) if doc]


def grants_of(*files: Path) -> list[Grant]:
    return rbac_grants(documents(*files), DEFAULT_USER)


@dataclass(frozen=True)
class Permission:
    """One verb on one resource (and one resourceName, "" for any) that one binding of a deploy file gives."""

    file: str
    binding: str
    namespace: str | None  # a RoleBinding's namespace; None: a ClusterRoleBinding's, everywhere
    group: str
    resource: str  # "pods/log" for a subresource
    verb: str
    name: str = ""

    def allows(self, attrs: Attributes) -> bool:
        rule: dict[str, Any] = {"apiGroups": [self.group], "resources": [self.resource], "verbs": [self.verb]}
        if self.name:
            rule["resourceNames"] = [self.name]
        return (self.namespace is None or self.namespace == attrs.namespace) and rule_allows(rule, attrs)

    def __str__(self) -> str:
        scope = f"in {self.namespace}" if self.namespace is not None else "cluster-wide"
        named = f" {self.name!r}" if self.name else ""
        return f"{self.file}: {self.verb} {self.resource}{named} ({self.group or 'core'}) {scope} ({self.binding})"


def permissions(path: Path) -> list[Permission]:
    out = []
    for grant in grants_of(path):
        for rule in grant.rules:
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    for verb in rule["verbs"]:
                        for name in rule.get("resourceNames") or [""]:
                            out.append(Permission(path.name, grant.source.split(" of ")[0], grant.namespace, group,
                                                  resource, verb, name))  # fmt: skip
    return out


# -- the scenarios ------------------------------------------------------------------------------------------------


@dataclass
class Run:
    """What one scenario did: the deploy files it ran under, every request the server saw, what the code returned
    (or raised) and what it logged."""

    files: tuple[Path, ...]
    requests: list[tuple[str, str]]
    outcome: Any
    log: str
    deletions: list[tuple[str, str, str | None]] = field(default_factory=list)

    def refused(self) -> list[tuple[str, str]]:
        grants = grants_of(*self.files)
        return [(m, p) for m, p in self.requests if not granted(attributes(m, p), grants)]


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.name} {record.levelname} {record.getMessage()}")


@contextmanager
def recorded(
    *files: Path, lifecycle: Lifecycle | None = None, training_operator: str | None = "v1-5170a36"
) -> Iterator[tuple[FakeKubernetes, Lines]]:
    """A fake API server authorizing as `files` say, and the log lines written meanwhile."""
    handler = Lines()
    logging.getLogger().addHandler(handler)
    try:
        with FakeKubernetes(CRD_PATH, lifecycle, training_operator=training_operator) as server:
            assert server.use_rbac(documents(*files)), f"no binding in {files} names {server.user}"
            yield server, handler
    finally:
        logging.getLogger().removeHandler(handler)


def finish(server: FakeKubernetes, handler: Lines, files: tuple[Path, ...], outcome: Any) -> Run:
    return Run(files, list(server.requests), outcome, "\n".join(handler.lines), list(server.deletions))


def client(server: FakeKubernetes) -> kubernetes.client.ApiClient:
    return kubernetes.client.ApiClient(server.client_configuration())


def cluster_config(root: Path, run_id: str, **overrides: Any) -> LaunchConfig:
    settings: dict[str, Any] = dict(
        storage_root=str(root), dataset="synthetic", run_id=run_id, backend="kubernetes", nnodes=2,
        nproc_per_node=8, pipeline_run_id=f"pipeline-{run_id}", image=IMAGE, owner_reference=False, timeout_s=60,
    )  # fmt: skip
    return LaunchConfig(**{**settings, **overrides})


def fast(**overrides: Any) -> WatchSettings:
    return WatchSettings(**{"diagnose_every_s": 0.1, "poll_interval_s": 0.2, "replace_timeout_s": 30, **overrides})


def attempt(fn: Callable[[], Any]) -> Any:
    """What `fn` returned, or the StepFailed it raised."""
    try:
        return fn()
    except StepFailed as exc:
        return exc


def running(job: dict[str, Any] | None) -> bool:
    return any(
        c["type"] == "Running" and c["status"] == "True" for c in (job or {}).get("status", {}).get("conditions", [])
    )


def launch_streaming_all_logs(root: Path, tmp: Path) -> Run:
    """The launcher as the pipeline runs it (`launch`), every worker's log streamed; then verify_nccl's log fetch."""
    cfg = cluster_config(root, "rbac-ok", stream_logs="all")
    with recorded(RBAC, lifecycle=Lifecycle.success(workers=2, log_lines=LINES)) as (server, handler):
        result = launch(cfg, client(server))
        fetched = fetch_pod_logs(result.job_name, result.namespace, tmp / "pod-logs", client(server))
        return finish(server, handler, (RBAC,), (result, fetched))


def failed_launch(root: Path, tmp: Path) -> Run:
    """A job that fails: describe_failure reads the failed pod's last lines and its events."""
    lifecycle = Lifecycle.failure(failing_pod_lines=["RuntimeError: CUDA error: out of memory"],
                                  events=[("Warning", "BackOff", EVENT)])  # fmt: skip
    job = render_job(cluster_config(root, "rbac-bad").job_spec())
    with recorded(RBAC, lifecycle=lifecycle) as (server, handler):
        outcome = attempt(lambda: run_job(Kube(client(server)), job, fast(), threading.Event()))
        return finish(server, handler, (RBAC,), outcome)


def failed_attempt_replaced(root: Path, tmp: Path) -> Run:
    """A crash loop past the backoff limit, then the step again (KFP's retry): the failed job is deleted, waited
    for, and created again as attempt 2."""
    job = render_job(cluster_config(root, "rbac-retried").job_spec())
    with recorded(RBAC, lifecycle=Lifecycle.crash_loop(crashes=4)) as (server, handler):
        server.pod_termination_s = 0.3  # the old job stays, with its finalizer, while its pods terminate
        first = attempt(lambda: run_job(Kube(client(server)), job, fast(logs="none"), threading.Event()))
        server.lifecycle = Lifecycle.success(workers=2, log_lines=LINES[:2])
        second = run_job(Kube(client(server)), job, fast(), threading.Event())
        return finish(server, handler, (RBAC,), (first, second))


def cancelled_by_sigterm(root: Path, tmp: Path) -> Run:
    """What SigtermToEvent's handler does: ImmediateDelete's own delete, then the loop deletes again and raises."""
    job = render_job(cluster_config(root, "rbac-cancel").job_spec())
    name = job["metadata"]["name"]
    with recorded(RBAC, lifecycle=Lifecycle.running()) as (server, handler):
        api = client(server)
        delete_now, cancel, outcome = ImmediateDelete(api, "kubeflow", name), threading.Event(), []

        def owned(uid: str) -> None:
            delete_now.uid = uid

        def launcher() -> None:
            try:
                run_job(Kube(api), job, fast(), cancel, on_owned=owned)
            except BaseException as exc:
                outcome.append(exc)

        thread = threading.Thread(target=launcher, daemon=True)
        thread.start()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not (running(server.job("kubeflow", name)) and delete_now.uid):
            time.sleep(0.05)
        delete_now()  # first, so that the handler's delete is the one that finds the job
        cancel.set()
        thread.join(timeout=30)
        return finish(server, handler, (RBAC,), outcome[0] if outcome else None)


def exit_step_cleanup(root: Path, tmp: Path) -> Run:
    """The exit step after a terminated run whose launcher died: the job is still running, and is deleted."""
    cfg = cluster_config(root, "rbac-cleanup")
    with recorded(RBAC) as (server, handler):
        server.put_job(render_job(cfg.job_spec()))
        cleanup = job_cleanup("kubernetes", "kubeflow", cfg.run_id, cfg.pipeline_run_id, client(server))
        assert cleanup is not None
        return finish(server, handler, (RBAC,), (cleanup(), cleanup()))


def healthy_cluster(server: FakeKubernetes) -> None:
    """Two GPU nodes with room, a CPU node, the device plugins and the FSx PVC, its PersistentVolume and the
    StorageClass that provisioned it (as tests/test_preflight.py has them)."""
    for i in range(2):
        server.add_node(f"hyperpod-i-{i:02d}", deep_health_check="Passed")
    server.add_node("cpu-system", instance_type="ml.m5.2xlarge", health_status=None)
    server.add_pod("kube-system", "aws-node-0", node_name="hyperpod-i-00", requests={"cpu": "25m", "memory": "64Mi"})
    server.add_device_plugins()
    server.add_storage_class("fsx-sc", {"subnetId": "subnet-0123456789abcdef0", "deploymentType": "SCRATCH_2"})
    server.add_pvc("kubeflow", "fsx-lustre-pvc")


def preflight_config(**overrides: Any) -> LaunchConfig:
    return cluster_config(Path("/fsx"), "rbac-pf", instance_type="ml.p5.48xlarge", **overrides)


def preflight_under(*files: Path, operator_elsewhere: bool = False) -> Callable[[Path, Path], Run]:
    """The preflight on a healthy cluster under `files`; `operator_elsewhere`: the Training Operator installed under
    another name and namespace (found only by operator_version's fallback, a list by label)."""

    def scenario(root: Path, tmp: Path) -> Run:
        with recorded(*files, training_operator=None if operator_elsewhere else "v1-5170a36") as (server, handler):
            healthy_cluster(server)
            if operator_elsewhere:
                server.add_namespace("ml-operators")
                server.add_deployment("ml-operators", "kubeflow-training-operator", labels=TRAINING_OPERATOR_LABELS,
                                      image="kubeflow/training-operator:v1-5170a36")  # fmt: skip
            result = preflight(preflight_config(), client(server), settings=FAST_KUBE)
            return finish(server, handler, files, result)

    return scenario


SCENARIOS: dict[str, Callable[[Path, Path], Run]] = {
    "launch": launch_streaming_all_logs,
    "failed launch": failed_launch,
    "failed attempt replaced": failed_attempt_replaced,
    "sigterm": cancelled_by_sigterm,
    "exit step clean-up": exit_step_cleanup,
    "preflight": preflight_under(*BOTH),
    "preflight, operator elsewhere": preflight_under(*BOTH, operator_elsewhere=True),
    "preflight without cluster-read": preflight_under(RBAC),
    "preflight without cluster-read, operator elsewhere": preflight_under(RBAC, operator_elsewhere=True),
}


@pytest.fixture(scope="module")
def runs(staged_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Run]:
    """Each scenario run once for the module, when a test first asks for it."""
    done: dict[str, Run] = {}

    def get(name: str) -> Run:
        if name not in done:
            done[name] = SCENARIOS[name](staged_root, tmp_path_factory.mktemp("rbac"))
        return done[name]

    return get


def statuses(result: PreflightResult) -> dict[str, str]:
    return {c.name: c.status for c in result.checks}


# -- every call granted ---------------------------------------------------------------------------------------


def test_a_launch_streaming_every_workers_log_is_granted(runs: Callable[[str], Run]) -> None:
    run = runs("launch")
    result, fetched = run.outcome
    assert run.refused() == [] and " 403 " not in run.log and "forbidden" not in run.log.lower()
    assert (result.state, result.attempt) == ("Succeeded", 1)
    for worker in (0, 1):
        pod = f"{result.job_name}-worker-{worker}"
        assert [line.split(" ", 2)[2] for line in run.log.splitlines() if line.startswith(f"pod.{pod} ")] == LINES
    assert len(fetched) == 2, "verify_nccl read both pods' logs"


def test_a_failed_launch_reads_the_logs_and_events_it_is_granted(runs: Callable[[str], Run]) -> None:
    run = runs("failed launch")
    assert run.refused() == []
    assert isinstance(run.outcome, StepFailed) and "RuntimeError: CUDA error: out of memory" in str(run.outcome)
    assert "Warning BackOff: Back-off restarting failed container pytorch" in run.log
    assert "not readable by this service account" not in run.log and "without events" not in run.log


def test_replacing_a_failed_attempt_is_granted(runs: Callable[[str], Run]) -> None:
    run = runs("failed attempt replaced")
    first, second = run.outcome
    assert run.refused() == []
    assert isinstance(first, StepFailed) and "backoff limit" in str(first)
    assert (second.state, second.attempt, second.reattached) == ("Succeeded", 2, False)
    assert [d[2] for d in run.deletions] == ["Foreground"], "the failed job, once"


def test_sigterm_deletes_the_job_with_what_is_granted(runs: Callable[[str], Run]) -> None:
    run = runs("sigterm")
    assert run.refused() == []
    assert isinstance(run.outcome, Cancelled)
    assert "SIGTERM: deleted PyTorchJob" in run.log, "the handler's own delete went through"
    assert "failed at once" not in run.log
    assert {(ns, policy) for ns, _, policy in run.deletions} == {("kubeflow", "Foreground")}


def test_the_exit_steps_clean_up_is_granted(runs: Callable[[str], Run]) -> None:
    run = runs("exit step clean-up")
    deleted, again = run.outcome
    assert run.refused() == []
    assert deleted.endswith("was still running after the run ended: deleted") and len(run.deletions) == 1
    assert again.startswith("no PyTorchJob") or "being deleted" in again


@pytest.mark.parametrize("name", ["preflight", "preflight, operator elsewhere"])
def test_with_both_files_every_preflight_check_passes(runs: Callable[[str], Run], name: str) -> None:
    run = runs(name)
    assert run.refused() == []
    assert statuses(run.outcome) == dict.fromkeys(statuses(run.outcome), PASS), run.outcome.markdown()
    crd = next(c for c in run.outcome.checks if c.name == "crd")
    where = "ml-operators/kubeflow-training-operator" if "elsewhere" in name else "kubeflow/training-operator"
    assert crd.reason.endswith(f"Training Operator v1.8.1 ({where}, image tag v1-5170a36)")


def test_without_the_cluster_read_file_the_preflight_warns_that_it_could_not_look(runs: Callable[[str], Run]) -> None:
    run = runs("preflight without cluster-read")
    refused = {(a.verb, a.resource, a.namespace) for a in (attributes(m, p) for m, p in run.refused())}
    assert refused == {("list", "nodes", ""), ("list", "daemonsets", ""), ("get", "persistentvolumes", "")}, \
        "only the cluster-wide reads"  # fmt: skip
    result = run.outcome
    assert result.passed and statuses(result) == {"crd": PASS, "permissions": PASS, "fsx-pvc": PASS,
                                                  "checkpoint-throughput": WARN, "nodes": WARN, "device-plugins": WARN,
                                                  "image": PASS, "memory": PASS}  # fmt: skip
    for check in result.warnings:
        assert check.reason.startswith("cannot list") or "; cannot read PersistentVolume pvc-" in check.reason, check
        assert "kubectl apply -f deploy/rbac-cluster-read.yaml" in check.fix, check

    elsewhere = runs("preflight without cluster-read, operator elsewhere")
    crd = next(c for c in elsewhere.outcome.checks if c.name == "crd")
    assert crd.status == WARN and "cannot read Deployments" in crd.reason, "the fallback needs the cluster-read file"


# -- every rule used ----------------------------------------------------------------------------------------------


def test_every_rule_is_used_by_a_call(runs: Callable[[str], Run]) -> None:
    """Each verb x resource x resourceName of deploy/rbac.yaml is asked for by a call; each of
    deploy/rbac-cluster-read.yaml by a call that deploy/rbac.yaml alone would refuse (nothing granted twice)."""
    everything = [runs(name) for name in SCENARIOS]
    base = grants_of(RBAC)
    for path in BOTH:
        asked = [attributes(m, p) for run in everything if path in run.files for m, p in run.requests]
        for permission in permissions(path):
            uses = [a for a in asked if permission.allows(a) and (path == RBAC or not granted(a, base))]
            assert uses, f"no call uses {permission}"


def test_the_launchers_access_check_asks_for_what_the_role_grants() -> None:
    """The preflight's SelfSubjectAccessReviews (LAUNCHER_ACCESS) ask about the Role's grants for the launcher and
    the exit step's clean-up: all of them, and nothing else. The Role's PVC read is the preflight's own."""
    role = {(p.verb, p.group, *p.resource.partition("/")[::2]) for p in permissions(RBAC) if p.namespace is not None}
    asked = {(verb, group, resource, subresource) for verb, group, resource, subresource, _ in LAUNCHER_ACCESS}
    assert role - asked == {("get", "", "persistentvolumeclaims", "")}
    assert asked <= role and len(asked) == len(LAUNCHER_ACCESS)


def test_the_grants_hold_no_wildcard_no_secret_and_write_only_pytorchjobs() -> None:
    for path in BOTH:
        for doc in documents(path):
            if doc["kind"].endswith("Binding"):
                assert doc["subjects"] == [{"kind": "ServiceAccount", "name": "pipeline-runner",
                                            "namespace": "kubeflow"}], doc  # fmt: skip
        for permission in permissions(path):
            assert "*" not in (permission.group, permission.resource, permission.verb), permission
            assert permission.resource != "secrets", permission
            assert permission.verb in ("get", "list", "watch") or permission.resource == "pytorchjobs", permission


# -- reading pods cluster-wide leaks no secret ------------------------------------------------------------------


def test_a_plain_text_secret_in_another_namespaces_pod_reaches_neither_report_nor_log(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The preflight lists every pod in the cluster for its node and its requests only: a credential written in plain
    text in another team's pod env is in the answer, and must go no further (report, JSON, logs at any level)."""
    caplog.set_level(logging.DEBUG)
    with recorded(*BOTH) as (server, _):
        healthy_cluster(server)
        server.add_namespace("team-b")
        server.add_pod("team-b", "their-trainer", node_name="hyperpod-i-00", containers=[{
            "name": "main", "image": "team-b/trainer:3", "resources": {"requests": {"nvidia.com/gpu": "8"}},
            "env": [{"name": "AWS_ACCESS_KEY_ID", "value": "AKIAIOSFODNN7EXAMPLE"},
                    {"name": "AWS_SECRET_ACCESS_KEY", "value": SECRET}],
        }])  # fmt: skip
        # The device plugins and the operator are read whole too (their DaemonSet and Deployment): the same rule.
        secret_env = [{"name": "PROXY_PASSWORD", "value": SECRET}]
        for kind, ns, name in ((DAEMONSETS, "kube-system", "aws-efa-k8s-device-plugin-daemonset"),
                               (DEPLOYMENTS, "kubeflow", "training-operator")):  # fmt: skip
            server._update(kind, ns, name, lambda o: o["spec"]["template"]["spec"]["containers"][0].update(
                env=secret_env))  # fmt: skip
        result = preflight(preflight_config(), client(server), settings=FAST_KUBE)
        command = [sys.executable, "-m", "pipelines.cli", "preflight", "--json", "--storage-root", "/fsx", "--dataset",
                   "synthetic", "--run-id", "rbac-pf", "--nnodes", "2", "--nproc-per-node", "8", "--image", IMAGE,
                   "--instance-type", "ml.p5.48xlarge", "--no-owner-reference"]  # fmt: skip
        env = {**os.environ, "KUBECONFIG": str(server.write_kubeconfig(tmp_path / "kubeconfig"))}
        cli = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
        requests = list(server.requests)
    assert any(attributes(m, p) == Attributes("list", "", "pods") for m, p in requests), "pods read cluster-wide"
    nodes = next(c for c in result.checks if c.name == "nodes")
    assert "hyperpod-i-00: nvidia.com/gpu 8 requested, 0 free" in nodes.reason, "their pod was counted"
    assert cli.returncode == 0, cli.stderr
    assert json.loads(cli.stdout)["checks"] == result.to_json()["checks"]
    for text in (result.markdown(), json.dumps(result.to_json()), caplog.text, cli.stdout, cli.stderr):
        assert SECRET not in text and "AKIAIOSFODNN7EXAMPLE" not in text
