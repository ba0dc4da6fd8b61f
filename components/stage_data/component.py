"""KFP wrapper of stage_data (core.py holds the logic)."""

from kfp import dsl

from components.kfp_support import COMPONENTS_IMAGE


@dsl.component(base_image=COMPONENTS_IMAGE, install_kfp_package=False)
def stage_data(
    source: str,
    storage_root: str,
    dataset: str,
    include: list,
    exclude: list,
    vocab_size: int,
    val_fraction: float,
    tokenizer_path: str,
    endpoint_url: str,
    workers: int,
    chunk_size_mb: int,
    keep_deleted: bool,
    metrics: dsl.Output[dsl.Metrics],
    report: dsl.Output[dsl.Markdown],
) -> str:
    """Mirror the source (S3 or local) onto the shared volume and tokenize it; returns the tokenized directory."""
    from components.kfp_support import log_numbers, setup_logging
    from components.stage_data.core import stage_data as run
    from components.stage_data.core import summary_markdown

    setup_logging()
    result = run(
        source=source,
        storage_root=storage_root,
        dataset=dataset,
        include=include,
        exclude=exclude,
        vocab_size=vocab_size,
        val_fraction=val_fraction,
        tokenizer_path=tokenizer_path,
        endpoint_url=endpoint_url,
        workers=workers,
        chunk_size_mb=chunk_size_mb,
        keep_deleted=keep_deleted,
    )
    log_numbers(metrics, result)
    with open(report.path, "w") as f:
        f.write(summary_markdown(source, result))
    return result.tokenized_dir
