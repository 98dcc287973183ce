"""Where does DSpine lose to DFlash? Round by round, on a pair (target/, dflash/, dspine/), greedy.

For each prompt: the target's own greedy answer (what T=0 speculation must produce, whatever the drafter), each
drafter's real τ (its own speculative run: DFlash; DSpine with the walk; DSpine's backbone argmax, the walk
switched off), and then, at the rounds of DSpine's run (same anchors and context for all three), per round:
the target's next B-1 tokens (the truth), DFlash's draft, DSpine's backbone argmax, the walk's choice, how far
each matches the truth, and at the first position the walk gets wrong whether the truth was among the
backbone's top-K candidates (the walk can only pick a candidate). Where the walk and the argmax fail at the
same position, the backbone is what loses; where the argmax is right and the walk is not, the transition
table is.

    python benchmarks/lab/diagnose.py --pair models/default --out /tmp/diagnose.json            # 20 chat prompts
    python benchmarks/lab/diagnose.py --pair models/default \
        --prompts models/default/suites/prose.heldout.jsonl --limit 12
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from sglang_dspine.source_files import as_package

if not __package__:  # run as a file (python benchmarks/lab/x.py): the package `benchmarks` first
    as_package(__file__)

from benchmarks.output import write_json  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Short chat prompts outside the default pair's corpus (whose answers are often one short fixed phrase).
CHAT_PROMPTS = [
    "Is the sky blue?", "What is the capital of France?", "Say hello.", "What is 2 + 2?", "Name a primary color.",
    "Is water wet?", "What day comes after Monday?", "Can fish fly?", "Translate 'thank you' into French.",
    "What is the opposite of hot?", "How many legs does a spider have?", "Is Python a programming language?",
    "Write a haiku about rain.", "What does HTTP stand for?", "Give me a synonym for happy.",
    "What is the boiling point of water in Celsius?", "Write a Python function that returns the square of x.",
    "List three fruits.", "Who wrote Hamlet?", "Explain what a list is in Python.",
]


def agree(draft: list[int], truth: list[int]) -> int:
    """Leading draft tokens equal to the truth (accepted at T=0)."""
    return len(os.path.commonprefix([draft, truth]))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pair", default=os.path.join(REPO, "models", "default"),
                    help="a folder with target/, dflash/, dspine/ (default: the built-in pair)")
    ap.add_argument("--prompts", help="JSONL of {prompt} records (default: 20 short chat prompts)")
    ap.add_argument("--limit", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--show", type=int, default=4, help="print the rounds of the N prompts DSpine loses most on")
    ap.add_argument("--out", help="JSON with every prompt's rounds")
    args = ap.parse_args(argv)
    for d in ("target", "dflash", "dspine"):
        if not os.path.isdir(os.path.join(args.pair, d)):
            raise SystemExit(f"--pair {args.pair}: no {d}/ folder")
    return args


def load_pair(pair: str):
    """(target, tokenizer, DFlash drafter, DSpine drafter) of the pair's folder, float32 on the CPU."""
    from transformers import AutoTokenizer

    from sglang_dspine.cli import load_target
    from sglang_dspine.drafter.checkpoint import load_drafter

    target = load_target(os.path.join(pair, "target"), "fp32", "cpu").eval()
    tok = AutoTokenizer.from_pretrained(os.path.join(pair, "target"))
    dflash = load_drafter(os.path.join(pair, "dflash"), dtype=target.dtype).eval()
    dspine = load_drafter(os.path.join(pair, "dspine"), dtype=target.dtype).eval()
    if dflash.cfg.kind != "dflash" or dspine.cfg.kind != "dspine":
        raise SystemExit(f"--pair {pair}: dflash/ and dspine/ must hold a DFlash and a DSpine drafter")
    return target, tok, dflash, dspine


def block_at(target, drafter, seq: list[int]):
    """The drafter's block output for the anchor seq[-1] given the verified context seq[:-1], and the anchor."""
    from sglang_dspine.training.generate import target_features

    b, s = drafter.cfg.block_size, len(seq) - 1
    head, embed = target.get_output_embeddings().weight, target.get_input_embeddings()
    out = target(input_ids=torch.tensor([seq[:-1]]), output_hidden_states=True)
    feats = target_features(out.hidden_states, drafter.cfg.target_layer_ids).to(head.dtype)
    ctx = drafter.context_kv(feats, torch.arange(s)[None])
    block = torch.tensor([[seq[-1]] + [drafter.cfg.mask_token_id] * (b - 1)])
    positions = (s + torch.arange(b)).view(1, 1, b)
    visible = torch.ones(1, 1, s, dtype=torch.bool)
    anchors = torch.tensor([[seq[-1]]])
    return drafter.forward_blocks(embed(block).view(1, 1, b, -1), positions, ctx, visible, anchors), anchors


def diagnose_prompt(target, tok, dflash, dspine, text: str, max_new: int, eos) -> dict:
    """One prompt: the three speculative runs (their answers must be the target's greedy one), then at each
    round of DSpine's run the truth against DFlash's draft, DSpine's argmax and its walk."""
    from sglang_dspine.training.data import prompt_ids
    from sglang_dspine.training.generate import DrafterProposer, speculative_generate

    b, head = dspine.cfg.block_size, target.get_output_embeddings().weight
    ids = prompt_ids({"prompt": text}, tok)
    runs = {}
    for name, drafter, decoding in (("dflash", dflash, "walk"), ("dspine_walk", dspine, "walk"),
                                    ("dspine_argmax", dspine, "argmax")):
        runs[name] = speculative_generate(target, DrafterProposer(drafter, target, decoding=decoding), ids,
                                          max_new, eos_token_ids=eos, block_size=b)
    answer = runs["dspine_walk"].tokens
    for name, r in runs.items():  # T=0 speculation reproduces the target's greedy answer whatever the drafter
        if r.tokens != answer:
            raise SystemExit(f"prompt {text!r}: {name}'s answer differs from the walk's; greedy speculation broke")
    rounds, a = [], 0
    for acc in runs["dspine_walk"].accept_lengths:
        seq = ids + answer[: a + 1]  # anchor answer[a]
        truth = answer[a + 1: a + b]
        out_s, anchors = block_at(target, dspine, seq)
        bd = dspine.draft(out_s, head, anchors.view(1))
        walk = bd.tokens[0].tolist()
        argmax = dspine.block_logits(out_s, head)[0].argmax(-1).tolist()
        out_f, _ = block_at(target, dflash, seq)
        flash = dflash.block_logits(out_f, head)[0].argmax(-1).tolist()
        n = {"dflash": agree(flash, truth), "dspine_argmax": agree(argmax, truth), "dspine_walk": agree(walk, truth)}
        miss = n["dspine_walk"]
        cands = bd.candidates[0].tolist()
        rounds.append({
            "anchor": tok.decode([answer[a]]), "truth": tok.convert_ids_to_tokens(truth),
            "dflash": tok.convert_ids_to_tokens(flash[: len(truth)]),
            "dspine_argmax": tok.convert_ids_to_tokens(argmax[: len(truth)]),
            "dspine_walk": tok.convert_ids_to_tokens(walk[: len(truth)]), "accepted": n,
            "run_accepted": acc - 1,  # the run's own count (context built round by round; equal but for near-ties)
            "walk_miss_position": miss + 1 if miss < len(truth) else None,
            "truth_in_top_k_at_walk_miss": (truth[miss] in cands[miss]) if miss < len(truth) else None,
            "argmax_right_walk_wrong": miss < len(truth) and argmax[miss] == truth[miss],
        })
        a += acc
    tau = {n: round(r.tau, 3) for n, r in runs.items()}
    print(f"τ DFlash {tau['dflash']:.2f}  walk {tau['dspine_walk']:.2f}  argmax {tau['dspine_argmax']:.2f}  "
          f"{text[:50]!r} -> {tok.decode(answer)[:60]!r}", flush=True)
    return {"prompt": text, "answer": tok.decode(answer), "tokens": len(answer), "tau": tau, "rounds": rounds}


def summarize(prompts_out: list[dict], b: int) -> dict:
    all_rounds = [r for p in prompts_out for r in p["rounds"]]
    misses = [r for r in all_rounds if r["walk_miss_position"] is not None]
    return {
        "prompts": len(prompts_out),
        "dspine_loses_prompts": sum(p["tau"]["dflash"] > p["tau"]["dspine_walk"] for p in prompts_out),
        "walk_equals_argmax_tau_prompts": sum(p["tau"]["dspine_walk"] == p["tau"]["dspine_argmax"]
                                              for p in prompts_out),
        "rounds": len(all_rounds),
        "rounds_recomputed_differently": sum(r["accepted"]["dspine_walk"] != r["run_accepted"]
                                             and len(r["truth"]) == b - 1
                                             for r in all_rounds),
        "walk_misses": len(misses),
        "walk_miss_truth_in_top_k": sum(bool(r["truth_in_top_k_at_walk_miss"]) for r in misses),
        "walk_miss_argmax_right": sum(r["argmax_right_walk_wrong"] for r in misses),
        "rounds_dflash_accepts_more": sum(r["accepted"]["dflash"] > r["accepted"]["dspine_walk"] for r in all_rounds),
        "rounds_walk_accepts_more": sum(r["accepted"]["dspine_walk"] > r["accepted"]["dflash"] for r in all_rounds),
    }


def print_worst(prompts_out: list[dict], show: int) -> None:
    """The rounds of the `show` prompts DSpine loses most on."""
    worst = sorted(prompts_out, key=lambda p: p["tau"]["dspine_walk"] - p["tau"]["dflash"])[:show]
    for p in worst:
        print(f"\n--- {p['prompt']!r}: τ DFlash {p['tau']['dflash']}, walk {p['tau']['dspine_walk']}, "
              f"argmax {p['tau']['dspine_argmax']}")
        for i, r in enumerate(p["rounds"]):
            print(f"  round {i}: anchor {r['anchor']!r} accepted {r['accepted']} walk miss at "
                  f"{r['walk_miss_position']} (truth in top-K: {r['truth_in_top_k_at_walk_miss']})")
            for k in ("truth", "dflash", "dspine_argmax", "dspine_walk"):
                print(f"    {k:14s} {' '.join(r[k][:8])}")


@torch.no_grad()  # inference only; the caller's grad mode is restored on return (tests call main in-process)
def main(argv: list[str] | None = None) -> int:
    from sglang_dspine.provenance import provenance
    from sglang_dspine.training.data import eos_ids_of
    from sglang_dspine.training.jsonl import read_jsonl

    args = parse_args(argv)
    t0 = time.time()
    target, tok, dflash, dspine = load_pair(args.pair)
    eos = eos_ids_of(tok, target)
    texts = [r["prompt"] for r in read_jsonl(args.prompts)] if args.prompts else CHAT_PROMPTS
    prompts_out = [diagnose_prompt(target, tok, dflash, dspine, text, args.max_new_tokens, eos)
                   for text in texts[: args.limit]]
    summary = summarize(prompts_out, dspine.cfg.block_size)
    print(json.dumps(summary))
    print_worst(prompts_out, args.show)
    if args.out:
        write_json(args.out, {"summary": summary, "prompts": prompts_out, "seconds": round(time.time() - t0, 1),
                              **provenance(sys.argv)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
