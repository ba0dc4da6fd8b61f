"""`submit` and `schedule`: the real CLI and kfp.Client against the loopback KFP v2beta1 server (tests/kfp_server/),
which checks every body against kfp_server_api's models and every run's parameters against the compiled spec."""

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from pipelines import COMPILED_PIPELINE
from pipelines.remote import MIN_KFP_BACKEND
from tests.helpers import run_cli
from tests.kfp_server import FakeKfp

pytestmark = pytest.mark.timeout(120)
CLI = str(Path(sys.executable).parent / "hyperpod-pretrain")
# The checked-in pipeline is compiled with no registry: its trainer_image is empty, which its preflight step refuses
# for the kubernetes backend, and so does submit before anything is sent.
IMAGE = "registry.example/hyperpod-pretrain-trainer:1"
SOURCE = ("--param", "source=s3://a/b", "--param", f"trainer_image={IMAGE}")


@pytest.fixture
def server() -> Iterator[FakeKfp]:
    with FakeKfp() as fake:
        yield fake
        assert fake.errors == []  # nothing the fake received broke the real API's schema


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    """No kfp context file, KF_PIPELINES_* variable or service-account token of this machine leaks in."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("KF_PIPELINES")}
    return clean | {"HOME": str(tmp_path), "KF_PIPELINES_SA_TOKEN_PATH": str(tmp_path / "no-token")}


def cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return run_cli(*args, env=env)


def test_submit_uploads_once_and_creates_a_run_with_typed_parameters(server: FakeKfp, env: dict[str, str]) -> None:
    params = [
        "--param",
        "source=s3://corpus/prefix",
        "--param",
        "nnodes=4",
        "--param",
        "lr=0.0003",
        "--param",
        f"trainer_image={IMAGE}",
        "--param",
        "skip_staging=true",
        "--param",
        'include=["*.txt", "*.md"]',
        "--param",
        'job_options={"memory": "512Gi"}',
    ]
    result = cli(env, "submit", "--host", server.url, "--run-name", "first", *params)
    assert result.returncode == 0, result.stderr
    (run,) = server.runs.values()
    assert f"{server.url}/#/runs/details/{run.id}" in result.stdout
    assert run.parameters == {
        "source": "s3://corpus/prefix",
        "nnodes": 4,
        "lr": 0.0003,
        "trainer_image": IMAGE,
        "skip_staging": True,
        "include": ["*.txt", "*.md"],
        "job_options": {"memory": "512Gi"},
    }
    assert run["display_name"] == "first"
    (pipeline,) = server.pipelines.values()
    assert pipeline["display_name"] == "hyperpod-pretrain"
    # The uploaded file is the compiled file, byte for byte, pipeline spec and platform spec.
    version = server.versions[run["pipeline_version_reference"]["pipeline_version_id"]]
    assert version.package == COMPILED_PIPELINE.read_bytes()
    spec, platform = yaml.safe_load_all(COMPILED_PIPELINE.read_text())
    assert version.pipeline_spec == spec and version.platform_spec == platform
    (experiment,) = server.experiments.values()
    assert experiment["display_name"] == "hyperpod-pretrain" and run["experiment_id"] == experiment.id

    uploads = len(server.requests_to("POST", r"/pipelines/upload"))
    again = cli(
        env, "submit", "--host", server.url, "--param", "source=s3://corpus/prefix", "--param", f"trainer_image={IMAGE}"
    )
    assert again.returncode == 0, again.stderr
    assert "existing version" in again.stdout
    assert len(server.requests_to("POST", r"/pipelines/upload")) == uploads  # reused, not uploaded again
    assert len(server.runs) == 2 and len(server.experiments) == 1
    second = [r for r in server.runs.values() if r.id != run.id][0]
    assert second["pipeline_version_reference"] == run["pipeline_version_reference"]


def test_a_changed_pipeline_file_adds_a_version(server: FakeKfp, env: dict[str, str], tmp_path: Path) -> None:
    assert cli(env, "submit", "--host", server.url, *SOURCE).returncode == 0
    changed = tmp_path / "pipeline.yaml"
    changed.write_text(COMPILED_PIPELINE.read_text().replace("defaultValue: 5000.0", "defaultValue: 6000.0"))
    result = cli(env, "submit", "--host", server.url, "--pipeline-file", str(changed), *SOURCE)
    assert result.returncode == 0, result.stderr
    assert "new version" in result.stdout
    (pipeline,) = server.pipelines.values()
    assert {v.package for v in server.versions_of(pipeline.id)} >= {
        COMPILED_PIPELINE.read_bytes(),
        changed.read_bytes(),
    }


@pytest.mark.parametrize(
    "params, message",
    [
        (["--param", "source=s3://a", "--param", "nnode=2"], "--param nnode: the pipeline has no such parameter"),
        (["--param", "source=s3://a", "--param", "nnodes=two"], "--param nnodes='two': not an integer"),
        (["--param", "source=s3://a", "--param", "skip_staging=yes"], "expected true or false"),
        (["--param", "source=s3://a", "--param", "include=*.txt"], "expected a JSON list"),
        (["--param", "nnodes=2"], "--param source=... is required"),
        (["--param", "source"], "'source' is not KEY=VALUE"),
    ],
)
def test_bad_parameters_fail_before_anything_is_created(
    server: FakeKfp, env: dict[str, str], params: list[str], message: str
) -> None:
    result = cli(env, "submit", "--host", server.url, *params)
    assert result.returncode == 2
    assert message in result.stderr.strip().splitlines()[-1]
    assert [r for r in server.requests if r.method != "GET"] == []


PRESETS = "tiny, small, gpt2-124m, gpt2-350m, llama-1b, llama-3b, llama-8b"


@pytest.mark.parametrize(
    "params, message",
    [
        (["preset=huge"], f"--param preset='huge': preset 'huge' is unknown: choose one of {PRESETS}"),
        (["nnodes=0"], "--param nnodes=0: nnodes must be a positive integer, got 0"),
        (["nnodes=four"], "--param nnodes='four': not an integer"),
        (["lr=inf"], "--param lr='inf': not a finite number (JSON has no NaN or infinity)"),
        (
            ['job_options={"privileged": true}'],
            "--param job_options: job option 'privileged' is not a run option "
            "(the platform team's settings are compiled in); a run may set: activation_checkpointing, auto_resume, ",
        ),
        (
            ["nproc_per_node=4"],
            "--param nproc_per_node=4: nproc-per-node 4 differs from the 8 GPUs requested per "
            "node: each process drives one GPU",
        ),
        (
            ["storage_root=/data"],
            "--param storage_root='/data': storage_root '/data' is outside the FSx mount path '/fsx'",
        ),
        (["vocab_size=100"], "--param vocab_size=100: vocab size 100 is out of range: it must be above 256"),
        (
            ["tokenize_workers=0"],
            "--param tokenize_workers=0: tokenize groups 0 is out of range: it must be between 1 and 64",
        ),
        (
            ["source=gs://bucket/corpus"],
            "--param source='gs://bucket/corpus': source gs://bucket/corpus: unsupported "
            "scheme (use s3://, file:// or a local path)",
        ),
        (
            ["max_bad_records=-1"],
            "--param max_bad_records=-1: max bad records -1 is out of range: it must be 0 or more",
        ),
        (
            ["text_field=content..body"],
            "--param text_field='content..body': text field 'content..body': give a field name, or a dotted path "
            "such as content.body",
        ),
        (
            ["tokenizer_path=gs://bucket/tok"],
            "--param tokenizer_path='gs://bucket/tok': tokenizer gs://bucket/tok: unsupported scheme (use s3://, "
            "file:// or a path)",
        ),
        (
            ["expect_transport=efaa"],
            "--param expect_transport='efaa': expected transport 'efaa': choose one of efa, ib, socket, any",
        ),
        (["eval_max_tokens=0"], "--param eval_max_tokens=0: max tokens and batch size must be positive, got 0 and 8"),
        (
            ["eval_checkpoints=20;40"],
            "--param eval_checkpoints='20;40': checkpoint '20;40': give 'latest', 'unevaluated', or step numbers "
            "separated by commas (e.g. 100,200)",
        ),
        (
            ["run_id=a", "resume_run_id=b"],
            "--param run_id='a', --param resume_run_id='b': run_id 'a' and "
            "resume_run_id 'b' name different runs: give one",
        ),
        (
            ["init_from_model=s3://models/llama", "preset=llama-8b"],
            "--param preset='llama-8b' and --param init_from_model both choose the architecture: leave preset out",
        ),
        (
            ["init_from_model=gs://models/llama"],
            "--param init_from_model='gs://models/llama': init_from_model gs://models/llama: unsupported scheme",
        ),
        (
            ["mlflow_tracking_uri=mlflow:5000"],
            "--param mlflow_tracking_uri='mlflow:5000': mlflow_tracking_uri: 'mlflow:5000' is neither an http(s):// "
            "URL of an MLflow tracking server nor a SageMaker MLflow ARN",
        ),
        (
            ["mlflow_tracking_uri=https://ci:s3cret@mlflow.example.com"],
            "--param mlflow_tracking_uri='https://ci:***@mlflow.example.com': mlflow_tracking_uri: the tracking "
            "URI holds credentials",
        ),
        (
            ["trainer_image="],
            "the pipeline's defaults: the trainer image is empty (--image; a pipeline's trainer_image): the "
            "kubernetes backend needs one",
        ),
    ],
    ids=lambda value: value[0] if isinstance(value, list) else "",
)
def test_bad_values_are_refused_by_the_steps_own_checks_before_any_request(
    server: FakeKfp, capsys: pytest.CaptureFixture[str], params: list[str], message: str
) -> None:
    """Each value is typed and checked as the compiled pipeline's steps would (the launcher's LaunchConfig, staging's,
    verification's and evaluation's own checks), with the package's defaults and compiled platform for the rest: the
    step's own line after the --param it comes from, exit 2, and no request at all. In-process: the real CLI."""
    from pipelines.cli import main

    given = [arg for value in params for arg in ("--param", value)]
    for command in (["submit"], ["schedule", "--name", "nightly", "--cron", "0 0 2 * * *"]):
        code = main([*command, "--host", server.url, *SOURCE, *given])
        assert code == 2
        assert (
            capsys.readouterr()
            .err.strip()
            .splitlines()[-1]
            .startswith(f"hyperpod-pretrain {command[0]}: error: {message}")
        )
    assert server.requests == []


@pytest.mark.parametrize("outcome, code", [("SUCCEEDED", 0), ("FAILED", 1), ("CANCELED", 1)])
def test_submit_wait_exits_by_the_runs_outcome(server: FakeKfp, env: dict[str, str], outcome: str, code: int) -> None:
    server.run_outcome = outcome
    result = cli(env, "submit", "--host", server.url, *SOURCE, "--wait", "--poll-s", "0.05")
    assert result.returncode == code, result.stderr
    (run,) = server.runs.values()
    assert f"{outcome}: {server.url}/#/runs/details/{run.id}" in result.stdout
    if code:
        last = result.stderr.strip().splitlines()[-1]
        assert last == (
            f"hyperpod-pretrain submit: failed: run {run.id} ended {outcome}; its summary: "
            f"/fsx/runs/{run.id}/summary.md"
        )


@pytest.mark.parametrize(
    "failing, reported",
    [
        # FAILED nodes: the workflow, root, exit-handler-1, stage-data and its executor pod; only the step is named.
        ("stage-data", ["step stage-data FAILED"]),
        ("verify-nccl-driver", ["step verify-nccl FAILED in its driver"]),
        # No step or driver of a step failed: every failed node is named (the workflow's name ends in 5 letters).
        ("root-driver", [r"hyperpod-pretrain-[a-z]{5} FAILED", "root-driver FAILED"]),
    ],
)
def test_a_failed_run_names_the_step_it_failed_in(
    server: FakeKfp, env: dict[str, str], failing: str, reported: list[str]
) -> None:
    server.run_outcome, server.failed_task = "FAILED", failing
    result = cli(env, "submit", "--host", server.url, *SOURCE, "--wait", "--poll-s", "0.05")
    assert result.returncode == 1, result.stderr
    (run,) = server.runs.values()
    errors = [
        line.split(" ERROR hyperpod-pretrain: ", 1)[1]
        for line in result.stderr.splitlines()
        if " ERROR hyperpod-pretrain: " in line
    ]
    assert len(errors) == len(reported) + 1
    assert all(re.fullmatch(pattern, line) for pattern, line in zip(reported, errors, strict=False)), errors
    assert errors[-1] == (  # the API has no message for any node: the reason is in the step's log
        "KFP keeps no error message for a step, and a failed step uploads no outputs: the step's log says why (the "
        "UI: the run's graph, the step, Logs)"
    )
    assert result.stderr.strip().splitlines()[-1] == (
        f"hyperpod-pretrain submit: failed: run {run.id} ended FAILED; its summary: /fsx/runs/{run.id}/summary.md"
    )


def test_the_service_account_token_is_sent(server: FakeKfp, env: dict[str, str], tmp_path: Path) -> None:
    server.require_token = "pipeline-runner-token"
    token = tmp_path / "token"
    token.write_text("pipeline-runner-token")
    env["KF_PIPELINES_SA_TOKEN_PATH"] = str(token)
    env["KF_PIPELINES_ENDPOINT"] = server.url  # the host from kfp's own variable
    result = cli(env, "submit", *SOURCE)
    assert result.returncode == 0, result.stderr
    assert all(r.headers.get("authorization") == "Bearer pipeline-runner-token" for r in server.requests)
    token.write_text("expired")
    denied = cli(env, "submit", *SOURCE)
    assert denied.returncode == 2  # credentials the backend refuses are bad input: no retry of the step helps
    assert "KFP refused this client (no --namespace given): Unauthenticated" in denied.stderr.strip().splitlines()[-1]
    server.errors.clear()


def test_without_a_host_the_kubeconfig_reaches_kfp_through_the_api_servers_proxy(
    env: dict[str, str], tmp_path: Path
) -> None:
    proxy = "/api/v1/namespaces/kubeflow/services/ml-pipeline:http/proxy"
    with FakeKfp(path_prefix=proxy, require_token="kubeconfig-user-token") as server:
        kubeconfig = {
            "apiVersion": "v1",
            "kind": "Config",
            "current-context": "hyperpod",
            "clusters": [{"name": "eks", "cluster": {"server": server.url}}],
            "users": [{"name": "me", "user": {"token": "kubeconfig-user-token"}}],
            "contexts": [{"name": "hyperpod", "context": {"cluster": "eks", "user": "me"}}],
        }
        (tmp_path / "kubeconfig").write_text(yaml.safe_dump(kubeconfig))
        env["KUBECONFIG"] = str(tmp_path / "kubeconfig")
        # A process of its own: the kubernetes client reads KUBECONFIG when it is imported.
        result = subprocess.run([CLI, "submit", *SOURCE], capture_output=True, text=True, env=env, timeout=100)
        assert result.returncode == 0, result.stderr
        assert len(server.runs) == 1  # and every request came through the proxy's path (else server.errors)
        assert "(set --host for a link)" in result.stdout
        assert server.errors == []


def test_transient_errors_are_retried_but_a_run_is_never_created_twice(server: FakeKfp, env: dict[str, str]) -> None:
    server.fail_next("GET", r"/pipelines$", status=503, times=2)
    result = cli(env, "submit", "--host", server.url, *SOURCE)
    assert result.returncode == 0, result.stderr
    assert len(server.requests_to("GET", r"/pipelines$")) == 3
    server.fail_next("POST", r"/runs$", status=503)
    result = cli(env, "submit", "--host", server.url, *SOURCE)
    assert result.returncode == 1
    assert "the KFP API answered 503" in result.stderr.strip().splitlines()[-1]
    assert len(server.requests_to("POST", r"/runs$")) == 2  # the first submit's and this one's: no retry of a POST
    server.errors.clear()


def test_an_unreachable_api_is_one_line(env: dict[str, str]) -> None:
    with FakeKfp() as gone:
        url = gone.url
    result = cli(env, "submit", "--host", url, *SOURCE)
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("hyperpod-pretrain submit: failed: submitting ") and "could not be reached" in last
    bad = cli(env, "submit", "--host", "localhost:8080", *SOURCE)
    assert bad.returncode == 2 and "--host 'localhost:8080' is not an http(s) URL" in bad.stderr


def test_a_backend_older_than_the_minimum_is_refused_before_anything_is_created(
    server: FakeKfp, env: dict[str, str]
) -> None:
    server.tag_name = "2.5.0"
    result = cli(env, "submit", "--host", server.url, *SOURCE)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == (
        "hyperpod-pretrain submit: failed: the KFP backend is version 2.5.0; this pipeline needs 2.14.0 or later, as "
        "older backends refuse to create a run whose exit handler takes dsl.PipelineTaskFinalStatus ('task final "
        "status not supported yet') and ignore retry policies inside the exit handler: upgrade KFP (nothing was "
        "uploaded)"
    )
    scheduled = cli(env, "schedule", "--host", server.url, "--name", "nightly", "--cron", "0 0 2 * * *", *SOURCE)
    assert scheduled.returncode == 1 and "the KFP backend is version 2.5.0" in scheduled.stderr
    assert [r for r in server.requests if r.method != "GET"] == []
    assert server.pipelines == server.versions == server.experiments == server.runs == server.recurring_runs == {}


@pytest.mark.parametrize("tag", [MIN_KFP_BACKEND, "2.17.0"])
def test_a_backend_at_or_above_the_minimum_is_accepted(server: FakeKfp, env: dict[str, str], tag: str) -> None:
    server.tag_name = tag
    result = cli(env, "submit", "--host", server.url, *SOURCE)
    assert result.returncode == 0, result.stderr
    assert f"KFP backend {tag} (this pipeline needs 2.14.0 or later)" in result.stderr
    assert "WARNING" not in result.stderr and len(server.runs) == 1


@pytest.mark.parametrize(
    "tag, status, why",
    [
        ("unknown", None, "healthz says tag_name 'unknown'"),  # an image built without TAG_NAME
        ("master", None, "healthz says tag_name 'master'"),
        ("2.17.0", 403, "GET /apis/v2beta1/healthz answered 403 Forbidden"),  # a proxy that guards the path
        ("2.17.0", 404, "GET /apis/v2beta1/healthz answered 404 Not Found"),
    ],
)
def test_an_unreadable_backend_version_warns_and_goes_on(
    server: FakeKfp, env: dict[str, str], tag: str, status: int | None, why: str
) -> None:
    server.tag_name = tag
    if status:
        server.fail_next("GET", r"/healthz$", status=status)
    result = cli(env, "submit", "--host", server.url, *SOURCE)
    assert result.returncode == 0, result.stderr
    warnings = [line for line in result.stderr.splitlines() if " WARNING " in line]
    assert len(warnings) == 1 and warnings[0].endswith(
        f"could not check the KFP backend's version ({why}): this pipeline needs KFP 2.14.0 or later, as older "
        "backends refuse to create a run whose exit handler takes dsl.PipelineTaskFinalStatus ('task final status not "
        "supported yet') and ignore retry policies inside the exit handler; going on"
    )
    assert len(server.runs) == 1


def test_schedule_creates_disables_enables_and_deletes(server: FakeKfp, env: dict[str, str]) -> None:
    result = cli(
        env,
        "schedule",
        "--host",
        server.url,
        "--name",
        "nightly",
        "--cron",
        "0 0 2 * * *",
        "--param",
        "source=s3://corpus/prefix",
        "--param",
        "max_steps=20000",
        "--param",
        f"trainer_image={IMAGE}",
    )
    assert result.returncode == 0, result.stderr
    (recurring,) = server.recurring_runs.values()
    assert f"{server.url}/#/recurringrun/details/{recurring.id}" in result.stdout
    assert recurring.cron == "0 0 2 * * *" and recurring.max_concurrency == 1 and recurring.no_catchup is True
    assert recurring.mode == "ENABLE" and recurring["display_name"] == "nightly"
    assert recurring.parameters == {"source": "s3://corpus/prefix", "max_steps": 20000, "trainer_image": IMAGE}
    version = server.versions[recurring["pipeline_version_reference"]["pipeline_version_id"]]
    assert version.package == COMPILED_PIPELINE.read_bytes()

    duplicate = cli(env, "schedule", "--host", server.url, "--name", "nightly", "--cron", "0 0 3 * * *", *SOURCE)
    assert duplicate.returncode == 2 and "a recurring run of that name exists" in duplicate.stderr
    assert len(server.recurring_runs) == 1

    for action, mode in (("--disable", "DISABLE"), ("--enable", "ENABLE")):
        changed = cli(env, "schedule", "--host", server.url, "--name", "nightly", action)
        assert changed.returncode == 0, changed.stderr
        assert server.recurring_runs[recurring.id].mode == mode
    deleted = cli(env, "schedule", "--host", server.url, "--name", "nightly", "--delete")
    assert deleted.returncode == 0, deleted.stderr
    assert server.recurring_runs == {}
    missing = cli(env, "schedule", "--host", server.url, "--name", "nightly", "--disable")
    assert missing.returncode == 2 and "no recurring run of that name" in missing.stderr
    elsewhere = cli(env, "schedule", "--host", server.url, "--name", "nightly", "--delete", "--experiment", "other")
    assert elsewhere.returncode == 2 and "--experiment 'other': no experiment of that name" in elsewhere.stderr
    assert len(server.experiments) == 1  # looking up what to disable or delete creates nothing


@pytest.mark.parametrize(
    "args, message",
    [
        (["--cron", "0 2 * * *", "--param", "source=s3://a"], "KFP's cron has 6 fields, seconds first"),
        (["--param", "source=s3://a"], "--cron is required to create a recurring run"),
        (["--disable", "--cron", "0 0 2 * * *"], "--disable takes only --name"),
    ],
)
def test_schedule_bad_input(server: FakeKfp, env: dict[str, str], args: list[str], message: str) -> None:
    result = cli(env, "schedule", "--host", server.url, "--name", "nightly", *args)
    assert result.returncode == 2 and message in result.stderr.strip().splitlines()[-1]
    assert server.requests == []


def test_a_multi_user_backend_puts_the_run_in_the_profile_and_refuses_another_profiles_token(
    env: dict[str, str], control_plane: Any, kubeflow: None, tmp_path: Path
) -> None:
    """KFP in multi-user mode (tests/kfp_server/ KubernetesAuthorizer: TokenReview and SubjectAccessReview on the
    real API server, Kubeflow's roles aggregated by its controller manager): a profile's default-editor, with a token
    for KFP's audience, submits and schedules into its profile; another profile's account, or no token, is refused in
    one line naming the namespace and the account, with exit 2."""
    from tests.cluster.kubeflow import EDITOR, make_profile
    from tests.kfp_server import KubernetesAuthorizer

    team, other = (make_profile(control_plane, control_plane.namespace_name()) for _ in range(2))
    tokens = {}
    for profile in (team, other):
        tokens[profile.namespace] = tmp_path / f"{profile.namespace}.token"
        token = control_plane.token_of(profile.namespace, EDITOR, audience=KubernetesAuthorizer.AUDIENCE)
        tokens[profile.namespace].write_text(token)
    mine = ("--namespace", team.namespace, "--token-file", str(tokens[team.namespace]))
    try:
        with FakeKfp(multi_user=True, authorizer=KubernetesAuthorizer(control_plane.admin)) as server:
            submitted = cli(env, "submit", "--host", server.url, *mine, *SOURCE)
            assert submitted.returncode == 0, submitted.stderr
            (run,) = server.runs.values()
            assert server.experiments[run["experiment_id"]]["namespace"] == team.namespace
            scheduled = cli(
                env, "schedule", "--host", server.url, *mine, "--name", "nightly", "--cron", "0 0 2 * * *", *SOURCE
            )
            assert scheduled.returncode == 0, scheduled.stderr
            (recurring,) = server.recurring_runs.values()
            assert server.experiments[recurring["experiment_id"]]["namespace"] == team.namespace
            disabled = cli(env, "schedule", "--host", server.url, *mine, "--name", "nightly", "--disable")
            assert disabled.returncode == 0 and recurring.mode == "DISABLE", disabled.stderr

            outsider = cli(
                env,
                "submit",
                "--host",
                server.url,
                "--namespace",
                team.namespace,
                "--token-file",
                str(tokens[other.namespace]),
                *SOURCE,
            )
            line = outsider.stderr.strip().splitlines()[-1]
            assert (
                outsider.returncode == 2
                and (
                    f"KFP refused system:serviceaccount:{other.namespace}:{EDITOR} in namespace {team.namespace}: "
                    f"Failed to authorize with API: Failed to authorize with API: User 'system:serviceaccount:"
                    f"{other.namespace}:{EDITOR}' is not authorized"
                )
                in line
            ), line
            anonymous = cli(env, "submit", "--host", server.url, "--namespace", team.namespace, *SOURCE)
            line = anonymous.stderr.strip().splitlines()[-1]
            assert (
                anonymous.returncode == 2
                and (
                    f"KFP refused this client (no token: give --token-file) in namespace {team.namespace}: Failed to "
                    "authorize with API: Failed to authorize with API: Failed to check authorization. User identity is "
                    "empty"
                )
                in line
            ), line
            assert len(server.runs) == 1 and server.errors == []
    finally:
        for profile in (team, other):
            control_plane.delete_namespace(profile.namespace)
