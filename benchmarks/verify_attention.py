#!/usr/bin/env python3
"""The target's attention in a verify step against a plain decode step, at Qwen3-8B heads, under SGLang's
triton backend: a diagnosis of why a DSPINE `none` step (one verify row a request, no drafter) cost 2.7x a plain
decode step at 48 requests (docs/results.md, "Adaptive verification").

SGLang's triton backend runs a speculative verify pass (TARGET_VERIFY: W rows a request, causal over the
context and the chain) on its extend kernel, or with SGLANG_DSPINE_SPLITKV_VERIFY=1 (patch 8) on its split-KV
verify kernel; a plain decode step (1 row) on its flash-decoding kernel. This times the three kernels alone, on
the inputs the backend hands them (the GPU test of patch 8 builds the same), per layer:
  - Qwen3-8B heads: 32 query heads, 8 KV heads of 128, bf16; 36 layers, each its own KV pool (so one layer's K/V
    is not in L2 for the next, as in the model);
  - `--context` tokens a request (default 576: the harness's 512-token prompts and half of its new tokens), in
    scattered KV slots;
  - rows W = 1 (`none`; the decode kernel too), 4, 8, 16 (the block), batch sizes 1, 4, 16, 48, 64;
  - decode: `--kv-splits` static splits a request (SGLang's default is 8, chosen per request by a Triton kernel;
    static here, as SGLang does with SGLANG_TRITON_DECODE_ATTN_STATIC_KV_SPLITS).
The split-KV kernel three ways: with exact index arrays (eager passes), with the array as a verify graph holds it
(the capture buffer, `--graph-kv-indices` long: SGLang's kernel then runs 16 KV splits), and the same through
patch 8's split count for graphs (`splitkv_graph_dspine`, what a DSPINE server's verify graphs run). And
DSPINE's own grouped kernel (`grouped`, SGLANG_DSPINE_SPLITKV_VERIFY=grouped: patch 10's dispatch, as the server's
verify graphs call it).
Timing: the 36 layers' calls captured in one CUDA graph per (kernel, W, bs), as the server replays them; median
of `--repeats` replays timed with CUDA events (benchmarks.kernels.Bench's capture and replays). It is the
attention kernels only: no GEMMs, norms or sampling.
Writes verify_attention.json (command, commit, GPU, versions, date) to --out and prints a table: ms per step
(36 layers) per kernel, W and bs.
    python -m benchmarks verify_attention --out $OUT
"""
from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

from sglang_dspine.provenance import default_output, provenance

HQ, HKV, D, LAYERS = 32, 8, 128, 36  # Qwen3-8B
# splitkv: exact index arrays (eager passes); splitkv_graph: the index array as a verify graph holds it (the capture
# buffer: SGLang's kernel then runs its 16 KV splits); splitkv_graph_dspine: the same through patch 8's split count
# for graphs (sglang_patches.with_graph_split_count), what a DSPINE server's verify graphs run; grouped: DSPINE's
# grouped kernel through patch 10's dispatch (sglang_patches.grouped_verify_dispatch), with the graphs' index array
VERIFY_KERNELS = ("extend", "splitkv", "splitkv_graph", "splitkv_graph_dspine", "grouped")
MAX_CONTEXT = 40960  # Qwen3-8B's context: the capture buffer's length per token, and patch 8's bound


def inputs(bs: int, rows: int, context: int, gen: torch.Generator, dev: str = "cuda"):
    """One layer's tensors as the triton backend hands them to its kernels: queries and the chain's own K/V
    [bs·W, heads, D], the KV pools with `context` scattered slots a request, and the index arrays."""
    dt = torch.bfloat16 if dev == "cuda" else torch.float32
    pool = bs * (context + 16) + 64
    k_pool, v_pool = (torch.randn(pool, HKV, D, generator=gen, device=dev, dtype=dt) for _ in range(2))
    kv_indptr = torch.arange(0, (bs + 1) * context, context, dtype=torch.int32, device=dev)
    kv_indices = torch.randperm(pool, generator=gen, device=dev)[: bs * context].to(torch.int32)
    qo_indptr = torch.arange(0, (bs + 1) * rows, rows, dtype=torch.int32, device=dev)
    q = torch.randn(bs * rows, HQ, D, generator=gen, device=dev, dtype=dt)
    k, v = (torch.randn(bs * rows, HKV, D, generator=gen, device=dev, dtype=dt) for _ in range(2))
    return dict(q=q, k=k, v=v, o=torch.empty_like(q), k_pool=k_pool, v_pool=v_pool, kv_indptr=kv_indptr,
                kv_indices=kv_indices, qo_indptr=qo_indptr)


def graph_kv_indices(layers: list[dict], length: int) -> torch.Tensor:
    """The index array as the triton backend's verify graphs hold it: a capture buffer of `length` int64 slots
    (SGLang's `cuda_graph_kv_indices`) whose head holds the batch's indices (every layer's pool is the same size,
    so one array serves them all)."""
    real = layers[0]["kv_indices"]
    buf = torch.zeros(length, dtype=torch.int64, device=real.device)
    buf[: real.numel()] = real
    return buf


def calls(kernel: str, layers: list[dict], bs: int, rows: int, kv_splits: int, dev: str = "cuda",
          graph_kv_len: int = 0):
    """The per-layer calls of `kernel` over `layers` (a list of `inputs`), as one function to capture."""
    from sglang.kernels.ops.attention.decode_attention import decode_attention_fwd
    from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd
    from sglang.kernels.ops.attention.verify_splitkv import verify_splitkv_fwd

    scale = D ** -0.5
    if kernel == "decode":
        logits = torch.empty(bs, HQ, kv_splits, D, dtype=torch.float32, device=dev)
        lse = torch.empty(bs, HQ, kv_splits, dtype=torch.float32, device=dev)
        splits = torch.full((bs,), kv_splits, dtype=torch.int32, device=dev)

        def run():
            for t in layers:  # the context already holds this step's K/V in a decode step: the same work
                decode_attention_fwd(t["q"], t["k_pool"], t["v_pool"], t["o"], t["kv_indptr"], t["kv_indices"],
                                     logits, lse, splits, kv_splits, scale, 1.0, 1.0)
        return run
    if kernel.startswith("splitkv"):
        from sglang_dspine.serving import sglang_patches

        sglang_patches.zero_split_kv_scratch()  # what patch 8 does before the server's first verify
        shared = graph_kv_indices(layers, graph_kv_len) if kernel.startswith("splitkv_graph") else None
        fwd = verify_splitkv_fwd
        if kernel == "splitkv_graph_dspine":
            fwd = sglang_patches.with_graph_split_count(verify_splitkv_fwd, MAX_CONTEXT)

        def run():
            for t in layers:
                indices = t["kv_indices"] if shared is None else shared
                if not fwd(t["q"], t["k"], t["v"], t["o"], t["k_pool"], t["v_pool"], t["qo_indptr"],
                           t["kv_indptr"], indices, None, True, None, rows, 1.0, 1.0, sm_scale=scale, max_bs=64):
                    raise RuntimeError(f"split-KV verify refused W={rows} bs={bs} (the backend falls back)")
        return run

    if kernel == "grouped":
        from sglang_dspine.serving import sglang_patches

        shared = graph_kv_indices(layers, graph_kv_len)
        fwd = sglang_patches.grouped_verify_dispatch(rows, HQ, HKV, D, dev)

        def run():
            for t in layers:
                fwd(t["q"], t["k"], t["v"], t["o"], t["k_pool"], t["v_pool"], t["qo_indptr"], t["kv_indptr"], shared,
                    None, True, None, rows, 1.0, 1.0, sm_scale=scale)
        return run
    if kernel.startswith("grouped_"):  # a tuning variant: grouped_<splits>s_<block_n>n_<warps>w
        from sglang_dspine.kernels import verify_attention as va

        splits, block_n, warps = (int(x[:-1]) for x in kernel.split("_")[1:])
        programs = max(splits * bs * HKV, 1)
        scratch = va.SplitScratch(programs, va.tile_rows(rows, HQ // HKV), D, dev) if splits > 1 else None

        def run():
            for t in layers:
                va.grouped_verify_attention(t["q"], t["k"], t["v"], t["k_pool"], t["v_pool"], t["kv_indptr"],
                                            t["kv_indices"], rows, scale, t["o"], scratch, splits, block_n=block_n,
                                            num_warps=warps)
        return run

    def run():
        for t in layers:
            extend_attention_fwd(t["q"], t["k"], t["v"], t["o"], t["k_pool"], t["v_pool"], t["qo_indptr"],
                                 t["kv_indptr"], t["kv_indices"], None, True, None, rows, 1.0, 1.0, sm_scale=scale)
    return run


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=default_output("verify_attention"))
    ap.add_argument("--context", type=int, default=576)
    ap.add_argument("--batch-sizes", default="1,4,16,48,64")
    ap.add_argument("--rows", default="1,4,8,16")
    ap.add_argument("--kv-splits", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--grouped-variants", default="",
                    help="the grouped kernel again at other settings, comma-separated <splits>s_<block_n>n_<warps>w "
                         "(e.g. 1s_32n_4w,1s_128n_8w): its tuning sweep, beside the server's own choice (`grouped`)")
    ap.add_argument("--graph-kv-indices", type=int, default=64 * 16 * MAX_CONTEXT,
                    help="length of the verify graphs' index buffer: cuda-graph max bs 64 x the block's 16 rows x "
                         "Qwen3-8B's 40960-token context")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("verify_attention.py: needs a CUDA GPU (it times SGLang's Triton kernels)")
    os.makedirs(args.out, exist_ok=True)
    res = {"provenance": provenance(), "settings": vars(args), "ms_per_step": {}}
    from benchmarks.kernels import Bench  # its CUDA-graph capture and replay timing

    bench = Bench("cuda", deadline=float("inf"))
    gen = torch.Generator(device="cuda").manual_seed(0)
    variants = tuple(f"grouped_{v}" for v in filter(None, args.grouped_variants.split(",")))
    for bs in (int(b) for b in args.batch_sizes.split(",")):
        for rows in (int(r) for r in args.rows.split(",")):
            layers = [inputs(bs, rows, args.context, gen) for _ in range(LAYERS)]
            for kernel in ("decode",) * (rows == 1) + VERIFY_KERNELS + variants:
                graph = bench.capture(calls(kernel, layers, bs, rows, args.kv_splits,
                                            graph_kv_len=args.graph_kv_indices))  # Triton compiles before
                for _ in range(3):
                    graph.replay()
                ms = [us / 1e3 for us in bench._replays(graph.replay, args.repeats, flush=False)]
                del graph
                cell = {"median": round(statistics.median(ms), 4), "min": round(min(ms), 4), "max": round(max(ms), 4)}
                res["ms_per_step"].setdefault(str(bs), {}).setdefault(str(rows), {})[kernel] = cell
                print(f"bs {bs:3d} W {rows:2d} {kernel:8s} {cell['median']:8.3f} ms/step (36 layers)", flush=True)
            del layers
            torch.cuda.empty_cache()
            json.dump(res, open(os.path.join(args.out, "verify_attention.json"), "w"), indent=1)
    kernels = ("decode",) + VERIFY_KERNELS + variants
    print(f"{'bs':>4} {'W':>3} " + " ".join(f"{k:>13}" for k in kernels))
    for bs, by_rows in res["ms_per_step"].items():
        for rows, cells in by_rows.items():
            row = [f"{cells[k]['median']:13.3f}" if k in cells else f"{'':13s}" for k in kernels]
            print(f"{bs:>4} {rows:>3} {' '.join(row)}")


if __name__ == "__main__":
    main()
