"""The nodes check: how many of the job's workers the cluster's nodes hold now, and would hold were nothing else
running, with each node that holds none counted by why (cordoned, unhealthy, selector, affinity, taint, short of a
resource). The scheduler's own rules are in scheduling.py."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from kubernetes.client.exceptions import ApiException

from components.launch_training.rendering import HEALTH_LABEL
from components.preflight.context import EFA, GPU, Context, forbidden, raw_items
from components.preflight.quantities import quantity, show
from components.preflight.result import FAIL, PASS, READ_FIX, SEED_FIX, WARN, Check
from components.preflight.scheduling import (
    add_to,
    pod_requests,
    required_affinity_mismatch,
    untolerated_taint,
    workers_in,
)

FIT_RESOURCES = (GPU, EFA, "cpu", "memory")
HEALTHY = "Schedulable"
EXAMPLES = 4  # nodes named in the nodes check's reason, one per cause first


@dataclass
class NodeFit:
    name: str
    slots: int = 0  # workers that fit on it now, after what runs there
    idle_slots: int = 0  # workers that would fit were nothing else running there (its allocatable alone)
    cause: str = ""  # why none fits now, counted across nodes ("cordoned", "short of nvidia.com/gpu", ...)
    detail: str = ""  # the same, for this node ("nvidia.com/gpu 8 requested, 4 free")


def check_nodes(ctx: Context) -> Check:
    kube = ctx.kube
    try:
        nodes = raw_items(kube.call("list nodes", kube.core.list_node, _preload_content=False))
    except ApiException as exc:
        if not forbidden(exc):
            raise
        return Check(
            "nodes",
            WARN,
            "cannot list nodes: the service account may not list nodes, so whether "
            f"{ctx.min_nodes} node(s) fit is unknown",
            READ_FIX.format(what="list on nodes and on pods in all namespaces"),
        )
    used: dict[str, dict[str, Decimal]] = {}
    pods_unknown = ""
    try:
        pods = raw_items(
            kube.call(
                "list pods",
                kube.core.list_pod_for_all_namespaces,
                _preload_content=False,
                field_selector="status.phase!=Succeeded,status.phase!=Failed",
            )
        )
    except ApiException as exc:
        if not forbidden(exc):
            raise
        pods_unknown = "cannot list pods in all namespaces, so free resources are unknown: counted by allocatable"
        pods = []
    for pod in pods:
        node = (pod.get("spec") or {}).get("nodeName")
        if not node or pod_of_job(ctx, pod):  # unscheduled, or ours
            continue
        add_to(used.setdefault(node, {}), pod_requests(pod["spec"]))
    fits = sorted((node_fit(ctx, node, used.get(node["metadata"]["name"], {})) for node in nodes), key=lambda f: f.name)
    slots, idle_slots = sum(f.slots for f in fits), sum(f.idle_slots for f in fits)
    fitting = [f for f in fits if f.slots]
    request = ", ".join(f"{show(r, q)} {r}" for r, q in ctx.request.items() if r in FIT_RESOURCES and q)
    needs = f"the job needs {ctx.min_nodes}" + (f" (up to {ctx.max_nodes})" if ctx.max_nodes != ctx.min_nodes else "")
    workers = f" ({slots} workers in all)" if slots != len(fitting) else ""
    busy = slots < ctx.min_nodes <= idle_slots  # too full now, big enough once the other pods are gone
    if busy:
        idle_nodes = sum(1 for f in fits if f.idle_slots)
        reason = (
            f"does not fit now: {len(fitting)} of {len(fits)} node(s) free for a worker{workers} ({request}); "
            f"{needs}; would fit an idle cluster ({idle_nodes} node(s) hold a worker when nothing else runs), "
            "so the job will wait in Pending/queue until capacity frees"
        )
    else:
        reason = f"{len(fitting)} of {len(fits)} node(s) fit a worker{workers} ({request}); {needs}"
        if slots < ctx.min_nodes:
            reason += f"; even an idle cluster holds only {idle_slots}"
    others = [f for f in fits if not f.slots]
    if others:
        counts = sorted(Counter(f.cause for f in others).items(), key=lambda item: (-item[1], item[0]))
        examples = [next(f for f in others if f.cause == cause) for cause, _ in counts]
        examples += [f for f in others if f not in examples]
        named = "; ".join(f"{f.name}: {f.detail}" for f in examples[:EXAMPLES])
        more = f"; +{len(others) - EXAMPLES} more" if len(others) > EXAMPLES else ""
        summary = ", ".join(f"{n} {cause}" for cause, n in counts)
        reason += f". Not fitting{' now' if busy else ''}: {summary} ({named}{more})"
    if pods_unknown:
        reason += f". {pods_unknown}"
    if busy:
        return Check(
            "nodes",
            WARN,
            reason,
            "nothing to change if waiting is fine; to start sooner, see what holds the "
            "nodes (kubectl get pods -A -o wide --field-selector spec.nodeName=NODE) and free them, or lower "
            "nnodes (or set max_nodes above it: an elastic job starts with what fits)",
        )
    fix = (
        f"{SEED_FIX['pending']}; uncordon or replace unhealthy nodes, free busy ones, add tolerations, or lower nnodes"
    )
    if slots < ctx.min_nodes:
        return Check("nodes", FAIL, reason, fix)
    if slots < ctx.max_nodes:
        return Check("nodes", WARN, reason + f": the elastic job starts with {slots} of {ctx.max_nodes}", fix)
    if pods_unknown:
        return Check("nodes", WARN, reason, READ_FIX.format(what="list on pods in all namespaces"))
    return Check("nodes", PASS, reason)


def pod_of_job(ctx: Context, pod: dict[str, Any]) -> bool:
    """Whether a pod (raw JSON) is one of the job's (its API's label)."""
    key, _, value = ctx.api.pod_selector(ctx.name).partition("=")
    return (pod["metadata"].get("labels") or {}).get(key) == value


def node_fit(ctx: Context, node: dict[str, Any], used: dict[str, Decimal]) -> NodeFit:
    """How many workers fit on the node now and with nothing else on it, or the first reason none does now. What
    keeps a worker off the node whatever runs there (cordon, health, Ready, selector, affinity, taints) blocks both."""
    name = node["metadata"]["name"]
    labels = node["metadata"].get("labels") or {}
    spec, status = node.get("spec") or {}, node.get("status") or {}
    fit = NodeFit(name)

    def blocked(cause: str, detail: str = "") -> NodeFit:
        fit.cause, fit.detail = cause, detail or cause
        return fit

    if spec.get("unschedulable"):
        return blocked("cordoned")
    ready = next((c for c in status.get("conditions") or [] if c.get("type") == "Ready"), None)
    if ready is None or ready.get("status") != "True":
        return blocked("not Ready", f"not Ready ({(ready or {}).get('reason') or 'no Ready condition'})")
    health = labels.get(HEALTH_LABEL)
    if health is not None and health != HEALTHY:  # HyperPod is about to reboot or replace it, affinity or not
        return blocked(f"health {health}")
    selector = ctx.pod.get("nodeSelector") or {}
    wrong = [f"{k}={v}" for k, v in selector.items() if labels.get(k) != v]
    if wrong:
        return blocked("node selector", f"node selector {', '.join(wrong)} not matched")
    unmatched = required_affinity_mismatch(ctx.pod.get("affinity") or {}, labels)
    if unmatched:
        if HEALTH_LABEL in unmatched and health is None:
            return blocked("no health label", f"no {HEALTH_LABEL} label (the job's affinity requires {HEALTHY})")
        return blocked("node affinity", f"node affinity {unmatched} not matched")
    taint = untolerated_taint(spec.get("taints") or [], ctx.pod.get("tolerations") or [])
    if taint:
        return blocked("untolerated taint", f"taint {taint} not tolerated")
    allocatable = {r: quantity(v) for r, v in (status.get("allocatable") or {}).items()}
    wanted = {r: q for r, q in ctx.request.items() if r in FIT_RESOURCES and q > 0}
    idle = {r: allocatable.get(r, Decimal(0)) for r in wanted}
    free = {r: idle[r] - used.get(r, Decimal(0)) for r in wanted}
    fit.slots, fit.idle_slots = workers_in(wanted, free, ctx.max_nodes), workers_in(wanted, idle, ctx.max_nodes)
    short = [(r, q, free[r]) for r, q in wanted.items() if free[r] < q]
    if short:
        detail = ", ".join(f"{r} {show(r, w)} requested, {show(r, max(f, Decimal(0)))} free" for r, w, f in short)
        return blocked(f"short of {short[0][0]}", detail)
    return fit
