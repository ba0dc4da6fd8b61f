"""Runs: create, get and list (``/apis/v2beta1/runs``), and how a run moves on each ``GET /runs/{id}``: ``PENDING``
at creation, then through ``run_progression`` (by default ``RUNNING``), then ``run_outcome``; a run that ends
SUCCEEDED or FAILED gets ``run_details.task_details`` as a real backend reports them (one per Argo node, argo_nodes),
and a FAILED run fails in ``failed_task``."""

from __future__ import annotations

import graphlib
import secrets
import string
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import kfp_server_api

from tests.kfp_server.errors import KfpError
from tests.kfp_server.experiments import Experiments
from tests.kfp_server.listing import page
from tests.kfp_server.pipelines import Pipelines
from tests.kfp_server.records import Call, Record, now_rfc3339, spec_parameters

RUN_STATES = tuple(kfp_server_api.V2beta1RuntimeState.allowable_values)
TERMINAL_STATES = frozenset({"SUCCEEDED", "FAILED", "SKIPPED", "CANCELED"})


@dataclass
class RunRecord(Record):
    spec: dict[str, Any] | None = None  # the pipeline spec it runs
    outcome: str | None = None  # this run's final state; FakeKfp.run_outcome when None
    polls: int = 0  # GETs of this run so far

    @property
    def id(self) -> str:
        return self.resource["run_id"]

    @property
    def state(self) -> str:
        return self.resource["state"]

    @property
    def parameters(self) -> dict[str, Any]:
        """``runtime_config.parameters`` as received (JSON values)."""
        return spec_parameters(self.resource)


def argo_nodes(spec: Mapping[str, Any], failing: str) -> list[tuple[str, str]]:
    """(display name, state) of the Argo nodes a run of ``spec`` leaves when ``failing`` fails: a step, a task's
    "<task>-driver" or "root-driver" ("": none).

    kubeflow/pipelines 2.x, backend/src/v2/compiler/argocompiler: the workflow is named after the pipeline
    (argo.go, GenerateName from pipelineInfo.name), its entrypoint runs "root-driver" and the "root" DAG; every task
    of a DAG is a "<task>-driver" pod then a "<task>" node (dag.go), which for a step is the system-container-executor
    DAG around one "executor" pod (container.go, addContainerExecutorTemplate), and for a group its sub-DAG. A failure
    fails every node around it; what comes after a failed task is not started (the API shows no node for it), but an
    exit task (triggerPolicy ALL_UPSTREAM_TASKS_COMPLETED, an exit hook from 2.4.0) still runs.
    """
    components = spec.get("components") or {}
    nodes: list[tuple[str, str]] = []

    def run_dag(dag: Mapping[str, Any]) -> bool:
        tasks = dag.get("tasks") or {}
        graph = {name: sorted(set(task.get("dependentTasks") or ()) & set(tasks)) for name, task in tasks.items()}
        failed = False
        for name in graphlib.TopologicalSorter(graph).static_order():
            task = tasks[name]
            exit_task = (task.get("triggerPolicy") or {}).get("strategy") == "ALL_UPSTREAM_TASKS_COMPLETED"
            if failed and not exit_task:
                continue
            if failing == f"{name}-driver":
                nodes.append((failing, "FAILED"))
                failed = True
                continue
            nodes.append((f"{name}-driver", "SUCCEEDED"))
            component = components.get(task["componentRef"]["name"]) or {}
            if "dag" in component:
                task_failed = run_dag(component["dag"])
                nodes.append((name, "FAILED" if task_failed else "SUCCEEDED"))
            else:
                task_failed = name == failing
                state = "FAILED" if task_failed else "SUCCEEDED"
                nodes.extend([(name, state), ("executor", state)])
            failed = failed or task_failed
        return failed

    workflow = f"{spec['pipelineInfo']['name']}-{''.join(secrets.choice(string.ascii_lowercase) for _ in range(5))}"
    if failing == "root-driver":
        return [(workflow, "FAILED"), ("root-driver", "FAILED")]
    state = "FAILED" if run_dag(spec["root"]["dag"]) else "SUCCEEDED"
    return [(workflow, state), ("root-driver", "SUCCEEDED"), ("root", state), *nodes]


def steps_in_order(spec: Mapping[str, Any]) -> list[str]:
    """The pipeline's steps (its container tasks) in the order a run reaches them: the nodes an "executor" follows."""
    names = [name for name, _ in argo_nodes(spec, "")]
    return [name for name, after in zip(names, names[1:], strict=False) if after == "executor"]


class Runs(Experiments, Pipelines):
    """The run service's handlers, over the runs the fake keeps, and how those runs move."""

    runs: dict[str, RunRecord]
    failed_task: str

    @property
    def run_outcome(self) -> str:
        """The state runs end in (any V2beta1RuntimeState; a non-terminal one makes them stay there)."""
        return self._run_outcome

    @run_outcome.setter
    def run_outcome(self, state: str) -> None:
        if state not in RUN_STATES:
            raise ValueError(f"run_outcome {state!r} is not a V2beta1RuntimeState ({', '.join(RUN_STATES)})")
        self._run_outcome = state

    @property
    def run_progression(self) -> tuple[str, ...]:
        """The states a run passes through, one per GET, between PENDING and the outcome."""
        return self._run_progression

    @run_progression.setter
    def run_progression(self, states: Sequence[str]) -> None:
        bad = [state for state in states if state not in RUN_STATES]
        if bad:
            raise ValueError(f"run_progression: {bad} are not V2beta1RuntimeState values")
        self._run_progression = tuple(states)

    def _create_run(self, call: Call) -> tuple[str, Any]:
        body = call.body
        if not (body.get("display_name") or "").strip():
            raise KfpError(400, "Invalid input error: the run's display_name is empty")
        spec = self._resolve_source(body, "run")
        self._check_runtime_config(body, spec, "run")
        experiment_id = self._experiment_for(body, call.query)
        namespace = self.experiments[experiment_id].get("namespace", "")
        self._access(
            call,
            "runs",
            "create",
            namespace,
            "Failed to create a run due to authorization error. Check if "
            f"you have write permissions to namespace {namespace}: Failed to authorize with API",
            "A run cannot have an empty namespace in multi-user mode",
        )
        created = now_rfc3339()
        resource = {
            **body,
            "run_id": str(uuid.uuid4()),
            "experiment_id": experiment_id,
            "storage_state": "AVAILABLE",
            "created_at": created,
            "scheduled_at": created,
            "state": "PENDING",
            "state_history": [{"update_time": created, "state": "PENDING"}],
        }
        record = RunRecord(resource, spec=spec)
        self.runs[record.id] = record
        return "V2beta1Run", resource

    def _run(self, run_id: str) -> RunRecord:
        record = self.runs.get(run_id)
        if record is None:
            raise KfpError(404, f"Run {run_id} not found")
        return record

    def _advance(self, record: RunRecord) -> None:
        if record.state in TERMINAL_STATES:
            return
        record.polls += 1
        states = (*self.run_progression, record.outcome or self.run_outcome)
        state = states[min(record.polls, len(states)) - 1]
        if state == record.state:
            return
        updated = now_rfc3339()
        # kubeflow/pipelines 2.x, backend/src/apiserver/server/api_converter.go (alike in an early 2.x copy and at
        # 010a6df2, which has plugins_input as kfp-server-api 2.17 does): toApiRun sets `error` only
        # when the stored run cannot be converted, never for a failed run; its task_details are the workflow's Argo
        # nodes (toModelTasks from Workflow.NodeStatuses, backend/src/common/util/workflow.go: display name, phase and
        # times; the node's message is not kept), and toApiPipelineTaskDetail gives no error and no outputs ("TODO:
        # parse input and output artifacts"), so a failed step shows neither, as the launcher uploads no outputs
        # for a step whose command failed (backend/src/v2/component/launcher_v2.go, executeV2). Nodes never started
        # are left out, and so are child_tasks, state_history and executor_detail.
        if state in ("SUCCEEDED", "FAILED") and record.spec is not None:
            steps = steps_in_order(record.spec)
            failing = (self.failed_task or steps[0]) if state == "FAILED" else ""
            drivers = sorted(name for name, _ in argo_nodes(record.spec, "") if name.endswith("-driver"))
            if failing and failing not in steps + drivers:
                message = f"FakeKfp.failed_task {failing!r} is not a step or a driver of the run's pipeline"
                raise KfpError(500, f"{message} ({', '.join(steps + drivers)})", violation=True)
            record.resource["run_details"] = {
                "task_details": [
                    {
                        "run_id": record.id,
                        "task_id": str(uuid.uuid4()),
                        "display_name": name,
                        "create_time": updated,
                        "start_time": updated,
                        "end_time": updated,
                        "state": node_state,
                    }
                    for name, node_state in argo_nodes(record.spec, failing)
                ]
            }
        record.resource["state"] = state
        record.resource["state_history"].append({"update_time": updated, "state": state})
        if state in TERMINAL_STATES:
            record.resource["finished_at"] = updated

    def _get_run(self, call: Call) -> tuple[str, Any]:
        record = self._run(call.params["run_id"])
        namespace = self.experiments[record["experiment_id"]].get("namespace", "")
        self._access(
            call,
            "runs",
            "get",
            namespace,
            "Failed to authorize the request: Failed to authorize with API",
            "A run cannot have an empty namespace in multi-user mode",
        )
        self._advance(record)
        return "V2beta1Run", record.resource

    def _list_runs(self, call: Call) -> tuple[str, Any]:
        experiment_id = call.query.get("experiment_id", "")
        records = [r for r in self.runs.values() if not experiment_id or r["experiment_id"] == experiment_id]
        return "V2beta1ListRunsResponse", page(records, call.query, "V2beta1Run", "runs")
