"""The HyperPodPyTorchJob (components/launch_training/hyperpodpytorchjob.py) and its log monitoring rules
(components/launch_training/log_rules.py): what the manifest holds for 1 and 2 nodes, the worker command as the
agent's parser reads it, the check against the HyperPod CLI's published job template, bad settings refused in one
line before anything is sent, and the rules matched against the trainer's real lines as the agent matches them."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from common.errors import InputError
from components.launch_training.apis import api_of
from components.launch_training.config import LaunchConfig
from components.launch_training.evidence import TrainerEvidence, failure_evidence
from components.launch_training.hyperpodpytorchjob import (
    HYPERPODPYTORCHJOB,
    RESTART_WINDOW_S,
    check_against_template,
    latest_faults,
    template_config,
    template_schema,
)
from components.launch_training.log_rules import (
    HANG_RULE,
    SLOW_DATA_POINTS,
    SLOW_RULE,
    STEP_PATTERN,
    STOP_PATTERN,
    TOKENS_PER_S_PATTERN,
    derived_rules,
)
from components.launch_training.manifest import JobSpec, render_job
from components.launch_training.platform import Platform, run_options
from components.launch_training.progress import STALL_FLOOR_S, STALL_GAPS
from components.launch_training.pytorchjob import PYTORCHJOB
from components.launch_training.rendering import PRIORITY_CLASS_LABEL, QUEUE_LABEL
from pipelines.cli import main
from tests.helpers import RENDER_JOB
from trainer.monitor import MONITOR_ENV, monitor_step_line, monitor_stop_line

REPO = Path(__file__).resolve().parents[1]
LAYER_3 = "topology.k8s.aws/network-node-layer-3"


def hyperpod_spec(**overrides: Any) -> JobSpec:
    return JobSpec(
        **{
            "name": "hpp-r1-train-0123456789",
            "image": "img:1",
            "trainer_args": ["--data-dir", "/fsx/datasets/d", "--run-dir", "/fsx/runs/r1", "--preset", "tiny"],
            "job_api": "hyperpodpytorchjob",
            **overrides,
        }
    )


def container_of(job: dict[str, Any]) -> dict[str, Any]:
    return job["spec"]["replicaSpecs"][0]["template"]["spec"]["containers"][0]


# The flags hyperpod-elastic-agent 1.1.3 adds to torchrun's (`run.py`, `add_additional_hyperpod_args`), restated (name,
# type, choices, default): the agent cannot be installed beside this project's torch.
AGENT_FLAGS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("--shutdown-signal", {"default": "SIGKILL", "choices": ["SIGTERM", "SIGKILL"], "type": str}),
    ("--shutdown-timeout", {"default": 15, "type": int}),
    ("--server-host", {"default": "0.0.0.0", "type": str}),
    ("--server-port", {"default": 8080, "type": int}),
)


def agent_parser() -> argparse.ArgumentParser:
    """hyperpodrun's parser: torch's torchrun parser (`torch.distributed.run.get_args_parser`) plus the agent's flags.
    The pinned torch's torchrun declares --shutdown-timeout itself (an int, as the agent's), which the agent's
    `add_argument` would refuse as a conflict: here torch's stands in for it."""
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    for flag, settings in AGENT_FLAGS:
        if flag not in parser._option_string_actions:  # argparse has no public way to ask
            parser.add_argument(flag, **settings)
    return parser


# -- the manifest -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("nodes", [1, 2])
def test_a_job_of_one_or_two_nodes_is_one_replica_group_run_by_the_operators_policy(nodes: int) -> None:
    job = render_job(hyperpod_spec(min_nodes=nodes, max_nodes=nodes, queue_name="team-q", priority_class="high"))
    assert (job["apiVersion"], job["kind"]) == ("sagemaker.amazonaws.com/v1", "HyperPodPyTorchJob")
    assert api_of(job) is HYPERPODPYTORCHJOB and HYPERPODPYTORCHJOB.nodes(job) == (nodes, nodes)
    spec = job["spec"]
    assert spec["nprocPerNode"] == "8" and "elasticPolicy" not in spec
    assert [(g["name"], g["replicas"]) for g in spec["replicaSpecs"]] == [("pods", nodes)]
    pod = spec["replicaSpecs"][0]["template"]["spec"]
    container = container_of(job)
    assert container["name"] == "pytorch" and container["ports"] == [{"containerPort": 8080}]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["NNODES"] == str(nodes) and env[MONITOR_ENV] == "1"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 8 and pod["terminationGracePeriodSeconds"] == 120
    assert "restartPolicy" not in pod, "the operator restarts the pods"
    assert (
        job["metadata"]["labels"][QUEUE_LABEL] == "team-q" and job["metadata"]["labels"][PRIORITY_CLASS_LABEL] == "high"
    )
    # max_restarts 3 process-level restarts before a full one, restart_budget 3 full ones: 4 x 3 + 3 retries in all
    assert spec["runPolicy"] == {
        "jobMaxRetryCount": 15,
        "cleanPodPolicy": "None",  # our default Running: finished pods kept for their logs
        "ttlSecondsAfterFinished": 7 * 24 * 3600,
        "restartPolicy": {
            "numRestartBeforeFullJobRestart": 3,
            "maxFullJobRestarts": 3,
            "evalPeriodSeconds": RESTART_WINDOW_S,
        },
        "logMonitoringConfiguration": derived_rules(hyperpod_spec()),
    }
    assert HYPERPODPYTORCHJOB.pod_selector(job["metadata"]["name"]) == "HPJob=hpp-r1-train-0123456789"


def test_the_restart_settings_map_onto_the_operators_two_levels_and_the_deadline_bounds_the_window() -> None:
    job = render_job(hyperpod_spec(max_restarts=1, restart_budget=0, active_deadline_s=7200, clean_pod_policy="All"))
    run_policy = job["spec"]["runPolicy"]
    assert run_policy["restartPolicy"] == {
        "numRestartBeforeFullJobRestart": 1,
        "maxFullJobRestarts": 0,
        "evalPeriodSeconds": 7200,
    }
    assert run_policy["jobMaxRetryCount"] == 1 and run_policy["activeDeadlineSeconds"] == 7200
    assert run_policy["cleanPodPolicy"] == "All"


@pytest.mark.parametrize(("required", "annotation"), [(False, "preferred"), (True, "required")])
def test_the_platforms_topology_goes_on_the_job_and_its_pods(required: bool, annotation: str) -> None:
    job = render_job(hyperpod_spec(topology_label=LAYER_3, topology_required=required))
    key = f"kueue.x-k8s.io/podset-{annotation}-topology"
    assert job["metadata"]["annotations"][key] == LAYER_3
    assert job["spec"]["replicaSpecs"][0]["template"]["metadata"]["annotations"][key] == LAYER_3
    assert template_config(job)[f"{annotation}_topology"] == LAYER_3
    plain = render_job(hyperpod_spec())
    assert not any("topology" in key for key in plain["metadata"]["annotations"])


# -- the worker command -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("nodes", "grace", "timeout"), [(1, 120, 100), (2, 300, 280)])
def test_the_workers_run_under_hyperpodrun_as_pid_1_with_the_flags_its_parser_reads(
    nodes: int, grace: int, timeout: int
) -> None:
    """hyperpodrun is the command itself (exec form: PID 1, no shell); its SIGTERM waits the job's shutdown timeout
    (the grace period less the launcher's margin, as torchrun's on the other APIs) before SIGKILL; the workers' output
    is teed under /tmp/hyperpod, where the agent's log agent reads it."""
    spec = hyperpod_spec(min_nodes=nodes, max_nodes=nodes, grace_period_s=grace)
    command = container_of(render_job(spec))["command"]
    assert command[0] == "hyperpodrun" and "args" not in container_of(render_job(spec))
    parsed = agent_parser().parse_args(command[1:])
    assert (parsed.nnodes, parsed.nproc_per_node, parsed.rdzv_backend) == (str(nodes), "8", "hyperpod")
    assert (parsed.server_port, parsed.shutdown_signal, parsed.shutdown_timeout) == (8080, "SIGTERM", timeout)
    assert (parsed.tee, parsed.log_dir) == ("3", "/tmp/hyperpod")
    assert parsed.module and parsed.training_script == "trainer.train_ddp"
    assert parsed.training_script_args == spec.trainer_args
    assert spec.shutdown_timeout == timeout


def test_a_shutdown_timeout_of_0_leaves_the_agents_own() -> None:
    command = container_of(render_job(hyperpod_spec(shutdown_timeout_s=0)))["command"]
    assert not any(flag.startswith("--shutdown-timeout") for flag in command)


# -- the published template ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "settings",
    [
        {},
        {"min_nodes": 1, "max_nodes": 1},
        {"queue_name": "team-q", "priority_class": "high", "topology_label": LAYER_3, "topology_required": True},
        {"service_account": "trainer", "node_selector": {"pool": "gpu"}, "env": {"FI_LOG_LEVEL": "warn"}},
        {"instance_type": "p5en.48xlarge", "min_tokens_per_s": 50_000, "expected_step_ms": 800},
    ],
)
def test_every_rendered_job_passes_the_published_templates_schema(settings: dict[str, Any]) -> None:
    """render checks it (`check_against_template`); here the flat settings it read back are validated again, whole,
    against hyperpod-pytorch-job-template 1.5.0's v1_1/schema.json, and hold what the job holds."""
    job = render_job(hyperpod_spec(**settings))
    config = template_config(job)
    jsonschema.Draft202012Validator(template_schema()).validate(config)
    assert (
        config["job_name"] == job["metadata"]["name"]
        and config["replica_count"] == job["spec"]["replicaSpecs"][0]["replicas"]
    )
    assert config["max_retry"] == job["spec"]["runPolicy"]["jobMaxRetryCount"]
    assert config["command"][0] == "hyperpodrun" and config["tasks_per_node"] == "8"
    assert config["volume"] == [
        {"name": "fsx-pvc", "type": "pvc", "mount_path": "/fsx", "claim_name": "fsx-lustre-pvc"}
    ]
    if "queue_name" in settings:
        assert (config["queue_name"], config["priority"]) == ("team-q", "high")


def test_a_job_the_template_would_refuse_is_refused_in_one_line() -> None:
    job = render_job(hyperpod_spec())
    bad_queue = json.loads(json.dumps(job))
    bad_queue["metadata"]["labels"][QUEUE_LABEL] = "Team_Q"
    with pytest.raises(InputError, match=r"fails hyperpod-pytorch-job-template 1.5.0 v1_1's schema at queue_name"):
        check_against_template(bad_queue)
    with pytest.raises(InputError, match="environment variable 'FI.LEVEL': .* takes C identifiers only") as refused:
        render_job(hyperpod_spec(env={"FI.LEVEL": "1"}))
    assert "\n" not in str(refused.value)


# -- bad settings -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"max_restarts": -1}, "max_restarts -1: a retry count cannot be below zero"),
        ({"restart_budget": -2}, "restart_budget -2: a retry count cannot be below zero"),
        ({"log_rules": ({"name": "NoLoss"},)}, "rule 'NoLoss': has no logPattern"),
        ({"log_rules": ({"name": "Bad", "logPattern": "(unclosed"},)}, "rule 'Bad': logPattern '(unclosed' is not"),
        (
            {"log_rules": ({"name": "Slow", "logPattern": ".*loss", "metricThreshold": 3, "operator": "lt"},)},
            "rule 'Slow': metricThreshold needs a group in logPattern",
        ),
        (
            {"log_rules": ({"name": "Slow", "logPattern": ".*(\\d+)", "metricThreshold": 3, "operator": "<"},)},
            "rule 'Slow': operator '<': choose one of gt, lt, eq, gteq, lteq",
        ),
        (
            {"log_rules": ({"name": "Fast", "logPattern": ".*", "faultOnMatch": "yes"},)},
            "rule 'Fast': faultOnMatch must be a bool, not 'yes'",
        ),
        ({"log_rules": ({"name": "Fast", "logPattern": ".*", "onMatch": True},)}, "unknown field 'onMatch'"),
        ({"topology_label": "topology.k8s.aws/network-node-layer-9"}, "topology label 'topology.k8s.aws/network-node"),
        ({"min_nodes": 2, "max_nodes": 4}, "max_nodes 4 above nnodes 2: hyperpodrun 1.1.3 runs a fixed number"),
        ({"auto_resume": True}, "auto_resume: the HyperPod training operator restarts its jobs itself"),
        ({"min_tokens_per_s": -5}, "min_tokens_per_s -5 cannot be negative"),
    ],
)
def test_bad_settings_are_refused_in_one_line_before_anything_is_sent(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(InputError) as refused:
        render_job(hyperpod_spec(**settings))
    assert message in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.parametrize(
    ("platform", "message"),
    [
        ({"topology_label": "zone"}, "platform setting topology_label 'zone' is not a topology layer"),
        ({"topology_required": True}, "platform setting topology_required needs a topology_label"),
        ({"hyperpod_log_rules": ({"logPattern": ".*"},)}, "hyperpod_log_rules: rule 1: has no name"),
        ({"job_api": "pytorchjob", "topology_label": LAYER_3}, "topology_label is for --job-api hyperpodpytorchjob"),
    ],
)
def test_bad_platform_settings_fail_the_compile_in_one_line(platform: dict[str, Any], message: str) -> None:
    with pytest.raises(InputError) as refused:
        Platform(**{"job_api": "hyperpodpytorchjob", **platform})
    assert message in str(refused.value) and "\n" not in str(refused.value)


def test_a_run_may_not_set_what_the_operator_decides_and_only_this_api_takes_the_rules_settings() -> None:
    for option, value, why in (
        ("restart_policy", "Never", "the operator restarts the pods itself"),
        ("rdzv_backend", "c10d", "hyperpodrun always uses its own rendezvous"),
        ("auto_resume", True, "restarts its jobs itself"),
    ):
        with pytest.raises(InputError, match=f"job option '{option}' does not apply to a HyperPodPyTorchJob: .*{why}"):
            run_options({option: value}, "hyperpodpytorchjob")
    rules = {"startup_allowance_s": 600, "expected_step_ms": 500, "min_tokens_per_s": 1000}
    assert run_options(rules, "hyperpodpytorchjob") == rules
    for api in ("pytorchjob", "trainjob"):
        with pytest.raises(InputError, match="log monitoring rules are a HyperPodPyTorchJob's"):
            run_options({"min_tokens_per_s": 1000}, api)


# -- the log rules against the trainer's lines --------------------------------------------------------------------


def test_the_derived_rules_follow_the_run_and_the_launchers_stall_margin() -> None:
    unknown = derived_rules(hyperpod_spec())
    assert [rule["name"] for rule in unknown] == [HANG_RULE], "no slow rule without a floor"
    assert unknown[0]["expectedRecurringFrequencyInSeconds"] == STALL_FLOOR_S
    assert unknown[0]["expectedStartCutOffInSeconds"] == 900 + STALL_FLOOR_S
    # 2.5 s per step, a line every 100 steps: 250 s between lines, ten times that before a hang is called
    hang, slow = derived_rules(
        hyperpod_spec(log_every=100, expected_step_ms=2500, startup_allowance_s=1200, min_tokens_per_s=40_000)
    )
    assert hang["expectedRecurringFrequencyInSeconds"] == STALL_GAPS * 250
    assert hang["expectedStartCutOffInSeconds"] == 1200 + STALL_GAPS * 250
    # fast steps: the margin, but never below the floor the agent's once-a-second reading needs
    assert (
        derived_rules(hyperpod_spec(log_every=1, expected_step_ms=300))[0]["expectedRecurringFrequencyInSeconds"] == 5
    )
    assert derived_rules(hyperpod_spec(log_every=1, expected_step_ms=20))[0]["expectedRecurringFrequencyInSeconds"] == 5
    assert slow == {
        "name": SLOW_RULE,
        "logPattern": TOKENS_PER_S_PATTERN,
        "metricThreshold": 40_000,
        "operator": "lt",
        "metricEvaluationDataPoints": SLOW_DATA_POINTS,
        "stopPattern": STOP_PATTERN,
    }


def test_the_patterns_match_the_trainers_monitor_lines_as_the_agent_matches_them() -> None:
    """The agent reads each line with its newline and tries `re.match` (anchored at the start), then `float()` of the
    first group (hyperpod-elastic-agent 1.1.3, logagent/log_agent.py, LogEvaluator.evaluate)."""
    step = monitor_step_line(40, 7134.6) + "\n"
    stop = monitor_stop_line(200, "max-steps") + "\n"
    assert re.match(STEP_PATTERN, step) and not re.match(STEP_PATTERN, stop)
    matched = re.match(TOKENS_PER_S_PATTERN, step)
    assert matched and float(matched.group(1)) == 7135
    assert re.match(STOP_PATTERN, stop) and not re.match(STOP_PATTERN, step)
    # torchrun's --tee prefixes console lines with the rank; a prefixed line still matches
    assert re.match(STEP_PATTERN, "[default0]:" + step)


# -- the status -------------------------------------------------------------------------------------------------------


def test_the_status_reads_as_the_sdks_models_describe_it() -> None:
    job = render_job(hyperpod_spec())
    job["metadata"]["creationTimestamp"] = "2026-12-01T10:00:00Z"
    job["status"] = {
        "conditions": [
            {"type": "Created", "status": "True", "lastTransitionTime": "2026-12-01T10:00:00Z"},
            {"type": "Running", "status": "True", "lastTransitionTime": "2026-12-01T10:05:00Z"},
        ],
        "startTime": "2026-12-01T10:02:00Z",
        "restartCount": 2,
        "latestFaultyPodInstanceList": {
            "restartType": "PLR",
            "faultyPodList": ["hpp-r1-train-0123456789-pod-1"],
            "faultyRankList": ["1"],
        },
    }
    api = HYPERPODPYTORCHJOB
    assert api.is_running(job) and not api.is_finished(job) and not api.is_suspended(job)
    assert api.latest_condition(job)["type"] == "Running"  # type: ignore[index]
    assert api.restarts(job, []) == 2
    assert latest_faults(job) == "PLR restart: pods hpp-r1-train-0123456789-pod-1; ranks 1"
    job["status"]["conditions"].append({"type": "Completed", "status": "True"})
    job["status"]["completionTime"] = "2026-12-01T11:02:00Z"
    assert api.is_succeeded(job) and api.latest_condition(job)["type"] == "Completed"  # type: ignore[index]
    assert api.times(job) == (120.0, 3600.0)
    job["spec"]["runPolicy"]["suspend"] = True
    assert api.is_suspended(job)


def test_a_failed_jobs_evidence_names_the_operators_last_restart_before_the_trainers_account() -> None:
    """The step's failure message (follow.JobFollower.fail): the operator's latestFaultyPodInstanceList (restart type,
    faulty pods and ranks), then the trainer's account from the volume, or the failed pods' last lines. An API whose
    status keeps no such account (or a job never restarted) adds nothing. On the real control plane:
    tests/test_k8s_launcher_diagnosis.py."""
    job = render_job(hyperpod_spec())
    job["status"] = {
        "latestFaultyPodInstanceList": {
            "restartType": "JLR",
            "faultyPodList": ["hpp-r1-train-0123456789-pods-1"],
            "faultyRankList": ["8", "9"],
        }
    }
    trainer = TrainerEvidence("crashed", 30, "", 3, ["boom"])
    faults = HYPERPODPYTORCHJOB.faults(job)
    assert failure_evidence(trainer, {}, faults) == (
        "; the operator's last restart: JLR restart: pods hpp-r1-train-0123456789-pods-1; ranks 8, 9; "
        "trainer crashed at step 30; last lines of rank 3, the first to log an error: boom"
    )
    tails = {"pods-1": "exit code 1 (Error): boom"}
    assert failure_evidence(None, tails, faults).endswith("ranks 8, 9; pods-1: exit code 1 (Error): boom")
    assert HYPERPODPYTORCHJOB.faults(render_job(hyperpod_spec())) == ""
    assert failure_evidence(None, tails, PYTORCHJOB.faults(job)) == "; pods-1: exit code 1 (Error): boom"


# -- the command line ---------------------------------------------------------------------------------------------


def test_render_job_prints_a_hyperpodpytorchjob_that_passes_the_template(tmp_path: Path) -> None:
    rules = tmp_path / "rules.json"
    rules.write_text(
        json.dumps([{"name": "LossLine", "logPattern": ".*loss.*", "expectedRecurringFrequencyInSeconds": 600}])
    )
    printed = subprocess.run(
        [
            *RENDER_JOB,
            "--job-api",
            "hyperpodpytorchjob",
            "--topology-label",
            LAYER_3,
            "--hyperpod-log-rules",
            str(rules),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert printed.returncode == 0, printed.stderr
    job = yaml.safe_load(printed.stdout)
    assert job["kind"] == "HyperPodPyTorchJob" and container_of(job)["command"][0] == "hyperpodrun"
    check_against_template(job)
    jsonschema.Draft202012Validator(template_schema()).validate(template_config(job))
    assert job["spec"]["runPolicy"]["logMonitoringConfiguration"] == json.loads(rules.read_text())
    assert job["metadata"]["annotations"]["kueue.x-k8s.io/podset-preferred-topology"] == LAYER_3
    rules.write_text(json.dumps([{"name": "NoPattern"}]))
    refused = subprocess.run(
        [*RENDER_JOB, "--job-api", "hyperpodpytorchjob", "--hyperpod-log-rules", str(rules)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert refused.returncode == 2 and refused.stderr.strip().splitlines()[-1].endswith(
        f"--hyperpod-log-rules {rules}: rule 'NoPattern': has no logPattern (the regex a line must match)"
    ), refused.stderr


def test_a_pipeline_compiled_for_it_renders_its_job_with_the_platforms_settings(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    package = tmp_path / "pipeline.yaml"
    compiled = [
        "compile",
        "--output",
        str(package),
        "--job-api",
        "hyperpodpytorchjob",
        "--topology-label",
        LAYER_3,
        "--topology-required",
    ]
    assert main(compiled) == 0
    assert main(["render-job", "--pipeline-file", str(package), "--param", "trainer_image=img:1"]) == 0
    job = yaml.safe_load(capsys.readouterr().out)
    assert job["kind"] == "HyperPodPyTorchJob"
    assert job["metadata"]["annotations"]["kueue.x-k8s.io/podset-required-topology"] == LAYER_3
    check_against_template(job)


def test_launch_config_hands_the_runs_log_every_and_the_platforms_rules_to_the_job() -> None:
    platform = Platform(job_api="hyperpodpytorchjob", mount_path="/fsx")
    cfg = LaunchConfig.of(
        storage_root="/fsx",
        dataset="d",
        run_id="r1",
        backend="kubernetes",
        image="img:1",
        nnodes=2,
        nproc_per_node=8,
        log_every=100,
        job_options={"expected_step_ms": 1000},
        platform=platform,
    )
    spec, job = cfg.checked_job()
    assert spec.log_every == 100 and spec.expected_step_ms == 1000
    (hang,) = job["spec"]["runPolicy"]["logMonitoringConfiguration"]
    assert hang["expectedRecurringFrequencyInSeconds"] == STALL_GAPS * 100  # a line every 100 s
