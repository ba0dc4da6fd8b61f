"""Which hyperpod-pretrain wrote something: the installed distribution's version, and the commit the images were
built from where docker/build.sh says (HYPERPOD_PRETRAIN_COMMIT). Written into config.json and shown by --version, so
a run's files say what produced them."""

from __future__ import annotations

import os
from importlib.metadata import PackageNotFoundError, version

DISTRIBUTION = "hyperpod-pretrain"
COMMIT_ENV = "HYPERPOD_PRETRAIN_COMMIT"


def tool_version() -> str:
    """'0.1.0', or '0.1.0 (commit 1a2b3c4)' in an image built with its commit; 'unknown' when not installed."""
    try:
        installed = version(DISTRIBUTION)
    except PackageNotFoundError:
        installed = "unknown"
    commit = os.environ.get(COMMIT_ENV, "").strip()
    return f"{installed} (commit {commit})" if commit else installed
