"""A published model to start from: a directory that transformers' `save_pretrained` wrote.

    config.json                                     the architecture (model_type llama or gpt2, sizes, token ids)
    model.safetensors, or model-0000N-of-0000M.safetensors with model.safetensors.index.json
    tokenizer.json, tokenizer_config.json, ...      the token ids the weights were trained with

Continued pretraining starts from it: its architecture replaces the preset, its weights the random ones, and the
optimizer and schedule start fresh. Here, the directory and its checks (staging reads them, without torch); its
weights are read by trainer/published_weights.py. A pickle checkpoint (`pytorch_model.bin`) is refused: loading one
runs code.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from common.objects import sha256_of
from trainer.config import SettingError
from trainer.errors import CheckpointError, DataError
from trainer.layout import TOKENIZER, ModelPaths

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
