"""The serving draft step's two implementations agree: the Triton kernels (through the interpreter on CPU)
and the PyTorch math, wired the way the SGLang model and worker use them."""
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("sglang")

from sglang_dspine.serving_kernels import KernelPath  # noqa: E402
from sglang_dspine.worker import draft_tokens, prepare_decoding  # noqa: E402



pytestmark = pytest.mark.usefixtures("no_grad")  # conftest.py



def blocks(drafter, target, anchors, ctx=6):
    """Final states and last-layer pre-injection states of one block per request, from the plain drafter."""
    b, h = drafter.cfg.block_size, drafter.cfg.hidden_size
    n = len(anchors)
    feats = torch.randn(n, ctx, len(drafter.cfg.target_layer_ids) * h, generator=torch.Generator().manual_seed(7))
    kv = drafter.context_kv(feats, torch.arange(ctx).expand(n, ctx))
    ids = torch.tensor([[a] + [drafter.cfg.mask_token_id] * (b - 1) for a in anchors])
    emb = target.get_input_embeddings()(ids).view(n, 1, b, h)
    pos = (ctx + torch.arange(b)).expand(n, b).reshape(n, 1, b)
    out = drafter.forward_blocks(emb, pos, kv, torch.ones(n, 1, ctx, dtype=torch.bool), torch.tensor(anchors).view(n, 1))
    return out.hidden[:, 0], out.pre_last[:, 0]


def serving_view(drafter, pre_last, anchors):
    """The attributes the worker's decoding reads from the SGLang model, filled from the plain drafter."""
    b, h = drafter.cfg.block_size, drafter.cfg.hidden_size
    return SimpleNamespace(
        block_size=b, top_k=drafter.cfg.dspine.top_k, transfer_codes=drafter.transfer_codes,
        last_pre_injection=pre_last.reshape(-1, h), last_anchors=torch.tensor(anchors),
        refine_normed=drafter.refine_normed, norm=SimpleNamespace(weight=drafter.norm.weight, variance_epsilon=drafter.norm.eps),
        kernel_path=None)


def test_kernel_decoding_equals_pytorch_decoding(dspine, target):
    anchors = [5, 11, 2]
    hidden, pre = blocks(dspine, target, anchors)
    head = target.lm_head.weight
    model = serving_view(dspine, pre, anchors)
    reference = draft_tokens(model, hidden[:, 1:], head)
    model.kernel_path = KernelPath(dspine.injection, torch.float32)
    prepare_decoding(model, head)
    assert model.kernel_path.tables is not None
    fast = draft_tokens(model, hidden[:, 1:], head)
    assert torch.equal(fast, reference)


def test_kernel_injection_equals_module(dspine):
    b, h = dspine.cfg.block_size, dspine.cfg.hidden_size
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2 * b, h, generator=g)
    anchors = torch.tensor([4, 9])
    kp = KernelPath(dspine.injection, torch.float32)
    proj = kp.anchor_projections(dspine.transfer_codes, anchors)
    for layer in range(dspine.cfg.num_hidden_layers):
        want = dspine.injection(layer, x.view(2, b, h), dspine.transfer_codes[anchors]).view(2 * b, h)
        torch.testing.assert_close(kp.inject(x, layer, proj, b), want, atol=1e-5, rtol=1e-5)


def test_transition_cache_keeps_the_steps_tables(dspine, target):
    from sglang_dspine.cache import TransitionCache
    from sglang_dspine.decoding import decode_block

    anchors = [5, 11]
    hidden, pre = blocks(dspine, target, anchors)
    head = target.lm_head.weight
    model = serving_view(dspine, pre, anchors)
    cache = TransitionCache(max_bs=4, positions=dspine.cfg.block_size - 1, top_k=dspine.cfg.dspine.top_k, device="cpu")
    tokens = draft_tokens(model, hidden[:, 1:], head, cache)
    ref = decode_block(hidden[:, 1:] @ head.T, pre[:, 1:], torch.tensor(anchors), dspine.cfg.dspine.top_k,
                       dspine.refine_normed, dspine.transfer_codes, head)
    assert torch.equal(tokens, ref.tokens)
    assert torch.equal(cache.candidates[:2], ref.candidates) and torch.equal(cache.choice[:2], ref.choice)
    torch.testing.assert_close(cache.scores[:2], ref.scores)
    assert cache.departure_rate(2) == float((ref.choice != 0).float().mean())
