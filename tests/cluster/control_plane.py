"""A real Kubernetes control plane for the tests: etcd, kube-apiserver and kube-controller-manager on loopback.

envtest's way (controller-runtime's ``pkg/envtest``): the binaries come from ``KUBEBUILDER_ASSETS`` (``etcd``,
``kube-apiserver``, and ``kube-controller-manager`` where present) or else from ``../shared/k8s`` beside the
repository (gzip files, unpacked once into a cache and checked against its ``SHA256SUMS``). Without either, the tests
that need them skip with :data:`SKIP_REASON`; without a controller manager (envtest never ships one), those that need
the garbage collector skip.

What a control plane does not run (the operators, Kueue, the kubelet and scheduler) is played by the modules beside
this one. The flags, the controller allow-list and the traps are those measured in ``../shared/k8s/README.md``.
"""

from __future__ import annotations

import base64
import contextlib
import copy
import ctypes
import gzip
import hashlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import kubernetes
import urllib3
import yaml
from kubernetes.client.exceptions import ApiException

from tests.cluster.tls import rsa_key_pair

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[2]
SHARED = REPO.parent / "shared"
SHARED_K8S = SHARED / "k8s"
PYTORCHJOB_CRD = Path(
    os.environ.get("PYTORCHJOB_CRD") or SHARED / "reference/crds/kubeflow.org_pytorchjobs.v1.8.1.yaml"
)
# Kubeflow Trainer v2.3.0's CRDs and the JobSet v0.12.0 CRD it runs through (reference/crds/SOURCES.md), and the
# default torch-distributed ClusterTrainingRuntime; a directory of its own with TRAINER_CRDS.
TRAINER_CRDS_DIR = Path(os.environ.get("TRAINER_CRDS") or SHARED / "reference/crds")
TRAINER_CRDS = tuple(
    TRAINER_CRDS_DIR / name
    for name in (
        "trainer.kubeflow.org_trainjobs.v2.3.0.yaml",
        "trainer.kubeflow.org_clustertrainingruntimes.v2.3.0.yaml",
        "trainer.kubeflow.org_trainingruntimes.v2.3.0.yaml",
        "jobset.x-k8s.io_jobsets.v0.12.0.yaml",
    )
)
TORCH_RUNTIME = TRAINER_CRDS_DIR / "torch_distributed.runtime.v2.3.0.yaml"
# The HyperPodPyTorchJob CRD: ours (AWS publishes none; its header says what it is derived from), so read from the
# project, never from ../shared; installed in every control plane a test session starts, not in its spares.
HYPERPODPYTORCHJOB_CRD = Path(__file__).resolve().parent / "crds/sagemaker.amazonaws.com_hyperpodpytorchjobs.yaml"
RBAC_FILES = (
    REPO / "deploy/rbac.yaml",
    REPO / "deploy/rbac-cluster-read.yaml",
    REPO / "deploy/rbac-pytorchjob.yaml",
    REPO / "deploy/rbac-trainjob.yaml",
    REPO / "deploy/rbac-hyperpodpytorchjob.yaml",
)
WITHOUT_CLUSTER_READ = tuple(path for path in RBAC_FILES if path.name != "rbac-cluster-read.yaml")

RUNNER_NAMESPACE, RUNNER_ACCOUNT = "kubeflow", "pipeline-runner"  # the account deploy/rbac*.yaml bind
RUNNER_USER = f"system:serviceaccount:{RUNNER_NAMESPACE}:{RUNNER_ACCOUNT}"
ADMIN_USER = "admin"
ACCOUNTS = "system:serviceaccounts"  # the group of every service account
LESS_GRANTED = "less-granted-runner"  # the account a test of less granted runs as, in its own namespace
LAUNCHER_ROLE = "hyperpod-pretrain-launcher"  # deploy/rbac.yaml's Role for the jobs' namespace
# deploy/rbac-<job api>.yaml's, for the jobs' namespace too
JOB_ROLES = ("hyperpod-pretrain-pytorchjob", "hyperpod-pretrain-trainjob", "hyperpod-pretrain-hyperpodpytorchjob")
ISSUER = "https://kubernetes.default.svc.cluster.local"
# Only what a test needs of the controller manager: anything more overwrites what the players write (README, "Flags").
# The Job controller is the real one: it makes the pods of the batch Jobs the JobSet player creates (indexed
# completion, backoffLimit, deleting the pods of a failed or suspended Job); nothing else here makes batch Jobs.
# The ClusterRole aggregation controller fills Kubeflow's kubeflow-edit from the roles its labels select
# (tests/cluster/kubeflow.py); it touches no ClusterRole without an aggregationRule.
CONTROLLERS = (
    "garbage-collector-controller,namespace-controller,serviceaccount-controller,job-controller,"
    "clusterrole-aggregation-controller"
)


@dataclass(frozen=True)
class Binaries:
    etcd: Path
    kube_apiserver: Path
    kube_controller_manager: Path | None
    source: str


def _cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hyperpod-pretrain/k8s"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _unpack_shared(bin_dir: Path, sums_file: Path) -> Path:
    """``bin/*.gz`` unpacked into the cache, each checked against SHA256SUMS, atomically (temp name, rename)."""
    sums = dict(reversed(line.split()) for line in sums_file.read_text().splitlines() if line.strip())
    target = _cache_dir() / hashlib.sha256(sums_file.read_bytes()).hexdigest()[:16]
    target.mkdir(parents=True, exist_ok=True)
    for name, expected in sums.items():
        final = target / name
        if final.is_file() and os.access(final, os.X_OK):
            continue  # written only after its checksum matched
        fd, tmp = tempfile.mkstemp(dir=target, prefix=f".{name}.")
        try:
            with os.fdopen(fd, "wb") as out, gzip.open(bin_dir / f"{name}.gz", "rb") as packed:
                shutil.copyfileobj(packed, out, 1 << 20)
            if (actual := _sha256(Path(tmp))) != expected:
                raise RuntimeError(f"{bin_dir / name}.gz unpacks to sha256 {actual}, not {expected} (SHA256SUMS)")
            os.chmod(tmp, 0o755)
            os.replace(tmp, final)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
    return target


def locate_binaries() -> tuple[Binaries | None, str]:
    """The binaries, or None and why not."""
    if assets := os.environ.get("KUBEBUILDER_ASSETS"):
        root = Path(assets)
        missing = [n for n in ("etcd", "kube-apiserver") if not (root / n).is_file()]
        if missing:
            return None, f"KUBEBUILDER_ASSETS={assets} has no {', '.join(missing)}"
        manager = root / "kube-controller-manager"
        return Binaries(
            root / "etcd",
            root / "kube-apiserver",
            manager if manager.is_file() else None,
            f"KUBEBUILDER_ASSETS={assets}",
        ), ""
    if not (SHARED_K8S / "SHA256SUMS").is_file():
        return None, (
            f"no Kubernetes control plane: set KUBEBUILDER_ASSETS, or put shared/k8s beside the repository "
            f"({SHARED_K8S})"
        )
    root = _unpack_shared(SHARED_K8S / "bin", SHARED_K8S / "SHA256SUMS")
    return Binaries(root / "etcd", root / "kube-apiserver", root / "kube-controller-manager", str(SHARED_K8S)), ""


def skip_reason() -> str:
    """Why the control-plane tests cannot run here ('' when they can)."""
    if reason := locate_binaries()[1]:
        return reason
    if not PYTORCHJOB_CRD.is_file():
        return f"the PyTorchJob CRD is not here ({PYTORCHJOB_CRD}; set PYTORCHJOB_CRD)"
    return ""


def trainer_crds() -> list[Path]:
    """The Trainer and JobSet CRDs to install beside the PyTorchJob CRD: all four, or none where any is missing."""
    return list(TRAINER_CRDS) if not trainer_skip_reason() else []


def trainer_skip_reason() -> str:
    """Why the TrainJob tests cannot run here ('' when they can): the control plane's reason, or a missing CRD."""
    if reason := skip_reason():
        return reason
    missing = [p.name for p in (*TRAINER_CRDS, TORCH_RUNTIME) if not p.is_file()]
    if missing:
        return (
            f"the Trainer v2.3.0 / JobSet v0.12.0 files are not here ({TRAINER_CRDS_DIR}: {', '.join(missing)}; "
            f"set TRAINER_CRDS)"
        )
    return ""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the test process dies (prctl PR_SET_PDEATHSIG)."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)


class ControlPlane:
    """etcd, kube-apiserver (RBAC, audit log, service-account tokens) and, where present, the controller manager.

    ``admin`` is an ApiClient in ``system:masters``; :meth:`runner_client` one with the pipeline runner's real
    service-account token, which only ``deploy/rbac*.yaml`` empower. Requests by the runner are recorded in
    :attr:`audit_log` (ResponseComplete events, Metadata level).
    """

    def __init__(self, binaries: Binaries, workdir: Path, crds: list[Path], *, etcd_url: str = ""):
        self.binaries, self.workdir, self.crds = binaries, workdir, crds
        # Given: another plane's etcd, under a store of this server's own (a spare; see spare()).
        self.etcd_url, self.etcd_prefix = etcd_url, f"/spare-{uuid.uuid4().hex[:8]}" if etcd_url else ""
        self.processes: dict[str, subprocess.Popen] = {}
        self.port = 0
        self.url = ""
        self.admin_token = uuid.uuid4().hex
        self.ca_file = workdir / "certs/apiserver.crt"
        self.audit_log = workdir / "audit.log"
        self.spare_audit_logs: list[Path] = []
        self.admin: kubernetes.client.ApiClient | None = None
        self._runner_token = ""
        self._namespaces = 0
        # namespace -> the token of the account its tests run as instead of the runner (a less-granted account, a
        # profile's default-editor), and what was made for it outside the namespace (removed with it)
        self._accounts: dict[str, tuple[str, list[dict[str, Any]]]] = {}
        # Players that serve the whole control plane (admission webhooks), registered by the test fixture.
        self.webhook: Any = None
        self.kueue: Any = None
        self.jobset_webhook: Any = None  # JobSet v0.12.0's defaulting webhook, where the Trainer CRDs are installed
        self.trainer_webhooks: Any = None  # Trainer v2.3.0's TrainJob defaulting and validating webhooks

    @property
    def has_controller_manager(self) -> bool:
        return "kube-controller-manager" in self.processes

    # -- start and stop ---------------------------------------------------------------------------------------

    def start(self) -> ControlPlane:
        self.workdir.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        if not self.etcd_url:
            self._start_etcd()
        self._start_apiserver()
        self.admin = kubernetes.client.ApiClient(self.configuration(self.admin_token))
        own = [] if self.etcd_prefix else [HYPERPODPYTORCHJOB_CRD]  # a spare gets only the CRDs it is given
        for crd in [*self.crds, *own]:  # before the controller manager, so that its garbage collector knows them
            self.install_crd(crd)
        if self.binaries.kube_controller_manager is not None and not self.etcd_prefix:
            self._start_controller_manager()
        self._setup_runner()
        log.info(
            "control plane up in %.1fs: %s (binaries from %s)",
            time.monotonic() - started,
            self.url,
            self.binaries.source,
        )
        return self

    def stop(self) -> None:
        """Controller manager, then API server, then etcd (an API server outlives SIGTERM once etcd is gone)."""
        for name in ("kube-controller-manager", "kube-apiserver", "etcd"):
            process = self.processes.pop(name, None)
            if process is None or process.poll() is not None:
                continue
            process.terminate()
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=5)
        if self.admin is not None:
            self.admin.close()

    def _spawn(self, name: str, path: Path, args: list[str]) -> subprocess.Popen:
        logfile = open(self.workdir / f"{name}.log", "ab")  # noqa: SIM115 (the child holds it)
        process = subprocess.Popen(
            [name, *args],
            executable=str(path),
            stdout=logfile,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            preexec_fn=_die_with_parent,
            cwd=self.workdir,
        )
        logfile.close()
        self.processes[name] = process
        return process

    def _wait(self, name: str, ready: Any, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.processes[name].poll() is not None:
                raise RuntimeError(f"{name} exited with {self.processes[name].returncode}: {self.log_tail(name)}")
            if ready():
                return
            time.sleep(0.1)
        raise RuntimeError(f"{name} not ready within {timeout_s:.0f}s: {self.log_tail(name)}")

    def log_tail(self, name: str, lines: int = 30) -> str:
        path = self.workdir / f"{name}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    def _start_etcd(self) -> None:
        client, peer = f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"
        self.etcd_url = client
        self._spawn(
            "etcd",
            self.binaries.etcd,
            [
                "--name",
                "test",
                "--data-dir",
                str(self.workdir / "etcd"),
                "--listen-client-urls",
                client,
                "--advertise-client-urls",
                client,
                "--listen-peer-urls",
                peer,
                "--initial-advertise-peer-urls",
                peer,
                "--initial-cluster",
                f"test={peer}",
                "--listen-metrics-urls",
                "",
            ],
        )
        http = urllib3.PoolManager(timeout=1.0, retries=False)

        def healthy() -> bool:
            try:
                return http.request("GET", f"{client}/health").status == 200
            except urllib3.exceptions.HTTPError:
                return False

        self._wait("etcd", healthy)

    def _start_apiserver(self) -> None:
        self.port = free_port()
        self.url = f"https://127.0.0.1:{self.port}"
        (self.workdir / "certs").mkdir(exist_ok=True)
        sa_key, sa_pub = self.workdir / "sa.key", self.workdir / "sa.pub"
        rsa_key_pair(sa_key, sa_pub)
        tokens = self.workdir / "tokens.csv"
        tokens.write_text(f'{self.admin_token},{ADMIN_USER},admin-uid,"system:masters"\n')
        policy = self.workdir / "audit-policy.yaml"
        policy.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "audit.k8s.io/v1",
                    "kind": "Policy",
                    "omitStages": ["RequestReceived"],
                    # Deletes at Request level: their DeleteOptions (propagationPolicy, preconditions) are in
                    # requestObject.
                    # Every service account: the runner, and the less-granted identities of tests that run with less.
                    "rules": [
                        {"level": "Request", "userGroups": [ACCOUNTS], "verbs": ["delete"]},
                        {"level": "Metadata", "userGroups": [ACCOUNTS]},
                        {"level": "None"},
                    ],
                }
            )
        )
        self._spawn(
            "kube-apiserver",
            self.binaries.kube_apiserver,
            [
                "--etcd-servers",
                self.etcd_url,
                "--bind-address",
                "127.0.0.1",
                "--advertise-address",
                "127.0.0.1",
                "--secure-port",
                str(self.port),
                "--cert-dir",
                str(self.workdir / "certs"),
                "--endpoint-reconciler-type",
                "none",
                "--token-auth-file",
                str(tokens),
                "--authorization-mode",
                "RBAC",
                "--service-account-issuer",
                ISSUER,
                "--service-account-key-file",
                str(sa_pub),
                "--service-account-signing-key-file",
                str(sa_key),
                "--api-audiences",
                ISSUER,
                "--service-cluster-ip-range",
                "10.96.0.0/16",
                "--allow-privileged=true",
                "--kubelet-preferred-address-types",
                "InternalIP",  # never a DNS lookup of a node's name
                "--audit-policy-file",
                str(policy),
                "--audit-log-path",
                str(self.audit_log),
                "--audit-log-maxsize",
                "0",
                # No watch cache for PyTorchJobs: a watch from a compacted resourceVersion then answers 410 at once
                # (README, "Watches that expire").
                "--watch-cache-sizes",
                "pytorchjobs.kubeflow.org#0",
                *(["--etcd-prefix", self.etcd_prefix] if self.etcd_prefix else []),
            ],
        )
        http = urllib3.PoolManager(timeout=2.0, retries=False, cert_reqs="CERT_NONE")
        headers = {"Authorization": f"Bearer {self.admin_token}"}

        def ready() -> bool:
            try:
                return http.request("GET", f"{self.url}/readyz", headers=headers).status == 200
            except urllib3.exceptions.HTTPError:
                return False

        with _quiet_insecure_warning():
            self._wait("kube-apiserver", ready)

    def _start_controller_manager(self) -> None:
        kubeconfig = self.write_kubeconfig(self.workdir / "admin.kubeconfig", self.admin_token)
        self._spawn(
            "kube-controller-manager",
            self.binaries.kube_controller_manager,
            [
                "--kubeconfig",
                str(kubeconfig),
                "--authentication-kubeconfig",
                str(kubeconfig),
                "--authorization-kubeconfig",
                str(kubeconfig),
                "--authentication-skip-lookup",
                "--bind-address",
                "127.0.0.1",
                "--secure-port",
                "0",
                "--leader-elect=false",
                "--use-service-account-credentials=false",
                "--service-account-private-key-file",
                str(self.workdir / "sa.key"),
                "--root-ca-file",
                str(self.ca_file),
                "--flex-volume-plugin-dir",
                str(self.workdir / "flexvolume"),
                "--controllers",
                CONTROLLERS,
            ],
        )
        self._wait(
            "kube-controller-manager",
            lambda: "all resource monitors have synced" in self.log_tail("kube-controller-manager", 400),
        )

    # -- clients and identities -------------------------------------------------------------------------------

    def configuration(self, token: str, host: str = "") -> kubernetes.client.Configuration:
        cfg = kubernetes.client.Configuration()
        cfg.host = host or self.url
        cfg.ssl_ca_cert = str(self.ca_file)
        cfg.api_key = {"authorization": f"Bearer {token}"}
        return cfg

    def runner_client(self, host: str = "", namespace: str = "") -> kubernetes.client.ApiClient:
        """An ApiClient that is the pipeline runner (a real token from the TokenRequest API); ``host``: a proxy. For a
        namespace made with less granted, the client is that namespace's less-granted account."""
        return kubernetes.client.ApiClient(self.configuration(self.token_for(namespace), host))

    def token_for(self, namespace: str = "") -> str:
        account = self._accounts.get(namespace)
        return account[0] if account else self._runner_token

    @property
    def runner_token(self) -> str:
        return self._runner_token

    def write_kubeconfig(self, path: Path, token: str = "", host: str = "") -> Path:
        path.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "current-context": "test",
                    "clusters": [
                        {
                            "name": "test",
                            "cluster": {"server": host or self.url, "certificate-authority": str(self.ca_file)},
                        }
                    ],
                    "users": [{"name": "test", "user": {"token": token or self._runner_token}}],
                    "contexts": [{"name": "test", "context": {"cluster": "test", "user": "test"}}],
                }
            )
        )
        return path

    def _setup_runner(self) -> None:
        self.create_namespace(RUNNER_NAMESPACE)
        self._runner_token = self._token(RUNNER_NAMESPACE, RUNNER_ACCOUNT)
        for doc in deploy_grants():  # all but the launcher's Role and RoleBinding, which go in each test namespace
            if not _for_the_jobs_namespace(doc):
                self.apply(doc)

    def _token(self, namespace: str, account: str) -> str:
        core = kubernetes.client.CoreV1Api(self.admin)
        core.create_namespaced_service_account(namespace, {"metadata": {"name": account}})
        return self.token_of(namespace, account)

    def token_of(self, namespace: str, account: str, audience: str = ISSUER) -> str:
        """A token of an existing service account, from the TokenRequest API."""
        request = {"spec": {"audiences": [audience], "expirationSeconds": 24 * 3600}}
        core = kubernetes.client.CoreV1Api(self.admin)
        return core.create_namespaced_service_account_token(account, namespace, request).status.token

    def run_as(self, namespace: str, token: str, made: list[dict[str, Any]]) -> None:
        """The tests in ``namespace`` run as the account of ``token``; ``made``: its grants outside the namespace
        (cluster-scoped, or in another namespace), removed with it."""
        self._accounts[namespace] = token, made

    def _grant_less(self, namespace: str, grants: list[dict[str, Any]]) -> None:
        """The account LESS_GRANTED in ``namespace``, bound to ``grants`` (deploy_grants() with rules cut) instead of
        the runner: the runner's own grants stay whole, so that it meets no 403 all session. What is cluster-scoped or
        in another namespace is named after the test's namespace and removed with it."""
        token = self._token(namespace, LESS_GRANTED)
        made: list[dict[str, Any]] = []
        subject = {"kind": "ServiceAccount", "name": LESS_GRANTED, "namespace": namespace}
        for doc in grants:
            doc = copy.deepcopy(doc)
            meta = doc["metadata"]
            if _for_the_jobs_namespace(doc):
                meta["namespace"] = namespace
            else:
                meta["name"] = f"{meta['name']}.{namespace}"
                if doc["kind"].endswith("Binding"):
                    doc["roleRef"]["name"] = f"{doc['roleRef']['name']}.{namespace}"
                made.append(doc)
            if doc["kind"].endswith("Binding"):
                doc["subjects"] = [subject]
            self.apply(doc)
        self.run_as(namespace, token, made)

    # -- objects ----------------------------------------------------------------------------------------------

    def install_crd(self, crd: Path | dict[str, Any]) -> None:
        """Install a CRD (a file, or a document) and wait until it is Established."""
        if isinstance(crd, Path):
            crd = read_crd(crd)
        api = kubernetes.client.ApiextensionsV1Api(self.admin)
        api.create_custom_resource_definition(crd)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            status = api.read_custom_resource_definition(crd["metadata"]["name"]).status
            if any(c.type == "Established" and c.status == "True" for c in status.conditions or []):
                return
            time.sleep(0.1)
        raise RuntimeError(f"CRD {crd['metadata']['name']} not Established within 30s")

    def remove_crd(self, name: str) -> None:
        """Delete a CRD and wait until it is gone (its objects with it; the API server's own finalizer)."""
        api = kubernetes.client.ApiextensionsV1Api(self.admin)
        api.delete_custom_resource_definition(name)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                api.read_custom_resource_definition(name)
            except ApiException as exc:
                if exc.status == 404:
                    return
                raise
            time.sleep(0.1)
        raise RuntimeError(f"CRD {name} not gone within 30s")

    def apply(self, doc: dict[str, Any], namespace: str = "") -> dict[str, Any]:
        """Create one object as the admin (the RBAC kinds and namespaces the fixtures need)."""
        rbac = kubernetes.client.RbacAuthorizationV1Api(self.admin)
        kind = doc["kind"]
        if namespace:
            doc = {**doc, "metadata": {**doc["metadata"], "namespace": namespace}}
        if kind in ("Role", "RoleBinding") and doc["metadata"]["namespace"] != namespace:
            self.ensure_namespace(doc["metadata"]["namespace"])
        create = {
            "ClusterRole": lambda: rbac.create_cluster_role(doc),
            "ClusterRoleBinding": lambda: rbac.create_cluster_role_binding(doc),
            "Role": lambda: rbac.create_namespaced_role(doc["metadata"]["namespace"], doc),
            "RoleBinding": lambda: rbac.create_namespaced_role_binding(doc["metadata"]["namespace"], doc),
        }[kind]
        return self.admin.sanitize_for_serialization(create())

    def create_namespace(self, name: str) -> None:
        core = kubernetes.client.CoreV1Api(self.admin)
        core.create_namespace({"metadata": {"name": name}})
        if self.has_controller_manager:  # its serviceaccount controller makes "default"; pods are refused before
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                try:
                    core.read_namespaced_service_account("default", name)
                    return
                except ApiException as exc:
                    if exc.status != 404:
                        raise
                time.sleep(0.05)
            raise RuntimeError(f"namespace {name}: no default ServiceAccount within 30s")
        core.create_namespaced_service_account(name, {"metadata": {"name": "default"}})

    def ensure_namespace(self, name: str) -> None:
        """``name`` exists (a system namespace the API server itself may be creating at this moment, say)."""
        with contextlib.suppress(ApiException):
            kubernetes.client.CoreV1Api(self.admin).read_namespace(name)
            return
        try:
            self.create_namespace(name)
        except ApiException as exc:
            if exc.status != 409:
                raise

    def namespace_name(self) -> str:
        """A fresh test namespace's name (hyperpod-t<n>-...: tests/test_rbac.py reads every such as the jobs')."""
        self._namespaces += 1
        return f"hyperpod-t{self._namespaces}-{uuid.uuid4().hex[:5]}"

    def test_namespace(self, grants: list[dict[str, Any]] | None = None) -> str:
        """A fresh namespace with deploy/rbac.yaml's launcher Role and RoleBinding in it for the runner; with
        ``grants`` (a test of less granted: deploy_grants() with rules cut), bound to an account of its own instead."""
        name = self.namespace_name()
        self.create_namespace(name)
        if grants is not None:
            self._grant_less(name, grants)
            return name
        for doc in deploy_grants():
            if _for_the_jobs_namespace(doc):
                self.apply(doc, namespace=name)
        return name

    def delete_namespace(self, name: str) -> None:
        """Not waited for: deleting a namespace takes ~5 s (README, "Measured"). A less-granted account's grants
        outside the namespace go with it."""
        _, made = self._accounts.pop(name, ("", []))
        for doc in made:
            meta = doc["metadata"]
            where = f"namespaces/{meta['namespace']}/" if "namespace" in meta else ""
            path = f"/apis/rbac.authorization.k8s.io/v1/{where}{doc['kind'].lower()}s/{meta['name']}"
            with contextlib.suppress(ApiException):
                self.admin.call_api(path, "DELETE", auth_settings=["BearerToken"], _preload_content=False)
        with contextlib.suppress(ApiException):
            kubernetes.client.CoreV1Api(self.admin).delete_namespace(name)

    @contextlib.contextmanager
    def spare(self, workdir: Path, crds: list[Path]) -> Iterator[ControlPlane]:
        """Another API server over this etcd, on a fresh ``--etcd-prefix``: a store of its own (~2 s to start;
        README, "Measured"), for a test that must remove or change a CRD without touching this plane's."""
        other = ControlPlane(self.binaries, workdir, crds, etcd_url=self.etcd_url)
        self.spare_audit_logs.append(other.audit_log)  # the runner's requests there count as much as here
        try:
            yield other.start()
        finally:
            other.stop()

    def compact(self) -> None:
        """Compact etcd's history up to now: a watch from an older resourceVersion then answers 410 (the API server
        runs without a watch cache for PyTorchJobs; README, "Watches that expire")."""
        http = urllib3.PoolManager(timeout=5.0, retries=False)
        key = base64.b64encode(b"/").decode()
        revision = json.loads(
            http.request(
                "POST", f"{self.etcd_url}/v3/kv/range", body=json.dumps({"key": key, "limit": 1}).encode()
            ).data
        )["header"]["revision"]
        http.request("POST", f"{self.etcd_url}/v3/kv/compaction", body=json.dumps({"revision": revision}).encode())

    # -- what the server recorded -----------------------------------------------------------------------------

    def audit_events(
        self, namespace: str | None = None, user: str | None = None, since: str = ""
    ) -> list[dict[str, Any]]:
        """Service accounts' completed requests (ResponseComplete audit events), optionally in one namespace, by one
        user (:data:`RUNNER_USER`: the runner), or received from ``since`` on (:func:`audit_time`; a watch or log
        stream of an earlier test may complete later)."""
        lines: list[str] = []
        for path in (self.audit_log, *self.spare_audit_logs):
            with contextlib.suppress(FileNotFoundError):
                lines += complete_lines(path)
        events = []
        for line in lines:
            event = json.loads(line)
            if event.get("stage") != "ResponseComplete":
                continue
            if namespace is not None and (event.get("objectRef") or {}).get("namespace") != namespace:
                continue
            if event["requestReceivedTimestamp"] < since:
                continue
            if user is None or event["user"]["username"] == user:
                events.append(event)
        if self.spare_audit_logs:  # in the order they completed, as one log would have them
            events.sort(key=lambda e: e["stageTimestamp"])
        return events

    def request_counts(self, resource: str, subresource: str = "") -> dict[tuple[str, str], float]:
        """``apiserver_request_total`` for one resource (and subresource), by (verb, code), from /metrics."""
        text = self.admin.call_api(
            "/metrics", "GET", auth_settings=["BearerToken"], response_type="str", _preload_content=False
        )[0].data.decode()
        counts: dict[tuple[str, str], float] = {}
        for line in text.splitlines():
            if not line.startswith("apiserver_request_total{"):
                continue
            labels_text, _, value = line[len("apiserver_request_total{") :].rpartition("} ")
            labels = dict(part.split("=", 1) for part in _split_labels(labels_text))
            labels = {k: v.strip('"') for k, v in labels.items()}
            if labels.get("resource") == resource and labels.get("subresource", "") == subresource:
                key = labels.get("verb", ""), labels.get("code", "")
                counts[key] = counts.get(key, 0.0) + float(value)
        return counts


def read_crd(path: Path) -> dict[str, Any]:
    """A CRD file's document (libyaml's loader where present: the PyTorchJob CRD is ~8,000 lines)."""
    return yaml.load(path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


def audit_time() -> str:
    """Now, as the audit log writes times (metav1.MicroTime: RFC 3339 with six fractional digits, UTC)."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def deploy_grants(files: tuple[Path, ...] = RBAC_FILES, without: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """The RBAC documents of ``files``; ``without``: verbs cut from their rules, as ``"list pods"`` (every Role and
    ClusterRole) or ``"hyperpod-pretrain-cluster-read: list pods"`` (one of them): what a test of less granted binds."""
    cuts = [(role, *what.split()) for role, _, what in (w.rpartition(": ") for w in without)]
    docs = []
    for path in files:
        for doc in yaml.safe_load_all(path.read_text()):
            if not doc:
                continue
            if "rules" in doc:
                name = doc["metadata"]["name"]
                rules = []
                for rule in doc["rules"]:
                    if not any(role in ("", name) and resource in rule["resources"] for role, _, resource in cuts):
                        rules.append(rule)
                        continue
                    for resource in rule["resources"]:  # the rule split by resource, to cut one of them
                        cut = {v for role, v, r in cuts if role in ("", name) and r == resource}
                        if verbs := [v for v in rule["verbs"] if v not in cut]:
                            rules.append({**rule, "resources": [resource], "verbs": verbs})
                doc = {**doc, "rules": rules}
            docs.append(doc)
    return docs


def _for_the_jobs_namespace(doc: dict[str, Any]) -> bool:
    """The launcher's Roles and their bindings (deploy/rbac.yaml's, and each job API's): written for namespace
    kubeflow, applied in the job's."""
    return doc["kind"] in ("Role", "RoleBinding") and doc["metadata"]["name"] in (LAUNCHER_ROLE, *JOB_ROLES)


def _split_labels(text: str) -> Iterator[str]:
    """Prometheus label pairs ``a="x",b="y"``, split on the commas outside quotes."""
    start, quoted = 0, False
    for i, char in enumerate(text):
        if char == '"' and (i == 0 or text[i - 1] != "\\"):
            quoted = not quoted
        elif char == "," and not quoted:
            yield text[start:i]
            start = i + 1
    if text[start:]:
        yield text[start:]


@contextlib.contextmanager
def _quiet_insecure_warning() -> Iterator[None]:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", urllib3.exceptions.InsecureRequestWarning)
        yield


def complete_lines(path: Path, attempts: int = 40) -> list[str]:
    """The whole lines of a log another process is appending to: a last line caught mid-write (no newline yet) is
    read again after a moment, and left out if it is still not whole after 2 s."""
    for _ in range(attempts):
        text = path.read_text()
        if not text or text.endswith("\n"):
            break
        time.sleep(0.05)
    return text.splitlines() if text.endswith("\n") else text.splitlines()[:-1]
