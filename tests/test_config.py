"""The trainer's settings come from flags, then TRAINER_* variables, then defaults."""

import pytest

from trainer.config import TRAIN_DEFAULTS, parse_config

REQUIRED = ["--data-dir", "d", "--run-dir", "r"]


def test_flag_beats_env_beats_default() -> None:
    cfg = parse_config([*REQUIRED, "--max-steps", "7"], {"TRAINER_MAX_STEPS": "9", "TRAINER_LR": "0.5"})
    assert cfg.max_steps == 7 and cfg.lr == 0.5 and cfg.seq_len == TRAIN_DEFAULTS["seq_len"]


def test_everything_from_the_environment() -> None:
    env = {
        "TRAINER_DATA_DIR": "d",
        "TRAINER_RUN_DIR": "r",
        "TRAINER_ASYNC_CHECKPOINT": "true",
        "TRAINER_GRAD_ACCUM_STEPS": "4",
    }
    cfg = parse_config([], env)
    assert (cfg.data_dir, cfg.async_checkpoint, cfg.grad_accum_steps) == ("d", True, 4)
    assert parse_config([*REQUIRED, "--compile", "on"], {"TRAINER_COMPILE": "off"}).compile == "on"
    assert parse_config(REQUIRED, {"TRAINER_DDP_COMM_HOOK": "bf16"}).ddp_comm_hook == "bf16"


@pytest.mark.parametrize(
    "argv, env, message",
    [
        (["--max-steps", "0"], {}, "argument --max-steps: must be a positive integer, got 0"),
        (["--batch-size", "many"], {}, "argument --batch-size: 'many' is not an integer"),
        (["--preset", "gpt5"], {}, "argument --preset: 'gpt5' is unknown"),
        ([], {"TRAINER_SEED": "x"}, "TRAINER_SEED: 'x' is not an integer"),
        ([], {"TRAINER_ASYNC_CHECKPOINT": "maybe"}, "TRAINER_ASYNC_CHECKPOINT: 'maybe' is not a boolean"),
        ([], {"TRAINER_COMPILE": "yes"}, "TRAINER_COMPILE: 'yes' is unknown: choose one of auto, on, off"),
        (["--ddp-comm-hook", "fp8"], {}, "argument --ddp-comm-hook: 'fp8' is unknown: choose one of none, bf16"),
    ],
)
def test_bad_settings_are_one_line_naming_the_source(argv, env, message: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_config([*REQUIRED, *argv], env)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err.splitlines()[-1]
