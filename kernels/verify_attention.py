"""A chain verify pass's attention, grouped by KV head: `W` verify rows a request read their committed context
from the KV pool, then the rows' own K/V causally (row r sees rows 0..r), in one pass over the context per KV head.

Why: SGLang's triton kernels for this pass read a KV head's context once per query head (the extend kernel
serially per (request, head); the split-KV verify kernel in splits, per head, then a one-warp combine with the
rows' own block). With GQA (Qwen3-8B: 32 query heads, 8 KV heads) that reads the context 4 times, in tiles of
W rows. At Qwen3-8B geometry on an H100 (benchmarks/results/verify_attention_h100_33f82f8.json, 576-token
contexts, all 36 layers) 16 rows cost 1.47 ms a step at 1 request against 0.41 for decode, and 8.6 to 14.1 ms at 48
against 1.8.

Here one program holds every (row, query head) that reads one KV head of one request: M = W·G tile rows (W rows ×
the G query heads of the group; 64 at W = 16, G = 4), so each K/V block of its stretch of the context is loaded
once. The context is cut into S splits (`split_count`: several only where requests × KV heads leave the GPU's
multiprocessors idle); the last split also reads the rows' own K/V. S = 1 writes the output directly; otherwise
each split writes its normalised partial output and log-sum-exp (float32 scratch) and `_merge_splits` combines them
per (row, query head).

fp8 KV pools: `k_scale` multiplies the context's scores and `v_scale` its values, not the rows' own fresh K/V
(what SGLang's extend kernel does). The PyTorch reference is `grouped_verify_attention_torch` (float32);
tests/test_verify_attention.py compares them through Triton's interpreter and on the GPU.

Trees: with a tree's mask (SGLang's layout for TARGET_VERIFY) the rows' own block follows the mask instead of
causality; the context stays visible to every row.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_SPLITS = 16
BLOCK_N = 64  # context tokens a step of a program's loop


def tile_rows(rows: int, group: int) -> int:
    """A program's tile height: W rows × G query heads, a power of two of at least 16 (tl.dot's minimum)."""
    return max(16, triton.next_power_of_2(rows * group))


def split_count(requests: int, kv_heads: int, programs: int) -> int:
    """Context splits per (request, KV head): the largest power of two ≤ MAX_SPLITS that keeps requests ×
    KV heads × splits within `programs` (about two per multiprocessor), 1 where that product already fills them.
    From static sizes only (a CUDA graph replays it at any context length)."""
    per = programs // max(1, requests * kv_heads)
    return 1 if per < 2 else min(MAX_SPLITS, 1 << (per.bit_length() - 1))


@triton.jit
def _online(qk, v, e_max, e_sum, acc):
    """One block's scores `qk` [M, N] and values `v` [N, Dv] folded into a running softmax (max, sum, output)."""
    new_max = tl.maximum(e_max, tl.max(qk, 1))
    alpha = tl.exp(e_max - new_max)
    p = tl.exp(qk - new_max[:, None])
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return new_max, e_sum * alpha + tl.sum(p, 1), acc


@triton.jit
def _grouped_verify_split(Q, K_ext, V_ext, K_buf, V_buf, kv_indptr, kv_indices, Out, Part, Lse, Mask, mask_indptr,
                          sm_scale, k_scale, v_scale,
                          stride_qt, stride_qh, stride_ket, stride_keh, stride_vet, stride_veh,
                          stride_kbt, stride_kbh, stride_vbt, stride_vbh, stride_ot, stride_oh,
                          stride_pb, stride_ph, stride_ps, stride_pm,
                          ROWS: tl.constexpr, GROUP: tl.constexpr, SPLITS: tl.constexpr, TREE: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                          HEAD_DIM: tl.constexpr, V_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                          BLOCK_DV: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    s = tl.program_id(2)
    m = tl.arange(0, BLOCK_M)
    row = m // GROUP
    head = kvh * GROUP + m % GROUP
    m_ok = m < ROWS * GROUP
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    d_ok = d < HEAD_DIM
    dv_ok = dv < V_DIM
    tok = b * ROWS + row  # the row's place in the pass's flat rows
    q = tl.load(Q + tok[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=m_ok[:, None] & d_ok[None, :], other=0.0)
    kv_start = tl.load(kv_indptr + b).to(tl.int64)
    ctx = tl.load(kv_indptr + b + 1).to(tl.int64) - kv_start
    per_split = tl.cdiv(tl.cdiv(ctx, SPLITS), BLOCK_N) * BLOCK_N
    lo = s * per_split
    hi = tl.minimum(lo + per_split, ctx)
    e_max = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
    e_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    # the committed context, this split's stretch of it
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < hi
        loc = tl.load(kv_indices + kv_start + n, mask=n_ok, other=0).to(tl.int64)
        k = tl.load(K_buf + loc[None, :] * stride_kbt + kvh * stride_kbh + d[:, None],
                    mask=n_ok[None, :] & d_ok[:, None], other=0.0)
        qk = tl.dot(q.to(k.dtype), k) * (sm_scale * k_scale)
        qk = tl.where(n_ok[None, :], qk, float("-inf"))
        v = tl.load(V_buf + loc[:, None] * stride_vbt + kvh * stride_vbh + dv[None, :],
                    mask=n_ok[:, None] & dv_ok[None, :], other=0.0)
        e_max, e_sum, acc = _online(qk, v, e_max, e_sum, acc)
    acc = acc * v_scale
    # the rows' own K/V in the last split, causal or, for a tree, as its mask says (SGLang's layout: a request's
    # rows × (context + rows) bits from mask_indptr, the context's all set); each row sees itself, so its max is
    # finite from here on (padding rows see every row)
    if s == SPLITS - 1:
        j = tl.arange(0, BLOCK_R)
        j_ok = j < ROWS
        tj = b * ROWS + j
        ke = tl.load(K_ext + tj[None, :] * stride_ket + kvh * stride_keh + d[:, None],
                     mask=j_ok[None, :] & d_ok[:, None], other=0.0)
        qk = tl.dot(q.to(ke.dtype), ke) * sm_scale
        if TREE:
            bits = tl.load(Mask + tl.load(mask_indptr + b).to(tl.int64) + row[:, None] * (ctx + ROWS) + ctx
                           + j[None, :], mask=(row[:, None] < ROWS) & j_ok[None, :], other=1)
            seen = j_ok[None, :] & (bits != 0)
        else:
            seen = j_ok[None, :] & (j[None, :] <= row[:, None])
        qk = tl.where(seen, qk, float("-inf"))
        ve = tl.load(V_ext + tj[:, None] * stride_vet + kvh * stride_veh + dv[None, :],
                     mask=j_ok[:, None] & dv_ok[None, :], other=0.0)
        e_max, e_sum, acc = _online(qk, ve, e_max, e_sum, acc)
    if SPLITS == 1:
        tl.store(Out + tok[:, None] * stride_ot + head[:, None] * stride_oh + dv[None, :],
                 (acc / e_sum[:, None]).to(Out.dtype.element_ty), mask=m_ok[:, None] & dv_ok[None, :])
    else:
        ran = e_sum > 0  # an empty split (a short context) leaves 0 and -inf, which the merge weighs 0
        part = tl.where(ran[:, None], acc / tl.where(ran, e_sum, 1.0)[:, None], 0.0)
        base = b * stride_pb + kvh * stride_ph + s * stride_ps
        tl.store(Part + base + m[:, None] * stride_pm + dv[None, :], part)
        tl.store(Lse + (base + m * stride_pm) // stride_pm,
                 tl.where(ran, e_max + tl.log(tl.where(ran, e_sum, 1.0)), float("-inf")))


@triton.jit
def _merge_splits(Part, Lse, Out, stride_pb, stride_ph, stride_ps, stride_pm, stride_ot, stride_oh,
                  ROWS: tl.constexpr, GROUP: tl.constexpr, SPLITS: tl.constexpr, V_DIM: tl.constexpr,
                  BLOCK_DV: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)  # one (row, query head) a program
    h = tl.program_id(1)
    b = t // ROWS
    m = (t % ROWS) * GROUP + h % GROUP
    sp = tl.arange(0, SPLITS)
    dv = tl.arange(0, BLOCK_DV)
    base = b * stride_pb + (h // GROUP) * stride_ph + m * stride_pm
    lse = tl.load(Lse + (base + sp * stride_ps) // stride_pm)
    w = tl.exp(lse - tl.max(lse, 0))  # the last split (the rows' own) is never empty
    part = tl.load(Part + base + sp[:, None] * stride_ps + dv[None, :])
    out = tl.sum(part * w[:, None], 0) / tl.sum(w, 0)
    tl.store(Out + t * stride_ot + h * stride_oh + dv, out.to(Out.dtype.element_ty), mask=dv < V_DIM)


class SplitScratch:
    """The float32 partials of the splits, allocated once at their bound (CUDA graphs keep its address): a
    split pass runs at most `programs` programs of M × Dv outputs and M log-sum-exps each."""

    def __init__(self, programs: int, block_m: int, v_dim: int, device):
        self.programs, self.block_m, self.block_dv = programs, block_m, triton.next_power_of_2(v_dim)
        self.part = torch.zeros(programs * block_m * self.block_dv, dtype=torch.float32, device=device)
        # the log-sum-exps share the partials' indexing, divided by the row stride (one per row)
        self.lse = torch.zeros(programs * block_m, dtype=torch.float32, device=device)


def grouped_verify_attention(q: torch.Tensor, k_ext: torch.Tensor, v_ext: torch.Tensor, k_buffer: torch.Tensor,
                             v_buffer: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor, rows: int,
                             sm_scale: float, out: torch.Tensor, scratch: SplitScratch | None = None,
                             splits: int = 1, k_scale: float = 1.0, v_scale: float = 1.0,
                             mask: torch.Tensor | None = None, mask_indptr: torch.Tensor | None = None,
                             block_n: int = BLOCK_N, num_warps: int | None = None) -> torch.Tensor:
    """`out` [bs·W, H_q, Dv] = each row's attention over its request's committed context (the KV pool rows
    `kv_indices[kv_indptr[b]:kv_indptr[b + 1]]` of `k_buffer` / `v_buffer` [pool, H_kv, D]) and the request's
    rows 0..r of `k_ext` / `v_ext` [bs·W, H_kv, D]; q [bs·W, H_q, D], rows W a request, flat by request.
    A tree's verify: `mask` (flat bool, SGLang's layout: request b's W × (context + W) cells from
    `mask_indptr[b]`) says which of the request's rows each row sees instead. `splits` > 1 needs `scratch` (of at
    least bs × H_kv × splits programs of this tile). `block_n` (context tokens a loop step) and `num_warps` (4, 8
    from a 128-row tile, unless given) change the speed only: what benchmarks/verify_attention.py sweeps."""
    tokens, h_q, head_dim = q.shape
    h_kv, v_dim = k_buffer.shape[1], v_buffer.shape[2]
    bs = kv_indptr.shape[0] - 1
    if rows < 1 or tokens != bs * rows or h_q % h_kv or k_ext.shape[:2] != (tokens, h_kv) or \
            v_ext.shape[:2] != (tokens, h_kv) or out.shape != (tokens, h_q, v_dim):
        raise ValueError(f"grouped_verify_attention: q {tuple(q.shape)}, k_ext {tuple(k_ext.shape)}, v_ext "
                         f"{tuple(v_ext.shape)}, out {tuple(out.shape)}, {bs} requests of {rows} rows, {h_kv} KV "
                         "heads")
    for name, t in (("q", q), ("k_ext", k_ext), ("v_ext", v_ext), ("k_buffer", k_buffer), ("v_buffer", v_buffer),
                    ("out", out)):
        if t.stride(2) != 1:
            raise ValueError(f"grouped_verify_attention: {name}'s last dimension must be contiguous")
    if (mask is None) != (mask_indptr is None):
        raise ValueError("grouped_verify_attention: a tree's mask needs its mask_indptr, and the other way round")
    group = h_q // h_kv
    block_m, block_dv = tile_rows(rows, group), triton.next_power_of_2(v_dim)
    if splits > 1:
        if scratch is None or scratch.block_m != block_m or scratch.block_dv != block_dv or \
                bs * h_kv * splits > scratch.programs:
            raise ValueError(f"grouped_verify_attention: {splits} splits of {bs} × {h_kv} programs need a scratch of "
                             f"that many {block_m}-row tiles")
        part, lse = scratch.part, scratch.lse
        sp = (h_kv * splits * block_m * block_dv, splits * block_m * block_dv, block_m * block_dv, block_dv)
    else:
        part, lse, sp = out, out, (0, 0, 0, 1)  # not read: SPLITS = 1 writes `out` itself
    tree = mask is not None
    _grouped_verify_split[(bs, h_kv, splits)](
        q, k_ext, v_ext, k_buffer, v_buffer, kv_indptr, kv_indices, out, part, lse,
        mask if tree else kv_indptr, mask_indptr if tree else kv_indptr,  # not read without a tree
        float(sm_scale), float(k_scale), float(v_scale),
        q.stride(0), q.stride(1), k_ext.stride(0), k_ext.stride(1), v_ext.stride(0), v_ext.stride(1),
        k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1), out.stride(0), out.stride(1),
        *sp, ROWS=rows, GROUP=group, SPLITS=splits, TREE=tree, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_R=max(16, triton.next_power_of_2(rows)), HEAD_DIM=head_dim, V_DIM=v_dim,
        BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_DV=block_dv,
        num_warps=num_warps or (8 if block_m >= 128 else 4), num_stages=2)
    if splits > 1:
        _merge_splits[(tokens, h_q)](part, lse, out, *sp, out.stride(0), out.stride(1), ROWS=rows, GROUP=group,
                                     SPLITS=splits, V_DIM=v_dim, BLOCK_DV=block_dv, num_warps=1)
    return out


def grouped_verify_attention_torch(q, k_ext, v_ext, k_buffer, v_buffer, kv_indptr, kv_indices, rows: int,
                                   sm_scale: float, k_scale: float = 1.0, v_scale: float = 1.0, mask=None,
                                   mask_indptr=None) -> torch.Tensor:
    """The reference, in float32, one request at a time: [context; own rows] keys, row r masked past own row r
    (a tree: where its mask's cell is unset)."""
    h_q, h_kv = q.shape[1], k_buffer.shape[1]
    group = h_q // h_kv
    outs = []
    for b in range(kv_indptr.shape[0] - 1):
        ctx = kv_indices[int(kv_indptr[b]):int(kv_indptr[b + 1])].long()
        own = slice(b * rows, (b + 1) * rows)
        k = torch.cat([k_buffer[ctx].float() * k_scale, k_ext[own].float()])  # [n + W, H_kv, D]
        v = torch.cat([v_buffer[ctx].float() * v_scale, v_ext[own].float()])
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # per query head
        scores = torch.einsum("rhd,nhd->hrn", q[own].float(), k) * sm_scale
        n = len(ctx)
        if mask is None:
            hidden = torch.arange(rows)[None, :] > torch.arange(rows)[:, None]  # own row j > row r
        else:
            start = int(mask_indptr[b])
            hidden = ~mask[start: start + rows * (n + rows)].view(rows, n + rows)[:, n:].bool().cpu()
        scores[:, :, n:] = scores[:, :, n:].masked_fill(hidden.to(scores.device), float("-inf"))
        outs.append(torch.einsum("hrn,nhd->rhd", scores.softmax(-1), v))
    return torch.cat(outs)
