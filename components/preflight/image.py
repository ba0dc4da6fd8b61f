"""The image check: the trainer's image is a well-formed reference (image_reference.py), pinned by a tag other
than latest or a digest, and, when it is in ECR, what the nodes need to pull it (its registry is not reachable from
the step). A HyperPodPyTorchJob's workers run hyperpodrun, the HyperPod elastic agent, which only the trainer image
docker/build.sh --job-api hyperpodpytorchjob pushes carries (docs/images.md): its command must start with it, and its
image must be that one, or one this check cannot tell about."""

from __future__ import annotations

from pathlib import PurePosixPath

from components.launch_training.hyperpodpytorchjob import HYPERPODPYTORCHJOB
from components.launch_training.job_api import JobApi
from components.preflight.context import Context
from components.preflight.image_reference import ECR, parse_reference
from components.preflight.result import FAIL, PASS, SEED_FIX, WARN, Check

AGENT = "hyperpodrun"
# The trainer repositories docker/build.sh pushes: the other job APIs' has no hyperpodrun, this one's is built on the
# agent's stack.
TRAINER_REPOSITORY, HYPERPOD_TRAINER_REPOSITORY = JobApi.trainer_repository, HYPERPODPYTORCHJOB.trainer_repository
HYPERPOD_BUILD = f"docker/build.sh --job-api hyperpodpytorchjob, which pushes {HYPERPOD_TRAINER_REPOSITORY}"


def check_image(ctx: Context) -> Check:
    image = ctx.container.get("image") or ""
    try:
        parts = parse_reference(image)
    except ValueError as exc:
        return Check(
            "image",
            FAIL,
            f"image {image!r} is not a valid reference: {exc}",
            "give registry/repository:tag or registry/repository@sha256:<64 hex digits>",
        )
    pulled = check_pull(ctx, image, parts)
    if ctx.api.name != HYPERPODPYTORCHJOB.name:
        return pulled
    return check_agent(ctx, image, parts["path"].rsplit("/", 1)[-1], pulled)


def check_pull(ctx: Context, image: str, parts: dict[str, str]) -> Check:
    """How the image is pinned and, in ECR, what pulling it takes."""
    secrets = [s.get("name", "") for s in ctx.pod.get("imagePullSecrets") or []]
    ecr = ECR.fullmatch(parts["domain"])
    pinned = f"@{parts['digest'][:19]}..." if parts["digest"] else f":{parts['tag'] or 'latest'}"
    if ecr is not None:
        where = (
            f"ECR image {parts['path']}{pinned} (account {ecr['account']}, {ecr['region']}): its registry is not "
            "reachable from here"
        )
        if secrets:
            return Check(
                "image",
                WARN,
                f"{where}; an ECR token in an image pull secret ({', '.join(secrets)}) "
                "expires after 12 hours: refresh it, or drop the secret and use the node role / IRSA",
                f"{SEED_FIX['ecr']} (ECR auth expires)",
            )
        return Check(
            "image",
            WARN,
            f"{where}; nodes pull with their instance role: it needs ecr:BatchGetImage "
            "(AmazonEC2ContainerRegistryReadOnly)",
            f"{SEED_FIX['ecr']}; attach AmazonEC2ContainerRegistryReadOnly to the nodes' role",
        )
    if not parts["tag"] and not parts["digest"] or parts["tag"] == "latest" and not parts["digest"]:
        return Check(
            "image",
            WARN,
            f"image {image} has no tag but :latest: a rerun or a restarted pod may get another image",
            "tag the image (docker/build.sh) or pin it by @sha256 digest",
        )
    registry = parts["domain"] or "docker.io"
    return Check("image", PASS, f"{image}: well formed ({registry}, {pinned.lstrip(':@')})")


def check_agent(ctx: Context, image: str, repository: str, pulled: Check) -> Check:
    """A HyperPodPyTorchJob's worker runs hyperpodrun as PID 1 (exec form: the pod's SIGTERM reaches the agent, which
    passes it to the trainer), from an image that has it: ours by its repository, any other with a warning."""
    command = ctx.container.get("command") or []
    if not command or PurePosixPath(command[0]).name != AGENT:
        first = repr(command[0]) if command else "nothing"
        return Check(
            "image",
            FAIL,
            f"the {HYPERPODPYTORCHJOB.kind}'s container command starts with {first}, not {AGENT}: the operator runs "
            "its workers through the HyperPod elastic agent, PID 1 in exec form",
            f"start the command with {AGENT}, as hyperpod-pretrain render-job --job-api hyperpodpytorchjob renders it",
        )
    if repository == TRAINER_REPOSITORY:
        return Check(
            "image",
            FAIL,
            f"image {image}: {TRAINER_REPOSITORY} has no {AGENT}, which a {HYPERPODPYTORCHJOB.kind}'s workers run",
            f"build with {HYPERPOD_BUILD}, and run with that image",
        )
    if repository == HYPERPOD_TRAINER_REPOSITORY:
        return pulled
    unknown = f"whether {repository} carries {AGENT} cannot be told from here (docs/images.md)"
    fix = f"use the image {HYPERPOD_BUILD}, or one with hyperpod-elastic-agent installed"
    return Check("image", WARN, f"{pulled.reason}; {unknown}", "; ".join(f for f in (pulled.fix, fix) if f))
