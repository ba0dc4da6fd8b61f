# The trainer image: what every PyTorchJob worker runs under torchrun.
#
# Base: NGC PyTorch 24.04, as in the seed (CUDA 12.4, NCCL 2.21.5, torch 2.3). What EFA needs comes from two
# places: the HyperPod AMI provides the EFA kernel driver on the host and the aws-efa-k8s-device-plugin
# exposes the devices to the pod; the NGC image has neither the libfabric EFA provider nor the aws-ofi-nccl
# plugin, so this image installs them (the EFA installer's user-space part, without the kernel module, and
# aws-ofi-nccl built against it). Without them NCCL falls back to TCP sockets, which `verify-nccl` fails.
#
# Build from the repository root: docker build -f docker/trainer.Dockerfile -t hyperpod-pretrain-trainer .
# (docker/build.sh builds, tags and pushes both images to ECR.)
FROM nvcr.io/nvidia/pytorch:24.04-py3

ARG EFA_INSTALLER_VERSION=1.31.0
# 1.9.1-aws is tested by AWS with NCCL 2.21.5 (the base image's) and needs libfabric >= 1.18.
ARG AWS_OFI_NCCL_VERSION=1.9.1-aws

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

WORKDIR /tmp/efa
RUN curl -fsSL "https://efa-installer.amazonaws.com/aws-efa-installer-${EFA_INSTALLER_VERSION}.tar.gz" \
        | tar -xz --strip-components=1 \
    && ./efa_installer.sh -y --skip-kmod --skip-limit-conf --no-verify \
    && rm -rf /tmp/efa /var/lib/apt/lists/*

WORKDIR /tmp/aws-ofi-nccl
RUN curl -fsSL "https://github.com/aws/aws-ofi-nccl/releases/download/v${AWS_OFI_NCCL_VERSION}/aws-ofi-nccl-${AWS_OFI_NCCL_VERSION}.tar.gz" \
        | tar -xz --strip-components=1 \
    && ./configure --prefix=/opt/aws-ofi-nccl --with-libfabric=/opt/amazon/efa --with-cuda=/usr/local/cuda \
        --enable-platform-aws --disable-tests \
    && make -j"$(nproc)" install \
    && rm -rf /tmp/aws-ofi-nccl

ENV LD_LIBRARY_PATH=/opt/aws-ofi-nccl/lib:/opt/amazon/efa/lib:${LD_LIBRARY_PATH} \
    PATH=/opt/amazon/efa/bin:${PATH} \
    FI_PROVIDER=efa \
    FI_EFA_USE_DEVICE_RDMA=1 \
    PYTHONUNBUFFERED=1

# What the trainer imports beyond the base image, pinned: the last transformers release for the base's
# Python 3.10 (5.x needs 3.11); it brings tokenizers and safetensors. torch and numpy are the base image's: the
# project installs without its dependencies, because NGC's torch (2.3.0a0) does not satisfy torch>=2.3 and
# pip would replace it with a PyPI build. tests/test_docker.py checks this against what trainer/ imports.
WORKDIR /workspace
RUN pip install --no-cache-dir "transformers==4.57.6"
COPY pyproject.toml README.md /workspace/src/
COPY trainer /workspace/src/trainer
COPY components /workspace/src/components
COPY pipelines /workspace/src/pipelines
RUN pip install --no-cache-dir --no-deps /workspace/src \
    && rm -rf /workspace/src \
    && ln -s "$(python -c 'import trainer.train_ddp as m; print(m.__file__)')" /workspace/train_ddp.py

# No ENTRYPOINT: the PyTorchJob's command is `torchrun ... -m trainer.train_ddp` (the manifest sets it);
# `torchrun ... /workspace/train_ddp.py`, the seed's path, runs the same program.
