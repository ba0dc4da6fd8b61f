#!/usr/bin/env bash
# Build the trainer, components and evaluator images, push them to ECR (log in, build, tag, push, as in the seed),
# and print the compile command that puts their references into the pipeline. The evaluator image is built from the
# trainer image (docker/evaluator.Dockerfile), so after it.
#
#   docker/build.sh --account 123456789012 --region us-east-1 [--tag TAG] [--platform linux/amd64] [--no-push]
#                   [--job-api pytorchjob|trainjob|hyperpodpytorchjob]
#
# TAG defaults to the git commit (with -dirty when the tree has changes). Needs docker and, to push, the AWS
# CLI with credentials that may push to ECR. The repositories are created when missing. --job-api (default
# pytorchjob) is the one the pipeline will be compiled for: hyperpodpytorchjob's workers run the trainer under the
# HyperPod elastic agent, on its own stack, so it pushes hyperpod-pretrain-trainer-hyperpod (trainer.Dockerfile,
# STACK_VARIANT=hyperpod) in place of hyperpod-pretrain-trainer; it still builds the plain trainer, without pushing
# it, as the evaluator's base (the evaluation runs the plain stack's torch). What it pushes is what the compile
# command it prints names.
set -euo pipefail

usage() { sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'; }
die() { echo "docker/build.sh: error: $*" >&2; exit 2; }

account="${AWS_ACCOUNT_ID:-}" region="${AWS_REGION:-${AWS_DEFAULT_REGION:-}}" tag="" platform="linux/amd64" push=1
job_api=pytorchjob
while [ $# -gt 0 ]; do
  case "$1" in
    --account) account="${2:?--account needs a value}"; shift 2 ;;
    --region) region="${2:?--region needs a value}"; shift 2 ;;
    --tag) tag="${2:?--tag needs a value}"; shift 2 ;;
    --platform) platform="${2:?--platform needs a value}"; shift 2 ;;
    --job-api) job_api="${2:?--job-api needs a value}"; shift 2 ;;
    --no-push) push=0; shift ;;
    -h|--help) usage; exit 0 ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
done

[[ "$account" =~ ^[0-9]{12}$ ]] || die "--account '$account' is not a 12-digit AWS account id"
case "$job_api" in  # components/launch_training/job_api.py's JOB_APIS (tests/test_docker.py checks)
  pytorchjob|trainjob|hyperpodpytorchjob) ;;
  *) die "--job-api '$job_api' is not one of pytorchjob, trainjob, hyperpodpytorchjob" ;;
esac
[[ "$region" =~ ^[a-z]{2}(-[a-z]+)+-[0-9]$ ]] || die "--region '$region' is not an AWS region such as us-east-1"
cd "$(dirname "$0")/.."
if [ -z "$tag" ]; then
  tag="$(git rev-parse --short=12 HEAD 2>/dev/null)" || die "no --tag given and this is not a git checkout"
  git diff --quiet HEAD 2>/dev/null || tag="$tag-dirty"
fi
[[ "$tag" =~ ^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$ ]] || die "--tag '$tag' is not a valid image tag"

registry="$account.dkr.ecr.$region.amazonaws.com"
images=(trainer components evaluator)  # the evaluator after the trainer: it is built FROM it
compile_args="" unpushed=""
if [ "$job_api" = hyperpodpytorchjob ]; then
  images=(trainer trainer-hyperpod components evaluator)
  unpushed=trainer  # only the evaluator's base: the pipeline names trainer-hyperpod
fi
if [ "$job_api" != pytorchjob ]; then
  compile_args=" --job-api $job_api"
fi

if [ "$push" = 1 ]; then
  echo "logging in to $registry"
  aws ecr get-login-password --region "$region" | docker login --username AWS --password-stdin "$registry"
fi

for image in "${images[@]}"; do
  repository="hyperpod-pretrain-$image"
  echo "building $repository:$tag ($platform)"
  build_args=(--build-arg "COMMIT=$(git rev-parse --short=12 HEAD 2>/dev/null || echo "$tag")")
  if [ "$image" = trainer-hyperpod ]; then
    build_args+=(--build-arg STACK_VARIANT=hyperpod)
  elif [ "$image" = evaluator ]; then
    build_args+=(--build-arg "TRAINER_IMAGE=$registry/hyperpod-pretrain-trainer:$tag")  # tagged above
  fi
  docker build --platform "$platform" -f "docker/${image%-hyperpod}.Dockerfile" "${build_args[@]}" \
    -t "$repository:$tag" .
  docker tag "$repository:$tag" "$registry/$repository:$tag"
  if [ "$push" = 1 ] && [ "$image" != "$unpushed" ]; then
    aws ecr describe-repositories --region "$region" --repository-names "$repository" >/dev/null 2>&1 \
      || aws ecr create-repository --region "$region" --repository-name "$repository" >/dev/null
    docker push "$registry/$repository:$tag"
  fi
done

echo
echo "next: compile the pipeline with these images"
echo "  hyperpod-pretrain compile --image-registry $registry --tag $tag$compile_args"
