"""The README's headline table is generated from benchmarks/results/headline.json (benchmarks/headline_table.py)."""
import copy
import json
import os

import pytest

from benchmarks import headline_table as ht
from sglang_dspine.provenance import git_commit


@pytest.fixture(scope="module")
def headline():
    with open(ht.HEADLINE) as f:
        return json.load(f)


def test_readme_table_is_the_one_headline_json_gives():
    with open(ht.README) as f:
        readme = f.read()
    assert ht.main(["--check"]) == 0, "README.md's headline table is stale: run python -m benchmarks.headline_table"
    assert ht.replace_table(readme, ht.render_table(json.load(open(ht.HEADLINE)))) == readme


def test_check_fails_on_a_hand_edited_table(tmp_path, headline):
    readme = tmp_path / "README.md"
    good = "# x\n\n" + ht.render_table(headline) + "\n\nafter\n"
    readme.write_text(good)
    assert ht.main(["--check", "--readme", str(readme)]) == 0
    readme.write_text(good.replace(ht.render_row(headline["rows"][0]), "| edited | 9.99 | | | |"))
    assert ht.main(["--check", "--readme", str(readme)]) == 1
    assert ht.main(["--readme", str(readme)]) == 0 and readme.read_text() == good  # the command writes it back
    readme.write_text("no markers here\n")
    with pytest.raises(ValueError, match="markers"):
        ht.main(["--check", "--readme", str(readme)])


def test_every_figure_is_its_result_files_value(headline):
    checked = 0
    for row in headline["rows"]:
        for name, spec in row["figures"].items():
            assert "{" + name + "}" in row["result"], (row["id"], name)
            got = ht.figure_value(spec)
            assert ht.shown(got, spec["fmt"]) == ht.shown(spec["value"], spec["fmt"]), (row["id"], name, got)
            checked += 1
        assert row["result"].format(**{n: "" for n in row["figures"]})  # no placeholder without its figure
    assert checked >= 40


def test_every_row_names_its_runs_commit_device_repeats(headline):
    for row in headline["rows"]:
        assert row["runs"], row["id"]
        for run in row["runs"]:
            assert len(run["commit"]) >= 7 and run["device"] and run["repeats"], (row["id"], run)
            assert all(os.path.isfile(os.path.join(ht.RESULTS, f)) for f in run["files"]), run["files"]
        for spec in row["figures"].values():  # every figure comes from a run the row names
            assert any(spec["file"] in run["files"] for run in row["runs"]), (row["id"], spec["file"])
        rendered = ht.render_row(row)
        assert all(run["commit"][:7] in rendered for run in row["runs"])


def test_tree_rows_say_which_rule_the_server_runs(headline):
    trees = [row for row in headline["rows"] if "tree" in row["measurement"]]
    assert len(trees) >= 2
    for row in trees:
        assert row.get("sampling_rule") and "the server's sampling rule: " + row["sampling_rule"] in ht.render_row(row)


def test_a_run_is_stale_once_the_measured_code_changed(headline):
    row = copy.deepcopy(headline["rows"][0])
    head = git_commit()
    row["runs"] = [dict(row["runs"][0], commit=head)]
    assert ht.run_status(head) is None
    assert "| current |" in ht.render_row(row)
    # 95e7eda measured a draft step and worker that no longer exist
    assert ht.run_status("95e7eda") == "changed"
    row["runs"] = [dict(row["runs"][0], commit="95e7eda"), dict(row["runs"][0], commit=head)]
    assert "| **stale**: the measured code (`sglang_dspine/`, `kernels/`) changed since 95e7eda |" in ht.render_row(row)
    row["runs"] = [dict(row["runs"][0], commit="0" * 40)]
    assert "changed since 0000000 (git cannot tell)" in ht.render_row(row)
