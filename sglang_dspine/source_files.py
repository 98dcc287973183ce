"""Running the repository's own Python files (benchmarks, the lab, the GPU scripts) safely.

The repository's top-level `kernels/` folder is installed as `sglang_dspine.kernels`. Whenever the repository
root is on sys.path, it shadows the unrelated `kernels` package that transformers and SGLang import, and
Python puts the current folder on sys.path for `python -c` and `python -m`. So:
- processes start outside the repository root (`OUTSIDE_REPO`; shell scripts `cd /tmp` for the same reason);
- `benchmarks/` is a package imported by its folder (`load_package`, `as_package`), never by putting the
  repository root on sys.path; a file run as a script leaves its own folder off sys.path too (a folder's
  `kernels.py` would shadow the package just the same).
"""
from __future__ import annotations

import importlib.util
import os
import sys
import tempfile
from types import ModuleType

OUTSIDE_REPO = tempfile.gettempdir()  # a working directory for child processes: never the repository root


def load_file(path: str, name: str | None = None) -> ModuleType:
    """The Python file `path` as a module registered in sys.modules as `name` (default `dspine_<file stem>`),
    executed once; sys.path is left as it is."""
    name = name or "dspine_" + os.path.splitext(os.path.basename(path))[0]
    if name in sys.modules:
        return sys.modules[name]
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such file to load as module {name}")
    return _execute(name, importlib.util.spec_from_file_location(name, path))


def load_package(name: str, folder: str) -> ModuleType:
    """The folder `folder` (with its __init__.py) as the package `name` in sys.modules, its submodules importable
    as `name.x` (`from name import x`); sys.path is left as it is. Where `name` is already imported, that one."""
    if name in sys.modules:
        return sys.modules[name]
    init = os.path.join(folder, "__init__.py")
    spec = importlib.util.spec_from_file_location(name, init, submodule_search_locations=[folder])
    if spec is None or not os.path.isfile(init):
        raise FileNotFoundError(f"{init}: no such file to load as package {name}")
    return _execute(name, spec)


def _execute(name: str, spec) -> ModuleType:
    """The module of `spec`, registered as `name` before it runs (so that it can import itself) and removed
    again if it raises."""
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)  # type: ignore[union-attr]
    except BaseException:
        del sys.modules[name]
        raise
    return module


def as_package(script: str) -> None:
    """For a file of `benchmarks/` run as a script (`python benchmarks/x.py`, `python benchmarks/lab/x.py`): its
    folder leaves sys.path (Python put it first) and `benchmarks` is imported by its folder, so the script's
    `from benchmarks import ...` and `from benchmarks.lab import ...` work as they do under `python -m`."""
    here = os.path.dirname(os.path.abspath(script))
    if sys.path and os.path.abspath(sys.path[0] or ".") == here:
        sys.path.pop(0)
    folder = here
    while os.path.basename(folder) != "benchmarks":
        parent = os.path.dirname(folder)
        if parent == folder:
            raise ValueError(f"{script}: not inside a benchmarks/ folder")
        folder = parent
    load_package("benchmarks", folder)
