"""KFP wrapper of stage_data (core.py holds the logic)."""

from kfp import dsl

from components.kfp_support import COMPONENTS_IMAGE


@dsl.component(base_image=COMPONENTS_IMAGE, install_kfp_package=False)
def stage_data(
    source: str,
    storage_root: str,
    dataset: str,
    include: list,
    vocab_size: int,
    val_fraction: float,
    tokenizer_path: str,
    metrics: dsl.Output[dsl.Metrics],
) -> str:
    """Mirror the source onto the shared volume and tokenize it; returns the tokenized directory."""
    from components.kfp_support import log_numbers, setup_logging
    from components.stage_data.core import stage_data as run

    setup_logging()
    result = run(
        source=source,
        storage_root=storage_root,
        dataset=dataset,
        include=include,
        vocab_size=vocab_size,
        val_fraction=val_fraction,
        tokenizer_path=tokenizer_path,
    )
    log_numbers(metrics, result)
    return result.tokenized_dir
