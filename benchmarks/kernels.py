#!/usr/bin/env python3
"""DSpine kernels on the GPU at Qwen3-8B shapes: fused kernels vs PyTorch vs torch.compile, and the draft step.

Shapes: H=4096, r=1024, m=512, K=16, B=16, V=151936, 5 drafter layers (32 heads / 8 kv heads / head_dim 128,
intermediate 12288), bf16, batch sizes 1, 8, 32, 48, a context of 1024 tokens per request.

Measured (CUDA events around CUDA-graph replays, L2 flushed before each kernel-level replay, median):
  * copy ceiling: a 1 GiB device-to-device copy (bytes read + written);
  * injection, one layer: the fused pass alone (`gate_message`) vs its reference vs torch.compile of it, and
    the whole layer (`inject_flat`: GEMMs + pass + residual GEMM; also the folded-GEMM variant) vs the
    drafter's own `AdjacentInjection.forward` vs torch.compile of it;
  * transition: the fused scoring + walk kernel (sweeping positions per program) vs its reference vs
    torch.compile of it, and the whole `transition_walk` vs the drafter's math (materialised refinement,
    `decoding.transition_scores`, `walk`) vs torch.compile of that; the memory-lean variant (no tables);
  * top-K: the streaming Triton top-K vs torch.topk vs torch.argmax (what DFlash does instead);
  * the draft step, one CUDA graph each, the SAME 5-layer backbone (weights of a DSpineDrafter; block queries
    against 1024 cached context keys/values, causal inside the block, as DSpine; bf16 logits for both):
    DFlash = backbone + final norm + LM head + argmax; DSpine = backbone with injection after every layer +
    final norm + LM head + top-K + transition scoring + walk; also DSpine with the drafter's PyTorch math.
Bytes are the fewest a variant must move (each input once, each output once); GB/s is bytes / time.
Writes benchmarks/results/kernels.json and kernels_summary.json (and copies to --copy-to).
`--smoke` runs the same logic on CPU at tiny shapes through TRITON_INTERPRET (a check of this script only).
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import shutil
import statistics
import sys
import time
import traceback

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

from sglang_dspine.config import DrafterConfig, DSpineSettings  # noqa: E402
from sglang_dspine.drafter_setup import new_drafter_config  # noqa: E402
from sglang_dspine.decoding import transition_scores  # noqa: E402
from sglang_dspine.kernels import injection as kinj  # noqa: E402
from sglang_dspine.kernels import top_k as ktopk  # noqa: E402
from sglang_dspine.kernels import transition as ktr  # noqa: E402
from sglang_dspine.model import DSpineDrafter  # noqa: E402
from sglang_dspine.provenance import git_commit  # noqa: E402

torch.set_grad_enabled(False)

# shapes of the split transition's per-position kernel tried by the sweep: (BLOCK_H, msg chunk, num_warps)
SPLIT_SWEEP = [(512, 512, 8), (256, 512, 8), (512, 512, 16), (1024, 512, 16)]

QWEN3_8B = dict(hidden=4096, rank=1024, message=512, top_k=16, block=16, vocab=151936, layers=5, heads=32,
                kv_heads=8, head_dim=128, inter=12288, target_layers=36, ctx=1024)
TINY = dict(hidden=64, rank=32, message=16, top_k=4, block=5, vocab=300, layers=2, heads=4, kv_heads=2,
            head_dim=16, inter=128, target_layers=8, ctx=8)


# ------------------------------------------------------------------------------------------- timing
class Bench:
    def __init__(self, device: str, deadline: float):
        self.device, self.deadline = device, deadline
        self.gpu = device == "cuda"
        self.flush = torch.empty(256 << 20, dtype=torch.int8, device=device) if self.gpu else None

    def left(self) -> float:
        return self.deadline - time.time()

    def _capture(self, fn):
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):  # JIT / torch.compile happen here, outside the capture
                fn()
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        return g

    def time(self, fn, reps: int = 40, flush: bool = True, graph: bool = True) -> dict:
        if not self.gpu:  # smoke: wall clock, no graphs
            fn()
            t0 = time.perf_counter()
            fn()
            return {"us": (time.perf_counter() - t0) * 1e6}
        if graph:
            g = self._capture(fn)
            run = g.replay
        else:
            g, run = None, fn
        for _ in range(3):
            run()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        for i in range(reps):
            if flush:
                self.flush.zero_()
            starts[i].record()
            run()
            ends[i].record()
        torch.cuda.synchronize()
        ts = sorted(s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends))
        del g
        return {"us": statistics.median(ts), "min_us": ts[0], "p80_us": ts[int(0.8 * (len(ts) - 1))]}


# ---------------------------------------------------------------------------------------- the model
def drafter_config(s: dict) -> DrafterConfig:
    """The trainer's drafter config for a Qwen3 target of the benchmark's geometry."""
    from transformers import Qwen3Config

    target = Qwen3Config(hidden_size=s["hidden"], intermediate_size=s["inter"], num_hidden_layers=s["target_layers"],
                         num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"], head_dim=s["head_dim"],
                         vocab_size=s["vocab"], rms_norm_eps=1e-6, rope_theta=1e6)
    settings = DSpineSettings(transfer_rank=s["rank"], message_size=s["message"], top_k=s["top_k"])
    return new_drafter_config(target, "dspine", s["layers"], s["block"], settings=settings)


def build_model(s: dict, device: str, dtype: torch.dtype) -> tuple[DSpineDrafter, torch.Tensor]:
    """A DSpineDrafter with random weights (injection and norms too: nothing is the zero/identity init)."""
    cfg = drafter_config(s)
    torch.manual_seed(0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = DSpineDrafter(cfg).eval()
    finally:
        torch.set_default_dtype(old)
    for name, p in model.named_parameters():
        if name.startswith("injection."):
            fan_in = p.shape[-1] if p.dim() > 1 else 10
            p.normal_(0, 1 / math.sqrt(fan_in))
        elif p.dim() == 1:  # norm weights
            p.normal_(1.0, 0.1)
    model.transfer_codes.copy_(F.normalize(torch.randn(s["vocab"], s["rank"], device=device), dim=-1))
    model.transfer_ready.fill_(True)
    head = (torch.randn(s["vocab"], s["hidden"], device=device) * 0.02).to(dtype)
    return model, head


class LeanBackbone:
    """The drafter's layers as serving runs them: fused QKV / gate-up GEMMs, block keys/values written into a
    preallocated cache behind the context's, grouped-query attention without repeating K/V (the heads that
    share a K/V head are stacked along the query axis), causal inside the block. Same weights as the model."""

    def __init__(self, model: DSpineDrafter, bs: int, ctx_len: int, ctx_hidden: torch.Tensor | None = None):
        cfg = model.cfg
        self.cfg, self.bs, self.S = cfg, bs, ctx_len
        self.B, self.H, self.d = cfg.block_size, cfg.hidden_size, cfg.head_dim
        self.nh, self.nkv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.rep = self.nh // self.nkv
        self.eps = cfg.rms_norm_eps
        dev, dt = model.fc.weight.device, model.fc.weight.dtype
        self.layers = []
        for layer in model.layers:
            a, m = layer.self_attn, layer.mlp
            self.layers.append(dict(
                ln1=layer.input_layernorm.weight, ln2=layer.post_attention_layernorm.weight,
                qkv=torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]).contiguous(),
                o=a.o_proj.weight, qn=a.q_norm.weight, kn=a.k_norm.weight,
                gu=torch.cat([m.gate_proj.weight, m.up_proj.weight]).contiguous(), down=m.down_proj.weight))
        self.norm_w = model.norm.weight
        # context keys / values of every layer (what the serving KV cache holds), block slots behind them
        if ctx_hidden is None:
            ctx_hidden = torch.randn(bs, ctx_len, self.H, device=dev, dtype=dt)
        pos = torch.arange(ctx_len, device=dev).expand(bs, ctx_len)
        self.k, self.v = [], []
        for layer in model.layers:
            k, v = layer.self_attn.keys_values(ctx_hidden, pos)  # [bs, S, kvh, d]
            kb = torch.zeros(bs, self.nkv, ctx_len + self.B, self.d, device=dev, dtype=dt)
            vb = torch.zeros_like(kb)
            kb[:, :, :ctx_len] = k.transpose(1, 2)
            vb[:, :, :ctx_len] = v.transpose(1, 2)
            self.k.append(kb)
            self.v.append(vb)
        d = self.d
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, device=dev, dtype=torch.float32) / d))
        f = (ctx_len + torch.arange(self.B, device=dev, dtype=torch.float32)).unsqueeze(-1) * inv
        emb = torch.cat([f, f], -1)  # [B, d]
        self.cos, self.sin = emb.cos()[None, :, None, :], emb.sin()[None, :, None, :]
        # query row (g, i) of a K/V head sees the context and block positions <= i
        i = torch.arange(self.B, device=dev).repeat(self.rep)
        cols = torch.arange(ctx_len + self.B, device=dev)
        allowed = cols[None, :] <= ctx_len + i[:, None]
        self.bias = torch.zeros(allowed.shape, device=dev, dtype=dt).masked_fill(~allowed, float("-inf"))[None, None]

    def _rope(self, x):  # x [bs, B, heads, d]
        h = self.d // 2
        rot = torch.cat([-x[..., h:], x[..., :h]], -1)
        return (x.float() * self.cos + rot.float() * self.sin).to(x.dtype)

    def layer(self, l: int, x: torch.Tensor) -> torch.Tensor:
        p, bs, B, d = self.layers[l], self.bs, self.B, self.d
        a = F.rms_norm(x, (self.H,), p["ln1"], self.eps)
        q, k, v = F.linear(a, p["qkv"]).split([self.nh * d, self.nkv * d, self.nkv * d], -1)
        q = self._rope(F.rms_norm(q.view(bs, B, self.nh, d), (d,), p["qn"], self.eps))
        k = self._rope(F.rms_norm(k.view(bs, B, self.nkv, d), (d,), p["kn"], self.eps))
        self.k[l][:, :, self.S:] = k.transpose(1, 2)
        self.v[l][:, :, self.S:] = v.view(bs, B, self.nkv, d).transpose(1, 2)
        qg = q.view(bs, B, self.nkv, self.rep, d).permute(0, 2, 3, 1, 4).reshape(bs, self.nkv, self.rep * B, d)
        o = F.scaled_dot_product_attention(qg, self.k[l], self.v[l], attn_mask=self.bias)
        o = o.view(bs, self.nkv, self.rep, B, d).permute(0, 3, 1, 2, 4).reshape(bs * B, self.nh * d)
        x = x + F.linear(o, p["o"])
        g, u = F.linear(F.rms_norm(x, (self.H,), p["ln2"], self.eps), p["gu"]).chunk(2, -1)
        return x + F.linear(F.silu(g) * u, p["down"])

    def logits(self, x: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
        """bf16 logits of block positions 1..B-1: [bs·(B-1), V]."""
        hn = F.rms_norm(x.view(self.bs, self.B, self.H)[:, 1:], (self.H,), self.norm_w, self.eps)
        return F.linear(hn, head).view(self.bs * (self.B - 1), -1)


class DraftSteps:
    """Static inputs / outputs and the draft-step variants for one batch size (CUDA-graph friendly)."""

    def __init__(self, model, head, w, tables, bs, ctx_len, ctx_hidden=None, emb=None, anchors=None):
        cfg = model.cfg
        self.model, self.head, self.w, self.tables = model, head, w, tables
        self.bs, self.B, self.H, self.K = bs, cfg.block_size, cfg.hidden_size, cfg.dspine.top_k
        self.P, self.m, self.V = self.B - 1, w.message_size, cfg.vocab_size
        dev, dt = head.device, head.dtype
        self.lean = LeanBackbone(model, bs, ctx_len, ctx_hidden)
        self.emb = emb if emb is not None else torch.randn(bs * self.B, self.H, device=dev, dtype=dt)
        self.anchors = anchors if anchors is not None else torch.randint(0, self.V, (bs,), device=dev)
        n = bs * self.P
        self.recv = torch.empty(bs * self.B, self.m, device=dev)
        self.vals = torch.empty(n, self.K, device=dev, dtype=dt)
        self.idx = torch.empty(n, self.K, device=dev, dtype=torch.long)
        self.scratch = torch.empty(n, triton.cdiv(self.V, ktopk.GROUP), device=dev)
        self.outs = (torch.empty(bs, self.P, self.K, self.K, device=dev),
                     torch.empty(bs, self.P, device=dev, dtype=torch.long),
                     torch.empty(bs, self.P, device=dev, dtype=torch.long))
        self.last = {}

    def dflash(self):
        x = self.emb
        for l in range(len(self.lean.layers)):
            x = self.lean.layer(l, x)
        tokens = self.lean.logits(x, self.head).argmax(-1).view(self.bs, self.P)
        self.last = dict(tokens=tokens)
        return tokens

    def dspine(self, topk: str = "triton", impl: str = "triton", **transition):
        w, bs, B = self.w, self.bs, self.B
        codes = self.model.transfer_codes
        ap = kinj.anchor_projections(w, codes, self.anchors)
        x = self.emb
        nl = len(self.lean.layers)
        for l in range(nl):
            x = self.lean.layer(l, x)
            if l < nl - 1:
                x = kinj.inject_flat(x, l, w, ap, B, out=x, impl=impl)
            else:
                pre = x
                x = kinj.inject_flat(x, l, w, ap, B, recv_out=self.recv, impl=impl)
        logits = self.lean.logits(x, self.head)
        if topk == "triton":
            _, cand = ktopk.topk(logits, self.K, self.vals, self.idx, self.scratch)
        else:
            cand = torch.topk(logits, self.K, dim=-1).indices
        uh = torch.matmul(pre, w.writes[-1]).view(bs, B, -1)[:, 1:]
        tokens, choice, scores = ktr.transition_walk(
            pre.view(bs, B, -1)[:, 1:], cand.view(bs, self.P, self.K), self.anchors, w, self.tables, codes,
            self.head, self.model.norm.weight, self.model.norm.eps, recv=self.recv.view(bs, B, -1)[:, 1:], uh=uh,
            out=self.outs, impl=impl, **transition)
        self.last = dict(tokens=tokens, pre=pre, hidden=x, cand=cand)
        return tokens

    def dspine_reference(self):
        """The drafter's PyTorch math: AdjacentInjection.forward, torch.topk, materialised refinement."""
        m, bs, B = self.model, self.bs, self.B
        anchor_codes = m.transfer_codes[self.anchors]
        x = self.emb
        nl = len(self.lean.layers)
        for l in range(nl):
            x = self.lean.layer(l, x)
            if l == nl - 1:
                pre = x
            x = m.injection(l, x.view(bs, B, -1), anchor_codes).view(bs * B, -1)
        cand = torch.topk(self.lean.logits(x, self.head), self.K, dim=-1).indices.view(bs, self.P, self.K)
        tokens = drafter_transition(m, self.head, pre.view(bs, B, -1)[:, 1:], cand, self.anchors)[0]
        self.last = dict(tokens=tokens)
        return tokens


def drafter_transition(model, head, pre, cand, anchors):
    """decode_block after its top-K (sglang_dspine.decoding): refine_normed, transition_scores, walk."""
    preds = ktr.predecessor_tokens(cand, anchors)
    refined = model.refine_normed(pre, model.transfer_codes[preds])
    scores = transition_scores(refined, head[cand])
    choice = ktr.walk(scores)
    return cand.gather(-1, choice.unsqueeze(-1)).squeeze(-1), choice, scores


# ----------------------------------------------------------------------------------------- sections
def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def check_backbone(model, head, w, tables, s, device):
    """The lean backbone + kernels against DSpineDrafter.forward_blocks + draft (bs 2, short context)."""
    cfg, bs, S = model.cfg, 2, min(64, s["ctx"])
    B, H = cfg.block_size, cfg.hidden_size
    dt = head.dtype
    ctx_hidden = torch.randn(bs, S, H, device=device, dtype=dt)
    emb = torch.randn(bs * B, H, device=device, dtype=dt)
    anchors = torch.randint(0, cfg.vocab_size, (bs,), device=device)
    steps = DraftSteps(model, head, w, tables, bs, S, ctx_hidden=ctx_hidden, emb=emb, anchors=anchors)
    steps.dspine()
    got = steps.last
    pos = torch.arange(S, device=device).expand(bs, S)
    ctx_kv = [layer.self_attn.keys_values(ctx_hidden, pos) for layer in model.layers]
    out = model.forward_blocks(emb.view(bs, 1, B, H), (S + torch.arange(B, device=device)).expand(bs, 1, B), ctx_kv,
                               torch.ones(bs, 1, S, dtype=torch.bool, device=device), anchors.view(bs, 1))
    ref = model.draft(out, head, anchors)
    return {
        "pre_last_rel_err": rel(got["pre"].view(bs, B, H), out.pre_last[:, 0]),
        "final_hidden_rel_err": rel(F.rms_norm(got["hidden"].view(bs, B, H), (H,), model.norm.weight, cfg.rms_norm_eps),
                                    out.hidden[:, 0]),
        "candidate_set_agreement": float(torch.tensor([
            len(set(a.tolist()) & set(b.tolist())) / len(a)
            for a, b in zip(got["cand"].view(-1, cfg.dspine.top_k).cpu(), ref.candidates.reshape(-1, cfg.dspine.top_k).cpu())
        ]).mean()),
        "draft_token_agreement": (got["tokens"] == ref.tokens).float().mean().item(),
        "note": "bf16 lean backbone (fused GEMMs, SDPA) vs the drafter's forward_blocks and draft (fp32 logits)",
    }


def section_step(bench, model, head, w, tables, bs, s, res):
    steps = DraftSteps(model, head, w, tables, bs, s["ctx"])
    out = {}
    for name, fn in (("dflash", steps.dflash), ("dspine", steps.dspine),
                     ("dspine_fused_transition", lambda: steps.dspine(variant="fused", positions_per_program=1)),
                     ("dspine_torch_topk", lambda: steps.dspine(topk="torch")),
                     ("dspine_pytorch_math", steps.dspine_reference)):
        t = try_time(bench, res, f"step {name} bs={bs}", fn, reps=30, flush=False)
        if t:
            out[name] = t["us"]
    if "dflash" in out and "dspine" in out:
        out["ratio"] = out["dspine"] / out["dflash"]
    del steps
    return out


def rec(res, bs, section, variant, t, nbytes=None, flops=None, ceiling=None):
    row = {"bs": bs, "section": section, "variant": variant, **t}
    if nbytes:
        row["bytes"] = nbytes
        row["GBps"] = nbytes / (t["us"] * 1e3)
        if ceiling:
            row["frac_of_copy"] = row["GBps"] / ceiling
    if flops:
        row["TFLOPs"] = flops / (t["us"] * 1e6)
    res["results"].append(row)
    print(f"  bs={bs:3d} {section:10s} {variant:28s} {t['us']:10.1f} us"
          + (f"  {row['GBps']:8.0f} GB/s" if nbytes else ""), flush=True)


def try_time(bench, res, label, fn, **kw):
    try:
        return bench.time(fn, **kw)
    except Exception as e:  # noqa: BLE001
        res["errors"].append(f"{label}: {e!r}")
        traceback.print_exc()
        return None


def section_kernels(bench, model, head, w, tables, bs, s, res, ceiling, compiled, do_compile, sweep):
    dev, dt = head.device, head.dtype
    H, r, m, K, B, V = s["hidden"], s["rank"], s["message"], s["top_k"], s["block"], s["vocab"]
    P, n = B - 1, bs * B
    eb = torch.finfo(dt).bits // 8
    codes = model.transfer_codes
    g = torch.Generator(device=dev).manual_seed(bs)
    h = torch.randn(n, H, device=dev, dtype=dt, generator=g)
    anchors = torch.randint(0, V, (bs,), device=dev, generator=g)
    ap = kinj.anchor_projections(w, codes, anchors)

    # ---- injection: fused pass alone
    z, y = kinj.project(h, 0, w)
    msg = torch.empty(n, m, device=dev, dtype=dt)
    recv = torch.empty(n, m, device=dev)
    nbytes = eb * n * (H + r + 3 * m + m) + 4 * n * m + eb * bs * 2 * m
    for variant, fn in (("gate_message triton", kinj.gate_message), ("gate_message torch", kinj.gate_message_torch)):
        t = try_time(bench, res, f"{variant} bs={bs}", lambda fn=fn: fn(h, z, y, ap, w.bias, B, msg, recv))
        if t:
            rec(res, bs, "injection", variant, t, nbytes, ceiling=ceiling)
    if do_compile():
        f = compiled.setdefault("gate", torch.compile(kinj.gate_message_torch))
        t = try_time(bench, res, f"gate compiled bs={bs}", lambda: f(h, z, y, ap, w.bias, B, msg, recv))
        if t:
            rec(res, bs, "injection", "gate_message torch.compile", t, nbytes, ceiling=ceiling)

    # ---- injection: one whole layer
    out = torch.empty_like(h)
    wbytes = eb * (r * H + 3 * m * r + H * m)
    lbytes = eb * 2 * n * H + wbytes + eb * bs * 2 * m
    lflops = 2 * n * (H * r + r * 3 * m + m * H)
    wf = kinj.InjectionWeights(w.readouts, w.maps, w.writes, w.bias,
                               folded=[torch.cat([w.readouts[0].float(), w.maps.float() @ w.readouts[0].float()]).to(dt)])
    anchor_codes = codes[anchors]
    variants = [
        ("inject_flat triton", lambda: kinj.inject_flat(h, 0, w, ap, B, out=out, recv_out=recv), lbytes),
        ("inject_flat triton folded", lambda: kinj.inject_flat(h, 0, wf, ap, B, out=out, recv_out=recv),
         lbytes + eb * 3 * m * H - eb * 3 * m * r),
        ("inject_flat torch pass", lambda: kinj.inject_flat(h, 0, w, ap, B, out=out, recv_out=recv, impl="torch"), lbytes),
        ("AdjacentInjection.forward", lambda: model.injection(0, h.view(bs, B, H), anchor_codes), lbytes),
        # attribution: the three cuBLAS GEMMs of inject_flat alone (no fused pass)
        ("inject_flat GEMMs only", lambda: torch.addmm(h, kinj.project(h, 0, w)[1][:, :m], w.writes[0].t(), out=out),
         lbytes),
    ]
    for variant, fn, nb in variants:
        t = try_time(bench, res, f"{variant} bs={bs}", fn)
        if t:
            rec(res, bs, "inj_layer", variant, t, nb, lflops, ceiling)
    if do_compile():
        f = compiled.setdefault("module", torch.compile(model.injection.forward))
        t = try_time(bench, res, f"module compiled bs={bs}", lambda: f(0, h.view(bs, B, H), anchor_codes))
        if t:
            rec(res, bs, "inj_layer", "AdjacentInjection torch.compile", t, lbytes, lflops, ceiling)

    # ---- transition
    pre_full = torch.randn(bs, B, H, device=dev, dtype=dt, generator=g)
    pre = pre_full[:, 1:]
    cand = torch.randint(0, V, (bs, P, K), device=dev, generator=g)
    recv_p = (torch.randn(bs, B, m, device=dev, generator=g))[:, 1:]
    uh = torch.matmul(pre_full, w.writes[-1])[:, 1:]
    outs = (torch.empty(bs, P, K, K, device=dev), torch.empty(bs, P, device=dev, dtype=torch.long),
            torch.empty(bs, P, device=dev, dtype=torch.long))
    nw, eps = model.norm.weight, model.norm.eps
    args = (pre, recv_p, uh, cand, anchors, tables.pred_proj, tables.head_proj, head, nw, w.bias, tables.rfac, eps)
    tbytes = (eb * bs * P * (K * H + H + K * 3 * m + m) + 4 * bs * P * m + eb * m * (m + 1) // 2
              + 4 * bs * P * K * K + 8 * bs * P * (K + 2))
    tflops = 2 * bs * P * K * (H + K * m + m + m * m / 2)
    split_cfgs = [ktr.SPLIT_CONFIG] + ([c for c in SPLIT_SWEEP if c != ktr.SPLIT_CONFIG] if sweep else [])
    for cfg in split_cfgs:
        t = try_time(bench, res, f"score_walk split {cfg} bs={bs}",
                     lambda cfg=cfg: ktr.transition_scores_walk(*args, *outs, variant="split", split_config=cfg))
        if t:
            rec(res, bs, "transition", f"score_walk triton split cfg={cfg}"
                + (" (default)" if cfg == ktr.SPLIT_CONFIG else ""), t, tbytes, tflops, ceiling)
    for pb in ([1, 2, 4] if sweep else [1]):
        t = try_time(bench, res, f"score_walk fused pb={pb} bs={bs}",
                     lambda pb=pb: ktr.transition_scores_walk(*args, *outs, variant="fused", positions_per_program=pb))
        if t:
            rec(res, bs, "transition", f"score_walk triton fused pb={pb}", t, tbytes, tflops, ceiling)
    t = try_time(bench, res, f"score_walk torch bs={bs}", lambda: ktr.transition_scores_walk_torch(*args, *outs))
    if t:
        rec(res, bs, "transition", "score_walk torch", t, tbytes, tflops, ceiling)
    if do_compile():
        f = compiled.setdefault("score", torch.compile(ktr.transition_scores_walk_torch))
        t = try_time(bench, res, f"score compiled bs={bs}", lambda: f(*args, *outs))
        if t:
            rec(res, bs, "transition", "score_walk torch.compile", t, tbytes, tflops, ceiling)
    # whole transition (uh GEMM included; recv from the last injection)
    whole = tbytes + eb * (bs * P * H + H * m)
    lean = ktr.TransitionTables(rfac=tables.rfac)
    variants = [
        ("transition_walk triton", lambda: ktr.transition_walk(pre, cand, anchors, w, tables, codes, head, nw, eps,
                                                              recv=recv_p, out=outs), whole),
        ("transition_walk triton no tables", lambda: ktr.transition_walk(pre, cand, anchors, w, lean, codes, head, nw,
                                                                        eps, recv=recv_p, out=outs), whole),
        ("drafter math (refine_normed)", lambda: drafter_transition(model, head, pre, cand, anchors), whole),
    ]
    for variant, fn, nb in variants:
        t = try_time(bench, res, f"{variant} bs={bs}", fn)
        if t:
            rec(res, bs, "transition", variant, t, nb, ceiling=ceiling)
    if do_compile():
        f = compiled.setdefault("drafter_transition", torch.compile(drafter_transition))
        t = try_time(bench, res, f"drafter transition compiled bs={bs}", lambda: f(model, head, pre, cand, anchors))
        if t:
            rec(res, bs, "transition", "drafter math torch.compile", t, whole, ceiling=ceiling)

    # ---- top-K of the logits
    logits = (torch.randn(bs * P, V, device=dev, generator=g) * 3).to(dt)
    vals = torch.empty(bs * P, K, device=dev, dtype=dt)
    idx = torch.empty(bs * P, K, device=dev, dtype=torch.long)
    scratch = torch.empty(bs * P, triton.cdiv(V, ktopk.GROUP), device=dev)
    kb = eb * bs * P * V
    for variant, fn in (("topk triton", lambda: ktopk.topk(logits, K, vals, idx, scratch)),
                        ("torch.topk", lambda: torch.topk(logits, K, dim=-1)),
                        ("torch.argmax (DFlash)", lambda: logits.argmax(-1))):
        t = try_time(bench, res, f"{variant} bs={bs}", fn)
        if t:
            rec(res, bs, "topk", variant, t, kb, ceiling=ceiling)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bs", default="1,8,32,48")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--copy-to", default=None, help="also copy the JSON files here (e.g. $OUT)")
    ap.add_argument("--budget", type=float, default=330.0, help="seconds; optional parts are skipped past it")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU through TRITON_INTERPRET")
    args = ap.parse_args()
    t_start = time.time()
    s = dict(TINY if args.smoke else QWEN3_8B)
    device = "cpu" if args.smoke else "cuda"
    dtype = torch.float32 if args.smoke else torch.bfloat16
    bss = [1, 3] if args.smoke else [int(x) for x in args.bs.split(",")]
    bench = Bench(device, t_start + args.budget)
    res = {
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "commit": git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name() if device == "cuda" else "cpu (smoke, TRITON_INTERPRET)",
        "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
        "dtype": str(dtype), "shapes": s, "batch_sizes": bss,
        "results": [], "draft_step": {}, "errors": [], "skipped": [],
    }
    os.makedirs(args.out, exist_ok=True)

    def save():
        res["elapsed_s"] = round(time.time() - t_start, 1)
        summary = {"commit": res["commit"], "gpu": res["gpu"], "date": res["date"],
                   "copy_ceiling_GBps": res.get("copy_ceiling_GBps"),
                   "draft_step_ratio_bs48": res["draft_step"].get("48", {}).get("ratio"),
                   "draft_step_overhead_us": {k: v["dspine"] - v["dflash"] for k, v in res["draft_step"].items()
                                              if "dspine" in v and "dflash" in v},
                   "draft_step_ratio": {k: v.get("ratio") for k, v in res["draft_step"].items()},
                   "draft_step_us": {k: {kk: vv for kk, vv in v.items() if kk != "ratio"}
                                     for k, v in res["draft_step"].items()},
                   "goal": "DSpine draft step <= 1.05x DFlash's", "smoke": args.smoke}
        paths = [os.path.join(args.out, "kernels.json"), os.path.join(args.out, "kernels_summary.json")]
        if args.smoke:
            paths = [p.replace(".json", "_smoke.json") for p in paths]
        for p, obj in zip(paths, (res, summary)):
            with open(p, "w") as f:
                json.dump(obj, f, indent=1)
            if args.copy_to:
                os.makedirs(args.copy_to, exist_ok=True)
                shutil.copy(p, args.copy_to)

    # 1. copy ceiling
    if bench.gpu:
        x = torch.empty(512 << 20, dtype=torch.bfloat16, device=device)
        x.normal_()
        y = torch.empty_like(x)
        nbytes = 2 * x.numel() * x.element_size()
        copies = {}
        for name, fn, graph in (("copy_ graph", lambda: y.copy_(x), True),
                                ("copy_ eager", lambda: y.copy_(x), False),
                                ("elementwise kernel (mul 1)", lambda: torch.mul(x, 1.0, out=y), True)):
            t = bench.time(fn, reps=20, flush=False, graph=graph)
            copies[name] = nbytes / (t["us"] * 1e3)
        res["copy_GBps"] = copies
        res["copy_ceiling_GBps"] = max(copies.values())
        print(f"copy ceiling: {res['copy_ceiling_GBps']:.0f} GB/s {copies}", flush=True)
        del x, y
    ceiling = res.get("copy_ceiling_GBps")

    model, head = build_model(s, device, dtype)
    w = kinj.InjectionWeights.from_module(model.injection, dtype)
    t0 = time.time()
    tables = ktr.TransitionTables.build(w, model.transfer_codes, head, model.norm.weight)
    res["tables_build_s"] = round(time.time() - t0, 2)
    res["tables_bytes"] = sum(t.numel() * t.element_size() for t in (tables.pred_proj, tables.head_proj, tables.rfac))
    save()

    # 2. correctness of the benchmark's own backbone against the drafter
    try:
        res["backbone_check"] = check_backbone(model, head, w, tables, s, device)
        print("backbone check:", res["backbone_check"], flush=True)
    except Exception as e:  # noqa: BLE001
        res["errors"].append(f"backbone check: {e!r}")
        traceback.print_exc()
    save()

    # 3. the draft steps (the headline), every batch size
    for bs in bss:
        print(f"draft step bs={bs}", flush=True)
        res["draft_step"][str(bs)] = section_step(bench, model, head, w, tables, bs, s, res)
        print("  ", res["draft_step"][str(bs)], flush=True)
        save()
        if bench.gpu:
            torch.cuda.empty_cache()

    # 4. kernels vs references (torch.compile and the sweep while time allows)
    compiled = {}

    def do_compile():
        if args.no_compile or args.smoke:
            return False
        if bench.left() < 60:
            if "torch.compile" not in res["skipped"]:
                res["skipped"].append("torch.compile")
            return False
        return True

    for bs in sorted(bss, reverse=True):  # the largest batch (the headline) first
        if bench.left() < 15:
            res["skipped"].append(f"kernels bs={bs}")
            continue
        print(f"kernels bs={bs}", flush=True)
        try:
            section_kernels(bench, model, head, w, tables, bs, s, res, ceiling, compiled, do_compile,
                            sweep=not args.no_sweep and bench.left() > 60)
        except Exception as e:  # noqa: BLE001
            res["errors"].append(f"kernels bs={bs}: {e!r}")
            traceback.print_exc()
        save()
        if bench.gpu:
            torch.cuda.empty_cache()

    # 5. the DSpine step again with the transition configuration the sweep found fastest, where it differs
    for bs in bss:
        sc = [r for r in res["results"] if r["bs"] == bs and r["variant"].startswith("score_walk triton")]
        if not sc or bench.left() < 10:
            continue
        best = min(sc, key=lambda r: r["us"])
        if best["variant"].endswith("(default)"):
            continue
        if "split" in best["variant"]:
            cfg = tuple(int(v) for v in best["variant"].split("cfg=(")[1].split(")")[0].split(","))
            kw, label = dict(variant="split", split_config=cfg), "split_" + "_".join(map(str, cfg))
        else:
            pb = int(best["variant"].split("pb=")[1].split()[0])
            kw, label = dict(variant="fused", positions_per_program=pb), f"fused_pb{pb}"
        steps = DraftSteps(model, head, w, tables, bs, s["ctx"])
        t = try_time(bench, res, f"dspine {label} bs={bs}", lambda: steps.dspine(**kw), reps=30, flush=False)
        if t:
            st = res["draft_step"][str(bs)]
            st[f"dspine_{label}"] = t["us"]
            if "dflash" in st:
                st[f"ratio_{label}"] = t["us"] / st["dflash"]
        del steps
    save()
    print_table(res)


def print_table(res) -> None:
    def get(bs, section, prefix):
        for r in res["results"]:
            if r["bs"] == bs and r["section"] == section and r["variant"].startswith(prefix):
                return r
        return None

    def us(r):
        return "-" if r is None else f"{r['us']:.1f}"

    print("\n== DSpine kernels, {} (copy ceiling {:.0f} GB/s), commit {} ==".format(
        res["gpu"], res.get("copy_ceiling_GBps") or 0, res["commit"][:10]))
    print(f"{'bs':>3} | {'gate tri/torch/comp':>20} | {'inj layer tri/torch/module/comp':>32} | "
          f"{'transition split/fused/torch/comp':>34} | {'topk tri/torch/argmax':>22} | {'step dflash/dspine us':>21} | ratio")
    for bs in res["batch_sizes"]:
        st = res["draft_step"].get(str(bs), {})
        print(f"{bs:>3} | {us(get(bs, 'injection', 'gate_message triton')):>6}/{us(get(bs, 'injection', 'gate_message torch')):>6}/"
              f"{us(get(bs, 'injection', 'gate_message torch.compile')):>6}"
              f" | {us(get(bs, 'inj_layer', 'inject_flat triton')):>7}/{us(get(bs, 'inj_layer', 'inject_flat torch')):>7}/"
              f"{us(get(bs, 'inj_layer', 'AdjacentInjection.forward')):>7}/{us(get(bs, 'inj_layer', 'AdjacentInjection torch.compile')):>7}"
              f" | {us(get(bs, 'transition', 'score_walk triton split')):>7}/{us(get(bs, 'transition', 'score_walk triton fused pb=1')):>7}/"
              f"{us(get(bs, 'transition', 'score_walk torch')):>7}/{us(get(bs, 'transition', 'score_walk torch.compile')):>7}"
              f" | {us(get(bs, 'topk', 'topk triton')):>6}/{us(get(bs, 'topk', 'torch.topk')):>6}/{us(get(bs, 'topk', 'torch.argmax')):>6}"
              f" | {st.get('dflash', float('nan')):>9.1f}/{st.get('dspine', float('nan')):>9.1f}"
              f" | {st.get('ratio', float('nan')):.3f}")
    if res["errors"]:
        print(f"errors: {len(res['errors'])} (see kernels.json)")
    if res["skipped"]:
        print("skipped:", ", ".join(res["skipped"]))


if __name__ == "__main__":
    main()
