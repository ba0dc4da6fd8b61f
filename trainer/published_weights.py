"""A published model's weights (trainer/published.py) into the model being trained, through DCP's Hugging Face
reader: each rank reads only the pieces of each tensor it holds (under fsdp its shards; under ddp everything, once
per rank), converted to the training dtype as they are copied; no rank ever holds the whole model otherwise."""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.futures import Future

from trainer.errors import CheckpointError
from trainer.private_api import HF_READ_ITEM
from trainer.published import PublishedModel


def load_weights(model: torch.nn.Module, published: PublishedModel) -> None:
    """Fill `model`'s parameters (plain, or FSDP's DTensors) from the published safetensors, collectively under a
    process group: each rank reads the pieces it holds. A tied weight is read once (save_pretrained leaves out its
    alias); the rotary frequencies and other buffers are the model's own; names with or without the base model's
    prefix are taken as transformers takes them (`model_key`), and tensors the model lacks (GPT-2's old attention
    masks) are left. A tensor missing from the files or of another shape is named."""
    import torch.distributed as dist
    from safetensors import safe_open

    parameters = dict(model.named_parameters())  # a tied weight once, by its first name (save_pretrained's too)
    shapes: dict[str, tuple[int, ...]] = {}
    for name in published.files:
        with safe_open(published.path / name, "pt") as f:
            shapes |= {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}
    file_keys = {model_key(key, model.base_model_prefix, parameters): key for key in shapes}
    where = f"--init-from-model {published.path}"
    if missing := sorted(set(parameters) - set(file_keys)):
        raise CheckpointError(
            f"{where}: {len(missing)} weight(s) of the model are not in its files: {', '.join(missing[:3])}"
        )
    state = {file_keys[name]: parameter for name, parameter in parameters.items()}  # as the files name them
    for key, parameter in state.items():
        if shapes[key] != tuple(parameter.shape):
            raise CheckpointError(
                f"{where}: {key} is {list(shapes[key])} in the files and {list(parameter.shape)} "
                "in the model its config.json describes"
            )
    with warnings.catch_warnings():  # one process (the evaluation's baseline) is meant: DCP warns it assumes so
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load(state, storage_reader=TensorAtATimeReader(str(published.path)), no_dist=not dist.is_initialized())


def model_key(file_key: str, prefix: str, model_keys: Any) -> str:
    """The model's name for a tensor the files name `file_key`, as transformers loads them
    (transformers 5.24 core_model_loading.py rename_source_key): the base model's prefix (GPT-2's `transformer`,
    Llama's `model`) taken off where only the name without it is the model's, or put on where only the name with it
    is: the Hub's GPT-2 files name its weights `h.0.*`, `wte.*`, as the base model saved them."""
    if file_key.startswith(f"{prefix}.") and file_key.removeprefix(f"{prefix}.") in model_keys:
        return file_key.removeprefix(f"{prefix}.")
    if f"{prefix}.{file_key}" in model_keys:
        return f"{prefix}.{file_key}"
    return file_key


class TensorAtATimeReader(dcp.HuggingFaceStorageReader):
    """DCP's Hugging Face reader, opening a file for each piece it reads. Its own keeps each file mapped while it
    reads all of this rank's pieces of it, and the pages read stay counted in the process's memory until the file
    closes: 0.61 of the model per rank on two ranks, against 0.50 (the rank's shard) this way, at no cost in time
    (bench/RESULTS.md); an 8B model's files are 5 GB each."""

    def read_data(self, plan: Any, planner: Any) -> Future[None]:
        from safetensors import safe_open

        for item in plan.items:
            with safe_open(filename=self.storage_data[item.storage_index].relative_path, framework="pt") as f:
                getattr(self, HF_READ_ITEM)(f, item, planner)
        done: Future[None] = Future()
        done.set_result(None)
        return done
