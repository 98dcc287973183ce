"""Transition scoring + walk on the GPU (`sglang_dspine.drafter.decoding.decode_block` is the math).

For request n, block position i (1..B-1, index p = i-1 here), predecessor candidate k and candidate j:

    S[k, j] = norm(h̃ + ρ U msg_k) · W_j,   msg_k = σ(G_r φ(h̃) + G_p p_k + b) ⊙ M p_k,   p_k = √r C[a_k]

(h̃ the last layer's pre-injection state, ρ = rms(h̃), U = U_L, norm = the final RMSNorm with weight w).
Materialising the K refined states per position costs a [bs·P·K, m]×[m, H] GEMM (48 GFLOP at bs 48) and
their dots with the candidates' head rows. Instead we expand it exactly:

    numerator    (w⊙h̃)·W_j + ρ · msg_k·Q_j,          Q_j = Uᵀ(w⊙W_j)       (m numbers per token)
    denominator  ν_k = sqrt((‖h̃‖² + 2ρ (Uᵀh̃)·msg_k + ρ² ‖R msg_k‖²)/H + ε),   U = Q_U R (QR; ‖U x‖ = ‖R x‖)

so per position the kernels touch K head rows (the only H-sized reads), K rows of m-sized tables, and do
K×K×m + K·m² multiply-adds.

Split between tables, GEMMs and kernels:
  * per-token tables (`TransitionTables`), the DSpine "transition cache": pred_proj[v] = √r C[v][G_p; M]ᵀ
    [V, 2m] (also the anchor projection the injection needs), head_proj[v] = (W_v⊙w) U_L [V, m], and
    rfac = Rᵀ [m, m]. Gathering rows by token id is far cheaper than GEMMs on gathered codes/head rows per
    step. pred_proj and rfac depend on the drafter only and are built when its weights are loaded; head_proj
    needs the target head and is filled when the worker hands it over (its memory is taken at load time, so
    SGLang's KV-cache sizing counts it).
  * per step: recv = G_r φ_L(h̃) and uh = h̃ U_L come from the last layer's injection (its gate pass and its
    projection GEMM), or are recomputed from h̃ when not given;
  * three launches: `_position_kernel`, one program per (request, position), every load issued up front and
    the K head rows streamed with a prefetch: msg_k (written), a_j, ‖h̃‖², t1_k and c = msg·Qᵀ (tensor cores),
    the numerators a_j + ρ c_kj into the score table; cuBLAS X = msg · rfac over all bs·P·K rows (the K·m²
    term as one GEMM, rfac read once); `_finish_walk_kernel`, one program per request: ν_k from ‖X_k‖², the
    table S = numerator / ν_k, and the walk on the rows while they are in registers.
No host synchronisation, fixed shapes: CUDA-graph capturable.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from sglang_dspine.drafter.decoding import predecessor_tokens, walk  # the references the kernels reproduce
from sglang_dspine.drafter.injection import NORMALIZE_EPS

from .injection import InjectionWeights
from .runtime import interpreting


# ------------------------------------------------------------------------------------------- tables
@dataclass
class TransitionTables:
    rfac: torch.Tensor  # [m, m] Rᵀ with U_L = Q R: ‖U_L x‖ = ‖x rfac‖ (lower triangular)
    pred_proj: torch.Tensor  # [V, 2m] √r·C[v] [G_p; M]ᵀ
    head_proj: torch.Tensor  # [V, m] (W_v ⊙ w) U_L; valid once `fill_head` has run
    head_ready: bool = False

    @classmethod
    @torch.no_grad()
    def build(cls, w: InjectionWeights, codes: torch.Tensor, chunk: int = 16384) -> TransitionTables:
        """The drafter's tables (pred_proj, rfac) and the memory of the head's (head_proj, filled later)."""
        dtype = w.maps.dtype
        u = w.writes[-1].double() if w.writes[-1].device.type == "cpu" else w.writes[-1].float()
        r = torch.linalg.qr(u, mode="r").R  # [m, m] upper triangular
        v = codes.shape[0]
        pred_proj = torch.empty(v, 2 * w.message_size, dtype=dtype, device=codes.device)
        sqrt_r, pm = math.sqrt(w.rank), w.pred_maps.float()
        for s in range(0, v, chunk):
            e = min(v, s + chunk)
            pred_proj[s:e] = (sqrt_r * codes[s:e].float()) @ pm.t()
        head_proj = torch.empty(v, w.message_size, dtype=dtype, device=codes.device)
        return cls(rfac=r.t().to(dtype).contiguous(), pred_proj=pred_proj, head_proj=head_proj)

    @torch.no_grad()
    def fill_head(self, w: InjectionWeights, head: torch.Tensor, norm_weight: torch.Tensor, chunk: int = 16384) -> None:
        """head_proj from the target head (once, outside any graph capture)."""
        if head.shape[0] != self.head_proj.shape[0]:
            raise ValueError(f"target head has {head.shape[0]} rows, "
                             f"the drafter's vocabulary {self.head_proj.shape[0]}")
        uf, nw = w.writes[-1].float(), norm_weight.float()
        for s in range(0, head.shape[0], chunk):
            e = min(head.shape[0], s + chunk)
            self.head_proj[s:e] = (head[s:e].float() * nw) @ uf
        self.head_ready = True

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.rfac, self.pred_proj, self.head_proj))


# ------------------------------------------------------------------------------------------- kernels
@triton.jit
def _position_kernel(
    pre_ptr, recv_ptr, uh_ptr, cand_ptr, anc_ptr, pp_ptr, hp_ptr, head_ptr, w_ptr, b_ptr,
    msg_ptr, num_ptr, base_ptr, rho_ptr,
    s_pre_n, s_pre_p, s_recv_n, s_recv_p, s_uh_n, s_uh_p, s_head, s_pp, s_hp,
    P: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, H: tl.constexpr, M: tl.constexpr, MB: tl.constexpr,
    MCH: tl.constexpr, BLOCK_H: tl.constexpr, DOT_DT: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """One program per (request, position): every load is issued before its first use (one
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
    prow = ptok.to(tl.int64)  # rows of the per-token tables
    qrow = tok.to(tl.int64)

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
    """One program per request: ν_k from ‖R msg_k‖² (rows of X = msg·Rᵀ), the table
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




# (BLOCK_H, message column chunk, num_warps) of the per-position kernel: from the H200 sweep at Qwen3-8B shapes
# (benchmarks/kernels_notes.md)
POSITION_CONFIG = (512, 512, 8)


def transition_scores_walk(pre, recv, uh, cand, anchors, pred_proj, head_proj, head, norm_weight, bias, rfac,
                           norm_eps: float, scores_out, choice_out, tokens_out,
                           position_config: tuple[int, int, int] | None = None):
    """K×K transition scores + walk (Triton): per-position kernel → one GEMM X = msg·rfac for all ‖R msg‖²
    terms → per-request finish + walk kernel.

    pre [bs, P, H] last-layer pre-injection states of positions 1..P (rows contiguous, any batch strides);
    recv [bs, P, m] G_r φ_L(pre); uh [bs, P, m] pre U_L (both: contiguous last axis, any other strides);
    cand [bs, P, K] candidate ids; anchors [bs]; pred_proj [V, 2m] and head_proj [V, m] per-token tables;
    head [V, H]; norm_weight [H]; bias [m]; rfac [m, m].
    Writes scores_out [bs, P, K, K] fp32, choice_out [bs, P], tokens_out [bs, P]. Returns the three.
    """
    bs, npos, hidden = pre.shape
    k = cand.shape[-1]
    m = bias.shape[0]
    for name, t, shape in (("recv", recv, (bs, npos, m)), ("uh", uh, (bs, npos, m)), ("cand", cand, (bs, npos, k))):
        if tuple(t.shape) != shape or t.stride(-1) != 1:
            raise ValueError(f"{name}: expected {shape} with a contiguous last axis, "
                             f"found {tuple(t.shape)} {t.stride()}")
    if pre.stride(-1) != 1:
        raise ValueError("pre: last axis must be contiguous")
    cand = cand.contiguous()
    kp = max(16, triton.next_power_of_2(k))
    if interpreting() or rfac.dtype == torch.float32:
        # fp32 operands: exact ("ieee") products; the interpreter also needs fp32 (its bf16 dot is wrong)
        dot_dt, prec = tl.float32, "ieee"
    else:
        dot_dt, prec = (tl.bfloat16 if rfac.dtype == torch.bfloat16 else tl.float16), "tf32"
    rows = bs * npos * k
    msg = torch.empty(rows, m, dtype=rfac.dtype, device=pre.device)
    base = torch.empty(rows, dtype=torch.float32, device=pre.device)
    rho = torch.empty(bs * npos, dtype=torch.float32, device=pre.device)
    mb = max(16, triton.next_power_of_2(m))  # a tensor-core tile needs 16 (masked)
    block_h, mch, warps = position_config or POSITION_CONFIG
    _position_kernel[(bs * npos,)](
        pre, recv, uh, cand, anchors.contiguous(), pred_proj, head_proj, head, norm_weight, bias,
        msg, scores_out, base, rho,
        pre.stride(0), pre.stride(1), recv.stride(0), recv.stride(1), uh.stride(0), uh.stride(1),
        head.stride(0), pred_proj.stride(0), head_proj.stride(0),
        P=npos, K=k, KP=kp, H=hidden, M=m, MB=mb, MCH=max(16, min(mch, mb)),
        BLOCK_H=min(block_h, triton.next_power_of_2(hidden)),
        DOT_DT=dot_dt, DOT_PREC=prec, num_warps=warps,
    )
    x = torch.mm(msg, rfac)  # R msg_k for every row: one GEMM, rfac read once
    _finish_walk_kernel[(bs,)](x, scores_out, base, rho, cand, scores_out, choice_out, tokens_out, norm_eps,
                               P=npos, K=k, KP=kp, H=hidden, M=m, MB=mb, num_warps=8)
    return scores_out, choice_out, tokens_out


def transition_scores_walk_torch(pre, recv, uh, cand, anchors, pred_proj, head_proj, head, norm_weight, bias, rfac,
                                 norm_eps: float, scores_out, choice_out, tokens_out, position_config=None):
    """PyTorch reference of `transition_scores_walk` (same signature), the same expansion in float32."""
    bs, npos, hidden = pre.shape
    m = bias.shape[0]
    pp = pred_proj[predecessor_tokens(cand, anchors)].float()
    hq = head_proj[cand].float()
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
    """G_r φ_L(pre) in float32 [.., m] (what the last layer's gate pass writes when asked)."""
    z = F.linear(pre, w.readouts[-1])
    s = math.sqrt(w.rank) / z.float().norm(dim=-1, keepdim=True).clamp_min(NORMALIZE_EPS)
    return F.linear(z, w.maps[: w.message_size]).float() * s


def transition_walk(pre: torch.Tensor, cand: torch.Tensor, anchors: torch.Tensor, w: InjectionWeights,
                    tables: TransitionTables, head: torch.Tensor, norm_weight: torch.Tensor, norm_eps: float,
                    recv: torch.Tensor | None = None, uh: torch.Tensor | None = None,
                    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None, kernel: bool = True,
                    position_config: tuple[int, int, int] | None = None):
    """Candidate decoding of one block per request from the top-K candidates (decode_block's result).

    pre [bs, P, H]: the last layer's pre-injection states of positions 1..B-1; cand [bs, P, K]; anchors [bs];
    head [V, H]; norm_weight/norm_eps: the drafter's final RMSNorm. recv (G_r φ_L(pre)) and uh (pre U_L) are
    recomputed when not given. out: optional (scores, choice, tokens) buffers to write. kernel: the Triton
    kernels, else their PyTorch reference. Returns (tokens [bs, P], choice [bs, P], scores [bs, P, K, K]).
    """
    if not tables.head_ready:
        raise RuntimeError("transition_walk before TransitionTables.fill_head")
    bs, npos, _ = pre.shape
    k = cand.shape[-1]
    if recv is None:
        recv = receiver_terms(pre, w)
    if uh is None:
        uh = torch.matmul(pre, w.writes[-1])
    if out is None:
        out = (torch.empty(bs, npos, k, k, dtype=torch.float32, device=pre.device),
               torch.empty(bs, npos, dtype=torch.long, device=pre.device),
               torch.empty(bs, npos, dtype=cand.dtype, device=pre.device))
    fn = transition_scores_walk if kernel else transition_scores_walk_torch
    scores, choice, tokens = fn(pre, recv, uh, cand, anchors, tables.pred_proj, tables.head_proj, head, norm_weight,
                                w.bias, tables.rfac, norm_eps, *out, position_config=position_config)
    return tokens, choice, scores
