#!/usr/bin/env python3
"""The SGLang release × backend matrix of what DSPINE was run on, on the GPU: one row per (release, attention,
sampling), each with the request-conformance result (features ok / total, greedy agreement with the server
without speculation, mixed-load errors) and the per-step cost against DFLASH at Qwen3-8B geometry, read from
the measured result files named in the row (no number is typed here). A release or backend that was not run
has a row saying so and why. Writes benchmarks/results/serving_versions_summary.json.

    python -m benchmarks versions [--results-dir benchmarks/results]
"""
from __future__ import annotations

import argparse
import json
import os
import re

from sglang_dspine.provenance import changed_files, git_commit
from sglang_dspine.source_files import as_package

if not __package__:  # run as a file (python benchmarks/serving_versions.py): the package `benchmarks` first
    as_package(__file__)

from benchmarks.output import write_json  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# What a GPU row measured: a row at an older commit still describes the code where none of this changed since.
SERVING_CODE = ("sglang_dspine/serving", "sglang_dspine/drafter", "kernels", "setup.py")

# (release, attention, sampling) -> the result files of its GPU runs (None: not run, with why)
ROWS = [
    {"sglang": "0.5.17", "attention": "triton", "sampling": "pytorch",
     "features": "serving_features_summary.json", "step_cost": "serving_scale_summary.json"},
    {"sglang": "0.5.17", "attention": "fa3 (SGLang's default on an H200)", "sampling": "flashinfer (SGLang's default)",
     "features": "serving_features_sglang_default_backends_summary.json",
     "step_cost": "device_e7e0441_0517_defaults/scale/serving_scale_summary.json",
     "alone_runs": "device_e7e0441_0517_defaults/scale/serving_scale.json",
     "e2e": "device_e7e0441_0517_defaults/e2e/serving_e2e_summary.json",
     "step_cost_note": "at e7e0441, FA3's kernel library carried in three pieces (scripts/device/fa3_0517.sh) and "
                       "each server alone on the GPU, no flags (versions.sh sglang-default/sglang-default scale "
                       "e2e); one run per server",
     "e2e_note": "alone on the GPU at e7e0441. The T=1 test passed after Bonferroni (0.092 over 11 tests); its "
                 "smallest raw p-values, 0.008 and 0.027, are at position 0, the token the target's own sampler "
                 "draws after prefill in both servers. Its throughputs are cells of 1-2 s each (192 requests of "
                 "96 tokens at 48 clients), one run"},
    {"sglang": "0.5.23", "attention": "fa3 (SGLang's default on an H200)", "sampling": "flashinfer (SGLang's default)",
     "features": "serving_features_0523_sglang_default_summary.json",
     "step_cost": "device_f528899_0523/serving_scale_summary.json",
     "alone_runs": "device_f528899_0523/serving_scale.json",
     "runs": ["device_3e3192e_0523", "device_c275234_0523", "device_f528899_0523", "device_c85e20d_0523",
              "device_bb9ff95_0523"],
     "gpu_tests": "device_bb9ff95_0523/gpu_tests.log",
     "e2e": "device_bb9ff95_0523/e2e/serving_e2e_summary.json",
     "main_job": "device_bb9ff95_0523/main_job.json",
     "e2e_note": "at bb9ff95, beside a soak of a 0.5.17 DSPINE server on the same GPU: its agreement, T=1 test and "
                 "load errors hold; its throughputs do not measure anything alone",
     "main_job_note": "the README's main job at bb9ff95 (scripts/device/main_job.sh), beside the same soak: its "
                      "cleanup's global pkill then stopped the soak's server too (now session-scoped: "
                      "scripts/device/stop_session.sh)",
     "features_note": "conformance at c85e20d (device_c85e20d_0523): 17 of 17 features for each server, 0 errors in "
                      "the mixed load, run beside a soak of a 0.5.17 DSPINE server on the same GPU. At 3e3192e two "
                      "checks had failed for every server, the plain one too: the checker read 0.5.23's answers as "
                      "0.5.17's (chat's emitted ids are in response_token_ids; a partial UTF-8 token's log-prob "
                      "text is its bytes as latin-1); fixed in the checker since",
     "step_cost_note": "DFlash2 first ran at f528899, on FlashInfer's top-k built ahead of time into the bundle "
                       "(bundle_0523.sh aot; at 35f24d8 and c275234 its JIT build outlasted the lease). The "
                       "earlier run without DFlash2 (c275234) gave DSPINE/DFLASH 0.962/1.017/1.003/0.998 at "
                       "1/4/16/48 clients: one run per server, a spread of about 3% between runs"},
]


def features_row(summary: dict) -> dict:
    out = {"commit": summary.get("commit"), "gpu": summary.get("gpu"), "date": summary.get("date"),
           "backends": summary.get("backends", {"attention": "triton", "sampling": "pytorch"}), "servers": {}}
    for name, r in summary["servers"].items():
        out["servers"][name] = {"up": r.get("up"), "features_ok": r.get("features_ok"),
                                "features_total": r.get("features_total"),
                                "greedy_vs_plain": (r.get("text_agreement_vs_plain") or {}).get("greedy_completions"),
                                "logprob_max_abs_diff_vs_plain": r.get("logprob_max_abs_diff_vs_plain"),
                                "mixed_load_requests": r.get("mixed_load_requests"),
                                "mixed_load_errors": r.get("mixed_load_errors"),
                                "mixed_load_errors_by_kind": r.get("mixed_load_errors_by_kind")}
    return out


def build(results: str) -> dict:
    def read(rel: str) -> dict:  # a result file named in ROWS, relative to the results folder
        return json.load(open(os.path.join(results, rel)))

    rows = []
    for spec in ROWS:
        row = {k: v for k, v in spec.items() if k not in ("features", "step_cost", "alone_runs", "gpu_tests",
                                                            "e2e", "main_job")}
        if spec.get("gpu_tests"):
            row["gpu_tests"] = {"file": spec["gpu_tests"],
                                "result": pytest_result(open(os.path.join(results, spec["gpu_tests"])).read())}
        if spec.get("e2e"):
            row["e2e"] = {"file": spec["e2e"], **e2e_row(read(spec["e2e"]))}
        if spec.get("main_job"):
            row["main_job"] = {"file": spec["main_job"], **main_job_row(read(spec["main_job"]))}
        if spec["features"]:
            row["features_file"] = spec["features"]
            row["features"] = features_row(read(spec["features"]))
        if spec.get("alone_runs"):
            row.update(alone_steps(read(spec["alone_runs"])))
        if spec["step_cost"]:
            row["step_cost_file"] = spec["step_cost"]
            row.update(step_ratios(read(spec["step_cost"])))
        rows.append(row)
    beside = [{"sglang": r["sglang"], "attention": r["attention"], "sampling": r["sampling"],
               **r["dspine_over_dflash2_step"]} for r in rows if r.get("dspine_over_dflash2_step")]
    out = {"rows": rows, "dflash2_beside_dspine": beside or None}
    if not beside:
        out["dflash2_not_run"] = "DFlash2 ships in SGLang 0.5.23, not run on the GPU (see the 0.5.23 row)"
    return out


def commits_of(rows: list[dict]) -> list[str]:
    """Every commit a row's results name (its runs' provenance), in the order met."""
    found: list[str] = []

    def walk(x):
        if isinstance(x, dict):
            for k, v in x.items():
                if k == "commit" and isinstance(v, str) and v not in found:
                    found.append(v)
                else:
                    walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)

    walk(rows)
    return found


def serving_code_since(rows: list[dict], until: str) -> dict:
    """Per commit the rows were measured at, the serving code (SERVING_CODE) git says changed from it to `until`
    (None where this checkout cannot tell): an empty list means the row still describes the code at `until`."""
    return {"until": until, "paths": list(SERVING_CODE),
            "changed_by_commit": {c: changed_files(c, until, SERVING_CODE) for c in commits_of(rows)}}


def pytest_result(log: str) -> str:
    """The closing line of a pytest run ("12 passed, 108 deselected, ... in 135.98s")."""
    lines = [ln.strip("= ") for ln in log.splitlines() if re.search(r"\d+ (passed|failed|error)", ln)]
    if not lines:
        raise ValueError("no pytest result line in the log")
    return lines[-1]


def e2e_row(summary: dict) -> dict:
    """serve_e2e.py's summary on the built-in pair: greedy agreement with the server without speculation, the T=1
    two-sample test's Bonferroni-adjusted p, the 48-client load's errors."""
    keys = ("commit", "backends", "exact_greedy_match", "bf16_greedy_match", "t1_test_pvalue", "load_requests",
            "load_errors", "bad_drafters_refused", "bad_drafters_tried")
    return {k: summary.get(k) for k in keys}


def main_job_row(run: dict) -> dict:
    """main_job.sh's result: per case (built-in default pair, pair given), ready in how many seconds and the
    README's curl and OpenAI-client requests' exit codes."""
    prov = run.get("provenance", {})
    return {"commit": prov.get("commit"), "sglang": (prov.get("versions") or {}).get("sglang"),
            "cases": {n: {"ready": c["ready"], "seconds_to_ready": c["seconds_to_ready_or_give_up"],
                          "curl_rc": c["curl_rc"], "openai_rc": c["openai_rc"]} for n, c in run["cases"].items()}}


def alone_steps(run: dict) -> dict:
    """From a serving_scale.json of servers run alone, where no ratio could be formed: each server's step (ms)
    per client count, and which servers did not answer."""
    steps = {n: {str(r["clients"]): round(r["step_ms"], 3) for r in a.get("rounds", [])}
             for n, a in run.get("alone", {}).items()}
    prov = run.get("provenance", {})
    return {"alone_step_ms": {n: v for n, v in steps.items() if v},
            "alone_not_up": sorted(n for n, v in steps.items() if not v),
            "alone_provenance": {k: prov.get(k) for k in ("commit", "date", "command")}}


def step_ratios(s: dict) -> dict:
    """DSPINE's step ÷ DFLASH's (and ÷ DFlash2's where it ran) per client count from a serving_scale summary:
    the side-by-side rounds (equal KV pools) where it has them, else each server alone (--alone-only)."""
    prov = {"commit": s.get("commit"), "date": s.get("date"), "command": s.get("command")}
    if any(s.get("step_ratio_by_clients", {}).values()):
        out = {"dspine_over_dflash_step": {"by_clients": s["step_ratio_by_clients"], "how": "side by side", **prov}}
        if s.get("step_ratio_vs_dflash2_by_clients"):
            out["dspine_over_dflash2_step"] = {"by_clients": s["step_ratio_vs_dflash2_by_clients"],
                                               "how": "side by side", **prov}
        return out
    alone = (s.get("alone_default_graph_bs") or {}).get("dspine") or {}
    out = {}
    for base in ("dflash", "dflash2"):
        if alone.get(f"step_ratio_vs_{base}"):
            out[f"dspine_over_{base}_step"] = {"by_clients": {"T0": alone[f"step_ratio_vs_{base}"]},
                                               "how": "each server alone", **prov}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--results-dir", default=os.path.join(REPO, "benchmarks", "results"))
    args = ap.parse_args(argv)
    out = build(args.results_dir)
    # beside what the files say: how far the code moved since each run (as of this checkout's commit)
    out["serving_code_changed_since_runs"] = serving_code_since(out["rows"], git_commit())
    path = write_json(os.path.join(args.results_dir, "serving_versions_summary.json"), out)
    for r in out["rows"]:
        f = r.get("features", {}).get("servers", {}).get("dspine", {})
        steps = (r.get("dspine_over_dflash_step") or {}).get("by_clients", {}).get("T0")
        steps2 = (r.get("dspine_over_dflash2_step") or {}).get("by_clients", {}).get("T0")
        print(f"{r['sglang']:7} {str(r['attention']):36} {str(r['sampling']):30} "
              f"features {f.get('features_ok')}/{f.get('features_total')} greedy {f.get('greedy_vs_plain')} "
              f"step/DFLASH {steps}" + (f" step/DFlash2 {steps2}" if steps2 else "")
              + (f"  NOT RUN: {r['not_run']}" if r.get("not_run") else ""))
    since = out["serving_code_changed_since_runs"]
    for c, files in since["changed_by_commit"].items():
        print(f"serving code changed from {c[:7]} to {since['until'][:7]}: "
              + ("unknown (git cannot tell)" if files is None else ", ".join(files) or "nothing"))
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
