"""What a checkpoint restores beside the model and optimizer tensors (those are trainer/checkpoint.py's): how far
training has come, the learning-rate schedule, the data position and the health watches, each a state_dict.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from trainer.data import DataPosition
from trainer.health import Divergence, SpikeWatch
from trainer.schedule import LRSchedule


@dataclass
class Progress:
    """How far training has come; saved in every checkpoint."""

    step: int = 0
    tokens_seen: int = 0

    def state_dict(self) -> dict[str, int]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.tokens_seen = int(state["step"]), int(state["tokens_seen"])


@dataclass
class TrainState:
    """One state_dict in, the same state out, so resume is exact."""

    schedule: LRSchedule
    progress: Progress
    data: DataPosition
    divergence: Divergence
    spikes: SpikeWatch

    def state_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name).state_dict() for name in self.__dataclass_fields__}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name in self.__dataclass_fields__:
            if name in state:  # the health state is in checkpoints from 2026-12 on; before, it starts afresh
                getattr(self, name).load_state_dict(state[name])
