"""Experiments: create, get and list (``/apis/v2beta1/experiments``), and the "Default" experiment a run without one
goes to."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tests.kfp_server.auth import Authorized
from tests.kfp_server.errors import KfpError
from tests.kfp_server.listing import page
from tests.kfp_server.records import Call, Record, now_rfc3339


@dataclass
class ExperimentRecord(Record):
    @property
    def id(self) -> str:
        return self.resource["experiment_id"]


class Experiments(Authorized):
    """The experiment service's handlers, over the experiments the fake keeps."""

    experiments: dict[str, ExperimentRecord]

    def _create_experiment(self, call: Call) -> tuple[str, Any]:
        body = call.body
        name = (body.get("display_name") or "").strip()
        if not name:
            raise KfpError(400, "Invalid input error: Experiment display_name is empty")
        namespace = body.get("namespace") or ""
        self._access(
            call,
            "experiments",
            "create",
            namespace,
            "Failed to authorize the request: Failed to authorize with API",
            "An experiment cannot have an empty namespace in multi-user mode",
            name,
        )
        if any(
            e.get("display_name") == name and e.get("namespace", "") == namespace for e in self.experiments.values()
        ):
            raise KfpError(409, f"Already exist error: experiment {name!r} already exists in namespace {namespace!r}")
        return "V2beta1Experiment", self._add_experiment(name, body.get("description"), namespace).resource

    def _add_experiment(self, name: str, description: str | None, namespace: str) -> ExperimentRecord:
        resource = {
            "experiment_id": str(uuid.uuid4()),
            "display_name": name,
            "created_at": now_rfc3339(),
            "storage_state": "AVAILABLE",
        }
        if description:
            resource["description"] = description
        if namespace:
            resource["namespace"] = namespace
        record = ExperimentRecord(resource)
        self.experiments[record.id] = record
        return record

    def _experiment(self, experiment_id: str) -> ExperimentRecord:
        record = self.experiments.get(experiment_id)
        if record is None:
            raise KfpError(404, f"Experiment {experiment_id} not found")
        return record

    def _get_experiment(self, call: Call) -> tuple[str, Any]:
        record = self._experiment(call.params["experiment_id"])
        self._access(
            call,
            "experiments",
            "get",
            record.get("namespace", ""),
            "Failed to authorize the request: Failed to authorize with API",
            "An experiment cannot have an empty namespace in multi-user mode",
            record["display_name"],
        )
        return "V2beta1Experiment", record.resource

    def _list_experiments(self, call: Call) -> tuple[str, Any]:
        namespace = call.query.get("namespace", "")
        self._access(
            call,
            "experiments",
            "list",
            namespace,
            "Failed to authorize with API: Failed to authorize with API",
            "An experiment cannot have an empty namespace in multi-user mode",
        )
        records = [e for e in self.experiments.values() if not namespace or e.get("namespace", "") == namespace]
        return "V2beta1ListExperimentsResponse", page(records, call.query, "V2beta1Experiment", "experiments")

    def _experiment_for(self, body: Mapping[str, Any], query: Mapping[str, str]) -> str:
        experiment_id = body.get("experiment_id") or query.get("experiment_id") or ""
        if experiment_id:
            return self._experiment(experiment_id).id
        default = next((e for e in self.experiments.values() if e.get("display_name") == "Default"), None)
        return (default or self._add_experiment("Default", None, "")).id
