"""DSPINE with tensor parallelism on two GPUs, against the same build at tp-size 1.

Servers, side by side (tp 1 on GPU 0, tp 2 on GPUs 0 and 1): DSPINE at tp 1 and tp 2, and the target
without speculation at tp 1 and tp 2; with `--deterministic`, the DSPINE pair again with
--enable-deterministic-inference. Measured: greedy outputs of DSPINE tp 2 vs tp 1 on the same prompts (with
the top-2 log-prob gap of the plain target at every first divergence), the same for the plain target (what
tensor parallelism alone changes in bf16) and DSPINE tp 2 vs plain tp 2; CUDA graphs and the folded candidate
decoding in the tp-2 logs; output throughput and accept length at concurrency 1 and 16, one server at a time.

Usage: `bash scripts/device/serve.sh tp2 --deterministic` on the two-GPU machine, or (repo root, after
`source scripts/device/setup.sh`):
    python3 scripts/device/serve_tp2.py --models models/default --out $OUT
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import sys
import time

import torch
from serve_e2e import (
    Server,
    archive_logs,
    collect_server_info,
    greedy_agreement,
    max_gap,
    prompts_for,
    start_warm_up,
    throughput,
    wait_all,
    warm,
    warm_up_seconds,
)

from sglang_dspine.provenance import provenance


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", required=True)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"))
    ap.add_argument("--prompts", type=int, default=60)
    ap.add_argument("--max-new", type=int, default=96)
    ap.add_argument("--deterministic", action="store_true")
    args = ap.parse_args()
    if torch.cuda.device_count() < 2:
        raise SystemExit(f"needs two GPUs, found {torch.cuda.device_count()}")
    os.makedirs(args.out, exist_ok=True)
    # The servers share GPU 0 on purpose; SGLang otherwise refuses a tp-2 server whose GPUs differ in free memory.
    os.environ["SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK"] = "0"
    t0 = time.time()
    models = os.path.abspath(args.models)
    target, drafter = os.path.join(models, "target"), os.path.join(models, "dspine")
    spec = ["--speculative-algorithm", "DSPINE", "--speculative-draft-model-path", drafter]
    tp2 = ["--tp-size", "2", "--mem-fraction-static", "0.08"]  # GPU 0 also holds the four tp-1 servers
    det = ["--enable-deterministic-inference"]
    plan = {  # name: (extra args, visible GPUs)
        "plain_tp1": ([], "0"), "plain_tp2": (tp2, "0,1"),
        "dspine_tp1": (spec, "0"), "dspine_tp2": (spec + tp2, "0,1"),
    }
    if args.deterministic:
        plan |= {"plain_tp1_det": (det, "0"), "dspine_tp1_det": (spec + det, "0"),
                 "dspine_tp2_det": (spec + tp2 + det, "0,1")}
    # plain tp 1 first, alone: it builds the JIT kernels the others then find cached.
    servers = {"plain_tp1": Server("plain_tp1", 31001, ["--model-path", target], args.out,
                                   env={"CUDA_VISIBLE_DEVICES": "0"})}
    servers["plain_tp1"].wait()
    for i, (name, (extra, gpus)) in enumerate(plan.items()):
        if name not in servers:
            servers[name] = Server(name, 31002 + i, ["--model-path", target, *extra], args.out,
                                   env={"CUDA_VISIBLE_DEVICES": gpus})
    results = {"models": models, "provenance": provenance(sys.argv), "plan": {n: v[0] for n, v in plan.items()},
               "gpu_count": torch.cuda.device_count(), "gpu": torch.cuda.get_device_name(0)}
    save = lambda: json.dump(results, open(os.path.join(args.out, "tp2_serving.json"), "w"), indent=1)
    try:
        up = wait_all(servers, results)
        save()
        if not (up["plain_tp1"] and up["dspine_tp1"] and up["dspine_tp2"]):
            raise SystemExit("a server this needs did not start")
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(target)
        suite_prompts = prompts_for(tok, args.prompts, os.path.join(models, "suites"))
        prompts = [ids for _, ids in suite_prompts]
        live = {n: s for n, s in servers.items() if up.get(n)}
        warming = start_warm_up(live, suite_prompts)
        warm(warming, *live)
        results["warm_up_seconds"] = warm_up_seconds(warming)
        print("warm-up seconds:", results["warm_up_seconds"], flush=True)
        s = servers
        with cf.ThreadPoolExecutor(16) as pool:
            results["dspine_tp2_vs_tp1"] = greedy_agreement(s["dspine_tp1"], s["dspine_tp2"], prompts, args.max_new,
                                                            pool, judge=s["plain_tp1"])
            print("greedy DSPINE tp2 vs tp1:", results["dspine_tp2_vs_tp1"]["identical"], "/", len(prompts), flush=True)
            save()
            if up.get("plain_tp2"):
                results["plain_tp2_vs_tp1"] = greedy_agreement(s["plain_tp1"], s["plain_tp2"], prompts, args.max_new,
                                                               pool)
                results["dspine_tp2_vs_plain_tp2"] = greedy_agreement(s["plain_tp2"], s["dspine_tp2"], prompts,
                                                                      args.max_new, pool)
                print("greedy plain tp2 vs tp1:", results["plain_tp2_vs_tp1"]["identical"],
                      "| DSPINE tp2 vs plain tp2:", results["dspine_tp2_vs_plain_tp2"]["identical"], flush=True)
            if up.get("dspine_tp1_det") and up.get("plain_tp1_det"):  # serve_e2e.py's exact setting, on one GPU
                results["dspine_vs_plain_tp1_det"] = greedy_agreement(s["plain_tp1_det"], s["dspine_tp1_det"], prompts,
                                                                      args.max_new, pool)
                print("greedy DSPINE vs plain, tp1, deterministic:", results["dspine_vs_plain_tp1_det"]["identical"],
                      flush=True)
            if up.get("dspine_tp1_det") and up.get("dspine_tp2_det"):
                results["dspine_tp2_vs_tp1_det"] = greedy_agreement(
                    s["dspine_tp1_det"], s["dspine_tp2_det"], prompts, args.max_new, pool,
                    judge=s["plain_tp1_det"] if up.get("plain_tp1_det") else s["plain_tp1"])
                print("greedy DSPINE tp2 vs tp1 (deterministic):", results["dspine_tp2_vs_tp1_det"]["identical"],
                      flush=True)
            save()
        results["throughput"] = throughput({n: s[n] for n in ("plain_tp1", "plain_tp2", "dspine_tp1", "dspine_tp2")
                                            if up.get(n)}, suite_prompts, [1, 16], args.max_new)
        save()
        collect_server_info(s, up, results, names=("dspine_tp1", "dspine_tp2"))
    finally:
        for srv in servers.values():
            srv.stop()
        results["wall_seconds"] = time.time() - t0
        results["summary"] = summarize(results)
        save()
        json.dump(results["summary"], open(os.path.join(args.out, "tp2_summary.json"), "w"), indent=1)
        archive_logs(args.out, "tp2_server_logs.tar.gz")
    print(json.dumps(results["summary"], indent=1))


def summarize(r):
    exact = r.get("dspine_tp2_vs_tp1_det") or r.get("dspine_tp2_vs_tp1") or {}
    gaps = lambda key: max_gap(r.get(key))
    thr = r.get("throughput", {})
    srv = r.get("dspine_tp2_server", {})
    return {
        "setting": ("--enable-deterministic-inference (bf16, triton)" if "dspine_tp2_vs_tp1_det" in r
                    else "bf16, triton"),
        "exact_match_tp2_vs_tp1": exact.get("match_rate"),
        "bf16_match_tp2_vs_tp1": r.get("dspine_tp2_vs_tp1", {}).get("match_rate"),
        "bf16_divergence_max_top2_gap": gaps("dspine_tp2_vs_tp1"),
        "plain_bf16_match_tp2_vs_tp1": r.get("plain_tp2_vs_tp1", {}).get("match_rate"),
        "plain_divergence_max_top2_gap": gaps("plain_tp2_vs_tp1"),
        "dspine_tp2_vs_plain_tp2_match": r.get("dspine_tp2_vs_plain_tp2", {}).get("match_rate"),
        "dspine_vs_plain_tp1_deterministic_match": r.get("dspine_vs_plain_tp1_det", {}).get("match_rate"),
        "dspine_vs_plain_tp1_deterministic_max_gap": gaps("dspine_vs_plain_tp1_det"),
        "prompts": exact.get("prompts"),
        "tokens_per_s": {n: {c: round(v["tokens_per_s"], 1) for c, v in d.items()} for n, d in thr.items()},
        "throughput_ratio_tp2_over_tp1": {c: round(thr["dspine_tp2"][c]["tokens_per_s"]
                                                   / thr["dspine_tp1"][c]["tokens_per_s"], 3)
                                          for c in thr.get("dspine_tp2", {}) if c in thr.get("dspine_tp1", {})},
        "accept_length": {n: {c: v["accept_length_by_suite"] for c, v in d.items()}
                          for n, d in thr.items() if n.startswith("dspine")},
        "tp2_cuda_graph": bool(srv.get("cuda_graph_true_lines")) and not srv.get("cuda_graph_false_lines"),
        "tp2_decoding_log": srv.get("graph_decoding_log"),
        "commit": r.get("provenance", {}).get("commit"),
    }


if __name__ == "__main__":
    main()
