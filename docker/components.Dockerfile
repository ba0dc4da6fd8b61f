# The components image: every KFP step (staging, the launcher, NCCL verification, evaluation) runs in it.
# It carries kfp and this project, so no step installs anything when it starts (the compiled pipeline's
# executors run `python3 -m kfp.dsl.executor_main` with nothing before it). No CUDA: evaluation runs on CPU.
#
# Build from the repository root: docker build -f docker/components.Dockerfile -t hyperpod-pretrain-components .
FROM python:3.11-slim

# The CPU build of torch first, so that the project's torch>=2.3 is already met and pip takes no CUDA build.
ARG TORCH_VERSION=2.13.0

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /opt/hyperpod-pretrain
RUN pip install --index-url https://download.pytorch.org/whl/cpu "torch==${TORCH_VERSION}"
COPY pyproject.toml README.md ./
COPY common ./common
COPY trainer ./trainer
COPY components ./components
COPY pipelines ./pipelines
RUN pip install . && rm -rf build ./*.egg-info

# The commit the image was built from (docker/build.sh passes it): common/version.py adds it to --version and to each
# run's config.json.
ARG COMMIT=""
ENV HYPERPOD_PRETRAIN_COMMIT=${COMMIT}

# KFP sets the command of each step; this default only shows what is inside.
CMD ["hyperpod-pretrain", "--help"]
