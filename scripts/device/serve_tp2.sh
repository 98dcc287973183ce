#!/usr/bin/env bash
# On the two-GPU machine (nvidia-h200-x2), from the repo root (carry .devbundle): DSPINE at --tp-size 2 vs 1
# on the built-in pair (models/default), results in $OUT. Extra arguments go to serve_tp2.py
# (e.g. --deterministic).
set -uo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
source scripts/device/setup.sh || exit 1
python3 scripts/device/serve_tp2.py --models "$PWD/models/default" --out "$OUT" "$@" 2>&1 \
  | tee "$OUT/tp2.log" | grep -v "Decode batch\|Prefill batch\|Capturing batches"
