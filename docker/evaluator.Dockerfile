# The evaluator image: what the evaluate step runs in when it has a GPU (the default; `compile --evaluation-gpus 0`
# runs it on the CPU, in the components image). The evaluation loads the checkpoint into a bf16 model on the GPU,
# which needs CUDA torch, and runs as a KFP step, which needs kfp and this project: the components image has the
# second and a CPU torch, the trainer image the first. So this is the trainer image, with the project and its
# dependencies added under the trainer's pins (`-c stack.txt`): the torch, transformers and tokenizers the run trained
# with, and its CUDA and NCCL, stay exactly the trainer's; pip installs only what the pins leave open (kfp,
# kubernetes, lm-eval, ...). Like the components image, no step installs anything when it starts.
#
# Built after the trainer image, from it: docker/build.sh passes TRAINER_IMAGE (the trainer image it just built).
# By hand, from the repository root:
#   docker build -f docker/evaluator.Dockerfile --build-arg TRAINER_IMAGE=hyperpod-pretrain-trainer:<tag> \
#       -t hyperpod-pretrain-evaluator:<tag> .
ARG TRAINER_IMAGE=hyperpod-pretrain-trainer:0.1.0
FROM ${TRAINER_IMAGE}

# The trainer image's own copy of trainer/stack.txt: the pins its venv was installed from.
ARG STACK=/opt/hyperpod-pretrain/stack.txt

WORKDIR /opt/hyperpod-pretrain/src
COPY pyproject.toml README.md ./
COPY common ./common
COPY trainer ./trainer
COPY components ./components
COPY pipelines ./pipelines
# The trainer image installed the project without its dependencies (trainer/ and common/ only): this reinstalls it
# whole, with them, and fails rather than move any pinned package off its pin. pip check: nothing installed here
# conflicts with the trainer's stack.
RUN test -f "${STACK}" \
    && pip install --no-cache-dir -c "${STACK}" . \
    && pip check \
    && rm -rf build ./*.egg-info
WORKDIR /workspace

# The commit the image was built from (docker/build.sh passes it): common/version.py adds it to --version and to each
# run's config.json.
ARG COMMIT=""
ENV HYPERPOD_PRETRAIN_COMMIT=${COMMIT}

# KFP sets the command of each step; this default only shows what is inside.
CMD ["hyperpod-pretrain", "--help"]
