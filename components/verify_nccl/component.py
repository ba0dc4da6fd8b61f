"""KFP wrapper of verify_nccl (core.py holds the logic)."""

from kfp import dsl

from components.kfp_support import COMPONENTS_IMAGE


@dsl.component(base_image=COMPONENTS_IMAGE, install_kfp_package=False)
def verify_nccl(
    storage_root: str,
    run_id: str,
    nnodes: int,
    max_nodes: int,
    nproc_per_node: int,
    instance_type: str,
    expect_transport: str,
    bandwidth_fails: bool,
    job_name: str,
    namespace: str,
    job_api: str,
    report: dsl.Output[dsl.Markdown],
    metrics: dsl.Output[dsl.Metrics],
):
    """Check every rank's comms self-test and the run's NCCL lines (and its pods' logs) of the run's latest attempt;
    fails on any failed check."""
    import tempfile
    from pathlib import Path

    from common.errors import StepFailed
    from components.kfp_support import log_numbers, setup_logging
    from components.run_summary.core import recorded_step
    from components.verify_nccl.core import Expectations, fetch_pod_logs
    from components.verify_nccl.core import verify_nccl as run
    from trainer.layout import RunPaths

    setup_logging()
    with recorded_step(storage_root, run_id, "verify-nccl", {"report": report.uri}) as record:
        expect = Expectations.for_job(
            nnodes, max_nodes, nproc_per_node, instance_type, expect_transport, bandwidth_fails
        )
        with tempfile.TemporaryDirectory() as pod_logs:
            logs = [str(p) for p in fetch_pod_logs(job_name, namespace, Path(pod_logs), job_api)] if job_name else []
            result = run(storage_root=storage_root, run_id=run_id, extra_logs=logs, expect=expect)
        with open(report.path, "w") as f:
            f.write(result.markdown())
        log_numbers(metrics, result.metrics())
        record.reports["volume"] = str(RunPaths.of(storage_root, run_id).comms_verification)
        record.details = {"checks_failed": len(result.failures)}
        if not result.passed:
            raise StepFailed("; ".join(f"{c.name}: {c.detail}" for c in result.failures))
