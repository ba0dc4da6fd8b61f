#!/usr/bin/env bash
# GPU check of the trainer: one run of at most 8 minutes on one GPU, rows written to $OUT as they are measured
# (bench/gpu_check.py says what it runs and why). Append $OUT/gpu_check.md, dated, to bench/RESULTS.md.
#     bash bench/gpu_check.sh            # on the GPU machine
#     bash bench/gpu_check.sh --dry-run  # on a CPU: tiny sizes; the real plan's disk and time budgets checked
set -uo pipefail
cd "$(dirname "$0")/.."
exec python3 bench/gpu_check.py "$@"
