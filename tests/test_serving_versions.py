"""benchmarks/serving_versions.py: the committed release × backend matrix is what the measured result files say."""
import json
import os

import pytest

from sglang_dspine.source_files import load_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")


def test_the_committed_matrix_is_rebuilt_from_the_result_files():
    sv = load_file(os.path.join(ROOT, "benchmarks", "serving_versions.py"))
    built = json.loads(json.dumps(sv.build(RESULTS)))
    assert built == json.load(open(os.path.join(RESULTS, "serving_versions_summary.json")))
    default = next(r for r in built["rows"] if r["sglang"] == "0.5.17" and r["attention"].startswith("fa3"))
    assert default["features"]["backends"] == {"attention": "sglang-default", "sampling": "sglang-default"}
    assert all(r.get("features") or r.get("not_run") for r in built["rows"])  # no row claims without a run


def test_a_gpu_test_log_is_read_by_its_closing_line():
    sv = load_file(os.path.join(ROOT, "benchmarks", "serving_versions.py"))
    assert sv.pytest_result("tests/a.py .F\n==== 1 failed, 2 passed in 3.1s ====\n") == "1 failed, 2 passed in 3.1s"
    with pytest.raises(ValueError):
        sv.pytest_result("collected 0 items\n")
