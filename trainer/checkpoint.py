"""Checkpoints: complete or absent, never half-written, and loaded without unpickling code."""

from __future__ import annotations

import logging
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from trainer.atomic import atomic_open

log = logging.getLogger(__name__)


class CheckpointError(Exception):
    """A checkpoint file exists but cannot be used."""


def save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    with atomic_open(path, "wb") as f:
        torch.save(state, f)


def load_checkpoint(path: Path) -> dict[str, Any]:
    """Load with weights_only=True: a checkpoint holds tensors and plain values, never code."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # garbage bytes surface as any of a dozen error types from the unpickler
        raise CheckpointError(
            f"checkpoint {path} is corrupt or not a plain-tensor checkpoint ({type(exc).__name__} from torch.load)"
        ) from exc
    if not isinstance(state, dict) or "model" not in state or "step" not in state:
        raise CheckpointError(f"checkpoint {path} is not a hyperpod-pretrain checkpoint (no model/step entries)")
    return state


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "python": list(random.getstate()[1]),
        "python_pos": random.getstate()[2],
        "numpy": np.random.get_state()[1].tolist(),
        "numpy_pos": int(np.random.get_state()[2]),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate((3, tuple(state["python"]), state["python_pos"]))
    np.random.set_state(("MT19937", np.array(state["numpy"], dtype=np.uint32), state["numpy_pos"], 0, 0.0))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
