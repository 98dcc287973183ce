#!/usr/bin/env bash
# A detached job on the GPU machine, for work that outlasts one device call (10 minutes). From the repo root,
# carrying .devbundle:
#   GIT_COMMIT=<hash> bash scripts/device/job.sh start NAME 'COMMAND'   # returns at once
#   bash scripts/device/job.sh wait NAME SECONDS                        # then copies what is done to $OUT
# COMMAND runs (bash -c) in a copy of the repo at /tmp/job_NAME/repo, so a later call's fresh working tree
# cannot change it, with SGLang's bundle and this package set up, OUT=/tmp/job_NAME/out and the log at
# /tmp/job_NAME/log. `wait` tails the log and packs out/ and the log into $OUT/NAME.tar.gz (one file: at
# most 8 files come back from a call).
set -uo pipefail
cmd="${1:?usage: job.sh start NAME COMMAND | wait NAME SECONDS}"; name="${2:?job name}"
JOB="/tmp/job_$name"
case "$cmd" in
start)
  [ -e "$JOB" ] && { echo "job.sh: $JOB exists (started already?)" >&2; exit 2; }
  mkdir -p "$JOB/repo" "$JOB/out"
  tar --exclude=.git -cf - . | tar -xf - -C "$JOB/repo"
  printf '%s\n' "${3:?command}" > "$JOB/command"
  cd "$JOB/repo" || exit 1
  export PYTHONUNBUFFERED=1 OUT="$JOB/out"
  setsid nohup bash -c "source scripts/device/setup.sh && { $3; }; echo \$? > $JOB/rc" < /dev/null > "$JOB/log" 2>&1 &
  echo $! > "$JOB/pid"  # the job's process group (setsid): lab2.sh stop ends it
  echo "job.sh: $name started (pid $!), commit ${GIT_COMMIT:-?}"
  ;;
wait)
  limit="${3:-540}"; t0=$(date +%s)
  while [ ! -e "$JOB/rc" ] && [ $(( $(date +%s) - t0 )) -lt "$limit" ]; do sleep 5; done
  grep -v "Decode batch\|Prefill batch\|Capturing batches" "$JOB/log" | tail -n 60
  mkdir -p "${OUT:-/tmp/out}"
  tar -czf "${OUT:-/tmp/out}/$name.tar.gz" -C "$JOB" log out
  if [ -e "$JOB/rc" ]; then echo "job.sh: $name finished, rc $(cat "$JOB/rc")"; else echo "job.sh: $name still running"; fi
  ;;
*) echo "job.sh: unknown command $cmd" >&2; exit 2 ;;
esac
