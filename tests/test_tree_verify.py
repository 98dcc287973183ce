"""Tree verification in the server (sglang_dspine/serving/tree_verify.py): SGLang's own tree walk (its Triton
kernel, through Triton's interpreter) on the verify inputs, and the accepted path brought to the front of the
block, against plain forwards of the target over the accepted path: after it the block reads as a chain step
over that path (the slots req_to_token gives each position hold the K/V a chain would have written there)."""
from __future__ import annotations

import pytest
import torch
from sampling_stats import chi_square_p, tree_walk_law
from test_serving_glue import VOCAB, served_pair
from test_tree_batch import PATHS, random_lattice

from sglang_dspine.drafter.tree import DraftTree, tree_attention_mask, tree_positions
from sglang_dspine.drafter.tree_batch import TreeBatch, accept, ancestor_masks, full_tree_mask, lattice_trees
from sglang_dspine.serving.tree_verify import (
    accept_tree,
    bring_to_front,
    chains_where,
    committed_rows,
    mask_cells_bound,
    rows_to_front,
    tree_verify_inputs,
)

pytestmark = pytest.mark.usefixtures("no_grad", "one_thread")  # conftest.py


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """test_serving_glue's pair: a target SGLang pads the vocabulary of, a DSpine drafter, the launch published."""
    return served_pair(tmp_path_factory.mktemp("tree_glue"))


def test_committed_rows_are_the_walks_path_then_the_other_rows():
    """On 64 random lattice trees: SGLang's greedy tree walk accepts what `tree_batch.accept` (the offline rule's
    batch form) accepts; `committed_rows` orders the block [anchor, accepted nodes root's child first, every other
    row ascending] and emits the accepted tokens then the target's next token."""
    bs, p, k, vocab = 64, 5, 3, 4
    cand, log_scores = random_lattice(bs, p, k, vocab, seed=31)
    trees = lattice_trees(cand, log_scores, 12)
    n = trees.size
    logits = torch.randn(bs, n + 1, vocab, generator=torch.Generator().manual_seed(32))
    anchors = torch.randint(0, vocab, (bs,), generator=torch.Generator().manual_seed(33))
    verify = tree_verify_inputs(trees, anchors, torch.arange(bs) % 7 + 3, depth=p)
    acc = accept_tree(verify, logits.view(bs * (n + 1), vocab))
    ref = accept(trees, logits, 0.0, depth=p)
    assert acc.accepted.tolist() == ref.accepted.tolist() and acc.bonus.tolist() == ref.next_token.tolist()
    rows = committed_rows(verify, acc)
    assert rows.commit_lens.tolist() == (ref.accepted + 1).tolist()
    emitted = ref.emitted(trees)
    for b in range(bs):
        a = ref.accepted[b].item()
        path = [0] + [m + 1 for m in ref.path[b, :a].tolist()]
        assert rows.order[b].tolist() == path + sorted(set(range(n + 1)) - set(path))
        assert rows.out_tokens[b].tolist() == emitted[b, : a + 1].tolist() + [0] * (n - a)
    assert set(ref.accepted.tolist()) >= {0, 1, 2}  # empty, short and longer paths all seen


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("width", [12, 40])  # verify rows 13 (BLOCK 16) and 41 (BLOCK 64, past a block of 6)
def test_the_commit_kernel_equals_committed_rows_and_bring_to_front(width, device):
    """kernels/tree_commit.py (Triton's interpreter) on 64 random lattice trees and SGLang's walk of them: the
    order, accept lengths, tokens out, slots in the new order and the rewritten req_to_token equal the PyTorch
    reference's (`committed_rows` then `bring_to_front`) exactly, entries outside the verify slots untouched."""
    from sglang_dspine.kernels.tree_commit import commit_path_kernel
    from sglang_dspine.serving.tree_verify import commit_path

    bs, p, k, vocab = 64, 5, 3, 4
    cand, log_scores = random_lattice(bs, p, k, vocab, seed=41)
    trees = lattice_trees(cand, log_scores, width)
    rows_n = trees.size + 1
    logits = torch.randn(bs * rows_n, vocab, generator=torch.Generator().manual_seed(42))
    seq_lens = torch.arange(bs) % 7 + 3
    verify = tree_verify_inputs(trees, torch.zeros(bs, dtype=torch.long), seq_lens, depth=p)
    pool = torch.randperm(bs, generator=torch.Generator().manual_seed(43))  # each request's req_to_token row
    r2t = torch.randint(0, 10_000, (bs + 3, 100), dtype=torch.int32, generator=torch.Generator().manual_seed(44))
    loc_2d = r2t[pool[:, None], seq_lens[:, None] + torch.arange(rows_n)].long()
    if device == "cuda":
        verify, logits, seq_lens, pool, r2t, loc_2d = (x.cuda() if isinstance(x, torch.Tensor) else x for x in (
            tree_verify_inputs(TreeBatch(*(x.cuda() for x in (trees.tokens, trees.parents, trees.depths, trees.scores))),
                               torch.zeros(bs, dtype=torch.long, device="cuda"), seq_lens.cuda(), depth=p),
            logits, seq_lens, pool, r2t, loc_2d))
    acc = accept_tree(verify, logits)
    want_r2t, got_r2t = r2t.clone(), r2t.clone()
    want, want_front = commit_path(verify, acc, loc_2d, want_r2t, pool, seq_lens, kernels=False)
    got, got_front = commit_path(verify, acc, loc_2d, got_r2t, pool, seq_lens, kernels=True)
    for x, y in ((got.order, want.order), (got.commit_lens, want.commit_lens), (got.out_tokens, want.out_tokens),
                 (got_front, want_front), (got_r2t, want_r2t)):
        assert x.dtype == y.dtype and torch.equal(x, y)
    assert not torch.equal(want_r2t, r2t) and len(set(acc.accepted.tolist())) >= 3  # paths moved, of several lengths
    with pytest.raises(ValueError, match="commit_path_kernel: accept_index"):
        commit_path_kernel(acc.accept_index, acc.accepted, acc.bonus, verify.tokens, loc_2d[:, :-1], r2t, pool,
                           seq_lens)


def test_greedy_requests_verify_their_walk_as_a_chain():
    """`chains_where`: a marked request's tree becomes its walk as a chain (each node under the one before), the
    others keep their trees; verified as a tree, the chain accepts the chain rule's longest prefix of the target's
    argmax tokens, then the target's token after it."""
    bs, p, k, vocab = 16, 5, 3, 6
    cand, log_scores = random_lattice(bs, p, k, vocab, seed=41)
    trees = lattice_trees(cand, log_scores, p)  # p nodes: the chain's size
    walk = torch.randint(0, vocab, (bs, p), generator=torch.Generator().manual_seed(42))
    greedy = torch.arange(bs) % 3 != 0
    mixed = chains_where(greedy, walk, trees)
    assert torch.equal(mixed.tokens[~greedy], trees.tokens[~greedy])
    assert torch.equal(mixed.parents[~greedy], trees.parents[~greedy])
    assert (trees.parents[~greedy] != torch.arange(-1, p - 1)).any(dim=1).any()  # some of those trees branch
    logits = torch.randn(bs, p + 1, vocab, generator=torch.Generator().manual_seed(43))
    for b in torch.nonzero(greedy).view(-1).tolist():  # the walk's first b mod (p+1) tokens: the target's argmax
        cut = b % (p + 1)
        for j in range(cut):
            logits[b, j, walk[b, j]] = 50.0
    verify = tree_verify_inputs(mixed, torch.zeros(bs, dtype=torch.long), torch.full((bs,), 4), depth=p)
    rows = committed_rows(verify, acc := accept_tree(verify, logits.view(-1, vocab)))
    for b in torch.nonzero(greedy).view(-1).tolist():
        assert mixed.tokens[b].tolist() == walk[b].tolist()
        assert mixed.parents[b].tolist() == list(range(-1, p - 1))
        assert mixed.depths[b].tolist() == list(range(1, p + 1))
        best = logits[b].argmax(-1)
        a = 0
        while a < p and walk[b, a] == best[a]:
            a += 1
        assert acc.accepted[b].item() == a and a >= b % (p + 1)
        assert rows.out_tokens[b, : a + 1].tolist() == walk[b, :a].tolist() + [best[a].item()]
        assert rows.order[b, : a + 1].tolist() == list(range(a + 1))


def test_the_tree_mask_sized_from_host_lengths_is_the_mask():
    """The tree mask sized without a read from the device (`mask_cells_bound` on host lengths that bound the
    committed ones from above, as DFlash's host bound does): the layout's cells are the mask's, every cell past
    them True (SGLang pads the same way); capped at the backend's mask buffer (SGLang's VerifyMask) where the
    batch fits it, not where it does not."""
    from sglang.srt.layers.attention.verify_mask import VerifyMask, tree_mask_numel
    from sglang.srt.speculative.eagle_utils import TreeMaskMode

    bs, p, k = 6, 4, 3
    cand, log_scores = random_lattice(bs, p, k, 20, seed=51)
    trees = lattice_trees(cand, log_scores, 9)
    rows = trees.size + 1
    seq_lens = torch.tensor([3, 0, 17, 5, 9, 1])
    host = seq_lens + torch.tensor([4, 4, 0, 2, 4, 1])  # lagging committed length + up to a block
    exact = full_tree_mask(ancestor_masks(trees, p), seq_lens)
    assert exact.numel() == int(seq_lens.sum()) * rows + bs * rows * rows
    cells = mask_cells_bound(host, rows)
    assert cells > exact.numel()
    sized = tree_verify_inputs(trees, torch.zeros(bs, dtype=torch.long), seq_lens, depth=p, mask_cells=cells)
    assert sized.custom_mask.numel() == cells
    assert torch.equal(sized.custom_mask[: exact.numel()], exact) and sized.custom_mask[exact.numel():].all()
    context = 32
    buffer = torch.zeros(tree_mask_numel(TreeMaskMode.FULL_MASK, bs, rows, context), dtype=torch.uint8)
    assert mask_cells_bound(host + 40, rows, VerifyMask(buffer=buffer, mode=TreeMaskMode.FULL_MASK, max_bs=bs)) \
        == buffer.numel() >= exact.numel()
    small = VerifyMask(buffer=buffer, mode=TreeMaskMode.FULL_MASK, max_bs=bs - 1)  # the batch is above its graphs
    assert mask_cells_bound(host + 40, rows, small) == int((host + 40).sum()) * rows + bs * rows * rows


def _tree(g: list[int], wrong_at: int | None, v: int) -> DraftTree:
    """A depth-4 tree whose branches interleave in node order, the target's greedy continuation g on its long
    branch, made wrong at `wrong_at`; the same shape whatever `wrong_at` (decoys differ from g by 1, the wrong
    token by 2)."""
    long = list(g[:4])
    if wrong_at is not None:
        long[wrong_at] = (long[wrong_at] + 2) % v
    decoy = lambda t: (t + 1) % v  # noqa: E731
    return DraftTree.from_paths([[decoy(g[0])], g[:1] + [decoy(g[1])], g[:2] + [decoy(g[2]), 0], long])


def _greedy(target, seq, n):
    out = []
    for _ in range(n):
        out.append(int(target(input_ids=torch.tensor([seq + out])).logits[0, -1].argmax()))
    return out


def test_a_tree_step_brought_to_front_is_a_chain_step_over_the_accepted_path(target):
    """Three requests (contexts of 5, 1 and 10 tokens) each verify a tree of 8 nodes in one target pass under
    the tree mask, their greedy paths through non-contiguous nodes (accepting 4, 3 and 2 of them). The verify
    pass writes each row's state into the row's KV slot. After acceptance (SGLang's walk), `committed_rows` and
    `bring_to_front`:
    - the emitted tokens are the target's own greedy continuation;
    - for every committed position, the slot req_to_token gives it holds the state a plain causal forward over
      context, anchor and accepted path computes there (what a chain step would have written), and the hidden
      states and logits brought to the front are that forward's;
    - each request's block keeps its slots (a permutation of them), everything else in req_to_token is as it was."""
    v = target.config.vocab_size
    prompts, anchors, wrong = [[1, 2, 3, 4, 5], [7], [9, 9, 9, 9, 9, 9, 9, 9, 30, 31]], [17, 3, 40], [None, 3, 2]
    greedy = [_greedy(target, p + [a], 5) for p, a in zip(prompts, anchors)]
    trees = [_tree(g, w, v) for g, w in zip(greedy, wrong)]
    rows = len(trees[0]) + 1
    logits, hidden = [], []
    for prompt, anchor, tree in zip(prompts, anchors, trees):
        s = len(prompt)
        mask = tree_attention_mask(tree, s, torch.float32)  # [1, 1, rows, s + rows], additive
        assert mask.shape[-2:] == (rows, s + rows)
        ctx = torch.tensor([prompt + [anchor] + tree.tokens])
        pos = torch.tensor([list(range(s)) + tree_positions(tree, s)])
        causal = torch.full((s + rows, s + rows), torch.finfo(torch.float32).min).triu(1)
        causal[s:, :] = mask[0, 0]
        out = target(input_ids=ctx, position_ids=pos, attention_mask=causal[None, None], output_hidden_states=True)
        logits.append(out.logits[0, s:])
        hidden.append(out.hidden_states[-1][0, s:])
    batch = TreeBatch.stack(trees)
    seq_lens = torch.tensor([len(p) for p in prompts])
    verify = tree_verify_inputs(batch, torch.tensor(anchors), seq_lens, depth=4)
    assert verify.positions.view(3, rows).tolist() == [tree_positions(t, len(p)) for t, p in zip(trees, prompts)]
    acc = accept_tree(verify, torch.cat(logits))
    committed = committed_rows(verify, acc)
    assert committed.commit_lens.tolist() == [5, 4, 3]

    # the block's slots: request n lives in req_to_token row req[n]; its block at [seq_len, seq_len + rows)
    req = torch.tensor([2, 0, 3])
    req_to_token = torch.randperm(400, generator=torch.Generator().manual_seed(4))[:4 * 100].view(4, 100).int()
    before = req_to_token.clone()
    cols = seq_lens[:, None] + torch.arange(rows)
    loc_2d = req_to_token[req[:, None], cols].long()
    pool = torch.zeros(400, hidden[0].shape[-1])
    pool[loc_2d.reshape(-1)] = torch.cat(hidden)  # the verify pass writes row r's state into slot loc_2d[n, r]
    front = bring_to_front(committed.order, loc_2d, req_to_token, req, seq_lens)
    front_hidden = rows_to_front(torch.cat(hidden), committed.order).view(3, rows, -1)
    front_logits = rows_to_front(torch.cat(logits), committed.order).view(3, rows, -1)
    for n, (prompt, anchor) in enumerate(zip(prompts, anchors)):
        c, s = committed.commit_lens[n].item(), len(prompt)
        assert committed.out_tokens[n, :c].tolist() == greedy[n][:c]
        seq = prompt + [anchor] + greedy[n][: c - 1]  # context, anchor, the accepted path
        ref = target(input_ids=torch.tensor([seq]), output_hidden_states=True)
        for j in range(c):
            slot = req_to_token[req[n], s + j].item()
            torch.testing.assert_close(pool[slot], ref.hidden_states[-1][0, s + j], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(front_hidden[n, :c], ref.hidden_states[-1][0, s:], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(front_logits[n, :c], ref.logits[0, s:], atol=1e-4, rtol=1e-4)
        block = req_to_token[req[n], s: s + rows]
        assert block.tolist() == front[n].tolist()
        assert sorted(block.tolist()) == sorted(before[req[n], s: s + rows].tolist())
        req_to_token[req[n], s: s + rows] = before[req[n], s: s + rows]
    assert torch.equal(req_to_token, before)  # nothing outside the blocks moved


def test_committed_rows_refuse_a_path_wider_than_the_block():
    trees = TreeBatch.stack([DraftTree.from_paths([[1, 2]])])
    verify = tree_verify_inputs(trees, torch.tensor([0]), torch.tensor([3]), depth=2)
    acc = accept_tree(verify, torch.randn(3, 5))
    wide = type(acc)(torch.cat([acc.accept_index, acc.accept_index], 1), acc.accepted, acc.bonus)
    with pytest.raises(ValueError, match="accept_index"):
        committed_rows(verify, wide)


@pytest.mark.gpu
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_gpu_tree_sampling_keeps_the_target_law(tmp_path, target, temperature):
    """`accept_tree` at T > 0 as the served step runs it (SGLang's SamplingBatchInfo for the requests, DFlash's
    target probabilities, SGLang's tree sampling kernel over `retrieve_links`, the server's lossless thresholds):
    20,000 copies of a branching depth-3 tree emit their sequences with the exact law of the target sampling one
    token at a time (chi-square), and `committed_rows` emits those tokens."""
    import sglang_on_cpu
    from sglang.srt.runtime_context import publish
    from sglang.srt.sampling.sampling_params import SamplingParams
    from test_serving_glue import _sampling_info

    from sglang_dspine.drafter.checkpoint import save_drafter
    from sglang_dspine.drafter.tiny import tiny_drafter

    # SGLang builds a batch's sampling info from the published configuration: a DSPINE server's on a tiny pair
    target.save_pretrained(tmp_path / "target")
    save_drafter(tiny_drafter(target, seed=0), tmp_path / "dspine")
    publish(sglang_on_cpu.server_args(tmp_path / "target", tmp_path / "dspine"), role="test")
    dev, v, n = torch.device("cuda"), 5, 20000
    tree = DraftTree.from_paths(PATHS)
    rows = len(tree) + 1
    logits = torch.randn(rows, v, generator=torch.Generator().manual_seed(5))
    probs = torch.softmax(logits.double() / temperature, -1)
    params = SamplingParams(temperature=temperature, top_k=-1, top_p=1.0)
    params.normalize(None)
    info = _sampling_info([params] * n, v, "cuda")
    trees = TreeBatch.stack([tree] * n, device=dev)
    verify = tree_verify_inputs(trees, torch.zeros(n, dtype=torch.long, device=dev),
                                torch.full((n,), 3, device=dev), depth=3)
    torch.manual_seed(3)
    acc = accept_tree(verify, logits.to(dev).repeat(n, 1), info, thresholds=(1.0, 1.0))
    out = committed_rows(verify, acc).out_tokens.cpu()
    counts = {}
    for b, a in enumerate(acc.accepted.cpu().tolist()):
        seq = tuple(out[b, : a + 1].tolist())
        counts[seq] = counts.get(seq, 0) + 1
    exact = tree_walk_law(tree, probs.tolist(), v)
    assert set(counts) <= set(exact)
    pv, cells = chi_square_p(counts, exact)
    assert cells > 25 and pv > 1e-3


@pytest.mark.parametrize("wide", [False, True], ids=["N=B", "N=B+2"])
def test_a_tree_steps_tail_leaves_dspine_a_chains_state(served, wide):
    """The tree step after its acceptance (`DSpineWorker._commit_tree_path`), on the SGLang draft model with a draft
    KV pool on the CPU and DFlash's own context writer: three requests verify trees of N - 1 nodes, N = B = 4
    verify rows a request, or N = B + 2 (a tree wider than the block: the draft K/V and the next draft stay B
    wide). Each verify row's target features are random; the target's argmax walks node 1 then its child node 2
    for the first request, so the path skips row 1; node 0 alone (N = B), or node 0 then its child node 4, verify
    row 5, past the block's rows (N = B + 2), for the second; nothing for the third. After it:
    - the tokens out and accept lengths are the walk's;
    - at every committed position seq_len + j, the slot req_to_token now gives holds the draft K/V DFlash's writer
      makes from the features of the j-th committed row ([anchor, accepted nodes]) at that position: a chain
      step's draft K/V over the accepted path;
    - the next decode step's draft, from the bonus tokens and the new lengths, is the plain drafter's draft on the
      context extended by those features: DSpine's per-request state after a tree step is a chain's."""
    import sglang_on_cpu
    from sglang.srt.layers.logits_processor import LogitsProcessorOutput

    from sglang_dspine.drafter.tree_batch import TreeBatch
    from sglang_dspine.serving.tree_verify import accept_tree, tree_verify_inputs
    from sglang_dspine.serving.worker import DSpineWorker

    b = served.plain.cfg.block_size
    rows_n = b + 2 if wide else b  # verify rows per request [anchor, nodes...]
    n = rows_n - 1
    shell = sglang_on_cpu.step_shell(served, DSpineWorker, 2 * rows_n, seed=8)  # SGLang reserves 2 N
    worker, g, width, req_to_token = shell.worker, shell.g, shell.width, shell.req_to_token
    seq_lens, anchors, req = shell.seq_lens, shell.anchors, shell.req
    # the trees: node 0 and node 1 under the anchor, node 2 under node 1 (rows 1, 2, 3); N = B + 2: node 3
    # under node 2 (depth 3 = B - 1), node 4 under node 0 (rows 4, 5)
    tokens = torch.tensor([[7, 8, 9, 10, 11], [12, 13, 14, 15, 16], [20, 21, 22, 23, 24]])[:, :n]
    parents, depths = torch.tensor([[-1, -1, 1, 2, 0]] * 3)[:, :n], torch.tensor([[1, 1, 2, 3, 2]] * 3)[:, :n]
    trees = TreeBatch(tokens, parents, depths, torch.zeros(3, n))
    verify = tree_verify_inputs(trees, anchors, seq_lens, depth=b - 1)
    logits = torch.randn(3, rows_n, VOCAB, generator=g)
    # (row, the target's argmax); the bonus tokens 40..42 are on no node
    wanted = {0: [(0, 8), (2, 9), (3, 40)], 1: [(0, 12), (1, 16), (5, 41)] if wide else [(0, 12), (1, 41)],
              2: [(0, 42)]}
    for i, picks in wanted.items():
        for row, tok in picks:
            logits[i, row, tok] = 100.0
    acc = accept_tree(verify, logits.view(-1, VOCAB))
    accepted = [2, 2 if wide else 1, 0]
    assert acc.accepted.tolist() == accepted and acc.bonus.tolist() == [40, 41, 42]
    verify_feats = torch.randn(3 * rows_n, width, generator=g)
    out = LogitsProcessorOutput(next_token_logits=logits.view(-1, VOCAB).clone(), hidden_states=verify_feats.clone())
    cols = seq_lens[:, None] + torch.arange(rows_n)
    loc_2d = req_to_token.req_to_token[req[:, None], cols].long()  # the verify's N slots a request
    block_positions = (seq_lens[:, None] + torch.arange(b)).reshape(-1)  # the draft block's positions
    with torch.no_grad():
        result = worker._commit_tree_path(verify, acc, out, loc_2d=loc_2d, positions=block_positions,
                                          prefix_lens=seq_lens, req_to_token=req_to_token.req_to_token,
                                          req_pool_indices=req, logprobs=True)
    assert result.accept_lens.tolist() == [a + 1 for a in accepted] and result.speculative_num_draft_tokens == rows_n
    emitted = result.next_token_ids.view(3, rows_n)
    assert [emitted[i, : a + 1].tolist() for i, a in enumerate(accepted)] == \
        [[8, 9, 40], [12, 16, 41] if wide else [12, 41], [42]]
    committed = [[0, 2, 3], [0, 1, 5] if wide else [0, 1], [0]]  # each request's committed verify rows
    for i, rows in enumerate(committed):
        torch.testing.assert_close(out.next_token_logits.view(3, rows_n, -1)[i, : len(rows)], logits[i, rows])
    nd = result.next_draft_input
    assert nd.bonus_tokens.tolist() == [40, 41, 42] and nd.new_seq_lens.tolist() == (seq_lens + result.accept_lens).tolist()

    # the draft K/V at each committed position, and the next step's draft: a chain step's over the path
    sglang_on_cpu.assert_chain_state(served, shell, [verify_feats.view(3, rows_n, -1)[i, rows]
                                                     for i, rows in enumerate(committed)], nd)
