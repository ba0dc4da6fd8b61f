"""The device-plugins check: a job that requests GPUs or EFA devices needs the DaemonSet that advertises them
running on the nodes, else its pods stay Pending (the seed's troubleshooting table: EFA not found)."""

from __future__ import annotations

from decimal import Decimal

from kubernetes.client.exceptions import ApiException

from components.preflight.context import EFA, GPU, Context, forbidden, raw_items
from components.preflight.result import FAIL, NOT_APPLICABLE, PASS, READ_FIX, SEED_FIX, WARN, Check


def check_device_plugins(ctx: Context) -> Check:
    wanted = [
        (what, words, fix)
        for what, resource, words, fix in (
            ("EFA", EFA, ("efa", "device-plugin"), SEED_FIX["efa"]),
            (
                "NVIDIA",
                GPU,
                ("nvidia", "device-plugin"),
                "Ensure the NVIDIA device plugin DaemonSet is running "
                "(HyperPod installs it in kube-system; or the NVIDIA GPU Operator)",
            ),
        )
        if ctx.request.get(resource, Decimal(0)) > 0
    ]
    if not wanted:
        return Check("device-plugins", NOT_APPLICABLE, "the job requests neither GPUs nor EFA devices")
    try:
        daemonsets = raw_items(
            ctx.kube.call("list DaemonSets", ctx.apps.list_daemon_set_for_all_namespaces, _preload_content=False)
        )
    except ApiException as exc:
        if not forbidden(exc):
            raise
        return Check(
            "device-plugins",
            WARN,
            "cannot list DaemonSets: the service account may not list daemonsets in all namespaces",
            READ_FIX.format(what="list on daemonsets.apps"),
        )
    problems, fixes, fine = [], [], []
    for what, words, fix in wanted:
        found = [d for d in daemonsets if all(w in d["metadata"]["name"].lower() for w in words)]
        if not found:
            problems.append(f"no {what} device plugin DaemonSet (a name with {' and '.join(words)}) in any namespace")
            fixes.append(fix)
            continue
        best = max(found, key=lambda d: (d.get("status") or {}).get("numberReady") or 0)
        ready = (best.get("status") or {}).get("numberReady") or 0
        desired = (best.get("status") or {}).get("desiredNumberScheduled") or 0
        ns, name = best["metadata"].get("namespace", ""), best["metadata"]["name"]
        where = f"{ns}/{name}"
        if desired == 0:
            problems.append(
                f"{what} device plugin {where} schedules no pod (0 desired): its nodeSelector or "
                "tolerations match no node"
            )
            fixes.append(f"{fix} (kubectl -n {ns} describe ds {name})")
        elif ready != desired:
            problems.append(f"{what} device plugin {where}: {ready} of {desired} pods ready")
            fixes.append(f"{fix} (kubectl -n {ns} describe ds {name})")
        else:
            fine.append(f"{what} {where} {ready}/{desired} ready")
    if problems:
        return Check("device-plugins", FAIL, "; ".join(problems + fine), "; ".join(fixes))
    return Check("device-plugins", PASS, "; ".join(fine))
