"""The Hugging Face export (components/evaluate_checkpoint/export.py): loadable, the same loss, which checkpoint it
holds, its files' modes, and its upload to S3."""

import json
import logging
import os
from pathlib import Path

import pytest
import torch

from common.errors import InputError
from components.evaluate_checkpoint.core import evaluate_checkpoint
from components.evaluate_checkpoint.export import SHARD_SIZE
from tests.evaluate_helpers import short_samples  # noqa: F401 (a fixture the tests name)
from trainer.layout import RunPaths


@pytest.mark.parametrize("shard_size", [SHARD_SIZE, "100KB"], ids=["one-file", "sharded"])
def test_export_loads_with_from_pretrained_and_gives_the_same_loss(
    trained_copy: Path, shard_size: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In one file, or (a model larger than the shard size: an 8B export is four 5 GB files) in shards with their
    index, as the Hub's models come."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer.checkpoint import read_checkpoint
    from trainer.model import build_model, config_from_dict

    monkeypatch.setattr("components.evaluate_checkpoint.export.SHARD_SIZE", shard_size)
    result = evaluate_checkpoint(str(trained_copy), "synthetic", "run-1")
    run = RunPaths.of(trained_copy, "run-1")
    exported = AutoModelForCausalLM.from_pretrained(result.export_dir, local_files_only=True).eval()
    original = build_model(config_from_dict(json.loads(run.config.read_text())["model"])).eval()
    original.load_state_dict(read_checkpoint(run.latest_checkpoint)["model"])
    tokenizer = AutoTokenizer.from_pretrained(result.export_dir, local_files_only=True)
    batch = torch.tensor([tokenizer("the healthy node saves the rank. the warm pod trains the model.")["input_ids"]])
    with torch.no_grad():
        theirs = exported(input_ids=batch, labels=batch).loss.item()
        ours = original(input_ids=batch, labels=batch).loss.item()
    assert abs(theirs - ours) < 1e-5
    weights = sorted(p.name for p in Path(result.export_dir).glob("model*.safetensors*"))
    if shard_size == SHARD_SIZE:
        assert weights == ["model.safetensors"]
    else:
        shards = json.loads((Path(result.export_dir) / "model.safetensors.index.json").read_text())["weight_map"]
        assert len(weights) > 2 and set(shards.values()) == set(weights) - {"model.safetensors.index.json"}


@pytest.mark.usefixtures("short_samples")
def test_the_export_says_which_checkpoint_it_holds_and_has_the_umasks_modes(
    trained_copy: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Step 60 exported, then an older step, 40: eval/eval.json keeps step 60's evaluation, and export/ now holds step
    40's weights, which export/export.json, the result and the log line say. safetensors writes its file 0600: every
    exported file has the mode open() gives under the umask instead (0640 under 027, 0644 under 022)."""
    run = RunPaths.of(trained_copy, "run-1")
    export = run.root / "export"
    trained_on = json.loads(run.config.read_text())["dataset"]

    def modes() -> dict[str, str]:
        return {
            p.relative_to(export).as_posix(): oct(p.stat().st_mode & 0o777) for p in export.rglob("*") if p.is_file()
        }

    previous = os.umask(0o027)
    try:
        newest = evaluate_checkpoint(str(trained_copy), "synthetic", "run-1", max_tokens=128)
        assert "model.safetensors" in modes() and set(modes().values()) == {"0o640"}, modes()
        os.umask(0o022)
        with caplog.at_level(logging.INFO, logger="components.evaluate_checkpoint.core"):
            older = evaluate_checkpoint(str(trained_copy), "synthetic", "run-1", checkpoint="40", max_tokens=128)
    finally:
        os.umask(previous)
    assert {"model.safetensors", "config.json", "tokenizer.json", "export.json"} <= set(modes())
    assert set(modes().values()) == {"0o644"}, modes()

    assert (newest.export_step, older.export_step, older.export_dir) == (60, 40, str(export))
    record = json.loads((export / "export.json").read_text())
    exported_at = record.pop("exported_at")
    assert record == {
        "run_id": "run-1",
        "step": 40,
        "checkpoint": older.checkpoint,
        "dataset": "synthetic",
        "snapshot": trained_on["snapshot"],
    }
    assert older.checkpoint.endswith("step_00000040") and exported_at >= older.evaluated_at
    assert json.loads(run.eval_result.read_text())["step"] == 60, "the newest evaluation stays the run's"
    assert f"Exported step 40's weights to `{export}`" in (run.eval_step(40) / "report.md").read_text()
    assert any(
        r.getMessage().startswith("run run-1 step 40: val loss ")
        and r.getMessage().endswith(f"; exported step 40 to {export}")
        for r in caplog.records
    ), caplog.text


@pytest.mark.usefixtures("aws_env")
def test_the_export_is_uploaded_to_s3(trained_copy: Path, s3_endpoint: str) -> None:
    import boto3

    s3 = boto3.client("s3", endpoint_url=s3_endpoint)
    s3.create_bucket(Bucket="models")
    result = evaluate_checkpoint(
        str(trained_copy), "synthetic", "run-1", export_s3_uri="s3://models/nightly/run-1", s3_endpoint_url=s3_endpoint
    )
    listed = {o["Key"]: o["Size"] for o in s3.list_objects_v2(Bucket="models", Prefix="nightly/run-1/")["Contents"]}
    local = {
        f"nightly/run-1/{p.relative_to(result.export_dir).as_posix()}": p.stat().st_size
        for p in Path(result.export_dir).rglob("*")
        if p.is_file()
    }
    assert listed == local and "nightly/run-1/model.safetensors" in listed
    with pytest.raises(InputError, match="give s3://bucket/prefix"):
        evaluate_checkpoint(str(trained_copy), "synthetic", "run-1", export_s3_uri="models/nightly")
