"""The machine's Chromium for the browser tests (Debian's: make test installs it where it runs as root with apt)."""

import shutil

import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# As Chromium must run here: no sandbox as root, no GPU, no calls home (refused on a closed network).
CHROMIUM_FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="no Chromium here (make test installs Debian's where it runs as root)"
)
