"""benchmarks/tree_offline.py's summaries from result rows: the paper's statistic (ratio of mean τ over suites)
on τ and on the expected τ."""
from __future__ import annotations

import importlib
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
tree_offline = importlib.import_module("benchmarks.tree_offline")


def _rows():
    """Two suites at T=1: chains, and the lattice and DDTree at N=32, with τ and expected τ that differ."""
    rows = []
    for suite, scale in (("code", 1.0), ("math", 2.0)):
        for arm, n, tau, expected in (("dspine_chain", None, 1.0, 1.1), ("dflash_chain", None, 1.0, 1.0),
                                      ("dspine_lattice", 32, 1.5, 1.4), ("dflash_ddtree", 32, 1.2, 1.4)):
            rows.append({"suite": suite, "temperature": 1.0, "arm": arm, "N": n, "tau": tau * scale,
                         "tau_expected": expected * scale, "per_prompt": [[2 * tau * scale, 2]]})
    return rows


def test_expected_summary_takes_the_ratio_of_means_over_suites():
    out = tree_offline.expected_summary(_rows(), ["code", "math"], [32], [1.0])
    means = out["tau_expected_mean_over_suites"]["T=1"]
    assert means["dspine_chain"] == pytest.approx(1.65) and means["dspine_lattice@N=32"] == pytest.approx(2.1)
    assert out["tau_expected_tree_over_chain"]["T=1"]["N=32"] == pytest.approx(round(2.1 / 1.65, 4))
    assert out["tau_expected_tree_over_ddtree"]["T=1"]["N=32"] == pytest.approx(1.0)
    # the same rows' τ: a different statistic, from `summarize`
    assert tree_offline.summarize(_rows(), ["code", "math"], [32], [1.0])["tau_tree_over_ddtree"]["T=1"]["N=32"] \
        == pytest.approx(1.25)


def test_expected_summary_leaves_a_missing_expectation_out():
    rows = _rows()
    rows[2].pop("tau_expected")  # code's lattice row: an older result without it
    out = tree_offline.expected_summary(rows, ["code", "math"], [32], [1.0])
    assert out["tau_expected_tree_over_chain"]["T=1"]["N=32"] is None
    assert out["tau_expected_mean_over_suites"]["T=1"]["dspine_lattice@N=32"] is None


def test_rule_summary_reports_the_arm_picked_per_temperature():
    """--rule's arm per temperature against the DSpine chain and DDTree (ratio of means over suites, bootstrap
    intervals), with the goals under it; an arm the run did not make gives None."""
    out = tree_offline.rule_summary(_rows(), ["code", "math"], [32], [1.0], {1.0: "dspine_lattice"})
    assert out["arms"] == {"T=1": "dspine_lattice"}
    assert out["over_chain"]["T=1"]["N=32"] == pytest.approx(1.5) and out["over_ddtree"]["T=1"]["N=32"] == 1.25
    assert out["bootstrap_95"]["T=1"]["N=32"]["over_chain"] == [1.5, 1.5]  # every prompt gives the same ratio
    assert out["goals"]["tree_N32_over_chain_ge_1.30"] == {"T=1": True}
    missing = tree_offline.rule_summary(_rows(), ["code", "math"], [32], [1.0], {1.0: "dspine_extended"})
    assert missing["over_chain"]["T=1"]["N=32"] is None
    assert missing["goals"]["tree_above_ddtree_at_every_N"] == {"T=1": False}


def test_rule_argument_is_parsed_and_checked():
    assert tree_offline.parse_args([]).rule == {0.0: "dspine_anchored_depth", 1.0: "dspine_extended"}
    assert tree_offline.parse_args(["--rule", "0.5=dspine_lattice"]).rule == {0.5: "dspine_lattice"}
    for bad in ("0=dflash_ddtree", "0:dspine_lattice", "0=nope"):
        with pytest.raises(SystemExit):
            tree_offline.parse_args(["--rule", bad])


def test_a_deadline_stops_new_evaluations_and_the_summary_says_so(tmp_path):
    """--deadline-s (a lease's end): on the built-in pair, a deadline already past at the first evaluation leaves
    no rows and a summary that says where it was cut; without one every row is made and nothing is cut."""
    import json

    common = ["--limit", "1", "--calib-limit", "1", "--calib-tokens", "16", "--max-new-tokens", "8", "--sizes", "16",
              "--temperatures", "0", "--arms", "dspine_anchored_depth", "--rule", "0=dspine_anchored_depth"]
    import torch

    threads, grad = torch.get_num_threads(), torch.is_grad_enabled()
    for deadline, cut in ((["--deadline-s", "0"], 0.0), ([], None)):
        out, summary = tmp_path / f"rows{bool(deadline)}.json", tmp_path / f"summary{bool(deadline)}.json"
        assert tree_offline.main(common + deadline + ["--out", str(out), "--summary", str(summary)]) == 0
        rows, s = json.load(open(out))["rows"], json.load(open(summary))
        assert s["cut_at_deadline_s"] == cut
        suites = len({r["suite"] for r in rows}) if rows else 0
        assert len(rows) == (0 if deadline else 3 * suites) and (deadline or suites == 3)
    assert (torch.get_num_threads(), torch.is_grad_enabled()) == (threads, grad)  # the run's settings are its own


def test_the_served_trees_ratios_are_of_means_over_suites_and_the_best_round():
    """benchmarks/tree_served.py: tau as the paper counts it (mean over suites, rounds averaged) and tokens/s
    (the best round) of each tree server over the chain server's at the same temperature and client count."""
    from benchmarks import tree_served as served


    def cell(code, math, tps):
        return {"tau_by_suite": {"code": code, "math": math}, "tokens_per_s": tps}

    record = {"repeats": [{"dspine": {"1": cell(2.0, 4.0, 100.0)}, "dspine_tree32": {"1": cell(3.0, 5.0, 50.0)}},
                          {"dspine": {"1": cell(2.0, 4.0, 120.0)}, "dspine_tree32": {"1": cell(3.0, 6.0, 90.0)}}],
              "throughput_t1": {"dspine": {"16": cell(1.0, 1.2, 80.0)}, "dspine_tree32": {"16": cell(1.2, 1.4, 40.0)}}}
    out = served.step_cost_summary(record)
    t0 = out["T=0"]["dspine_tree32"]["1"]
    assert t0["tau"] == pytest.approx(4.25) and t0["tau_over_chain"] == pytest.approx(round(4.25 / 3.0, 4))
    assert t0["tokens_per_s_over_chain"] == pytest.approx(0.75) and t0["tokens_per_s_rounds"] == [50.0, 90.0]
    assert out["T=1"]["dspine_tree32"]["16"]["tau_over_chain"] == pytest.approx(round(1.3 / 1.1, 4))
    assert "tau_over_chain" not in out["T=0"]["dspine"]["1"]
    with pytest.raises(ValueError, match="no 'dspine' server"):
        served.step_cost_summary({"repeats": [{"dspine_tree32": {"1": cell(3.0, 5.0, 50.0)}}]})


def test_the_served_trees_summary_file_takes_the_step_ratios_at_qwen3_8b_geometry(tmp_path):
    """tree_served.py's file: the built-in pair's ratios, and from serving_scale's summary each tree server's step
    over DSPINE's (side by side and alone), nothing else of it."""
    import json

    from benchmarks import tree_served as served

    cell = {"tau_by_suite": {"code": 2.0}, "tokens_per_s": 10.0}
    (tmp_path / "sc.json").write_text(json.dumps({"repeats": [{"dspine": {"1": cell}, "dspine_tree32": {"1": cell}}]}))
    (tmp_path / "scale.json").write_text(json.dumps({
        "tree_step_ratio_vs_dspine_by_clients": None, "step_ratio_by_clients": {"T0": {"1": 1.01}},
        "alone_default_graph_bs": {"dspine": {"step_ratio_vs_dflash": {"1": 1.0},
                                              "dspine_tree32_step_ratio": {"1": 1.2, "48": 1.7}}}}))
    assert served.main(["--step-cost", str(tmp_path / "sc.json"), "--scale", str(tmp_path / "scale.json"),
                        "--out", str(tmp_path / "out.json")]) == 0
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["qwen3_8b_geometry"] == {"side_by_side": None, "alone": {"dspine_tree32_step_ratio": {"1": 1.2, "48": 1.7}}}
    assert out["built_in_pair"]["T=0"]["dspine_tree32"]["1"]["tau_over_chain"] == 1.0 and "e2e" not in out
