"""The evaluation-memory check: what the evaluate step needs to hold the run's model, against the GPU and the memory
limit the compile gave it (components/evaluate_checkpoint/resources.py), so that a model the step cannot hold fails
the run in its first minute rather than after the training.

The model is built on the meta device and filled in place, a checkpoint piece at a time, one model at a time (the
checkpoint's, then the one the run started from: components/evaluate_checkpoint/loading.py). On a GPU (the default)
the GPU holds:

    weights      bf16, 2 bytes a parameter
    val batch    one block's working set for the evaluation's batch (nothing is kept for a backward) and the hidden
                 states outside the blocks, times batch x sequence: bounded by what training keeps of a block
                 (trainer/memory.py's bytes per token), which a forward without gradients frees as it goes
    logits       one chunk of the loss (trainer/loss.py): its bf16 logits, their fp32 copy and log-softmax's
                 temporary, 10 bytes an element of at most 2^26
    reserve      the allocator's, 10% of the rest (trainer/memory.py)

against a GPU of the training nodes (gpu_memory.py's table, 90% of it usable), and the host holds the process and the
largest piece while it is read (DCP's record of it, fp32, 4 bytes an element; the tensor made of it, 4; on the way to
the GPU the bf16 copy a converting copy makes on the CPU first, 2). On the CPU the host holds all of it: the model and
the val batch's working set in fp32, the logits chunk and the piece (8 bytes an element).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from decimal import Decimal

from components.preflight.context import Context
from components.preflight.gpu_memory import GPU_MEMORY_GIB, GPU_MEMORY_TIGHT, GPU_MEMORY_USABLE
from components.preflight.quantities import quantity
from components.preflight.result import FAIL, NOT_APPLICABLE, PASS, WARN, Check
from trainer.config import TRAIN_DEFAULTS
from trainer.memory import (
    ALLOCATOR_RESERVE,
    GIB,
    LOSS_BYTES_PER_CHUNK_ELEMENT,
    LOSS_CHUNK_ELEMENTS,
    ModelShape,
    block_activation_bytes,
    model_shape,
)

NAME = "evaluation-memory"
STEP = "evaluate-checkpoint"
EVAL_BATCH_SIZE = 8  # evaluate_checkpoint's batch_size (components/evaluate_checkpoint/core.py), which the step keeps
# The process before any model: torch, transformers, lm-eval, kfp and the project imported measured 0.37 GiB resident
# on the CPU; a GPU's process adds CUDA's context and the libraries it maps (about 2 GiB more: an estimate, no GPU
# runs the tests).
PROCESS_FLOOR_GIB = {False: 1, True: 3}  # by on_gpu


@dataclass(frozen=True)
class EvaluationNeed:
    """Bytes the evaluation needs, by part: the model's on the GPU (on the host when it runs on the CPU), and the
    process's and the checkpoint piece's on the host."""

    weights: int
    val_batch: int
    logits: int
    floor: int
    piece: int
    on_gpu: bool

    @property
    def model(self) -> int:
        return self.weights + self.val_batch + self.logits

    @property
    def device(self) -> int:
        """On the GPU, with the allocator's reserve; 0 on the CPU."""
        return self.model + int(self.model * ALLOCATOR_RESERVE) if self.on_gpu else 0

    @property
    def host(self) -> int:
        return self.floor + self.piece + (0 if self.on_gpu else self.model)

    def parts(self) -> str:
        return f"weights {gib(self.weights)}, val batch {gib(self.val_batch)}, logits {gib(self.logits)}"

    def describe_device(self) -> str:
        return f"{gib(self.device)} GiB ({self.parts()}, allocator reserve {gib(self.device - self.model)})"

    def describe_host(self, limit: str) -> str:
        held = f"process {gib(self.floor)}, the largest checkpoint piece {gib(self.piece)}"
        return (
            f"{gib(self.host)} GiB of its {limit} memory limit ({held if self.on_gpu else self.parts() + ', ' + held})"
        )


def gib(amount: int) -> str:
    return f"{amount / GIB:.1f}"


def evaluation_need(shape: ModelShape, seq_len: int, on_gpu: bool) -> EvaluationNeed:
    """What evaluating a model of `shape` needs (the module docstring): bf16 on a GPU, fp32 on the CPU."""
    width = 2 if on_gpu else 4  # bytes an element of the weights and the activations
    tokens = EVAL_BATCH_SIZE * seq_len
    working = tokens * (block_activation_bytes(shape, "none") + 8 * shape.hidden) * width // 2  # counted in bf16
    logits = (2 + LOSS_BYTES_PER_CHUNK_ELEMENT) * min(LOSS_CHUNK_ELEMENTS, tokens * shape.vocab)
    piece = shape.largest_tensor * (4 + 4 + (2 if on_gpu else 0))
    return EvaluationNeed(width * shape.parameters, working, logits, PROCESS_FLOOR_GIB[on_gpu] * GIB, piece, on_gpu)


def check_evaluation_memory(ctx: Context) -> Check:
    """The evaluate step's need for the run's model against its GPU (one of the run's instance type) and its memory
    limit; when it does not fit, the compile flags after which it would."""
    resources = ctx.evaluation
    seq_len = int(ctx.trainer_flag("--seq-len", TRAIN_DEFAULTS["seq_len"]))
    config, preset, vocab, assumed = ctx.model_config(seq_len)
    shape = model_shape(config)
    size = f"{shape.parameters / 1e9:.2f}B" if shape.parameters >= 10**9 else f"{shape.parameters / 1e6:.1f}M"
    model = f"{preset} ({size} parameters at vocabulary {vocab:,}{', assumed' if assumed else ''})"
    need = evaluation_need(shape, seq_len, resources.on_gpu)
    gpu_gib = GPU_MEMORY_GIB.get(ctx.instance_type.removeprefix("ml."))
    where = f"on 1 GPU of a {ctx.instance_type}" if resources.on_gpu else "on the CPU"
    dtype = "bf16" if resources.on_gpu else "fp32"
    run = f"{STEP} {where}: {model} in {dtype}, batch {EVAL_BATCH_SIZE} x {seq_len} tokens"
    to_cpu = (
        f"compile with --evaluation-gpus 0 --evaluation-memory "
        f"{math.ceil(evaluation_need(shape, seq_len, False).host / GIB)}Gi (fp32 on the CPU, slower)"
    )
    problems, fixes = [], []
    gpu_short = resources.on_gpu and gpu_gib is not None and need.device > usable(gpu_gib)
    if gpu_short:
        problems.append(
            f"needs {need.describe_device()} of one GPU, more than a {ctx.instance_type} GPU's {gpu_gib} GiB can hold "
            f"({usable(gpu_gib) / GIB:.0f} GiB usable)"
        )
        larger = [t for t, g in sorted(GPU_MEMORY_GIB.items(), key=lambda i: i[1]) if need.device <= usable(g)]
        fixes.append(to_cpu + (f", or train on {larger[0]} ({GPU_MEMORY_GIB[larger[0]]} GiB GPUs)" if larger else ""))
    if need.host > quantity(resources.memory):
        problems.append(f"needs {need.describe_host(resources.memory)}, more than the limit")
        if not gpu_short:
            fixes.append(f"compile with --evaluation-memory {math.ceil(need.host / GIB)}Gi")
        if not resources.on_gpu and gpu_gib and evaluation_need(shape, seq_len, True).device <= usable(gpu_gib):
            fixes.append("or with --evaluation-gpus 1 (bf16 on a GPU of the training nodes)")
    if problems:
        return Check(NAME, FAIL, f"{run}: " + "; ".join(problems), " ".join(fixes))
    host = need.describe_host(resources.memory)
    if not resources.on_gpu:
        return Check(NAME, PASS, f"{run}: {host}")
    if gpu_gib is None:
        return Check(
            NAME,
            NOT_APPLICABLE,
            f"{run}: {need.describe_device()} of one GPU and {host}; the GPU memory of "
            f"{ctx.instance_type or 'this instance type'} is unknown (known: {', '.join(GPU_MEMORY_GIB)})",
        )
    held = f"{run}: {need.describe_device()} of a {gpu_gib} GiB GPU and {host}"
    if need.device > Decimal(gpu_gib) * GPU_MEMORY_TIGHT * GIB:
        return Check(
            NAME, WARN, f"{held}: tight (over {GPU_MEMORY_TIGHT:.0%} of the GPU)", f"if it runs out of memory: {to_cpu}"
        )
    return Check(NAME, PASS, held)


def usable(gpu_gib: int) -> Decimal:
    """Bytes of a GPU the evaluation may fill (the rest for the CUDA context and fragmentation: gpu_memory.py)."""
    return Decimal(gpu_gib) * GPU_MEMORY_USABLE * GIB
