#!/usr/bin/env bash
# Rebuild the built-in default pair (models/default) on a CPU: ~20 minutes on 2 cores (target 600 s,
# data ~70 s, two drafters ~7 min, eval ~45 s). Usage: bash benchmarks/lab/cpu_pair.sh [OUT] [PY] [run.py args...]
# (later --set values override these, e.g. --set train_steps=1200). The built-in DSpine drafter was trained on
# SpecForge's recipe (the default then): `dspine_recipe=specforge` rebuilds it as it is; `--set dspine_recipe=ce`
# trains today's default. `target_steps=none`: the target trains target_seconds (the tiny preset counts steps).
set -euo pipefail
OUT="${1:-/tmp/lab_cpu}"
PY="${2:-python3}"
shift $(( $# < 2 ? $# : 2 ))
here="$(cd "$(dirname "$0")" && pwd)"
cd /tmp  # never the repo root (sglang_dspine/source_files.py says why)
"$PY" "$here/run.py" --preset tiny --out "$OUT" --results "$OUT/results" \
  --set 'target_args=["--hidden","256","--layers","4","--heads","4","--kv-heads","2","--head-dim","64","--intermediate","768","--seq-len","256","--batch-size","16"]' \
  --set target_steps=none --set target_seconds=600 --set dspine_recipe=specforge --set vocab=4096 --set tokenizer_mb=8 --set corpus_mb=20 --set train_prompts=600 \
  --set suite_size=16 --set gen_tokens=96 --set gen_batch=32 --set max_prompt_len=256 \
  --set block_size=16 --set target_layer_ids=1,2 --set transfer_rank=64 --set message_size=32 --set top_k=8 \
  --set train_steps=300 --set train_batch=8 --set num_anchors=32 --set max_length=384 --set train_lr=2e-3 \
  --set eval_limit=12 --set eval_tokens=96 --set temperatures=0,1 --set threads=2 "$@"
echo "pair: $OUT/target $OUT/drafters/{dspine,dflash}; results: $OUT/results"
