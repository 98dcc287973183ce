#!/usr/bin/env bash
# The lab's second edition on one H200, staged inside one 30-minute lease, on top of job.sh (a detached job
# whose folders stay on the machine between device calls). From the repo root, carrying .devbundle:
#   LEASE_T0=<unix time the lease was asked for> GIT_COMMIT=<hash> bash scripts/device/lab2.sh start [run.py args]
#   bash scripts/device/lab2.sh wait SECONDS   # waits (returns early at DONE or when a stage needs attention),
#                                              # prints progress, packs results to $OUT/lab2.tar.gz and
#                                              # what the lab made so far to $OUT/lab2_partial.tar.gz
#   bash scripts/device/lab2.sh patch PATH...  # copies files of this call's tree into the running job (its repo
#                                              # copy and the installed package), for stages not yet started
#   bash scripts/device/lab2.sh stop           # ends the job and its servers, removes its folders
#   bash scripts/device/lab2.sh restart [run.py args]  # stop, keeping the corpus, tokenizer and tokenized corpus
#                                              # (and a target whose held-out loss is finite), then start again
#                                              # within the same lease (LEASE_T0 as before)
# One device call runs at most 10 minutes and the machine goes back 30 s after a call, so the lease is calls
# back to back, none longer than ~540 s: `start && wait 510`, `wait 540`, `wait 540`, then `wait` until DONE.
# (Twice the machine was lost after a call of ~585 s, whose caller came back more than 30 s later; never
# after one of ~540 s.)
# Stages (the job's log marks each with `=== HH:MM:SS [job s | lease s]`):
#   1 lab      benchmarks/lab/run.py --preset second: corpus, tokenizer, target (8 min), regenerated data, the
#              drafter grid (main pair first, then seed 1, the curve, 2 layers, the upgrade), trained/exported/
#              evaluated in parallel, stopped at lease second SERVE_BY; while the target trains,
#              benchmarks/lab/warm_sglang.py fills SGLang's caches and runs the serving path once
#   2 serving  benchmarks/lab/serve_bench.py: plain / DFLASH / DSPINE with SGLang's bench_serving, no new run
#              after lease second SERVE_END
#              (STAGE2=tree: instead, benchmarks/tree_offline.py on the main pair, on the GPU: draft trees against
#              the chains and DDTree, its summary's `rule` section fixed in advance; TREE_ARGS: more of its
#              arguments; its rows are written as they finish, the summary at its end)
#   3 summary  benchmarks/lab/summary.py: lab_summary.json fields and the plots
# Deadlines count from LEASE_T0 (the lease's device time runs from the asking, machine start included). Models
# and checkpoints stay in $LAB (default /tmp/lab2) on the machine; only results, metrics and logs come back.
set -uo pipefail
LAB="${LAB:-/tmp/lab2}"
JOB=/tmp/job_lab2
SERVE_BY="${SERVE_BY:-1400}"    # lease second by which the lab stage ends (run.py's deadline) and serving starts
SERVE_END="${SERVE_END:-1720}"  # lease second after which serve_bench starts no new run
SERVE_ARGS="${SERVE_ARGS:-}"    # more serve_bench.py arguments (a rehearsal: --clients 48)
STAGE2="${STAGE2:-serving}"     # serving | tree (stage 2 above)
TREE_ARGS="${TREE_ARGS:-}"      # more tree_offline.py arguments
# PRESET=tree (with STAGE2=tree): the main pair only, then the tree stage (`lab2.sh plan` prints how to start it).
# PRESET=recipe (or recipe_long, recipe_cross): a recipe lab instead (run.py --preset PRESET; no SGLang servers):
# its lab stage ends at lease second LAB_BY, then benchmarks/lab/recipe.py writes lab_PRESET_summary.json and its
# plot
PRESET="${PRESET:-second}"
LAB_BY="${LAB_BY:-1690}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

plan() {
  [ "$PRESET" = tree ] && { cat <<'EOF'
tree lab plan (lease seconds on one H200; PRESET=tree STAGE2=tree; not run yet: the training and tree rows are
estimates from the second edition's runs)
  stage                                                          plan   cumulative
  machine start, setup, corpus, tokenizer                          135     135
  target: the second edition's (46M, 480 s of training, no servers) 535     670
  data: 9,000 responses regenerated (75 s cap)                     100     770
  the main pair, DFlash and DSpine (default recipe), 1,200 steps
    two at a time (~5 steps/s each expected)                       260    1030
    (deadline: lease SERVE_BY; give 1100)
  tree_offline.py on the main pair on the GPU: calibration, the
    chains and the trees per suite and T; no new evaluation after
    lease SERVE_END (give 1700), its summary of what was done      600    1700
  archive                                                           15    1715   (of 1800)
start (the lab's own evaluations left out; tree_offline evaluates the chains on the trees' prompts):
  PRESET=tree STAGE2=tree SERVE_BY=1100 SERVE_END=1700 LEASE_T0=<t> GIT_COMMIT=<hash> \
    TREE_ARGS='--sizes 16,32,64 --arms dspine_lattice_depth,dspine_anchored_depth,dspine_extended,dflash_ddtree' \
    bash scripts/device/lab2.sh start --stages corpus,tokenizer,target,data,train,export
device calls, none longer than ~540 s: `start && wait 510`, `wait 540`, `wait 540`, `wait` until DONE
beside the 20-minute soak (run.sh's header), both from the lease's first call: the soak's job
started first (DSPINE_SITE=/tmp/dspine-site-soak, --port-offset 100; its server was up in 113 s beside the
target's training at e7e0441), then this; each later call `job.sh wait soak 515; lab2.sh wait 5`, sent the
moment the previous one returns (at e7e0441 a call sent 64 s after found the machine gone, and both jobs).
Before the lease: `bash scripts/device/carry.sh size .devbundle` (over 64 MiB: CARRY_ASIDE=benchmarks/results
carry.sh aside first, `back` after)
EOF
  return; }
  [ "$PRESET" = recipe_long ] && { cat <<'EOF'
recipe_long lab plan (lease seconds on one H200; PRESET=recipe_long; "seen": the f462d5c lease, whose job
started at lease second ~53 and was done at ~1,440)
  stage                                                          plan   cumulative
  machine start and transfer (36-115 s seen; 53 at f462d5c)        90      90
  setup, corpus (9,600 prompts a domain + 16 validation),
    tokenizer (seen 48)                                             45     135
  target: the second edition's shape, 300 s of training (seen 357) 360     495
  data: 28,800 prompts regenerated (110 s cap; seen 130)           135     630
  6 trainings at once under CUDA MPS, 1,800 steps each: DFlash,
    DSpine ce and DSpine ce_anneal at seeds 0 and 1 (seen 570 s
    DFlash, 683-694 s DSpine: 15.6 steps/s together)               710    1340
  evaluations, 16 processes: held-out per drafter and T, the
    validation suites at T=0 apart (seen 73-130 s)                 135    1475
    (deadline: lease LAB_BY; 1745 at f462d5c)
  recipe.py summary + archive (seen 3 s)                            15    1490   (of 1800)
device calls, none longer than ~540 s: `start && wait 470`, `wait 530`, `wait` until DONE
EOF
  return; }
  [ "$PRESET" = recipe_cross ] && { cat <<'EOF'
recipe_cross lab plan (lease seconds on one H200; PRESET=recipe_cross; not run yet)
  stage                                                          plan   cumulative
  machine start, setup, corpus, tokenizer                          135     135
  target: the second edition's (46M, 480 s of training)            535     670
  data: 28,800 prompts regenerated (110 s cap)                     135     805
  12 trainings of 600 steps, 6 at once under CUDA MPS (7,200 steps
    at the 15.6 steps/s seen at f462d5c)                           470    1275
  evaluations: 24 held-out processes + 8 validation, 16 at a time  300    1575
    (deadline: lease LAB_BY)
  recipe.py summary + archive                                       15    1590   (of 1800)
EOF
  return; }
  [ "$PRESET" = recipe ] && { cat <<'EOF'
recipe lab plan (lease seconds on one H200; PRESET=recipe)
  stage                                                          plan   cumulative
  machine start and transfer (36-90 s seen)                        90      90
  setup, corpus (300 MB, 9,600 prompts a domain + 16 validation),
    tokenizer                                                       45     135
  target: the second edition's (46M, 480 s of training)            535     670
  data: 28,800 prompts regenerated in batches of 3,072 (110 s cap) 120     790
  6 trainings at once: DFlash and DSpine (ce) 1,800 steps at seeds
    0 and 1, DSpine specforge and ce at 600 steps (8,400 steps at
    the ~12 steps/s six 600-step trainings gave side by side)       700    1490
  evaluations, one process per drafter and T (seen 163 s: cut)     150    1640
    (deadline: lease LAB_BY, default 1690; the 320944e lease set 1640)
  recipe.py summary + archive                                       15    1655   (of 1800)
device calls, none longer than ~540 s: `start && wait 510`, `wait 540`, `wait 540`, `wait` until DONE
EOF
  return; }
  cat <<'EOF'
lab2 stage plan (lease seconds on one H200, counted from the asking; "seen": the H200 runs at 034e7f9, fd79969, 6464174)
  stage                                                       plan   cumulative
  machine start and transfer (seen 23 s; 117-160 s seen earlier)  60      60
  setup: SGLang bundle, plugin layout, repo copy (seen 10 s)      10      70
  corpus (300 MB) + tokenizer (8192) (seen 25 s)                  25      95
  target: tokenize, 480 s training, held-out loss, save (seen 533-534) 535 630
    (meanwhile: 3 servers on random models of the same shapes, one bench_serving run each; seen 95-340 s)
  data: regenerate 9,000 responses (75 s cap; seen 98 s)          100     730
  grid: 11 trainings of 600/300/150 steps, 4 at a time, main pair
        first (seen: the four 600-step runs in 197-216 s, all 11
        started 300 s after the data)                              420    1150
        then 64 evaluations and 8 walk-off ones, 16 at a time (seen:
        the first 48 started within 150 s)                        220    1370
        (deadline: lease SERVE_BY=1400)
  serving: 3 servers start at once (warm caches), warm-up burst,
           24 bench_serving runs (no new run after SERVE_END=1720) 240    1600
    (STAGE2=tree instead: tree_offline.py on the main pair, not timed yet: lower SERVE_BY to leave it room)
  summary + archive                                               15    1615   (of 1800)
device calls, none longer than ~540 s: `start && wait 510`, `wait 540`, `wait 540`, `wait` until DONE (ask status for the time left)
EOF
}

lease_s() { echo $(( $(date +%s) - $(cat "$LAB/lease_t0") )); }
# What of the lab comes back (no weights): the offline evaluations, training metrics and configs, logs, the
# target's and the data's reports; those that exist so far (fails only when there is nothing yet).
pack_lab() {
  (cd "$LAB/lab" 2>/dev/null && tar -czf "$1" $(ls -d eval logs logs_run.txt target/lab_target.json data/summary.json runs/*/metrics.jsonl runs/*/train_config.json drafters/*/config.json corpus/manifest.json 2>/dev/null)) 2>/dev/null
}

case "${1:?usage: lab2.sh plan | start [run.py args] | wait SECONDS | patch PATH... | stop | restart [args] | stages}" in
plan) plan ;;
start)
  shift
  plan
  [ -e "$LAB" ] && { echo "lab2: $LAB exists (a job started already? lab2.sh stop clears it)" >&2; exit 2; }
  mkdir -p "$LAB"
  : > "$LAB/run_args"; [ $# -gt 0 ] && printf '%q ' "$@" > "$LAB/run_args"
  now=$(date +%s)
  if [ -z "${LEASE_T0:-}" ]; then
    echo "lab2: LEASE_T0 not given; assuming the lease began 130 s ago" >&2
    LEASE_T0=$(( now - 130 ))
  fi
  echo "$LEASE_T0" > "$LAB/lease_t0"
  echo "$now" > "$LAB/t_start"
  echo "lab2: job starts at lease second $(( now - LEASE_T0 ))"
  GIT_COMMIT="${GIT_COMMIT:-}" LAB="$LAB" bash "$HERE/job.sh" start lab2 \
    "LAB=$LAB SERVE_BY=$SERVE_BY SERVE_END=$SERVE_END SERVE_ARGS='$SERVE_ARGS' PRESET=$PRESET LAB_BY=$LAB_BY \
     STAGE2=$STAGE2 TREE_ARGS='$TREE_ARGS' \
     bash scripts/device/lab2.sh stages"
  ;;
stages)  # runs detached (job.sh), in the job's copy of the repo, with the bundle set up and OUT=$JOB/out
  step() { echo "=== $(date -u +%T) [job $(( $(date +%s) - $(cat "$LAB/t_start") )) s | lease $(lease_s) s] $*"; }
  attention() { step "ATTENTION: $*"; echo "$*" >> "$LAB/attention"; }
  export PYTHONUNBUFFERED=1
  mkdir -p "$OUT/results"
  t0=$(cat "$LAB/lease_t0")
  step "1 lab"
  # run.py's deadline: steps still running at lease second SERVE_BY are killed and the report says what was done
  lab_cmd="PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python3 benchmarks/lab/run.py --preset $PRESET \
    --out $LAB/lab --results $OUT/results $(cat "$LAB/run_args")"
  eval "$lab_cmd --stages corpus,tokenizer" || attention "lab corpus/tokenizer failed ($?)"
  if [ "${PRESET#recipe}" != "$PRESET" ]; then  # a recipe lab: no servers; its summary
    eval "$lab_cmd --set deadline_s=$(( t0 + LAB_BY - $(date +%s) ))" || attention "lab failed ($?)"
    step "2 summary"
    python3 benchmarks/lab/recipe.py --lab "$LAB/lab" --report "$OUT/results/lab_$PRESET.json" \
      --out "$OUT/results/lab_${PRESET}_summary.json" || attention "summary failed"
    pack_lab "$OUT/lab2_runs.tar.gz" || attention "runs archive failed"
    step "done"
    exit 0
  fi
  # while the target trains: SGLang's JIT/Triton/sampling caches built on random models of the same shapes (for
  # the serving stage only: the tree stage serves nothing, and the target's training time is fixed)
  warm_pid=""
  if [ "$STAGE2" != tree ]; then
    ( python3 benchmarks/lab/warm_sglang.py --lab "$LAB/lab" --out "$LAB/warm" 2>&1 \
        | grep -v "Decode batch\|Prefill batch\|Capturing" > "$LAB/warm.log"
      cp "$LAB/warm/warm_sglang.json" "$LAB/warm/warm_server_logs.tar.gz" "$OUT/results/" 2>/dev/null
      grep "warm_sglang: bench_serving check\|Traceback\|Error" "$LAB/warm.log" | tail -n 8
      python3 -c "import json,sys; sys.exit(0 if json.load(open('$LAB/warm/warm_sglang.json')).get('ok') else 1)" \
        2>/dev/null && step "warm servers: ok" || attention "warm servers: not ok (see $LAB/warm.log)" ) &
    warm_pid=$!
  fi
  eval "$lab_cmd --set deadline_s=$(( t0 + SERVE_BY - $(date +%s) ))" || attention "lab failed ($?)"
  [ -n "$warm_pid" ] && wait "$warm_pid"
  if [ "$STAGE2" = tree ] && [ -d "$LAB/lab/drafters/dspine" ] && [ -d "$LAB/lab/drafters/dflash" ]; then
    step "2 tree"
    python3 benchmarks/tree_offline.py --target "$LAB/lab/target" --dspine "$LAB/lab/drafters/dspine" \
      --dflash "$LAB/lab/drafters/dflash" --suites "$LAB/lab/corpus/prompts" --device cuda \
      --out "$OUT/results/tree_offline_lab.json" --summary "$OUT/results/tree_summary_lab.json" \
      --deadline-s $(( t0 + SERVE_END - $(date +%s) )) $TREE_ARGS \
      || attention "tree failed"
  elif [ -d "$LAB/lab/drafters/dspine" ] && [ -d "$LAB/lab/drafters/dflash" ]; then
    step "2 serving"
    python3 benchmarks/lab/serve_bench.py --lab "$LAB/lab" --out "$LAB/serving" --deadline $(( t0 + SERVE_END )) \
      $SERVE_ARGS 2>&1 | grep -v "Decode batch\|Prefill batch\|Capturing" || attention "serving failed"
    cp "$LAB/serving/lab_bench_serving.json" "$LAB/serving/bench_server_logs.tar.gz" "$OUT/results/" 2>/dev/null \
      || attention "serving wrote no results"
  else
    attention "2 serving skipped: the main pair's drafters are missing"
  fi
  step "3 summary"
  [ -f benchmarks/results/lab_summary.json ] && cp benchmarks/results/lab_summary.json "$OUT/results/lab_summary.json"
  labjson=$(ls -t "$OUT"/results/lab_*.json 2>/dev/null | grep -v "lab_summary.json\|lab_bench_serving.json" | head -n 1)
  serving=(); [ "$STAGE2" = tree ] || serving=(--serving "$OUT/results/lab_bench_serving.json")
  python3 benchmarks/lab/summary.py --lab "${labjson:-$OUT/results/lab_second.json}" \
    "${serving[@]}" --out "$OUT/results/lab_summary.json" || attention "summary failed"
  pack_lab "$OUT/lab2_runs.tar.gz" || attention "runs archive failed"  # what comes back besides results/
  step "done"
  ;;
wait)
  limit="${2:-560}"
  [ -f "$LAB/t_start" ] || { echo "lab2: no job (start it first)" >&2; exit 2; }
  echo "lab2: job $(( $(date +%s) - $(cat "$LAB/t_start") )) s, lease $(lease_s) s; waiting up to $limit s"
  t0=$(date +%s)
  seen=$(cat "$LAB/attention" 2>/dev/null | wc -l)
  while [ ! -e "$JOB/rc" ] && [ $(( $(date +%s) - t0 )) -lt "$limit" ] \
        && [ "$(cat "$LAB/attention" 2>/dev/null | wc -l)" -eq "$seen" ]; do sleep 3; done
  bash "$HERE/job.sh" wait lab2 0 | grep -v "^\[lab .*\$ sglang-dspine \(eval\|export\)" | tail -n 40
  # what the lab has made so far, should the machine be gone before the next call (the job's own archive
  # comes at its end)
  mkdir -p "${OUT:-/tmp/out}"
  pack_lab "${OUT:-/tmp/out}/lab2_partial.tar.gz" || echo "lab2: nothing of the lab to pack yet"
  cp "$LAB/serving/lab_bench_serving.json" "${OUT:-/tmp/out}/" 2>/dev/null  # serve_bench rewrites it after each run
  echo "--- stages so far:"; grep "^=== " "$JOB/log" 2>/dev/null
  echo "--- lab log (last lines):"; grep -v "\$ sglang-dspine" "$LAB/lab/logs_run.txt" 2>/dev/null | tail -n 25
  echo "--- GPU: $(nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader 2>/dev/null)"
  echo "lab2: returned at lease $(lease_s) s"
  ;;
patch)
  shift
  [ -d "$JOB/repo" ] || { echo "lab2: no job to patch" >&2; exit 2; }
  for f in "$@"; do
    mkdir -p "$JOB/repo/$(dirname "$f")" && cp "$f" "$JOB/repo/$f" || exit 1
    case "$f" in  # the package runs from the layout setup.sh made
      sglang_dspine/*) mkdir -p "/tmp/dspine-site/$(dirname "$f")" && cp "$f" "/tmp/dspine-site/$f" ;;
      kernels/*) cp "$f" "/tmp/dspine-site/sglang_dspine/$f" ;;
    esac
    echo "lab2: patched $f"
  done
  ;;
stop)
  [ -f "$JOB/pid" ] && kill -- -"$(cat "$JOB/pid")" 2>/dev/null
  # bracketed patterns: they never match the command line of the shell that runs this. Only servers of this lab
  # (their model paths under $LAB): another job's servers (a soak beside it) keep running.
  pkill -f "[s]glang[.]launch_server.*$LAB/" 2>/dev/null; pkill -f "[s]glang_dspine[.]cli.*$LAB/" 2>/dev/null
  # and only this lab's steps (their --out under $LAB): a lab run elsewhere on the machine keeps running (at
  # 04949a3 the bare pattern, run by tests/test_scripts.py, killed a CPU rebuild of the built-in pair twice)
  pkill -f "[b]enchmarks/lab/.*$LAB(/| |\$)" 2>/dev/null
  sleep 2; rm -rf "$JOB" "$LAB"; echo "lab2: stopped and cleared"
  ;;
restart)
  shift
  [ -f "$LAB/lease_t0" ] || { echo "lab2: no job to restart" >&2; exit 2; }
  keep="$LAB.keep"; rm -rf "$keep"; mkdir -p "$keep"
  for d in corpus tokenizer tokens; do [ -d "$LAB/lab/$d" ] && mv "$LAB/lab/$d" "$keep/"; done
  python3 -c "import json,math,sys; h=json.load(open('$LAB/lab/target/lab_target.json'))['heldout_loss']; \
sys.exit(0 if all(math.isfinite(v) for v in h.values()) else 1)" 2>/dev/null && mv "$LAB/lab/target" "$keep/"
  t0=$(cat "$LAB/lease_t0")
  bash "$0" stop
  LEASE_T0="$t0" bash "$0" start "$@" > /dev/null || exit 1
  mkdir -p "$LAB/lab" && mv "$keep"/* "$LAB/lab/" 2>/dev/null; rmdir "$keep"  # before run.py starts (setup.sh first)
  echo "lab2: restarted at lease second $(lease_s), kept: $(ls "$LAB/lab" | tr '\n' ' ')"
  ;;
*) echo "lab2: unknown command $1" >&2; exit 2 ;;
esac
