"""What a compiled pipeline package says, read without KFP: its parameters (typed, with their defaults), what each
step is called with for a run's values, and whether the steps would take those values, by their own checks.

`submit` and `schedule` check a run's --param values so before any call to KFP; `render-job --pipeline-file` and
`preflight --pipeline-file` show and check the job a submission of the package would create. Nothing here is a second
validator: a step's inputs are resolved as the compiled YAML wires them (the pipeline's parameters, the constants the
platform team compiled in, KFP's run id), made into the step's config by the step's own constructor and checked by
the step's own checks, short of what only the run itself can know (the snapshot staging makes, the storage, the
cluster).
"""

from __future__ import annotations

import inspect
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from common.errors import InputError

if TYPE_CHECKING:
    from components.launch_training.config import LaunchConfig

PIPELINE_RUN_PLACEHOLDER = "{{$.pipeline_job_uuid}}"  # dsl.PIPELINE_JOB_ID_PLACEHOLDER, as the compiled YAML has it
SUBMITTED_RUN = "00000000-0000-4000-8000-000000000000"  # stands for a KFP run's id (a UUID) until KFP gives one
ROOT = ""  # the pipeline's own DAG, among the components that hold one
# Empty values of each parameter type: what a required parameter (it has no default) is set back to when finding out
# which --param a refusal comes from.
EMPTY: dict[str, Any] = {
    "STRING": "",
    "NUMBER_INTEGER": 0,
    "NUMBER_DOUBLE": 0.0,
    "BOOLEAN": False,
    "LIST": [],
    "STRUCT": {},
}


class _RunTime:
    """An input known only once the run is under way: another step's output, a loop's item, KFP's final status."""

    def __repr__(self) -> str:
        return "<known at run time>"


RUN_TIME = _RunTime()


@dataclass(frozen=True)
class Package:
    path: Path
    spec: dict[str, Any]  # the pipeline spec, the file's first document (the platform spec follows it)

    @classmethod
    def load(cls, path: Path) -> Package:
        try:
            spec = next(yaml.load_all(path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)))
            spec["root"]["inputDefinitions"]["parameters"].items()
        except (OSError, yaml.YAMLError, StopIteration, KeyError, TypeError, AttributeError) as exc:
            raise InputError(f"pipeline file {path}: not a compiled pipeline ({exc})") from None
        return cls(path, spec)

    @property
    def inputs(self) -> dict[str, dict[str, Any]]:
        """The pipeline's parameters as the package declares them: name -> parameterType, defaultValue."""
        return self.spec["root"]["inputDefinitions"]["parameters"]

    def defaults(self) -> dict[str, Any]:
        """Each parameter's default, of its type (KFP writes an integer's as a number: 2.0)."""
        return {
            name: int(d["defaultValue"]) if d["parameterType"] == "NUMBER_INTEGER" else d["defaultValue"]
            for name, d in self.inputs.items()
            if "defaultValue" in d
        }

    def empty(self) -> dict[str, Any]:
        """Each parameter's empty value, of its type."""
        return {name: EMPTY[d["parameterType"]] for name, d in self.inputs.items()}

    def typed(self, pairs: list[tuple[str, str]], require: bool = True) -> dict[str, Any]:
        """KEY=VALUE pairs as the JSON values the pipeline's parameters take; every required one must be given, unless
        not `require`d."""
        values: dict[str, Any] = {}
        for key, text in pairs:
            if key not in self.inputs:
                raise InputError(f"--param {key}: the pipeline has no such parameter (see docs/parameters.md)")
            try:
                values[key] = parse_value(text, self.inputs[key]["parameterType"])
            except ValueError as exc:
                raise InputError(f"--param {key}={text!r}: {exc}") from None
        required = [k for k, d in self.inputs.items() if not d.get("isOptional") and "defaultValue" not in d]
        missing = [k for k in required if k not in values]
        if missing and require:
            raise InputError(f"--param {missing[0]}=... is required (the pipeline has no default for it)")
        if require and not any(values.get(k) for k in ("source", "mixture", "skip_staging")):
            raise InputError(
                "--param source=... is required (the corpus to stage), or mixture=... (several), or "
                "skip_staging=true (the dataset as staged before)"
            )
        return values

    def checked(
        self, pairs: list[tuple[str, str]], pipeline_run_id: str = SUBMITTED_RUN, require: bool = True
    ) -> dict[str, Any]:
        """The given parameters, typed, once every step takes them with the package's defaults for the rest; else the
        first step's refusal in one line, after the --param values it comes from: those that, set back to their
        defaults, change that step's refusal, into none or one the defaults themselves do not get (an empty
        trainer_image) if any do so. A required parameter not `require`d and not given is empty (its type's)."""
        given = self.typed(pairs, require)
        if "preset" in given and given.get("init_from_model"):  # a package's default preset is no choice; a given one
            raise InputError(
                f"{shown('preset', given['preset'])} and --param init_from_model both choose the "
                "architecture: leave preset out (the model's config.json gives it)"
            )
        defaults = self.defaults()
        values = self.empty() | defaults | given
        first = self.refusal(values, pipeline_run_id)
        if first is None:
            return given
        task, refusal = first
        unset = {k: defaults[k] if k in defaults else self.empty()[k] for k in given}
        of_defaults = self.step_refusal(task, values | unset, pipeline_run_id)
        changed, freed = [], []
        for key in given:
            without = self.step_refusal(task, values | {key: unset[key]}, pipeline_run_id)
            if without != refusal:
                changed.append(shown(key, given[key]))
                if without is None or without != of_defaults:
                    freed.append(shown(key, given[key]))
        where = ", ".join(freed or changed) or "the pipeline's defaults"
        raise InputError(f"{where}: {refusal}")

    def refusal(self, values: dict[str, Any], pipeline_run_id: str) -> tuple[str, str] | None:
        """The first refusal of the steps in pipeline order for the run's values, and its step: what the run would
        fail on."""
        for task in STEP_CHECKS:
            refusal = self.step_refusal(task, values, pipeline_run_id)
            if refusal is not None:
                return task, refusal
        return None

    def step_refusal(self, task: str, values: dict[str, Any], pipeline_run_id: str) -> str | None:
        """The step's own refusal of its inputs for the run's values (None for a step the package does not have)."""
        if not self.has_task(task):
            return None
        try:
            STEP_CHECKS[task](self.step_inputs(task, values, pipeline_run_id))
        except InputError as exc:
            return str(exc)
        return None

    def launch_config(self, pairs: list[tuple[str, str]], task: str, pipeline_run_id: str) -> LaunchConfig:
        """The LaunchConfig the package's step `task` (launch-pytorchjob, preflight) makes for a submission with
        these --param values, once every step takes them; the job depends on no required parameter (the source: only
        staging reads it), so none needs to be given."""
        return step_config(self.submitted_inputs(pairs, task, pipeline_run_id))

    def submitted_inputs(self, pairs: list[tuple[str, str]], task: str, pipeline_run_id: str) -> dict[str, Any]:
        """What the step `task` is called with in a submission with these --param values (checked as `submit`
        checks them; required ones may be missing)."""
        values = self.empty() | self.defaults() | self.checked(pairs, pipeline_run_id, require=False)
        if not self.has_task(task):
            raise InputError(f"pipeline file {self.path}: no step {task}")
        return self.step_inputs(task, values, pipeline_run_id)

    # -- the compiled wiring -------------------------------------------------------------------------------------

    def _dags(self) -> dict[str, dict[str, Any]]:
        """The DAGs: the pipeline's own (ROOT) and each group's (an exit handler, a loop), by component name."""
        groups = {name: c["dag"] for name, c in (self.spec.get("components") or {}).items() if "dag" in c}
        return {ROOT: self.spec["root"]["dag"], **groups}

    def _task(self, task: str) -> tuple[str, dict[str, Any]] | None:
        """The DAG that holds `task` and its definition."""
        for owner, dag in self._dags().items():
            if task in (dag.get("tasks") or {}):
                return owner, dag["tasks"][task]
        return None

    def has_task(self, task: str) -> bool:
        return self._task(task) is not None

    def step_inputs(self, task: str, values: dict[str, Any], pipeline_run_id: str) -> dict[str, Any]:
        """What the step `task` is called with, for the run's parameter values: each input followed up through the
        groups to a pipeline parameter or a compiled constant (KFP's run id: `pipeline_run_id`); RUN_TIME for one
        known only once the run is under way."""
        found = self._task(task)
        if found is None:
            raise InputError(f"pipeline file {self.path}: no step {task}")
        callers = {
            t["componentRef"]["name"]: (owner, t)
            for owner, dag in self._dags().items()
            for t in (dag.get("tasks") or {}).values()
        }

        def resolve(owner: str, source: dict[str, Any]) -> Any:
            if "runtimeValue" in source:
                constant = source["runtimeValue"].get("constant")
                if isinstance(constant, str) and "{{$." in constant:
                    return pipeline_run_id if constant == PIPELINE_RUN_PLACEHOLDER else RUN_TIME
                return constant
            name = source.get("componentInputParameter")
            staged = (source.get("taskOutputParameter") or {}).get("outputParameterKey")
            if name is None and staged in FORETOLD_OUTPUTS:  # what staging will say, the parameters tell now
                return FORETOLD_OUTPUTS[staged](values)
            if name is None:  # another task's output, a task's final status
                return RUN_TIME
            if owner == ROOT:
                return values[name]
            outer_owner, caller = callers[owner]
            outer = (caller.get("inputs", {}).get("parameters") or {}).get(name)
            return RUN_TIME if outer is None else resolve(outer_owner, outer)  # None: a loop's item

        owner, definition = found
        parameters = definition.get("inputs", {}).get("parameters") or {}
        return {name: resolve(owner, source) for name, source in parameters.items()}


def parse_value(text: str, kind: str) -> Any:
    """A --param value as the JSON value of the parameter's type; ValueError says what is wrong, in a few words."""
    if kind == "STRING":
        return text
    if kind == "NUMBER_INTEGER":
        try:
            return int(text)
        except ValueError:
            raise ValueError("not an integer") from None
    if kind == "NUMBER_DOUBLE":
        try:
            value = float(text)
        except ValueError:
            raise ValueError("not a number") from None
        if not math.isfinite(value):
            raise ValueError("not a finite number (JSON has no NaN or infinity)")
        return value
    if kind == "BOOLEAN":
        if text.lower() not in ("true", "false"):
            raise ValueError("expected true or false")
        return text.lower() == "true"
    expected = {"LIST": list, "STRUCT": dict}[kind]
    try:
        value = json.loads(text)
    except ValueError:
        raise ValueError(f"expected a JSON {expected.__name__}") from None
    if not isinstance(value, expected):
        raise ValueError(f"expected a JSON {expected.__name__}")
    return value


def shown(key: str, value: Any) -> str:
    """A --param as a message names it: with its value, unless a list or dict (too long to repeat); a URL's password
    masked (a message may reach a scheduler's logs)."""
    if isinstance(value, list | dict):
        return f"--param {key}"
    if isinstance(value, bool):
        return f"--param {key}={str(value).lower()}"
    if isinstance(value, str):
        return f"--param {key}={URL_PASSWORD.sub(MASKED, value)!r}"
    return f"--param {key}={value}"


URL_PASSWORD, MASKED = re.compile(r"(://[^/@:]*:)[^/@]*@"), r"\1***@"


# -- each step's checks, in pipeline order: the step's own, on its resolved inputs -------------------------------

# Staging's outputs the launcher is given, known only once it ran: the snapshot it made (""; the dataset's current
# one) and the warm start's origin it resolved ("": none; "previous" needs the volume to resolve).
STAGING_OUTPUTS = {"snapshot": "", "init_from_run_id": ""}


def _foretold_mixture(values: dict[str, Any]) -> Any:
    """The finalize step's `mixture`: the parameter's entries as the launcher takes them (no source, no text field;
    the snapshot is staging's), malformed ones as given, for the launcher's check to refuse."""
    mixture = values.get("mixture") or []
    return (
        [
            {k: v for k, v in e.items() if k not in ("source", "text_field")} if isinstance(e, dict) else e
            for e in mixture
        ]
        if isinstance(mixture, list)
        else mixture
    )


def _foretold_dataset(values: dict[str, Any]) -> Any:
    """The finalize step's `dataset`: the mixture's first (when it names one), else the `dataset` parameter."""
    mixture = values.get("mixture") or []
    first = mixture[0] if isinstance(mixture, list) and mixture else None
    return str(first["dataset"]) if isinstance(first, dict) and "dataset" in first else values.get("dataset", "")


# Staging's outputs that the run's parameters tell before it runs (by the finalize step's output names).
FORETOLD_OUTPUTS: dict[str, Callable[[dict[str, Any]], Any]] = {
    "dataset": _foretold_dataset,
    "mixture": _foretold_mixture,
}


def step_config(inputs: dict[str, Any]) -> LaunchConfig:
    """The LaunchConfig the launcher's or the preflight's step makes of its inputs (LaunchConfig.of_step), staging's
    outputs standing in as STAGING_OUTPUTS says; the step's other inputs (preflight's warn_only) are left out."""
    from components.launch_training.config import TRAIN_SETTINGS, LaunchConfig

    step_names = set(inspect.signature(LaunchConfig.of_step).parameters) - {"settings"}
    names = step_names | {f.name for f in fields(LaunchConfig)} | set(TRAIN_SETTINGS)
    known = {k: STAGING_OUTPUTS.get(k, v) if v is RUN_TIME else v for k, v in inputs.items() if k in names}
    unknown = [k for k, v in known.items() if v is RUN_TIME]
    if unknown:
        raise InputError(
            f"the launcher's input {unknown[0]} is known only at run time in this pipeline file: it "
            "cannot be checked or rendered beforehand"
        )
    return LaunchConfig.of_step(**known)


def _call_with(check: Callable[..., Any], inputs: dict[str, Any]) -> Any:
    """`check` called with the step's inputs it names (the step passes them under the same names)."""
    return check(**{name: inputs[name] for name in inspect.signature(check).parameters if name in inputs})


def _check_launcher(inputs: dict[str, Any]) -> None:
    """The launcher's checks (the preflight step's too), short of the storage: the job rendered for a cluster."""
    config = step_config(inputs)
    if config.backend == "kubernetes":
        config.checked_job()
    else:
        config.validate(check_storage=False)


def _check_staging(inputs: dict[str, Any]) -> None:
    from components.run_summary.core import resolve_run_id
    from components.stage_data.settings import StageSettings

    resolve_run_id(inputs["run_id"], inputs["resume_run_id"], inputs["pipeline_run_id"])
    settings = {k: v for k, v in inputs.items() if k in StageSettings.__dataclass_fields__}
    if inputs.get("mixture"):  # each entry's source and text field with the run's other settings
        from components.stage_data.mixture import mixture_sources

        for entry in mixture_sources(inputs["mixture"]):
            if entry.source and not inputs["skip"]:
                StageSettings.of_step(
                    **settings
                    | {
                        "source": entry.source,
                        "dataset": entry.dataset,
                        "text_field": entry.text_field or settings.get("text_field", ""),
                    }
                ).check()
    elif not inputs["skip"]:  # a skipped staging takes the dataset as staged: its settings are not read
        StageSettings.of_step(**settings).check(source_given=False)  # Package.typed requires it at submit


def _check_verification(inputs: dict[str, Any]) -> None:
    from components.verify_nccl.core import Expectations

    _call_with(Expectations.for_job, inputs).check()


def _check_evaluation(inputs: dict[str, Any]) -> None:
    from components.evaluate_checkpoint.benchmarks import BenchmarkSettings
    from components.evaluate_checkpoint.inputs import check_checkpoints, check_inputs

    _call_with(check_inputs, inputs)
    check_checkpoints(inputs["checkpoint"])
    settings = BenchmarkSettings(inputs["benchmarks"], inputs["benchmark_data_uri"], inputs["benchmark_limit"])
    settings.checked(inputs["benchmark_gate"])


STEP_CHECKS: dict[str, Callable[[dict[str, Any]], None]] = {
    "preflight": _check_launcher,
    "stage-data": _check_staging,
    "launch-pytorchjob": _check_launcher,
    "verify-nccl": _check_verification,
    "evaluate-checkpoint": _check_evaluation,
}
