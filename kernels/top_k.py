"""Top-K of the draft logits in one streaming pass (the candidates of DSpine's transition decoding).

`torch.topk` over [bs·(B-1), V] rows (V = 151936) makes several radix passes over the logits; DFlash's
argmax makes one. Two kernels here make DSpine's top-K cost about one pass as well:
  1. group maxima: the row is cut into groups of S consecutive logits and each group's max is written
     ([N, V/S], S = 32: 1/32 of the logits' bytes). One coalesced read of the logits, fully parallel.
  2. per row: the K groups with the largest maxima (iterated max over V/S values), then the top K of those
     K·S logits, re-read by gather. The K largest logits lie in the K groups with the largest maxima (each
     such logit's group max is at least as large, and at most K groups hold them), so the result is exact;
     with ties the values are exact and the indices are one valid choice (torch.topk's are unspecified too).
Values come out sorted descending, as `torch.topk(sorted=True)`. NaN logits are not supported.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

GROUP = 32


@triton.jit
def _group_max_kernel(x_ptr, g_ptr, V, G, stride_x, stride_g, S: tl.constexpr, BLOCK_G: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    gi = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)
    offs = gi[:, None] * S + tl.arange(0, S)[None, :]
    x = tl.load(x_ptr + row * stride_x + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    tl.store(g_ptr + row * stride_g + gi, tl.max(x, 1), mask=gi < G)


@triton.jit
def _select_kernel(x_ptr, g_ptr, val_ptr, idx_ptr, V, G, stride_x, stride_g, stride_v, stride_i,
                   K: tl.constexpr, KP: tl.constexpr, S: tl.constexpr, BLOCK_G: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    gi = tl.arange(0, BLOCK_G)
    gm = tl.load(g_ptr + row * stride_g + gi, mask=gi < G, other=float("-inf"))
    kk = tl.arange(0, KP)
    sel = tl.zeros([KP], tl.int32)
    for t in tl.static_range(K):  # the K groups with the largest maxima
        _, j = tl.max(gm, 0, return_indices=True)
        sel = tl.where(kk == t, j, sel)
        gm = tl.where(gi == j, float("-inf"), gm)
    offs = sel[:, None] * S + tl.arange(0, S)[None, :]  # [KP, S] their logits
    ok = (kk[:, None] < K) & (offs < V)
    x = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=float("-inf")).to(tl.float32)
    xf = tl.reshape(x, (KP * S,))
    of = tl.reshape(offs, (KP * S,))
    ar = tl.arange(0, KP * S)
    for t in tl.static_range(K):
        v, j = tl.max(xf, 0, return_indices=True)
        idx = tl.sum(tl.where(ar == j, of, 0), 0)
        tl.store(val_ptr + row * stride_v + t, v.to(val_ptr.dtype.element_ty))
        tl.store(idx_ptr + row * stride_i + t, idx.to(idx_ptr.dtype.element_ty))
        xf = tl.where(ar == j, float("-inf"), xf)


def topk(logits: torch.Tensor, k: int, values_out: torch.Tensor | None = None,
         indices_out: torch.Tensor | None = None, scratch: torch.Tensor | None = None):
    """Top-k over the last axis of logits [N, V] (Triton). Returns (values [N, k] in the logits' dtype,
    indices [N, k] int64), sorted descending. scratch: optional [N, ceil(V/32)] float32 buffer (V ≥ 32·k)."""
    n, v = logits.shape
    if logits.stride(-1) != 1:
        raise ValueError("logits: last axis must be contiguous")
    if not 1 <= k <= v:
        raise ValueError(f"k={k} must be in [1, V={v}]")
    # groups of S logits; small vocabularies get smaller groups so that there are at least k of them
    s = min(GROUP, 1 << ((v // k).bit_length() - 1))
    g = triton.cdiv(v, s)
    if scratch is None:
        scratch = torch.empty(n, g, dtype=torch.float32, device=logits.device)
    if values_out is None:
        values_out = torch.empty(n, k, dtype=logits.dtype, device=logits.device)
    if indices_out is None:
        indices_out = torch.empty(n, k, dtype=torch.long, device=logits.device)
    block_g = 128
    _group_max_kernel[(n, triton.cdiv(g, block_g))](
        logits, scratch, v, g, logits.stride(0), scratch.stride(0), S=s, BLOCK_G=block_g, num_warps=4)
    bg = triton.next_power_of_2(g)
    _select_kernel[(n,)](
        logits, scratch, values_out, indices_out, v, g, logits.stride(0), scratch.stride(0),
        values_out.stride(0), indices_out.stride(0),
        K=k, KP=max(16, triton.next_power_of_2(k)), S=s, BLOCK_G=bg, num_warps=8 if bg >= 4096 else 4)
    return values_out, indices_out


def topk_torch(logits: torch.Tensor, k: int, values_out=None, indices_out=None, scratch=None):
    """Reference: torch.topk (sorted)."""
    res = torch.topk(logits, k, dim=-1)
    if values_out is not None:
        values_out.copy_(res.values)
        indices_out.copy_(res.indices)
        return values_out, indices_out
    return res.values, res.indices
