"""The published model a run starts from (init_from_model), as staging finds it before anything is staged.

It is a directory on the volume, or an S3 prefix that staging copies onto the volume once (trainer/layout.py
ModelPaths), with the corpus mirror's machinery: verified against the listing's sizes and ETags, never half-written,
and copied again only where an object changed, so the next run of the same model copies nothing. The directory is
checked as the trainer checks it (trainer/published.py), so a bad model fails here, before any GPU is requested.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from common.errors import InputError
from components.stage_data.mirror import mirror, staging_lock
from components.stage_data.settings import check_source
from trainer.errors import CheckpointError
from trainer.layout import TOKENIZER, ModelPaths
from trainer.published import PublishedModel

if TYPE_CHECKING:
    from tokenizers import Tokenizer

log = logging.getLogger(__name__)

INPUT = "init_from_model"


def published_model(
    uri: str, storage_root: str, endpoint_url: str = "", workers: int = 16, chunk_size_mb: int = 8
) -> PublishedModel:
    """The checked model `uri` names (a directory, file:// or s3://), copied onto the volume first if in S3."""
    path = (
        copy_from_s3(uri, storage_root, endpoint_url, workers, chunk_size_mb)
        if uri.startswith("s3://")
        else Path(uri.removeprefix("file://"))
    )
    if not path.is_dir():
        raise InputError(f"{INPUT} {uri}: no such directory")
    try:
        return PublishedModel.read(path, where=f"{INPUT} {uri}")
    except CheckpointError as exc:
        raise InputError(str(exc)) from None


def copy_from_s3(uri: str, storage_root: str, endpoint_url: str, workers: int, chunk_size_mb: int) -> Path:
    """Mirror the prefix into its ModelPaths on the volume; returns the directory the trainer reads."""
    from common.s3 import S3Settings, S3Source

    check_source(uri, INPUT)
    paths = ModelPaths.of(storage_root, uri)
    source = S3Source(
        uri, S3Settings(endpoint_url=endpoint_url, workers=workers, chunk_size=chunk_size_mb * 2**20), what=INPUT
    )
    try:
        objects = source.list()
        with staging_lock(paths):
            copied = mirror(source, objects, paths, workers, keep_deleted=False, listed=objects)
    finally:
        source.close()
    if copied.files_copied:
        log.info(
            "%s %s: copied %d of its %d files (%.2f GB) to %s",
            INPUT,
            uri,
            copied.files_copied,
            copied.files,
            copied.bytes_copied / 1e9,
            paths.raw,
        )
    else:
        log.info(
            "%s %s: the copy in %s is up to date (%d files, %.2f GB): nothing copied",
            INPUT,
            uri,
            paths.raw,
            copied.files,
            copied.bytes / 1e9,
        )
    return paths.raw


def check_tokenizer(model: PublishedModel, uri: str, tokenizer: Tokenizer, where: str) -> None:
    """Refuse, in one line, a tokenizer (`where`: as the user gave it) whose ids would not mean the model's tokens."""
    if mismatch := model.tokenizer_mismatch(tokenizer):
        raise InputError(
            f"tokenizer_path {where} does not fit {INPUT} {uri}: {mismatch}; leave tokenizer_path empty "
            "to stage with the model's own"
        )


def own_tokenizer(model: PublishedModel, uri: str) -> str:
    """The model directory, as the tokenizer to stage with when none is given: it must hold a tokenizer.json."""
    if not (model.path / TOKENIZER).is_file():
        raise InputError(
            f"{INPUT} {uri} holds no {TOKENIZER}: give tokenizer_path, the tokenizer the model was trained with"
        )
    return str(model.path)
