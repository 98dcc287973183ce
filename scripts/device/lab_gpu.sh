#!/usr/bin/env bash
# The lab's GPU stages on one H200 as one detached job (together they outlast one device call):
#   1. benchmarks/lab/run.py --preset budget   corpus, tokenizer, target, regenerated data, DFlash and DSpine
#                                              drafters (same data, steps, backbone), offline tau, pack
#   2. python -m benchmarks step_cost_pair     the lab's pair in SGLang: no speculation / DFLASH / DSPINE,
#                                              T=0 at 1, 4, 16, 48 clients (twice) and T=1 at 16
#   3. benchmarks/lab/ablate.py                no alignment / no refinement (retrained), walk off, injection off
# From the repo root, carrying .devbundle:
#   GIT_COMMIT=<hash> bash scripts/device/lab_gpu.sh start    # starts the job detached, returns at once
#   bash scripts/device/lab_gpu.sh wait 560                    # waits up to 560 s, then copies what is done to $OUT
# The job runs from a copy of the repo in $LAB (default /tmp/lab_gpu), so a later call's fresh working tree
# cannot change it under its feet; progress: $LAB/driver.log. Extra `start` arguments go to run.py.
set -uo pipefail
LAB="${LAB:-/tmp/lab_gpu}"
OUT="${OUT:-/tmp/out}"
case "${1:?usage: lab_gpu.sh start [run.py args] | wait SECONDS}" in
start)
  shift
  [ -e "$LAB" ] && { echo "lab_gpu: $LAB exists (a job started already?)" >&2; exit 2; }
  source scripts/device/setup.sh || exit 1
  mkdir -p "$LAB/results" "$LAB/repo"
  tar --exclude=.devbundle --exclude=.git -cf - . | tar -xf - -C "$LAB/repo"
  cd "$LAB/repo" || exit 1
  export PYTHONUNBUFFERED=1 LAB
  : > "$LAB/run_args"; [ $# -gt 0 ] && printf '%q ' "$@" > "$LAB/run_args"
  setsid nohup bash scripts/device/lab_gpu.sh stages < /dev/null > "$LAB/driver.log" 2>&1 &
  echo "lab_gpu: started (pid $!), log $LAB/driver.log, commit ${GIT_COMMIT:-?}"
  ;;
stages)
  step() { echo "=== $(date -u +%T) $*"; }
  step "1 lab"
  eval "python3 benchmarks/lab/run.py --preset budget --out $LAB/lab \
        --results $LAB/results --pack $LAB/pack $(cat "$LAB/run_args")" || step "lab failed ($?)"
  if [ -d "$LAB/lab/drafters/dspine" ] && [ -d "$LAB/lab/drafters/dflash" ]; then
    step "2 serving"
    python3 -m benchmarks step_cost_pair --models "$LAB/lab" --out "$LAB/serving" --name lab_gpu_serving \
      --servers plain,dflash,dspine --t1-concurrency 16 --stop-at-eos 2>&1 | grep -v "Decode batch\|Prefill batch\|Capturing"
    cp "$LAB/serving/lab_gpu_serving.json" "$LAB/results/" 2>/dev/null || step "serving wrote no results"
    step "3 ablations"
    python3 benchmarks/lab/ablate.py --lab "$LAB/lab" --out "$LAB/results/lab_gpu_ablations.json" \
      --limit 16 --max-new-tokens 128 || step "ablations failed ($?)"
  fi
  step "done"
  touch "$LAB/DONE"
  ;;
wait)
  limit="${2:-560}"; t0=$(date +%s)
  while [ ! -e "$LAB/DONE" ] && [ $(( $(date +%s) - t0 )) -lt "$limit" ]; do sleep 5; done
  mkdir -p "$OUT"
  grep -v "^\[lab" "$LAB/driver.log" | tail -n 40; echo "--- lab log:"; tail -n 25 "$LAB/lab/logs_run.txt" 2>/dev/null
  # at most 8 files come back: one tar of results and logs, and the pack's parts once the job is done
  tar -czf "$OUT/lab_gpu_results.tar.gz" -C "$LAB" driver.log results \
    $(cd "$LAB" && ls -d lab/logs lab/logs_run.txt serving/step_cost_logs.tar.gz lab/ablations/*.log 2>/dev/null)
  if [ -e "$LAB/DONE" ]; then cp "$LAB"/pack/lab_models.tar.gz* "$OUT/" 2>/dev/null; echo "lab_gpu: DONE"; fi
  ;;
*) echo "lab_gpu: unknown command $1" >&2; exit 2 ;;
esac
