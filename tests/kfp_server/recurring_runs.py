"""Recurring runs: create, get, list, enable, disable and delete (``/apis/v2beta1/recurringruns``; the ``jobs``
resource to the authorizer), their trigger's cron checked as the scheduled-workflow controller reads it."""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from typing import Any

from tests.kfp_server.errors import KfpError
from tests.kfp_server.experiments import Experiments
from tests.kfp_server.listing import page
from tests.kfp_server.pipelines import Pipelines
from tests.kfp_server.records import Call, Record, now_rfc3339, spec_parameters
from tests.kfp_server.schema import schema_violations

# robfig/cron as the KFP scheduled-workflow controller configures it: seconds first, day of week optional.
CRON_FIELDS = ("second", "minute", "hour", "day_of_month", "month", "day_of_week")
CRON_RANGES = {
    "second": (0, 59),
    "minute": (0, 59),
    "hour": (0, 23),
    "day_of_month": (1, 31),
    "month": (1, 12),
    "day_of_week": (0, 6),
}
CRON_NAMES = {
    "month": {m: i + 1 for i, m in enumerate("JAN FEB MAR APR MAY JUN JUL AUG SEP OCT NOV DEC".split())},
    "day_of_week": {d: i for i, d in enumerate("SUN MON TUE WED THU FRI SAT".split())},
}
CRON_DESCRIPTORS = frozenset({"@yearly", "@annually", "@monthly", "@weekly", "@daily", "@midnight", "@hourly"})


@dataclass
class RecurringRunRecord(Record):
    @property
    def id(self) -> str:
        return self.resource["recurring_run_id"]

    @property
    def mode(self) -> str:
        return self.resource["mode"]

    @property
    def enabled(self) -> bool:
        return self.resource["mode"] == "ENABLE"

    @property
    def max_concurrency(self) -> int:
        return int(self.resource["max_concurrency"])

    @property
    def no_catchup(self) -> bool:
        return bool(self.resource.get("no_catchup", False))

    @property
    def cron(self) -> str | None:
        return (self.resource["trigger"].get("cron_schedule") or {}).get("cron")

    @property
    def cron_fields(self) -> dict[str, str] | None:
        """The cron expression by field, as the scheduler reads it (seconds first; 5 fields = no day of week)."""
        if self.cron is None or self.cron.startswith("@"):
            return None
        return dict(zip(CRON_FIELDS, [*self.cron.split(), "*"], strict=False))

    @property
    def interval_second(self) -> int | None:
        periodic = self.resource["trigger"].get("periodic_schedule")
        return None if periodic is None else int(periodic["interval_second"])

    @property
    def parameters(self) -> dict[str, Any]:
        return spec_parameters(self.resource)


def cron_violations(cron: str) -> list[str]:
    if cron.startswith("@"):
        if cron in CRON_DESCRIPTORS or re.fullmatch(r"@every (\d+(\.\d+)?(ns|us|µs|ms|s|m|h))+", cron):
            return []
        return [f"cron {cron!r}: unknown descriptor"]
    fields = cron.split()
    if len(fields) not in (5, 6):
        return [f"cron {cron!r}: expected 5 or 6 fields (seconds first, day of week optional), got {len(fields)}"]
    violations = []
    for name, text in zip(CRON_FIELDS, fields, strict=False):
        low, high = CRON_RANGES[name]
        names = CRON_NAMES.get(name, {})
        for part in text.split(","):
            match = re.fullmatch(r"(\*|\?|[0-9A-Za-z]+(?:-[0-9A-Za-z]+)?)(?:/(\d+))?", part)
            if match is None or (match[1] == "?" and name not in ("day_of_month", "day_of_week")):
                violations.append(f"cron {cron!r}: bad {name} {part!r}")
                continue
            if match[1] in ("*", "?"):
                continue
            for bound in match[1].split("-"):
                number = names.get(bound.upper()) if not bound.isdigit() else int(bound)
                if number is None or not low <= number <= high:
                    violations.append(f"cron {cron!r}: {name} {bound!r} is outside {low}-{high}")
    return violations


class RecurringRuns(Experiments, Pipelines):
    """The recurring run service's handlers, over the recurring runs the fake keeps."""

    recurring_runs: dict[str, RecurringRunRecord]

    def _create_recurring_run(self, call: Call) -> tuple[str, Any]:
        body = call.body
        if not (body.get("display_name") or "").strip():
            raise KfpError(400, "Invalid input error: the recurring run's display_name is empty")
        trigger = body.get("trigger") or {}
        schedules = [k for k in ("cron_schedule", "periodic_schedule") if trigger.get(k)]
        if len(schedules) != 1:
            raise KfpError(400, f"Invalid recurring run: the trigger needs exactly one schedule, got {schedules}")
        trigger = {key: dict(value) for key, value in trigger.items() if value}
        if "cron_schedule" in trigger:
            violations = cron_violations(trigger["cron_schedule"].get("cron") or "")
            if violations:
                raise KfpError(400, f"Invalid recurring run: {'; '.join(violations)}")
        else:
            interval = int(trigger["periodic_schedule"].get("interval_second") or 0)
            if interval <= 0:
                raise KfpError(400, f"Invalid recurring run: interval_second must be positive, got {interval}")
            trigger["periodic_schedule"]["interval_second"] = str(interval)
        max_concurrency = int(body.get("max_concurrency") or 0)
        if not 1 <= max_concurrency <= 10:
            raise KfpError(400, f"Invalid recurring run: max_concurrency must be in [1, 10], got {max_concurrency}")
        spec = self._resolve_source(body, "recurring run")
        self._check_runtime_config(body, spec, "recurring run")
        experiment_id = self._experiment_for(body, call.query)
        namespace = self.experiments[experiment_id].get("namespace", "")
        self._access(
            call,
            "jobs",
            "create",
            namespace,
            "Failed to create a recurring run due to authorization error. "
            f"Check if you have write permission to namespace {namespace}: failed to authorize with API",
            "a recurring run cannot have an empty namespace in multi-user mode",
        )
        mode = body.get("mode") or "MODE_UNSPECIFIED"
        created = now_rfc3339()
        resource = {
            **body,
            "recurring_run_id": str(uuid.uuid4()),
            "experiment_id": experiment_id,
            "trigger": trigger,
            "max_concurrency": str(max_concurrency),
            "no_catchup": bool(body.get("no_catchup", False)),
            "mode": mode,
            "status": "ENABLED" if mode == "ENABLE" else "DISABLED",
            "created_at": created,
            "updated_at": created,
        }
        record = RecurringRunRecord(resource)
        self.recurring_runs[record.id] = record
        return "V2beta1RecurringRun", resource

    def _recurring_run(self, recurring_run_id: str) -> RecurringRunRecord:
        record = self.recurring_runs.get(recurring_run_id)
        if record is None:
            raise KfpError(404, f"Recurring run {recurring_run_id} not found")
        return record

    def _get_recurring_run(self, call: Call) -> tuple[str, Any]:
        return "V2beta1RecurringRun", self._recurring_run(call.params["recurring_run_id"]).resource

    def _list_recurring_runs(self, call: Call) -> tuple[str, Any]:
        experiment_id = call.query.get("experiment_id", "")
        namespace = call.query.get("namespace", "")
        if experiment_id and not namespace:  # job_server.go listJobs: the experiment's namespace
            namespace = self._experiment(experiment_id).get("namespace", "")
        self._access(
            call,
            "jobs",
            "list",
            namespace,
            "Failed to list recurring runs due to authorization error. Check "
            f"if you have permission to access namespace {namespace}: failed to authorize with API",
            "a recurring run cannot have an empty namespace in multi-user mode",
        )
        records = [r for r in self.recurring_runs.values() if not experiment_id or r["experiment_id"] == experiment_id]
        # The proto field is literally named recurringRuns, so that is the JSON key (and the model's attribute_map).
        response = page(records, call.query, "V2beta1RecurringRun", "recurringRuns")
        return "V2beta1ListRecurringRunsResponse", response

    def _job_access(self, call: Call, verb: str) -> RecurringRunRecord:
        record = self._recurring_run(call.params["recurring_run_id"])
        namespace = self.experiments[record["experiment_id"]].get("namespace", "")
        self._access(
            call,
            "jobs",
            verb,
            namespace,
            "Failed to authorize the request: failed to authorize with API",
            "a recurring run cannot have an empty namespace in multi-user mode",
            record["display_name"],
        )
        return record

    def _set_mode(self, recurring_run_id: str, mode: str) -> tuple[None, Any]:
        record = self._recurring_run(recurring_run_id)
        record.resource.update(
            mode=mode, status="ENABLED" if mode == "ENABLE" else "DISABLED", updated_at=now_rfc3339()
        )
        return None, {}

    def _enable_recurring_run(self, call: Call) -> tuple[None, Any]:
        return self._set_mode(self._job_access(call, "enable").id, "ENABLE")

    def _disable_recurring_run(self, call: Call) -> tuple[None, Any]:
        return self._set_mode(self._job_access(call, "disable").id, "DISABLE")

    def _delete_recurring_run(self, call: Call) -> tuple[None, Any]:
        policy = call.query.get("propagation_policy")
        if policy is not None:
            violations = schema_violations(policy, "V2beta1DeletePropagationPolicy", "propagation_policy")
            if violations:
                raise KfpError(400, "; ".join(violations))
        del self.recurring_runs[self._job_access(call, "delete").id]
        return None, {}
