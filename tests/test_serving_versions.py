"""benchmarks/serving_versions.py: the committed release × backend matrix is what the measured result files say."""
import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")


def test_the_committed_matrix_is_rebuilt_from_the_result_files():
    from benchmarks import serving_versions as sv

    built = json.loads(json.dumps(sv.build(RESULTS)))
    committed = json.load(open(os.path.join(RESULTS, "serving_versions_summary.json")))
    since = committed.pop("serving_code_changed_since_runs")  # as of the commit it was built at, not the files'
    assert built == committed
    assert list(since["changed_by_commit"]) == sv.commits_of(built["rows"]) and since["paths"] == list(sv.SERVING_CODE)
    default = next(r for r in built["rows"] if r["sglang"] == "0.5.17" and r["attention"].startswith("fa3"))
    assert default["features"]["backends"] == {"attention": "sglang-default", "sampling": "sglang-default"}
    assert all(r.get("features") or r.get("not_run") for r in built["rows"])  # no row claims without a run


def test_a_gpu_test_log_is_read_by_its_closing_line():
    from benchmarks import serving_versions as sv

    assert sv.pytest_result("tests/a.py .F\n==== 1 failed, 2 passed in 3.1s ====\n") == "1 failed, 2 passed in 3.1s"
    with pytest.raises(ValueError):
        sv.pytest_result("collected 0 items\n")


@pytest.mark.skipif(not os.path.exists(os.path.join(ROOT, ".git")), reason="not a git checkout: no history to read")
def test_serving_code_changed_since_a_run_is_what_git_says():
    """How far the serving code moved since a row's run: git's list between two commits of this history, under the
    serving paths only; None for a commit this checkout lacks."""
    from benchmarks import serving_versions as sv
    from sglang_dspine.provenance import changed_files

    # e7e0441 -> 8d38b20 added the 0.5.17 FA3 results and changed serving_versions.py, no serving code
    assert changed_files("e7e0441", "8d38b20", ("benchmarks/serving_versions.py",)) == ["benchmarks/serving_versions.py"]
    assert changed_files("e7e0441", "8d38b20", sv.SERVING_CODE) == []
    # bb9ff95 -> e7e0441 (stop 47) touched no serving code either; f528899 -> bb9ff95 did (the draft tree's kernel)
    since = sv.serving_code_since([{"e2e": {"commit": "bb9ff95"}}, {"runs": [{"commit": "f528899"}]}], "e7e0441")
    assert since["changed_by_commit"]["bb9ff95"] == []
    assert "kernels/tree_build.py" in since["changed_by_commit"]["f528899"]
    assert changed_files("0" * 40, "e7e0441", sv.SERVING_CODE) is None


def test_provenance_records_the_plugins_switches(monkeypatch):
    """A result says which of the plugin's environment switches were on (SGLANG_DSPINE_TREE=1 makes a DSPINE
    server verify trees: the same command line measures something else), and no other variable."""
    from sglang_dspine.provenance import provenance

    monkeypatch.setenv("SGLANG_DSPINE_TREE", "1")
    monkeypatch.setenv("SGLANG_OTHER_SWITCH", "1")
    env = provenance(["x"])["env"]
    assert env.get("SGLANG_DSPINE_TREE") == "1" and "SGLANG_OTHER_SWITCH" not in env
    monkeypatch.delenv("SGLANG_DSPINE_TREE")
    assert "SGLANG_DSPINE_TREE" not in provenance(["x"])["env"]
