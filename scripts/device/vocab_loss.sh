#!/usr/bin/env bash
# On the GPU machine, from the repo root (carry .devbundle): tests/test_vocab_loss.py on the GPU (the `gpu` test
# at Qwen3-8B's shape included: it prints the error of writing dz in bf16), then `python -m benchmarks vocab_loss`: the
# objective's vocabulary-sized work, fwd+bwd under checkpoint, the former float32 code against the kernel, at one
# chunk (1920 rows × 151936, hidden 4096, bf16). Writes $OUT/vocab_loss.json, $OUT/tests.log, $OUT/bench.log.
#   GIT_COMMIT=<hash> bash scripts/device/vocab_loss.sh [benchmark args]
set -uo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
source scripts/device/setup.sh || exit 1
REPO="$PWD"
c=$(git -C "$REPO" rev-parse HEAD 2>/dev/null) && export GIT_COMMIT="${GIT_COMMIT:-$c}"  # the package runs from a copy
cd /tmp || exit 1  # the tests never from the repo root: its kernels/ would shadow the `kernels` package
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
timeout 300 python3 -m pytest "$REPO/tests/test_vocab_loss.py" -q -s -p no:cacheprovider -rfE -W ignore::DeprecationWarning \
  2>&1 | tee "$OUT/tests.log"
TEST_RC=${PIPESTATUS[0]}
(cd "$REPO" && python3 -m benchmarks vocab_loss --out "$OUT/vocab_loss.json" "$@") 2>&1 | tee "$OUT/bench.log"
BENCH_RC=${PIPESTATUS[0]}
echo "vocab_loss.sh: tests rc=$TEST_RC, benchmark rc=$BENCH_RC"
exit $(( TEST_RC != 0 || BENCH_RC != 0 ))
