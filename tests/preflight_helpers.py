"""What the preflight's test files share: the run they check (`config`), how they read a result, and the cluster the
tests on the real control plane (tests/cluster/) check (`make_site`, `site`, `spare`; with Kubeflow Trainer:
`trainer_site`), which a test file names by importing them.

Each test writes the cluster it reads (tests/cluster/installed.py: nodes, other teams' pods, device plugins, the
Training Operator's Deployment, the FSx PVC with its PV and StorageClass) and removes it; cluster-scoped names carry the
test's tag. The runner is the pipeline runner (deploy/rbac*.yaml), or, in a test of less granted, an account of the
test's own bound to those files less the rules cut. Tests that need the CRD absent or changed run on a spare API server
over the same etcd (ControlPlane.spare). A pipeline compiled for TrainJobs (Kubeflow Trainer v2) is checked against
Kubeflow Trainer's install, our ClusterTrainingRuntime (named hyperpod-pretrain, as deploy/rbac-trainjob.yaml lets the
runner read only that one: cluster-scoped, so each test that makes it deletes it) and, with a queue, Kueue's. One
compiled for HyperPodPyTorchJobs (HYPERPOD_PLATFORM, its image HYPERPOD_IMAGE) is checked against our CRD of the kind
(in every session's control plane) and the HyperPod training operator's Deployment in aws-hyperpod.
tests/test_rbac.py measures the deploy files' rules from the requests of these tests.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import kubernetes
import pytest

from components.kube import KubeSettings
from components.launch_training.config import LaunchConfig
from components.launch_training.hyperpodpytorchjob import HYPERPODPYTORCHJOB
from components.launch_training.platform import Platform
from components.launch_training.trainjob import TRAINJOB, render_runtime
from components.preflight.core import CHECK_NAMES, preflight
from components.preflight.result import NOT_APPLICABLE, PASS, PreflightResult
from tests.cluster.cluster import profile_namespace
from tests.cluster.control_plane import RUNNER_USER, ControlPlane, trainer_skip_reason
from tests.cluster.installed import Installed, unique_tag

IMAGE = "registry.example.com/ml/hyperpod-pretrain-trainer:1.0"
ECR_IMAGE = "123456789012.dkr.ecr.us-east-1.amazonaws.com/hyperpod-pretrain-trainer:1"
HYPERPOD_IMAGE = "registry.example.com/ml/hyperpod-pretrain-trainer-hyperpod:1.0"  # the image with hyperpodrun
FAST = KubeSettings(request_timeout_s=5, attempts=3, backoff_s=0.01, max_backoff_s=0.02)


def config(**overrides: Any) -> LaunchConfig:
    settings: dict[str, Any] = dict(
        storage_root="/fsx",
        dataset="synthetic",
        run_id="pf-1",
        backend="kubernetes",
        nnodes=2,
        nproc_per_node=8,
        pipeline_run_id="pipeline-pf-1",
        image=IMAGE,
        instance_type="ml.p5.48xlarge",
        owner_reference=False,
    )
    return LaunchConfig.of(**{**settings, **overrides})


def check(result: PreflightResult, name: str) -> Any:
    return next(c for c in result.checks if c.name == name)


def statuses(result: PreflightResult) -> dict[str, str]:
    return {c.name: c.status for c in result.checks}


# -- the cluster on the real control plane -------------------------------------------------------------------------

OPERATOR_IMAGE = "kubeflow/training-operator:v1-04f9f13"  # Training Operator v1.8.1's release image

SCRATCH_2 = {
    "subnetId": "subnet-0123456789abcdef0",
    "securityGroupIds": "sg-0123456789abcdef0",
    "deploymentType": "SCRATCH_2",
}


@dataclass
class Site:
    """One test's cluster: its namespace (the job's), what is installed, and the three nodes' names."""

    plane: ControlPlane
    namespace: str
    hp: Installed
    i00: str = ""
    i01: str = ""
    cpu: str = ""

    def api(self, host: str = "") -> kubernetes.client.ApiClient:
        return self.plane.runner_client(host, self.namespace)

    def run(self, api: Any = None, **overrides: Any) -> PreflightResult:
        warn_only = overrides.pop("warn_only", False)
        cfg = config(**{"namespace": self.namespace, **overrides})
        if api is not None:
            return preflight(cfg, api, warn_only=warn_only, settings=FAST)
        with self.api() as client:
            return preflight(cfg, client, warn_only=warn_only, settings=FAST)

    def runner_requests(self, since: str) -> list[dict[str, Any]]:
        """The runner's requests received from ``since`` on (audit_time())."""
        return self.plane.audit_events(user=RUNNER_USER, since=since)

    def in_profile(self, api: str) -> Site:
        """The same cluster, from another Kubeflow profile's namespace (the ``kubeflow`` fixture), without a PVC."""
        namespace = profile_namespace(self.plane, api, cluster_read=True)
        self.hp.adopt_namespace(namespace)
        return Site(self.plane, namespace, self.hp, self.i00, self.i01, self.cpu)

    def with_grants(self, grants: list[dict[str, Any]]) -> Site:
        """The same cluster, from a namespace of its own (with the FSx PVC) whose account has only ``grants``."""
        namespace = self.plane.test_namespace(grants)
        self.hp.adopt_namespace(namespace)
        self.hp.add_pvc(namespace, "fsx-lustre-pvc")
        return Site(self.plane, namespace, self.hp, self.i00, self.i01, self.cpu)


@contextlib.contextmanager
def sites(control_plane: ControlPlane) -> Iterator[Callable[..., Site]]:
    """What the ``make_site`` fixture (tests/conftest.py) yields: ``make(**settings)`` writes a healthy cluster (two
    GPU nodes with room, a CPU node, a daemon pod, the device plugins, the FSx PVC (1,200 GiB, SCRATCH_2, dynamically
    provisioned) and the Training Operator v1.8.1); ``grants``: run as an account bound to these (deploy_grants() with
    rules cut) instead of the runner; ``profile`` (a job API): run as a Kubeflow profile's default-editor (the
    ``kubeflow`` fixture), with what render-rbac --kubeflow-profile --cluster-read renders for it; ``node_00``/
    ``node_01``: the GPU nodes' settings. Each cluster made is removed at the end."""
    made: list[Site] = []

    def make(
        *,
        plane: ControlPlane | None = None,
        grants: list[dict[str, Any]] | None = None,
        pvc: bool = True,
        device_plugins: bool = True,
        operator: str | None = OPERATOR_IMAGE,
        node_00: dict[str, Any] | None = None,
        node_01: dict[str, Any] | None = None,
        profile: str = "",
    ) -> Site:
        plane = plane or control_plane
        namespace = profile_namespace(plane, profile, cluster_read=True) if profile else plane.test_namespace(grants)
        site = Site(plane, namespace, Installed(plane, unique_tag()))
        made.append(site)
        hp = site.hp
        site.i00 = hp.add_node("hyperpod-i-00", **(node_00 or {"deep_health_check": "Passed"}))
        site.i01 = hp.add_node("hyperpod-i-01", **(node_01 or {"deep_health_check": "Passed"}))
        site.cpu = hp.add_node("cpu-system", instance_type="ml.m5.2xlarge", health_status=None)
        hp.add_pod(site.namespace, "aws-node-0", node=site.i00, requests={"cpu": "25m", "memory": "64Mi"})
        if device_plugins:
            hp.add_device_plugins()
        hp.add_storage_class("fsx-sc", SCRATCH_2)
        if pvc:
            hp.add_pvc(site.namespace, "fsx-lustre-pvc")
        if operator:
            hp.add_operator(operator)
        return site

    yield make
    for site in made:
        site.hp.close()
        site.plane.delete_namespace(site.namespace)


# A PyTorchJob without a Kueue queue (the default site): no runtime to check, no queue; no MLflow server named.
NOT_FOR_A_PYTORCHJOB = {"runtime": NOT_APPLICABLE, "queue": NOT_APPLICABLE, "mlflow": NOT_APPLICABLE}

# A TrainJob (compiled with --job-api trainjob) without a queue: its runtime is checked, the queue is n/a.
NOT_FOR_A_TRAINJOB = {"queue": NOT_APPLICABLE, "mlflow": NOT_APPLICABLE}


def all_pass(names: Iterable[str] = CHECK_NAMES, api: str = "pytorchjob") -> dict[str, str]:
    """What a passing site's checks say: pass, but n/a for what the job has none of (a PyTorchJob: a runtime and a
    queue; a TrainJob: a queue)."""
    not_applicable = NOT_FOR_A_TRAINJOB if api == TRAINJOB.name else NOT_FOR_A_PYTORCHJOB
    return {n: not_applicable.get(n, PASS) for n in names}


def others_pass(result: PreflightResult, *names: str) -> None:
    """The checks but ``names`` say what a passing site's do, for the job API the result checked (its target)."""
    api = TRAINJOB.name if result.target.startswith(f"{TRAINJOB.kind} ") else "pytorchjob"
    assert {n: s for n, s in statuses(result).items() if n not in names} == all_pass(
        (n for n in CHECK_NAMES if n not in names), api
    ), result.markdown()


# Compiled with --job-api trainjob: Kubeflow Trainer v2.3's TrainJob naming our ClusterTrainingRuntime, which must be
# named hyperpod-pretrain here: deploy/rbac-trainjob.yaml lets the runner get that one only.
TRAINJOB_PLATFORM = Platform(job_api=TRAINJOB.name, runtime_name="hyperpod-pretrain")

RUNTIMES = "clustertrainingruntimes"

# Compiled with --job-api hyperpodpytorchjob: the SageMaker HyperPod training operator's HyperPodPyTorchJob, whose
# workers run hyperpodrun (run it with HYPERPOD_IMAGE).
HYPERPOD_PLATFORM = Platform(job_api=HYPERPODPYTORCHJOB.name)

QUEUE = "hyperpod-ns-team-a-localqueue"  # HyperPod task governance's LocalQueue of a team


def trainjob_runtime(site: Site, **overrides: Any) -> dict[str, Any]:
    """Our ClusterTrainingRuntime for the LaunchConfig `site.run(platform=TRAINJOB_PLATFORM, **overrides)` checks:
    `render_runtime` of its job_spec(), what `hyperpod-pretrain render-runtime` prints for the same settings."""
    settings = {"namespace": site.namespace, "platform": TRAINJOB_PLATFORM, **overrides}
    return render_runtime(config(**settings).job_spec())


@contextlib.contextmanager
def runtime_applied(plane: ControlPlane, runtime: dict[str, Any]) -> Iterator[Callable[[dict[str, Any]], None]]:
    """``runtime`` made as the admin (cluster-scoped: deleted however the test ends); yields a function that replaces
    it with another, deleted and made again (its failurePolicy is immutable: the CRD's validation rule)."""
    custom = kubernetes.client.CustomObjectsApi(plane.admin)
    name = runtime["metadata"]["name"]
    custom.create_cluster_custom_object(TRAINJOB.group, TRAINJOB.version, RUNTIMES, runtime)

    def replace(other: dict[str, Any]) -> None:
        custom.delete_cluster_custom_object(TRAINJOB.group, TRAINJOB.version, RUNTIMES, name)
        custom.create_cluster_custom_object(TRAINJOB.group, TRAINJOB.version, RUNTIMES, other)

    try:
        yield replace
    finally:
        custom.delete_cluster_custom_object(TRAINJOB.group, TRAINJOB.version, RUNTIMES, name)


def needs_trainer() -> None:
    if reason := trainer_skip_reason():
        pytest.skip(reason)


def runner_reads(site: Site, since: str) -> set[tuple[str, str, str, str, int]]:
    """The runner's requests since ``since``: (verb, resource, namespace, name, HTTP code); a request for a path that
    is no resource (/version) as (verb, its path, "", "", HTTP code)."""
    reads = set()
    for e in site.runner_requests(since):
        ref = e.get("objectRef") or {"resource": e["requestURI"].split("?", 1)[0]}
        reads.add(
            (e["verb"], ref["resource"], ref.get("namespace", ""), ref.get("name", ""), e["responseStatus"]["code"])
        )
    return reads
