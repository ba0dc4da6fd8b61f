"""Pipelines and their versions: uploads (``multipart/form-data`` with an ``uploadfile`` part holding a compiled
pipeline: first YAML document a ``PipelineSpec`` with ``pipelineInfo``, ``root`` and ``schemaVersion``, an optional
second one a ``PlatformSpec``, both parsed with the real protobuf messages), get and list; and what a run or recurring
run runs: the pipeline spec of the version it references (404 otherwise) or the one it carries, with its
``runtime_config.parameters`` checked against the pipeline's declared inputs by name and JSON type (unless
``check_parameters=False``), as the API server checks them when it creates the run or recurring run
(kubeflow/pipelines, ``backend/src/apiserver/template/v2_template.go``, ``V2Spec.validatePipelineJobInputs``, called
from ``RunWorkflow`` and ``ScheduledWorkflow``): any number passes for an integer input, and the first violation is
answered, in its words, with 400 "invalid pipeline job inputs"."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import yaml
from google.protobuf import json_format
from kfp.pipeline_spec import pipeline_spec_pb2

from tests.kfp_server.errors import KfpError
from tests.kfp_server.listing import page
from tests.kfp_server.records import Call, FormPart, Record, now_rfc3339, spec_parameters
from tests.kfp_server.schema import json_kind

# parameterType of a pipeline input -> the JSON types a runtime parameter value may have.
PARAMETER_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "STRING": (str,),
    "NUMBER_INTEGER": (int, float),  # any google.protobuf.Value number: the server does not ask for an integral one
    "NUMBER_DOUBLE": (int, float),
    "BOOLEAN": (bool,),
    "LIST": (list,),
    "STRUCT": (dict,),
}


@dataclass
class PipelineRecord(Record):
    @property
    def id(self) -> str:
        return self.resource["pipeline_id"]


@dataclass
class VersionRecord(Record):
    """A pipeline version and the package it was uploaded from."""

    package: bytes  # the uploaded file, byte for byte
    filename: str
    pipeline_spec: dict[str, Any]  # the first YAML document
    platform_spec: dict[str, Any] | None  # the second one, if any

    @property
    def id(self) -> str:
        return self.resource["pipeline_version_id"]


def load_pipeline_package(data: bytes) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The pipeline spec and platform spec in a compiled package (YAML or JSON); KfpError(400) if it is not one."""
    try:
        docs = [doc for doc in yaml.safe_load_all(data.decode("utf-8")) if doc is not None]
    except (UnicodeDecodeError, yaml.YAMLError) as error:
        raise KfpError(400, f"Failed to parse the pipeline package: not YAML: {error}") from error
    if not docs or len(docs) > 2:
        raise KfpError(400, f"Invalid pipeline package: expected 1 or 2 YAML documents, got {len(docs)}")
    spec = docs[0]
    platform = docs[1] if len(docs) == 2 else None
    check_pipeline_spec(spec, platform)
    return spec, platform


def check_pipeline_spec(spec: Any, platform: Any | None) -> None:
    if not isinstance(spec, dict):
        raise KfpError(400, f"Invalid pipeline spec: expected a mapping, got {json_kind(spec)}")
    missing = [key for key in ("pipelineInfo", "root", "schemaVersion") if key not in spec]
    if missing:
        raise KfpError(400, f"Invalid pipeline spec: missing {', '.join(missing)}")
    if not (spec["pipelineInfo"] or {}).get("name"):
        raise KfpError(400, "Invalid pipeline spec: pipelineInfo.name is empty")
    try:
        json_format.ParseDict(spec, pipeline_spec_pb2.PipelineSpec())
    except json_format.ParseError as error:
        raise KfpError(400, f"Invalid pipeline spec: {error}") from error
    if platform is not None:
        if not isinstance(platform, dict):
            raise KfpError(400, f"Invalid platform spec: expected a mapping, got {json_kind(platform)}")
        try:
            json_format.ParseDict(platform, pipeline_spec_pb2.PlatformSpec())
        except json_format.ParseError as error:
            raise KfpError(400, f"Invalid platform spec: {error}") from error


def split_inline_spec(body_spec: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """A run's ``pipeline_spec``: the spec itself or ``{"pipeline_spec": ..., "platform_spec": ...}`` (kfp's form)."""
    if "pipeline_spec" in body_spec:
        unknown = set(body_spec) - {"pipeline_spec", "platform_spec"}
        if unknown:
            raise KfpError(400, f"Invalid pipeline spec: unknown keys {sorted(unknown)} next to pipeline_spec")
        spec, platform = body_spec["pipeline_spec"], body_spec.get("platform_spec")
    else:
        spec, platform = body_spec, None
    check_pipeline_spec(spec, platform)
    return spec, platform


def parameter_violations(spec: Mapping[str, Any], parameters: Mapping[str, Any]) -> list[str]:
    """What validatePipelineJobInputs says of ``parameters``, in its words (it returns at the first)."""
    declared: dict[str, Any] = ((spec.get("root") or {}).get("inputDefinitions") or {}).get("parameters") or {}
    words = {
        "NUMBER_INTEGER": "double or integer",
        "NUMBER_DOUBLE": "double or integer",
        "STRING": "string",
        "BOOLEAN": "bool",
        "LIST": "list",
        "STRUCT": "struct",
    }
    for name, decl in declared.items():
        if name not in parameters:
            if "defaultValue" not in decl and not decl.get("isOptional"):
                return [f"parameter {name} is not optional, yet has neither default value nor user provided value"]
            continue
        kind, value = decl.get("parameterType"), parameters[name]
        json_types = PARAMETER_JSON_TYPES.get(kind)
        if json_types is None:
            continue
        if not isinstance(value, json_types) or (isinstance(value, bool) and bool not in json_types):
            return [
                f"input parameter {name} requires type {words[kind]}, but the parameter value is not of "
                f"{'number' if kind.startswith('NUMBER') else words[kind]} value type"
            ]
    extra = [name for name in parameters if name not in declared]
    return [f"parameter(s) provided are not required by pipeline: {', '.join(extra)}"] if extra else []


class Pipelines:
    """The pipeline service's handlers, over the pipelines and versions the fake keeps."""

    pipelines: dict[str, PipelineRecord]
    versions: dict[str, VersionRecord]
    check_parameters: bool
    _lock: threading.RLock

    def pipeline_named(self, name: str) -> PipelineRecord | None:
        with self._lock:
            return next((p for p in self.pipelines.values() if p.get("display_name") == name), None)

    def versions_of(self, pipeline_id: str) -> list[VersionRecord]:
        with self._lock:
            return [v for v in self.versions.values() if v["pipeline_id"] == pipeline_id]

    def _pipeline(self, pipeline_id: str) -> PipelineRecord:
        record = self.pipelines.get(pipeline_id)
        if record is None:
            raise KfpError(404, f"Pipeline {pipeline_id} not found")
        return record

    def _version(self, pipeline_id: str, version_id: str) -> VersionRecord:
        self._pipeline(pipeline_id)
        record = self.versions.get(version_id)
        if record is None or record["pipeline_id"] != pipeline_id:
            raise KfpError(404, f"Pipeline version {version_id} of pipeline {pipeline_id} not found")
        return record

    def _list_pipelines(self, call: Call) -> tuple[str, Any]:
        namespace = call.query.get("namespace", "")
        records = [p for p in self.pipelines.values() if not namespace or p.get("namespace", "") == namespace]
        return "V2beta1ListPipelinesResponse", page(records, call.query, "V2beta1Pipeline", "pipelines")

    def _get_pipeline(self, call: Call) -> tuple[str, Any]:
        return "V2beta1Pipeline", self._pipeline(call.params["pipeline_id"]).resource

    def _list_versions(self, call: Call) -> tuple[str, Any]:
        records = self.versions_of(self._pipeline(call.params["pipeline_id"]).id)
        response = page(records, call.query, "V2beta1PipelineVersion", "pipeline_versions")
        return "V2beta1ListPipelineVersionsResponse", response

    def _get_version(self, call: Call) -> tuple[str, Any]:
        return "V2beta1PipelineVersion", self._version(
            call.params["pipeline_id"], call.params["pipeline_version_id"]
        ).resource

    @staticmethod
    def _uploaded_file(call: Call) -> FormPart:
        part = call.body.get("uploadfile")
        if part is None or part.filename is None:
            raise KfpError(400, f"The upload has no 'uploadfile' file part (parts: {sorted(call.body)})")
        return part

    @staticmethod
    def _upload_names(call: Call, part: FormPart) -> tuple[str, str]:
        name = call.query.get("name") or call.query.get("display_name") or (part.filename or "").rsplit(".", 1)[0]
        display_name = call.query.get("display_name") or name
        if not name.strip():
            raise KfpError(400, "Invalid input error: the pipeline name is empty")
        return name, display_name

    def _upload_pipeline(self, call: Call) -> tuple[str, Any]:
        part = self._uploaded_file(call)
        spec, platform = load_pipeline_package(part.data)
        name, display_name = self._upload_names(call, part)
        namespace = call.query.get("namespace", "")
        if any(p["name"] == name and p.get("namespace", "") == namespace for p in self.pipelines.values()):
            raise KfpError(409, f"Already exist error: a pipeline named {name!r} already exists")
        resource = {
            "pipeline_id": str(uuid.uuid4()),
            "name": name,
            "display_name": display_name,
            "created_at": now_rfc3339(),
        }
        if call.query.get("description"):
            resource["description"] = call.query["description"]
        if namespace:
            resource["namespace"] = namespace
        record = PipelineRecord(resource)
        self.pipelines[record.id] = record
        # A real server stores the package as the pipeline's first version, under the pipeline's name.
        self._add_version(record, name, display_name, call.query.get("description"), part, spec, platform)
        return "V2beta1Pipeline", resource

    def _upload_version(self, call: Call) -> tuple[str, Any]:
        part = self._uploaded_file(call)
        pipeline_id = call.query.get("pipelineid", "")
        if not pipeline_id:
            raise KfpError(400, "Invalid input error: pipelineid is required to upload a pipeline version")
        pipeline = self._pipeline(pipeline_id)
        spec, platform = load_pipeline_package(part.data)
        name, display_name = self._upload_names(call, part)
        if any(v["name"] == name for v in self.versions_of(pipeline_id)):
            raise KfpError(409, f"Already exist error: pipeline {pipeline_id} already has a version named {name!r}")
        version = self._add_version(pipeline, name, display_name, call.query.get("description"), part, spec, platform)
        return "V2beta1PipelineVersion", version.resource

    def _add_version(
        self,
        pipeline: PipelineRecord,
        name: str,
        display_name: str,
        description: str | None,
        part: FormPart,
        spec: dict[str, Any],
        platform: dict[str, Any] | None,
    ) -> VersionRecord:
        resource: dict[str, Any] = {
            "pipeline_id": pipeline.id,
            "pipeline_version_id": str(uuid.uuid4()),
            "name": name,
            "display_name": display_name,
            "created_at": now_rfc3339(),
            "pipeline_spec": spec if platform is None else {"pipeline_spec": spec, "platform_spec": platform},
        }
        if description:
            resource["description"] = description
        record = VersionRecord(resource, part.data, part.filename or "", spec, platform)
        self.versions[record.id] = record
        return record

    def _resolve_source(self, body: Mapping[str, Any], what: str) -> dict[str, Any]:
        """The pipeline spec a run or recurring run uses: from its version reference or its inline spec."""
        reference = body.get("pipeline_version_reference")
        sources = [k for k in ("pipeline_version_reference", "pipeline_spec", "pipeline_version_id") if body.get(k)]
        if len(sources) != 1:
            raise KfpError(
                400,
                f"Invalid {what}: exactly one of pipeline_version_reference, pipeline_spec or pipeline_version_id "
                f"is required, got {sources or 'none'}",
            )
        if body.get("pipeline_spec"):
            return split_inline_spec(body["pipeline_spec"])[0]
        reference = dict(reference or {"pipeline_version_id": body["pipeline_version_id"]})
        pipeline_id = reference.get("pipeline_id") or ""
        version_id = reference.get("pipeline_version_id") or ""
        if not pipeline_id and not version_id:
            raise KfpError(400, f"Invalid {what}: the pipeline version reference is empty")
        if not version_id:
            versions = self.versions_of(self._pipeline(pipeline_id).id)
            if not versions:
                raise KfpError(404, f"Pipeline {pipeline_id} has no versions")
            return versions[-1].pipeline_spec
        version = self.versions.get(version_id)
        if pipeline_id:
            version = self._version(pipeline_id, version_id)
        if version is None:
            raise KfpError(404, f"Pipeline version {version_id} not found")
        return version.pipeline_spec

    def _check_runtime_config(self, body: Mapping[str, Any], spec: Mapping[str, Any], what: str) -> None:
        if not self.check_parameters:
            return
        violations = parameter_violations(spec, spec_parameters(body))
        if violations:
            raise KfpError(400, f"Invalid {what}: invalid pipeline job inputs: {'; '.join(violations)}")
