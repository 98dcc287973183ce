#!/usr/bin/env bash
# Set up (first run: a virtualenv with SGLang and the pinned packages, a few minutes) and run the CPU test suite.
#   bash scripts/test.sh [--sglang VERSION] [PATH[::TEST] ...] [pytest flags]
# With test paths, runs just those; without, the whole tests/ folder, or, for an import-time environment (below),
# the tests that import SGLang: the plugin, serving-glue, log-prob, checkpoint and verify-shape tests, and
# serving_features' checker on answers built by that SGLang's response code (all but its xgrammar test: an import-time
# environment holds no xgrammar). Other arguments go to pytest.
# --sglang: one of setup.py's SGLANG_RELEASES (default: the first, the GPU-verified one, in .venv); another
# release gets its own virtualenv, .venv-VERSION. Every package is installed at the version in
# locks/sglang-VERSION.txt (scripts/lock.sh refreshes it), so a dependency's new release cannot change the
# result. Where locks/sglang-VERSION.imports exists the lock is an import-time environment (SGLang without its
# dependencies, and what its imports need), installed exactly as written.
# pytest's "no tests collected" (exit 5) fails like any error.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
releases="$(sglang_releases)"
default="${releases%% *}"
version="$default"
if [ "${1:-}" = "--sglang" ]; then
  version="${2:?test.sh: --sglang needs a VERSION}"
  shift 2
  case " $releases " in
    *" $version "*) ;;
    *) echo "test.sh: --sglang $version: not one of setup.py's SGLANG_RELEASES ($releases)" >&2; exit 2 ;;
  esac
fi
if [ "$version" = "$default" ]; then
  VENV="${VENV:-.venv}"
else
  VENV="${VENV:-.venv-$version}"
fi
lock="locks/sglang-$version.txt"
if [ ! -f "$lock" ]; then
  echo "test.sh: $lock not found; make it with: bash scripts/lock.sh $version" >&2
  exit 2
fi
# --no-cache-dir: a venv of several GB, no second copy in a cache. No -q: the first install takes minutes, and
# pip's progress shows it is not stuck. PIP_CONSTRAINT pins pip's isolated build
# environment (setuptools), which does not see -c or -r. Installed once, again only when the lock, setup.py or
# this script change (scripts/env.sh).
key="$(env_key "$lock" "locks/sglang-$version.imports" setup.py scripts/test.sh)"
if ! env_current "$VENV" "$key"; then
  [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
  echo "test.sh: installing SGLang $version and this package into $VENV at $lock's versions (first time: several minutes)" >&2
  if [ -f "locks/sglang-$version.imports" ]; then
    PIP_CONSTRAINT="$lock" "$VENV/bin/python" -m pip install --disable-pip-version-check --no-cache-dir \
      --no-deps -r "$lock"
    PIP_CONSTRAINT="$lock" "$VENV/bin/python" -m pip install --disable-pip-version-check --no-cache-dir \
      --no-deps -e .
  else
    # -c pins what this install resolves.
    PIP_CONSTRAINT="$lock" "$VENV/bin/python" -m pip install --disable-pip-version-check --no-cache-dir \
      -c "$lock" -e ".[test,lab]"
  fi
  env_mark "$VENV" "$key"
fi
if [ -f "locks/sglang-$version.imports" ]; then
  all_tests=(tests/test_plugin.py tests/test_serving_glue.py tests/test_logprobs.py tests/test_checkpoint.py
             tests/test_verify_shapes.py
             tests/test_serving_features.py --deselect tests/test_serving_features.py::test_grammars_compile_and_samples)
else
  all_tests=(tests)
fi
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
exec "$VENV/bin/python" -m pytest "${all_tests[@]}" "$@"
