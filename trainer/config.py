"""The trainer's configuration: one dataclass, readable from flags and from environment variables.

Every field is a flag (`max_steps` -> `--max-steps`) and an environment variable (`TRAINER_MAX_STEPS`),
so a PyTorchJob can set it either in the container's args or in its env. A flag wins over the variable,
the variable over the default.

A field is declared once, here, with what every surface needs (docs/repository.md, "Add a run setting"): its help
and bounds, and `run`: how a pipeline run chooses it. SETTING: a pipeline input, a flag of the CLI's run commands,
an entry of the launcher's `train` mapping that becomes the trainer's flag as it is; LAUNCHER: a pipeline input the
launcher turns into the trainer's flag itself (a place on the volume, the run's own prefix); JOB_OPTION: a key of a
run's `job_options`; none: the trainer's alone (paths the launcher sets, fault injection). `resumed`: a resume that
does not give it keeps the run's recorded value; `cluster`: the pipeline's default where it is not the trainer's
(the trainer's defaults are small, for CPU runs).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import Any

from trainer.model import PRESETS

ENV_PREFIX = "TRAINER_"
CONTINUE, REWARM = "continue", "rewarm"  # --extend-schedule's kinds (trainer/schedule.py)
EXTENSIONS = (CONTINUE, REWARM)
PARALLELISMS = ("ddp", "fsdp", "hsdp")  # trainer/parallel.py
ACTIVATION_CHECKPOINTING = ("none", "full", "selective")
SETTING, LAUNCHER, JOB_OPTION = "setting", "launcher", "job_option"  # how a run chooses a field (`run`)
STEPS_LIMIT = 10**9  # a count of steps past this is a typo


def _opt(
    default: Any,
    help: str,
    minimum: float | None = None,
    below: float | None = None,
    choices: tuple[str, ...] | None = None,
    bare: str | None = None,
    *,
    above: float | None = None,
    maximum: float | None = None,
    run: str | None = None,
    resumed: bool = False,
    cluster: Any = MISSING,
    run_help: str = "",
):
    """A setting; `bare`: the value of its flag given without one (bool flags: true); `above`: an exclusive
    minimum; `run_help`: the help of its pipeline input and CLI flag where a run means more than the trainer does."""
    return field(
        default=default,
        metadata={
            "help": help,
            "min": minimum,
            "above": above,
            "below": below,
            "max": maximum,
            "choices": choices,
            "bare": bare,
            "run": run,
            "resumed": resumed,
            "cluster": default if cluster is MISSING else cluster,
            "run_help": run_help or help,
        },
    )


class SettingError(Exception):
    """A setting this machine cannot honour (found at start, where the device is known): bad input, exit 2."""


@dataclass
class TrainConfig:
    run_dir: str = _opt(MISSING, "run directory (<root>/runs/<run_id>); resumed if it holds a checkpoint")
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
    preset: str = _opt(
        "small",
        "model preset (see trainer/model.py); none with --init-from-model",
        choices=tuple(PRESETS),
        run=SETTING,
        resumed=True,
        cluster="gpt2-124m",
    )
    seed: int = _opt(1234, "seed of the initial weights and of the sample order", run=SETTING, resumed=True)
    init_from: str = _opt(
        "",
        "a finished run's directory to start this new run from: its weights only (not its "
        "optimizer, schedule or sample order); the snapshot's tokenizer must be that run's",
    )
    init_from_model: str = _opt(
        "",
        "a published model to start this new run from: a directory save_pretrained wrote (config.json, safetensors); "
        "its architecture replaces --preset and its weights the random ones; the optimizer and schedule start fresh",
        run=LAUNCHER,
        resumed=True,
        run_help="start from a published model (its architecture, weights and tokenizer): a directory "
        "save_pretrained wrote, or an s3:// prefix of one, copied once to <root>/models/; not with --preset",
    )
    on_new_snapshot: str = _opt(
        "keep",
        "on resume after the dataset was staged again: keep training on the checkpoint's snapshot, or refuse",
        choices=("keep", "refuse"),
    )
    # How long to train: the first limit reached ends the run.
    max_steps: int = _opt(
        200,
        "optimizer steps to train for; also the length of the LR schedule",
        1,
        maximum=STEPS_LIMIT,
        run=SETTING,
        resumed=True,
        cluster=5000,
    )
    max_tokens: int = _opt(0, "stop after this many training tokens (0: no limit)", 0)
    max_time_s: float = _opt(0.0, "checkpoint and stop after this many seconds in this process (0: no limit)", 0)
    # The batch: batch_size sequences per rank per micro-step, grad_accum_steps micro-steps per step.
    batch_size: int = _opt(
        8, "sequences per rank per micro-step", 1, maximum=65536, run=SETTING, resumed=True, cluster=16
    )
    grad_accum_steps: int = _opt(1, "micro-steps per optimizer step", 1, run=JOB_OPTION)
    seq_len: int = _opt(128, "tokens per sequence", 1, maximum=1 << 20, run=SETTING, resumed=True, cluster=1024)
    # The optimizer: AdamW with linear warm-up and cosine decay.
    lr: float = _opt(3e-3, "peak learning rate", above=0, run=SETTING, resumed=True, cluster=6e-4)
    min_lr_ratio: float = _opt(0.1, "final learning rate as a fraction of the peak", 0)
    warmup_steps: int = _opt(
        20, "steps of linear warm-up", 0, maximum=STEPS_LIMIT, run=SETTING, resumed=True, cluster=200
    )
    extend_schedule: str = _opt(
        "",
        "on resume, go on from the current learning rate to these schedule settings "
        "where they differ from the checkpoint's: continue (the given alone: the cosine from "
        "the current learning rate down to the end one at the new --max-steps; --lr and "
        "--warmup-steps stay the run's) or rewarm (linear to --lr over --warmup-steps, then "
        "cosine); empty: other settings are refused",
        choices=("", *EXTENSIONS),
        bare=CONTINUE,
        run=SETTING,
    )
    weight_decay: float = _opt(
        0.1, "AdamW weight decay of the matrices (not of biases and norms' scales)", 0, run=SETTING, resumed=True
    )
    grad_clip: float = _opt(1.0, "clip the gradient norm to this (0: no clipping)", 0)
    dropout: float = _opt(
        0.0,
        "dropout probability of the model's dropout layers (not an architecture setting)",
        0,
        1,
        run=SETTING,
        resumed=True,
    )
    compile: str = _opt(
        "auto",
        "torch.compile the model with its loss: on, off, or auto (on for the GPU presets "
        "on a GPU); the compiled code is cached in the run directory for the next start",
        choices=("auto", "on", "off"),
        run=JOB_OPTION,
    )
    parallelism: str = _opt(
        "ddp",
        "how the model is spread over the ranks: ddp (a whole copy on every GPU), fsdp "
        "(parameters, gradients and optimizer state sharded; hsdp on several nodes), or hsdp "
        "(sharded within a node, replicated across nodes)",
        choices=PARALLELISMS,
        run=JOB_OPTION,
    )
    activation_checkpointing: str = _opt(
        "none",
        "recompute each block's activations in backward instead of keeping "
        "them: full (keep only its input), selective (keep the matmuls' outputs "
        "too), or none",
        choices=ACTIVATION_CHECKPOINTING,
        run=JOB_OPTION,
    )
    ddp_comm_hook: str = _opt(
        "none",
        "DDP gradient all-reduce: none (in the gradients' dtype), or bf16 (compressed "
        "to bfloat16 on the wire: half the bytes, for multi-node runs)",
        choices=("none", "bf16"),
        run=JOB_OPTION,
    )
    # Checkpoints and preemption.
    checkpoint_every: int = _opt(
        50, "steps between checkpoints", 1, maximum=STEPS_LIMIT, run=SETTING, resumed=True, cluster=500
    )
    keep_checkpoints: int = _opt(3, "committed checkpoints kept (checkpoint_latest links the newest)", 1)
    async_checkpoint: bool = _opt(False, "write periodic checkpoints in the background (staged to host memory first)")
    checkpoint_s3_uri: str = _opt(
        "",
        "copy every committed checkpoint to this s3://bucket/prefix (the run's own) "
        "in the background, and resume from it when the volume has none",
        run=LAUNCHER,
        run_help="copy every committed checkpoint to S3 under <this prefix>/<run_id>/ (s3://bucket/prefix), and "
        "resume from there when the volume lost them",
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
    log_every: int = _opt(
        10, "steps between metrics rows and log lines", 1, maximum=STEPS_LIMIT, run=SETTING, resumed=True
    )
    peak_tflops: float = _opt(0.0, "peak bf16 TFLOP/s of one accelerator for MFU (0: detect the GPU)", 0)
    log_samples: bool = _opt(False, "record the sample (window) ids each rank trains on, under <run>/logs/")
    eval_every: int = _opt(
        0,
        "steps between validation losses on the snapshot's val split, in that step's metrics "
        "row (val_loss, val_bpb) and log (0: none)",
        0,
        maximum=STEPS_LIMIT,
        run=SETTING,
        resumed=True,
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
        run=SETTING,
    )
    mlflow_experiment: str = _opt(
        "hyperpod-pretrain", "the MLflow experiment of the run (made if missing)", run=SETTING
    )

    @property
    def tokens_per_step(self) -> int:
        """Per rank; multiply by the world size for the global figure."""
        return self.batch_size * self.grad_accum_steps * self.seq_len


SPECS: dict[str, Field] = {f.name: f for f in fields(TrainConfig)}
TRAIN_DEFAULTS = {name: f.default for name, f in SPECS.items() if f.default is not MISSING}


def run_settings(*kinds: str) -> tuple[str, ...]:
    """The fields a run chooses in one of these ways (SETTING, LAUNCHER, JOB_OPTION), in declaration order."""
    return tuple(name for name, f in SPECS.items() if f.metadata["run"] in kinds)


# What a resume keeps of the run's own record when it is not given (--extend-schedule is what a resume does, not a
# setting of the run), and what a cluster run uses when a run does not say.
RESUMED_SETTINGS = tuple(name for name, f in SPECS.items() if f.metadata["resumed"])
CLUSTER_TRAIN_DEFAULTS = {name: SPECS[name].metadata["cluster"] for name in run_settings(SETTING, LAUNCHER)}

# Field types as written in the class (strings, because of `from __future__ import annotations`).
_KINDS: dict[str, type] = {"str": str, "int": int, "float": float, "bool": bool}
_KIND_NAMES = {int: "an integer", float: "a number"}


def convert(spec: Field, text: str) -> bool | int | float | str:
    """One setting from its text, within its declared bounds; ValueError says what is wrong with it."""
    meta, kind = spec.metadata, _KINDS[spec.type]
    if meta["choices"] is not None and text not in meta["choices"]:
        raise ValueError(f"{text!r} is unknown: choose one of {', '.join(c or repr(c) for c in meta['choices'])}")
    if kind is bool:
        lowered = text.strip().lower()
        if lowered not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
            raise ValueError(f"{text!r} is not a boolean (use true or false)")
        return lowered in ("1", "true", "yes", "on")
    try:
        value = kind(text)
    except ValueError:
        raise ValueError(f"{text!r} is not {_KIND_NAMES.get(kind, 'a ' + kind.__name__)}") from None
    low, above, below, high = meta["min"], meta["above"], meta["below"], meta["max"]
    if kind is int and low == 1 and value < 1:
        raise ValueError(f"must be a positive integer, got {value}")
    if above == 0 and not value > 0:
        raise ValueError(f"must be positive, got {value}")
    if (low is not None and value < low) or (below is not None and value >= below):
        bounds = [f"at least {low}" if low is not None else "", f"below {below}" if below is not None else ""]
        raise ValueError(f"must be {' and '.join(b for b in bounds if b)}, got {value}")
    if high is not None and value > high:
        raise ValueError(f"{value} is above the limit of {high}")
    return value


def check_setting(name: str, value: object) -> str:
    """One setting as its flag's text, checked as the flag would be (for settings given elsewhere: a run's
    pipeline inputs and job_options); ValueError says what is wrong."""
    if name not in SPECS:
        raise ValueError(f"{name!r} is not a trainer setting")
    text = str(value).lower() if isinstance(value, bool) else str(value)
    convert(SPECS[name], text)
    return text


def flag_of(name: str) -> str:
    return "--" + name.replace("_", "-")


def as_flags(values: Mapping[str, object]) -> list[str]:
    """The trainer's command line for these settings, each checked; an empty string is the setting left out."""
    return [arg for name, value in values.items() if value != "" for arg in (flag_of(name), check_setting(name, value))]


def flag_arguments(name: str, help: str = "") -> dict[str, Any]:
    """add_argument's keywords for a setting's flag, so that every command line parses it as the trainer does."""
    spec = SPECS[name]

    def parse(text: str) -> bool | int | float | str:
        try:
            return convert(spec, text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return {
        "type": parse,
        "help": help or spec.metadata["help"],
        **({"nargs": "?", "const": True} if spec.type == "bool" else {}),
        **({"nargs": "?", "const": spec.metadata["bare"]} if spec.metadata["bare"] else {}),
    }


def parse_config(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> TrainConfig:
    """Flags, then TRAINER_* variables, then defaults; a bad value is one argparse error naming its source."""
    from trainer.tracking import check_tracking_uri  # imports its writers only when they start

    environ = os.environ if environ is None else environ
    parser = argparse.ArgumentParser(prog="train_ddp", description="DDP pretraining of a causal LM (under torchrun).")
    for f in fields(TrainConfig):
        env = ENV_PREFIX + f.name.upper()
        parser.add_argument(
            flag_of(f.name),
            required=f.default is MISSING and env not in environ,
            **flag_arguments(f.name, f"{f.metadata['help']} [env {env}]"),
        )
    args = vars(parser.parse_args(argv))
    values = {}
    for f in fields(TrainConfig):
        env = ENV_PREFIX + f.name.upper()
        if args[f.name] is not None:
            values[f.name] = args[f.name]
        elif env in environ:
            try:
                values[f.name] = convert(f, environ[env])
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
    return config
