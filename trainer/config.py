"""The trainer's configuration: one dataclass, whose defaults the launcher and the CLI share."""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass
class TrainConfig:
    data_dir: str
    run_dir: str
    preset: str = "small"
    max_steps: int = 200
    seed: int = 1234
    batch_size: int = 8  # per rank
    seq_len: int = 128
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    checkpoint_every: int = 50
    log_every: int = 10


TRAIN_DEFAULTS = {f.name: f.default for f in fields(TrainConfig) if f.name not in ("data_dir", "run_dir")}
