"""The batched, fixed-shape draft trees (sglang_dspine/drafter/tree_batch.py) against the per-request offline
rules they must equal (drafter/tree.py's best-first heap, ancestor mask; training/tree_generate.py's walk) and
against the exact law of the lossless walk."""
from __future__ import annotations

import pytest
import torch
from sampling_stats import chi_square_p, tree_walk_law

from sglang_dspine.drafter.tree import DraftTree, ancestor_mask, best_first
from sglang_dspine.drafter.tree_batch import TreeBatch, accept, ancestor_masks, lattice_trees, tree_size
from sglang_dspine.training.tree_generate import verify_tree


def random_lattice(bs, p, k, vocab, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    cand = torch.stack([torch.stack([torch.randperm(vocab, generator=g)[:k] for _ in range(p)]) for _ in range(bs)])
    log_scores = torch.log_softmax(3 * torch.randn(bs, p, k, k, generator=g, dtype=dtype), dim=-1)
    return cand, log_scores


def heap_tree(cand, log_scores, budget) -> DraftTree:
    """One request's tree by tree.py's heap: depth 1 reads row 0 (the anchor's), as table_log_scores gives it."""
    logp = [log_scores[0, :1]] + [log_scores[i] for i in range(1, log_scores.shape[0])]
    return best_first(logp, list(cand), budget)


@pytest.mark.parametrize("p,k,budget", [(4, 3, 5), (6, 4, 20), (15, 16, 64), (15, 16, 16), (3, 2, 100), (1, 5, 3)])
def test_lattice_trees_equal_the_heaps_best_first_trees(p, k, budget):
    """Every request's tree equals tree.py's best_first on the same log-scores: the same nodes in the same
    (best-first) order with the same parents, depths and path scores; its size is tree_size's."""
    bs = 5
    cand, log_scores = random_lattice(bs, p, k, vocab=50, seed=p * 100 + k + budget)
    got = lattice_trees(cand, log_scores, budget)
    assert got.size == tree_size(p, k, budget)
    for i in range(bs):
        ref = heap_tree(cand[i], log_scores[i], budget)
        assert len(ref) == got.size
        assert got.tokens[i].tolist() == ref.tokens
        assert got.parents[i].tolist() == ref.parents
        assert got.depths[i].tolist() == ref.depths
        assert got.scores[i].tolist() == pytest.approx(ref.scores, abs=1e-9)


def test_lattice_trees_keep_a_parent_before_a_child_that_ties_it():
    """Transitions of probability 1 (log-score 0) make children tie their parents: the parent still comes first
    and every node's parent is in the tree."""
    cand = torch.arange(12).view(1, 4, 3)
    log_scores = torch.full((1, 4, 3, 3), -50.0)
    log_scores[..., 0] = 0.0  # candidate 0 after anything: certain
    got = lattice_trees(cand, log_scores, 6)
    assert got.tokens[0, :4].tolist() == [0, 3, 6, 9] and got.parents[0, :4].tolist() == [-1, 0, 1, 2]
    for n, par in enumerate(got.parents[0].tolist()):
        assert -1 <= par < n


def test_lattice_trees_check_their_arguments():
    cand, log_scores = random_lattice(2, 3, 4, vocab=20, seed=0)
    with pytest.raises(ValueError, match="log_scores"):
        lattice_trees(cand, log_scores[:, :2], 4)
    with pytest.raises(ValueError, match="budget 0"):
        lattice_trees(cand, log_scores, 0)


def test_ancestor_masks_hold_each_nodes_path():
    """Row m + 1 of each request's mask sees the anchor and exactly the nodes of node m's path (DraftTree.path);
    the anchor's row sees itself only. tree.ancestor_mask is one tree of the same mask."""
    cand, log_scores = random_lattice(4, 6, 3, vocab=30, seed=7)
    trees = lattice_trees(cand, log_scores, 17)
    masks = ancestor_masks(trees, depth=6)
    for i in range(4):
        ref = DraftTree(trees.tokens[i].tolist(), trees.parents[i].tolist(), trees.depths[i].tolist(),
                        trees.scores[i].tolist())
        want = torch.zeros(len(ref) + 1, len(ref) + 1, dtype=torch.bool)
        want[:, 0] = True
        for m in range(len(ref)):
            want[m + 1, [a + 1 for a in ref.path(m)]] = True
        assert torch.equal(masks[i], want)
        assert torch.equal(ancestor_mask(ref), want)


def test_greedy_acceptance_equals_the_offline_walk():
    """T = 0 over a small vocabulary (so that many nodes match): each request's accepted path and next token are
    verify_tree's; the emitted tokens are the path's tokens then the next token."""
    bs, p, k, vocab = 64, 5, 3, 4
    cand, log_scores = random_lattice(bs, p, k, vocab, seed=11)
    trees = lattice_trees(cand, log_scores, 12)
    logits = torch.randn(bs, trees.size + 1, vocab, generator=torch.Generator().manual_seed(12))
    got = accept(trees, logits, 0.0, depth=p)
    lengths = set()
    for i in range(bs):
        tree = DraftTree(trees.tokens[i].tolist(), trees.parents[i].tolist(), trees.depths[i].tolist(),
                         trees.scores[i].tolist())
        path, nxt = verify_tree(logits[i], tree, 0.0, None)
        assert got.accepted[i].item() == len(path)
        assert got.path[i].tolist() == path + [-1] * (p - len(path))
        assert got.next_token[i].item() == nxt
        assert got.emitted(trees)[i].tolist() == [tree.tokens[m] for m in path] + [nxt] + [-1] * (p - len(path))
        lengths.add(len(path))
    assert len(lengths) >= 3  # the walk ended at several depths


# A branching depth-3 tree (tests/test_tree.py's), every parent before its children.
PATHS = [[0, 1, 2], [1, 4, 0], [2], [0, 3], [1, 4, 1], [0, 1, 4]]


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_sampled_acceptance_emits_the_targets_law(temperature):
    """T > 0: 20,000 copies of one tree in one batch; the emitted sequences (accepted path, then the next token)
    follow the exact law Π p_node(token) along the walk, which ends at the first token that is not a child of its
    node (enumerated; chi-square over every sequence), and the walk reaches the deepest nodes."""
    v, n = 5, 20000
    tree = DraftTree.from_paths(PATHS)
    logits = torch.randn(len(tree) + 1, v, generator=torch.Generator().manual_seed(5))
    exact = tree_walk_law(tree, torch.softmax(logits.double() / temperature, -1).tolist(), v)
    trees = TreeBatch.stack([tree] * n)
    got = accept(trees, logits.expand(n, -1, -1), temperature, depth=3, generator=torch.Generator().manual_seed(2))
    emitted = got.emitted(trees)
    counts = {}
    for row, a in zip(emitted.tolist(), got.accepted.tolist()):
        counts[tuple(row[: a + 1])] = counts.get(tuple(row[: a + 1]), 0) + 1
    assert set(counts) <= set(exact)
    assert (got.accepted == 3).sum() > 0.01 * n
    pv, cells = chi_square_p(counts, exact)
    assert cells > 25 and pv > 1e-3


def test_tree_batch_stack_wants_one_size():
    with pytest.raises(ValueError, match="one size"):
        TreeBatch.stack([DraftTree.from_paths([[1, 2]]), DraftTree.from_paths([[1]])])


def test_sglangs_tree_verify_kernel_walks_the_retrieve_links_to_the_same_path():
    """SGLang's own greedy tree-verify kernel (its Triton version, through Triton's interpreter on CPU) fed
    with retrieve_links of the batched trees accepts the path `accept` accepts: the same accepted count, the
    same rows (anchor first), and the target's token written at each accepted row."""
    from sglang.srt.speculative.eagle_utils import verify_tree_greedy_triton

    from sglang_dspine.drafter.tree_batch import retrieve_links

    bs, p, k, vocab = 32, 5, 3, 4
    cand, log_scores = random_lattice(bs, p, k, vocab, seed=21)
    trees = lattice_trees(cand, log_scores, 12)
    n = trees.size
    logits = torch.randn(bs, n + 1, vocab, generator=torch.Generator().manual_seed(22))
    ours = accept(trees, logits, 0.0, depth=p)
    links = retrieve_links(trees)
    target = logits.argmax(-1)
    predicts = torch.full((bs * (n + 1),), -1, dtype=torch.long)
    accept_index = torch.full((bs, p + 1), -1, dtype=torch.long)
    accept_num = torch.zeros(bs, dtype=torch.long)
    candidates = torch.cat([torch.zeros(bs, 1, dtype=torch.long), trees.tokens], dim=1)  # the anchor's row first
    verify_tree_greedy_triton(predicts, accept_index, accept_num, candidates, links.index, links.next_token,
                              links.next_sibling, target)
    assert accept_num.tolist() == ours.accepted.tolist()
    for b in range(bs):
        a = ours.accepted[b].item()
        rows = [0] + [m + 1 for m in ours.path[b, :a].tolist()]
        assert accept_index[b, : a + 1].tolist() == [b * (n + 1) + r for r in rows]
        # the kernel writes the target's token at every accepted row but the last (its bonus is the caller's)
        assert [predicts[b * (n + 1) + r].item() for r in rows[:-1]] == [trees.tokens[b, m].item()
                                                                          for m in ours.path[b, :a].tolist()]
    assert len(set(accept_num.tolist())) >= 3


def test_retrieve_links_of_a_known_tree():
    """next_token/next_sibling of the PATHS tree written out by hand (rows: 0 the anchor, m + 1 node m)."""
    from sglang_dspine.drafter.tree_batch import retrieve_links

    tree = DraftTree.from_paths(PATHS)  # nodes: 0:[0] 1:[0,1] 2:[0,1,2] 3:[1] 4:[1,4] 5:[1,4,0] 6:[2] 7:[0,3] ...
    links = retrieve_links(TreeBatch.stack([tree, tree]))
    kids = tree.children()
    for r in range(len(tree) + 1):
        first = kids[r][0] + 1 if kids[r] else -1
        assert links.next_token[1, r].item() == first
    for m, par in enumerate(tree.parents):
        after = [c for c in kids[par + 1] if c > m]
        assert links.next_sibling[0, m + 1].item() == (after[0] + 1 if after else -1)
    assert links.next_sibling[:, 0].tolist() == [-1, -1]
    assert links.index[1].tolist() == list(range(len(tree) + 1, 2 * (len(tree) + 1)))


@pytest.mark.gpu
@pytest.mark.parametrize("on_kernel", [False, True])
def test_lattice_trees_replay_in_a_cuda_graph(on_kernel):
    """The builder (its tensor operations, or the one kernel), mask and links, and the tree step's verify layout
    (`tree_layout`), at serving size (P = 15, K = 16, N = 64) captured in one CUDA graph and replayed on new inputs give what they give eagerly on those inputs
    (no host sync, fixed shapes); the kernel's trees equal lattice_trees' there too."""
    dev = torch.device("cuda")
    bs, p, k, budget = 8, 15, 16, 64
    from sglang_dspine.drafter.tree_batch import retrieve_links
    from sglang_dspine.serving.tree_verify import tree_layout

    seq_lens = torch.arange(bs, device=dev) * 5 + 7  # the tree step's layout reads the committed lengths

    def run(cand, ls):
        t = _kernel_trees(cand, ls, budget) if on_kernel else lattice_trees(cand, ls, budget)
        links = retrieve_links(t)
        layout = tree_layout(t, seq_lens, p)  # what TreeDraftSampler builds in the draft graph
        return [t.tokens, t.parents, t.depths, t.scores, ancestor_masks(t, p), links.next_token, links.next_sibling,
                layout.positions, layout.masks, layout.mask_index, layout.links.next_sibling]

    cand, ls = (x.to(dev) for x in random_lattice(bs, p, k, vocab=1000, seed=1, dtype=torch.float32))
    static_cand, static_ls = cand.clone(), ls.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run(static_cand, static_ls)  # warm-up off the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = run(static_cand, static_ls)
    cand2, ls2 = (x.to(dev) for x in random_lattice(bs, p, k, vocab=1000, seed=2, dtype=torch.float32))
    static_cand.copy_(cand2)
    static_ls.copy_(ls2)
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip(outs, run(cand2, ls2)):
        assert torch.equal(got, want)
    if on_kernel:
        _assert_same_trees(_kernel_trees(cand2, ls2, budget), lattice_trees(cand2, ls2, budget))


@pytest.mark.gpu
def test_sglangs_tree_sampling_kernel_emits_the_targets_law_on_the_retrieve_links():
    """SGLang's sampling verify kernel (tree_speculative_sampling_target_only, what its DFLASH verify calls at
    T > 0, with point-mass drafts: draft probabilities 0, thresholds 1) walking retrieve_links of the PATHS tree:
    the emitted sequences follow the exact law (chi-square), as `accept`'s do on the CPU. Taken from where the
    release's DFLASH takes it (sgl_kernel on 0.5.17, a JIT-built sglang.kernels op on 0.5.23)."""
    from sglang.srt.speculative.dflash_utils import tree_speculative_sampling_target_only

    assert tree_speculative_sampling_target_only is not None, "this SGLang has no tree sampling kernel on CUDA"

    from sglang_dspine.drafter.tree_batch import retrieve_links

    dev = torch.device("cuda")
    v, n, depth = 5, 20000, 3
    tree = DraftTree.from_paths(PATHS)
    rows = len(tree) + 1
    logits = torch.randn(rows, v, generator=torch.Generator().manual_seed(5))
    probs = torch.softmax(logits.double(), -1)
    trees = TreeBatch.stack([tree] * n, device=dev)
    links = retrieve_links(trees)
    candidates = torch.cat([torch.zeros(n, 1, dtype=torch.long, device=dev), trees.tokens], dim=1)
    target_probs = probs.float().to(dev).expand(n, -1, -1).contiguous()
    predicts = torch.full((n * rows,), -1, dtype=torch.int32, device=dev)
    accept_index = torch.full((n, depth + 1), -1, dtype=torch.int32, device=dev)
    accept_num = torch.zeros(n, dtype=torch.int32, device=dev)
    g = torch.Generator(device=dev).manual_seed(3)
    tree_speculative_sampling_target_only(
        predicts=predicts, accept_index=accept_index, accept_token_num=accept_num, candidates=candidates,
        retrive_index=links.index, retrive_next_token=links.next_token, retrive_next_sibling=links.next_sibling,
        uniform_samples=torch.rand(n, rows, device=dev, generator=g),
        uniform_samples_for_final_sampling=torch.rand(n, device=dev, generator=g),
        target_probs=target_probs, draft_probs=torch.zeros_like(target_probs),
        threshold_single=1.0, threshold_acc=1.0, deterministic=True)
    counts = {}
    cand, idx, pred = candidates.cpu(), accept_index.cpu().long(), predicts.cpu().long()
    for b, a in enumerate(accept_num.cpu().tolist()):
        seq = tuple(cand[b, idx[b, j] % rows].item() for j in range(1, a + 1)) + (pred[idx[b, a]].item(),)
        counts[seq] = counts.get(seq, 0) + 1
    exact = tree_walk_law(tree, probs.tolist(), v)
    assert set(counts) <= set(exact)
    pv, cells = chi_square_p(counts, exact)
    assert cells > 25 and pv > 1e-3


def eagle_tree_inputs(bs, topk, depth, num_verify, seed):
    """Inputs of SGLang's EAGLE tree builder as its draft loop makes them, from random log-probs: step 0 offers
    topk tokens under the root; each later step expands the topk best nodes of the step before (its beam) by topk
    children each; the num_verify - 1 best nodes over all steps are selected, in ascending flat index.
    Flat index of a node: step 0's j is j; step i's child c of beam b is topk + (i-1)·topk² + b·topk + c.
    parent_list[1 + i·topk + b] is the flat index of step i's beam b (parent_list[0] = -1)."""
    g = torch.Generator().manual_seed(seed)
    parents, scores = [torch.full((bs, 1), -1, dtype=torch.long)], []
    cum = torch.log_softmax(torch.randn(bs, topk, generator=g), -1)  # step 0
    scores.append(cum)
    flat = torch.arange(topk).expand(bs, topk)
    for i in range(1, depth):
        beam_scores, beam = cum.topk(topk, dim=1)
        parents.append(flat.gather(1, beam))
        cum = (beam_scores[..., None] + torch.log_softmax(torch.randn(bs, topk, topk, generator=g), -1)).reshape(bs, -1)
        flat = topk + (i - 1) * topk * topk + torch.arange(topk * topk).expand(bs, -1)
        scores.append(cum)
    selected = torch.cat(scores, 1).topk(num_verify - 1, dim=1).indices.sort(dim=1).values
    return torch.cat(parents, 1), selected


def test_full_tree_mask_positions_and_links_equal_sglangs_tree_builder():
    """SGLang's EAGLE tree builder (its Triton kernel, interpreted) on random EAGLE draft trees writes a tree
    mask (FULL_MASK layout), positions and retrieve links; the same trees as a TreeBatch (parents read off its
    links) give the same three from full_tree_mask(ancestor_masks), verify_positions and retrieve_links."""
    from sglang.srt.speculative.eagle_utils import sgl_build_tree_kernel_triton

    from sglang_dspine.drafter.tree_batch import full_tree_mask, retrieve_links, verify_positions

    bs, topk, depth, r = 3, 3, 4, 10
    parent_list, selected = eagle_tree_inputs(bs, topk, depth, r, seed=4)
    seq_lens = torch.tensor([5, 0, 12])
    mask = torch.ones(int(seq_lens.sum()) * r + bs * r * r, dtype=torch.bool)
    positions = torch.empty(bs * r, dtype=torch.long)
    index, next_token, next_sibling = torch.full((3, bs, r), -1, dtype=torch.long)
    sgl_build_tree_kernel_triton(parent_list, selected, seq_lens, mask, positions, index, next_token, next_sibling,
                                 topk, depth, r)
    parents = torch.full((bs, r - 1), -2, dtype=torch.long)
    for b in range(bs):
        for row in range(r):
            c = next_token[b, row].item()
            while c != -1:
                parents[b, c - 1] = row - 1
                c = next_sibling[b, c].item()
    assert (parents >= -1).all()  # every node hangs under a row
    depths = torch.zeros_like(parents)
    for m in range(r - 1):
        depths[:, m] = torch.where(parents[:, m] < 0, 1, depths.gather(1, parents[:, m:m + 1].clamp_min(0))[:, 0] + 1)
    trees = TreeBatch(torch.zeros_like(parents), parents, depths, torch.zeros(bs, r - 1))
    assert depths.amax().item() > 2  # the trees go deep
    links = retrieve_links(trees)
    assert torch.equal(links.index, index) and torch.equal(links.next_token, next_token)
    assert torch.equal(links.next_sibling, next_sibling)
    assert torch.equal(verify_positions(trees, seq_lens), positions)
    assert torch.equal(full_tree_mask(ancestor_masks(trees, depth), seq_lens), mask)


# ------------------------------------------------------------------------ the builder on one kernel (Triton)
def _kernel_trees(cand, ls, budget):
    from sglang_dspine.kernels.tree_build import lattice_trees_kernel

    return TreeBatch(*lattice_trees_kernel(cand, ls, budget))


def _assert_same_trees(got: TreeBatch, want: TreeBatch):
    for name in ("tokens", "parents", "depths", "scores"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name


@pytest.mark.parametrize("p,k,budget", [(4, 3, 5), (6, 4, 20), (15, 16, 15), (5, 16, 63), (3, 2, 100), (1, 5, 3),
                                        (2, 16, 64)])
def test_the_tree_kernel_equals_lattice_trees(p, k, budget):
    """The one-kernel builder (Triton; its interpreter on CPU) returns lattice_trees' trees exactly, in every
    regime: budget below K, between K and the lattice, above the whole lattice (the serving size, P = 15 with
    63 nodes, in test_lattice_trees_replay_in_a_cuda_graph on the GPU: its 1,024-key sorts take a minute in the
    interpreter)."""
    cand, ls = random_lattice(2, p, k, vocab=1000, seed=p * 31 + k + budget, dtype=torch.float32)
    _assert_same_trees(_kernel_trees(cand, ls, budget), lattice_trees(cand, ls, budget))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_tree_kernel_breaks_ties_as_the_stable_sort(dtype):
    """Scores rounded to halves (many exact ties, among siblings, cousins and depths) and a certain candidate
    (transition log-score 0.0 and -0.0: a child that ties its parent): the same order as lattice_trees' stable
    sort, from float32 and bf16 tables (bf16 read as float32 by both)."""
    cand, ls = random_lattice(4, 6, 4, vocab=100, seed=5, dtype=torch.float32)
    ls = (ls * 2).round() / 2
    ls[0, :, :, 1] = 0.0
    ls[1, :, :, 2] = -0.0
    ls = ls.to(dtype)
    for budget in (3, 9, 30):
        _assert_same_trees(_kernel_trees(cand, ls, budget), lattice_trees(cand, ls, budget))


def test_the_tree_kernel_checks_its_arguments():
    from sglang_dspine.kernels.tree_build import lattice_trees_kernel

    cand, ls = random_lattice(2, 3, 4, vocab=20, seed=0, dtype=torch.float32)
    with pytest.raises(ValueError, match="log_scores"):
        lattice_trees_kernel(cand, ls[:, :2], 4)
    with pytest.raises(ValueError, match="budget"):
        lattice_trees_kernel(cand, ls, 0)
    with pytest.raises(ValueError, match="float64"):
        lattice_trees_kernel(cand, ls.double(), 4)
