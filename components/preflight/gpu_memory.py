"""The gpu-memory check: the run's estimated memory per GPU (trainer/memory.py) against the GPU of its instance
type, and when it does not fit, the few job options after which it would."""

from __future__ import annotations

from collections.abc import Callable
from decimal import Decimal

from components.preflight.context import GPU, Context
from components.preflight.result import FAIL, NOT_APPLICABLE, PASS, WARN, Check
from trainer.config import TRAIN_DEFAULTS
from trainer.memory import GIB, estimate, model_shape

# Each GPU's memory by instance type (HyperPod's ml.<type> too), from AWS's accelerated-computing instance pages
# and NVIDIA's data sheets: g5 A10G 24 GB, g6e L40S 48 GB, p4d A100 40 GB, p4de A100 80 GB, p5 H100 80 GB, p5e and
# p5en H200 141 GB, p6-b200 B200 (1,440 GB of HBM3e over 8 GPUs) 180 GB. The vendors' "GB" here are GiB of HBM (an
# H100's five 16 GiB stacks are its 80 GB), and the estimate is in GiB too (trainer/memory.py).
GPU_MEMORY_GIB: dict[str, int] = {
    "g5.48xlarge": 24,
    "g6e.48xlarge": 48,
    "p4d.24xlarge": 40,
    "p4de.24xlarge": 80,
    "p5.48xlarge": 80,
    "p5e.48xlarge": 141,
    "p5en.48xlarge": 141,
    "p6-b200.48xlarge": 180,
}
GPU_MEMORY_USABLE = Decimal("0.90")  # the rest for the allocator's fragmentation, NCCL's buffers, the CUDA context
GPU_MEMORY_TIGHT = Decimal("0.80")  # above this share of the GPU a run fits, but with little room


def check_gpu_memory(ctx: Context) -> Check:
    """The run's estimated memory per GPU (trainer/memory.py) against the instance type's GPU; when it does not fit,
    what would."""
    name = "gpu-memory"
    gpu_gib = GPU_MEMORY_GIB.get(ctx.instance_type.removeprefix("ml."))
    gpus = int(ctx.request.get(GPU, 0))
    if not gpus:
        return Check(name, NOT_APPLICABLE, "the job requests no GPUs")
    flag = ctx.trainer_flag
    seq_len = int(flag("--seq-len", TRAIN_DEFAULTS["seq_len"]))
    batch = int(flag("--batch-size", TRAIN_DEFAULTS["batch_size"]))
    accumulation = int(flag("--grad-accum-steps", TRAIN_DEFAULTS["grad_accum_steps"]))
    parallelism = flag("--parallelism", TRAIN_DEFAULTS["parallelism"])
    recompute = flag("--activation-checkpointing", TRAIN_DEFAULTS["activation_checkpointing"])
    config, preset, vocab, assumed = ctx.model_config(seq_len)
    shape = model_shape(config)

    def per_gpu(parallelism: str, nodes: int, batch: int, recompute: str) -> int:
        return estimate(shape, parallelism, nodes * gpus, gpus, batch, seq_len, recompute).total

    need = estimate(shape, parallelism, ctx.max_nodes * gpus, gpus, batch, seq_len, recompute)
    size = f"{shape.parameters / 1e9:.2f}B" if shape.parameters >= 10**9 else f"{shape.parameters / 1e6:.1f}M"
    accumulated = (
        f", {accumulation} micro-batches a step (no more memory: gradients stay sharded between them)"
        if accumulation > 1
        else ""
    )
    run = (
        f"{preset} ({size} parameters at vocabulary {vocab:,}"
        f"{', assumed' if assumed else ''}) under {parallelism} on {ctx.max_nodes} node(s) x {gpus} GPUs, "
        f"micro-batch {batch} x {seq_len} tokens{accumulated}, activation checkpointing {recompute}: "
        f"{need.describe()}"
    )
    if gpu_gib is None:
        return Check(
            name,
            NOT_APPLICABLE,
            f"{run}; the GPU memory of {ctx.instance_type or 'this instance type'} is "
            f"unknown (known: {', '.join(GPU_MEMORY_GIB)})",
        )
    usable = Decimal(gpu_gib) * GPU_MEMORY_USABLE * GIB
    if need.total <= Decimal(gpu_gib) * GPU_MEMORY_TIGHT * GIB:
        return Check(name, PASS, f"{run}, of the {gpu_gib} GiB of a {ctx.instance_type} GPU")
    if need.total <= usable:
        return Check(
            name,
            WARN,
            f"{run}: tight in the {gpu_gib} GiB of a {ctx.instance_type} GPU (over {GPU_MEMORY_TIGHT:.0%})",
            "if it runs out of memory: " + memory_fixes(per_gpu, parallelism, ctx.max_nodes, batch, recompute, usable),
        )
    return Check(
        name,
        FAIL,
        f"{run}: more than the {gpu_gib} GiB of a {ctx.instance_type} GPU can hold ({usable / GIB:.0f} GiB usable)",
        memory_fixes(per_gpu, parallelism, ctx.max_nodes, batch, recompute, usable),
    )


def memory_fixes(
    per_gpu: Callable[[str, int, int, str], int],
    parallelism: str,
    nodes: int,
    batch: int,
    recompute: str,
    usable: Decimal,
) -> str:
    """The first few changes (job options) after which the run would fit, each with its estimate."""
    sharded = "hsdp" if nodes > 1 else "fsdp"
    candidates = [
        (f"job option parallelism={sharded}", sharded, nodes, batch, recompute),
        (f"parallelism={sharded} and activation_checkpointing=selective", sharded, nodes, batch, "selective"),
        (f"parallelism={sharded} and activation_checkpointing=full", sharded, nodes, batch, "full"),
        (f"parallelism=hsdp on {max(2, nodes * 2)} nodes", "hsdp", max(2, nodes * 2), batch, recompute),
        (
            f"batch_size {max(1, batch // 2)} (raise grad_accum_steps to keep the global batch)",
            parallelism,
            nodes,
            max(1, batch // 2),
            recompute,
        ),
        (
            f"batch_size {max(1, batch // 4)} with parallelism={sharded} and activation_checkpointing=full",
            sharded,
            nodes,
            max(1, batch // 4),
            "full",
        ),
    ]
    changed = [
        (text, settings) for text, *settings in candidates if tuple(settings) != (parallelism, nodes, batch, recompute)
    ]
    fits = [
        f"{text} ({per_gpu(*settings) / GIB:.1f} GiB)" for text, settings in changed if per_gpu(*settings) <= usable
    ][:3]
    if not fits:
        return "no single change fits: a larger GPU (p5e/p5en: 141 GiB), more nodes under hsdp with full checkpointing"
    return "it would fit with " + "; or ".join(fits)
