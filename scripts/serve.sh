#!/usr/bin/env bash
# Serve a target with DSPINE speculative decoding (OpenAI-compatible API on port ${PORT:-30000}).
#   bash scripts/serve.sh [TARGET_DIR DRAFTER_DIR] [extra sglang.launch_server args]
# With no model given (no arguments, or only --flags), serves the built-in default pair in models/default/
# (target/ + dspine/) under the model name `default`; a given pair is served under its target folder's name.
# Extra arguments go to the server last, so they override the ones set here (--port, --served-model-name, ...).
set -euo pipefail
cd "$(dirname "$0")/.."
usage="usage: bash scripts/serve.sh [TARGET_DIR DRAFTER_DIR] [sglang args]"
if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then  # before the GPU check: the usage is readable anywhere
  cat <<EOF
$usage
Serves TARGET_DIR with DSPINE speculative decoding from DRAFTER_DIR: an OpenAI-compatible API at /v1 on port
30000 (PORT=N for another); with no folders, the built-in pair in models/default/ as the model "default". Other
arguments go to python -m sglang.launch_server last, so they override this script's (--port, ...).
Needs an NVIDIA GPU. First run: makes the virtualenv .venv (VENV=DIR for another) with this package and SGLang
at the versions in locks/sglang-0.5.17.txt, ~9 GB; again only when the lock, setup.py or this script change.
EOF
  exit 0
fi
if [ $# -ge 1 ] && [ "${1#-}" = "$1" ]; then  # a first argument that is not a --flag: the pair
  if [ $# -lt 2 ] || [ "${2#-}" != "$2" ]; then
    echo "serve.sh: TARGET_DIR $1 given without a DRAFTER_DIR; $usage" >&2
    exit 2
  fi
  for pair in "TARGET_DIR:$1" "DRAFTER_DIR:$2"; do
    what="${pair%%:*}" path="${pair#*:}"
    if [ ! -d "$path" ]; then
      if [ -e "$path" ]; then
        echo "serve.sh: $what $path: a file, not a directory; $usage" >&2
      else
        echo "serve.sh: $what $path: no such directory; $usage" >&2
      fi
      exit 2
    fi
  done
  target="$1"; drafter="$2"; shift 2
  name="$(basename "$(realpath "$target")")"
else
  target=models/default/target; drafter=models/default/dspine; name=default
  if [ ! -d "$drafter" ]; then
    echo "serve.sh: no model given and no built-in default pair in models/default/; $usage" >&2
    exit 2
  fi
fi
# Before any install: serving needs an NVIDIA GPU, and the environment is ~9 GB.
if ! { command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; } && ! ls /dev/nvidia[0-9]* >/dev/null 2>&1; then
  echo "serve.sh: SGLang serving needs a CUDA GPU; none is visible here (no nvidia-smi, no /dev/nvidia0)." >&2
  exit 2
fi
VENV="${VENV:-.venv}"
# The tested versions of the GPU-verified SGLang, the first of setup.py's SGLANG_RELEASES (scripts/test.sh installs
# the same lock); PIP_CONSTRAINT reaches pip's build env too. Installed once, again only when the lock,
# setup.py or this script change (scripts/env.sh).
source scripts/env.sh
lock="$(serve_lock)"
key="$(serve_env_key)"
if ! env_current "$VENV" "$key"; then
  [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
  echo "serve.sh: installing SGLang and this package into $VENV at $lock's versions (first time: ~9 GB, several minutes)" >&2
  PIP_CONSTRAINT="$lock" "$VENV/bin/python" -m pip install --disable-pip-version-check --no-cache-dir \
    --progress-bar on -c "$lock" -e .
  env_mark "$VENV" "$key"
fi
if ! "$VENV/bin/python" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "serve.sh: torch in $VENV sees no CUDA GPU (torch.cuda.is_available() is False)." >&2
  exit 2
fi
target="$(realpath "$target")"; drafter="$(realpath "$drafter")"; py="$(cd "$VENV/bin" && pwd)/python"  # not realpath: that would leave the venv
# Run outside the repo root (sglang_dspine/source_files.py says why).
cd /tmp
exec "$py" -m sglang.launch_server --model-path "$target" \
  --speculative-algorithm DSPINE --speculative-draft-model-path "$drafter" \
  --port "${PORT:-30000}" --served-model-name "$name" --attention-backend triton --sampling-backend pytorch "$@"
