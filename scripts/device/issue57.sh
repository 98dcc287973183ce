#!/usr/bin/env bash
# Issue 57 (verify shapes) in one detached job on the GPU machine, from the repo root (carry .devbundle):
#   GIT_COMMIT=<hash> bash scripts/device/job.sh start l57 'bash scripts/device/issue57.sh'   # or `... headline`
#   bash scripts/device/job.sh wait l57 540     # again within ~30 s of each return; $OUT/l57.tar.gz each time
# What the leases at 6f41609 and c615dca (benchmarks/results/adaptive_run_h100_*.json) left, and what changed since
# (cab6869: a step's cost is the larger of its settled wall time and its GPU time, medians, and every 500 decisions
# at a bucket the stalest other shape is explored again), in the order the decisions need it (a lease can end
# anywhere; adaptive.py skips what its JSON already has):
#   0. Qwen3-8B geometry, each alone (~2.2 min a server): adaptive below-block and plain (the new cost at τ = 1,
#      where the right shape is `none` everywhere), first: six refused starts left 12 device minutes;
#   1. the GPU tests (~1.5 min), then at the geometry fixed DSPINE and fixed DSPINE with split-KV (the block's
#      step under split-KV with the graphs' split count), adaptive on the extend kernel;
#   2. switching on the adaptive below-block server (~3 min): with step 1 it decides below-block;
#   3. the built-in pair (~5 min): plain, DSPINE at the block, adaptive; after the kernels, the block and adaptive
#      again into $OUT/rep2 (at c615dca the block ran at half its 6f41609 speed while plain held and adaptive ran
#      1.67x it on the same shape: two passes, so a slow period of the machine shows as a disagreement; a lease
#      of 22 device minutes reaches neither the second pass nor what follows);
#   4. the verify pass's attention kernels (~1 min, 1 and 48 requests, 1 and 16 rows: `splitkv_graph_dspine`,
#      the split-KV kernel as a DSPINE server's verify graphs now run it, 4 KV splits from 5 verify rows up,
#      against the capture buffer's 16 that made the block slower at c615dca), then the pair's second pass;
#   (33f82f8 ran 0, the request features with adaptive on (20/20), the GPU tests, the kernels and the fixed
#   servers with and without split-KV; a69f10b the grouped kernel (patch 10) alone and served, the cost floors
#   (reverted by their rule); the next lease, below: the GPU tests, the pair's two passes on the default kernel,
#   switching, memory pressure with adaptive on, the geometry on the default kernel, FA3/FlashInfer, and 0.5.23
#   between stages)
#   SGLang 0.5.23 (Deliver 4), if the lease started it as a second job once its pieces were received (it gets the GPU
#      at the next stage's start, yield_gpu; the 0.5.23 calls: bundle_0523.sh plan, the core and jit parts: at
#      33f82f8 only the core was carried and every speculative server failed at start; setup now refuses that):
#        source scripts/device/bundle_0523.sh setup && DEVICE_SGLANG=0.5.23 GIT_COMMIT=<c> bash scripts/device/job.sh
#        start j23 'until [ -e /tmp/gpu_turn_j23 ] || [ -e /tmp/job_l57/rc ]; do sleep 5; done;
#        bash scripts/device/versions.sh triton/pytorch features e2e adaptive'   (conformance and the pair end to end,
#        ~8 min; then, new in 97513c7, adaptive verification on 0.5.23: the pair's plain, fixed and adaptive servers
#        and switching, ~12 min)
#   5. SGLang's FA3 and FlashInfer attention backends at the geometry (5(b), ~12 min), if the lease lasts.
# After the lease, on this machine: python3 scripts/device/adaptive.py --merge <the lease's adaptive.json>
#   --out benchmarks/results (merge an earlier run only if it ran on the same card and its plain matches).
# Then: python3 scripts/device/default_rules.py <adaptive.json> --rep2 <rep2/adaptive.json> --gpu-tests-log
#   <gpu_tests.log> --summary benchmarks/results/adaptive_summary.json judges the rules below, as written there.
# Decision rules, fixed before the run (2026-12-06, after c615dca):
#   - (2026-12-07, after 671b819; diagnoses, no default changes) cap_cost: a cap of 128 running requests costs the
#     pair's step if fixed DSPINE with it serves <= 0.95x fixed DSPINE (48) at 1 and 16 clients in both passes;
#     cap_graphs: where it does, the graphs above 48 requests are the cost if the cap of 128 with graphs to 48
#     serves >= 0.97x there in both passes; both undecided where fixed DSPINE's two passes differ by > 5% at 1 or 16
#     (identical servers differed by up to 28% on the pair at 97513c7); admission: the adaptive server's defaults
#     gain SGLang's prefill delayer (queue ratio 0.09, 100 ms at most) if fixed DSPINE at cap 128 with it serves
#     >= 1.10x the same cap without it at 48 clients and >= 0.97x at 1 and 16, in both passes;
#   - (2026-12-07, after 97513c7, where the first upkeep rule was not met: its GPU tests failed, so the default
#     became 0) SGLANG_DSPINE_UPKEEP_GRAPHS becomes 1 by default if the upkeep GPU tests pass and
#     dspine_adaptive_upkeep_graphs serves >= 0.98x dspine_adaptive's tokens/s (medians) at the geometry at 1 and 48
#     clients (two identical servers measured 0.977 / 0.987 of each other there at 97513c7);
#   - (2026-12-06, after a69f10b) the grouped kernel's settings (BLOCK_N 64, 4 warps, one split from 17 requests at
#     8 KV heads) change to a tuning variant of the sweep ($OUT/tune) only if it is >= 5% faster than `grouped` at
#     48 and 64 requests x 16 rows and not slower than 0.98x `grouped` in any other cell of the sweep;
#   - (2026-12-06, before patch 10 ran on a GPU) SGLANG_DSPINE_SPLITKV_VERIFY=grouped (DSPINE's grouped verify
#     attention, 643b9ca) becomes every chain server's default on triton if the GPU tests pass (the grouped
#     kernel's among them), at Qwen3-8B geometry fixed DSPINE with it serves >= 1.05x fixed DSPINE without it at
#     16, 48 and 64 clients and >= 0.98x at 1 and 4, and on the pair its greedy outputs equal plain's on at least
#     as many prompts as fixed DSPINE's, less one (default_rules.py `grouped`);
#   - (2026-12-06, after 33f82f8) the cost floors (0d6c622) stay if, at Qwen3-8B geometry (τ = 1), the adaptive
#     below-block server runs shapes other than `none` on <= 2% of its steps at 48 and 64 clients (33f82f8, before
#     them: 3.5%) and serves >= 0.95x plain decoding at every client count (33f82f8: 0.924-0.965x); otherwise they
#     are reverted (default_rules.py `floors`);
#   - (2026-12-06, c26518c) patch 9 (`none` on SGLang's decode kernel) stays if, at Qwen3-8B geometry, the adaptive
#     below-block server's `none` step (its policy's step_ms) is <= 1.03x plain decoding's step at 16, 48 and 64
#     clients, the GPU tests pass (patch 9's cuda test among them) and the adaptive request-features run agrees
#     with plain (greedy within the near-tie rule, 0 load errors); otherwise it is reverted;
#   - the new cost stays if, at Qwen3-8B geometry and 1 client, the adaptive below-block server runs `none` on
#     >= 80% of its steps and serves >= 0.95x plain decoding's tokens/s; otherwise the note gives its step tables;
#   - SGLANG_DSPINE_SPLITKV_VERIFY=below-block becomes the adaptive server's default on the triton backend if, at
#     Qwen3-8B geometry, it serves >= 0.97x the extend-kernel adaptive server's tokens/s at every client count and
#     >= 1.10x at 48 and 64 clients, and the switching phase's T=1 test passes with every greedy divergence within
#     the near-tie margin;
#   - SGLANG_DSPINE_SPLITKV_VERIFY=1 becomes the default of every chain server on triton (fixed and adaptive) if,
#     at Qwen3-8B geometry, fixed DSPINE with it serves >= 1.03x fixed DSPINE without it at 4 clients and more and
#     >= 0.97x at 1 client, and the GPU tests pass (`graph_dspine` among them);
#   - adaptive becomes the server's default (SGLANG_DSPINE_VERIFY) only if, on the pair, it serves >= 0.97x fixed
#     DSPINE at 1, 16 and 48 clients in both passes, and at Qwen3-8B geometry >= fixed DSPINE at every client count.
set -uo pipefail
OUT="${OUT:-/tmp/out}"
A="python3 scripts/device/adaptive.py --out $OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/gpu.txt"
if [ "${1:-}" = headline ]; then
  # `issue57.sh headline`: every row of the issue at one commit, as 84ba46f ran it (now with a warm round a client
  # count), for the summary the "done when" asks for once the serving code stops changing; a lease that
  # ends early leaves a run that a second lease at the same commit completes: `issue57.sh headline RUN_JSON`
  # (the first lease's adaptive.json, carried) starts from it, and adaptive.py skips what it has
  if [ -n "${2:-}" ]; then
    had="$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["provenance"]["commit"])' "$2")"
    [ "$had" = "${GIT_COMMIT:-?}" ] || { echo "issue57 headline: $2 ran at $had, this lease at ${GIT_COMMIT:-?}" >&2; exit 2; }
    cp "$2" "$OUT/adaptive.json"
  fi
  bash scripts/device/gpu_tests.sh > /dev/null 2>&1
  echo "issue57 headline: GPU tests rc $?"; tail -2 "$OUT/gpu_tests.log"
  $A --phases pair --pair-servers plain,dspine_adaptive,dspine,dflash,dspine_tree32 --clients 1,4,16,48,64 \
    --t1-clients 1,48
  $A --phases geometry --geometry-servers plain,dspine_adaptive --clients 1,4,16,48,64
  $A --phases switching --switching-server dspine_adaptive
  $A --phases pair --pair-servers dspine_adaptive_tree32,dspine_adaptive_tree64 --clients 1,4,16,48,64 --t1-clients ""
  $A --phases geometry --geometry-servers dspine_adaptive_tree32,dspine_adaptive_tree64 --clients 1,4,16,48,64
  exit 0
fi
# 84ba46f ran the headline (benchmarks/results/adaptive_run_h100_84ba46f.json): every row of the issue but SGLang
# 0.5.23, the other attention backends and the tree of 64. 671b819 (adaptive_run_h100_671b819*.json) made the
# grouped kernel the trees' default (rule tree_grouped) and traced most of the adaptive server's loss on the
# host-bound pair to its cap of 128 running requests (one pass: fixed DSPINE with that cap served 0.87 / 0.86 /
# 0.78x fixed DSPINE at 1 / 16 / 48 clients; at 48 SGLang's MinFreeSlotsDelayer batches a full cap of 48's
# admissions, 4 at a time, which a cap of 128 never triggers). What is left, in the order the issue needs it
# (a lease that ends early keeps the first; adaptive.py skips what its JSON already has):
#   (61da15d, 15 device minutes after 8 refused starts, H100: the GPU tests passed (35) and the pair's two adaptive
#   tree servers ran at 1 / 4 / 16 clients; the geometry's tree-64 server ran out of memory capturing its graphs at
#   --mem-fraction-static 0.85, and now keeps 20% of the GPU (adaptive.py TREE64_MEM_FRACTION); rerun from step 1,
#   adaptive.py skips nothing of this lease's since its JSON starts empty)
#   1. the GPU tests (~3 min; the tree's default kernel changed, and the grouped kernel's tree of 64 is new);
#   2. the tree of 64 (issue 57's 5(b) step table names it; ~5 min): its step at the geometry (the adaptive server
#      with it in its menu times it beside the chains) and its acceptance on the pair (the same server's mean
#      tokens a tree step after its last T=0 cell, as for the tree of 32: the projection's source, fixed now,
#      before the run), beside the adaptive tree32 server's on the pair at the same client counts: rule tree64
#      (default_rules.py, written before this run: which tree the docs recommend at low load);
#   3. the cap on the pair, two passes in opposite orders (~9 min): fixed DSPINE at 48, at 128, and at 128 with
#      SGLang's prefill delayer batching admissions (`dspine_cap128_delayed`), 1 / 16 / 48 clients: rules
#      cap_cost and admission (default_rules.py, written before this run); the cap with the 48 cap's graphs
#      (`dspine_cap128_graphs48`, rule cap_graphs) waits: it is judged only where cap_cost is met, and its ~3
#      minutes would push the second pass past a lease that refused starts have shortened (stop 73: 18 minutes);
#   4. the upkeep graphs' A/B at the geometry (~5 min; rule upkeep), if the lease lasts.
# SGLang's FA3 and FlashInfer backends (5(b)) are not in this lease: the .devbundle leaves FA3's kernels out
# (fa3_0517.sh carries them, ~1 GB in pieces) and FlashInfer's attention would JIT-build on the machine. SGLang
# 0.5.23's pieces carry both (its fa3 and jit parts), so they run in the 0.5.23 lease, after its own checks:
#   bundle_0523.sh plan's calls, then `source scripts/device/bundle_0523.sh setup && DEVICE_SGLANG=0.5.23 bash
#   scripts/device/versions.sh triton/pytorch backends features e2e adaptive` (versions.sh's `backends` step:
#   the geometry's plain and adaptive servers on fa3 and flashinfer).
bash scripts/device/gpu_tests.sh > /dev/null 2>&1
echo "issue57: GPU tests rc $?"; tail -2 "$OUT/gpu_tests.log"
$A --phases geometry --geometry-servers dspine_adaptive_tree64 --clients 1,4,16,48,64
$A --phases pair --pair-servers dspine_adaptive_tree64,dspine_adaptive_tree32 --clients 1,4,16 --t1-clients ""
if ! grep -q "H100 80GB HBM3" "$OUT/gpu.txt"; then  # rule tree64's references from 671b819 are an H100's: this
  $A --phases geometry --geometry-servers dspine_adaptive_tree32 --clients 1  # card's tree32 table at 1 request
  $A --phases pair --pair-servers plain --clients 1 --t1-clients ""  # and plain's greedy answers
fi
P=(--phases pair --clients 1,16,48 --t1-clients "")
$A "${P[@]}" --pair-servers dspine,dspine_cap128,dspine_cap128_delayed
mkdir -p "$OUT/rep2"  # the second pass in the opposite order
python3 scripts/device/adaptive.py --out "$OUT/rep2" "${P[@]}" --pair-servers dspine_cap128_delayed,dspine_cap128,dspine
mkdir -p "$OUT/upkeep"
python3 scripts/device/adaptive.py --out "$OUT/upkeep" --phases geometry --geometry-servers \
  dspine_adaptive,dspine_adaptive_upkeep_graphs --clients 1,48
