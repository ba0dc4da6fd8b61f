#!/usr/bin/env bash
# GPU check of the trainer on one GPU, bf16: GPT-2 124M and Llama 1B, eager and torch.compile, and with asynchronous
# checkpoints; Llama 1B and 3B under FSDP2 with their peak memory against the preflight's estimate. Records tokens/s,
# MFU, the time waiting for input and for syncs, and the checkpoint stall. First, a few steps under CUDA's sync
# debug mode "error" on the steps that must not wait for the device (bench/sync_debug.py).
#
# Made for the device tool's one-GPU machine (an H200: torch, transformers and tokenizers are in its
# image, nothing can be fetched), run from the repository root:
#     bash bench/gpu_check.sh            # results in $OUT/gpu_check.md (or ./gpu_check.md), under 10 minutes
# then append that table, dated, to bench/RESULTS.md (only $OUT comes back from the device machine).
# Settings can be overridden for a quick dry run on a CPU:
#     GPU_CHECK_PRESETS="tiny:8" GPU_CHECK_FSDP_PRESETS="tiny:8" GPU_CHECK_STEPS=20 GPU_CHECK_SEQ_LEN=64 \
#     GPU_CHECK_VOCAB=512 bash bench/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1

presets=${GPU_CHECK_PRESETS:-gpt2-124m:16 llama-1b:8}  # preset:batch
steps=${GPU_CHECK_STEPS:-150}
seq_len=${GPU_CHECK_SEQ_LEN:-1024}
out_dir=${OUT:-.}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# A real corpus: the standard library's own source (not the packages installed beside it), tokenized with a
# GPT-2-sized BPE vocabulary.
python3 - "$work" "${GPU_CHECK_VOCAB:-50304}" <<'PY'
import logging, sys, sysconfig
from components.stage_data.core import stage_data
logging.basicConfig(level=logging.INFO)
stage_data(sysconfig.get_paths()["stdlib"], sys.argv[1], "stdlib", vocab_size=int(sys.argv[2]), val_fraction=0.01,
           include=["*.py"], exclude=["site-packages/*", "dist-packages/*", "__pycache__/*", ".*"])
PY

run() {  # $1: run name, $2: preset, $3: batch, then extra trainer flags
  local name=$1 preset=$2 batch=$3; shift 3
  timeout 300 python3 -m torch.distributed.run --standalone --nnodes=1 --nproc-per-node=1 -m "${entry:-trainer.train_ddp}" \
    --data-dir "$work/datasets/stdlib" --run-dir "$work/runs/$name" --preset "$preset" \
    --batch-size "$batch" --seq-len "$seq_len" --max-steps "$steps" --warmup-steps 50 --lr 6e-4 \
    --log-every 10 --checkpoint-every 100000 "$@"
}
first=${presets%% *}
# No host sync on the steps between logged ones: a sync there raises (eager, so that compiling takes no time).
# With DDP's bf16 compression hook (NCCL only: none in a CPU dry run).
hook=$(python3 -c 'import torch; print("bf16" if torch.cuda.is_available() else "none")')
entry=bench.sync_debug run sync-debug "${first%%:*}" "${first##*:}" --compile off --max-steps 30 --ddp-comm-hook "$hook"
names=()
for preset_batch in $presets; do
  preset=${preset_batch%%:*} batch=${preset_batch##*:}
  run "$preset-eager" "$preset" "$batch" --compile off
  run "$preset-compiled" "$preset" "$batch" --compile on
  # An asynchronous checkpoint every 50 steps: what the background copy and write cost training.
  run "$preset-compiled-async-ckpt" "$preset" "$batch" --compile on --async-checkpoint --checkpoint-every 50
  names+=("$preset-eager" "$preset-compiled" "$preset-compiled-async-ckpt")
done
# FSDP2 on one GPU (trainer/parallel.py): its peak memory against the preflight's estimate (trainer/memory.py).
for preset_batch in ${GPU_CHECK_FSDP_PRESETS:-llama-1b:8 llama-3b:4}; do
  preset=${preset_batch%%:*} batch=${preset_batch##*:}
  run "$preset-fsdp" "$preset" "$batch" --parallelism fsdp --compile on
  names+=("$preset-fsdp")
done

python3 - "$work" "$out_dir/gpu_check.md" "$presets" "$seq_len" "$steps" "${names[@]}" <<'PY'
import json, re, statistics, sys, torch
work, out, presets, seq_len, steps, *names = sys.argv[1:]
device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (dry run)"
lines = [f"GPU check on {device}, torch {torch.__version__}: presets (batch) {presets}, {seq_len}-token sequences, "
         f"bf16 autocast, {steps} steps; medians over the steps after the first third (warm-up and compilation). "
         "30 steps under CUDA's sync debug mode 'error' between logged steps (bench/sync_debug.py), with "
         "--ddp-comm-hook bf16, passed.", "",
         "Mean tokens/s: tokens over wall time across that same span, checkpoint saves included. Input and sync "
         "waits: seconds per step the loop waited for the next batch and for the stop/non-finite flags or a logged "
         "row. Checkpoint stall: the largest a save held training up (the async copy to host memory). Estimate: "
         "the memory per GPU the preflight's gpu-memory check expects (trainer/memory.py), as the trainer logged it.",
         "",
         "| run | tokens/s | mean tokens/s | MFU | step time (s) | input wait (s) | sync wait (s) "
         "| checkpoint stall (s) | peak memory (GB) | estimate (GB) | final loss |",
         "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
for name in names:
    rows = [json.loads(r) for r in open(f"{work}/runs/{name}/metrics.jsonl")]
    steady = [r for r in rows if r["step"] > int(steps) // 3]
    med = lambda k: statistics.median(r[k] for r in steady) if steady and steady[0][k] is not None else float("nan")
    mean = (steady[-1]["tokens"] - steady[0]["tokens"]) / (steady[-1]["time"] - steady[0]["time"])
    stall = max(r["checkpoint_stall_s"] for r in rows)
    logged = re.search(r"memory estimate.*?: ([\d.]+) GB per GPU", open(f"{work}/runs/{name}/logs/rank_00000.log").read())
    peak = max(r["gpu_mem_gib"] or float("nan") for r in rows)
    lines.append(f"| {name} | {med('tokens_per_s'):,.0f} | {mean:,.0f} | {med('mfu'):.1%} | {med('step_time_s'):.4f} | "
                 f"{med('input_wait_s'):.4f} | {med('sync_wait_s'):.4f} | {stall:.3f} | {peak:.1f} | "
                 f"{logged.group(1) if logged else '?'} | {rows[-1]['loss']:.3f} |")
text = "\n".join(lines) + "\n"
open(out, "w").write(text)
print(text)
PY
