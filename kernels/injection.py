"""Fused adjacent injection for the serving layout (`sglang_dspine.drafter.injection.AdjacentInjection.forward` is the
math; this computes the same thing).

States are flat `[bs*B, H]`: whole blocks of B rows, B a compile-time constant. For one layer l:

    φ_t  = √r · normalize(z_t),  z_t = R_l h_t
    p_t  = √r · C[anchor]   (block position 1)   |   φ_{t-1}   (positions ≥ 2)
    h_t += rms(h_t) · U_l(σ(G_r φ_t + G_p p_t + b) ⊙ M p_t)          (position 0 untouched)

Split between cuBLAS and the fused pass (why):
  1. GEMM  z = h R_lᵀ                       [N, r]   weight-bound (R_l is H×r), cuBLAS does it best. For the
     last layer the GEMM also yields uh = h U_L ([R_L; U_Lᵀ], one launch), which the transition scoring needs.
  2. GEMM  y = z [G_r; G_p; M]ᵀ             [N, 3m]  one GEMM on the *unnormalised* z: normalisation is a
     per-row scale s_t = √r / max(‖z_t‖, ε) and commutes with the linear maps, so G φ_t = s_t · (G z_t).
     The shift is applied after this GEMM: G_p p_t = s_{t-1} · (G_p z_{t-1}) for t at position ≥ 2, exact.
  3. The anchor's projection √r·C[a] [G_p; M]ᵀ is a row of the per-token table `pred_proj` [V, 2m] that the
     transition scoring uses too: the fused pass reads it by token id, no per-step GEMM.
  4. Fused kernel (`gate_message`), one program per row: ‖h_t‖ (rms), ‖z_t‖ and ‖z_{t-1}‖ (the feature
     scales), the in-block shift, the anchor's row for position 1, the gate σ(·), the product with the message
     and the rms scale; it writes msg_t = rms(h_t)·g_t ⊙ M p_t (zero on position 0) and optionally the
     receiver term G_r φ_t, which the transition scoring of the last layer reuses.
  5. GEMM  delta = msg U_lᵀ. Scaling msg by rms(h_t) *before* U_l is exact (a row scalar); position-0 rows
     have msg = 0. The caller adds delta to the state (SGLang's next fused add-RMSNorm does it for free).
No host synchronisation, no data-dependent shapes: everything is CUDA-graph capturable.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from sglang_dspine.drafter.injection import NORMALIZE_EPS, AdjacentInjection


# --------------------------------------------------------------------------------------------- weights
@dataclass
class InjectionWeights:
    """The injection weights laid out for the flat serving path (one model dtype, contiguous)."""

    readouts: list[torch.Tensor]  # R_l [r, H]
    maps: torch.Tensor  # [G_r; G_p; M] [3m, r] (shared by all layers)
    writes: list[torch.Tensor]  # U_l [H, m]
    bias: torch.Tensor  # b [m]
    last_projection: torch.Tensor  # [R_L; U_Lᵀ] [r+m, H]: z and uh of the last layer in one GEMM

    @property
    def rank(self) -> int:
        return self.maps.shape[1]

    @property
    def message_size(self) -> int:
        return self.bias.shape[0]

    @property
    def num_layers(self) -> int:
        return len(self.readouts)

    @property
    def pred_maps(self) -> torch.Tensor:
        """[G_p; M] [2m, r]: the maps applied to a predecessor."""
        return self.maps[self.message_size:]

    @classmethod
    @torch.no_grad()
    def from_module(cls, inj: AdjacentInjection, dtype: torch.dtype | None = None) -> InjectionWeights:
        dtype = dtype or inj.bias.dtype
        cvt = lambda t: t.detach().to(dtype).contiguous()  # noqa: E731
        maps = torch.cat([inj.receiver_gate.weight, inj.predecessor_gate.weight, inj.message.weight], 0)
        return cls(
            readouts=[cvt(r.weight) for r in inj.readouts],
            maps=cvt(maps),
            writes=[cvt(w.weight) for w in inj.writes],
            bias=cvt(inj.bias),
            last_projection=cvt(torch.cat([inj.readouts[-1].weight, inj.writes[-1].weight.t()], 0)),
        )


# ---------------------------------------------------------------------------------------- fused kernel
@triton.jit
def _gate_message_kernel(
    h_ptr, z_ptr, y_ptr, pp_ptr, anc_ptr, b_ptr, msg_ptr, recv_ptr,
    stride_h, stride_z, stride_y, stride_pp, stride_msg, stride_recv,
    sqrt_r, eps,
    B: tl.constexpr, H: tl.constexpr, R: tl.constexpr, M: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_M: tl.constexpr, WRITE_RECV: tl.constexpr,
):
    # One program per row, whole rows as single tiles: every load is issued before the first use, so the
    # row costs one memory latency (loops over chunks measured ~7 µs on the H200, mostly latency).
    t = tl.program_id(0).to(tl.int64)
    n = t // B
    i = t % B
    live = i > 0  # position 0 is never written: its message is 0
    first = i == 1  # predecessor = the anchor's code
    shifted = i > 1  # predecessor = feature of row t-1 (same block)
    oh = tl.arange(0, BLOCK_H)
    orr = tl.arange(0, BLOCK_R)
    o = tl.arange(0, BLOCK_M)
    om = o < M
    x = tl.load(h_ptr + t * stride_h + oh, mask=(oh < H) & live, other=0.0)
    z0 = tl.load(z_ptr + t * stride_z + orr, mask=(orr < R) & live, other=0.0)
    z1 = tl.load(z_ptr + (t - 1) * stride_z + orr, mask=(orr < R) & shifted, other=0.0)
    yr = tl.load(y_ptr + t * stride_y + o, mask=om & live, other=0.0)
    # shift after the GEMM: row t-1's G_p z and M z, scaled below by row t-1's feature scale
    yp = tl.load(y_ptr + (t - 1) * stride_y + M + o, mask=om & shifted, other=0.0)
    ym = tl.load(y_ptr + (t - 1) * stride_y + 2 * M + o, mask=om & shifted, other=0.0)
    anchor = tl.load(anc_ptr + n).to(tl.int64)  # position 1: the anchor's row of the per-token table
    ap_g = tl.load(pp_ptr + anchor * stride_pp + o, mask=om & first, other=0.0)
    ap_m = tl.load(pp_ptr + anchor * stride_pp + M + o, mask=om & first, other=0.0)
    b = tl.load(b_ptr + o, mask=om, other=0.0).to(tl.float32)

    xf = x.to(tl.float32)
    rms = tl.sqrt(tl.sum(xf * xf, 0) / H)  # rms(h_t) = ‖h_t‖ / √H
    z0f = z0.to(tl.float32)
    z1f = z1.to(tl.float32)
    s0 = sqrt_r / tl.maximum(tl.sqrt(tl.sum(z0f * z0f, 0)), eps)  # √r / max(‖z‖, ε)
    s1 = sqrt_r / tl.maximum(tl.sqrt(tl.sum(z1f * z1f, 0)), eps)
    gr = s0 * yr.to(tl.float32)
    gp = s1 * yp.to(tl.float32) + ap_g.to(tl.float32)
    mp = s1 * ym.to(tl.float32) + ap_m.to(tl.float32)
    msg = tl.where(live, tl.sigmoid(gr + gp + b) * mp * rms, 0.0)
    tl.store(msg_ptr + t * stride_msg + o, msg.to(msg_ptr.dtype.element_ty), mask=om)
    if WRITE_RECV:
        tl.store(recv_ptr + t * stride_recv + o, tl.where(live, gr, 0.0).to(recv_ptr.dtype.element_ty), mask=om)


def _check_rows(name: str, t: torch.Tensor, rows: int, cols: int) -> None:
    if t.dim() != 2 or t.shape[0] != rows or t.shape[1] != cols or t.stride(1) != 1:
        raise ValueError(f"{name}: expected a [{rows}, {cols}] tensor with contiguous rows, found "
                         f"{tuple(t.shape)} strides {t.stride()}")


def gate_message(h, z, y, anchors, pred_proj, bias, block_size: int, msg_out, recv_out=None):
    """Fused gate + message (Triton). h [N, H]; z [N, r] (= h R_lᵀ); y [N, 3m] (= z [G_r;G_p;M]ᵀ);
    anchors [bs] token ids; pred_proj [V, 2m] per-token √r·C[v][G_p; M]ᵀ; bias [m]; writes msg_out [N, m] =
    rms(h)·σ(G_r φ + G_p p + b) ⊙ M p (0 on position 0) and, if given, recv_out [N, m] = G_r φ (0 on
    position 0). N = bs·block_size. Returns msg_out."""
    n_rows, hidden = h.shape
    rank, m = z.shape[1], bias.shape[0]
    if n_rows % block_size:
        raise ValueError(f"h has {n_rows} rows, not a multiple of block_size {block_size}")
    _check_rows("h", h, n_rows, hidden)
    _check_rows("z", z, n_rows, rank)
    _check_rows("y", y, n_rows, 3 * m)
    _check_rows("pred_proj", pred_proj, pred_proj.shape[0], 2 * m)
    _check_rows("msg_out", msg_out, n_rows, m)
    if anchors.numel() != n_rows // block_size:
        raise ValueError(f"anchors: expected {n_rows // block_size}, found {anchors.numel()}")
    if recv_out is not None:
        _check_rows("recv_out", recv_out, n_rows, m)
    _gate_message_kernel[(n_rows,)](
        h, z, y, pred_proj, anchors.contiguous(), bias.contiguous(), msg_out,
        recv_out if recv_out is not None else msg_out,
        h.stride(0), z.stride(0), y.stride(0), pred_proj.stride(0), msg_out.stride(0),
        recv_out.stride(0) if recv_out is not None else 0,
        math.sqrt(rank), NORMALIZE_EPS,
        B=block_size, H=hidden, R=rank, M=m,
        BLOCK_H=triton.next_power_of_2(hidden),
        BLOCK_R=triton.next_power_of_2(rank),
        BLOCK_M=triton.next_power_of_2(m),
        WRITE_RECV=recv_out is not None,
        num_warps=4 if hidden <= 4096 else 8,
    )
    return msg_out


def gate_message_torch(h, z, y, anchors, pred_proj, bias, block_size: int, msg_out, recv_out=None):
    """PyTorch reference of `gate_message` (same signature, same outputs), computed in float32."""
    n_rows, hidden = h.shape
    bs, rank, m = n_rows // block_size, z.shape[1], bias.shape[0]
    hf = h.float().view(bs, block_size, hidden)
    rms = hf.norm(dim=-1, keepdim=True) / math.sqrt(hidden)
    zf = z.float().view(bs, block_size, rank)
    s = math.sqrt(rank) / zf.norm(dim=-1, keepdim=True).clamp_min(NORMALIZE_EPS)
    yf = y.float().view(bs, block_size, 3 * m) * s  # [G_r φ, G_p φ, M φ] of every row
    anchor_rows = pred_proj[anchors.view(-1)].float().view(bs, 1, 2 * m)
    pred = torch.cat([anchor_rows, yf[:, 1:-1, m:]], dim=1)  # shift by one
    recv = yf[:, 1:, :m]
    msg = torch.sigmoid(recv + pred[..., :m] + bias.float()) * pred[..., m:] * rms[:, 1:]
    zero = msg.new_zeros(bs, 1, m)
    msg_out.copy_(torch.cat([zero, msg], 1).view(n_rows, m))
    if recv_out is not None:
        recv_out.copy_(torch.cat([zero, recv], 1).view(n_rows, m))
    return msg_out


# ------------------------------------------------------------------------------------ one whole layer
def project(h: torch.Tensor, layer: int, w: InjectionWeights) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The cuBLAS part before the fused pass: z = h R_lᵀ, y = z [G_r;G_p;M]ᵀ and, for the last layer,
    uh = h U_L (z and uh are column views of one GEMM's output there)."""
    if layer == w.num_layers - 1:
        zu = F.linear(h, w.last_projection)
        z, uh = zu[:, : w.rank], zu[:, w.rank:]
    else:
        z, uh = F.linear(h, w.readouts[layer]), None
    return z, F.linear(z, w.maps), uh


def injection_delta(h: torch.Tensor, layer: int, w: InjectionWeights, anchors: torch.Tensor,
                    pred_proj: torch.Tensor, block_size: int, recv_out: torch.Tensor | None = None,
                    kernel: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What the injection after `layer` adds to flat states h [bs·B, H]: delta = msg U_lᵀ (GEMMs + fused pass).

    anchors [bs]; pred_proj: the per-token table `TransitionTables.pred_proj`. recv_out [bs·B, m]: optional
    G_r φ of each row (the transition scoring uses the last layer's). kernel: the Triton pass, else the
    PyTorch reference. Returns (delta, uh): uh = h U_L for the last layer, else None.
    """
    z, y, uh = project(h, layer, w)
    msg = torch.empty(h.shape[0], w.message_size, dtype=h.dtype, device=h.device)
    fn = gate_message if kernel else gate_message_torch
    fn(h, z, y, anchors, pred_proj, w.bias, block_size, msg, recv_out)
    return torch.mm(msg, w.writes[layer].t()), uh
