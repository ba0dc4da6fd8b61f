"""KFP wrapper of verify_nccl (core.py holds the logic)."""

from kfp import dsl

from components.kfp_support import COMPONENTS_IMAGE


@dsl.component(base_image=COMPONENTS_IMAGE, install_kfp_package=False)
def verify_nccl(
    storage_root: str,
    run_id: str,
    nnodes: int,
    nproc_per_node: int,
    report: dsl.Output[dsl.Markdown],
    metrics: dsl.Output[dsl.Metrics],
):
    """Check every rank's comms self-test and the run's NCCL lines; fails the step on any failed check."""
    from components.errors import StepFailed
    from components.kfp_support import log_numbers, setup_logging
    from components.verify_nccl.core import verify_nccl as run

    setup_logging()
    result = run(storage_root=storage_root, run_id=run_id, world_size=nnodes * nproc_per_node)
    with open(report.path, "w") as f:
        f.write(result.markdown())
    log_numbers(metrics, result.metrics())
    if not result.passed:
        raise StepFailed("; ".join(f"{c.name}: {c.reason}" for c in result.failures))
