#!/usr/bin/env bash
# Lays this package out in DEST as an installed distribution would, without pip (the GPU machine has no network):
# sglang_dspine, kernels/ as sglang_dspine.kernels, and a dist-info whose sglang.srt.plugins entry point (read
# from setup.py) SGLang's plugin loader finds. Used by setup.sh (every release) and bundle_0523.sh.
#   bash scripts/device/layout_package.sh DEST
set -euo pipefail
dest="${1:?layout_package.sh DEST}"
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
rm -rf "$dest" && mkdir -p "$dest/sglang_dspine-0.1.0.dist-info"
cp -r "$repo/sglang_dspine" "$dest/sglang_dspine"
cp -r "$repo/kernels" "$dest/sglang_dspine/kernels"
printf 'Metadata-Version: 2.1\nName: sglang-dspine\nVersion: 0.1.0\n' >"$dest/sglang_dspine-0.1.0.dist-info/METADATA"
python3 - "$repo/setup.py" "$dest/sglang_dspine-0.1.0.dist-info/entry_points.txt" <<'PY'
import re, sys
eps = re.search(r'"sglang.srt.plugins": \["([^"]+)"\]', open(sys.argv[1]).read()).group(1)
open(sys.argv[2], "w").write(f"[sglang.srt.plugins]\n{eps.replace('=', ' = ', 1)}\n")
PY
