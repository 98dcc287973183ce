"""The README's headline table is generated from benchmarks/results/headline.json (benchmarks/headline_table.py)."""
import copy
import json
import os
import time

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
    assert ht.replace_block(readme, ht.render_table(json.load(open(ht.HEADLINE))), ht.BEGIN, ht.END,
                            "the headline table's") == readme


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


# ------------------------------------------------------------------------------------------- the headline run
def test_memory_is_sized_from_the_card():
    from benchmarks.headline import mem_fraction

    assert mem_fraction(79.6, 5) == 0.18  # H100: an equal share of 90%
    assert mem_fraction(139.8, 5) == 0.114  # H200: 16 GiB each, about what 0.12 gave there
    assert mem_fraction(79.6, 1) == 0.201


def test_parts_name_rows_scenarios_and_repeats(headline):
    from benchmarks import headline as hr
    from benchmarks.__main__ import SCENARIOS

    ids = {row["id"] for row in headline["rows"]}
    for part in hr.PARTS:
        assert set(part.rows) <= ids, part.name
        assert part.seconds <= hr.BUDGET_S
        assert part.argv[:2] == ["-m", "benchmarks"] and part.argv[2] in SCENARIOS, part.name
        if "--repeats" in part.argv:
            assert int(part.argv[part.argv.index("--repeats") + 1]) >= 3, part.name
    pair = next(p for p in hr.PARTS if p.name == "pair")
    assert "plain" in pair.argv[pair.argv.index("--servers") + 1].split(",")  # beside every tokens/s
    assert "--pool" in pair.argv  # side by side with equal KV pools (step_cost's have serving_scale's --pool)


def test_parts_resume_after_a_part_that_did_not_end(tmp_path, monkeypatch, capsys):
    from benchmarks import headline as hr

    write = "import os, sys; open(os.path.join(sys.argv[1], 'x'), 'w').write('x')"
    parts = [hr.Part("a", ("r",), 10, 5, ["-c", write, "{out}"]),
             hr.Part("b", ("r",), 10, 1, ["-c", "import sys, time; time.sleep(float(sys.argv[1]))", "30"]),
             hr.Part("c", ("r",), 10, 1, ["-c", "raise SystemExit(3)"])]
    monkeypatch.setattr(hr, "PARTS", parts)
    monkeypatch.setattr(hr, "card", lambda: ("Fake GPU", 79.6))
    out = tmp_path / "run"
    parts[1].argv[-1] = "30"  # b outlives its budget
    assert hr.main(["--out", str(out), "--budget-s", "5"]) == 0  # a
    state = json.loads((out / "state.json").read_text())
    assert state["a"]["status"] == "done" and (out / "parts" / "a" / "x").exists()
    assert state["a"]["gpu"] == "Fake GPU" and state["a"]["mem_fraction"] == 0.18
    (out / "parts" / "b").mkdir()
    (out / "parts" / "b" / "stale").write_text("from a lost machine")
    t0 = time.time()
    assert hr.main(["--out", str(out), "--budget-s", "2"]) == 1  # b, killed at its budget
    assert time.time() - t0 < 20
    state = json.loads((out / "state.json").read_text())
    assert state["b"]["status"] == "timed out" and not (out / "parts" / "b" / "stale").exists()
    parts[1].argv[-1] = "0"
    assert hr.main(["--out", str(out), "--budget-s", "5"]) == 0  # b again: not done, so next
    assert hr.main(["--out", str(out)]) == 1  # c fails, and stays the next part
    state = json.loads((out / "state.json").read_text())
    assert (state["b"]["status"], state["c"]["status"], state["c"]["rc"]) == ("done", "failed", 3)
    assert hr.next_part(state, parts).name == "c"
    assert hr.main(["--out", str(out), "--part", "a"]) == 0  # a named part runs again
    assert hr.main(["--out", str(out), "--status"]) == 0
    printed = capsys.readouterr().out
    assert "a           done" in printed and "c           failed" in printed


def test_collect_gives_median_min_max_of_the_repeats(tmp_path, monkeypatch):
    from benchmarks import headline as hr

    out = tmp_path / "run"
    step = out / "parts" / "step_cost"
    step.mkdir(parents=True)
    rows = lambda d, s: [{"clients": 1, "temperature": 0.0, "step_ms": d}, {"clients": 4, "temperature": 0.0,
                                                                              "step_ms": s}]
    (step / "serving_scale.json").write_text(json.dumps({"provenance": {"commit": "abc1234", "gpu": "G"}, "rounds": [
        {"dflash": rows(10.0, 20.0), "dspine": rows(10.2, 21.0)},
        {"dflash": rows(10.0, 20.0), "dspine": rows(10.1, 20.2)},
        {"dflash": rows(10.0, 20.0), "dspine": rows(10.4, None)}]}))
    pair = out / "parts" / "pair"
    pair.mkdir(parents=True)
    per = {"plain": {"16": {"tokens_per_s": [900.0, 1000.0, 950.0], "tau": [1.0, 1.0, 1.0]}},
           "dflash": {"16": {"tokens_per_s": [400.0, 500.0, 500.0], "tau": [2.0, 2.0, 2.0]}},
           "dspine": {"16": {"tokens_per_s": [600.0, 500.0, 550.0], "tau": [3.0, 3.0, 3.0]}},
           "dspine_tree32": {"16": {"tokens_per_s": [300.0, 250.0, 275.0], "tau": [3.3, 3.3, 3.3]}}}
    (pair / "serving_step_cost.json").write_text(json.dumps({"provenance": {"commit": "abc1234", "gpu": "G"},
                                                             "summary": {"per_server": per}}))
    (out / "state.json").write_text(json.dumps({n: {"status": "done", "gpu": "G"} for n in ("step_cost", "pair")}))
    found = hr.collect(str(out), hr.PARTS)
    cells = found["step_cost"]["dspine_over_dflash_step"]
    assert cells["T=0 c=1"] == {"median": 1.02, "min": 1.01, "max": 1.04, "n": 3}
    assert cells["T=0 c=4"] == {"median": 1.03, "min": 1.01, "max": 1.05, "n": 2}  # a round without its step
    ratios = found["pair"]["ratios"]
    assert ratios["dspine/dflash tokens_per_s"]["16"] == {"median": 1.1, "min": 1.0, "max": 1.5, "n": 3}
    assert ratios["dspine_tree32/dspine tau"]["16"]["median"] == 1.1
    assert found["pair"]["tokens_per_s"]["plain"]["16"] == {"median": 950.0, "min": 900.0, "max": 1000.0, "n": 3}
    assert json.loads((out / "headline_parts.json").read_text()) == found


def test_device_headline_runs_a_part_and_resumes_from_what_came_back(tmp_path):
    """scripts/device/headline.sh: refused without a commit to name; runs `python -m benchmarks headline` on its
    run folder with the budget and its arguments, packs the folder (not the parts' models) into $OUT, passes the
    run's exit status on; on a fresh machine, given that archive back, the run resumes from its state."""
    import shutil
    import subprocess
    import tarfile

    dev = tmp_path / "repo" / "scripts" / "device"
    dev.mkdir(parents=True)
    shutil.copy(os.path.join(ht.ROOT, "scripts", "device", "headline.sh"), dev)
    (dev / "setup.sh").write_text("true\n")  # stands for the bundle's set-up only
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(  # stands for the run: notes its arguments and whether it found a state
        '#!/usr/bin/env bash\nrun="$5"\necho "$* commit=$GIT_COMMIT state=$(cat "$run/state.json" 2>/dev/null)" '
        '>> "$CALLS"\nmkdir -p "$run/parts/a/work"\necho model > "$run/parts/a/work/w"\necho log > "$run/parts/a/x"\n'
        'echo \'{"a": "done"}\' > "$run/state.json"\nexit "${FAKE_RC:-0}"\n')
    (bin_dir / "python3").chmod(0o755)
    calls = tmp_path / "calls.txt"

    def headline(run, *args, **env):
        e = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "OUT": str(tmp_path / "out"),
             "HEADLINE_RUN": str(tmp_path / run), "CALLS": str(calls), **env}
        if "GIT_COMMIT" not in env:
            e.pop("GIT_COMMIT", None)
        return subprocess.run(["bash", "scripts/device/headline.sh", *args], cwd=tmp_path / "repo",
                              capture_output=True, text=True, timeout=60, env=e)

    r = headline("run1")
    assert r.returncode == 2 and "pass GIT_COMMIT" in r.stderr and not calls.exists()
    r = headline("run1", "--part", "a", GIT_COMMIT="abc1234", FAKE_RC="1")
    assert r.returncode == 1, r.stderr
    assert calls.read_text().splitlines() == [
        f"-m benchmarks headline --out {tmp_path / 'run1'} --budget-s 540 --part a commit=abc1234 state="]
    with tarfile.open(tmp_path / "out" / "headline.tar.gz") as tar:
        names = set(tar.getnames())
    assert {"./state.json", "./parts/a/x"} <= names and not any("work" in n for n in names)
    r = headline("run2", GIT_COMMIT="abc1234", HEADLINE_FROM=str(tmp_path / "out" / "headline.tar.gz"),
                 HEADLINE_BUDGET_S="300")
    assert r.returncode == 0, r.stderr
    assert calls.read_text().splitlines()[-1] == (f"-m benchmarks headline --out {tmp_path / 'run2'} --budget-s 300 "
                                                  'commit=abc1234 state={"a": "done"}')


def test_collected_parts_become_checked_headline_rows(tmp_path):
    """--collect --write: the step-cost and pair parts' files copied beside headline.json, their rows (step cost,
    the lab pair's tokens/s with plain decoding's, the served trees) rebuilt from them with the new run's commit and
    GPU, each figure a median, min or max over the repeats that reads back from its file; the other rows and each
    row's measurement, link and sampling rule kept."""
    import shutil

    from benchmarks import headline as hr

    out, results = tmp_path / "run", tmp_path / "results"
    results.mkdir()
    shutil.copy(ht.HEADLINE, results / "headline.json")
    step = out / "parts" / "step_cost"
    step.mkdir(parents=True)
    row = lambda t, c, ms: {"clients": c, "temperature": t, "step_ms": ms}
    rnd = lambda d: {"dflash": [row(0.0, 1, 10.0), row(0.0, 4, 20.0), row(1.0, 1, 10.0)],
                     "dspine": [row(0.0, 1, 10.0 * d), row(0.0, 4, 20.0 * d), row(1.0, 1, 10.5)]}
    prov = {"commit": "def5678", "gpu": "NVIDIA H100 80GB HBM3"}
    (step / "serving_scale.json").write_text(json.dumps({"provenance": prov,
                                                         "rounds": [rnd(1.02), rnd(1.01), rnd(1.04)]}))
    pair = out / "parts" / "pair"
    pair.mkdir(parents=True)
    tps = lambda *v: {"1": {"tokens_per_s": list(v), "tau": [2.0, 2.0, 2.0]},
                      "16": {"tokens_per_s": [x * 4 for x in v], "tau": [2.0, 2.0, 2.0]}}
    per = {"plain": tps(500.0, 500.0, 500.0), "dflash": tps(400.0, 500.0, 500.0), "dspine": tps(600.0, 500.0, 550.0),
           "dspine_tree32": tps(300.0, 300.0, 330.0), "dspine_tree64": tps(360.0, 250.0, 275.0)}
    per["dspine_tree32"]["1"]["tau"] = [2.5, 2.5, 2.5]
    (pair / "serving_step_cost.json").write_text(json.dumps({"provenance": prov, "summary": {"per_server": per}}))
    (out / "state.json").write_text(json.dumps({n: {"status": "done", "gpu": "G"} for n in ("step_cost", "pair")}))
    assert hr.main(["--out", str(out), "--collect", "--write", str(results)]) == 0
    before = {r["id"]: r for r in json.loads(open(ht.HEADLINE).read())["rows"]}
    after = {r["id"]: r for r in json.loads((results / "headline.json").read_text())["rows"]}
    new = {"step_cost_qwen3_8b", "lab_pair_sglang_tokens_per_s", "tree_served"}
    assert {i for i in after if after[i] != before[i]} == new and list(after) == list(before)
    for i in new:
        assert {k: after[i][k] for k in ("measurement", "where")} == {k: before[i][k] for k in ("measurement", "where")}
        assert after[i]["runs"] == [{"commit": "def5678", "device": "NVIDIA H100 80GB HBM3",
                                     "files": [f"headline_{'step_cost' if i.startswith('step') else 'pair'}.json"],
                                     "repeats": "3 repeats: each figure their median unless it says min / max"}]
        for name, spec in after[i]["figures"].items():
            got = ht.figure_value(spec, str(results))
            assert ht.shown(got, spec["fmt"]) == ht.shown(spec["value"], spec["fmt"]), (i, name)
        assert "def5678" in ht.render_row(after[i])
    assert after["tree_served"]["sampling_rule"] == before["tree_served"]["sampling_rule"]
    shown = {i: after[i]["result"].format(**{n: ht.shown(s["value"], s["fmt"])
                                             for n, s in after[i]["figures"].items()}) for i in new}
    assert shown["step_cost_qwen3_8b"] == ("DSPINE's step ÷ DFLASH's 1.020 / 1.020 at 1 / 4 clients, T=0; 1.050 at 1 "
                                           "clients, T=1 (single repeats 1.010–1.050)")
    assert shown["lab_pair_sglang_tokens_per_s"] == ("DSPINE ÷ DFLASH 1.100 / 1.100 at 1 / 16 clients (single repeats "
                                                     "1.000–1.500); τ ratio 1.000–1.000; DSPINE ÷ no speculation "
                                                     "1.100 / 1.100")
    assert shown["tree_served"] == ("τ ÷ the chain's 1.250 / 1.000 at N = 32 / 64 (1 client); tokens/s ÷ the chain's "
                                    "0.500–0.600 (single repeats, 1–16 clients)")


def test_every_parts_rows_from_files_shaped_as_the_committed_ones(tmp_path):
    """--write for the parts without a spread to collect (KV alone, features, pressure, training step), on copies
    of the committed summaries those scenarios wrote: the rows give back the numbers the README had from them, with
    each file's commit and GPU."""
    import shutil

    from benchmarks import headline as hr

    out, results = tmp_path / "run", tmp_path / "results"
    results.mkdir()
    shutil.copy(ht.HEADLINE, results / "headline.json")
    for part, committed in (("kv_alone", "serving_scale_alone_summary.json"),
                            ("features", "serving_features_summary.json"),
                            ("pressure", "serving_pressure_summary.json"), ("train_step", "train_scale_summary.json")):
        (out / "parts" / part).mkdir(parents=True)
        shutil.copy(os.path.join(ht.RESULTS, committed), out / "parts" / part / hr.ROW_BUILDERS[part][0])
    (out / "state.json").write_text(json.dumps({p: {"status": "done", "gpu": "G"}
                                                for p in ("kv_alone", "features", "pressure", "train_step")}))
    assert hr.main(["--out", str(out), "--collect", "--write", str(results)]) == 0
    rows = {r["id"]: r for r in json.loads((results / "headline.json").read_text())["rows"]}
    shown = {}
    for i in ("kv_cache_qwen3_8b", "request_features", "pressure", "training_step_qwen3_8b"):
        for name, spec in rows[i]["figures"].items():
            assert ht.shown(ht.figure_value(spec, str(results)), spec["fmt"]) == ht.shown(spec["value"], spec["fmt"])
        shown[i] = rows[i]["result"].format(**{n: ht.shown(s["value"], s["fmt"]) for n, s in rows[i]["figures"].items()})
    assert shown["kv_cache_qwen3_8b"] == "606,022 tokens vs DFLASH's 612,965 (0.989×)"
    assert rows["kv_cache_qwen3_8b"]["runs"][0]["commit"] == "c89e04d"
    assert shown["request_features"].startswith("DSPINE 17 of 17, stock DFLASH 14, no speculation 17")
    assert shown["pressure"] == ("DSPINE passes 4 of 4 scenarios: 0 errors, 26 differences from the server alone (26 "
                                 "at near-ties), 0 leaked KV slots; stock DFLASH passes 2")
    assert rows["pressure"]["measurement"].startswith("under pressure (built-in pair): disconnects, graph_overflow")
    assert shown["training_step_qwen3_8b"] == ("1.21× DFlash's step with the ce_anneal recipe and 2 accumulation "
                                               "steps (mean of 10 timed steps)")
    assert rows["training_step_qwen3_8b"]["runs"][0]["commit"] == "e5b9d6a"


def test_serving_summary_rewrites_the_lab_summarys_previous_not_its_second_edition(tmp_path, monkeypatch, capsys):
    """benchmarks/serving_summary.py on the committed results: lab_summary.json comes back as committed, the lab's
    second edition on top and the pair's summary under `previous` (before, it wrote the pair's over the edition)."""
    import shutil

    from benchmarks import serving_summary as ss

    results = tmp_path / "results"
    shutil.copytree(ht.RESULTS, results)
    monkeypatch.setattr(ss, "RESULTS", str(results))
    before = json.loads((results / "lab_summary.json").read_text())
    ss.main()
    after = json.loads((results / "lab_summary.json").read_text())
    assert after["edition"] == 2 and after == before
