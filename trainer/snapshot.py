"""Which dataset snapshot a run trains on: the one it started on, even after its dataset is staged again.

Staging changed data writes a new snapshot (new shards, perhaps a new tokenizer) and makes it current; the
pipeline then hands the trainer the new one. A resumed run must not switch: its token ids would mean other
strings and its sample order would change under it. So the checkpoint records the snapshot, and on resume the
trainer keeps reading it (or, with --on-new-snapshot refuse, stops with one line naming both).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from trainer.errors import CheckpointError, DataError
from trainer.layout import META, DatasetPaths, dataset_of_snapshot

log = logging.getLogger(__name__)

KEEP, REFUSE = "keep", "refuse"
POLICIES = (KEEP, REFUSE)


def snapshot_record(data_dir: Path, meta: dict[str, Any]) -> dict[str, str]:
    """What a checkpoint records of the data it was trained on (the tokenizer: for a warm start from it)."""
    return {
        "dataset": dataset_of_snapshot(data_dir).name,
        "snapshot": data_dir.name,
        "tokenizer_sha256": meta.get("tokenizer_sha256", ""),
    }


def model_vocab(meta: dict[str, Any]) -> int:
    """The embedding rows of a model trained on a snapshot (its meta.json): the tokenizer's size padded to a
    multiple of 64, or in a snapshot staged before padding, the tokenizer's size itself (so its runs resume)."""
    return int(meta.get("model_vocab_size", meta["vocab_size"]))


def config_snapshot(config: dict[str, Any]) -> tuple[str, str]:
    """(dataset, snapshot) that a run's config.json names; by name, not path, so a moved storage root still finds
    it. A config from before snapshots has only the directory (its "snapshot" is then "tokenized")."""
    dataset = config.get("dataset", {})
    if "snapshot" in dataset:
        return dataset["dataset"], dataset["snapshot"]
    directory = Path(dataset.get("tokenized_dir") or config["trainer"]["data_dir"])
    return dataset_of_snapshot(directory).name, directory.name


def given_snapshot(data_dir: Path) -> Path:
    """--data-dir is a snapshot's directory, or a dataset's (then its current snapshot, as staging left it)."""
    if (data_dir / META).is_file():
        return data_dir
    try:
        current = DatasetPaths(data_dir).current_snapshot()
    except ValueError as exc:  # an unreadable current.json
        raise DataError(f"--data-dir {data_dir}: {exc}") from None
    if current is None:
        raise DataError(
            f"--data-dir {data_dir}: neither a dataset snapshot (no {META}) nor a staged dataset (no "
            "current.json): stage the dataset first"
        )
    return current


def training_snapshot(data_dir: Path, checkpoint: dict[str, Any] | None, policy: str = KEEP) -> Path:
    """The snapshot directory to train on: `data_dir`'s for a new run, else the one the checkpoint was trained on."""
    data_dir = given_snapshot(data_dir)
    if checkpoint is None:
        return data_dir
    recorded = checkpoint.get("data_snapshot")
    if recorded is None:  # a checkpoint from before snapshots (schema 1): the resume's warning says so
        return data_dir
    given = {"dataset": dataset_of_snapshot(data_dir).name, "snapshot": data_dir.name}
    if recorded["dataset"] != given["dataset"]:
        raise CheckpointError(
            f"--data-dir {data_dir} is of dataset {given['dataset']!r}, and this run trained on "
            f"{recorded['dataset']!r}: resume with its dataset, or start a new run"
        )
    if recorded["snapshot"] == given["snapshot"]:
        return data_dir
    if policy == REFUSE:
        raise CheckpointError(
            f"dataset {given['dataset']!r} was staged again: --data-dir is snapshot "
            f"{given['snapshot']}, this run's checkpoint was trained on snapshot "
            f"{recorded['snapshot']}; resume with --on-new-snapshot keep to go on with the "
            "checkpoint's, or start a new run (a warm start) on the new one"
        )
    kept = dataset_of_snapshot(data_dir).resolve_snapshot(recorded["snapshot"])
    if kept is None or not (kept / META).is_file():
        raise CheckpointError(
            f"this run trained on snapshot {recorded['snapshot']} of dataset {given['dataset']!r}, "
            f"which is gone ({kept} has no {META}): it cannot resume exactly; start a new run (a "
            f"warm start) on snapshot {given['snapshot']}"
        )
    log.warning(
        "dataset %r was staged again since this run started: the run keeps training on its snapshot %s, "
        "not on %s; a new run (or a warm start from this one) trains on the new data",
        given["dataset"],
        recorded["snapshot"],
        given["snapshot"],
    )
    return kept
