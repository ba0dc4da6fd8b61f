"""GPU check of the trainer: one run of at most 8 minutes on the device tool's machine (one H200, a 64 GiB disk, 600 s
a command), every figure written to $OUT as it is measured.

    bash bench/gpu_check.sh            # on the GPU machine; results in $OUT/gpu_check.md, failed runs' logs beside
    bash bench/gpu_check.sh --dry-run  # on a CPU: the same cases at tiny sizes; checks the real plan's budgets

Cases (trainer/train_ddp.py under torchrun, one GPU, bf16, a real corpus: the standard library's source):
    sync-debug     gpt2-124m under fsdp, eager, CUDA's sync debug mode "error" between sync steps (bench/sync_debug.py)
    gpt2-ddp       gpt2-124m under ddp, compiled: tokens/s and MFU
    llama1b-*      llama-1b under fsdp, compiled and eager (the eager loss's memory), gradient accumulation 1 and 2
    async-ckpt     gpt2-124m under ddp, compiled, an asynchronous checkpoint every 25 steps: the stall
    8b-geometry    Llama 3.1 8B's shapes with 4 blocks, 1 x 8,192 tokens, selective (bench/estimate_probe.py): the
                   memory estimate's constants at the target shape
    eval-gpu       the evaluation step on llama-1b's fp32 checkpoint, in bf16 on the GPU, with three benchmarks of 50
                   items each and the export (bench/eval_probe.py): its time and peak memory beside the bf16 model
    published-fsdp a published Llama (save_pretrained in bf16, several shards, Llama 3's rope scaling) started from
                   with --init-from-model under fsdp, eager: the CUDA side of loading it (bf16 on disk into fp32
                   DTensors on the GPU), then training it
Each row: tokens/s, MFU, step time, peak allocated and reserved GiB beside the estimate, graph breaks and
recompiles (counted in TORCH_LOGS' lines), the last loss, and how the case ended. A failed case never stops the
others; its logs are copied to $OUT/failed/<case>/. All compiled cases share one inductor cache, each run directory
is deleted after its row is written (only the final checkpoint is ever kept), and before anything runs the plan's
disk need at the real sizes is computed from the presets (12 bytes a parameter a checkpoint, at most two at once)
and checked against `df`; the dry run fails if the real plan would need more than 50 GiB.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
GIB = 2**30
DEADLINE_S = 480  # 8 minutes of the device tool's 600 s a command: the rest for the machine's start-up and copies
DISK_LIMIT = 50 * GIB  # of the 64 GiB disk: the image, the repository and the corpus take the rest
REAL_VOCAB = 50304  # the staged corpus's vocabulary asked for (GPT-2's, padded)


@dataclass
class Case:
    name: str
    preset: str
    batch: int
    steps: int
    flags: list[str] = field(default_factory=list)
    entry: str = "trainer.train_ddp"
    timeout_s: int = 120
    checkpoints: int = 1  # checkpoints on disk at once at most (1: the final one; 2: periodic, keep 1)
    published: bool = False  # started from the published model save_published writes (its architecture: no preset)


def plan(dry_run: bool) -> tuple[list[Case], int, int]:
    """The cases, the sequence length and the corpus vocabulary: the real ones, or tiny ones for a CPU."""
    big = not dry_run
    gpt2, llama = ("gpt2-124m", "llama-1b") if big else ("tiny", "tiny")
    steps = 60 if big else 8
    compiled = ["--compile", "on"] if big else ["--compile", "off"]  # compiling on 2 CPU cores takes minutes
    cases = [
        Case(
            "sync-debug",
            gpt2,
            16 if big else 4,
            30 if big else 6,
            ["--parallelism", "fsdp", "--compile", "off"],
            entry="bench.sync_debug",
            timeout_s=40,
        ),
        Case("gpt2-ddp", gpt2, 16 if big else 4, steps, compiled, timeout_s=75),
        Case("llama1b-fsdp-compiled", llama, 4, steps, ["--parallelism", "fsdp", *compiled], timeout_s=85),
        Case(
            "llama1b-fsdp-compiled-accum2",
            llama,
            4,
            steps // 2,
            ["--parallelism", "fsdp", "--grad-accum-steps", "2", *compiled],
            timeout_s=45,
        ),
        Case("llama1b-fsdp-eager", llama, 4, steps // 2, ["--parallelism", "fsdp", "--compile", "off"], timeout_s=35),
        Case(
            "llama1b-fsdp-eager-accum2",
            llama,
            4,
            steps // 4,
            ["--parallelism", "fsdp", "--grad-accum-steps", "2", "--compile", "off"],
            timeout_s=40,
        ),
        Case(
            "async-ckpt",
            gpt2,
            16 if big else 4,
            steps,
            [*compiled, "--async-checkpoint", "--checkpoint-every", str(steps // 3 or 1)],
            timeout_s=45,
            checkpoints=2,
        ),
        Case("8b-geometry", "llama-8b", 1, 3, entry="bench.estimate_probe", timeout_s=50, checkpoints=0),
        Case("eval-gpu", llama, 8, 0, entry="bench.eval_probe", timeout_s=35),
        Case(
            "published-fsdp",
            "",
            4,
            steps // 4,
            ["--parallelism", "fsdp", "--compile", "off"],
            timeout_s=30,
            published=True,
        ),
    ]
    return cases, 1024 if big else 64, REAL_VOCAB if big else 512


def checkpoint_bytes(preset: str, vocab: int) -> int:
    """A checkpoint of `preset` ("": the published model): fp32 weights and AdamW's two moments, 12 bytes a
    parameter (shapes only)."""
    from trainer.memory import model_shape
    from trainer.model import model_config

    config = published_config(vocab, big=True) if not preset else model_config(preset, vocab, 1024, eos_token_id=0)
    return 12 * model_shape(config).parameters


def published_config(vocab: int, big: bool) -> Any:
    """A small Llama as teams publish theirs: untied, Llama 3's rope scaling, in bf16."""
    from transformers import LlamaConfig

    rope = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256,
    }
    return LlamaConfig(
        num_hidden_layers=4 if big else 2,
        hidden_size=512 if big else 64,
        intermediate_size=1536 if big else 128,
        num_attention_heads=8 if big else 4,
        num_key_value_heads=4 if big else 2,
        vocab_size=vocab,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        rope_scaling=rope,
        dtype="bfloat16",
    )


def save_published(work: Path, vocab: int, big: bool) -> Path:
    """The published model the published case starts from, written by transformers (random weights, several
    shards). No tokenizer beside it: the run's snapshot is the stdlib's, of a vocabulary no larger than its rows."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    directory = work / "published"
    LlamaForCausalLM(published_config(vocab, big)).to(torch.bfloat16).save_pretrained(directory, max_shard_size="50MB")
    return directory


def budgets(cases: list[Case], vocab: int) -> tuple[int, int]:
    """(disk bytes, seconds): the most any one case holds at once (its checkpoints, the corpus and the shared
    inductor cache beside it), and the sum of the cases' timeouts."""
    corpus, inductor_cache = 1 * GIB, 4 * GIB  # the stdlib's tokens and their staging; compiled kernels
    disk = max(case.checkpoints * checkpoint_bytes(case.preset, vocab) for case in cases) + corpus + inductor_cache
    return disk, sum(case.timeout_s for case in cases)


def stage(work: Path, vocab: int) -> Path:
    """A real corpus: the standard library's own source (not the packages installed beside it)."""
    import sysconfig

    from components.stage_data.core import stage_data
    from trainer.layout import DatasetPaths

    stage_data(
        sysconfig.get_paths()["stdlib"],
        str(work),
        "stdlib",
        vocab_size=vocab,
        val_fraction=0.01,
        include=["*.py"],
        exclude=["site-packages/*", "dist-packages/*", "__pycache__/*", ".*"],
    )
    return DatasetPaths.of(work, "stdlib").current_snapshot()


def run_case(case: Case, data_dir: Path, work: Path, seq_len: int, dry_run: bool) -> tuple[str, Path, str]:
    """(how it ended, its run directory, its output)."""
    run_dir = work / "runs" / case.name
    if case.entry == "bench.estimate_probe":
        sizes = ["4", "1", "8192", "selective"] if not dry_run else ["2", "1", "64", "selective", "512", "128", "256"]
        args = ["-m", case.entry, *sizes]
    elif case.entry == "bench.eval_probe":
        args = ["-m", case.entry, str(data_dir), str(run_dir), case.preset, "4" if dry_run else "50"]
    else:
        model = ["--init-from-model", str(work / "published")] if case.published else ["--preset", case.preset]
        args = [
            "-m",
            case.entry,
            "--data-dir",
            str(data_dir),
            "--run-dir",
            str(run_dir),
            *model,
            "--batch-size",
            str(case.batch),
            "--seq-len",
            str(seq_len),
            "--max-steps",
            str(case.steps),
            "--warmup-steps",
            "10",
            "--lr",
            "6e-4",
            "--log-every",
            "5",
            "--checkpoint-every",
            "100000",
            "--keep-checkpoints",
            "1",
            *case.flags,
        ]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1", "--nproc-per-node=1", *args]
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "PYTHONUNBUFFERED": "1",
        "TORCH_LOGS": "graph_breaks,recompiles",
        "TORCHINDUCTOR_CACHE_DIR": str(work / "inductor"),
    }
    try:
        done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=case.timeout_s)
    except subprocess.TimeoutExpired as exc:
        output = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
        return f"timed out after {case.timeout_s}s", run_dir, output
    return ("ok" if done.returncode == 0 else f"exit {done.returncode}"), run_dir, done.stdout + done.stderr


def row(case: Case, ended: str, run_dir: Path, output: str) -> str:
    """The case's table row, from its metrics.jsonl and log (or the probe's JSON line)."""
    breaks = len(re.findall(r"Graph break", output))
    recompiles = len(re.findall(r"Recompiling function", output))
    if case.entry == "bench.eval_probe":
        probe = next((json.loads(line) for line in output.splitlines() if line.startswith("{")), None)
        if probe is None:
            return f"| {case.name} | | | | | | | {breaks} | {recompiles} | | {ended} |"
        gib = lambda v: "—" if v is None else f"{v:.1f}"  # noqa: E731
        return (
            f"| {case.name} | | | {probe['seconds']:.1f} (whole step) | {gib(probe['allocated_gib'])} | "
            f"{gib(probe['reserved_gib'])} | {probe['bf16_model_gib']:.1f} (bf16 model) | {breaks} | {recompiles} | "
            f"{probe['val_loss']:.3f} | {ended}; {json.dumps(probe['benchmarks'])} |"
        )
    if case.entry == "bench.estimate_probe":
        probe = next((json.loads(line) for line in output.splitlines() if line.startswith("{")), None)
        if probe is None:
            return f"| {case.name} | | | | | | | {breaks} | {recompiles} | | {ended} |"
        fmt = lambda v: "—" if v is None else f"{v:.1f}"  # noqa: E731
        return (
            f"| {case.name} | | | | {fmt(probe['allocated_gib'])} | {fmt(probe['reserved_gib'])} | "
            f"{probe['estimate_allocated_gib']:.1f} / {probe['estimate_gib']:.1f} | {breaks} | {recompiles} | "
            f"{probe['loss']:.3f} | {ended} |"
        )
    metrics = run_dir / "metrics.jsonl"
    rows = [json.loads(r) for r in metrics.read_text().splitlines()] if metrics.exists() else []
    steady = [r for r in rows if r["step"] > case.steps // 3] or rows[-1:]

    def median(key: str) -> float | None:
        values = [r[key] for r in steady if r.get(key) is not None]
        return statistics.median(values) if values else None

    def shown(value: float | None, spec: str) -> str:
        return "—" if value is None else format(value, spec)

    log = run_dir / "logs" / "rank_00000.log"
    estimate = re.search(r"memory estimate.*?: ([\d.]+) GiB per GPU", log.read_text()) if log.exists() else None
    peak = max((r["gpu_mem_gib"] for r in rows if r.get("gpu_mem_gib") is not None), default=None)
    reserved = max((r["gpu_reserved_gib"] for r in rows if r.get("gpu_reserved_gib") is not None), default=None)
    stall = max((r["checkpoint_stall_s"] for r in rows), default=None)
    stalled = f", checkpoint stall {stall:.3f}s" if case.checkpoints == 2 and stall is not None else ""
    return (
        f"| {case.name} | {shown(median('tokens_per_s'), ',.0f')} | {shown(median('mfu'), '.1%')} | "
        f"{shown(median('step_time_s'), '.4f')} | {shown(peak, '.1f')} | {shown(reserved, '.1f')} | "
        f"{estimate.group(1) if estimate else '—'} | {breaks} | {recompiles} | "
        f"{shown(rows[-1]['loss'] if rows else None, '.3f')} | {ended}{stalled} |"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes on a CPU; the real plan's budgets checked")
    dry_run = parser.parse_args().dry_run
    sys.path.insert(0, str(REPO))
    import torch

    out = Path(os.environ.get("OUT") or REPO / "gpu_check_out")
    out.mkdir(parents=True, exist_ok=True)
    real_cases, _, real_vocab = plan(dry_run=False)
    disk, seconds = budgets(real_cases, real_vocab)
    say = [
        f"budget of the real plan: {len(real_cases)} cases, at most {disk / GIB:.1f} GiB of disk at once (limit "
        f"{DISK_LIMIT / GIB:.0f} GiB), timeouts summing to {seconds} s (at most {DEADLINE_S} s)"
    ]
    print(say[0], flush=True)
    if disk > DISK_LIMIT or seconds > DEADLINE_S:
        print(
            f"gpu_check: the plan does not fit: {disk / GIB:.1f} GiB of disk (at most {DISK_LIMIT / GIB:.0f}), "
            f"{seconds} s of timeouts (at most {DEADLINE_S})",
            file=sys.stderr,
        )
        return 1
    cases, seq_len, vocab = plan(dry_run)
    work = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    free = shutil.disk_usage(work).free
    if not dry_run and free < disk:
        print(f"gpu_check: {free / GIB:.1f} GiB free under {work}, the plan needs {disk / GIB:.1f}", file=sys.stderr)
        return 1
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (dry run)"
    report = out / "gpu_check.md"
    report.write_text(
        f"GPU check on {device}, torch {torch.__version__}, {seq_len}-token sequences (the 8B-geometry probe: 8,192), "
        f"bf16; medians over the logged rows after the first third of each run. {say[0]}; {free / GIB:.0f} GiB free."
        "\n\n| case | tokens/s | MFU | step time (s) | peak allocated (GiB) | peak reserved (GiB) | estimate (GiB) "
        "| graph breaks | recompiles | last loss | ended |\n| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
        "| ---: | ---: | --- |\n"
    )
    started, failures = time.monotonic(), 0
    try:
        data_dir = stage(work, vocab)
        save_published(work, vocab, big=not dry_run)
        for case in cases:
            if time.monotonic() - started + case.timeout_s > DEADLINE_S + 60:  # staging took more than its minute
                line = f"| {case.name} | | | | | | | | | | skipped: not enough time left |"
            else:
                ended, run_dir, output = run_case(case, data_dir, work, seq_len, dry_run)
                line = row(case, ended, run_dir, output)
                if ended != "ok":
                    failures += 1
                    kept = out / "failed" / case.name
                    kept.mkdir(parents=True, exist_ok=True)
                    (kept / "output.txt").write_text(output[-200_000:])
                    if (run_dir / "logs").exists():
                        shutil.copytree(run_dir / "logs", kept / "logs", dirs_exist_ok=True)
                shutil.rmtree(run_dir, ignore_errors=True)  # its checkpoint: the next case has the disk
            with report.open("a") as f:
                f.write(line + "\n")
            print(line, flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"{time.monotonic() - started:.0f} s; {failures} case(s) failed; {report}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
