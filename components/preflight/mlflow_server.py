"""The mlflow check: the MLflow tracking server the trainer is to report to answers (a warning when not: the
trainer trains on without it)."""

from __future__ import annotations

from components.preflight.context import Context
from components.preflight.result import NOT_APPLICABLE, PASS, WARN, Check
from trainer.tracking import probe


def check_mlflow(ctx: Context) -> Check:
    """The MLflow tracking server the trainer is to send its metrics to, asked once: one that does not answer is a
    warning, never a failure (the trainer trains on without it and counts what it could not send)."""
    uri = ctx.trainer_flag("--mlflow-tracking-uri", "")
    if not uri:
        return Check("mlflow", NOT_APPLICABLE, "no mlflow_tracking_uri: the run is watched in TensorBoard alone")
    experiment = ctx.trainer_flag("--mlflow-experiment", "")
    if why := probe(uri, experiment):
        return Check(
            "mlflow",
            WARN,
            f"{uri} did not answer as an MLflow tracking server ({why}); the run trains without it",
            "check the URI, the step's network to it and its credentials (the pods' IAM role "
            "for a SageMaker ARN, MLFLOW_TRACKING_TOKEN otherwise)",
        )
    return Check("mlflow", PASS, f"{uri} answers; the run goes in experiment {experiment!r}")
