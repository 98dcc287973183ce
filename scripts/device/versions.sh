#!/usr/bin/env bash
# On the GPU machine, from the repo root: one SGLang release × backend pair of the version matrix
# (benchmarks/serving_versions.py reads what this writes). DEVICE_SGLANG picks the release (0.5.17: the
# .devbundle, carried; 0.5.23: the site `source scripts/device/bundle_0523.sh setup` left in this lease).
#   DEVICE_SGLANG=0.5.23 bash scripts/device/versions.sh ATTENTION/SAMPLING [STEP ...]
# ATTENTION/SAMPLING: e.g. triton/pytorch, or sglang-default/sglang-default (the flags left out, as a user who
# passes none). STEPs, in order (default: all three, in this order):
#   tests     every `gpu`-marked test (scripts/device/gpu_tests.sh)
#   features  request conformance: no speculation / DFLASH / DSPINE, 60 s of mixed load (serving_features.py)
#   scale     per-step cost at Qwen3-8B geometry, each server alone (DFLASH, DSPINE, then DFlash2 on 0.5.23 without this plugin), 1/4/16/48
#             clients, T=0 (serving_scale.py --alone-only; a server alone gets 420 s to start). DFlash2 needs
#             FlashInfer's top-k prebuilt in the bundle (bundle_0523.sh aot): its JIT build outlasts a lease.
#             At f528899 the three servers' scale step took about 8 minutes, the setup before it 2
#   e2e       (asked for by name only) serve_e2e.py on the built-in pair (scripts/device/serve.sh e2e) with the
#             pair's backends, no deterministic-inference servers:
#             greedy agreement, the T=1 two-sample test against the server without speculation, a 48-client load
#   adaptive  (asked for by name only) adaptive verification on the built-in pair (scripts/device/adaptive.py, on the
#             harness's triton/pytorch backends whatever ATTENTION/SAMPLING say): plain, fixed DSPINE and adaptive at
#             1 / 16 / 48 clients (T=1 at 48), then switching: greedy answers against plain and the T=1 two-sample
#             test while the load varies, and a 1 -> 64 -> 1 ramp (~12 min; on 0.5.23 new in 97513c7)
#   backends  (asked for by name only) issue 57's 5(b) on SGLang's own attention backends: at Qwen3-8B geometry, plain
#             and adaptive DSPINE (its step table per shape) on FA3 and on FlashInfer, each alone, 1 / 4 / 16 / 48 /
#             64 clients (adaptive.py --phases geometry; ~10 min; whatever ATTENTION/SAMPLING say: the backend is
#             the server's name's). 0.5.23's pieces carry both backends; 0.5.17 needs FA3 carried (fa3_0517.sh)
# A failed serving step (scale, features, e2e: a server that did not start, or a failed run) ends the run there: the
# steps after it would start the same servers again (at 064fd69 every server failed the same way, for 10 minutes).
# Results: $OUT/<release>_<attention>_<sampling>/{tests,scale,features,e2e,adaptive}/.
set -uo pipefail
pair="${1:?versions.sh ATTENTION/SAMPLING [STEP ...]}"; shift
attention="${pair%/*}" sampling="${pair#*/}"
[ -n "$attention" ] && [ -n "$sampling" ] && [ "$pair" != "$attention" ] \
  || { echo "versions.sh: want ATTENTION/SAMPLING, got '$pair'" >&2; exit 2; }
release="${DEVICE_SGLANG:-0.5.17}"
case "$release" in 0.5.17|0.5.23) ;; *) echo "versions.sh: DEVICE_SGLANG=$release: 0.5.17 or 0.5.23" >&2; exit 2 ;; esac
steps="${*:-tests features scale}"
root="${OUT:-/tmp/out}/${release}_${attention}_${sampling}"
servers="dflash,dspine"
[ "$release" = 0.5.23 ] && servers="dflash,dspine,dflash2"
for step in $steps; do
  case "$step" in tests|scale|features|e2e|adaptive|backends) ;;
    *) echo "versions.sh: unknown step $step (tests, scale, features, e2e, adaptive, backends)" >&2; exit 2 ;; esac
done
# 0.5.17's .devbundle leaves FA3 out (1.07 GB), SGLang's default attention on an H200: carried apart first
if [ "$release" = 0.5.17 ] && { [ "$attention" = sglang-default ] || [ "$attention" = fa3 ] \
     || [[ " $steps " == *" backends "* ]]; } \
   && [ "$steps" != tests ] && [ ! -f "${SGLANG_SITE:-/tmp/site}/sgl_kernel/flash_ops.abi3.so" ]; then
  echo "versions.sh: 0.5.17 with $attention attention (or the backends step) needs FA3, which the .devbundle" \
    "leaves out: carry .carry-store/fa3-0517 and run scripts/device/fa3_0517.sh setup first (its header says how)" >&2
  exit 2
fi
mkdir -p "$root"
rc=0
for step in $steps; do
  t0=$(date +%s)
  case "$step" in
    tests) OUT="$root/tests" bash scripts/device/gpu_tests.sh ;;
    scale) OUT="$root/scale" bash scripts/device/run.sh step_cost --servers "$servers" --alone-only \
             --clients 1,4,16,48 --temperatures 0 --start-timeout 420 --attention-backend "$attention" --sampling-backend "$sampling" ;;
    features) OUT="$root/features" bash scripts/device/run.sh features --load-seconds 60 \
                --attention-backend "$attention" --sampling-backend "$sampling" ;;
    e2e) OUT="$root/e2e" bash scripts/device/serve.sh e2e --no-deterministic \
           --attention-backend "$attention" --sampling-backend "$sampling" ;;
    adaptive) mkdir -p "$root/adaptive" && python3 scripts/device/adaptive.py --out "$root/adaptive" \
                --phases pair,switching --pair-servers plain,dspine,dspine_adaptive --clients 1,16,48 \
                --t1-clients 48 --switching-server dspine_adaptive ;;
    backends) mkdir -p "$root/backends" && python3 scripts/device/adaptive.py --out "$root/backends" \
                --phases geometry --geometry-servers \
                plain_fa3,dspine_adaptive_fa3,plain_flashinfer,dspine_adaptive_flashinfer --clients 1,4,16,48,64 ;;
  esac
  r=$?
  echo "versions.sh: $release $pair $step rc $r in $(( $(date +%s) - t0 )) s" | tee -a "$root/steps.txt"
  [ "$r" = 0 ] || rc=1
  if [ "$r" != 0 ] && [ "$step" != tests ]; then
    echo "versions.sh: $release $pair: stopped after the failed $step step" | tee -a "$root/steps.txt"
    break
  fi
done
exit "$rc"
