"""The private PyTorch APIs behind trainer/private_api.py, checked on the pinned stack: a torch upgrade that changes
one fails here, not in a training run."""

from __future__ import annotations

import inspect
import socket

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from trainer.dcp_io import VerifyingReader
from trainer.private_api import HF_READ_ITEM, READER_SLICE_HOOK, default_store, skip_update_if


def test_the_fused_adamw_kernel_skips_its_update_when_found_inf_is_set() -> None:
    """The GPU path's assumption, checked on the CPU build of the same kernel: with `found_inf` set (GradScaler's
    protocol, torch/optim/adamw.py -> _fused_adamw), the step leaves the weights, the moments and the step count as
    they were; with it clear, it updates."""
    weight = torch.nn.Parameter(torch.ones(8))
    optimizer = torch.optim.AdamW([weight], lr=0.1, fused=True)
    weight.grad = torch.ones(8)
    optimizer.step()
    before = (weight.detach().clone(), optimizer.state[weight]["exp_avg"].clone(), optimizer.state[weight]["step"])
    weight.grad = torch.full((8,), float("nan"))
    skip_update_if(optimizer, torch.ones((), dtype=torch.bool))
    optimizer.step()
    assert torch.equal(weight.detach(), before[0]) and torch.equal(optimizer.state[weight]["exp_avg"], before[1])
    assert optimizer.state[weight]["step"].item() == 1
    weight.grad = torch.ones(8)
    skip_update_if(optimizer, torch.zeros((), dtype=torch.bool))
    optimizer.step()
    assert not torch.equal(weight.detach(), before[0]) and optimizer.state[weight]["step"].item() == 2


def test_the_default_store_is_the_process_groups() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        store = default_store()
        store.set("attempt", "7")
        assert isinstance(store, dist.Store) and store.get("attempt") == b"7"
    finally:
        dist.destroy_process_group()


def test_dcps_reader_still_calls_the_per_item_hook_the_verifying_reader_overrides() -> None:
    hook = getattr(dcp.FileSystemReader, READER_SLICE_HOOK)
    assert list(inspect.signature(hook).parameters) == ["self", "file", "sinfo"]
    assert f"self.{READER_SLICE_HOOK}(" in inspect.getsource(dcp.FileSystemReader.read_data)
    assert READER_SLICE_HOOK in VerifyingReader.__dict__


def test_dcps_hugging_face_reader_still_reads_each_item_with_the_method_ours_calls() -> None:
    hook = getattr(dcp.HuggingFaceStorageReader, HF_READ_ITEM)
    assert list(inspect.signature(hook).parameters) == ["self", "f", "req", "planner"]
    source = inspect.getsource(dcp.HuggingFaceStorageReader.read_data)
    assert f"self.{HF_READ_ITEM}(f, req, planner)" in source and "self.storage_data[read_item.storage_index]" in source


@pytest.mark.parametrize("preset", ["tiny", "llama-1b"])
def test_the_unmasked_causal_attention_builds_no_mask_and_computes_what_sdpa_does(
    preset: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """transformers builds no mask for an attention implementation without a mask function, and its SDPA function
    then runs causal (trainer/model.py, without_attention_masks): the same logits as the "sdpa" implementation, and
    no per-batch packed-sequence check (a host sync)."""
    import transformers.masking_utils

    from trainer.model import build_model, model_config, without_attention_masks

    config = model_config(preset, 300, 32, 0)
    if preset == "llama-1b":  # the family, at a size a test affords
        config.update(
            {
                "num_hidden_layers": 2,
                "hidden_size": 64,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "intermediate_size": 128,
            }
        )
    torch.manual_seed(0)
    model = build_model(config).eval()
    tokens = torch.randint(0, 300, (2, 32))
    with torch.no_grad():
        expected = model(input_ids=tokens, use_cache=False).logits
        without_attention_masks(model)

        def no_mask_please(*args, **kwargs):
            raise AssertionError("a packed-sequence check ran")

        monkeypatch.setattr(transformers.masking_utils, "find_packed_sequence_indices", no_mask_please)
        assert torch.equal(model(input_ids=tokens, use_cache=False).logits, expected)
