"""scripts/device/bundle_0523.py (SGLang 0.5.23's environment for the GPU machine), the parts that run on CPU: the
import scan that catches a module the bundle lacks, the .pth paths a PYTHONPATH site needs, and two facts seen
on the H200 (a server needs `cutlass`; DSpine's transfer space needs torch's CUDA linear algebra)."""
import fnmatch
import os
import subprocess
import sys

from sglang_dspine.source_files import load_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUNDLE = os.path.join(ROOT, "scripts", "device", "bundle_0523.py")


def scan(tmp_path, modules: dict[str, str] | None = None):
    """import-scan over tmp_path/fakepkg, first written with `modules` (name: source) when given."""
    pkg = tmp_path / "fakepkg"
    if modules is not None:
        pkg.mkdir()
        (pkg / "__init__.py").write_text("")
        for name, body in modules.items():
            (pkg / f"{name}.py").write_text(body)
    return subprocess.run([sys.executable, BUNDLE, "import-scan", "fakepkg"], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(tmp_path)})


def test_import_scan_fails_on_a_missing_module_and_lets_other_hardware_pass(tmp_path):
    ok = {"plain": "import json\n", "fused_ops": "import aiter\n", "blackwell": "import quack.kernels\n",
          "raises": "raise RuntimeError('needs a GPU')\n"}
    r = scan(tmp_path, {**ok, "mlp": "import cutlass_not_in_this_bundle\n"})
    assert r.returncode == 1, r.stdout + r.stderr
    assert "MISSING cutlass_not_in_this_bundle: 1 modules, e.g. fakepkg.mlp" in r.stdout
    assert "absent (expected) aiter" in r.stdout and "absent (expected) quack" in r.stdout
    assert "1 unexpected missing modules; 1 modules failed otherwise" in r.stdout
    (tmp_path / "fakepkg" / "mlp.py").unlink()
    r = scan(tmp_path)
    assert r.returncode == 0 and "0 unexpected missing modules" in r.stdout, r.stdout + r.stderr


def test_pth_paths_are_what_a_site_directory_would_add(tmp_path):
    """PYTHONPATH entries do not run .pth files: the site's own (cutlass's puts dsl_packages on sys.path with an
    import line) are found and put on PYTHONPATH by setup."""
    site = tmp_path / "site"
    (site / "dsl" / "dsl_packages").mkdir(parents=True)
    (site / "dsl" / "__init__.py").write_text("")
    (site / "plain_dir").mkdir()
    (site / "plain.pth").write_text("plain_dir\n")
    (site / "dsl.pth").write_text("import sys, os, dsl; sys.path.insert(0, os.path.join(dsl.__path__[0], 'dsl_packages'))\n")
    r = subprocess.run([sys.executable, BUNDLE, "pth-paths", str(site)], capture_output=True, text=True, timeout=60,
                       cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert sorted(r.stdout.strip().split(":")) == sorted([str(site / "dsl" / "dsl_packages"), str(site / "plain_dir")])


def test_the_bundle_keeps_what_the_h200_showed_it_needs():
    """Seen at 064fd69: no 0.5.23 server starts without `cutlass` (every Qwen3 MLP imports it), and torch.linalg on
    the GPU (DSpine's transfer space) needs libtorch_cuda_linalg.so."""
    b = load_file(BUNDLE)
    lock = os.path.join(ROOT, "locks", "device-sglang-0.5.23.txt")
    pins = b.read_lock(__import__("pathlib").Path(lock))
    for name in ("nvidia-cutlass-dsl", "nvidia-cutlass-dsl-libs-base", "nvidia-cutlass-dsl-libs-core",
                 "nvidia-cutlass-dsl-libs-cu13"):
        assert any(p == f"{name}==4.8.0" and len(h) == 64 for p, h in pins.items()), name
    assert not [p for p, _, _ in b.TRIM if fnmatch.fnmatch("torch/lib/libtorch_cuda_linalg.so", p)]


def test_the_package_laid_out_for_the_gpu_machine_is_found_as_installed(tmp_path):
    """scripts/device/layout_package.sh (setup.sh, every release; bundle_0523.sh): with the layout first on the
    path and the repo root not on it, SGLang's plugin entry point and sglang_dspine.kernels resolve to it."""
    dest = tmp_path / "site"
    r = subprocess.run(["bash", os.path.join(ROOT, "scripts", "device", "layout_package.sh"), str(dest)],
                       capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    probe = ("from importlib.metadata import distribution; import sglang_dspine.kernels as k; "
             "d = distribution('sglang-dspine'); "
             "print(d.locate_file(''), [e.value for e in d.entry_points if e.group == 'sglang.srt.plugins'], k.__file__)")
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, cwd=tmp_path,
                       env={**os.environ, "PYTHONPATH": str(dest)})
    assert r.returncode == 0, r.stderr
    where, rest = r.stdout.split(" ", 1)
    eps, path = rest.rsplit(" ", 1)
    assert where == str(dest) and eps == "['sglang_dspine.serving.plugin:register']", r.stdout
    assert path.strip().startswith(str(dest / "sglang_dspine" / "kernels"))
