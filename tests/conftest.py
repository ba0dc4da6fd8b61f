"""Shared fixtures: a synthetic corpus with learnable structure, staged once, trained once (2 processes)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from components.launch_pytorchjob.core import launch
from components.stage_data.core import stage_data
from tests.helpers import tiny_launch, write_corpus


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
