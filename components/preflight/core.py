"""Preflight: check the cluster against the exact job the launcher would create, before it creates it.

The manifest is rendered with the launcher's own `render_job(cfg.job_spec())` (a PyTorchJob, or a TrainJob with the
pod its runtime makes) and everything checked comes from it: the job API and its operator (and a TrainJob's
runtime), the Kueue queue, namespace, the worker's resources, nodeSelector, node affinity, tolerations, the PVC,
/dev/shm, the image, the node counts, the auto-resume annotation, and the trainer's preset, grace period and torchrun
shutdown timeout (what a SIGTERM's checkpoint must write, and in how long); beside it, the evaluate step's GPU and
memory limit as compiled (`EvaluationResources`), against the same model. Each check is pass, warn, fail or n/a
with a one-line reason and a one-line fix (the seed's troubleshooting table where it has one). Every call goes
through `Kube.call` (timeouts, retries of transient errors); any other API error fails only its own check, and a 403
on reading cluster state warns (the step's service account may not be allowed to look), so the other checks still
run.

This module runs the checks in order; each check family is a module of its own (`CHECKS` below names them), its
outcome a `result.Check`."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kubernetes.client.exceptions import ApiException

from common.errors import InputError, StepFailed
from common.s3 import S3Settings, S3Source
from components.evaluate_checkpoint.resources import EvaluationResources
from components.kube import Kube, KubeSettings, api_client_from_environment, describe
from components.launch_training.apis import job_api
from components.launch_training.config import LaunchConfig
from components.preflight.checkpoint_throughput import check_checkpoint_throughput
from components.preflight.context import Context
from components.preflight.crd import check_crd
from components.preflight.device_plugins import check_device_plugins
from components.preflight.evaluation_memory import check_evaluation_memory
from components.preflight.fsx_pvc import check_pvc
from components.preflight.gpu_memory import check_gpu_memory
from components.preflight.image import check_image
from components.preflight.kueue import check_queue
from components.preflight.memory import check_memory
from components.preflight.mlflow_server import check_mlflow
from components.preflight.nodes import check_nodes
from components.preflight.permissions import check_permissions
from components.preflight.result import FAIL, NOT_APPLICABLE, WARN, Check, PreflightResult
from components.preflight.runtime import check_runtime

log = logging.getLogger(__name__)

UNREACHABLE_FIX = "rerun when the API server answers; check the step's network, the API endpoint and credentials"

# The checks in the order they run and report, each from its family's module.
CHECKS: tuple[tuple[str, Callable[[Context], Check]], ...] = (
    ("crd", check_crd),
    ("runtime", check_runtime),
    ("queue", check_queue),
    ("permissions", check_permissions),
    ("fsx-pvc", check_pvc),
    ("checkpoint-throughput", check_checkpoint_throughput),
    ("nodes", check_nodes),
    ("device-plugins", check_device_plugins),
    ("image", check_image),
    ("memory", check_memory),
    ("gpu-memory", check_gpu_memory),
    ("evaluation-memory", check_evaluation_memory),
    ("mlflow", check_mlflow),
)
CHECK_NAMES = tuple(name for name, _ in CHECKS)
# The checks that read the cluster; the others read the manifest.
API_CHECKS = frozenset(
    {"crd", "runtime", "queue", "permissions", "fsx-pvc", "checkpoint-throughput", "nodes", "device-plugins"}
)


# -- the entry points -------------------------------------------------------------------------------------


def preflight(
    cfg: LaunchConfig,
    api_client: Any = None,
    *,
    warn_only: bool = False,
    settings: KubeSettings | None = None,
    evaluation: EvaluationResources | None = None,
) -> PreflightResult:
    """Check the cluster for the PyTorchJob `cfg` makes, and the evaluate step's resources (`evaluation`; None: the
    default compile's) for its model; `api_client` replaces the in-cluster/kubeconfig one."""
    if cfg.backend == "local":
        reason = "backend local: torchrun runs on this machine, there is no cluster to check"
        return PreflightResult([Check(name, NOT_APPLICABLE, reason) for name in CHECK_NAMES], warn_only, "local run")
    spec, job = cfg.checked_job()  # not the storage: the dataset may not be staged yet when preflight runs
    api = job_api(spec.job_api)
    return check_manifest(
        job,
        api_client,
        memory_gib=spec.instance().memory_gib,
        instance_type=spec.instance_type,
        warn_only=warn_only,
        settings=settings,
        pod=api.runtime_pod(spec),
        runtime=api.runtime_manifest(spec),
        model=published_config(cfg) if cfg.init_from_model else None,
        evaluation=evaluation,
    )


def published_config(cfg: LaunchConfig) -> dict[str, Any] | str:
    """The config.json of the published model the run starts from: on the volume (given there, or staging's copy
    of an s3:// prefix), else read from S3 (one small object: the copy is staging's); or why it cannot be read."""
    local = Path(cfg.model_dir) / "config.json"
    try:
        if local.is_file() or not cfg.init_from_model.startswith("s3://"):
            return json.loads(local.read_text())
        source = S3Source(
            cfg.init_from_model, S3Settings(endpoint_url=cfg.s3_endpoint_url, workers=1), what="init_from_model"
        )
        try:
            key = f"{source.prefix.rstrip('/')}/config.json"
            return json.loads(source.client.get_object(Bucket=source.bucket, Key=key)["Body"].read())
        except Exception as exc:  # botocore's, a timeout, not JSON: the check says it
            raise source.fail(exc, f"reading {key}") from None
        finally:
            source.close()
    except (OSError, ValueError, InputError, StepFailed) as exc:
        return f"init_from_model {cfg.init_from_model}: config.json not read ({exc})"


def check_manifest(
    job: dict[str, Any],
    api_client: Any = None,
    *,
    memory_gib: int = 0,
    instance_type: str = "",
    warn_only: bool = False,
    settings: KubeSettings | None = None,
    pod: dict[str, Any] | None = None,
    runtime: dict[str, Any] | None = None,
    model: dict[str, Any] | str | None = None,
    evaluation: EvaluationResources | None = None,
) -> PreflightResult:
    """Check the cluster for a rendered job (`render_job`'s dict); `memory_gib`: the instance's. A TrainJob comes
    with the pod template its runtime makes of it (`pod`) and the runtime it expects (`runtime`); a run from a
    published model with its config.json (`model`; a string: why it could not be read); the evaluate step's
    resources (`evaluation`; None: the default compile's)."""
    api_client = api_client or api_client_from_environment()
    kube = Kube(api_client, settings or KubeSettings())
    ctx = Context(job, kube, api_client, memory_gib, instance_type, pod, runtime, model, evaluation)
    checks = [_guarded(name, fn, ctx) for name, fn in CHECKS]
    for c in checks:  # the log is all a failed step shows in the KFP UI (no artifact is uploaded): the fix goes too
        level = {FAIL: logging.ERROR, WARN: logging.WARNING}.get(c.status, logging.INFO)
        log.log(level, "preflight %s: %s (%s)%s", c.name, c.status, c.reason, f" Fix: {c.fix}" if c.fix else "")
    nodes = str(ctx.min_nodes) if ctx.min_nodes == ctx.max_nodes else f"{ctx.min_nodes} to {ctx.max_nodes}"
    target = f"{ctx.api.kind} `{ctx.namespace}/{job['metadata']['name']}`: {nodes} node(s)" + (
        f" of {instance_type}" if instance_type else ""
    )
    return PreflightResult(checks, warn_only, target)


def _guarded(name: str, fn: Callable[[Context], Check], ctx: Context) -> Check:
    """Run one check; an error it does not handle fails that check alone. Once the API server could not be reached
    at all (every retry of a call lost its connection), the checks that read the cluster fail at once, unattempted."""
    if ctx.unreachable and name in API_CHECKS:
        return Check(name, FAIL, f"not checked: {ctx.unreachable}", UNREACHABLE_FIX)
    try:
        return fn(ctx)
    except ApiException as exc:
        return Check(name, FAIL, f"Kubernetes API: {describe(exc)}", "see the API server's message; rerun when fixed")
    except StepFailed as exc:  # transient errors, retried to the end by Kube.call
        if not isinstance(exc.__cause__, ApiException) or exc.__cause__.status == 0:
            ctx.unreachable = "the Kubernetes API server is unreachable"
        return Check(name, FAIL, str(exc), UNREACHABLE_FIX)
    except Exception as exc:  # bad data from the server (an unparsable quantity), ...
        log.debug("preflight %s", name, exc_info=True)
        return Check(name, FAIL, f"{type(exc).__name__}: {exc}", "see the reason; rerun when fixed")
