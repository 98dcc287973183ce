"""Offline τ of one drafter on several suites at one temperature, in one process: the target and the drafter
load once (a process start and two loads cost ~16 s on the H200 with 16 evaluations in flight, as much as a
suite's decoding). Each suite's result is the JSON `sglang-dspine eval --output` writes (generate.evaluate),
at OUT_DIR/LABEL_SUITE_tT.json; a suite whose file exists is skipped.

    python benchmarks/lab/eval_suites.py --target LAB/target --drafter LAB/drafters/dspine --label dspine \
        --suite code=LAB/corpus/prompts/code.heldout.jsonl --suite math=LAB/corpus/prompts/math.heldout.jsonl:32 \
        --temperature 0 --max-new-tokens 80 --limit 16 --out-dir LAB/eval
"""
from __future__ import annotations

import argparse
import os
import sys

from sglang_dspine.source_files import as_package

if not __package__:  # run as a file (python benchmarks/lab/x.py): the package `benchmarks` first
    as_package(__file__)

from benchmarks.output import write_json  # noqa: E402


def suite_file(out_dir: str, label: str, suite: str, temperature: float) -> str:
    """Where a suite's result goes: the name `sglang-dspine eval --output` gets in the lab."""
    return os.path.join(out_dir, f"{label}_{suite}_t{temperature:g}.json")


def parse_suite(spec: str, default_limit: int) -> tuple[str, str, int]:
    """NAME=PATH[:LIMIT] -> (name, path, limit)."""
    name, sep, rest = spec.partition("=")
    if not sep or not name or not rest:
        raise SystemExit(f"--suite {spec}: expected NAME=PATH[:LIMIT]")
    path, _, limit = rest.rpartition(":") if rest.rsplit(":", 1)[-1].isdigit() else (rest, "", "")
    return name, path, int(limit) if limit else default_limit


def main(argv: list[str] | None = None) -> int:
    import torch

    from sglang_dspine.drafter.checkpoint import load_drafter
    from sglang_dspine.training.data import eos_ids_of, iter_records, prompt_ids
    from sglang_dspine.training.generate import evaluate
    from sglang_dspine.training.target_loading import default_device, load_target, load_tokenizer

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--drafter", required=True, help="an exported drafter directory")
    ap.add_argument("--label", required=True, help="the name results are filed under (LABEL_SUITE_tT.json)")
    ap.add_argument("--suite", action="append", required=True, metavar="NAME=PATH[:LIMIT]",
                    help="a prompts JSONL and, optionally, how many of its prompts (repeatable)")
    ap.add_argument("--limit", type=int, default=16, help="prompts per suite where --suite gives no LIMIT")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--max-new-tokens", type=int, default=80)
    ap.add_argument("--decoding", choices=("walk", "argmax"), default="walk")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device")
    ap.add_argument("--out-dir", required=True)
    args = ap.parse_args(argv)
    suites = [parse_suite(s, args.limit) for s in args.suite]
    todo = [s for s in suites if not os.path.isfile(suite_file(args.out_dir, args.label, s[0], args.temperature))]
    if not todo:
        print("eval_suites: every suite done")
        return 0
    with torch.no_grad():
        dev = default_device(args.device)
        target = load_target(args.target, None, dev)
        head = target.get_output_embeddings().weight
        drafter = load_drafter(args.drafter, target_head=head.detach().float().cpu(), dtype=head.dtype, device=dev)
        drafter.cfg.check_target(head.shape[1], head.shape[0], target.config.num_hidden_layers)
        tokenizer = load_tokenizer(None, args.target)
        eos = eos_ids_of(tokenizer, target, [])
        os.makedirs(args.out_dir, exist_ok=True)
        for name, path, limit in todo:
            prompts = [(rid, prompt_ids(rec, tokenizer, where=f"{path} id {rid}"))
                       for i, (rid, rec) in enumerate(iter_records(path, "train")) if i < limit]
            res = evaluate(target, drafter, prompts, args.max_new_tokens, args.temperature, eos, args.decoding,
                           args.seed)
            res.update({"drafter": args.drafter, "target": args.target, "prompts_file": path, "suite": name})
            out = suite_file(args.out_dir, args.label, name, args.temperature)
            write_json(out, res, indent=2)
            print(f"eval_suites {args.label} {name} T={args.temperature:g}: tau {res['tau']:.3f} "
                  f"({res['prompts']} prompts, {res['rounds']} rounds, {res['seconds']:.1f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
