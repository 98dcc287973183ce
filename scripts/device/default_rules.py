"""The decision rules that pick the verify defaults from a lease's runs (issue 57), written before the lease that
judges them, so that nobody picks a rule after seeing the numbers (the leases ran scripts/device/issue57.sh).

    python3 scripts/device/default_rules.py RUN_JSON [--rep2 RUN_JSON] [--gpu-tests-log LOG] [--summary SUMMARY]

RUN_JSON is the lease's $OUT/adaptive.json (scripts/device/adaptive.py), --rep2 the pair's second pass, LOG the
GPU tests' pytest output (scripts/device/gpu_tests.sh), SUMMARY the merged adaptive_summary.json (`adaptive.py
--merge`: its float32 verdicts on the switching server's greedy divergences). Prints one line a rule and writes
nothing; a rule whose data the runs lack says so (`undecided`), never passes.
Rules (each ratio is of median tokens/s, each server alone on the GPU, T=0):
  new_cost       the policy's cost (the larger of settled wall time and GPU time, with refresh) stays if, at Qwen3-8B
                 geometry and 1 client, adaptive below-block runs `none` on >= 80% of its steps and serves >= 0.95x
                 plain decoding;
  below_block    SGLANG_DSPINE_SPLITKV_VERIFY=below-block becomes the adaptive default on triton if, at the
                 geometry, it serves >= 0.97x the extend-kernel adaptive server at every client count and >= 1.10x
                 at 48 and 64, and while switching the T=1 test passes (Bonferroni min p >= 0.05) with every greedy
                 divergence a near-tie (float32 when the summary has it, else the server's log-probs);
  split_kv       SGLANG_DSPINE_SPLITKV_VERIFY=1 becomes every chain server's default on triton if fixed DSPINE with
                 it serves >= 1.03x fixed DSPINE without it from 4 clients up and >= 0.97x at 1, and the GPU tests
                 pass (`graph_dspine` among them);
  floors         (written 2026-12-06, after 33f82f8) the policy's cost floors (0d6c622: a shape is explored at a
                 bucket only where it could win there) stay if, at the geometry (τ = 1), adaptive below-block runs
                 shapes other than `none` on <= 2% of its steps at 48 and 64 clients and serves >= 0.95x plain
                 decoding at every client count;
  grouped        (written 2026-12-06, before patch 10 ran on a GPU) SGLANG_DSPINE_SPLITKV_VERIFY=grouped becomes every
                 chain server's default on triton if the GPU tests pass (the grouped kernel's among them), at the
                 geometry fixed DSPINE with it serves >= 1.05x fixed DSPINE without it at 16, 48 and 64 clients and
                 >= 0.98x at 1 and 4, and on the pair its greedy outputs equal plain's on at least as many prompts as
                 fixed DSPINE's do, less one;
  upkeep         (written 2026-12-07 after 97513c7, which the first upkeep rule judged `not met`: the upkeep's GPU
                 tests failed, on their float32 drafter, before reaching the graphs, so every adaptive server ran
                 the eager writer and the default became 0) SGLANG_DSPINE_UPKEEP_GRAPHS becomes 1 by default if the
                 GPU tests pass (the upkeep's among them: --gpu-tests-log may be their own log) and the adaptive
                 server with the graphs (`_upkeep_graphs`) serves >= 0.98x the default one at the geometry at every
                 client count both ran (at 97513c7 two identical eager servers measured 0.977 and 0.987 of each
                 other there); the pair's ratios are printed, not judged (there the identical servers measured
                 0.722-1.012 of each other);
  wrapper        (a diagnosis, written 2026-12-07 after 84ba46f) the adaptive step's own work costs the pair if
                 the adaptive server with a menu of the block and chain15 (`dspine_adaptive_wide`: the adaptive
                 step's work, shapes that cost and carry about the same) serves <= 0.90x fixed DSPINE at 16 and 48
                 clients in both passes; else its switching and exploration do;
  tree_grouped   (written 2026-12-07 after 84ba46f) trees verify on the grouped kernel by default if the GPU tests
                 pass, the grouped tree's greedy outputs equal plain's on >= 17 of the pair's 24 prompts, and its
                 tree32 step at the geometry is <= 0.95x the extend kernel's at 1, 4 and 16 requests;
  cap_cost       (a diagnosis, written 2026-12-07 after 671b819, where fixed DSPINE with the adaptive server's cap of
                 128 running requests served 0.87 / 0.86 / 0.78x fixed DSPINE's 48 at 1 / 16 / 48 clients on the pair,
                 one pass) the cap itself costs the pair's step if `dspine_cap128` serves <= 0.95x `dspine` at 1
                 and 16 clients (where neither server's cap is reached, so admission cannot differ) in both passes;
                 both cap rules are undecided where fixed DSPINE's two passes differ by more than 5% at 1 or 16;
  cap_graphs     (the same) where cap_cost is met, the verify and draft graphs captured for 49-64 requests are
                 that cost if `dspine_cap128_graphs48` (the cap of 128, --cuda-graph-max-bs-decode 48) serves
                 >= 0.97x `dspine` at 1 and 16 clients in both passes; 48 clients printed, not judged (there
                 SGLang's MinFreeSlotsDelayer batches a full cap's admissions, which a cap of 128 never triggers);
  admission      (written 2026-12-07 after 671b819) the adaptive server's defaults gain SGLang's prefill delayer
                 (--enable-prefill-delayer --prefill-delayer-queue-min-ratio 0.09 --prefill-delayer-max-delay-ms
                 100: fresh admissions batched, as a full cap of 48 batches them) if `dspine_cap128_delayed` serves
                 >= 1.10x `dspine_cap128` at 48 clients and >= 0.97x it at 1 and 16 in both passes of the pair
                 (undecided where dspine_cap128's two passes differ by more than 5% at 48);
  tree64         (written 2026-12-07, stop 73, before the lease that runs it) the docs' recommended tree for an
                 adaptive server (SGLANG_DSPINE_TREE=1, --speculative-num-draft-tokens N) becomes N = 64, from 32,
                 if the GPU tests pass (the grouped kernel's 64-row tile among them), on the pair the adaptive tree64
                 server's greedy outputs equal plain's (this run's plain, else 671b819's kept one, which equals
                 84ba46f's on 24/24) on >= 17 of 24 prompts, and at 1 request E(tree64) / (tree64 step ÷ chain16
                 step) >= 1.05x the same for the tree of 32: E from each adaptive tree server on the pair in this
                 run (its mean tokens a tree step after its last T=0 cell), each step ratio from one geometry table
                 (tree64's from this run, tree32's from this run or else 671b819's grouped tree server), so that
                 leases compare only within a table; undecided where 671b819's references are read on another GPU;
  adaptive       adaptive becomes the server default if on the pair it serves >= 0.97x fixed DSPINE at 1, 16 and 48
                 clients in both passes, and at the geometry >= fixed DSPINE at every client count (the adaptive
                 server the below_block rule makes the default).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys

from sglang_dspine.source_files import load_package

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
load_package("benchmarks", os.path.join(_ROOT, "benchmarks"))  # the repository root stays off sys.path
from benchmarks.servers import NEAR_TIE_MARGIN  # noqa: E402 - the harness' near-tie rule (nats)

T1_ALPHA = 0.05


class Undecided(Exception):
    """The runs lack what a rule needs."""


def tokens_per_s(run: dict, phase: str, server: str) -> dict[int, float]:
    cells = run.get(phase, {}).get(server, {}).get("t0") or {}
    if not cells:
        raise Undecided(f"no {phase} cells for {server}")
    return {int(c): v["tokens_per_s"]["median"] for c, v in cells.items()}


def ratios(run: dict, phase: str, num: str, den: str) -> dict[int, float]:
    a, b = tokens_per_s(run, phase, num), tokens_per_s(run, phase, den)
    if set(a) != set(b):
        raise Undecided(f"{phase}: {num} ran at {sorted(a)} clients, {den} at {sorted(b)}")
    return {c: a[c] / b[c] for c in sorted(a)}


def fmt(r: dict[int, float]) -> str:
    return " ".join(f"{c}:{v:.3f}" for c, v in r.items())


def new_cost(run: dict, **_) -> tuple[bool, str]:
    cell = run.get("geometry", {}).get("dspine_adaptive_below_block", {}).get("t0", {}).get("1")
    if not cell or not cell.get("shapes"):
        raise Undecided("no 1-client cell with shapes for dspine_adaptive_below_block at the geometry")
    none = cell["shapes"].get("none", 0) / sum(cell["shapes"].values())
    vs_plain = ratios(run, "geometry", "dspine_adaptive_below_block", "plain")[1]
    return none >= 0.80 and vs_plain >= 0.95, f"none {none:.1%} of steps (>= 80%), {vs_plain:.3f}x plain (>= 0.95)"


def floors(run: dict, **_) -> tuple[bool, str]:
    cells = run.get("geometry", {}).get("dspine_adaptive_below_block", {}).get("t0", {})
    shares = {}
    for c in ("48", "64"):
        shapes = (cells.get(c) or {}).get("shapes")
        if not shapes:
            raise Undecided(f"no {c}-client cell with shapes for dspine_adaptive_below_block at the geometry")
        shares[int(c)] = 1 - shapes.get("none", 0) / sum(shapes.values())
    r = ratios(run, "geometry", "dspine_adaptive_below_block", "plain")
    ok = all(v <= 0.02 for v in shares.values()) and all(v >= 0.95 for v in r.values())
    return ok, (f"other shapes {' '.join(f'{c}:{v:.1%}' for c, v in shares.items())} of steps (<= 2%); "
                f"÷ plain {fmt(r)} (>= 0.95)")


def switching_lossless(run: dict, summary: dict | None) -> tuple[bool, str]:
    sw = run.get("switching") or {}
    if "t1" not in sw:
        raise Undecided("no switching record")
    p = sw["t1"]["bonferroni_min_pvalue"]
    fp32 = ((summary or {}).get("switching") or {}).get("greedy_divergences_fp32")
    if fp32:
        divs = fp32.get("divergences", [])
        near = sum(bool(d.get("near_tie")) for d in divs)
        ties, how = near == len(divs), f"{near}/{len(divs)} divergences float32 near-ties"
    else:
        gaps = [d.get("top2_logprob_gap") for d in sw["greedy"].get("divergences", [])]
        ties = all(g is not None and g <= NEAR_TIE_MARGIN for g in gaps)
        how = f"largest server log-prob gap {max((g for g in gaps if g is not None), default=0):.4f} (no float32)"
    return p is not None and p >= T1_ALPHA and ties, f"T=1 min p {p} (>= {T1_ALPHA}), {how}"


def below_block(run: dict, summary: dict | None = None, **_) -> tuple[bool, str]:
    r = ratios(run, "geometry", "dspine_adaptive_below_block", "dspine_adaptive")
    wide = [c for c in (48, 64) if c in r]
    if len(wide) < 2:
        raise Undecided("the geometry lacks 48 or 64 clients")
    speed = all(v >= 0.97 for v in r.values()) and all(r[c] >= 1.10 for c in wide)
    lossless, why = switching_lossless(run, summary)
    return speed and lossless, f"÷ adaptive (extend) {fmt(r)} (>= 0.97, >= 1.10 at 48/64); {why}"


def gpu_tests_passed(log: str | None) -> tuple[bool, str]:
    if log is None:
        raise Undecided("no GPU tests log")
    tail = log.strip().splitlines()[-1] if log.strip() else ""
    passed = re.search(r"\d+ passed", tail) and not re.search(r"\d+ (failed|errors?)\b", tail)
    return bool(passed), f"GPU tests: {tail or 'an empty log'}"


def split_kv(run: dict, gpu_log: str | None = None, **_) -> tuple[bool, str]:
    r = ratios(run, "geometry", "dspine_splitkv", "dspine")
    speed = all(v >= (0.97 if c < 4 else 1.03) for c, v in r.items())
    tests, why = gpu_tests_passed(gpu_log)
    return speed and tests, f"÷ fixed {fmt(r)} (>= 0.97 at 1, >= 1.03 from 4); {why}"


def greedy_equal(run: dict, server: str) -> tuple[int, int]:
    """(prompts whose greedy output equals plain's, prompts) on the pair."""
    pair = run.get("pair", {})
    mine, plain = (pair.get(n, {}).get("greedy_ids") for n in (server, "plain"))
    if not mine or not plain:
        raise Undecided(f"no pair greedy outputs for {server} and plain")
    return sum(a == b for a, b in zip(mine, plain)), len(plain)


def grouped(run: dict, gpu_log: str | None = None, **_) -> tuple[bool, str]:
    r = ratios(run, "geometry", "dspine_grouped", "dspine")
    if set(r) != {1, 4, 16, 48, 64}:
        raise Undecided(f"the geometry ran at {sorted(r)} clients, not 1, 4, 16, 48 and 64")
    speed = all(v >= (0.98 if c <= 4 else 1.05) for c, v in r.items())
    (same, n), (base, _) = greedy_equal(run, "dspine_grouped"), greedy_equal(run, "dspine")
    tests, why = gpu_tests_passed(gpu_log)
    return speed and same >= base - 1 and tests, (f"÷ fixed {fmt(r)} (>= 0.98 at 1/4, >= 1.05 from 16); greedy = "
                                                  f"plain {same}/{n} (fixed {base}/{n}, >= {base - 1}); {why}")


def adaptive(run: dict, rep2: dict | None = None, summary: dict | None = None, gpu_log: str | None = None,
             **_) -> tuple[bool, str]:
    if rep2 is None:
        raise Undecided("no second pass of the pair")
    passes = [ratios(p, "pair", "dspine_adaptive", "dspine") for p in (run, rep2)]
    pair_ok = all(p.get(c, 0) >= 0.97 for p in passes for c in (1, 16, 48))
    try:
        default = "dspine_adaptive_below_block" if below_block(run, summary)[0] else "dspine_adaptive"
    except Undecided:
        default = "dspine_adaptive"
    geo = ratios(run, "geometry", default, "dspine")
    ok = pair_ok and all(v >= 1.0 for v in geo.values())
    return ok, (f"pair ÷ fixed, pass 1 {fmt(passes[0])}, pass 2 {fmt(passes[1])} (>= 0.97 at 1/16/48); "
                f"geometry {default} ÷ fixed {fmt(geo)} (>= 1)")


def upkeep(run: dict, gpu_log: str | None = None, **_) -> tuple[bool, str]:
    geo = ratios(run, "geometry", "dspine_adaptive_upkeep_graphs", "dspine_adaptive")
    try:
        pair = fmt(ratios(run, "pair", "dspine_adaptive_upkeep_graphs", "dspine_adaptive"))
    except Undecided as e:
        pair = str(e)
    tests, why = gpu_tests_passed(gpu_log)
    ok = tests and all(v >= 0.98 for v in geo.values())
    return ok, f"graphs ÷ eager upkeep, geometry {fmt(geo)} (>= 0.98), pair {pair} (not judged); {why}"


PASS_SPREAD = 0.05  # the largest difference the pair rules allow between a baseline's two instances (one a pass)


def _both_passes(run: dict, rep2: dict | None, num: str, den: str, clients=(1, 16),
                 spread_at=(1, 16)) -> list[dict[int, float]]:
    """num ÷ den on the pair in each pass, each holding `clients`. Undecided where `den`'s two instances differ by
    more than PASS_SPREAD at a client count of `spread_at`: identical servers started twice have differed by up to
    28% on the pair (97513c7), more than the effects these rules look for."""
    if rep2 is None:
        raise Undecided("no second pass of the pair")
    passes = [ratios(p, "pair", num, den) for p in (run, rep2)]
    if not all(set(clients) <= set(p) for p in passes):
        raise Undecided(f"the pair's passes lack one of {'/'.join(map(str, clients))} clients for {num}")
    if spread_at:
        a, b = (tokens_per_s(p, "pair", den) for p in (run, rep2))
        spread = {c: abs(a[c] / b[c] - 1) for c in spread_at}
        if max(spread.values()) > PASS_SPREAD:
            raise Undecided(f"{den}'s two passes differ by {fmt(spread)} (> {PASS_SPREAD}): the pair is too noisy")
    return passes


def wrapper(run: dict, rep2: dict | None = None, **_) -> tuple[bool, str]:
    """A diagnosis, not a default: `met` says the adaptive step's own work (the policy's bookkeeping, its events and
    copies, the adaptive server's set-up) is what costs the host-bound pair; `not met` that its shape switching and
    exploration are."""
    passes = _both_passes(run, rep2, "dspine_adaptive_wide", "dspine", clients=(16, 48), spread_at=())
    met = all(p[c] <= 0.90 for p in passes for c in (16, 48))
    extra = []
    for num, den in (("dspine_adaptive", "dspine_adaptive_wide"), ("dspine_cap128", "dspine")):
        try:
            extra.append(f"{num} ÷ {den} {fmt(ratios(run, 'pair', num, den))}")
        except Undecided as e:
            extra.append(str(e))
    return met, (f"wide-menu adaptive ÷ fixed, pass 1 {fmt(passes[0])}, pass 2 {fmt(passes[1])} (<= 0.90 at 16 and "
                 f"48 in both: the adaptive step's own work); pass 1: {'; '.join(extra)}")


def cap_cost(run: dict, rep2: dict | None = None, **_) -> tuple[bool, str]:
    """A diagnosis: `met` says a server's cap of 128 running requests itself (not the adaptive step) costs the
    host-bound pair's step where the cap is never reached."""
    passes = _both_passes(run, rep2, "dspine_cap128", "dspine")
    met = all(p[c] <= 0.95 for p in passes for c in (1, 16))
    return met, (f"cap 128 ÷ cap 48 (fixed DSPINE), pass 1 {fmt(passes[0])}, pass 2 {fmt(passes[1])} (<= 0.95 at 1 "
                 f"and 16 in both)")


def cap_graphs(run: dict, rep2: dict | None = None, **_) -> tuple[bool, str]:
    """A diagnosis, where cap_cost is met: the graphs captured above 48 requests are what the cap costs."""
    if not cap_cost(run, rep2)[0]:
        raise Undecided("cap_cost is not met: the cap costs nothing to explain")
    passes = _both_passes(run, rep2, "dspine_cap128_graphs48", "dspine")
    met = all(p[c] >= 0.97 for p in passes for c in (1, 16))
    return met, (f"cap 128 with graphs to 48 ÷ cap 48, pass 1 {fmt(passes[0])}, pass 2 {fmt(passes[1])} (>= 0.97 at "
                 f"1 and 16 in both; 48 not judged)")


def admission(run: dict, rep2: dict | None = None, **_) -> tuple[bool, str]:
    """The cap of 128 with admissions batched by SGLang's prefill delayer, against the same cap without."""
    passes = _both_passes(run, rep2, "dspine_cap128_delayed", "dspine_cap128", clients=(1, 16, 48), spread_at=(48,))
    met = all(p[48] >= 1.10 and p[1] >= 0.97 and p[16] >= 0.97 for p in passes)
    return met, (f"delayed ÷ undelayed (cap 128), pass 1 {fmt(passes[0])}, pass 2 {fmt(passes[1])} (>= 1.10 at 48, "
                 f">= 0.97 at 1 and 16, both passes)")


TREE32_GREEDY_84BA46F = 18  # dspine_tree32's greedy outputs equal to plain's on the pair at 84ba46f (of 24)
TREE_GREEDY_MIN = TREE32_GREEDY_84BA46F - 1  # what a tree server's greedy outputs must match (tree rules)


def policy_step(run: dict, server: str, shape: str) -> dict[int, float]:
    """The geometry server's policy table: `shape`'s step ms per bucket."""
    table = (run.get("geometry", {}).get(server, {}).get("policy_last") or {}).get("step_ms") or {}
    steps = {int(b): row[shape] for b, row in table.items() if shape in row}
    if not steps:
        raise Undecided(f"no {shape} steps in {server}'s table at the geometry")
    return steps


def tree_grouped(run: dict, gpu_log: str | None = None, **_) -> tuple[bool, str]:
    """(written 2026-12-07, stop 71, before the lease that runs it) trees verify on DSPINE's grouped kernel by
    default on triton if the GPU tests pass, on the pair the grouped tree's greedy outputs equal plain's on at least
    as many prompts as the extend-kernel tree's at 84ba46f less one, and at the geometry its tree32 step is <=
    0.95x the extend-kernel tree's at 1, 4 and 16 requests (the two adaptive tree servers' tables, one lease)."""
    grouped_, extend = (policy_step(run, n, "tree32") for n in ("dspine_adaptive_tree32_grouped",
                                                               "dspine_adaptive_tree32"))
    buckets = [b for b in (1, 4, 16) if b in grouped_ and b in extend]
    if buckets != [1, 4, 16]:
        raise Undecided(f"tree32 steps at buckets {buckets} in both tables, not 1, 4 and 16")
    r = {b: grouped_[b] / extend[b] for b in buckets}
    same, n = greedy_equal(run, "dspine_tree32_grouped")
    tests, why = gpu_tests_passed(gpu_log)
    ok = tests and same >= TREE_GREEDY_MIN and all(v <= 0.95 for v in r.values())
    return ok, (f"tree32 step grouped ÷ extend {fmt(r)} (<= 0.95); greedy = plain {same}/{n} "
                f"(>= {TREE_GREEDY_MIN}); {why}")


_KEPT_671B819 = os.path.join(_ROOT, "benchmarks", "results", "adaptive_run_h100_671b819.json")


def _kept_671b819() -> dict:
    return json.load(open(_KEPT_671B819)) if os.path.exists(_KEPT_671B819) else {}


def last_t0_expected_tokens(run: dict, server: str) -> dict | None:
    """The pair server's policy's expected tokens per shape after its last T=0 cell (None where it has none)."""
    cells = run.get("pair", {}).get(server, {}).get("t0", {})
    last = cells[max(cells, key=int)] if cells else {}
    return (last.get("policy") or {}).get("expected_tokens")


def tree_value_at_1(run: dict, n: int, table_run: dict, table_server: str) -> tuple[float, str]:
    """E(treeN) on the pair over the tree's step in chain16 steps at 1 request (one table), and how it was read."""
    e = (last_t0_expected_tokens(run, f"dspine_adaptive_tree{n}") or {}).get(f"tree{n}")
    if not e:
        raise Undecided(f"no tree{n} acceptance from dspine_adaptive_tree{n} on the pair")
    tree, block = (policy_step(table_run, table_server, s).get(1) for s in (f"tree{n}", "chain16"))
    if not tree or not block:
        raise Undecided(f"no 1-request tree{n} and chain16 steps in {table_server}'s table")
    return e * block / tree, f"tree{n} E {e:.2f}, step {tree / block:.3f}x chain16"


def tree64(run: dict, gpu_log: str | None = None, **_) -> tuple[bool, str]:
    """Which tree the docs recommend for an adaptive server at low load: 64 over 32 where it carries more per
    chain16 step (the module docstring's rule)."""
    v64, why64 = tree_value_at_1(run, 64, run, "dspine_adaptive_tree64")
    in_run = "dspine_adaptive_tree32" in run.get("geometry", {})
    kept = {} if in_run and "plain" in run.get("pair", {}) else _kept_671b819()
    gpu = lambda r: (r.get("provenance") or {}).get("gpu")
    if kept and gpu(run) != gpu(kept):  # a step ratio or a greedy answer of another card is no reference
        raise Undecided(f"the run's GPU is {gpu(run)}, 671b819's reference {gpu(kept)}")
    v32, why32 = tree_value_at_1(run, 32, run if in_run else kept,
                                 "dspine_adaptive_tree32" if in_run else "dspine_adaptive_tree32_grouped")
    plain = run.get("pair", {}).get("plain") or kept.get("pair", {}).get("plain")
    same, n = greedy_equal({"pair": {**run.get("pair", {}), "plain": plain or {}}}, "dspine_adaptive_tree64")
    tests, why = gpu_tests_passed(gpu_log)
    ok = tests and same >= TREE_GREEDY_MIN and v64 >= 1.05 * v32
    return ok, (f"value 64 ÷ 32 {v64 / v32:.3f} (>= 1.05; {why64}; {why32}); greedy = plain {same}/{n} "
                f"(>= {TREE_GREEDY_MIN}); "
                f"{why}")


RULES = {"new_cost": new_cost, "below_block": below_block, "split_kv": split_kv, "floors": floors,
         "grouped": grouped, "upkeep": upkeep, "adaptive": adaptive, "wrapper": wrapper, "tree_grouped": tree_grouped,
         "cap_cost": cap_cost, "cap_graphs": cap_graphs, "admission": admission, "tree64": tree64}


def decide(run: dict, rep2: dict | None = None, summary: dict | None = None, gpu_log: str | None = None) -> dict:
    """Each rule's verdict: `met`, `not met` or `undecided`, with the numbers it read."""
    out = {}
    for name, rule in RULES.items():
        try:
            ok, why = rule(run, rep2=rep2, summary=summary, gpu_log=gpu_log)
            out[name] = {"verdict": "met" if ok else "not met", "numbers": why}
        except Undecided as e:
            out[name] = {"verdict": "undecided", "numbers": str(e)}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run")
    ap.add_argument("--rep2")
    ap.add_argument("--gpu-tests-log")
    ap.add_argument("--summary")
    a = ap.parse_args(argv)
    load = lambda p: json.load(open(p)) if p else None
    log = open(a.gpu_tests_log).read() if a.gpu_tests_log else None
    for name, v in decide(load(a.run), load(a.rep2), load(a.summary), log).items():
        print(f"{name:12s} {v['verdict']:9s} {v['numbers']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
