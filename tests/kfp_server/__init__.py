"""A fake Kubeflow Pipelines API server (REST, ``/apis/v2beta1``) on loopback, for driving the real ``kfp.Client``.

It serves what ``kfp.Client`` (kfp 2.17, REST layer ``kfp_server_api``) sends for experiments, pipeline uploads and
versions, runs and recurring runs, and it is strict about it, so that a test catches what a real server would reject:

- every JSON request body must deserialize into its ``kfp_server_api`` model with no unknown key at any depth (keys
  are compared with each model's ``attribute_map``, recursing by ``openapi_types``), scalars of the right JSON type
  (int64 fields such as ``max_concurrency`` as a JSON number or a decimal string, as protobuf's JSON mapping allows),
  timestamps in RFC 3339 and enums among their values (schema.py);
- ``filter`` query parameters must be a JSON ``Filter`` (``predicates`` with an ``operation``, a ``key`` of the listed
  resource and exactly one typed value); EQUALS, NOT_EQUALS, IN and IS_SUBSTRING are evaluated on string keys
  (listing.py);
- unknown query parameters, unknown routes and methods are rejected too (server.py);
- uploads must be ``multipart/form-data`` with an ``uploadfile`` part holding a compiled pipeline (first YAML
  document: a ``PipelineSpec`` with ``pipelineInfo``, ``root`` and ``schemaVersion``; an optional second document: a
  ``PlatformSpec``), both parsed with the real protobuf messages (pipelines.py);
- runs and recurring runs must reference an existing pipeline version (404 otherwise) or carry a pipeline spec, and
  (unless ``check_parameters=False``) their ``runtime_config.parameters`` must match the pipeline's declared inputs
  by name and JSON type, as the API server checks them when it creates the run or recurring run (kubeflow/pipelines,
  ``backend/src/apiserver/template/v2_template.go``, ``V2Spec.validatePipelineJobInputs``, called from
  ``RunWorkflow`` and ``ScheduledWorkflow``): any number passes for an integer input, and the first violation is
  answered, in its words, with 400 "invalid pipeline job inputs" (pipelines.py).

A rejected request gets the status a real server gives (400 INVALID_ARGUMENT, 404 NOT_FOUND, 409 ALREADY_EXISTS, ...)
with a ``google.rpc.Status``-like JSON body ``{"error", "code", "message", "details"}`` (errors.py); every 400 and
every request the fake has no route for is also appended to :attr:`FakeKfp.errors`, which a test asserts is empty.

Runs move on each ``GET /runs/{id}``: ``PENDING`` at creation, then through :attr:`FakeKfp.run_progression` (by
default ``RUNNING``), then :attr:`FakeKfp.run_outcome`. ``kfp.Client.wait_for_run_completion`` sleeps
``sleep_duration`` (5 s by default) between polls, so a test passes ``sleep_duration=0``. A run that ends SUCCEEDED or
FAILED gets ``run_details.task_details`` as a real backend reports them: one per Argo node, with a display name and a
state, and nothing else (no message, no outputs); a FAILED run fails in :attr:`FakeKfp.failed_task` (runs.py).

``GET /healthz`` answers as a real backend does, with its version in ``tag_name`` (:attr:`FakeKfp.tag_name`).
Multi-user mode's authorization is asked of a real Kubernetes API server (auth.py, KubernetesAuthorizer).

The modules, one per part of the real server they stand for: server.py (the HTTP server, routes and dispatch),
errors.py, schema.py (kfp_server_api's models), listing.py (filters and pages), records.py (what is kept), auth.py,
experiments.py, pipelines.py (pipelines, versions, and the spec a run runs), runs.py, recurring_runs.py.

Usage::

    with FakeKfp() as server:
        client = server.client()  # kfp.Client(host=server.url), with the token when one is required
        ...
        assert server.errors == []
"""

from tests.kfp_server.auth import KubernetesAuthorizer
from tests.kfp_server.errors import KfpError
from tests.kfp_server.experiments import ExperimentRecord
from tests.kfp_server.pipelines import PipelineRecord, VersionRecord
from tests.kfp_server.records import FormPart, RecordedRequest
from tests.kfp_server.recurring_runs import RecurringRunRecord
from tests.kfp_server.runs import RunRecord
from tests.kfp_server.schema import deserialize, schema_violations
from tests.kfp_server.server import FakeKfp

__all__ = [
    "ExperimentRecord",
    "FakeKfp",
    "FormPart",
    "KfpError",
    "KubernetesAuthorizer",
    "PipelineRecord",
    "RecordedRequest",
    "RecurringRunRecord",
    "RunRecord",
    "VersionRecord",
    "deserialize",
    "schema_violations",
]
