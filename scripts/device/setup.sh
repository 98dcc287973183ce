#!/usr/bin/env bash
# Source on the GPU machine from the repo root: unpacks the SGLang bundle (.devbundle, carried) and lays this
# package out as an installed distribution would (sglang_dspine + kernels as sglang_dspine.kernels + a
# dist-info whose entry point SGLang's plugin loader finds). The machine has no network, so no pip build.
source .devbundle/sglang-bundle-setup.sh || return 1
python3 -m pip uninstall -q -y sglang-dspine >/dev/null 2>&1  # an earlier editable install would shadow this layout
DSPINE_SITE=/tmp/dspine-site
rm -rf "$DSPINE_SITE" && mkdir -p "$DSPINE_SITE/sglang_dspine-0.1.0.dist-info"
cp -r sglang_dspine "$DSPINE_SITE/sglang_dspine"
cp -r kernels "$DSPINE_SITE/sglang_dspine/kernels"
printf 'Metadata-Version: 2.1\nName: sglang-dspine\nVersion: 0.1.0\n' > "$DSPINE_SITE/sglang_dspine-0.1.0.dist-info/METADATA"
python3 - "$DSPINE_SITE/sglang_dspine-0.1.0.dist-info/entry_points.txt" <<'PY' || return 1
import re, sys
src = open("setup.py").read()
eps = re.search(r'"sglang.srt.plugins": \["([^"]+)"\]', src).group(1)
open(sys.argv[1], "w").write(f"[sglang.srt.plugins]\n{eps.replace('=', ' = ', 1)}\n")
PY
# Not the repo root on the path (sglang_dspine/source_files.py says why).
export PYTHONPATH="$DSPINE_SITE:$PYTHONPATH"
# Checked from /tmp, never the repo root.
(cd /tmp && python3 - <<'PY') || return 1
from importlib.metadata import entry_points
import sglang_dspine.kernels
eps = [e.value for e in entry_points(group="sglang.srt.plugins")]
assert "sglang_dspine.serving.plugin:register" in eps, eps
print("sglang-dspine plugin entry point:", eps)
PY
