#!/usr/bin/env bash
# Issue 57 (verify shapes) in one detached job on the GPU machine, from the repo root (carry .devbundle):
#   GIT_COMMIT=<hash> bash scripts/device/job.sh start l57 'bash scripts/device/issue57.sh'
#   bash scripts/device/job.sh wait l57 540     # again within ~30 s of each return; $OUT/l57.tar.gz each time
# What the lease at 6f41609 (benchmarks/results/adaptive_run_h100_6f41609.json) left, and what changed since
# (SGLANG_DSPINE_SPLITKV_VERIFY=below-block; the policy weighs wall time), in the order the decisions need it (a
# lease can end anywhere; adaptive.py skips what its JSON already has). Run order at 2026-12-06: 0b, 1, 2, 3, 0, 4,
# 5 (the kernel-only timing 0 explains, it decides nothing, so it goes after the decisions' runs):
#   0. the verify pass's attention kernels at Qwen3-8B heads, split-KV also with its index array as the server's
#      graphs hold it (benchmarks/verify_attention.py `splitkv_graph`, ~1.5 min): whether the 16 KV splits the
#      graphs make it run are why the block's verify step got 2.6-4.2 ms slower with split-KV at that lease where
#      the kernel alone (4 splits) was 0.2 ms faster;
#   0b. the GPU tests (~1 min), patch 8's kernel against the extend kernel with the graphs' index array among them;
#   1. Qwen3-8B geometry, each alone: adaptive below-block, adaptive on the extend kernel, plain (~7 min);
#   2. switching on the adaptive below-block server: lossless while it switches shapes and kernels (greedy, the
#      T=1 two-sample test), and the 1 -> 64 -> 1 ramp (~5 min; crashed at 6f41609 on a harness bug, fixed);
#   3. the built-in pair in one lease: plain, DSPINE at the block, adaptive, adaptive below-block (~5 min; the
#      earlier adaptive cells came from another machine, whose plain decoding ran 1.8x faster at 1 client);
#   4. the pair's adaptive tree server (on wall time the policy should stop choosing the tree at 1 client, where
#      the fixed tree ran 0.68x the block) and the geometry's (its step table times the tree of 32) (~6 min).
#   5. what a longer lease has time for: the geometry's plain, DSPINE and adaptive on SGLang's FA3 and FlashInfer
#      attention backends (the step table under SGLang's defaults, issue 57's 5(b); ~12 min).
# After the lease, on this machine: python3 scripts/device/adaptive.py --merge <the lease's adaptive.json>
#   --out benchmarks/results (merge an earlier run only if it ran on the same card and its plain matches).
# Decision rules, fixed before the run:
#   - SGLANG_DSPINE_SPLITKV_VERIFY=below-block becomes the adaptive server's default on the triton backend if, at
#     Qwen3-8B geometry, its step table's block (chain16) is <= 1.03x the extend-kernel adaptive server's at every
#     bucket both measured, its `none` is <= 0.97x at every bucket >= 16, the switching phase's greedy
#     divergences are all float32 near-ties and its T=1 test passes;
#   - the wall-time policy stays if the pair's adaptive is >= 0.97x the best of plain and the block at 1 and 16
#     clients; otherwise the note says by how much it missed, with both step tables (step_ms, gpu_step_ms).
set -uo pipefail
OUT="${OUT:-/tmp/out}"
A="python3 scripts/device/adaptive.py --out $OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/gpu.txt"
bash scripts/device/gpu_tests.sh
$A --phases geometry --geometry-servers dspine_adaptive_below_block,dspine_adaptive,plain --clients 1,4,16,48,64
$A --phases switching --switching-server dspine_adaptive_below_block
$A --phases pair --pair-servers plain,dspine,dspine_adaptive,dspine_adaptive_below_block --clients 1,16,48 \
   --t1-clients 48
python3 -m benchmarks verify_attention --out "$OUT" --batch-sizes 1,16,48 --rows 1,4,16
$A --phases pair --pair-servers dspine_adaptive_tree32 --clients 1,16,48 --t1-clients 48
$A --phases geometry --geometry-servers dspine_adaptive_tree32 --clients 1,4,16,48,64
$A --phases geometry --geometry-servers plain_fa3,dspine_adaptive_fa3,dspine_fa3,plain_flashinfer,\
dspine_adaptive_flashinfer,dspine_flashinfer --clients 1,4,16,48,64
