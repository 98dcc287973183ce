#!/usr/bin/env bash
# On the GPU machine, from the repo root (carry .devbundle): every test marked `gpu` (the CPU suite skips them), or
# those of the test files given (`bash scripts/device/gpu_tests.sh tests/test_verify_shapes.py`), run from /tmp
# against the package as installed (scripts/device/setup.sh). Log: $OUT/gpu_tests.log.
# Not the request-conformance tests (tests/test_serving_conformance.py): they start three servers for minutes, and
# `scripts/device/run.sh features` runs them (the version matrix's `features` step).
set -uo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
source scripts/device/setup.sh || exit 1
REPO="$PWD"
files=$(if [ "$#" -gt 0 ]; then printf '%s\n' "$@"; else grep -l "mark.gpu" tests/*.py; fi |
  grep -vx "tests/test_serving_conformance.py" | sed "s|^|$REPO/|")
cd /tmp && python3 -m pytest $files -m gpu -q -p no:cacheprovider -rfE 2>&1 | tee "$OUT/gpu_tests.log"
exit "${PIPESTATUS[0]}"
