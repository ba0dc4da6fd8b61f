# The trainer image: what every PyTorchJob worker runs under torchrun.
#
# Its stack (Python, torch, transformers, tokenizers, safetensors, numpy) is pinned once, in trainer/stack.txt: the
# image installs that file, the test environment is installed from it (Makefile), and tests/test_docker.py fails
# when this file or the test environment disagrees with it.
#
# Base: a CUDA base image plus PyPI's torch wheel, not an NGC PyTorch image. NGC images carry pre-release torch
# builds (the seed's 24.04: 2.3.0a0) that no test environment can install, so the tests would never run the torch
# the workers run. PyPI's torch 2.13.0 for Linux is the CUDA 13.0 build and brings the CUDA libraries, cuDNN and
# NCCL 2.29.7 as wheels (its nvidia-* and cuda-toolkit 13.0.3 requirements), so the base needs no toolkit: the
# `base` flavour of the same CUDA release gives the container runtime's settings, and its NVIDIA_REQUIRE_CUDA has
# the runtime check the node's driver against CUDA 13.0 (580 or newer) when the container starts, rather than torch
# failing later. CUDA 13 runs on p5 (H100, sm_90) and p4d (A100, sm_80). This torch has the c10d restart fix
# (torch 2.3's first restart of a c10d worker group died with RendezvousClosedError, pytorch #123678, fixed in
# 2.4 by #124819) and its torchrun honours TORCH_ELASTIC_SHUTDOWN_TIMEOUT (measured with 2.13), which the job sets.
# Ubuntu 22.04: EFA installer 1.51 supports it, and nvidia/cuda:13.0.3 has a flavour on it. Its own python3.11
# (universe) stays at 3.11.0, so the pinned Python comes from the deadsnakes PPA, in a venv that pip and torchrun
# run from.
#
# EFA: the HyperPod AMI provides the EFA kernel driver on the host and the aws-efa-k8s-device-plugin exposes the
# devices to the pod; the image needs the user-space part: libfabric's EFA provider and the AWS OFI NCCL plugin,
# which the EFA installer has shipped since 1.39. Installer 1.51.0 (2026-10-22) brings libfabric 2.7.0amzn2.0,
# rdma-core 65.0 and the plugin 1.22.0 (docs.aws.amazon.com/AWSEC2/latest/UserGuide/efa-changelog.html). Without
# them NCCL falls back to TCP sockets, which `verify-nccl` fails.
#
# STACK_VARIANT: "" (the default) installs trainer/stack.txt; "hyperpod" builds the HyperPodPyTorchJob's image
# (hyperpod-pretrain-trainer-hyperpod): stack.txt less its torch line plus trainer/stack-hyperpod.txt, torch 2.11 and
# the HyperPod elastic agent, which cannot start on torch 2.12 or later (docs/images.md).
#
# Build from the repository root: docker build -f docker/trainer.Dockerfile -t hyperpod-pretrain-trainer .
# (docker/build.sh builds, tags and pushes the images to ECR; --job-api hyperpodpytorchjob adds the variant.)
FROM nvidia/cuda:13.0.3-base-ubuntu22.04

# Must equal trainer/stack.txt's `# python:` line (tests/test_docker.py checks it, and so does the build below).
ARG PYTHON_VERSION=3.11
ARG EFA_INSTALLER_VERSION=1.51.0
ARG DEBIAN_FRONTEND=noninteractive

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# gcc and the Python headers: torch.compile (the trainer's --compile) has Triton build its launcher at run time.
# Package versions are not pinned: deadsnakes keeps only its newest build and Ubuntu's security updates replace
# theirs, so a pin would break the build; the stack that matters is pinned in trainer/stack.txt.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates curl gnupg software-properties-common \
    && add-apt-repository -y ppa:deadsnakes/ppa \
    && apt-get update \
    && apt-get install -y --no-install-recommends "python${PYTHON_VERSION}" "python${PYTHON_VERSION}-venv" \
        "python${PYTHON_VERSION}-dev" gcc libc6-dev \
    && "python${PYTHON_VERSION}" -m venv /opt/venv \
    && rm -rf /var/lib/apt/lists/*
ENV PATH=/opt/venv/bin:${PATH}

# The installer's user-space part only, as AWS documents for containers
# (docs.aws.amazon.com/AWSEC2/latest/UserGuide/efa-installer-containers.html): --skip-kmod (a container cannot
# load the kernel module; the host has it), --skip-limit-conf (ulimits are the pod's), --no-verify (no EFA device
# at build time). --disable-ngc (installers >= 1.48): the installer takes an image with
# /opt/nvidia/nvidia_entrypoint.sh, as nvidia/cuda images have, for an NGC container and then installs its NGC
# variant of the plugin (with an apt NCCL beside torch's) or none at all; this asks for the standard packages.
# It installs its dependencies with apt, hence the update first. The plugin lands in /opt/amazon/ofi-nccl/lib or,
# from Ubuntu's multiarch packages, /opt/amazon/ofi-nccl/lib/x86_64-linux-gnu depending on the release: both are
# on the search path below, and the build fails here, not on the cluster, when it is in neither or cannot load
# (libcuda comes from the node's driver at run time, so it alone may be missing now).
ENV LD_LIBRARY_PATH=/opt/amazon/ofi-nccl/lib:/opt/amazon/ofi-nccl/lib/x86_64-linux-gnu:/opt/amazon/efa/lib:${LD_LIBRARY_PATH} \
    PATH=/opt/amazon/efa/bin:${PATH}
WORKDIR /tmp/efa
RUN apt-get update \
    && curl -fsSL "https://efa-installer.amazonaws.com/aws-efa-installer-${EFA_INSTALLER_VERSION}.tar.gz" \
        | tar -xz --strip-components=1 \
    && ./efa_installer.sh -y --skip-kmod --skip-limit-conf --no-verify --disable-ngc \
    && ldconfig \
    && plugin="$(find /opt/amazon/ofi-nccl -name libnccl-net-ofi.so -print -quit)" \
    && test -n "${plugin}" \
    && { ! ldd "${plugin}" | grep -v 'libcuda\.so' | grep 'not found'; } \
    && rm -rf /tmp/efa /var/lib/apt/lists/*

# NCCL_NET_PLUGIN=ofi: NCCL loads libnccl-net-ofi.so, the one name every layout of the plugin has (some releases
# also have libnccl-net.so, NCCL's default name, and some do not). FI_PROVIDER=efa: libfabric must not pick a TCP
# provider on EFA hardware (the job sets it too).
ENV NCCL_NET_PLUGIN=ofi \
    FI_PROVIDER=efa \
    FI_EFA_USE_DEVICE_RDMA=1 \
    PYTHONUNBUFFERED=1

# The pinned stack first, from the pin itself, in a layer of its own (torch's wheels are gigabytes; a change to
# the trainer does not reinstall them). The grep fails the build when PYTHON_VERSION was overridden away from the pin.
# The hyperpod variant installs stack.txt without its torch line and stack-hyperpod.txt (its torch and the agent),
# as the Makefile installs .venv-hyperpod; pip check fails the build on a conflict (the agent's own pip<25.3 is
# left to pip to meet). Any other STACK_VARIANT fails the build rather than quietly building the plain image. It is
# declared here, not above: a build argument changes the cache key of every RUN after it, and the layers above are
# the same in both images.
ARG STACK_VARIANT=""
WORKDIR /workspace
COPY trainer/stack.txt /opt/hyperpod-pretrain/stack.txt
COPY trainer/stack-hyperpod.txt /opt/hyperpod-pretrain/stack-hyperpod.txt
RUN grep -qx "# python: ${PYTHON_VERSION}" /opt/hyperpod-pretrain/stack.txt \
    && if [ "${STACK_VARIANT}" = hyperpod ]; then \
        sed '/^torch==/d' /opt/hyperpod-pretrain/stack.txt > /opt/hyperpod-pretrain/stack-without-torch.txt \
        && pip install --no-cache-dir -r /opt/hyperpod-pretrain/stack-without-torch.txt \
            -r /opt/hyperpod-pretrain/stack-hyperpod.txt \
        && pip check; \
    elif [ -z "${STACK_VARIANT}" ]; then \
        pip install --no-cache-dir -r /opt/hyperpod-pretrain/stack.txt; \
    else \
        echo "STACK_VARIANT=${STACK_VARIANT}: not \"\" or hyperpod" >&2 && exit 1; \
    fi
# The project without its dependencies: what the trainer imports is already the pin's, and the project's own
# ranges (kfp, kubernetes, ... for the pipeline steps) are not the trainer's; boto3, which its durable checkpoint copies
# use, is in the pin. Of the project, only what the trainer imports: trainer/ and common/ (the errors and the S3
# client, below the pipeline's code), not components/ or pipelines/; so the `hyperpod-pretrain` command, whose
# entry point is in pipelines/, is removed. tests/test_docker.py checks that trainer/ imports neither, that this
# copies no other package, and that every third-party module trainer/ imports is in the pin.
COPY pyproject.toml README.md /workspace/src/
COPY common /workspace/src/common
COPY trainer /workspace/src/trainer
RUN pip install --no-cache-dir --no-deps /workspace/src \
    && rm -rf /workspace/src /opt/venv/bin/hyperpod-pretrain \
    && ln -s "$(python -c 'import trainer.train_ddp as m; print(m.__file__)')" /workspace/train_ddp.py

# No ENTRYPOINT: the PyTorchJob's command is `torchrun ... -m trainer.train_ddp` (the manifest sets it);
# `torchrun ... /workspace/train_ddp.py`, the seed's path, runs the same program.

# The commit the image was built from (docker/build.sh passes it): common/version.py adds it to --version and to each
# run's config.json.
ARG COMMIT=""
ENV HYPERPOD_PRETRAIN_COMMIT=${COMMIT}
