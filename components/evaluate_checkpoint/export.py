"""The export: the evaluated model in Hugging Face format (safetensors) with its tokenizer, for serving stacks on
transformers 4.x and 5.x and readable by the team, apart from the evaluation that decides which weights go there.

The model goes under <run>/export/, and export/export.json says which checkpoint it holds: the evaluated one, which
need not be the newest evaluated (evaluate --checkpoint N replaces the export, while eval/eval.json keeps the newest
step's evaluation).
"""

from __future__ import annotations

import json
import logging
import shutil
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from components.evaluate_checkpoint.results import EXPORT_RECORD
from trainer.atomic import file_mode, replace_dir, write_json
from trainer.data import load_meta
from trainer.layout import TOKENIZER

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

log = logging.getLogger(__name__)

SHARD_SIZE = "5GB"  # the Hub's usual shard (Llama 3.1 8B ships four): an 8B export is four files, not one of 16 GB


def export_record(run_id: str, step: int, checkpoint: str, trained_on: tuple[str, str]) -> dict[str, Any]:
    """What export.json says: the checkpoint exported and the data it was trained on (dataset, snapshot), so that an
    export replaced by an evaluation of an older checkpoint is not taken for the newest one."""
    return {
        "run_id": run_id,
        "step": step,
        "checkpoint": checkpoint,
        "dataset": trained_on[0],
        "snapshot": trained_on[1],
        "exported_at": datetime.now(UTC).isoformat(timespec="seconds"),
    }


def export_model(
    model: torch.nn.Module, snapshot_dir: Path, directory: Path, record: dict[str, Any], dtype: str = "float32"
) -> Path:
    """save_pretrained (safetensors) in `dtype` (a published model's own, so the export is its size and says its
    dtype) with the snapshot's tokenizer: AutoModelForCausalLM.from_pretrained(directory) loads it, and AutoTokenizer
    encodes as training did (the snapshot keeps its post-processor so: [BOS] text), with the snapshot's own BOS and
    EOS named; `record` (export_record) goes in beside them as export.json, so the directory says which checkpoint
    it holds. The model's other config fields (rope scaling, special token ids) are the run's, so a published
    model's, in the keys both transformers 4.x and 5.x read (transformers_4_rope)."""
    staging = directory.with_name(f".{directory.name}.new")
    shutil.rmtree(staging, ignore_errors=True)  # left by a killed run
    # On its device (a GPU's model is not moved whole to the host), written a shard at a time: what the host holds
    # is one shard's tensors as safetensors copies them out. Safetensors: transformers 5 writes no other format.
    model.to(getattr(torch, dtype)).save_pretrained(staging, max_shard_size=SHARD_SIZE)
    write_json(staging / "config.json", transformers_4_rope(json.loads((staging / "config.json").read_text())))
    hf_tokenizer(snapshot_dir).save_pretrained(staging)
    write_json(staging / EXPORT_RECORD, record)
    readable_by_the_team(staging)
    replace_dir(staging, directory)
    log.info(
        "exported step %s (%s) in Hugging Face format to %s", record.get("step"), record.get("checkpoint"), directory
    )
    return directory


def hf_tokenizer(snapshot_dir: Path) -> PreTrainedTokenizerFast:
    """The snapshot's tokenizer as transformers' AutoTokenizer and lm-eval take it: it encodes as training did
    ([BOS] text, the snapshot's post-processor), with the snapshot's own BOS and EOS named."""
    from transformers import PreTrainedTokenizerFast

    from components.stage_data.tokenizer import EOS

    meta = load_meta(snapshot_dir)
    bos = meta["bos"] if "bos" in meta else EOS  # a snapshot staged before BOS: the trained tokenizer's one token
    return PreTrainedTokenizerFast(
        tokenizer_file=str(snapshot_dir / TOKENIZER), eos_token=meta.get("eos", EOS), bos_token=bos
    )


def transformers_4_rope(config: dict[str, Any]) -> dict[str, Any]:
    """A config.json of transformers 5 with the rope keys transformers 4 reads beside `rope_parameters`: 5.x writes
    only rope_parameters (rope_theta inside it), which 4.57 does not read (its LlamaConfig takes `rope_theta`, default
    10000.0, and `rope_scaling`, default None), so a serving stack on 4.x would run a Llama 3 export with the wrong
    positions, silently. 5.x reads `rope_scaling` in place of rope_parameters and `rope_theta` into it
    (modeling_rope_utils.py, convert_rope_params_to_dict): both keys say what rope_parameters says, so both versions
    build the same rotary frequencies. A config without rope (GPT-2), or with rope per layer type, is left as it is."""
    rope = config.get("rope_parameters")
    if not isinstance(rope, dict) or "rope_theta" not in rope or any(isinstance(v, dict) for v in rope.values()):
        return config
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}  # 4.x warns on a key its rope type does not take
    legacy = None if scaling.get("rope_type", "default") == "default" else scaling  # what 4.x writes for no scaling
    return config | {"rope_theta": rope["rope_theta"], "rope_scaling": legacy}


def readable_by_the_team(directory: Path) -> None:
    """Give every file under `directory` the mode open() gives under the umask (0644 under 022): safetensors writes
    model.safetensors 0600, which teammates reading the volume, and a copy made from it, could not read."""
    mode = file_mode()
    for path in directory.rglob("*"):
        if path.is_file() and not path.is_symlink():
            path.chmod(mode)
