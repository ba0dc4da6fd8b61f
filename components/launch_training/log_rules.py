"""A HyperPodPyTorchJob's log monitoring rules (`runPolicy.logMonitoringConfiguration`), derived from the trainer's
own lines, and the check every rule passes, derived or given by the platform team.

Who reads them, and how (hyperpod-elastic-agent 1.1.3, the agent in every worker container): the operator hands the
rules to each node's agent with /start (`server/api_models.py`, `StartRequest.log_monitoring_configuration`); the
agent's log agent follows local rank 0's `<log dir>/<run>/attempt_<n>/0/stdout.log` (`HyperPodElasticAgent.
start_log_monitoring`, `LogAgent._monitor_log_loop`), and `LogEvaluator.evaluate` (`logagent/log_agent.py`) tries
each line with Python's `re.match` (anchored at the line's start: hence the leading `.*`), reads a rule's first group
with `float()`, compares it with `int(metricThreshold)`, counts `metricEvaluationDataPoints` slow lines in a row, calls
a rule HANGING when no line matched within `expectedStartCutOffInSeconds` of its start or `expectedRecurringFrequency
InSeconds` of the last match, and retires a rule at its `stopPattern`. Its rules are made anew at each start of the
workers (the PLR agent clears them when it stops its workers: `PLRHyperPodElasticAgent._stop_workers`), so the
start-up allowance covers every restart's loading too. The fields and operators are those of the SDK's model
(sagemaker-hyperpod 3.12.0, `training/config/hyperpod_pytorch_job_unified_config.py`, `LogMonitoringConfiguration`).

The lines are the trainer's monitor lines (trainer/monitor.py): local rank 0 of every node prints one per logged step
with the exact tokens/s, and one when the loop ends (before the final checkpoint, which may take long). The derived
rules:
- hang: a step line within the start-up allowance plus one interval of step lines, then one every interval, the
  interval being the launcher's own stall margin over the expected time between step lines (progress.py: STALL_GAPS
  times it, at least HANG_FLOOR_S); while the step time is not given, the launcher's own stall floor (STALL_FLOOR_S).
  The margin is what covers a blocking periodic checkpoint between two step lines: a save longer than STALL_GAPS - 1
  intervals needs asynchronous checkpoints or a larger expected step time;
- slow (only with a tokens/s floor): the step line's tokens/s below the floor SLOW_DATA_POINTS lines in a row;
- both retired at the stop line.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from common.errors import InputError
from components.launch_training.progress import STALL_FLOOR_S, STALL_GAPS

if TYPE_CHECKING:
    from components.launch_training.manifest import JobSpec

# The trainer's monitor lines (trainer/monitor.py: monitor_step_line, monitor_stop_line), as the agent matches them.
STEP_PATTERN = r".*monitor: step \d+ tokens_per_s \d+"
TOKENS_PER_S_PATTERN = r".*monitor: step \d+ tokens_per_s (\d+)"
STOP_PATTERN = r".*monitor: training stopped at step \d+"
HANG_RULE, SLOW_RULE = "TrainerStepHang", "TrainerSlowTokensPerSecond"
# The run's settings the derived rules are made of (JobSpec fields, run options): only a HyperPodPyTorchJob has a place.
RULE_SETTINGS = ("startup_allowance_s", "expected_step_ms", "min_tokens_per_s")
NO_RULES = "log monitoring rules are a HyperPodPyTorchJob's (compile --job-api hyperpodpytorchjob)"
# The least hang interval a given step time makes: the agent reads the log once a second when it is idle, and a line
# may reach the file a few seconds late on a loaded node.
HANG_FLOOR_S = 5
SLOW_DATA_POINTS = 3  # slow step lines in a row before the job is called slow: one slow interval is not a trend
# The rule's fields and the operators the SDK's LogMonitoringConfiguration model lists, and faultOnMatch, which AWS's
# guide lists ("Using the training operator to run jobs": a match faults the job at once) and the agent reads
# (`LogEvaluator`, faultOnMatch).
RULE_FIELDS = {
    "name": str,
    "logPattern": str,
    "expectedStartCutOffInSeconds": int,
    "expectedRecurringFrequencyInSeconds": int,
    "metricThreshold": int,
    "operator": str,
    "metricEvaluationDataPoints": int,
    "stopPattern": str,
    "faultOnMatch": bool,
}
OPERATORS = ("gt", "lt", "eq", "gteq", "lteq")


def step_line_interval_s(spec: JobSpec) -> float:
    """The expected seconds between two step lines (0: the step time was not given)."""
    return spec.log_every * spec.expected_step_ms / 1000


def hang_frequency_s(spec: JobSpec) -> int:
    """How long without a step line is a hang: the launcher's stall margin over the expected interval, or its stall
    floor while the step time is not given."""
    if not spec.expected_step_ms:
        return math.ceil(STALL_FLOOR_S)
    return math.ceil(max(HANG_FLOOR_S, STALL_GAPS * step_line_interval_s(spec)))


def derived_rules(spec: JobSpec) -> list[dict[str, Any]]:
    """The hang rule, and the slow rule when the run gives a tokens/s floor (module docstring)."""
    frequency = hang_frequency_s(spec)
    rules: list[dict[str, Any]] = [
        {
            "name": HANG_RULE,
            "logPattern": STEP_PATTERN,
            "expectedStartCutOffInSeconds": spec.startup_allowance_s + frequency,
            "expectedRecurringFrequencyInSeconds": frequency,
            "stopPattern": STOP_PATTERN,
        }
    ]
    if spec.min_tokens_per_s:
        rules.append(
            {
                "name": SLOW_RULE,
                "logPattern": TOKENS_PER_S_PATTERN,
                "metricThreshold": spec.min_tokens_per_s,
                "operator": "lt",
                "metricEvaluationDataPoints": SLOW_DATA_POINTS,
                "stopPattern": STOP_PATTERN,
            }
        )
    return rules


def job_rules(spec: JobSpec) -> list[dict[str, Any]]:
    """The job's rules: the platform team's, when it compiled some in, else those derived from the run."""
    return [dict(rule) for rule in spec.log_rules] if spec.log_rules is not None else derived_rules(spec)


def check_rules(rules: Any, source: str) -> None:
    """Each rule as the agent and the SDK's model take it, refused in one line naming `source` and the rule: a list of
    objects with only the model's fields, of their types; a unique name; a pattern Python's `re` compiles (the stop
    pattern too); durations and data points positive; a threshold only with an operator the agent knows and a pattern
    with a group to compare."""
    if not isinstance(rules, list):
        raise InputError(f"{source}: a JSON list of log monitoring rules, not {type(rules).__name__}")
    names: set[str] = set()
    for index, rule in enumerate(rules):
        where = f"{source}: rule {index + 1}"
        if not isinstance(rule, dict):
            raise InputError(f"{where} is not an object")
        where = f"{source}: rule {rule.get('name') or index + 1!r}"
        unknown = sorted(set(rule) - set(RULE_FIELDS))
        if unknown:
            raise InputError(f"{where}: unknown field {unknown[0]!r} (fields: {', '.join(RULE_FIELDS)})")
        for key, kind in RULE_FIELDS.items():
            value = rule.get(key)
            if value is not None and (not isinstance(value, kind) or (kind is not bool and isinstance(value, bool))):
                raise InputError(f"{where}: {key} must be a {kind.__name__}, not {value!r}")
        if not rule.get("name"):
            raise InputError(f"{where}: has no name")
        if rule["name"] in names:
            raise InputError(f"{where}: a second rule of that name")
        names.add(rule["name"])
        if not rule.get("logPattern"):
            raise InputError(f"{where}: has no logPattern (the regex a line must match)")
        groups = 0
        for key in ("logPattern", "stopPattern"):
            if key in rule:
                try:
                    compiled = re.compile(rule[key])
                except re.error as exc:
                    raise InputError(f"{where}: {key} {rule[key]!r} is not a Python regex ({exc})") from None
                groups = compiled.groups if key == "logPattern" else groups
        for key in (
            "expectedStartCutOffInSeconds",
            "expectedRecurringFrequencyInSeconds",
            "metricEvaluationDataPoints",
        ):
            if key in rule and rule[key] < 1:
                raise InputError(f"{where}: {key} must be positive, got {rule[key]}")
        if "operator" in rule and rule["operator"] not in OPERATORS:
            raise InputError(f"{where}: operator {rule['operator']!r}: choose one of {', '.join(OPERATORS)}")
        if ("metricThreshold" in rule) != ("operator" in rule):
            raise InputError(f"{where}: metricThreshold and operator go together (the agent compares only with both)")
        if "metricThreshold" in rule and not groups:
            raise InputError(f"{where}: metricThreshold needs a group in logPattern to read the figure from")


def load_rules(path: Path) -> tuple[dict[str, Any], ...]:
    """The platform team's rules from a JSON file (compile --hyperpod-log-rules), checked."""
    try:
        rules = json.loads(path.read_text())
    except OSError as exc:
        raise InputError(f"--hyperpod-log-rules {path}: cannot be read ({exc.strerror})") from None
    except ValueError as exc:
        raise InputError(f"--hyperpod-log-rules {path}: not JSON ({exc})") from None
    check_rules(rules, f"--hyperpod-log-rules {path}")
    return tuple(rules)
