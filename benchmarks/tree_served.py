"""The served tree's numbers in one file (docs/tree.md, "Trees wider than the block"): DSPINE servers verifying
trees (SGLANG_DSPINE_TREE=1, --speculative-num-draft-tokens N) against the chain server, from the GPU runs'
result files:
- `--step-cost`: benchmarks/serve_step_cost.py's record (servers side by side on one GPU, the built-in pair):
  tau as the paper counts it (mean over suites of tokens per verify step) and output tokens/s, each server's
  ratio to the chain server's at the same temperature and client count;
- `--e2e`: serve_e2e.py's summary of a tree server (greedy equality with no speculation, the T=1 test, the load);
- `--scale`: serving_scale.py's summary at Qwen3-8B geometry (random weights: the per-step cost only).

Usage:
    python -m benchmarks tree_served --step-cost F [--e2e F] [--scale F] \
        --out benchmarks/results/tree_served_summary.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

from sglang_dspine.source_files import as_package

if not __package__:  # run as a file (python benchmarks/tree_served.py): the package `benchmarks` first
    as_package(__file__)

from benchmarks.output import write_json  # noqa: E402

CHAIN = "dspine"


def mean_over_suites(by_suite: dict) -> float:
    return statistics.fmean(by_suite.values())


def step_cost_summary(record: dict, chain: str = CHAIN) -> dict:
    """Per temperature ("T=0", "T=1"), server and client count: tau (mean over suites; rounds averaged), output
    tokens/s (the best round: the first pays first uses of batch sizes, and the rounds' spread is kept beside
    it) and both as ratios to `chain`'s."""
    t0: dict = {}
    for rnd in record["repeats"]:
        for server, by_clients in rnd.items():
            for c, r in by_clients.items():
                cell = t0.setdefault(server, {}).setdefault(c, {"tau": [], "tokens_per_s": []})
                cell["tau"].append(mean_over_suites(r["tau_by_suite"]))
                cell["tokens_per_s"].append(r["tokens_per_s"])
    t1 = {server: {c: {"tau": [mean_over_suites(r["tau_by_suite"])], "tokens_per_s": [r["tokens_per_s"]]}
                   for c, r in by_clients.items()} for server, by_clients in record.get("throughput_t1", {}).items()}
    out: dict = {}
    for temp, cells in (("T=0", t0), ("T=1", t1)):
        if not cells:  # not measured at this temperature (no --t1-concurrency)
            continue
        if chain not in cells:
            raise ValueError(f"tree_served: no {chain!r} server at {temp} in the step-cost record")
        rows: dict = {}
        for server, by_clients in cells.items():
            for c, cell in by_clients.items():
                base = cells[chain].get(c)
                tau, tps = statistics.fmean(cell["tau"]), max(cell["tokens_per_s"])
                row = {"tau": round(tau, 4), "tokens_per_s": round(tps, 1),
                       "tokens_per_s_rounds": [round(x, 1) for x in cell["tokens_per_s"]]}
                if base is not None and server != chain:
                    row["tau_over_chain"] = round(tau / statistics.fmean(base["tau"]), 4)
                    row["tokens_per_s_over_chain"] = round(tps / max(base["tokens_per_s"]), 4)
                rows.setdefault(server, {})[c] = row
        out[temp] = rows
    return out


def e2e_summary(summary: dict) -> dict:
    keys = ("exact_greedy_match", "divergence_max_top2_gap", "t1_test_pvalue", "load_requests", "load_errors",
            "cuda_graph", "bad_drafters_refused", "bad_drafters_tried", "commit")
    return {k: summary.get(k) for k in keys}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--step-cost", required=True, help="serve_step_cost.py's JSON")
    ap.add_argument("--e2e", help="serve_e2e.py's summary of a tree server")
    ap.add_argument("--scale", help="serving_scale.py's summary with tree servers")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    record = json.load(open(args.step_cost, encoding="utf-8"))
    out = {"what": "DSPINE serving trees (SGLANG_DSPINE_TREE=1) against its chain, on an H200 (SGLang 0.5.17); "
                   "tau = mean over suites of tokens per verify step; *_over_chain: ratio to the 'dspine' server's "
                   "at the same temperature and client count",
           "servers": {"dspine": "the chain", "dspine_tree": "N = B (16): greedy requests their walk, sampled ones "
                       "a tree of B - 1 nodes", "dspine_tree32": "N = 32: trees of 31 nodes, greedy requests' "
                       "scored with the drafter's tree calibration", "dspine_tree64": "N = 64: 63 nodes, as N = 32"},
           "step_cost_source": os.path.basename(args.step_cost), "step_cost_provenance": record.get("provenance"),
           "built_in_pair": step_cost_summary(record)}
    if args.e2e:
        out["e2e_source"] = os.path.basename(args.e2e)
        out["e2e"] = e2e_summary(json.load(open(args.e2e, encoding="utf-8")))
    if args.scale:
        scale = json.load(open(args.scale, encoding="utf-8"))
        out["qwen3_8b_geometry_source"] = os.path.basename(args.scale)
        alone = (scale.get("alone_default_graph_bs") or {}).get("dspine") or {}
        out["qwen3_8b_geometry"] = {  # a tree server's step ÷ DSPINE's, side by side or each server alone
            "side_by_side": scale.get("tree_step_ratio_vs_dspine_by_clients"),
            "alone": {k: v for k, v in alone.items() if k.startswith("dspine_tree")}}
    write_json(args.out, out)
    for temp, rows in out["built_in_pair"].items():
        for server, by_clients in rows.items():
            print(temp, server, {c: (r["tau"], r.get("tau_over_chain"), r.get("tokens_per_s_over_chain"))
                                 for c, r in by_clients.items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
