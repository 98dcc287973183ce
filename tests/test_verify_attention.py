"""The grouped verify attention kernel (kernels/verify_attention.py) against its float32 PyTorch reference, and
the reference against attention written out independently. Without a GPU the kernel runs through Triton's
interpreter (conftest sets TRITON_INTERPRET=1)."""
from __future__ import annotations

import importlib
import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tree_masks import tree_mask  # noqa: E402

from sglang_dspine.kernels import verify_attention as va  # noqa: E402

pytestmark = pytest.mark.usefixtures("no_grad")  # conftest.py

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(va._grouped_verify_split, InterpretedFunction):  # imported before TRITON_INTERPRET was set
        va = importlib.reload(va)


def problem(rows, contexts, h_q=8, h_kv=2, dim=32, pool=400, dtype=torch.float32, seed=0, device=DEVICE):
    """q, own K/V, a KV pool and each request's context as scattered pool slots (kv_indptr, kv_indices)."""
    g = torch.Generator().manual_seed(seed)
    bs = len(contexts)
    t = bs * rows
    q = torch.randn(t, h_q, dim, generator=g)
    k_ext, v_ext = torch.randn(t, h_kv, dim, generator=g), torch.randn(t, h_kv, dim, generator=g)
    k_buf, v_buf = torch.randn(pool, h_kv, dim, generator=g), torch.randn(pool, h_kv, dim, generator=g)
    indices = torch.randperm(pool, generator=g)[: sum(contexts)]
    indptr = torch.tensor([0] + list(contexts)).cumsum(0).to(torch.int32)
    return [x.to(device=device, dtype=dtype) for x in (q, k_ext, v_ext, k_buf, v_buf)] + \
        [indptr.to(device), indices.to(device)]


def written_out(q, k_ext, v_ext, k_buf, v_buf, indptr, indices, rows, sm_scale):
    """Attention one (request, row, query head) at a time: softmax over the context's keys and the request's
    own rows up to this one, with the query head's KV head h // G."""
    h_q, h_kv = q.shape[1], k_buf.shape[1]
    out = torch.empty(q.shape[0], h_q, v_buf.shape[2], dtype=torch.float64)
    for b in range(len(indptr) - 1):
        ctx = indices[int(indptr[b]):int(indptr[b + 1])].long()
        for r in range(rows):
            t = b * rows + r
            for h in range(h_q):
                kvh = h * h_kv // h_q
                keys = torch.cat([k_buf[ctx, kvh], k_ext[b * rows: t + 1, kvh]]).double()
                vals = torch.cat([v_buf[ctx, kvh], v_ext[b * rows: t + 1, kvh]]).double()
                w = torch.softmax(keys @ q[t, h].double() * sm_scale, 0)
                out[t, h] = w @ vals
    return out


def test_the_reference_is_attention_over_the_context_and_the_rows_so_far():
    args = problem(3, [5, 17], dim=8)
    ref = va.grouped_verify_attention_torch(*args, rows=3, sm_scale=0.3)
    assert torch.allclose(ref.double(), written_out(*args, rows=3, sm_scale=0.3), atol=1e-5)


@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("splits", [1, 4])
def test_the_kernel_matches_the_reference(rows, splits):
    # contexts: shorter than one block of the loop, several blocks, and fewer tokens than splits × a block
    # (empty splits); scattered pool slots
    args = problem(rows, [5, 70, 130], seed=rows)
    h_kv, dim = args[3].shape[1], args[3].shape[2]
    tokens, h_q = args[0].shape[:2]
    sm_scale = 1 / math.sqrt(dim)
    ref = va.grouped_verify_attention_torch(*args, rows=rows, sm_scale=sm_scale)
    out = torch.full((tokens, h_q, dim), float("nan"), device=DEVICE)
    scratch = va.SplitScratch(3 * h_kv * splits, va.tile_rows(rows, h_q // h_kv), dim, DEVICE)
    va.grouped_verify_attention(*args, rows=rows, sm_scale=sm_scale, out=out, scratch=scratch, splits=splits)
    assert not out.isnan().any()
    assert torch.allclose(out, ref, atol=2e-5, rtol=1e-4), (out - ref).abs().max()
    # the rows' own keys count, causally: the same kernel with the rows' K shuffled gives another answer
    shuffled = list(args)
    shuffled[1] = args[1].roll(1, 0)
    other = torch.empty_like(out)
    va.grouped_verify_attention(*shuffled, rows=rows, sm_scale=sm_scale, out=other, scratch=scratch, splits=splits)
    assert not torch.allclose(other, ref, atol=1e-3)


@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("rows", [8, 64])
def test_a_tree_sees_its_ancestors_and_the_context(splits, rows):
    """With a tree's mask the rows' own block follows it (the reference against attention written out over each
    row's context and ancestors), and the kernel matches the reference; a tree that is a chain gives causal.
    64 rows: the tree of 64, a tile of 256 rows at 4 query heads a KV head."""
    contexts = [5, 70, 33]
    args = problem(rows, contexts, seed=11)
    mask, indptr = tree_mask(rows, contexts, seed=3, device=DEVICE)
    ref = va.grouped_verify_attention_torch(*args, rows=rows, sm_scale=0.2, mask=mask, mask_indptr=indptr)
    q, k_ext, v_ext, k_buf, v_buf, kv_indptr, kv_indices = args
    for b, n in enumerate(contexts):  # one (request, row, head), written out
        cells = mask[int(indptr[b]): int(indptr[b + 1])].view(rows, n + rows)[:, n:]
        ctx = kv_indices[int(kv_indptr[b]): int(kv_indptr[b + 1])].long()
        for r in range(rows):
            own = [b * rows + j for j in range(rows) if cells[r, j]]
            for h in (0, 5):
                keys = torch.cat([k_buf[ctx, h // 4], k_ext[own, h // 4]]).double()
                vals = torch.cat([v_buf[ctx, h // 4], v_ext[own, h // 4]]).double()
                want = torch.softmax(keys @ q[b * rows + r, h].double() * 0.2, 0) @ vals
                assert torch.allclose(ref[b * rows + r, h].double(), want, atol=1e-5)
    out = torch.empty_like(ref)
    scratch = va.SplitScratch(3 * 2 * splits, va.tile_rows(rows, 4), 32, DEVICE)
    va.grouped_verify_attention(*args, rows=rows, sm_scale=0.2, out=out, scratch=scratch, splits=splits, mask=mask,
                                mask_indptr=indptr)
    assert torch.allclose(out, ref, atol=2e-5, rtol=1e-4)
    assert not torch.allclose(out, va.grouped_verify_attention_torch(*args, rows=rows, sm_scale=0.2), atol=1e-3)
    chain = torch.cat([torch.cat([torch.ones(rows, n, dtype=torch.bool), torch.ones(rows, rows).tril().bool()], 1)
                       .reshape(-1) for n in contexts]).to(DEVICE)
    va.grouped_verify_attention(*args, rows=rows, sm_scale=0.2, out=out, scratch=scratch, splits=splits, mask=chain,
                                mask_indptr=indptr)
    assert torch.allclose(out, va.grouped_verify_attention_torch(*args, rows=rows, sm_scale=0.2), atol=2e-5,
                          rtol=1e-4)


def test_fp8_scales_apply_to_the_context_only():
    args = problem(4, [40, 9], seed=5)
    ref = va.grouped_verify_attention_torch(*args, rows=4, sm_scale=0.2, k_scale=0.5, v_scale=2.0)
    out = torch.empty_like(ref)
    scratch = va.SplitScratch(2 * 2 * 2, va.tile_rows(4, 4), 32, DEVICE)
    va.grouped_verify_attention(*args, rows=4, sm_scale=0.2, out=out, scratch=scratch, splits=2, k_scale=0.5,
                                v_scale=2.0)
    assert torch.allclose(out, ref, atol=2e-5, rtol=1e-4)
    assert not torch.allclose(ref, va.grouped_verify_attention_torch(*args, rows=4, sm_scale=0.2), atol=1e-3)


def test_split_count_fills_the_gpu_within_its_programs():
    # an H100's 132 multiprocessors, two programs each; Qwen3-8B's 8 KV heads
    assert [va.split_count(n, 8, 264) for n in (1, 2, 4, 8, 16, 17, 33, 48)] == [16, 16, 8, 4, 2, 1, 1, 1]
    for n in range(1, 80):
        s = va.split_count(n, 8, 264)
        assert s == 1 or n * 8 * s <= 264


def test_bad_inputs_are_refused_in_words():
    args = problem(4, [10, 10])
    out = torch.empty(8, 8, 32, device=DEVICE)
    with pytest.raises(ValueError, match="2 requests of 3 rows"):
        va.grouped_verify_attention(*args, rows=3, sm_scale=0.1, out=out)
    small = va.SplitScratch(4, va.tile_rows(4, 4), 32, DEVICE)
    with pytest.raises(ValueError, match="4 splits of 2 × 2 programs"):
        va.grouped_verify_attention(*args, rows=4, sm_scale=0.1, out=out, scratch=small, splits=4)
    with pytest.raises(ValueError, match="mask needs its mask_indptr"):
        va.grouped_verify_attention(*args, rows=4, sm_scale=0.1, out=out, mask=torch.ones(96, dtype=torch.bool))


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 4, 16, 32, 64])
def test_gpu_qwen3_8b_shapes_in_bf16(rows):
    """Qwen3-8B's heads (32 query, 8 KV, 128 dims) in bfloat16, split counts the server picks, chains and trees
    (32 rows: the tree of 32's tile of 128; 64: the tree of 64's of 256)."""
    contexts = [576, 1, 2000, 333]
    args = problem(rows, contexts, h_q=32, h_kv=8, dim=128, pool=4096, dtype=torch.bfloat16, seed=rows)
    ref = va.grouped_verify_attention_torch(*args, rows=rows, sm_scale=128 ** -0.5)
    scratch = va.SplitScratch(264, va.tile_rows(rows, 4), 128, "cuda")
    mask, indptr = tree_mask(rows, contexts, seed=rows, device="cuda")
    tree_ref = va.grouped_verify_attention_torch(*args, rows=rows, sm_scale=128 ** -0.5, mask=mask,
                                                 mask_indptr=indptr)
    for splits in (1, 2, 8):
        for tree, want in ((None, ref), ((mask, indptr), tree_ref)):
            out = torch.empty(len(contexts) * rows, 32, 128, dtype=torch.bfloat16, device="cuda")
            va.grouped_verify_attention(*args, rows=rows, sm_scale=128 ** -0.5, out=out, scratch=scratch,
                                        splits=splits, **(dict(mask=tree[0], mask_indptr=tree[1]) if tree else {}))
            err = ((out.double() - want.double()).norm() / want.double().norm()).item()
            assert err < 1e-2, (splits, tree is not None, err)
