"""What the evaluation refuses before it reads anything, without importing torch: the CLI checks a submission's
parameters with it before the pipeline runs."""

from common.errors import InputError

DTYPES = ("auto", "bfloat16", "float32")  # the models' dtype while evaluated (loading.py evaluation_dtype)


def check_inputs(
    max_tokens: int, batch_size: int = 8, export: bool = True, export_s3_uri: str = "", dtype: str = "auto"
) -> None:
    """Bad settings fail before a checkpoint is read, one line naming them."""
    if dtype not in DTYPES:
        raise InputError(f"dtype {dtype!r}: give one of {', '.join(DTYPES)}")
    if max_tokens <= 0 or batch_size <= 0:
        raise InputError(f"max tokens and batch size must be positive, got {max_tokens} and {batch_size}")
    if export_s3_uri and (not export or not export_s3_uri.startswith("s3://")):
        raise InputError(f"export S3 URI {export_s3_uri!r}: give s3://bucket/prefix, with the export on")


LATEST, UNEVALUATED = "latest", "unevaluated"  # which checkpoints an evaluation measures (checkpoints.py)


def check_checkpoints(checkpoints: str) -> list[int]:
    """Which checkpoints to evaluate: 'latest' (the newest committed; "" says the same), 'unevaluated' (each committed
    one whose step has no kept evaluation), or step numbers separated by commas ("100,200"): their steps, ascending
    and each once ([] for 'latest' and 'unevaluated'); anything else is refused in one line."""
    text = checkpoints.strip()
    if text in ("", LATEST, UNEVALUATED):
        return []
    parts = [part.strip() for part in text.split(",")]
    if not all(part.isascii() and part.isdigit() and int(part) > 0 for part in parts):
        raise InputError(
            f"checkpoint {checkpoints!r}: give {LATEST!r}, {UNEVALUATED!r}, or step numbers separated by commas "
            "(e.g. 100,200)"
        )
    return sorted({int(part) for part in parts})
