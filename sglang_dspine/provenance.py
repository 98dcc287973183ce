"""Provenance stamped on every benchmark result: command, git commit, GPU, versions, date."""
from __future__ import annotations

import datetime
import os
import subprocess
import sys


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
