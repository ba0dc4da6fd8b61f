"""The code passes the linter and formatter configured in pyproject.toml."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RUFF = str(Path(sys.executable).parent / "ruff")


def test_ruff_check() -> None:
    result = subprocess.run([RUFF, "check", "."], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout


def test_ruff_format() -> None:
    result = subprocess.run([RUFF, "format", "--check", "."], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout
