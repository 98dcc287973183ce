"""Helper of scripts/device/bundle_0523.sh (stdlib only): unpacks the locked wheels into one site folder, moves
the optional parts out of it, trims what SGLang 0.5.23's imports never touch, and writes the manifest.

  python3 scripts/device/bundle_0523.py unpack SITE LOCK WHEELDIR
  python3 scripts/device/bundle_0523.py trim SITE OPTDIR LOCK MANIFEST [KEEP_SM]
  python3 scripts/device/bundle_0523.py prune-sass FILE KEEP_SM      # e.g. 90: see prune_sass
  python3 scripts/device/bundle_0523.py pth-paths SITE               # what SITE's .pth files add to sys.path
  python3 scripts/device/bundle_0523.py import-scan [PACKAGE ...]    # (bundle first on the path) see import_scan
  python3 scripts/device/bundle_0523.py aot-src DEST LOCK WHEELDIR   # the lock's flashinfer wheel alone, unpacked
  python3 scripts/device/bundle_0523.py aot-key MODULE LOCK [nocub]  # the store name of MODULE's prebuilt .so
  python3 scripts/device/bundle_0523.py aot-place SITE STORE LOCK    # prebuilt modules into SITE/flashinfer/data/aot
  PYTHON-with-torch-and-tvm_ffi scripts/device/bundle_0523.py aot-ninja FLASHINFER_PARENT MODULE WORKSPACE
                                                                     # MODULE's build.ninja by FlashInfer's own code

aot-*: FlashInfer JIT modules built here, ahead of time, for the H200 (see AOT_MODULES; bundle_0523.sh aot).

trim moves each optional part to OPTDIR/<part>/<same relative path> (tarred and carried separately, unpacked into
the same site on the device), deletes the rest of the TRIM table, strips debug sections of shared libraries, and
writes MANIFEST: every pin with its wheel's sha256, and every trim with its size and reason.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

# (glob relative to the site folder, what happens, why). "drop": deleted; "jit"/"fa3": moved to that optional
# part; globs without a match are reported as such in the manifest (a new wheel moved something: look again).
TRIM: list[tuple[str, str, str]] = [
    # ---- optional parts (own tar each, unpacked into the same site if carried) ----
    ("sgl_kernel/flash_ops.abi3.so", "fa3",
     "FA3 kernels (sm90); only --attention-backend fa3 (SGLang's default on an H200) and vision FA3 import it"),
    ("flashinfer/data", "jit",
     "FlashInfer JIT sources/headers (cutlass, cccl, csrc, include, spdlog): only FlashInfer JIT builds, e.g. "
     "--sampling-backend flashinfer or the flashinfer attention backend"),
    ("torch/include", "jit",
     "C++ headers of torch: only torch.utils.cpp_extension builds (--enable-symm-mem's allocator, inductor's "
     "cpp_wrapper); SGLang's own JIT kernels build against tvm-ffi's headers"),
    # ---- sgl_kernel ----
    ("sgl_kernel/flashmla_ops.abi3.so", "drop", "FlashMLA (DeepSeek MLA backends only); import is guarded"),
    ("sgl_kernel/infllm_ops.*.so", "drop", "InfLLM-v2 sparse attention (MiniCPM4 only); loaded lazily on call"),
    ("sgl_kernel/sm100", "drop", "Blackwell build of common_ops; an H200 (cc 9.0) loads sm90/"),
    # ---- torch ----
    # (torch/lib/libtorch_cuda_linalg.so stays: torch.linalg on a GPU dlopens it, and DSpine's transfer space is an
    # eigendecomposition of the target head, computed on its device: seen failing on the H200 without it)
    ("torch/bin/protoc*", "drop", "protobuf compiler, a build tool"),
    # ---- triton ----
    ("triton/backends/nvidia/lib/cupti", "drop", "CUPTI for Triton's Proton profiler only (ncu is on the machine)"),
    ("triton/backends/nvidia/lib/cupti-blackwell", "drop", "CUPTI for Proton on Blackwell"),
    ("triton/_C/libproton.so", "drop", "Proton profiler library, imported only by triton.profiler"),
    ("triton/backends/nvidia/bin/ptxas-blackwell", "drop", "ptxas for cc >= 10.0 only; an H200 (9.0) uses ptxas"),
    ("triton/instrumentation/libGPUInstrumentationTestLib.so", "drop", "Triton's instrumentation test library"),
    # ---- sglang ----
    ("sglang/multimodal_gen", "drop", "diffusion server (sglang serve falls back to LLM on ImportError)"),
    ("sglang/srt/rust_extensions/_server.*.so", "drop",
     "Rust API server, only with SGLANG_RUST_SERVER=1 (default off)"),
    ("sglang/srt/rust_extensions/_grpc.*.so", "drop", "native gRPC server, only with --grpc-port"),
    ("sglang/srt/rust_extensions/_bench.*.so", "drop", "Rust benchmark client (bench_serving --rust-client)"),
    ("tools", "drop", "build helper at top level, not imported"),
    # ---- others ----
    ("mistral_common/data", "drop", "Mistral tokenizer files used only by MistralTokenizer.vN() factories"),
    ("pycountry/locales", "drop", "gettext translations of country names; databases/ kept"),
    ("torch_memory_saver_hook_mode_*cu12.abi3.so", "drop", "CUDA 12 builds; the machine has CUDA 13 (cu13 kept)"),
    ("nvidia_cutlass_dsl/cu13/lib/stubs", "drop", "CuTe DSL runtime stubs for aarch64 and QNX"),
    ("torch_memory_saver_hook_mode_preload.abi3.so", "drop", "ROCm build"),
    ("torch_memory_saver_hook_mode_torch.abi3.so", "drop", "ROCm build"),
    ("build_backend.py", "drop", "flashinfer packaging leftover at top level"),
    ("build_utils.py", "drop", "flashinfer packaging leftover at top level"),
    ("bin", "drop", "console scripts with this host's shebang"),
    ("share", "drop", "man pages"),
    ("**/*.pyi", "drop", "type stubs, never imported"),
    ("**/__pycache__", "drop", "byte code of this host (rebuilt there)"),
    ("**/*.a", "drop", "static libraries, never loaded by Python"),
]


# FlashInfer JIT modules built here ahead of time for the H200 (sm_90a), carried in the jit part as
# flashinfer/data/aot/<name>/<name>.so. FlashInfer 0.7.2 (jit/env.py get_aot_artifacts) loads a module from its
# package's data/aot/<name>/<name>.so when that file exists, as is: no ninja run, no freshness check, no arch check
# (the JIT cache under cached_ops/ is not consulted for it). What each module costs to build on the H200 (16 cores,
# nvcc one thread a file) and who calls it:
#   topk: flashinfer.top_k, which SGLang 0.5.23's DFlash2 selector (models/dflash.py _radix_topk, sorted and
#     deterministic: the radix kernels of csrc/topk.cu) calls whenever flashinfer imports; four files, csrc/cub_topk.cu
#     alone past 13 min (c275234: the prebuild's 900 s ran out), so DFlash2 could not start within a lease.
#   sampling: flashinfer.sampling (stock DFLASH and DSPINE under --sampling-backend flashinfer); 107 s there.
AOT_MODULES: dict[str, tuple[str, str]] = {
    "topk": ("flashinfer.jit.topk", "gen_topk_module"),
    "sampling": ("flashinfer.jit.sampling", "gen_sampling_module"),
}
AOT_ARCH = "9.0a"  # FLASHINFER_CUDA_ARCH_LIST: the H200's; FlashInfer's workspace there is .../0.7.2/90a/
# The CUDA 13.0 toolchain of the machine's torch 2.11+cu130 image (nvcc 13.0, as its /usr/local/cuda) from PyPI,
# only here (never carried): nvcc, cicc (nvvm), crt and CCCL headers, cudart (headers and library to link), curand
# headers (flashinfer/sampling.cuh includes curand.h; on the machine they come from nvidia/cu13/include).
AOT_TOOLCHAIN = [
    "nvidia-cuda-nvcc==13.0.88 --hash=sha256:56fe502eb77625a12f25172caa3cdddb4e4c8ba2c8c17dba44b164761b380f03",
    "nvidia-nvvm==13.0.88 --hash=sha256:c5f41ffeb6466944a026dfa5317d7d85355c119bbec279205d22f1869d1054e0",
    "nvidia-cuda-crt==13.0.88 --hash=sha256:2c8043c7c9e02492716426e9919fc78d2c5b3b2a7a768a88e952676b08aa55a4",
    "nvidia-cuda-cccl==13.0.85 --hash=sha256:e0da7ad981f3a8aff08241b5bfc1af868742a63e2762f53a5171c492ef242649",
    "nvidia-cuda-runtime==13.0.96 --hash=sha256:7f82250d7782aa23b6cfe765ecc7db554bd3c2870c43f3d1821f1d18aebf0548",
    "nvidia-curand==10.4.0.35 --hash=sha256:1aee33a5da6e1db083fe2b90082def8915f30f3248d5896bcec36a579d941bfc",
]


# topk without csrc/cub_topk.cu (AOT_TOPK_CUB=0 bundle_0523.sh aot): that file's CUB DeviceBatchedTopK kernels are
# ~270 MB of PTX for sm_90a, hours of ptxas on 2 cores. FlashInfer 0.7.2's top_k takes CUB only for unsorted,
# non-deterministic calls (can_use_cub_topk), never for DFlash2's selector (sorted, deterministic: radix kernels of
# csrc/topk.cu, built as usual). This variant links, in cub_topk.cu's place, the stand-ins below (the six functions
# flashinfer_topk_binding.cu exports, each raising an error that says so), and is placed with a NOCUB marker beside it,
# from which setup exports FLASHINFER_TOPK_ALGO=default (FlashInfer then never picks CUB). A full build is
# preferred when both are in the store.
AOT_NOCUB_MARKER = "NOCUB"
AOT_NOCUB_STUB = r"""// sglang-dspine scripts/device/bundle_0523.py (AOT_NOCUB_STUB): stand-ins for the entry points of
// FlashInfer's csrc/cub_topk.cu in a topk module built ahead of time without it; each raises an error saying so.
#include "tvm_ffi_utils.h"

using tvm::ffi::Optional;

#define DSPINE_NO_CUB(NAME)                                                                      \
  TVM_FFI_THROW(NotImplementedError) << NAME << ": this prebuilt FlashInfer topk module has no "  \
                                     << "CUB top-k kernels (sglang-dspine bundle_0523 aot, "     \
                                     << "AOT_TOPK_CUB=0); set FLASHINFER_TOPK_ALGO=default"

void cub_topk_page_table_transform(TensorView, TensorView, TensorView, TensorView, Optional<TensorView>,
                                   Optional<TensorView>, int64_t, int64_t, int64_t, Optional<TensorView>,
                                   Optional<TensorView>, Optional<TensorView>) {
  DSPINE_NO_CUB("cub_topk_page_table_transform");
}

int64_t cub_topk_page_table_transform_workspace_size(TensorView, TensorView, int64_t, int64_t, bool, bool) {
  DSPINE_NO_CUB("cub_topk_page_table_transform_workspace_size");
  return 0;
}

void cub_topk_ragged_transform(TensorView, TensorView, TensorView, TensorView, Optional<TensorView>, int64_t,
                               int64_t, Optional<TensorView>) {
  DSPINE_NO_CUB("cub_topk_ragged_transform");
}

int64_t cub_topk_ragged_transform_workspace_size(TensorView, TensorView, int64_t, int64_t, bool) {
  DSPINE_NO_CUB("cub_topk_ragged_transform_workspace_size");
  return 0;
}

void cub_topk(TensorView, TensorView, TensorView, Optional<TensorView>, int64_t, int64_t) {
  DSPINE_NO_CUB("cub_topk");
}

int64_t cub_topk_workspace_size(TensorView, int64_t, int64_t) {
  DSPINE_NO_CUB("cub_topk_workspace_size");
  return 0;
}
"""

def flashinfer_pin(lock: Path) -> tuple[str, str]:
    """(version, wheel sha256) of the lock's flashinfer-python."""
    for pin, h in read_lock(lock).items():
        name, version = pin.split("==")
        if norm(name) == "flashinfer_python":
            return version, h
    raise SystemExit(f"bundle_0523.py: no flashinfer-python in {lock}")


def aot_key(module: str, lock: Path, variant: str = "") -> str:
    """The store name of MODULE's prebuilt .so: what decides its build (FlashInfer's wheel, which fixes its sources
    and flags; the toolchain; the arch). A new flashinfer pin or toolchain gives a new name: the old .so is not
    placed (the module is then JIT-built on the device again, as before)."""
    version, sha = flashinfer_pin(lock)
    parts = [module, version, sha, AOT_ARCH, *AOT_TOOLCHAIN] + ([variant, AOT_NOCUB_STUB] if variant else [])
    h = hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]
    return f"{module}{'-' + variant if variant else ''}-flashinfer{version}-sm{AOT_ARCH.replace('.', '')}-{h}"


def aot_src(dest: Path, lock: Path, wheeldir: Path) -> None:
    """The lock's flashinfer wheel (sha256 checked) unpacked into DEST: its sources and headers to build from."""
    version, want = flashinfer_pin(lock)
    cands = [f for f in wheeldir.glob("*.whl")
             if norm(f.name.split("-")[0]) == "flashinfer_python" and f.name.split("-")[1] == version]
    if len(cands) != 1:
        raise SystemExit(f"aot-src: flashinfer-python=={version}: {len(cands)} wheels in {wheeldir}")
    got = hashlib.sha256(cands[0].read_bytes()).hexdigest()
    if got != want:
        raise SystemExit(f"aot-src: {cands[0].name}: sha256 {got}, the lock says {want}")
    if dest.exists():
        shutil.rmtree(dest)
    with zipfile.ZipFile(cands[0]) as z:
        z.extractall(dest, [n for n in z.namelist() if n.startswith("flashinfer/")])


def aot_ninja(parent: Path, module: str, workspace: Path) -> None:
    """Writes MODULE's build.ninja through FlashInfer's own JitSpec (the flags, sources and link line the device
    would use), importing flashinfer from PARENT as a bare package: its __init__ imports every kernel family (some
    need another CuTe DSL than this host's), and only flashinfer.jit is needed. The environment decides the rest:
    FLASHINFER_CUDA_ARCH_LIST (AOT_ARCH), CUDA_HOME (the toolchain), FLASHINFER_WORKSPACE_BASE (WORKSPACE)."""
    import importlib
    import types

    os.environ["FLASHINFER_CUDA_ARCH_LIST"] = AOT_ARCH
    os.environ["FLASHINFER_WORKSPACE_BASE"] = str(workspace)
    for var in ("CC", "CXX", "FLASHINFER_JIT_DEBUG", "FLASHINFER_JIT_VERBOSE", "FLASHINFER_JIT_LINEINFO",
                "FLASHINFER_NVCC_THREADS", "FLASHINFER_EXTRA_CFLAGS", "FLASHINFER_EXTRA_CUDAFLAGS",
                "FLASHINFER_EXTRA_LDFLAGS"):
        os.environ.pop(var, None)  # as on the machine (its CC only names its gcc)
    pkg = types.ModuleType("flashinfer")
    pkg.__path__ = [str(parent / "flashinfer")]
    sys.modules["flashinfer"] = pkg
    mod_name, fn = AOT_MODULES[module]
    spec = getattr(importlib.import_module(mod_name), fn)()
    spec.write_ninja()
    if module == "topk" and os.environ.get("AOT_TOPK_CUB", "1") == "0":
        stub = spec.build_dir / "dspine_no_cub_topk.cu"
        stub.write_text(AOT_NOCUB_STUB)
        text = spec.ninja_path.read_text()
        cub = str((parent / "flashinfer" / "data" / "csrc" / "cub_topk.cu").resolve())
        if text.count(f"cuda_compile {cub}") != 1:
            raise SystemExit(f"aot-ninja: {cub} is not compiled once in {spec.ninja_path}")
        spec.ninja_path.write_text(text.replace(f"cuda_compile {cub}", f"cuda_compile {stub.resolve()}"))
    print(spec.ninja_path)


def aot_place(site: Path, store: Path, lock: Path) -> list[str]:
    """Copies each module of AOT_MODULES prebuilt for this lock (STORE/<aot_key>.so) to the path FlashInfer loads
    it from, SITE/flashinfer/data/aot/<name>/<name>.so; prints one line a module. Returns the modules placed."""
    placed = []
    for module in AOT_MODULES:
        dest = site / "flashinfer" / "data" / "aot" / module / f"{module}.so"
        marker = dest.parent / AOT_NOCUB_MARKER
        variants = [""] + (["nocub"] if module == "topk" else [])
        key = next((k for k in (aot_key(module, lock, v) for v in variants) if (store / f"{k}.so").is_file()), None)
        if key is None:
            print(f"aot-place: {module}: not prebuilt for this lock ({aot_key(module, lock)}.so not in {store}): "
                  "FlashInfer builds it on the device on first use (bundle_0523.sh aot builds it here)")
            if dest.exists():
                dest.unlink()
            marker.unlink(missing_ok=True)
            continue
        so = store / f"{key}.so"
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(so, dest)
        os.chmod(dest, 0o755)
        nocub = "-nocub-" in key
        if nocub:
            marker.write_text("topk built without csrc/cub_topk.cu (bundle_0523.py AOT_NOCUB_STUB): "
                              "FLASHINFER_TOPK_ALGO=default\n")
        else:
            marker.unlink(missing_ok=True)
        info = store / f"{key}.json"
        meta = json.loads(info.read_text()) if info.is_file() else {}
        print(f"aot-place: {module}{' (without CUB top-k: FLASHINFER_TOPK_ALGO=default there)' if nocub else ''}: "
              f"{so.stat().st_size / 1e6:.1f} MB -> {dest.relative_to(site)} "
              f"(built {meta.get('built', '?')} in {meta.get('seconds', '?')} s with nvcc {meta.get('nvcc', '?')})")
        placed.append(module)
    return placed


def size(p: Path) -> int:
    if p.is_symlink() or p.is_file():
        return p.lstat().st_size
    return sum(f.lstat().st_size for f in p.rglob("*") if f.is_file() or f.is_symlink())


def read_lock(lock: Path) -> dict[str, str]:
    pins = {}
    for line in lock.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            pin, _, h = line.partition(" --hash=sha256:")
            pins[pin.strip()] = h.strip()
    return pins


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name.lower())


def lock_wheels(lock: Path, wheeldir: Path) -> list[Path]:
    """The one wheel of each pin in WHEELDIR, its sha256 checked against the lock."""
    files = list(wheeldir.glob("*.whl"))
    out = []
    for pin, want in read_lock(lock).items():
        name, version = pin.split("==")
        cands = [f for f in files if norm(f.name.split("-")[0]) == norm(name) and f.name.split("-")[1] == version]
        if len(cands) != 1:
            sys.exit(f"bundle_0523.py: {pin}: {len(cands)} wheels in {wheeldir}")
        got = hashlib.sha256(cands[0].read_bytes()).hexdigest()
        if got != want:
            sys.exit(f"bundle_0523.py: {cands[0].name}: sha256 {got}, the lock says {want}")
        out.append(cands[0])
    return out


def unpack(site: Path, lock: Path, wheeldir: Path) -> None:
    """Lays the locked wheels out as pip --target would (purelib/platlib of .data into the site; scripts, headers
    and data left out and reported), keeping the executable bit (Triton's ptxas)."""
    site.mkdir(parents=True, exist_ok=True)
    for whl in lock_wheels(lock, wheeldir):
        with zipfile.ZipFile(whl) as z:
            for info in z.infolist():
                if info.filename.endswith("/"):
                    continue
                parts = info.filename.split("/")
                if parts[0].endswith(".data"):
                    if parts[1] not in ("purelib", "platlib"):
                        print(f"unpack: left out {info.filename} of {whl.name}")
                        continue
                    parts = parts[2:]
                dest = site.joinpath(*parts)
                dest.parent.mkdir(parents=True, exist_ok=True)
                with z.open(info) as src, open(dest, "wb") as out:
                    shutil.copyfileobj(src, out, 1 << 20)
                os.chmod(dest, 0o755 if (info.external_attr >> 16) & 0o111 else 0o644)


def matches(site: Path, pattern: str) -> list[Path]:
    if pattern.startswith("**/"):
        tail = pattern[3:]
        return sorted({p for p in site.rglob(tail)}, key=lambda p: len(p.parts))
    return sorted(site.glob(pattern))


def strip_libs(site: Path, rows: list[str]) -> None:
    """strip --strip-debug on every shared library with debug sections: keeps .symtab and .dynsym and every
    loaded section (code, data, CUDA fatbins); only DWARF goes."""
    for f in sorted(site.rglob("*.so*")):
        if not f.is_file() or f.is_symlink():
            continue
        with open(f, "rb") as fh:
            if fh.read(4) != b"\x7fELF":
                continue
        out = subprocess.run(["readelf", "-SW", str(f)], capture_output=True, text=True).stdout
        if ".debug_" not in out:
            continue
        before = f.stat().st_size
        subprocess.run(["strip", "--strip-debug", str(f)], check=True)
        after = f.stat().st_size
        if before - after > 64 * 1024:
            rows.append(f"{(before - after) / 1e6:8.1f} MB  {f.relative_to(site)}  -- strip --strip-debug "
                        f"({before // 1024}K -> {after // 1024}K)")


FATBIN_MAGICS = (0xBA55ED50, 0x466243B1)


def fatbin_section(path: Path) -> tuple[int, int] | None:
    """File offset and size of the .nv_fatbin section, if any."""
    out = subprocess.run(["readelf", "-SW", str(path)], capture_output=True, text=True).stdout
    for line in out.splitlines():
        p = line.replace("[ ", "[").split()
        if len(p) > 6 and p[1] == ".nv_fatbin":
            return int(p[4], 16), int(p[5], 16)
    return None


ZSTD_MAGIC = 0xFD2FB528
ZSTD_SKIPPABLE = 0x184D2A50


def zero_frame(n: int, size: int) -> bytes | None:
    """A zstd stream of exactly SIZE bytes that decompresses to N zero bytes: one frame of RLE blocks (and a raw
    block to make the length come out exact), then a skippable frame of zeros for the rest."""
    import struct

    for k in range(0, 64):
        if k > n:
            break
        rle = n - k
        blocks = b"".join(struct.pack("<I", (min(131072, rle - i) << 3) | 0b010)[:3] + b"\0"
                          for i in range(0, rle, 131072))
        raw = (struct.pack("<I", (k << 3) | 0b000)[:3] + bytes(k)) if k else b""
        body = blocks + raw
        if not body:
            body = struct.pack("<I", 0b001)[:3]  # one empty last raw block
        else:  # mark the last block as last
            last = len(body) - (3 + k if k else 4)
            body = body[:last] + bytes([body[last] | 1]) + body[last + 1:]
        frame = struct.pack("<IBQ", ZSTD_MAGIC, 0b11100000, n) + body  # single segment, 8-byte content size
        rest = size - len(frame)
        if rest == 0:
            return frame
        if rest >= 8:
            return frame + struct.pack("<II", ZSTD_SKIPPABLE, rest - 8) + bytes(rest - 8)
    return None


def prune_sass(path: Path, keep_sm: int) -> tuple[int, int, dict[int, int]]:
    """Replaces, in place, every zstd-compressed cubin (ELF entry) of the .nv_fatbin section built for another SM
    than KEEP_SM by a stream of the same length that decompresses to as many zero bytes (an RLE frame, then a
    skippable frame of zeros), keeping every entry header, size and offset: the fatbin parses as before, the KEEP_SM
    cubins (sm_90 and sm_90a for 90) and any PTX stay byte for byte the same, and cubins that a cc 9.0 GPU can
    never load (SASS runs only on its own major version) become zeros, which the compressor removes. Returns (bytes
    replaced, bytes kept, {sm: cubin bytes}). Layout: the public reverse-engineered one (16-byte container header:
    u32 magic, u16 version, u16 header size, u64 size of what follows; entry: u16 kind, u32 entry size at 4, u32
    padded payload at 8, u32 payload at 16, u32 sm at 28); cuobjdump --extract-elf checks it (bundle_0523.sh)."""
    import mmap
    import struct

    sec = fatbin_section(path)
    if sec is None:
        return 0, 0, {}
    start, length = sec
    zeroed = kept = 0
    per_sm: dict[int, int] = {}
    with open(path, "r+b") as fh, mmap.mmap(fh.fileno(), 0) as m:
        o, end = start, start + length
        while o + 16 <= end:
            magic, _ver, hsize, body = struct.unpack_from("<IHHQ", m, o)
            if magic not in FATBIN_MAGICS:
                o += 8  # containers are 8-aligned; skip padding between them
                continue
            if hsize != 16:
                raise SystemExit(f"prune_sass: {path}: container at {o:#x} has header size {hsize}")
            cend = o + 16 + body
            if cend > end:
                raise SystemExit(f"prune_sass: {path}: container at {o:#x} runs past the section")
            e = o + 16
            while e + 64 <= cend:
                kind, _v, esize, padded = struct.unpack_from("<HHII", m, e)
                dsize = struct.unpack_from("<I", m, e + 16)[0]
                sm = struct.unpack_from("<I", m, e + 28)[0]
                if esize < 64 or dsize > padded or e + esize + padded > cend:
                    raise SystemExit(f"prune_sass: {path}: bad entry at {e:#x} (size {esize}, payload {padded})")
                d = e + esize
                if kind in (2, 0x10):
                    per_sm[sm] = per_sm.get(sm, 0) + padded
                if kind in (2, 0x10) and sm != keep_sm and struct.unpack_from("<I", m, d)[0] == ZSTD_MAGIC:
                    fhd = m[d + 4]
                    fcs_len = {0: 1 if fhd & 0x20 else 0, 1: 2, 2: 4, 3: 8}[fhd >> 6]
                    if fcs_len in (4, 8) and not fhd & 0x03:  # content size present, no dictionary id
                        off = d + 5 + (0 if fhd & 0x20 else 1)
                        n = int.from_bytes(m[off:off + fcs_len], "little")
                        frame = zero_frame(n, dsize)
                        if frame is not None:
                            m[d:d + dsize] = frame
                            zeroed += dsize
                            e += esize + padded
                            continue
                kept += padded
                e += esize + padded
            if e != cend:
                raise SystemExit(f"prune_sass: {path}: entries end at {e:#x}, container at {cend:#x}")
            o = cend
        m.flush()
    return zeroed, kept, per_sm


def trim(site: Path, optdir: Path, lock: Path, manifest: Path, keep_sm: int = 0) -> None:
    rows: list[str] = []
    moved: dict[str, int] = {}
    for pattern, action, why in TRIM:
        found = [p for p in matches(site, pattern) if p.exists() or p.is_symlink()]
        if not found:
            rows.append(f"{'-':>8}     {pattern}  -- no match in this build ({why})")
            continue
        total = 0
        for p in found:
            if not (p.exists() or p.is_symlink()):
                continue  # inside an earlier match
            n = size(p)
            total += n
            if action == "drop":
                shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
            else:
                dest = optdir / action / p.relative_to(site)
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.move(str(p), str(dest))
                moved[action] = moved.get(action, 0) + n
        where = "left out" if action == "drop" else f"moved to the optional part '{action}'"
        label = pattern if len(found) == 1 or "*" not in pattern else f"{pattern} ({len(found)} paths)"
        rows.append(f"{total / 1e6:8.1f} MB  {label}  -- {where}: {why}")
    strip_libs(site, rows)
    strip_libs(optdir, rows)
    if keep_sm:
        for f in sorted([*site.rglob("*.so*"), *optdir.rglob("*.so*")]):
            if f.is_file() and not f.is_symlink():
                zeroed, kept, per_sm = prune_sass(f, keep_sm)
                if zeroed:
                    rel = f.relative_to(site) if f.is_relative_to(site) else f.relative_to(optdir)
                    archs = ", ".join(f"sm_{k} {v / 1e6:.1f}" for k, v in sorted(per_sm.items()))
                    rows.append(f"{zeroed / 1e6:8.1f} MB  {rel}  -- cubins for other GPUs than sm_{keep_sm} "
                                f"zeroed in place (headers kept; {kept / 1e6:.1f} MB unchanged; MB per SM: {archs})")

    wheels = read_lock(lock)
    tops = sorted(((size(p), p.name) for p in site.iterdir()), reverse=True)
    with open(manifest, "w") as out:
        out.write("sglang 0.5.23 device bundle for CPython 3.12 x86_64 (H200 image: torch 2.11.0+cu130, triton 3.6.0, "
                  "CUDA 13.0, driver 580)\nmade by scripts/device/bundle_0523.sh build from "
                  f"{lock.name}; nvidia libraries other than NCCL come from the machine's own torch install\n\n")
        out.write("## packages (name==version  wheel sha256)\n")
        for pin, h in wheels.items():
            out.write(f"{pin:40s} {h}\n")
        out.write("\n## trimmed (size, path, why)\n")
        out.write("\n".join(rows) + "\n")
        out.write("\n## optional parts (uncompressed)\n")
        for part in sorted(moved):
            out.write(f"{size(optdir / part) / 1e6:8.1f} MB  {part}\n")
        out.write("\n## top-level entries in the core bundle (uncompressed)\n")
        out.write(f"{sum(s for s, _ in tops) / 1e6:8.1f} MB  (all)\n")
        for s, name in tops:
            if s >= 100_000:
                out.write(f"{s / 1e6:8.1f} MB  {name}\n")


def pth_paths(site_dir: Path) -> list[str]:
    """The sys.path entries the site's .pth files add (Python runs .pth files only in site directories, not in
    PYTHONPATH entries: nvidia-cutlass-dsl puts `cutlass` on the path this way)."""
    import site as site_module

    before = list(sys.path)
    sys.path.insert(0, str(site_dir))
    site_module.addsitedir(str(site_dir))
    own = os.path.realpath(site_dir)
    return [p for p in sys.path if p not in before and os.path.realpath(p) != own]


# Modules SGLang 0.5.23 imports only for other hardware or features a DSPINE server on an H200 never starts
# (ROCm, Blackwell's FA4 (quack), other models' kernels, audio models, debugging tools, diffusion): their absence
# is expected.
ABSENT_OK = {"polars", "helion", "aiter", "sglang.multimodal_gen", "tilelang", "flydsl", "ray", "flash_mla",
             "deep_gemm", "checkpoint_engine", "quack", "torchaudio"}
SKIP = (".test", "npu", "hpu", "xpu", "rocm", "amd", "mlx", "musa", "ascend", "cpu_", "__main__")


def import_scan(packages: list[str]) -> int:
    """Imports every module of `packages` (walking them) and fails on any module missing from the bundle that
    is not in ABSENT_OK: a module a server imports on some path (e.g. `cutlass` from every Qwen3 MLP) left out
    of the lock or trimmed shows here, on the CPU, instead of in a server that does not start."""
    import importlib
    import pkgutil

    missing: dict[str, list[str]] = {}
    failed = 0
    for root in packages:
        pkg = importlib.import_module(root)
        for m in pkgutil.walk_packages(pkg.__path__, root + ".", onerror=lambda name: None):
            if any(x in m.name for x in SKIP):
                continue
            try:
                importlib.import_module(m.name)
            except ModuleNotFoundError as e:
                missing.setdefault(e.name or "?", []).append(m.name)
            except Exception:  # other hardware, a GPU needed on the CPU check, an optional feature's own guard
                failed += 1
    bad = {k: v for k, v in missing.items() if k.split(".")[0] not in ABSENT_OK and k not in ABSENT_OK}
    for k, v in sorted(missing.items(), key=lambda kv: -len(kv[1])):
        flag = "MISSING" if k in bad else "absent (expected)"
        print(f"import scan: {flag} {k}: {len(v)} modules, e.g. {v[0]}")
    print(f"import scan: {', '.join(packages)}: {len(bad)} unexpected missing modules; {failed} modules failed "
          "otherwise (other hardware, or a GPU needed)")
    return 1 if bad else 0


if __name__ == "__main__":
    cmd = sys.argv[1] if len(sys.argv) > 1 else ""
    if cmd == "unpack":
        unpack(Path(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4]))
    elif cmd == "trim":
        trim(Path(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4]), Path(sys.argv[5]),
             int(sys.argv[6]) if len(sys.argv) > 6 else 0)
    elif cmd == "pth-paths":
        print(":".join(pth_paths(Path(sys.argv[2]))))
    elif cmd == "import-scan":
        sys.exit(import_scan(sys.argv[2:] or ["sglang.srt", "sglang.kernels"]))
    elif cmd == "aot-src":
        aot_src(Path(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4]))
    elif cmd == "aot-key":
        print(aot_key(sys.argv[2], Path(sys.argv[3]), sys.argv[4] if len(sys.argv) > 4 else ""))
    elif cmd == "aot-ninja":
        aot_ninja(Path(sys.argv[2]), sys.argv[3], Path(sys.argv[4]))
    elif cmd == "aot-place":
        aot_place(Path(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4]))
    elif cmd == "prune-sass":
        z, k, per = prune_sass(Path(sys.argv[2]), int(sys.argv[3]))
        print(f"prune-sass: {sys.argv[2]}: zeroed {z / 1e6:.1f} MB, kept {k / 1e6:.1f} MB; "
              + ", ".join(f"sm_{a} {b / 1e6:.1f}" for a, b in sorted(per.items())))
    else:
        print(__doc__)
        sys.exit(2)
