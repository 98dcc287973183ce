"""FlashInfer modules built ahead of time for the H200 (scripts/device/bundle_0523.py aot-*, bundle_0523.sh aot) and
what benchmarks/servers.py's FlashInfer prebuild records of them: the store name of a prebuilt module, where it is
placed in the bundle's jit part (the path FlashInfer loads it from, as is), and the prebuild log's module lines."""
import contextlib
import io
import json
import os
import re
import subprocess
import sys
import types

import pytest

from sglang_dspine.source_files import load_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUNDLE = os.path.join(ROOT, "scripts", "device", "bundle_0523.py")
LOCK = os.path.join(ROOT, "locks", "device-sglang-0.5.23.txt")


def bundle():
    return load_file(BUNDLE)


def test_a_prebuilt_module_is_named_by_what_decides_its_build(tmp_path):
    """The store name changes with the module, the flashinfer wheel (its sources and flags) and the toolchain, so
    a .so built for another lock is never placed; the toolchain is CUDA 13.0, the machine's (torch 2.11+cu130)."""
    b = bundle()
    version, sha = b.flashinfer_pin(b.Path(LOCK))
    key = b.aot_key("topk", b.Path(LOCK))
    assert re.fullmatch(rf"topk-flashinfer{re.escape(version)}-sm90a-[0-9a-f]{{16}}", key)
    assert b.aot_key("topk", b.Path(LOCK)) == key and b.aot_key("sampling", b.Path(LOCK)) != key
    other = tmp_path / "lock.txt"
    other.write_text(open(LOCK).read().replace(sha, "0" * 64))
    assert b.aot_key("topk", other) != key
    pins = dict(p.split(" --hash=")[0].split("==") for p in b.AOT_TOOLCHAIN)
    assert pins["nvidia-cuda-nvcc"].startswith("13.0.") and pins["nvidia-nvvm"] == pins["nvidia-cuda-nvcc"]
    # the runtime headers/library it links against: torch 2.14.1's pin, as setup checks on the machine
    setup = open(os.path.join(ROOT, "scripts", "device", "bundle_0523.sh")).read()
    assert f'"nvidia-cuda-runtime": "{pins["nvidia-cuda-runtime"]}"' in setup
    assert all(re.fullmatch(r"[\w.-]+==[\w.]+ --hash=sha256:[0-9a-f]{64}", p) for p in b.AOT_TOOLCHAIN)
    assert set(b.AOT_MODULES) == {"topk", "sampling"}


def test_aot_place_puts_a_prebuilt_module_where_flashinfer_loads_it(tmp_path):
    """A module in the store for this lock goes to flashinfer/data/aot/<name>/<name>.so of the jit part; one not
    built is left to FlashInfer's JIT build on the device, and said so."""
    store, site = tmp_path / "store", tmp_path / "jit"
    store.mkdir()
    key = subprocess.run([sys.executable, BUNDLE, "aot-key", "topk", LOCK], capture_output=True, text=True,
                         check=True).stdout.strip()
    (store / f"{key}.so").write_bytes(b"\x7fELF" + bytes(100))
    (store / f"{key}.json").write_text(json.dumps({"seconds": 2400, "nvcc": "V13.0.88", "built": "then"}))
    (store / "topk-flashinfer0.0.1-sm90a-0123456789abcdef.so").write_bytes(b"another lock's")
    r = subprocess.run([sys.executable, BUNDLE, "aot-place", str(site), str(store), LOCK], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    placed = site / "flashinfer" / "data" / "aot" / "topk" / "topk.so"
    assert placed.read_bytes() == b"\x7fELF" + bytes(100)
    assert "aot-place: topk: 0.0 MB -> flashinfer/data/aot/topk/topk.so (built then in 2400 s with nvcc V13.0.88)" \
        in r.stdout
    assert "aot-place: sampling: not prebuilt for this lock" in r.stdout
    assert sorted(p.name for p in (site / "flashinfer" / "data" / "aot").iterdir()) == ["topk"]


def test_the_installed_flashinfer_loads_aot_modules_from_that_path():
    """flashinfer/data/aot/<name>/<name>.so is where the installed FlashInfer looks for a module built ahead of time
    when no flashinfer-jit-cache package is there (0.7.2's get_aot_artifacts reads the same path first)."""
    pytest.importorskip("flashinfer")
    from importlib.util import find_spec

    if find_spec("flashinfer_jit_cache") is not None:
        pytest.skip("flashinfer-jit-cache installed: it supplies the AOT folder")
    import flashinfer
    from flashinfer.jit import env

    aot = env.FLASHINFER_AOT_DIR
    assert os.path.relpath(aot, os.path.dirname(flashinfer.__file__)) == os.path.join("data", "aot")


class _Spec:
    def __init__(self, name, prebuilt):
        self.is_aot = prebuilt
        self.jit_library_path = types.SimpleNamespace(exists=lambda: False)
        self.path = f"/site/flashinfer/data/aot/{name}/{name}.so"

    def get_library_path(self):
        return self.path


def _fake_flashinfer(calls, prebuilt):
    """torch and flashinfer as far as PREBUILD uses them, recording its calls."""
    def rec(name):
        return lambda *a, **k: calls.append(name)
    torch = types.SimpleNamespace(float32="f32", bfloat16="bf16", int32="i32", softmax=lambda x, d: x,
                                  randn=lambda *a, **k: None, tensor=lambda *a, **k: None,
                                  cuda=types.SimpleNamespace(synchronize=lambda: None))
    fi = types.ModuleType("flashinfer")
    fi.top_k = rec("top_k")
    fi.sampling = types.SimpleNamespace(top_k_renorm_probs=rec("top_k_renorm_probs"),
                                        top_p_renorm_probs=rec("top_p_renorm_probs"))
    jit = {f"flashinfer.jit.{n}": types.SimpleNamespace(**{f"gen_{n}_module": (lambda n=n: _Spec(n, n in prebuilt))})
           for n in ("sampling", "topk")}
    return {"torch": torch, "flashinfer": fi, "flashinfer.sampling": fi.sampling, **jit}


def test_the_prebuild_says_where_each_module_came_from_and_the_record_keeps_it(tmp_path, monkeypatch):
    """PREBUILD's module lines (run here against stand-ins for torch and flashinfer) are what prebuild_record
    parses: a module FlashInfer loads prebuilt is recorded as such with its path, one it compiles as "jit build"."""
    from benchmarks import servers

    calls = []
    mods = _fake_flashinfer(calls, prebuilt={"topk"})
    monkeypatch.setattr(sys.modules["importlib"], "import_module", lambda name: mods[name])
    monkeypatch.setitem(sys.modules, "flashinfer", mods["flashinfer"])
    monkeypatch.setitem(sys.modules, "flashinfer.sampling", mods["flashinfer.sampling"])
    monkeypatch.setitem(sys.modules, "torch", mods["torch"])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(servers.PREBUILD, "PREBUILD", "exec"), {"__name__": "__main__"})
    log = out.getvalue()
    assert calls == ["top_k_renorm_probs", "top_p_renorm_probs", "top_k", "top_k"]
    got = servers.prebuild_modules(log)
    assert got == {"sampling": {"from": "jit build", "seconds": pytest.approx(0.0, abs=0.5)},
                   "topk": {"from": "prebuilt", "path": "/site/flashinfer/data/aot/topk/topk.so",
                            "seconds": pytest.approx(0.0, abs=0.5)}}
    (tmp_path / "flashinfer_prebuild.log").write_text(log)
    rec = servers.prebuild_record(types.SimpleNamespace(poll=lambda: 0), str(tmp_path))
    assert rec["returncode"] == 0 and rec["modules"] == got and rec["log"].endswith("s\n")
    # a module still compiling has no line yet; a failed origin look-up is "unknown" with its reason
    partial = "FlashInfer module sampling: unknown (RuntimeError); 107.0 s\n"
    assert servers.prebuild_modules(partial) == {"sampling": {"from": "unknown", "detail": "(RuntimeError)",
                                                              "seconds": 107.0}}


def test_topk_without_cub_is_placed_only_without_a_full_build_and_marked(tmp_path):
    """The topk variant built without csrc/cub_topk.cu (AOT_TOPK_CUB=0) has its own store name, is placed only when
    no full build is in the store, and leaves the NOCUB marker from which setup exports FLASHINFER_TOPK_ALGO=default
    (so FlashInfer never picks the CUB kernels it lacks); a full build placed later removes the marker. Its stand-ins
    are the six functions FlashInfer's topk binding exports from cub_topk.cu."""
    b = bundle()
    lock = b.Path(LOCK)
    full, nocub = b.aot_key("topk", lock), b.aot_key("topk", lock, "nocub")
    assert nocub != full and nocub.startswith("topk-nocub-flashinfer")
    assert sorted(re.findall(r"^(?:void|int64_t) (\w+)\(", b.AOT_NOCUB_STUB, re.M)) == sorted(
        ["cub_topk_page_table_transform", "cub_topk_page_table_transform_workspace_size",
         "cub_topk_ragged_transform", "cub_topk_ragged_transform_workspace_size", "cub_topk",
         "cub_topk_workspace_size"])
    store, site = tmp_path / "store", tmp_path / "jit"
    store.mkdir()
    aot = site / "flashinfer" / "data" / "aot" / "topk"
    (store / f"{nocub}.so").write_bytes(b"nocub")
    with contextlib.redirect_stdout(io.StringIO()) as out:
        assert b.aot_place(site, store, lock) == ["topk"]
    assert (aot / "topk.so").read_bytes() == b"nocub" and (aot / b.AOT_NOCUB_MARKER).is_file()
    assert "topk (without CUB top-k: FLASHINFER_TOPK_ALGO=default there)" in out.getvalue()
    (store / f"{full}.so").write_bytes(b"full")
    with contextlib.redirect_stdout(io.StringIO()):
        b.aot_place(site, store, lock)
    assert (aot / "topk.so").read_bytes() == b"full" and not (aot / b.AOT_NOCUB_MARKER).exists()
    setup = open(os.path.join(ROOT, "scripts", "device", "bundle_0523.sh")).read()
    assert f"flashinfer/data/aot/topk/{b.AOT_NOCUB_MARKER}" in setup and "FLASHINFER_TOPK_ALGO=default" in setup
