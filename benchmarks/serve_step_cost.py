"""DFLASH vs DSPINE in SGLang, side by side on one GPU: throughput, tau and the per-step cost.

Servers (`--servers`, default the first five but plain): the target without speculation (plain); stock DFLASH; DFLASH on
the same drafter with `is_causal: true` (DSpine's block mask: does the bidirectional draft attention cost
DFLASH its steps?); DSPINE; DSPINE with SGLANG_DSPINE_KERNELS=0 (its PyTorch math: the kernels' effect in
serving); DSPINE with SGLANG_DSPINE_TREE=1 (sampled requests verify a tree over the lattice, greedy ones their
walk through the same tree verify: at T=0 its step cost against DSPINE's, at T=1 its tau); the same verifying
trees of 31 and 63 nodes (dspine_tree32, dspine_tree64: --speculative-num-draft-tokens 32 / 64, greedy requests
scored with the drafter's tree calibration; tau and tokens/s at T=0 and T=1). Measured, after a
warm-up: output tokens/s and tau (tokens per verify step) at T=0 and concurrency 1, 4, 16, 48, the servers in
turn, `--repeats` times (so the spread between repeats is visible), and verify steps per second = tokens/s /
tau (the per-step cost, whatever the acceptance); with `--t1-concurrency C`, also tokens/s and tau at T=1 for
the speculative servers.

Usage: `bash scripts/device/serve.sh step_cost` on the GPU machine, or (repo root, after
`source scripts/device/setup.sh`):
    python3 -m benchmarks step_cost_pair --models models/default --out $OUT
`--models` also takes a lab run's --out folder (benchmarks/lab/run.py) or its unpacked pack.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from benchmarks.output import write_result
from benchmarks.serve_e2e import (  # the harness (benchmarks.servers, benchmarks.models) as serve_e2e uses it
    Server,
    archive_logs,
    drafter_variant,
    model_layout,
    prompts_for,
    spec_args,
    start_warm_up,
    throughput,
    wait_all,
    warm,
)
from sglang_dspine.provenance import provenance

SERVERS = ["plain", "dflash", "dflash_causal", "dspine", "dspine_torch", "dspine_tree", "dspine_tree32",
           "dspine_tree64"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", required=True)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"))
    ap.add_argument("--max-new", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--servers", default="dflash,dflash_causal,dspine,dspine_torch",
                    help=f"comma-separated subset of {','.join(SERVERS)} (default: these four)")
    ap.add_argument("--t1-concurrency", type=int, default=0, help="also measure at T=1 at this concurrency (0: no)")
    ap.add_argument("--name", default="serving_step_cost", help="results file name (without .json)")
    ap.add_argument("--mem-fraction", type=float, default=None,
                    help="--mem-fraction-static of every server (default serve_e2e's, sized for five on an H200)")
    ap.add_argument("--pool", type=int, default=None,
                    help="--max-total-tokens of every server: KV pools of one size side by side (default: as memory "
                         "gives)")
    ap.add_argument("--stop-at-eos", action="store_true",
                    help="requests stop at the target's end token (default: all run --max-new tokens)")
    args = ap.parse_args()
    names = [n for n in args.servers.split(",") if n]
    if not names or set(names) - set(SERVERS):
        raise SystemExit(f"--servers: choose from {', '.join(SERVERS)}")
    os.makedirs(args.out, exist_ok=True)
    t0 = time.time()
    models = model_layout(args.models)
    target = os.path.join(models, "target")
    causal = drafter_variant(os.path.join(models, "dflash"), "/tmp/dflash_causal",
                             edit_cfg=lambda c: c.update(is_causal=True))
    spec = lambda algo, d: spec_args(target, algo, d)
    args_env = {"plain": (["--model-path", target], None),
                "dflash": (spec("DFLASH", os.path.join(models, "dflash")), None),
                "dflash_causal": (spec("DFLASH", causal), None),
                "dspine": (spec("DSPINE", os.path.join(models, "dspine")), None),
                "dspine_torch": (spec("DSPINE", os.path.join(models, "dspine")), {"SGLANG_DSPINE_KERNELS": "0"}),
                "dspine_tree": (spec("DSPINE", os.path.join(models, "dspine")), {"SGLANG_DSPINE_TREE": "1"})}
    for n in (32, 64):  # trees wider than the block: the drafter folder must hold its tree calibration
        args_env[f"dspine_tree{n}"] = (spec("DSPINE", os.path.join(models, "dspine")) +
                                       ["--speculative-num-draft-tokens", str(n)], {"SGLANG_DSPINE_TREE": "1"})
    mem = ["--mem-fraction-static", str(args.mem_fraction)] if args.mem_fraction else []  # after the default
    mem += ["--max-total-tokens", str(args.pool)] if args.pool else []
    servers = {n: Server(n, 32000 + SERVERS.index(n), [*args_env[n][0], *mem], args.out, env=args_env[n][1])
               for n in names}
    results = {"provenance": provenance(sys.argv), "models": models, "server_args_added": mem}
    out = os.path.join(args.out, f"{args.name}.json")
    try:
        up = wait_all(servers, results)
        live = {n: s for n, s in servers.items() if up[n]}
        from transformers import AutoTokenizer

        prompts = prompts_for(AutoTokenizer.from_pretrained(target), 60, os.path.join(models, "suites"))
        warm(start_warm_up(live, prompts), *live)
        results["repeats"] = []
        for r in range(args.repeats):
            order = dict(reversed(live.items())) if r % 2 else live  # drift over a repeat favours no server
            results["repeats"].append(throughput(order, prompts, [1, 4, 16, 48], args.max_new,
                                                 ignore_eos=not args.stop_at_eos))
            write_result(out, results)
        if args.t1_concurrency:
            spec_live = {n: s for n, s in live.items() if n != "plain"}
            results["throughput_t1"] = throughput(spec_live, prompts, [args.t1_concurrency], args.max_new,
                                                  temperature=1.0,
                                                  ignore_eos=not args.stop_at_eos)
    finally:
        for s in servers.values():
            s.stop()
        results["wall_seconds"] = time.time() - t0
        results["summary"] = summarize(results)
        write_result(out, results)
        archive_logs(args.out, "step_cost_logs.tar.gz")
    print(json.dumps(results["summary"], indent=1))


def summarize(r):
    table = {}
    for rep in r.get("repeats", []):
        for name, by_c in rep.items():
            for c, v in by_c.items():
                row = table.setdefault(name, {}).setdefault(str(c), {"tokens_per_s": [], "tau": [], "steps_per_s": []})
                row["tokens_per_s"].append(round(v["tokens_per_s"], 1))
                if v.get("verify_steps"):
                    tau = v["output_tokens"] / v["verify_steps"]
                    row["tau"].append(round(tau, 3))
                    row["steps_per_s"].append(round(v["tokens_per_s"] / tau, 1))
    t1 = {name: {str(c): {"tokens_per_s": round(v["tokens_per_s"], 1),
                          "tau": round(v["output_tokens"] / v["verify_steps"], 3) if v.get("verify_steps") else None}
                 for c, v in by_c.items()} for name, by_c in r.get("throughput_t1", {}).items()}
    return {"per_server": table, "t1": t1, "commit": r.get("provenance", {}).get("commit")}


if __name__ == "__main__":
    main()
