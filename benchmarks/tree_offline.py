"""Offline τ of draft trees: DSpine's tree over its transition lattice against its chain walk,
and against DDTree's tree over the DFlash drafter's independent marginals, per suite, tree size N and temperature.

    python benchmarks/tree_offline.py                       # the built-in pair (models/default), CPU, fp32
    python benchmarks/tree_offline.py --target LAB/target --dspine LAB/drafters/dspine --dflash LAB/drafters/dflash \
        --suites LAB/corpus/prompts --device cuda --out benchmarks/results/tree_offline_lab.json \
        --summary benchmarks/results/tree_summary_lab.json

N is the number of tokens the target verifies per round, the anchor included (a tree of N - 1 draft nodes; N = 16
is the chain's cost at block size 16). τ of a suite is tokens ÷ verify rounds over its prompts (token-weighted,
as `sglang-dspine eval`). Two stages:

1. calibration (docs/tree.md): the temperature that divides each score before its log-softmax is fitted by
   cross-entropy (temperature scaling) to what verification accepts, on prompts disjoint from the evaluation's
   (by default the last 4 of each suite's 16; the evaluation takes the first --limit): the target's greedy
   token at T=0, the target's softmax(logits / T) at T>0, teacher-forced along the target's greedy continuation.
   Fitted separately for DSpine's table rows, DSpine's marginals and DFlash's marginals, at each T.
2. evaluation, per suite and T: the chains (DSpine's walk, DFlash's argmax; generate.evaluate) and, per N,
   the trees: DSpine lattice (raw: temperature 1; calibrated), DSpine extended lattice (calibrated),
   DDTree on DFlash (raw; calibrated), and DDTree's rule on DSpine's own marginals (calibrated; an ablation of the
   table); and the DSpine lattice calibrated per block position (`dspine_lattice_depth`: a temperature per position
   fitted on the rows a tree can reach, every earlier true token a candidate, plus the log of the target's mass
   on the position's candidates; tree_generate.fit_depth_calibration). Each round also records its expected
   accepted count (`tau_expected`).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from sglang_dspine.provenance import default_output
from sglang_dspine.source_files import as_package

if not __package__:  # run as a file (python benchmarks/tree_offline.py): the package `benchmarks` first
    as_package(__file__)

from benchmarks.output import write_json  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT = os.path.join(ROOT, "models", "default")

# arm -> (drafter, rule, which fitted temperatures it uses: None = raw (1.0))
ARMS = {
    "dspine_lattice_raw": ("dspine", "lattice", None),
    "dspine_lattice": ("dspine", "lattice", "dspine"),
    "dspine_lattice_depth": ("dspine", "lattice", "depth"),
    "dspine_anchored_depth": ("dspine", "anchored", "depth"),
    "dspine_extended": ("dspine", "extended", "dspine"),
    "dflash_ddtree_raw": ("dflash", "marginal", None),
    "dflash_ddtree": ("dflash", "marginal", "dflash"),
    "dspine_marginal": ("dspine", "marginal", "dspine"),
}


# The DSpine tree per temperature, picked on the built-in pair's validation prompts (8-11 of each suite) by the best
# mean τ at N = 32 (tree_summary_validation.json, then tree_summary_validation_anchored.json for the anchored tree:
# 7.719 against the lattice tree's 7.704 at T=0, 1.217 against the extended tree's 1.363 at T=1; docs/tree.md);
# fixed before the lab pair's run.
DEFAULT_RULE = "0=dspine_anchored_depth,1=dspine_extended"


# where the served tree's cost is (this offline run measures acceptance only)
STEP_COST = ("served: tree_served_summary.json (benchmarks/tree_served.py: tau and tokens/s of the tree servers "
             "against the chain's, side by side on an H200); the draft side's kernel cost: kernels_summary.json's "
             "draft_tree_over_dflash_step")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=os.path.join(DEFAULT, "target"))
    ap.add_argument("--dspine", default=os.path.join(DEFAULT, "dspine"))
    ap.add_argument("--dflash", default=os.path.join(DEFAULT, "dflash"))
    ap.add_argument("--suites", default=os.path.join(DEFAULT, "suites"), help="folder of SUITE.heldout.jsonl")
    ap.add_argument("--limit", type=int, default=8, help="evaluation prompts per suite: LIMIT from --eval-start")
    ap.add_argument("--eval-start", type=int, default=0,
                    help="evaluation prompts from this index of each suite (8: the validation prompts 8-11, between "
                         "the held-out evaluation's 0-7 and the calibration's 12-15)")
    ap.add_argument("--calib-start", type=int, default=12, help="calibration prompts: from this index of each suite")
    ap.add_argument("--calib-limit", type=int, default=4, help="calibration prompts per suite")
    ap.add_argument("--calib-tokens", type=int, default=64, help="greedy tokens per calibration prompt")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--sizes", default="16,32,64,128", help="N: tokens verified per round, the anchor included")
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--arms", default=",".join(ARMS), help=f"tree arms (of {', '.join(ARMS)})")
    ap.add_argument("--rule", default=DEFAULT_RULE,
                    help="the DSpine tree the summary's `rule` section reports, per temperature (T=ARM,...; a "
                         "temperature not listed: dspine_lattice); the default was picked on the built-in pair's "
                         "validation prompts (docs/tree.md), fixed here before any other pair's run")
    ap.add_argument("--deadline-s", type=float, default=None,
                    help="seconds from the start after which no new evaluation starts (a lease's end); the summary "
                         "is then made of the rows done, and says it was cut")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device")
    ap.add_argument("--dtype", help="default: bf16 on GPU, fp32 on CPU")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads (default 1: the models are tiny, and on a shared CPU two threads ran "
                         "20x slower than one)")
    ap.add_argument("--out", default=default_output("tree_offline_builtin.json"),
                    help="results JSON (default: $OUT or a temporary folder; the committed one: "
                         "benchmarks/results/tree_offline_builtin.json)")
    ap.add_argument("--summary", default=default_output("tree_summary.json"),
                    help="summary JSON (the committed one: benchmarks/results/tree_summary.json)")
    args = ap.parse_args(argv)
    args.sizes = [int(x) for x in args.sizes.split(",") if x.strip()]
    args.temperatures = [float(x) for x in args.temperatures.split(",") if x.strip()]
    args.arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = [a for a in args.arms if a not in ARMS]
    if unknown:
        ap.error(f"--arms: unknown {unknown}")
    try:
        args.rule = {float(t): a.strip() for t, a in (x.split("=") for x in args.rule.split(",") if x.strip())}
    except ValueError:
        ap.error(f"--rule: expected T=ARM,..., found {args.rule!r}")
    if any(a not in ARMS or ARMS[a][0] != "dspine" for a in args.rule.values()):
        ap.error(f"--rule: each ARM must be a DSpine arm of {', '.join(a for a in ARMS if ARMS[a][0] == 'dspine')}")
    if any(n < 2 for n in args.sizes):
        ap.error("--sizes: N counts the anchor, so at least 2")
    if args.calib_start < args.eval_start + args.limit:
        ap.error("--calib-start: calibration prompts must come after the evaluation prompts (disjoint sets)")
    return args


def load(args):
    from sglang_dspine.drafter.checkpoint import load_drafter
    from sglang_dspine.training.data import eos_ids_of, iter_records, prompt_ids
    from sglang_dspine.training.target_loading import default_device, load_target, load_tokenizer

    dev = default_device(args.device)
    target = load_target(args.target, args.dtype, dev)
    head = target.get_output_embeddings().weight
    drafters = {}
    for name in ("dspine", "dflash"):
        d = load_drafter(getattr(args, name), target_head=head.detach().float().cpu(), dtype=head.dtype, device=dev)
        d.cfg.check_target(head.shape[1], head.shape[0], target.config.num_hidden_layers)
        drafters[name] = d.eval()
    if not drafters["dspine"].cfg.is_dspine or drafters["dflash"].cfg.is_dspine:
        raise SystemExit("tree_offline: --dspine must be a DSpine drafter and --dflash a DFlash drafter")
    tokenizer = load_tokenizer(None, args.target)
    eos = eos_ids_of(tokenizer, target, [])
    suites, calib = {}, []
    for f in sorted(os.listdir(args.suites)):
        if not f.endswith(".heldout.jsonl"):
            continue
        name, path = f.split(".")[0], os.path.join(args.suites, f)
        recs = list(iter_records(path, "train"))
        chosen = recs[args.eval_start: args.eval_start + args.limit]
        suites[name] = [(rid, prompt_ids(rec, tokenizer, where=f"{path} id {rid}")) for rid, rec in chosen]
        calib += [prompt_ids(rec, tokenizer) for _, rec in recs[args.calib_start: args.calib_start + args.calib_limit]]
    if not suites:
        raise SystemExit(f"tree_offline: no *.heldout.jsonl in {args.suites}")
    if not calib:
        raise SystemExit(f"tree_offline: no calibration prompts: no suite in {args.suites} has a prompt at index "
                         f"--calib-start {args.calib_start} or after (lower it, keeping it past the evaluation's)")
    return target, drafters, eos, suites, calib, dev


def calibrate(target, drafters, calib, temperatures, tokens, eos, progress) -> dict:
    """{str(T): {"dspine": {"row": t, "marginal": t, "row_depth": [t per position], "row_log_mass": [...]},
    "dflash": {"marginal": t}, "cross_entropy": ...}}."""
    from sglang_dspine.training.tree_generate import calibration_set, fit_depth_calibration, fit_temperature

    out = {}
    for temp in temperatures:
        entry, ce = {}, {}
        for name, d in drafters.items():
            cal = calibration_set(target, d, calib, tokens, temp, eos_token_ids=eos)
            t_m, ce_m = fit_temperature(cal.marginal, cal.marginal_labels)
            entry[name] = {"marginal": t_m, "marginal_rows": len(cal.marginal)}
            ce[f"{name}_marginal"] = {"at_1": ce_m[min(ce_m, key=lambda x: abs(x - 1))], "at_fit": ce_m[t_m]}
            if cal.rows is not None:
                t_r, ce_r = fit_temperature(cal.rows, cal.row_labels)
                entry[name].update(row=t_r, table_rows=len(cal.rows))
                t_d, m_d = fit_depth_calibration(cal, d.cfg.block_size - 1)
                entry[name].update(row_depth=t_d, row_log_mass=[round(m, 4) for m in m_d],
                                   reachable_rows=int(cal.row_reached.sum()))
                ce[f"{name}_row"] = {"at_1": ce_r[min(ce_r, key=lambda x: abs(x - 1))], "at_fit": ce_r[t_r]}
            progress(f"calibration T={temp:g} {name}")
        entry["cross_entropy"] = ce
        out[f"{temp:g}"] = entry
    return out


def bootstrap_ratio(rows: list[dict], suites: list[str], temp: float, a: tuple, b: tuple, draws: int = 2000,
                    seed: int = 0) -> list[float] | None:
    """95% percentile interval of mean-over-suites τ(a) ÷ τ(b), a and b = (arm, N), resampling each suite's
    prompts with replacement (the same prompts for both arms: they ran on the same prompts)."""
    import random

    per = {(r["suite"], r["arm"], r["N"]): r["per_prompt"] for r in rows if r["temperature"] == temp}
    if any((s, *x) not in per for s in suites for x in (a, b)):
        return None
    rng = random.Random(seed)
    out = []
    for _ in range(draws):
        ta = tb = 0.0
        for s in suites:
            pa, pb = per[(s, *a)], per[(s, *b)]
            idx = [rng.randrange(len(pa)) for _ in pa]
            ta += sum(pa[i][0] for i in idx) / max(sum(pa[i][1] for i in idx), 1)
            tb += sum(pb[i][0] for i in idx) / max(sum(pb[i][1] for i in idx), 1)
        out.append(ta / tb)
    out.sort()
    return [round(out[int(0.025 * draws)], 4), round(out[int(0.975 * draws) - 1], 4)]


def suite_means(rows: list[dict], suites: list[str], key: str = "tau"):
    """mean(arm, temp, N): the mean over `suites` of the rows' `key` (the paper's statistic is a ratio of such
    means); None where a suite has no value."""
    tau = {(r["suite"], r["temperature"], r["arm"], r["N"]): r.get(key) for r in rows}

    def mean(arm, temp, n):
        vals = [tau.get((s, temp, arm, n)) for s in suites]
        return sum(vals) / len(vals) if vals and all(v is not None for v in vals) else None

    return mean


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 4) if a is not None and b else None


def goals(over_chain: dict, over_ddtree: dict, sizes: list[int]) -> dict:
    """The issue's goals from a tree's {T: {"N=n": ratio}} against the DSpine chain and against DDTree."""
    return {
        "tree_N32_over_chain_ge_1.30": {k: (v.get("N=32") is not None and v["N=32"] >= 1.30)
                                        for k, v in over_chain.items()},
        "tree_above_ddtree_at_every_N": {k: all(x is not None and x > 1 for x in v.values())
                                         for k, v in over_ddtree.items()},
        "tree_N_le_64_over_chain_ge_1.2 (item 2's gate)": {
            k: any(v.get(f"N={n}") is not None and v[f"N={n}"] >= 1.2 for n in sizes if n <= 64)
            for k, v in over_chain.items()},
    }


def summarize(rows: list[dict], suites: list[str], sizes: list[int], temperatures: list[float]) -> dict:
    """Ratios of mean τ over the suites (the paper's statistic, docs/results.md), and per suite; 95% bootstrap
    intervals over prompts for the headline ratios."""
    tau = {(r["suite"], r["temperature"], r["arm"], r["N"]): r["tau"] for r in rows}
    mean = suite_means(rows, suites)
    out: dict = {"tau_mean_over_suites": {}, "tau_tree_over_chain": {}, "tau_tree_over_chain_raw": {},
                 "tau_tree_over_ddtree": {}, "tau_tree_over_ddtree_raw": {}, "tau_extended_over_chain": {},
                 "tau_extended_over_ddtree": {}, "tau_ddtree_over_dflash_chain": {},
                 "tau_lattice_over_dspine_marginal": {}, "bootstrap_95": {}, "per_suite": {}}
    arms = sorted({r["arm"] for r in rows if r["N"] is not None})
    for temp in temperatures:
        key = f"T={temp:g}"
        ch_s, ch_f = mean("dspine_chain", temp, None), mean("dflash_chain", temp, None)
        means = {"dspine_chain": ch_s, "dflash_chain": ch_f}
        for n in sizes:
            for arm in arms:
                means[f"{arm}@N={n}"] = mean(arm, temp, n)
            ln = f"N={n}"
            out["tau_tree_over_chain"].setdefault(key, {})[ln] = ratio(mean("dspine_lattice", temp, n), ch_s)
            out["tau_tree_over_chain_raw"].setdefault(key, {})[ln] = ratio(mean("dspine_lattice_raw", temp, n), ch_s)
            out["tau_tree_over_ddtree"].setdefault(key, {})[ln] = ratio(mean("dspine_lattice", temp, n),
                                                                         mean("dflash_ddtree", temp, n))
            out["tau_tree_over_ddtree_raw"].setdefault(key, {})[ln] = ratio(mean("dspine_lattice_raw", temp, n),
                                                                             mean("dflash_ddtree_raw", temp, n))
            out["tau_extended_over_chain"].setdefault(key, {})[ln] = ratio(mean("dspine_extended", temp, n), ch_s)
            out["tau_extended_over_ddtree"].setdefault(key, {})[ln] = ratio(mean("dspine_extended", temp, n),
                                                                             mean("dflash_ddtree", temp, n))
            out["tau_ddtree_over_dflash_chain"].setdefault(key, {})[ln] = ratio(mean("dflash_ddtree", temp, n), ch_f)
            out["tau_lattice_over_dspine_marginal"].setdefault(key, {})[ln] = ratio(mean("dspine_lattice", temp, n),
                                                                                    mean("dspine_marginal", temp, n))
            boot = out["bootstrap_95"].setdefault(key, {}).setdefault(ln, {})
            for label, a, b in (("tree_over_chain", ("dspine_lattice", n), ("dspine_chain", None)),
                                ("tree_over_ddtree", ("dspine_lattice", n), ("dflash_ddtree", n)),
                                ("extended_over_chain", ("dspine_extended", n), ("dspine_chain", None)),
                                ("extended_over_ddtree", ("dspine_extended", n), ("dflash_ddtree", n))):
                boot[label] = bootstrap_ratio(rows, suites, temp, a, b)
        out["tau_mean_over_suites"][key] = {k: (round(v, 4) if v is not None else None) for k, v in means.items()}
        for s in suites:
            c = tau.get((s, temp, "dspine_chain", None))
            out["per_suite"].setdefault(key, {})[s] = {
                f"N={n}": {"tree_over_chain": ratio(tau.get((s, temp, "dspine_lattice", n)), c),
                           "tree_over_ddtree": ratio(tau.get((s, temp, "dspine_lattice", n)),
                                                     tau.get((s, temp, "dflash_ddtree", n)))}
                for n in sizes}
    out["goals"] = goals(out["tau_tree_over_chain"], out["tau_tree_over_ddtree"], sizes)
    return out


def expected_summary(rows: list[dict], suites: list[str], sizes: list[int], temperatures: list[float]) -> dict:
    """The same mean-over-suites τ and headline ratios on `tau_expected` (each round's accepted count replaced
    by its expectation given the round's context, drafter/tree.py expected_accepted): at T > 0 the acceptance
    draws' noise is gone (the generated text is still sampled), so small differences between tree sizes and
    rules are readable on few prompts; at T = 0 it equals τ."""
    mean = suite_means(rows, suites, "tau_expected")
    arms = sorted({r["arm"] for r in rows if r["N"] is not None})
    out: dict = {"tau_expected_mean_over_suites": {}, "tau_expected_tree_over_chain": {},
                 "tau_expected_tree_over_ddtree": {}}
    for temp in temperatures:
        key = f"T={temp:g}"
        means = {c: mean(c, temp, None) for c in ("dspine_chain", "dflash_chain")}
        for n in sizes:
            means |= {f"{arm}@N={n}": mean(arm, temp, n) for arm in arms}
            tree = mean("dspine_lattice", temp, n)
            out["tau_expected_tree_over_chain"].setdefault(key, {})[f"N={n}"] = ratio(tree, means["dspine_chain"])
            out["tau_expected_tree_over_ddtree"].setdefault(key, {})[f"N={n}"] = ratio(
                tree, mean("dflash_ddtree", temp, n))
        out["tau_expected_mean_over_suites"][key] = {k: (round(v, 4) if v is not None else None)
                                                     for k, v in means.items()}
    return out


def rule_summary(rows: list[dict], suites: list[str], sizes: list[int], temperatures: list[float],
                 rule: dict[float, str]) -> dict:
    """The paper's statistic for the DSpine tree `rule` picks per temperature (--rule): its mean τ over suites ÷
    the DSpine chain's and ÷ DDTree-on-DFlash's, with 95% bootstrap intervals over prompts, and the issue's
    goals under it. An arm the run did not make gives None."""
    mean = suite_means(rows, suites)
    out: dict = {"arms": {}, "over_chain": {}, "over_ddtree": {}, "bootstrap_95": {}}
    for temp in temperatures:
        key, arm = f"T={temp:g}", rule.get(temp, "dspine_lattice")
        out["arms"][key] = arm
        chain = mean("dspine_chain", temp, None)
        for n in sizes:
            tree = mean(arm, temp, n)
            out["over_chain"].setdefault(key, {})[f"N={n}"] = ratio(tree, chain)
            out["over_ddtree"].setdefault(key, {})[f"N={n}"] = ratio(tree, mean("dflash_ddtree", temp, n))
            out["bootstrap_95"].setdefault(key, {})[f"N={n}"] = {
                "over_chain": bootstrap_ratio(rows, suites, temp, (arm, n), ("dspine_chain", None)),
                "over_ddtree": bootstrap_ratio(rows, suites, temp, (arm, n), ("dflash_ddtree", n))}
    out["goals"] = goals(out["over_chain"], out["over_ddtree"], sizes)
    return out


def markdown(rows: list[dict], suites: list[str], sizes: list[int], temperatures: list[float], arms: list[str]) -> str:
    tau = {(r["suite"], r["temperature"], r["arm"], r["N"]): r["tau"] for r in rows}
    head = ["T", "suite", "N", "DSpine chain", "DFlash chain"] + arms
    lines = ["| " + " | ".join(head) + " |", "| --- | --- | ---: |" + " ---: |" * (len(head) - 3)]
    for temp in temperatures:
        for s in suites + ["mean"]:
            for n in sizes:
                def cell(arm, nn, temp=temp, s=s):
                    vals = [tau.get((x, temp, arm, nn)) for x in (suites if s == "mean" else [s])]
                    return f"{sum(vals) / len(vals):.2f}" if all(v is not None for v in vals) else "-"
                lines.append(f"| {temp:g} | {s} | {n} | {cell('dspine_chain', None)} | {cell('dflash_chain', None)} | "
                             + " | ".join(cell(a, n) for a in arms) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    import torch

    args = parse_args(argv)
    threads = torch.get_num_threads()
    try:  # no gradients and --threads for this run only (a caller's settings come back: tests call main)
        if args.threads:
            torch.set_num_threads(args.threads)
        with torch.no_grad():
            return _run(args, argv)
    finally:
        torch.set_num_threads(threads)


def _run(args, argv) -> int:
    import torch
    from tqdm import tqdm

    from sglang_dspine.provenance import provenance
    from sglang_dspine.training.generate import evaluate
    from sglang_dspine.training.tree_generate import evaluate_tree

    t_start = time.time()
    target, drafters, eos, suites, calib, dev = load(args)
    names = list(suites)
    n_evals = len(args.temperatures) * len(names) * (2 + len(args.arms) * len(args.sizes))
    bar = tqdm(total=2 * len(args.temperatures) + n_evals, desc="tree_offline", dynamic_ncols=True)

    def step(msg):
        bar.set_postfix_str(msg)
        bar.update(1)

    calibration = calibrate(target, drafters, calib, args.temperatures, args.calib_tokens, eos, step)
    prov = provenance(argv if argv is not None else sys.argv)
    dirty = os.popen(f"git -C {ROOT} status --porcelain 2>/dev/null").read().strip()
    record = {
        "what": "offline tau of draft trees: DSpine lattice tree vs chain walk vs DDTree on DFlash",
        **prov, "device": prov["gpu"] or f"cpu ({torch.get_num_threads()} threads)", "worktree_dirty": bool(dirty),
        "settings": {k: getattr(args, k) for k in ("target", "dspine", "dflash", "suites", "limit", "calib_start",
                                                      "calib_limit", "calib_tokens", "max_new_tokens", "sizes",
                                                      "eval_start", "rule",
                                                      "temperatures", "arms", "seed")},
        "dtype": str(target.get_output_embeddings().weight.dtype),
        "N_means": "tokens the target verifies per round, the anchor included (tree of N - 1 draft nodes)",
        "arms": {a: {"drafter": ARMS[a][0], "rule": ARMS[a][1],
                     "temperature": {None: 1.0, "depth": "fitted per block position, with the candidates' mass"}.get(
                         ARMS[a][2], "fitted")}
                 for a in args.arms},
        "calibration": calibration, "rows": [],
    }

    save = lambda: write_json(args.out, record)

    def out_of_time() -> bool:
        if args.deadline_s is not None and time.time() - t_start > args.deadline_s:
            record["cut_at_deadline_s"] = args.deadline_s  # the rows stop here; the summary is of what was done
            return True
        return False

    for temp in args.temperatures:
        cal = calibration[f"{temp:g}"]
        for suite, prompts in suites.items():
            for name in ("dspine", "dflash"):
                if out_of_time():
                    break
                res = evaluate(target, drafters[name], prompts, args.max_new_tokens, temp, eos, seed=args.seed)
                record["rows"].append({"suite": suite, "temperature": temp, "arm": f"{name}_chain", "N": 16,
                                       "chain_N": drafters[name].cfg.block_size, **_brief(res)})
                record["rows"][-1]["N"] = None
                step(f"T={temp:g} {suite} {name} chain tau {res['tau']:.2f}")
                save()
            for n in args.sizes:
                for arm in args.arms:
                    if out_of_time():
                        break
                    name, rule, fitted = ARMS[arm]
                    row_t = cal[name].get("row", 1.0) if fitted else 1.0
                    marg_t = cal[name]["marginal"] if fitted else 1.0
                    log_mass = None
                    if fitted == "depth":
                        row_t, log_mass = cal[name]["row_depth"], cal[name]["row_log_mass"]
                    res = evaluate_tree(target, drafters[name], prompts, args.max_new_tokens, n - 1, rule, temp, eos,
                                        seed=args.seed, row_temperature=row_t, marginal_temperature=marg_t,
                                        row_log_mass=log_mass)
                    record["rows"].append({"suite": suite, "temperature": temp, "arm": arm, "N": n, **_brief(res),
                                           "mean_tree_nodes": res["mean_tree_nodes"],
                                           "mean_tree_depth": res["mean_tree_depth"],
                                           "row_temperature": row_t, "marginal_temperature": marg_t,
                                           "row_log_mass": log_mass})
                    step(f"T={temp:g} {suite} {arm} N={n} tau {res['tau']:.2f}")
                    save()
    bar.close()
    record["seconds"] = round(time.time() - t_start, 1)
    table = markdown(record["rows"], names, args.sizes, args.temperatures, args.arms)
    record["table_markdown"] = table
    save()
    summary = {"what": "draft trees offline: ratios of mean tau over suites (and per suite); tree = DSpine lattice "
                       "tree with calibrated temperature; raw = temperature 1; ddtree = DDTree on the DFlash drafter",
               **{k: record[k] for k in ("command", "commit", "device", "versions", "date", "worktree_dirty",
                                         "settings", "N_means", "arms")},
               "source": os.path.relpath(args.out, ROOT), "calibration": calibration,
               **summarize(record["rows"], names, args.sizes, args.temperatures),
               **expected_summary(record["rows"], names, args.sizes, args.temperatures),
               "rule": {"chosen_on": ("the built-in pair's validation prompts (tree_summary_validation.json, "
                                      "tree_summary_validation_anchored.json)"
                                      if args.rule == parse_args([]).rule else "--rule as given"),
                        **rule_summary(record["rows"], names, args.sizes, args.temperatures, args.rule)},
               "step_cost": STEP_COST,
               "cut_at_deadline_s": record.get("cut_at_deadline_s"), "seconds": record["seconds"]}
    write_json(args.summary, summary)
    print(table)
    print(json.dumps({k: summary[k] for k in ("tau_tree_over_chain", "tau_tree_over_ddtree", "tau_extended_over_chain",
                                              "tau_extended_over_ddtree", "goals")}, indent=1))
    return 0


def _brief(res: dict) -> dict:
    """A result's numbers; per_prompt: [accepted lengths summed, rounds] of each prompt (for the bootstrap)."""
    return {k: res[k] for k in ("tau", "tau_expected", "rounds", "tokens", "prompts", "seconds")} | {
        "position_acceptance": [round(x, 4) for x in res["position_acceptance"]],
        "per_prompt": [[round(p["tau"] * p["rounds"]), p["rounds"]] for p in res["per_prompt"]]}


if __name__ == "__main__":
    sys.exit(main())
