"""The draft tree for a batch in one kernel: `drafter/tree_batch.lattice_trees` with one program per request.

`lattice_trees` keeps, at each of the P depths, the `budget` best children of the previous depth's kept nodes,
then the `budget` best of all kept nodes: a sort and a handful of gathers per depth, about 15 × 8 small kernels
in the draft graph (+~590 µs over the walk at 1 request on an H200). Here one program per request does the same
in registers, its kept nodes in a scratch row:
  - each depth's children (kept parent place · K + slot, the order lattice_trees lists them in) are scored as
    there (parent's path score + the row's log-score, in float32), packed into one int64 key per child: the
    score's bits mapped to a signed order in the high word, (2^31 - 1 - child index) in the low word. One
    descending sort of the keys is then lattice_trees' stable descending sort: equal scores keep index order.
  - the first `width` keys name the kept children; their scores, slots, parents and depths go to the scratch
    row (a barrier before the next depth reads them).
  - the final `budget` best of the kept nodes the same way; each kept parent's node index through a scatter.
The outputs equal lattice_trees' exactly (tests/test_tree_batch.py: ties, bf16 tables, every budget regime).
NaN scores are not supported.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _keys(score, index, valid):
    """int64 sort keys: the float32 score's order in the high word, 2^31 - 1 - index in the low word (a lower
    index sorts first among equal scores)."""
    bits = (score + 0.0).to(tl.int32, bitcast=True)  # + 0.0: -0.0 and 0.0 are one score, as sort has them
    high = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # float order as signed int order
    key = (high.to(tl.int64) << 32) | (2147483647 - index).to(tl.int64)
    lowest = tl.full(score.shape, -2147483648, tl.int32).to(tl.int64) << 32  # below every valid key
    return tl.where(valid, key, lowest)


@triton.jit
def _low_word(key):
    """The low 32 bits of int64 keys (no 32-bit mask literal: its type would be unsigned)."""
    return (key - ((key >> 32) << 32)).to(tl.int32)


@triton.jit
def _lattice_tree_kernel(ls_ptr, cand_ptr, plan_ptr, kscore_ptr, kslot_ptr, kpar_ptr, kdep_ptr, keys_ptr,
                         nodeof_ptr, tok_ptr, par_ptr, dep_ptr, sc_ptr, P, N, T, NOUT, stride_scratch, stride_keys,
                         K: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    ls = ls_ptr + r * P * K * K
    ks, kl, kp, kd = (kscore_ptr + r * stride_scratch, kslot_ptr + r * stride_scratch,
                      kpar_ptr + r * stride_scratch, kdep_ptr + r * stride_scratch)
    keys, nodeof = keys_ptr + r * stride_keys, nodeof_ptr + r * stride_scratch
    c = tl.arange(0, BLOCK_C)
    i = tl.arange(0, BLOCK_N)
    for d in range(P):
        # the host's plan of depth d: kept width, children, where its kept nodes start, where the parents' start
        width = tl.load(plan_ptr + d)
        n_child = tl.load(plan_ptr + P + d)
        start = tl.load(plan_ptr + 2 * P + d)
        start_prev = tl.load(plan_ptr + 3 * P + d)
        deeper = d > 0  # depth 1's parent is the anchor: row 0, path score 0
        # children of the previous depth's kept nodes, listed parent place · K + slot
        ok = c < n_child
        parent = start_prev + c // K
        row = tl.load(kl + parent, mask=ok & deeper, other=0)
        base = tl.load(ks + parent, mask=ok & deeper, other=0.0)
        score = base + tl.load(ls + d * K * K + row * K + c % K, mask=ok, other=0.0).to(tl.float32)
        tl.store(keys + c, tl.sort(_keys(score, c, ok), descending=True))
        tl.debug_barrier()
        take = i < width
        idx = tl.where(take, 2147483647 - _low_word(tl.load(keys + i, mask=take, other=0)), 0)
        slot_t = idx % K
        par_t = start_prev + idx // K
        row_t = tl.load(kl + par_t, mask=take & deeper, other=0)
        base_t = tl.load(ks + par_t, mask=take & deeper, other=0.0)
        score_t = base_t + tl.load(ls + d * K * K + row_t * K + slot_t, mask=take, other=0.0).to(tl.float32)
        tl.store(ks + start + i, score_t, mask=take)
        tl.store(kl + start + i, slot_t, mask=take)
        tl.store(kp + start + i, tl.where(deeper, par_t, -1), mask=take)
        tl.store(kd + start + i, tl.zeros_like(i) + d + 1, mask=take)
        tl.debug_barrier()
    # the NOUT best of all T kept nodes, parents turned into node indices
    t = tl.arange(0, BLOCK_T)
    kept = t < T
    tl.store(keys + t, tl.sort(_keys(tl.load(ks + t, mask=kept, other=0.0), t, kept), descending=True))
    tl.store(nodeof + t, tl.zeros_like(t) + NOUT, mask=kept)
    tl.debug_barrier()
    out = i < NOUT
    order = tl.where(out, 2147483647 - _low_word(tl.load(keys + i, mask=out, other=0)), 0)
    tl.store(nodeof + order, i, mask=out)
    tl.debug_barrier()
    kpar = tl.load(kp + order, mask=out, other=-1)
    parent = tl.where(kpar < 0, -1, tl.load(nodeof + kpar, mask=out & (kpar >= 0), other=0))
    depth = tl.load(kd + order, mask=out, other=1)
    slot = tl.load(kl + order, mask=out, other=0)
    token = tl.load(cand_ptr + r * P * K + (depth - 1) * K + slot, mask=out, other=0)
    o = r * NOUT + i
    tl.store(tok_ptr + o, token, mask=out)
    tl.store(par_ptr + o, parent.to(tl.int64), mask=out)
    tl.store(dep_ptr + o, depth.to(tl.int64), mask=out)
    tl.store(sc_ptr + o, tl.load(ks + order, mask=out, other=0.0), mask=out)


_PLANS: dict = {}


def _plan(p: int, k: int, budget: int, device) -> tuple[torch.Tensor, dict]:
    """The per-depth plan [4, P] int32 on `device` (kept width, children, start of the kept nodes, start of their
    parents') and the block sizes: made once per shape and device, before any CUDA-graph capture copies it."""
    key = (p, k, budget, str(device))
    if key not in _PLANS:
        widths, children, starts, starts_prev, w = [], [], [], [], 1
        for _ in range(p):
            children.append(w * k)
            starts_prev.append(starts[-1] if starts else 0)
            starts.append(sum(widths))
            w = min(budget, w * k)
            widths.append(w)
        total = sum(widths)
        n_out = min(budget, total)  # ≥ every depth's width
        sizes = dict(total=total, n_out=n_out, BLOCK_C=triton.next_power_of_2(max(children)),
                     BLOCK_N=triton.next_power_of_2(n_out), BLOCK_T=triton.next_power_of_2(total))
        plan = torch.tensor([widths, children, starts, starts_prev], dtype=torch.int32, device=device)
        _PLANS[key] = (plan, sizes)
    return _PLANS[key]


def lattice_trees_kernel(candidates: torch.Tensor, log_scores: torch.Tensor, budget: int
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens, parents, depths, scores), each [bs, n]: `lattice_trees` on the kernel (module docstring).
    candidates [bs, P, K] int64; log_scores [bs, P, K, K] (float32, bf16 or fp16; scored in float32)."""
    from ..drafter.tree_batch import check_lattice

    bs, p, k = check_lattice("lattice_trees_kernel", candidates, log_scores, budget)
    if log_scores.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"lattice_trees_kernel: log_scores of {log_scores.dtype}; float32, bf16 or fp16")
    dev = candidates.device
    plan, sz = _plan(p, k, budget, dev)
    n_out, block_t = sz["n_out"], sz["BLOCK_T"]
    ls = log_scores.contiguous()
    cand = candidates.to(torch.long).contiguous()
    kscore = torch.empty(bs, block_t, dtype=torch.float32, device=dev)
    kslot, kpar, kdep, nodeof = (torch.empty(bs, block_t, dtype=torch.int32, device=dev) for _ in range(4))
    keys = torch.empty(bs, max(sz["BLOCK_C"], block_t), dtype=torch.int64, device=dev)
    tokens, parents, depths = (torch.empty(bs, n_out, dtype=torch.long, device=dev) for _ in range(3))
    scores = torch.empty(bs, n_out, dtype=torch.float32, device=dev)
    _lattice_tree_kernel[(bs,)](ls, cand, plan, kscore, kslot, kpar, kdep, keys, nodeof, tokens, parents, depths,
                                scores, p, budget, sz["total"], n_out, block_t, keys.stride(0), K=k,
                                BLOCK_C=sz["BLOCK_C"], BLOCK_N=sz["BLOCK_N"], BLOCK_T=block_t, num_warps=4)
    return tokens, parents, depths, scores
