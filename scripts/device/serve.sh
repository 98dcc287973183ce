#!/usr/bin/env bash
# On the GPU machine, from the repo root (carry .devbundle): one of the serving measurements on the built-in
# pair (models/default), results in $OUT. Extra arguments go to the script.
#   bash scripts/device/serve.sh e2e          # serve_e2e.py: end-to-end serving evidence (one GPU)
#   bash scripts/device/serve.sh step_cost    # serve_step_cost.py: DFLASH vs DSPINE throughput and tau (one GPU)
set -uo pipefail
WHAT="${1:?usage: serve.sh e2e|step_cost [args]}"; shift
[ -f "scripts/device/serve_$WHAT.py" ] || { echo "serve.sh: no scripts/device/serve_$WHAT.py" >&2; exit 2; }
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
source scripts/device/setup.sh || exit 1
python3 "scripts/device/serve_$WHAT.py" --models "$PWD/models/default" --out "$OUT" "$@" 2>&1 \
  | tee "$OUT/$WHAT.log" | grep -v "Decode batch\|Prefill batch\|Capturing batches"
