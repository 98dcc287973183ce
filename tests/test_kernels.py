"""Triton kernels (sglang_dspine.kernels) against their PyTorch references and the drafter's own math.

Without a GPU the kernels run through Triton's interpreter (conftest sets TRITON_INTERPRET=1; this module
checks it really is the interpreter). Outputs are pre-filled with NaN / poison so an unwritten element fails.
Tests marked `gpu` run the same checks at Qwen3-8B shapes on the device (scripts/device/kernels.sh).
"""
import dataclasses
import importlib
import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import sglang_dspine.kernels as K  # noqa: E402
from sglang_dspine.drafter.decoding import decode_block  # noqa: E402
from sglang_dspine.drafter.injection import AdjacentInjection  # noqa: E402
from sglang_dspine.kernels import injection as kinj  # noqa: E402
from sglang_dspine.kernels import top_k as ktopk
from sglang_dspine.kernels import transition as ktr

pytestmark = pytest.mark.usefixtures("no_grad")  # conftest.py

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
POISON = -7_777_777


def _interpreted() -> bool:
    from triton.runtime.interpreter import InterpretedFunction
    return isinstance(kinj._gate_message_kernel, InterpretedFunction)


if DEVICE == "cpu" and not _interpreted():
    # Imported before TRITON_INTERPRET was set (another module got there first): decorate again.
    for mod in (kinj, ktopk, ktr, K):
        importlib.reload(mod)
    from sglang_dspine.kernels import injection as kinj  # noqa: E402,F811
    from sglang_dspine.kernels import top_k as ktopk
    from sglang_dspine.kernels import transition as ktr


def gen(seed):
    return torch.Generator().manual_seed(seed)


def randn(*shape, g, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEVICE)


def rel_err(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


# numbers rounded once to the dtype: relative error of a whole tensor
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}
# Bounds of the low-precision comparisons, a few times the error measured on these inputs and far below what a
# wrong kernel gives (each test checks that a kernel without its gate bias fails its bound):
# the injection's delta against the float32 module: measured 4.3e-3 (bf16), 4.2e-4 (fp16), about one unit
# roundoff u (2^-8, 2^-11); bound 4u. A kernel without the gate bias: 5.4e-2.
INJECTION_TOL = {torch.float32: 1e-5, torch.bfloat16: 4 * 2**-8, torch.float16: 4 * 2**-11}
# the transition scores against the float32 reference on the same rounded inputs: measured 2.9e-4 (bf16), 1.6e-5
# (fp16); a kernel without the gate bias: 9.6e-3.
TRANSITION_TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-3, torch.float16: 2e-4}
# the whole decoding against the drafter's own (which rounds its refined states): measured 2.9e-3 (bf16), 2.9e-4
# (fp16).
WALK_TOL = {torch.bfloat16: 1e-2, torch.float16: 1.5e-3}


def kernel_tol(dtype):
    """Transition kernel vs its fp32 reference: the kernel rounds msg to the model dtype (tensor-core / GEMM
    operands), the reference does not; fp32 is exact up to summation order."""
    return TRANSITION_TOL[dtype]


def test_interpreter_is_used_on_cpu():
    if DEVICE == "cpu":
        assert os.environ.get("TRITON_INTERPRET") == "1"
        assert _interpreted()
        assert isinstance(ktr._position_kernel, type(kinj._gate_message_kernel))
    else:
        assert not _interpreted()


def make_injection(h, r, m, layers, seed, dtype=torch.float32):
    torch.manual_seed(seed)
    inj = AdjacentInjection(h, r, m, layers)
    g = gen(seed + 1)
    for p in inj.parameters():
        p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return inj.to(DEVICE)


def unit_codes(v, r, g):
    return torch.nn.functional.normalize(torch.randn(v, r, generator=g), dim=-1).to(DEVICE)


def pred_table(w, codes):
    """The per-token √r·C[v] [G_p; M]ᵀ rows the kernels read (TransitionTables.pred_proj), in float32."""
    return (math.sqrt(w.rank) * codes.float()) @ w.pred_maps.float().t()


# ------------------------------------------------------------------------------------------ injection
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_recv", [False, True])
def test_gate_message_kernel_matches_reference(dtype, with_recv):
    g = gen(0)
    bs, B, H, r, m, V = 3, 5, 64, 32, 16, 40
    n = bs * B
    h = randn(n, H, g=g, dtype=dtype)
    zy = randn(n, r + 3 * m + 3, g=g, dtype=dtype)  # z and y as strided views of one buffer
    z, y = zy[:, :r], zy[:, r:r + 3 * m]
    table = randn(V, 2 * m, g=g, dtype=dtype)
    anchors = torch.tensor([7, 0, 39], device=DEVICE)
    bias = randn(m, g=g, dtype=dtype, scale=0.3)
    outs = []
    for fn in (kinj.gate_message, kinj.gate_message_torch):
        msg = torch.full((n, m), float("nan"), dtype=dtype, device=DEVICE)
        recv = torch.full((n, m), float("nan"), dtype=torch.float32, device=DEVICE) if with_recv else None
        fn(h, z, y, anchors, table, bias, B, msg, recv)
        assert not msg.isnan().any()
        outs.append((msg, recv))
    (msg, recv), (msg_ref, recv_ref) = outs
    assert (msg.view(bs, B, m)[:, 0] == 0).all()
    assert rel_err(msg, msg_ref) < TOL[dtype]
    if with_recv:
        assert not recv.isnan().any()
        assert rel_err(recv, recv_ref) < 1e-5


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kernel", [True, False], ids=["triton", "torch"])
def test_injection_delta_matches_module(dtype, kernel):
    """state + injection_delta on flat [bs·B, H] states == AdjacentInjection.forward on [bs, B, H] (the drafter's
    math); the last layer's uh is state·U_L and its receiver terms are G_r φ_L."""
    bs, B, H, r, m, layers, V = 3, 5, 64, 32, 16, 2, 40
    inj = make_injection(H, r, m, layers, seed=2)
    g = gen(3)
    codes = unit_codes(V, r, g)
    anchors = torch.randint(0, V, (bs,), generator=g).to(DEVICE)
    h = randn(bs * B, H, g=g, dtype=dtype)
    w = kinj.InjectionWeights.from_module(inj, dtype)
    table = pred_table(w, codes).to(dtype)
    inj32 = AdjacentInjection(H, r, m, layers).to(DEVICE)  # the module in float32 on the same rounded weights
    inj32.load_state_dict({k: v.to(dtype).float() for k, v in inj.state_dict().items()})
    for layer in range(layers):
        last = layer == layers - 1
        recv = torch.full((bs * B, m), float("nan"), device=DEVICE) if last else None
        delta, uh = kinj.injection_delta(h, layer, w, anchors, table, B, recv_out=recv, kernel=kernel)
        assert not delta.isnan().any()
        assert (delta.view(bs, B, H)[:, 0] == 0).all()  # position 0 untouched
        ref = inj32(layer, h.float().view(bs, B, H), codes[anchors]).view(bs * B, H)
        want = ref - h.float()
        assert rel_err(delta, want) < INJECTION_TOL[dtype]
        no_bias = dataclasses.replace(w, bias=torch.zeros_like(w.bias))  # a kernel that drops the gate bias
        assert rel_err(kinj.injection_delta(h, layer, no_bias, anchors, table, B, kernel=kernel)[0], want) > \
            3 * INJECTION_TOL[dtype]
        if dtype == torch.float32:  # and the module itself, in its own dtype
            got = h + delta
            assert rel_err(got, inj(layer, h.view(bs, B, H), codes[anchors]).view(bs * B, H)) < 1e-5
        if last:
            assert rel_err(uh, h.float() @ w.writes[-1].float()) < TOL[dtype]
            want_recv = ktr.receiver_terms(h, w).view(bs, B, m)[:, 1:]
            assert rel_err(recv.view(bs, B, m)[:, 1:], want_recv) < 1e-5  # both in float32 (measured 7e-8)
        else:
            assert uh is None and recv is None


# ------------------------------------------------------------------------------------------------ topk
@pytest.mark.parametrize("dtype", DTYPES)
def test_topk_matches_torch(dtype):
    g = gen(5)
    n, v, k = 6, 1000, 8  # V not a multiple of the group size
    x = randn(n, v, g=g, dtype=dtype)
    vals = torch.full((n, k), float("nan"), dtype=dtype, device=DEVICE)
    idx = torch.full((n, k), POISON, dtype=torch.long, device=DEVICE)
    ktopk.topk(x, k, vals, idx)
    ref = torch.topk(x.float(), k, dim=-1)
    assert torch.equal(vals.float(), ref.values)
    assert torch.equal(x.gather(1, idx), vals)
    assert all(len(set(row.tolist())) == k for row in idx.cpu())
    if dtype == torch.float32:
        assert torch.equal(idx, ref.indices)


def test_topk_with_ties_is_a_valid_topk():
    g = gen(6)
    x = torch.randint(-4, 5, (5, 700), generator=g).float().to(DEVICE)  # many ties
    vals, idx = ktopk.topk(x, 16)
    ref = torch.topk(x, 16, dim=-1)
    assert torch.equal(vals, ref.values)
    assert torch.equal(x.gather(1, idx), vals)
    assert all(len(set(row.tolist())) == 16 for row in idx.cpu())


# ------------------------------------------------------------------------------------------ transition
def transition_inputs(dtype, bs=3, P=4, H=64, m=16, V=50, k=4, seed=7):
    g = gen(seed)
    pre_full = randn(bs, P + 1, H, g=g, dtype=dtype)
    pre = pre_full[:, 1:]  # strided view, as in serving ([bs, B, H] minus position 0)
    recv = randn(bs, P, m, g=g)
    uh = randn(bs, P, m, g=g, dtype=dtype)
    cand = torch.stack([torch.randperm(V, generator=g)[:k] for _ in range(bs * P)]).view(bs, P, k).to(DEVICE)
    anchors = torch.randint(0, V, (bs,), generator=g).to(DEVICE)
    pred_proj = randn(V, 2 * m, g=g, dtype=dtype)
    head_proj = randn(V, m, g=g, dtype=dtype, scale=0.3)
    head = randn(V, H, g=g, dtype=dtype)
    norm_w = (torch.rand(H, generator=g) + 0.5).to(dtype).to(DEVICE)
    bias = randn(m, g=g, dtype=dtype, scale=0.3)
    rfac = torch.tril(randn(m, m, g=g, scale=0.3)).to(dtype)
    return pre, recv, uh, cand, anchors, pred_proj, head_proj, head, norm_w, bias, rfac


def poisoned_outputs(bs, P, k):
    return (torch.full((bs, P, k, k), float("nan"), device=DEVICE),
            torch.full((bs, P), POISON, dtype=torch.long, device=DEVICE),
            torch.full((bs, P), POISON, dtype=torch.long, device=DEVICE))


def check_walk(scores, choice, tokens, cand):
    """The walk over the kernel's own table, exactly."""
    assert torch.equal(choice, ktr.walk(scores))
    assert torch.equal(tokens, cand.gather(-1, choice.unsqueeze(-1)).squeeze(-1))


@pytest.mark.parametrize("dtype", DTYPES)
def test_transition_kernel_matches_reference(dtype):
    bs, P, k = 3, 4, 4
    pre, recv, uh, cand, anchors, pred_proj, head_proj, head, norm_w, bias, rfac = transition_inputs(dtype)
    args = (pre, recv, uh, cand, anchors, pred_proj, head_proj, head, norm_w, bias, rfac, 1e-6)
    got = poisoned_outputs(bs, P, k)
    ktr.transition_scores_walk(*args, *got)
    ref = poisoned_outputs(bs, P, k)
    ktr.transition_scores_walk_torch(*args, *ref)
    scores, choice, tokens = got
    assert not scores.isnan().any()
    assert rel_err(scores, ref[0]) < kernel_tol(dtype)
    check_walk(scores, choice, tokens, cand)
    check_walk(*ref, cand)
    no_bias = poisoned_outputs(bs, P, k)  # a kernel that drops the gate bias fails the bound
    ktr.transition_scores_walk(*args[:9], torch.zeros_like(bias), *args[10:], *no_bias)
    assert rel_err(no_bias[0], ref[0]) > 3 * kernel_tol(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_transition_kernel_multi_chunk_loops(dtype):
    """The per-position kernel's loops with more than one chunk (at serving shapes they have several; the tiny
    shapes above have one): the message columns in chunks of 16 (m = 40: three chunks and a masked one) and the
    hidden size in chunks of 16 (H = 72: four and a partial one, the next chunk prefetched past the end), against
    the reference and against the one-chunk configuration."""
    bs, P, k, H, m = 2, 3, 5, 72, 40
    inputs = transition_inputs(dtype, bs=bs, P=P, H=H, m=m, V=60, k=k, seed=21)
    args = (*inputs, 1e-6)
    ref = poisoned_outputs(bs, P, k)
    ktr.transition_scores_walk_torch(*args, *ref)
    chunked, whole = poisoned_outputs(bs, P, k), poisoned_outputs(bs, P, k)
    ktr.transition_scores_walk(*args, *chunked, position_config=(16, 16, 1))
    ktr.transition_scores_walk(*args, *whole, position_config=(128, 64, 1))
    for got in (chunked, whole):
        assert not got[0].isnan().any()
        assert rel_err(got[0], ref[0]) < kernel_tol(dtype)
        check_walk(*got, inputs[3])
    assert rel_err(chunked[0], whole[0]) < kernel_tol(dtype)


def test_transition_tables_in_chunks(dspine, target):
    """TransitionTables.build and fill_head over the vocabulary in chunks (7 rows: ten chunks and a partial one)
    equal the one-chunk tables."""
    d, w, head, tables = tiny_drafter_parts(dspine, target, torch.float32)
    chunked = ktr.TransitionTables.build(w, d.transfer_codes, chunk=7)
    chunked.fill_head(w, head, d.norm.weight, chunk=7)
    for name in ("rfac", "pred_proj", "head_proj"):
        torch.testing.assert_close(getattr(chunked, name), getattr(tables, name), rtol=1e-6, atol=1e-6)


def tiny_drafter_parts(dspine, target, dtype):
    d = dspine.to(device=DEVICE, dtype=dtype)
    w = kinj.InjectionWeights.from_module(d.injection, dtype)
    head = target.lm_head.weight.to(device=DEVICE, dtype=dtype)
    tables = ktr.TransitionTables.build(w, d.transfer_codes)
    tables.fill_head(w, head, d.norm.weight)
    return d, w, head, tables


def test_transition_tables(dspine, target):
    """The per-token tables: pred_proj rows are the injection's anchor projections, head_proj rows (W_v⊙w)U_L,
    and rfac = Rᵀ of U_L = QR (‖U_L x‖ = ‖x rfac‖)."""
    d, w, head, tables = tiny_drafter_parts(dspine, target, torch.float32)
    sqrt_r = math.sqrt(w.rank)
    want = torch.cat([d.injection.predecessor_gate(sqrt_r * d.transfer_codes),
                      d.injection.message(sqrt_r * d.transfer_codes)], -1)
    assert rel_err(tables.pred_proj, want) < 1e-6
    assert rel_err(tables.head_proj, (head * d.norm.weight) @ w.writes[-1]) < 1e-6
    x = randn(7, w.message_size, g=gen(9))
    assert rel_err((x @ tables.rfac).norm(dim=-1), (x @ w.writes[-1].t()).norm(dim=-1)) < 1e-6
    assert torch.equal(tables.rfac, torch.tril(tables.rfac))
    empty = ktr.TransitionTables.build(w, d.transfer_codes)
    with pytest.raises(RuntimeError, match="before TransitionTables.fill_head"):
        ktr.transition_walk(randn(1, 2, w.writes[0].shape[0], g=gen(1)), torch.zeros(1, 2, 4, dtype=torch.long,
                            device=DEVICE), torch.zeros(1, dtype=torch.long, device=DEVICE), w, empty, head,
                            d.norm.weight, d.norm.eps)
    with pytest.raises(ValueError, match="target head has 3 rows"):
        empty.fill_head(w, head[:3], d.norm.weight)


def test_transition_walk_matches_decode_block(dspine, target):
    """transition_walk == decoding.decode_block with the drafter's refine_normed (float32: exact tokens)."""
    d, w, head, tables = tiny_drafter_parts(dspine, target, torch.float32)
    g = gen(11)
    B, H, V, topk = d.cfg.block_size, d.cfg.hidden_size, d.cfg.vocab_size, d.cfg.dspine.top_k
    bs = 3
    pre = randn(bs, B - 1, H, g=g)
    logits = randn(bs, B - 1, V, g=g, scale=3.0)
    anchors = torch.randint(0, V, (bs,), generator=g).to(DEVICE)
    ref = decode_block(logits, pre, anchors, topk, d.refine_normed, d.transfer_codes, head)
    for kernel in (True, False):
        out = poisoned_outputs(bs, B - 1, topk)
        tokens, choice, scores = ktr.transition_walk(pre, ref.candidates, anchors, w, tables, head,
                                                     d.norm.weight, d.norm.eps, out=out, kernel=kernel)
        assert rel_err(scores, ref.scores) < 1e-5
        assert torch.equal(choice, ref.choice) and torch.equal(tokens, ref.tokens)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_transition_walk_low_precision_close_to_decode_block(dspine, target, dtype):
    """In bf16/fp16 the drafter rounds its refined states; ours rounds elsewhere: close, not equal."""
    d, w, head, tables = tiny_drafter_parts(dspine, target, dtype)
    g = gen(12)
    B, H, V, topk = d.cfg.block_size, d.cfg.hidden_size, d.cfg.vocab_size, d.cfg.dspine.top_k
    bs = 3
    pre = randn(bs, B - 1, H, g=g, dtype=dtype)
    logits = randn(bs, B - 1, V, g=g, scale=3.0)
    anchors = torch.randint(0, V, (bs,), generator=g).to(DEVICE)
    ref = decode_block(logits, pre, anchors, topk, d.refine_normed, d.transfer_codes, head)
    out = poisoned_outputs(bs, B - 1, topk)
    tokens, choice, scores = ktr.transition_walk(pre, ref.candidates, anchors, w, tables, head,
                                                 d.norm.weight, d.norm.eps, out=out)
    assert rel_err(scores, ref.scores) < WALK_TOL[dtype]
    check_walk(scores, choice, tokens, ref.candidates)


def test_draft_step_with_kernels_matches_drafter(dspine, target):
    """The whole draft: drafter layers + injection_delta + topk + transition_walk (recv and uh from the last
    layer's injection, as served) == DSpineDrafter.draft (fp32)."""
    d = dspine.to(DEVICE)
    head = target.lm_head.weight.to(DEVICE)
    cfg = d.cfg
    B, H, V = cfg.block_size, cfg.hidden_size, cfg.vocab_size
    g = gen(13)
    n, S = 2, 6
    feats = randn(n, S, len(cfg.target_layer_ids) * H, g=g)
    ctx_pos = torch.arange(S, device=DEVICE).expand(n, S)
    ctx_kv = d.context_kv(feats, ctx_pos)
    emb = randn(n, 1, B, H, g=g)
    pos = (S + torch.arange(B, device=DEVICE)).expand(n, 1, B)
    visible = torch.ones(n, 1, S, dtype=torch.bool, device=DEVICE)
    anchors = torch.randint(0, V, (n,), generator=g).to(DEVICE)
    out = d.forward_blocks(emb, pos, ctx_kv, visible, anchors.view(n, 1))
    ref = d.draft(out, head, anchors)

    w = kinj.InjectionWeights.from_module(d.injection, torch.float32)
    tables = ktr.TransitionTables.build(w, d.transfer_codes)
    tables.fill_head(w, head, d.norm.weight)
    mask = d.block_mask(visible)
    x = emb.view(n, B, H)
    recv = torch.full((n * B, w.message_size), float("nan"), device=DEVICE)
    for l, layer in enumerate(d.layers):
        x = layer(x, pos.view(n, B), ctx_kv[l], mask)
        last = l == len(d.layers) - 1
        pre = x
        delta, uh = kinj.injection_delta(x.reshape(n * B, H), l, w, anchors, tables.pred_proj, B,
                                         recv_out=recv if last else None)
        x = x + delta.view(n, B, H)
    assert rel_err(pre, out.pre_last[:, 0]) < 1e-5
    hidden = d.norm(x)
    assert rel_err(hidden, out.hidden[:, 0]) < 1e-5
    logits = (hidden[:, 1:].float() @ head.float().T).reshape(n * (B - 1), V)
    _, cand = ktopk.topk(logits, cfg.dspine.top_k)
    cand = cand.view(n, B - 1, -1)
    assert torch.equal(cand, ref.candidates)
    m = w.message_size
    tokens, choice, scores = ktr.transition_walk(pre[:, 1:], cand, anchors, w, tables, head, d.norm.weight,
                                                 d.norm.eps, recv=recv.view(n, B, m)[:, 1:],
                                                 uh=uh.view(n, B, m)[:, 1:])
    assert rel_err(scores, ref.scores) < 1e-5
    assert torch.equal(tokens, ref.tokens) and torch.equal(choice, ref.choice)


# ------------------------------------------------------------------------------------------ GPU only
QWEN = dict(H=4096, r=1024, m=512, B=16, K=16)


def qwen_injection(layers=2, seed=0):
    inj = AdjacentInjection(QWEN["H"], QWEN["r"], QWEN["m"], layers)
    g = gen(seed)
    for p in inj.parameters():  # nn.Linear-like scale: keeps activations O(1)
        p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1] if p.dim() > 1 else 4))
    return inj.cuda()


@pytest.mark.gpu
def test_gpu_injection_delta_qwen_shapes():
    H, r, m, B = QWEN["H"], QWEN["r"], QWEN["m"], QWEN["B"]
    bs, V = 8, 4096
    inj = qwen_injection()
    g = gen(1)
    codes = unit_codes(V, r, g)
    anchors = torch.randint(0, V, (bs,), generator=g).cuda()
    h = randn(bs * B, H, g=g, dtype=torch.bfloat16)
    w = kinj.InjectionWeights.from_module(inj, torch.bfloat16)
    table = pred_table(w, codes).bfloat16()
    inj32 = AdjacentInjection(H, r, m, 2).cuda()
    inj32.load_state_dict({k: v.bfloat16().float() for k, v in inj.state_dict().items()})
    for layer in range(2):
        delta, _ = kinj.injection_delta(h, layer, w, anchors, table, B)
        delta_t, _ = kinj.injection_delta(h, layer, w, anchors, table, B, kernel=False)
        want = inj32(layer, h.float().view(bs, B, H), codes[anchors]).view(bs * B, H) - h.float()
        scale = want.double().norm()
        assert not delta.isnan().any()
        assert (delta.view(bs, B, H)[:, 0] == 0).all()
        assert ((delta.double() - want.double()).norm() / scale).item() < 0.1
        assert ((delta.double() - delta_t.double()).norm() / scale).item() < 0.05


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_transition_qwen_shapes(dtype):
    H, m, K, P = QWEN["H"], QWEN["m"], QWEN["K"], QWEN["B"] - 1
    bs, V = 6, 8192
    pre, recv, uh, cand, anchors, pred_proj, head_proj, head, norm_w, bias, rfac = transition_inputs(
        dtype, bs=bs, P=P, H=H, m=m, V=V, k=K, seed=3)
    rfac = torch.tril(torch.randn(m, m, device="cuda") / math.sqrt(m)).to(dtype)
    args = (pre, recv, uh, cand, anchors, pred_proj, head_proj, head, norm_w, bias, rfac, 1e-6)
    got = poisoned_outputs(bs, P, K)
    ktr.transition_scores_walk(*args, *got)
    ref = poisoned_outputs(bs, P, K)
    ktr.transition_scores_walk_torch(*args, *ref)
    assert not got[0].isnan().any()
    assert rel_err(got[0], ref[0]) < (1e-3 if dtype == torch.float32 else 1e-2)
    check_walk(*got, cand)


@pytest.mark.gpu
def test_gpu_topk_vocab():
    g = gen(4)
    x = randn(48 * 15, 151936, g=g, dtype=torch.bfloat16, scale=3.0)
    vals, idx = ktopk.topk(x, 16)
    ref = torch.topk(x, 16, dim=-1)
    assert torch.equal(vals, ref.values)
    assert torch.equal(x.gather(1, idx), vals)
    assert (idx.sort(-1).values.diff(dim=-1) > 0).all()


@pytest.mark.gpu
def test_gpu_cuda_graph_capture(dspine, target):
    """injection_delta + topk + transition_walk captured in one CUDA graph, replayed on new inputs."""
    d = dspine.cuda()
    head = target.lm_head.weight.cuda()
    cfg = d.cfg
    B, H, V, k = cfg.block_size, cfg.hidden_size, cfg.vocab_size, cfg.dspine.top_k
    w = kinj.InjectionWeights.from_module(d.injection, torch.float32)
    tables = ktr.TransitionTables.build(w, d.transfer_codes)
    tables.fill_head(w, head, d.norm.weight)
    bs, m = 4, w.message_size
    h = torch.randn(bs * B, H, device="cuda")
    anchors = torch.randint(0, V, (bs,), device="cuda")

    def step():
        recv = torch.empty(bs * B, m, device="cuda")
        x = h
        for l in range(cfg.num_hidden_layers):
            pre = x
            delta, uh = kinj.injection_delta(x, l, w, anchors, tables.pred_proj, B, recv_out=recv)
            x = x + delta
        logits = (d.norm(x).view(bs, B, H)[:, 1:] @ head.T).reshape(bs * (B - 1), V)
        _, cand = ktopk.topk(logits, k)
        return ktr.transition_walk(pre.view(bs, B, H)[:, 1:], cand.view(bs, B - 1, k), anchors, w, tables, head,
                                   d.norm.weight, d.norm.eps, recv=recv.view(bs, B, m)[:, 1:],
                                   uh=uh.view(bs, B, m)[:, 1:])

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step()
    for seed in range(3):
        torch.manual_seed(seed)
        h.copy_(torch.randn_like(h))
        anchors.copy_(torch.randint(0, V, (bs,), device="cuda"))
        graph.replay()
        eager = step()
        assert torch.equal(static[0], eager[0]) and torch.equal(static[1], eager[1])  # tokens, choice
        torch.testing.assert_close(static[2], eager[2], rtol=1e-5, atol=1e-5)  # cuBLAS may differ in a graph
