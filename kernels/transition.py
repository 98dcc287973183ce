"""Fused transition scoring + walk (DESIGN.md §1, §3; `sglang_dspine.decoding.decode_block` is the math).

For request n, block position i (1..B-1, index p = i-1 here), predecessor candidate k and candidate j:

    S[k, j] = norm(h̃ + ρ U msg_k) · W_j,   msg_k = σ(G_r φ(h̃) + G_p p_k + b) ⊙ M p_k,   p_k = √r C[a_k]

(h̃ the last layer's pre-injection state, ρ = rms(h̃), U = U_L, norm = the final RMSNorm with weight w).
Materialising the K refined states per position costs a [bs·P·K, m]×[m, H] GEMM (48 GFLOP at bs 48) and
their dots with the candidates' head rows. Instead we expand it exactly:

    numerator    (w⊙h̃)·W_j + ρ · msg_k·Q_j,          Q_j = Uᵀ(w⊙W_j)       (m numbers per token)
    denominator  ν_k = sqrt((‖h̃‖² + 2ρ (Uᵀh̃)·msg_k + ρ² ‖R msg_k‖²)/H + ε),   U = Q_U R (QR; ‖U x‖ = ‖R x‖)

so per position the kernel touches K head rows (the only H-sized reads), K rows of m-sized tables, and
does K×K×m + K·m² multiply-adds; R is upper triangular, so half of the m² term is skipped.

Split between GEMMs and kernels:
  * once per model (`TransitionTables.build`): pred_proj[v] = √r C[v][G_p; M]ᵀ  [V, 2m],
    head_proj[v] = (W_v⊙w) U_L  [V, m], and rfac = Rᵀ [m, m]. Gathering rows by token id is far cheaper than
    GEMMs on gathered codes/head rows per step. Without the per-token tables (`per_token=False`) the same
    rows are computed per step by GEMMs on the gathered candidates (memory-lean, slower).
  * per step, cuBLAS: uh = h̃ U_L [bs, P, m]; recv = G_r φ_L(h̃) comes from the last layer's injection
    (`inject_flat(recv_out=...)`), or is recomputed from h̃ by two small GEMMs.
  * "split" variant (default), three launches:
      1. `_position_kernel`, one program per (request, position), every load issued up front and the K head
         rows streamed with a prefetch: msg_k (written), a_j, ‖h̃‖², t1_k and c = msg·Qᵀ (tensor cores);
         it writes the numerators a_j + ρ c_kj into the score table;
      2. cuBLAS X = msg · rfac over all bs·P·K rows: the K·m² term as one GEMM, rfac read once;
      3. `_finish_walk_kernel`, one program per request: ν_k from ‖X_k‖², the table S = numerator / ν_k, and
         the walk on the rows while they are in registers (the next position's inputs already in flight).
  * "fused" variant: one kernel per (request, PB positions) computing ‖R msg‖² itself on tensor cores (rfac
    re-read per program from L2) + a walk kernel. Measured slower on the H200 (latency-bound loops); kept
    as the measured alternative.
No host synchronisation, fixed shapes: CUDA-graph capturable.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from sglang_dspine.decoding import predecessor_tokens, walk  # the references the kernels reproduce
from sglang_dspine.injection import NORMALIZE_EPS

from .injection import InjectionWeights, anchor_projections


# ------------------------------------------------------------------------------------------- tables
@dataclass
class TransitionTables:
    rfac: torch.Tensor  # [m, m] Rᵀ with U_L = Q R: ‖U_L x‖ = ‖x rfac‖ (lower triangular)
    pred_proj: torch.Tensor | None = None  # [V, 2m] √r·C[v] [G_p; M]ᵀ
    head_proj: torch.Tensor | None = None  # [V, m] (W_v ⊙ w) U_L

    @classmethod
    @torch.no_grad()
    def build(cls, w: InjectionWeights, codes: torch.Tensor, head: torch.Tensor, norm_weight: torch.Tensor,
              per_token: bool = True, chunk: int = 16384) -> "TransitionTables":
        dtype = w.maps.dtype
        u = w.writes[-1].double() if w.writes[-1].device.type == "cpu" else w.writes[-1].float()
        r = torch.linalg.qr(u, mode="r").R  # [m, m] upper triangular
        rfac = r.t().to(dtype).contiguous()
        if not per_token:
            return cls(rfac=rfac)
        v = codes.shape[0]
        pred_proj = torch.empty(v, 2 * w.message_size, dtype=dtype, device=codes.device)
        head_proj = torch.empty(v, w.message_size, dtype=dtype, device=codes.device)
        sqrt_r = math.sqrt(w.rank)
        pm, uf, nw = w.pred_maps.float(), w.writes[-1].float(), norm_weight.float()
        for s in range(0, v, chunk):
            e = min(v, s + chunk)
            pred_proj[s:e] = (sqrt_r * codes[s:e].float()) @ pm.t()
            head_proj[s:e] = (head[s:e].float() * nw) @ uf
        return cls(rfac=rfac, pred_proj=pred_proj, head_proj=head_proj)

    @property
    def per_token(self) -> bool:
        return self.pred_proj is not None


# ------------------------------------------------------------------------------------------- kernels
@triton.jit
def _message(recv_rows, pp_rows, b_ptr, cols, valid, M: tl.constexpr):
    """msg = σ(recv + G_p p + b) ⊙ M p for a tile of rows: recv_rows / pp_rows are [R] row pointers."""
    mask = valid[:, None] & (cols[None, :] < M)
    gr = tl.load(recv_rows[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    gp = tl.load(pp_rows[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    mp = tl.load(pp_rows[:, None] + M + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + cols, mask=cols < M, other=0.0).to(tl.float32)
    return tl.sigmoid(gr + gp + b[None, :]) * mp


@triton.jit
def _score_kernel(
    pre_ptr, recv_ptr, uh_ptr, cand_ptr, anc_ptr, pp_ptr, hp_ptr, head_ptr, w_ptr, b_ptr, rf_ptr,
    s_ptr, ch_ptr, tok_ptr,
    s_pre_n, s_pre_p, s_recv_n, s_recv_p, s_uh_n, s_uh_p, s_head, s_pp, s_hp,
    norm_eps,
    P: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, H: tl.constexpr, M: tl.constexpr, PB: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, CW: tl.constexpr,
    BY_TOKEN: tl.constexpr, FUSE_WALK: tl.constexpr, DOT_DT: tl.constexpr, DOT_PREC: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    i0 = tl.program_id(1) * PB
    anchor = tl.load(anc_ptr + n)
    kk = tl.arange(0, KP)
    kmask = kk < K

    # ---- ‖R msg‖² for the PB·KP rows (position, predecessor k) of this program
    RP: tl.constexpr = PB * KP
    rr = tl.arange(0, RP)
    rpos = i0 + rr // KP
    rk = rr % KP
    rvalid = (rpos < P) & (rk < K)
    rtok = tl.load(cand_ptr + (n * P + rpos - 1) * K + rk, mask=rvalid & (rpos > 0), other=0)
    rtok = tl.where(rpos == 0, anchor, rtok)
    if BY_TOKEN:
        prow = rtok.to(tl.int64)
    else:
        prow = (n * P + rpos) * K + rk
    recv_rows = recv_ptr + n * s_recv_n + rpos * s_recv_p
    pp_rows = pp_ptr + prow * s_pp
    # column passes of width CW: msg is computed once per (pass, k-block); rfac = Rᵀ is lower triangular,
    # so pass cp only needs k-blocks from its first column on.
    MP: tl.constexpr = (M + CW - 1) // CW * CW  # m padded to whole passes (masked)
    NQ: tl.constexpr = MP // BLOCK_Q
    t2 = tl.zeros([RP], tl.float32)
    for c0 in range(0, MP, CW):
        cols = c0 + tl.arange(0, CW)
        acc = tl.zeros([RP, CW], tl.float32)
        for kb in range(c0 // BLOCK_Q, NQ):
            ks = kb * BLOCK_Q + tl.arange(0, BLOCK_Q)
            msg = _message(recv_rows, pp_rows, b_ptr, ks, rvalid, M)
            lt = tl.load(rf_ptr + ks[:, None] * M + cols[None, :], mask=(ks[:, None] < M) & (cols[None, :] < M),
                         other=0.0)
            acc += tl.dot(msg.to(DOT_DT), lt.to(DOT_DT), input_precision=DOT_PREC)
        t2 += tl.sum(acc * acc, 1)
    t2 = tl.reshape(t2, (PB, KP))
    sel = tl.arange(0, PB)

    # ---- per position: head-row dots, msg·Q dots, the K×K table (and the walk)
    prev = tl.zeros([], tl.int32)
    for pp in range(0, PB):
        i = i0 + pp
        pvalid = i < P
        jm = kmask & pvalid
        tok = tl.load(cand_ptr + (n * P + i) * K + kk, mask=jm, other=0)
        ptok = tl.load(cand_ptr + (n * P + i - 1) * K + kk, mask=jm & (i > 0), other=0)
        ptok = tl.where(i == 0, anchor, ptok)

        # a_j = (w⊙h̃)·W_j and ‖h̃‖²
        a = tl.zeros([KP], tl.float32)
        ssv = tl.zeros([BLOCK_H], tl.float32)
        for c in range(0, H, BLOCK_H):
            o = c + tl.arange(0, BLOCK_H)
            om = o < H
            x = tl.load(pre_ptr + n * s_pre_n + i * s_pre_p + o, mask=om & pvalid, other=0.0).to(tl.float32)
            wv = tl.load(w_ptr + o, mask=om, other=0.0).to(tl.float32)
            ssv += x * x
            rows = tl.load(head_ptr + tok.to(tl.int64)[:, None] * s_head + o[None, :],
                           mask=jm[:, None] & om[None, :], other=0.0).to(tl.float32)
            a += tl.sum(rows * (x * wv)[None, :], 1)
        ss = tl.sum(ssv, 0)

        # c[k, j] = msg_k·Q_j and t1_k = msg_k·(Uᵀh̃)
        if BY_TOKEN:
            prow_i = ptok.to(tl.int64)
            qrow = tok.to(tl.int64)
        else:
            prow_i = (n * P + i) * K + kk
            qrow = prow_i
        rec_i = recv_ptr + n * s_recv_n + i * s_recv_p + kk * 0
        cmat = tl.zeros([KP, KP], tl.float32)
        t1 = tl.zeros([KP], tl.float32)
        for c in range(0, M, BLOCK_M):
            cols = c + tl.arange(0, BLOCK_M)
            cm = cols < M
            msg = _message(rec_i, pp_ptr + prow_i * s_pp, b_ptr, cols, jm, M)
            q = tl.load(hp_ptr + qrow[:, None] * s_hp + cols[None, :], mask=jm[:, None] & cm[None, :], other=0.0)
            u = tl.load(uh_ptr + n * s_uh_n + i * s_uh_p + cols, mask=cm & pvalid, other=0.0).to(tl.float32)
            t1 += tl.sum(msg * u[None, :], 1)
            cmat += tl.dot(msg.to(DOT_DT), tl.trans(q.to(DOT_DT)), input_precision=DOT_PREC)
        t2p = tl.sum(tl.where((sel == pp)[:, None], t2, 0.0), 0)

        rho = tl.sqrt(ss / H)
        nu = tl.sqrt((ss + 2.0 * rho * t1 + rho * rho * t2p) / H + norm_eps)
        scores = (a[None, :] + rho * cmat) / nu[:, None]
        smask = jm[:, None] & kmask[None, :]
        tl.store(s_ptr + ((n * P + i) * K + kk[:, None]) * K + kk[None, :], scores, mask=smask)

        if FUSE_WALK:
            row = tl.sum(tl.where(kk[:, None] == prev, scores, 0.0), 0)
            row = tl.where(kmask, row, float("-inf"))
            pick = tl.argmax(row, 0).to(tl.int32)
            prev = tl.where(pvalid, pick, prev)
            t_pick = tl.sum(tl.where(kk == pick, tok, 0), 0)
            tl.store(ch_ptr + n * P + i, pick.to(ch_ptr.dtype.element_ty), mask=pvalid)
            tl.store(tok_ptr + n * P + i, t_pick.to(tok_ptr.dtype.element_ty), mask=pvalid)


@triton.jit
def _walk_kernel(s_ptr, cand_ptr, ch_ptr, tok_ptr, P: tl.constexpr, K: tl.constexpr, KP: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    kk = tl.arange(0, KP)
    prev = tl.zeros([], tl.int32)
    for i in range(0, P):
        row = tl.load(s_ptr + ((n * P + i) * K + prev) * K + kk, mask=kk < K, other=float("-inf"))
        prev = tl.argmax(row, 0).to(tl.int32)
        tok = tl.load(cand_ptr + (n * P + i) * K + prev)
        tl.store(ch_ptr + n * P + i, prev.to(ch_ptr.dtype.element_ty))
        tl.store(tok_ptr + n * P + i, tok.to(tok_ptr.dtype.element_ty))


@triton.jit
def _position_kernel(
    pre_ptr, recv_ptr, uh_ptr, cand_ptr, anc_ptr, pp_ptr, hp_ptr, head_ptr, w_ptr, b_ptr,
    msg_ptr, num_ptr, base_ptr, rho_ptr,
    s_pre_n, s_pre_p, s_recv_n, s_recv_p, s_uh_n, s_uh_p, s_head, s_pp, s_hp,
    P: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, H: tl.constexpr, M: tl.constexpr, MB: tl.constexpr,
    MCH: tl.constexpr, BLOCK_H: tl.constexpr, BY_TOKEN: tl.constexpr, DOT_DT: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """Split variant, one program per (request, position): every load is issued before its first use (one
    memory latency, not one per loop step), the head rows stream with a one-chunk prefetch. Writes msg_k
    (for the ‖R msg_k‖² GEMM), the numerators a_j + ρ c_kj (into the score table), ‖h̃‖² + 2ρ t1_k and ρ."""
    pid = tl.program_id(0).to(tl.int64)  # n * P + i
    n = pid // P
    i = pid % P
    kk = tl.arange(0, KP)
    km = kk < K
    tok = tl.load(cand_ptr + pid * K + kk, mask=km, other=0)
    ptok = tl.load(cand_ptr + (pid - 1) * K + kk, mask=km & (i > 0), other=0)
    ptok = tl.where(i == 0, tl.load(anc_ptr + n), ptok)
    if BY_TOKEN:
        prow = ptok.to(tl.int64)
        qrow = tok.to(tl.int64)
    else:
        prow = pid * K + kk
        qrow = prow

    # the head rows are the bulk of the bytes: start streaming them first
    oh = tl.arange(0, BLOCK_H)
    hrows = head_ptr + tok.to(tl.int64)[:, None] * s_head
    rows = tl.load(hrows + oh[None, :], mask=km[:, None] & (oh[None, :] < H), other=0.0)

    # messages, in column chunks of MCH (a register-pressure knob; MCH = MB: one chunk, one latency)
    cmat = tl.zeros([KP, KP], tl.float32)
    t1 = tl.zeros([KP], tl.float32)
    for c0 in range(0, MB, MCH):
        cols = c0 + tl.arange(0, MCH)
        cm = cols < M
        mm = km[:, None] & cm[None, :]
        gp = tl.load(pp_ptr + prow[:, None] * s_pp + cols[None, :], mask=mm, other=0.0).to(tl.float32)
        mp = tl.load(pp_ptr + prow[:, None] * s_pp + M + cols[None, :], mask=mm, other=0.0).to(tl.float32)
        q = tl.load(hp_ptr + qrow[:, None] * s_hp + cols[None, :], mask=mm, other=0.0)
        gr = tl.load(recv_ptr + n * s_recv_n + i * s_recv_p + cols, mask=cm, other=0.0).to(tl.float32)
        u = tl.load(uh_ptr + n * s_uh_n + i * s_uh_p + cols, mask=cm, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + cols, mask=cm, other=0.0).to(tl.float32)
        msg = tl.where(mm, tl.sigmoid(gr[None, :] + gp + b[None, :]) * mp, 0.0)
        msg_lp = msg.to(msg_ptr.dtype.element_ty)
        tl.store(msg_ptr + (pid * K + kk)[:, None] * M + cols[None, :], msg_lp, mask=mm)
        t1 += tl.sum(msg * u[None, :], 1)
        cmat += tl.dot(msg_lp.to(DOT_DT), tl.trans(q.to(DOT_DT)), input_precision=DOT_PREC)  # [KP, KP]

    # a_j = (w⊙h̃)·W_j and ‖h̃‖², next chunk prefetched while this one is reduced
    a = tl.zeros([KP], tl.float32)
    ssv = tl.zeros([BLOCK_H], tl.float32)
    for c0 in range(0, H, BLOCK_H):
        o = c0 + oh
        x = tl.load(pre_ptr + n * s_pre_n + i * s_pre_p + o, mask=o < H, other=0.0).to(tl.float32)
        wv = tl.load(w_ptr + o, mask=o < H, other=0.0).to(tl.float32)
        nxt = o + BLOCK_H
        rows_next = tl.load(hrows + nxt[None, :], mask=km[:, None] & (nxt[None, :] < H), other=0.0)
        ssv += x * x
        a += tl.sum(rows.to(tl.float32) * (x * wv)[None, :], 1)
        rows = rows_next
    ss = tl.sum(ssv, 0)
    rho = tl.sqrt(ss / H)
    num = a[None, :] + rho * cmat
    tl.store(num_ptr + (pid * K + kk[:, None]) * K + kk[None, :], num, mask=km[:, None] & km[None, :])
    tl.store(base_ptr + pid * K + kk, ss + 2.0 * rho * t1, mask=km)
    tl.store(rho_ptr + pid, rho)


@triton.jit
def _finish_walk_kernel(
    x_ptr, num_ptr, base_ptr, rho_ptr, cand_ptr, s_ptr, ch_ptr, tok_ptr, norm_eps,
    P: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, H: tl.constexpr, M: tl.constexpr, MB: tl.constexpr,
):
    """Split variant, one program per request: ν_k from ‖R msg_k‖² (rows of X = msg·Rᵀ), the table
    S = numerator / ν (written in place of the numerators), and the walk on the rows held in registers.
    The next position's inputs are loaded before this position is finished."""
    n = tl.program_id(0).to(tl.int64)
    kk = tl.arange(0, KP)
    km = kk < K
    cols = tl.arange(0, MB)
    mm = km[:, None] & (cols[None, :] < M)
    tm = km[:, None] & km[None, :]
    r0 = n * P
    xt = tl.load(x_ptr + (r0 * K + kk)[:, None] * M + cols[None, :], mask=mm, other=0.0)
    num = tl.load(num_ptr + (r0 * K + kk[:, None]) * K + kk[None, :], mask=tm, other=0.0)
    base = tl.load(base_ptr + r0 * K + kk, mask=km, other=0.0)
    rho = tl.load(rho_ptr + r0)
    tok = tl.load(cand_ptr + r0 * K + kk, mask=km, other=0)
    prev = tl.zeros([], tl.int32)
    for i in range(0, P):
        row = n * P + i
        nx = row + 1
        ok = i + 1 < P
        xt_n = tl.load(x_ptr + (nx * K + kk)[:, None] * M + cols[None, :], mask=mm & ok, other=0.0)
        num_n = tl.load(num_ptr + (nx * K + kk[:, None]) * K + kk[None, :], mask=tm & ok, other=0.0)
        base_n = tl.load(base_ptr + nx * K + kk, mask=km & ok, other=0.0)
        rho_n = tl.load(rho_ptr + nx, mask=ok, other=0.0)
        tok_n = tl.load(cand_ptr + nx * K + kk, mask=km & ok, other=0)

        xf = xt.to(tl.float32)
        t2 = tl.sum(xf * xf, 1)
        nu = tl.sqrt((base + rho * rho * t2) / H + norm_eps)
        scores = num / nu[:, None]
        tl.store(s_ptr + (row * K + kk[:, None]) * K + kk[None, :], scores, mask=tm)
        r = tl.sum(tl.where(kk[:, None] == prev, scores, 0.0), 0)
        prev = tl.argmax(tl.where(km, r, float("-inf")), 0).to(tl.int32)
        pick = tl.sum(tl.where(kk == prev, tok, 0), 0)
        tl.store(ch_ptr + row, prev.to(ch_ptr.dtype.element_ty))
        tl.store(tok_ptr + row, pick.to(tok_ptr.dtype.element_ty))
        xt, num, base, rho, tok = xt_n, num_n, base_n, rho_n, tok_n


def _interpreting() -> bool:
    return triton.knobs.runtime.interpret


# positions per program -> (BLOCK_H, BLOCK_M, BLOCK_Q, CW, num_warps): chosen from ptxas's register report
# for H=4096, m=512 (scripts/kernels_compile_check.py): no spills up to 8, ~130 registers up to 4.
_SCORE_CONFIGS = {
    1: (256, 32, 32, 256, 4),
    2: (256, 32, 32, 128, 4),
    4: (256, 32, 32, 128, 8),
    8: (512, 32, 32, 128, 8),
    16: (256, 32, 32, 64, 8),
}


# Positions per program of the fused variant. One was fastest (or within 5%) at bs 1, 8, 32, 48 on the H200:
# the per-program latency, not the rfac re-reads, bounds it (benchmarks/results/kernels.json).
DEFAULT_POSITIONS_PER_PROGRAM = 1


# split variant: (BLOCK_H, message column chunk, num_warps) of the per-position kernel
SPLIT_CONFIG = (512, 512, 8)


def transition_scores_walk(pre, recv, uh, cand, anchors, pred_proj, head_proj, head, norm_weight, bias, rfac,
                           norm_eps: float, scores_out, choice_out, tokens_out, by_token: bool = True,
                           positions_per_program: int | None = None, variant: str = "split",
                           split_config: tuple[int, int, int] | None = None):
    """K×K transition scores + walk (Triton).

    variant "split" (default): per-position kernel → one GEMM X = msg·rfac for all ‖R msg‖² terms (rfac read
    once) → per-request finish + walk kernel. "fused": one kernel doing the ‖R msg‖² term on tensor cores
    per program (positions_per_program positions share the rfac reads), plus a walk kernel if needed.

    pre [bs, P, H] last-layer pre-injection states of positions 1..P (rows contiguous, any batch strides);
    recv [bs, P, m] G_r φ_L(pre); uh [bs, P, m] pre U_L; cand [bs, P, K] candidate ids; anchors [bs];
    by_token: pred_proj [V, 2m] and head_proj [V, m] indexed by token id; else pred_proj [bs, P, K, 2m]
    (rows of the predecessors of each (n, p, k)) and head_proj [bs, P, K, m] (rows of cand[n, p, j]);
    head [V, H]; norm_weight [H]; bias [m]; rfac [m, m].
    Writes scores_out [bs, P, K, K] fp32, choice_out [bs, P], tokens_out [bs, P]. Returns the three.
    """
    bs, npos, hidden = pre.shape
    k = cand.shape[-1]
    m = bias.shape[0]
    for name, t, shape in (("recv", recv, (bs, npos, m)), ("uh", uh, (bs, npos, m)), ("cand", cand, (bs, npos, k))):
        if tuple(t.shape) != shape or t.stride(-1) != 1:
            raise ValueError(f"{name}: expected {shape} with a contiguous last axis, found {tuple(t.shape)} {t.stride()}")
    if pre.stride(-1) != 1:
        raise ValueError("pre: last axis must be contiguous")
    cand = cand.contiguous()
    if not by_token:
        pred_proj = pred_proj.reshape(bs * npos * k, 2 * m)
        head_proj = head_proj.reshape(bs * npos * k, m)
    kp = max(16, triton.next_power_of_2(k))
    if _interpreting() or rfac.dtype == torch.float32:
        # fp32 operands: exact ("ieee") products; the interpreter also needs fp32 (its bf16 dot is wrong)
        dot_dt, prec = tl.float32, "ieee"
    else:
        dot_dt, prec = (tl.bfloat16 if rfac.dtype == torch.bfloat16 else tl.float16), "tf32"
    if variant == "split":
        rows = bs * npos * k
        msg = torch.empty(rows, m, dtype=rfac.dtype, device=pre.device)
        base = torch.empty(rows, dtype=torch.float32, device=pre.device)
        rho = torch.empty(bs * npos, dtype=torch.float32, device=pre.device)
        mb = max(16, triton.next_power_of_2(m))  # a tensor-core tile needs 16 (masked)
        block_h, mch, warps = split_config or SPLIT_CONFIG
        _position_kernel[(bs * npos,)](
            pre, recv, uh, cand, anchors.contiguous(), pred_proj, head_proj, head, norm_weight, bias,
            msg, scores_out, base, rho,
            pre.stride(0), pre.stride(1), recv.stride(0), recv.stride(1), uh.stride(0), uh.stride(1),
            head.stride(0), pred_proj.stride(0), head_proj.stride(0),
            P=npos, K=k, KP=kp, H=hidden, M=m, MB=mb, MCH=max(16, min(mch, mb)),
            BLOCK_H=min(block_h, triton.next_power_of_2(hidden)),
            BY_TOKEN=by_token, DOT_DT=dot_dt, DOT_PREC=prec, num_warps=warps,
        )
        x = torch.mm(msg, rfac)  # R msg_k for every row: one GEMM, rfac read once
        _finish_walk_kernel[(bs,)](x, scores_out, base, rho, cand, scores_out, choice_out, tokens_out, norm_eps,
                                   P=npos, K=k, KP=kp, H=hidden, M=m, MB=mb, num_warps=8)
        return scores_out, choice_out, tokens_out
    if variant != "fused":
        raise ValueError(f"variant: expected 'split' or 'fused', found {variant!r}")
    pb = triton.next_power_of_2(positions_per_program or DEFAULT_POSITIONS_PER_PROGRAM)
    fuse = pb >= npos
    if fuse:
        pb = triton.next_power_of_2(npos)
    bh, bm, bq, cw, warps = _SCORE_CONFIGS[min(pb, 16)]
    stages = 3
    if dot_dt == tl.float32:  # fp32 tiles take twice the shared memory (PB=16 went over the H200's limit)
        cw, stages = cw // 2, 1
    mp = triton.cdiv(m, 16) * 16  # tensor-core tiles need 16: smaller or odd m is padded with masks
    bq = bq if mp % bq == 0 else 16
    cw = max(bq, math.gcd(mp, cw))
    grid = (bs, triton.cdiv(npos, pb))
    _score_kernel[grid](
        pre, recv, uh, cand, anchors.contiguous(), pred_proj, head_proj, head, norm_weight, bias, rfac,
        scores_out, choice_out, tokens_out,
        pre.stride(0), pre.stride(1), recv.stride(0), recv.stride(1), uh.stride(0), uh.stride(1),
        head.stride(0), pred_proj.stride(0), head_proj.stride(0),
        norm_eps,
        P=npos, K=k, KP=kp, H=hidden, M=m, PB=pb,
        BLOCK_H=min(bh, triton.next_power_of_2(hidden)), BLOCK_M=max(16, min(bm, triton.next_power_of_2(m))), BLOCK_Q=bq,
        CW=cw, BY_TOKEN=by_token, FUSE_WALK=fuse, DOT_DT=dot_dt, DOT_PREC=prec, num_warps=warps, num_stages=stages,
    )
    if not fuse:
        _walk_kernel[(bs,)](scores_out, cand, choice_out, tokens_out, P=npos, K=k, KP=kp, num_warps=1)
    return scores_out, choice_out, tokens_out


def transition_scores_walk_torch(pre, recv, uh, cand, anchors, pred_proj, head_proj, head, norm_weight, bias, rfac,
                                 norm_eps: float, scores_out, choice_out, tokens_out, by_token: bool = True,
                                 positions_per_program: int | None = None, variant: str | None = None,
                                 split_config=None):
    """PyTorch reference of `transition_scores_walk` (same signature), the same expansion in float32."""
    bs, npos, hidden = pre.shape
    m = bias.shape[0]
    if by_token:
        pp = pred_proj[predecessor_tokens(cand, anchors)].float()
        hq = head_proj[cand].float()
    else:
        pp, hq = pred_proj.float(), head_proj.float()
    msg = torch.sigmoid(recv.float().unsqueeze(2) + pp[..., :m] + bias.float()) * pp[..., m:]  # [bs,P,K,m]
    hf = pre.float()
    ss = (hf * hf).sum(-1)  # [bs, P]
    rho = (ss / hidden).sqrt()
    a = torch.einsum("nph,npjh->npj", hf * norm_weight.float(), head[cand].float())
    c = torch.einsum("npkm,npjm->npkj", msg, hq)
    t1 = torch.einsum("npkm,npm->npk", msg, uh.float())
    t2 = (msg @ rfac.float()).pow(2).sum(-1)
    nu = ((ss.unsqueeze(-1) + 2 * rho.unsqueeze(-1) * t1 + rho.unsqueeze(-1) ** 2 * t2) / hidden + norm_eps).sqrt()
    scores = (a.unsqueeze(2) + rho[..., None, None] * c) / nu.unsqueeze(-1)
    choice = walk(scores)
    scores_out.copy_(scores)
    choice_out.copy_(choice)
    tokens_out.copy_(cand.gather(-1, choice.unsqueeze(-1)).squeeze(-1))
    return scores_out, choice_out, tokens_out


# ------------------------------------------------------------------------------------- whole scoring
def receiver_terms(pre: torch.Tensor, w: InjectionWeights) -> torch.Tensor:
    """G_r φ_L(pre) in float32 [.., m] (what the last layer's injection already computed, if kept)."""
    z = F.linear(pre, w.readouts[-1])
    s = math.sqrt(w.rank) / z.float().norm(dim=-1, keepdim=True).clamp_min(NORMALIZE_EPS)
    return F.linear(z, w.maps[: w.message_size]).float() * s


def transition_walk(pre: torch.Tensor, cand: torch.Tensor, anchors: torch.Tensor, w: InjectionWeights,
                    tables: TransitionTables, codes: torch.Tensor, head: torch.Tensor, norm_weight: torch.Tensor,
                    norm_eps: float, recv: torch.Tensor | None = None, uh: torch.Tensor | None = None,
                    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None, impl: str = "triton",
                    positions_per_program: int | None = None, variant: str = "split",
                    split_config: tuple[int, int, int] | None = None):
    """Candidate decoding of one block per request from the top-K candidates (decode_block's result).

    pre [bs, P, H]: the last layer's pre-injection states of positions 1..B-1; cand [bs, P, K]; anchors [bs];
    codes [V, r]; head [V, H]; norm_weight/norm_eps: the drafter's final RMSNorm. recv (G_r φ_L(pre)) and
    uh (pre U_L) are recomputed when not given. Returns (tokens [bs, P], choice [bs, P], scores [bs,P,K,K]).
    """
    bs, npos, _ = pre.shape
    k = cand.shape[-1]
    if recv is None:
        recv = receiver_terms(pre, w)
    if uh is None:
        uh = torch.matmul(pre, w.writes[-1])
    if tables.per_token:
        pred_proj, head_proj, by_token = tables.pred_proj, tables.head_proj, True
    else:  # memory-lean: the same rows, from GEMMs on the gathered candidates
        ptok = predecessor_tokens(cand, anchors)
        pred_proj = anchor_projections(w, codes, ptok).view(*ptok.shape, -1)
        head_proj = torch.matmul(head[cand] * norm_weight, w.writes[-1])
        by_token = False
    if out is None:
        out = (torch.empty(bs, npos, k, k, dtype=torch.float32, device=pre.device),
               torch.empty(bs, npos, dtype=torch.long, device=pre.device),
               torch.empty(bs, npos, dtype=cand.dtype, device=pre.device))
    fn = transition_scores_walk if impl == "triton" else transition_scores_walk_torch
    scores, choice, tokens = fn(pre, recv, uh, cand, anchors, pred_proj, head_proj, head, norm_weight, w.bias,
                                tables.rfac, norm_eps, *out, by_token=by_token,
                                positions_per_program=positions_per_program, variant=variant,
                                split_config=split_config)
    return tokens, choice, scores
