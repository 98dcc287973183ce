#!/usr/bin/env python3
"""The objective's vocabulary-sized work, fwd+bwd under the trainer's checkpoint: the former float32
formulation against `sglang_dspine.objective.vocab_terms` (the vocab_loss kernel on CUDA), per kind.

One chunk of the objective at Qwen3-8B geometry: 128 blocks × 15 positions = 1920 rows, hidden 4096, the
151936-token bf16 head, bf16 autocast, float32 hidden states (what the drafter hands the objective), random
labels and weights. Per kind, what the vocabulary costs:
  dspine (ce_weight 0.1): the drafter's and the teacher's logits, CE, argmax, L1 to the teacher, top-16 and the
    teacher's probabilities of the candidates (their sum is the refinement's candidate mass);
  dflash (ce_weight 1):   the drafter's logits, CE, argmax, top-16 (the coverage metric).
"old" is the former code (log_softmax, softmax and the L1 on float32 [rows, V] tensors, kept here verbatim
as the baseline), "new" the objective's `vocab_terms` (`--path kernel` or `torch`: the kernel or its PyTorch
math). Each variant runs as the trainer runs a chunk (torch.utils.checkpoint, so the forward twice) and reports
the median ms of fwd+bwd over --iters, the peak memory above the inputs, and how old and new agree (CE and L1
sums, the gradient of the hidden states, argmax, the top-K sets, the teacher's candidate probabilities).

    python benchmarks/vocab_loss.py --out /tmp/vocab_loss.json                   # H200, the real shape
    python benchmarks/vocab_loss.py --rows 30 --vocab 1000 --hidden 64 --path torch --out /tmp/v.json   # CPU check
Writes JSON with provenance (command, commit, GPU, versions, date).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
from torch.utils.checkpoint import checkpoint

HERE = os.path.dirname(os.path.abspath(__file__))
CE_WEIGHT = {"dspine": 0.1, "dflash": 1.0}


def old_vocab(hidden, t_hidden, head, labels, weights, k, cw):
    """The former `_terms` vocabulary code: (loss, argmax, cand, t_cand, mass)."""
    from sglang_dspine.objective import _head_logits

    logits = _head_logits(hidden, head).float()
    logp = logits.log_softmax(-1)
    ce = -logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    loss = cw * (ce * weights).sum()
    with torch.no_grad():
        amax = logits.argmax(-1)
    teacher = t_cand = mass = None
    if t_hidden is not None:
        with torch.no_grad():
            teacher = _head_logits(t_hidden, head).float().softmax(-1)
    if cw < 1:
        l1 = (logp.exp() - teacher).abs().sum(-1)
        loss = loss + (1 - cw) * (l1 * weights).sum()
    cand = logits.detach().topk(min(k, logits.shape[-1]), dim=-1).indices
    if teacher is not None:
        t_cand = teacher.gather(-1, cand)
        mass = t_cand.sum(-1)
    return loss, amax, cand, t_cand, mass


def new_vocab(hidden, t_hidden, head, labels, weights, k, cw, kernel):
    from sglang_dspine.objective import vocab_terms

    v = vocab_terms(hidden, t_hidden, head, labels, k, cw < 1, kernel=kernel)
    loss = cw * (v.ce * weights).sum()
    if cw < 1:
        loss = loss + (1 - cw) * (v.l1 * weights).sum()
    mass = v.teacher_cand.sum(-1) if v.teacher_cand is not None else None
    return loss, v.argmax, v.cand, v.teacher_cand, mass


def make_inputs(rows, vocab, hidden, device, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    dt = torch.bfloat16 if device.type == "cuda" else torch.float32
    blocks, pos = max(1, rows // 15), min(rows, 15)
    head = (torch.randn(vocab, hidden, generator=g) / hidden ** 0.5 * 2).to(device=device, dtype=dt)
    h = torch.randn(blocks, pos, hidden, generator=g).to(device)
    th = torch.randn(blocks, pos, hidden, generator=g).to(device)
    labels = torch.randint(0, vocab, (blocks, pos), generator=g).to(device)
    weights = torch.rand(blocks, pos, generator=g).to(device)
    return head, h, th, labels, weights


def run_variant(fn, inputs, needs_teacher, device, iters, warmup, autocast):
    head, h, th, labels, weights = inputs
    x = h.clone().requires_grad_()
    t = th if needs_teacher else None

    def step():
        x.grad = None
        # enable_grad: provenance() imports sglang, and that import can leave autograd switched off
        with torch.enable_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            out = checkpoint(lambda xx: fn(xx, t, head, labels, weights), x, use_reentrant=False)
            out[0].backward()
        return out

    for _ in range(warmup):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            out = step()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            out = step()
            times.append((time.perf_counter() - t0) * 1e3)
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30 if device.type == "cuda" else None
    return {"ms": statistics.median(times), "ms_all": [round(v, 3) for v in times],
            "peak_gib_above_inputs": peak}, out, x.grad.detach().clone()


def rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def agreement(old, new, g_old, g_new):
    loss_o, am_o, cand_o, tc_o, mass_o = old
    loss_n, am_n, cand_n, tc_n, mass_n = new
    res = {"loss_rel": abs(float(loss_n) - float(loss_o)) / max(abs(float(loss_o)), 1e-30),
           "grad_hidden_rel": rel(g_new, g_old),
           "argmax_agree": float((am_o == am_n).float().mean()),
           "topk_set_agree": float((cand_o.sort(-1).values == cand_n.sort(-1).values).all(-1).float().mean())}
    if tc_o is not None:
        # per row the candidates may come in another order: compare the teacher's probabilities as sorted
        res["teacher_cand_max_abs"] = float((tc_o.sort(-1).values - tc_n.sort(-1).values).abs().max())
        res["mass_max_abs"] = float((mass_o - mass_n).abs().max())
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=1920, help="rows of one chunk (128 blocks × 15 positions)")
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--top-k", type=int, default=16)
    ap.add_argument("--kinds", default="dspine,dflash")
    ap.add_argument("--path", choices=("kernel", "torch"), help="the new code's path (default: kernel on CUDA, "
                    "else torch)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--device", help="default: cuda if present, else cpu")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "vocab_loss.json"))
    args = ap.parse_args(argv)
    from sglang_dspine.provenance import provenance

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    path = args.path or ("kernel" if device.type == "cuda" else "torch")
    if path == "kernel" and device.type != "cuda":
        import triton
        if not triton.knobs.runtime.interpret:
            ap.error("--path kernel: needs CUDA (or TRITON_INTERPRET=1)")
    autocast = device.type == "cuda"
    if args.rows % 15 and args.rows > 15:
        ap.error(f"--rows {args.rows}: a multiple of 15 (blocks × the 15 supervised positions)")
    inputs = make_inputs(args.rows, args.vocab, args.hidden, device)
    res = {"rows": args.rows, "vocab": args.vocab, "hidden": args.hidden, "top_k": args.top_k, "new_path": path,
           "device": str(device), "precision": "bf16 autocast, bf16 head, float32 hidden" if autocast else "float32",
           "timing": "median ms of forward + recomputed forward + backward under torch.utils.checkpoint",
           "kinds": {}, **provenance(argv if argv is not None else sys.argv)}
    for kind in args.kinds.split(","):
        if kind not in CE_WEIGHT:
            ap.error(f"--kinds: unknown kind {kind!r} (dspine, dflash)")
        cw = CE_WEIGHT[kind]
        needs_teacher = kind == "dspine"
        old_fn = lambda h, t, hd, l, w: old_vocab(h, t, hd, l, w, args.top_k, cw)  # noqa: E731
        new_fn = lambda h, t, hd, l, w: new_vocab(h, t, hd, l, w, args.top_k, cw, path == "kernel")  # noqa: E731
        r_old, out_old, g_old = run_variant(old_fn, inputs, needs_teacher, device, args.iters, args.warmup, autocast)
        r_new, out_new, g_new = run_variant(new_fn, inputs, needs_teacher, device, args.iters, args.warmup, autocast)
        res["kinds"][kind] = {"ce_weight": cw, "old": r_old, "new": r_new, "speedup": r_old["ms"] / r_new["ms"],
                              "agreement": agreement(out_old, out_new, g_old, g_new)}
        print(f"{kind}: old {r_old['ms']:.2f} ms, new {r_new['ms']:.2f} ms ({path}), x{r_old['ms'] / r_new['ms']:.2f}; "
              f"peak GiB old {r_old['peak_gib_above_inputs']} new {r_new['peak_gib_above_inputs']}; "
              f"{res['kinds'][kind]['agreement']}", flush=True)
        del out_old, out_new, g_old, g_new
        if device.type == "cuda":
            torch.cuda.empty_cache()
    k = res["kinds"]
    if {"dspine", "dflash"} <= set(k):
        res["dspine_minus_dflash_ms"] = {v: k["dspine"][v]["ms"] - k["dflash"][v]["ms"] for v in ("old", "new")}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print("->", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
