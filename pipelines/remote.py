"""Submit and schedule the compiled pipeline on a Kubeflow Pipelines installation, through kfp.Client.

The pipeline is uploaded once per content: its versions are named <project version>-<sha256 of the compiled
file>, so submitting the same file again reuses its version and a changed file adds one. Parameters are given as
KEY=VALUE, typed by the pipeline's own input definitions (the v2 API wants JSON numbers, booleans, lists and
objects, not strings) and checked by the steps' own checks (pipelines/package.py), so a typo or a bad value fails
before anything is sent. So does a KFP backend older than MIN_KFP_BACKEND, when its healthz tells its version.

Auth is kfp.Client's: --host (or KF_PIPELINES_ENDPOINT) with the in-cluster service-account token when one is
mounted (KF_PIPELINES_SA_TOKEN_PATH, or kfp's default path), or, with no host, the in-cluster service or the
current kubeconfig context (kfp reaches the API through the Kubernetes API server's proxy).
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

import kfp
import kfp_server_api
import urllib3
import yaml

from common.errors import InputError, StepFailed
from pipelines import MIN_KFP_BACKEND, MIN_KFP_BACKEND_WHY
from pipelines.package import Package

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S, READ_TIMEOUT_S = 10, 120  # an upload of the compiled file takes well under a second
# Transient failures are retried with backoff: connection errors on any request, 429/5xx only on the idempotent
# methods (a POST that created a run and then failed must not create a second one).
RETRY = urllib3.Retry(
    total=4,
    connect=3,
    read=2,
    status=3,
    backoff_factor=1.0,
    status_forcelist=(429, 500, 502, 503, 504),
    raise_on_status=False,
)
FINISHED = ("SUCCEEDED", "FAILED", "CANCELED", "SKIPPED")
DEFAULT_SA_TOKEN = "/var/run/secrets/kubeflow/pipelines/token"  # where KFP mounts a pod's token

# A release's healthz tag_name is its tag (TAG_NAME of the image build, e.g. "2.14.0"); a build without one says
# "unknown" (kubeflow/pipelines#11573, seen on 2.4.0). A pre-release ("2.14.0-rc.1") counts as its release.
RELEASE_TAG = re.compile(r"v?(\d+)\.(\d+)\.(\d+)(?:[-+][0-9A-Za-z.+-]*)?")


class Client(kfp.Client):
    """kfp.Client with a timeout on every call and bounded retries of transient errors (kfp sets neither), which
    keeps the whole healthz answer: the backend's version is in it, but not in kfp's model of it."""

    def _load_config(self, *args: Any, **kwargs: Any) -> kfp_server_api.Configuration:
        config = super()._load_config(*args, **kwargs)
        config.retries = RETRY
        # Through a kubeconfig, kfp appends the API server's service-proxy path to the cluster's URL, but the
        # kubernetes client's token refresh hook (run before every request) sets the URL back to the cluster's,
        # and itself back as the hook: every call would miss the proxy. Put both back after it.
        refresh = config.refresh_api_key_hook
        if refresh is not None and config.host.endswith("/proxy/"):
            proxied = config.host

            def refresh_keeping_the_proxy(configuration: kfp_server_api.Configuration) -> None:
                refresh(configuration)
                configuration.host = proxied
                configuration.refresh_api_key_hook = refresh_keeping_the_proxy

            config.refresh_api_key_hook = refresh_keeping_the_proxy
        return config

    def __init__(self, **kwargs: Any) -> None:
        # kfp's constructor reads healthz itself (unless a namespace is given): its answer is kept here.
        self.healthz: dict[str, Any] | None = None
        self.healthz_problem = ""  # why healthz could not be read, when a proxy refused it
        self.backend_checked = False
        super().__init__(**kwargs)
        rest = self._run_api.api_client.rest_client  # shared by every API object of this client
        request = rest.request

        def request_with_timeout(*args: Any, _request_timeout: Any = None, **kw: Any) -> Any:
            return request(*args, _request_timeout=_request_timeout or (CONNECT_TIMEOUT_S, READ_TIMEOUT_S), **kw)

        rest.request = request_with_timeout

    def get_kfp_healthz(self, sleep_duration: int = 5) -> kfp_server_api.V2beta1GetHealthzResponse:
        """One call, with the timeout and the transport's retries (kfp's own tries 5 times, 5 s apart, unbounded).

        The answer is also kept whole in `healthz`. A 403 or 404 (a proxy that guards the path, not the API) gives an
        empty answer: the calls that follow say whether the API itself can be used.
        """
        try:
            response = self._healthz_api.healthz_service_get_healthz(
                _request_timeout=(CONNECT_TIMEOUT_S, READ_TIMEOUT_S), _preload_content=False
            )
        except kfp_server_api.ApiException as exc:
            if exc.status not in (403, 404):
                raise
            self.healthz, self.healthz_problem = {}, f"GET /apis/v2beta1/healthz answered {exc.status} {exc.reason}"
            return kfp_server_api.V2beta1GetHealthzResponse()
        answer = kfp_server_api.rest.RESTResponse(response)
        try:
            body = json.loads(answer.data)
        except ValueError:
            body = None
        self.healthz = body if isinstance(body, dict) else {}
        self.healthz_problem = "" if isinstance(body, dict) else "healthz did not answer a JSON object"
        return self._healthz_api.api_client.deserialize(answer, "V2beta1GetHealthzResponse")


def token_path(token_file: str = "") -> str:
    """The token a call to KFP carries: --token-file, else the pod's projected token (KFP's audience) when there."""
    return token_file or os.environ.get("KF_PIPELINES_SA_TOKEN_PATH", DEFAULT_SA_TOKEN)


def read_token(token_file: str) -> str:
    try:
        token = Path(token_file).read_text().strip()
    except OSError as exc:
        raise InputError(f"--token-file {token_file}: cannot be read ({exc.strerror})") from None
    if not token or any(c.isspace() for c in token):
        raise InputError(f"--token-file {token_file}: holds no bearer token (empty, or more than one word)")
    return token


def token_subject(path: str) -> str:
    """Whom a service-account token speaks for (its JWT's sub, read without verifying: the server verifies it), or
    "" when it is not a JWT; never the token itself."""
    try:
        payload = Path(path).read_text().strip().split(".")[1]
        return str(json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4))).get("sub", ""))
    except (OSError, IndexError, ValueError):
        return ""


def connect(host: str = "", namespace: str = "", token_file: str = "") -> tuple[Client, str]:
    """A client, and the base of the UI's links (empty when kfp found the API itself, in-cluster or kubeconfig)."""
    host = host or os.environ.get("KF_PIPELINES_ENDPOINT", "")
    if host and not re.match(r"^https?://[^/\s]+", host):
        raise InputError(f"--host {host!r} is not an http(s) URL such as http://localhost:8080")
    kwargs: dict[str, Any] = {"host": host or None}
    if namespace:
        kwargs["namespace"] = namespace
    token = token_path()
    if token_file:
        kwargs["existing_token"] = read_token(token_file)
    elif host and os.path.isfile(token):
        from kfp.client.set_volume_credentials import ServiceAccountTokenVolumeCredentials

        kwargs["credentials"] = ServiceAccountTokenVolumeCredentials(path=token)
    client = Client(**kwargs)
    ui = os.environ.get("KF_PIPELINES_UI_ENDPOINT", host).rstrip("/")
    return client, ui


def check_backend(client: Client) -> None:
    """Refuse a KFP backend older than MIN_KFP_BACKEND before anything is created on it, rather than leave an
    uploaded version whose runs cannot start; when its version cannot be read, warn and go on. Once per client."""
    if client.backend_checked:
        return
    if client.healthz is None:
        client.get_kfp_healthz()
    client.backend_checked = True
    # kubeflow/pipelines backend/src/apiserver/main.go (2.x), startHTTPProxy: /apis/v2beta1/healthz is a
    # plain handler writing commit_sha, tag_name, multi_user and pipeline_store; kfp_server_api's model keeps only
    # the last two, so the version is read from the raw answer.
    tag = (client.healthz or {}).get("tag_name")
    match = RELEASE_TAG.fullmatch(tag) if isinstance(tag, str) else None
    if match is None:
        said = f"healthz says tag_name {tag!r}" if tag is not None else "healthz has no tag_name"
        why = client.healthz_problem or said
        log.warning(
            "could not check the KFP backend's version (%s): this pipeline needs KFP %s or later, as %s; going on",
            why,
            MIN_KFP_BACKEND,
            MIN_KFP_BACKEND_WHY,
        )
        return
    if tuple(int(part) for part in match.groups()) < tuple(int(part) for part in MIN_KFP_BACKEND.split(".")):
        raise StepFailed(
            f"the KFP backend is version {tag}; this pipeline needs {MIN_KFP_BACKEND} or later, as "
            f"{MIN_KFP_BACKEND_WHY}: upgrade KFP (nothing was uploaded)"
        )
    log.info("KFP backend %s (this pipeline needs %s or later)", tag, MIN_KFP_BACKEND)


@contextmanager
def api_errors(what: str, namespace: str = "", token_file: str = "") -> Iterator[None]:
    """A failed call to the KFP API as one line: the status and the server's message, or why it was not reached. A
    multi-user backend's refusal (401: no token it accepts; 403: the token's account may not act in the namespace)
    is bad input, exit 2, naming the namespace and the account."""
    try:
        yield
    except kfp_server_api.ApiException as exc:
        try:
            message = json.loads(exc.body or "{}").get("message") or exc.body
        except ValueError:
            message = exc.body
        if exc.status in (401, 403):
            path = token_path(token_file)
            has_token = bool(token_file) or os.path.isfile(path)
            who = token_subject(path) or ("the token of --token-file" if token_file else "this client")
            where = f" in namespace {namespace}" if namespace else " (no --namespace given)"
            if exc.status == 401:
                who += "" if has_token else " (no token: give --token-file)"
            raise InputError(f"{what}: KFP refused {who}{where}: {str(message).strip()[:300]}") from None
        raise StepFailed(
            f"{what}: the KFP API answered {exc.status} {exc.reason}: {str(message).strip()[:300]}"
        ) from None
    except (urllib3.exceptions.HTTPError, OSError) as exc:
        raise StepFailed(f"{what}: the KFP API could not be reached: {str(exc).splitlines()[0][:300]}") from None


def run_link(ui: str, run_id: str) -> str:
    return f"{ui}/#/runs/details/{run_id}" if ui else f"run {run_id} (set --host for a link)"


def recurring_run_link(ui: str, recurring_run_id: str) -> str:
    return f"{ui}/#/recurringrun/details/{recurring_run_id}" if ui else f"recurring run {recurring_run_id}"


# --- pipeline versions and runs -------------------------------------------------------------------------------


@dataclass
class PipelineVersion:
    pipeline_id: str
    version_id: str
    name: str
    uploaded: bool


def version_name(package: Path) -> str:
    digest = hashlib.sha256(package.read_bytes()).hexdigest()[:12]
    return f"{version('hyperpod-pretrain')}-{digest}"


def _name_filter(key: str, value: str) -> str:
    return json.dumps({"predicates": [{"operation": "EQUALS", "key": key, "stringValue": value}]})


def ensure_pipeline_version(client: Client, package: Path, pipeline_name: str) -> PipelineVersion:
    """The pipeline version holding exactly `package`: found by its content-derived name, else uploaded (on a
    backend that can run it)."""
    check_backend(client)
    name = version_name(package)
    pipeline_id = client.get_pipeline_id(pipeline_name)
    if pipeline_id is None:
        description = next(yaml.safe_load_all(package.read_text()))["pipelineInfo"].get("description", "")
        pipeline_id = client.upload_pipeline(str(package), pipeline_name, description[:1000]).pipeline_id
        log.info("created pipeline %s (%s)", pipeline_name, pipeline_id)
    else:
        found = client.list_pipeline_versions(pipeline_id, page_size=1, filter=_name_filter("display_name", name))
        if found.pipeline_versions:
            return PipelineVersion(pipeline_id, found.pipeline_versions[0].pipeline_version_id, name, uploaded=False)
    uploaded = client.upload_pipeline_version(str(package), pipeline_version_name=name, pipeline_id=pipeline_id)
    log.info("uploaded pipeline version %s (%s)", name, uploaded.pipeline_version_id)
    return PipelineVersion(pipeline_id, uploaded.pipeline_version_id, name, uploaded=True)


def experiment_id(client: Client, name: str, namespace: str, create: bool = True) -> str:
    """The experiment's id; created when missing (kfp looks it up by name first, and nothing is created on a backend
    that cannot run the pipeline), or an InputError."""
    if create:
        check_backend(client)
        return client.create_experiment(name, namespace=namespace or None).experiment_id
    try:
        return client.get_experiment(experiment_name=name, namespace=namespace or None).experiment_id
    except ValueError:
        raise InputError(f"--experiment {name!r}: no experiment of that name") from None


def submit_run(
    client: Client, version: PipelineVersion, experiment: str, run_name: str, parameters: dict[str, Any]
) -> str:
    run = client.run_pipeline(
        experiment_id=experiment,
        job_name=run_name,
        pipeline_id=version.pipeline_id,
        version_id=version.version_id,
        params=parameters,
    )
    return run.run_id


def summary_path(package: Path, parameters: dict[str, Any], run_id: str) -> str:
    """Where the run's exit step writes its summary, from the run's parameters and the pipeline's defaults."""
    values = Package.load(package).defaults() | parameters
    run_dir = values.get("resume_run_id") or values.get("run_id") or run_id
    return f"{str(values.get('storage_root', '')).rstrip('/')}/runs/{run_dir}/summary.md"


def wait_for_run(client: Client, run_id: str, timeout_s: float, poll_s: float = 15.0) -> kfp_server_api.V2beta1Run:
    """Poll until the run finishes (CANCELED included, which kfp's own wait ignores); the finished run."""
    deadline, last = time.monotonic() + timeout_s, ""
    while True:
        run = client.get_run(run_id)
        state = run.state or "PENDING"
        if state != last:
            log.info("run %s: %s", run_id, state)
            last = state
        if state in FINISHED:
            return run
        if time.monotonic() + poll_s > deadline:
            raise StepFailed(f"run {run_id} is still {state} after {timeout_s:.0f} s (--wait-timeout-s)")
        time.sleep(poll_s)


def container_tasks(package: Path) -> set[str]:
    """The names of the pipeline's steps (tasks that run a container, in any DAG), as its compiled spec has them."""
    spec = next(yaml.safe_load_all(package.read_text()))
    components = spec.get("components") or {}
    dags = [spec["root"]["dag"]] + [c["dag"] for c in components.values() if "dag" in c]
    return {
        name
        for dag in dags
        for name, task in (dag.get("tasks") or {}).items()
        if "dag" not in components.get(task["componentRef"]["name"], {})
    }


def failure_lines(run: kfp_server_api.V2beta1Run, package: Path) -> list[str]:
    """Which steps a failed run failed in, one line each, and where to see why: KFP's API keeps no step's message,
    and a step whose command fails uploads no outputs (backend/src/v2/component/launcher_v2.go, executeV2 returns
    before uploadOutputArtifacts).

    kubeflow/pipelines 2.x, backend/src/apiserver/server/api_converter.go: a run's task_details are its Argo
    nodes (toModelTasks of Workflow.NodeStatuses, backend/src/common/util/workflow.go), each with a display name and a
    state, no message and no outputs; toApiPipelineTaskDetail and toApiRun fill `error` only when a stored run cannot
    be converted, never with why a step failed. The nodes are each step's "<step>-driver" and "<step>", and the groups
    and "executor" pods around them, which fail with it: the nodes named after a step (or its driver) are reported,
    or every failed node when none is.
    """
    steps = container_tasks(package)
    failed = [
        t.display_name or ""
        for t in (run.run_details.task_details if run.run_details else None) or []
        if t.state == "FAILED"
    ]
    named = [n for n in failed if n.removesuffix("-driver") in steps]
    lines = [
        f"step {n} FAILED" if n in steps else f"step {n.removesuffix('-driver')} FAILED in its driver" for n in named
    ] or [f"{n} FAILED" for n in failed if n]
    if not lines:
        lines.append(f"run {run.run_id}: KFP reports no failed task yet")
    lines.append(
        "KFP keeps no error message for a step, and a failed step uploads no outputs: the step's log says "
        "why (the UI: the run's graph, the step, Logs)"
    )
    return lines


# --- recurring runs -------------------------------------------------------------------------------------------

CRON_FIELDS = 6  # KFP's scheduler takes seconds first: "0 0 2 * * *" is 02:00 every day


def check_cron(cron: str) -> str:
    fields = cron.split()
    if len(fields) != CRON_FIELDS:
        raise InputError(
            f"--cron {cron!r}: KFP's cron has 6 fields, seconds first, e.g. '0 0 2 * * *' for 02:00 every day"
        )
    return cron


def find_recurring_run(client: Client, name: str, experiment: str, namespace: str) -> str | None:
    found = client.list_recurring_runs(
        experiment_id=experiment, namespace=namespace or None, page_size=2, filter=_name_filter("display_name", name)
    )
    runs = found.recurring_runs or []
    if len(runs) > 1:
        raise InputError(f"--name {name!r}: more than one recurring run has this name; manage them in the UI")
    return runs[0].recurring_run_id if runs else None


def create_recurring_run(
    client: Client, version: PipelineVersion, experiment: str, name: str, cron: str, parameters: dict[str, Any]
) -> str:
    """At most one run at a time, and no catch-up of the runs missed while disabled or down."""
    recurring = client.create_recurring_run(
        experiment_id=experiment,
        job_name=name,
        cron_expression=cron,
        max_concurrency=1,
        no_catchup=True,
        pipeline_id=version.pipeline_id,
        version_id=version.version_id,
        params=parameters,
        enabled=True,
    )
    return recurring.recurring_run_id
