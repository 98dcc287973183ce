#!/usr/bin/env bash
# The lab's second edition on one H200, staged inside one 30-minute lease, on top of job.sh (a detached job
# whose folders stay on the machine between device calls). From the repo root, carrying .devbundle:
#   GIT_COMMIT=<hash> bash scripts/device/lab2.sh start [run.py args, e.g. --set train_steps=900]
#   bash scripts/device/lab2.sh wait SECONDS     # waits, prints progress against the plan, packs results to $OUT
# One device call runs at most 10 minutes, so the lease takes three calls back to back (each within the
# machine's 30 s idle window): `start; wait 540`, `wait 590`, `wait 590` (the last returns at DONE).
# Stages (the job's log marks each with `=== HH:MM:SS`):
#   1 lab      benchmarks/lab/run.py --preset second: corpus, tokenizer, target (8 min), regenerated data, the
#              drafter grid (main pair, curve, seed 1, 2 layers, upgrade) trained/exported/evaluated in parallel;
#              while the target trains, benchmarks/lab/warm_sglang.py fills SGLang's caches
#   2 serving  benchmarks/lab/serve_bench.py: plain / DFLASH / DSPINE with SGLang's bench_serving
#              (skipped when the job is past SERVE_BY seconds, so the offline results still come back)
#   3 summary  benchmarks/lab/summary.py: lab_summary.json fields and the plots
# Models and checkpoints stay in $LAB (default /tmp/lab2) on the machine; only results, metrics and logs come
# back ($OUT/lab2.tar.gz: results/, the eval JSONs, every run's metrics.jsonl and train_config.json, logs).
set -uo pipefail
LAB="${LAB:-/tmp/lab2}"
SERVE_BY="${SERVE_BY:-1300}"     # job seconds after which serving is skipped
LAB_DEADLINE="${LAB_DEADLINE:-1450}"  # run.py's deadline (seconds after it starts, ~35 s into the job)
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

plan() {
  cat <<'EOF'
lab2 stage plan (planned seconds on one H200; cumulative from the lease's start)
  stage                                                       plan   cumulative
  machine start (before the first call)                         120     120
  setup: SGLang bundle, plugin layout, repo copy                  35     155
  corpus (300 MB) + tokenizer (8192)                              30     185
  target: tokenize, 480 s training, held-out loss, save          520     705
    (meanwhile: SGLang caches warmed on random models of the same shapes, ~3-4 min)
  data: regenerate responses (75 s cap) + load                    95     800
  grid: 11 trainings at once (800/400/200 steps; 2 layers at 400),
        exports, 64 evaluations pipelined (the last after training) 520    1320
  report + plots                                                  10    1330
  serving: 3 servers start at once (~70 s on warm caches), warm-up
           burst, 24 bench_serving runs (1/4/16/48 clients, T=0/1) 270    1600
  summary                                                          5    1605   (26.8 min of the 30)
device calls: `start; wait 540` (returns ~t=700), `wait 590` (~t=1300), `wait 590` (returns at DONE ~t=1605)
EOF
}

case "${1:?usage: lab2.sh plan | start [run.py args] | wait SECONDS | stages}" in
plan) plan ;;
start)
  shift
  plan
  [ -e "$LAB" ] && { echo "lab2: $LAB exists (a job started already?)" >&2; exit 2; }
  mkdir -p "$LAB"
  : > "$LAB/run_args"; [ $# -gt 0 ] && printf '%q ' "$@" > "$LAB/run_args"
  date +%s > "$LAB/t_start"
  GIT_COMMIT="${GIT_COMMIT:-}" LAB="$LAB" bash "$HERE/job.sh" start lab2 "LAB=$LAB SERVE_BY=$SERVE_BY LAB_DEADLINE=$LAB_DEADLINE bash scripts/device/lab2.sh stages"
  ;;
stages)  # runs detached (job.sh), in the job's copy of the repo, with the bundle set up and OUT=/tmp/job_lab2/out
  step() { echo "=== $(date -u +%T) [$(( $(date +%s) - $(cat "$LAB/t_start") )) s] $*"; }
  export PYTHONUNBUFFERED=1
  mkdir -p "$OUT/results"
  step "1 lab"
  # deadline_s: steps still running then are killed and the report says what was done (the lease must end)
  lab_cmd="PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python3 benchmarks/lab/run.py --preset second \
    --out $LAB/lab --results $OUT/results --set deadline_s=$LAB_DEADLINE $(cat "$LAB/run_args")"
  eval "$lab_cmd --stages corpus,tokenizer" || step "lab corpus/tokenizer failed ($?)"
  # while the target trains: SGLang's JIT/Triton/sampling caches built on random models of the same shapes
  python3 benchmarks/lab/warm_sglang.py --lab "$LAB/lab" --out "$LAB/warm" 2>&1 \
    | grep -v "Decode batch\|Prefill batch\|Capturing" > "$LAB/warm.log" &
  warm_pid=$!
  eval "$lab_cmd" || step "lab failed ($?)"
  wait "$warm_pid"; tail -n 3 "$LAB/warm.log"; cp "$LAB/warm/warm_sglang.json" "$OUT/results/" 2>/dev/null
  elapsed=$(( $(date +%s) - $(cat "$LAB/t_start") ))
  if [ -d "$LAB/lab/drafters/dspine" ] && [ -d "$LAB/lab/drafters/dflash" ]; then
    if [ "$elapsed" -lt "$SERVE_BY" ]; then
      step "2 serving"
      python3 benchmarks/lab/serve_bench.py --lab "$LAB/lab" --out "$LAB/serving" 2>&1 \
        | grep -v "Decode batch\|Prefill batch\|Capturing" || step "serving failed"
      cp "$LAB/serving/lab_bench_serving.json" "$LAB/serving/bench_server_logs.tar.gz" "$OUT/results/" 2>/dev/null \
        || step "serving wrote no results"
    else
      step "2 serving skipped: ${elapsed} s elapsed, past SERVE_BY=${SERVE_BY} s"
    fi
  fi
  step "3 summary"
  [ -f benchmarks/results/lab_summary.json ] && cp benchmarks/results/lab_summary.json "$OUT/results/lab_summary.json"
  labjson=$(ls -t "$OUT"/results/lab_*.json 2>/dev/null | grep -v "lab_summary.json\|lab_bench_serving.json" | head -n 1)
  python3 benchmarks/lab/summary.py --lab "${labjson:-$OUT/results/lab_second.json}" \
    --serving "$OUT/results/lab_bench_serving.json" --out "$OUT/results/lab_summary.json" || step "summary failed"
  # what comes back besides results/: the offline evaluations, training metrics and logs (no weights)
  (cd "$LAB/lab" && tar -czf "$OUT/lab2_runs.tar.gz" eval logs logs_run.txt target/lab_target.json data/summary.json \
     $(ls -d runs/*/metrics.jsonl runs/*/train_config.json 2>/dev/null)) || step "runs archive failed"
  step "done"
  ;;
wait)
  limit="${2:-560}"
  [ -f "$LAB/t_start" ] && echo "lab2: $(( $(date +%s) - $(cat "$LAB/t_start") )) s since start (plan: ~1485 s from start to DONE)"
  bash "$HERE/job.sh" wait lab2 "$limit" | grep -v "^\[lab .*\$ sglang-dspine eval"
  echo "--- stages so far:"; grep "^=== " /tmp/job_lab2/log 2>/dev/null
  echo "--- lab log (last lines):"; grep -v "\$ sglang-dspine" "$LAB/lab/logs_run.txt" 2>/dev/null | tail -n 25
  ;;
*) echo "lab2: unknown command $1" >&2; exit 2 ;;
esac
