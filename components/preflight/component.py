"""KFP wrapper of the preflight check (core.py holds the logic)."""

from kfp import dsl

from components.kfp_support import COMPONENTS_IMAGE


@dsl.component(base_image=COMPONENTS_IMAGE, install_kfp_package=False)
def preflight(
    storage_root: str,
    dataset: str,
    run_id: str,
    resume_run_id: str,
    pipeline_run_id: str,
    backend: str,
    nnodes: int,
    max_nodes: int,
    nproc_per_node: int,
    preset: str,
    init_from_model: str,
    mlflow_tracking_uri: str,
    image: str,
    namespace: str,
    instance_type: str,
    job_options: dict,
    platform: dict,
    evaluation: dict,
    warn_only: bool,
    report: dsl.Output[dsl.Markdown],
):
    """Check the cluster for the job the launcher would create (job API, runtime, queue, permissions, FSx PVC,
    checkpoint throughput, nodes, device plugins, image, memory, the MLflow server) and the evaluate step's GPU and
    memory (`evaluation`, compiled in) for its model; fails on any failed check unless `warn_only`."""
    from common.errors import StepFailed
    from components.evaluate_checkpoint.resources import EvaluationResources
    from components.kfp_support import setup_logging
    from components.launch_training.config import LaunchConfig
    from components.preflight.core import preflight as run
    from components.preflight.result import failure_message
    from components.run_summary.core import recorded_step, resolve_run_id

    setup_logging()
    run_id = resolve_run_id(run_id, resume_run_id, pipeline_run_id)
    # The first step of every pipeline run: naming the pipeline run marks the run directory as this run's, so that
    # a resume's summary reads its own steps' records, not the earlier pipeline run's (components/run_summary).
    with recorded_step(storage_root, run_id, "preflight", {"report": report.uri}, pipeline_run_id) as record:
        config = LaunchConfig.of_step(
            storage_root=storage_root,
            dataset=dataset,
            run_id=run_id,
            resume_run_id=resume_run_id,
            pipeline_run_id=pipeline_run_id,
            backend=backend,
            nnodes=nnodes,
            max_nodes=max_nodes,
            nproc_per_node=nproc_per_node,
            preset=preset,
            init_from_model=init_from_model,
            mlflow_tracking_uri=mlflow_tracking_uri,
            image=image,
            namespace=namespace,
            instance_type=instance_type,
            job_options=job_options,
            owner_reference=False,  # the job is not created here: whose pod owns it does not matter
            platform=platform,
        )
        # Validates the config first (not the storage: not staged yet).
        result = run(config, warn_only=warn_only, evaluation=EvaluationResources.from_dict(evaluation))
        with open(report.path, "w") as f:
            f.write(result.markdown())
        if backend == "local":  # every check is n/a: nothing was checked, so there is no verdict to record
            record.state = "skipped"
            record.details = {"reason": "backend local: no cluster to check"}
        else:
            record.details = {"verdict": result.verdict()}
        if not result.passed:  # KFP uploads no report for a failed step: the message carries each fix
            raise StepFailed(failure_message(result))
