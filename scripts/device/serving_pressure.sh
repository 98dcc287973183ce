#!/usr/bin/env bash
# On the GPU machine, from the repo root (carry .devbundle): SGLang servers without speculation, with DFLASH and
# with DSPINE on the built-in pair under pressure: KV-pool exhaustion and retraction, batches above the captured
# graphs, long and near-context prompts, shared prefixes, disconnects, and with --soak-seconds a soak
# (benchmarks/serving_pressure.py; extra arguments go to it). Results under $OUT: serving_pressure.json,
# serving_pressure_summary.json, the servers' logs; with --tag TAG or --geometry NAME (its name is the tag),
# serving_pressure_TAG*.json and serving_pressure_TAG.log.
#   GIT_COMMIT=<hash> bash scripts/device/serving_pressure.sh                        # the pair, every scenario
#   ... serving_pressure.sh --geometry qwen3-8b                                      # memory at Qwen3-8B geometry
# The 20-minute soak outlasts one device call (10 minutes): a detached job (scripts/device/job.sh),
#   GIT_COMMIT=<hash> bash scripts/device/job.sh start soak \
#     'bash scripts/device/serving_pressure.sh --servers dspine --scenarios soak --soak-seconds 1200 --tag soak1200'
#   bash scripts/device/job.sh wait soak 540   # again until it says finished
# Beside another run on the same GPU (the pressure run while the soak goes on): the bundle unpacked first
# (`source scripts/device/setup.sh`), then the soak with its own ports and package layout,
#   DSPINE_SITE=/tmp/dspine-site-soak ... job.sh start soak '... --tag soak1200 --port-offset 100'
# (the soak's GPU memory is then its server's own, where nvidia-smi lists its processes: gpu_mib_scope).
set -uo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
tag=""; prev=""
for a in "$@"; do
  case "$prev" in
    --tag) tag="$a" ;;
    --geometry) [ -z "$tag" ] && [ "$a" != pair ] && tag="$a" ;;
  esac
  prev="$a"
done
log="$OUT/serving_pressure${tag:+_$tag}.log"
source scripts/device/setup.sh || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 benchmarks/serving_pressure.py --out "$OUT" "$@" 2>&1 | tee "$log" \
  | grep -v "Decode batch\|Prefill batch\|Capturing batches"
