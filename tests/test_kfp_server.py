"""The fake KFP API server (tests/kfp_server.py) against the real kfp.Client: what it serves, and what it rejects."""

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kfp
import kfp_server_api
import pytest
import yaml
from kfp import compiler, dsl, kubernetes

from tests.kfp_server import FakeKfp, schema_violations

pytestmark = pytest.mark.timeout(30)


@dsl.component(base_image="python:3.11")
def repeat(msg: str, times: int) -> str:
    return msg * times


@dsl.pipeline(name="tiny")
def tiny(msg: str = "hi", times: int = 2, ratio: float = 0.5, verbose: bool = False, extra: dict = {}) -> None:  # noqa: B006 - a pipeline input default
    repeat(msg=msg, times=times)


@dsl.component(base_image="python:3.11")
def report(status: dsl.PipelineTaskFinalStatus) -> str:
    return status.state


@dsl.pipeline(name="guarded")
def guarded(msg: str = "hi") -> None:
    summary = report()
    with dsl.ExitHandler(summary):
        first = repeat(msg=msg, times=1)
        repeat(msg=first.output, times=2)


@dsl.pipeline(name="tiny-on-gpu-nodes")
def tiny_with_platform(msg: str) -> None:
    task = repeat(msg=msg, times=1)
    kubernetes.add_node_selector(task, label_key="node.kubernetes.io/instance-type", label_value="ml.p5.48xlarge")


@pytest.fixture(scope="module")
def package(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("compiled") / "tiny.yaml"
    compiler.Compiler().compile(tiny, str(path))
    return path


@pytest.fixture(autouse=True)
def isolated_kfp_settings(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """kfp.Client reads ~/.config/kfp/context.json and KF_PIPELINES_* variables: neither may leak in."""
    monkeypatch.setattr(kfp.Client, "_LOCAL_KFP_CONTEXT", str(tmp_path / "kfp-context.json"))
    for name in (
        "KF_PIPELINES_ENDPOINT",
        "KF_PIPELINES_UI_ENDPOINT",
        "KF_PIPELINES_DEFAULT_EXPERIMENT_NAME",
        "KF_PIPELINES_OVERRIDE_EXPERIMENT_NAME",
    ):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def server() -> Iterator[FakeKfp]:
    with FakeKfp() as fake:
        yield fake


@pytest.fixture
def client(server: FakeKfp) -> kfp.Client:
    return server.client()


@pytest.fixture
def uploaded(client: kfp.Client, package: Path) -> tuple[str, str]:
    """(pipeline id, version id) of the tiny pipeline uploaded with a second version 'v2'."""
    pipeline = client.upload_pipeline(str(package), pipeline_name="tiny", description="a tiny pipeline")
    version = client.upload_pipeline_version(str(package), pipeline_version_name="v2", pipeline_id=pipeline.pipeline_id)
    return pipeline.pipeline_id, version.pipeline_version_id


def raw(server: FakeKfp, method: str, path: str, body: Any = None, **headers: str) -> tuple[int, Any]:
    """A request without kfp.Client: (status, parsed JSON answer)."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        server.url + path, data=data, method=method, headers={"Content-Type": "application/json", **headers}
    )
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as error:
        with error:
            return error.code, json.load(error)


def api_error(excinfo: pytest.ExceptionInfo[kfp_server_api.ApiException]) -> dict[str, Any]:
    return json.loads(excinfo.value.body)


# ------------------------------------------------------------------------------------------------- served


def test_client_construction_checks_healthz(server: FakeKfp) -> None:
    client = server.client()
    assert [r.path for r in server.requests] == ["/apis/v2beta1/healthz"]
    assert client.get_kfp_healthz().multi_user is False
    server.multi_user = True
    assert client.get_kfp_healthz().multi_user is True
    assert server.errors == []


def test_healthz_reports_the_backends_version_which_kfps_model_drops(server: FakeKfp) -> None:
    status, answer = raw(server, "GET", "/apis/v2beta1/healthz")
    assert status == 200 and set(answer) == {"commit_sha", "tag_name", "multi_user", "pipeline_store"}
    assert answer["tag_name"] == "2.17.0" and answer["pipeline_store"] == "database"
    server.tag_name = "unknown"  # an image built without TAG_NAME
    assert raw(server, "GET", "/apis/v2beta1/healthz")[1]["tag_name"] == "unknown"
    model = server.client().get_kfp_healthz()
    assert model.to_dict() == {"multi_user": False, "pipeline_store": "database"}
    assert server.errors == []


def test_experiments_by_name_and_id(server: FakeKfp, client: kfp.Client) -> None:
    experiment = client.create_experiment("pretrain")
    assert experiment.display_name == "pretrain" and experiment.storage_state == "AVAILABLE"
    assert client.get_experiment(experiment_name="pretrain").experiment_id == experiment.experiment_id
    assert client.get_experiment(experiment_id=experiment.experiment_id).display_name == "pretrain"
    # create_experiment looks the name up first and reuses the experiment.
    assert client.create_experiment("pretrain").experiment_id == experiment.experiment_id
    assert list(server.experiments) == [experiment.experiment_id]
    assert len(server.requests_to("POST", r"/experiments$")) == 1
    lookup = server.requests_to("GET", r"/experiments$")[0]
    assert json.loads(lookup.query["filter"]) == {
        "predicates": [{"operation": 1, "key": "display_name", "stringValue": "pretrain"}]
    }
    with pytest.raises(ValueError, match="No experiment is found with name other"):
        client.get_experiment(experiment_name="other")
    with pytest.raises(kfp_server_api.ApiException) as excinfo:
        client.get_experiment(experiment_id="missing")
    assert excinfo.value.status == 404 and api_error(excinfo)["code"] == 5
    assert server.errors == []


def test_upload_pipeline_and_versions(server: FakeKfp, client: kfp.Client, package: Path) -> None:
    assert client.get_pipeline_id("tiny") is None
    pipeline = client.upload_pipeline(str(package), pipeline_name="tiny", description="a tiny pipeline")
    assert (pipeline.display_name, pipeline.description) == ("tiny", "a tiny pipeline")
    assert client.get_pipeline_id("tiny") == pipeline.pipeline_id
    assert client.get_pipeline(pipeline.pipeline_id).display_name == "tiny"

    version = client.upload_pipeline_version(str(package), pipeline_version_name="v2", pipeline_id=pipeline.pipeline_id)
    assert (version.pipeline_id, version.display_name) == (pipeline.pipeline_id, "v2")
    stored = server.versions[version.pipeline_version_id]
    assert stored.package == package.read_bytes() and stored.filename == "tiny.yaml"
    assert stored.pipeline_spec["pipelineInfo"]["name"] == "tiny" and stored.platform_spec is None
    # The upload itself stored the first version, under the pipeline's name.
    assert [v["name"] for v in server.versions_of(pipeline.pipeline_id)] == ["tiny", "v2"]

    fetched = client.get_pipeline_version(pipeline.pipeline_id, version.pipeline_version_id)
    assert fetched.name == "v2" and fetched.pipeline_spec["root"] == stored.pipeline_spec["root"]

    by_name = json.dumps({"predicates": [{"operation": "EQUALS", "key": "display_name", "string_value": "v2"}]})
    listed = client.list_pipeline_versions(pipeline.pipeline_id, filter=by_name)
    assert [v.pipeline_version_id for v in listed.pipeline_versions] == [version.pipeline_version_id]
    newest = client.list_pipeline_versions(pipeline.pipeline_id, sort_by="display_name desc", page_size=1)
    assert [v.display_name for v in newest.pipeline_versions] == ["v2"]
    assert (newest.total_size, newest.next_page_token) == (2, "1")
    either = {"predicates": [{"operation": "IN", "key": "name", "stringValues": {"values": ["tiny", "v9"]}}]}
    assert [
        v.name for v in client.list_pipeline_versions(pipeline.pipeline_id, filter=json.dumps(either)).pipeline_versions
    ] == ["tiny"]
    assert server.errors == []


def test_upload_conflicts(server: FakeKfp, client: kfp.Client, package: Path, uploaded: tuple[str, str]) -> None:
    pipeline_id, _ = uploaded
    with pytest.raises(kfp_server_api.ApiException) as excinfo:
        client.upload_pipeline(str(package), pipeline_name="tiny")
    assert excinfo.value.status == 409 and api_error(excinfo)["code"] == 6
    with pytest.raises(kfp_server_api.ApiException) as excinfo:
        client.upload_pipeline_version(str(package), pipeline_version_name="v2", pipeline_id=pipeline_id)
    assert excinfo.value.status == 409
    with pytest.raises(kfp_server_api.ApiException) as excinfo:
        client.upload_pipeline_version(str(package), pipeline_version_name="v3", pipeline_id="missing")
    assert excinfo.value.status == 404
    assert len(server.pipelines) == 1 and len(server.versions) == 2
    assert server.errors == []


def test_upload_keeps_the_platform_spec(server: FakeKfp, client: kfp.Client, tmp_path: Path) -> None:
    path = tmp_path / "platform.yaml"
    compiler.Compiler().compile(tiny_with_platform, str(path))
    assert len(list(yaml.safe_load_all(path.read_text()))) == 2
    pipeline = client.upload_pipeline(str(path), pipeline_name="tiny-on-gpu-nodes")
    (version,) = server.versions_of(pipeline.pipeline_id)
    executor = version.platform_spec["platforms"]["kubernetes"]["deploymentSpec"]["executors"]["exec-repeat"]
    assert executor["nodeSelector"]["labels"] == {"node.kubernetes.io/instance-type": "ml.p5.48xlarge"}
    fetched = client.get_pipeline_version(pipeline.pipeline_id, version.id)
    assert set(fetched.pipeline_spec) == {"pipeline_spec", "platform_spec"}
    assert server.errors == []


def test_run_pipeline_and_wait(server: FakeKfp, client: kfp.Client, uploaded: tuple[str, str]) -> None:
    pipeline_id, version_id = uploaded
    experiment = client.create_experiment("pretrain")
    params = {"msg": "yo", "times": 3, "ratio": 1, "verbose": True, "extra": {"a": [1, 2]}}
    run = client.run_pipeline(
        experiment_id=experiment.experiment_id,
        job_name="run-1",
        pipeline_id=pipeline_id,
        version_id=version_id,
        params=params,
    )
    assert run.state == "PENDING" and run.created_at is not None
    (create,) = server.requests_to("POST", r"/runs$")
    assert create.body["pipeline_version_reference"] == {"pipeline_id": pipeline_id, "pipeline_version_id": version_id}
    assert create.body["runtime_config"] == {"parameters": params}  # typed JSON values, no pipeline_root
    assert server.runs[run.run_id].parameters == params

    started = time.monotonic()
    finished = client.wait_for_run_completion(run.run_id, timeout=10, sleep_duration=0)
    assert time.monotonic() - started < 2
    assert finished.state == "SUCCEEDED" and finished.finished_at is not None
    assert [s.state for s in finished.state_history] == ["PENDING", "RUNNING", "SUCCEEDED"]
    assert len(server.requests_to("GET", rf"/runs/{run.run_id}$")) == 2
    assert client.get_run(run.run_id).state == "SUCCEEDED"  # terminal states stay

    listed = client.list_runs(experiment_id=experiment.experiment_id)
    assert [r.run_id for r in listed.runs] == [run.run_id] and listed.total_size == 1
    assert client.list_runs(experiment_id="elsewhere").runs is None
    named = json.dumps({"predicates": [{"operation": "EQUALS", "key": "display_name", "stringValue": "run-1"}]})
    assert client.list_runs(filter=named).total_size == 1
    assert server.errors == []


def test_scripted_outcomes(server: FakeKfp, client: kfp.Client, uploaded: tuple[str, str]) -> None:
    pipeline_id, version_id = uploaded
    experiment_id = client.create_experiment("pretrain").experiment_id

    def run(name: str) -> str:
        return client.run_pipeline(experiment_id, name, pipeline_id=pipeline_id, version_id=version_id).run_id

    server.run_outcome = "FAILED"
    failed = client.wait_for_run_completion(run("fails"), timeout=10, sleep_duration=0)
    assert failed.state == "FAILED" and failed.error is None  # a real backend keeps no message for a failed run
    assert [(t.display_name, t.state) for t in failed.run_details.task_details][1:] == [
        ("root-driver", "SUCCEEDED"),
        ("root", "FAILED"),
        ("repeat-driver", "SUCCEEDED"),
        ("repeat", "FAILED"),
        ("executor", "FAILED"),
    ]

    server.run_progression = ()
    server.run_outcome = "SUCCEEDED"
    assert client.get_run(run("at once")).state == "SUCCEEDED"

    server.run_outcome = "RUNNING"  # never finishes
    with pytest.raises(TimeoutError):
        client.wait_for_run_completion(run("hangs"), timeout=0.2, sleep_duration=0.05)

    with pytest.raises(ValueError, match="not a V2beta1RuntimeState"):
        server.run_outcome = "DONE"
    assert server.errors == []


def test_a_failed_run_has_the_argo_nodes_a_real_backend_reports(
    server: FakeKfp, client: kfp.Client, tmp_path: Path
) -> None:
    path = tmp_path / "guarded.yaml"
    compiler.Compiler().compile(guarded, str(path))
    server.run_outcome, server.failed_task = "FAILED", "repeat"
    run = client.create_run_from_pipeline_package(str(path), run_name="guarded")
    failed = client.wait_for_run_completion(run.run_id, timeout=10, sleep_duration=0)
    nodes = [(t.display_name, t.state) for t in failed.run_details.task_details]
    assert nodes[0][0].startswith("guarded-") and nodes[0][1] == "FAILED"  # the workflow, named after the pipeline
    assert nodes[1:] == [
        ("root-driver", "SUCCEEDED"),
        ("root", "FAILED"),
        ("exit-handler-1-driver", "SUCCEEDED"),
        ("repeat-driver", "SUCCEEDED"),
        ("repeat", "FAILED"),
        ("executor", "FAILED"),  # repeat-2 never starts
        ("exit-handler-1", "FAILED"),
        ("report-driver", "SUCCEEDED"),
        ("report", "SUCCEEDED"),
        ("executor", "SUCCEEDED"),  # the exit task runs
    ]
    # No message and no outputs on any task: the launcher uploads nothing for a failed step, and the API keeps none.
    assert all(t.error is None and not t.outputs for t in failed.run_details.task_details)
    assert failed.error is None

    server.failed_task = "no-such-step"
    with pytest.raises(kfp_server_api.ApiException) as excinfo:
        client.wait_for_run_completion(client.create_run_from_pipeline_package(str(path)).run_id, 10, 0)
    assert excinfo.value.status == 500 and "is not a step or a driver of the run's" in api_error(excinfo)["message"]
    assert len(server.errors) == 1
    server.errors.clear()

    server.failed_task = "repeat-2-driver"  # a driver fails: its step never starts
    failed = client.wait_for_run_completion(client.create_run_from_pipeline_package(str(path)).run_id, 10, 0)
    nodes = [(t.display_name, t.state) for t in failed.run_details.task_details]
    assert ("repeat-2-driver", "FAILED") in nodes and "repeat-2" not in [name for name, _ in nodes]
    assert ("repeat", "SUCCEEDED") in nodes and ("exit-handler-1", "FAILED") in nodes
    server.failed_task = "root-driver"
    failed = client.wait_for_run_completion(client.create_run_from_pipeline_package(str(path)).run_id, 10, 0)
    assert [(t.display_name, t.state) for t in failed.run_details.task_details][1:] == [("root-driver", "FAILED")]

    server.run_outcome = "SUCCEEDED"
    done = client.wait_for_run_completion(client.create_run_from_pipeline_package(str(path)).run_id, 10, 0)
    assert {t.state for t in done.run_details.task_details} == {"SUCCEEDED"}
    assert "repeat-2" in [t.display_name for t in done.run_details.task_details]


def test_run_from_a_package(server: FakeKfp, client: kfp.Client, package: Path) -> None:
    run = client.create_run_from_pipeline_package(str(package), arguments={"times": 4}, run_name="inline")
    (create,) = server.requests_to("POST", r"/runs$")
    assert create.body["pipeline_spec"]["pipelineInfo"]["name"] == "tiny"
    assert "pipeline_version_reference" not in create.body
    assert server.runs[run.run_id].parameters == {"times": 4}
    assert server.experiments[server.runs[run.run_id]["experiment_id"]]["display_name"] == "Default"
    assert server.errors == []


def test_recurring_runs(server: FakeKfp, client: kfp.Client, uploaded: tuple[str, str]) -> None:
    pipeline_id, version_id = uploaded
    experiment_id = client.create_experiment("nightly").experiment_id
    created = client.create_recurring_run(
        experiment_id,
        "nightly-pretrain",
        cron_expression="0 30 2 * * *",
        max_concurrency=3,
        no_catchup=True,
        pipeline_id=pipeline_id,
        version_id=version_id,
        params={"times": 5},
        enabled=False,
    )
    (create,) = server.requests_to("POST", r"/recurringruns$")
    assert create.body["max_concurrency"] == 3  # an int64 sent as a JSON number ...
    assert created.max_concurrency == "3"  # ... and read back as the string protobuf's JSON mapping writes
    assert (created.mode, created.status, created.no_catchup) == ("DISABLE", "DISABLED", True)
    stored = server.recurring_runs[created.recurring_run_id]
    assert (stored.max_concurrency, stored.cron, stored.enabled, stored.parameters) == (
        3,
        "0 30 2 * * *",
        False,
        {"times": 5},
    )
    assert stored.cron_fields is not None and (stored.cron_fields["hour"], stored.cron_fields["minute"]) == ("2", "30")

    fetched = client.get_recurring_run(created.recurring_run_id)
    assert fetched.trigger.cron_schedule.cron == "0 30 2 * * *"
    listed = client.list_recurring_runs(experiment_id=experiment_id)
    assert [r.recurring_run_id for r in listed.recurring_runs] == [created.recurring_run_id]
    named = json.dumps({"predicates": [{"operation": 1, "key": "display_name", "stringValue": "nightly-pretrain"}]})
    assert client.list_recurring_runs(filter=named).total_size == 1

    client.enable_recurring_run(created.recurring_run_id)
    assert client.get_recurring_run(created.recurring_run_id).mode == "ENABLE" and stored.enabled
    client.disable_recurring_run(created.recurring_run_id)
    assert client.get_recurring_run(created.recurring_run_id).status == "DISABLED"

    periodic = client.create_recurring_run(
        experiment_id, "hourly", interval_second=3600, pipeline_id=pipeline_id, version_id=version_id
    )
    assert server.recurring_runs[periodic.recurring_run_id].interval_second == 3600
    assert periodic.trigger.periodic_schedule.interval_second == "3600"
    assert periodic.mode == "ENABLE" and server.recurring_runs[periodic.recurring_run_id].max_concurrency == 1

    client.delete_recurring_run(created.recurring_run_id)
    assert list(server.recurring_runs) == [periodic.recurring_run_id]
    with pytest.raises(kfp_server_api.ApiException) as excinfo:
        client.get_recurring_run(created.recurring_run_id)
    assert excinfo.value.status == 404
    assert api_error(excinfo) == {
        "error": f"Recurring run {created.recurring_run_id} not found",
        "code": 5,
        "message": f"Recurring run {created.recurring_run_id} not found",
        "details": [],
    }
    assert server.errors == []


def test_injected_failures(server: FakeKfp, client: kfp.Client, uploaded: tuple[str, str]) -> None:
    pipeline_id, version_id = uploaded
    run = client.run_pipeline(
        client.create_experiment("e").experiment_id, "r", pipeline_id=pipeline_id, version_id=version_id
    )
    server.fail_next("GET", r"/runs/", status=503, times=2)
    for _ in range(2):
        with pytest.raises(kfp_server_api.ApiException) as excinfo:
            client.get_run(run.run_id)
        assert excinfo.value.status == 503 and api_error(excinfo)["code"] == 14
    assert client.get_run(run.run_id).state == "RUNNING"
    # wait_for_run_completion retries nothing but a 401 after a first success.
    server.fail_next("GET", r"/runs/", status=500)
    with pytest.raises(kfp_server_api.ApiException):
        client.wait_for_run_completion(run.run_id, timeout=5, sleep_duration=0)
    assert server.errors == []


def test_bearer_token() -> None:
    with FakeKfp(require_token="abc") as server:
        status, answer = raw(server, "GET", "/apis/v2beta1/healthz")
        assert status == 401 and answer["code"] == 16
        status, _ = raw(server, "GET", "/apis/v2beta1/healthz", Authorization="Bearer wrong")
        assert status == 401
        client = server.client()  # passes existing_token="abc"
        assert client.create_experiment("e").display_name == "e"
        assert all(r.headers.get("authorization") == "Bearer abc" for r in server.requests[2:])
        server.require_token = "rotated"
        with pytest.raises(kfp_server_api.ApiException) as excinfo:
            client.get_experiment(experiment_name="e")
        assert excinfo.value.status == 401
        assert server.errors == []


# ------------------------------------------------------------------------------------------------ rejected


def run_body(pipeline_id: str, version_id: str, **extra: Any) -> dict[str, Any]:
    reference = {"pipeline_id": pipeline_id, "pipeline_version_id": version_id}
    return {
        "display_name": "raw",
        "pipeline_version_reference": reference,
        "runtime_config": {"parameters": {}},
        **extra,
    }


def test_rejects_unknown_fields_in_a_run(server: FakeKfp, uploaded: tuple[str, str]) -> None:
    status, answer = raw(server, "POST", "/apis/v2beta1/runs", run_body(*uploaded, pipelineVersionReference={}))
    assert status == 400 and answer["code"] == 3 and "pipelineVersionReference: unknown field" in answer["message"]
    body = run_body(*uploaded)
    body["runtime_config"]["params"] = {"times": 1}
    status, answer = raw(server, "POST", "/apis/v2beta1/runs", body)
    assert status == 400 and "$.runtime_config.params: unknown field of V2beta1RuntimeConfig" in answer["message"]
    status, answer = raw(server, "POST", "/apis/v2beta1/runs", run_body(*uploaded, state="DONE"))
    assert status == 400 and "'DONE' is not a V2beta1RuntimeState" in answer["message"]
    assert len(server.errors) == 3 and not server.runs
    status, _ = raw(server, "POST", "/apis/v2beta1/runs", run_body(*uploaded))
    assert status == 200 and len(server.runs) == 1


def test_rejects_bad_recurring_runs(server: FakeKfp, uploaded: tuple[str, str]) -> None:
    def create(**fields: Any) -> tuple[int, Any]:
        body = run_body(
            *uploaded, trigger={"cron_schedule": {"cron": "0 0 2 * * *"}}, max_concurrency="1", mode="ENABLE"
        )
        return raw(server, "POST", "/apis/v2beta1/recurringruns", {**body, **fields})

    assert create()[0] == 200  # max_concurrency as a decimal string is valid int64 JSON
    assert create(max_concurrency="one")[0] == 400
    assert create(max_concurrency=11)[0] == 400
    assert create(mode="ON")[0] == 400
    assert create(trigger={"cron_schedule": {"cron": "0 61 2 * * *"}})[0] == 400
    assert create(trigger={"cron_schedule": {"cron": "0 0 2 * * *", "timezone": "UTC"}})[0] == 400
    assert create(trigger={})[0] == 400
    assert len(server.recurring_runs) == 1 and len(server.errors) == 6


def test_rejects_bad_filters(server: FakeKfp, client: kfp.Client) -> None:
    bad = [
        "not json",
        json.dumps({"predicates": [{"operation": "LIKE", "key": "display_name", "stringValue": "x"}]}),
        json.dumps({"predicates": [{"operation": 4, "key": "display_name", "stringValue": "x"}]}),
        json.dumps({"predicates": [{"operation": "EQUALS", "key": "colour", "stringValue": "x"}]}),
        json.dumps({"predicates": [{"operation": "EQUALS", "key": "display_name"}]}),
        json.dumps({"predicates": [{"operation": "EQUALS", "key": "display_name", "stringValue": "x", "intValue": 1}]}),
        json.dumps({"predicates": [{"operation": "EQUALS", "key": "display_name", "string_value": 7}]}),
        json.dumps({"predicates": [{"operation": "GREATER_THAN", "key": "display_name", "stringValue": "x"}]}),
        json.dumps({"predicates": [{"op": "EQUALS", "key": "display_name", "stringValue": "x"}]}),
        json.dumps({"predicate": []}),
    ]
    for text in bad:
        with pytest.raises(kfp_server_api.ApiException) as excinfo:
            client.list_runs(filter=text)
        assert excinfo.value.status == 400, text
    assert len(server.errors) == len(bad)


def test_rejects_a_file_that_is_not_a_pipeline(server: FakeKfp, client: kfp.Client, tmp_path: Path) -> None:
    for name, content in [
        ("config.yaml", b"learning_rate: 0.001\nsteps: 10\n"),
        ("binary.yaml", b"\x00\xff\xfe not yaml"),
        ("component.yaml", yaml.safe_dump({"pipelineInfo": {"name": "x"}, "root": {"dag": {"tasks": {}}}}).encode()),
        (
            "typo.yaml",
            yaml.safe_dump({"pipelineInfo": {"name": "x"}, "root": {}, "schemaVersion": "2.1.0", "rooot": {}}).encode(),
        ),
    ]:
        path = tmp_path / name
        path.write_bytes(content)
        with pytest.raises(kfp_server_api.ApiException) as excinfo:
            client.upload_pipeline(str(path), pipeline_name=name)
        assert excinfo.value.status == 400, name
    assert not server.pipelines and len(server.errors) == 4


def test_rejects_a_missing_pipeline_version(server: FakeKfp, client: kfp.Client, uploaded: tuple[str, str]) -> None:
    pipeline_id, version_id = uploaded
    experiment_id = client.create_experiment("e").experiment_id
    for pipeline, version in [(pipeline_id, "missing"), ("missing", version_id)]:
        with pytest.raises(kfp_server_api.ApiException) as excinfo:
            client.run_pipeline(experiment_id, "r", pipeline_id=pipeline, version_id=version)
        assert excinfo.value.status == 404 and api_error(excinfo)["code"] == 5
    with pytest.raises(kfp_server_api.ApiException) as excinfo:
        client.run_pipeline("missing", "r", pipeline_id=pipeline_id, version_id=version_id)
    assert excinfo.value.status == 404
    assert server.errors == []  # not-found is an answer, not a malformed request
    status, answer = raw(server, "POST", "/apis/v2beta1/runs", {"display_name": "no source"})
    assert status == 400 and "exactly one of pipeline_version_reference" in answer["message"]
    assert not server.runs and len(server.errors) == 1


def test_rejects_parameters_the_pipeline_does_not_take(
    server: FakeKfp, client: kfp.Client, uploaded: tuple[str, str]
) -> None:
    pipeline_id, version_id = uploaded
    experiment_id = client.create_experiment("e").experiment_id
    for params in [{"times": "3"}, {"verbose": 1}, {"epochs": 3}]:
        with pytest.raises(kfp_server_api.ApiException) as excinfo:
            client.run_pipeline(experiment_id, "r", pipeline_id=pipeline_id, version_id=version_id, params=params)
        assert excinfo.value.status == 400 and "invalid pipeline job inputs" in excinfo.value.body, params
    assert len(server.errors) == 3 and not server.runs
    # validatePipelineJobInputs asks an integer input for a number, not an integral one
    client.run_pipeline(experiment_id, "r", pipeline_id=pipeline_id, version_id=version_id, params={"times": 2.5})
    assert len(server.runs) == 1


def test_rejects_unknown_routes_and_query_parameters(server: FakeKfp) -> None:
    assert raw(server, "GET", "/apis/v1beta1/runs")[0] == 404
    assert raw(server, "PUT", "/apis/v2beta1/runs")[0] == 405
    assert raw(server, "GET", "/apis/v2beta1/runs?pageSize=3")[0] == 400
    assert raw(server, "GET", "/apis/v2beta1/runs?page_size=many")[0] == 400
    assert raw(server, "GET", "/apis/v2beta1/runs?sort_by=colour")[0] == 400
    assert len(server.errors) == 5


def test_schema_violations() -> None:
    assert schema_violations({"max_concurrency": 5}, "V2beta1RecurringRun") == []
    assert schema_violations({"max_concurrency": "5"}, "V2beta1RecurringRun") == []
    assert schema_violations({"max_concurrency": 5.5}, "V2beta1RecurringRun") != []
    assert schema_violations({"display_name": 5}, "V2beta1RecurringRun") != []  # a string field takes no number
    assert schema_violations({"created_at": "2024-05-01T10:00:00Z"}, "V2beta1Run") == []
    assert schema_violations({"created_at": "2024-05-01 10:00"}, "V2beta1Run") != []
    assert schema_violations({"pipeline_spec": []}, "V2beta1Run") != []
    assert schema_violations({"runtime_config": {"parameters": {"a": [1, {"b": None}]}}}, "V2beta1Run") == []
    assert schema_violations({"trigger": {"periodic_schedule": {"interval_second": "60"}}}, "V2beta1RecurringRun") == []
