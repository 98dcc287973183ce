#!/usr/bin/env bash
# On the GPU machine, from the repo root (carry .devbundle): DSPINE vs DFLASH per-step cost at a real target's
# geometry (benchmarks/serving_scale.py; extra arguments go to it). Results under $OUT and benchmarks/results/.
set -uo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
source scripts/device/setup.sh || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 benchmarks/serving_scale.py --out "$OUT" "$@" 2>&1 | tee "$OUT/serving_scale.log" \
  | grep -v "Decode batch\|Prefill batch\|Capturing batches"
