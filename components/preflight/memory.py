"""The memory check: the container's memory limit against the instance's memory (a node must keep some for itself)
and /dev/shm against the limit (it is memory-backed: a /dev/shm as large as the limit gets the pod OOM-killed)."""

from __future__ import annotations

from decimal import Decimal

from components.preflight.context import Context
from components.preflight.quantities import GI, quantity, show
from components.preflight.result import FAIL, NOT_APPLICABLE, PASS, SEED_FIX, WARN, Check

# A memory limit above this share of the instance's memory leaves too little for the kubelet's reserve, the eviction
# threshold, the OS, the device plugins and the daemons on the node: EKS nodes keep ~4% of a 2 TiB instance back
# (a p5.48xlarge has ~1968 GiB allocatable of 2048), so 95% is already at the edge of what can be scheduled at all.
MEMORY_HEADROOM = Decimal("0.95")


def check_memory(ctx: Context) -> Check:
    resources = ctx.container.get("resources") or {}
    memory = (resources.get("limits") or {}).get("memory") or (resources.get("requests") or {}).get("memory")
    shm_volume = ctx.volume(lambda v: (v.get("emptyDir") or {}).get("medium") == "Memory")
    shm_text = (shm_volume or {}).get("emptyDir", {}).get("sizeLimit")
    if memory is None:
        return Check(
            "memory",
            WARN,
            "the container has no memory limit: /dev/shm and the processes are unbounded",
            f"{SEED_FIX['oom']} (job option memory)",
        )
    limit = quantity(memory)
    problems, fixes, notes = [], [], []
    status = PASS
    if shm_text is not None:
        shm = quantity(shm_text)
        if shm >= limit:
            status = FAIL
            over = shm - limit
            by = "equal to it" if not over else f"{show('memory', over)} over it"
            problems.append(
                f"/dev/shm sizeLimit {show('memory', shm)} is not below the {show('memory', limit)} "
                f"memory limit ({by}): /dev/shm is memory-backed and counts against the pod's memory, "
                "so the pod is OOM-killed before /dev/shm fills"
            )
            fixes.append(f"{SEED_FIX['oom']} (job option memory) or lower shm_size below it")
        else:
            notes.append(
                f"/dev/shm {show('memory', shm)} leaves {show('memory', limit - shm)} of the "
                f"{show('memory', limit)} limit for the processes"
            )
    if not ctx.memory_gib:
        if status == FAIL:
            return Check("memory", FAIL, "; ".join(problems), "; ".join(fixes))
        return Check(
            "memory", NOT_APPLICABLE, "the instance type's memory is unknown" + (f"; {notes[0]}" if notes else "")
        )
    instance = Decimal(ctx.memory_gib) * GI
    ceiling = instance * MEMORY_HEADROOM
    pct = f"{limit / instance * 100:.0f}%"
    if limit > instance:
        status = FAIL
        problems.append(
            f"memory limit {show('memory', limit)} is above the instance's {ctx.memory_gib}Gi "
            f"({pct}): no node can hold a worker"
        )
        fixes.append(f"lower job option memory to at most {show('memory', ceiling)} (95% of {ctx.memory_gib}Gi)")
    elif limit > ceiling:
        status = WARN if status == PASS else status
        problems.append(
            f"memory limit {show('memory', limit)} is {pct} of the instance's {ctx.memory_gib}Gi: above "
            "95% too little is left for the kubelet's reserve, the OS and the node's daemons"
        )
        fixes.append(f"lower job option memory to at most {show('memory', ceiling)} (95% of {ctx.memory_gib}Gi)")
    if problems:
        return Check("memory", status, "; ".join(problems), "; ".join(fixes))
    return Check(
        "memory",
        PASS,
        f"memory limit {show('memory', limit)} is {pct} of the instance's {ctx.memory_gib}Gi "
        f"(at most 95%)" + (f"; {notes[0]}" if notes else ""),
    )
