"""Measuring a checkpoint (components/evaluate_checkpoint/measure.py): the numbers, the samples, and the checkpoints
and val splits refused in one line."""

import io
import json
import math
import shutil
import struct
import zipfile
from pathlib import Path

import pytest
import torch

from common.errors import InputError
from components.evaluate_checkpoint.core import evaluate_checkpoint
from tests.helpers import snapshot_dir
from trainer.layout import RunPaths


def test_trained_model_beats_untrained(trained_copy: Path) -> None:
    result = evaluate_checkpoint(str(trained_copy), "synthetic", "run-1")
    assert result.step == 60 and result.val_tokens > 0
    assert result.val_loss < result.untrained_val_loss - 1.0, result
    run = RunPaths.of(trained_copy, "run-1")
    assert json.loads(run.eval_result.read_text())["val_loss"] == result.val_loss
    assert "val perplexity" in run.eval_report.read_text()


def test_the_checkpoint_is_read_into_a_model_of_the_evaluations_dtype(
    trained_copy: Path, one_process_group: None
) -> None:
    """In bf16 (a GPU's evaluation) every weight is the checkpoint's, rounded once; GPT-2's output layer stays its
    embedding. The untrained model is the one the trainer began from: the initial weights it drew from the run's
    seed (trainer/parallel.py parallelize)."""
    from components.evaluate_checkpoint.loading import checkpoint_model, starting_model
    from components.evaluate_checkpoint.measure import read_checkpoint
    from trainer.checkpoint import read_weights
    from trainer.model import config_from_dict
    from trainer.parallel import parallelize

    run = RunPaths.of(trained_copy, "run-1")
    config = json.loads(run.config.read_text())
    found, state = read_checkpoint(run, "latest")
    model_config = config_from_dict(config["model"])
    model = checkpoint_model(model_config, found, run, state, torch.device("cpu"), torch.bfloat16)
    saved = read_weights(found)
    loaded = dict(model.named_parameters(remove_duplicate=False))
    assert set(loaded) == set(saved)
    assert all(p.dtype == torch.bfloat16 and torch.equal(p, saved[k].to(torch.bfloat16)) for k, p in loaded.items())
    assert model.lm_head.weight is model.transformer.wte.weight
    start, name = starting_model(model_config, config, torch.device("cpu"), torch.float32)
    began = parallelize(model_config, "ddp", torch.device("cpu"), config["trainer"]["seed"], local_world=1).model
    assert name == "untrained" and start.state_dict().keys() == began.state_dict().keys()
    assert all(torch.equal(p, began.state_dict()[k]) for k, p in start.state_dict().items())
    assert not torch.equal(start.lm_head.weight, saved["lm_head.weight"])


def latest_dir(root: Path) -> Path:
    return RunPaths.of(root, "run-1").latest_checkpoint.resolve()


def rewrite(checkpoint: Path, name: str, data: bytes) -> None:
    """Replace one file of a committed checkpoint, and its size in commit.json, as a bad writer would."""
    (checkpoint / name).write_bytes(data)
    commit = json.loads((checkpoint / "commit.json").read_text())
    commit["files"][name] = len(data)
    (checkpoint / "commit.json").write_text(json.dumps(commit))


def test_corrupt_checkpoint_is_one_clear_error(trained_copy: Path) -> None:
    share = latest_dir(trained_copy) / "__0_0.distcp"
    share.write_bytes(share.read_bytes()[:1000])  # truncated, as after a crash without atomic saves
    with pytest.raises(InputError, match=r"is truncated or altered: __0_0.distcp is 1000 bytes") as failure:
        evaluate_checkpoint(str(trained_copy), "synthetic", "run-1")
    assert "\n" not in str(failure.value)


def test_checkpoint_that_is_not_plain_tensors_is_refused(trained_copy: Path) -> None:
    buffer = io.BytesIO()
    torch.save({"step": 1, "payload": Path("/etc/passwd")}, buffer)  # an arbitrary object
    rewrite(latest_dir(trained_copy), "trainer_state.pt", buffer.getvalue())
    with pytest.raises(InputError, match="not a plain-tensor checkpoint"):
        evaluate_checkpoint(str(trained_copy), "synthetic", "run-1")


def test_checkpoint_of_another_model_is_refused(trained_copy: Path) -> None:
    config_file = RunPaths.of(trained_copy, "run-1").config
    config = json.loads(config_file.read_text())
    config["model"]["n_embd"] *= 2
    config_file.write_text(json.dumps(config))
    with pytest.raises(InputError, match="does not fit the model"):
        evaluate_checkpoint(str(trained_copy), "synthetic", "run-1")


def test_missing_checkpoint(trained_copy: Path) -> None:
    for committed in RunPaths.of(trained_copy, "run-1").checkpoints.glob("step_*"):
        shutil.rmtree(committed)
    with pytest.raises(InputError, match="holds no committed checkpoint \\(any\\): run 'run-1' is incomplete"):
        evaluate_checkpoint(str(trained_copy), "synthetic", "run-1")


def test_evaluation_reads_the_weights_and_not_the_optimizer_state(trained_copy: Path) -> None:
    """Every optimizer record of the checkpoint is damaged (sizes kept): evaluation, which reads only the weights'
    records, is unaffected; a full read of the same checkpoint fails their CRC32."""
    from torch.distributed.checkpoint import FileSystemReader

    from trainer.checkpoint import read_checkpoint
    from trainer.errors import CheckpointError

    checkpoint = latest_dir(trained_copy)
    before = evaluate_checkpoint(str(trained_copy), "synthetic", "run-1", export=False)
    damaged = 0
    for index, item in FileSystemReader(checkpoint).read_metadata().storage_data.items():
        if index.fqn.startswith("optim.state."):
            with open(checkpoint / item.relative_path, "r+b") as f:
                f.seek(item.offset)
                record = f.read(item.length)  # the item: a torch.save archive; flip the first byte of its data
                data = next(i for i in zipfile.ZipFile(io.BytesIO(record)).infolist() if i.filename.endswith("/0"))
                name_len, extra_len = struct.unpack_from("<HH", record, data.header_offset + 26)  # its local header
                start = data.header_offset + 30 + name_len + extra_len
                f.seek(item.offset + start)
                f.write(bytes([record[start] ^ 0xFF]))
            damaged += 1
    assert damaged > 10
    after = evaluate_checkpoint(str(trained_copy), "synthetic", "run-1", export=False)
    assert after.val_loss == before.val_loss
    with pytest.raises(CheckpointError, match="fails its CRC32"):
        read_checkpoint(checkpoint)


def test_bits_per_byte_counts_the_bytes_the_tokens_stand_for(trained_copy: Path) -> None:
    from tokenizers import Tokenizer

    from trainer.data import load_meta, load_split
    from trainer.evaluation import token_byte_lengths
    from trainer.layout import TOKENIZER

    snapshot = snapshot_dir(trained_copy, "synthetic")
    lengths = token_byte_lengths(Tokenizer.from_file(str(snapshot / TOKENIZER)), load_meta(snapshot)["vocab_size"])
    val = load_split(snapshot, "val")[:500].tolist()
    text = Tokenizer.from_file(str(snapshot / TOKENIZER)).decode(val, skip_special_tokens=True)
    assert int(lengths[val].sum()) == len(text.encode("utf-8"))
    result = evaluate_checkpoint(str(trained_copy), "synthetic", "run-1", export=False)
    assert 0 < result.val_bits_per_byte < result.untrained_val_loss / math.log(2)


def test_a_named_step_and_the_samples(trained_copy: Path) -> None:
    result = evaluate_checkpoint(str(trained_copy), "synthetic", "run-1", checkpoint="40", export=False)
    assert result.step == 40 and result.checkpoint.endswith("step_00000040")
    assert [s["prompt"] for s in result.samples] == ["The", "def ", "import ", "In the"]
    assert all(len(s["text"]) > len(s["prompt"]) and s["text"].startswith(s["prompt"]) for s in result.samples)
    assert "## Samples" in result.markdown() and f"- **'def '**: {result.samples[1]['text']!r}" in result.markdown()
    with pytest.raises(InputError, match="holds no committed checkpoint \\(step 41's\\)"):
        evaluate_checkpoint(str(trained_copy), "synthetic", "run-1", checkpoint="41")


def test_an_empty_val_split_is_one_clear_error(trained_copy: Path) -> None:
    from trainer.layout import META

    meta_path = snapshot_dir(trained_copy, "synthetic") / META
    meta = json.loads(meta_path.read_text())
    meta["shards"]["val"] = []
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(InputError, match="the val split has no shards"):
        evaluate_checkpoint(str(trained_copy), "synthetic", "run-1")


def test_mean_loss_reads_the_windows_of_each_shard_without_joining_them() -> None:
    import numpy as np

    from trainer.data import TokenSplit
    from trainer.errors import DataError
    from trainer.evaluation import TokenBytes, mean_loss
    from trainer.model import build_model, model_config

    torch.manual_seed(0)
    model, cpu = build_model(model_config("tiny", 64, 16, 63)), torch.device("cpu")
    rng = np.random.default_rng(0)
    a, b = rng.integers(0, 64, 100, dtype=np.uint16), rng.integers(0, 64, 60, dtype=np.uint16)  # 6 + 3 windows
    ones = TokenBytes(np.ones(64, dtype=np.int64), None, ())
    loss, count, n_bytes = mean_loss(model, TokenSplit([a, b], "val"), 16, 10**6, 4, cpu, ones)
    each = [mean_loss(model, TokenSplit([s], "val"), 16, 10**6, 4, cpu, ones) for s in (a, b)]
    assert count == n_bytes == each[0][1] + each[1][1] == 9 * 16
    assert loss == pytest.approx((each[0][0] * each[0][1] + each[1][0] * each[1][1]) / count, rel=1e-6)
    assert mean_loss(model, TokenSplit([a, b], "val"), 16, 7 * 16, 4, cpu, ones)[1] == 7 * 16  # max_tokens
    with pytest.raises(DataError, match="shard"):  # 2 x 10 tokens: no window of 17 inside one shard
        mean_loss(model, TokenSplit([a[:10], b[:10]], "val"), 16, 10**6, 4, cpu, ones)
