"""Why DSPINE out-serves DFLASH by more than its acceptance: one server per candidate cause, side by side.

Servers (one GPU): stock DFLASH; DFLASH on the same drafter with `is_causal: true` (DSpine's block mask:
tests whether the bidirectional draft attention is what costs DFLASH its steps; its drafts are worse, its
outputs still exact); DSPINE; DSPINE with SGLANG_DSPINE_KERNELS=0 (its PyTorch math: the kernels' effect in
serving). Measured, after a warm-up: output tokens/s and tau (tokens per verify step) at T=0 and
concurrency 1, 4, 16, 48, the four servers in turn, twice (so the spread between repeats is visible), and
verify steps per second = tokens/s / tau (the per-step cost, whatever the acceptance).

Usage: `bash scripts/device/serve.sh step_cost` on the GPU machine, or (repo root, after
`source scripts/device/setup.sh`):
    python3 scripts/device/serve_step_cost.py --models models/default --out $OUT
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

from serve_e2e import Server, prompts_for, start_warm_up, throughput, wait_all, warm

from sglang_dspine.provenance import provenance


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", required=True)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"))
    ap.add_argument("--max-new", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    t0 = time.time()
    models = os.path.abspath(args.models)
    target = os.path.join(models, "target")
    causal = "/tmp/dflash_causal"
    shutil.rmtree(causal, ignore_errors=True)
    shutil.copytree(os.path.join(models, "dflash"), causal)
    cfg = json.load(open(os.path.join(causal, "config.json")))
    cfg["is_causal"] = True
    json.dump(cfg, open(os.path.join(causal, "config.json"), "w"))
    spec = lambda algo, d: ["--model-path", target, "--speculative-algorithm", algo, "--speculative-draft-model-path", d]
    servers = {"dflash": Server("dflash", 32001, spec("DFLASH", os.path.join(models, "dflash")), args.out),
               "dflash_causal": Server("dflash_causal", 32002, spec("DFLASH", causal), args.out),
               "dspine": Server("dspine", 32003, spec("DSPINE", os.path.join(models, "dspine")), args.out)}
    servers["dspine_torch"] = Server("dspine_torch", 32004, spec("DSPINE", os.path.join(models, "dspine")), args.out,
                                     env={"SGLANG_DSPINE_KERNELS": "0"})
    results = {"provenance": provenance(sys.argv), "models": models}
    out = os.path.join(args.out, "serving_step_cost.json")
    try:
        up = wait_all(servers, results)
        live = {n: s for n, s in servers.items() if up[n]}
        from transformers import AutoTokenizer

        prompts = prompts_for(AutoTokenizer.from_pretrained(target), 60, os.path.join(models, "suites"))
        warm(start_warm_up(live, prompts), *live)
        results["repeats"] = []
        for r in range(args.repeats):
            results["repeats"].append(throughput(live, prompts, [1, 4, 16, 48], args.max_new))
            json.dump(results, open(out, "w"), indent=1)
    finally:
        for s in servers.values():
            s.stop()
        results["wall_seconds"] = time.time() - t0
        results["summary"] = summarize(results)
        json.dump(results, open(out, "w"), indent=1)
        os.system(f"cd {args.out} && tar czf step_cost_logs.tar.gz server_*.log && rm -f server_*.log")
    print(json.dumps(results["summary"], indent=1))


def summarize(r):
    table = {}
    for i, rep in enumerate(r.get("repeats", [])):
        for name, by_c in rep.items():
            for c, v in by_c.items():
                row = table.setdefault(name, {}).setdefault(str(c), {"tokens_per_s": [], "tau": [], "steps_per_s": []})
                row["tokens_per_s"].append(round(v["tokens_per_s"], 1))
                if v.get("verify_steps"):
                    tau = v["output_tokens"] / v["verify_steps"]
                    row["tau"].append(round(tau, 3))
                    row["steps_per_s"].append(round(v["tokens_per_s"] / tau, 1))
    return {"per_server": table, "commit": r.get("provenance", {}).get("commit")}


if __name__ == "__main__":
    main()
