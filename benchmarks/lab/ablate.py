"""Ablations on a built lab (`run.py --out LAB`): what each DSpine part contributes to acceptance.

Trained on the lab's data with the lab's own training command (its DSpine or DFlash one), one thing changed:
  no_alignment      DSpine, --no-alignment-loss
  no_refinement     DSpine, --no-refinement-loss
  ce_only           DSpine with --ce-weight 1: its backbone and refinement terms on CE alone, as DFlash's backbone
                    (the `ce` recipe's value: a change only for a lab trained on another recipe)
  specforge         DSpine with --recipe specforge: SpecForge's 0.1·CE + 0.9·L1 to the teacher
  dflash_mix        DFlash with --dflash-ce-weight at SpecForge's DSpine ce_weight (0.1): that CE/L1 mix without
                    the injection (with specforge: the objective's share of a DSpine/DFlash gap)
Evaluated from the trained DSpine drafter, nothing retrained:
  walk_off          the transition table unused: the backbone's argmax at every position
  injection_off     the injection's writes zeroed at evaluation (the trained backbone alone)
against the lab's DFlash and DSpine drafters: offline τ per suite at T=0 (the lab's eval settings).

    python benchmarks/lab/ablate.py --lab LAB --out benchmarks/results/lab_ablations.json
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from sglang_dspine.drafter.config import DSpineSettings
from sglang_dspine.source_files import OUTSIDE_REPO, as_package

if not __package__:  # run as a file (python benchmarks/lab/x.py): the package `benchmarks` first
    as_package(__file__)

from benchmarks.output import write_json  # noqa: E402

# variant -> (the lab training command it changes, the flags it adds)
TRAIN_FLAGS = {"no_alignment": ("dspine", ["--no-alignment-loss"]),
               "no_refinement": ("dspine", ["--no-refinement-loss"]),
               "ce_only": ("dspine", ["--ce-weight", "1"]),
               "specforge": ("dspine", ["--recipe", "specforge"]),
               "dflash_mix": ("dflash", ["--dflash-ce-weight", str(DSpineSettings().ce_weight)])}
VARIANTS = ("walk_off", "injection_off", *TRAIN_FLAGS)


def lab_train_command(lab: str, kind: str = "dspine") -> list[str]:
    """The lab's own `sglang-dspine train` command for `kind`, read back from its run log."""
    for line in open(os.path.join(lab, "logs_run.txt"), encoding="utf-8"):
        if "$ sglang-dspine train" in line and f"--kind {kind}" in line:
            return line.split("$ ", 1)[1].split()
    raise SystemExit(f"{lab}/logs_run.txt: no `sglang-dspine train --kind {kind}` line")


def train(lab: str, name: str, work: str) -> str:
    out = os.path.join(work, name)
    if not os.path.isdir(os.path.join(out, "final")):
        kind, flags = TRAIN_FLAGS[name]
        cmd = lab_train_command(lab, kind)
        cmd[cmd.index("--output-dir") + 1] = out
        argv = [sys.executable, "-m", "sglang_dspine.cli"] + cmd[1:] + flags
        print("$", " ".join(argv[2:]), f"> {out}.log", flush=True)
        os.makedirs(work, exist_ok=True)
        with open(f"{out}.log", "w") as log:
            rc = subprocess.run(argv, cwd=OUTSIDE_REPO, stdout=log, stderr=subprocess.STDOUT).returncode
        if rc:
            raise SystemExit(f"ablation {name}: training failed ({rc}); tail of {out}.log:\n"
                             + open(f"{out}.log").read()[-3000:])
    return os.path.join(out, "final")


def evaluate(target, drafter, prompts, eos, max_new: int, decoding: str = "walk") -> float:
    """τ of one suite at T=0 as `sglang-dspine eval` computes it (generate.evaluate)."""
    from sglang_dspine.training.generate import evaluate as evaluate_prompts

    named = [(str(i), ids) for i, ids in enumerate(prompts)]
    return evaluate_prompts(target, drafter, named, max_new, 0.0, eos, decoding)["tau"]


@torch.no_grad()  # inference here (trainings run as subprocesses); the caller's grad mode is restored on return
def main(argv: list[str] | None = None) -> int:
    from transformers import AutoTokenizer

    from sglang_dspine.drafter.checkpoint import load_drafter
    from sglang_dspine.provenance import provenance
    from sglang_dspine.training.data import eos_ids_of, prompt_ids
    from sglang_dspine.training.jsonl import read_jsonl
    from sglang_dspine.training.target_loading import default_device, load_target

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lab", required=True, help="a lab directory built by benchmarks/lab/run.py")
    ap.add_argument("--out", required=True, help="results JSON")
    ap.add_argument("--limit", type=int, default=12, help="held-out prompts per suite")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--device", help="default: cuda if present, else cpu")
    ap.add_argument("--dtype",
                    help="target and drafters (default: bf16 on a GPU, fp32 on CPU, as `sglang-dspine eval`)")
    ap.add_argument("--jobs", type=int, help="ablation trainings at once (default: 2 on a GPU, 1 on CPU)")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help=f"comma-separated subset of {','.join(VARIANTS)} (dflash and dspine are always evaluated)")
    args = ap.parse_args(argv)
    command = [os.path.abspath(__file__)] + (sys.argv[1:] if argv is None else argv)
    chosen = set(args.variants.split(","))
    if chosen - set(VARIANTS):
        ap.error(f"--variants: unknown {sorted(chosen - set(VARIANTS))}; choose from {','.join(VARIANTS)}")
    t0 = time.time()
    dev = default_device(args.device)
    jobs = args.jobs or (2 if dev.startswith("cuda") else 1)
    work = os.path.join(args.lab, "ablations")
    with ThreadPoolExecutor(jobs) as ex:
        retrain = [n for n in TRAIN_FLAGS if n in chosen]
        drafters = dict(zip(retrain, ex.map(lambda name: train(args.lab, name, work), retrain)))

    target = load_target(os.path.join(args.lab, "target"), args.dtype, dev).eval()
    load = lambda path: load_drafter(path, dtype=target.dtype, device=dev).eval()
    tok = AutoTokenizer.from_pretrained(os.path.join(args.lab, "target"))
    eos = eos_ids_of(tok, target)
    suites = {}
    pdir = os.path.join(args.lab, "corpus", "prompts")
    for f in sorted(os.listdir(pdir)):
        if f.endswith(".heldout.jsonl"):
            recs = read_jsonl(os.path.join(pdir, f))[: args.limit]
            suites[f.split(".")[0]] = [prompt_ids(r, tok) for r in recs]

    dspine = load(os.path.join(args.lab, "drafters", "dspine"))
    injection_off = copy.deepcopy(dspine)
    injection_off.injection.reset_zero()
    variants = {
        "dflash": (load(os.path.join(args.lab, "drafters", "dflash")), "walk"),
        "dspine": (dspine, "walk"),
        "walk_off": (dspine, "argmax"),
        "injection_off": (injection_off, "walk"),
        **{n: (load(p), "walk") for n, p in drafters.items()},
    }
    variants = {n: v for n, v in variants.items() if n in ("dflash", "dspine") or n in chosen}
    table = {}
    for name, (drafter, decoding) in variants.items():
        table[name] = {s: round(evaluate(target, drafter, ps, eos, args.max_new_tokens, decoding), 4)
                       for s, ps in suites.items()}
        table[name]["mean"] = round(sum(table[name].values()) / len(suites), 4)
        print(f"{name:14s}", "  ".join(f"{s} {v:.3f}" for s, v in table[name].items()), flush=True)
    res = {"what": f"offline tau (token-weighted per suite) at T=0, {target.dtype}, transformers target on {dev}; "
                   + __doc__.split("\n\n")[1],
           "lab": os.path.abspath(args.lab), "tau_t0": table,
           "ratio_to_dflash": {n: round(v["mean"] / table["dflash"]["mean"], 4) for n, v in table.items()},
           "seconds": round(time.time() - t0, 1), **provenance(command)}
    write_json(args.out, res)
    print(json.dumps(res["ratio_to_dflash"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
