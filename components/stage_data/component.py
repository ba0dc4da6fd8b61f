"""KFP wrappers of staging's three steps (core.py and tokenization/ hold the logic): mirror and plan, encode one
group (the pipeline runs one per group, in parallel), finalize the snapshot."""

from typing import NamedTuple

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
    text_field: str,
    max_bad_records: int,
    endpoint_url: str,
    workers: int,
    chunk_size_mb: int,
    keep_deleted: bool,
    tokenize_groups: int,
    tokenizer_sample_mb: int,
    init_from_run_id: str,
    init_from_model: str,
    skip: bool,
    run_id: str,
    resume_run_id: str,
    pipeline_run_id: str,
    metrics: dsl.Output[dsl.Metrics],
    report: dsl.Output[dsl.Markdown],
    mixture: list = [],  # noqa: B006 - KFP reads the default from the signature
) -> list:
    """Mirror the source (S3 or local) onto the shared volume and plan its snapshot (val split, tokenizer, groups);
    returns one work item per group to encode, {"snapshot": id, "group": n, "init_from": run} (at least one: a
    group of a finished snapshot does nothing; "init_from": a warm start's origin, resolved, whose tokenizer the
    snapshot uses). With `init_from_model`, a published model to start from, copied onto the volume if in S3 (also
    with `skip`) and checked; the snapshot uses its tokenizer unless tokenizer_path names another. With `skip`, the
    dataset's current snapshot (fails if it was never staged). With `mixture` ({dataset, weight, source?,
    text_field?} each; components/stage_data/mixture.py), each entry instead of `source`, the items of them all naming
    their dataset and weight."""
    from dataclasses import replace

    from components.kfp_support import log_numbers, setup_logging
    from components.run_summary.core import recorded_step, resolve_run_id
    from components.stage_data.core import mirror_and_plan, plan_markdown, staged_dataset, starting_model
    from components.stage_data.settings import StageSettings
    from components.stage_data.snapshots import resolve_init_run

    setup_logging()
    run_id = resolve_run_id(run_id, resume_run_id, pipeline_run_id)
    settings = StageSettings.of_step(
        source=source,
        storage_root=storage_root,
        dataset=dataset,
        include=include,
        exclude=exclude,
        vocab_size=vocab_size,
        val_fraction=val_fraction,
        tokenizer_path=tokenizer_path,
        text_field=text_field,
        max_bad_records=max_bad_records,
        endpoint_url=endpoint_url,
        workers=workers,
        chunk_size_mb=chunk_size_mb,
        keep_deleted=keep_deleted,
        tokenize_groups=tokenize_groups,
        tokenizer_sample_mb=tokenizer_sample_mb,
        init_from_run_id=init_from_run_id,
        init_from_model=init_from_model,
        run_id=run_id,
    )  # each mixture entry: its own source, dataset and text field (components/stage_data/mixture.py)
    with recorded_step(storage_root, run_id, "stage-data", {"report": report.uri}) as record:
        if mixture:
            from components.stage_data.mixture import mixture_markdown, mixture_sources, plan_mixture

            sources = mixture_sources(mixture)
            if skip:  # each dataset as staged before
                sources = [replace(s, source="") for s in sources]
            work = plan_mixture(sources, settings)
            record.details = {"mixture": {s.dataset: s.weight for s in sources}, "groups": len(work)}
            log_numbers(metrics, {"datasets": len(sources), "groups": len(work)})
            with open(report.path, "w") as f:
                f.write(mixture_markdown(sources, work))
            return work
        if skip:
            directory, meta = staged_dataset(storage_root, dataset)
            record.state = "skipped"
            record.details = {"train_tokens": meta["tokens"]["train"], "dataset": dataset, "snapshot": directory.name}
            log_numbers(metrics, {"train_tokens": meta["tokens"]["train"], "val_tokens": meta["tokens"]["val"]})
            with open(report.path, "w") as f:
                f.write(
                    f"# Staging skipped\n\nThe run trains on the dataset's current snapshot, staged before: "
                    f"`{directory}` ({meta['tokens']['train']} train and {meta['tokens']['val']} val "
                    "tokens).\n"
                )
            init_from = resolve_init_run(storage_root, dataset, init_from_run_id, run_id)
            starting_model(settings)
            return [{"snapshot": directory.name, "group": 0, "init_from": init_from}]
        result = mirror_and_plan(settings)
        record.details = {
            "files_copied": result.files_copied,
            "groups": result.groups,
            "dataset": dataset,
            "snapshot": result.snapshot,
        }
        if init_from_model:  # the published model to start from: as given, and where it is on the volume
            record.details |= {"init_from_model": init_from_model, "model_dir": result.init_from_model}
        log_numbers(metrics, result)
        with open(report.path, "w") as f:
            f.write(plan_markdown(source, result))
        return [
            {"snapshot": result.snapshot, "group": group, "init_from": result.init_from_run_id}
            for group in range(max(1, result.groups))
        ]


@dsl.component(base_image=COMPONENTS_IMAGE, install_kfp_package=False)
def tokenize_group(
    storage_root: str,
    dataset: str,
    work: dict,
    run_id: str,
    resume_run_id: str,
    pipeline_run_id: str,
    metrics: dsl.Output[dsl.Metrics],
):
    """Encode one group of the planned snapshot (`work`: {"snapshot": id, "group": n}, and of a mixture the dataset)
    into its shards; a retried pod carries on after the last file it finished. Nothing to do when the snapshot
    exists."""
    from components.kfp_support import log_numbers, setup_logging
    from components.run_summary.core import recorded_step, resolve_run_id
    from components.stage_data.tokenization.encode import encode_group
    from trainer.layout import DatasetPaths

    setup_logging()
    run_id = resolve_run_id(run_id, resume_run_id, pipeline_run_id)
    snapshot, group, dataset = str(work["snapshot"]), int(work["group"]), str(work.get("dataset") or dataset)
    step = f"tokenize-data-g{group:03d}-{dataset}" if "dataset" in work else f"tokenize-data-g{group:03d}"
    with recorded_step(storage_root, run_id, step, {}) as record:
        result = encode_group(DatasetPaths.of(storage_root, dataset), snapshot, group)
        record.details = {"files": result.files, "files_resumed": result.files_resumed, **result.tokens}
        log_numbers(
            metrics,
            {
                "files": result.files,
                "files_resumed": result.files_resumed,
                "text_mb": result.text_bytes / 1e6,
                **result.tokens,
            },
        )


@dsl.component(base_image=COMPONENTS_IMAGE, install_kfp_package=False)
def finalize_snapshot(
    storage_root: str,
    dataset: str,
    work: list,
    run_id: str,
    resume_run_id: str,
    pipeline_run_id: str,
    metrics: dsl.Output[dsl.Metrics],
    report: dsl.Output[dsl.Markdown],
) -> NamedTuple("Outputs", snapshot=str, init_from=str, dataset=str, mixture=list):  # noqa: UP014
    """Gather the groups' shards into the snapshot's meta.json (`work`: stage_data's items, all of one snapshot, or
    of a mixture's), put it in place and make it the dataset's current one; returns its id, which the training step
    trains on, the warm start's origin run ("" for none), the dataset trained on (a mixture's first) and the mixture
    ({dataset, weight, snapshot} each; [] for one dataset)."""
    from collections import namedtuple

    from components.kfp_support import log_numbers, setup_logging
    from components.run_summary.core import recorded_step, resolve_run_id
    from components.stage_data.core import finish_snapshot, snapshot_markdown
    from components.stage_data.report import details

    setup_logging()
    run_id = resolve_run_id(run_id, resume_run_id, pipeline_run_id)
    outputs = namedtuple("Outputs", ["snapshot", "init_from", "dataset", "mixture"])
    snapshot, init_from = str(work[0]["snapshot"]), str(work[0].get("init_from", ""))
    with recorded_step(storage_root, run_id, "finalize-data", {"report": report.uri}) as record:
        if "dataset" in work[0]:  # a mixture's
            from components.stage_data.mixture import finish_mixture

            mixture, text = finish_mixture(storage_root, work)
            record.details = {"mixture": mixture}
            log_numbers(metrics, {f"train_tokens_{m['dataset']}": m["train_tokens"] for m in mixture})
            with open(report.path, "w") as f:
                f.write(text)
            chosen = [{k: m[k] for k in ("dataset", "weight", "snapshot")} for m in mixture]
            return outputs(chosen[0]["snapshot"], init_from, chosen[0]["dataset"], chosen)
        result = finish_snapshot(storage_root, dataset, snapshot)
        record.details = {"snapshot": snapshot, "train_tokens": result.train_tokens, **details(result.documents)}
        log_numbers(metrics, result)
        with open(report.path, "w") as f:
            f.write(snapshot_markdown(result))
        return outputs(result.snapshot, init_from, dataset, [])
