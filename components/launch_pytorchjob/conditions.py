"""Reading a PyTorchJob's status: its conditions, as the Training Operator writes them (UpdateJobConditions)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

TERMINAL = ("Succeeded", "Failed")


def true_condition(job: dict[str, Any], type_: str) -> bool:
    conditions = job.get("status", {}).get("conditions", [])
    return any(c.get("type") == type_ and c.get("status") == "True" for c in conditions)


def is_finished(job: dict[str, Any]) -> bool:
    return true_condition(job, "Succeeded") or true_condition(job, "Failed")


def condition_times(job: dict[str, Any]) -> tuple[float | None, float | None]:
    def seconds(stamp: str | None) -> float | None:
        return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp() if stamp else None

    created = seconds(job.get("metadata", {}).get("creationTimestamp"))
    by_type = {c["type"]: seconds(c.get("lastTransitionTime")) for c in job.get("status", {}).get("conditions", [])}
    running = by_type.get("Running")
    end = by_type.get("Succeeded") or by_type.get("Failed")
    queued = running - created if running and created else None
    return queued, (end - running if end and running else None)


def latest_condition(job: dict[str, Any]) -> dict[str, Any] | None:
    true = [c for c in job.get("status", {}).get("conditions", []) if c.get("status") == "True"]
    terminal = [c for c in true if c["type"] in TERMINAL]
    return (terminal or true or [None])[-1]
