#!/usr/bin/env python3
"""DSpine's draft step and kernels on the GPU at Qwen3-8B shapes: what the server runs, timed alone.

Shapes: H=4096, r=1024, m=512, K=16, B=16, V=151936, 5 drafter layers (32 heads / 8 kv heads / head_dim 128,
intermediate 12288), bf16, batch sizes 1, 4, 16, 48, 64, a context of 1024 tokens per request.

Timing: CUDA events around CUDA-graph replays, median. Kernel-level replays run with L2 flushed before each
(cold weights, as inside the draft step); draft steps are not flushed, and their variants are replayed in
alternating rounds so that clock drift hits them alike.

1. Draft step, one CUDA graph per variant, the SAME backbone (`LeanBackbone`: the drafter's 5 layers laid out as
   SGLang's DFlash layers run them: fused QKV / gate-up GEMMs, the residual add deferred to the next norm,
   block keys/values written behind 1024 cached context keys/values, causal inside the block):
     dflash        layers → final norm → positions 1..B-1 as rows → [bs·(B-1), H]×[H, V] GEMM → argmax
                   (SGLang's DFlash draft sampler);
     dspine        the server's own `DraftStep` (sglang_dspine.serving.draft_step) on the Triton kernels: `begin`, the
                   layers with `inject` after each (its (hidden, residual) pair added by the next norm, as
                   SGLang's fused add-RMSNorm does), final norm, then `decode` on positions 1..B-1 as
                   contiguous rows (worker.DSpineDraftSampler);
     dspine_torch  the same with `DraftStep(..., kernels=False)` (SGLANG_DSPINE_KERNELS=0: the PyTorch math);
     dspine_injection_only (attribution) dspine's layers and injection with dflash's argmax tail;
     dspine_tree_N dspine's layers, then `DraftStep.draft_tree` with N draft nodes (N in TREE_BUDGETS) and the
                   verify tensors of its trees (ancestor masks, retrieve links): the draft side of a tree step,
                   not served yet (docs/tree.md); the math check below compares its trees with tree.lattice_tree.
   Reported per batch size: µs per step, the ratio to dflash and the overhead (dspine − dflash, µs).
2. Kernels against their references: the gate pass (`gate_message` vs `gate_message_torch`); one injection
   layer (`injection_delta` vs its reference pass vs the module's forward, which `DraftStep(kernels=False)`
   runs; cuBLAS GEMMs alone for attribution); the transition (`transition_scores_walk` vs
   `transition_scores_walk_torch`, a sweep of its per-position launch configuration, the whole
   `transition_walk` as served and the drafter's materialised refinement); top-K (Triton vs torch.topk vs
   DFlash's argmax). Bytes are the fewest a variant must move; GB/s is bytes / time, also as a fraction of a
   measured copy ceiling.
3. A check that the benchmark runs the right math: at a tiny shape in float32 (on the benchmark's device),
   the tokens of the timed dspine, dspine_torch and dflash paths equal the plain drafter's `draft` tokens
   (and the plain layers' argmax for dflash); at Qwen3-8B shapes in bf16 (GPU) their agreement is recorded.
   A mismatch at the tiny shape is an error and the exit status is 1.

Writes benchmarks/results/kernels.json and kernels_summary.json (command, commit, GPU, versions, date,
`draft_step_overhead_us` per batch size), and copies them to --copy-to.
`--compare-serving serving_scale.json` runs nothing: it prints the server's DSPINE − DFLASH µs per step (from
its step times and its per-kernel profile) beside this benchmark's overhead at the same batch size, and the
server step ratio that overhead predicts.
`--smoke` runs everything on the CPU at tiny shapes through TRITON_INTERPRET (a check of this script).
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
import tempfile
import time
import traceback
from types import SimpleNamespace

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton decorates the kernels

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

from sglang_dspine.drafter.config import DrafterConfig, DSpineSettings, new_drafter_config  # noqa: E402
from sglang_dspine.drafter.decoding import predecessor_tokens, transition_scores, walk  # noqa: E402
from sglang_dspine.drafter.model import DSpineDrafter  # noqa: E402
from sglang_dspine.drafter.tree import DraftTree, lattice_tree  # noqa: E402
from sglang_dspine.drafter.tree_batch import ancestor_masks, retrieve_links  # noqa: E402
from sglang_dspine.kernels import injection as kinj  # noqa: E402
from sglang_dspine.kernels import top_k as ktopk  # noqa: E402
from sglang_dspine.kernels import transition as ktr  # noqa: E402
from sglang_dspine.provenance import git_commit  # noqa: E402
from sglang_dspine.serving.draft_step import DraftStep  # noqa: E402
from sglang_dspine.source_files import as_package  # noqa: E402

if not __package__:  # run as a file (python benchmarks/kernels.py) or loaded by its path: the package first
    as_package(__file__)

from benchmarks.geometry import DRAFTER, short  # noqa: E402
from benchmarks.models import on_device  # noqa: E402
from benchmarks.output import write_json  # noqa: E402

torch.set_grad_enabled(False)

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")

# per-position launch configurations of the transition tried by the sweep: (BLOCK_H, msg chunk, num_warps)
POSITION_SWEEP = [(512, 512, 8), (256, 512, 8), (512, 512, 16), (1024, 512, 16)]

_QWEN3_8B = short("qwen3-8b")  # the target; the drafter's layers, block and DSpine sizes: DRAFTER
QWEN3_8B = dict(hidden=_QWEN3_8B["hidden"], rank=DRAFTER["transfer_rank"], message=DRAFTER["message_size"],
                top_k=DRAFTER["top_k"], block=DRAFTER["block_size"], vocab=_QWEN3_8B["vocab"], layers=DRAFTER["layers"],
                heads=_QWEN3_8B["heads"], kv_heads=_QWEN3_8B["kv_heads"], head_dim=_QWEN3_8B["head_dim"],
                inter=_QWEN3_8B["intermediate"], target_layers=_QWEN3_8B["layers"], ctx=1024)
TINY = dict(hidden=64, rank=32, message=16, top_k=4, block=5, vocab=300, layers=2, heads=4, kv_heads=2,
            head_dim=16, inter=128, target_layers=8, ctx=8)

# Draft-tree budgets timed (draft nodes; N = budget + 1 verify rows): the step ending in DraftStep.draft_tree and
# the verify tensors (ancestor masks, retrieve links) instead of the walk's tokens. Not served yet (docs/tree.md).
TREE_BUDGETS = (15, 31, 63)
STEP_VARIANTS = ("dflash", "dspine", "dspine_torch", "dspine_injection_only") + tuple(f"dspine_tree_{n}"
                                                                                       for n in TREE_BUDGETS)


# ------------------------------------------------------------------------------------------- timing
class Bench:
    def __init__(self, device: str, deadline: float):
        self.device, self.deadline = device, deadline
        self.gpu = device == "cuda"
        self.flush = torch.empty(256 << 20, dtype=torch.int8, device=device) if self.gpu else None

    def left(self) -> float:
        return self.deadline - time.time()

    @staticmethod
    def capture(fn):
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):  # Triton JIT happens here, outside the capture
                fn()
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        return g

    def _replays(self, run, reps: int, flush: bool) -> list[float]:
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        for i in range(reps):
            if flush:
                self.flush.zero_()
            starts[i].record()
            run()
            ends[i].record()
        torch.cuda.synchronize()
        return [s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends)]

    @staticmethod
    def _stats(ts: list[float]) -> dict:
        ts = sorted(ts)
        return {"us": statistics.median(ts), "min_us": ts[0], "p80_us": ts[int(0.8 * (len(ts) - 1))], "n": len(ts)}

    def time(self, fn, reps: int = 40, flush: bool = True, graph: bool = True) -> dict:
        if not self.gpu:  # smoke: wall clock, no graphs
            fn()
            t0 = time.perf_counter()
            fn()
            return {"us": (time.perf_counter() - t0) * 1e6}
        g = self.capture(fn) if graph else None
        run = g.replay if graph else fn
        for _ in range(3):
            run()
        out = self._stats(self._replays(run, reps, flush))
        del g
        return out

    def time_interleaved(self, fns: dict, res: dict, label: str, rounds: int = 4, reps: int = 10) -> dict:
        """Each fn captured once, then `rounds` rounds of `reps` replays, the order reversed every round.
        A variant that fails to run or capture is recorded in res['errors'] and left out."""
        if not self.gpu:
            out = {}
            for name, fn in fns.items():
                t = try_time(self, res, f"{label} {name}", fn)
                if t:
                    out[name] = t
            return out
        graphs = {}
        for name, fn in fns.items():
            try:
                graphs[name] = self.capture(fn)
                for _ in range(3):
                    graphs[name].replay()
            except Exception as e:  # noqa: BLE001
                res["errors"].append(f"{label} {name}: {e!r}")
                traceback.print_exc()
        samples = {name: [] for name in graphs}
        per_round = {name: [] for name in graphs}
        names = list(graphs)
        for r in range(rounds):
            for name in (names if r % 2 == 0 else names[::-1]):
                ts = self._replays(graphs[name].replay, reps, flush=False)
                samples[name] += ts
                per_round[name].append(round(statistics.median(ts), 1))
        del graphs
        return {name: {**self._stats(ts), "round_medians_us": per_round[name]} for name, ts in samples.items()}


def try_time(bench, res, label, fn, **kw):
    try:
        return bench.time(fn, **kw)
    except Exception as e:  # noqa: BLE001
        res["errors"].append(f"{label}: {e!r}")
        traceback.print_exc()
        return None


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
    model = on_device(lambda: DSpineDrafter(cfg), device, dtype).eval()
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


class FinalNorm:
    """The drafter's final RMSNorm with the attributes DraftStep reads from SGLang's (weight, variance_epsilon),
    callable on 2-D rows."""

    def __init__(self, weight: torch.Tensor, eps: float):
        self.weight, self.variance_epsilon = weight, eps

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.variance_epsilon)


def served_parts(model: DSpineDrafter) -> SimpleNamespace:
    """What DraftStep takes from SGLang's DSpineDraftModel, taken from the plain drafter (same weights)."""
    return SimpleNamespace(block_size=model.cfg.block_size, top_k=model.cfg.dspine.top_k, injection=model.injection,
                           norm=FinalNorm(model.norm.weight, model.norm.eps), transfer_codes=model.transfer_codes,
                           layers=model.layers)


def served_steps(model: DSpineDrafter, head: torch.Tensor) -> dict[str, DraftStep]:
    """The server's draft step on the kernels and on the PyTorch math, the target head attached."""
    parts = served_parts(model)
    steps = {"kernels": DraftStep(parts, kernels=True), "torch": DraftStep(parts, kernels=False)}
    for step in steps.values():
        step.attach_head(head)
    return steps


class LeanBackbone:
    """The drafter's layers as SGLang's DFlash layers run them: `layer(l, hidden, residual)` -> (hidden,
    residual), the residual add deferred to the next norm (SGLang fuses it into an add-RMSNorm; here an add and
    a norm, the same for both drafters); fused QKV and gate-up GEMMs; block keys/values written into a
    preallocated cache behind the context's; grouped-query attention without repeating K/V (the heads sharing a
    K/V head stacked along the query axis), causal inside the block. Same weights as the model."""

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

    def add_norm(self, x, residual, weight):
        """(norm(x + residual), x + residual); residual None: (norm(x), x)."""
        if residual is not None:
            x = x + residual
        return F.rms_norm(x, (self.H,), weight, self.eps), x

    def layer(self, l: int, x: torch.Tensor, residual: torch.Tensor | None):
        p, bs, B, d = self.layers[l], self.bs, self.B, self.d
        a, residual = self.add_norm(x, residual, p["ln1"])
        q, k, v = F.linear(a, p["qkv"]).split([self.nh * d, self.nkv * d, self.nkv * d], -1)
        q = self._rope(F.rms_norm(q.view(bs, B, self.nh, d), (d,), p["qn"], self.eps))
        k = self._rope(F.rms_norm(k.view(bs, B, self.nkv, d), (d,), p["kn"], self.eps))
        self.k[l][:, :, self.S:] = k.transpose(1, 2)
        self.v[l][:, :, self.S:] = v.view(bs, B, self.nkv, d).transpose(1, 2)
        qg = q.view(bs, B, self.nkv, self.rep, d).permute(0, 2, 3, 1, 4).reshape(bs, self.nkv, self.rep * B, d)
        o = F.scaled_dot_product_attention(qg, self.k[l], self.v[l], attn_mask=self.bias)
        o = o.view(bs, self.nkv, self.rep, B, d).permute(0, 3, 1, 2, 4).reshape(bs * B, self.nh * d)
        a, residual = self.add_norm(F.linear(o, p["o"]), residual, p["ln2"])
        g, u = F.linear(a, p["gu"]).chunk(2, -1)
        return F.linear(F.silu(g) * u, p["down"]), residual

    def final_norm(self, x, residual):
        return self.add_norm(x, residual, self.norm_w)[0]


class DraftStepBench:
    """The draft-step variants at one batch size, on static inputs (CUDA-graph friendly): the block's input ids
    (anchor + mask tokens), its embeddings, the context in the backbone's cache, the sampler's output buffer."""

    def __init__(self, model, head, steps: dict[str, DraftStep], bs: int, ctx_len: int, ctx_hidden=None, emb=None,
                 anchors=None):
        cfg = model.cfg
        self.head, self.steps, self.bs = head, steps, bs
        self.B, self.H, self.V = cfg.block_size, cfg.hidden_size, cfg.vocab_size
        dev, dt = head.device, head.dtype
        self.lean = LeanBackbone(model, bs, ctx_len, ctx_hidden)
        self.emb = emb if emb is not None else torch.randn(bs * self.B, self.H, device=dev, dtype=dt)
        anchors = anchors if anchors is not None else torch.randint(0, self.V, (bs,), device=dev)
        self.input_ids = torch.full((bs, self.B), cfg.mask_token_id, dtype=torch.long, device=dev)
        self.input_ids[:, 0] = anchors
        self.input_ids = self.input_ids.view(-1)
        self.out = torch.empty(bs * (self.B - 1), dtype=torch.long, device=dev)  # the sampler's static buffer

    # SGLang's draft model forward (DFlash's, and DSpineDraftModel's with a draft step)
    def forward(self, step: DraftStep | None) -> torch.Tensor:
        if step is not None:
            step.begin(self.input_ids.view(-1, self.B)[:, 0])
        x, residual = self.emb, None
        for l in range(len(self.lean.layers)):
            x, residual = self.lean.layer(l, x, residual)
            if step is not None:
                x, residual = step.inject(x + residual, l)
        return self.lean.final_norm(x, residual)

    def _rows(self, hidden):  # positions 1..B-1 as contiguous rows, as both samplers take them
        return hidden.view(-1, self.B, self.H)[:, 1:].reshape(-1, self.H)

    def _argmax_tail(self, hidden):
        logits = torch.matmul(self._rows(hidden), self.head.T)
        tokens = torch.argmax(logits, dim=-1)
        self.out[: tokens.numel()].copy_(tokens)
        return tokens.view(self.bs, self.B - 1)

    def dflash(self):
        return self._argmax_tail(self.forward(None))

    def dspine(self, which: str = "kernels"):
        step = self.steps[which]
        tokens = step.decode(self._rows(self.forward(step)))
        self.out[: tokens.numel()].copy_(tokens.reshape(-1))
        return tokens

    def dspine_injection_only(self):
        return self._argmax_tail(self.forward(self.steps["kernels"]))

    def dspine_tree(self, budget: int):
        step = self.steps["kernels"]
        trees = step.draft_tree(self._rows(self.forward(step)), budget)
        links = retrieve_links(trees)
        return trees, ancestor_masks(trees, self.B - 1), links

    def variants(self) -> dict:
        return {"dflash": self.dflash, "dspine": self.dspine, "dspine_torch": lambda: self.dspine("torch"),
                "dspine_injection_only": self.dspine_injection_only,
                **{f"dspine_tree_{n}": (lambda n=n: self.dspine_tree(n)) for n in TREE_BUDGETS}}


# ----------------------------------------------------------------------------------------- sections
def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def check_draft_step(model, head, steps, device, exact: bool) -> dict:
    """The timed paths against the plain drafter at bs 2, a short context: DraftStep's tokens (kernels and
    PyTorch math) vs DSpineDrafter.forward_blocks + draft, dflash's vs the plain layers + norm + argmax.
    exact: float32, the tokens must be equal (else the returned 'ok' is False)."""
    cfg = model.cfg
    bs, S, B, H = 2, min(64, QWEN3_8B["ctx"]), cfg.block_size, cfg.hidden_size
    dt = head.dtype
    g = torch.Generator(device=device).manual_seed(1)
    ctx_hidden = torch.randn(bs, S, H, device=device, dtype=dt, generator=g)
    emb = torch.randn(bs * B, H, device=device, dtype=dt, generator=g)
    anchors = torch.randint(0, cfg.vocab_size, (bs,), device=device, generator=g)
    db = DraftStepBench(model, head, steps, bs, S, ctx_hidden=ctx_hidden, emb=emb, anchors=anchors)
    got = {"dspine": db.dspine("kernels"), "dspine_torch": db.dspine("torch"), "dflash": db.dflash()}
    hidden = db.forward(steps["kernels"]).view(bs, B, H)

    pos = torch.arange(S, device=device).expand(bs, S)
    ctx_kv = [layer.self_attn.keys_values(ctx_hidden, pos) for layer in model.layers]
    visible = torch.ones(bs, 1, S, dtype=torch.bool, device=device)
    block_pos = (S + torch.arange(B, device=device)).expand(bs, 1, B)
    out = model.forward_blocks(emb.view(bs, 1, B, H), block_pos, ctx_kv, visible, anchors.view(bs, 1))
    ref = model.draft(out, head, anchors)
    # DFlash: the same layers without the injection, the final norm, the argmax of fp32 logits
    x, mask = emb.view(bs, B, H), model.block_mask(visible)
    for l, layer in enumerate(model.layers):
        x = layer(x, block_pos.view(bs, B), ctx_kv[l], mask)
    ref_dflash = (model.norm(x)[:, 1:].float() @ head.float().T).argmax(-1)

    want = {"dspine": ref.tokens, "dspine_torch": ref.tokens, "dflash": ref_dflash}
    agree = {k: (got[k].view(bs, B - 1) == want[k]).float().mean().item() for k in got}
    res = {"shape": "tiny" if H == TINY["hidden"] else "qwen3-8b", "dtype": str(dt), "bs": bs, "context": S,
           "final_hidden_rel_err": rel(hidden, out.hidden[:, 0]),
           "token_agreement": agree, "exact": exact}
    # the timed tree variant's trees against tree.lattice_tree of the plain drafter's draft, per request
    budget = min(TREE_BUDGETS)
    trees = db.dspine_tree(budget)[0]
    want_trees = [lattice_tree(ref, budget, index=i) for i in range(bs)]
    res["tree_agreement"] = sum(trees.tokens[i].tolist() == t.tokens and trees.parents[i].tolist() == t.parents
                                for i, t in enumerate(want_trees)) / bs
    # in bf16 the two drafts' scores differ slightly (final_hidden_rel_err), so near-equal paths can trade places
    # and a whole tree rarely matches: the share of the plain drafter's tree paths the timed tree holds too
    got_paths = [{tuple(DraftTree(trees.tokens[i].tolist(), trees.parents[i].tolist(), trees.depths[i].tolist(),
                                  [0.0] * len(t)).path(n)) for n in range(len(t))} for i, t in enumerate(want_trees)]
    res["tree_path_overlap"] = sum(len(got_paths[i] & {tuple(t.path(n)) for n in range(len(t))}) / len(t)
                                   for i, t in enumerate(want_trees)) / bs
    if exact:
        res["ok"] = all(torch.equal(got[k].view(bs, B - 1), want[k]) for k in got) and res["tree_agreement"] == 1
    return res


def section_step(bench, model, head, steps, bs, s, res) -> dict:
    db = DraftStepBench(model, head, steps, bs, s["ctx"])
    t = bench.time_interleaved(db.variants(), res, f"step bs={bs}")
    del db
    out = {name: round(v["us"], 1) for name, v in t.items()}
    out["timing"] = t
    d = out.get("dflash")
    if d:
        for name in STEP_VARIANTS[1:]:
            if name in out:
                out[f"ratio_{name}"] = out[name] / d
                out[f"overhead_{name}_us"] = round(out[name] - d, 1)
        if "dspine" in out:
            out["ratio"], out["overhead_us"] = out["ratio_dspine"], out["overhead_dspine_us"]
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
    print(f"  bs={bs:3d} {section:10s} {variant:44s} {t['us']:10.1f} us"
          + (f"  {row['GBps']:8.0f} GB/s" if nbytes else ""), flush=True)


def section_kernels(bench, model, head, steps, bs, s, res, ceiling, sweep: bool):
    step = steps["kernels"]
    w, tables = step.weights, step.tables  # the server's own weights layout and per-token tables
    dev, dt = head.device, head.dtype
    H, r, m, K, B, V = s["hidden"], s["rank"], s["message"], s["top_k"], s["block"], s["vocab"]
    P, n = B - 1, bs * B
    eb = torch.finfo(dt).bits // 8
    g = torch.Generator(device=dev).manual_seed(bs)
    h = torch.randn(n, H, device=dev, dtype=dt, generator=g)
    anchors = torch.randint(0, V, (bs,), device=dev, generator=g)

    def timed(section, variant, fn, nbytes=None, flops=None):
        t = try_time(bench, res, f"{variant} bs={bs}", fn)
        if t:
            rec(res, bs, section, variant, t, nbytes, flops, ceiling)

    # ---- injection: the gate pass alone
    z, y, _ = kinj.project(h, 0, w)
    msg = torch.empty(n, m, device=dev, dtype=dt)
    recv = torch.empty(n, m, device=dev)
    nbytes = eb * n * (H + r + 3 * m + m) + 4 * n * m + eb * bs * 2 * m
    for variant, fn in (("gate_message triton", kinj.gate_message), ("gate_message torch", kinj.gate_message_torch)):
        timed("injection", variant,
              lambda fn=fn: fn(h, z, y, anchors, tables.pred_proj, w.bias, B, msg, recv), nbytes)

    # ---- injection: one whole layer (what DraftStep.inject runs, less the add SGLang's next norm does)
    last = w.num_layers - 1
    wbytes = eb * (r * H + 3 * m * r + H * m)
    lbytes = eb * 2 * n * H + wbytes + eb * bs * 2 * m
    lflops = 2 * n * (H * r + r * 3 * m + m * H)
    anchor_codes = model.transfer_codes[anchors]
    variants = [
        ("injection_delta triton", lambda: kinj.injection_delta(h, 0, w, anchors, tables.pred_proj, B), lbytes),
        ("injection_delta triton last layer (recv, uh)",
         lambda: kinj.injection_delta(h, last, w, anchors, tables.pred_proj, B, recv_out=recv),
         lbytes + eb * (m * H + n * m) + 4 * n * m),
        ("injection_delta torch pass",
         lambda: kinj.injection_delta(h, 0, w, anchors, tables.pred_proj, B, kernel=False), lbytes),
        # attribution: the cuBLAS GEMMs of injection_delta alone (no gate pass)
        ("injection_delta GEMMs only", lambda: torch.mm(kinj.project(h, 0, w)[1][:, :m], w.writes[0].t()), lbytes),
        # what DraftStep(kernels=False).inject runs
        ("AdjacentInjection.forward", lambda: model.injection(0, h.view(bs, B, H), anchor_codes), lbytes),
    ]
    for variant, fn, nb in variants:
        timed("inj_layer", variant, fn, nb, lflops)

    # ---- transition
    pre_full = torch.randn(bs, B, H, device=dev, dtype=dt, generator=g)
    pre = pre_full[:, 1:]
    cand = torch.randint(0, V, (bs, P, K), device=dev, generator=g)
    recv_p = torch.randn(bs, B, m, device=dev, generator=g)[:, 1:]
    uh = torch.matmul(pre_full, w.writes[-1])[:, 1:]
    outs = (torch.empty(bs, P, K, K, device=dev), torch.empty(bs, P, device=dev, dtype=torch.long),
            torch.empty(bs, P, device=dev, dtype=torch.long))
    nw, eps = step.norm.weight, step.norm.variance_epsilon
    args = (pre, recv_p, uh, cand, anchors, tables.pred_proj, tables.head_proj, head, nw, w.bias, tables.rfac, eps)
    tbytes = (eb * bs * P * (K * H + H + K * 3 * m + m) + 4 * bs * P * m + eb * m * (m + 1) // 2
              + 4 * bs * P * K * K + 8 * bs * P * (K + 2))
    tflops = 2 * bs * P * K * (H + K * m + m + m * m / 2)
    configs = [ktr.POSITION_CONFIG] + ([c for c in POSITION_SWEEP if c != ktr.POSITION_CONFIG] if sweep else [])
    for cfg in configs:
        default = " (default)" if cfg == ktr.POSITION_CONFIG else ""
        timed("transition", f"score_walk triton cfg={cfg}{default}",
              lambda cfg=cfg: ktr.transition_scores_walk(*args, *outs, position_config=cfg), tbytes, tflops)
    timed("transition", "score_walk torch", lambda: ktr.transition_scores_walk_torch(*args, *outs), tbytes, tflops)
    # the whole decoding after top-K: as DraftStep.decode calls it (recv and uh from the last injection), and
    # the drafter's math that DraftStep(kernels=False) runs (materialised refinement, scores, walk)
    whole = tbytes + eb * (bs * P * H + H * m)
    timed("transition", "transition_walk triton (as served)",
          lambda: ktr.transition_walk(pre, cand, anchors, w, tables, head, nw, eps, recv=recv_p, uh=uh, out=outs),
          whole)
    timed("transition", "drafter math (refine_normed)",
          lambda: drafter_transition(steps["torch"], head, pre, cand, anchors), whole)

    # ---- top-K of the logits
    logits = (torch.randn(bs * P, V, device=dev, generator=g) * 3).to(dt)
    vals = torch.empty(bs * P, K, device=dev, dtype=dt)
    idx = torch.empty(bs * P, K, device=dev, dtype=torch.long)
    scratch = torch.empty(bs * P, triton.cdiv(V, ktopk.GROUP), device=dev)
    kb = eb * bs * P * V
    for variant, fn in (("topk triton", lambda: ktopk.topk(logits, K, vals, idx, scratch)),
                        ("torch.topk", lambda: torch.topk(logits, K, dim=-1)),
                        ("torch.argmax (DFlash)", lambda: logits.argmax(-1))):
        timed("topk", variant, fn, kb)


def drafter_transition(step: DraftStep, head, pre, cand, anchors):
    """decode_block after its top-K, as DraftStep(kernels=False) runs it: refine_normed, scores, walk."""
    refined = step.refine_normed(pre, step.codes[predecessor_tokens(cand, anchors)])
    scores = transition_scores(refined, head[cand])
    choice = walk(scores)
    return cand.gather(-1, choice.unsqueeze(-1)).squeeze(-1), choice, scores


# ------------------------------------------------------------------------------- against the server
def _mean_step_us(serving: dict, name: str, clients: int, temperature: float) -> float | None:
    vals = [r["step_ms"] for rnd in serving.get("rounds", []) for r in rnd.get(name, [])
            if r.get("clients") == clients and r.get("temperature") == temperature and r.get("step_ms")]
    return 1000.0 * sum(vals) / len(vals) if vals else None


def serving_comparison(summary: dict, serving: dict) -> list[dict]:
    """Per client count (= batch size) and temperature of a serving_scale.json: the server's DSPINE − DFLASH
    µs per step, from its step times (wall) and, where profiled, its GPU time per step; this benchmark's draft
    step overhead at that batch size; and the server step ratio the overhead predicts,
    (DFLASH step + overhead) ÷ DFLASH step, beside the measured one."""
    over = summary.get("draft_step_overhead_us", {})
    ratio = summary.get("draft_step_ratio", {})
    rows = []
    for c in serving.get("clients", []):
        for temp in serving.get("temperatures", [0.0]):
            d, s = _mean_step_us(serving, "dflash", c, temp), _mean_step_us(serving, "dspine", c, temp)
            b = over.get(str(c))
            row = {"clients": c, "temperature": temp, "server_dflash_step_us": d, "server_dspine_step_us": s,
                   "server_overhead_us": s - d if d and s else None,
                   "server_step_ratio": s / d if d and s else None,
                   "bench_overhead_us": b, "bench_draft_ratio": ratio.get(str(c))}
            if d and s and b is not None:
                row["predicted_step_ratio"] = (d + b) / d
                row["prediction_error"] = row["predicted_step_ratio"] / row["server_step_ratio"] - 1
            prof = serving.get("profile", {}).get(f"c{c}", {})
            pd, ps = (prof.get(n, {}).get("gpu_us_per_step") for n in ("dflash", "dspine"))
            if temp == 0 and pd and ps:  # the profiles run a greedy load
                row.update(profile_overhead_us=ps - pd, profile_step_ratio=ps / pd)
                if b is not None:
                    row["profile_predicted_ratio"] = (pd + b) / pd
            rows.append(row)
    return rows


def print_serving_comparison(rows: list[dict], summary: dict, serving: dict) -> None:
    def f(v, spec):
        return format(v, spec) if v is not None else format("-", ">" + spec.lstrip("+").split(".")[0])

    prov = serving.get("provenance", {})
    print(f"server: {serving.get('geometry_name')} commit {str(prov.get('commit'))[:10]} {prov.get('gpu')}, "
          f"cuda graphs up to bs {serving.get('graph_bs')}; benchmark: commit {str(summary.get('commit'))[:10]} "
          f"{summary.get('gpu')}")
    print(f"{'c':>3} {'T':>3} | {'server DFLASH':>13} {'DSPINE':>9} {'over µs':>8} {'ratio':>6} | "
          f"{'profile over':>12} {'ratio':>6} {'predicted':>9} | {'bench over':>10} {'draft ratio':>11} | "
          f"{'predicted':>9} {'error':>7}")
    for r in rows:
        print(f"{r['clients']:>3} {r['temperature']:>3g} | {f(r['server_dflash_step_us'], '13.0f')} "
              f"{f(r['server_dspine_step_us'], '9.0f')} {f(r['server_overhead_us'], '8.0f')} "
              f"{f(r['server_step_ratio'], '6.3f')} | {f(r.get('profile_overhead_us'), '12.0f')} "
              f"{f(r.get('profile_step_ratio'), '6.3f')} {f(r.get('profile_predicted_ratio'), '9.3f')} | "
              f"{f(r['bench_overhead_us'], '10.0f')} "
              f"{f(r['bench_draft_ratio'], '11.3f')} | {f(r.get('predicted_step_ratio'), '9.3f')} "
              f"{f(r.get('prediction_error'), '+7.1%')}")
    print("predicted = (server DFLASH step + bench overhead) / server DFLASH step, from the wall step times "
          "(error = predicted / measured - 1) and from the profile's GPU µs per step")


# --------------------------------------------------------------------------------------------- main
def summarize(res: dict, smoke: bool) -> dict:
    st = res["draft_step"]
    return {
        "command": res["command"], "commit": res["commit"], "gpu": res["gpu"], "date": res["date"],
        "versions": res["versions"], "shapes": res["shapes"], "context": res["shapes"]["ctx"],
        "copy_ceiling_GBps": res.get("copy_ceiling_GBps"),
        "draft_step_overhead_us": {k: v["overhead_us"] for k, v in st.items() if "overhead_us" in v},
        "draft_step_ratio": {k: v["ratio"] for k, v in st.items() if "ratio" in v},
        "draft_step_overhead_torch_us": {k: v["overhead_dspine_torch_us"] for k, v in st.items()
                                         if "overhead_dspine_torch_us" in v},
        "draft_step_overhead_injection_us": {k: v["overhead_dspine_injection_only_us"] for k, v in st.items()
                                             if "overhead_dspine_injection_only_us" in v},
        "draft_step_us": {k: {n: v[n] for n in STEP_VARIANTS if n in v} for k, v in st.items()},
        "draft_tree_over_dflash_step": {k: {n: round(v[f"ratio_dspine_tree_{n}"], 4) for n in TREE_BUDGETS
                                            if f"ratio_dspine_tree_{n}" in v} for k, v in st.items()},
        "draft_check": res.get("draft_check"), "draft_check_bf16_agreement":
            (res.get("draft_check_bf16") or {}).get("token_agreement"),
        "tables_bytes": res.get("tables_bytes"),
        "errors": len(res["errors"]), "skipped": res["skipped"], "smoke": smoke,
    }


def parse_args() -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bs", default=None, help="batch sizes (requests per draft step; default 1,4,16,48,64, "
                    "--smoke: 1,3)")
    ap.add_argument("--out", default=None, help=f"results folder (default {RESULTS}; --smoke: a temporary one)")
    ap.add_argument("--copy-to", default=None, help="also copy the JSON files here (e.g. $OUT)")
    ap.add_argument("--budget", type=float, default=400.0,
                    help="seconds; sections that do not fit are skipped (the draft steps run first)")
    ap.add_argument("--no-sweep", action="store_true", help="no sweep of the transition's launch configuration")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU through TRITON_INTERPRET")
    ap.add_argument("--compare-serving", metavar="SERVING_SCALE_JSON", default=None,
                    help="run nothing: print the server's DSPINE-DFLASH µs/step beside --summary's overhead")
    ap.add_argument("--summary", default=os.path.join(RESULTS, "kernels_summary.json"),
                    help="this benchmark's summary for --compare-serving")
    args = ap.parse_args()
    try:
        args.bs = [int(x) for x in (args.bs or ("1,3" if args.smoke else "1,4,16,48,64")).split(",")]
    except ValueError:
        ap.error(f"--bs: expected comma-separated integers, found {args.bs!r}")
    if any(b < 1 for b in args.bs):
        ap.error(f"--bs: batch sizes must be positive, found {args.bs!r}")
    return ap, args


def compare_serving(ap: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """--compare-serving: the server's DSPINE − DFLASH per step beside this benchmark's summary; runs nothing."""
    for p in (args.compare_serving, args.summary):
        if not os.path.isfile(p):
            ap.error(f"{p}: no such file")
    serving, summary = json.load(open(args.compare_serving)), json.load(open(args.summary))
    if "rounds" not in serving or "clients" not in serving:
        ap.error(f"{args.compare_serving}: not a serving_scale.json (no 'rounds'/'clients')")
    if "draft_step_overhead_us" not in summary:
        ap.error(f"{args.summary}: not a kernels_summary.json (no 'draft_step_overhead_us')")
    print_serving_comparison(serving_comparison(summary, serving), summary, serving)
    return 0


def copy_ceiling(bench: Bench, res: dict) -> None:
    """1. the device's copy bandwidth (GB/s of a bf16 copy, eager and graphed, and of an elementwise kernel)."""
    x = torch.empty(512 << 20, dtype=torch.bfloat16, device=bench.device)
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


def guarded(res: dict, what: str, fn) -> None:
    """fn(), an exception recorded in res["errors"] under `what` (e.g. out of memory at one batch size)."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        res["errors"].append(f"{what}: {e!r}")
        traceback.print_exc()


def draft_check(res: dict, key: str, model, head, steps, device: str, exact: bool) -> None:
    """2. the timed paths' tokens against the plain drafter's (exact at float32, agreement in bf16)."""
    res[key] = check_draft_step(model, head, steps, device, exact=exact)
    print(f"{key}:", res[key], flush=True)
    if exact and not res[key]["ok"]:
        res["errors"].append("draft check: the timed paths' tokens differ from the plain drafter's")


def tiny_check(res: dict, device: str) -> None:
    """2. the benchmark runs the right math: the tiny shape in float32, its tokens exact."""
    model, head = build_model(TINY, device, torch.float32)
    draft_check(res, "draft_check", model, head, served_steps(model, head), device, exact=True)


def by_batch(bench: Bench, res: dict, what: str, sizes: list[int], need_s: float, run, save) -> None:
    """run(bs) for each batch size while need_s seconds of the budget are left (else recorded as skipped), an
    error recorded (run the next), the results saved after each."""
    for bs in sizes:
        if bench.left() < need_s:
            res["skipped"].append(f"{what} bs={bs}")
            continue
        print(f"{what} bs={bs}", flush=True)
        guarded(res, f"{what} bs={bs}", lambda bs=bs: run(bs))
        save()
        if bench.gpu:
            torch.cuda.empty_cache()


def smoke_comparison(res: dict, bss: list[int]) -> None:
    """--smoke: the serving comparison on a synthetic server whose DSPINE step is DFLASH's plus this run's
    overhead; it must predict that overhead exactly."""
    summary = summarize(res, True)
    fake = {"clients": bss, "temperatures": [0.0], "rounds": [{
        "dflash": [{"clients": c, "temperature": 0.0, "step_ms": 10.0} for c in bss],
        "dspine": [{"clients": c, "temperature": 0.0, "step_ms": 10.0 + summary["draft_step_overhead_us"][str(c)]
                    / 1000.0} for c in bss]}], "profile": {}}
    rows = serving_comparison(summary, fake)
    print_serving_comparison(rows, summary, fake)
    if not all(abs(r["prediction_error"]) < 1e-9 for r in rows):
        res["errors"].append("serving comparison: a server with exactly the benchmark's overhead not predicted")


def main() -> int:
    ap, args = parse_args()
    if args.compare_serving:
        return compare_serving(ap, args)
    t_start = time.time()
    s = dict(TINY if args.smoke else QWEN3_8B)
    device = "cpu" if args.smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        ap.error("no CUDA device (use --smoke for the CPU check)")
    out_dir = args.out or (tempfile.mkdtemp(prefix="dspine_kernels_smoke_") if args.smoke else RESULTS)
    dtype, bss = (torch.float32 if args.smoke else torch.bfloat16), args.bs
    bench = Bench(device, t_start + args.budget)
    res = {
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "commit": git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name() if device == "cuda" else "cpu (smoke, TRITON_INTERPRET)",
        "versions": {"torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda},
        "dtype": str(dtype), "shapes": s, "batch_sizes": bss,
        "results": [], "draft_step": {}, "errors": [], "skipped": [],
    }
    paths = [os.path.join(out_dir, "kernels.json"), os.path.join(out_dir, "kernels_summary.json")]

    def save():
        res["elapsed_s"] = round(time.time() - t_start, 1)
        for p, obj in zip(paths, (res, summarize(res, args.smoke))):
            write_json(p, obj)
            if args.copy_to:
                os.makedirs(args.copy_to, exist_ok=True)
                shutil.copy(p, args.copy_to)

    if bench.gpu:
        copy_ceiling(bench, res)
    guarded(res, "draft check", lambda: tiny_check(res, device))
    save()
    model, head = build_model(s, device, dtype)
    t0 = time.time()
    steps = served_steps(model, head)
    res["tables_build_s"] = round(time.time() - t0, 2)
    res["tables_bytes"] = steps["kernels"].tables.nbytes
    if bench.gpu:  # the same check at the benchmark's shapes in bf16: agreement only
        guarded(res, "draft check bf16",
                lambda: draft_check(res, "draft_check_bf16", model, head, steps, device, exact=False))
    save()

    def draft_step(bs):
        st = res["draft_step"][str(bs)] = section_step(bench, model, head, steps, bs, s, res)
        print("  ", {k: (round(v, 3) if isinstance(v, float) else v) for k, v in st.items() if k != "timing"},
              flush=True)

    # 3. the draft steps (the headline), every batch size; 4. kernels vs references, the largest batch first
    by_batch(bench, res, "draft step", bss, 20, draft_step, save)
    by_batch(bench, res, "kernels", sorted(bss, reverse=True), 15, lambda bs: section_kernels(
        bench, model, head, steps, bs, s, res, res.get("copy_ceiling_GBps"),
        sweep=not args.no_sweep and not args.smoke and bench.left() > 60), save)
    if args.smoke:
        smoke_comparison(res, bss)
    save()
    print_table(res)
    print("wrote", *paths)
    return 1 if res["errors"] else 0


def print_table(res) -> None:
    def get(bs, section, prefix):
        for r in res["results"]:
            if r["bs"] == bs and r["section"] == section and r["variant"].startswith(prefix):
                return r
        return None

    def us(r):
        return "-" if r is None else f"{r['us']:.1f}"

    print("\n== DSpine draft step and kernels, {} (copy ceiling {:.0f} GB/s), commit {} ==".format(
        res["gpu"], res.get("copy_ceiling_GBps") or 0, res["commit"][:10]))
    print(f"{'bs':>3} | {'DFlash':>8} {'DSpine':>8} {'ratio':>6} {'over':>6} | {'torch math':>10} {'ratio':>6} | "
          f"{'inj only':>8} | {'gate tri/torch':>14} | {'inj layer tri/torch/module':>26} | "
          f"{'score_walk tri/torch':>20} | {'walk':>6} | {'topk tri/torch/argmax':>22}")
    nan = float("nan")
    for bs in res["batch_sizes"]:
        st = res["draft_step"].get(str(bs), {})
        print(f"{bs:>3} | {st.get('dflash', nan):>8.1f} {st.get('dspine', nan):>8.1f} {st.get('ratio', nan):>6.3f} "
              f"{st.get('overhead_us', nan):>6.0f} | {st.get('dspine_torch', nan):>10.1f} "
              f"{st.get('ratio_dspine_torch', nan):>6.3f} | {st.get('dspine_injection_only', nan):>8.1f} | "
              f"{us(get(bs, 'injection', 'gate_message triton')):>6}/"
              f"{us(get(bs, 'injection', 'gate_message torch')):>7} | "
              f"{us(get(bs, 'inj_layer', 'injection_delta triton')):>8}/"
              f"{us(get(bs, 'inj_layer', 'injection_delta torch')):>8}/"
              f"{us(get(bs, 'inj_layer', 'AdjacentInjection.forward')):>8} | "
              f"{us(get(bs, 'transition', 'score_walk triton cfg=' + str(ktr.POSITION_CONFIG))):>9}/"
              f"{us(get(bs, 'transition', 'score_walk torch')):>10} | "
              f"{us(get(bs, 'transition', 'transition_walk triton')):>6} | "
              f"{us(get(bs, 'topk', 'topk triton')):>6}/{us(get(bs, 'topk', 'torch.topk')):>7}/"
              f"{us(get(bs, 'topk', 'torch.argmax')):>7}")
    if res["errors"]:
        print(f"errors: {len(res['errors'])}:", *res["errors"], sep="\n  ")
    if res["skipped"]:
        print("skipped:", ", ".join(res["skipped"]))


if __name__ == "__main__":
    sys.exit(main())
