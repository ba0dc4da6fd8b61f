"""KFP wrapper of the run summary, the pipeline's exit step (core.py holds the logic)."""

from kfp import dsl

from components.kfp_support import COMPONENTS_IMAGE


@dsl.component(base_image=COMPONENTS_IMAGE, install_kfp_package=False)
def summarize_run(
    storage_root: str,
    run_id: str,
    resume_run_id: str,
    pipeline_run_id: str,
    backend: str,
    namespace: str,
    job_api: str,
    status: dsl.PipelineTaskFinalStatus,
    summary: dsl.Output[dsl.Markdown],
) -> str:
    """Every step's outcome, the job's name and the reports' links, in <root>/runs/<run_id>/summary.json; after a
    run that did not succeed, its job (`job_api`: the compiled one) is deleted if it still runs (a terminated run's
    launcher may be dead)."""
    import shutil

    from components.kfp_support import setup_logging
    from components.run_summary.core import job_cleanup, resolve_run_id
    from components.run_summary.core import summarize_run as run
    from trainer.layout import RunPaths

    setup_logging()
    run_id = resolve_run_id(run_id, resume_run_id, pipeline_run_id)
    result = run(
        storage_root,
        run_id,
        pipeline_run_id,
        state=status.state,
        error=status.error_message or "",
        cleanup=job_cleanup(backend, namespace, run_id, pipeline_run_id, job_api),
    )
    shutil.copyfile(RunPaths.of(storage_root, run_id).summary_report, summary.path)
    return result.state
