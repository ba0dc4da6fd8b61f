"""The fake KFP API server itself: a threading HTTP server on a free loopback port, the route table, and the dispatch
of every request (injected faults, the bearer token, routing, query parameters, the body checked against its model,
the answer checked against its model too) to the handlers of experiments.py, pipelines.py, runs.py and
recurring_runs.py.

Unknown query parameters, unknown routes and methods are rejected; every 400 and every request the fake has no route
for is also appended to :attr:`FakeKfp.errors`, which a test asserts is empty. ``GET /healthz`` answers as a real
backend does, with its version in ``tag_name`` (:attr:`FakeKfp.tag_name`).
"""

from __future__ import annotations

import email.parser
import email.policy
import json
import logging
import re
import threading
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

import kfp

from tests.kfp_server.auth import KubernetesAuthorizer
from tests.kfp_server.errors import GRPC_CODES, KfpError
from tests.kfp_server.experiments import ExperimentRecord
from tests.kfp_server.pipelines import PipelineRecord, VersionRecord
from tests.kfp_server.records import Call, FormPart, RecordedRequest
from tests.kfp_server.recurring_runs import RecurringRunRecord, RecurringRuns
from tests.kfp_server.runs import RunRecord, Runs
from tests.kfp_server.schema import deserialize, json_kind, schema_violations

log = logging.getLogger(__name__)

API = "/apis/v2beta1"


@dataclass
class _Fault:
    method: str
    path: re.Pattern[str]
    status: int
    remaining: int
    message: str


Handler = Callable[[Call], tuple[str | None, Any]]  # -> (response model name or None for '{}', JSON)


@dataclass(frozen=True)
class _Route:
    method: str
    pattern: re.Pattern[str]
    handler: Handler
    query: frozenset[str] = frozenset()
    body: str | None = None  # the model a JSON body must deserialize into
    multipart: bool = False


def parse_multipart(content_type: str, body: bytes) -> dict[str, FormPart]:
    if not content_type.lower().startswith("multipart/form-data"):
        raise KfpError(400, f"Expected multipart/form-data, got Content-Type {content_type!r}")
    message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(
        b"Content-Type: " + content_type.encode("latin-1") + b"\r\n\r\n" + body
    )
    if not message.is_multipart() or message.defects:
        raise KfpError(400, f"Malformed multipart/form-data body: {message.defects or 'no parts'}")
    parts: dict[str, FormPart] = {}
    for part in message.iter_parts():
        name = part.get_param("name", header="content-disposition")
        if part.get_content_disposition() != "form-data" or not isinstance(name, str):
            raise KfpError(400, "Malformed multipart/form-data body: a part without a form-data name")
        if name in parts:
            raise KfpError(400, f"Malformed multipart/form-data body: part {name!r} given twice")
        payload = part.get_payload(decode=True)
        data = payload if isinstance(payload, bytes) else b""
        parts[name] = FormPart(name, part.get_filename(), part.get_content_type(), data)
    return parts


class _RequestHandler(BaseHTTPRequestHandler):
    server: _HttpServer

    def _serve(self) -> None:
        length = self.headers.get("Content-Length")
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            status, payload = 411, {"error": "chunked bodies are not supported by FakeKfp"}
        else:
            body = self.rfile.read(int(length)) if length else b""
            status, payload = self.server.fake._dispatch(self.command, self.path, dict(self.headers.items()), body)
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = do_DELETE = do_PUT = do_PATCH = _serve

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("FakeKfp: " + format, *args)


class _HttpServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, fake: FakeKfp) -> None:
        super().__init__(("127.0.0.1", 0), _RequestHandler)
        self.fake = fake


class FakeKfp(Runs, RecurringRuns):
    """The fake API server; a context manager that starts it on a free loopback port and stops it."""

    def __init__(
        self,
        *,
        require_token: str | None = None,
        multi_user: bool = False,
        tag_name: str = "2.17.0",
        run_outcome: str = "SUCCEEDED",
        run_progression: Sequence[str] = ("RUNNING",),
        failed_task: str = "",
        check_parameters: bool = True,
        path_prefix: str = "",
        authorizer: KubernetesAuthorizer | None = None,
    ) -> None:
        self.require_token = require_token
        # Multi-user mode's authorization (with multi_user): None, none at all.
        self.authorizer = authorizer
        # Served under this prefix too, as kfp.Client reaches KFP through a kubeconfig: the Kubernetes API
        # server's service proxy, e.g. /api/v1/namespaces/kubeflow/services/ml-pipeline:http/proxy.
        self.path_prefix = path_prefix.rstrip("/")
        self.multi_user = multi_user
        # What healthz reports as the backend's version: a release's tag ("2.17.0"), or "unknown" for an image built
        # without TAG_NAME (kubeflow/pipelines#11573).
        self.tag_name = tag_name
        self.run_outcome = run_outcome
        self.run_progression = run_progression
        # Where a FAILED run fails: a step, a task's "<task>-driver" or "root-driver" ("": its first step).
        self.failed_task = failed_task
        self.check_parameters = check_parameters
        self.errors: list[str] = []
        self.requests: list[RecordedRequest] = []
        self.experiments: dict[str, ExperimentRecord] = {}
        self.pipelines: dict[str, PipelineRecord] = {}
        self.versions: dict[str, VersionRecord] = {}
        self.runs: dict[str, RunRecord] = {}
        self.recurring_runs: dict[str, RecurringRunRecord] = {}
        self._faults: list[_Fault] = []
        self._lock = threading.RLock()
        self._server: _HttpServer | None = None
        self._thread: threading.Thread | None = None
        self._routes = self._make_routes()

    # ------------------------------------------------------------------------------------------- lifecycle

    def start(self) -> FakeKfp:
        self._server = _HttpServer(self)
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,), name="FakeKfp", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def __enter__(self) -> FakeKfp:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    @property
    def port(self) -> int:
        if self._server is None:
            raise RuntimeError("FakeKfp is not started")
        return self._server.server_address[1]

    @property
    def url(self) -> str:
        """The host to give ``kfp.Client(host=...)``."""
        return f"http://127.0.0.1:{self.port}"

    # -------------------------------------------------------------------------------------------- helpers

    def client(self, **kwargs: Any) -> kfp.Client:
        """A real ``kfp.Client`` on this server (with ``existing_token`` when a token is required)."""
        if self.require_token is not None:
            kwargs.setdefault("existing_token", self.require_token)
        with warnings.catch_warnings():
            warnings.simplefilter(
                "ignore", FutureWarning
            )  # "This client only works with Kubeflow Pipeline v2.0.0-beta.2"
            return kfp.Client(host=self.url, **kwargs)

    def fail_next(
        self, method: str, path_regex: str, status: int = 503, times: int = 1, message: str | None = None
    ) -> None:
        """Answer the next ``times`` requests of ``method`` whose path matches ``path_regex`` (re.search) with
        ``status`` and a Status body, before authentication and routing."""
        with self._lock:
            self._faults.append(
                _Fault(method.upper(), re.compile(path_regex), status, times, message or f"injected failure ({status})")
            )

    def requests_to(self, method: str, path_regex: str) -> list[RecordedRequest]:
        """The recorded requests of ``method`` whose path matches ``path_regex`` (re.search)."""
        pattern = re.compile(path_regex)
        with self._lock:
            return [r for r in self.requests if r.method == method.upper() and pattern.search(r.path)]

    # ------------------------------------------------------------------------------------------- dispatch

    def _dispatch(self, method: str, raw_path: str, headers: dict[str, str], raw_body: bytes) -> tuple[int, Any]:
        with self._lock:
            split = urlsplit(raw_path)
            path = split.path
            if self.path_prefix:  # only under the prefix: anything else finds no route (a 404, in .errors)
                path = unquote(path)  # the client sends the proxy path's ":" as %3A
                inside = path.startswith(self.path_prefix + "/")
                path = "/" + path[len(self.path_prefix) :].lstrip("/") if inside else "/outside-the-proxy" + path
            lower_headers = {name.lower(): value for name, value in headers.items()}
            pairs = parse_qsl(split.query, keep_blank_values=True)
            query = dict(pairs)
            try:
                body = self._parse_body(lower_headers.get("content-type", ""), raw_body)
                parse_error: KfpError | None = None
            except KfpError as error:
                body, parse_error = raw_body, error
            self.requests.append(RecordedRequest(method, path, query, lower_headers, body, raw_body))
            try:
                for fault in self._faults:
                    if fault.method == method and fault.path.search(path):
                        fault.remaining -= 1
                        if fault.remaining <= 0:
                            self._faults.remove(fault)
                        raise KfpError(fault.status, fault.message, violation=False)
                if self.require_token is not None:
                    if lower_headers.get("authorization") != f"Bearer {self.require_token}":
                        raise KfpError(401, "Unauthenticated: missing or wrong bearer token", violation=False)
                route, params = self._route(method, path)
                if len(pairs) != len(query):
                    raise KfpError(400, f"Repeated query parameters in {split.query!r}")
                unknown = set(query) - route.query
                if unknown:
                    raise KfpError(400, f"Unknown query parameters {sorted(unknown)} for {method} {path}")
                if parse_error is not None:
                    raise parse_error
                self._check_body(route, lower_headers, body)
                model_name, payload = route.handler(Call(params, query, body, lower_headers))
                if model_name is not None:
                    violations = schema_violations(payload, model_name)
                    if violations:  # a bug in the fake, not in the client
                        raise KfpError(500, f"FakeKfp built an invalid {model_name}: {violations}", violation=True)
                    try:
                        deserialize(payload, model_name)
                    except (ValueError, TypeError) as error:
                        raise KfpError(
                            500, f"FakeKfp built an invalid {model_name}: {error}", violation=True
                        ) from error
                return 200, payload
            except KfpError as error:
                if error.violation:
                    self.errors.append(f"{method} {path}: {error.message}")
                    log.warning("FakeKfp rejected %s %s: %s", method, path, error.message)
                code = GRPC_CODES.get(error.status, 2)
                return error.status, {"error": error.message, "code": code, "message": error.message, "details": []}

    def _parse_body(self, content_type: str, raw_body: bytes) -> Any:
        if not raw_body:
            return None
        if content_type.lower().startswith("multipart/"):
            return parse_multipart(content_type, raw_body)
        try:
            return json.loads(raw_body)
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise KfpError(400, f"The request body is not JSON: {error}") from error

    def _route(self, method: str, path: str) -> tuple[_Route, dict[str, str]]:
        allowed = []
        for route in self._routes:
            match = route.pattern.fullmatch(path)
            if match is None:
                continue
            if route.method == method:
                return route, match.groupdict()
            allowed.append(route.method)
        if allowed:
            raise KfpError(405, f"Method {method} not allowed on {path} (allowed: {allowed})", violation=True)
        raise KfpError(404, f"No route for {method} {path} in FakeKfp", violation=True)

    @staticmethod
    def _check_body(route: _Route, headers: Mapping[str, str], body: Any) -> None:
        if route.multipart:
            if not isinstance(body, dict) or not all(isinstance(p, FormPart) for p in body.values()):
                raise KfpError(400, "Expected a multipart/form-data body")
            return
        if route.body is None:
            if body not in (None, {}):
                raise KfpError(400, f"{route.method} takes no body here, got {body!r}")
            return
        if not headers.get("content-type", "").lower().startswith("application/json"):
            raise KfpError(400, f"Expected Content-Type application/json, got {headers.get('content-type')!r}")
        if not isinstance(body, dict):
            raise KfpError(400, f"Expected a JSON {route.body} object, got {json_kind(body)}")
        violations = schema_violations(body, route.body)
        if violations:
            raise KfpError(400, f"Invalid {route.body}: {'; '.join(violations)}")
        try:
            deserialize(body, route.body)
        except (ValueError, TypeError) as error:
            raise KfpError(400, f"Invalid {route.body}: {error}") from error

    def _make_routes(self) -> list[_Route]:
        ident = r"[^/:]+"
        listing = frozenset({"page_token", "page_size", "sort_by", "filter"})

        def route(method: str, template: str, handler: Handler, **kwargs: Any) -> _Route:
            pieces = re.split(r"\{(\w+)\}", API + template)  # literal, name, literal, name, ...
            pattern = "".join(re.escape(p) if i % 2 == 0 else f"(?P<{p}>{ident})" for i, p in enumerate(pieces))
            return _Route(method, re.compile(pattern), handler, **kwargs)

        return [
            route("GET", "/healthz", self._healthz),
            route("POST", "/experiments", self._create_experiment, body="V2beta1Experiment"),
            route("GET", "/experiments", self._list_experiments, query=listing | {"namespace"}),
            route("GET", "/experiments/{experiment_id}", self._get_experiment),
            route("GET", "/pipelines", self._list_pipelines, query=listing | {"namespace"}),
            route(
                "POST",
                "/pipelines/upload",
                self._upload_pipeline,
                query=frozenset({"name", "display_name", "description", "namespace", "tags"}),
                multipart=True,
            ),
            route(
                "POST",
                "/pipelines/upload_version",
                self._upload_version,
                query=frozenset({"name", "display_name", "pipelineid", "description", "tags"}),
                multipart=True,
            ),
            route("GET", "/pipelines/{pipeline_id}", self._get_pipeline),
            route("GET", "/pipelines/{pipeline_id}/versions", self._list_versions, query=listing),
            route("GET", "/pipelines/{pipeline_id}/versions/{pipeline_version_id}", self._get_version),
            route("POST", "/runs", self._create_run, query=frozenset({"experiment_id"}), body="V2beta1Run"),
            route("GET", "/runs", self._list_runs, query=listing | {"namespace", "experiment_id"}),
            route("GET", "/runs/{run_id}", self._get_run, query=frozenset({"experiment_id"})),
            route("POST", "/recurringruns", self._create_recurring_run, body="V2beta1RecurringRun"),
            route("GET", "/recurringruns", self._list_recurring_runs, query=listing | {"namespace", "experiment_id"}),
            route("GET", "/recurringruns/{recurring_run_id}", self._get_recurring_run),
            route("POST", "/recurringruns/{recurring_run_id}:enable", self._enable_recurring_run),
            route("POST", "/recurringruns/{recurring_run_id}:disable", self._disable_recurring_run),
            route(
                "DELETE",
                "/recurringruns/{recurring_run_id}",
                self._delete_recurring_run,
                query=frozenset({"propagation_policy"}),
            ),
        ]

    # ---------------------------------------------------------------------------------------- handlers

    def _healthz(self, call: Call) -> tuple[None, Any]:
        # kubeflow/pipelines backend/src/apiserver/main.go (2.x), startHTTPProxy: /apis/v2beta1/healthz is
        # a plain handler, not the gRPC gateway, writing commit_sha and tag_name (the image's COMMIT_SHA and TAG_NAME
        # build args, "unknown" when unset), multi_user and pipeline_store ("database" unless pipelines are stored
        # in Kubernetes). kfp_server_api's V2beta1GetHealthzResponse has only multi_user and pipeline_store, so the
        # answer is not checked against it: the client drops the other two.
        return None, {
            "commit_sha": "0123456789abcdef0123456789abcdef01234567",
            "tag_name": self.tag_name,
            "multi_user": self.multi_user,
            "pipeline_store": "database",
        }
