#!/usr/bin/env bash
# Set up (first run: a virtualenv in .venv with sglang 0.5.17 and its pins, ~3 min) and run the CPU test suite.
# Extra arguments go to pytest. pytest's "no tests collected" (exit 5) fails like any other error.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-cache-dir -e ".[test]"  # ~9 GB venv; no second copy in a cache
exec "$VENV/bin/python" -m pytest tests "$@"
