"""The image check: the trainer's image is a well-formed reference (image_reference.py), pinned by a tag other
than latest or a digest, and, when it is in ECR, what the nodes need to pull it (its registry is not reachable from
the step)."""

from __future__ import annotations

from components.preflight.context import Context
from components.preflight.image_reference import ECR, parse_reference
from components.preflight.result import FAIL, PASS, SEED_FIX, WARN, Check


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
