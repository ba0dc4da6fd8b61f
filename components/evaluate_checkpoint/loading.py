"""The models an evaluation measures, each built where it will run and filled in place: the checkpoint's, then the
model the run started from, never both at once.

A model is built on the meta device (no storage), its parameters given the evaluation's dtype (bf16 on a GPU) while
still without storage, then allocated once on the evaluation's device and filled: the checkpoint's weights are read
into it by DCP a piece at a time (each piece converted as it is copied in), so no second full copy of the weights
exists, fp32 or other. The rotary frequencies and other buffers are computed as the trainer computes them
(trainer/parallel.py initialize), in fp32. An 8B model in bf16 is 16 GB: one H100 holds it with room for the val
batches (bench/RESULTS.md projects it).
"""

from __future__ import annotations

import copy
import ctypes
import ctypes.util
import gc
import logging
from pathlib import Path
from typing import Any

import torch

from common.errors import InputError
from components.evaluate_checkpoint.inputs import DTYPES
from trainer.checkpoint import Checkpoint, read_weights_into
from trainer.errors import CheckpointError
from trainer.layout import RunPaths
from trainer.loss import with_output_head
from trainer.model import build_model
from trainer.parallel import initialize

log = logging.getLogger(__name__)


def evaluation_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def evaluation_dtype(device: torch.device, dtype: str = "auto") -> torch.dtype:
    """`auto`: bf16 on a GPU (what the trainer computes in), fp32 on a CPU (whose bf16 matmuls are slow on most
    hosts, and whose numbers the laptop run keeps)."""
    assert dtype in DTYPES, dtype  # checked with the other inputs (inputs.py), before anything is read
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, dtype)


def empty_model(
    model_config: Any, device: torch.device, dtype: torch.dtype, initial_seed: int | None = None
) -> torch.nn.Module:
    """The model for `model_config` with its parameters in `dtype` on `device` and its buffers computed; the
    parameters' values are garbage, for the caller to fill, or the trainer's initial weights for `initial_seed`.
    Its output layer is an OutputHead (trainer/loss.py), so the val loss runs chunked as training's does. In eval
    mode."""
    with torch.device("meta"):
        model = with_output_head(build_model(model_config))
    template = copy.deepcopy(model)  # fp32, without storage: what the buffers are computed from
    for module in model.modules():
        for name, parameter in list(module.named_parameters(recurse=False)):
            setattr(module, name, torch.nn.Parameter(parameter.to(dtype), requires_grad=False))
    model.to_empty(device=device)
    model.tie_weights()  # each module's parameter was replaced (and to_empty allocates each): tie GPT-2's again
    initialize(model, template, initial_seed or 0, weights=initial_seed is not None)
    return model.eval()


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)


def steady_host_memory() -> None:
    """Every block of 1 MiB or more mapped on its own and unmapped when freed (glibc's mallopt): by default glibc
    raises that threshold as blocks are freed, and the next model's weights then land in heaps that keep their
    pages (gpt2-350m's step held 0.98 to 1.01 GB over the process floor without this, 0.83 GB with it: 1.6x and
    1.36x its bf16 size). Process-wide, as allocator settings are: called where the step's process starts (the
    component, the CLI's evaluate), not by a library function a test process calls."""
    libc = ctypes.util.find_library("c")
    if libc and hasattr(ctypes.CDLL(libc), "mallopt"):
        ctypes.CDLL(libc).mallopt(M_MMAP_THRESHOLD, 2**20)


def release_memory() -> None:
    """Give the memory of a model just dropped back before the next is built: what still refers to it in a cycle
    (lm-eval's wrapper) is collected, and CUDA's cache and glibc's heap return their free pages. With
    steady_host_memory's threshold the weights' blocks are unmapped as they are freed anyway; the trim is for the
    small ones (at gpt2-350m on the CPU the step's peak is the same without it, 0.83 GB over the floor)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    libc = ctypes.util.find_library("c")
    if libc and hasattr(ctypes.CDLL(libc), "malloc_trim"):  # glibc: the heap's free pages back to the system
        ctypes.CDLL(libc).malloc_trim(0)


def checkpoint_model(
    model_config: Any, found: Checkpoint, run: RunPaths, state: dict[str, Any], device: torch.device, dtype: torch.dtype
) -> torch.nn.Module:
    """The run's model with the checkpoint's weights, refused in one line when they do not fit it."""
    model = empty_model(model_config, device, dtype)
    try:
        read_weights_into(found, model)
    except CheckpointError as exc:
        raise InputError(
            f"checkpoint {found.path} does not fit the model in {run.config} (preset {state.get('preset')!r}): {exc}"
        ) from None
    return model


def starting_model(
    model_config: Any, config: dict[str, Any], device: torch.device, dtype: torch.dtype
) -> tuple[torch.nn.Module, str]:
    """The model the run started from, and its name in the report: a published model's weights when the run began
    from one (its config.json's init_from) and the directory is still there; otherwise the initial weights the
    trainer drew from the run's seed (trainer/parallel.py initialize), exactly."""
    origin = config.get("init_from") or {}
    if origin.get("model"):
        from trainer.published import PublishedModel
        from trainer.published_weights import load_weights

        path = Path(origin["model"])
        if (path / "config.json").is_file():
            model = empty_model(model_config, device, dtype)
            load_weights(model, PublishedModel.read(path))
            return model, f"start ({origin.get('name', path.name)})"
        log.warning(
            "the run started from the published model in %s, which is gone: its baseline is the untrained "
            "model instead",
            path,
        )
    return empty_model(model_config, device, dtype, initial_seed=config["trainer"]["seed"]), "untrained"
