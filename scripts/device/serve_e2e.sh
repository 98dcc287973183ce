#!/usr/bin/env bash
# On the GPU machine, from the repo root (carry .devbundle): DSPINE end to end on the built-in pair
# (models/default), results in $OUT. Extra arguments go to serve_e2e.py (e.g. --load-seconds 180).
set -uo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
source scripts/device/setup.sh || exit 1
python3 scripts/device/serve_e2e.py --models "$PWD/models/default" --out "$OUT" "$@" 2>&1 \
  | tee "$OUT/e2e.log" | grep -v "Decode batch\|Prefill batch\|Capturing batches"
