"""Watching a run live: TensorBoard event files under <run>/tensorboard/ and, given a tracking URI, one MLflow run.

Rank 0 feeds both from the rows it writes to metrics.jsonl (one chart per field, the same names in both), and
neither holds up a step: tensorboard's writer queues its events for a thread that writes them to the volume, and
MLflow's points go through a bounded queue to a thread of ours (MlflowFeed) that sends them in batches, retries a
few times, and drops and counts what a slow or absent server cannot take. The MLflow run is found again by its
tag on a resume, so a run keeps one MLflow run however often it restarts.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

log = logging.getLogger(__name__)

# metrics.jsonl's fields -> their charts (TensorBoard tags and MLflow metric keys alike).
CHARTS = {
    "loss": "train/loss",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "tokens": "train/tokens_seen",
    "skipped_steps": "train/skipped_steps",
    "tokens_per_s": "throughput/tokens_per_s",
    "mfu": "throughput/mfu",
    "step_time_s": "throughput/step_time_s",
    "input_wait_s": "waits/input_s",
    "sync_wait_s": "waits/sync_s",
    "checkpoint_stall_s": "waits/checkpoint_stall_s",
    "gpu_mem_gib": "memory/gpu_allocated_gib",
    "gpu_reserved_gib": "memory/gpu_reserved_gib",
    "rss_gib": "memory/host_rss_gib",
    "val_loss": "eval/val_loss",
    "val_bpb": "eval/bits_per_byte",
}
RUN_TAG = "hyperpod_pretrain.run_dir"  # the MLflow run's tag that names the training run it records
# MLflow 3's UI shows an experiment by its kind, this tag's value (server/js: ExperimentKind; the onboarding skill,
# mlflow/assistant/skills/mlflow-onboarding/SKILL.md): "genai_development" for traces, "custom_model_development"
# for model training. Without it the UI guesses, and may open the experiment in its GenAI view.
EXPERIMENT_KIND = {"mlflow.experimentKind": "custom_model_development"}
ENDED = ("FINISHED", "FAILED", "KILLED")  # MLflow's RunStatus values of a run that has ended
ARN = re.compile(r"arn:aws(-us-gov)?:sagemaker:[a-z0-9-]+:\d{12}:(mlflow-tracking-server|mlflow-app)/[A-Za-z0-9-]+")
PLUGIN_EXTRA = "pip install 'hyperpod-pretrain[sagemaker-mlflow]' (the trainer image has it)"


def check_tracking_uri(uri: str) -> str:
    """An MLflow tracking URI as given (empty: none), or ValueError saying what is wrong with it. Credentials go in
    the environment (MLFLOW_TRACKING_TOKEN, or the pod's IAM role for SageMaker), never in the URI, which shows in
    the KFP UI and the logs."""
    if not uri or ARN.fullmatch(uri):
        return uri
    if uri.startswith("arn:"):
        raise ValueError(
            f"{uri!r} is not a SageMaker MLflow ARN (arn:aws:sagemaker:<region>:<account>:"
            "mlflow-tracking-server/<name> or ...:mlflow-app/<id>)"
        )
    parts = urlsplit(uri)
    if "@" in parts.netloc:  # said without the URI: it would repeat them
        raise ValueError(
            "the tracking URI holds credentials, which would show in the KFP UI and the logs: give the "
            "URL without them and the token in the pod's environment (MLFLOW_TRACKING_TOKEN)"
        )
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(
            f"{uri!r} is neither an http(s):// URL of an MLflow tracking server nor a SageMaker MLflow ARN"
        )
    if parts.query or parts.fragment:
        raise ValueError(f"{uri!r} has a query or fragment: give the tracking server's base URL")
    return uri


def preload_mlflow() -> None:
    """Import MLflow's client in a thread now, while the run starts: the import takes seconds, and the feed's first
    batch waits for it."""
    threading.Thread(target=_import_quietly, args=("mlflow.tracking",), name="mlflow-import", daemon=True).start()


def _import_quietly(name: str) -> None:
    try:
        __import__(name)
    except ImportError:  # the feed says so when it needs it
        pass


def check_plugin(uri: str) -> None:
    """A SageMaker ARN needs the sagemaker-mlflow plugin: ImportError naming the extra where it is missing."""
    if uri.startswith("arn:"):
        try:
            import sagemaker_mlflow  # noqa: F401
        except ImportError:
            raise ImportError(
                f"the MLflow tracking URI is a SageMaker ARN and the sagemaker-mlflow plugin is not "
                f"installed: {PLUGIN_EXTRA}"
            ) from None


def flatten(settings: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """config.json's leaves by dotted name (nested keys joined with dots)."""
    flat: dict[str, Any] = {}
    for key, value in settings.items():
        if isinstance(value, Mapping):
            flat |= flatten(value, f"{prefix}{key}.")
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def flat_params(settings: Mapping[str, Any]) -> dict[str, str]:
    """config.json as MLflow params: values as text, lists as JSON, none left out."""
    return {
        k: json.dumps(v) if isinstance(v, list | tuple) else str(v)
        for k, v in flatten(settings).items()
        if v is not None
    }


def chart_points(row: Mapping[str, Any]) -> dict[str, float]:
    """A metrics row's numbers, by chart (fields with no number, such as a CPU's MFU, left out); a mixture's datasets'
    figures (tokens, epochs, val loss and bits per byte) under data/<dataset>/."""
    points = {chart: float(row[name]) for name, chart in CHARTS.items() if isinstance(row.get(name), int | float)}
    for dataset, figures in (row.get("datasets") or {}).items():
        points |= {
            f"data/{dataset}/{name}": float(value) for name, value in figures.items() if isinstance(value, int | float)
        }
    return points


def mlflow_client(uri: str, request_timeout_s: float) -> Any:
    """MLflow's client of `uri`, imported here (seconds). Its own retries are cut to ours: its default is 7 retries
    with exponential backoff, minutes against a server that is down."""
    check_plugin(uri)
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(int(request_timeout_s)))
    # set_terminated prints the run's URL to stdout (after one more request for it): our log says where it is
    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
    import mlflow
    from mlflow.tracking import MlflowClient

    # sagemaker-mlflow 0.5.0's request header provider parses mlflow's global tracking URI as an ARN on every request,
    # whatever the client's own URI (mlflow_sagemaker_request_header_provider.py, request_headers): it needs the global
    # set to the ARN, and with any other URI it fails and mlflow warns on every request (mlflow/tracking/
    # request_header/registry.py, resolve_request_headers). One tracking server per process: set it.
    mlflow.set_tracking_uri(uri)
    if not uri.startswith("arn:"):
        logging.getLogger("mlflow.tracking.request_header.registry").setLevel(logging.ERROR)
    return MlflowClient(uri)


def probe(uri: str, experiment: str, timeout_s: float = 10.0) -> str:
    """Whether the tracking server answers (the preflight's check): "" if it does, whether or not the experiment
    exists yet; else why not, in one line."""
    said: list[str] = []

    def ask() -> None:
        try:
            mlflow_client(uri, timeout_s).get_experiment_by_name(experiment)
            said.append("")
        except Exception as exc:  # unreachable, refused, not an MLflow server, the plugin missing
            said.append(one_line(exc))

    asking = threading.Thread(target=ask, name="mlflow-probe", daemon=True)
    asking.start()
    asking.join(timeout_s + 20)  # the import takes seconds
    return said[0] if said else f"no answer within {timeout_s + 20:.0f}s"


def one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


@dataclass
class Point:
    key: str
    value: float
    step: int
    wall_time: float


@dataclass
class FeedReport:
    """What the MLflow feed did, said once at the end."""

    sent: int = 0
    unsent: int = 0
    reasons: list[str] = field(default_factory=list)


class MlflowFeed:
    """One MLflow run per training run (found by its RUN_TAG, made on the first start), fed from a thread.

    `put` never blocks: a full queue drops the point and counts it. The thread sends what `flush_s` gathers, up to
    1,000 points (MLflow's log_batch limit), with `attempts` tries each; a batch that fails them all is dropped and
    counted. The first failure is logged as a warning, the count at the end (`close`)."""

    BATCH = 1000

    def __init__(
        self,
        uri: str,
        experiment: str,
        run_dir: Path,
        run_name: str,
        params: Mapping[str, str],
        step: int = 0,
        queue_size: int = 50_000,
        attempts: int = 3,
        request_timeout_s: float = 10.0,
        flush_s: float = 2.0,
    ):
        self.uri, self.experiment, self.run_dir, self.run_name, self.step = uri, experiment, run_dir, run_name, step
        self.params, self.attempts, self.request_timeout_s = dict(params), attempts, request_timeout_s
        self.flush_s = flush_s
        self.points: queue.Queue[Point | tuple[str, str] | None] = queue.Queue(maxsize=queue_size)
        self.report = FeedReport()
        self.run_id: str | None = None
        self.url: str | None = None
        self._warned = self._down = False
        self._in_flight = 0
        self._thread = threading.Thread(target=self._run, name="mlflow-feed", daemon=True)
        self._thread.start()

    def put(self, points: Iterable[Point]) -> None:
        for point in points:
            self._enqueue(point)

    def tag(self, key: str, value: str) -> None:
        self._enqueue((key, value))

    def _enqueue(self, item: Point | tuple[str, str]) -> None:
        try:
            self.points.put_nowait(item)
        except queue.Full:
            self.report.unsent += 1

    def close(self, timeout_s: float) -> FeedReport:
        """Send what is queued within timeout_s, then say once what was not sent."""
        deadline = time.monotonic() + timeout_s
        try:
            self.points.put(None, timeout=timeout_s)
        except queue.Full:
            pass
        self._thread.join(max(deadline - time.monotonic(), 0.0))
        left = sum(1 for item in list(self.points.queue) if isinstance(item, Point))
        if self._thread.is_alive():  # out of time: the batch being sent counts as not sent (it may still land)
            left += self._in_flight
        self.report.unsent += left
        if self.report.unsent:
            log.warning(
                "MLflow: %d metric points of this run were not sent to %s (%s); metrics.jsonl and the "
                "TensorBoard files have them all",
                self.report.unsent,
                self.uri,
                "; ".join(self.report.reasons[:3]) or "the server was still busy at the end",
            )
        return FeedReport(self.report.sent, self.report.unsent, list(self.report.reasons))

    # -- the thread ----------------------------------------------------------------------------------------------
    def _open_run(self, client: Any) -> None:
        """The MLflow run of this training run: found by its tag (a resume, a restart), else made."""
        experiment = client.get_experiment_by_name(self.experiment)
        if experiment is None:  # made with the kind of MLflow experiment it is
            experiment_id = client.create_experiment(self.experiment, tags=EXPERIMENT_KIND)
        else:
            experiment_id = experiment.experiment_id
        found = client.search_runs([experiment_id], filter_string=f"tags.`{RUN_TAG}` = '{self.run_dir}'", max_results=1)
        if found:
            run = found[0]
            old = run.data.params
            changed = {k: (old[k], v) for k, v in self.params.items() if k in old and old[k] != v}
            new = {k: v for k, v in self.params.items() if k not in old}
            log.info("MLflow: continuing run %s (%s)", run.info.run_id, self._url(experiment_id, run.info.run_id))
            if run.info.status != "RUNNING":  # ended by an earlier pipeline run's summary: it trains again
                client.update_run(run.info.run_id, status="RUNNING")
                log.info("MLflow: run %s was %s: running again", run.info.run_id, run.info.status)
            if changed:  # params cannot change in MLflow: the new values go in a tag
                text = "; ".join(f"{k}: {a} -> {b}" for k, (a, b) in sorted(changed.items()))
                client.set_tag(run.info.run_id, f"params_changed_at_step_{self.step}", text[:5000])
        else:
            tags = {RUN_TAG: str(self.run_dir), "hyperpod_pretrain.run_id": self.run_name}
            run = client.create_run(experiment_id, run_name=self.run_name, tags=tags)
            new = self.params
            log.info(
                "MLflow: run %s in experiment %r (%s)",
                run.info.run_id,
                self.experiment,
                self._url(experiment_id, run.info.run_id),
            )
        from mlflow.entities import Param

        items = [Param(k, v[:6000]) for k, v in sorted(new.items())]
        for start in range(0, len(items), 100):  # log_batch takes 100 params at most
            client.log_batch(run.info.run_id, params=items[start : start + 100])
        self.run_id, self.url = run.info.run_id, self._url(experiment_id, run.info.run_id)

    def _url(self, experiment_id: str, run_id: str) -> str:
        """The run's page in MLflow's UI (an ARN's UI opens from SageMaker Studio: its ARN and run id then)."""
        if self.uri.startswith("arn:"):
            return f"{self.uri} run {run_id}"
        return f"{self.uri.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}"

    def _next_batch(self) -> tuple[list[Point | tuple[str, str]], bool]:
        """What arrives within flush_s of the first item, up to BATCH: a request every few seconds, not one a row (a
        request costs the trainer's process ~3 ms of CPU and the server ~10 ms). True once the feed is closing."""
        batch: list[Point | tuple[str, str]] = []
        item = self.points.get()
        deadline = time.monotonic() + self.flush_s
        while item is not None:
            batch.append(item)
            if len(batch) >= self.BATCH:
                return batch, False
            try:
                item = self.points.get(timeout=max(deadline - time.monotonic(), 0.0))
            except queue.Empty:
                return batch, False
        return batch, True

    def _failed(self, exc: BaseException) -> None:
        """The first failure as a warning; each kind of reason once, for the count said at the end."""
        reason = one_line(exc)
        if not self._warned:
            log.warning(
                "MLflow: could not send to %s (%s); training goes on, retrying a few times per batch and "
                "counting what is dropped",
                self.uri,
                reason,
            )
            self._warned = True
        if reason not in self.report.reasons:
            self.report.reasons.append(reason)

    def _run(self) -> None:
        client = None
        try:  # the run at once, so that its link is known before the first batch (else: with the first batch)
            client = mlflow_client(self.uri, self.request_timeout_s)
            self._open_run(client)
        except Exception as exc:  # a server down, refusing or slow: never the training's problem
            self._failed(exc)
        finished = False
        while not finished:
            batch, finished = self._next_batch()
            if not batch:
                continue
            points = [p for p in batch if isinstance(p, Point)]
            tags = [p for p in batch if isinstance(p, tuple)]
            self._in_flight = len(points)
            attempts = 1 if self._down else self.attempts  # a server found down gets one try a batch until it answers
            for attempt in range(attempts):
                try:
                    client = client or mlflow_client(self.uri, self.request_timeout_s)
                    if self.run_id is None:
                        self._open_run(client)
                    from mlflow.entities import Metric, RunTag

                    client.log_batch(
                        self.run_id,
                        tags=[RunTag(k, v) for k, v in tags],
                        metrics=[Metric(p.key, p.value, int(p.wall_time * 1000), p.step) for p in points],
                    )
                    self.report.sent += len(points)
                    self._down = False
                    break
                except Exception as exc:  # a server down, refusing or slow: never the training's problem
                    self._failed(exc)
                    if isinstance(exc, ImportError):
                        self.report.unsent += len(points)
                        break
                    if attempt + 1 < attempts:
                        time.sleep(min(2.0**attempt, 4.0))
            else:
                self.report.unsent += len(points)
                self._down = True
            self._in_flight = 0


class RunWatch:
    """Rank 0's TensorBoard writer and MLflow feed, as the training loop sees them; on other ranks (`off`) each
    method does nothing. A context manager: leaving it closes both (briefly, after an error)."""

    def __init__(self, events: Any = None, feed: MlflowFeed | None = None, record: Path | None = None):
        self.events, self.feed, self.record = events, feed, record
        self._saved_step: int | None = None
        self._recorded = False

    @classmethod
    def off(cls) -> RunWatch:
        return cls()

    @classmethod
    def start(
        cls,
        tensorboard_dir: Path | None,
        mlflow_record: Path,
        step: int,
        settings: Mapping[str, Any],
        tracking_uri: str = "",
        experiment: str = "",
        run_name: str = "",
    ) -> RunWatch:
        """At `step` (0: a new run; else the step resumed from, past which TensorBoard drops what this directory
        holds: a crash after the last checkpoint logged steps that are trained again). `settings`: config.json."""
        events = None
        if tensorboard_dir is not None:
            from torch.utils.tensorboard import SummaryWriter
            from torch.utils.tensorboard.summary import hparams

            # purge_step writes a SessionLog START at that step: readers drop the older events at or past it.
            events = SummaryWriter(
                str(tensorboard_dir), purge_step=step + 1 if step else None, max_queue=1000, flush_secs=10
            )
            events.add_text("settings", settings_table(flat_params(settings)), step)
            hparam_values = {k: v for k, v in flatten(settings).items() if isinstance(v, bool | int | float | str)}
            for summary in hparams(hparam_values, {"train/loss": 0.0, "eval/val_loss": 0.0}):
                events.file_writer.add_summary(summary, step)
        feed = None
        if tracking_uri:
            feed = MlflowFeed(tracking_uri, experiment, mlflow_record.parent, run_name, flat_params(settings), step)
        return cls(events, feed, mlflow_record)

    def row(self, row: Mapping[str, Any]) -> None:
        """A metrics.jsonl row: its numbers at its step."""
        points = chart_points(row)
        step, wall = int(row["step"]), float(row.get("time", time.time()))
        if self.events is not None:
            for chart, value in points.items():
                self.events.add_scalar(chart, value, step, wall)
        if self.feed is not None:
            self.feed.put(Point(chart, value, step, wall) for chart, value in points.items())
            self._record_mlflow_run()

    def saved(self, report: Any) -> None:
        """A committed checkpoint (trainer/checkpoint.py SaveReport), once each: its size and seconds."""
        if report is None or report.step == self._saved_step:
            return
        self._saved_step = report.step
        points = {"checkpoint/size_gib": report.total_bytes / 2**30, "checkpoint/seconds": report.seconds}
        if self.events is not None:
            for chart, value in points.items():
                self.events.add_scalar(chart, value, report.step)
        if self.feed is not None:
            self.feed.put(Point(chart, value, report.step, time.time()) for chart, value in points.items())

    def note(self, step: int, kind: str, text: str) -> None:
        """A start (or resume, restart) or a stop: a text event, and the MLflow run's tag of that step and kind (a
        stop and the resume after it share their step)."""
        if self.events is not None:
            self.events.add_text("events", text, step)
        if self.feed is not None:
            self.feed.tag(f"event.step_{step:08d}.{kind}", text[:5000])

    def _record_mlflow_run(self) -> None:
        """<run>/mlflow.json, once the feed has its run: for `runs`, the summary and the evaluation step."""
        if self._recorded or self.feed is None or self.feed.run_id is None or self.record is None:
            return
        from trainer.atomic import write_json

        write_json(
            self.record,
            {
                "tracking_uri": self.feed.uri,
                "experiment": self.feed.experiment,
                "run_id": self.feed.run_id,
                "url": self.feed.url,
            },
        )
        self._recorded = True

    def close(self, timeout_s: float) -> None:
        if self.events is not None:
            self.events.close()
            self.events = None
        if self.feed is not None:
            self.feed.close(timeout_s)
            self._record_mlflow_run()
            self.feed = None

    def __enter__(self) -> RunWatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(timeout_s=2.0)


def settings_table(flat: Mapping[str, str]) -> str:
    """The run's settings as a Markdown table for TensorBoard's text tab."""
    return "| setting | value |\n|---|---|\n" + "\n".join(f"| {k} | {v.replace('|', '/')} |" for k, v in flat.items())


def record_outcome(
    run_dir: Path,
    step: int | None,
    values: Mapping[str, float],
    files: Iterable[Path],
    tags: Mapping[str, str],
    artifact_path: str,
    timeout_s: float = 60.0,
) -> None:
    """A step after training (the evaluation, the run's summary) adds to the run's charts: `values` at `step` in
    TensorBoard's files of <run_dir>/tensorboard/, and to the run's MLflow run (<run_dir>/mlflow.json, when it has one)
    those values, `files` as artifacts under `artifact_path` and `tags`. A server that fails is a warning: the step's
    own files hold it all."""
    if step is not None and values:
        from torch.utils.tensorboard import SummaryWriter

        with SummaryWriter(str(run_dir / "tensorboard"), filename_suffix=f".{artifact_path}") as events:
            for chart, value in values.items():
                events.add_scalar(chart, value, step)

    def send(client: Any, run_id: str) -> None:
        from mlflow.entities import Metric, RunTag

        now = int(time.time() * 1000)
        client.log_batch(
            run_id,
            tags=[RunTag(k, v[:5000]) for k, v in tags.items()],
            metrics=[Metric(k, v, now, step or 0) for k, v in values.items() if step is not None],
        )
        for path in files:
            if path.is_file():
                client.log_artifact(run_id, str(path), artifact_path)

    failed = with_mlflow_run(run_dir, send, "mlflow-outcome", timeout_s)
    if failed:
        log.warning(
            "MLflow: the %s of run %s was not recorded there (%s); its files on the volume have it",
            artifact_path,
            run_dir.name,
            failed,
        )


def with_mlflow_run(run_dir: Path, work: Callable[[Any, str], None], name: str, timeout_s: float) -> str | None:
    """Run `work(client, run id)` against the run's MLflow run (<run_dir>/mlflow.json) in a thread, waited for at
    most `timeout_s`: None when the run has no MLflow run, "" when the work was done, else why not in one line (an
    unreachable or refusing server is never the calling step's failure)."""
    record = run_dir / "mlflow.json"
    if not record.exists():
        return None
    said: list[str] = []

    def send() -> None:
        try:
            mlflow_run = json.loads(record.read_text())
            work(mlflow_client(mlflow_run["tracking_uri"], min(timeout_s, 30.0)), mlflow_run["run_id"])
            said.append("")
        except Exception as exc:  # unreachable, refused, an unreadable record, a record of another server
            said.append(one_line(exc))

    sending = threading.Thread(target=send, name=name, daemon=True)
    sending.start()
    sending.join(timeout_s)
    return said[0] if said else f"no answer within {timeout_s:.0f}s"


def end_run(run_dir: Path, status: str, timeout_s: float = 60.0, attempts: int = 3) -> str:
    """End the run's MLflow run (<run_dir>/mlflow.json, when it has one) as `status` (FINISHED, FAILED or KILLED) at
    this time: only the pipeline's exit step knows how the run ended (the trainer does not: a step after it may fail,
    and a resume reopens the run). Transient errors are tried `attempts` times; a server that fails is a warning,
    never the step's failure. Returns what happened, in a few words ("" when there is no MLflow run)."""
    if status not in ENDED:
        raise ValueError(f"MLflow run status {status!r} is not one of {', '.join(ENDED)}")

    def send(client: Any, run_id: str) -> None:
        for attempt in range(attempts):
            try:
                client.set_terminated(run_id, status)
                return
            except Exception as exc:
                if attempt + 1 == attempts or not transient(exc):
                    raise
                time.sleep(min(2.0**attempt, 4.0))

    failed = with_mlflow_run(run_dir, send, "mlflow-end", timeout_s)
    if failed is None:
        return ""
    if not failed:
        log.info("MLflow: the run of %s ended %s", run_dir.name, status)
        return f"ended {status}"
    log.warning("MLflow: the run of %s was not ended %s (%s); it shows as running there", run_dir.name, status, failed)
    return f"not ended: {failed}"


def transient(exc: BaseException) -> bool:
    """Whether an MLflow request that failed may succeed if sent again: no answer, a 5xx or a 429 (MLflow's client
    says a connection refused or timed out as an MlflowException of status 500); not a refusal of the request."""
    from mlflow.exceptions import MlflowException

    if isinstance(exc, MlflowException):
        return exc.get_http_status_code() >= 500 or exc.get_http_status_code() == 429
    return isinstance(exc, OSError)


def where_to_look(run_dir: Path) -> dict[str, str]:
    """Where a run can be watched: its TensorBoard directory and the command that opens it, and its MLflow run."""
    found: dict[str, str] = {}
    if (run_dir / "tensorboard").is_dir():
        found["tensorboard"] = str(run_dir / "tensorboard")
        found["tensorboard_command"] = f"tensorboard --logdir {run_dir / 'tensorboard'}"
    try:
        mlflow_run = json.loads((run_dir / "mlflow.json").read_text())
        found |= {"mlflow_run_id": str(mlflow_run["run_id"]), "mlflow_url": str(mlflow_run["url"])}
    except (OSError, ValueError, KeyError, TypeError):  # none, or not readable: nothing to point at
        pass
    return found


def watch_line(found: Mapping[str, str]) -> str:
    """where_to_look's findings as one line of Markdown ("" when there are none)."""
    parts = [f"TensorBoard: `{found['tensorboard_command']}`"] if "tensorboard_command" in found else []
    parts += [f"MLflow run [{found['mlflow_run_id']}]({found['mlflow_url']})"] if "mlflow_url" in found else []
    return "Watch: " + "; ".join(parts) + "." if parts else ""
