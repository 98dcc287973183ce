#!/usr/bin/env bash
# On the GPU machine, from the repo root (carry .devbundle): request conformance of SGLang servers without
# speculation, with DFLASH and with DSPINE on the built-in pair (benchmarks/serving_features.py; extra arguments
# go to it). The checks are pytest tests marked `gpu`, one per server and check (tests/test_serving_conformance.py,
# which serving_features.py runs under pytest with its arguments: each reported PASSED or FAILED with its evidence);
# exit status 1 only when a server did not start or the tests did not run (failed checks are results).
# Results under $OUT: serving_features.json, serving_features_summary.json, serving_features_tests.xml (JUnit),
# the servers' logs.
set -uo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
source scripts/device/setup.sh || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 benchmarks/serving_features.py --out "$OUT" "$@" 2>&1 | tee "$OUT/serving_features.log" \
  | grep -v "Decode batch\|Prefill batch\|Capturing batches"
