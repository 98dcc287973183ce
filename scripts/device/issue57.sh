#!/usr/bin/env bash
# Issue 57 (verify shapes) in one detached job on the GPU machine, from the repo root (carry .devbundle):
#   GIT_COMMIT=<hash> bash scripts/device/job.sh start l57 'bash scripts/device/issue57.sh'
#   bash scripts/device/job.sh wait l57 540     # again within ~30 s of each return; $OUT/l57.tar.gz each time
# What the lease at 6f41609 (benchmarks/results/adaptive_run_h100_6f41609.json) left, in the order the decision
# needs it (a lease can end anywhere; adaptive.py skips what its JSON already has):
#   0. the verify pass's attention kernels at Qwen3-8B heads, split-KV also with its index array as the server's
#      graphs hold it (benchmarks/verify_attention.py `splitkv_graph`, ~2 min): whether the 16 KV splits the
#      graphs make it run are why the block's verify step got 2.6-4.2 ms slower with split-KV at that lease where
#      the kernel alone (4 splits) was 0.2 ms faster;
#   1. switching: lossless while the adaptive server switches shapes (greedy, T=1 two-sample test), and the
#      1 -> 64 -> 1 ramp (~5 min; crashed at 6f41609 on a harness bug, fixed since);
#   2. the built-in pair in one lease: plain, DSPINE at the block and DSPINE adaptive (the previous adaptive
#      cells come from another machine, whose plain decoding ran 1.8x faster at 1 client) (~4 min);
#   3. the geometry's adaptive server with the tree of 32 in its menu (its step table times the tree; it ran out
#      of memory at 6f41609 beside the leaked server of step 1) (~3 min);
#   4. the geometry's plain and DSPINE at the block again, for a same-lease baseline of step 3 (~4 min).
# After the lease, on this machine: python3 scripts/device/adaptive.py --merge <the lease's adaptive.json>
#   --out benchmarks/results (merge an earlier run only if it ran on the same card and its plain matches).
set -uo pipefail
OUT="${OUT:-/tmp/out}"
A="python3 scripts/device/adaptive.py --out $OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/gpu.txt"
python3 -m benchmarks verify_attention --out "$OUT" --batch-sizes 1,16,48 --rows 1,4,16
$A --phases switching --switching-server dspine_adaptive
$A --phases pair --pair-servers plain,dspine,dspine_adaptive --clients 1,16,48 --t1-clients 48
$A --phases geometry --geometry-servers dspine_adaptive_tree32 --clients 1,4,16,48,64
$A --phases geometry --geometry-servers plain,dspine --clients 1,4,16,48,64
