"""DDP pretraining of a causal LM: the program torchrun starts in every PyTorchJob pod.

    torchrun --nproc_per_node=N [--nnodes=MIN:MAX --rdzv_backend=c10d ...] trainer/train_ddp.py \\
        --data-dir <root>/datasets/<name>/snapshots/<id> --run-dir <root>/runs/<id> --preset small ...

NCCL on GPUs (bf16: autocast under ddp, FSDP's mixed precision under fsdp/hsdp), gloo on CPU (fp32). A run
directory that holds a checkpoint is resumed from it, also with another world size. SIGTERM/SIGINT stop every
rank after the same step, rank 0 commits a checkpoint, and the processes exit with a code from
trainer.preemption.ExitCode:
0 done, 1 crashed (also: a collective timed out, naming the ranks that stopped answering), 2 bad input,
3 diverged (trainer/health.py), 75 preempted and saved (rerun to resume), 76 preempted, save failed.

As torchtitan's trainer: constructing a `Trainer` builds this rank's state (process group, data, model, optimizer,
checkpoints; resumed from the newest checkpoint, if any), `Trainer.train_step` is one optimizer step, and
`Trainer.train` is the loop, which returns the exit code.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import sys
import time
from contextlib import ExitStack
from dataclasses import asdict
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
    Checkpoint,
    CheckpointError,
    CheckpointManager,
    Mirror,
    SaveFailed,
    check_schema,
    old_checkpoint_warning,
    rng_state,
    set_rng_state,
    unchecked_by_old_checkpoint,
)
from trainer.config import CONTINUE, SettingError, TrainConfig, parse_config
from trainer.errors import DataError
from trainer.evaluation import merge_rows, validation
from trainer.health import Divergence, Heartbeat, SpikeWatch, announce_failure, collective_failed
from trainer.layout import RunPaths
from trainer.memory import estimate, model_shape
from trainer.metrics import MetricsLog, StepMetrics, eval_line, flops_per_token, peak_flops, plan_line, step_line
from trainer.mixture import mixture_plan
from trainer.model import SMALL_PRESETS, architecture_differences, config_from_dict, model_config, set_dropout
from trainer.monitor import monitor_logger, monitor_step_line, monitor_stop_line, monitored
from trainer.parallel import parallelize, torch_release
from trainer.preemption import ExitCode, StopSignal, save_budget_report, save_budget_s
from trainer.prefetch import Prefetcher
from trainer.private_api import default_store, skip_update_if
from trainer.process_group import join
from trainer.published import PublishedModel, check_published_fits
from trainer.published_weights import load_weights
from trainer.run_data import RunData
from trainer.schedule import LRSchedule, ScheduleSettings
from trainer.snapshot import model_vocab, snapshot_record
from trainer.status import write_hung_status, write_status
from trainer.tracking import RunWatch, preload_mlflow
from trainer.train_state import Progress, TrainState
from trainer.warm_start import warm_start_state

log = logging.getLogger("trainer")


class Trainer:
    """One rank's training run. Constructing it joins the process group and builds the data, model, optimizer and
    checkpointing state, resumed from the newest checkpoint if there is one; `train()` runs the loop of
    `train_step()`s and returns the exit code."""

    def __init__(self, cfg: TrainConfig, cleanup: ExitStack):
        """`cleanup`: what is left open on the way out (rank 0's TensorBoard writer and MLflow feed)."""
        self.cfg = cfg
        self.use_cuda = torch.cuda.is_available()
        if cfg.ddp_comm_hook == "bf16" and not self.use_cuda:  # DDP refuses the hook under gloo
            raise SettingError(
                "--ddp-comm-hook bf16 compresses NCCL's gradient all-reduce and needs GPUs; on a CPU (gloo) use none"
            )
        if cfg.async_checkpoint and torch_release() < (2, 12):
            raise SettingError(
                f"--async-checkpoint needs torch 2.12 or newer, this is {torch.__version__}: torch 2.11's checkpoint "
                "stager empties its copy table when a background save ends, and the next one fails (KeyError: "
                "<class 'type'>); the HyperPodPyTorchJob's image runs 2.11 (docs/images.md): save in the foreground"
            )
        self.run = RunPaths(Path(cfg.run_dir))
        self.collective_timeout = timedelta(seconds=cfg.collective_timeout_s)  # a silent rank fails the others
        self.join_process_group()

        # The newest good checkpoint, if any (on the volume, else the durable copy): it names the dataset snapshot to
        # read. (Checkpoints have their own gloo group: an asynchronous save plans in the background, beside training.)
        self.checkpoints = CheckpointManager(
            self.run.checkpoints,
            keep=cfg.keep_checkpoints,
            async_save=cfg.async_checkpoint,
            attempt=self.attempt,
            group=dist.new_group(backend="gloo", timeout=self.collective_timeout),
            mirror=durable_copy(cfg),
            fail_from_step=cfg.fault_save_at_step,
        )
        checkpoint = self.checkpoints.newest()
        state = checkpoint.trainer_state() if checkpoint is not None else None

        # Data, model, optimizer.
        self.data = RunData.read(cfg, state, self.rank, self.world)
        published = self.choose_model(state)
        self.build_model(initial_weights=published is None)
        self.schedule = LRSchedule(ScheduleSettings.of(cfg))
        self.progress = Progress()
        self.divergence, self.spikes = Divergence(cfg.max_nonfinite_steps), SpikeWatch(cfg.spike_factor)
        position = self.data.batches.position
        self.train_state = TrainState(self.schedule, self.progress, position, self.divergence, self.spikes)
        self.metrics = MetricsLog(self.run.metrics, enabled=self.rank == 0)

        # Resume from the checkpoint, if any; or a new run, from another run's weights (a warm start), a published
        # model's or initial ones.
        self.warm_started = state.get("init_from") if state is not None else None  # kept by every checkpoint of a run
        if state is None:
            self.start_from_weights(published)
        else:
            self.resume(checkpoint, state)
        del state, checkpoint
        self.status(
            "running",
            step=self.progress.step,
            world_size=self.world,
            restart_count=int(self.restarts),
            attempt=self.attempt,
        )
        self.watch = self.record_start(cleanup) if self.rank == 0 else RunWatch.off()

        self.compute_precision = self.parallel.compute_precision(self.device)
        flops_per_step = flops_per_token(self.model, cfg.seq_len) * cfg.tokens_per_step * self.world
        peak = peak_flops(self.device, cfg.peak_tflops)
        self.step_metrics = StepMetrics(self.rank, self.world, self.device, flops_per_step, peak)
        samples_file = self.run.logs / f"samples_rank_{self.rank:05d}.txt"
        self.samples_log = cleanup.enter_context(open(samples_file, "a")) if cfg.log_samples else None  # closed at exit
        self.budget_s = save_budget_s(cfg.grace_period_s)
        self.budget_checked = False

    # Construction, in the order it happens.

    def join_process_group(self) -> None:
        """This rank in the process group: its attempt number, device, log file, signal handlers, comms self-test."""
        cfg, run = self.cfg, self.run
        self.rank, self.world, self.attempt, self.device = join(run, self.use_cuda, self.collective_timeout)
        setup_logging(self.rank, run.rank_log(self.rank))
        self.monitor = monitor_logger(monitored())  # a per-node log monitor's lines (trainer/monitor.py), if asked
        if self.rank == 0 and cfg.mlflow_tracking_uri:
            preload_mlflow()
        self.restarts = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        log.info(
            "rank %d of %d on %s (torchelastic restart count %s)", self.rank, self.world, self.device, self.restarts
        )
        self.stop = StopSignal(self.device)

        self.comms_report = comms.self_test(self.device) | {"attempt": self.attempt}
        write_json(run.comms_report(self.rank, self.attempt), self.comms_report)
        log.info(
            "comms self-test: all_reduce %s, bus bandwidth %.3f GB/s",
            "correct" if self.comms_report["all_reduce_correct"] else "WRONG",
            self.comms_report["busbw_gbps"],
        )

    def choose_model(self, state: dict[str, Any] | None) -> PublishedModel | None:
        """The architecture (self.mconfig): a published model's, the one a resumed run's checkpoints hold, or the
        preset's. Returns the published model a new run starts from, if any."""
        cfg = self.cfg
        if cfg.init_from_model and cfg.init_from:
            raise SettingError(
                "--init-from (a run's weights) and --init-from-model (a published model's) are two "
                "starting points: give one"
            )
        published = PublishedModel.read(Path(cfg.init_from_model)) if cfg.init_from_model and state is None else None
        if published is not None:  # its architecture, checked against this run's tokenizer and sequence length
            self.mconfig = published.model_config(cfg.dropout)
            check_published_fits(published, self.mconfig, self.data.directory, cfg.seq_len)
        elif cfg.init_from_model:  # a resume: the architecture its checkpoints hold (the directory may be gone since)
            self.mconfig = set_dropout(config_from_dict(state["model_config"]), cfg.dropout)
        else:
            meta = self.data.meta
            self.mconfig = model_config(
                cfg.preset, model_vocab(meta), cfg.seq_len, meta["eos_id"], cfg.dropout, meta.get("bos_id")
            )
        return published

    def build_model(self, initial_weights: bool) -> None:
        """The model, spread over the ranks as --parallelism says (trainer/parallel.py), with the same initial weights
        whatever the parallelism and world size; and its AdamW."""
        cfg = self.cfg
        if self.use_cuda:  # TF32 for the fp32 matmuls that autocast leaves (CPU: no such mode)
            torch.set_float32_matmul_precision("high")
        compiled = cfg.compile == "on" or (cfg.compile == "auto" and self.use_cuda and cfg.preset not in SMALL_PRESETS)
        if compiled:  # the compiled code in the run directory: a restarted pod loads it instead of compiling again
            os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(self.run.compile_cache))
            log.info("torch.compile: model and loss (cache %s)", os.environ["TORCHINDUCTOR_CACHE_DIR"])
        hook = default_hooks.bf16_compress_hook if cfg.ddp_comm_hook == "bf16" else None  # half the bytes on the wire
        self.parallel = parallelize(
            self.mconfig,
            cfg.parallelism,
            self.device,
            cfg.seed,
            int(os.environ.get("LOCAL_WORLD_SIZE", self.world)),
            comm_hook=hook,
            compile_model=compiled,
            activation_checkpointing=cfg.activation_checkpointing,
            initial_weights=initial_weights,
        )
        self.model = self.parallel.model
        if self.parallel.kind != "ddp":
            log.info("parallelism %s over %s", self.parallel.kind, self.parallel.mesh)
        if self.rank == 0:
            self.log_memory_estimate()
        matrices = [p for p in self.model.parameters() if p.dim() >= 2]
        vectors = [p for p in self.model.parameters() if p.dim() < 2]
        self.optimizer = torch.optim.AdamW(
            [{"params": matrices, "weight_decay": cfg.weight_decay}, {"params": vectors, "weight_decay": 0.0}],
            lr=cfg.lr,
            betas=(0.9, 0.95),
            fused=True,  # fused on the CPU too: it honours found_inf (trainer/health.py)
        )

    def log_memory_estimate(self) -> None:
        """The preflight's estimate of this run's memory per GPU (trainer/memory.py), beside what the device has free:
        the metrics' gpu_mem_gib then shows the real peak to compare with."""
        cfg, shape, kind = self.cfg, model_shape(self.mconfig), self.parallel.kind
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", self.world))
        need = estimate(shape, kind, self.world, local_world, cfg.batch_size, cfg.seq_len, cfg.activation_checkpointing)
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            log.info(
                "memory estimate: %s; the GPU has %.1f GiB free of %.1f", need.describe(), free / 2**30, total / 2**30
            )
        else:
            log.info("memory estimate (as on a GPU): %s", need.describe())

    def start_from_weights(self, published: PublishedModel | None) -> None:
        """A new run: another run's weights (--init-from, a warm start), a published model's (--init-from-model) or
        the initial ones; then every rank's random generators seeded."""
        cfg = self.cfg
        if cfg.init_from:
            weights, self.warm_started = warm_start_state(
                Path(cfg.init_from), self.data.meta.get("tokenizer_sha256", ""), self.mconfig.to_dict()
            )
            set_model_state_dict(self.model, weights, options=StateDictOptions(full_state_dict=True, strict=True))
            del weights
            log.info(
                "warm start from run %s at step %d (%d tokens seen there): its weights, with this run's data, "
                "schedule and sample order",
                self.warm_started["run"],
                self.warm_started["step"],
                self.warm_started["tokens_seen"],
            )
        if published is not None:
            load_weights(self.model, published)  # every rank its own pieces
            self.warm_started = published.record() if self.rank == 0 else {"model": str(published.path)}
            log.info(
                "starting from the published %s model in %s (%.1f MB of safetensors in %d file(s)): its weights, "
                "with this run's data, a fresh optimizer and schedule",
                published.config["model_type"],
                published.path,
                self.warm_started.get("bytes", 0) / 1e6,
                len(published.files),
            )
        seed_everything(cfg.seed + self.rank)

    def resume(self, checkpoint: Checkpoint, state: dict[str, Any]) -> None:
        """The checkpoint's model, optimizer, trainer state (TrainState) and this rank's random generators, as the run
        left them; a schedule extended by new flags and another world size are said in the log."""
        cfg, run, rank, progress = self.cfg, self.run, self.rank, self.progress
        differences = architecture_differences(state["model_config"], self.mconfig.to_dict())
        if state["preset"] != cfg.preset or differences:
            raise CheckpointError(
                f"the checkpoint in {run.checkpoints} is of preset {state['preset']!r} and another architecture than "
                f"this run's {cfg.preset!r} ({'; '.join(differences) or 'another preset'}): use a new run directory "
                "or the original settings"
            )
        check_schema(state)
        if (unchecked := unchecked_by_old_checkpoint(state)) and rank == 0:
            log.warning("%s", old_checkpoint_warning(unchecked))
        state.setdefault("schedule", self.schedule.state_dict())  # schema 1: the flags' schedule
        self.checkpoints.restore(checkpoint, self.model, self.optimizer)
        matrices = self.optimizer.param_groups[0]  # the checkpoint's groups hold its weight decay: this start's wins
        if matrices["weight_decay"] != cfg.weight_decay:
            if rank == 0:
                log.info(
                    "weight decay %g -> %g (this start's --weight-decay)", matrices["weight_decay"], cfg.weight_decay
                )
            matrices["weight_decay"] = cfg.weight_decay
        self.train_state.load_state_dict(state)
        changes = self.schedule.resume(progress.step, ScheduleSettings.of(cfg), cfg.extend_schedule)
        if changes and rank == 0:
            start_lr, end_lr = self.schedule.lr_at(progress.step), cfg.min_lr_ratio * cfg.lr
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
        saved_world = state["world_size"]
        log.info(
            "resumed at step %d (%d tokens seen) from a checkpoint of %d ranks",
            progress.step,
            progress.tokens_seen,
            saved_world,
        )
        if saved_world != self.world:
            log.warning(
                "world size changed from %d to %d: the data is re-partitioned from %s, nothing repeated or "
                "skipped; a step now takes %d sequences instead of %d",
                saved_world,
                self.world,
                self.data.batches.position.where(),
                cfg.batch_size * cfg.grad_accum_steps * self.world,
                cfg.batch_size * cfg.grad_accum_steps * saved_world,
            )
        self.metrics.truncate_after(progress.step)

    def record_start(self, cleanup: ExitStack) -> RunWatch:
        """Rank 0: the step this start goes on from (0: from scratch) beside its comms report, which marks each
        resume with it; the resolved settings in config.json; the TensorBoard files and MLflow run."""
        cfg, run, step = self.cfg, self.run, self.progress.step
        write_json(run.comms_report(self.rank, self.attempt), self.comms_report | {"start_step": step})
        resolved = {
            "trainer": asdict(cfg),
            "world_size": self.world,
            "model": self.mconfig.to_dict(),
            "dataset": self.data.record(),
            "init_from": self.warm_started,
            "hyperpod_pretrain": tool_version(),
        }
        write_json(run.config, resolved)
        watch = cleanup.enter_context(
            RunWatch.start(
                run.tensorboard if cfg.tensorboard else None,
                run.mlflow_run,
                step,
                resolved,
                cfg.mlflow_tracking_uri,
                cfg.mlflow_experiment,
                run.root.name,
            )
        )
        begun = "resumed at" if step else "started from"
        restart = f"torchrun restart {self.restarts}"
        watch.note(step, "start", f"attempt {self.attempt}: {begun} step {step} on {self.world} ranks ({restart})")
        return watch

    # Training.

    def train(self) -> ExitCode:
        """The loop: an optimizer step, the ranks' agreement on stopping, the metrics row of a logged step (with the
        val loss of an eval step), a periodic checkpoint; at the stop, the final checkpoint and the exit code.

        Nothing in it waits for the device except on a sync step (this process's first step, a logged step, a
        checkpoint, the last step): the next batches are read ahead (trainer/prefetch.py) and the ranks agree on
        stopping one step late (trainer/preemption.py). The loop's own helpers start here: the heartbeat thread
        (trainer/health.py), the batches read ahead, the clocks."""
        cfg, progress = self.cfg, self.progress
        self.heartbeat = Heartbeat(
            default_store(),
            self.rank,
            self.world,
            cfg.collective_timeout_s,
            on_silent=self.report_hang,
            on_peer_failure=self.end_with_failed_rank,
        )
        self.log_plan()
        self.started, self.resumed_at = time.monotonic(), progress.step
        self.step_metrics.throughput.reset()  # the first row's clock starts with the loop
        stop_reason = "max-steps" if progress.step >= cfg.max_steps else None
        if stop_reason:
            log.info("nothing to do: the run already reached step %d", progress.step)
        self.prefetch = Prefetcher(
            self.data.batches, self.device, depth=2 * cfg.grad_accum_steps, read_latency_s=cfg.fault_read_latency_s
        )
        step_time_s = 0.0
        try:
            while stop_reason is None:
                step_started = time.perf_counter()
                loss_sum, grad_norm, nonfinite = self.train_step()
                progress.step += 1
                progress.tokens_seen += cfg.tokens_per_step * self.world
                self.step_metrics.stepped(cfg.tokens_per_step * self.world)

                time_up = bool(cfg.max_time_s) and time.monotonic() - self.started > cfg.max_time_s
                if cfg.fault_signal_at_step == progress.step and self.rank == 0:
                    os.kill(os.getpid(), signal.SIGTERM)  # fault injection: handled (StopSignal) before the proposal
                self.stop.propose(progress.step, time_up, nonfinite)
                first_step = progress.step == self.resumed_at + 1  # compile and warm-up: timed on its own
                evaluate = bool(cfg.eval_every) and progress.step % cfg.eval_every == 0
                stop_reason = self.agree_on_stop(sync_step=first_step or evaluate or self.is_sync_step())
                step_time_s = time.perf_counter() - step_started
                if first_step:
                    self.step_metrics.step_times.mark(progress.step, time.perf_counter())
                    if self.rank == 0:
                        log.info("step %d took %.1fs (includes compile/warm-up)", progress.step, step_time_s)

                if progress.step % cfg.log_every == 0 or stop_reason or evaluate:
                    # The val loss too on an eval step, but not with a signal's budget running.
                    validate = evaluate and stop_reason in (None, "max-steps", "max-tokens")
                    self.log_step(loss_sum, grad_norm, first_step, validate)
                if progress.step % cfg.checkpoint_every == 0 and stop_reason is None:
                    self.periodic_checkpoint(step_time_s)
                if first_step:  # the throughput of the rows after it leaves out compilation and warm-up
                    self.step_metrics.throughput.reset()

        except (RuntimeError, dist.DistError) as exc:  # a collective failed (a timeout, a peer gone), or anything else
            # The peer said why it failed: no need to ask.
            if collective_failed(exc) and (failed := self.heartbeat.peer_failure()):
                self.heartbeat.stop()
                self.end_with_failed_rank(*failed)
            if collective_failed(exc) and (silent := self.heartbeat.silent_ranks()):  # an OOM or a shape error: at once
                return self.report_silent_ranks(silent, progress.step + 1, exc)
            raise
        finally:
            self.heartbeat.stop()
            self.prefetch.close()
        return self.finish(stop_reason, step_time_s)

    def train_step(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One optimizer step of grad_accum_steps micro-batches: forward and loss, backward, clip, update. Returns the
        micro-batches' summed loss, the gradient norm and whether it is not finite, as device tensors: nothing here
        waits for the device. A step whose gradient norm is not finite skips its update (trainer/health.py)."""
        cfg, step = self.cfg, self.progress.step + 1  # the step this one will be
        if cfg.fault_crash_at_step and step == cfg.fault_crash_at_step and self.rank == self.world - 1:
            raise RuntimeError(f"fault injection (--fault-crash-at-step): rank {self.rank} fails at step {step}")
        loss_sum = torch.zeros((), device=self.device)
        for micro in range(cfg.grad_accum_steps):
            inputs, targets = self.prefetch.next()
            if self.samples_log:
                batches = self.data.batches
                self.samples_log.write(f"{step} {micro} {' '.join(batches.sample_ids(batches.last_windows))}\n")
            last_micro = micro == cfg.grad_accum_steps - 1
            with self.parallel.accumulating(last_micro), self.compute_precision:
                loss = self.parallel.forward_loss(inputs, targets)
                if cfg.fault_nan_at_step and step >= cfg.fault_nan_at_step:
                    loss = loss * float("nan")  # fault injection (--fault-nan-at-step): a diverged loss
                (loss / cfg.grad_accum_steps).backward()
            loss_sum += loss.detach()
        grad_norm = self.parallel.clip_grad_norm(cfg.grad_clip or float("inf"))
        nonfinite = ~torch.isfinite(grad_norm)  # the same on every rank: DDP all-reduced the gradients
        # An async save copies the weights meanwhile: not past here.
        self.step_metrics.save_stall_s += self.checkpoints.wait_until_staged()
        for group in self.optimizer.param_groups:
            group["lr"] = self.schedule.lr_at(self.progress.step)
        skip_update_if(self.optimizer, nonfinite)  # the fused kernel skips a non-finite step itself: no host sync
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss_sum, grad_norm, nonfinite

    def is_sync_step(self) -> bool:
        """A step after which the host waits for the device, whatever happened in it: logged, checkpointed, the last."""
        step, cfg = self.progress.step, self.cfg
        return step % cfg.log_every == 0 or step % cfg.checkpoint_every == 0 or self.limit_reached() is not None

    def limit_reached(self) -> str | None:
        """The limit reached, "max-steps" or "max-tokens", once the run has trained as far as it was asked to."""
        if self.progress.step >= self.cfg.max_steps:
            return "max-steps"
        if self.cfg.max_tokens and self.progress.tokens_seen >= self.cfg.max_tokens:
            return "max-tokens"
        return None

    def agree_on_stop(self, sync_step: bool) -> str | None:
        """Why every rank stops after this step, or None: a signal or --max-time on any rank (agreed a step late, or at
        once on a `sync_step`: trainer/preemption.py), a non-finite streak (trainer/health.py), or a limit."""
        waiting = time.perf_counter()
        stop_reason, flagged = self.stop.agree(sync_step)
        self.step_metrics.sync_wait_s += time.perf_counter() - waiting
        self.heartbeat.stepped(self.progress.step)
        for flagged_step, bad in flagged:
            if self.divergence.record(flagged_step, finite=not bad):
                stop_reason = "diverged"
        if stop_reason is None:
            stop_reason = self.limit_reached()
        return stop_reason

    def log_step(self, loss_sum: torch.Tensor, grad_norm: torch.Tensor, first_step: bool, validate: bool) -> None:
        """A logged step's metrics row (with the val loss when `validate`): to metrics.jsonl, TensorBoard and MLflow,
        status.json and rank 0's console."""
        cfg, step, metrics = self.cfg, self.progress.step, self.step_metrics
        # lr: the next step's (what LambdaLR's get_last_lr gave), so a finished run's last row shows the floor
        row, tokens_per_s = metrics.row(
            step,
            self.progress.tokens_seen,
            loss_sum / cfg.grad_accum_steps,
            grad_norm,
            self.schedule.lr_at(step),
            self.prefetch.take_waited(),
            self.divergence.skipped,
            first_step,
        )
        if self.data.mixture:  # each dataset's tokens and epochs so far
            row["datasets"] = self.data.batches.accounting()
        if validate:  # (a collective under fsdp)
            measured = validation(
                self.model, self.data.val, self.data.text_bytes, cfg, self.device, self.data.weights()
            )
            row = merge_rows(row, measured)
            metrics.throughput.reset()  # its time is not training's
        if self.spikes.is_spike(step, row["loss"]):
            row["loss_spike"] = True
        self.metrics.write(row)
        self.watch.row(row)
        for committed in self.checkpoints.take_committed():  # a background save commits later: seen now
            self.watch.saved(committed)
        self.status("running", step=step, world_size=self.world, attempt=self.attempt, durable=False)
        metrics.step_times.mark(step, time.perf_counter())
        eta_s = metrics.step_times.eta_s(step, cfg.max_steps)
        self.monitor.info("%s", monitor_step_line(step, tokens_per_s))
        if self.rank == 0:
            line = step_line(
                step, cfg.max_steps, row["loss"], row["lr"], row["grad_norm"], tokens_per_s, row["mfu"], eta_s
            )
            log.info("%s", line)
            if "val_loss" in row:
                log.info("%s", eval_line(step, row))

    def periodic_checkpoint(self, step_time_s: float) -> None:
        """Every --checkpoint-every steps (in the background with --async-checkpoint), unless the step's update was
        skipped as not finite: then the newest checkpoint stays the last good one."""
        if self.divergence.streak:
            log.warning("no checkpoint at step %d: its update was skipped (not finite)", self.progress.step)
            return
        self.step_metrics.save_stall_s += self.save(blocking=False)
        self.check_save_budget_once(step_time_s)

    def save(self, blocking: bool) -> float:
        """Collective: every rank writes its share. Returns the seconds this rank was held up."""
        cfg, data_dir, meta = self.cfg, self.data.directory, self.data.meta
        state = {
            **self.train_state.state_dict(),
            "schema": SCHEMA,
            "step": self.progress.step,
            "preset": cfg.preset,
            "model_config": self.mconfig.to_dict(),
            "world_size": self.world,
            "data_snapshot": snapshot_record(data_dir, meta),
            "init_from": self.warm_started,
        }
        if self.data.mixture:  # each dataset's, so that a resume reads the snapshots it trained on
            state["data_snapshots"] = {e.name: snapshot_record(e.directory, meta) for e in self.data.mixture}
        return self.checkpoints.save(
            self.progress.step, self.model, self.optimizer, state, rng_state(), blocking=blocking
        )

    def check_save_budget_once(self, step_time_s: float) -> None:
        """After the first checkpoint of this process: would a preemption's save fit its budget (said by rank 0)?"""
        if not self.budget_checked and self.checkpoints.last_save is not None:
            line, warning = save_budget_report(step_time_s, self.checkpoints.last_save, self.budget_s)
            if self.rank == 0:
                log.info("%s", line)
                if warning:
                    log.warning("%s", warning)
            self.budget_checked = True

    # The end.

    def finish(self, stop_reason: str | None, step_time_s: float) -> ExitCode:
        """Stopping: a blocking save, waited for by every rank, so that the exit code tells the truth; none after a
        divergence (the newest checkpoint stays the last good one) or when there was nothing to do."""
        progress = self.progress
        self.monitor.info("%s", monitor_stop_line(progress.step, stop_reason or "stopped"))
        if stop_reason == "diverged":
            return self.end_diverged()
        if progress.step == self.resumed_at:
            self.status("done", step=progress.step, exit_code=ExitCode.DONE, reason="max-steps", attempt=self.attempt)
            dist.destroy_process_group()
            return ExitCode.DONE
        if self.samples_log:
            self.samples_log.close()
        signalled = stop_reason == "signal"
        if signalled and (limit := self.limit_reached()):  # the run is done, not preempted (exit 0, not 75)
            stop_reason = limit
            log.warning("a signal arrived on the last step (%d): the run is done", progress.step)
        preempted = stop_reason == "signal"
        try:
            self.save(blocking=True)  # committed when it returns (it waited for any earlier background save first)
            dist.barrier()  # every rank's share committed; then rank 0 alone waits for its durable copy, if any
            self.checkpoints.close(wait_for_mirror=not signalled)  # after a signal, no time for the durable copy
            self.check_save_budget_once(step_time_s)
        except Exception as exc:
            log.exception("the final checkpoint of step %d could not be committed", progress.step)
            code = ExitCode.PREEMPTED_UNSAVED if preempted else ExitCode.CRASHED
            self.status(
                "preempted-unsaved" if preempted else "crashed",
                step=progress.step,
                exit_code=code,
                reason=stop_reason,
                error=f"final checkpoint failed: {exc}",
                permanent=getattr(exc, "permanent", False),
                attempt=self.attempt,
            )
            return code
        if preempted:
            log.warning(
                "stopped by %s at step %d: checkpoint committed %.1fs after the signal (budget %.0fs)",
                self.stop.signal.name if self.stop.signal else "a signal on another rank",
                progress.step,
                self.stop.seconds_since(),
                self.budget_s,
            )
        else:
            log.info(
                "training stopped at step %d (%s), %d tokens seen", progress.step, stop_reason, progress.tokens_seen
            )
        code = ExitCode.PREEMPTED if preempted else ExitCode.DONE
        for committed in self.checkpoints.take_committed():  # the final save, and a background one it waited for
            self.watch.saved(committed)
        self.watch.note(progress.step, "stop", f"stopped at step {progress.step} ({stop_reason}), checkpoint committed")
        self.watch.close(timeout_s=2.0 if preempted else 30.0)  # after a signal, the pod's grace period is running
        self.status(
            "preempted" if preempted else "done",
            step=progress.step,
            exit_code=code,
            attempt=self.attempt,
            reason=stop_reason,
            tokens_seen=progress.tokens_seen,
            seconds_to_commit=round(self.stop.seconds_since(), 3) if preempted else None,
        )
        dist.destroy_process_group()
        return code

    def end_diverged(self) -> ExitCode:
        """The non-finite streak passed --max-nonfinite-steps: no checkpoint over the last good one."""
        reason = self.divergence.reason()
        log.error("%s", reason)
        self.status(
            "diverged",
            step=self.divergence.first_bad_step,
            exit_code=ExitCode.DIVERGED,
            reason="diverged",
            error=reason,
            attempt=self.attempt,
        )
        self.watch.note(self.progress.step, "stop", reason)
        self.checkpoints.close(wait_for_mirror=False)
        dist.destroy_process_group()
        return ExitCode.DIVERGED

    def status(self, state: str, durable: bool = True, **details: Any) -> None:
        """Rank 0's status.json (trainer/status.py)."""
        write_status(self.run, self.rank, state, durable, **details)

    # Failures of other ranks (the first two called from the heartbeat thread: trainer/health.py).

    def report_hang(self, silent: list[int], step: int) -> None:
        """Before NCCL's watchdog ends the process at the collective timeout: the lowest rank still answering says
        which stopped (rank 0 may be the silent one)."""
        if self.rank == min(set(range(self.world)) - set(silent)):
            stopped = ", ".join(map(str, silent))
            reason = f"no step completed after step {step}: rank(s) {stopped} stopped answering"
            write_hung_status(self.run, step, silent, reason, self.attempt)

    def end_with_failed_rank(self, failed_rank: int, error: str) -> None:
        """Another rank failed and this one would wait for it in a collective until the timeout. Rank 0 records who
        failed and why (unless it is the one that failed: it says so itself)."""
        log.error(
            "ending this rank: rank %d failed (%s) and the collectives cannot complete without it", failed_rank, error
        )
        self.status(
            "crashed",
            step=self.progress.step,
            exit_code=ExitCode.CRASHED,
            failed_rank=failed_rank,
            error=f"rank {failed_rank} failed: {error}",
            attempt=self.attempt,
        )
        exit_now(ExitCode.CRASHED)

    def report_silent_ranks(self, silent: list[int], step: int, exc: BaseException) -> ExitCode:
        """A collective failed and `silent` stopped answering: say so, in the log and (by the lowest rank still
        answering, as rank 0 may be the silent one) in status.json. A crash: the next start may have its nodes back."""
        reason = (
            f"a collective failed at step {step} ({type(exc).__name__}): rank(s) {', '.join(map(str, silent))} "
            "stopped answering (a stopped or hung process, or a lost node)"
        )
        log.error("%s", reason)
        if self.rank == min(set(range(self.world)) - set(silent)):
            write_hung_status(self.run, step - 1, silent, reason, self.attempt)
        return ExitCode.CRASHED

    def log_plan(self) -> None:
        """Rank 0's plan: the model's size, tokens per step and steps, and a mixture's shares."""
        if self.rank != 0:
            return
        cfg, world, batches = self.cfg, self.world, self.data.batches
        parameters = sum(p.numel() for p in self.model.parameters())  # DTensors under fsdp: their global sizes
        log.info("%s", plan_line(parameters, cfg.tokens_per_step * world, cfg.max_steps, batches.train_tokens))
        if self.data.mixture:
            sequences = cfg.batch_size * cfg.grad_accum_steps * world * cfg.max_steps
            log.info("%s", mixture_plan(batches, sequences))


def durable_copy(cfg: TrainConfig) -> Mirror | None:
    """The S3 copy of every committed checkpoint, when --checkpoint-s3-uri asks for one."""
    if not cfg.checkpoint_s3_uri:
        return None
    from trainer.durable import CheckpointMirror  # boto3: only when asked for

    return CheckpointMirror(cfg.checkpoint_s3_uri)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


# Each rank's log on the volume; the launcher reads it back after a failure (components/launch_training/evidence.py).
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
            return Trainer(cfg, cleanup).train()
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
