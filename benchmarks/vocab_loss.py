#!/usr/bin/env python3
"""The objective's vocabulary-sized work of one micro-batch, fwd+bwd as the trainer runs it (chunks under
torch.utils.checkpoint): the former float32 formulation against the objective's code now (`teacher_logits` +
`vocab_terms`, the vocab_loss kernel on CUDA), per kind.

One micro-batch at Qwen3-8B geometry: 2 sequences × 2048 positions, 512 anchors each (sorted random, blocks of
16 overlapping as the trainer's do), 15 supervised positions per block, chunks of 128 blocks (1920 rows), hidden
4096, the 151936-token bf16 head, bf16 autocast, float32 drafter hidden states, random labels and weights, the
target's last hidden states in bf16. Per kind, the vocabulary's work:
  dspine (ce_weight 0.1): the drafter's and the teacher's logits, CE, argmax, L1 to the teacher, top-16 and the
    teacher's probabilities of the candidates (their sum is the refinement's candidate mass);
  dflash (ce_weight 1):   the drafter's logits, CE, argmax, top-16 (the coverage metric).
"old" is the former code, kept here verbatim as the baseline: per chunk, log_softmax, softmax and the L1 on
float32 [rows, V] tensors, the teacher's logits per (block, position) inside the checkpoint. "new" is the
objective's: the teacher's logits once per distinct position outside the checkpoint, per chunk `vocab_terms`
(`--path kernel` or `torch`: the kernel or its PyTorch math). Reported: median ms of fwd+bwd of the micro-batch
over --iters (a training step is grad_accum × sequences / 2 micro-batches of this), the peak memory above the
inputs, and how old and new agree (CE/L1 loss, the gradient of the hidden states, argmax, the top-K sets, the
teacher's candidate probabilities).

    python -m benchmarks vocab_loss --out /tmp/vocab_loss.json                   # H200, the real shape
    python -m benchmarks vocab_loss --seq-len 64 --anchors 8 --chunk-blocks 4 --vocab 500 --hidden 32 \
        --path torch --out /tmp/v.json                                            # CPU check
Writes JSON with provenance (command, commit, GPU, versions, date).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from torch.utils.checkpoint import checkpoint

from sglang_dspine.provenance import default_output
from sglang_dspine.source_files import as_package

if not __package__:  # run as a file (python benchmarks/vocab_loss.py): the package `benchmarks` first
    as_package(__file__)

from benchmarks.output import write_json  # noqa: E402

CE_WEIGHT = {"dspine": 0.1, "dflash": 1.0}
POSITIONS = 15  # supervised positions of a block of 16


def old_vocab(hidden, t_hidden, head, labels, weights, k, cw):
    """The former `_terms` vocabulary code, one chunk: (loss, argmax, cand, t_cand, mass)."""
    from sglang_dspine.training.objective import _head_logits

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


def new_vocab(hidden, t_logits, t_rows, head, labels, weights, k, cw, kernel):
    """One chunk through the objective's `vocab_terms`: (loss, argmax, cand, t_cand, mass)."""
    from sglang_dspine.training.objective import vocab_terms

    v = vocab_terms(hidden, head, labels, k, cw < 1, kernel=kernel, t_logits=t_logits, t_rows=t_rows)
    loss = cw * (v.ce * weights).sum()
    if cw < 1:
        loss = loss + (1 - cw) * (v.l1 * weights).sum()
    mass = v.teacher_cand.sum(-1) if v.teacher_cand is not None else None
    return loss, v.argmax, v.cand, v.teacher_cand, mass


def old_microbatch(x, inp, k, cw, chunk, teacher):
    """The former forward: the teacher's hidden states gathered per (block, position), then per chunk."""
    head, last, t_pos, labels, weights = inp
    t_hidden = last.index_select(0, t_pos.reshape(-1)).view(*t_pos.shape, -1) if teacher else None
    outs = []
    for a in range(0, x.shape[0], chunk):
        sl = slice(a, a + chunk)
        outs.append(checkpoint(old_vocab, x[sl], t_hidden[sl] if teacher else None, head, labels[sl], weights[sl],
                               k, cw, use_reentrant=False))
    return outs


def new_microbatch(x, inp, k, cw, chunk, teacher, kernel):
    """The objective's forward now: the teacher's logits of the distinct positions once, then per chunk."""
    from sglang_dspine.training.objective import teacher_logits

    head, last, t_pos, labels, weights = inp
    t_logits, t_rows = teacher_logits(last, t_pos, head) if teacher else (None, None)
    outs = []
    for a in range(0, x.shape[0], chunk):
        sl = slice(a, a + chunk)
        outs.append(checkpoint(new_vocab, x[sl], t_logits, t_rows[sl] if teacher else None, head, labels[sl],
                               weights[sl], k, cw, kernel, use_reentrant=False))
    return outs


def make_inputs(seqs, seq_len, anchors, vocab, hidden, device, seed=0):
    """(head [V, H], the target's last hidden states [seqs·seq_len, H], t_pos [blocks, 15] (each position's
    teacher: anchor + i - 1), labels, weights, drafter hidden states [blocks, 15, H] float32)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    dt = torch.bfloat16 if device.type == "cuda" else torch.float32
    if seq_len <= POSITIONS + 1 or anchors > seq_len - POSITIONS - 1:
        raise ValueError(f"--anchors {anchors} must fit in --seq-len {seq_len} minus a block")
    head = (torch.randn(vocab, hidden, generator=g) / hidden ** 0.5 * 2).to(device=device, dtype=dt)
    last = torch.randn(seqs * seq_len, hidden, generator=g).to(device=device, dtype=dt)
    a = torch.stack([torch.randperm(seq_len - POSITIONS - 1, generator=g)[:anchors].sort().values
                     for _ in range(seqs)])  # [seqs, anchors]
    t_pos = (a.unsqueeze(-1) + torch.arange(POSITIONS) + seq_len * torch.arange(seqs).view(-1, 1, 1))
    blocks = seqs * anchors
    labels = torch.randint(0, vocab, (blocks, POSITIONS), generator=g)
    weights = torch.rand(blocks, POSITIONS, generator=g)
    h = torch.randn(blocks, POSITIONS, hidden, generator=g)
    inp = (head, last, t_pos.reshape(blocks, POSITIONS).to(device), labels.to(device), weights.to(device))
    return inp, h.to(device)


def run_variant(fn, inp, h, device, iters, warmup, autocast):
    x = h.clone().requires_grad_()

    def step():
        x.grad = None
        # enable_grad: provenance() imports sglang, and that import can leave autograd switched off
        with torch.enable_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            outs = fn(x, inp)
            sum(o[0] for o in outs).backward()
        return outs

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
            outs = step()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            outs = step()
            times.append((time.perf_counter() - t0) * 1e3)
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30 if device.type == "cuda" else None
    cat = [sum(float(o[0]) for o in outs)] + [None if outs[0][i] is None else torch.cat([o[i] for o in outs])
                                             for i in range(1, 5)]
    return {"ms": statistics.median(times), "ms_all": [round(v, 3) for v in times],
            "peak_gib_above_inputs": peak}, cat, x.grad.detach().clone()


def rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def agreement(old, new, g_old, g_new):
    loss_o, am_o, cand_o, tc_o, mass_o = old
    loss_n, am_n, cand_n, tc_n, mass_n = new
    res = {"loss_rel": abs(loss_n - loss_o) / max(abs(loss_o), 1e-30),
           "grad_hidden_rel": rel(g_new, g_old),
           "argmax_agree": float((am_o == am_n).float().mean()),
           "topk_set_agree": float((cand_o.sort(-1).values == cand_n.sort(-1).values).all(-1).float().mean())}
    if tc_o is not None:
        # per row the candidates may come in another order: compare the probabilities sorted by candidate id
        so, sn = cand_o.sort(-1), cand_n.sort(-1)
        res["teacher_cand_max_abs"] = float((tc_o.gather(-1, so.indices) - tc_n.gather(-1, sn.indices)).abs().max())
        res["mass_max_abs"] = float((mass_o - mass_n).abs().max())
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqs", type=int, default=2, help="sequences per micro-batch")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--anchors", type=int, default=512, help="blocks per sequence")
    ap.add_argument("--chunk-blocks", type=int, default=128, help="blocks per checkpointed chunk")
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--top-k", type=int, default=16)
    ap.add_argument("--kinds", default="dspine,dflash")
    ap.add_argument("--path", choices=("kernel", "torch"), help="the new code's path (default: kernel on CUDA, "
                    "else torch)")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--device", help="default: cuda if present, else cpu")
    ap.add_argument("--out", default=default_output("vocab_loss.json"),
                    help="results JSON (default: $OUT or a temporary folder; the committed one: "
                         "benchmarks/results/vocab_loss.json)")
    args = ap.parse_args(argv)
    from sglang_dspine.provenance import provenance

    prov = provenance(argv if argv is not None else sys.argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    path = args.path or ("kernel" if device.type == "cuda" else "torch")
    if path == "kernel":
        from sglang_dspine.kernels.runtime import runs_on

        if not runs_on(device):
            ap.error("--path kernel: needs CUDA (or TRITON_INTERPRET=1)")
    kinds = args.kinds.split(",")
    for kind in kinds:
        if kind not in CE_WEIGHT:
            ap.error(f"--kinds: unknown kind {kind!r} (dspine, dflash)")
    autocast = device.type == "cuda"
    try:
        inp, h = make_inputs(args.seqs, args.seq_len, args.anchors, args.vocab, args.hidden, device)
    except ValueError as e:
        ap.error(str(e))
    blocks = args.seqs * args.anchors
    res = {"seqs": args.seqs, "seq_len": args.seq_len, "anchors": args.anchors, "chunk_blocks": args.chunk_blocks,
           "rows_per_chunk": args.chunk_blocks * POSITIONS, "chunks": -(-blocks // args.chunk_blocks),
           "teacher_positions": int(inp[2].unique().numel()), "vocab": args.vocab, "hidden": args.hidden,
           "top_k": args.top_k, "new_path": path, "device": str(device),
           "precision": "bf16 autocast, bf16 head and target states, float32 drafter states" if autocast
           else "float32",
           "timing": "median ms of one micro-batch: forward, recomputed forward and backward of every chunk",
           "kinds": {}, **prov}
    for kind in kinds:
        cw = CE_WEIGHT[kind]
        teacher = kind == "dspine"

        def old_fn(x, i, cw=cw, teacher=teacher):
            return old_microbatch(x, i, args.top_k, cw, args.chunk_blocks, teacher)

        def new_fn(x, i, cw=cw, teacher=teacher):
            return new_microbatch(x, i, args.top_k, cw, args.chunk_blocks, teacher, path == "kernel")

        r_old, out_old, g_old = run_variant(old_fn, inp, h, device, args.iters, args.warmup, autocast)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        r_new, out_new, g_new = run_variant(new_fn, inp, h, device, args.iters, args.warmup, autocast)
        res["kinds"][kind] = {"ce_weight": cw, "old": r_old, "new": r_new, "speedup": r_old["ms"] / r_new["ms"],
                              "agreement": agreement(out_old, out_new, g_old, g_new)}
        print(f"{kind}: old {r_old['ms']:.1f} ms, new {r_new['ms']:.1f} ms ({path}), x{r_old['ms'] / r_new['ms']:.2f}; "
              f"peak GiB old {r_old['peak_gib_above_inputs']} new {r_new['peak_gib_above_inputs']}; "
              f"{res['kinds'][kind]['agreement']}", flush=True)
        del out_old, out_new, g_old, g_new
        if device.type == "cuda":
            torch.cuda.empty_cache()
    k = res["kinds"]
    if {"dspine", "dflash"} <= set(k):
        res["dspine_minus_dflash_ms"] = {v: k["dspine"][v]["ms"] - k["dflash"][v]["ms"] for v in ("old", "new")}
    print("->", write_json(args.out, res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
