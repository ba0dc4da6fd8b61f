"""Shared fixtures: a synthetic corpus with learnable structure, staged once, trained once (2 processes)."""

from __future__ import annotations

import logging
import shutil
import threading
from collections.abc import Callable, Iterator
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

import pytest

from components.stage_data.core import stage_data
from tests.helpers import EXACT, MIXED_RUN, built_once, snapshot_dir, trained, write_corpus
from tests.s3_server import S3Server
from trainer.layout import RunPaths


def pytest_report_header(config: pytest.Config) -> str:
    """Say whether the Kubernetes tests run on the real control plane, or why they skip."""
    from tests.cluster.control_plane import locate_binaries, skip_reason

    if reason := skip_reason():
        return f"kubernetes: the control-plane tests skip: {reason}"
    binaries, _ = locate_binaries()
    manager = "kube-controller-manager" if binaries.kube_controller_manager else "no controller manager"
    return f"kubernetes: real etcd, kube-apiserver and {manager} from {binaries.source}"


# The test files whose tests run on the session's control plane: under pytest-xdist (`-n 2`, the suite's default)
# they run in one worker, in order, so that one control plane's audit log holds every request tests/test_rbac.py
# measures, and the control plane starts once. A test on the control plane elsewhere is refused at collection.
CONTROL_PLANE_FILES = (
    "test_k8s_launcher*.py",
    "test_preflight*.py",
    "test_trainjob*.py",
    "test_rbac.py",
    "test_diagnosis.py",
    "test_fault_proxy.py",
    "test_manifest.py",
    "test_remote.py",
    "test_security.py",
    "test_verify_nccl.py",
)


def on_control_plane(path: str) -> bool:
    return any(fnmatch(Path(path).name, pattern) for pattern in CONTROL_PLANE_FILES)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests marked after_cluster_tests read the audit log of the session's control-plane tests: they go last."""
    last = [item for item in items if item.get_closest_marker("after_cluster_tests")]
    items[:] = [item for item in items if not item.get_closest_marker("after_cluster_tests")] + last
    for item in items:
        if "control_plane" in item.fixturenames and not on_control_plane(str(item.fspath)):
            raise pytest.UsageError(f"{item.nodeid} runs on the control plane: add its file to CONTROL_PLANE_FILES")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """pytest-xdist's load scheduling (each test to the next free worker), but for the control plane's files, which
    are one unit: one worker runs them in collection order (so tests/test_rbac.py last). xdist's own loadgroup reads
    a node id suffix that pytest 9.2's node ids no longer carry."""
    from xdist.scheduler import LoadScopeScheduling  # the dev extra's; only a run under xdist gets here

    class ControlPlaneScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "control-plane" if on_control_plane(nodeid.split("::")[0]) else nodeid

    return ControlPlaneScheduling(config, log) if config.getvalue("dist") == "load" else None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Any:
    """A failed test on the control plane keeps the servers' logs: their paths and the API server's last lines."""
    report = yield
    plane = getattr(item, "funcargs", {}).get("control_plane")
    if report.failed and plane is not None:
        logs = "\n".join(str(plane.workdir / f"{n}.log") for n in ("etcd", "kube-apiserver", "kube-controller-manager"))
        report.sections.append(("control plane", f"{logs}\n{plane.log_tail('kube-apiserver', 20)}"))
    return report


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One real control plane for the session (tests/cluster/control_plane.py), with the Training Operator's
    validating webhook and Kueue's mutating webhook registered; where the Trainer v2.3.0 and JobSet v0.12.0 CRDs are
    at hand, those too, with JobSet's defaulting webhook and Trainer's TrainJob webhooks."""
    from tests.cluster.control_plane import PYTORCHJOB_CRD, ControlPlane, locate_binaries, skip_reason, trainer_crds
    from tests.cluster.jobset import JobSetWebhook
    from tests.cluster.kueue import Kueue
    from tests.cluster.trainer import TrainerWebhooks
    from tests.cluster.training_operator import ValidatingWebhook

    if reason := skip_reason():
        pytest.skip(reason)
    binaries, _ = locate_binaries()
    workdir = tmp_path_factory.mktemp("control-plane")
    extra = trainer_crds()
    plane = ControlPlane(binaries, workdir, [PYTORCHJOB_CRD, *extra])
    try:
        plane.start()
        plane.webhook = ValidatingWebhook(plane.admin, workdir / "certs")
        plane.kueue = Kueue(plane.admin, workdir / "certs", trainjob=bool(extra))
        if extra:
            plane.jobset_webhook = JobSetWebhook(plane.admin, workdir / "certs")
            plane.trainer_webhooks = TrainerWebhooks(plane.admin, workdir / "certs")
        yield plane
    finally:
        plane.stop()


@pytest.fixture
def garbage_collector(control_plane: Any) -> None:
    """For a test that needs the garbage collector (a foreground deletion that ends): kube-controller-manager."""
    if not control_plane.has_controller_manager:
        pytest.skip("needs the garbage collector: no kube-controller-manager beside kube-apiserver")


@pytest.fixture
def fault_proxy(control_plane: Any) -> Iterator[Any]:
    """A fault-injecting TLS proxy in front of the control plane's API server (tests/cluster/fault_proxy.py): point
    a client at its ``url``."""
    from tests.cluster.fault_proxy import FaultProxy

    certs = control_plane.workdir / "certs"
    with FaultProxy(control_plane.url, certs / "apiserver.crt", certs / "apiserver.key", control_plane.ca_file) as p:
        yield p


@pytest.fixture(autouse=True)
def no_stale_log_handler() -> Iterator[None]:
    """A command run in-process sets up logging (`setup_logging`: a root handler on the sys.stderr of the moment, the
    test's capture, closed after it): taken off again, or every later test's log would print 'Logging error'."""
    before = set(logging.root.handlers)
    yield
    for handler in logging.root.handlers[:]:
        if type(handler) is logging.StreamHandler and handler not in before:
            logging.root.removeHandler(handler)


@pytest.fixture
def make_cluster(control_plane: Any, tmp_path: Path) -> Iterator[Callable[..., Any]]:
    """A Cluster (tests/cluster/cluster.py) in a fresh namespace; closed after the test, which fails if a player
    met an error."""
    from tests.cluster.cluster import Cluster

    made: list[Cluster] = []

    def make(**settings: Any) -> Cluster:
        """``api="trainjob"``: Kubeflow Trainer and JobSet played; skipped with a reason where their CRDs are not."""
        from tests.cluster.control_plane import trainer_skip_reason

        if settings.get("api") == "trainjob" and (reason := trainer_skip_reason()):
            pytest.skip(reason)
        made.append(Cluster(control_plane, control_plane.kueue, tmp_path / f"kubelet-{len(made)}", **settings))
        return made[-1]

    yield make
    # The launch's readers (readers.Reader: the job's watch, the log streams) end before it returns; one left
    # reading would log into the next test and make loggers while pytest walks them.
    readers = [t.name for t in threading.enumerate() if t.name == "job-watch" or t.name.startswith("log-")]
    for cluster in made:
        cluster.close()
    assert not [e for c in made for e in c.errors], [e for c in made for e in c.errors]
    assert not readers, f"the launch returned with its readers still running: {readers}"


@pytest.fixture
def kubeflow(control_plane: Any) -> Iterator[None]:
    """A full Kubeflow install's RBAC for one test (tests/cluster/kubeflow.py): make_cluster(profile=True) then makes
    a profile's namespace and runs as its default-editor."""
    from tests.cluster.kubeflow import kubeflow_install

    with kubeflow_install(control_plane):
        yield


@pytest.fixture
def make_site(control_plane: Any) -> Iterator[Callable[..., Any]]:
    """A healthy cluster for a preflight test, as many as it makes (tests/preflight_helpers.py sites: its settings),
    each removed after the test."""
    from tests.preflight_helpers import sites

    with sites(control_plane) as make:
        yield make


@pytest.fixture
def site(make_site: Callable[..., Any]) -> Any:
    """One healthy cluster for a preflight test (make_site's, as it comes)."""
    return make_site()


@pytest.fixture
def spare(control_plane: Any, tmp_path: Path) -> Iterator[Any]:
    """A spare API server over the same etcd, with no CRD installed: the shared one is never removed."""
    with control_plane.spare(tmp_path / "spare", []) as plane:
        yield plane


@pytest.fixture
def trainer_site(make_site: Callable[..., Any]) -> Any:
    """The healthy cluster on the shared control plane (both job APIs' CRDs), Kubeflow Trainer v2.3.0 installed
    beside the Training Operator (skipped with the reason where its CRDs are not)."""
    from tests.preflight_helpers import needs_trainer

    needs_trainer()
    site = make_site()
    site.hp.add_trainer()
    return site


@pytest.fixture(scope="session")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return built_once(tmp_path_factory, "corpus", write_corpus)


@pytest.fixture(scope="session")
def staged_root(tmp_path_factory: pytest.TempPathFactory, corpus: Path) -> Path:
    """A storage root with the corpus staged as dataset 'synthetic' (treat as read-only)."""
    return built_once(
        tmp_path_factory,
        "fsx",
        lambda root: stage_data(str(corpus), str(root), "synthetic", vocab_size=512, val_fraction=0.1),
    )


@pytest.fixture(scope="session")
def mixed_root(tmp_path_factory: pytest.TempPathFactory, staged_root: Path) -> Path:
    """staged_root and two more datasets staged with its tokenizer, for mixtures (MIXTURE; treat as read-only):
    'code' a quarter of its size, 'math' a sixteenth, each with its own text."""

    def build(root: Path) -> None:
        shutil.copytree(staged_root, root, dirs_exist_ok=True)
        tokenizer = str(snapshot_dir(root, "synthetic") / "tokenizer.json")
        for dataset, files, sentences, seed in (("code", 4, 90, 7), ("math", 2, 45, 8)):
            source = write_corpus(root.parent / f"{dataset}-text", files=files, sentences=sentences, seed=seed)
            stage_data(str(source), str(root), dataset, tokenizer_path=tokenizer, val_fraction=0.25)

    return built_once(tmp_path_factory, "mixed", build)


@pytest.fixture(scope="session")
def mixture_run(mixed_root: Path, tmp_path_factory: pytest.TempPathFactory) -> RunPaths:
    """Run 'mixed': 20 steps of the tiny preset with dropout on MIXTURE under FSDP, every step logged, a checkpoint
    every 5, the val losses every 10 (treat as read-only; its storage root holds mixed_root's datasets)."""
    build = trained(mixed_root, "mixed", **MIXED_RUN, eval_every=10, extra_env={"TRAINER_PARALLELISM": "fsdp"})
    root = built_once(tmp_path_factory, "mixture-run", build)
    return RunPaths.of(root, "mixed")


@pytest.fixture
def staged_copy(staged_root: Path, tmp_path: Path) -> Path:
    """A private copy of the staged storage root, for tests that change it."""
    root = tmp_path / "fsx"
    shutil.copytree(staged_root, root)
    return root


@pytest.fixture(scope="session")
def trained_root(tmp_path_factory: pytest.TempPathFactory, staged_root: Path) -> Path:
    """A storage root holding run 'run-1': 60 steps of the tiny preset under torchrun with 2 processes."""
    return built_once(tmp_path_factory, "trained", trained(staged_root, "run-1"))


@pytest.fixture(scope="session")
def uninterrupted(staged_root: Path, tmp_path_factory: pytest.TempPathFactory) -> RunPaths:
    """40 steps of the tiny preset under DDP, every step logged, a checkpoint every 10: what the exact-resume tests
    (test_trainer.py, test_parallel.py) compare against. It measures the val loss every 10 steps (--eval-every),
    which the runs compared with it do not: the same rows show that evaluating changes nothing of the training."""
    root = built_once(tmp_path_factory, "uninterrupted", trained(staged_root, "straight", **EXACT, eval_every=10))
    return RunPaths.of(root, "straight")


@pytest.fixture
def trained_copy(trained_root: Path, tmp_path: Path) -> Path:
    """A private copy of trained_root, for tests that change it."""
    root = tmp_path / "fsx"
    shutil.copytree(trained_root, root, symlinks=True)
    return root


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """A real S3-compatible server (moto's standalone server) on loopback, in its own process."""
    with S3Server(tmp_path_factory.mktemp("moto") / "server.log") as server:
        yield server


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A real MLflow tracking server (`mlflow server`, SQLite store) on loopback, in its own process."""
    from tests.mlflow_server import MlflowServer

    with MlflowServer(tmp_path_factory.mktemp("mlflow")) as server:
        yield server


@pytest.fixture
def s3_endpoint(s3_server: S3Server) -> str:
    return s3_server.endpoint


@pytest.fixture
def aws_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Credentials for the test server, and nothing from the machine's own AWS configuration."""
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


@pytest.fixture
def one_process_group(tmp_path: Path) -> Iterator[None]:
    """A process group of this test process alone (gloo, a file store), destroyed after the test."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="session")
def parallel_probe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tests/parallel_probe.py, run once on 2 processes for the tests that read it (one torchrun's start-up, not
    several): its output directory, with the published models it loaded: llama/ (sharded), gpt2/ (in the Hub's
    layout, without its base model's prefix) and llama-unprefixed/."""
    from tests.helpers import run_probe, save_gpt2_as_the_hub_serves_it, save_llama, save_llama_without_its_prefix

    def build(out: Path) -> None:
        save_llama(out / "llama")
        save_gpt2_as_the_hub_serves_it(out / "gpt2")
        save_llama_without_its_prefix(out / "llama-unprefixed")
        run_probe("tests.parallel_probe", str(out), *(str(out / m) for m in ("llama", "gpt2", "llama-unprefixed")))

    return built_once(tmp_path_factory, "parallel-probe", build)
