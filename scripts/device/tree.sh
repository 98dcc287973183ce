#!/usr/bin/env bash
# On the GPU machine, from the repo root (carry .devbundle): the served draft tree's runs (docs/tree.md), SGLang
# 0.5.17, triton/pytorch. A long sequence: start it detached,
#   GIT_COMMIT=<hash> bash scripts/device/job.sh start tree 'bash scripts/device/tree.sh [STEP ...]'
# then `bash scripts/device/job.sh wait tree 540` call after call. STEPs, in order (default: all):
#   tests      every `gpu`-marked test (the tree's layout in a CUDA graph, the commit kernel on CUDA among them)
#   step_cost  the built-in pair, chain and trees side by side: tau and tokens/s at T=0 (1/4/16/48 clients) and T=1
#              (16), servers dspine, dspine_tree (N = B), dspine_tree32, dspine_tree64 (about 5 minutes)
#   scale      the per-step cost at Qwen3-8B geometry (random weights), each server alone: dspine, dspine_tree16,
#              dspine_tree32, dspine_tree64 at 1/4/16/48 clients, T=0 (four side by side do not fit in memory)
#   e2e        serve_e2e.py at N = 32: greedy equality with no speculation, the T=1 test, 60 s of mixed load
#   features   every request feature at N = 32 (serving_features.py: plain and dspine)
# Results: $OUT/tree/<step>/, and $OUT/tree/tree_served_summary.json from what ran (benchmarks/tree_served.py).
set -uo pipefail
steps="${*:-tests step_cost scale e2e features}"
for step in $steps; do  # every step known before any runs
  case "$step" in tests|step_cost|scale|e2e|features) ;;
    *) echo "tree.sh: unknown step $step (tests step_cost scale e2e features)" >&2; exit 2 ;; esac
done
root="${OUT:-/tmp/out}/tree"
mkdir -p "$root"
wide=(--dspine-args "--speculative-num-draft-tokens 32")
failed=0
for step in $steps; do
  mkdir -p "$root/$step"
  t0=$(date +%s)
  case "$step" in
    tests) OUT="$root/$step" bash scripts/device/gpu_tests.sh > /dev/null 2>&1 ;;
    step_cost) OUT="$root/$step" bash scripts/device/serve.sh step_cost --repeats 2 --t1-concurrency 16 \
                 --servers dspine,dspine_tree,dspine_tree32,dspine_tree64 --name tree_step_cost > /dev/null 2>&1 ;;
    scale) OUT="$root/$step" bash scripts/device/run.sh step_cost --alone-only \
             --servers dspine,dspine_tree16,dspine_tree32,dspine_tree64 --clients 1,4,16,48 --temperatures 0 \
             --repeats 1 > /dev/null 2>&1 ;;
    e2e) SGLANG_DSPINE_TREE=1 OUT="$root/$step" bash scripts/device/serve.sh e2e --load-seconds 60 "${wide[@]}" \
           > /dev/null 2>&1 ;;
    features) SGLANG_DSPINE_TREE=1 OUT="$root/$step" bash scripts/device/run.sh features --servers plain,dspine \
                --tag tree32 "${wide[@]}" > /dev/null 2>&1 ;;
  esac
  rc=$?
  [ "$rc" = 0 ] || failed=1
  echo "tree.sh: $step rc $rc in $(( $(date +%s) - t0 )) s" | tee -a "$root/steps.txt"
done
args=()
if [ -f "$root/step_cost/tree_step_cost.json" ]; then
  [ -f "$root/e2e/serving_e2e_summary.json" ] && args+=(--e2e "$root/e2e/serving_e2e_summary.json")
  [ -f "$root/scale/serving_scale_summary.json" ] && args+=(--scale "$root/scale/serving_scale_summary.json")
  (source scripts/device/setup.sh >/dev/null && python3 -m benchmarks tree_served \
    --step-cost "$root/step_cost/tree_step_cost.json" "${args[@]}" --out "$root/tree_served_summary.json") || failed=1
fi
exit "$failed"
