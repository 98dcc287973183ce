"""Provenance stamped on every benchmark result: command, git commit, a digest of the code measured, GPU, versions,
date."""
from __future__ import annotations

import datetime
import os
import subprocess
import sys

# what a measurement measured, as paths of a checkout (`changed_files`) and as the digest of the imported package
# (`measured_code_digest`): the plugin, the drafter, the kernels
MEASURED_CODE = ("sglang_dspine", "kernels")


def git_commit() -> str:
    """The commit measured. The GPU machine gets a copy of the tree without .git, and the scripts there run
    the package from a copy outside the repo: pass GIT_COMMIT there (scripts/device/kernels.sh sets it when
    git can tell)."""
    if os.environ.get("GIT_COMMIT"):
        return os.environ["GIT_COMMIT"]
    try:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        out = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def changed_files(since: str, until: str, paths: tuple[str, ...] | list[str]) -> list[str] | None:
    """The files under `paths` (repo-relative) that git says changed between two commits of this checkout, for
    telling whether a result measured at `since` still describes the code at `until`. None where this checkout
    cannot tell (no git, or a commit it does not have)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        out = subprocess.run(["git", "-C", root, "diff", "--name-only", since, until, "--", *paths],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.split() if out.returncode == 0 else None


def measured_code_digest() -> str:
    """A digest of the code a measurement ran: every file of the imported `sglang_dspine` package and of its
    kernels (`sglang_dspine.kernels`, which the GPU machine lays out inside the package and a checkout keeps in
    `kernels/`), by path relative to each and content, caches left out. Two runs with equal digests ran the same
    serving code whatever their commits; the GPU machine has no git to say so (`changed_files`)."""
    import hashlib
    import importlib.util

    package = os.path.dirname(os.path.abspath(__file__))
    spec = importlib.util.find_spec("sglang_dspine.kernels")
    kernels = os.path.abspath(list(spec.submodule_search_locations)[0]) if spec else None
    h = hashlib.sha256()
    for prefix, root in (("sglang_dspine", package), ("kernels", kernels)):
        if root is None:
            continue
        for folder, dirs, files in os.walk(root):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__" and os.path.join(folder, d) != kernels)
            for f in sorted(files):
                if f.endswith((".pyc", ".pyo")):
                    continue
                path = os.path.join(folder, f)
                h.update(f"{prefix}/{os.path.relpath(path, root)}\0".encode())
                h.update(open(path, "rb").read())
                h.update(b"\0")
    return h.hexdigest()[:16]


def provenance(argv: list[str] | None = None) -> dict:
    import torch

    versions = {"python": sys.version.split()[0], "torch": torch.__version__}
    for name in ("triton", "sglang", "transformers"):
        try:
            versions[name] = __import__(name).__version__
        except Exception:  # noqa: BLE001 - a missing package is recorded as such
            versions[name] = None
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {
        "command": " ".join(argv if argv is not None else sys.argv),
        "commit": git_commit(),
        "measured_code": measured_code_digest(),
        "gpu": gpu,
        "versions": versions,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        # the plugin's switches change what a server runs (SGLANG_DSPINE_TREE=1: trees, not chains)
        "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("SGLANG_DSPINE_")},
    }


def default_output(name: str) -> str:
    """Where a benchmark writes when no destination is given: $OUT (the GPU machine's results folder) or a
    folder under the system's temporary directory, never the source tree (the committed results under
    benchmarks/results are written only when asked for by path)."""
    import tempfile

    return os.path.join(os.environ.get("OUT") or os.path.join(tempfile.gettempdir(), "sglang-dspine-results"), name)
