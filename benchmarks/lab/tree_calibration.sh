#!/usr/bin/env bash
# Fit a lab pair's tree calibration (what a server verifying trees wider than the block reads for greedy
# requests; docs/tree.md): prompts 13-16 of each suite (the calibration prompts of benchmarks/tree_offline.py,
# disjoint from its evaluation prompts 1-8), 64 greedy tokens each, written to PAIR/tree_calibration_prompts.jsonl
# and fitted into PAIR/dspine/dspine_tree_calibration.json. ~1 minute on 2 cores for models/default.
# Usage: bash benchmarks/lab/tree_calibration.sh [PAIR] [PY]   (default: models/default, the venv's python)
set -euo pipefail
PAIR="${1:-models/default}"
PY="${2:-.venv/bin/python}"
"$PY" - "$PAIR" <<'PYEOF'
import json, os, sys
pair = sys.argv[1]
suites = os.path.join(pair, "suites")
names = sorted(f for f in os.listdir(suites) if f.endswith(".heldout.jsonl"))
if not names:
    sys.exit(f"tree_calibration.sh: no *.heldout.jsonl in {suites}")
with open(os.path.join(pair, "tree_calibration_prompts.jsonl"), "w", encoding="utf-8") as out:
    for name in names:
        with open(os.path.join(suites, name), encoding="utf-8") as f:
            records = [json.loads(line) for line in f if line.strip()][12:16]
        if len(records) < 4:
            sys.exit(f"tree_calibration.sh: {name} has fewer than 16 prompts")
        for rec in records:
            out.write(json.dumps(rec) + "\n")
PYEOF
"$PY" -m sglang_dspine.cli tree-calibrate --target "$PAIR/target" --drafter "$PAIR/dspine" \
  --prompts "$PAIR/tree_calibration_prompts.jsonl" --max-new-tokens 64
