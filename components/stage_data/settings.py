"""Staging's settings as one object, checked once before anything is read, without importing numpy, tokenizers or
torch: the CLI checks a submission's parameters with it before the pipeline runs."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from common.errors import InputError
from components.stage_data import SAMPLE_MB, SHARD_TOKENS, TEXT_FIELD, VAL_FRACTION, VOCAB_SIZE
from components.stage_data.sources import DEFAULT_EXCLUDE
from trainer.layout import DatasetPaths

MAX_GROUPS = 64  # encoding pods of one staging


@dataclass(frozen=True)
class StageSettings:
    """Where the corpus comes from and goes, how it is read, tokenized and split."""

    source: str
    storage_root: str
    dataset: str
    include: tuple[str, ...] = ("*",)
    exclude: tuple[str, ...] = DEFAULT_EXCLUDE
    # the tokenizer: trained (vocab_size, on tokenizer_sample_mb of the train text), or given
    vocab_size: int = VOCAB_SIZE
    tokenizer_sample_mb: int = SAMPLE_MB
    tokenizer_path: str = ""  # a tokenizer.json, or a directory or s3:// prefix holding one
    init_from_run_id: str = ""  # a warm start: that run's tokenizer
    init_from_model: str = ""  # a published model to start from (a directory or s3:// prefix): its tokenizer
    # documents
    text_field: str = ""  # JSON Lines and Parquet: the text's field, a dotted path ("": TEXT_FIELD)
    max_bad_records: int = 0  # malformed records skipped (and counted) before the staging is refused
    val_fraction: float = VAL_FRACTION
    # the mirror
    endpoint_url: str = ""
    workers: int = 16
    chunk_size_mb: int = 8
    keep_deleted: bool = False
    # the snapshot
    shard_tokens: int = SHARD_TOKENS
    tokenize_groups: int = 1
    run_id: str = ""  # the run staging for (a warm start from "previous" skips it)

    @classmethod
    def of_step(
        cls,
        source: str,
        storage_root: str,
        dataset: str,
        include: Iterable[str] = ("*",),
        exclude: Iterable[str] = DEFAULT_EXCLUDE,
        **settings: Any,
    ) -> StageSettings:
        """From the staging step's inputs (lists where KFP passes lists), the step's names for them."""
        known = set(cls.__dataclass_fields__)
        return cls(
            source,
            storage_root,
            dataset,
            tuple(include),
            tuple(exclude),
            **{k: v for k, v in settings.items() if k in known},
        )

    @property
    def field_path(self) -> str:
        return self.text_field or TEXT_FIELD

    def check(self, source_given: bool = True) -> DatasetPaths:
        """What staging refuses before it reads anything (settings out of bounds, a source of another form, a bad
        dataset name), one line each; the dataset's paths. Not `source_given`: the other settings only (a
        submission's check, which requires the source itself)."""
        if source_given and not self.source.strip():
            raise InputError(
                "source is empty: give the corpus to stage (s3://bucket/prefix, a file:// URI or a path), "
                "or a mixture of several"
            )
        if not 256 < self.vocab_size <= 2**32:
            raise InputError(f"vocab size {self.vocab_size} is out of range: it must be above 256 (the byte alphabet)")
        if not 0 < self.val_fraction < 0.5:
            raise InputError(f"val fraction {self.val_fraction} is out of range: it must be between 0 and 0.5")
        if not 1 <= self.workers <= 256:
            raise InputError(f"workers {self.workers} is out of range: it must be between 1 and 256")
        if not 1 <= self.chunk_size_mb <= 5 * 1024:
            raise InputError(f"chunk size {self.chunk_size_mb} MB is out of range: it must be between 1 MB and 5 GB")
        if not 1024 <= self.shard_tokens <= 2**31:
            raise InputError(f"shard tokens {self.shard_tokens} is out of range: it must be between 1024 and 2**31")
        if not 1 <= self.tokenize_groups <= MAX_GROUPS:
            raise InputError(
                f"tokenize groups {self.tokenize_groups} is out of range: it must be between 1 and {MAX_GROUPS}"
            )
        if not 1 <= self.tokenizer_sample_mb <= 1024**2:
            raise InputError(
                f"tokenizer sample {self.tokenizer_sample_mb} MB is out of range: it must be between 1 MB and 1 TB"
            )
        if self.max_bad_records < 0:
            raise InputError(f"max bad records {self.max_bad_records} is out of range: it must be 0 or more")
        if any(not part or part != part.strip() for part in self.field_path.split(".")):
            raise InputError(
                f"text field {self.text_field!r}: give a field name, or a dotted path such as content.body"
            )
        if self.tokenizer_path and self.init_from_run_id:
            raise InputError("tokenizer_path and init_from_run_id both choose the tokenizer: give one")
        if self.init_from_model and self.init_from_run_id:
            raise InputError(
                "init_from_run_id (a run's weights) and init_from_model (a published model's) are two "
                "starting points: give one"
            )
        if self.source:
            check_source(self.source)
        if self.init_from_model:
            check_source(self.init_from_model, "init_from_model")
        if self.tokenizer_path.startswith("s3://"):
            check_source(self.tokenizer_path, "tokenizer")
        elif "://" in self.tokenizer_path and not self.tokenizer_path.startswith("file://"):
            raise InputError(f"tokenizer {self.tokenizer_path}: unsupported scheme (use s3://, file:// or a path)")
        try:
            return DatasetPaths.of(self.storage_root, self.dataset)
        except ValueError as exc:
            raise InputError(str(exc)) from None


def check_source(source: str, what: str = "source") -> None:
    """s3://bucket/prefix, a file:// URI or a local path (whether it is there, only reading it tells)."""
    if source.startswith("s3://"):
        from common.s3 import parse_s3_uri

        try:
            parse_s3_uri(source)
        except InputError as exc:
            raise InputError(str(exc).replace("source ", f"{what} ", 1)) from None
    elif "://" in source and not source.startswith("file://"):
        raise InputError(f"{what} {source}: unsupported scheme (use s3://, file:// or a local path)")
