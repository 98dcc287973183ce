#!/usr/bin/env bash
# On the H200, from the repo root: the kernels' tests on the GPU (all of tests/test_kernels.py, the `gpu`
# ones at Qwen3-8B shapes included), then benchmarks/kernels.py (the server's draft step, DFlash's and the
# kernels). No SGLang needed: torch + triton only (sglang_dspine.serving.draft_step imports no SGLang).
# Results: benchmarks/results/kernels{,_summary}.json, and under $OUT: the JSON, tests.log, bench.log, gpu.txt.
# KERNELS_DEADLINE_S (default 540, inside one 10-minute device command): seconds for the whole script; the
# benchmark skips what does not fit (kernel sections, the launch-configuration sweep). Extra arguments go to
# benchmarks/kernels.py.
set -uo pipefail
T0=$(date +%s)
REPO="$PWD"
OUT="${OUT:-$REPO/benchmarks/results/kernels_device}"
mkdir -p "$OUT" "$REPO/benchmarks/results"
export PYTHONUNBUFFERED=1
# The package as installed (kernels/ -> sglang_dspine/kernels); Python runs from /tmp, never the repo root
# (sglang_dspine/source_files.py says why).
SITE=/tmp/dspine-kernels-site
rm -rf "$SITE" && mkdir -p "$SITE"
cp -r "$REPO/sglang_dspine" "$SITE/" && cp -r "$REPO/kernels" "$SITE/sglang_dspine/kernels"
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
c=$(git -C "$REPO" rev-parse HEAD 2>/dev/null) && export GIT_COMMIT="${GIT_COMMIT:-$c}"  # the package runs from $SITE
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv | tee "$OUT/gpu.txt"
cd /tmp
XDIST=""
python3 -c "import xdist" 2>/dev/null && XDIST="-n 6"
timeout 150 python3 -m pytest "$REPO/tests/test_kernels.py" $XDIST -q -p no:cacheprovider -rfE 2>&1 | tee "$OUT/tests.log"
TEST_RC=${PIPESTATUS[0]}
LEFT=$(( ${KERNELS_DEADLINE_S:-540} - ($(date +%s) - T0) ))
python3 "$REPO/benchmarks/kernels.py" --out "$REPO/benchmarks/results" --copy-to "$OUT" --budget "$LEFT" "$@" 2>&1 \
  | tee "$OUT/bench.log"
BENCH_RC=${PIPESTATUS[0]}
echo "kernels.sh: gpu tests rc=$TEST_RC, benchmark rc=$BENCH_RC, $(( $(date +%s) - T0 )) s"
exit $(( TEST_RC != 0 || BENCH_RC != 0 ))
