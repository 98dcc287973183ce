#!/usr/bin/env bash
# On the GPU machine, from the repo root (carry .devbundle): what a drafter training step costs, DFlash vs DSpine
# (benchmarks/train_step.py on a random target of the lab's size), with the loss in chunks of 128 blocks (the
# trainer's default) and in one chunk. Results in $OUT.   GIT_COMMIT=<hash> bash scripts/device/train_step.sh [args]
set -uo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
source scripts/device/setup.sh || exit 1
REPO="$PWD"
cd /tmp || exit 1  # never the repo root (sglang_dspine/source_files.py says why)
for chunk in 128 0; do
  python3 "$REPO/benchmarks/train_step.py" --random-target --objective-chunk-blocks "$chunk" "$@" \
    --out "$OUT/train_step_gpu_chunk$chunk.json" 2>&1 | grep -v "Loading weights\|profiler.py\|_warn_once"
done
