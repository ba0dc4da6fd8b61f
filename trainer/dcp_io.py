"""The tensors of a checkpoint through torch.distributed.checkpoint (DCP): written in parallel, read once.

Saving: each rank offers DCP only its share of the (replicated) model and optimizer state, the tensors assigned to
it by size (`share`), so the ranks write about equal shares side by side, one file each, fsynced, and an
asynchronous save copies to host memory only what this rank writes. Loading: the tensors are dealt out to the
ranks the same way, each rank reads only its share, and the owners broadcast them, so the checkpoint is read once
in all, not once per rank. Every tensor item is a small
torch.save archive whose records carry a CRC32; torch.load does not check it, so the reader here does, on the
bytes it reads anyway.

Keys are fully qualified names: `model.<parameter>` and `optim.state.<parameter>.<exp_avg|exp_avg_sq|step>`
(torch.distributed.checkpoint.state_dict's flattened optimizer form), which do not depend on the world size.
The optimizer's hyperparameters are not tensors; they travel beside, in the trainer state.
"""

from __future__ import annotations

import errno
import io
import zipfile
from pathlib import Path
from typing import IO, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

MODEL, OPTIM = "model.", "optim."
_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


class CorruptCheckpoint(Exception):
    """An item whose bytes are missing or fail their CRC32."""


def split_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    """The live model and optimizer state by name: the tensors (views of the training state, for DCP) and the
    optimizer's other entries (learning rate, betas, ...). An optimizer that has not stepped yet gets its state
    created first (DCP's own zero-learning-rate step), so that there is something to load into.

    A tensor tied to an earlier one (GPT-2's output layer is its token embedding) is left out: DCP deduplicates by
    name, not by storage, and would write it twice; loading the first fills both."""
    model_state, optim_state = get_state_dict(model, optimizer, options=_FLAT)
    tensors = {MODEL + k: v for k, v in model_state.items() if k not in tied_aliases(model_state)}
    other = {}
    for key, value in optim_state.items():
        (tensors if isinstance(value, torch.Tensor) else other)[OPTIM + key] = value
    return tensors, other


def apply_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, tensors: dict, other: dict) -> None:
    """split_state's inverse: the loaded tensors and the saved other entries back into the model and optimizer."""
    both = {**tensors, **other}
    model_state = {k.removeprefix(MODEL): v for k, v in both.items() if k.startswith(MODEL)}
    for alias, first in tied_aliases(model.state_dict()).items():
        model_state[alias] = model_state[first]
    optim_state = {k.removeprefix(OPTIM): v for k, v in both.items() if k.startswith(OPTIM)}
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state, options=_FLAT)


def apply_whole_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, model_state: dict, optim_state: dict
) -> None:
    """A whole model and optimizer state as a single-file checkpoint holds it (the optimizer's by parameter index, in
    the order of its groups), into a model of any parallelism: each rank keeps its shard under fsdp. Group entries
    this optimizer does not have (LambdaLR's initial_lr, from before trainer/schedule.py) are left out."""
    names = {id(p): name for name, p in model.named_parameters()}
    order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    groups = [
        {**{k: v for k, v in saved.items() if k in live}, "params": [order[i] for i in saved["params"]]}
        for saved, live in zip(optim_state["param_groups"], optimizer.param_groups, strict=True)
    ]
    by_name = {"state": {order[index]: state for index, state in optim_state["state"].items()}, "param_groups": groups}
    set_state_dict(
        model,
        optimizer,
        model_state_dict=model_state,
        optim_state_dict=by_name,
        options=StateDictOptions(full_state_dict=True),
    )


def tied_aliases(state: dict[str, torch.Tensor]) -> dict[str, str]:
    """Each name whose tensor is an earlier name's (the same storage, offset and shape), with that earlier name."""
    first: dict[tuple, str] = {}
    aliases = {}
    for name, tensor in state.items():
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor  # a shard's storage is this rank's piece
        key = (local.untyped_storage().data_ptr(), local.storage_offset(), tuple(tensor.shape), tensor.dtype)
        if key in first:
            aliases[name] = first[key]
        else:
            first[key] = name
    return aliases


# -- writing ----------------------------------------------------------------------------------------------


def writer(path: Path, full: bool = False) -> dcp.FileSystemWriter:
    """One file per rank, fsynced before DCP reports it written (so before .metadata, and before our commit).
    `full`: a writer that fails as on a full file system (fault injection, --fault-save-at-step)."""
    kind = FullDiskWriter if full else dcp.FileSystemWriter
    return kind(path, single_file_per_rank=True, sync_files=True, thread_count=1, overwrite=True)


class FullDiskWriter(dcp.FileSystemWriter):
    """Every write fails with ENOSPC, as DCP's writer does when the volume is full."""

    def write_data(self, plan: Any, planner: Any) -> Any:
        raise OSError(errno.ENOSPC, "No space left on device (fault injection: --fault-save-at-step)")


def written_bytes(path: Path) -> dict[int, int]:
    """Bytes each rank wrote into the DCP checkpoint at `path` (its files are named __<rank>_<n>.distcp)."""
    shares: dict[int, int] = {}
    for item in dcp.FileSystemReader(path).read_metadata().storage_data.values():
        rank = int(item.relative_path.split("_")[2])
        shares[rank] = shares.get(rank, 0) + item.length
    return shares


# -- reading ----------------------------------------------------------------------------------------------


class VerifyingReader(dcp.FileSystemReader):
    """DCP's file reader, with every item's CRC32 records checked on the bytes read for it (through its private
    per-item hook: trainer/private_api.py READER_SLICE_HOOK)."""

    def _slice_file(self, file: IO[bytes], sinfo: Any) -> IO[bytes]:
        file.seek(sinfo.offset)
        data = file.read(sinfo.length)
        where = f"{Path(self.path) / sinfo.relative_path} at byte {sinfo.offset}"
        if len(data) != sinfo.length:
            raise CorruptCheckpoint(f"{where}: {len(data)} of the item's {sinfo.length} bytes are there")
        try:
            with zipfile.ZipFile(io.BytesIO(data)) as archive:
                bad = archive.testzip()
        except zipfile.BadZipFile as exc:
            raise CorruptCheckpoint(f"{where}: not a tensor record ({exc})") from None
        if bad is not None:
            raise CorruptCheckpoint(f"{where}: record {bad} fails its CRC32")
        return io.BytesIO(data)


def owners(tensors: dict[str, torch.Tensor], world: int) -> dict[str, int]:
    """Who reads (or writes) each tensor: the largest first, each to the rank with the fewest bytes so far; the same
    answer on every rank (a DTensor counts its global size, the same on every rank)."""
    load = [0] * world
    owner = {}
    for key in sorted(tensors, key=lambda k: (-_global_bytes(tensors[k]), k)):
        owner[key] = min(range(world), key=lambda r: (load[r], r))
        load[owner[key]] += _global_bytes(tensors[key])
    return owner


def _global_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()  # a DTensor's numel is its global one


def _replicas(tensor: DTensor) -> tuple[int, int]:
    """(how many replicas of each shard, which of them this rank holds): over the mesh dimensions the tensor is
    replicated on (HSDP's replicate dimension); (1, 0) for one sharded everywhere."""
    mesh, count, index = tensor.device_mesh, 1, 0
    for dim, placement in enumerate(tensor.placements):
        if placement.is_replicate():
            index = index * mesh.size(dim) + mesh.get_local_rank(dim)
            count *= mesh.size(dim)
    return count, index


def share(tensors: dict[str, torch.Tensor], rank: int, world: int) -> dict[str, torch.Tensor]:
    """The tensors this rank writes, so that an asynchronous save stages (copies to host memory) only those: DCP's
    stager copies whatever it is handed, before its planner drops the duplicates. DCP takes state dicts whose keys
    differ by rank and writes their union.

    A tensor every rank holds whole (DDP's) goes to one rank (`owners`: balanced shares, at most 1/world of the
    state plus one tensor). A sharded tensor (FSDP's DTensor) is offered by every rank that holds a piece: under
    fsdp each rank its own; under hsdp each replica holds every piece, so each tensor goes to one replica (`owners`
    over the replicas), whose ranks offer their pieces: each rank stages what it writes, about 1/world of it."""
    whole = {key: tensor for key, tensor in tensors.items() if not isinstance(tensor, DTensor)}
    owner = owners(whole, world)
    replicated = {key: t for key, t in tensors.items() if isinstance(t, DTensor) and _replicas(t)[0] > 1}
    if replicated:
        replicas, mine = _replicas(next(iter(replicated.values())))
        replica_owner = owners(replicated, replicas)
        owner |= {key: rank if replica_owner[key] == mine else -1 for key in replicated}
    return {key: tensor for key, tensor in tensors.items() if owner.get(key, rank) == rank}


def load_shared(path: Path, tensors: dict[str, torch.Tensor], group: dist.ProcessGroup | None) -> None:
    """Fill `tensors` (every rank's full, replicated state) from the checkpoint at `path`, collectively: each rank
    reads its share (DCP over `group`), then each tensor is broadcast from the rank that read it.

    Tensors that the default process group cannot carry (CPU scalars under NCCL) are read by every rank. Sharded
    tensors (FSDP's DTensors) are read by DCP alone: each rank reads the pieces it holds, whatever the sharding the
    checkpoint was written with."""
    if any(isinstance(t, DTensor) for t in tensors.values()):
        dcp.load(tensors, storage_reader=VerifyingReader(path), process_group=group)
        return
    rank, world = dist.get_rank(), dist.get_world_size()
    backend_device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    shareable = {k: t for k, t in tensors.items() if t.device.type == backend_device}
    owner = owners(shareable, world)
    mine = {k: t for k, t in tensors.items() if owner.get(k, rank) == rank}
    dcp.load(mine, storage_reader=VerifyingReader(path), process_group=group)
    for key in sorted(owner):
        dist.broadcast(tensors[key], src=owner[key])


def saved_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Each tensor's name and whole shape in the checkpoint at `path`, from its metadata (nothing else is read)."""
    metadata = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    return {key: tuple(md.size) for key, md in metadata.items() if isinstance(md, TensorStorageMetadata)}


def load_into(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Fill `tensors` (by their names in the checkpoint) in place, read by this process alone: each piece is read,
    checked, copied into its tensor (converted to its dtype) and dropped before the next."""
    dcp.load(tensors, storage_reader=VerifyingReader(path), no_dist=True)


def load_alone(path: Path, prefix: str = "") -> dict[str, torch.Tensor]:
    """The tensors whose names start with `prefix`, read by this process alone (no process group): evaluation reads
    the weights (MODEL) and nothing of the optimizer."""
    metadata = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    tensors = {
        key: torch.empty(md.size, dtype=md.properties.dtype)
        for key, md in metadata.items()
        if key.startswith(prefix) and isinstance(md, TensorStorageMetadata)
    }
    load_into(path, tensors)
    return tensors
