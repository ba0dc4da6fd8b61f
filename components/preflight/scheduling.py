"""What the kube-scheduler counts and matches, redone on plain dicts: a pod's requests, node affinity and taints
against tolerations. The nodes check asks it of every node; Context sums the worker's requests with it."""

from __future__ import annotations

from collections.abc import Iterable
from decimal import Decimal
from typing import Any

from components.preflight.quantities import quantity


def workers_in(wanted: dict[str, Decimal], free: dict[str, Decimal], most: int) -> int:
    """How many workers needing `wanted` fit in `free`, at most `most` (all of them when nothing is requested)."""
    return min([int(max(free[r], Decimal(0)) // q) for r, q in wanted.items()] + [most])


def required_affinity_mismatch(affinity: dict[str, Any], labels: dict[str, str]) -> str:
    """ "" when the node satisfies the pod's required node affinity, else the first term's unmatched expression."""
    required = (affinity.get("nodeAffinity") or {}).get("requiredDuringSchedulingIgnoredDuringExecution") or {}
    terms = required.get("nodeSelectorTerms") or []
    if not terms:
        return ""
    first_miss = ""
    for term in terms:  # terms are ORed, expressions ANDed
        missed = next((e for e in term.get("matchExpressions") or [] if not expression_matches(e, labels)), None)
        if missed is None:
            return ""
        first_miss = first_miss or f"{missed['key']} {missed['operator']} {','.join(missed.get('values') or [])}"
    return first_miss.strip()


def expression_matches(expression: dict[str, Any], labels: dict[str, str]) -> bool:
    key, operator, values = expression["key"], expression["operator"], expression.get("values") or []
    value = labels.get(key)
    if operator == "In":
        return value in values
    if operator == "NotIn":
        return value not in values
    if operator == "Exists":
        return value is not None
    if operator == "DoesNotExist":
        return value is None
    if operator in ("Gt", "Lt"):
        try:
            number, bound = int(value or ""), int(values[0])
        except (ValueError, IndexError):
            return False
        return number > bound if operator == "Gt" else number < bound
    return False


def untolerated_taint(taints: Iterable[dict[str, Any]], tolerations: list[dict[str, Any]]) -> str:
    """The first NoSchedule/NoExecute taint no toleration tolerates, as key=value:Effect; "" if none."""
    for taint in taints:
        if taint.get("effect") not in ("NoSchedule", "NoExecute"):
            continue
        if not any(tolerates(t, taint) for t in tolerations):
            value = taint.get("value")
            return f"{taint.get('key')}" + (f"={value}" if value else "") + f":{taint['effect']}"
    return ""


def tolerates(toleration: dict[str, Any], taint: dict[str, Any]) -> bool:
    """Whether a pod's toleration tolerates a node's taint (an empty effect or key with Exists matches all)."""
    effect = toleration.get("effect") or ""
    if effect and effect != taint.get("effect"):
        return False
    key, operator = toleration.get("key") or "", toleration.get("operator") or "Equal"
    if operator == "Exists":
        return not key or key == taint.get("key")
    return key == taint.get("key") and (toleration.get("value") or "") == (taint.get("value") or "")


def pod_requests(pod_spec: dict[str, Any]) -> dict[str, Decimal]:
    """What the scheduler counts for a pod: the containers' requests (a limit stands in for a missing request),
    sidecar init containers included; at least any one init container's; plus the pod's overhead."""

    def of(container: dict[str, Any]) -> dict[str, Decimal]:
        resources = container.get("resources") or {}
        amounts = {**(resources.get("limits") or {}), **(resources.get("requests") or {})}
        return {r: quantity(v) for r, v in amounts.items()}

    total: dict[str, Decimal] = {}
    for container in pod_spec.get("containers") or []:
        add_to(total, of(container))
    init_peak: dict[str, Decimal] = {}
    sidecars: dict[str, Decimal] = {}
    for container in pod_spec.get("initContainers") or []:
        if container.get("restartPolicy") == "Always":  # a sidecar runs alongside the containers
            add_to(sidecars, of(container))
            add_to(total, of(container))
        else:
            for r, q in of(container).items():
                init_peak[r] = max(init_peak.get(r, Decimal(0)), q + sidecars.get(r, Decimal(0)))
    for r, q in init_peak.items():
        total[r] = max(total.get(r, Decimal(0)), q)
    add_to(total, {r: quantity(v) for r, v in (pod_spec.get("overhead") or {}).items()})
    return total


def add_to(total: dict[str, Decimal], amounts: dict[str, Decimal]) -> None:
    for r, q in amounts.items():
        total[r] = total.get(r, Decimal(0)) + q
