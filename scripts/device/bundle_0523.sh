#!/usr/bin/env bash
# SGLang 0.5.23 on the H200 (CPython 3.12, torch 2.11 image, no network): a site folder with torch 2.14.1,
# triton 3.8.0, sglang 0.5.23, sglang-kernel 0.4.10, flashinfer 0.7.2, transformers 5.19.0 ... pinned with sha256
# in locks/device-sglang-0.5.23.txt, carried in pieces by scripts/device/carry.sh, unpacked there into
# /tmp/site-0523 ahead of the machine's own site-packages. torch's CUDA libraries are the machine's
# (nvidia/cu13, cudnn, cusparselt, nvshmem linked in from its torch install) except NCCL, which travels.
#
# Here (repo root, needs PyPI; ~1.6 GB download into BUNDLE_WORK, default /tmp/bundle-0523):
#   bash scripts/device/bundle_0523.sh build       # download, unpack, trim, tar, carry.sh pack: prints the pieces
#        MEASURE=1 ... build                       #   also sizes under xz -9e and zstd -19 --long (slow)
#        KEEP_SM=90 ... build                      #   EXPERIMENTAL, not yet run on a GPU: other GPUs' cubins in
#                                                  #   torch/NCCL/FA3 fatbins made zero streams (bundle_0523.py)
#        BUNDLE_PARTS="sglang-0523" ... build      #   pack only these parts (default: all three)
#        BUNDLE_NAME=sglang-0523-sm90 ... build    #   other part names (then the same BUNDLE_NAME for setup)
#   bash scripts/device/bundle_0523.sh check-cpu   # the built site in a CPython 3.12 venv here: imports, no GPU
#   bash scripts/device/bundle_0523.sh relock      # re-download the lock's pins and rewrite their sha256s
#   bash scripts/device/bundle_0523.sh plan        # the device calls for what build left in .carry-store
#   bash scripts/device/bundle_0523.sh aot         # FlashInfer's topk and sampling modules built here for the H200
#        AOT_MODULES="topk" ... aot                #   (sm_90a, CUDA 13.0 nvcc from PyPI, FlashInfer's own build.ninja;
#                                                  #   topk 626 s on 2 cores on 2026-12-04) into BUNDLE_WORK/aot/store;
#                                                  #   build then puts them in the jit part: FlashInfer loads them as
#                                                  #   they are there (flashinfer/data/aot), nothing compiles. Then:
#        BUNDLE_PARTS="sglang-0523-jit" PIECE_MIB=61 ... build   # the jit part alone again, or, faster, from the
#   BUNDLE_PARTS="sglang-0523-jit" PIECE_MIB=61 bash scripts/device/bundle_0523.sh repack   # trimmed tree build left
#                                                  # in BUNDLE_WORK (no download, unpack or trim): prebuilt modules
#                                                  # placed, tarred, packed
# Fewer calls: the pieces travel beside the working tree (~25 MiB, 18 of it models/default). With models/ and
# benchmarks/results/ set aside for the piece calls (`carry.sh aside`, then `carry.sh back`: a 1.6 MiB tree),
# pieces of 61 MiB fit (build with PIECE_MIB=61, or `carry.sh resplit`), and `plan` packs them into 16 calls.
# There: the calls `plan` prints, back to back in one lease (the machine keeps /tmp while warm, ~30 s), each
# carrying its pieces and sums straight from .carry-store (no stage step here between calls) and running:
#   bash scripts/device/carry.sh receive .carry-store/NAME [...]
# and in the call of the last piece (or any later call of the lease):
#   source scripts/device/bundle_0523.sh setup     # assembles + unpacks every fully received part, links the
#                                                  # machine's nvidia libs, exports the env (also written to
#                                                  # /tmp/site-0523/env.sh), lays out sglang_dspine, checks imports
# Later calls of the lease run any device script on 0.5.23 with DEVICE_SGLANG=0.5.23 (scripts/device/setup.sh).
# Parts: sglang-0523 (core, needed), sglang-0523-jit (needed too: FlashInfer JIT sources + torch headers: FlashInfer
# sampling/attention), sglang-0523-fa3 (sgl_kernel's FA3 flash_ops: --attention-backend fa3, SGLang's H200 default).
_b23_main() {
  local repo lock name_core="${BUNDLE_NAME:-sglang-0523}"
  repo="$(cd "$(dirname "${BASH_SOURCE[0]:-$0}")/../.." && pwd)"
  lock="$repo/locks/device-sglang-0.5.23.txt"
  local work="${BUNDLE_WORK:-/tmp/bundle-0523}" site="${SITE_0523:-/tmp/site-0523}"
  local parts="${BUNDLE_PARTS:-$name_core $name_core-jit $name_core-fa3}"
  case "${1:-}" in
    build) _b23_build ;;
    relock) _b23_relock ;;
    plan) _b23_plan ;;
    check-cpu) _b23_check_cpu ;;
    aot) _b23_aot ;;
    repack) _b23_repack ;;
    setup) _b23_setup ;;
    *) sed -n '2,/^_b23_main/p' "${BASH_SOURCE[0]:-$0}" | sed '$d'; return 2 ;;
  esac
}

_b23_pip_download() {  # DEST ARGS...: cp312 manylinux x86_64 wheels only, no dependencies
  local dest="$1"; shift
  local plats="" n
  for n in manylinux_2_34 manylinux_2_28 manylinux_2_27 manylinux_2_26 manylinux_2_24 manylinux_2_18 \
           manylinux_2_17 manylinux2014 manylinux_2_5 manylinux1; do plats="$plats --platform ${n}_x86_64"; done
  # The host's pip constraints cap torch; the lock pins everything exactly.
  PIP_CONSTRAINT="" python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp $plats -d "$dest" "$@" 2> >(grep -v "^WARNING: Location 'file:" >&2)
}

_b23_relock() {
  local dl="$work/relock" pins
  rm -rf "$dl" && mkdir -p "$dl"
  pins="$(grep -v '^#' "$lock" | sed 's/ --hash=.*//' | grep .)"
  # shellcheck disable=SC2086
  _b23_pip_download "$dl" $pins || return 1
  python3 - "$lock" "$dl" <<'PY'
import hashlib, pathlib, re, sys
lock, dl = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
norm = lambda s: re.sub(r"[-_.]+", "_", s.lower())
out = []
for line in lock.read_text().splitlines():
    if not line.strip() or line.startswith("#"):
        out.append(line); continue
    pin = line.split(" --hash=")[0].strip(); name, ver = pin.split("==")
    (whl,) = [f for f in dl.glob("*.whl") if norm(f.name.split("-")[0]) == norm(name) and f.name.split("-")[1] == ver]
    out.append(f"{pin} --hash=sha256:{hashlib.sha256(whl.read_bytes()).hexdigest()}")
lock.write_text("\n".join(out) + "\n")
print(f"relock: {len([l for l in out if '==' in l])} pins rewritten in {lock}")
PY
  mv "$dl"/*.whl "$work/wheels/" 2>/dev/null; rm -rf "$dl"
}

_b23_tree_bytes() {  # what one device call carries besides .carry: tracked + untracked-not-ignored files
  (cd "$repo" && { git ls-files -z; git ls-files -z --others --exclude-standard; } | xargs -0 stat -c %s 2>/dev/null \
    | awk '{s+=$1} END {print s+0}')
}

_b23_build() {
  set -o pipefail
  local t0 t1 mib tree fit
  t0=$(date +%s)
  command -v strip >/dev/null && command -v readelf >/dev/null || { echo "build: needs binutils (strip, readelf)" >&2; return 1; }
  mkdir -p "$work/wheels"
  echo "build: downloading the lock's wheels into $work/wheels (kept between builds)"
  _b23_pip_download "$work/wheels" --require-hashes -r "$lock" || return 1
  rm -rf "$work/site" "$work/opt" "$work"/*.tar
  echo "build: unpacking into $work/site"
  (cd "$repo" && python3 scripts/device/bundle_0523.py unpack "$work/site" "$lock" "$work/wheels") || return 1
  local unpacked trimmed
  unpacked=$(du -sb "$work/site" | cut -f1)
  echo "build: trimming (manifest: $work/manifest.txt)"
  (cd "$repo" && python3 scripts/device/bundle_0523.py trim "$work/site" "$work/opt" "$lock" "$work/manifest.txt" \
    ${KEEP_SM:-}) || return 1
  trimmed=$(du -sb "$work/site" | cut -f1)
  # FlashInfer modules built ahead of time (bundle_0523.sh aot) into the jit part, where FlashInfer loads them from
  # (flashinfer/data/aot/<name>/<name>.so); after trim, so the manifest stays that of the wheels
  local aot_line=""
  if [ -d "$work/opt/jit/flashinfer/data" ]; then
    aot_line="$(python3 "$repo/scripts/device/bundle_0523.py" aot-place "$work/opt/jit" "$work/aot/store" "$lock" \
      | tee /dev/stderr | tr '\n' ';')" || return 1
  fi
  # The piece size that still fits one call beside the working tree (64 MiB in all).
  tree=$(_b23_tree_bytes)
  fit=$(( (64 * 1048576 - tree - 16384) / 1048576 ))  # 16 KiB: the sums file beside the piece
  mib="${PIECE_MIB:-$fit}"  # default: the largest that fits
  [ "$mib" -le "$fit" ] || echo "build: WARNING the working tree is $((tree / 1000)) kB: a ${mib} MiB piece does not fit one call; use PIECE_MIB=$fit" >&2
  _b23_pack_parts build "$mib" || return 1
  if [ "$name_core" = sglang-0523 ] && [ -z "${KEEP_SM:-}" ]; then  # the repo's manifest: the default build only
    cp "$work/manifest.txt" "$repo/locks/device-sglang-0.5.23.manifest.txt"
  fi
  t1=$(date +%s)
  python3 - "$lock" "$work" "$repo/.carry-store" "$unpacked" "$trimmed" "$mib" "$tree" "$((t1 - t0))" "$parts" "$aot_line" <<'PY' | tee "$work/summary.txt"
import pathlib, sys
lock, work, store = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), pathlib.Path(sys.argv[3])
unpacked, trimmed, mib, tree, secs = map(int, sys.argv[4:9])
parts = sys.argv[9].split()
pins = [l.split(" --hash")[0] for l in lock.read_text().splitlines() if l.strip() and not l.startswith("#")]
names = {p.split("==")[0].lower().replace("_", "-") for p in pins}
dl = 0
for w in (work / "wheels").glob("*.whl"):
    n = w.name.split("-")[0].lower().replace("_", "-")
    if n in names:
        dl += w.stat().st_size
M = 1e6
print(f"bundle 0.5.23: {len(pins)} wheels, {dl / M:.1f} MB downloaded; unpacked {unpacked / M:.1f} MB; "
      f"core after trims {trimmed / M:.1f} MB")
total_calls = 0
for part in parts:
    tar = (work / f"{part}.tar").stat().st_size
    pieces = sorted((store / part).glob(f"{part}.xz.part*"))
    xz = sum(p.stat().st_size for p in pieces)
    total_calls += len(pieces)
    print(f"  {part:18s} tar {tar / M:8.1f} MB  xz -6 {xz / M:7.1f} MB  {len(pieces):2d} pieces of {mib} MiB = {len(pieces)} device calls")
print(f"working tree carried with each piece: {tree / M:.1f} MB; build took {secs} s here")
aot = sys.argv[10].strip(";")
if aot:
    print("FlashInfer modules in the jit part: " + aot.replace(";", "; "))
print(f"device calls: core alone {len(sorted((store / parts[0]).glob('*.part*')))}, all parts {total_calls} "
      "(setup runs in the call of the last piece)")
PY
  if [ "${MEASURE:-0}" = 1 ]; then _b23_measure; fi
}

_b23_aot() {  # FlashInfer JIT modules built here for the H200: see AOT_MODULES in bundle_0523.py
  set -o pipefail
  local py="$repo/scripts/device/bundle_0523.py" aotw="$work/aot" cuda m key ninja so t0 secs
  local vpy="${AOT_PYTHON:-$repo/.venv/bin/python}"  # torch + tvm_ffi, only to run FlashInfer's ninja generator
  command -v ninja >/dev/null && command -v gcc >/dev/null || { echo "aot: needs ninja and gcc" >&2; return 1; }
  "$vpy" -c 'import torch, tvm_ffi, filelock' 2>/dev/null \
    || { echo "aot: $vpy lacks torch/tvm_ffi (bash scripts/test.sh makes .venv; or set AOT_PYTHON)" >&2; return 1; }
  local tvm_have tvm_want
  tvm_have="$("$vpy" -c 'from importlib.metadata import version; print(version("apache-tvm-ffi"))')"
  tvm_want="$(grep -i '^apache-tvm-ffi==' "$lock" | sed 's/ --hash.*//; s/.*==//')"
  [ "$tvm_have" = "$tvm_want" ] || echo "aot: WARNING tvm-ffi $tvm_have here, $tvm_want in the lock (its headers are compiled in)" >&2
  mkdir -p "$aotw/wheels" "$aotw/store" "$work/wheels"
  # the toolchain (pinned with sha256 in bundle_0523.py) and the lock's flashinfer wheel
  python3 -c 'import sys; sys.path.insert(0, sys.argv[1]); import bundle_0523 as b; print("\n".join(b.AOT_TOOLCHAIN))' \
    "$repo/scripts/device" >"$aotw/toolchain.txt" || return 1
  _b23_pip_download "$aotw/wheels" --require-hashes -r "$aotw/toolchain.txt" || return 1
  grep -i '^flashinfer-python==' "$lock" >"$aotw/flashinfer.txt"
  _b23_pip_download "$work/wheels" --require-hashes -r "$aotw/flashinfer.txt" || return 1
  cuda="$aotw/cuda"
  if [ ! -x "$cuda/bin/nvcc" ]; then
    rm -rf "$aotw/toolchain" && mkdir -p "$aotw/toolchain"
    for w in "$aotw"/wheels/*.whl; do python3 -m zipfile -e "$w" "$aotw/toolchain" || return 1; done
    ln -sfn "$aotw/toolchain/nvidia/cu13" "$cuda"
    chmod +x "$cuda"/bin/* "$cuda"/nvvm/bin/* 2>/dev/null
    # the link line is FlashInfer's (-L$cuda_home/lib64 -L$cuda_home/lib64/stubs -lcudart -lcuda): the wheels'
    # lib/ as lib64, libcudart.so, and a stub libcuda.so.1 (no driver here; the machine's is loaded there)
    ln -sfn lib "$cuda/lib64" && ln -sf libcudart.so.13 "$cuda/lib/libcudart.so" && mkdir -p "$cuda/lib/stubs"
    echo 'void dspine_libcuda_stub(void) {}' >"$aotw/stub.c"
    gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$cuda/lib/stubs/libcuda.so" "$aotw/stub.c" || return 1
  fi
  "$cuda/bin/nvcc" --version | tail -2
  python3 "$py" aot-src "$aotw/src" "$lock" "$work/wheels" || return 1
  local variant log
  for m in ${AOT_MODULES:-topk sampling}; do
    variant=""
    [ "$m" = topk ] && [ "${AOT_TOPK_CUB:-1}" = 0 ] && variant=nocub  # see AOT_NOCUB_STUB in bundle_0523.py
    key="$(python3 "$py" aot-key "$m" "$lock" $variant)" || return 1
    if [ -f "$aotw/store/$key.so" ]; then echo "aot: $m: $aotw/store/$key.so already built"; continue; fi
    ninja="$(cd /tmp && CUDA_HOME="$cuda" "$vpy" "$py" aot-ninja "$aotw/src" "$m" "$aotw/ws${variant:+-$variant}")" \
      || return 1
    log="$aotw/$m${variant:+-$variant}.log"
    echo "aot: $m${variant:+ ($variant)}: building $ninja with ${AOT_JOBS:-$(nproc)} jobs (log $log)"
    t0=$(date +%s)
    (cd "$(dirname "$ninja")" && ninja -v -j "${AOT_JOBS:-$(nproc)}" -f "$ninja") >"$log" 2>&1 \
      || { tail -20 "$log" >&2; echo "aot: $m: build failed" >&2; return 1; }
    secs=$(( $(date +%s) - t0 ))
    so="$(dirname "$ninja")/$m.so"
    cp "$so" "$aotw/store/$key.so"
    python3 - "$aotw/store/$key.json" "$m" "$secs" "$("$cuda/bin/nvcc" --version | grep -o 'V[0-9][0-9.]*')" "$ninja" \
      "$variant" <<'PY'
import datetime, json, sys
out, module, secs, nvcc, ninja, variant = sys.argv[1:7]
json.dump({"module": module, "variant": variant or "full", "seconds": int(secs), "nvcc": nvcc, "arch": "sm_90a",
           "host_cores": __import__("os").cpu_count(),
           "built": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
           "build_ninja": open(ninja).read()}, open(out, "w"), indent=1)
PY
    echo "aot: $m: $(du -h "$aotw/store/$key.so" | cut -f1) in $secs s -> $aotw/store/$key.so"
  done
  echo "aot: done; the jit part takes them at its next build: BUNDLE_PARTS=\"$name_core-jit\" PIECE_MIB=61 bash scripts/device/bundle_0523.sh build"
}

_b23_pack_parts() {  # LABEL MIB: each part of $parts from the trimmed tree (core: site/, others: opt/NAME/) into
  # $work/PART.tar, reproducibly (sorted names, no owners or times), and into MIB-MiB pieces in .carry-store
  local part dir
  for part in $parts; do
    case "$part" in
      "$name_core") dir="$work/site" ;;
      *) dir="$work/opt/${part#"$name_core"-}" ;;
    esac
    [ -d "$dir" ] || { echo "$1: no $dir" >&2; return 1; }
    tar --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 -C "$dir" -cf "$work/$part.tar" . || return 1
    (cd "$repo" && PIECE_MIB="$2" bash scripts/device/carry.sh pack "$part" "$work/$part.tar") || return 1
  done
}

_b23_repack() {  # the parts again from the trimmed tree of the last build (BUNDLE_WORK/site, opt/): after `aot`
  set -o pipefail
  [ -d "$work/site" ] && [ -d "$work/opt" ] || { echo "repack: no trimmed tree in $work: run build" >&2; return 1; }
  [ -d "$work/opt/jit/flashinfer/data" ] \
    && { python3 "$repo/scripts/device/bundle_0523.py" aot-place "$work/opt/jit" "$work/aot/store" "$lock" || return 1; }
  _b23_pack_parts repack "${PIECE_MIB:-61}"
}

_b23_measure() {  # other compressors on the core tar: size and pieces (decompression needs xz or python lzma there)
  local tar="$work/$name_core.tar" mib="${PIECE_MIB:-40}" t s
  for c in "xz -9e -T0 -c" "zstd -19 --long=30 -T0 -c" "zstd --ultra -22 --long=31 -T0 -c"; do
    command -v "${c%% *}" >/dev/null || continue
    t=$(date +%s)
    s=$($c "$tar" | wc -c)
    echo "measure: $c: $((s / 1000000)) MB, $(( (s + mib * 1048576 - 1) / (mib * 1048576) )) pieces, $(( $(date +%s) - t )) s" | tee -a "$work/summary.txt"
  done
}

_b23_plan() {  # the device calls for the pieces in .carry-store: packed greedily, as many as fit beside the tree
  local tree
  tree=$(_b23_tree_bytes)
  python3 - "$repo/.carry-store" "$tree" $parts <<'PY'
import json, pathlib, sys
store, tree, parts = pathlib.Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
room = 64 * 1048576 - tree - 16384 * len(parts)  # one call: 64 MiB with the tree and the sums files
pieces = [(p.stat().st_size, f"{part} {k}") for part in parts
          for k, p in enumerate(sorted((store / part).glob(f"{part}.xz.part*")), 1)]
calls, sizes = [], []  # first fit, largest piece first
for n, name in sorted(pieces, key=lambda x: -x[0]):
    if n > room:
        sys.exit(f"plan: {name} ({n >> 20} MiB) does not fit beside a {tree >> 20} MiB tree: resplit smaller")
    i = next((i for i, s in enumerate(sizes) if s + n <= room), None)
    if i is None:
        calls.append([]); sizes.append(0); i = len(calls) - 1
    calls[i].append(name); sizes[i] += n
print(f"# {len(calls)} device calls, back to back in one lease (tree {tree / 1048576:.1f} MiB); each carries its"
      " pieces straight from .carry-store (no stage step between calls: the machine goes after ~30 s idle)")
for c in calls:
    names = sorted({n.split()[0] for n in c})
    carry = [f".carry-store/{n}/{n}.xz.part{int(k) - 1:02d}" for n, k in (x.split() for x in c)]
    carry += [f".carry-store/{n}/{n}.sha256" for n in names]
    if len(carry) > 8:  # a device call carries at most 8 paths
        sys.exit(f"plan: a call would carry {len(carry)} paths (at most 8): {carry}")
    dirs = " ".join(f".carry-store/{n}" for n in names)
    print(f"carry {json.dumps(carry)}  command: bash scripts/device/carry.sh receive {dirs}")
print("# in the last call, after receive: && source scripts/device/bundle_0523.sh setup")
print("# (planned with the tree as it is now; `carry.sh aside` first shrinks it, `carry.sh back` after the last call)")
PY
}

_b23_check_cpu() {
  # Here, no GPU: the built site ahead of a CPython 3.12 venv that stands in for the machine's own packages,
  # with CUDA libraries of torch 2.14.1's pins from .venv-0.5.23 (scripts/test.sh --sglang 0.5.23 makes it)
  # or, failing that, none (then import torch cannot load libtorch_cuda and the check stops there).
  local py312 venv="$work/venv312" chk="$work/check-site"
  local c
  py312=""
  for c in "${PY312:-}" python3.12 $(ls "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3.12 2>/dev/null) \
           "$(command -v uv >/dev/null && uv python find 3.12 2>/dev/null)"; do
    [ -n "$c" ] && "$c" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null && { py312="$c"; break; }
  done
  [ -n "$py312" ] || { echo "check-cpu: no CPython 3.12 here (set PY312, or: uv python install 3.12)" >&2; return 1; }
  [ -d "$work/site" ] || { echo "check-cpu: no $work/site: run build first" >&2; return 1; }
  if [ ! -x "$venv/bin/python" ]; then
    "$py312" -m venv "$venv" || return 1
    # The machine's packages that SGLang imports (KINDS.md's list), at the CPU test lock's versions where it has them.
    PIP_CONSTRAINT="" "$venv/bin/python" -m pip install -q --disable-pip-version-check \
      numpy==2.4.6 requests aiohttp==3.14.5 psutil==7.2.2 pillow==13.0.0 packaging==26.4 PyYAML==6.0.4 \
      regex==2026.11.19 safetensors==0.8.0 tokenizers==0.23.2 huggingface_hub==1.33.0 tqdm sentencepiece==0.2.1 \
      tiktoken einops==0.8.2 filelock fsspec Jinja2 sympy==1.14.0 networkx typing_extensions setuptools anyio httpx \
      click typer rich attrs uvloop prometheus-client xxhash msgpack scipy ninja nvidia-ml-py pyarrow pandas \
      cloudpickle protobuf "cuda-bindings==13.5.0" "cuda-pathfinder==1.9.1" pytest || return 1
  fi
  # The site as the machine gets it: core + optional parts in one folder, nvidia libs linked in.
  rm -rf "$chk" && mkdir -p "$chk"
  cp -al "$work/site/." "$chk/" && for d in "$work"/opt/*; do cp -al "$d/." "$chk/"; done
  local sysnv
  sysnv="$(ls -d "$repo"/.venv-0.5.23/lib/python3.*/site-packages/nvidia 2>/dev/null | head -1)"
  if [ -n "$sysnv" ]; then
    for d in "$sysnv"/*; do [ -e "$chk/nvidia/$(basename "$d")" ] || ln -s "$d" "$chk/nvidia/$(basename "$d")"; done
  fi
  local dsp="$work/dspine-site"
  bash "$repo/scripts/device/layout_package.sh" "$dsp" || return 1
  local pth
  pth="$(cd /tmp && "$venv/bin/python" "$repo/scripts/device/bundle_0523.py" pth-paths "$chk")" || return 1
  (cd /tmp && PYTHONPATH="$chk${pth:+:$pth}:$dsp" "$venv/bin/python" "$repo/scripts/device/bundle_0523.py" import-scan) \
    || { echo "check-cpu: a module SGLang imports is missing from the bundle (import scan above)" >&2; return 1; }
  (cd /tmp && PYTHONPATH="$chk${pth:+:$pth}:$dsp" SGLANG_0523_EXPECT_GPU=0 "$venv/bin/python" - <<'PY'
import importlib, sys, time, traceback
t = time.time()
import torch
print(f"check-cpu: python {sys.version.split()[0]}, torch {torch.__version__} from {torch.__file__}, cuda build "
      f"{torch.version.cuda}, nccl {torch.cuda.nccl.version() if hasattr(torch.cuda, 'nccl') else '?'}")
mods = ["triton", "sglang", "flashinfer", "xgrammar", "transformers", "torchvision",
        "sglang.srt.server_args", "sglang.srt.entrypoints.http_server", "sglang.srt.entrypoints.engine",
        "sglang.srt.managers.scheduler", "sglang.srt.managers.tokenizer_manager",
        "sglang.srt.model_executor.model_runner", "sglang.srt.models.qwen3", "sglang.srt.models.dflash",
        "sglang.srt.speculative.dflash_worker_v2", "sglang.srt.speculative.dflash_info_v2",
        "sglang.srt.speculative.dflash_utils", "sglang.srt.layers.attention.triton_backend",
        "sglang.srt.layers.attention.flashinfer_backend", "sglang.srt.layers.sampler",
        "sglang.srt.layers.dual_gemm", "cutlass", "sglang.kernels.ops.gemm.cutedsl_dual_gemm",
        "sglang_dspine.serving.plugin", "sglang_dspine.serving.sglang_patches"]
# sgl_kernel loads its sm90/ build only next to a GPU: these need one (checked there by setup)
gpu_only = ["sgl_kernel", "sglang.srt.layers.attention.flashattention_backend"]
bad = []
for m in mods:
    try:
        importlib.import_module(m)
    except Exception as e:
        bad.append(m)
        print(f"check-cpu: FAIL import {m}: {type(e).__name__}: {e}")
        traceback.print_exc(limit=-3)
for m in gpu_only:
    try:
        importlib.import_module(m)
        print(f"check-cpu: {m} imported (unexpected without a GPU)")
    except Exception as e:
        print(f"check-cpu: {m}: needs a GPU here ({type(e).__name__}: {str(e).strip().splitlines()[-1][:100]})")
import torch.distributed as dist
print(f"check-cpu: torch.distributed nccl available {dist.is_nccl_available()}, cudnn {torch.backends.cudnn.version()}")
import sglang, transformers, triton, flashinfer
print(f"check-cpu: sglang {sglang.__version__}, transformers {transformers.__version__}, triton {triton.__version__}, "
      f"flashinfer {flashinfer.__version__}; {len(mods) - len(bad)}/{len(mods)} modules imported in {time.time() - t:.1f}s")
sys.exit(1 if bad else 0)
PY
  )
}

_b23_setup() {
  local there="${CARRY_THERE:-/tmp/carry}" part sum stamp got=0
  mkdir -p "$site" || return 1
  for part in $parts; do
    stamp="$site/.$part.stamp"
    # the core and the jit part are both needed: without the jit part's FlashInfer sources and headers every
    # speculative server failed at start (33f82f8: DFLASH's verify JIT-builds FlashInfer's sampling, SGLang's
    # JIT kernels include FlashInfer's headers); fa3 only for --attention-backend fa3
    local needed=0
    { [ "$part" = "$name_core" ] || [ "$part" = "$name_core-jit" ]; } && needed=1
    if [ ! -f "$there/$part.sha256" ]; then
      [ "$needed" = 1 ] && [ ! -f "$stamp" ] && { echo "bundle_0523 setup: no piece of $part received (carry.sh receive; every speculative server needs it)" >&2; return 1; }
      continue
    fi
    sum="$(grep -v part "$there/$part.sha256" | cut -c1-64)"
    if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$sum" ]; then
      echo "bundle_0523 setup: $part already unpacked in $site"; got=$((got + 1)); continue
    fi
    local have want
    have=$(ls "$there/$part".xz.part* 2>/dev/null | wc -l); want=$(grep -c part "$there/$part.sha256")
    if [ "$have" -lt "$want" ]; then
      [ "$needed" = 1 ] && { echo "bundle_0523 setup: $part: $have of $want pieces here" >&2; return 1; }
      echo "bundle_0523 setup: $part: $have of $want pieces here, left for later"; continue
    fi
    (cd "$repo" && bash scripts/device/carry.sh assemble "$part" "/tmp/$part.tar") || return 1
    tar -xf "/tmp/$part.tar" -C "$site" || { echo "bundle_0523 setup: untar $part failed" >&2; return 1; }
    rm -f "/tmp/$part.tar" "$there/$part.xz"
    echo "$sum" >"$stamp"; got=$((got + 1))
    echo "bundle_0523 setup: $part unpacked into $site"
  done
  # torch 2.14.1 finds its CUDA libraries at $ORIGIN/../../nvidia/<lib>/lib (RPATH): link the machine's own,
  # except those the bundle carries (nccl).
  local sysnv d
  sysnv="$(cd /tmp && env -u PYTHONPATH python3 -c 'import os, sys, nvidia
print(next(p for p in nvidia.__path__ if not os.path.realpath(p).startswith(os.path.realpath(sys.argv[1]))))' "$site" 2>/dev/null)"
  [ -d "$sysnv" ] || { echo "bundle_0523 setup: the machine's nvidia packages not found" >&2; return 1; }
  mkdir -p "$site/nvidia"
  for d in "$sysnv"/*/; do
    d="${d%/}"; [ -e "$site/nvidia/$(basename "$d")" ] || ln -s "$d" "$site/nvidia/$(basename "$d")"
  done
  # The machine's CUDA library versions against torch 2.14.1's pins.
  (cd /tmp && env -u PYTHONPATH python3 - <<'PY'
from importlib.metadata import version, PackageNotFoundError
pins = {"nvidia-cuda-runtime": "13.0.96", "nvidia-cublas": "13.1.1.3", "nvidia-cudnn-cu13": "9.24.0.43",
        "nvidia-cusparselt-cu13": "0.8.1", "nvidia-nvshmem-cu13": "3.4.5", "nvidia-nccl-cu13": "2.30.7 (carried)",
        "nvidia-cuda-nvrtc": "13.0.88", "nvidia-cufft": "12.0.0.61", "nvidia-curand": "10.4.0.35",
        "nvidia-cusolver": "12.0.4.66", "nvidia-cusparse": "12.6.3.3", "nvidia-nvjitlink": "13.5.37",
        "nvidia-cufile": "1.15.1.6", "nvidia-cuda-cupti": "13.0.85"}
row = []
for n, want in pins.items():
    try:
        have = version(n)
    except PackageNotFoundError:
        have = "absent"
    row.append(f"{n.replace('nvidia-', '')} {have} (torch 2.14.1 pins {want})")
print("bundle_0523 setup: machine's CUDA libs: " + "; ".join(row))
PY
  )
  local cache="${SGLANG_CACHE_ROOT:-/tmp/sglang-cache-0523}" cuda_root="" c nvcc_real=""
  if command -v nvcc >/dev/null 2>&1; then nvcc_real="$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")"; fi
  for c in "${CUDA_HOME:-}" /usr/local/cuda $(ls -d /usr/local/cuda-* 2>/dev/null | sort -rV) "$nvcc_real"; do
    if [ -n "$c" ] && [ -x "$c/bin/nvcc" ] && [ -f "$c/include/cuda_runtime.h" ]; then cuda_root="$c"; break; fi
  done
  local dsp="/tmp/dspine-site-0523"
  (cd /tmp && env -u PYTHONPATH python3 -m pip uninstall -q -y sglang-dspine >/dev/null 2>&1)
  bash "$repo/scripts/device/layout_package.sh" "$dsp" || return 1
  local libcuda="" link="$cache/link"
  libcuda="$( (ldconfig -p 2>/dev/null | awk '/libcuda\.so(\.1)? /{print $NF}'; ls /usr/local/nvidia/lib64/libcuda.so* /usr/lib/x86_64-linux-gnu/libcuda.so* 2>/dev/null) | head -n 1)"
  mkdir -p "$cache"/{tvm-ffi,triton,sglang,inductor,link}
  [ -n "$libcuda" ] && ln -sf "$libcuda" "$link/libcuda.so"
  local curand_inc
  curand_inc="$(ls -d "$sysnv"/cu13/include 2>/dev/null | head -1)"
  # Every variable the 0.5.23 runs need, also for later calls of the lease: source /tmp/site-0523/env.sh
  local pth  # what the site's .pth files would add (PYTHONPATH entries do not run them): cutlass's dsl_packages
  pth="$(cd /tmp && env -u PYTHONPATH python3 "$repo/scripts/device/bundle_0523.py" pth-paths "$site")" || return 1
  local nocub=""  # a prebuilt topk without CUB's kernels (bundle_0523.py AOT_NOCUB_STUB): FlashInfer must not pick CUB
  [ -f "$site/flashinfer/data/aot/topk/NOCUB" ] && nocub=1
  cat >"$site/env.sh" <<EOF
export PYTHONPATH="$site${pth:+:$pth}:$dsp"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 DO_NOT_TRACK=1
export no_proxy="localhost,127.0.0.1,::1" NO_PROXY="localhost,127.0.0.1,::1"
export TVM_FFI_CACHE_DIR="$cache/tvm-ffi" TRITON_CACHE_DIR="$cache/triton" FLASHINFER_WORKSPACE_BASE="$cache"
export SGLANG_CACHE_DIR="$cache/sglang" TORCHINDUCTOR_CACHE_DIR="$cache/inductor"
export LIBRARY_PATH="$link\${LIBRARY_PATH:+:\$LIBRARY_PATH}"
${curand_inc:+export CPLUS_INCLUDE_PATH="$curand_inc\${CPLUS_INCLUDE_PATH:+:\$CPLUS_INCLUDE_PATH}"}
${cuda_root:+export CUDA_HOME="$cuda_root" PATH="\$PATH:$cuda_root/bin"}
# cuDNN: torch 2.14.1 is built against 9.24, the machine has torch 2.11's (9.19 by its pins); every symbol torch
# needs is there, only torch's minor-version check would refuse it.
export PYTORCH_SKIP_CUDNN_COMPATIBILITY_CHECK=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
${nocub:+export FLASHINFER_TOPK_ALGO=default  # the prebuilt topk has no CUB top-k (flashinfer/data/aot/topk/NOCUB)}
EOF
  echo "bundle_0523 setup: env ($site/env.sh):"; sed 's/^/  /' "$site/env.sh"
  # shellcheck disable=SC1090,SC1091
  source "$site/env.sh"
  [ -n "$cuda_root" ] || echo "bundle_0523 setup: WARNING no CUDA toolkit (nvcc + headers): SGLang's JIT kernels cannot build" >&2
  (cd /tmp && python3 - <<'PY'
import importlib, os, sys, time
t = time.time()
import torch
assert torch.__version__.startswith("2.14.1"), f"torch {torch.__version__} from {torch.__file__}: the bundle is not first on sys.path"
cuda = torch.cuda.is_available()
mods = ["triton", "sgl_kernel", "flashinfer", "transformers", "xgrammar", "sglang",
        "sglang.srt.entrypoints.http_server", "sglang.srt.managers.scheduler",
        "sglang.srt.model_executor.model_runner", "sglang.srt.models.qwen3", "sglang.srt.models.dflash",
        "sglang.srt.speculative.dflash_worker_v2", "sglang.srt.layers.attention.triton_backend",
        "sglang.srt.layers.attention.flashinfer_backend", "sglang.srt.layers.attention.flashattention_backend",
        "sglang.srt.layers.dual_gemm", "cutlass", "sglang.kernels.ops.gemm.cutedsl_dual_gemm",
        "sglang_dspine.serving.plugin"]
bad = []
for m in mods:
    try:
        importlib.import_module(m)
    except Exception as e:
        bad.append(m); print(f"bundle_0523 check: FAIL import {m}: {type(e).__name__}: {e}")
import sglang, transformers, triton, flashinfer
extra = ""
if cuda:
    # cuBLAS, and torch's own kernels (its fatbin: elementwise, reduction, sort, softmax)
    x = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
    y = (x @ x).float().softmax(-1).topk(4).values.sum() + torch.arange(8, device="cuda").cumsum(0).sum()
    torch.cuda.synchronize(); y.item()
    # torch.linalg on the GPU (libtorch_cuda_linalg: DSpine's transfer space is an eigendecomposition there)
    torch.linalg.eigh(torch.eye(8, device="cuda", dtype=torch.float64))
    import sgl_kernel
    fa3 = os.path.exists(os.path.join(os.path.dirname(sgl_kernel.__file__), "flash_ops.abi3.so"))
    extra = (f", {torch.cuda.get_device_name()} cc {torch.cuda.get_device_capability()}, nccl {torch.cuda.nccl.version()}, "
             f"cudnn {torch.backends.cudnn.version()}, sgl_kernel {sgl_kernel.common_ops.__file__.split('/')[-2]}, fa3 {'present' if fa3 else 'absent'}")
    # FlashInfer modules built ahead of time (jit part, bundle_0523.sh aot): FlashInfer loads them from
    # flashinfer/data/aot as they are. topk run once against torch.topk; a module not there is JIT-built at its first
    # use (topk: past 15 min on this machine), so it is not called here.
    from flashinfer.jit import env as fi_env
    aot = [m for m in ("topk", "sampling") if getattr(fi_env, "get_aot_artifacts", lambda m: ())(m)]
    if "topk" in aot:
        t1 = time.time()
        sc = torch.randn(4, 151936, device="cuda", dtype=torch.bfloat16)
        v, _ = flashinfer.top_k(sc, 16, sorted=True, deterministic=True)
        same = torch.equal(v, torch.topk(sc, 16, dim=-1).values)
        aot[0] = f"topk ({'top_k = torch.topk' if same else 'FAIL: top_k differs from torch.topk'}, {time.time() - t1:.1f} s)"
    extra += f", FlashInfer prebuilt modules: {', '.join(aot) or 'none (JIT-built on first use)'}"
print(f"bundle_0523 check: torch {torch.__version__} cuda {cuda}, sglang {sglang.__version__}, transformers "
      f"{transformers.__version__}, triton {triton.__version__}, flashinfer {flashinfer.__version__}{extra}; "
      f"{len(mods) - len(bad)}/{len(mods)} modules in {time.time() - t:.1f}s")
sys.exit(1 if bad or not cuda else 0)
PY
  ) || { echo "bundle_0523 setup: import check failed" >&2; return 1; }
  (cd /tmp && python3 "$repo/scripts/device/bundle_0523.py" import-scan) \
    || { echo "bundle_0523 setup: a module SGLang imports is missing from the bundle (import scan above)" >&2; return 1; }
  echo "bundle_0523 setup: ready ($got part(s) in $site; later calls: source $site/env.sh)"
}

_b23_main "$@"
_b23_rc=$?
unset -f _b23_main _b23_pip_download _b23_relock _b23_tree_bytes _b23_build _b23_pack_parts _b23_aot _b23_repack _b23_measure _b23_plan _b23_check_cpu \
  _b23_setup
if (return 0 2>/dev/null); then return "$_b23_rc"; else exit "$_b23_rc"; fi
