"""The trainer under torchrun with every host-device synchronisation point of the training thread counted.

Run as `torchrun ... -m tests.sync_probe` with the trainer's TRAINER_* settings and SYNC_PROBE_OUT (a directory):
each rank writes `rank_<r>.json`, the events of its training thread in order, for tests/test_trainer.py.

What is counted: the calls that make the host wait for a tensor's value (`Tensor.__bool__`, `item`, `tolist`,
`__float__`, `__int__`, `numpy`, `cpu`) and waits on a collective (`Work.wait`); which step each happened in (the
trainer calls Heartbeat.stepped once per step); and the host-to-device copies of token rows (`Tensor.to` of an int32
[batch, seq_len + 1] tensor). A read of a flag tensor that an earlier step's all-reduce produced, and a wait on an
earlier step's all-reduce, are marked `earlier`: a value the device finished while the host went on. A wait that a
collective called without async_op makes for itself inside c10d is marked `collective_itself`: under NCCL it orders
the stream and the host goes on (FSDP's all-gathers and reduce-scatters are such calls).
"""

from __future__ import annotations

import functools
import json
import os
import sys
import threading
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from trainer import health, train_ddp

SYNCING_METHODS = ("__bool__", "item", "tolist", "__float__", "__int__", "numpy", "cpu")


class Probe:
    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.segment = 1  # the step the training thread is in (stepped(n) ends step n)
        self.main = threading.get_ident()
        self.reduced_in: dict[int, int] = {}  # id of an async all-reduce's tensor or work -> the segment it began in
        self.kept: list[Any] = []

    def record(self, kind: str, **details: Any) -> None:
        if threading.get_ident() == self.main:
            self.events.append({"step": self.segment, "kind": kind, **details})
            if details.get("earlier") is False:  # where it came from, for the test's message
                caller = traceback.extract_stack(limit=6)[:-2]
                self.events[-1]["where"] = " < ".join(f"{Path(f.filename).name}:{f.lineno}" for f in reversed(caller))

    def install(self) -> None:
        for name in SYNCING_METHODS:
            self._wrap_tensor_method(name)
        original_to = torch.Tensor.to

        def to(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            if tensor.dtype == torch.int32 and tensor.dim() == 2:
                self.record("h2d", shape=list(tensor.shape), non_blocking=bool(kwargs.get("non_blocking")))
            return original_to(tensor, *args, **kwargs)

        torch.Tensor.to = to  # type: ignore[method-assign]
        original_wait = dist.Work.wait

        def wait(work: Any, *args: Any, **kwargs: Any) -> Any:
            began = self.reduced_in.get(id(work))
            # A collective called without async_op waits for itself inside c10d (FSDP's all-gathers and
            # reduce-scatters): the host waits under gloo; under NCCL only the stream does.
            collective_itself = sys._getframe(1).f_code.co_filename.endswith("distributed_c10d.py")
            self.record(
                "Work.wait", earlier=began is not None and began < self.segment, collective_itself=collective_itself
            )
            return original_wait(work, *args, **kwargs)

        dist.Work.wait = wait
        original_all_reduce = dist.all_reduce

        @functools.wraps(original_all_reduce)
        def all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            work = original_all_reduce(tensor, *args, **kwargs)
            if kwargs.get("async_op"):
                self.reduced_in[id(tensor)] = self.reduced_in[id(work)] = self.segment
                self.kept += [tensor, work]  # alive to the end, so that no other object takes their ids
            return work

        dist.all_reduce = all_reduce
        original_stepped = health.Heartbeat.stepped

        def stepped(heartbeat: health.Heartbeat, step: int) -> None:
            self.record("stepped", step=step)
            self.segment = step + 1
            original_stepped(heartbeat, step)

        health.Heartbeat.stepped = stepped  # type: ignore[method-assign]

    def _wrap_tensor_method(self, name: str) -> None:
        original = getattr(torch.Tensor, name)

        @functools.wraps(original)
        def counted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            began = self.reduced_in.get(id(tensor))
            self.record(name, earlier=began is not None and began < self.segment)
            return original(tensor, *args, **kwargs)

        setattr(torch.Tensor, name, counted)


def main() -> int:
    probe = Probe()
    probe.install()
    code = train_ddp.main(sys.argv[1:])
    out = Path(os.environ["SYNC_PROBE_OUT"])
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank_{os.environ['RANK']}.json").write_text(json.dumps(probe.events))
    return code


if __name__ == "__main__":
    train_ddp.exit_now(main())
