"""DDP pretraining of a causal LM: the program torchrun starts in every PyTorchJob pod.

    torchrun --nproc_per_node=N [--nnodes=MIN:MAX --rdzv_backend=c10d ...] trainer/train_ddp.py \\
        --data-dir <root>/datasets/<name>/snapshots/<id> --run-dir <root>/runs/<id> --preset small ...

NCCL on GPUs (bf16: autocast under ddp, FSDP's mixed precision under fsdp/hsdp), gloo on CPU (fp32). A run
directory that holds a checkpoint is resumed from it, also with another world size. SIGTERM/SIGINT stop every
rank after the same step, rank 0 commits a checkpoint, and the processes exit with a code from
trainer.preemption.ExitCode:
0 done, 1 crashed (also: a collective timed out, naming the ranks that stopped answering), 2 bad input,
3 diverged (trainer/health.py), 75 preempted and saved (rerun to resume), 76 preempted, save failed.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import sys
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.elastic.multiprocessing.errors import get_error_handler

if __package__ in (None, ""):  # run as a script (trainer/train_ddp.py), as torchrun does in the seed
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.version import tool_version
from trainer import comms
from trainer.atomic import write_json
from trainer.checkpoint import (
    SCHEMA,
    CheckpointError,
    CheckpointManager,
    Mirror,
    SaveFailed,
    SaveReport,
    check_schema,
    old_checkpoint_warning,
    rng_state,
    set_rng_state,
    unchecked_by_old_checkpoint,
)
from trainer.config import CONTINUE, SettingError, TrainConfig, parse_config
from trainer.data import DataError, DataPosition, TokenBatches, TokenSplit, load_meta, load_split
from trainer.evaluation import bits_per_byte, mean_loss, token_byte_lengths
from trainer.health import Divergence, Heartbeat, SpikeWatch, announce_failure, collective_failed
from trainer.layout import TOKENIZER, RunPaths
from trainer.memory import estimate, model_shape
from trainer.metrics import (
    MetricsLog,
    StepTimes,
    Throughput,
    flops_per_token,
    peak_flops,
    plan_line,
    rss_gib,
    step_line,
)
from trainer.mixture import MixtureBatches, mixture_plan, resolve_mixture, shares
from trainer.model import SMALL_PRESETS, architecture_differences, config_from_dict, model_config, set_dropout
from trainer.parallel import parallelize
from trainer.preemption import ExitCode, StopSignal, save_budget_s
from trainer.prefetch import Prefetcher
from trainer.private_api import default_store, skip_update_if
from trainer.published import PublishedModel, load_weights
from trainer.schedule import LRSchedule, ScheduleSettings
from trainer.snapshot import model_vocab, snapshot_record, training_snapshot
from trainer.tracking import RunWatch, preload_mlflow
from trainer.warm_start import warm_start_state

log = logging.getLogger("trainer")


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
    """What a checkpoint restores beside the model and optimizer tensors (those are the CheckpointManager's): one
    state_dict in, the same state out, so resume is exact."""

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


def train(cfg: TrainConfig, cleanup: ExitStack) -> ExitCode:
    """`cleanup`: what is left open on the way out (rank 0's TensorBoard writer and MLflow feed)."""
    use_cuda = torch.cuda.is_available()
    if cfg.ddp_comm_hook == "bf16" and not use_cuda:  # DDP refuses the hook under gloo
        raise SettingError(
            "--ddp-comm-hook bf16 compresses NCCL's gradient all-reduce and needs GPUs; on a CPU (gloo) use none"
        )
    run = RunPaths(Path(cfg.run_dir))
    collective_timeout = timedelta(seconds=cfg.collective_timeout_s)  # a silent rank fails the others after it
    init_distributed("nccl" if use_cuda else "gloo", collective_timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = agree_on_attempt(run, rank)
    if use_cuda and "NCCL_DEBUG" in os.environ:  # NCCL's lines on the volume, past the pod's life, per attempt
        os.environ["NCCL_DEBUG_FILE"] = str(run.nccl_dir(attempt) / "%h.%p.log")  # read at the first collective
        run.nccl_dir(attempt).mkdir(parents=True, exist_ok=True)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device(f"cuda:{local_rank}") if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    setup_logging(rank, run.rank_log(rank))
    if rank == 0 and cfg.mlflow_tracking_uri:
        preload_mlflow()
    restarts = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    log.info("rank %d of %d on %s (torchelastic restart count %s)", rank, world, device, restarts)
    stop = StopSignal(device)

    report = comms.self_test(device) | {"attempt": attempt}
    write_json(run.comms_report(rank, attempt), report)
    log.info(
        "comms self-test: all_reduce %s, bus bandwidth %.3f GB/s",
        "correct" if report["all_reduce_correct"] else "WRONG",
        report["busbw_gbps"],
    )

    # The newest good checkpoint, if any (on the volume, else the durable copy): it names the dataset snapshot to read.
    # (Checkpoints have their own gloo group: an asynchronous save plans in the background, beside training.)
    checkpoint_group = dist.new_group(backend="gloo", timeout=collective_timeout)
    checkpoints = CheckpointManager(
        run.checkpoints,
        keep=cfg.keep_checkpoints,
        async_save=cfg.async_checkpoint,
        attempt=attempt,
        group=checkpoint_group,
        mirror=durable_copy(cfg),
        fail_from_step=cfg.fault_save_at_step,
    )
    checkpoint = checkpoints.newest()
    state = checkpoint.trainer_state() if checkpoint is not None else None
    # A mixture's datasets (trainer/mixture.py), the first of which stands for all where one is asked for (the
    # tokenizer, the model's vocabulary: every dataset of a mixture has the same).
    mixture = resolve_mixture(cfg.mixture, state, cfg.on_new_snapshot) if cfg.mixture else []
    data_dir = mixture[0].directory if mixture else training_snapshot(Path(cfg.data_dir), state, cfg.on_new_snapshot)

    # Data, model, optimizer.
    meta = load_meta(data_dir)
    if mixture:
        splits = [load_split(e.directory, "train") for e in mixture]
        batches = MixtureBatches(
            [e.name for e in mixture],
            splits,
            [e.weight for e in mixture],
            cfg.seq_len,
            cfg.batch_size,
            rank,
            world,
            cfg.seed,
        )
    else:
        batches = TokenBatches(load_split(data_dir, "train"), cfg.seq_len, cfg.batch_size, rank, world, cfg.seed)
    val_dirs = {e.name: e.directory for e in mixture} or {snapshot_record(data_dir, meta)["dataset"]: data_dir}
    val, byte_lengths = validation_data(val_dirs, meta, cfg.seq_len) if cfg.eval_every else (None, None)
    if cfg.init_from_model and cfg.init_from:
        raise SettingError(
            "--init-from (a run's weights) and --init-from-model (a published model's) are two "
            "starting points: give one"
        )
    published = PublishedModel.read(Path(cfg.init_from_model)) if cfg.init_from_model and state is None else None
    if published is not None:  # its architecture, checked against this run's tokenizer and sequence length
        mconfig = published.model_config(cfg.dropout)
        check_published_fits(published, mconfig, data_dir, cfg.seq_len)
    elif cfg.init_from_model:  # a resume: the architecture its checkpoints hold (the directory may be gone since)
        mconfig = set_dropout(config_from_dict(state["model_config"]), cfg.dropout)
    else:
        mconfig = model_config(
            cfg.preset, model_vocab(meta), cfg.seq_len, meta["eos_id"], cfg.dropout, meta.get("bos_id")
        )
    # The model, spread over the ranks as --parallelism says (trainer/parallel.py), with the same initial weights
    # whatever the parallelism and world size.
    if use_cuda:  # TF32 for the fp32 matmuls that autocast leaves (CPU: no such mode)
        torch.set_float32_matmul_precision("high")
    compiled = cfg.compile == "on" or (cfg.compile == "auto" and use_cuda and cfg.preset not in SMALL_PRESETS)
    if compiled:  # the compiled code in the run directory: a restarted pod loads it instead of compiling again
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(run.compile_cache))
        log.info("torch.compile: model and loss (cache %s)", os.environ["TORCHINDUCTOR_CACHE_DIR"])
    hook = default_hooks.bf16_compress_hook if cfg.ddp_comm_hook == "bf16" else None  # half the bytes on the wire
    parallel = parallelize(
        mconfig,
        cfg.parallelism,
        device,
        cfg.seed,
        int(os.environ.get("LOCAL_WORLD_SIZE", world)),
        comm_hook=hook,
        compile_model=compiled,
        activation_checkpointing=cfg.activation_checkpointing,
        initial_weights=published is None,
    )
    model = parallel.model
    if parallel.kind != "ddp":
        log.info("parallelism %s over %s", parallel.kind, parallel.mesh)
    log_memory_estimate(mconfig, cfg, parallel.kind, world, device, rank)
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    vectors = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": matrices, "weight_decay": cfg.weight_decay}, {"params": vectors, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=(0.9, 0.95),
        fused=True,  # fused on the CPU too: it honours found_inf (trainer/health.py)
    )
    schedule = LRSchedule(ScheduleSettings.of(cfg))
    progress = Progress()
    divergence, spikes = Divergence(cfg.max_nonfinite_steps), SpikeWatch(cfg.spike_factor)
    train_state = TrainState(schedule, progress, batches.position, divergence, spikes)
    metrics = MetricsLog(run.metrics, enabled=rank == 0)

    # Resume from the checkpoint, if any; or a new run from another run's weights (a warm start).
    warm_started = state.get("init_from") if state is not None else None  # kept by every checkpoint of the run
    if state is None and cfg.init_from:
        weights, warm_started = warm_start_state(
            Path(cfg.init_from), meta.get("tokenizer_sha256", ""), mconfig.to_dict()
        )
        set_model_state_dict(model, weights, options=StateDictOptions(full_state_dict=True, strict=True))
        del weights
        log.info(
            "warm start from run %s at step %d (%d tokens seen there): its weights, with this run's data, "
            "schedule and sample order",
            warm_started["run"],
            warm_started["step"],
            warm_started["tokens_seen"],
        )
    if state is None and published is not None:
        load_weights(model, published)  # every rank its own pieces
        warm_started = published.record() if rank == 0 else {"model": str(published.path)}
        log.info(
            "starting from the published %s model in %s (%.1f MB of safetensors in %d file(s)): its weights, "
            "with this run's data, a fresh optimizer and schedule",
            published.config["model_type"],
            published.path,
            warm_started.get("bytes", 0) / 1e6,
            len(published.files),
        )
    if state is None:
        seed_everything(cfg.seed + rank)
    else:
        differences = architecture_differences(state["model_config"], mconfig.to_dict())
        if state["preset"] != cfg.preset or differences:
            raise CheckpointError(
                f"the checkpoint in {run.checkpoints} is of preset {state['preset']!r} and another architecture than "
                f"this run's {cfg.preset!r} ({'; '.join(differences) or 'another preset'}): use a new run directory "
                "or the original settings"
            )
        check_schema(state)
        if (unchecked := unchecked_by_old_checkpoint(state)) and rank == 0:
            log.warning("%s", old_checkpoint_warning(unchecked))
        state.setdefault("schedule", schedule.state_dict())  # schema 1: the flags' schedule
        checkpoints.restore(checkpoint, model, optimizer)
        train_state.load_state_dict(state)
        if (changes := schedule.resume(progress.step, ScheduleSettings.of(cfg), cfg.extend_schedule)) and rank == 0:
            start_lr, end_lr = schedule.lr_at(progress.step), cfg.min_lr_ratio * cfg.lr
            shape = (
                f"cosine from lr {start_lr:.3g} to {end_lr:.3g} at step {cfg.max_steps}, no re-warm"
                if cfg.extend_schedule == CONTINUE
                else f"from lr {start_lr:.3g} linear to {cfg.lr:.3g} over "
                f"{cfg.warmup_steps} steps, then cosine to {end_lr:.3g} at step {cfg.max_steps}"
            )
            log.info("learning-rate schedule extended at step %d (%s): %s", progress.step, "; ".join(changes), shape)
        if (rng := checkpoint.rng_of(rank)) is not None:
            set_rng_state(rng)
        else:  # a rank the saved run did not have
            seed_everything(cfg.seed + rank + progress.step)
        log.info(
            "resumed at step %d (%d tokens seen) from a checkpoint of %d ranks",
            progress.step,
            progress.tokens_seen,
            state["world_size"],
        )
        if state["world_size"] != world:
            log.warning(
                "world size changed from %d to %d: the data is re-partitioned from %s, nothing repeated or "
                "skipped; a step now takes %d sequences instead of %d",
                state["world_size"],
                world,
                batches.position.where(),
                cfg.batch_size * cfg.grad_accum_steps * world,
                cfg.batch_size * cfg.grad_accum_steps * state["world_size"],
            )
        metrics.truncate_after(progress.step)
        del state, checkpoint
    write_status(
        run, rank, "running", step=progress.step, world_size=world, restart_count=int(restarts), attempt=attempt
    )
    watch = RunWatch.off()  # rank 0's TensorBoard files and MLflow run (trainer/tracking.py)
    if rank == 0:
        # The step this start went on from (0: from scratch), beside its time: the report marks each resume with it.
        write_json(run.comms_report(rank, attempt), report | {"start_step": progress.step})
        dataset = {
            **snapshot_record(data_dir, meta),
            "tokenized_dir": str(data_dir),
            "vocab_size": meta["vocab_size"],
            "model_vocab_size": model_vocab(meta),
        }  # the tokenizer's, and the model's (padded)
        if mixture:  # each dataset's snapshot, weight and share: what the evaluation and the summary read
            dataset["mixture"] = [
                {
                    **snapshot_record(e.directory, meta),
                    "tokenized_dir": str(e.directory),
                    "weight": e.weight,
                    "share": round(share, 6),
                    "train_tokens": len(split),
                }
                for e, share, split in zip(mixture, shares(batches.weights), batches.splits, strict=True)
            ]
        resolved = {
            "trainer": asdict(cfg),
            "world_size": world,
            "model": mconfig.to_dict(),
            "dataset": dataset,
            "init_from": warm_started,
            "hyperpod_pretrain": tool_version(),
        }
        write_json(run.config, resolved)
        watch = cleanup.enter_context(
            RunWatch.start(
                run.tensorboard if cfg.tensorboard else None,
                run.mlflow_run,
                progress.step,
                resolved,
                cfg.mlflow_tracking_uri,
                cfg.mlflow_experiment,
                run.root.name,
            )
        )
        begun = "resumed at" if progress.step else "started from"
        watch.note(
            progress.step,
            "start",
            f"attempt {attempt}: {begun} step {progress.step} on {world} ranks (torchrun restart {restarts})",
        )

    compute_precision = parallel.compute_precision(device)
    flops_per_step = flops_per_token(model, cfg.seq_len) * cfg.tokens_per_step * world
    peak = peak_flops(device, cfg.peak_tflops)
    samples_log = open(run.logs / f"samples_rank_{rank:05d}.txt", "a") if cfg.log_samples else None
    budget_s = save_budget_s(cfg.grace_period_s)

    def report_hang(silent: list[int], step: int) -> None:
        """From the heartbeat thread, before NCCL's watchdog ends the process at the collective timeout."""
        if rank == min(set(range(world)) - set(silent)):
            write_hung_status(
                run,
                step,
                silent,
                f"no step completed after step {step}: rank(s) {', '.join(map(str, silent))} stopped answering",
                attempt,
            )

    def end_with_failed_rank(failed_rank: int, error: str) -> None:
        """From the heartbeat thread: another rank failed and this one would wait for it in a collective until the
        timeout. Rank 0 records who failed and why (unless it is the one that failed: it says so itself)."""
        log.error(
            "ending this rank: rank %d failed (%s) and the collectives cannot complete without it", failed_rank, error
        )
        write_status(
            run,
            rank,
            "crashed",
            step=progress.step,
            exit_code=ExitCode.CRASHED,
            failed_rank=failed_rank,
            error=f"rank {failed_rank} failed: {error}",
            attempt=attempt,
        )
        exit_now(ExitCode.CRASHED)

    heartbeat = Heartbeat(
        default_store(),
        rank,
        world,
        cfg.collective_timeout_s,
        on_silent=report_hang,
        on_peer_failure=end_with_failed_rank,
    )

    def save(blocking: bool) -> float:
        """Collective: every rank writes its share. Returns the seconds this rank was held up."""
        state = {
            **train_state.state_dict(),
            "schema": SCHEMA,
            "step": progress.step,
            "preset": cfg.preset,
            "model_config": mconfig.to_dict(),
            "world_size": world,
            "data_snapshot": snapshot_record(data_dir, meta),
            "init_from": warm_started,
        }
        if mixture:  # each dataset's, so that a resume reads the snapshots it trained on
            state["data_snapshots"] = {e.name: snapshot_record(e.directory, meta) for e in mixture}
        return checkpoints.save(progress.step, model, optimizer, state, rng_state(), blocking=blocking)

    # The loop: one optimizer step of grad_accum_steps micro-batches per iteration. Nothing in it waits for the
    # device except on a sync step (this process's first step, a logged step, a checkpoint, the last step): the next
    # batches are read ahead (trainer/prefetch.py) and the ranks agree on stopping one step late
    # (trainer/preemption.py).
    if rank == 0:
        parameters = sum(p.numel() for p in model.parameters())  # DTensors under fsdp: their global sizes
        log.info("%s", plan_line(parameters, cfg.tokens_per_step * world, cfg.max_steps, batches.train_tokens))
        if mixture:
            sequences = cfg.batch_size * cfg.grad_accum_steps * world * cfg.max_steps
            log.info("%s", mixture_plan(batches, sequences))
    started, throughput, budget_checked, resumed_at = time.monotonic(), Throughput(), False, progress.step
    step_times = StepTimes()  # for the ETA
    stop_reason = "max-steps" if progress.step >= cfg.max_steps else None
    if stop_reason:
        log.info("nothing to do: the run already reached step %d", progress.step)
    prefetch = Prefetcher(batches, device, depth=2 * cfg.grad_accum_steps, read_latency_s=cfg.fault_read_latency_s)
    sync_wait_s, save_stall_s, steps_since_log = 0.0, 0.0, 0
    try:
        while stop_reason is None:
            step_started = time.perf_counter()
            loss_sum = torch.zeros((), device=device)
            if cfg.fault_crash_at_step and progress.step + 1 == cfg.fault_crash_at_step and rank == world - 1:
                raise RuntimeError(
                    f"fault injection (--fault-crash-at-step): rank {rank} fails at step {progress.step + 1}"
                )
            for micro in range(cfg.grad_accum_steps):
                inputs, targets = prefetch.next()
                if samples_log:
                    ids = " ".join(batches.sample_ids(batches.last_windows))
                    samples_log.write(f"{progress.step + 1} {micro} {ids}\n")
                last_micro = micro == cfg.grad_accum_steps - 1
                with parallel.accumulating(last_micro), compute_precision:
                    loss = parallel.forward_loss(inputs, targets)
                    if cfg.fault_nan_at_step and progress.step + 1 >= cfg.fault_nan_at_step:
                        loss = loss * float("nan")  # fault injection (--fault-nan-at-step): a diverged loss
                    (loss / cfg.grad_accum_steps).backward()
                loss_sum += loss.detach()
            grad_norm = parallel.clip_grad_norm(cfg.grad_clip or float("inf"))
            nonfinite = ~torch.isfinite(grad_norm)  # the same on every rank: DDP all-reduced the gradients
            save_stall_s += checkpoints.wait_until_staged()  # an async save copies the weights meanwhile: not past here
            for group in optimizer.param_groups:
                group["lr"] = schedule.lr_at(progress.step)
            skip_update_if(optimizer, nonfinite)  # the fused kernel skips a non-finite step itself: no host sync
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            progress.step += 1
            progress.tokens_seen += cfg.tokens_per_step * world
            throughput.add(cfg.tokens_per_step * world)
            steps_since_log += 1

            time_up = bool(cfg.max_time_s) and time.monotonic() - started > cfg.max_time_s
            if cfg.fault_signal_at_step == progress.step and rank == 0:
                os.kill(os.getpid(), signal.SIGTERM)  # fault injection: handled (StopSignal) before the proposal
            stop.propose(progress.step, time_up, nonfinite)
            first_step = progress.step == resumed_at + 1  # compile and warm-up: timed on its own
            evaluate = bool(cfg.eval_every) and progress.step % cfg.eval_every == 0
            sync_step = (
                first_step
                or progress.step % cfg.log_every == 0
                or progress.step % cfg.checkpoint_every == 0
                or evaluate
                or progress.step >= cfg.max_steps
                or bool(cfg.max_tokens)
                and progress.tokens_seen >= cfg.max_tokens
            )
            waiting = time.perf_counter()
            stop_reason, flagged = stop.agree(sync_step)
            sync_wait_s += time.perf_counter() - waiting
            heartbeat.stepped(progress.step)
            for flagged_step, bad in flagged:
                if divergence.record(flagged_step, finite=not bad):
                    stop_reason = "diverged"
            if stop_reason is None and progress.step >= cfg.max_steps:
                stop_reason = "max-steps"
            if stop_reason is None and cfg.max_tokens and progress.tokens_seen >= cfg.max_tokens:
                stop_reason = "max-tokens"
            step_time_s = time.perf_counter() - step_started
            if first_step:
                step_times.mark(progress.step, time.perf_counter())
                if rank == 0:
                    log.info("step %d took %.1fs (includes compile/warm-up)", progress.step, step_time_s)

            if progress.step % cfg.log_every == 0 or stop_reason or evaluate:
                # One collective for the row: the loss summed over the ranks, each rank's private memory in its
                # own slot (gloo has no average, and a sum of slots gives every rank's, for the maximum).
                row_values = torch.zeros(1 + world, device=device)
                row_values[0] = loss_sum / cfg.grad_accum_steps
                row_values[1 + rank] = rss_gib()
                dist.all_reduce(row_values)
                loss_total, *rss_all, norm = torch.cat([row_values, grad_norm.reshape(1).float()]).tolist()
                tokens_per_s, seconds_per_step = throughput.report()
                # lr: the next step's (what LambdaLR's get_last_lr gave), so a finished run's last row shows the floor
                row = {
                    "step": progress.step,
                    "loss": loss_total / world,
                    "lr": schedule.lr_at(progress.step),
                    "grad_norm": norm,
                    "tokens": progress.tokens_seen,
                    "tokens_per_s": round(tokens_per_s, 1),
                    "step_time_s": round(seconds_per_step, 4),
                    "input_wait_s": round(prefetch.take_waited() / steps_since_log, 4),
                    "sync_wait_s": round(sync_wait_s / steps_since_log, 4),
                    "checkpoint_stall_s": round(save_stall_s, 4),  # the saves' hold on training since the last row
                    # Not for the first step alone: its time is mostly compilation and warm-up.
                    "mfu": round(flops_per_step / seconds_per_step / (peak * world), 4)
                    if peak and not first_step
                    else None,
                    "gpu_mem_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if use_cuda else None,
                    "gpu_reserved_gib": round(torch.cuda.max_memory_reserved(device) / 2**30, 2) if use_cuda else None,
                    "rss_gib": round(max(rss_all), 2),
                    "skipped_steps": divergence.skipped,
                    "time": time.time(),
                }
                if mixture:  # each dataset's tokens and epochs so far
                    row["datasets"] = batches.accounting()
                sync_wait_s, save_stall_s, steps_since_log = 0.0, 0.0, 0
                if evaluate and stop_reason in (None, "max-steps", "max-tokens"):  # not with a signal's budget running
                    row = merge_rows(row, validation(model, val, byte_lengths, cfg, device))  # a collective under fsdp
                    throughput.reset()  # its time is not training's
                if spikes.is_spike(progress.step, row["loss"]):
                    row["loss_spike"] = True
                metrics.write(row)
                watch.row(row)
                for committed in checkpoints.take_committed():  # a background save commits later: seen now
                    watch.saved(committed)
                write_status(run, rank, "running", step=progress.step, world_size=world, attempt=attempt, durable=False)
                step_times.mark(progress.step, time.perf_counter())
                eta_s = step_times.eta_s(progress.step, cfg.max_steps)
                if rank == 0:
                    log.info(
                        "%s",
                        step_line(
                            progress.step,
                            cfg.max_steps,
                            row["loss"],
                            row["lr"],
                            row["grad_norm"],
                            tokens_per_s,
                            row["mfu"],
                            eta_s,
                        ),
                    )
                    if "val_loss" in row:
                        each = "".join(
                            f"; {name} {figures['val_loss']:.4f}"
                            for name, figures in row.get("datasets", {}).items()
                            if "val_loss" in figures
                        )
                        log.info(
                            "eval step %d: val loss %.4f (%.4f bits per byte, %s tokens)%s",
                            progress.step,
                            row["val_loss"],
                            row["val_bpb"],
                            f"{row['val_tokens']:,}",
                            each,
                        )

            if progress.step % cfg.checkpoint_every == 0 and stop_reason is None and divergence.streak:
                log.warning("no checkpoint at step %d: its update was skipped (not finite)", progress.step)
            elif progress.step % cfg.checkpoint_every == 0 and stop_reason is None:
                save_stall_s += save(blocking=False)
                if not budget_checked and checkpoints.last_save is not None:
                    check_save_budget(step_time_s, checkpoints.last_save, budget_s, rank)
                    budget_checked = True
            if first_step:  # the throughput of the rows after it leaves out compilation and warm-up
                throughput.reset()

    except (RuntimeError, dist.DistError) as exc:  # a collective failed (a timeout, a peer gone), or anything else
        if collective_failed(exc) and (failed := heartbeat.peer_failure()):  # the peer said why: no need to ask
            heartbeat.stop()
            end_with_failed_rank(*failed)
        if collective_failed(exc) and (silent := heartbeat.silent_ranks()):  # an OOM or a shape error: at once
            return report_silent_ranks(run, rank, world, silent, progress.step + 1, exc, attempt)
        raise
    finally:
        heartbeat.stop()
        prefetch.close()

    if stop_reason == "diverged":  # no checkpoint over the last good one
        reason = divergence.reason()
        log.error("%s", reason)
        write_status(
            run,
            rank,
            "diverged",
            step=divergence.first_bad_step,
            exit_code=ExitCode.DIVERGED,
            reason="diverged",
            error=reason,
            attempt=attempt,
        )
        watch.note(progress.step, "stop", reason)
        checkpoints.close(wait_for_mirror=False)
        dist.destroy_process_group()
        return ExitCode.DIVERGED
    # Stopping: a blocking save, waited for by every rank, so that the exit code tells the truth.
    if progress.step == resumed_at:
        write_status(
            run, rank, "done", step=progress.step, exit_code=ExitCode.DONE, reason="max-steps", attempt=attempt
        )
        dist.destroy_process_group()
        return ExitCode.DONE
    if samples_log:
        samples_log.close()
    signalled = stop_reason == "signal"
    finished = progress.step >= cfg.max_steps or bool(cfg.max_tokens) and progress.tokens_seen >= cfg.max_tokens
    if signalled and finished:  # the signal came on the last step: the run is done, not preempted (exit 0, not 75)
        stop_reason = "max-steps" if progress.step >= cfg.max_steps else "max-tokens"
        log.warning("a signal arrived on the last step (%d): the run is done", progress.step)
    preempted = stop_reason == "signal"
    try:
        save(blocking=True)  # committed when it returns (it waited for any earlier background save first)
        dist.barrier()  # every rank's share committed; then rank 0 alone waits for its durable copy, if any
        checkpoints.close(wait_for_mirror=not signalled)  # after a signal there is no time for the durable copy
        if not budget_checked and checkpoints.last_save is not None:
            check_save_budget(step_time_s, checkpoints.last_save, budget_s, rank)
    except Exception as exc:
        log.exception("the final checkpoint of step %d could not be committed", progress.step)
        code = ExitCode.PREEMPTED_UNSAVED if preempted else ExitCode.CRASHED
        write_status(
            run,
            rank,
            "preempted-unsaved" if preempted else "crashed",
            step=progress.step,
            exit_code=code,
            reason=stop_reason,
            error=f"final checkpoint failed: {exc}",
            permanent=getattr(exc, "permanent", False),
            attempt=attempt,
        )
        return code
    if preempted:
        log.warning(
            "stopped by %s at step %d: checkpoint committed %.1fs after the signal (budget %.0fs)",
            stop.signal.name if stop.signal else "a signal on another rank",
            progress.step,
            stop.seconds_since(),
            budget_s,
        )
    else:
        log.info("training stopped at step %d (%s), %d tokens seen", progress.step, stop_reason, progress.tokens_seen)
    code = ExitCode.PREEMPTED if preempted else ExitCode.DONE
    for committed in checkpoints.take_committed():  # the final save, and a background one it waited for
        watch.saved(committed)
    watch.note(progress.step, "stop", f"stopped at step {progress.step} ({stop_reason}), checkpoint committed")
    watch.close(timeout_s=2.0 if preempted else 30.0)  # after a signal, the pod's grace period is running
    write_status(
        run,
        rank,
        "preempted" if preempted else "done",
        step=progress.step,
        exit_code=code,
        attempt=attempt,
        reason=stop_reason,
        tokens_seen=progress.tokens_seen,
        seconds_to_commit=round(stop.seconds_since(), 3) if preempted else None,
    )
    dist.destroy_process_group()
    return code


def check_published_fits(published: PublishedModel, mconfig: Any, data_dir: Path, seq_len: int) -> None:
    """A published model trains on this snapshot only if the snapshot's tokenizer is the model's (else its token ids
    mean other tokens than the weights learnt) and the sequence fits its positions (bad input otherwise, one line)."""
    from tokenizers import Tokenizer

    if mismatch := published.tokenizer_mismatch(Tokenizer.from_file(str(data_dir / TOKENIZER))):
        raise DataError(
            f"--init-from-model {published.path}: snapshot {data_dir.name} was staged with another "
            f"tokenizer ({mismatch}): stage the corpus with the model's own tokenizer"
        )
    positions = getattr(mconfig, "max_position_embeddings", None) or getattr(mconfig, "n_positions", None)
    if positions and seq_len > positions:
        raise SettingError(
            f"--seq-len {seq_len} is longer than the {positions} positions of the model in {published.path}"
        )


def validation_data(
    snapshots: dict[str, Path], meta: dict[str, Any], seq_len: int
) -> tuple[dict[str, TokenSplit], np.ndarray]:
    """--eval-every's data, read once: each dataset's val split (memory-mapped; one, or a mixture's), and the bytes
    each token stands for (bits per byte; a mixture's datasets share their tokenizer). A split without one window is
    bad input at start, not a crash at the first evaluation."""
    splits = {}
    for name, data_dir in snapshots.items():
        splits[name] = val = load_split(data_dir, "val")
        if val.num_windows(seq_len) == 0:
            raise DataError(
                f"--eval-every: the val split of {data_dir} has no window of {seq_len + 1} tokens in one "
                f"shard ({len(val)} tokens in {len(val.shards)} shard(s)): evaluate with a shorter "
                "--seq-len, or turn it off (0)"
            )
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(next(iter(snapshots.values())) / TOKENIZER))
    return splits, token_byte_lengths(tokenizer, model_vocab(meta))


def validation(
    model: torch.nn.Module, val: dict[str, TokenSplit], byte_lengths: np.ndarray, cfg: TrainConfig, device: torch.device
) -> dict[str, Any]:
    """The val loss over each split's first --eval-tokens tokens, as the evaluation step measures a checkpoint
    (trainer/evaluation.py), in training batches; of a mixture, each dataset's too and the total over them all. No
    random numbers drawn and no training data read, so a run evaluated along the way trains exactly as one that is
    not."""
    training = model.training
    measured = {}
    for name, split in val.items():
        loss, tokens, n_bytes = mean_loss(
            model, split, cfg.seq_len, cfg.eval_tokens, cfg.batch_size, device, byte_lengths
        )
        measured[name] = (loss, tokens, n_bytes)
    model.train(training)
    tokens, n_bytes = sum(t for _, t, _ in measured.values()), sum(b for *_, b in measured.values())
    loss = (
        next(iter(measured.values()))[0]
        if len(measured) == 1
        else sum(loss * t for loss, t, _ in measured.values()) / tokens
    )
    row: dict[str, Any] = {"val_loss": loss, "val_bpb": bits_per_byte(loss, tokens, n_bytes), "val_tokens": tokens}
    if len(val) > 1:
        row["datasets"] = {
            name: {"val_loss": loss, "val_bpb": bits_per_byte(loss, t, b)} for name, (loss, t, b) in measured.items()
        }
    return row


def merge_rows(row: dict[str, Any], more: dict[str, Any]) -> dict[str, Any]:
    """`row` with `more`'s fields, each dataset's figures (row["datasets"]) merged rather than replaced."""
    datasets = {
        name: {**row.get("datasets", {}).get(name, {}), **figures} for name, figures in more.pop("datasets", {}).items()
    }
    merged = row | more
    if datasets:
        merged["datasets"] = {**row.get("datasets", {}), **datasets}
    return merged


def report_silent_ranks(
    run: RunPaths, rank: int, world: int, silent: list[int], step: int, exc: BaseException, attempt: int
) -> ExitCode:
    """A collective failed and `silent` stopped answering: say so, in the log and (by the lowest rank still
    answering, as rank 0 may be the silent one) in status.json. A crash: the next start may have its nodes back."""
    reason = (
        f"a collective failed at step {step} ({type(exc).__name__}): rank(s) {', '.join(map(str, silent))} "
        "stopped answering (a stopped or hung process, or a lost node)"
    )
    log.error("%s", reason)
    if rank == min(set(range(world)) - set(silent)):
        write_hung_status(run, step - 1, silent, reason, attempt)
    return ExitCode.CRASHED


def write_hung_status(run: RunPaths, step: int, silent: list[int], reason: str, attempt: int) -> None:
    """Status `hung`, written by the lowest rank still answering (rank 0 may be the silent one)."""
    status = {"state": "hung", "step": step, "silent_ranks": silent, "error": reason, "attempt": attempt}
    write_json(run.status, {**status, "exit_code": int(ExitCode.CRASHED), "time": time.time()})


def write_status(run: RunPaths, rank: int, state: str, durable: bool = True, **details: Any) -> None:
    """Rank 0 records where the run stands, so that the launcher can tell preempted-and-saved from a crash, and
    see progress (at every logged step: not `durable`, no fsync, as it is rewritten so often)."""
    if rank == 0:
        write_json(run.status, {"state": state, **details, "time": time.time()}, fsync=durable)


ATTEMPT_KEY = "hyperpod-pretrain/attempt"


def agree_on_attempt(run: RunPaths, rank: int) -> int:
    """This start's attempt number, the same on every rank: rank 0 takes the next after those on the volume and
    publishes it in the process group's store, the others wait for it there.

    torchrun's restart count is per node and starts again with a new container, and the rendezvous id never
    changes, so neither tells two starts apart. The store is used, not a collective: with NCCL the first collective
    creates the communicator, which must already know its (per-attempt) NCCL_DEBUG_FILE.
    """
    store = default_store()
    if rank == 0:
        attempt = max(run.attempts(), default=0) + 1
        (run.comms / run.attempt(attempt)).mkdir(parents=True, exist_ok=True)
        store.set(ATTEMPT_KEY, str(attempt))
        return attempt
    return int(store.get(ATTEMPT_KEY))


def init_distributed(backend: str, timeout: timedelta) -> None:
    """env:// as torchrun sets it up, with each torchelastic restart's keys apart in the store.

    Without the prefix, a group restarted by torchrun (--max-restarts) can read the previous attempt's
    gloo addresses from the agent's store and fail with "connectFullMesh ... Connection refused".
    """
    if "TORCHELASTIC_RESTART_COUNT" not in os.environ:
        dist.init_process_group(backend, timeout=timeout)
        return
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent_hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world_size=world,
        is_master=rank == 0 and not agent_hosts_store,
        multi_tenant=not agent_hosts_store,
        timeout=timedelta(minutes=15),
    )
    attempt = dist.PrefixStore(f"attempt-{os.environ['TORCHELASTIC_RESTART_COUNT']}", store)
    dist.init_process_group(backend, store=attempt, rank=rank, world_size=world, timeout=timeout)


def durable_copy(cfg: TrainConfig) -> Mirror | None:
    """The S3 copy of every committed checkpoint, when --checkpoint-s3-uri asks for one."""
    if not cfg.checkpoint_s3_uri:
        return None
    from trainer.durable import CheckpointMirror  # boto3: only when asked for

    return CheckpointMirror(cfg.checkpoint_s3_uri)


def log_memory_estimate(mconfig: Any, cfg: TrainConfig, kind: str, world: int, device: torch.device, rank: int) -> None:
    """The preflight's estimate of this run's memory per GPU (trainer/memory.py), beside what the device has free:
    the metrics' gpu_mem_gib then shows the real peak to compare with."""
    if rank != 0:
        return
    shape = model_shape(mconfig)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    need = estimate(shape, kind, world, local_world, cfg.batch_size, cfg.seq_len, cfg.activation_checkpointing)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        log.info("memory estimate: %s; the GPU has %.1f GiB free of %.1f", need.describe(), free / 2**30, total / 2**30)
    else:
        log.info("memory estimate (as on a GPU): %s", need.describe())


def check_save_budget(step_time_s: float, saved: SaveReport, budget_s: float, rank: int) -> None:
    """After the first checkpoint: could a SIGTERM arriving mid-step still end in a committed checkpoint? The ranks
    agree on it a step later (trainer/preemption.py), so up to two steps pass before the save. And how much did
    writing from every rank help (the save would take parallel_speedup times longer from one writer)?"""
    if rank != 0:
        return
    save_s, needed_s = saved.seconds, 2 * step_time_s + saved.seconds
    fits = "fits" if needed_s <= budget_s else "does NOT fit"
    log.info(
        "checkpoint save: %.1f MB in %.1fs (%.0f MB/s), written by %d ranks in parallel, about %.1fx faster than "
        "one writer at the same rate; two steps (%.1fs each) plus a save %s the %.0fs preemption budget",
        saved.total_bytes / 1e6,
        save_s,
        saved.total_bytes / 1e6 / max(save_s, 1e-9),
        saved.writers,
        saved.parallel_speedup,
        step_time_s,
        fits,
        budget_s,
    )
    if needed_s > budget_s:
        log.warning(
            "!!! PREEMPTION WOULD LOSE WORK: two steps (%.1fs each: the one the signal lands in and the one "
            "in which the ranks agree to stop) plus a checkpoint save (%.1fs) take longer than the %.0fs "
            "between SIGTERM and SIGKILL (the grace period, capped by torchrun's shutdown timeout); raise "
            "terminationGracePeriodSeconds and torchrun's --shutdown-timeout, or save faster "
            "(--async-checkpoint does not help here: the final save is always waited for)",
            step_time_s,
            save_s,
            budget_s,
        )


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


# Each rank's log on the volume; the launcher reads it back after a failure (components/launch_pytorchjob/evidence.py).
LOG_FORMAT = "%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s"


def setup_logging(rank: int, log_file: Path) -> None:
    log_file.parent.mkdir(parents=True, exist_ok=True)
    fmt = logging.Formatter(LOG_FORMAT.replace("{rank}", str(rank)))
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    for handler in (logging.StreamHandler(sys.stderr), logging.FileHandler(log_file)):
        handler.setFormatter(fmt)
        root.addHandler(handler)


def main(argv: list[str] | None = None) -> int:
    """Exit codes as ExitCode documents; every failure reaches torchrun's error file and summary, and the other
    ranks (trainer/health.py announce_failure), which end too instead of waiting for this one in a collective."""
    errors = get_error_handler()
    errors.initialize()
    cfg = parse_config(argv)  # bad flags: argparse's one line and exit 2
    rank = int(os.environ.get("RANK", 0))
    run = RunPaths(Path(cfg.run_dir))

    def failed(exc: BaseException, state: str, code: ExitCode, **details: Any) -> None:
        if dist.is_initialized():
            announce_failure(default_store(), rank, f"{type(exc).__name__}: {exc}")
        errors.record_exception(exc)
        write_status(run, rank, state, exit_code=code, failed_rank=rank, **details)

    try:
        with ExitStack() as cleanup:
            return train(cfg, cleanup)
    except (CheckpointError, DataError, SettingError) as exc:
        log.error("%s", exc)
        failed(exc, "bad-input", ExitCode.BAD_INPUT, error=str(exc))
        return ExitCode.BAD_INPUT
    except SaveFailed as exc:  # a periodic or background save: the last committed checkpoint stands
        log.error("%s", exc)
        failed(exc, "crashed", ExitCode.CRASHED, step=exc.step, error=str(exc), permanent=exc.permanent)
        return ExitCode.CRASHED
    except Exception as exc:
        log.exception("training crashed")  # into this rank's log on the volume, which outlives the pod
        failed(exc, "crashed", ExitCode.CRASHED, error=repr(exc))
        raise


def exit_now(code: int) -> None:
    """Exit without the interpreter's teardown, which restores the default SIGTERM handler while it unloads
    torch: torchrun SIGTERMs the remaining workers as soon as one exits, and a worker caught in teardown
    would die by that signal (-15) instead of exiting with its own code."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
