"""The trainer's configuration: one dataclass, readable from flags and from environment variables.

Every field is a flag (`max_steps` -> `--max-steps`) and an environment variable (`TRAINER_MAX_STEPS`),
so a PyTorchJob can set it either in the container's args or in its env. A flag wins over the variable,
the variable over the default. The launcher and the CLI share the defaults through TRAIN_DEFAULTS.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from dataclasses import MISSING, dataclass, field, fields

ENV_PREFIX = "TRAINER_"
CONTINUE, REWARM = "continue", "rewarm"  # --extend-schedule's kinds (trainer/schedule.py)
EXTENSIONS = (CONTINUE, REWARM)
PARALLELISMS = ("ddp", "fsdp", "hsdp")  # trainer/parallel.py
ACTIVATION_CHECKPOINTING = ("none", "full", "selective")


def _opt(
    default,
    help: str,
    minimum: float | None = None,
    below: float | None = None,
    choices: tuple[str, ...] | None = None,
    bare: str | None = None,
):
    """A setting; `bare`: the value of its flag given without one (bool flags: true)."""
    return field(
        default=default, metadata={"help": help, "min": minimum, "below": below, "choices": choices, "bare": bare}
    )


class SettingError(Exception):
    """A setting this machine cannot honour (found at start, where the device is known): bad input, exit 2."""


@dataclass
class TrainConfig:
    run_dir: str = field(metadata={"help": "run directory (<root>/runs/<run_id>); resumed if it holds a checkpoint"})
    data_dir: str = _opt(
        "",
        "dataset snapshot directory (<root>/datasets/<name>/snapshots/<id>), or the dataset's "
        "directory for its current snapshot; or --mixture",
    )
    mixture: str = _opt(
        "",
        "train on several datasets, each global batch's sequences drawn in proportion to their "
        "weights: DIR=WEIGHT,... where each DIR is as --data-dir; all staged with one tokenizer; an "
        "exact resume keeps the weights (see trainer/mixture.py)",
    )
    preset: str = _opt("small", "model preset (see trainer/model.py); none with --init-from-model")
    seed: int = _opt(1234, "seed of the initial weights and of the sample order")
    init_from: str = _opt(
        "",
        "a finished run's directory to start this new run from: its weights only (not its "
        "optimizer, schedule or sample order); the snapshot's tokenizer must be that run's",
    )
    init_from_model: str = _opt(
        "",
        "a published model to start this new run from: a directory save_pretrained wrote (config.json, safetensors); "
        "its architecture replaces --preset and its weights the random ones; the optimizer and schedule start fresh",
    )
    on_new_snapshot: str = _opt(
        "keep",
        "on resume after the dataset was staged again: keep training on the checkpoint's snapshot, or refuse",
        choices=("keep", "refuse"),
    )
    # How long to train: the first limit reached ends the run.
    max_steps: int = _opt(200, "optimizer steps to train for; also the length of the LR schedule", 1)
    max_tokens: int = _opt(0, "stop after this many training tokens (0: no limit)", 0)
    max_time_s: float = _opt(0.0, "checkpoint and stop after this many seconds in this process (0: no limit)", 0)
    # The batch: batch_size sequences per rank per micro-step, grad_accum_steps micro-steps per step.
    batch_size: int = _opt(8, "sequences per rank per micro-step", 1)
    grad_accum_steps: int = _opt(1, "micro-steps per optimizer step", 1)
    seq_len: int = _opt(128, "tokens per sequence", 1)
    # The optimizer: AdamW with linear warm-up and cosine decay.
    lr: float = _opt(3e-3, "peak learning rate", 0)
    min_lr_ratio: float = _opt(0.1, "final learning rate as a fraction of the peak", 0)
    warmup_steps: int = _opt(20, "steps of linear warm-up", 0)
    extend_schedule: str = _opt(
        "",
        "on resume, go on from the current learning rate to these schedule settings "
        "where they differ from the checkpoint's: continue (the given alone: the cosine from "
        "the current learning rate down to the end one at the new --max-steps; --lr and "
        "--warmup-steps stay the run's) or rewarm (linear to --lr over --warmup-steps, then "
        "cosine); empty: other settings are refused",
        choices=("", *EXTENSIONS),
        bare=CONTINUE,
    )
    weight_decay: float = _opt(0.1, "AdamW weight decay of matrices", 0)
    grad_clip: float = _opt(1.0, "clip the gradient norm to this (0: no clipping)", 0)
    dropout: float = _opt(0.0, "dropout probability of the model's dropout layers (not an architecture setting)", 0, 1)
    compile: str = _opt(
        "auto",
        "torch.compile the model with its loss: on, off, or auto (on for the GPU presets "
        "on a GPU); the compiled code is cached in the run directory for the next start",
        choices=("auto", "on", "off"),
    )
    parallelism: str = _opt(
        "ddp",
        "how the model is spread over the ranks: ddp (a whole copy on every GPU), fsdp "
        "(parameters, gradients and optimizer state sharded; hsdp on several nodes), or hsdp "
        "(sharded within a node, replicated across nodes)",
        choices=PARALLELISMS,
    )
    activation_checkpointing: str = _opt(
        "none",
        "recompute each block's activations in backward instead of keeping "
        "them: full (keep only its input), selective (keep the matmuls' outputs "
        "too), or none",
        choices=ACTIVATION_CHECKPOINTING,
    )
    ddp_comm_hook: str = _opt(
        "none",
        "DDP gradient all-reduce: none (in the gradients' dtype), or bf16 (compressed "
        "to bfloat16 on the wire: half the bytes, for multi-node runs)",
        choices=("none", "bf16"),
    )
    # Checkpoints and preemption.
    checkpoint_every: int = _opt(50, "steps between checkpoints", 1)
    keep_checkpoints: int = _opt(3, "committed checkpoints kept (checkpoint_latest links the newest)", 1)
    async_checkpoint: bool = _opt(False, "write periodic checkpoints in the background (staged to host memory first)")
    checkpoint_s3_uri: str = _opt(
        "",
        "copy every committed checkpoint to this s3://bucket/prefix (the run's own) "
        "in the background, and resume from it when the volume has none",
    )
    grace_period_s: float = _opt(120.0, "the pod's terminationGracePeriodSeconds: time from SIGTERM to SIGKILL", 0.01)
    # Health: divergence, spikes, hangs.
    max_nonfinite_steps: int = _opt(
        3,
        "consecutive steps with a non-finite loss or gradient norm (each skipped) "
        "tolerated; one more stops the run as diverged (exit code 3)",
        0,
    )
    spike_factor: float = _opt(
        3.0, "log and mark a loss above this many times the median of the recent logged losses as a spike (0: off)", 0
    )
    collective_timeout_s: float = _opt(
        600.0,
        "a collective that waits longer fails, naming the ranks that stopped answering (the process group's timeout)",
        1,
    )
    fault_nan_at_step: int = _opt(
        0, "fault injection, for testing the divergence handling: from this step on the loss is NaN (0: off)", 0
    )
    fault_save_at_step: int = _opt(
        0,
        "fault injection, for testing the save contract: every checkpoint of this "
        "step or later fails as on a full file system, ENOSPC (0: off)",
        0,
    )
    fault_crash_at_step: int = _opt(
        0,
        "fault injection, for testing that a failure ends every rank: the last rank "
        "raises at the start of this step (0: off)",
        0,
    )
    fault_signal_at_step: int = _opt(
        0, "fault injection, for testing preemption: rank 0 sends itself SIGTERM at the end of this step (0: off)", 0
    )
    fault_read_latency_s: float = _opt(
        0.0,
        "fault injection, for benching a cold file system: each micro-batch's "
        "read takes this many seconds longer (0: off)",
        0,
    )
    # Observability.
    log_every: int = _opt(10, "steps between metrics rows and log lines", 1)
    peak_tflops: float = _opt(0.0, "peak bf16 TFLOP/s of one accelerator for MFU (0: detect the GPU)", 0)
    log_samples: bool = _opt(False, "record the sample (window) ids each rank trains on, under <run>/logs/")
    eval_every: int = _opt(
        0,
        "steps between validation losses on the snapshot's val split, in that step's metrics "
        "row (val_loss, val_bpb) and log (0: none)",
        0,
    )
    eval_tokens: int = _opt(
        16384,
        "val tokens each validation reads at most: the split's first windows, as the evaluation step reads them",
        1,
    )
    tensorboard: bool = _opt(
        True,
        "write TensorBoard event files of every metrics row, checkpoint and restart under <run>/tensorboard/ (rank 0)",
    )
    mlflow_tracking_uri: str = _opt(
        "",
        "also send them to this MLflow tracking server, one MLflow run per run (found "
        "again on a resume): an http(s):// URL or a SageMaker MLflow ARN; credentials "
        "from the environment (MLFLOW_TRACKING_TOKEN, the IAM role), never in the URI; "
        "a slow or absent server never slows or fails training (empty: none)",
    )
    mlflow_experiment: str = _opt("hyperpod-pretrain", "the MLflow experiment of the run (made if missing)")

    @property
    def tokens_per_step(self) -> int:
        """Per rank; multiply by the world size for the global figure."""
        return self.batch_size * self.grad_accum_steps * self.seq_len


TRAIN_DEFAULTS = {f.name: f.default for f in fields(TrainConfig) if f.default is not MISSING}


def convert(
    kind: type, minimum: float | None, text: str, below: float | None = None, choices: tuple[str, ...] | None = None
) -> bool | int | float | str:
    """One setting from its text; ValueError says what is wrong with it."""
    if choices is not None and text not in choices:
        raise ValueError(f"{text!r} is unknown: choose one of {', '.join(c or repr(c) for c in choices)}")
    if kind is bool:
        lowered = text.strip().lower()
        if lowered not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
            raise ValueError(f"{text!r} is not a boolean (use true or false)")
        return lowered in ("1", "true", "yes", "on")
    try:
        value = kind(text)
    except ValueError:
        raise ValueError(f"{text!r} is not a valid {kind.__name__}") from None
    if minimum is not None and value < minimum:
        raise ValueError(f"must be at least {minimum}, got {value}")
    if below is not None and value >= below:
        raise ValueError(f"must be below {below}, got {value}")
    return value


def check_setting(name: str, value: object) -> str:
    """One setting as a flag's text, checked as the flag would be (for settings given elsewhere: a run's
    job_options); ValueError says what is wrong."""
    spec = next((f for f in fields(TrainConfig) if f.name == name), None)
    if spec is None:
        raise ValueError(f"{name!r} is not a trainer setting")
    text = str(value).lower() if isinstance(value, bool) else str(value)
    convert(_KINDS[spec.type], spec.metadata.get("min"), text, spec.metadata.get("below"), spec.metadata.get("choices"))
    return text


def _flag_type(kind: type, minimum: float | None, below: float | None, choices: tuple[str, ...] | None):
    def parse(text: str):
        try:
            return convert(kind, minimum, text, below, choices)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse


# Field types as written in the class (strings, because of `from __future__ import annotations`).
_KINDS: dict[str, type] = {"str": str, "int": int, "float": float, "bool": bool}


def parse_config(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> TrainConfig:
    """Flags, then TRAINER_* variables, then defaults; a bad value is one argparse error naming its source."""
    from trainer.model import PRESETS  # plain data: cheap
    from trainer.tracking import check_tracking_uri  # imports its writers only when they start

    environ = os.environ if environ is None else environ
    parser = argparse.ArgumentParser(prog="train_ddp", description="DDP pretraining of a causal LM (under torchrun).")
    for f in fields(TrainConfig):
        env = ENV_PREFIX + f.name.upper()
        parser.add_argument(
            "--" + f.name.replace("_", "-"),
            type=_flag_type(_KINDS[f.type], f.metadata.get("min"), f.metadata.get("below"), f.metadata.get("choices")),
            required=f.default is MISSING and env not in environ,
            help=f"{f.metadata['help']} [env {env}]",
            **({"nargs": "?", "const": True} if f.type == "bool" else {}),
            **({"nargs": "?", "const": f.metadata["bare"]} if f.metadata.get("bare") else {}),
        )
    args = vars(parser.parse_args(argv))
    values = {}
    for f in fields(TrainConfig):
        env = ENV_PREFIX + f.name.upper()
        if args[f.name] is not None:
            values[f.name] = args[f.name]
        elif env in environ:
            try:
                values[f.name] = convert(
                    _KINDS[f.type],
                    f.metadata.get("min"),
                    environ[env],
                    f.metadata.get("below"),
                    f.metadata.get("choices"),
                )
            except ValueError as exc:
                parser.error(f"{env}: {exc}")
    config = TrainConfig(**values)
    if bool(config.data_dir) == bool(config.mixture):
        parser.error("give --data-dir (one dataset) or --mixture (several), one of them")
    if config.checkpoint_s3_uri and not config.checkpoint_s3_uri.startswith("s3://"):
        parser.error(f"argument --checkpoint-s3-uri: {config.checkpoint_s3_uri!r} is not an s3://bucket/prefix URI")
    try:
        check_tracking_uri(config.mlflow_tracking_uri)
    except ValueError as exc:
        parser.error(f"argument --mlflow-tracking-uri: {exc}")
    if config.init_from_model:  # the architecture is the model's (its config.json): no preset
        if "preset" in values:
            parser.error(
                f"argument --preset: {config.preset!r} and --init-from-model both choose the architecture: "
                "leave --preset out (the model's config.json gives it)"
            )
        config.preset = ""
    elif config.preset not in PRESETS:
        parser.error(f"argument --preset: {config.preset!r} is unknown: choose one of {', '.join(PRESETS)}")
    return config
