#!/usr/bin/env bash
# FA3 for SGLang 0.5.17 on the H200: SGLang's default attention backend there (`--attention-backend fa3`, or no
# flag). The .devbundle leaves out sgl_kernel/flash_ops.abi3.so (1.07 GB); this carries it in checked pieces.
# Here (repo root, needs PyPI):
#   bash scripts/device/fa3_0517.sh build    # sglang-kernel 0.4.5's wheel (the bundle's pin; sha256 checked), its
#                                            # flash_ops.abi3.so packed by carry.sh into .carry-store/fa3-0517
#   bash scripts/device/fa3_0517.sh plan     # the device calls (with `carry.sh aside` first: 61 MiB pieces)
# There, in one lease, after a call that set up the .devbundle (scripts/device/setup.sh: /tmp/site):
#   bash scripts/device/carry.sh receive .carry-store/fa3-0517          # one call per piece
#   bash scripts/device/fa3_0517.sh setup    # assembles it into /tmp/site/sgl_kernel/ and imports it
# Then `versions.sh sglang-default/sglang-default scale` measures DSPINE's step under FA3 on 0.5.17.
set -euo pipefail
WHEEL=sglang_kernel-0.4.5-cp310-abi3-manylinux2014_x86_64.whl
WHEEL_SHA256=5927a14dfff92ced8b1f7c7d5844144bc574ec58e604d4fd53e6f53c709003a8
NAME=fa3-0517 SO=sgl_kernel/flash_ops.abi3.so
case "${1:-}" in
  build)
    work="${FA3_WORK:-/tmp/fa3-0517}"; mkdir -p "$work"
    [ -f "$work/$WHEEL" ] || PIP_CONSTRAINT="" python3 -m pip download -q --no-deps --only-binary=:all: \
      --python-version 3.12 --implementation cp --platform manylinux2014_x86_64 -d "$work" sglang-kernel==0.4.5
    echo "$WHEEL_SHA256  $work/$WHEEL" | sha256sum -c --quiet || { echo "fa3_0517: $WHEEL: wrong sha256" >&2; exit 1; }
    python3 -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extract(sys.argv[2], sys.argv[3])" \
      "$work/$WHEEL" "$SO" "$work"
    PIECE_MIB="${PIECE_MIB:-61}" bash scripts/device/carry.sh pack "$NAME" "$work/$SO"
    ;;
  plan)
    [ -f ".carry-store/$NAME/$NAME.sha256" ] || { echo "fa3_0517: nothing in .carry-store/$NAME: build first" >&2; exit 1; }
    for p in ".carry-store/$NAME/$NAME".xz.part*; do
      echo "carry [\"$p\", \".carry-store/$NAME/$NAME.sha256\"]  command: bash scripts/device/carry.sh receive .carry-store/$NAME"
    done
    echo "# then, in that call or a later one of the lease: bash scripts/device/fa3_0517.sh setup"
    ;;
  setup)
    site="${SGLANG_SITE:-/tmp/site}"
    [ -d "$site/sgl_kernel" ] || { echo "fa3_0517: no $site/sgl_kernel: set up the .devbundle first (scripts/device/setup.sh)" >&2; exit 1; }
    if [ ! -f "$site/$SO" ]; then  # under another name until whole: a cut assembly is never taken for FA3
      bash scripts/device/carry.sh assemble "$NAME" "$site/$SO.partial" && mv "$site/$SO.partial" "$site/$SO"
    fi
    (cd /tmp && PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" python3 -c \
      "import torch, sgl_kernel.flash_ops as f; print('fa3_0517: FA3 imported from', f.__file__)")
    ;;
  *) sed -n '2,12p' "$0"; exit 2 ;;
esac
