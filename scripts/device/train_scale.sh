#!/usr/bin/env bash
# On the GPU machine, from the repo root: drafter training at Qwen3-8B geometry, 5-layer DFlash vs DSpine, bf16,
# 2048-token sequences, the target forward included (benchmarks/train_scale.py). No SGLang bundle needed (training
# imports none): the package is laid out as installed under /tmp and runs on the image's torch and transformers.
# One GPU:   GIT_COMMIT=<hash> bash scripts/device/train_scale.sh [args]        -> $OUT/train_scale_summary.json
#   each recipe of TIME_RECIPES (default "ce_anneal specforge"; empty: none) timed ($OUT/train_scale_<recipe>.json),
#   and each of ACCUM1_RECIPES (default "ce_anneal") at --grad-accum 1 (no CE prepass:
#   $OUT/train_scale_<recipe>_accum1.json),
#   then merged (the accumulation runs apart, `by_grad_accum`)
# N GPUs (adds the one-GPU run and the scaling fields):   NGPUS=N GIT_COMMIT=<hash> bash scripts/device/train_scale.sh
# Profile:   GIT_COMMIT=<hash> bash scripts/device/train_scale.sh profile [args]
#   each recipe (PROFILE_RECIPES, default "specforge ce_anneal") profiled on one GPU (--profile): $OUT/train_profile_<recipe>.json,
#   gzipped chrome traces of the last recipe ($OUT/train_profile_{dflash,dspine}.json.gz, dropped over 16 MiB),
#   $OUT/profile.log; the last recipe's table is printed last. About 2 minutes a recipe after a 30 s start.
set -uo pipefail
T0=$(date +%s)
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
REPO="$PWD"
SITE=/tmp/dspine-train-site
rm -rf "$SITE" && mkdir -p "$SITE"
cp -r "$REPO/sglang_dspine" "$SITE/" && cp -r "$REPO/kernels" "$SITE/sglang_dspine/kernels" || exit 1
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
c=$(git -C "$REPO" rev-parse HEAD 2>/dev/null) && export GIT_COMMIT="${GIT_COMMIT:-$c}"  # the package runs from $SITE
cd /tmp || exit 1  # never the repo root (sglang_dspine/source_files.py says why)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import torch, transformers, triton; print(torch.__version__, transformers.__version__, triton.__version__)" \
  || exit 1
MODE=time
if [ "${1:-}" = profile ]; then MODE=profile; shift; fi
if [ "$MODE" = profile ]; then
  recipes=(${PROFILE_RECIPES:-specforge ce_anneal})
  rc=0
  for r in "${recipes[@]}"; do
    trace=()
    [ "$r" = "${recipes[-1]}" ] && trace=(--trace-dir "$OUT")
    timeout 280 python3 "$REPO/benchmarks/train_scale.py" --profile --recipe "$r" "${trace[@]}" \
      --work /tmp/train_scale_work --out "$OUT/train_profile_$r.json" "$@" 2>&1 \
      | grep -v "Loading weights\|_warn_once\|Profiler clears events" | tee -a "$OUT/profile.log" | tee "/tmp/profile_$r.txt"
    st=${PIPESTATUS[0]}; [ "$st" -ne 0 ] && rc=$st
    echo "train_scale.sh: profile $r rc=$st, $(( $(date +%s) - T0 )) s" | tee -a "$OUT/profile.log"
  done
  for r in "${recipes[@]}"; do echo "== recipe $r"; grep -A200 "^per optimizer step" "/tmp/profile_$r.txt"; done
  exit "$rc"
fi
NGPUS="${NGPUS:-1}"
if [ "$NGPUS" -gt 1 ]; then
  launch=(python3 -m torch.distributed.run --standalone --nproc_per_node "$NGPUS")
else
  launch=(python3)
fi
# each recipe timed on its own (TIME_RECIPES, the default recipe first), then one summary of them
recipes=(${TIME_RECIPES-ce_anneal specforge})
rc=0 files=()
for r in "${recipes[@]}"; do
  "${launch[@]}" "$REPO/benchmarks/train_scale.py" --work /tmp/train_scale_work --recipe "$r" \
    --out "$OUT/train_scale_$r.json" "$@" 2>&1 | grep -v "Loading weights\|_warn_once"
  st=${PIPESTATUS[0]}; [ "$st" -ne 0 ] && rc=$st
  files+=("$OUT/train_scale_$r.json")
done
[ "$NGPUS" -gt 1 ] && ACCUM1_RECIPES="${ACCUM1_RECIPES-}"  # the scaling runs keep their accumulation
for r in ${ACCUM1_RECIPES-ce_anneal}; do
  "${launch[@]}" "$REPO/benchmarks/train_scale.py" --work /tmp/train_scale_work --recipe "$r" \
    --out "$OUT/train_scale_${r}_accum1.json" "$@" --grad-accum 1 2>&1 | grep -v "Loading weights\|_warn_once"
  st=${PIPESTATUS[0]}; [ "$st" -ne 0 ] && rc=$st
  files+=("$OUT/train_scale_${r}_accum1.json")
done
[ "$rc" = 0 ] || exit "$rc"
python3 "$REPO/benchmarks/train_scale.py" --merge-recipes "${files[@]}" --out "$OUT/train_scale_summary.json"
st=$?
[ "$st" = 3 ] && exit 0  # no run of the default recipe (TIME_RECIPES without it): the merge printed the hint
exit "$st"
