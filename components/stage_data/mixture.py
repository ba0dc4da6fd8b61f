"""Staging a mixture: each entry's source mirrored and planned as a dataset of its own, all with one tokenizer.

The pipeline's `mixture` parameter is a list of {dataset, weight, source?, text_field?}; an entry without a source
trains on its dataset as staged before. The first entry's tokenizer (given, a warm start's, a published model's, or
trained on its corpus) stages every other entry, so their token ids mean the same strings; the other entries are
mirrored and planned in parallel. Their groups join one fan-out of encoders (the corpus-sized work), and the finalize
step makes each snapshot current and checks that they share the tokenizer.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from common.errors import InputError
from components.stage_data.settings import StageSettings, check_source
from trainer.errors import DataError
from trainer.layout import META, TOKENIZER, DatasetPaths, check_name
from trainer.mixture import entry_weights, one_tokenizer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MixtureSource:
    dataset: str
    weight: float
    source: str = ""  # "": the dataset as staged before
    text_field: str = ""  # "": the run's text_field


def mixture_sources(entries: list[Any]) -> list[MixtureSource]:
    """The `mixture` parameter, checked: one line naming what is wrong."""
    try:
        weighed = entry_weights(entries, {"source", "text_field"})
    except ValueError as exc:
        raise InputError(str(exc)) from None
    sources = []
    for entry, (dataset, weight) in zip(entries, weighed, strict=True):
        try:
            check_name("dataset", dataset)
        except ValueError as exc:
            raise InputError(f"mixture: {exc}") from None
        source = str(entry.get("source") or "")
        if source:
            check_source(source, f"mixture source of {dataset!r}")
        sources.append(MixtureSource(dataset, weight, source, str(entry.get("text_field") or "")))
    return sources


def plan_mixture(sources: list[MixtureSource], settings: StageSettings) -> list[dict[str, Any]]:
    """Mirror and plan each entry with a source (the first with the run's tokenizer settings, the others with its
    tokenizer, in parallel); the encoders' work items of them all, each naming its dataset and weight."""
    from components.stage_data.core import mirror_and_plan, staged_dataset, starting_model
    from components.stage_data.snapshots import resolve_init_run
    from components.stage_data.tokenization.snapshot import building_dir

    def plan(source: MixtureSource, tokenizer: str) -> tuple[list[dict[str, Any]], Path]:
        """One entry's work items, and the tokenizer.json its snapshot is (or will be) staged with."""
        item = {"dataset": source.dataset, "weight": source.weight}
        if not source.source:
            directory, _ = staged_dataset(settings.storage_root, source.dataset)
            init_from = ""
            if not tokenizer:  # the first entry: the warm start's origin, the published model copied (as staged)
                init_from = resolve_init_run(
                    settings.storage_root, source.dataset, settings.init_from_run_id, settings.run_id
                )
                starting_model(settings)
            return [item | {"snapshot": directory.name, "group": 0, "init_from": init_from}], directory / TOKENIZER
        entry = replace(
            settings, source=source.source, dataset=source.dataset, text_field=source.text_field or settings.text_field
        )
        if tokenizer:  # the first entry's: no other tokenizer, warm start or model to stage with
            entry = replace(entry, tokenizer_path=tokenizer, init_from_run_id="", init_from_model="")
        result = mirror_and_plan(entry)
        paths = DatasetPaths.of(settings.storage_root, source.dataset)
        built = paths.snapshot(result.snapshot)
        where = built if (built / META).is_file() else building_dir(paths, result.snapshot)
        items = [
            item | {"snapshot": result.snapshot, "group": group, "init_from": result.init_from_run_id}
            for group in range(max(1, result.groups))
        ]
        return items, where / TOKENIZER

    first, tokenizer = plan(sources[0], "")
    rest = sources[1:]
    with ThreadPoolExecutor(max_workers=max(1, len(rest)), thread_name_prefix="stage-mixture") as pool:
        planned = list(pool.map(lambda s: plan(s, str(tokenizer))[0], rest))
    log.info(
        "mixture: %s staged with the tokenizer of %r (%s)",
        ", ".join(repr(s.dataset) for s in sources),
        sources[0].dataset,
        tokenizer,
    )
    return first + [item for items in planned for item in items]


def finish_mixture(storage_root: str, work: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], str]:
    """Finalize each entry's snapshot (in the mixture's order) and check they share one tokenizer; each entry's
    {dataset, weight, snapshot, train_tokens, val_tokens}, and the step's report."""
    from components.stage_data.core import finish_snapshot, snapshot_markdown
    from trainer.data import load_meta

    entries: dict[str, dict[str, Any]] = {}
    for item in work:
        entries.setdefault(str(item["dataset"]), {"weight": float(item["weight"]), "snapshot": str(item["snapshot"])})
    finished, sections, tokenizers = [], [], {}
    for dataset, entry in entries.items():
        result = finish_snapshot(storage_root, dataset, entry["snapshot"])
        tokenizers[dataset] = load_meta(Path(result.snapshot_dir)).get("tokenizer_sha256", "")
        finished.append(
            {"dataset": dataset, **entry, "train_tokens": result.train_tokens, "val_tokens": result.val_tokens}
        )
        sections.append(snapshot_markdown(result).replace("## Dataset snapshot", f"## Dataset {dataset!r}", 1))
    try:
        one_tokenizer(
            tokenizers,
            "mixture",
            "give it a source to stage it again with the first's tokenizer, or stage both with the same tokenizer_path",
        )
    except DataError as exc:
        raise InputError(str(exc)) from None
    total = sum(e["weight"] for e in finished)
    table = ["## Mixture", "", "| dataset | weight | share | snapshot | train tokens |", "|---|---:|---:|---|---:|"]
    table += [
        f"| {e['dataset']} | {e['weight']:g} | {e['weight'] / total:.1%} | `{e['snapshot']}` | {e['train_tokens']:,} |"
        for e in finished
    ]
    return finished, "\n".join([*table, "", *sections])


def mixture_markdown(sources: list[MixtureSource], work: list[dict[str, Any]]) -> str:
    """The staging step's report of a mixture: each entry's source and what is left to encode."""
    lines = [
        "## Data staging: a mixture",
        "",
        "| dataset | weight | source | groups to encode |",
        "|---|---:|---|---:|",
    ]
    for source in sources:
        groups = sum(1 for item in work if item["dataset"] == source.dataset)
        lines.append(f"| {source.dataset} | {source.weight:g} | {source.source or '(as staged before)'} | {groups} |")
    return "\n".join(lines)
