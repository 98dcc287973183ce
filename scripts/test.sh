#!/usr/bin/env bash
# Set up (first run: a virtualenv in .venv with sglang 0.5.17 and its pins, ~3 min) and run the CPU test suite.
#   bash scripts/test.sh [PATH[::TEST] ...] [pytest flags]
# With test paths, runs just those; without, the whole tests/ folder. Other arguments go to pytest.
# Every package is installed at the version in locks/sglang-VERSION.txt (scripts/lock.sh refreshes it), so a
# dependency's new release cannot change the result. pytest's "no tests collected" (exit 5) fails like any error.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
version="$(sed -n 's/.*"sglang==\([^"]*\)".*/\1/p' setup.py)"
lock="locks/sglang-$version.txt"
if [ ! -f "$lock" ]; then
  echo "test.sh: $lock not found; make it with: bash scripts/lock.sh $version" >&2
  exit 2
fi
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
# -c pins what this install resolves; PIP_CONSTRAINT pins pip's isolated build environment too (setuptools),
# which does not see -c. --no-cache-dir: a ~9 GB venv, no second copy in a cache.
PIP_CONSTRAINT="$lock" "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-cache-dir \
  -c "$lock" -e ".[test,lab]"
# A test path is an argument naming a file or folder under tests/ (optionally with ::TEST), unless it is the
# value of a pytest option given as a separate argument (-k EXPR, -p PLUGIN, --ignore PATH, ...).
paths=no
tests_dir="$(realpath tests)"
prev=""
for a in "$@"; do
  case "$prev" in
    -k|-m|-p|-c|-o|-W|-n|-r|--deselect|--ignore|--ignore-glob|--rootdir|--basetemp|--confcutdir|--junitxml|\
    --junit-xml|--maxfail|--durations|--tb|--log-level|--timeout) prev=""; continue ;;
  esac
  prev="$a"
  case "$a" in -*) continue ;; esac
  p="${a%%::*}"
  if [ -e "$p" ]; then
    case "$(realpath "$p")/" in "$tests_dir"/*) paths=yes ;; esac
  fi
done
if [ "$paths" = yes ]; then
  exec "$VENV/bin/python" -m pytest "$@"
fi
exec "$VENV/bin/python" -m pytest tests "$@"
