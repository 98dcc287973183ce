"""docs/results.md's offline τ table of a drafter pair, from its folder: `sglang-dspine eval` of the DFlash and the
DSpine drafter on each held-out suite at each temperature, with the lab's eval settings (the first 12 prompts
of each suite, 96 new tokens, seed 0; what benchmarks/results/lab_cpu_pair.json records), then the table.

    python benchmarks/lab/tau_table.py models/default          # ~1 min on 2 idle cores; prints the table

PAIR holds target/, dflash/, dspine/ and suites/SUITE.heldout.jsonl (the layout of models/default). τ of a
suite is tokens ÷ verify rounds over its prompts (token-weighted, as `eval` reports it and SGLang's servers
count it); a ratio is DSpine's τ ÷ DFlash's; the mean ratio is the plain mean over the suites.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile

from sglang_dspine.cli import main as cli

KINDS = ("dflash", "dspine")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("pair", help="folder with target/, dflash/, dspine/, suites/")
    ap.add_argument("--limit", type=int, default=12, help="prompts per suite (the first N)")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="keep the eval JSONs (τ, acceptance per position, per prompt) in this folder")
    args = ap.parse_args()
    with contextlib.ExitStack() as stack:
        out = args.out or stack.enter_context(tempfile.TemporaryDirectory(prefix="tau_table."))
        return table(args, out)


def table(args, out: str) -> int:
    suites = sorted(f.split(".")[0] for f in os.listdir(os.path.join(args.pair,
                                                                     "suites")) if f.endswith(".heldout.jsonl"))
    temps = [t.strip() for t in args.temperatures.split(",") if t.strip()]
    tau: dict[tuple[str, str, str], float] = {}
    for t in temps:
        for suite in suites:
            for k in KINDS:
                path = os.path.join(out, f"{k}_{suite}_t{t}.json")
                argv = ["eval", "--target", os.path.join(args.pair, "target"), "--drafter", os.path.join(args.pair, k),
                        "--prompts", os.path.join(args.pair, "suites", f"{suite}.heldout.jsonl"),
                        "--limit", str(args.limit), "--max-new-tokens", str(args.max_new_tokens),
                        "--temperature", t, "--seed", str(args.seed), "--output", path]
                print("$ sglang-dspine " + " ".join(argv), file=sys.stderr, flush=True)
                with contextlib.redirect_stdout(sys.stderr):  # eval prints its whole JSON; the table goes to stdout
                    rc = cli(argv)
                if rc:
                    return rc
                tau[t, suite, k] = json.load(open(path))["tau"]
    head = ["suite"] + [c for t in temps for c in (f"τ DFlash T={t}", f"τ DSpine T={t}", "ratio")]
    print("| " + " | ".join(head) + " |")
    print("| --- |" + " ---: |" * (len(head) - 1))
    ratios = {t: [tau[t, s, "dspine"] / tau[t, s, "dflash"] for s in suites] for t in temps}
    for i, s in enumerate(suites):
        cells = [f"{tau[t, s, 'dflash']:.2f} | {tau[t, s, 'dspine']:.2f} | {ratios[t][i]:.3f}" for t in temps]
        print(f"| {s} | " + " | ".join(cells) + " |")
    cells = ["mean ratio"] + [c for r in ratios.values() for c in ("", "", f"**{sum(r) / len(r):.3f}**")]
    print("| " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
