"""The recipe lab's summary: which DSpine training recipe wins, and by how much DSpine leads DFlash with it.

Reads a lab built by `run.py --preset recipe` (its evaluations and training metrics) and run.py's report of it
(`lab_recipe.json`: provenance, settings, target, data), and writes `lab_recipe_summary.json` and a plot.

The decision rule, fixed before the run:
  1. choice: the DSpine arms trained at the same length and seed on the same data differ only in the recipe
     (`--recipe`). On the validation prompts (drawn from the training split, never trained on, never the
     held-out suites) the default recipe is the one with the higher mean τ over the validation suites at T=0
     (over those evaluated for every candidate, where a deadline cut some: `validation_suites_used` names them;
     a recipe trained at several seeds scores the mean over its seeds; a tie chooses nothing);
     the T=1 winner is reported beside it (if it differs, the choice depends on temperature, and says so);
  2. report, on the held-out suites only: the paper's statistic, the ratio of mean τ over the suites of DSpine
     (trained on the chosen recipe, at the main pair's length: the main pair's DSpine runs, or the arms trained
     on that recipe as long, seed by seed) to DFlash (CE, its own best recipe), per seed and the mean over seeds,
     at T=0 and T=1; per-suite ratios beside it, acceptance per block position, the training curves.

    python benchmarks/lab/recipe.py --lab LAB --report benchmarks/results/lab_recipe.json \
        --out benchmarks/results/lab_recipe_summary.json
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
from typing import Any

from sglang_dspine.provenance import git_commit
from sglang_dspine.source_files import as_package

if not __package__:  # run as a file (python benchmarks/lab/x.py): the package `benchmarks` first
    as_package(__file__)

from benchmarks.output import write_json  # noqa: E402

TEMPS = ("t0", "t1")


def _read(path: str) -> dict[str, Any] | None:
    return json.load(open(path)) if os.path.isfile(path) else None


def suite_results(lab: str, label: str, suites: list[str], tk: str) -> dict[str, dict[str, Any]]:
    """{suite: the evaluation JSON} of a drafter's label at temperature tk, for the suites evaluated."""
    out = {}
    for s in suites:
        r = _read(os.path.join(lab, "eval", f"{label}_{s}_{tk}.json"))
        if r is not None:
            out[s] = r
    return out


def mean_tau(rows: dict[str, dict[str, Any]], suites: list[str]) -> float | None:
    """Mean τ over the suites (None unless every suite was evaluated): the paper's per-drafter number."""
    if not suites or any(s not in rows for s in suites):
        return None
    return sum(rows[s]["tau"] for s in suites) / len(suites)


def curve(lab: str, name: str) -> list[dict[str, Any]]:
    """The training metrics a run logged (step, loss, CE, accuracy, backbone accept length on its batches)."""
    path = os.path.join(lab, "runs", name, "metrics.jsonl")
    if not os.path.isfile(path):
        return []
    keep = ("step", "loss", "ce", "l1", "alignment", "refinement", "accuracy", "backbone_accept_len",
            "candidate_coverage")
    rows = [json.loads(x) for x in open(path) if x.strip()]
    return [{k: round(r[k], 4) if isinstance(r[k], float) else r[k] for k in keep if k in r} for r in rows]


def recipe_of(lab: str, name: str) -> str | None:
    cfg = _read(os.path.join(lab, "drafters", name, "config.json")) or {}
    rec = cfg.get("training_recipe")
    return rec.get("name") if isinstance(rec, dict) else None


def _r(x: float | None) -> float | None:
    return round(x, 4) if x is not None else None


def summarize(lab: str, report: dict[str, Any]) -> dict[str, Any]:
    p = report["settings"]
    suites = [s for s in p["suites"].split(",") if s]
    val_suites = [f"{d}_val" for d in str(p.get("val_suites") or "").split(",") if d]
    seeds = [0] + [int(s) for s in str(p.get("seeds") or "").split(",") if s.strip() and int(s) != 0]
    pairs = {s: ("dflash", "dspine") if s == 0 else (f"dflash_seed{s}", f"dspine_seed{s}") for s in seeds}
    arms = p.get("arms") or []
    out: dict[str, Any] = {
        "what": "DSpine's training recipe on the lab (run.py --preset recipe): the default recipe chosen on "
                "validation prompts, then DSpine (that recipe) vs DFlash (CE, its own best) on the held-out "
                "suites; tau = offline acceptance length (sglang-dspine eval: tokens / verify rounds)",
        "decision_rule": __doc__.split("\n\n")[2].strip(),
        "statistic": "ratio of mean tau over the suites (the paper's: mean tau DSpine / mean tau DFlash); "
                     "mean_of_suite_ratios beside it",
        "suites": suites, "validation_suites": val_suites,
        **{k: report.get(k) for k in ("command", "commit", "device", "versions", "date")},
        "summary_commit": git_commit(),  # the code that wrote this summary from the lab's files
        "steps": int(p["train_steps"]), "seeds": seeds,
        "target": {k: (report.get("target") or {}).get(k) for k in ("parameters", "steps", "heldout_loss")},
        "data": report.get("data"),
    }
    if out["data"] and out["data"].get("sequences"):
        out["data"]["epochs_at_steps"] = round(int(p["train_steps"]) * int(p["train_batch"])
                                               / out["data"]["sequences"], 3)

    # 1. the choice, on validation prompts: the DSpine arms that ask, and the main pair's (and seeds') DSpine
    # drafters with main_val
    candidates = [(a["name"], a.get("steps"), a.get("seed", 0)) for a in arms
                  if a.get("kind") == "dspine" and a.get("val")]
    if p.get("main_val"):
        candidates += [(pr[1], int(p["train_steps"]), s) for s, pr in pairs.items()]
    val: dict[str, Any] = {}
    for name, steps, seed in candidates:
        val[name] = {"recipe": recipe_of(lab, name), "steps": steps, "seed": seed}
        for tk in TEMPS:
            rows = suite_results(lab, name, val_suites, tk)
            val[name][tk] = {"tau": {s: _r(r["tau"]) for s, r in rows.items()},
                             "mean_tau": _r(mean_tau(rows, val_suites))}
    out["validation"] = val
    chosen, used = {}, {}
    for tk in TEMPS:
        # the suites every candidate was evaluated on (a deadline can cut the last ones)
        common = [x for x in val_suites if val and all(x in v[tk]["tau"] for v in val.values())]
        used[tk] = common
        by_recipe: dict[str, list[float]] = {}
        for v in val.values():
            if common:
                v[tk]["mean_tau_common"] = _r(statistics.mean(v[tk]["tau"][x] for x in common))
                by_recipe.setdefault(v["recipe"], []).append(statistics.mean(v[tk]["tau"][x] for x in common))
        scored = [(statistics.mean(ms), r) for r, ms in by_recipe.items()]
        out.setdefault("validation_mean_tau_by_recipe", {})[tk] = {r: _r(m) for m, r in scored}
        best = max(scored)[0] if len(scored) > 1 else None
        winners = [r for m, r in scored if m == best]
        chosen[tk] = winners[0] if len(winners) == 1 else None  # a tie chooses nothing
    out["validation_suites_used"] = used
    out["recipe"] = chosen["t0"]
    out["recipe_t1_winner"] = chosen["t1"]
    out["recipe_depends_on_temperature"] = (chosen["t0"] != chosen["t1"]
                                            if None not in (chosen["t0"], chosen["t1"]) else None)
    out["main_pair_recipe"] = recipe_of(lab, "dspine")

    # 2. held-out: the paper's statistic per seed and temperature, for the DSpine runs on the chosen recipe at the
    # main length (the main pair's where it was trained on it, else an arm's; the main pair's where none was)
    main_len = int(p["train_steps"])

    def run_on(recipe: str | None, seed: int) -> str | None:
        if recipe is None or recipe_of(lab, pairs[seed][1]) == recipe:
            return pairs[seed][1]
        return next((a["name"] for a in arms if a.get("kind") == "dspine" and recipe_of(lab, a["name"]) == recipe
                     and int(a.get("steps") or main_len) == main_len and int(a.get("seed") or 0) == seed), None)

    head_runs = {s: run_on(chosen["t0"], s) for s in seeds}
    if None in head_runs.values():  # the chosen recipe was not trained at the main length at every seed
        head_runs = {s: pr[1] for s, pr in pairs.items()}
    head_pairs = {s: (pairs[s][0], head_runs[s]) for s in seeds}
    out["headline_recipe"] = recipe_of(lab, head_runs[seeds[0]])
    out["headline_runs"] = {str(s): list(pr) for s, pr in head_pairs.items()}
    per_seed: dict[str, dict[str, Any]] = {}
    positions: dict[str, Any] = {}
    for tk in TEMPS:
        row: dict[str, Any] = {}
        for s, (a, b) in head_pairs.items():
            ra, rb = suite_results(lab, a, suites, tk), suite_results(lab, b, suites, tk)
            ma, mb = mean_tau(ra, suites), mean_tau(rb, suites)
            common = [x for x in suites if x in ra and x in rb]
            row[str(s)] = {
                "ratio_of_means": _r(mb / ma) if ma and mb is not None else None,
                "mean_tau": {"dflash": _r(ma), "dspine": _r(mb)},
                "tau": {x: {"dflash": _r(ra[x]["tau"]), "dspine": _r(rb[x]["tau"]),
                            "ratio": _r(rb[x]["tau"] / max(ra[x]["tau"], 1e-9))} for x in common},
                "mean_of_suite_ratios": _r(statistics.mean(rb[x]["tau"] / max(ra[x]["tau"], 1e-9) for x in common))
                if len(common) == len(suites) else None,
            }
            positions.setdefault(tk, {})[str(s)] = {
                k: {x: [round(v, 4) for v in r[x]["position_acceptance"]] for x in r} for k, r in
                (("dflash", ra), ("dspine", rb))}
        per_seed[tk] = row
        vals = [v["ratio_of_means"] for v in row.values() if v["ratio_of_means"] is not None]
        out[f"tau_ratio_of_means_{tk}"] = _r(statistics.mean(vals)) if len(vals) == len(seeds) else None
        out[f"tau_ratio_of_means_{tk}_per_seed"] = {k: v["ratio_of_means"] for k, v in row.items()}
        out[f"tau_ratio_of_means_{tk}_spread"] = ({"min": min(vals), "max": max(vals),
                                                  "std": _r(statistics.stdev(vals)) if len(vals) > 1 else 0.0}
                                                 if vals else None)
        sr = [v["mean_of_suite_ratios"] for v in row.values() if v["mean_of_suite_ratios"] is not None]
        out[f"mean_of_suite_ratios_{tk}"] = _r(statistics.mean(sr)) if len(sr) == len(seeds) else None
    out["per_seed"] = per_seed
    out["position_acceptance"] = positions

    # every trained drafter: recipe, length, seed, held-out τ per suite and temperature
    table = {}
    names = [n for pair in pairs.values() for n in pair] + [a["name"] for a in arms]
    for n in names:
        kind = "dflash" if n.startswith("dflash") else "dspine"
        arm = next((a for a in arms if a["name"] == n), None)
        seed = arm.get("seed", 0) if arm else next(s for s, pr in pairs.items() if n in pr)
        row = {"kind": kind, "recipe": recipe_of(lab, n) if kind == "dspine" else "ce (DFlash's objective)",
               "steps": int(arm.get("steps") or p["train_steps"]) if arm else int(p["train_steps"]), "seed": seed}
        for tk in TEMPS:
            rs = suite_results(lab, n, suites, tk)
            row[tk] = {"tau": {s: _r(r["tau"]) for s, r in rs.items()}, "mean_tau": _r(mean_tau(rs, suites))}
        c = curve(lab, n)
        row["train_last"] = c[-1] if c else None
        table[n] = row
    out["arms"] = table
    # each DSpine arm against the SpecForge-recipe arm trained as long, on the same seed (held-out)
    ref = {(r["steps"], r["seed"]): n for n, r in table.items() if r["recipe"] == "specforge"}
    out["ratio_of_means_to_specforge_recipe"] = {
        n: {tk: _r(r[tk]["mean_tau"] / table[ref[r["steps"], r["seed"]]][tk]["mean_tau"])
            if r[tk]["mean_tau"] and table[ref[r["steps"], r["seed"]]][tk]["mean_tau"] else None for tk in TEMPS}
        for n, r in table.items()
        if r["kind"] == "dspine" and r["recipe"] != "specforge" and (r["steps"], r["seed"]) in ref}
    # the cross: every run's ratio of mean τ to the DFlash run (CE, the main pair's) of its length and seed, and
    # each run's mean over the seeds it was trained at
    dflash_ref = {(table[pr[0]]["steps"], s): pr[0] for s, pr in pairs.items()}
    cross = {}
    for n, r in table.items():
        ref_name = dflash_ref.get((r["steps"], r["seed"]))
        if ref_name:
            cross[n] = {"reference": ref_name, **{tk: _r(r[tk]["mean_tau"] / table[ref_name][tk]["mean_tau"])
                                                  if r[tk]["mean_tau"] and table[ref_name][tk]["mean_tau"] else None
                                                  for tk in TEMPS}}
    out["cross"] = cross
    groups: dict[str, list[dict[str, Any]]] = {}
    for n, v in cross.items():
        groups.setdefault(re.sub(r"_seed\d+$", "", n), []).append(v)
    out["cross_mean_over_seeds"] = {
        g: {"runs": len(vs), **{tk: _r(statistics.mean(v[tk] for v in vs)) if all(v[tk] is not None for v in vs)
                                else None for tk in TEMPS}} for g, vs in groups.items()}
    out["training_curves"] = {n: curve(lab, n) for n in names}
    missing = [n for n, r in table.items() for tk in TEMPS if r[tk]["mean_tau"] is None]
    out["missing_evaluations"] = sorted(set(missing))
    return out


def plot(summary: dict[str, Any], path: str) -> str:
    """Acceptance per block position (math; the mean of the other suites) at T=0 and T=1, and the training
    curves (backbone accept length on the training batches)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(tk, part) for tk in TEMPS for part in ("math", "others")]
    fig, axes = plt.subplots(1, len(panels) + 1, figsize=(5 * (len(panels) + 1), 4))
    for ax, (tk, part) in zip(axes, panels):
        for seed, row in (summary["position_acceptance"].get(tk) or {}).items():
            for kind, style in (("dflash", "--"), ("dspine", "-")):
                per_suite = {s: v for s, v in (row.get(kind) or {}).items() if (s == "math") == (part == "math")}
                if not per_suite:
                    continue
                n = min(len(v) for v in per_suite.values())
                mean = [sum(v[i] for v in per_suite.values()) / len(per_suite) for i in range(n)]
                ax.plot(range(1, n + 1), mean, style, label=f"{kind} seed {seed}")
        ax.set_title(f"T={tk[1:]}, {'math' if part == 'math' else 'other suites (mean)'}")
        ax.set_xlabel("block position")
        ax.set_ylabel("share of rounds accepted this far")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    ax = axes[-1]
    for name, rows in summary["training_curves"].items():
        pts = [(r["step"], r["backbone_accept_len"]) for r in rows if "backbone_accept_len" in r]
        if pts:
            ax.plot(*zip(*pts), "--" if name.startswith("dflash") else "-", label=name)
    ax.set_title("training batches: backbone accept length")
    ax.set_xlabel("step")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    fig.suptitle(f"recipe lab, {summary['steps']} steps: ratio of mean τ DSpine ÷ DFlash "
                 f"{summary.get('tau_ratio_of_means_t0')} at T=0, {summary.get('tau_ratio_of_means_t1')} at T=1")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lab", required=True, help="the lab folder run.py --preset recipe built")
    ap.add_argument("--report", required=True, help="run.py's results JSON of that lab (lab_recipe.json)")
    ap.add_argument("--out", required=True, help="the summary JSON (lab_recipe_summary.json)")
    ap.add_argument("--plot", help="the plot (default: next to --out, named after it: lab_X_summary.json -> "
                                   "lab_X_positions.png)")
    args = ap.parse_args(argv)
    summary = summarize(args.lab, json.load(open(args.report)))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    stem = re.sub(r"(_summary)?\.json$", "", os.path.basename(args.out))
    summary["plot"] = os.path.basename(plot(summary, args.plot or os.path.join(
        os.path.dirname(os.path.abspath(args.out)), f"{stem}_positions.png")))
    write_json(args.out, summary)
    print(json.dumps({k: summary[k] for k in ("recipe", "recipe_t1_winner", "tau_ratio_of_means_t0",
                                              "tau_ratio_of_means_t0_per_seed", "tau_ratio_of_means_t1",
                                              "tau_ratio_of_means_t1_per_seed", "missing_evaluations")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
