#!/usr/bin/env bash
# GPU check of the trainer: GPT-2 124M, bf16, one GPU, eager and torch.compile; records tokens/s and MFU.
#
# Made for the device tool's one-GPU machine (an H200: torch, transformers and tokenizers are in its
# image, nothing can be fetched), run from the repository root:
#     bash bench/gpu_check.sh            # results in $OUT/gpu_check.md (or ./gpu_check.md), under 8 minutes
# then append that table, dated, to bench/RESULTS.md (only $OUT comes back from the device machine).
# Settings can be overridden for a quick dry run on a CPU: GPU_CHECK_PRESET=tiny GPU_CHECK_STEPS=20 ...
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1

preset=${GPU_CHECK_PRESET:-gpt2-124m}
steps=${GPU_CHECK_STEPS:-300}
batch=${GPU_CHECK_BATCH:-16}
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

run() {  # $1: run name, then extra trainer flags
  local name=$1; shift
  timeout 240 python3 -m torch.distributed.run --standalone --nnodes=1 --nproc-per-node=1 -m trainer.train_ddp \
    --data-dir "$work/datasets/stdlib/tokenized" --run-dir "$work/runs/$name" --preset "$preset" \
    --batch-size "$batch" --seq-len "$seq_len" --max-steps "$steps" --warmup-steps 50 --lr 6e-4 \
    --log-every 10 --checkpoint-every 100000 "$@"
}
run eager
run compiled --compile
# The same with an asynchronous checkpoint every 50 steps: what the background copy and write cost training.
run compiled-async-ckpt --compile --async-checkpoint --checkpoint-every 50

python3 - "$work" "$out_dir/gpu_check.md" "$preset" "$batch" "$seq_len" "$steps" <<'PY'
import json, statistics, sys, torch
work, out, preset, batch, seq_len, steps = sys.argv[1:]
device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (dry run)"
lines = [f"GPU check on {device}, torch {torch.__version__}: preset {preset}, batch {batch} x {seq_len} tokens, "
         f"bf16 autocast, {steps} steps; medians over the steps after the first third (warm-up and compilation).", "",
         "Mean tokens/s: tokens over wall time across that same span, checkpoint saves included.", "",
         "| run | tokens/s | mean tokens/s | MFU | step time (s) | peak memory (GB) | final loss |",
         "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
for name in ("eager", "compiled", "compiled-async-ckpt"):
    rows = [json.loads(r) for r in open(f"{work}/runs/{name}/metrics.jsonl")]
    steady = [r for r in rows if r["step"] > int(steps) // 3]
    med = lambda k: statistics.median(r[k] for r in steady) if steady and steady[0][k] is not None else float("nan")
    mean = (steady[-1]["tokens"] - steady[0]["tokens"]) / (steady[-1]["time"] - steady[0]["time"])
    lines.append(f"| {name} | {med('tokens_per_s'):,.0f} | {mean:,.0f} | {med('mfu'):.1%} | {med('step_time_s'):.4f} | "
                 f"{med('gpu_mem_gb'):.1f} | {rows[-1]['loss']:.3f} |")
text = "\n".join(lines) + "\n"
open(out, "w").write(text)
print(text)
PY
