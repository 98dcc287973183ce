#!/usr/bin/env bash
# On the GPU machine, from the repo root (carry .devbundle): one part of the headline run (benchmarks/headline.py)
# within one device call. `GIT_COMMIT=<hash> bash scripts/device/headline.sh` runs the next part not done (killed
# after HEADLINE_BUDGET_S, 540 s); `... headline.sh --part P` that part; `--status`; `--collect`. The run's folder,
# /tmp/headline, is kept between the calls of one lease and comes back after each call as $OUT/headline.tar.gz
# (without the parts' model folders); a call on a new machine given it back (HEADLINE_FROM=that file, carried)
# resumes from it: the parts done stay done.
set -uo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
RUN="${HEADLINE_RUN:-/tmp/headline}"; mkdir -p "$RUN"
if [ -n "${HEADLINE_FROM:-}" ] && [ ! -f "$RUN/state.json" ]; then
  tar -xzf "$HEADLINE_FROM" -C "$RUN" || exit 1
fi
c=$(git rev-parse HEAD 2>/dev/null) && export GIT_COMMIT="${GIT_COMMIT:-$c}"
[ -n "${GIT_COMMIT:-}" ] || { echo "headline.sh: no git here: pass GIT_COMMIT=<hash>" >&2; exit 2; }
export PYTHONUNBUFFERED=1
source scripts/device/setup.sh || exit 1
python3 -m benchmarks headline --out "$RUN" --budget-s "${HEADLINE_BUDGET_S:-540}" "$@"
rc=$?
tar -czf "$OUT/headline.tar.gz" -C "$RUN" --exclude='./parts/*/work' . || rc=1
exit $rc
