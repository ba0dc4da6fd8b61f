# Two entry points (see README): `make run-local` and `make test`. Both set up .venv first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The trainer's stack is pinned in trainer/stack.txt (the trainer image installs the same file): torch is its torch
# line, the project installs under it as constraints, so the test environment is the pin's. The CPU build of that
# torch: outside a machine that has it on disk, point pip at the CPU wheels:
#   make TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu run-local
# TORCH_SPEC may name another build of the pinned release (torch==2.13.0+cpu); another release is refused by the
# constraints: change the pin instead.
STACK := trainer/stack.txt
TORCH_SPEC ?= $(shell sed -n 's/^\(torch==[^ ;#]*\).*/\1/p' $(STACK))
TORCH_INDEX_URL ?=
TORCH_INDEX_ARGS := $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL),)

# The HyperPodPyTorchJob's workers run the trainer under the HyperPod elastic agent, on the stack
# trainer/stack-hyperpod.txt changes (torch 2.11, the agent): .venv-hyperpod is that stack, where the tests run
# hyperpodrun and the trainer (tests/test_hyperpod_agent.py). Its torch is PyPI's CUDA build (docs/images.md).
HYPERPOD_STACK := trainer/stack-hyperpod.txt
HYPERPOD_VENV := .venv-hyperpod

.PHONY: setup browser run-local test compile bench clean

# Where PYTHONDONTWRITEBYTECODE is set (as on this project's CI machines), no process would keep what it compiled:
# every start of a worker, a CLI or a KFP step compiled its modules again (uncompiled, `import torch` took 5.4 s
# against 2.6 s), and each pytest worker rewrote every test module (collecting the suite: 12.9 CPU-s, 9.4 with the
# caches kept). Unexported, each module is compiled once, by the first process that imports it, into the ignored
# __pycache__ folders: cheaper than compiling every installed file at install (uv's --compile-bytecode: .venv's
# install 72.5 s against 57.0, .venv-hyperpod's 32.3 s against 10.7, measured here).
unexport PYTHONDONTWRITEBYTECODE

# The pipeline needs the project alone; the tests add the dev extra (an MLflow server, Playwright, moto, ruff, ...).
# pip installs torch (the build TORCH_INDEX_URL names, or the one pip's configuration finds); uv installs the rest
# under the same constraints.
UV := $(BIN)/uv pip install --quiet --python $(BIN)/python
$(BIN)/hyperpod-pretrain: pyproject.toml $(STACK)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip uv
	$(BIN)/python -m pip install --quiet --no-compile $(TORCH_INDEX_ARGS) -c $(STACK) "$(TORCH_SPEC)"
	$(UV) -c $(STACK) -e .
	touch $@

$(VENV)/dev-installed: $(BIN)/hyperpod-pretrain
	$(UV) -c $(STACK) -e '.[dev]'
	touch $@

# As the image installs it (docker/trainer.Dockerfile, STACK_VARIANT=hyperpod): stack.txt less its torch line, and
# the variant's file; the trainer itself comes from the working tree (PYTHONPATH), as the image's /workspace does.
$(HYPERPOD_VENV)/installed: $(STACK) $(HYPERPOD_STACK)
	rm -rf $(HYPERPOD_VENV)
	$(PYTHON) -m venv $(HYPERPOD_VENV)
	$(HYPERPOD_VENV)/bin/python -m pip install --quiet uv
	sed '/^torch==/d' $(STACK) > $(HYPERPOD_VENV)/stack-without-torch.txt
	$(HYPERPOD_VENV)/bin/uv pip install --quiet --python $(HYPERPOD_VENV)/bin/python \
	  -r $(HYPERPOD_VENV)/stack-without-torch.txt -r $(HYPERPOD_STACK)
	$(HYPERPOD_VENV)/bin/python -m pip check
	touch $@

setup: $(BIN)/hyperpod-pretrain

run-local: setup
	$(BIN)/hyperpod-pretrain run-local $(ARGS)

# The HTML report test renders in headless Chromium: Debian's, installed here when missing and this runs
# as root with apt; elsewhere (a laptop) that one test skips, saying why.
browser:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || \
	  { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
	    { apt-get install -y -q chromium >/dev/null 2>&1 || \
	      { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q chromium >/dev/null 2>&1; }; } ; } || \
	  echo "no Chromium: the HTML report's browser test will be skipped"

# The two environments are built side by side.
test:
	$(MAKE) --no-print-directory -j2 $(VENV)/dev-installed $(HYPERPOD_VENV)/installed browser
	$(BIN)/python -m pytest $(ARGS)

compile: setup
	$(BIN)/hyperpod-pretrain compile

bench: $(VENV)/dev-installed
	$(BIN)/python bench/bench_run_local.py $(ARGS)

clean:
	rm -rf $(VENV) $(HYPERPOD_VENV) local-runs
