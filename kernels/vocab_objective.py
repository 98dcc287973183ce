"""The vocabulary-sized part of the drafter objective, one row at a time, without float32 [rows, V] tensors.

Per row, with drafter logits z and (optionally) teacher logits y over the vocabulary (any float dtype; the math
runs in float32), and the row's label c (row r's teacher is row y_index[r] of y: positions that several rows
share are computed once):
    lse_z = log Σ_j exp(z_j)              lse_y = log Σ_j exp(y_j)
    p = softmax(z) = exp(z - lse_z)       t = softmax(y) = exp(y - lse_y)
    ce    = lse_z - z_c
    l1    = Σ_j |p_j - t_j|
    amax  = argmax_j z_j                  (ties: the first index, as torch.argmax)
Gradients (g_ce, g_l1: the upstream gradients of row's ce and l1), with s = sign(p - t), sign(0) = 0
(what autograd's |·| gives at 0), and S = Σ_k p_k s_k saved by the forward:
    dz_j = g_ce (p_j - [j = c]) + g_l1 p_j (s_j - S)
y gets no gradient (the teacher is frozen). lse_y is returned so the caller can read the teacher's probability
of any token as exp(y_j - lse_y) without materialising t.

The forward streams the row in vocabulary tiles twice (online max / log-sum-exp and argmax, then L1 and S), the
backward once (one program per row and tile), writing dz in z's dtype: the GEMM that made z takes its gradient
in that dtype anyway. `vocab_loss_torch` is the same math in plain PyTorch (float32 [rows, V] temporaries), the
CPU path and the reference of the tests; `vocab_loss` runs either behind one autograd Function.
Labels must lie in [0, V) (the kernel masks the load, so an out-of-range label gives a wrong CE, not a fault).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .runtime import runs_on


def launch_settings(v: int, block_v: int | None = None) -> tuple[int, int]:
    """(vocabulary tile, warps): 4096-wide tiles at 8 warps for large vocabularies (16 elements per thread and
    tensor, 37 tiles at V = 151936); block_v forces a tile (a power of two; the tests use small ones)."""
    if block_v is None:
        block_v = min(4096, triton.next_power_of_2(v))
    if block_v & (block_v - 1) or block_v < 16:
        raise ValueError(f"vocab_loss: block_v={block_v} must be a power of two >= 16")
    return block_v, 8 if block_v >= 2048 else 4


@triton.jit
def _fwd_kernel(z_ptr, y_ptr, yidx_ptr, lab_ptr, ce_ptr, l1_ptr, lsez_ptr, lsey_ptr, ssum_ptr, amax_ptr,
                V, stride_z, stride_y, HAS_Y: tl.constexpr, WANT_L1: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    zrow = z_ptr + row * stride_z
    yrow = y_ptr
    if HAS_Y:
        yrow = y_ptr + tl.load(yidx_ptr + row) * stride_y
    mz = float("-inf")
    sz = 0.0
    amax = 0
    my = float("-inf")
    sy = 0.0
    for start in range(0, V, BLOCK):
        offs = start + cols
        ok = offs < V
        z = tl.load(zrow + offs, mask=ok, other=float("-inf")).to(tl.float32)
        tmax, targ = tl.max(z, 0, return_indices=True, return_indices_tie_break_left=True)
        amax = tl.where(tmax > mz, start + targ, amax)  # strict: an equal later maximum keeps the first index
        mnew = tl.maximum(mz, tmax)
        sz = sz * tl.exp(mz - mnew) + tl.sum(tl.exp(z - mnew), 0)
        mz = mnew
        if HAS_Y:
            y = tl.load(yrow + offs, mask=ok, other=float("-inf")).to(tl.float32)
            mnew_y = tl.maximum(my, tl.max(y, 0))
            sy = sy * tl.exp(my - mnew_y) + tl.sum(tl.exp(y - mnew_y), 0)
            my = mnew_y
    lse_z = mz + tl.log(sz)
    lab = tl.load(lab_ptr + row)
    zl = tl.load(zrow + lab, mask=(lab >= 0) & (lab < V), other=0.0).to(tl.float32)
    tl.store(ce_ptr + row, lse_z - zl)
    tl.store(lsez_ptr + row, lse_z)
    tl.store(amax_ptr + row, amax.to(tl.int64))
    if HAS_Y:
        lse_y = my + tl.log(sy)
        tl.store(lsey_ptr + row, lse_y)
        if WANT_L1:
            l1 = tl.zeros([BLOCK], tl.float32)
            ps = tl.zeros([BLOCK], tl.float32)
            for start in range(0, V, BLOCK):
                offs = start + cols
                ok = offs < V
                z = tl.load(zrow + offs, mask=ok, other=float("-inf")).to(tl.float32)
                y = tl.load(yrow + offs, mask=ok, other=float("-inf")).to(tl.float32)
                p = tl.exp(z - lse_z)
                d = p - tl.exp(y - lse_y)
                l1 += tl.abs(d)
                ps += tl.where(d > 0, p, tl.where(d < 0, -p, 0.0))
            tl.store(l1_ptr + row, tl.sum(l1, 0))
            tl.store(ssum_ptr + row, tl.sum(ps, 0))


@triton.jit
def _bwd_kernel(z_ptr, y_ptr, yidx_ptr, lab_ptr, lsez_ptr, lsey_ptr, ssum_ptr, gce_ptr, gl1_ptr, dz_ptr,
                V, stride_z, stride_y, stride_dz, HAS_L1: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < V
    z = tl.load(z_ptr + row * stride_z + offs, mask=ok, other=float("-inf")).to(tl.float32)
    p = tl.exp(z - tl.load(lsez_ptr + row))
    lab = tl.load(lab_ptr + row)
    dz = tl.load(gce_ptr + row) * (p - tl.where(offs == lab, 1.0, 0.0))
    if HAS_L1:
        y = tl.load(y_ptr + tl.load(yidx_ptr + row) * stride_y + offs, mask=ok, other=float("-inf")).to(tl.float32)
        d = p - tl.exp(y - tl.load(lsey_ptr + row))
        s = tl.where(d > 0, 1.0, tl.where(d < 0, -1.0, 0.0))
        dz += tl.load(gl1_ptr + row) * p * (s - tl.load(ssum_ptr + row))
    tl.store(dz_ptr + row * stride_dz + offs, dz.to(dz_ptr.dtype.element_ty), mask=ok)


def _check(z, labels, y, y_index):
    if z.dim() != 2 or z.stride(-1) != 1:
        raise ValueError(f"vocab_loss: z must be [rows, V] with a contiguous last axis, got {tuple(z.shape)}")
    if labels.shape != z.shape[:1] or labels.dtype != torch.long:
        raise ValueError(f"vocab_loss: labels must be int64 [{z.shape[0]}], got {labels.dtype} {tuple(labels.shape)}")
    if y is None:
        if y_index is not None:
            raise ValueError("vocab_loss: y_index without y")
        return
    if y.dim() != 2 or y.shape[1] != z.shape[1] or y.stride(-1) != 1 or y.device != z.device:
        raise ValueError(f"vocab_loss: y must be [R, V={z.shape[1]}] on {z.device} with a contiguous last axis, "
                         f"got {tuple(y.shape)} on {y.device}")
    if y_index is None and y.shape[0] != z.shape[0]:
        raise ValueError(f"vocab_loss: y has {y.shape[0]} rows, z {z.shape[0]}: give y_index")
    if y_index is not None and (y_index.shape != z.shape[:1] or y_index.dtype != torch.long):
        raise ValueError(f"vocab_loss: y_index must be int64 [{z.shape[0]}], got {y_index.dtype} "
                         f"{tuple(y_index.shape)}")


def _fwd_triton(z, labels, y, y_index, want_l1, block_v):
    n, v = z.shape
    block, warps = launch_settings(v, block_v)
    f32 = dict(dtype=torch.float32, device=z.device)
    ce, lse_z = torch.empty(n, **f32), torch.empty(n, **f32)
    amax = torch.empty(n, dtype=torch.long, device=z.device)
    has_y = y is not None
    lse_y = torch.empty(n, **f32) if has_y else None
    l1 = torch.empty(n, **f32) if has_y and want_l1 else None
    ssum = torch.empty(n, **f32) if has_y and want_l1 else None
    dummy = ce  # pointers of the outputs a variant does not write
    _fwd_kernel[(n,)](z, y if has_y else z, y_index if has_y else labels, labels, ce,
                      l1 if l1 is not None else dummy, lse_z, lse_y if has_y else dummy,
                      ssum if ssum is not None else dummy, amax, v, z.stride(0), (y if has_y else z).stride(0),
                      HAS_Y=has_y, WANT_L1=has_y and want_l1, BLOCK=block, num_warps=warps)
    return ce, l1, lse_z, lse_y, ssum, amax


def _bwd_triton(z, labels, y, y_index, lse_z, lse_y, ssum, g_ce, g_l1, block_v):
    n, v = z.shape
    block, warps = launch_settings(v, block_v)
    dz = torch.empty_like(z)
    has_l1 = g_l1 is not None
    _bwd_kernel[(n, triton.cdiv(v, block))](
        z, y if has_l1 else z, y_index if has_l1 else labels, labels, lse_z, lse_y if has_l1 else lse_z,
        ssum if has_l1 else lse_z, g_ce, g_l1 if has_l1 else g_ce, dz, v, z.stride(0),
        (y if has_l1 else z).stride(0), dz.stride(0), HAS_L1=has_l1, BLOCK=block, num_warps=warps)
    return dz


def _fwd_torch(z, labels, y, y_index, want_l1, block_v=None):
    zf = z.float()
    lse_z = zf.logsumexp(-1)
    ce = lse_z - zf.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    amax = zf.argmax(-1)
    lse_y = l1 = ssum = None
    if y is not None:
        yf = y.index_select(0, y_index).float()
        lse_y = yf.logsumexp(-1)
        if want_l1:
            p = (zf - lse_z.unsqueeze(-1)).exp()
            d = p - (yf - lse_y.unsqueeze(-1)).exp()
            l1 = d.abs().sum(-1)
            ssum = (p * d.sign()).sum(-1)
    return ce, l1, lse_z, lse_y, ssum, amax


def _bwd_torch(z, labels, y, y_index, lse_z, lse_y, ssum, g_ce, g_l1, block_v=None):
    p = (z.float() - lse_z.unsqueeze(-1)).exp()
    dz = g_ce.unsqueeze(-1) * p
    dz.scatter_add_(-1, labels.unsqueeze(-1), -g_ce.unsqueeze(-1))
    if g_l1 is not None:
        s = (p - (y.index_select(0, y_index).float() - lse_y.unsqueeze(-1)).exp()).sign()
        dz += g_l1.unsqueeze(-1) * p * (s - ssum.unsqueeze(-1))
    return dz.to(z.dtype)


class _VocabLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z, labels, y, y_index, want_l1, kernel, block_v):
        fwd = _fwd_triton if kernel else _fwd_torch
        with torch.autocast(z.device.type, enabled=False):  # float32 math whatever the caller's autocast
            ce, l1, lse_z, lse_y, ssum, amax = fwd(z, labels, y, y_index, want_l1, block_v)
        ctx.set_materialize_grads(False)  # an unused l1 (or ce) brings None: its term is skipped
        ctx.save_for_backward(z, labels, y, y_index, lse_z, lse_y, ssum)
        ctx.kernel, ctx.block_v = kernel, block_v
        ctx.mark_non_differentiable(amax, *([lse_y] if lse_y is not None else []))
        return ce, l1, lse_y, amax

    @staticmethod
    def backward(ctx, g_ce, g_l1, _g_lse_y, _g_amax):
        z, labels, y, y_index, lse_z, lse_y, ssum = ctx.saved_tensors
        if g_ce is None:
            g_ce = torch.zeros_like(lse_z)
        g_ce = g_ce.float().contiguous()
        if g_l1 is not None:
            g_l1 = g_l1.float().contiguous()
        bwd = _bwd_triton if ctx.kernel else _bwd_torch
        with torch.autocast(z.device.type, enabled=False):
            dz = bwd(z, labels, y, y_index, lse_z, lse_y, ssum, g_ce, g_l1 if ssum is not None else None,
                     ctx.block_v)
        return dz, None, None, None, None, None, None


def vocab_loss(z: torch.Tensor, labels: torch.Tensor, y: torch.Tensor | None = None,
               y_index: torch.Tensor | None = None, *, l1: bool = True, kernel: bool, block_v: int | None = None):
    """Per-row (ce [N], l1 [N] or None, lse_y [N] or None, argmax [N] int64) of z [N, V] (the formulas above).
    y: teacher logits (no gradient) [N, V], or [R, V] with y_index [N] (row r's teacher is y[y_index[r]],
    indices in [0, R)), or None (then l1 and lse_y are None); l1=False skips the L1 pass (lse_y is still
    returned). kernel: True runs the Triton kernels (CUDA, or Triton's interpreter), False the PyTorch math;
    the caller decides by device. ce and l1 are differentiable in z, float32."""
    _check(z, labels, y, y_index)
    if kernel and not runs_on(z.device):
        raise ValueError(f"vocab_loss: the Triton kernels need CUDA tensors (z is on {z.device}); "
                         "run the PyTorch math (kernel=False) there")
    if y is not None:
        y = y.detach()
        if y_index is None:
            y_index = torch.arange(z.shape[0], device=z.device)
    return _VocabLoss.apply(z, labels, y, y_index, bool(l1 and y is not None), kernel, block_v)


def vocab_loss_torch(z, labels, y=None, y_index=None, *, l1: bool = True, block_v: int | None = None):
    """The PyTorch math of `vocab_loss` (same outputs and gradients)."""
    return vocab_loss(z, labels, y, y_index, l1=l1, kernel=False, block_v=block_v)
