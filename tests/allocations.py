"""What tensors a piece of code holds at once, on any device: the bytes of every tensor storage an op creates while
it runs, for as long as it lives, and their peak. A view or an in-place result (its storage is one of the op's
inputs') is not new memory; a storage is counted at its current size, so one that FSDP frees by resizing it to
nothing (its unsharded parameters between uses) counts nothing. The figure is what the code allocated, not what the
allocator or the process reserved (tests/test_loss.py, tests/parallel_probe.py, tests/test_memory.py)."""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def _storages(tree: Any) -> list[torch.UntypedStorage]:
    return [t.untyped_storage() for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


class LiveBytes(TorchDispatchMode):
    """`with LiveBytes() as held:` ... `held.peak`, `held.live`: bytes of the storages created inside, at most and
    now."""

    def __init__(self) -> None:
        super().__init__()
        self.peak = 0
        self._created: dict[int, weakref.ref] = {}

    @property
    def live(self) -> int:
        return sum(storage.nbytes() for ref in self._created.values() if (storage := ref()) is not None)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {storage.data_ptr() for storage in _storages((args, kwargs))}
        for storage in _storages(out):
            key = storage.data_ptr()
            if key in inputs or key in self._created or storage.nbytes() == 0:
                continue
            self._created[key] = weakref.ref(storage)
            weakref.finalize(storage, self._created.pop, key, None)
        self.peak = max(self.peak, self.live)
        return out
