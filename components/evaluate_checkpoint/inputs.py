"""What the evaluation refuses before it reads anything, without importing torch: the CLI checks a submission's
parameters with it before the pipeline runs."""

from common.errors import InputError


def check_inputs(max_tokens: int, batch_size: int = 8, export: bool = True, export_s3_uri: str = "") -> None:
    """Bad settings fail before a checkpoint is read, one line naming them."""
    if max_tokens <= 0 or batch_size <= 0:
        raise InputError(f"max tokens and batch size must be positive, got {max_tokens} and {batch_size}")
    if export_s3_uri and (not export or not export_s3_uri.startswith("s3://")):
        raise InputError(f"export S3 URI {export_s3_uri!r}: give s3://bucket/prefix, with the export on")
