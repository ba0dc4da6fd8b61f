"""The trainer with CUDA's sync debug mode set to "error" on every step that should make no host sync.

torchrun entry (`-m bench.sync_debug <trainer flags>`), for bench/gpu_check.sh: the same steps tests/test_trainer.py
counts on the CPU (a step with nothing to log or save, after one with nothing either) run with
torch.cuda.set_sync_debug_mode("error"), so any call that waits for the device there (an `.item()`, a blocking
copy to the host, a `nonzero`) raises instead of passing unnoticed. The other steps run in the default mode.
Without a GPU it runs the trainer unchanged (a dry run of the script).
"""

from __future__ import annotations

import sys

import torch

from trainer import health, train_ddp
from trainer.config import parse_config


def main(argv: list[str]) -> int:
    cfg = parse_config(argv)

    def sync_step(step: int) -> bool:  # as the training loop decides (a fresh run: its first step is step 1)
        return step == 1 or step % cfg.log_every == 0 or step % cfg.checkpoint_every == 0 or step >= cfg.max_steps

    stepped = health.Heartbeat.stepped

    def strict_between_sync_steps(heartbeat: health.Heartbeat, step: int) -> None:
        stepped(heartbeat, step)
        if torch.cuda.is_available():  # what runs next: the log of `step`, if any, then step + 1
            torch.cuda.set_sync_debug_mode("error" if not sync_step(step) and not sync_step(step + 1) else "default")

    health.Heartbeat.stepped = strict_between_sync_steps  # type: ignore[method-assign]
    return train_ddp.main(argv)


if __name__ == "__main__":
    train_ddp.exit_now(main(sys.argv[1:]))
