#!/usr/bin/env bash
# On the GPU machine, from the repo root (carry .devbundle): drafter training at Qwen3-8B geometry, 5-layer DFlash
# vs DSpine, bf16, 2048-token sequences, the target forward included (benchmarks/train_scale.py). Writes
# $OUT/train_scale_summary.json. One GPU:   GIT_COMMIT=<hash> bash scripts/device/train_scale.sh [args]
# N GPUs (adds the one-GPU run and the scaling fields):   NGPUS=N GIT_COMMIT=<hash> bash scripts/device/train_scale.sh
set -uo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
source scripts/device/setup.sh || exit 1
REPO="$PWD"
cd /tmp || exit 1  # never the repo root (sglang_dspine/source_files.py says why)
NGPUS="${NGPUS:-1}"
if [ "$NGPUS" -gt 1 ]; then
  launch=(python3 -m torch.distributed.run --standalone --nproc_per_node "$NGPUS")
else
  launch=(python3)
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
"${launch[@]}" "$REPO/benchmarks/train_scale.py" --work /tmp/train_scale_work --out "$OUT/train_scale_summary.json" "$@" \
  2>&1 | grep -v "Loading weights\|_warn_once"
exit "${PIPESTATUS[0]}"
