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
