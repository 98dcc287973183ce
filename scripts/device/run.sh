#!/usr/bin/env bash
# On the GPU machine, from the repo root (carry .devbundle): one scenario of the benchmarks package whose --out is
# a folder, `python -m benchmarks SCENARIO --out $OUT [ARGS...]`, after the bundle's set-up; the GPU in
# $OUT/gpu.txt, the log in $OUT/SCENARIO[_TAG].log (the servers' batch lines left off the screen).
#   GIT_COMMIT=<hash> bash scripts/device/run.sh step_cost --servers dflash,dspine --clients 1,4,16,64
#   ... run.sh features                # request conformance (tests/test_serving_conformance.py under pytest)
#   ... run.sh pressure [--geometry qwen3-8b | --scenarios soak --soak-seconds 1200 --tag soak1200]
# A run longer than one device call (10 minutes), such as the 20-minute soak, goes in a detached job:
#   GIT_COMMIT=<hash> bash scripts/device/job.sh start soak 'bash scripts/device/run.sh pressure --servers dspine ...'
# Beside another run on the same GPU: its own package layout and ports (DSPINE_SITE=/tmp/dspine-site-soak, and
# the scenario's --port-offset).
set -uo pipefail
scenario="${1:?usage: run.sh SCENARIO [ARGS...] (python -m benchmarks --help lists them)}"; shift
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
c=$(git rev-parse HEAD 2>/dev/null) && export GIT_COMMIT="${GIT_COMMIT:-$c}"
tag=""; prev=""
for a in "$@"; do [ "$prev" = --tag ] && tag="$a"; prev="$a"; done
source scripts/device/setup.sh || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -m benchmarks "$scenario" --out "$OUT" "$@" 2>&1 | tee "$OUT/$scenario${tag:+_$tag}.log" \
  | grep -v "Decode batch\|Prefill batch\|Capturing batches"
exit "${PIPESTATUS[0]}"
