"""The learning-rate schedule: an object in every checkpoint, so that a resume keeps the run's shape.

A fresh run warms up linearly to the peak over `warmup_steps`, then decays by a cosine to `min_lr_ratio` x peak
at `max_steps`. A resume under other settings is refused unless it asks for an extension (--extend-schedule). An
extension starts at the step it resumes from, at the learning rate that step had (no jump), and is one of

    continue  a cosine from that learning rate down to min_lr_ratio x peak at the new `max_steps`: more steps at the
              rate the run had, no re-warm (a finished run goes on at its end learning rate). The peak and the
              warm-up stay the run's: another --lr or --warmup-steps is refused, as is a rate below the end one.
    rewarm    linear to the new peak over the new `warmup_steps`, then a cosine to `min_lr_ratio` x the new peak at
              the new `max_steps` (a re-warm, then a second decay; it can raise the loss for a while).

Extensions are recorded in the schedule's state, so a later resume reproduces them.

`lr_at(step)` is the learning rate of the optimizer step taken when `step` steps are done (0 for the first).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from trainer.config import CONTINUE, EXTENSIONS, REWARM
from trainer.errors import CheckpointError


@dataclass(frozen=True)
class ScheduleSettings:
    """What the flags set, under the flags' names (`lr` is the peak)."""

    lr: float
    warmup_steps: int
    max_steps: int
    min_lr_ratio: float

    @classmethod
    def of(cls, config: Any) -> ScheduleSettings:
        """From anything with these attributes (a TrainConfig)."""
        return cls(**{f.name: getattr(config, f.name) for f in fields(cls)})

    def differences(self, other: ScheduleSettings) -> list[str]:
        """The settings that differ, as 'name: mine -> other'."""
        return [
            f"{f.name}: {getattr(self, f.name)!r} -> {getattr(other, f.name)!r}"
            for f in fields(self)
            if getattr(self, f.name) != getattr(other, f.name)
        ]

    def cosine(self, progress: float) -> float:
        """The decay from the peak (progress 0) to min_lr_ratio x peak (progress 1 and beyond)."""
        factor = self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
        return self.lr * factor


@dataclass(frozen=True)
class Extension:
    """From `start_step` on, from `start_lr`: `continue`, a cosine down to the end learning rate at the new max_steps;
    `rewarm`, linear to the new peak over its warm-up, then the cosine."""

    start_step: int
    start_lr: float
    settings: ScheduleSettings
    kind: str = REWARM  # extensions saved before `continue` existed were all re-warms

    def lr_at(self, step: int) -> float:
        s, new = step - self.start_step, self.settings
        if self.kind == CONTINUE:
            end = new.lr * new.min_lr_ratio
            progress = min(1.0, s / max(1, new.max_steps - self.start_step))
            return end + (self.start_lr - end) * 0.5 * (1 + math.cos(math.pi * progress))
        if s < new.warmup_steps:
            return self.start_lr + (new.lr - self.start_lr) * s / new.warmup_steps
        return new.cosine((s - new.warmup_steps) / max(1, new.max_steps - self.start_step - new.warmup_steps))


@dataclass
class LRSchedule:
    """The run's schedule: the settings it started with, and each extension since, in order."""

    base: ScheduleSettings
    extensions: list[Extension] = field(default_factory=list)

    @property
    def current(self) -> ScheduleSettings:
        """The settings in force now: a resume with the same flags continues without a word."""
        return self.extensions[-1].settings if self.extensions else self.base

    def lr_at(self, step: int) -> float:
        for extension in reversed(self.extensions):
            if step >= extension.start_step:
                return extension.lr_at(step)
        base = self.base
        if step < base.warmup_steps:
            return base.lr * ((step + 1) / base.warmup_steps)
        return base.cosine((step - base.warmup_steps) / max(1, base.max_steps - base.warmup_steps))

    def extend(self, step: int, settings: ScheduleSettings, kind: str = REWARM) -> None:
        """Go on from `step`, at the learning rate it has now, to `settings`' end, as `kind` says; a CheckpointError
        in one line for what `kind` cannot do."""
        if settings.max_steps <= step:
            raise CheckpointError(
                f"--extend-schedule: --max-steps {settings.max_steps} is not beyond step {step}, "
                "where the checkpoint resumes: give a larger --max-steps"
            )
        start_lr = self.lr_at(step)
        if kind == CONTINUE:
            fixed = [c for c in self.current.differences(settings) if c.startswith(("lr:", "warmup_steps:"))]
            if fixed:
                raise CheckpointError(
                    f"--extend-schedule continue keeps the run's peak learning rate and warm-up "
                    f"({'; '.join(fixed)}): give the run's own --lr and --warmup-steps, or "
                    "--extend-schedule rewarm to warm up to new ones"
                )
            end = settings.lr * settings.min_lr_ratio
            if start_lr < end * (1 - 1e-12):  # (a finished decay ends on it, give or take rounding)
                raise CheckpointError(
                    f"--extend-schedule continue decays from the learning rate at step {step} "
                    f"({start_lr:.3g}), which is below the end learning rate ({end:.3g}): give "
                    "--extend-schedule rewarm to go up to a peak first"
                )
        elif kind != REWARM:
            raise CheckpointError(f"--extend-schedule {kind!r} is unknown: give {' or '.join(EXTENSIONS)}")
        self.extensions.append(Extension(step, start_lr, settings, kind))

    def resume(self, step: int, settings: ScheduleSettings, extend: str) -> list[str]:
        """Check the flags' `settings` against the schedule in force at `step`; with `extend` (continue or rewarm),
        go on to them. Returns the changes ('name: old -> new'); raises CheckpointError, naming them, without
        `extend`."""
        changes = self.current.differences(settings)
        if changes and not extend:
            raise CheckpointError(
                f"the checkpoint's learning-rate schedule differs from this run's flags ({'; '.join(changes)}): "
                "resume with the checkpoint's settings, or give --extend-schedule: continue (the decay goes on "
                "from the current learning rate to the new max-steps) or rewarm (a warm-up to the new --lr, then a "
                "decay)"
            )
        if changes:
            self.extend(step, settings, extend)
        return changes

    def state_dict(self) -> dict[str, Any]:
        return {
            "base": asdict(self.base),
            "extensions": [
                {"start_step": e.start_step, "start_lr": e.start_lr, "settings": asdict(e.settings), "kind": e.kind}
                for e in self.extensions
            ],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.base = ScheduleSettings(**state["base"])
        self.extensions = [
            Extension(e["start_step"], e["start_lr"], ScheduleSettings(**e["settings"]), e.get("kind", REWARM))
            for e in state["extensions"]
        ]
