"""The repository passes `ruff check` under its ruff.toml, so CI (which runs this suite) fails on a lint error."""
import os
import subprocess
import sys

from sglang_dspine.source_files import OUTSIDE_REPO

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_ruff_check_passes():
    # ruff finds REPO/ruff.toml itself (the closest configuration above each file)
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", REPO], capture_output=True, text=True,
                         timeout=300, cwd=OUTSIDE_REPO)
    assert out.returncode == 0, (out.stdout[-6000:] + out.stderr[-2000:]
                                 + "\n(no ruff? `pip install -e .[test]` installs it; scripts/test.sh does)")


def _package_imports() -> dict[str, set[str]]:
    """Each module of the package (kernels/ as sglang_dspine.kernels) -> the package modules it imports, imports
    inside functions included (they keep a cycle alive without showing it at import time)."""
    import ast

    mods = {}
    for top, prefix in (("sglang_dspine", ""), ("kernels", "sglang_dspine.")):
        for d, _, files in os.walk(os.path.join(REPO, top)):
            for f in files:
                if f.endswith(".py"):
                    path = os.path.join(d, f)
                    name = prefix + os.path.relpath(path, REPO)[:-3].replace(os.sep, ".")
                    mods[name.removesuffix(".__init__")] = path
    graph = {}
    for name, path in mods.items():
        pkg = name if path.endswith("__init__.py") else name.rsplit(".", 1)[0]
        found = set()
        for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
            if isinstance(node, ast.ImportFrom):
                base = pkg.split(".")[:len(pkg.split(".")) - node.level + 1] if node.level else []
                mod = ".".join(base + ([node.module] if node.module else []))
                found |= {f"{mod}.{a.name}" if f"{mod}.{a.name}" in mods else mod for a in node.names}
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
        graph[name] = {m for m in found if m in mods and m != name}
    return graph


def test_package_imports_go_one_way():
    graph = _package_imports()
    assert "sglang_dspine.serving.sglang_patches" in graph["sglang_dspine.serving.plugin"]  # the walk sees imports
    cycles, state = [], {}  # state: 1 on the current path, 2 done

    def visit(m, path):
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycles.append(path[path.index(n):] + [n])
            elif n not in state:
                visit(n, path + [n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)
