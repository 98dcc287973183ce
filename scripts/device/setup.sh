#!/usr/bin/env bash
# Source on the GPU machine from the repo root: unpacks the SGLang bundle (.devbundle, carried) and installs
# this package without dependencies so SGLang finds the `sglang.srt.plugins` entry point.
source .devbundle/sglang-bundle-setup.sh || return 1
if ! python3 -c "import sglang_dspine.plugin, sglang_dspine.kernels" 2>/dev/null \
   || [ "$(python3 -c 'import sglang_dspine,os;print(os.path.dirname(sglang_dspine.__file__))')" != "$PWD/sglang_dspine" ]; then
  python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/tmp/pip-install.log 2>&1 \
    || { echo "pip install -e . failed:"; tail -20 /tmp/pip-install.log; return 1; }
fi
python3 - <<'PY' || return 1
from importlib.metadata import entry_points
eps = [e.value for e in entry_points(group="sglang.srt.plugins")]
assert "sglang_dspine.plugin:register" in eps, eps
print("sglang-dspine plugin entry point:", eps)
PY
