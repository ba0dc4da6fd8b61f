"""What the preflight's test files share: the run they check (`config`) and how they read a result."""

from __future__ import annotations

from typing import Any

from components.kube import KubeSettings
from components.launch_training.config import LaunchConfig
from components.preflight.result import PreflightResult

IMAGE = "registry.example.com/ml/hyperpod-pretrain-trainer:1.0"
ECR_IMAGE = "123456789012.dkr.ecr.us-east-1.amazonaws.com/hyperpod-pretrain-trainer:1"
FAST = KubeSettings(request_timeout_s=5, attempts=3, backoff_s=0.01, max_backoff_s=0.02)


def config(**overrides: Any) -> LaunchConfig:
    settings: dict[str, Any] = dict(
        storage_root="/fsx",
        dataset="synthetic",
        run_id="pf-1",
        backend="kubernetes",
        nnodes=2,
        nproc_per_node=8,
        pipeline_run_id="pipeline-pf-1",
        image=IMAGE,
        instance_type="ml.p5.48xlarge",
        owner_reference=False,
    )
    return LaunchConfig.of(**{**settings, **overrides})


def check(result: PreflightResult, name: str) -> Any:
    return next(c for c in result.checks if c.name == name)


def statuses(result: PreflightResult) -> dict[str, str]:
    return {c.name: c.status for c in result.checks}
