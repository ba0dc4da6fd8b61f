"""The private PyTorch APIs the trainer relies on, each in one place, so that a torch upgrade that changes one fails
tests/test_private_api.py on the pinned stack instead of a training run."""

from __future__ import annotations

import torch
import torch.distributed as dist

# DCP's file reader calls this for each item it reads (torch/distributed/checkpoint/filesystem.py,
# FileSystemReader.read_data): trainer/dcp_io.py's VerifyingReader overrides it to check each item's CRC32.
READER_SLICE_HOOK = "_slice_file"
# DCP's Hugging Face reader reads each item with this, given the open safetensors file (torch/distributed/checkpoint/
# hf_storage.py, HuggingFaceStorageReader.read_data): trainer/published_weights.py's TensorAtATimeReader calls it.
HF_READ_ITEM = "_process_read_request"


def default_store() -> dist.Store:
    """The default process group's store (torchrun's rendezvous store): the attempt number and the heartbeat live
    there, since a collective would create NCCL's communicator before its per-attempt debug file is set."""
    return dist.distributed_c10d._get_default_store()


def skip_update_if(optimizer: torch.optim.Optimizer, nonfinite: torch.Tensor) -> None:
    """Give the fused AdamW kernel its `found_inf` input, as torch.amp.GradScaler does: the next `step()` leaves
    the parameters as they are when it is 1, decided on the device, with no host sync."""
    optimizer.found_inf = nonfinite.float()
