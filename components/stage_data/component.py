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
    skip: bool,
    run_id: str,
    resume_run_id: str,
    pipeline_run_id: str,
    metrics: dsl.Output[dsl.Metrics],
    report: dsl.Output[dsl.Markdown],
) -> str:
    """Mirror the source (S3 or local) onto the shared volume and tokenize it into a snapshot; returns the
    snapshot's id. With `skip`, returns the dataset's current snapshot (fails if it was never staged)."""
    from components.kfp_support import log_numbers, setup_logging
    from components.run_summary.core import recorded_step, resolve_run_id
    from components.stage_data.core import stage_data as run
    from components.stage_data.core import staged_dataset, summary_markdown

    setup_logging()
    run_id = resolve_run_id(run_id, resume_run_id, pipeline_run_id)
    with recorded_step(storage_root, run_id, "stage-data", {"report": report.uri}) as record:
        if skip:
            directory, meta = staged_dataset(storage_root, dataset)
            record.state = "skipped"
            record.details = {"train_tokens": meta["tokens"]["train"], "dataset": dataset,
                              "snapshot": directory.name}  # fmt: skip
            log_numbers(metrics, {"train_tokens": meta["tokens"]["train"], "val_tokens": meta["tokens"]["val"]})
            with open(report.path, "w") as f:
                f.write(f"# Staging skipped\n\nThe run trains on the dataset's current snapshot, staged before: "
                        f"`{directory}` ({meta['tokens']['train']} train and {meta['tokens']['val']} val "
                        "tokens).\n")  # fmt: skip
            return directory.name
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
        record.details = {"files_copied": result.files_copied, "train_tokens": result.train_tokens,
                          "dataset": dataset, "snapshot": result.snapshot}  # fmt: skip
        log_numbers(metrics, result)
        with open(report.path, "w") as f:
            f.write(summary_markdown(source, result))
        return result.snapshot
