#!/usr/bin/env bash
# Serve a target with DSPINE speculative decoding (OpenAI-compatible API on port ${PORT:-30000}).
#   bash scripts/serve.sh [TARGET_DIR DRAFTER_DIR] [extra sglang.launch_server args]
# With no model given, serves the built-in default pair in models/default/ (target/ + dspine/).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check -e .
if [ $# -ge 2 ] && [ -d "$1" ] && [ -d "$2" ]; then
  target="$1"; drafter="$2"; shift 2
else
  target=models/default/target; drafter=models/default/dspine
  if [ ! -d "$drafter" ]; then
    echo "No model given and no built-in default pair in models/default/ yet." >&2
    echo "Usage: bash scripts/serve.sh TARGET_DIR DRAFTER_DIR [sglang args]" >&2
    exit 2
  fi
fi
if ! "$VENV/bin/python" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "SGLang serving needs a CUDA GPU; none is visible here." >&2
  exit 2
fi
target="$(realpath "$target")"; drafter="$(realpath "$drafter")"; py="$(cd "$VENV/bin" && pwd)/python"  # not realpath: that would leave the venv
# Run outside the repo root: its top-level kernels/ folder must not shadow the `kernels` package.
cd /tmp
exec "$py" -m sglang.launch_server --model-path "$target" \
  --speculative-algorithm DSPINE --speculative-draft-model-path "$drafter" \
  --port "${PORT:-30000}" --attention-backend triton --sampling-backend pytorch "$@"
