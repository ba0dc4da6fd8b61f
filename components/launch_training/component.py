"""KFP wrapper of the launcher (core.py holds the logic)."""

from typing import NamedTuple

from kfp import dsl

from components.kfp_support import COMPONENTS_IMAGE


@dsl.component(base_image=COMPONENTS_IMAGE, install_kfp_package=False)
def launch_pytorchjob(
    storage_root: str,
    dataset: str,
    snapshot: str,
    init_from_run_id: str,
    init_from_model: str,
    run_id: str,
    resume_run_id: str,
    pipeline_run_id: str,
    backend: str,
    nnodes: int,
    max_nodes: int,
    nproc_per_node: int,
    preset: str,
    max_steps: int,
    seed: int,
    batch_size: int,
    seq_len: int,
    lr: float,
    warmup_steps: int,
    extend_schedule: str,
    weight_decay: float,
    dropout: float,
    checkpoint_every: int,
    log_every: int,
    eval_every: int,
    checkpoint_s3_uri: str,
    s3_endpoint_url: str,
    mlflow_tracking_uri: str,
    mlflow_experiment: str,
    timeout_s: int,
    pending_timeout_s: int,
    recovery_timeout_s: int,
    queue_timeout_s: int,
    stall_timeout_s: int,
    image: str,
    namespace: str,
    instance_type: str,
    job_options: dict,
    stream_logs: str,
    owner_reference: bool,
    platform: dict,
    metrics: dsl.Output[dsl.Metrics],
    report: dsl.Output[dsl.Markdown],
    mixture: list = [],  # noqa: B006 - KFP reads the default from the signature
) -> NamedTuple("Outputs", run_id=str, job_name=str, namespace=str, state=str, attempt=int):  # noqa: UP014
    """Train with torchrun (locally, or as a PyTorchJob or TrainJob that a retried step re-attaches to, or replaces
    when it failed); returns the run id. With `resume_run_id`, training continues in that run's directory from its
    newest checkpoint; `extend_schedule` lets that resume go on to other settings: "continue" (a larger max_steps, the
    decay going on from the current learning rate) or "rewarm" (also another lr or warmup_steps). With
    `checkpoint_s3_uri`, the trainer copies each committed checkpoint to <checkpoint_s3_uri>/<run_id>/ in S3. With
    `init_from_model` (a published model's directory on the volume, or an s3:// prefix, read where staging copied
    it), the run starts from its weights and architecture, and `preset` is not used. With `mlflow_tracking_uri`, the
    trainer sends its metrics to that MLflow server too, in one MLflow run of `mlflow_experiment` per run.
    With `mixture` (staging's: {dataset, weight, snapshot} each), it trains on those datasets by their weights.
    `platform` is compiled in (the job API, the FSx PVC and its mount path, the Kueue queue), not a run parameter."""
    inputs = dict(locals())  # each input, by the name LaunchConfig.of_step knows it by (the outputs aside)
    from collections import namedtuple

    from components.kfp_support import log_numbers, setup_logging
    from components.launch_training.apis import job_api
    from components.launch_training.config import LaunchConfig
    from components.launch_training.core import launch, summary_markdown
    from components.run_summary.core import recorded_step

    setup_logging()
    config = LaunchConfig.of_step(**{k: v for k, v in inputs.items() if k not in ("metrics", "report")})
    with recorded_step(storage_root, config.run_id, "launch-pytorchjob", {"report": report.uri}) as record:
        if backend == "kubernetes":
            kind = job_api(config.platform.job_api).kind
            record.details = {"job_name": config.job_name, "namespace": namespace, "job_kind": kind}
        result = launch(config)
        if result.state:
            record.details |= {"state": result.state, "attempt": result.attempt}
    log_numbers(metrics, {k: v for k, v in vars(result).items() if v is not None})
    with open(report.path, "w") as f:
        f.write(summary_markdown(result))
    outputs = namedtuple("Outputs", ["run_id", "job_name", "namespace", "state", "attempt"])
    return outputs(result.run_id, result.job_name, result.namespace, result.state, result.attempt)
