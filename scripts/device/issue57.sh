#!/usr/bin/env bash
# Issue 57 (verify shapes) in one detached job on the GPU machine, from the repo root (carry .devbundle):
#   GIT_COMMIT=<hash> bash scripts/device/job.sh start l57 'bash scripts/device/issue57.sh'
#   bash scripts/device/job.sh wait l57 540     # again within ~30 s of each return; $OUT/l57.tar.gz each time
# In the order the decision needs it (a lease can end anywhere; adaptive.py skips what its JSON already has):
#   0. the verify pass's attention kernels against plain decode's at Qwen3-8B heads (benchmarks/verify_attention.py,
#      ~1.5 min): whether the extend kernel is what makes a `none` step cost 2.7x a plain decode step at 48;
#   1. Qwen3-8B geometry, each server alone: DSPINE at the block with and without SGLang's split-KV verify kernel
#      (patch 8), and plain decoding (~8 min);
#   2. the GPU tests, the split-KV kernel against the extend kernel at Qwen3-8B heads among them (~2.5 min);
#   3. the geometry's adaptive server with split-KV (~2.5 min);
#   4. the built-in pair: greedy answers and tokens/s of plain and DSPINE with split-KV (~3 min);
#   5. switching: lossless while the adaptive split-KV server switches shapes, and the 1 -> 64 -> 1 ramp (~5 min);
#   6. what a longer lease has time for: the geometry's adaptive server without split-KV, the pair's DSPINE without;
#   7. the pair's DFLASH, tree of 32 and adaptive with the tree in its menu;
#   8. the geometry's adaptive server with the tree of 32 in its menu (its step table times the tree).
# After the lease, on this machine: python3 scripts/device/adaptive.py --merge
#   benchmarks/results/adaptive_run_h100_8399c53.json <the lease's adaptive.json> --out benchmarks/results
# (later files win for a server both measured; mixing cards is named in the summary's gpu).
# Decision rule, fixed before the run: split-KV becomes the default on triton if dspine_splitkv's tokens/s (median
# of 3) is >= dspine's at every client count at Qwen3-8B geometry, the GPU tests pass and the pair's greedy
# answers with split-KV equal plain decoding's (near ties as before).
set -uo pipefail
OUT="${OUT:-/tmp/out}"
A="python3 scripts/device/adaptive.py --out $OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/gpu.txt"
python3 -m benchmarks verify_attention --out "$OUT"
$A --phases geometry --geometry-servers dspine,dspine_splitkv,plain --clients 1,4,16,48,64
bash scripts/device/gpu_tests.sh
$A --phases geometry --geometry-servers dspine_adaptive_splitkv --clients 1,4,16,48,64
$A --phases pair --pair-servers plain,dspine_splitkv --clients 1,16,48 --t1-clients 48
$A --phases switching --switching-server dspine_adaptive_splitkv
$A --phases geometry --geometry-servers dspine_adaptive --clients 1,4,16,48,64
$A --phases pair --pair-servers dspine --clients 1,16,48 --t1-clients 48
# 7. the other pair servers (plain, DSPINE and adaptive at 1/16/48 came from the H100 run at 8399c53)
$A --phases pair --pair-servers dflash,dspine_tree32,dspine_adaptive_tree32 --clients 1,16,48 --t1-clients 48
# 8. the geometry's step table with the tree of 32 beside the chains (the projection's tree; the 1-client goal)
$A --phases geometry --geometry-servers dspine_adaptive_tree32 --clients 1,4,16,48,64
