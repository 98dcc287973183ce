"""A target's loss in nats per UTF-8 byte on a pair's suites (prompt + reference of each line), per suite and
their mean: a strength comparable across tokenizers (issue 57's rule for adopting a rebuilt built-in pair).

    python benchmarks/lab/nats_per_byte.py SUITES_DIR TARGET [TARGET ...]   # prints one JSON line a target
"""
from __future__ import annotations

import argparse
import json
import os


def nats_per_byte(target: str, suites: str, max_tokens: int = 1024) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    # the folder's suites, as tau_table.py finds them
    names = sorted(f.split(".")[0] for f in os.listdir(suites) if f.endswith(".heldout.jsonl"))
    out = {}
    for suite in names:
        nats = nbytes = 0.0
        with open(os.path.join(suites, f"{suite}.heldout.jsonl")) as f:
            for line in f:
                r = json.loads(line)
                ids = tok(r["prompt"] + r["reference"], return_tensors="pt").input_ids[:, :max_tokens]
                with torch.no_grad():
                    logits = model(ids).logits[0, :-1].float()
                nats += torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum").item()
                # the first token is not predicted: only the predicted tokens' bytes count
                nbytes += len(tok.decode(ids[0]).encode()) - len(tok.decode(ids[0, :1]).encode())
        out[suite] = round(nats / nbytes, 4)
    out["mean"] = round(sum(out[s] for s in names) / len(names), 4)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("suites", help="a folder of SUITE.heldout.jsonl files (prompt, reference)")
    ap.add_argument("targets", nargs="+")
    args = ap.parse_args()
    for t in args.targets:
        print(json.dumps({"target": t, "nats_per_byte": nats_per_byte(t, args.suites)}), flush=True)


if __name__ == "__main__":
    main()
