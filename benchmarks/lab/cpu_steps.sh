#!/usr/bin/env bash
# How does the DSpine/DFlash tau ratio move with training length? Retrains both drafters of a built CPU pair
# (cpu_pair.sh's output: corpus, tokenizer, target and data are reused, not rebuilt) for each step count, one
# after the other, then evaluates them on the same held-out suites as the pair's own run.
# ~25 minutes per 1000 steps on 2 cores. Then: python benchmarks/lab/steps_summary.py PAIR_OUT OUT.
# Usage: bash benchmarks/lab/cpu_steps.sh PAIR_OUT [OUT] [STEPS] [PY]
set -euo pipefail
PAIR="$(cd "${1:?the output folder of cpu_pair.sh}" && pwd)"
OUT="${2:-/tmp/lab_cpu_steps}"
STEPS="${3:-1000,2000}"
PY="${4:-python3}"
here="$(cd "$(dirname "$0")" && pwd)"
mkdir -p "$OUT"
for n in ${STEPS//,/ }; do
  run="$OUT/steps_$n"
  mkdir -p "$run"
  for d in corpus tokenizer target data; do ln -sfn "$PAIR/$d" "$run/$d"; done
  bash "$here/cpu_pair.sh" "$run" "$PY" --set train_steps="$n" >"$OUT/steps_$n.log" 2>&1
done
echo "done: $OUT/steps_*/results"
