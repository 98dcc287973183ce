#!/usr/bin/env bash
# Issue 56 on the GPU machine, from the repo root (carry .devbundle): the soak and the pressure scenarios where users
# run, in parts. Every part is one `python -m benchmarks pressure` run (benchmarks/serving_pressure.py), its
# --mem-fraction-static sized from the card (H100 80 GB or H200), its results merged into
# /tmp/issue56/results/serving_pressure_summary.json (per release, backends, variant, server, scenario) and packed,
# with the part's own folder, into $OUT/issue56_<part>.tar.gz after every call. A part that finished is marked in
# /tmp/issue56/done and skipped by `next`; a part cut by the call's limit or a lost machine runs again from its start.
#
#   bash scripts/device/issue56.sh plan               # the parts and their minutes
#   bash scripts/device/issue56.sh PART               # that part, in the foreground (killed after 540 s)
#   bash scripts/device/issue56.sh next               # the next part of LEASE (1 or 2, default 1) not done
#   bash scripts/device/issue56.sh soak-start         # the soak as a detached job (scripts/device/job.sh)
#   bash scripts/device/issue56.sh soak-wait SECONDS  # job.sh wait soak SECONDS, the results packed
#
# Lease 1 (30 device minutes; the issue's "done when": a finished soak and 0.5.23 rows). Before it, here:
# `bash scripts/device/bundle_0523.sh build` (PyPI) then `bundle_0523.sh plan` (the piece calls), `carry.sh aside`.
#   call 1        (~3 min)  soak-start (0.5.17, DSPINE alone: its server ~2 min, then 16 minutes of load,
#                           soak.SCHEDULE's 1-64 clients), then `soak-wait 60`: the server is up. Carry .devbundle.
#   calls 2-17    (~8 min)  the 0.5.23 pieces, one call each, back to back (the soak runs on; receiving is disk
#                           work): `bash scripts/device/carry.sh receive .carry-store/... ; bash
#                           scripts/device/issue56.sh soak-wait 1` (the minutes so far come back every call)
#   call 18       (~9 min)  `issue56.sh soak-wait 540`: the soak ends ~19.5 min after call 1 started it
#   call 19       (~9 min)  `carry.sh back` here first (models/ travels again); there `source
#                           scripts/device/bundle_0523.sh setup && bash scripts/device/issue56.sh p0523` (setup
#                           ~2 min, the part ~6 min)
# Lease 2 (~25 device minutes, 0.5.17 from the .devbundle; one call each, `issue56.sh next 2` runs them in order):
#   chain0517     (~5 min)  plain, DFLASH, DSPINE: the 4 scenarios, graph overflow's mismatches explained
#                           (margin under the reference run, DFLASH differing on the same prompt)
#   retraction    (~3 min)  DSPINE and plain, the retraction scenario (new-token ratio decaying in 20 steps)
#   tree          (~5 min)  DSPINE with SGLANG_DSPINE_TREE=1: the 4 scenarios and retraction
#   adaptive      (~5 min)  DSPINE with SGLANG_DSPINE_VERIFY=adaptive: the 4 scenarios and retraction
#   qwen3_8b      (~6 min)  Qwen3-8B geometry (random weights), plain, DFLASH, DSPINE: KV exhaustion
# Not in the plan: graph overflow at Qwen3-8B geometry (the burst's grammar and log-prob requests need a tokenizer,
# which the geometry's dummy target has not; serving_pressure.GEOMETRY_SCENARIOS says what runs there).
set -uo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
RUN="${ISSUE56_RUN:-/tmp/issue56}"; RESULTS="$RUN/results"
mkdir -p "$RUN/done" "$RESULTS"
export PYTHONUNBUFFERED=1
c=$(git rev-parse HEAD 2>/dev/null) && export GIT_COMMIT="${GIT_COMMIT:-$c}"
SCEN="kv_exhaustion,graph_overflow,long_prompts,disconnects"
RETRACT_ENV="--server-env SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS=20"
SOAK_SECONDS="${SOAK_SECONDS:-960}"

args_of() {  # the pressure run's arguments of a part
  case "$1" in
    p0523) echo "--attention-backend sglang-default --sampling-backend sglang-default --scenarios $SCEN,retraction --tag 0523_default" ;;
    chain0517) echo "--scenarios $SCEN --tag chain0517" ;;
    retraction) echo "--servers plain,dspine --scenarios retraction $RETRACT_ENV --tag retraction" ;;
    tree) echo "--servers dspine --variant tree --scenarios $SCEN,retraction $RETRACT_ENV --tag tree" ;;
    adaptive) echo "--servers dspine --variant adaptive --scenarios $SCEN,retraction $RETRACT_ENV --tag adaptive" ;;
    qwen3_8b) echo "--geometry qwen3-8b --tag qwen3-8b" ;;
    soak) echo "--servers dspine --scenarios soak --soak-seconds $SOAK_SECONDS --tag soak" ;;
    *) return 1 ;;
  esac
}
LEASE2="chain0517 retraction tree adaptive qwen3_8b"

pack() {  # the part's folder and the merged results into $OUT (one file a part: at most 8 come back)
  tar -czf "$OUT/issue56_$1.tar.gz" -C "$RUN" "parts/$1" results done 2>/dev/null
}

run_part() {
  local part="$1" a rc
  a="$(args_of "$part")" || { echo "issue56: no part $part (plan lists them)" >&2; return 2; }
  rm -rf "$RUN/parts/$part"; mkdir -p "$RUN/parts/$part"
  # shellcheck disable=SC2086
  OUT="$RUN/parts/$part" timeout -k 10 "${ISSUE56_PART_S:-540}" bash scripts/device/run.sh pressure \
    --results-dir "$RESULTS" $a
  rc=$?
  [ "$rc" = 0 ] && date -u +%FT%TZ > "$RUN/done/$part"
  echo "issue56: $part rc $rc"
  pack "$part"
  return "$rc"
}

case "${1:-plan}" in
  plan) sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//' ;;
  next)
    lease="${2:-1}"; parts="p0523"; [ "$lease" = 2 ] && parts="$LEASE2"
    for p in $parts; do
      [ -e "$RUN/done/$p" ] && continue
      run_part "$p"; exit $?
    done
    echo "issue56: every part of lease $lease is done" ;;
  soak-start)
    # shellcheck disable=SC2046
    bash scripts/device/job.sh start soak "bash scripts/device/run.sh pressure --results-dir $RESULTS $(args_of soak)" ;;
  soak-wait)
    bash scripts/device/job.sh wait soak "${2:-540}"
    [ -e /tmp/job_soak/rc ] && [ "$(cat /tmp/job_soak/rc)" = 0 ] && date -u +%FT%TZ > "$RUN/done/soak"
    mkdir -p "$RUN/parts/soak" && cp -r /tmp/job_soak/out/. "$RUN/parts/soak/" 2>/dev/null
    pack soak ;;
  *) run_part "$1" ;;
esac
