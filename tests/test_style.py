"""The code passes the linter and formatter configured in pyproject.toml, and docs/repository.md maps every module."""

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


def test_the_repository_map_names_every_module() -> None:
    """A module docs/repository.md does not name is one a newcomer will not find: each is named by its path."""
    mapped = (REPO / "docs" / "repository.md").read_text()
    modules = [
        path.relative_to(REPO).as_posix()
        for top in ("common", "trainer", "components", "pipelines", "bench", "experiments", "tests")
        for path in sorted((REPO / top).rglob("*.py"))
        if not path.name.startswith("test_") and not (path.name == "__init__.py" and path.stat().st_size == 0)
    ]
    assert len(modules) > 150
    missing = [module for module in modules if f"`{module}`" not in mapped]
    assert not missing, f"docs/repository.md does not name: {', '.join(missing)}"
