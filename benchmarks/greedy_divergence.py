#!/usr/bin/env python3
"""Where a speculative server's greedy answer first differs from plain decoding's, how close the target's two
candidates were there: the target itself in float32 on the CPU judges each first divergence of a GPU run.

A server that verifies several rows at once computes the target's logits in bf16 under other batch shapes than
plain decoding does, so a position where the target's top two tokens are nearly tied can flip either way; any
other difference is a bug. `scripts/device/adaptive.py` (phase `pair`) keeps every server's greedy answers
(`greedy_ids`: 24 prompts, 96 new tokens, ignore EOS) but asks nothing more of the GPU. This reads them back,
rebuilds the same prompts from the models folder (serve_e2e.prompts_for: 48 prompts of its suites, the first 24
asked), and for each answer that differs from plain's, at its first differing position k, runs the target in
float32 on prompt + plain's first k tokens. Reported per divergence: both tokens' float32 log-probs, their gap,
the float32 top token, and whether it is a near-tie: both tokens within servers.NEAR_TIE_MARGIN (0.07 nats, the
rule of the GPU benchmarks) of the float32 best.
    python -m benchmarks greedy_divergence ADAPTIVE_JSON [--models models/default] [--out DIR]
Writes greedy_divergence.json (command, commit, date; the run's own provenance beside it) to --out;
scripts/device/adaptive.py --merge puts the same verdicts into its summary (`judge_pair`).
"""
from __future__ import annotations

import argparse
import json
import os

import torch

from benchmarks.models import model_layout
from benchmarks.serve_e2e import prompts_for
from benchmarks.servers import NEAR_TIE_MARGIN
from sglang_dspine.provenance import default_output, provenance

# scripts/device/adaptive.py's pair phase (it imports these): its prompts, and the first of them its greedy answers ask
PAIR_PROMPTS, GREEDY_ASKED = 48, 24


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """The first position where `a` and `b` differ (the shorter one's length if one is a prefix); None if equal."""
    k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if k is None and len(a) != len(b):
        k = min(len(a), len(b))
    return k


def judge(model, prompt: list[int], plain: list[int], spec: list[int], k: int) -> dict:
    """The float32 target's verdict at position k of two answers to `prompt` that agree before k."""
    ids = torch.tensor([prompt + plain[:k]])
    with torch.no_grad():
        lp = torch.log_softmax(model(ids).logits[0, -1].float(), -1)
    best = int(lp.argmax())
    rec = {"position": k, "plain_token": plain[k] if k < len(plain) else None,
           "spec_token": spec[k] if k < len(spec) else None, "fp32_top_token": best,
           "fp32_top_logprob": round(float(lp[best]), 5)}
    if rec["plain_token"] is None or rec["spec_token"] is None:
        return {**rec, "near_tie": False, "note": "one answer is shorter"}
    a, b = float(lp[rec["plain_token"]]), float(lp[rec["spec_token"]])
    return {**rec, "plain_logprob": round(a, 5), "spec_logprob": round(b, 5), "gap": round(abs(a - b), 5),
            "near_tie": max(lp[best].item() - a, lp[best].item() - b) <= NEAR_TIE_MARGIN}


def pair_prompts(models: str) -> tuple[str, list[list[int]]]:
    """(the target's folder, the pair phase's PAIR_PROMPTS prompts as token ids) of a models folder: what
    adaptive.py serves and what its greedy answers are judged against."""
    from transformers import AutoTokenizer

    models = model_layout(models)
    target = os.path.join(models, "target")
    return target, [ids for _, ids in prompts_for(AutoTokenizer.from_pretrained(target), PAIR_PROMPTS,
                                                  os.path.join(models, "suites"))]


def judge_pair(pair: dict, models: str) -> dict:
    """Per server of a `pair` phase (name -> its record with `greedy_ids`), its answers against plain's: identical
    count, near-ties among the first divergences and each divergence's verdict (`judge`), the target of the
    models folder `models` in float32 on the CPU."""
    from transformers import AutoModelForCausalLM

    if not pair.get("plain", {}).get("greedy_ids"):
        raise ValueError("greedy_divergence: the pair phase holds no plain server's greedy_ids")
    target, prompts = pair_prompts(models)
    prompts = prompts[:GREEDY_ASKED]
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    plain = pair["plain"]["greedy_ids"]
    if len(plain) != len(prompts):
        raise ValueError(f"greedy_divergence: {len(plain)} plain answers for {len(prompts)} prompts")
    servers = {}
    for name, rec in pair.items():
        if name == "plain" or not rec.get("greedy_ids"):
            continue
        divergences = []
        for i, (p, a, b) in enumerate(zip(prompts, plain, rec["greedy_ids"])):
            k = first_divergence(a, b)
            if k is not None:
                divergences.append({"prompt": i, **judge(model, p, a, b, k)})
        servers[name] = {"identical": len(prompts) - len(divergences), "prompts": len(prompts),
                         "near_ties": sum(d["near_tie"] for d in divergences),
                         "largest_gap": max((d.get("gap", float("inf")) for d in divergences), default=None),
                         "divergences": divergences}
    return servers


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", help="an adaptive.json with a `pair` phase (plain's greedy_ids among its servers)")
    ap.add_argument("--models", default=os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                     "models", "default"))
    ap.add_argument("--out", default=default_output("greedy_divergence"))
    args = ap.parse_args(argv)
    run = json.load(open(args.run))
    try:
        servers = judge_pair(run.get("pair", {}), args.models)
    except ValueError as e:
        raise SystemExit(f"greedy_divergence.py: {args.run}: {e}") from None
    for name, r in servers.items():
        print(f"{name}: {r['identical']}/{r['prompts']} identical; of the {r['prompts'] - r['identical']} "
              f"divergences {r['near_ties']} near-ties (float32), largest gap {r['largest_gap']}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "greedy_divergence.json")
    json.dump({"provenance": provenance(), "run_provenance": run.get("provenance"), "near_tie_margin": NEAR_TIE_MARGIN,
               "servers": servers}, open(path, "w"), indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
