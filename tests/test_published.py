"""Starting from a published model (trainer/published.py): real model directories written by transformers'
save_pretrained (Llama untied and in several safetensors shards, GPT-2 tied in one file), read back into the
trainer's model, and every bad directory refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import PUBLISHED_VOCAB as VOCAB
from tests.helpers import save_gpt2, save_llama
from trainer.checkpoint import CheckpointError
from trainer.parallel import parallelize
from trainer.published import PublishedModel, load_weights


def plain_loss(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=tokens[:, :-1]).logits
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1))


@pytest.mark.parametrize("save", [save_llama, save_gpt2])
@pytest.mark.usefixtures("one_process_group")
def test_the_trainers_model_loads_a_published_model_and_computes_its_loss(save, tmp_path: Path) -> None:  # noqa: ANN001
    """Under ddp (every weight whole) and fsdp (sharded DTensors, read piece by piece by DCP's Hugging Face reader):
    the loss of a batch is transformers' own on the same weights."""
    original = save(tmp_path / "model")
    published = PublishedModel.read(tmp_path / "model")
    assert (len(published.files) > 1) == (published.config["model_type"] == "llama")
    tokens = torch.randint(0, VOCAB, (2, 33), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = plain_loss(original, tokens)
    for kind in ("ddp", "fsdp"):
        parallel = parallelize(published.model_config(), kind, torch.device("cpu"), seed=9, local_world=1)
        load_weights(parallel.model, published)
        with torch.no_grad():
            loss = parallel.forward_loss(tokens[:, :-1], tokens[:, 1:])
        torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6, msg=kind)
    record = published.record()
    assert record["bytes"] == sum((tmp_path / "model" / f).stat().st_size for f in published.files)
    assert set(record["sha256"]) == set(published.files)


def test_a_bad_model_directory_is_refused_in_one_line(tmp_path: Path) -> None:
    save_llama(tmp_path / "model")

    def refused(path: Path) -> str:
        with pytest.raises(CheckpointError) as raised:
            PublishedModel.read(path)
        assert "\n" not in str(raised.value)
        return str(raised.value)

    assert refused(tmp_path).endswith("no config.json there: give a directory that save_pretrained wrote")
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    (tmp_path / "model" / "config.json").write_text(json.dumps({**config, "model_type": "mistral"}))
    assert "model_type 'mistral' cannot be trained here: choose a model of type llama or gpt2" in refused(
        tmp_path / "model")  # fmt: skip
    (tmp_path / "model" / "config.json").write_text(json.dumps(config))
    shard = sorted((tmp_path / "model").glob("model-*.safetensors"))[-1]
    shard.unlink()
    assert f"model.safetensors.index.json names 1 file(s) that are not there: {shard.name}" in refused(
        tmp_path / "model")  # fmt: skip
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text(json.dumps(config))
    torch.save({}, pickled / "pytorch_model.bin")
    assert "a pickle checkpoint (pytorch_model.bin), which runs code when loaded: convert it to safetensors" in refused(
        pickled)  # fmt: skip


@pytest.mark.usefixtures("one_process_group")
def test_a_weight_of_another_shape_is_named(tmp_path: Path) -> None:
    save_llama(tmp_path / "model")
    published = PublishedModel.read(tmp_path / "model")
    config = published.model_config()
    config.intermediate_size = 128  # the model the config describes no longer matches the files
    parallel = parallelize(config, "fsdp", torch.device("cpu"), seed=9, local_world=1)
    with pytest.raises(CheckpointError, match=r"model.layers.0.mlp.gate_proj.weight is \[160, 64\] in the files and "
                                              r"\[128, 64\] in the model"):  # fmt: skip
        load_weights(parallel.model, published)


def test_the_trainers_model_loads_a_published_model_on_two_processes(parallel_probe: Path) -> None:
    """tests/parallel_probe.py: on each of 2 processes, its own batch; under ddp and fsdp (each rank reading only
    its shards of the sharded Llama's files) the loss the training loop calls is transformers' own."""
    for rank in (0, 1):
        losses = json.loads((parallel_probe / f"published_rank_{rank}.json").read_text())
        assert set(losses) == {"llama", "gpt2"}
        for model, by in losses.items():
            for kind in ("ddp", "fsdp"):
                assert by[kind] == pytest.approx(by["transformers"], rel=1e-5), (rank, model, kind, by)


def test_evaluation_compares_with_the_published_model_the_run_started_from(tmp_path: Path) -> None:
    """The report's baseline column is the starting model when the run began from a published one (its weights,
    read again from the directory its config.json names), and the untrained model when that directory is gone."""
    from components.evaluate_checkpoint.core import starting_model

    original = save_llama(tmp_path / "model")
    published = PublishedModel.read(tmp_path / "model")
    config = {"init_from": published.record(), "trainer": {"seed": 1}}
    start, name = starting_model(published.model_config(), config)
    assert name == "start (model)"
    assert all(torch.equal(p, original.state_dict()[k]) for k, p in start.state_dict().items() if k in
               original.state_dict())  # fmt: skip
    config["init_from"]["model"] = str(tmp_path / "gone")
    untrained, name = starting_model(published.model_config(), config)
    assert name == "untrained" and not torch.equal(untrained.lm_head.weight, original.lm_head.weight)
