"""The installed `hyperpod-pretrain` command: every core reachable, bad input one clear line and non-zero."""

import argparse
import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from components.launch_training.config import LaunchConfig
from tests.helpers import run_cli
from trainer.layout import RunPaths

CLI = str(Path(sys.executable).parent / "hyperpod-pretrain")
REPO = Path(__file__).resolve().parents[1]


def cli(*args: str) -> subprocess.CompletedProcess:
    """The command's entry point in this process (tests/helpers.py run_cli); the installed script itself runs in
    test_the_version_is_shown_and_written_into_each_runs_config."""
    return run_cli(*args)


def subcommands() -> dict[str, argparse.ArgumentParser]:
    from pipelines.cli import build_parser

    parser = build_parser()
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def test_every_flag_of_every_command_is_explained_and_every_example_parses() -> None:
    from pipelines.cli import EXAMPLES, build_parser

    commands = subcommands()
    assert set(commands) == set(EXAMPLES)
    for name, parser in commands.items():
        unexplained = [a.option_strings[-1] for a in parser._actions if a.option_strings and not a.help]
        assert not unexplained, f"{name}: {unexplained} have no help"
        text = parser.format_help()
        assert f"example:\n  hyperpod-pretrain {EXAMPLES[name]}" in text
        args = build_parser().parse_args(shlex.split(EXAMPLES[name]))
        assert args.command == name
    preflight = commands["preflight"].format_help()
    order = [
        preflight.index(f"\n{g}")
        for g in (
            "the compiled pipeline:",
            "cluster (without --pipeline-file):",
            "platform (without",
            "run (without",
            "training (without",
        )
    ]
    assert order == sorted(order), "a platform engineer's flags first, the trainer's last"
    launch = commands["launch"].format_help()
    assert [g in launch for g in ("\nrun:", "\ntraining:", "\ncluster:", "\ndeadlines:", "\nplatform:")] == [True] * 5
    assert "(default: 1800)" in launch and "--pending-timeout-s" in launch.split("\ndeadlines:")[1]


def test_help_loads_neither_torch_nor_kfp_nor_numpy() -> None:
    """--help answers at once: the heavy libraries are imported by the commands that use them."""
    probe = (
        "import sys, pipelines.cli as c; c.build_parser(); print(sorted({'torch', 'kfp', 'numpy'} & set(sys.modules)))"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert result.stdout.strip() == "[]", result.stderr
    assert cli("launch", "--help").returncode == 0


def test_stage_data_prints_result(corpus: Path, tmp_path: Path) -> None:
    result = cli(
        "stage-data",
        "--source",
        f"file://{corpus}",
        "--storage-root",
        str(tmp_path),
        "--dataset",
        "d",
        "--vocab-size",
        "300",
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["files"] == 12


def test_verify_and_evaluate_on_a_trained_run(trained_root: Path, tmp_path: Path) -> None:
    root = tmp_path / "fsx"
    shutil.copytree(trained_root, root, symlinks=True)
    verified = cli("verify-nccl", "--storage-root", str(root), "--run-id", "run-1", "--world-size", "2")
    assert verified.returncode == 0 and "Communication check: passed" in verified.stdout
    failed = cli("verify-nccl", "--storage-root", str(root), "--run-id", "run-1", "--world-size", "3")
    assert failed.returncode == 1
    assert failed.stderr.strip().splitlines()[-1] == (
        "hyperpod-pretrain verify-nccl: failed: all ranks reported: rank 2: no self-test report; "
        "same world size: rank 0 reports world size 2, expected 3 (and 1 more)"
    )
    evaluated = cli("evaluate", "--storage-root", str(root), "--dataset", "synthetic", "--run-id", "run-1")
    assert evaluated.returncode == 0 and "val loss" in evaluated.stdout

    latest = RunPaths.of(root, "run-1").latest_checkpoint.resolve()
    (latest / "__0_0.distcp").write_bytes(b"\x00garbage")
    corrupt = cli("evaluate", "--storage-root", str(root), "--dataset", "synthetic", "--run-id", "run-1")
    assert corrupt.returncode == 2
    assert corrupt.stderr.splitlines() == [
        f"hyperpod-pretrain evaluate: error: checkpoint {latest} is truncated or altered: __0_0.distcp is 8 bytes, "
        f"commit.json says {json.loads((latest / 'commit.json').read_text())['files']['__0_0.distcp']}"
    ]


def test_bad_benchmarks_are_one_line_exit_2_and_leave_the_evaluations_as_they_were(
    trained_root: Path, tmp_path: Path
) -> None:
    """An unknown task, a task whose data was never staged, and a task data set with other columns: each refused in
    one line with exit 2 before a model is loaded, nothing written under eval/ (eval.json, the reports, the
    history)."""
    import pyarrow.parquet as pq

    from tests.benchmark_data import write_task_data

    root = tmp_path / "fsx"
    shutil.copytree(trained_root, root, symlinks=True)
    evaluate = ["evaluate", "--storage-root", str(root), "--dataset", "synthetic", "--run-id", "run-1", "--no-export"]
    eval_dir = RunPaths.of(root, "run-1").eval
    assert not eval_dir.exists()
    mirror = write_task_data(tmp_path / "mirror", items=4)["piqa"].parent
    piqa = mirror / "piqa" / "validation.parquet"
    pq.write_table(pq.read_table(piqa).rename_columns(["question", "sol1", "sol2", "label"]), piqa)
    for args, says in (
        (["--benchmarks", "hellaswag,mmlu_pro"], "benchmark 'mmlu_pro' is not supported"),
        (["--benchmarks", "arc_easy"], "benchmark arc_easy: no staged data in"),
        (["--benchmarks", "piqa", "--benchmark-data", str(mirror)], "has the columns question (string)"),
    ):
        refused = cli(*evaluate, *args)
        assert refused.returncode == 2, refused.stderr
        *progress, line = refused.stderr.splitlines()  # the staging's INFO lines, then the one error line
        assert line.startswith("hyperpod-pretrain evaluate: error: ") and says in line, line
        assert all(" INFO " in each for each in progress), progress
        assert not eval_dir.exists()


def test_bad_input_is_one_line_and_leaves_nothing(corpus: Path, tmp_path: Path) -> None:
    root = tmp_path / "fsx"
    missing = cli("stage-data", "--source", str(tmp_path / "nope"), "--storage-root", str(root), "--dataset", "d")
    assert missing.returncode == 2
    assert missing.stderr.splitlines() == [
        f"hyperpod-pretrain stage-data: error: source {tmp_path / 'nope'}: does not exist"
    ]

    blocker = tmp_path / "file"
    blocker.write_text("")
    unwritable = cli("stage-data", "--source", str(corpus), "--storage-root", str(blocker / "x"), "--dataset", "d")
    assert unwritable.returncode == 2 and "storage root" in unwritable.stderr and "not writable" in unwritable.stderr
    assert len(unwritable.stderr.splitlines()) == 1
    assert not root.exists()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--max-steps", "0"], "argument --max-steps: must be a positive integer, got 0"),
        (["--nproc-per-node", "-2"], "argument --nproc-per-node: must be a positive integer, got -2"),
        (["--preset", "gpt5"], "argument --preset: 'gpt5' is unknown: choose one of tiny"),
        (["--batch-size", "x"], "argument --batch-size: 'x' is not an integer"),
        (["--lr", "-1"], "argument --lr: must be positive, got -1.0"),
    ],
)
@pytest.mark.parametrize("command", ["launch", "run-local"])
def test_bad_training_arguments(command: str, args: list[str], message: str, tmp_path: Path) -> None:
    base = ["--storage-root", str(tmp_path)] + (["--dataset", "d", "--run-id", "r"] if command == "launch" else [])
    result = cli(command, *base, *args)
    assert result.returncode == 2
    assert message in result.stderr.splitlines()[-1]
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--dropout", "0.5", "--warmup-steps", "3", "--source", "/nonexistent/corpus"],
            "source /nonexistent/corpus: no such file or directory",
        ),
        (
            ["--resume-run-id", "never-ran"],
            "resume_run_id 'never-ran': {root}/runs/never-ran/checkpoints holds no checkpoint to continue from",
        ),
        (["--skip-staging", "--dataset", "never"], "skip_staging: dataset 'never' was never staged under {root}"),
        (
            ["--tokenizer-path", "/nonexistent/tokenizer.json"],
            "tokenizer_path /nonexistent/tokenizer.json: no such file or directory",
        ),
    ],
)
def test_run_local_refuses_bad_input_before_anything_runs(
    args: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Checked before the pipeline starts (before a minute of staging and tokenizing): one line, exit 2, nothing
    written. In process: the pipeline would be the first thing to load kfp.local."""
    from pipelines.cli import main

    root = tmp_path / "fsx"
    assert main(["run-local", "--storage-root", str(root), *args]) == 2
    assert capsys.readouterr().err.splitlines() == [f"hyperpod-pretrain run-local: error: {message.format(root=root)}"]
    assert not root.exists()


def test_run_local_stages_all_of_a_given_source_and_refuses_filters_that_keep_no_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--include is '*' for a --source of one's own and '*.py' only for the demo corpus (a corpus of .txt files failed
    in staging after 35 s under the demo's filter); a local source whose filters keep no file is refused before the
    pipeline starts, in staging's own words, nothing written. --tokenizer-path reaches the pipeline, checked here
    only where it is local. In process, as the refusals above."""
    from pipelines import COMPILED_PIPELINE
    from pipelines.cli import main
    from pipelines.cli.run_settings import run_local_arguments
    from pipelines.local_run import check_before_start, default_corpus
    from pipelines.package import Package
    from tests.helpers import write_corpus

    corpus = write_corpus(tmp_path / "corpus", files=2, sentences=3)
    tokenizer = tmp_path / "tokenizer"
    tokenizer.mkdir()
    root = tmp_path / "fsx"
    own = run_local_arguments(
        parsed("run-local", "--storage-root", str(root), "--source", str(corpus), "--tokenizer-path", str(tokenizer))
    )
    demo = run_local_arguments(parsed("run-local", "--storage-root", str(root)))
    assert (own["source"], own["include"], own["tokenizer_path"]) == (str(corpus), ["*"], str(tokenizer))
    assert (demo["source"], demo["include"], demo["tokenizer_path"]) == (default_corpus(), ["*.py"], "")
    package = Package.load(COMPILED_PIPELINE)
    assert set(own) < set(package.inputs), "every argument is a pipeline parameter"
    assert own["exclude"] == package.defaults()["exclude"], "the filters checked are those the pipeline stages with"
    for arguments in (own, demo, {**own, "tokenizer_path": "s3://bucket/tokenizers/llama-3/"}):
        check_before_start(root, arguments)

    exclude = "exclude ['__pycache__/*', '*.pyc', '.*']"
    (corpus / ".notes").write_text("kept out by the default exclude")
    for include in (["*.py"], [".notes"]):
        command = ["run-local", "--storage-root", str(root), "--source", str(corpus), "--include", *include]
        assert main(command) == 2
        assert capsys.readouterr().err.splitlines() == [
            f"hyperpod-pretrain run-local: error: source {corpus}: no files to stage (include {include}, {exclude})"
        ]
    assert not root.exists()


def test_the_version_is_shown_and_written_into_each_runs_config(trained_root: Path) -> None:
    from common.version import tool_version

    shown = subprocess.run([CLI, "--version"], capture_output=True, text=True, timeout=60)  # the installed script
    assert shown.returncode == 0 and shown.stdout.strip() == f"hyperpod-pretrain {tool_version()}"
    assert tool_version() != "unknown", "the project is installed (make setup)"
    config = json.loads(RunPaths.of(trained_root, "run-1").config.read_text())
    assert config["hyperpod_pretrain"] == tool_version()


# -- a resume takes the run's recorded settings (pipelines/cli/run_settings.py fill_train_args); in process -------


def parsed(*argv: str) -> argparse.Namespace:
    from pipelines.cli import build_parser

    return build_parser().parse_args(list(argv))


def test_a_resume_takes_the_runs_recorded_settings_where_none_are_given(trained_root: Path) -> None:
    """run-1 trained with the tests' settings (tiny, 60 steps, seq_len 64, lr 5e-3, warm-up 5, a checkpoint every
    20), not the trainer's defaults, as its config.json records: resumed from the CLI with only --max-steps and
    --extend-schedule it trains on with them; a setting given wins; a new run, and the cluster commands, get the
    defaults."""
    from pipelines import CLUSTER_DEFAULTS
    from pipelines.cli.run_settings import RESUMED_SETTINGS, launch_config, run_local_arguments
    from trainer.config import TRAIN_DEFAULTS

    root = str(trained_root)
    recorded = json.loads(RunPaths.of(trained_root, "run-1").config.read_text())["trainer"]
    assert {n: recorded[n] for n in ("preset", "max_steps", "seq_len", "lr", "warmup_steps", "checkpoint_every")} == {
        "preset": "tiny",
        "max_steps": 60,
        "seq_len": 64,
        "lr": 5e-3,
        "warmup_steps": 5,
        "checkpoint_every": 20,
    }, "settings other than the defaults, or this test would show nothing"
    own = {name: recorded[name] for name in RESUMED_SETTINGS}

    resumed = run_local_arguments(
        parsed(
            "run-local", "--storage-root", root, "--resume-run-id", "run-1", "--max-steps", "80", "--extend-schedule"
        )
    )
    assert {name: resumed[name] for name in RESUMED_SETTINGS} == {**own, "max_steps": 80}
    assert (resumed["run_id"], resumed["extend_schedule"]) == ("run-1", "continue"), "not a setting of the run"

    relaunched = launch_config(
        parsed(
            "launch",
            "--storage-root",
            root,
            "--dataset",
            "synthetic",
            "--run-id",
            "run-1",
            "--lr",
            "1e-3",
            "--extend-schedule",
            "rewarm",
        )
    )
    assert {name: chosen(relaunched, name) for name in RESUMED_SETTINGS} == {**own, "lr": 1e-3}
    args = relaunched.trainer_args()
    assert args[args.index("--seq-len") + 1] == "64" and args[args.index("--extend-schedule") + 1] == "rewarm"

    defaults = {name: TRAIN_DEFAULTS[name] for name in RESUMED_SETTINGS}
    new = run_local_arguments(parsed("run-local", "--storage-root", root, "--run-id", "run-2"))
    assert {name: new[name] for name in RESUMED_SETTINGS} == defaults and new["extend_schedule"] == ""
    fresh = launch_config(parsed("launch", "--storage-root", root, "--dataset", "synthetic", "--run-id", "run-2"))
    assert {name: chosen(fresh, name) for name in RESUMED_SETTINGS} == defaults
    rendered = launch_config(
        parsed("render-job", "--storage-root", root, "--dataset", "synthetic", "--run-id", "run-1")
    )
    assert {name: chosen(rendered, name) for name in RESUMED_SETTINGS} == {
        **defaults,
        **{name: CLUSTER_DEFAULTS[name] for name in RESUMED_SETTINGS if name in CLUSTER_DEFAULTS},
    }, "render-job: the pipeline's defaults"


def chosen(config: LaunchConfig, name: str) -> Any:
    """A run setting of the launch: in its trainer settings, or the launcher's own (init_from_model)."""
    return config.train[name] if name in config.train else getattr(config, name)


def test_a_resume_whose_recorded_settings_are_missing_or_unreadable_is_refused_in_one_line(
    trained_copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from pipelines.cli import main

    run = RunPaths.of(trained_copy, "run-1")
    root = str(trained_copy)
    commands = [
        ["run-local", "--storage-root", root, "--dataset", "synthetic", "--skip-staging", "--resume-run-id", "run-1"],
        ["launch", "--storage-root", root, "--dataset", "synthetic", "--run-id", "run-1"],
    ]
    run.config.unlink()
    for command in commands:
        assert main([*command, "--max-steps", "80"]) == 2
        assert capsys.readouterr().err.splitlines() == [
            f"hyperpod-pretrain {command[0]}: error: run 'run-1' holds a checkpoint to resume, but not {run.config}, "
            "which records its settings: the run directory is incomplete"
        ]
    run.config.write_text('{"trainer": ')
    for command in commands:
        assert main(command) == 2
        assert capsys.readouterr().err.splitlines() == [
            f"hyperpod-pretrain {command[0]}: error: run 'run-1': its settings in {run.config} are unreadable "
            "(JSONDecodeError: Expecting value: line 1 column 13 (char 12))"
        ]
    assert not (run.root / "steps").exists() and json.loads(run.status.read_text())["step"] == 60, "nothing ran"


def test_render_rbac_for_a_profile_leaves_out_what_kubeflow_grants_and_refuses_bad_subjects(tmp_path: Path) -> None:
    """render-rbac: for any namespace and service account; --kubeflow-profile names what Kubeflow already grants
    instead of granting it; deploy/ is its --split output (tests/test_rbac.py holds the rules to real requests)."""
    import yaml

    profile = cli("render-rbac", "--namespace", "team-a", "--service-account", "default-editor", "--kubeflow-profile")
    assert profile.returncode == 0, profile.stderr
    docs = list(yaml.safe_load_all(profile.stdout))
    assert [(d["kind"], d["metadata"]["name"]) for d in docs] == [
        ("ClusterRole", "hyperpod-pretrain-preflight-read"),
        ("ClusterRoleBinding", "hyperpod-pretrain-preflight-read:team-a:default-editor"),
        ("Role", "hyperpod-pretrain-operator-read"),
        ("RoleBinding", "hyperpod-pretrain-operator-read:team-a:default-editor"),
    ]
    assert all(
        d["subjects"] == [{"kind": "ServiceAccount", "name": "default-editor", "namespace": "team-a"}]
        for d in docs
        if d["kind"].endswith("Binding")
    )
    assert "# Left out, as Kubeflow grants them to default-editor already:" in profile.stdout
    assert "kubeflow-training-edit (through kubeflow-edit in team-a" in profile.stdout
    full = list(yaml.safe_load_all(cli("render-rbac", "--namespace", "team-a", "--job-api", "trainjob").stdout))
    assert {d["metadata"]["name"] for d in full if d["kind"] == "Role"} == {
        "hyperpod-pretrain-launcher",
        "hyperpod-pretrain-trainjob",
    }
    assert all(d["metadata"]["namespace"] == "team-a" for d in full if d["kind"] == "Role")
    for args, line in (
        (["--namespace", "Team_A"], "--namespace 'Team_A' is not a namespace name (a DNS-1123 label)"),
        (
            ["--namespace", "a", "--jobs-namespace", "b", "--kubeflow-profile"],
            "--kubeflow-profile: a profile's "
            "default-editor holds kubeflow-edit in its own namespace only: leave out --jobs-namespace",
        ),
        (["--split", str(tmp_path / "missing")], f"--split {tmp_path / 'missing'}: not a directory"),
    ):
        refused = cli("render-rbac", *args)
        assert refused.returncode == 2 and refused.stderr.strip().splitlines()[-1].endswith(line), refused.stderr
    assert cli("render-rbac", "--split", str(tmp_path)).returncode == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "rbac-cluster-read.yaml",
        "rbac-hyperpodpytorchjob.yaml",
        "rbac-pytorchjob.yaml",
        "rbac-trainjob.yaml",
        "rbac.yaml",
    ]


def test_render_storage_gives_each_namespace_a_pv_on_the_same_file_system_and_refuses_bad_values() -> None:
    """render-storage: per namespace a static PV, pre-bound to its claim, and the claim; tests/test_preflight_fsx_pvc.py
    applies them and runs the preflight in two profiles."""
    import yaml

    fsx = [
        "--file-system-id",
        "fs-0123456789abcdef0",
        "--dns-name",
        "fs-0123456789abcdef0.fsx.us-west-2.amazonaws.com",
        "--mount-name",
        "abcdefgh",
        "--capacity",
        "1200Gi",
    ]
    made = cli("render-storage", "--namespace", "team-a", "--namespace", "team-b", *fsx)
    assert made.returncode == 0, made.stderr
    docs = list(yaml.safe_load_all(made.stdout))
    pvs = [d for d in docs if d["kind"] == "PersistentVolume"]
    claims = [d for d in docs if d["kind"] == "PersistentVolumeClaim"]
    assert [(p["spec"]["claimRef"]["namespace"], p["spec"]["claimRef"]["name"]) for p in pvs] == [
        ("team-a", "fsx-lustre-pvc"),
        ("team-b", "fsx-lustre-pvc"),
    ]
    assert {p["spec"]["csi"]["volumeHandle"] for p in pvs} == {"fs-0123456789abcdef0"}
    assert [c["spec"]["volumeName"] for c in claims] == [p["metadata"]["name"] for p in pvs]
    assert all(
        p["spec"]["persistentVolumeReclaimPolicy"] == "Retain" and p["spec"]["storageClassName"] == "" for p in pvs
    )
    for args, line in (
        (
            ["--namespace", "a", *fsx, "--file-system-id", "fs-1"],
            "--file-system-id 'fs-1' is not an FSx file system id (fs-...)",
        ),
        (["--namespace", "a", *fsx, "--mount-name", "short"], "--mount-name 'short' is not an FSx mount name"),
        (
            ["--namespace", "a", *fsx, "--per-unit-storage-throughput", "250"],
            "--per-unit-storage-throughput is a "
            "PERSISTENT_1 or PERSISTENT_2 file system's: give --deployment-type with it",
        ),
        (["--namespace", "a", "--namespace", "a", *fsx], "--namespace: each namespace once"),
    ):
        refused = cli("render-storage", *args)
        line_got = refused.stderr.strip().splitlines()[-1] if refused.stderr.strip() else ""
        assert refused.returncode == 2 and line in line_got, refused.stderr


def test_render_runtime_from_a_compiled_pipeline_is_the_one_its_flags_give(tmp_path: Path) -> None:
    """render-runtime --pipeline-file: the runtime from the settings compiled into a trainjob pipeline, so that the
    runtime cannot drift from the pipeline; a pytorchjob pipeline, or a platform flag beside the file, is refused."""
    registry = "123456789012.dkr.ecr.us-east-1.amazonaws.com"
    pipeline = tmp_path / "trainjob.yaml"
    compiled = cli(
        "compile",
        "--output",
        str(pipeline),
        "--job-api",
        "trainjob",
        "--fsx-pvc",
        "team-fsx",
        "--image-registry",
        registry,
        "--tag",
        "v3",
        "--trainer-env",
        "NCCL_DEBUG=WARN",
    )
    assert compiled.returncode == 0, compiled.stderr
    from_file = cli("render-runtime", "--pipeline-file", str(pipeline), "--restart-budget", "5")
    from_flags = cli(
        "render-runtime",
        "--fsx-pvc",
        "team-fsx",
        "--image",
        f"{registry}/hyperpod-pretrain-trainer:v3",
        "--trainer-env",
        "NCCL_DEBUG=WARN",
        "--restart-budget",
        "5",
    )
    assert from_file.returncode == 0 and from_file.stdout == from_flags.stdout, from_file.stderr
    assert "maxRestarts: 5" in from_file.stdout and "team-fsx" in from_file.stdout
    pytorchjob = cli(
        "render-runtime",
        "--pipeline-file",
        str(REPO / "compiled/pretrain_pipeline.yaml"),
        "--param",
        f"trainer_image={registry}/t:1",
    )
    assert (
        pytorchjob.returncode == 2
        and "a ClusterTrainingRuntime is for a --job-api trainjob pipeline"
        in (pytorchjob.stderr.strip().splitlines()[-1])
    )
    mixed = cli("render-runtime", "--pipeline-file", str(pipeline), "--fsx-pvc", "other")
    assert mixed.returncode == 2 and mixed.stderr.strip().splitlines()[-1].endswith(
        "give pipeline parameters as --param KEY=VALUE"
    )


def test_run_local_refuses_a_starting_model_with_a_preset_or_unreadable(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before anything is staged or written: one line, exit 2 (staging's own refusals: tests/test_published.py).
    In-process: the real CLI's main."""
    from pipelines.cli import main

    root = tmp_path / "fsx"
    for args, line in (
        (
            ["--init-from-model", str(tmp_path), "--preset", "tiny"],
            "--preset tiny and --init-from-model both choose "
            "the architecture: leave --preset out (the model's config.json gives it)",
        ),
        (
            ["--init-from-model", str(tmp_path)],
            f"init_from_model {tmp_path}: no config.json there: give a directory that save_pretrained wrote",
        ),
    ):
        assert main(["run-local", "--storage-root", str(root), *args]) == 2
        assert capsys.readouterr().err.strip().splitlines()[-1].endswith(line)
    assert not root.exists()


MISSPELT = [
    (["--max-step", "5"], "--max-step: did you mean --max-steps?"),
    (["--text_field", "body"], "--text_field: did you mean --text-field?"),
]


@pytest.mark.parametrize(("flag", "hint"), MISSPELT)
def test_an_abbreviated_or_misspelt_flag_is_refused_with_the_flag_meant(
    flag: list[str], hint: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """argparse took `--max-step 5` for `--max-steps 5` (its abbreviations); `--text_field` got no suggestion."""
    from pipelines.cli import main

    with pytest.raises(SystemExit) as exited:
        main(["run-local", *flag])
    assert exited.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith(f"unrecognized arguments: {' '.join(flag)}; {hint}")
