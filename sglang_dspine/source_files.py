"""Running the repository's own Python files (benchmarks, the lab, the GPU scripts) safely.

The repository's top-level `kernels/` folder is installed as `sglang_dspine.kernels`. Whenever the repository
root is on sys.path, it shadows the unrelated `kernels` package that transformers and SGLang import, and
Python puts the current folder on sys.path for `python -c` and `python -m`. So:
- processes start outside the repository root (`OUTSIDE_REPO`; shell scripts `cd /tmp` for the same reason);
- a script's sibling files are loaded by path (`load_file`), never by putting a folder on sys.path (a
  folder's `kernels.py` would shadow the package just the same).
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
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)  # type: ignore[union-attr]
    except BaseException:
        del sys.modules[name]
        raise
    return module
