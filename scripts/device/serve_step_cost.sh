#!/usr/bin/env bash
# On the GPU machine, from the repo root (carry .devbundle): DFLASH / DFLASH-causal / DSPINE / DSPINE-on-PyTorch
# throughput, tau and verify steps per second side by side on the built-in pair; results in $OUT.
set -uo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
source scripts/device/setup.sh || exit 1
python3 scripts/device/serve_step_cost.py --models "$PWD/models/default" --out "$OUT" "$@" 2>&1 \
  | tee "$OUT/step_cost.log" | grep -v "Decode batch\|Prefill batch\|Capturing batches"
