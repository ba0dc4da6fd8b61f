"""Launch the trainer: what the job runs is decided here, where it runs is the backend's business.

backend="local" runs torchrun as a subprocess on this machine (CPU and gloo, or local GPUs);
backend="kubernetes" creates a kubeflow.org/v1 PyTorchJob (the launcher issue builds it; until then
it is refused with a clear message rather than pretending).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from components.errors import InputError
from trainer.config import TRAIN_DEFAULTS
from trainer.layout import DatasetPaths, RunPaths
from trainer.model import PRESETS

log = logging.getLogger(__name__)

BACKENDS = ("local", "kubernetes")


@dataclass
class LaunchConfig:
    storage_root: str
    dataset: str
    run_id: str
    backend: str = "local"
    nnodes: int = 1
    nproc_per_node: int = 2
    preset: str = TRAIN_DEFAULTS["preset"]
    max_steps: int = TRAIN_DEFAULTS["max_steps"]
    seed: int = TRAIN_DEFAULTS["seed"]
    batch_size: int = TRAIN_DEFAULTS["batch_size"]
    seq_len: int = TRAIN_DEFAULTS["seq_len"]
    lr: float = TRAIN_DEFAULTS["lr"]
    warmup_steps: int = TRAIN_DEFAULTS["warmup_steps"]
    checkpoint_every: int = TRAIN_DEFAULTS["checkpoint_every"]
    log_every: int = TRAIN_DEFAULTS["log_every"]
    timeout_s: int = 0  # 0: no deadline
    extra_env: dict[str, str] = field(default_factory=dict)

    @property
    def dataset_paths(self) -> DatasetPaths:
        return DatasetPaths.of(self.storage_root, self.dataset)

    @property
    def run_paths(self) -> RunPaths:
        return RunPaths.of(self.storage_root, self.run_id)

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    def validate(self) -> None:
        """Fail before anything starts, with one line naming the input."""
        if self.backend not in BACKENDS:
            raise InputError(f"backend {self.backend!r} is unknown: choose one of {', '.join(BACKENDS)}")
        for name in (
            "nnodes",
            "nproc_per_node",
            "max_steps",
            "batch_size",
            "seq_len",
            "warmup_steps",
            "checkpoint_every",
            "log_every",
        ):
            if getattr(self, name) <= 0:
                raise InputError(f"{name.replace('_', '-')} must be a positive integer, got {getattr(self, name)}")
        if self.timeout_s < 0:
            raise InputError(f"timeout-s must be 0 (none) or positive, got {self.timeout_s}")
        if not self.lr > 0:
            raise InputError(f"lr must be positive, got {self.lr}")
        if self.preset not in PRESETS:
            raise InputError(f"model preset {self.preset!r} is unknown: choose one of {', '.join(PRESETS)}")
        try:
            meta = self.dataset_paths.meta
            RunPaths.of(self.storage_root, self.run_id)  # checks the run id
        except ValueError as exc:
            raise InputError(str(exc)) from None
        if not meta.is_file():
            raise InputError(f"dataset {self.dataset!r} is not staged under {self.storage_root}: {meta} is missing")
        if self.backend == "local" and self.nnodes != 1:
            raise InputError(f"nnodes {self.nnodes}: the local backend runs on one node")

    def trainer_args(self) -> list[str]:
        """The trainer's command line, the same for every backend."""
        return [
            "--data-dir",
            str(self.dataset_paths.tokenized),
            "--run-dir",
            str(self.run_paths.root),
            "--preset",
            self.preset,
            "--max-steps",
            str(self.max_steps),
            "--seed",
            str(self.seed),
            "--batch-size",
            str(self.batch_size),
            "--seq-len",
            str(self.seq_len),
            "--lr",
            repr(self.lr),
            "--warmup-steps",
            str(self.warmup_steps),
            "--checkpoint-every",
            str(self.checkpoint_every),
            "--log-every",
            str(self.log_every),
        ]

    def trainer_env(self) -> dict[str, str]:
        """NCCL writes its INFO lines per process onto the volume, where verify_nccl finds them after pods are gone."""
        return {
            "NCCL_DEBUG": "INFO",
            "NCCL_DEBUG_FILE": str(self.run_paths.nccl / "%h.%p.log"),
            **self.extra_env,
        }


@dataclass
class LaunchResult:
    run_id: str
    run_dir: str
    backend: str
    world_size: int
    seconds: float


def launch(cfg: LaunchConfig) -> LaunchResult:
    cfg.validate()
    if cfg.backend == "kubernetes":
        raise InputError("backend 'kubernetes' is not available in this release: use backend 'local'")
    from components.launch_pytorchjob.local_backend import run_torchrun

    for directory in (cfg.run_paths.root, cfg.run_paths.logs, cfg.run_paths.nccl):
        Path(directory).mkdir(parents=True, exist_ok=True)
    return run_torchrun(cfg)
