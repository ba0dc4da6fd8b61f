"""trainer/tracking.py in-process: the tracking URI's checks, config.json as params, and the MLflow feed against a
real tracking server (tests/mlflow_server.py) that is slow or gone. The trainer's own runs watched in TensorBoard and
MLflow are in tests/test_trainer.py (a SIGTERM and resume; a server gone midway; a resume that drops logged steps)."""

from __future__ import annotations

import logging
import re
import sys
import time
from pathlib import Path

import pytest

from tests.browser import needs_chromium
from tests.mlflow_server import Relay
from trainer.config import parse_config
from trainer.tracking import RUN_TAG, MlflowFeed, Point, check_tracking_uri, flat_params


@pytest.mark.parametrize(
    "uri",
    [
        "",
        "http://mlflow.kubeflow.svc.cluster.local:5000",
        "https://mlflow.example.com/tracking/",
        "arn:aws:sagemaker:us-east-1:123456789012:mlflow-tracking-server/team-a",
        "arn:aws-us-gov:sagemaker:us-gov-west-1:123456789012:mlflow-app/app-3x4mpl3",
    ],
)
def test_tracking_uris_that_are_taken(uri: str) -> None:
    assert check_tracking_uri(uri) == uri


@pytest.mark.parametrize(
    "uri,said",
    [
        ("mlflow:5000", "is neither an http(s):// URL"),
        ("file:///fsx/mlruns", "is neither an http(s):// URL"),
        ("http://", "is neither an http(s):// URL"),
        ("http://mlflow:5000/?token=abc", "has a query or fragment"),
        ("arn:aws:s3:::my-bucket", "is not a SageMaker MLflow ARN"),
        ("arn:aws:sagemaker:us-east-1:123456789012:endpoint/x", "is not a SageMaker MLflow ARN"),
    ],
)
def test_a_malformed_tracking_uri_is_one_line_naming_it(uri: str, said: str) -> None:
    with pytest.raises(ValueError, match=re.escape(said)) as refused:
        check_tracking_uri(uri)
    assert "\n" not in str(refused.value) and repr(uri) in str(refused.value)


def test_credentials_in_the_uri_are_refused_without_repeating_them(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as refused:
        parse_config(
            ["--data-dir", "d", "--run-dir", "r", "--mlflow-tracking-uri", "https://ci:s3cret@mlflow:5000"], environ={}
        )
    assert refused.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert "argument --mlflow-tracking-uri: the tracking URI holds credentials" in error
    assert "MLFLOW_TRACKING_TOKEN" in error and "s3cret" not in error


def test_config_json_becomes_params_by_dotted_name() -> None:
    settings = {
        "trainer": {"lr": 0.003, "init_from": "", "mlflow_tracking_uri": "http://m:5000"},
        "world_size": 16,
        "model": {"n_layer": 4, "rope_scaling": None},
        "dataset": {"files": ["a.txt", "b.txt"]},
    }
    assert flat_params(settings) == {
        "trainer.lr": "0.003",
        "trainer.init_from": "",
        "trainer.mlflow_tracking_uri": "http://m:5000",
        "world_size": "16",
        "model.n_layer": "4",
        "dataset.files": '["a.txt", "b.txt"]',
    }


def test_an_arn_without_the_sagemaker_plugin_says_which_extra_to_install(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "sagemaker_mlflow", None)  # what an environment without the plugin imports
    arn = "arn:aws:sagemaker:us-east-1:123456789012:mlflow-tracking-server/team-a"
    with caplog.at_level(logging.WARNING, "trainer.tracking"):
        feed = MlflowFeed(arn, "exp", tmp_path, "run-1", {})
        feed.put([Point("train/loss", 1.0, 1, time.time())])
        report = feed.close(timeout_s=30)
    assert report.unsent == 1 and report.sent == 0
    assert "pip install 'hyperpod-pretrain[sagemaker-mlflow]'" in caplog.text
    assert "1 metric points of this run were not sent" in caplog.text


def test_a_slow_server_never_holds_up_put_and_the_queue_stays_bounded(mlflow_server, tmp_path: Path) -> None:
    """Every request answered 0.5 s late: 5,000 points put at once return at once; what the 100-point queue cannot
    hold is dropped and counted; the server gets the rest, at their steps."""
    from mlflow.tracking import MlflowClient

    relay = Relay(mlflow_server.port, delay_s=0.5)
    try:
        feed = MlflowFeed(relay.url, "slow", tmp_path / "slow-run", "slow-run", {"trainer.lr": "0.003"}, queue_size=100)
        started = time.perf_counter()
        feed.put(Point("train/loss", float(step), step, time.time()) for step in range(5000))
        put_s = time.perf_counter() - started
        assert put_s < 0.5, f"put took {put_s:.2f}s"
        assert feed.points.qsize() <= 100
        report = feed.close(timeout_s=60)
    finally:
        relay.stop()
    assert report.sent + report.unsent == 5000 and 100 <= report.sent <= 1100  # the queue, and what the feed took
    client = MlflowClient(mlflow_server.url)
    (run,) = client.search_runs(
        [client.get_experiment_by_name("slow").experiment_id],
        filter_string=f"tags.`{RUN_TAG}` = '{tmp_path / 'slow-run'}'",
    )
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")]
    assert run.data.params == {"trainer.lr": "0.003"} and len(steps) == report.sent and steps == sorted(steps)


@needs_chromium
def test_tensorboard_shows_a_runs_loss_chart_in_a_browser(uninterrupted, tmp_path: Path) -> None:
    """TensorBoard's own server on the uninterrupted run's event files (40 steps, every one logged), the page opened
    in headless Chromium: the loss chart is drawn with a point per logged step, and its table ends at step 40."""
    import json
    import struct

    from tests.tensorboard_view import TensorBoard, loss_chart

    rows = [json.loads(line) for line in uninterrupted.metrics.read_text().splitlines()]
    with TensorBoard(uninterrupted.tensorboard, tmp_path / "tensorboard.log") as board:
        chart = loss_chart(board.url, tmp_path / "shot.png", 1400, 900)
    assert chart.points == len(rows) == 40, chart
    assert f" {rows[-1]['loss']:.4f} 40 " in f" {chart.table} ", chart.table  # value and step of the last point
    header = (tmp_path / "shot.png").read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">II", header[16:24]) == (1400, 900)


def test_the_experiment_is_model_training_and_a_resume_reopens_an_ended_run(mlflow_server, tmp_path: Path) -> None:
    """The experiment the feed makes carries MLflow 3's kind tag for model training (its UI would otherwise guess,
    and may show it as a GenAI experiment); a run the pipeline's summary ended (tests/test_run_summary.py) is set
    running again when the trainer continues it."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(mlflow_server.url)
    feed = MlflowFeed(mlflow_server.url, "kind-and-resume", tmp_path / "run", "run", {"trainer.lr": "0.003"})
    feed.put([Point("train/loss", 2.0, 1, time.time())])
    assert feed.close(timeout_s=60).sent == 1
    experiment = client.get_experiment_by_name("kind-and-resume")
    assert experiment.tags.get("mlflow.experimentKind") == "custom_model_development"
    client.set_terminated(feed.run_id, "FINISHED")
    assert client.get_run(feed.run_id).info.status == "FINISHED"

    resumed = MlflowFeed(mlflow_server.url, "kind-and-resume", tmp_path / "run", "run", {"trainer.lr": "0.003"}, 1)
    resumed.put([Point("train/loss", 1.5, 2, time.time())])
    assert resumed.close(timeout_s=60).sent == 1
    assert resumed.run_id == feed.run_id and client.get_run(feed.run_id).info.status == "RUNNING"
    assert [m.step for m in client.get_metric_history(feed.run_id, "train/loss")] == [1, 2]
