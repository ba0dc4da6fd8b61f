"""A published model to start from: a directory that transformers' `save_pretrained` wrote.

    config.json                                     the architecture (model_type llama or gpt2, sizes, token ids)
    model.safetensors, or model-0000N-of-0000M.safetensors with model.safetensors.index.json
    tokenizer.json, tokenizer_config.json, ...      the token ids the weights were trained with

Continued pretraining starts from it: its architecture replaces the preset, its weights the random ones, and the
optimizer and schedule start fresh. The weights are read with DCP's Hugging Face reader, so each rank reads only the
pieces of each tensor it holds (under fsdp its shards; under ddp everything, once per rank), converted to the
training dtype as they are copied; no rank ever holds the whole model otherwise. A pickle checkpoint
(`pytorch_model.bin`) is refused: loading one runs code.
"""

from __future__ import annotations

import json
import logging
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed.checkpoint as dcp
from torch.futures import Future

from common.objects import sha256_of
from trainer.checkpoint import CheckpointError
from trainer.config import SettingError
from trainer.data import DataError
from trainer.layout import TOKENIZER, ModelPaths
from trainer.private_api import HF_READ_ITEM

if TYPE_CHECKING:
    from tokenizers import Tokenizer

log = logging.getLogger(__name__)

TRAINABLE = ("llama", "gpt2")  # the families trainer/model.py builds and trainer/parallel.py shards
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


@dataclass(frozen=True)
class PublishedModel:
    """A checked model directory: its config.json and its safetensors files."""

    path: Path
    config: dict[str, Any]
    files: tuple[str, ...]

    @classmethod
    def read(cls, path: Path, where: str = "") -> PublishedModel:
        """The model at `path`, or CheckpointError (bad input) in one line naming what is wrong and, first, `where`
        (the input as the user gave it; the trainer's flag by default)."""
        where = where or f"--init-from-model {path}"
        if not (path / "config.json").is_file():
            raise CheckpointError(f"{where}: no config.json there: give a directory that save_pretrained wrote")
        try:
            config = json.loads((path / "config.json").read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"{where}: config.json is not readable JSON ({exc})") from None
        model_type = config.get("model_type")
        if model_type not in TRAINABLE:
            raise CheckpointError(
                f"{where}: model_type {model_type!r} cannot be trained here: choose a model of type "
                f"{' or '.join(TRAINABLE)}"
            )
        if (path / INDEX).is_file():
            weight_map = json.loads((path / INDEX).read_text()).get("weight_map") or {}
            files = tuple(sorted(set(weight_map.values())))
            if missing := [name for name in files if not (path / name).is_file()]:
                raise CheckpointError(
                    f"{where}: {INDEX} names {len(missing)} file(s) that are not there: {', '.join(missing[:3])}"
                )
        elif (path / SINGLE).is_file():
            files = (SINGLE,)
        elif pickles := sorted(p.name for pattern in ("*.bin", "*.pt", "*.pth") for p in path.glob(pattern)):
            raise CheckpointError(
                f"{where}: its weights are a pickle checkpoint ({pickles[0]}), which runs code when "
                "loaded: convert it to safetensors (transformers: from_pretrained, then "
                "save_pretrained, which writes safetensors; save its tokenizer into the same "
                "directory)"
            )
        else:
            raise CheckpointError(f"{where}: no {SINGLE} nor {INDEX} there")
        return cls(path, config, files)

    def model_config(self, dropout: float = 0.0) -> Any:
        """The transformers config as the model was saved (never downloaded), with the run's dropout."""
        from transformers import AutoConfig

        from trainer.model import set_dropout

        return set_dropout(AutoConfig.from_pretrained(self.path, local_files_only=True), dropout)

    def record(self) -> dict[str, Any]:
        """Where the weights came from, for the run's config.json and summary: the directory (and the S3 prefix it
        was copied from, with the objects' ETags: staging's copy, trainer/layout.py ModelPaths; else each file's
        sha256), the files' total size, the dtype they hold, and a short name for reports."""
        size = sum((self.path / name).stat().st_size for name in self.files)
        origin = {
            "model": str(self.path),
            "name": self.path.name,
            "model_type": self.config["model_type"],
            "dtype": self.dtype,
            "bytes": size,
        }
        copy = ModelPaths.copy_holding(self.path)
        if copy is not None:
            manifest = json.loads(copy.manifest.read_text())
            etags = {e["key"]: e.get("etag", "") for e in manifest["files"]}
            source = str(manifest["source"]).rstrip("/")
            return {
                **origin,
                "name": source.rsplit("/", 1)[-1],
                "s3_uri": manifest["source"],
                "etags": {name: etags.get(name, "") for name in self.files},
            }
        return {**origin, "sha256": {name: sha256_of(self.path / name) for name in self.files}}

    @property
    def dtype(self) -> str:
        """The dtype the weights were saved in (transformers 5 says `dtype`, 4.x `torch_dtype`): the export's."""
        return str(self.config.get("dtype") or self.config.get("torch_dtype") or "float32")

    def tokenizer_mismatch(self, tokenizer: Tokenizer) -> str | None:
        """Why `tokenizer` cannot feed this model, or None: token ids past its embedding rows, or (where the model
        directory has its own tokenizer.json) another vocabulary than the model's, whose ids would then mean other
        tokens than its weights learnt."""
        from tokenizers import Tokenizer

        given = tokenizer.get_vocab(with_added_tokens=True)
        rows = int(self.config.get("vocab_size") or 0)
        if len(given) > rows:
            return f"the tokenizer has {len(given):,} tokens and the model embeds {rows:,}"
        if not (self.path / TOKENIZER).is_file():
            return None  # nothing to compare with: the rows are all that can be checked
        own = Tokenizer.from_file(str(self.path / TOKENIZER)).get_vocab(with_added_tokens=True)
        if given == own:
            return None
        other = sum(1 for token, index in given.items() if own.get(token) != index)
        return (
            f"the tokenizer is not the model's own: {other:,} of its {len(given):,} tokens have another id (or "
            f"none) in the model's {len(own):,}"
        )


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


def check_published_fits(published: PublishedModel, mconfig: Any, data_dir: Path, seq_len: int) -> None:
    """A published model trains on this snapshot only if the snapshot's tokenizer is the model's (else its token ids
    mean other tokens than the weights learnt) and the sequence fits its positions (bad input otherwise, one line)."""
    from tokenizers import Tokenizer

    if mismatch := published.tokenizer_mismatch(Tokenizer.from_file(str(data_dir / TOKENIZER))):
        raise DataError(
            f"--init-from-model {published.path}: snapshot {data_dir.name} was staged with another "
            f"tokenizer ({mismatch}): stage the corpus with the model's own tokenizer"
        )
    positions = getattr(mconfig, "max_position_embeddings", None) or getattr(mconfig, "n_positions", None)
    if positions and seq_len > positions:
        raise SettingError(
            f"--seq-len {seq_len} is longer than the {positions} positions of the model in {published.path}"
        )
