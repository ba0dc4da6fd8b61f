"""Every setting a run chooses is declared once (trainer/config.py) and reaches each surface it is declared for: the
compiled pipeline's inputs with the declared cluster default, the launch step's inputs, the CLI's run commands, the
trainer's command line (and back into the trainer's config), a resume's rules, and the docs' parameter table."""

from __future__ import annotations

import json
import re
from dataclasses import MISSING
from pathlib import Path
from typing import Any

import pytest
import yaml

from common.errors import InputError
from components.launch_training.component import launch_pytorchjob
from components.launch_training.config import TRAIN_SETTINGS, LaunchConfig
from components.launch_training.platform import TRAINER_OPTIONS, run_options
from pipelines import CLUSTER_DEFAULTS, COMPILED_PIPELINE
from trainer.config import JOB_OPTION, LAUNCHER, RESUMED_SETTINGS, SETTING, SPECS, parse_config, run_settings
from trainer.layout import RunPaths

RUN_CHOSEN = run_settings(SETTING, LAUNCHER)
PARAMETER_TYPES = {"str": "STRING", "int": "NUMBER_INTEGER", "float": "NUMBER_DOUBLE", "bool": "BOOLEAN"}
# A value other than the default for the settings whose kind alone does not give one.
OTHER_VALUES: dict[str, Any] = {
    "preset": "tiny",
    "mlflow_tracking_uri": "http://127.0.0.1:5000",
    "mlflow_experiment": "another",
    "checkpoint_s3_uri": "s3://bucket/checkpoints",
    "init_from_model": "/fsx/models/llama",
}


# What a setting is said to the trainer with: an experiment only beside the tracking server it is on (without one, the
# platform's environment may name both).
SAID_WITH = {"mlflow_experiment": {"mlflow_tracking_uri": "http://127.0.0.1:5000"}}


def other_value(name: str) -> Any:
    """A valid value of the setting that differs from its default, from its declaration."""
    spec = SPECS[name]
    if name in OTHER_VALUES:
        return OTHER_VALUES[name]
    if spec.metadata["choices"]:
        return next(c for c in spec.metadata["choices"] if c and c != spec.default)
    if spec.type == "bool":
        return not spec.default
    if spec.type == "int":
        return spec.default + 1
    assert spec.type == "float", name
    below = spec.metadata["below"]
    return (spec.default + below) / 2 if below is not None else spec.default * 2 + 0.25


def test_the_declarations_say_how_each_run_setting_is_chosen() -> None:
    assert set(TRAIN_SETTINGS) | set(run_settings(LAUNCHER)) == set(RUN_CHOSEN)
    assert set(TRAINER_OPTIONS) == set(run_settings(JOB_OPTION))
    assert set(RESUMED_SETTINGS) <= set(RUN_CHOSEN), "a resume keeps only what a run chooses"
    for name in RUN_CHOSEN:
        spec = SPECS[name]
        assert spec.default is not MISSING and spec.metadata["run_help"], name
        assert CLUSTER_DEFAULTS[name] == spec.metadata["cluster"], name


def test_each_run_setting_is_a_pipeline_input_with_its_cluster_default_and_a_launch_input() -> None:
    spec = next(yaml.safe_load_all(COMPILED_PIPELINE.read_text()))
    parameters = spec["root"]["inputDefinitions"]["parameters"]
    launch_inputs = launch_pytorchjob.component_spec.inputs
    for name in RUN_CHOSEN:
        declared = SPECS[name]
        assert parameters[name]["parameterType"] == PARAMETER_TYPES[declared.type], name
        if name != "mlflow_tracking_uri":  # its default is the platform team's (PlatformOptions), "" as compiled
            assert parameters[name]["defaultValue"] == declared.metadata["cluster"], name
        assert name in launch_inputs, f"the launch step does not take {name}"
    launch_task = spec["root"]["dag"]["tasks"]["exit-handler-1"]
    inner = spec["components"][launch_task["componentRef"]["name"]]["dag"]["tasks"]["launch-pytorchjob"]
    for name in RUN_CHOSEN:  # the launch step is given the pipeline parameter itself
        wired = inner["inputs"]["parameters"][name]["componentInputParameter"]
        assert wired == f"pipelinechannel--{name}", name


@pytest.mark.parametrize("name", TRAIN_SETTINGS)
def test_a_run_setting_reaches_the_trainer_as_given(name: str) -> None:
    value = other_value(name)
    config = LaunchConfig.of(storage_root="/fsx", dataset="d", run_id="r", **SAID_WITH.get(name, {}), **{name: value})
    config.validate(check_storage=False)
    assert config.train[name] == value
    argv = config.trainer_args()
    trained = parse_config(argv, {})
    assert getattr(trained, name) == value, argv


def test_an_experiment_without_a_tracking_server_is_left_to_the_environment() -> None:
    config = LaunchConfig.of(storage_root="/fsx", dataset="d", run_id="r", mlflow_experiment="another")
    argv = config.trainer_args()
    assert "--mlflow-experiment" not in argv
    assert parse_config(argv, {"TRAINER_MLFLOW_EXPERIMENT": "platform's"}).mlflow_experiment == "platform's"


def test_the_launchers_own_settings_reach_the_trainer_as_they_read_them() -> None:
    config = LaunchConfig.of(
        storage_root="/fsx",
        dataset="d",
        run_id="r",
        **{name: other_value(name) for name in run_settings(LAUNCHER)},
    )
    config.validate(check_storage=False)
    trained = parse_config(config.trainer_args(), {})
    assert trained.init_from_model == "/fsx/models/llama" and trained.preset == "", "the model's architecture"
    assert trained.checkpoint_s3_uri == "s3://bucket/checkpoints/r", "the run's own prefix"


@pytest.mark.parametrize("name", TRAINER_OPTIONS)
def test_a_job_option_reaches_the_trainer_as_given(name: str) -> None:
    value = other_value(name)
    assert run_options({name: value}) == {name: value}
    config = LaunchConfig.of(storage_root="/fsx", dataset="d", run_id="r", job_options={name: value})
    assert getattr(parse_config(config.trainer_args(), {}), name) == value


@pytest.mark.parametrize("name", TRAIN_SETTINGS)
def test_a_bad_value_is_refused_by_the_launcher_naming_the_setting(name: str) -> None:
    spec = SPECS[name]
    bad = {"int": "x", "float": "x", "bool": "maybe"}.get(spec.type, None)
    if bad is None:
        if not spec.metadata["choices"]:
            pytest.skip(f"{name}: any text is a value")
        bad = "no-such-choice"
    config = LaunchConfig.of(storage_root="/fsx", dataset="d", run_id="r", **{name: bad})
    with pytest.raises(InputError, match=re.escape(name.replace("_", "-"))):
        config.validate(check_storage=False)


def test_a_new_setting_is_refused_where_no_declaration_makes_it_a_run_setting() -> None:
    config = LaunchConfig(storage_root="/fsx", dataset="d", run_id="r", train={"fault_nan_at_step": 3})
    with pytest.raises(InputError, match="'fault_nan_at_step' is not a training setting a run chooses"):
        config.validate(check_storage=False)


def test_each_pipeline_input_of_a_run_setting_has_a_docs_row() -> None:
    docs = "\n".join(p.read_text() for p in [Path("README.md"), *sorted(Path("docs").glob("*.md"))])
    for name in RUN_CHOSEN:
        assert re.search(rf"^\| `{name}` \|", docs, re.M), f"no parameter row for {name}"


def write_recorded_run(root: Path, run_id: str, trainer: dict[str, Any]) -> RunPaths:
    run = RunPaths.of(str(root), run_id)
    run.config.parent.mkdir(parents=True)
    run.config.write_text(json.dumps({"trainer": trainer}))
    return run


def test_a_resume_keeps_the_runs_recorded_value_of_each_resumed_setting_unless_given(tmp_path: Path) -> None:
    from pipelines.cli import build_parser
    from pipelines.cli.run_settings import fill_train_args

    recorded = {name: other_value(name) for name in RUN_CHOSEN}
    run = write_recorded_run(tmp_path, "r", recorded)
    args = build_parser().parse_args(["launch", "--storage-root", str(tmp_path), "--dataset", "d", "--run-id", "r"])
    fill_train_args(args, run)
    for name in RESUMED_SETTINGS:
        assert getattr(args, name) == recorded[name], name
    given = build_parser().parse_args(
        ["launch", "--storage-root", str(tmp_path), "--dataset", "d", "--run-id", "r", "--weight-decay", "0.01"]
    )
    fill_train_args(given, run)
    assert given.weight_decay == 0.01 and given.seq_len == recorded["seq_len"]


@pytest.mark.parametrize("command", ["run-local", "launch", "render-job", "preflight"])
def test_each_run_setting_is_a_flag_of_the_run_commands(command: str) -> None:
    from pipelines.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]
    flags = {option for action in sub._actions for option in action.option_strings}
    for name in RUN_CHOSEN:
        assert "--" + name.replace("_", "-") in flags, f"{command} has no flag for {name}"
