"""Shared fixtures: a synthetic corpus with learnable structure, staged once, trained once (2 processes)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from components.launch_pytorchjob.core import launch
from components.stage_data.core import stage_data
from tests.helpers import tiny_launch, write_corpus
from tests.s3_server import S3Server


@pytest.fixture(scope="session")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="session")
def staged_root(tmp_path_factory: pytest.TempPathFactory, corpus: Path) -> Path:
    """A storage root with the corpus staged as dataset 'synthetic' (treat as read-only)."""
    root = tmp_path_factory.mktemp("fsx")
    stage_data(str(corpus), str(root), "synthetic", vocab_size=512, val_fraction=0.1)
    return root


@pytest.fixture
def staged_copy(staged_root: Path, tmp_path: Path) -> Path:
    """A private copy of the staged storage root, for tests that change it."""
    root = tmp_path / "fsx"
    shutil.copytree(staged_root, root)
    return root


@pytest.fixture(scope="session")
def trained_root(tmp_path_factory: pytest.TempPathFactory, staged_root: Path) -> Path:
    """A storage root holding run 'run-1': 60 steps of the tiny preset under torchrun with 2 processes."""
    root = tmp_path_factory.mktemp("trained")
    shutil.copytree(staged_root, root, dirs_exist_ok=True)
    launch(tiny_launch(root, "run-1"))
    return root


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
