from pathlib import Path

# The compiled pipeline, checked in: what users upload and what run-local executes.
COMPILED_PIPELINE = Path(__file__).resolve().parent.parent / "compiled" / "pretrain_pipeline.yaml"
