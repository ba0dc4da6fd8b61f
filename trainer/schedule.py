"""The learning-rate schedule: an object in every checkpoint, so that a resume keeps the run's shape.

A fresh run warms up linearly to the peak over `warmup_steps`, then decays by a cosine to `min_lr_ratio` x peak
at `max_steps`. A resume under other settings is refused unless it asks for an extension (--extend-schedule);
an extension starts at the step it resumes from, at the learning rate that step had, goes linearly to the new
peak over the new `warmup_steps`, then by a cosine to `min_lr_ratio` x the new peak at the new `max_steps`
(re-warm, then decay). Extensions are recorded in the schedule's state, so a later resume reproduces them.

`lr_at(step)` is the learning rate of the optimizer step taken when `step` steps are done (0 for the first).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from trainer.checkpoint import CheckpointError


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
        return [f"{f.name}: {getattr(self, f.name)!r} -> {getattr(other, f.name)!r}" for f in fields(self)
                if getattr(self, f.name) != getattr(other, f.name)]  # fmt: skip

    def cosine(self, progress: float) -> float:
        """The decay from the peak (progress 0) to min_lr_ratio x peak (progress 1 and beyond)."""
        factor = self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
        return self.lr * factor


@dataclass(frozen=True)
class Extension:
    """From `start_step` on: linear from `start_lr` to the new peak over its warm-up, then the cosine."""

    start_step: int
    start_lr: float
    settings: ScheduleSettings

    def lr_at(self, step: int) -> float:
        s, new = step - self.start_step, self.settings
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

    def extend(self, step: int, settings: ScheduleSettings) -> None:
        """Continue from `step`, at the learning rate it has now, to `settings`' end."""
        if settings.max_steps <= step:
            raise CheckpointError(f"--extend-schedule: --max-steps {settings.max_steps} is not beyond step {step}, "
                                  "where the checkpoint resumes: give a larger --max-steps")  # fmt: skip
        self.extensions.append(Extension(step, self.lr_at(step), settings))

    def resume(self, step: int, settings: ScheduleSettings, extend: bool) -> list[str]:
        """Check the flags' `settings` against the schedule in force at `step`; with `extend`, continue to them.
        Returns the changes ('name: old -> new'); raises CheckpointError, naming them, without `extend`."""
        changes = self.current.differences(settings)
        if changes and not extend:
            raise CheckpointError(
                f"the checkpoint's learning-rate schedule differs from this run's flags ({'; '.join(changes)}): "
                "resume with the checkpoint's settings, or give --extend-schedule to continue from the current "
                "learning rate to the new ones"
            )
        if changes:
            self.extend(step, settings)
        return changes

    def state_dict(self) -> dict[str, Any]:
        return {
            "base": asdict(self.base),
            "extensions": [{"start_step": e.start_step, "start_lr": e.start_lr, "settings": asdict(e.settings)}
                           for e in self.extensions],
        }  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.base = ScheduleSettings(**state["base"])
        self.extensions = [Extension(e["start_step"], e["start_lr"], ScheduleSettings(**e["settings"]))
                           for e in state["extensions"]]  # fmt: skip
