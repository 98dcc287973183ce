#!/usr/bin/env bash
# On the GPU machine, from the repo root (carry .devbundle): one of the serving measurements on the built-in
# pair (models/default), results in $OUT. Extra arguments go to the scenario.
#   bash scripts/device/serve.sh e2e          # python -m benchmarks e2e: end-to-end serving evidence (one GPU)
#   bash scripts/device/serve.sh step_cost    # python -m benchmarks step_cost_pair: DFLASH vs DSPINE tokens/s, tau
set -uo pipefail
WHAT="${1:?usage: serve.sh e2e|step_cost [args]}"; shift
case "$WHAT" in e2e) scenario=e2e ;; step_cost) scenario=step_cost_pair ;;
  *) echo "serve.sh: no measurement $WHAT (e2e, step_cost)" >&2; exit 2 ;; esac
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
source scripts/device/setup.sh || exit 1
python3 -m benchmarks "$scenario" --models "$PWD/models/default" --out "$OUT" "$@" 2>&1 \
  | tee "$OUT/$WHAT.log" | grep -v "Decode batch\|Prefill batch\|Capturing batches"
