"""How the model is spread over the ranks: DDP, FSDP2 or HSDP, applied here and nowhere else.

    ddp    every rank holds the whole model, its gradients and AdamW's state (16 bytes a parameter, before
           activations); gradients are all-reduced in DDP's buckets; on GPU bf16 autocast
    fsdp   `fully_shard` on every transformer block, on the input embedding and on the final norm with the output
           layer (an untied model's, as torchtitan does; a tied model keeps them in the root unit, whose weights
           are gathered for the whole forward anyway), and on the root: parameters, gradients and optimizer state
           are split over the ranks, each unit's parameters all-gathered for its forward and backward; on GPU the
           parameters compute in bf16 and the gradients are reduced in fp32 (FSDP's mixed precision, no autocast)
    hsdp   fsdp within a node and replicas across nodes (a 2-D device mesh: replicate x shard), so the all-gathers
           stay on NVLink and only the gradient all-reduce crosses the network; what fsdp becomes on several nodes

Gradient accumulation never holds unsharded gradients: under fsdp and hsdp each micro-batch's gradients are
reduce-scattered within the node as they are made (FSDP2 would otherwise keep the whole model's in fp32 between
micro-batches, +32 GB a GPU at 8B); only hsdp's all-reduce across nodes waits for the last micro-batch.

The model is built on the meta device (no storage), sharded, and only then given memory, so no rank ever holds the
whole model under fsdp. Its initial weights are drawn unit by unit (each block, then each other module that holds
weights) on the CPU, from a generator keyed by the seed and the unit's name, with the model's own initialisation
rules (transformers' `_init_weights`), and each rank keeps its shard: the same initial model for every
parallelism and world size, holding at most one unit whole at a time.

The training loop sees a `Parallelized`: the loss to call, contexts for the compute precision and gradient
accumulation, the gradient norm clipping; it does not know which of the three it runs.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from trainer.loss import CausalLMLoss, with_output_head
from trainer.model import build_model, without_attention_masks

log = logging.getLogger(__name__)


@dataclass
class Parallelized:
    """The model as the loop uses it."""

    model: torch.nn.Module  # the transformers model: its state_dict is the checkpoint's (sharded under fsdp)
    forward_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (inputs, targets) -> mean loss
    kind: str  # ddp, fsdp or hsdp
    mesh: DeviceMesh | None = None
    _ddp: DistributedDataParallel | None = None

    @contextlib.contextmanager
    def accumulating(self, last_micro_batch: bool) -> Iterator[None]:
        """Around one micro-batch's forward and backward: gradients are all-reduced across replicas (ddp's ranks,
        hsdp's nodes) only after the last one; fsdp's reduce-scatter runs for every micro-batch, so what is kept
        between them is sharded."""
        if self._ddp is not None:
            with contextlib.nullcontext() if last_micro_batch else self._ddp.no_sync():
                yield
            return
        assert isinstance(self.model, FSDPModule)
        if self.kind == "hsdp":
            self.model.set_requires_all_reduce(last_micro_batch)
        yield

    def compute_precision(self, device: torch.device) -> contextlib.AbstractContextManager:
        """Around the forward: bf16 autocast for ddp on a GPU; fsdp and hsdp compute in bf16 by their mixed-precision
        policy (parameters gathered in bf16), so autocast would only cast again; fp32 on a CPU."""
        return torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda" and self.kind == "ddp")

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Clip the gradients to `max_norm` (inf: measure only); the total norm over all of them, a plain tensor
        equal on every rank."""
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm


def parallelize(
    config: Any,
    kind: str,
    device: torch.device,
    seed: int,
    local_world: int,
    comm_hook: Callable | None = None,
    compile_model: bool = False,
    activation_checkpointing: str = "none",
    initial_weights: bool = True,
) -> Parallelized:
    """Build the transformers model for `config` on the meta device, spread it as `kind` says, give it memory on
    `device` and its initial weights (initialize; without `initial_weights`, its buffers only: the caller loads
    every weight next, a published model's); then wrap the loss for DDP or compile it."""
    with torch.device("meta"):
        model = with_output_head(without_attention_masks(build_model(config)))
    template = copy.deepcopy(model)  # unsharded, still without storage: the shapes to draw the initial weights in
    recompute_activations(model, activation_checkpointing)
    kind, mesh = shard(model, kind, device, local_world)
    model.to_empty(device=device)
    model.tie_weights()  # to_empty gives each module's entry its own storage, untying GPT-2's output layer
    initialize(model, template, seed, weights=initial_weights)
    loss = CausalLMLoss(model)
    ddp = None
    if kind == "ddp":
        # Gradients are views into DDP's all-reduce buckets (no second copy of them); the only buffers, the rotary
        # frequencies, are computed the same on every rank, so nothing is broadcast at each forward.
        ddp = DistributedDataParallel(
            loss,
            device_ids=[device.index] if device.type == "cuda" else None,
            gradient_as_bucket_view=True,
            **no_buffer_sync_at_forward(),
        )
        if comm_hook is not None:
            ddp.register_comm_hook(None, comm_hook)
    forward_loss = ddp if ddp is not None else loss
    if compile_model:
        forward_loss = torch.compile(forward_loss)
    return Parallelized(model, forward_loss, kind, mesh, ddp)


def torch_release() -> tuple[int, int]:
    """torch's (major, minor): the trainer runs on the pinned 2.13 and on the HyperPodPyTorchJob image's 2.11
    (trainer/stack-hyperpod.txt, docs/images.md)."""
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


def no_buffer_sync_at_forward() -> dict[str, bool]:
    """DDP's keyword for not broadcasting buffers at each forward: torch 2.12 renamed `broadcast_buffers` to
    `forward_sync_buffers` (the old name warns there)."""
    return {"forward_sync_buffers": False} if torch_release() >= (2, 12) else {"broadcast_buffers": False}


# What selective activation checkpointing keeps from a block's forward: the matmuls' and attention's outputs (the
# costly part to compute again); everything elementwise (norms, activations, rotary, residual adds) is recomputed.
_KEPT_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
}


def _keep_matmuls(_ctx: Any, op: Any, *_args: Any, **_kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _KEPT_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def recompute_activations(model: torch.nn.Module, mode: str) -> None:
    """Activation checkpointing per block (transformers' activation_checkpointing_enable, non-reentrant): `full`
    keeps only each block's input and runs its forward again in backward; `selective` keeps the matmuls' outputs too
    and recomputes only the cheap elementwise work; `none` keeps everything."""
    if mode == "none":
        return
    kwargs: dict[str, Any] = {"use_reentrant": False}
    if mode == "selective":
        kwargs["context_fn"] = functools.partial(create_selective_checkpoint_contexts, _keep_matmuls)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)


def shard(model: torch.nn.Module, kind: str, device: torch.device, local_world: int) -> tuple[str, DeviceMesh | None]:
    """fully_shard the units (the module docstring), for fsdp and hsdp, still on the meta device (nothing is
    allocated); the parallelism it became (fsdp on several nodes is hsdp) and its mesh."""
    if kind == "ddp":
        return kind, None
    world = dist.get_world_size()
    kind = "hsdp" if kind == "hsdp" or world > local_world else "fsdp"
    mesh = fsdp_mesh(device, kind, world, local_world)
    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if device.type == "cuda"
        else MixedPrecisionPolicy()
    )
    embedding, (norm, head) = model.get_input_embeddings(), output_units(model)
    if not model.config.tie_word_embeddings:
        fully_shard(embedding, mesh=mesh, mp_policy=policy)
        # Not resharded after forward: the output is the first unit backward needs (torchtitan's choice too).
        fully_shard([norm, head], mesh=mesh, mp_policy=policy, reshard_after_forward=False)
    for block in blocks(model).values():
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return kind, mesh


def output_units(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The decoder's final norm and the output layer: what runs after the last block."""
    base = model.base_model
    norm = getattr(base, "norm", None) or getattr(base, "ln_f", None)  # Llama, GPT-2
    if norm is None:
        raise ValueError(f"{type(base).__name__} has no final norm named norm or ln_f")
    return norm, model.get_output_embeddings()


def fsdp_mesh(device: torch.device, kind: str, world: int, local_world: int) -> DeviceMesh:
    """fsdp: one dimension over every rank. hsdp: replicas across nodes x shards within a node."""
    if kind == "fsdp":
        return init_device_mesh(device.type, (world,), mesh_dim_names=("shard",))
    if world % local_world:
        raise ValueError(f"hsdp needs whole nodes: {world} ranks are not a multiple of {local_world} per node")
    return init_device_mesh(device.type, (world // local_world, local_world), mesh_dim_names=("replicate", "shard"))


def blocks(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The transformer blocks, by name: the modules transformers keeps whole when it splits a model
    (`_no_split_modules`: GPT2Block, LlamaDecoderLayer)."""
    kinds = set(getattr(model, "_no_split_modules", None) or ())  # fully_shard subclasses them (FSDPGPT2Block)
    return {
        name: module
        for name, module in model.named_modules()
        if any(cls.__name__ in kinds for cls in type(module).__mro__)
    }


def init_units(template: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """What the initial weights are drawn in, one at a time: each block whole, then each other module that holds
    weights or buffers of its own (embeddings, final norm, output layer, rotary frequencies)."""
    block_names = blocks(template)
    units = dict(block_names)
    for name, module in template.named_modules():
        inside = any(name == b or name.startswith(b + ".") for b in block_names)
        if inside or not (list(module.parameters(recurse=False)) or list(module.buffers(recurse=False))):
            continue
        if any(True for child in module.children() for _ in child.parameters()):
            raise ValueError(f"module {name!r} holds weights beside child modules that do: no unit to draw it in")
        units[name] = module
    return units


def unit_seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"init/{seed}/{name}".encode(), digest_size=8).digest()) % 2**63


@torch.no_grad()
def initialize(model: torch.nn.Module, template: torch.nn.Module, seed: int, weights: bool = True) -> None:
    """Draw the initial weights of `model` (its storage allocated, its values garbage) unit by unit (see the module
    docstring); a weight tied to one already drawn (GPT-2's output layer) keeps the first draw. Without `weights`,
    only the units that hold buffers (the rotary frequencies) are computed: drawing 8B random weights only to
    overwrite them takes longer than loading them, and a unit's host memory."""
    drawn: set[int] = set()
    for name, unit in init_units(template).items():
        if not weights and not any(True for _ in unit.buffers()):
            continue
        full = copy.deepcopy(unit).to_empty(device="cpu")
        torch.manual_seed(unit_seed(seed, name))
        full.apply(template._init_weights)
        live = model.get_submodule(name)
        targets = {**dict(live.named_parameters()), **dict(live.named_buffers())}
        for key, value in [*full.named_parameters(), *full.named_buffers()]:
            target = targets[key]
            if id(target) in drawn:
                continue
            drawn.add(id(target))
            value = value.to(target.device)
            if isinstance(target, DTensor):  # this rank's shard of the full draw, cut where FSDP cut it
                shard = distribute_tensor(value, target.device_mesh, target.placements, src_data_rank=None)
                target.to_local().copy_(shard.to_local())
                del shard
            else:
                target.copy_(value)
            del value
        del full  # before the next unit is drawn: one unit whole at a time
