"""KFP wrapper of evaluate_checkpoint (core.py holds the logic)."""

from kfp import dsl

from components.kfp_support import COMPONENTS_IMAGE


@dsl.component(base_image=COMPONENTS_IMAGE, install_kfp_package=False)
def evaluate_checkpoint(
    storage_root: str,
    dataset: str,
    run_id: str,
    max_tokens: int,
    report: dsl.Output[dsl.Markdown],
    metrics: dsl.Output[dsl.Metrics],
):
    """Validation loss and perplexity of the run's latest checkpoint, beside the untrained model's."""
    from components.evaluate_checkpoint.core import evaluate_checkpoint as run
    from components.kfp_support import log_numbers, setup_logging

    setup_logging()
    result = run(storage_root=storage_root, dataset=dataset, run_id=run_id, max_tokens=max_tokens)
    with open(report.path, "w") as f:
        f.write(result.markdown())
    log_numbers(metrics, result)
