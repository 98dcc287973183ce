#!/usr/bin/env bash
# Source on the GPU machine from the repo root: unpacks the SGLang bundle (.devbundle, carried) and lays this
# package out as an installed distribution would (sglang_dspine + kernels as sglang_dspine.kernels + a
# dist-info whose entry point SGLang's plugin loader finds). The machine has no network, so no pip build.
# The bundle travels on a lease's first call; it is kept in /tmp/devbundle so that later calls of the same lease
# (which carry other things, e.g. pieces of scripts/device/carry.sh, in the 64 MiB) can set up without it.
# DEVICE_SGLANG=0.5.23: SGLang 0.5.23 from the site scripts/device/bundle_0523.sh set up earlier in this lease
# (/tmp/site-0523) instead of the 0.5.17 bundle; the package is laid out afresh from this call's tree.
if [ "${DEVICE_SGLANG:-0.5.17}" = 0.5.23 ]; then
  [ -f /tmp/site-0523/env.sh ] || { echo "setup.sh: DEVICE_SGLANG=0.5.23 but no /tmp/site-0523/env.sh: run 'source scripts/device/bundle_0523.sh setup' first in this lease" >&2; return 1; }
  source /tmp/site-0523/env.sh || return 1  # its PYTHONPATH holds /tmp/dspine-site-0523
  bash scripts/device/layout_package.sh /tmp/dspine-site-0523 || return 1
else
  if [ -f .devbundle/sglang-bundle.tar.xz ]; then
    if ! cmp -s .devbundle/sglang-bundle.tar.xz /tmp/devbundle/sglang-bundle.tar.xz; then
      rm -rf /tmp/devbundle && cp -r .devbundle /tmp/devbundle || return 1
    fi
  elif [ -f /tmp/devbundle/sglang-bundle.tar.xz ]; then
    echo "setup.sh: .devbundle not carried; using the copy an earlier call of this lease left in /tmp/devbundle"
  else
    echo "setup.sh: no .devbundle here and none left by an earlier call: carry .devbundle" >&2
    return 1
  fi
  source /tmp/devbundle/sglang-bundle-setup.sh /tmp/devbundle/sglang-bundle.tar.xz || return 1
  python3 -m pip uninstall -q -y sglang-dspine >/dev/null 2>&1  # an earlier editable install would shadow this layout
  # DSPINE_SITE: a layout of its own for a job that runs beside another (their layouts would replace each other
  # under a starting server); lab2.sh's `patch` writes into the default one.
  site="${DSPINE_SITE:-/tmp/dspine-site}"
  bash scripts/device/layout_package.sh "$site" || return 1
  # Not the repo root on the path (sglang_dspine/source_files.py says why).
  export PYTHONPATH="$site:$PYTHONPATH"
fi
# Checked from /tmp, never the repo root.
(cd /tmp && python3 - <<'PY') || return 1
from importlib.metadata import entry_points
import sglang, torch
import sglang_dspine.kernels
eps = [e.value for e in entry_points(group="sglang.srt.plugins")]
assert "sglang_dspine.serving.plugin:register" in eps, eps
print(f"setup.sh: SGLang {sglang.__version__}, torch {torch.__version__}; sglang-dspine plugin entry point: {eps}")
PY
# Results record GIT_COMMIT (the tree here has no .git): say so at once when it is missing, not after the run.
[ -n "${GIT_COMMIT:-}" ] || echo "setup.sh: GIT_COMMIT is not set: every result of this call records commit 'unknown' (export GIT_COMMIT=<hash> first)" >&2
