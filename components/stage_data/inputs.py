"""What staging refuses before it reads anything, without importing torch: the CLI checks a submission's
parameters with it before the pipeline runs."""

from common.errors import InputError
from components.stage_data import SAMPLE_MB, SHARD_TOKENS
from trainer.layout import DatasetPaths

MAX_GROUPS = 64  # encoding pods of one staging


def check_inputs(
    source: str,
    storage_root: str,
    dataset: str,
    vocab_size: int = 4096,
    val_fraction: float = 0.05,
    workers: int = 16,
    chunk_size_mb: int = 8,
    shard_tokens: int = SHARD_TOKENS,
    tokenize_groups: int = 1,
    tokenizer_sample_mb: int = SAMPLE_MB,
    tokenizer_path: str = "",
    init_from_run_id: str = "",
) -> DatasetPaths:
    """What staging refuses before it reads anything (settings out of bounds, a source of another form, a bad dataset
    name), one line each, so that a submission's parameters are checked with it too; the dataset's paths."""
    if not 256 < vocab_size <= 2**32:
        raise InputError(f"vocab size {vocab_size} is out of range: it must be above 256 (the byte alphabet)")
    if not 0 < val_fraction < 0.5:
        raise InputError(f"val fraction {val_fraction} is out of range: it must be between 0 and 0.5")
    if not 1 <= workers <= 256:
        raise InputError(f"workers {workers} is out of range: it must be between 1 and 256")
    if not 1 <= chunk_size_mb <= 5 * 1024:
        raise InputError(f"chunk size {chunk_size_mb} MB is out of range: it must be between 1 MB and 5 GB")
    if not 1024 <= shard_tokens <= 2**31:
        raise InputError(f"shard tokens {shard_tokens} is out of range: it must be between 1024 and 2**31")
    if not 1 <= tokenize_groups <= MAX_GROUPS:
        raise InputError(f"tokenize groups {tokenize_groups} is out of range: it must be between 1 and {MAX_GROUPS}")
    if not 1 <= tokenizer_sample_mb <= 1024**2:
        raise InputError(f"tokenizer sample {tokenizer_sample_mb} MB is out of range: it must be between 1 MB and 1 TB")
    if tokenizer_path and init_from_run_id:
        raise InputError("tokenizer_path and init_from_run_id both choose the tokenizer: give one")
    check_source(source)
    try:
        return DatasetPaths.of(storage_root, dataset)
    except ValueError as exc:
        raise InputError(str(exc)) from None


def check_source(source: str) -> None:
    """s3://bucket/prefix, a file:// URI or a local path (whether it is there, only reading it tells)."""
    if source.startswith("s3://"):
        from common.s3 import parse_s3_uri

        parse_s3_uri(source)
    elif "://" in source and not source.startswith("file://"):
        raise InputError(f"source {source}: unsupported scheme (use s3://, file:// or a local path)")
