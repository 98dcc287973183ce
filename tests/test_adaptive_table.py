"""The README's "when speculation pays" tables are generated from benchmarks/results/adaptive_summary.json
(benchmarks/adaptive_table.py)."""
import json

import pytest

from benchmarks import adaptive_table as at
from sglang_dspine.provenance import git_commit


def test_readme_tables_are_the_ones_the_summary_gives():
    assert at.main(["--check"]) == 0, "README.md's adaptive tables are stale: run python -m benchmarks.adaptive_table"


def _summary(commit: str) -> dict:
    cell = lambda v: {"tokens_per_s": {"median": v, "min": v - 1, "max": v + 1}, "tau": 3.0}  # noqa: E731
    return {"gpu": "NVIDIA H200", "commit": commit,
            "end_to_end": {"16": {"plain": cell(800.4), "dspine": cell(900.6), "dspine_adaptive": cell(950.0)},
                           "1": {"plain": cell(100.0), "dflash": cell(150.0), "dspine": cell(200.0),
                                 "dspine_tree32": cell(210.0), "dspine_adaptive": cell(205.0),
                                 "dspine_adaptive_tree32": cell(215.0)},
                           "1_t1": {"plain": cell(1.0)}},
            at.PROJECTION: {"48": {"plain": 50.0, "dflash": 60.0, "dspine": 70.0, "dspine_adaptive": 80.0,
                                   "adaptive_shape": "chain8"},
                            "1": {"plain": 10.0, "dspine": 30.0}}}


def test_tables_give_each_servers_median_in_client_order_and_mark_stale_code(tmp_path):
    """Client counts in numeric order, T = 1 rows left out, a server the summary lacks as a dash, the adaptive
    server's shape beside its projection; the caption names the GPU and commit and says whether the measured code
    changed since (a commit git does not know: stale, as the headline table marks it)."""
    head = at.render(_summary(git_commit()[:7]))
    assert "the measured code is as at HEAD" in head and "NVIDIA H200" in head
    assert at.pair_rows(_summary("x")) == [["1", "100", "150", "200", "210", "205", "215"],
                                             ["16", "800", "–", "901", "–", "950", "–"]]
    assert at.geometry_rows(_summary("x")) == [["1", "10", "–", "30", "–"], ["48", "50", "60", "70", "80 (chain8)"]]
    assert "**stale**" in at.render(_summary("0" * 40))

    readme = tmp_path / "README.md"
    summary = tmp_path / "adaptive_summary.json"
    summary.write_text(json.dumps(_summary(git_commit()[:7])))
    good = "# x\n\n" + at.render(json.loads(summary.read_text())) + "\n\nafter\n"
    readme.write_text(good)
    args = ["--readme", str(readme), "--summary", str(summary)]
    assert at.main(["--check", *args]) == 0
    readme.write_text(good.replace("| 1 | 100 |", "| 1 | 999 |"))
    assert at.main(["--check", *args]) == 1
    assert at.main(args) == 0 and readme.read_text() == good  # the command writes it back
    readme.write_text("no markers here\n")
    with pytest.raises(ValueError, match="adaptive tables' markers"):
        at.main(["--check", *args])
