#!/usr/bin/env bash
# A detached job on the GPU machine, for work that outlasts one device call (10 minutes). From the repo root,
# carrying .devbundle:
#   GIT_COMMIT=<hash> bash scripts/device/job.sh start NAME 'COMMAND'   # returns at once
#   bash scripts/device/job.sh wait NAME SECONDS                        # then copies what every job has done to $OUT
# COMMAND runs (bash -c) in a copy of the repo at /tmp/job_NAME/repo, so a later call's fresh working tree
# cannot change it, with SGLang's bundle and this package set up, OUT=/tmp/job_NAME/out and the log at
# /tmp/job_NAME/log. `wait` tails NAME's log and packs each job's out/ and log into $OUT/<job>.tar.gz (one
# file a job: at most 8 files come back from a call), every job's at every wait, so that whatever a lost
# machine had done by the last call came back. Keep a call's waits within its timeout (several `wait`s in one
# call add up), and the next call within ~30 s of the last: the machine is released after that, with every job
# on it. Before the lease: `bash scripts/device/carry.sh size .devbundle` says whether the tree and the bundle fit
# one call's 64 MiB (at 8d38b20 they did not: 64.2 MiB; the results set aside, 56.8).
set -uo pipefail
cmd="${1:?usage: job.sh start NAME COMMAND | wait NAME SECONDS}"; name="${2:?job name}"
ROOT="${JOB_ROOT:-/tmp}"  # where the jobs live (tests use their own)
JOB="$ROOT/job_$name"
case "$cmd" in
start)
  [ -e "$JOB" ] && { echo "job.sh: $JOB exists (started already?)" >&2; exit 2; }
  mkdir -p "$JOB/repo" "$JOB/out"
  tar --exclude=.git -cf - . | tar -xf - -C "$JOB/repo"
  printf '%s\n' "${3:?command}" > "$JOB/command"
  cd "$JOB/repo" || exit 1
  export PYTHONUNBUFFERED=1 OUT="$JOB/out"
  # in a subshell: a COMMAND that calls `exit` still leaves its status in rc
  setsid nohup bash -c "( source scripts/device/setup.sh && { $3; } ); echo \$? > $JOB/rc" < /dev/null > "$JOB/log" 2>&1 &
  echo $! > "$JOB/pid"  # the job's process group (setsid): lab2.sh stop ends it
  echo "job.sh: $name started (pid $!), commit ${GIT_COMMIT:-?}"
  ;;
wait)
  limit="${3:-540}"; t0=$(date +%s)
  [ -d "$JOB" ] || { echo "job.sh: no $JOB on this machine (a fresh one? every job of the lease is gone)" >&2; exit 3; }
  while [ ! -e "$JOB/rc" ] && [ $(( $(date +%s) - t0 )) -lt "$limit" ]; do sleep 5; done
  grep -v "Decode batch\|Prefill batch\|Capturing batches" "$JOB/log" | tail -n 60
  dest="${OUT:-/tmp/out}"
  mkdir -p "$dest"
  # every job's files so far, not only NAME's: a lease lost before the next call still returned them all
  for j in "$ROOT"/job_*/; do
    j="${j%/}" n="${j##*/job_}"
    # written aside, then renamed: a call cut off mid-write (its time or the lease's) leaves the last whole one
    tar -czf "$dest/$n.tar.gz.part" -C "$j" log out && mv -f "$dest/$n.tar.gz.part" "$dest/$n.tar.gz"
    if [ -e "$j/rc" ]; then echo "job.sh: $n finished, rc $(cat "$j/rc")"; else echo "job.sh: $n still running"; fi
  done
  ;;
*) echo "job.sh: unknown command $cmd" >&2; exit 2 ;;
esac
