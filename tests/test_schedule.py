"""The learning-rate schedule as a pure function of its state: the fresh shape, extensions, refusals, round trips."""

import math

import pytest
import torch

from trainer.checkpoint import CheckpointManager, newest_checkpoint
from trainer.errors import CheckpointError
from trainer.schedule import Extension, LRSchedule, ScheduleSettings

BASE = ScheduleSettings(lr=5e-3, warmup_steps=5, max_steps=60, min_lr_ratio=0.1)


def legacy_lr_factor(lr: float, warmup_steps: int, max_steps: int, min_lr_ratio: float):
    """The LambdaLR factor the trainer used before the schedule was an object (schema 1), copied as it was."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


@pytest.mark.parametrize("settings", [BASE, ScheduleSettings(3e-3, 20, 200, 0.1), ScheduleSettings(1e-3, 0, 7, 0.0)])
def test_a_fresh_schedule_is_the_lambdalr_one_bit_for_bit(settings: ScheduleSettings) -> None:
    """Every lr the old LambdaLR set on the optimizer, step by step, past max_steps too."""
    weight = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([weight], lr=settings.lr)
    legacy = torch.optim.lr_scheduler.LambdaLR(optimizer, legacy_lr_factor(**vars(settings)))
    schedule = LRSchedule(settings)
    for step in range(settings.max_steps + 5):
        assert schedule.lr_at(step) == optimizer.param_groups[0]["lr"], step
        optimizer.step()
        legacy.step()


def test_the_fresh_shape_warms_up_then_decays_to_the_floor() -> None:
    schedule = LRSchedule(BASE)
    assert schedule.lr_at(0) == pytest.approx(BASE.lr / 5)
    assert schedule.lr_at(4) == schedule.lr_at(5) == BASE.lr
    lrs = [schedule.lr_at(s) for s in range(5, 61)]
    assert all(a > b for a, b in zip(lrs, lrs[1:], strict=False))
    assert schedule.lr_at(60) == schedule.lr_at(1000) == pytest.approx(BASE.lr * BASE.min_lr_ratio)


def test_the_same_settings_resume_without_a_change() -> None:
    schedule = LRSchedule(BASE)
    assert schedule.resume(30, BASE, extend="") == [] and schedule.extensions == []
    assert schedule.resume(30, BASE, extend="rewarm") == [] and schedule.extensions == []


def test_other_settings_are_refused_naming_each_difference() -> None:
    schedule = LRSchedule(BASE)
    wanted = ScheduleSettings(lr=2e-3, warmup_steps=5, max_steps=200, min_lr_ratio=0.1)
    with pytest.raises(CheckpointError) as refused:
        schedule.resume(60, wanted, extend="")
    message = str(refused.value)
    assert "\n" not in message and "--extend-schedule" in message
    assert "lr: 0.005 -> 0.002" in message and "max_steps: 60 -> 200" in message
    assert "warmup_steps" not in message and "min_lr_ratio" not in message
    assert schedule.extensions == [], "a refusal changes nothing"


def test_an_extension_continues_from_the_current_lr_then_rewarms_and_decays() -> None:
    schedule = LRSchedule(BASE)
    before = [schedule.lr_at(s) for s in range(61)]
    wanted = ScheduleSettings(lr=2e-3, warmup_steps=10, max_steps=200, min_lr_ratio=0.1)
    changes = schedule.resume(60, wanted, extend="rewarm")
    assert changes == ["lr: 0.005 -> 0.002", "warmup_steps: 5 -> 10", "max_steps: 60 -> 200"]
    assert [schedule.lr_at(s) for s in range(61)] == before, "the past is unchanged"
    start = before[60]
    assert schedule.lr_at(60) == start, "no jump at the resume step"
    ramp = (wanted.lr - start) / wanted.warmup_steps
    for s in range(60, 70):
        assert schedule.lr_at(s + 1) - schedule.lr_at(s) == pytest.approx(ramp), s
    assert schedule.lr_at(70) == wanted.lr
    decay = [schedule.lr_at(s) for s in range(70, 201)]
    assert all(a > b for a, b in zip(decay, decay[1:], strict=False))
    assert schedule.lr_at(200) == schedule.lr_at(500) == pytest.approx(wanted.lr * wanted.min_lr_ratio)
    assert schedule.current == wanted


def test_an_extension_from_mid_decay_to_a_lower_peak_is_continuous() -> None:
    schedule = LRSchedule(BASE)
    start = schedule.lr_at(30)
    schedule.resume(30, ScheduleSettings(lr=1e-4, warmup_steps=4, max_steps=90, min_lr_ratio=0.5), extend="rewarm")
    assert schedule.lr_at(30) == start and schedule.lr_at(34) == 1e-4 and schedule.lr_at(90) == pytest.approx(5e-5)
    assert abs(schedule.lr_at(31) - start) == pytest.approx((start - 1e-4) / 4)


def test_an_extension_must_end_past_the_resume_step() -> None:
    schedule = LRSchedule(BASE)
    with pytest.raises(CheckpointError, match="--max-steps 40 is not beyond step 60"):
        schedule.resume(60, ScheduleSettings(5e-3, 5, 40, 0.1), extend="rewarm")
    with pytest.raises(CheckpointError, match="--max-steps 60 is not beyond step 60"):
        schedule.resume(60, ScheduleSettings(1e-3, 5, 60, 0.1), extend="rewarm")
    assert schedule.extensions == []


def test_a_second_extension_appends_and_a_round_trip_reproduces_both(tmp_path) -> None:
    schedule = LRSchedule(BASE)
    first = ScheduleSettings(lr=2e-3, warmup_steps=10, max_steps=200, min_lr_ratio=0.1)
    second = ScheduleSettings(lr=1e-3, warmup_steps=20, max_steps=400, min_lr_ratio=0.05)
    schedule.resume(60, first, extend="rewarm")
    at_150 = schedule.lr_at(150)
    assert schedule.resume(150, second, extend="rewarm") == [
        "lr: 0.002 -> 0.001",
        "warmup_steps: 10 -> 20",
        "max_steps: 200 -> 400",
        "min_lr_ratio: 0.1 -> 0.05",
    ]
    assert len(schedule.extensions) == 2 and schedule.lr_at(150) == at_150 and schedule.lr_at(170) == 1e-3
    assert schedule.lr_at(400) == pytest.approx(5e-5)

    model = torch.nn.Linear(2, 2)
    manager = CheckpointManager(tmp_path)
    manager.save(150, model, torch.optim.AdamW(model.parameters()), {"schedule": schedule.state_dict()}, {})
    manager.close()
    restored = LRSchedule(ScheduleSettings(9.0, 1, 2, 0.5))  # what the flags would build, replaced by the state
    restored.load_state_dict(newest_checkpoint(tmp_path).trainer_state()["schedule"])  # weights_only=True loading
    assert restored == schedule
    assert [restored.lr_at(s) for s in range(450)] == [schedule.lr_at(s) for s in range(450)]
    assert restored.resume(150, second, extend="") == [], "the extended run resumes with its own flags"


def test_continue_decays_from_the_current_lr_to_the_end_lr_at_the_new_max_without_a_jump() -> None:
    """Resumed mid-decay (step 30 of 60) to 120 steps: the lr of step 30 stays, then only goes down, to the same
    end lr (min_lr_ratio x the unchanged peak) at step 120 and after; no re-warm, the past unchanged."""
    schedule = LRSchedule(BASE)
    before = [schedule.lr_at(s) for s in range(31)]
    wanted = ScheduleSettings(lr=BASE.lr, warmup_steps=BASE.warmup_steps, max_steps=120, min_lr_ratio=0.1)
    assert schedule.resume(30, wanted, extend="continue") == ["max_steps: 60 -> 120"]
    assert [schedule.lr_at(s) for s in range(31)] == before, "the past is unchanged"
    assert schedule.extensions[-1].kind == "continue" and schedule.current == wanted
    lrs = [schedule.lr_at(s) for s in range(30, 131)]
    assert lrs[0] == before[30], "no jump at the resume step"
    assert all(a > b for a, b in zip(lrs[:90], lrs[1:91], strict=True)), "strictly down to the new max"
    assert lrs[1] == pytest.approx(before[30], rel=1e-3), "smoothly: the cosine starts flat, not with a step"
    assert schedule.lr_at(120) == pytest.approx(BASE.lr * 0.1) and schedule.lr_at(130) == schedule.lr_at(120)
    assert max(lrs) == before[30] < BASE.lr


def test_continue_after_the_end_goes_on_at_the_end_lr_and_round_trips(tmp_path) -> None:
    """A finished run (step 60 of 60) extended to 80: more steps at the rate it ended on; a second continue, and a
    rewarm after it, append; the checkpointed state reproduces every lr, and kind-less (older) extensions re-warm."""
    schedule = LRSchedule(BASE)
    end = schedule.lr_at(60)
    schedule.resume(60, ScheduleSettings(BASE.lr, 5, 80, 0.1), extend="continue")
    assert [schedule.lr_at(s) for s in range(60, 90)] == pytest.approx([end] * 30)
    schedule.resume(70, ScheduleSettings(BASE.lr, 5, 100, 0.05), extend="continue")  # a lower floor: down to it
    assert schedule.lr_at(70) == pytest.approx(end) and schedule.lr_at(100) == pytest.approx(BASE.lr * 0.05)
    schedule.resume(100, ScheduleSettings(1e-3, 10, 200, 0.1), extend="rewarm")
    assert [e.kind for e in schedule.extensions] == ["continue", "continue", "rewarm"]
    restored = LRSchedule(ScheduleSettings(9.0, 1, 2, 0.5))
    restored.load_state_dict(schedule.state_dict())
    assert restored == schedule and [restored.lr_at(s) for s in range(220)] == [schedule.lr_at(s) for s in range(220)]
    old = schedule.state_dict()
    for extension in old["extensions"]:
        del extension["kind"]  # as saved before `continue` existed
    restored.load_state_dict(old)
    assert [e.kind for e in restored.extensions] == ["rewarm"] * 3


@pytest.mark.parametrize(
    ("step", "wanted", "message"),
    [
        (
            60,
            ScheduleSettings(2e-3, 5, 120, 0.1),
            "--extend-schedule continue keeps the run's peak learning rate and "
            "warm-up (lr: 0.005 -> 0.002): give the run's own --lr and --warmup-steps, or --extend-schedule rewarm",
        ),
        (60, ScheduleSettings(5e-3, 10, 120, 0.1), "(warmup_steps: 5 -> 10)"),
        (60, ScheduleSettings(5e-3, 5, 50, 0.1), "--max-steps 50 is not beyond step 60"),
        (
            60,
            ScheduleSettings(5e-3, 5, 120, 0.5),
            "decays from the learning rate at step 60 (0.0005), which is below "
            "the end learning rate (0.0025): give --extend-schedule rewarm",
        ),
        (1, ScheduleSettings(5e-3, 5, 120, 0.5), "learning rate at step 1 (0.002)"),  # still warming up, below the end
    ],
)
def test_continue_refuses_what_it_cannot_do_in_one_line(step: int, wanted: ScheduleSettings, message: str) -> None:
    schedule = LRSchedule(BASE)
    with pytest.raises(CheckpointError) as refused:
        schedule.resume(step, wanted, extend="continue")
    assert message in str(refused.value) and "\n" not in str(refused.value)
    assert schedule.extensions == [], "a refusal changes nothing"


def test_an_unknown_extension_is_refused() -> None:
    with pytest.raises(CheckpointError, match="--extend-schedule 'true' is unknown: give continue or rewarm"):
        LRSchedule(BASE).resume(60, ScheduleSettings(5e-3, 5, 120, 0.1), extend="true")
    assert Extension(0, 1.0, BASE).kind == "rewarm"
