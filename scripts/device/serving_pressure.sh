#!/usr/bin/env bash
# On the GPU machine, from the repo root (carry .devbundle): SGLang servers without speculation, with DFLASH and
# with DSPINE on the built-in pair under pressure: KV-pool exhaustion and retraction, batches above the captured
# graphs, long and near-context prompts, shared prefixes, disconnects, and with --soak-seconds a soak
# (benchmarks/serving_pressure.py; extra arguments go to it). Results under $OUT: serving_pressure.json,
# serving_pressure_summary.json, the servers' logs.
set -uo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
source scripts/device/setup.sh || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 benchmarks/serving_pressure.py --out "$OUT" "$@" 2>&1 | tee "$OUT/serving_pressure.log" \
  | grep -v "Decode batch\|Prefill batch\|Capturing batches"
