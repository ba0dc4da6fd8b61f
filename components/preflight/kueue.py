"""The queue check: with a Kueue queue compiled in, Kueue must run in the cluster, be new enough to admit the job's
kind and manage that kind (its integrations.frameworks), or the job waits suspended for ever or runs unqueued."""

from __future__ import annotations

import yaml
from kubernetes.client.exceptions import ApiException

from components.launch_training.rendering import QUEUE_LABEL
from components.preflight.context import Context, forbidden, not_found, raw_items
from components.preflight.image_reference import SEMVER, image_tag
from components.preflight.kueue_versions import KUEUE_INTEGRATION_SINCE, kueue_api_note
from components.preflight.result import FAIL, NOT_APPLICABLE, PASS, READ_FIX, WARN, Check

# Kueue as its release manifests install it (kubernetes-sigs/kueue v0.19.2, config/default/kustomization.yaml:
# namespace kueue-system, namePrefix kueue-, labels app.kubernetes.io/name=kueue): the controller's Deployment and
# its configuration, whose integrations.frameworks lists the job kinds it manages (controller_manager_config.yaml).
KUEUE_NAMESPACE, KUEUE_SELECTOR, KUEUE_CONFIG = "kueue-system", "app.kubernetes.io/name=kueue", "kueue-manager-config"


def check_queue(ctx: Context) -> Check:
    """With a Kueue queue compiled in: Kueue is there, new enough for the job's kind, and manages that kind."""
    queue = (ctx.job["metadata"].get("labels") or {}).get(QUEUE_LABEL)
    if not queue:
        return Check("queue", NOT_APPLICABLE, "no Kueue queue compiled in: the job starts when its pods fit")
    framework = ctx.api.kueue_framework
    fix = (
        f"install Kueue v0.14 or later with {framework} in its integrations.frameworks "
        f"({KUEUE_NAMESPACE}/{KUEUE_CONFIG}), or compile without --queue-name"
    )
    try:
        deployments = raw_items(
            ctx.kube.call(
                "list Deployments",
                ctx.apps.list_namespaced_deployment,
                KUEUE_NAMESPACE,
                label_selector=KUEUE_SELECTOR,
                _preload_content=False,
            )
        )
    except ApiException as exc:
        if not forbidden(exc):
            raise
        deployments = None
    reasons: list[str] = []
    if deployments == []:
        return Check(
            "queue",
            FAIL,
            f"queue {queue!r} is compiled in, but no Kueue runs in {KUEUE_NAMESPACE} (no "
            f"Deployment labelled {KUEUE_SELECTOR}): the job would never be admitted",
            fix,
        )
    version = ""
    if deployments:
        containers = deployments[0]["spec"]["template"]["spec"].get("containers") or []
        version = image_tag(next((c.get("image", "") for c in containers if "kueue" in c.get("image", "")), ""))
        match = SEMVER.fullmatch(version)
        release = (int(match[1]), int(match[2]), int(match[3])) if match else None
        since = KUEUE_INTEGRATION_SINCE.get(framework)
        if since and release and release < since:
            return Check(
                "queue",
                FAIL,
                f"Kueue {version} admits no {ctx.api.kind}s (its {ctx.api.name} integration came in "
                f"v{'.'.join(map(str, since))}): the job would wait suspended for ever",
                fix,
            )
        reasons.append(f"Kueue {version or 'version unknown'}")
        note = kueue_api_note(ctx.api, release)
    else:
        reasons.append("Kueue's Deployment not readable (its version unknown)")
        note = kueue_api_note(ctx.api, None)
    try:
        config = ctx.kube.call("get ConfigMap", ctx.core.read_namespaced_config_map, KUEUE_CONFIG, KUEUE_NAMESPACE)
        # controller_manager_config.yaml: a Configuration whose integrations.frameworks lists the managed kinds
        settings = [yaml.safe_load(text) for text in (config.data or {}).values()]
        frameworks = [
            name
            for doc in settings
            if isinstance(doc, dict)
            for name in ((doc.get("integrations") or {}).get("frameworks") or [])
        ]
        if framework not in frameworks:
            return Check(
                "queue",
                FAIL,
                f"{', '.join(reasons)} does not manage {framework} (not in "
                f"integrations.frameworks of {KUEUE_NAMESPACE}/{KUEUE_CONFIG}): the queue label is ignored "
                "and the job runs unqueued",
                fix,
            )
        reasons.append(f"manages {framework}")
    except ApiException as exc:
        if not (forbidden(exc) or not_found(exc)):
            raise
        return Check(
            "queue",
            WARN,
            f"queue {queue!r}; {', '.join(reasons)}; whether it manages {framework} is "
            f"unknown ({KUEUE_NAMESPACE}/{KUEUE_CONFIG} not readable)",
            READ_FIX.format(what=f"get on configmaps {KUEUE_CONFIG} in {KUEUE_NAMESPACE}"),
        )
    return Check("queue", PASS, f"queue {queue!r}: {', '.join(reasons)}; Kueue {note}")
