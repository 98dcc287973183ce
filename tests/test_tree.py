"""Draft trees (drafter/tree.py) and tree speculative generation (training/tree_generate.py).

Builders against brute-force enumeration of every path; the tree mask and the cache/context bookkeeping against
plain forwards of each path; greedy output against the target's own greedy; sampling against the target's exact
distribution (chi-square)."""
import itertools
import math

import pytest
import torch
from conftest import randomize_injection
from sampling_stats import tree_walk_law
from scipy.stats import chi2

from sglang_dspine.drafter.decoding import BlockDraft, walk
from sglang_dspine.drafter.model import DSpineDrafter
from sglang_dspine.drafter.tiny import drafter_config_for, make_target, tiny_drafter
from sglang_dspine.drafter.tree import (
    DraftTree,
    ancestor_mask,
    best_first,
    chain_tree,
    expected_accepted,
    extended_lattice_tree,
    lattice_tree,
    marginal_tree,
    tree_attention_mask,
    tree_positions,
)
from sglang_dspine.training.generate import speculative_generate, target_features
from sglang_dspine.training.tree_generate import (
    TreeProposer,
    calibration_set,
    fit_depth_calibration,
    fit_temperature,
    keep_cache_positions,
    tree_generate,
    verify_tree,
)

pytestmark = pytest.mark.usefixtures("no_grad", "one_thread")  # conftest.py

PROMPTS = [[1, 2, 3, 4, 5], [7], [9, 9, 9, 9, 9, 9, 9, 9, 30, 31], [60, 2, 44]]


# ------------------------------------------------------------------------------------------ the builders
def _log_softmax_ref(row: list[float], t: float = 1.0) -> list[float]:
    """log-softmax in float64 written out (the reference does not call torch's)."""
    m = max(x / t for x in row)
    lse = m + math.log(sum(math.exp(x / t - m) for x in row))
    return [x / t - lse for x in row]


def _top_paths(all_paths: dict, budget: int) -> dict:
    best = sorted(all_paths, key=all_paths.get, reverse=True)[:budget]
    return {p: all_paths[p] for p in best}


def _tree_paths(tree: DraftTree) -> dict:
    return {tuple(tree.path_tokens(n)): tree.scores[n] for n in range(len(tree))}


def _check_shape(tree: DraftTree) -> None:
    assert all(p < n for n, p in enumerate(tree.parents))
    assert all(a >= b - 1e-12 for a, b in zip(tree.scores, tree.scores[1:]))  # best-first order
    for n in range(len(tree)):
        assert tree.path(n)[-1] == n and len(tree.path(n)) == tree.depths[n]


def _random_block_draft(p: int, k: int, vocab: int, seed: int) -> BlockDraft:
    g = torch.Generator().manual_seed(seed)
    cand = torch.stack([torch.randperm(vocab, generator=g)[:k] for _ in range(p)])[None]  # distinct per position
    scores = torch.randn(1, p, k, k, generator=g) * 2
    scores[:, 0] = scores[:, 0, :1]  # position 1: every row is the anchor's
    choice = walk(scores)
    return BlockDraft(tokens=cand.gather(-1, choice[..., None])[..., 0], candidates=cand, scores=scores, choice=choice)


@pytest.mark.parametrize("temperature", [1.0, 0.4])
def test_lattice_tree_is_the_best_paths_of_the_transition_table(temperature):
    """Every path of depth ≤ P through the candidates, scored by the sum of log-softmax(table row of the
    predecessor) (row 0 at position 1): the tree holds exactly the `budget` best, with their scores."""
    p, k = 4, 3
    draft = _random_block_draft(p, k, vocab=50, seed=7)
    cand, sc = draft.candidates[0].tolist(), draft.scores[0].double().tolist()
    all_paths = {}
    for depth in range(1, p + 1):
        for slots in itertools.product(range(k), repeat=depth):
            score, prev = 0.0, 0
            for i, j in enumerate(slots):
                score += _log_softmax_ref(sc[i][prev], temperature)[j]
                prev = j
            all_paths[tuple(cand[i][j] for i, j in enumerate(slots))] = score
    assert len(all_paths) == 3 + 9 + 27 + 81
    for budget in (1, 2, 5, 13, 40, 119, 120, 500):
        _assert_best_paths(lattice_tree(draft, budget, temperature=temperature), all_paths, budget)


def test_anchored_lattice_tree_is_the_walk_then_the_best_other_paths():
    """anchored: the walk's chain (BlockDraft.choice) as the first nodes, as far as the budget goes, then the
    best paths outside it: the tree holds the chain's prefixes and the (budget - P) best of every other path,
    each with its own score (brute force over the whole lattice)."""
    p, k = 4, 3
    draft = _random_block_draft(p, k, vocab=50, seed=11)
    cand, sc, choice = draft.candidates[0].tolist(), draft.scores[0].double().tolist(), draft.choice[0].tolist()
    all_paths = {}
    for depth in range(1, p + 1):
        for slots in itertools.product(range(k), repeat=depth):
            score, prev = 0.0, 0
            for i, j in enumerate(slots):
                score += _log_softmax_ref(sc[i][prev])[j]
                prev = j
            all_paths[tuple(cand[i][j] for i, j in enumerate(slots))] = score
    chain = [tuple(cand[i][choice[i]] for i in range(d)) for d in range(1, p + 1)]
    for budget in (1, 3, 4, 5, 9, 30, 120, 500):
        tree = lattice_tree(draft, budget, anchored=True)
        got = _tree_paths(tree)
        assert len(tree) == min(budget, len(all_paths))
        assert [tuple(tree.path_tokens(n)) for n in range(min(budget, p))] == chain[:budget]
        assert all(abs(got[path] - all_paths[path]) < 1e-5 for path in got)
        others = {q: v for q, v in all_paths.items() if q not in chain}
        want = sorted(others.values(), reverse=True)[: max(0, budget - p)]
        assert sorted((v for q, v in got.items() if q not in chain), reverse=True) == pytest.approx(want, abs=1e-5)
        assert all(pa < n for n, pa in enumerate(tree.parents))
    with pytest.raises(ValueError, match="forced"):
        best_first([torch.zeros(1, 2)], [torch.tensor([5, 6])], 2, forced=[2])


def test_lattice_tree_per_position_temperatures_and_candidate_mass():
    """Per block position i a temperature t_i and a log mass m_i: a path's score is Σ_i (log-softmax(row / t_i)[j]
    + m_i); the tree holds the `budget` best such paths. Equal temperatures and no mass are the scalar case;
    wrong lengths and positive masses are refused."""
    p, k = 4, 3
    draft = _random_block_draft(p, k, vocab=50, seed=11)
    cand, sc = draft.candidates[0].tolist(), draft.scores[0].double().tolist()
    temps, mass = [0.3, 1.0, 2.5, 0.7], [-0.9, -0.05, -0.4, 0.0]
    all_paths = {}
    for depth in range(1, p + 1):
        for slots in itertools.product(range(k), repeat=depth):
            score, prev = 0.0, 0
            for i, j in enumerate(slots):
                score += _log_softmax_ref(sc[i][prev], temps[i])[j] + mass[i]
                prev = j
            all_paths[tuple(cand[i][j] for i, j in enumerate(slots))] = score
    for budget in (1, 4, 13, 60, 120):
        _assert_best_paths(lattice_tree(draft, budget, temperature=temps, log_mass=mass), all_paths, budget)
    assert _tree_paths(lattice_tree(draft, 30, temperature=[0.4] * p)) == \
        pytest.approx(_tree_paths(lattice_tree(draft, 30, temperature=0.4)))
    with pytest.raises(ValueError, match="temperatures"):
        lattice_tree(draft, 5, temperature=[1.0] * (p - 1))
    with pytest.raises(ValueError, match="log_mass"):
        lattice_tree(draft, 5, log_mass=[0.1] + [0.0] * (p - 1))


def _assert_best_paths(tree, all_paths: dict, budget: int) -> None:
    """`tree` holds `budget` nodes (all paths, where there are fewer), well formed, and its paths are the
    `budget` best of `all_paths` with their scores."""
    assert len(tree) == min(budget, len(all_paths))
    _check_shape(tree)
    got, want = _tree_paths(tree), _top_paths(all_paths, budget)
    assert set(got) == set(want)
    assert all(abs(got[q] - want[q]) < 1e-5 for q in want)


def test_marginal_tree_is_the_best_paths_of_independent_marginals():
    """DDTree's rule: a path's score is the sum of its positions' full-vocabulary log-softmax; the tree holds the
    `budget` best of every token sequence of depth ≤ P (all V tokens per position enumerated)."""
    p, v = 4, 7
    logits = torch.randn(p, v, generator=torch.Generator().manual_seed(3)) * 1.5
    lp = [_log_softmax_ref(row) for row in logits.double().tolist()]
    all_paths = {seq: sum(lp[i][t] for i, t in enumerate(seq))
                 for depth in range(1, p + 1) for seq in itertools.product(range(v), repeat=depth)}
    for budget in (1, 3, 6, 10, 33, 100):
        _assert_best_paths(marginal_tree(logits, budget), all_paths, budget)


def test_extended_lattice_tree_is_the_best_paths_of_its_distribution():
    """The extended rule's distribution written out per step (candidates after a candidate: m_i × the row's
    softmax; everything else: the marginal), every token sequence of depth ≤ P enumerated over the vocabulary."""
    p, k, v, t_row, t_marg = 3, 3, 9, 0.7, 1.3
    draft = _random_block_draft(p, k, vocab=v, seed=11)
    logits = torch.randn(p, v, generator=torch.Generator().manual_seed(4)) * 1.5
    cand, sc = draft.candidates[0].tolist(), draft.scores[0].double().tolist()
    q = [[math.exp(x) for x in _log_softmax_ref(row, t_marg)] for row in logits.double().tolist()]

    def step(i, prev, tok):
        prev_slot = 0 if i == 0 else (cand[i - 1].index(prev) if prev in cand[i - 1] else None)
        if prev_slot is not None and tok in cand[i]:
            mass = sum(q[i][c] for c in cand[i])
            return math.log(mass) + _log_softmax_ref(sc[i][prev_slot], t_row)[cand[i].index(tok)]
        return math.log(q[i][tok])

    all_paths = {}
    for depth in range(1, p + 1):
        for seq in itertools.product(range(v), repeat=depth):
            all_paths[seq] = sum(step(i, seq[i - 1] if i else None, t) for i, t in enumerate(seq))
    for budget in (1, 4, 12, 40, 150):
        _assert_best_paths(extended_lattice_tree(draft, logits, budget, row_temperature=t_row,
                                                 marginal_temperature=t_marg), all_paths, budget)


def test_fit_temperature_recovers_the_temperature_of_the_labels():
    """Soft labels softmax(z / 0.5): the cross-entropy of softmax(z / t) is smallest at t = 0.5 (on the grid)."""
    z = torch.randn(3000, 10, generator=torch.Generator().manual_seed(0)) * 2
    for t_true in (0.5, 1.6):
        t, ce = fit_temperature(z, torch.softmax(z / t_true, -1))
        assert abs(math.log(t / t_true)) < 0.07
        assert ce[t] == min(ce.values()) and ce[t] < ce[max(ce)] and ce[t] < ce[min(ce)]


def test_calibration_set_without_a_whole_block_says_so(target, dspine):
    """Continuations shorter than a block leave no anchor to score: a clear error, not an empty concatenation."""
    with pytest.raises(ValueError, match="no anchor with a whole block"):
        calibration_set(target, dspine, [PROMPTS[0]], dspine.cfg.block_size - 2, 0.0)


def test_calibration_set_labels_the_targets_greedy_tokens(target, dspine):
    """At T=0 each backbone row's label is the target's greedy next token given the true prefix, and the table
    rows are taken at the true predecessor (the anchor's row for position 1)."""
    prompt, b = PROMPTS[0], dspine.cfg.block_size
    cal = calibration_set(target, dspine, [prompt], 10, 0.0, stride=3)
    seq = prompt + greedy_reference(target, prompt, 10)
    anchors = list(range(len(prompt), len(seq) - b + 1, 3))
    assert cal.marginal.shape == (len(anchors) * (b - 1), target.config.vocab_size)
    want = torch.tensor([seq[a + 1 + i] for a in anchors for i in range(b - 1)])
    assert torch.equal(cal.marginal_labels.argmax(-1), want)
    assert torch.equal(cal.marginal_labels.sum(-1), torch.ones(len(want)))
    # T=1: soft labels; the first row is the first block's anchor row, labelled with the target's
    # distribution on its candidates, renormalised
    cal = calibration_set(target, dspine, [prompt], 10, 1.0, stride=3)
    assert cal.rows is not None and cal.rows.shape[1] == dspine.cfg.dspine.top_k
    assert torch.allclose(cal.row_labels.sum(-1), torch.ones(len(cal.rows)))
    prop = TreeProposer(dspine, target, 1, "lattice")
    out = target(input_ids=torch.tensor([seq]), output_hidden_states=True)
    prop.extend(out.hidden_states, 0, anchors[0])
    bo, anc = prop.block(seq[: anchors[0] + 1])
    d = dspine.draft(bo, target.lm_head.weight, anc.view(1))
    torch.testing.assert_close(cal.rows[0], d.scores[0, 0, 0].float(), atol=1e-4, rtol=1e-4)
    p_next = torch.softmax(out.logits[0, anchors[0]], -1)[d.candidates[0, 0]]
    torch.testing.assert_close(cal.row_labels[0], p_next / p_next.sum(), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(cal.marginal[: b - 1], dspine.block_logits(bo, target.lm_head.weight)[0],
                               atol=1e-4, rtol=1e-4)


def test_depth_calibration_fits_each_position_on_the_rows_a_tree_can_reach(target, dspine):
    """calibration_set marks a row reachable when every earlier true token of its block is a candidate, and
    records every reachable position's candidate mass; fit_depth_calibration fits each position on its reachable
    rows (the pooled fit where a position has too few) and takes the log of its mean mass."""
    prompt, b = PROMPTS[0], dspine.cfg.block_size
    cal = calibration_set(target, dspine, [prompt, PROMPTS[2]], 12, 1.0, stride=2)
    assert cal.row_depths.shape == cal.row_reached.shape == (len(cal.rows),)
    assert cal.reach_depths.shape == cal.reach_mass.shape
    assert bool(cal.row_reached.any()) and bool((cal.reach_mass <= 1 + 1e-9).all())
    # depth 0 (block position 1) follows the anchor: always reachable
    assert bool(cal.row_reached[cal.row_depths == 0].all())
    temps, log_mass = fit_depth_calibration(cal, b - 1, min_rows=5)
    assert len(temps) == len(log_mass) == b - 1 and all(m <= 0 for m in log_mass)
    for i in range(b - 1):
        sel = cal.row_reached & (cal.row_depths == i)
        if int(sel.sum()) >= 5:
            assert temps[i] == fit_temperature(cal.rows[sel], cal.row_labels[sel])[0]
        at = cal.reach_depths == i
        if int(at.sum()) >= 5:
            assert log_mass[i] == pytest.approx(math.log(float(cal.reach_mass[at].mean())))
    pooled = fit_temperature(cal.rows[cal.row_reached], cal.row_labels[cal.row_reached])[0]
    assert fit_depth_calibration(cal, b - 1, min_rows=10**6)[0] == [pooled] * (b - 1)
    res = tree_generate(target, TreeProposer(dspine, target, 10, "lattice", temps, row_log_mass=log_mass), prompt, 8)
    assert res.tree_sizes and set(res.tree_sizes) == {10}  # the proposer takes them
    with pytest.raises(ValueError, match="only the lattice"):
        TreeProposer(dspine, target, 10, "extended", temps)


def test_lattice_tree_of_a_drafter_starts_with_the_walks_first_pick(target, dspine):
    """On a real BlockDraft: the best node is the walk's first token (both take the anchor row's best), and a
    tree of every path of depth ≤ 2 holds the walk's first two picks."""
    from sglang_dspine.training.tree_generate import TreeProposer

    prompt = PROMPTS[0]
    out = target(input_ids=torch.tensor([prompt]), output_hidden_states=True)
    prop = TreeProposer(dspine, target, budget=8, rule="lattice")
    prop.extend(out.hidden_states, 0, len(prompt))
    seq = prompt + [int(out.logits[0, -1].argmax())]
    bo, anchors = prop.block(seq)
    draft = dspine.draft(bo, target.lm_head.weight, anchors.view(1))
    k = dspine.cfg.dspine.top_k
    tree = lattice_tree(draft, k + k * k)
    assert tree.tokens[0] == int(draft.tokens[0, 0])
    assert tuple(draft.tokens[0, :2].tolist()) in _tree_paths(tree)
    assert prop.propose_tree(seq).tokens == lattice_tree(draft, 8).tokens


# ------------------------------------------------------------------------ the tree mask and the cache
def _interleaved_tree() -> DraftTree:
    """Branches whose nodes interleave in node order, so a path's nodes are not contiguous."""
    return DraftTree.from_paths([[5, 6], [8, 9], [5, 10, 11, 12], [8, 13], [5, 10, 14], [20]])


def test_ancestor_mask_against_paths():
    tree = _interleaved_tree()
    anc = ancestor_mask(tree)
    for m in range(len(tree)):
        want = {0} | {a + 1 for a in tree.path(m)}
        assert {j for j in range(len(tree) + 1) if anc[m + 1, j]} == want
    assert anc[0].tolist() == [True] + [False] * len(tree)
    assert tree_positions(tree, 10) == [10] + [10 + d for d in tree.depths]


def _prefill(target, prompt):
    from transformers import DynamicCache

    cache = DynamicCache()
    target(input_ids=torch.tensor([prompt]), past_key_values=cache, use_cache=True)
    return cache


def _tree_pass(target, prompt, anchor, tree):
    cache = _prefill(target, prompt)
    s = len(prompt)
    out = target(input_ids=torch.tensor([[anchor] + tree.tokens]), past_key_values=cache, use_cache=True,
                 output_hidden_states=True, position_ids=torch.tensor([tree_positions(tree, s)]),
                 attention_mask=tree_attention_mask(tree, s, torch.float32))
    return out, cache


def test_tree_pass_gives_every_node_its_own_paths_outputs(target):
    """One forward over [anchor, nodes] with the tree mask = a plain causal forward of each path: logits and
    every layer's hidden state at the path's last token."""
    prompt, anchor, tree = PROMPTS[2], 17, _interleaved_tree()
    out, _ = _tree_pass(target, prompt, anchor, tree)
    for row, node in enumerate([-1] + list(range(len(tree)))):
        ref = target(input_ids=torch.tensor([prompt + [anchor] + tree.path_tokens(node)]), output_hidden_states=True)
        torch.testing.assert_close(out.logits[0, row], ref.logits[0, -1], atol=1e-4, rtol=1e-4)
        for h, hr in zip(out.hidden_states, ref.hidden_states):
            torch.testing.assert_close(h[0, row], hr[0, -1], atol=1e-4, rtol=1e-4)


def test_cache_keeps_the_accepted_path_only(target):
    """After the tree pass and keep_cache_positions, the cache equals that of a plain forward of prompt, anchor
    and the accepted path, and the next token's logits equal a plain forward's."""
    prompt, anchor, tree = PROMPTS[0], 17, _interleaved_tree()
    node = tree.tokens.index(12)  # path 5, 10, 11, 12: nodes 0, 4, 5, 6
    assert tree.path(node) == [0, 4, 5, 6]
    _, cache = _tree_pass(target, prompt, anchor, tree)
    s, path = len(prompt), tree.path(node)
    keep_cache_positions(cache, torch.cat([torch.arange(s), s + torch.tensor([0] + [m + 1 for m in path])]))
    seq = prompt + [anchor] + tree.path_tokens(node)
    ref = _prefill(target, seq)
    assert cache.get_seq_length() == len(seq)
    for layer, ref_layer in zip(cache.layers, ref.layers):
        torch.testing.assert_close(layer.keys, ref_layer.keys, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(layer.values, ref_layer.values, atol=1e-4, rtol=1e-4)
    nxt = target(input_ids=torch.tensor([[3]]), past_key_values=cache, position_ids=torch.tensor([[len(seq)]]))
    torch.testing.assert_close(nxt.logits[0, -1], target(input_ids=torch.tensor([seq + [3]])).logits[0, -1],
                               atol=1e-4, rtol=1e-4)


# --------------------------------------------------------------------------------- greedy generation
def greedy_reference(target, prompt, n):
    return target.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                           pad_token_id=0)[0, len(prompt):].tolist()


class OracleTrees:
    """A deterministic tree proposer built from the target's greedy continuation g (depth `depth`): decoys come
    first in node order, the greedy path is the last branch, so accepting it needs a walk past rejected
    siblings and a cache that keeps non-contiguous nodes. corrupt_at: a position of g made wrong in the long
    branch (the round then accepts up to it). Also wraps a TreeProposer's `extend` when given one."""

    def __init__(self, target, depth, corrupt_at=None, proposer=None, children=None):
        self.target, self.depth, self.corrupt_at, self.proposer = target, depth, corrupt_at, proposer
        self.children = children
        self.v = target.config.vocab_size
        self.cache = {}

    def greedy(self, seq):
        key = tuple(seq)
        if key not in self.cache:
            s = list(seq)
            for _ in range(self.depth):
                s.append(int(self.target(input_ids=torch.tensor([s])).logits[0, -1].argmax()))
            self.cache[key] = s[len(seq):]
        return self.cache[key]

    def extend(self, hidden_states, start, count):
        if self.proposer is not None:
            self.proposer.extend(hidden_states, start, count)

    def propose_tree(self, sequence):
        g = list(self.greedy(sequence))
        if self.children is not None:  # a full tree: every node's children are `children(greedy token)`
            paths = []
            def grow(prefix):
                if len(prefix) == self.depth:
                    paths.append(prefix)
                    return
                nxt = self.greedy(list(sequence) + prefix)[0]
                for c in self.children(nxt):
                    grow(prefix + [c])
            grow([])
            return DraftTree.from_paths(paths)
        wrong = lambda t: (t + 1) % self.v
        long = list(g)
        if self.corrupt_at is not None:
            long[self.corrupt_at] = wrong(long[self.corrupt_at])
        paths = [[wrong(g[0])], g[:1] + [wrong(g[1])], g[:2] + [wrong(g[2]), 0], long]
        return DraftTree.from_paths([q[: self.depth] for q in paths])


@pytest.mark.parametrize("corrupt_at", [None, 3])
def test_greedy_through_accepted_branches_equals_target_greedy(target, corrupt_at):
    depth = 5
    oracle = OracleTrees(target, depth, corrupt_at)
    for prompt in PROMPTS:
        res = tree_generate(target, oracle, prompt, 27, block_size=depth + 1)
        assert res.tokens == greedy_reference(target, prompt, 27)
        want = depth + 1 if corrupt_at is None else corrupt_at + 1
        assert res.accept_lengths[:-1] == [want] * (len(res.accept_lengths) - 1)  # the last round may be cut


@pytest.mark.parametrize("kind,rule,budget", [("dspine", "lattice", 1), ("dspine", "lattice", 9),
                                              ("dspine", "lattice", 40), ("dspine", "extended", 40),
                                              ("dspine", "marginal", 40), ("dflash", "marginal", 12),
                                              ("dspine", "chain", 3)])
def test_drafter_trees_greedy_equals_target_greedy(target, dspine, kind, rule, budget):
    drafter = dspine
    if kind == "dflash":
        torch.manual_seed(0)
        drafter = DSpineDrafter(drafter_config_for(target, kind="dflash")).eval()
    for prompt in PROMPTS:
        res = tree_generate(target, TreeProposer(drafter, target, budget, rule), prompt, 20)
        assert res.tokens == greedy_reference(target, prompt, 20)
        assert set(res.tree_sizes) == {min(budget, drafter.cfg.block_size - 1) if rule == "chain" else budget}


def test_drafter_context_holds_the_accepted_path_only(target, dspine):
    """After tree rounds that accepted non-contiguous nodes, the drafter's context keys/values are those of the
    target's plain forward over the verified sequence."""
    prop = TreeProposer(dspine, target, budget=4, rule="lattice")
    oracle = OracleTrees(target, 3, proposer=prop)
    prompt = PROMPTS[0]
    res = tree_generate(target, oracle, prompt, 40, block_size=4)
    assert max(res.accept_lengths) == 4
    seq = prompt + res.tokens
    n = prop.ctx_kv[0][0].shape[1]
    assert len(prompt) < n <= len(seq)
    hs = target(input_ids=torch.tensor([seq[:n]]), output_hidden_states=True).hidden_states
    ref = dspine.context_kv(target_features(hs, dspine.cfg.target_layer_ids), torch.arange(n)[None])
    for (k, v), (rk, rv) in zip(prop.ctx_kv, ref):
        torch.testing.assert_close(k, rk, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(v, rv, atol=1e-4, rtol=1e-4)


class ChainOracle:
    """The target's greedy continuation with one position corrupted, as a chain (`propose`) and as a tree."""

    def __init__(self, target, block_size, corrupt_at=2):
        self.trees = OracleTrees(target, block_size - 1)
        self.corrupt_at, self.v = corrupt_at, target.config.vocab_size

    def extend(self, hidden_states, start, count):
        pass

    def propose(self, sequence):
        g = list(self.trees.greedy(sequence))
        g[self.corrupt_at] = (g[self.corrupt_at] + 1) % self.v
        return g

    def propose_tree(self, sequence):
        return DraftTree.from_paths([self.propose(sequence)])


@pytest.mark.parametrize("temperature", [0.0, 1.0, 0.7])
def test_a_chain_tree_reproduces_chain_generation(temperature):
    """One child per node is the chain: the same tokens and acceptance as generate.speculative_generate, drawing
    the same random numbers (seeded alike)."""
    target = make_target(vocab=16, hidden=32, layers=2, heads=2, kv_heads=1, head_dim=16, inter=64, seed=5,
                         init_std=0.3)
    oracle = ChainOracle(target, 5)
    for prompt in ([1, 2, 3], [4]):
        chain = speculative_generate(target, oracle, prompt, 30, temperature,
                                     generator=torch.Generator().manual_seed(9), block_size=5)
        tree = tree_generate(target, oracle, prompt, 30, temperature, generator=torch.Generator().manual_seed(9),
                             block_size=5)
        assert tree.tokens == chain.tokens
        assert tree.accept_lengths == chain.accept_lengths
        assert max(chain.accept_lengths) > 1
        assert tree.expected_lengths == pytest.approx(chain.expected_lengths, abs=1e-9)
        if temperature == 0:  # the expectation of a deterministic acceptance is the acceptance
            assert chain.expected_lengths == pytest.approx(chain.accept_lengths, abs=0)
        else:
            assert chain.tau_expected != chain.tau and abs(chain.tau_expected - chain.tau) < 1.0


# ------------------------------------------------------------------------------------------ sampling
def _chi_square_p(counts: dict, exact: dict, n: int) -> tuple[float, int]:
    total = sum(exact.values())
    assert abs(total - 1) < 1e-6
    big = sorted((c for c in exact if exact[c] * n >= 5), key=exact.get, reverse=True)
    obs = [counts.get(c, 0) for c in big] + [n - sum(counts.get(c, 0) for c in big)]
    exp = [exact[c] * n for c in big]
    exp.append(n - sum(exp))
    if exp[-1] < 1e-9:
        obs, exp = obs[:-1], exp[:-1]
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp))
    return float(chi2.sf(stat, len(obs) - 1)), len(obs)


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_verify_tree_samples_the_target_distribution_at_a_node(temperature):
    """A root with three children over 6 tokens: the emitted first token (an accepted child, or the sample
    from the residual) follows softmax(logits / T) exactly, and every branch is taken."""
    g = torch.Generator().manual_seed(0)
    logits = torch.tensor([1.0, 0.2, -0.5, 0.8, 0.0, 0.5])[None].repeat(4, 1)
    tree = DraftTree.from_paths([[3], [0], [5]])  # tried in this order
    p = torch.softmax(logits[0].double() / temperature, -1).tolist()
    n = 20000
    counts, branches = {}, [0, 0, 0, 0]
    for _ in range(n):
        path, nxt = verify_tree(logits, tree, temperature, g)
        first = tree.tokens[path[0]] if path else nxt
        counts[first] = counts.get(first, 0) + 1
        branches[path[0] if path else 3] += 1
    assert min(branches) > 0.02 * n
    pv, cells = _chi_square_p(counts, dict(enumerate(p)), n)
    assert cells == 6 and pv > 1e-3


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_verify_tree_follows_the_chain_rule_down_a_deep_tree(temperature):
    """Fixed target logits per node of a branching depth-3 tree: the emitted tokens (accepted path + the final
    sample) have probability Π p_node(token) along the walk, which ends at the first token that is not a child of
    its node (exact law enumerated; chi-square over every sequence)."""
    v = 5
    tree = DraftTree.from_paths([[0, 1, 2], [1, 4, 0], [2], [0, 3], [1, 4, 1], [0, 1, 4]])
    logits = torch.randn(len(tree) + 1, v, generator=torch.Generator().manual_seed(5))
    exact = tree_walk_law(tree, torch.softmax(logits.double() / temperature, -1).tolist(), v)
    g = torch.Generator().manual_seed(2)
    n, counts, deepest = 20000, {}, 0
    for _ in range(n):
        path, nxt = verify_tree(logits, tree, temperature, g)
        seq = tuple(tree.tokens[m] for m in path) + (nxt,)
        counts[seq] = counts.get(seq, 0) + 1
        deepest += len(path) == 3
    assert deepest > 0.01 * n
    pv, cells = _chi_square_p(counts, exact, n)
    assert set(counts) <= set(exact)
    assert cells > 25 and pv > 1e-3


@pytest.mark.parametrize("temperature", [0.0, 1.0, 0.5])
def test_expected_accepted_is_the_mean_of_the_walks_accepted_count(temperature):
    """expected_accepted against two independent references on a branching depth-3 tree: the exact mean of the
    accepted count over every outcome of the walk (enumerated from the target's per-node p as in the test
    above), and the mean of verify_tree's accepted count over 20,000 draws (within 4 standard errors). At T = 0,
    the walk's own accepted count."""
    v = 5
    tree = DraftTree.from_paths([[0, 1, 2], [1, 4, 0], [2], [0, 3], [1, 4, 1], [0, 1, 4]])
    logits = torch.randn(len(tree) + 1, v, generator=torch.Generator().manual_seed(5))
    got = expected_accepted(logits, tree, temperature)
    if temperature == 0:
        assert got == len(verify_tree(logits, tree, 0.0, None)[0])
        return
    p = torch.softmax(logits.double() / temperature, -1).tolist()
    kids = tree.children()

    def mean_accepted(row, depth):  # E[accepted | the walk is at this node, `depth` nodes accepted so far]
        child_of = {tree.tokens[c]: c for c in kids[row]}
        return sum(p[row][x] * (mean_accepted(child_of[x] + 1, depth + 1) if x in child_of else depth)
                   for x in range(v))

    assert got == pytest.approx(mean_accepted(0, 0), abs=1e-12)
    g = torch.Generator().manual_seed(3)
    draws = [len(verify_tree(logits, tree, temperature, g)[0]) for _ in range(20000)]
    mean = sum(draws) / len(draws)
    se = (sum((d - mean) ** 2 for d in draws) / (len(draws) - 1) / len(draws)) ** 0.5
    assert abs(mean - got) < 4 * se and got > 0.3


def test_expected_accepted_of_a_chain_is_the_sum_of_its_prefix_products():
    """A chain's expectation: Σ_i Π_{j<=i} p_j(d_j), each p_j the target's distribution after the j-th prefix."""
    logits = torch.randn(5, 7, generator=torch.Generator().manual_seed(1))
    draft = [3, 1, 1, 6]
    p = torch.softmax(logits.double() / 0.8, -1)
    ref, prod = 0.0, 1.0
    for j, d in enumerate(draft):
        prod *= float(p[j, d])
        ref += prod
    assert expected_accepted(logits, chain_tree(draft), 0.8) == pytest.approx(ref, abs=1e-12)
    assert expected_accepted(logits, DraftTree([], [], [], []), 1.0) == 0.0


def _drafter_for(target, block_size, top_k):
    d = tiny_drafter(target, seed=2, block_size=block_size, transfer_rank=4, message_size=2, top_k=top_k)
    return randomize_injection(d)


@pytest.mark.parametrize("temperature,proposer", [(1.0, "oracle"), (0.6, "oracle"), (1.0, "lattice")])
def test_tree_sampling_keeps_the_target_distribution(temperature, proposer):
    """The first three generated tokens follow the target's own joint distribution at temperature T (chi-square
    against the exact probabilities from the chain rule), through accepted children, rejected siblings and
    residual samples. oracle: a full binary tree (the greedy token and its neighbour at every node);
    lattice: DSpine's tree from a real drafter."""
    vocab = 6
    target = make_target(vocab=vocab, hidden=32, layers=2, heads=2, kv_heads=1, head_dim=16, inter=64, seed=3,
                         init_std=0.15)
    prompt = [1, 2]
    cond = {prefix: torch.softmax(target(input_ids=torch.tensor([prompt + list(prefix)])).logits[0, -1].double()
                                  / temperature, -1)
            for i in range(3) for prefix in itertools.product(range(vocab), repeat=i)}
    exact = {seq: math.prod(float(cond[seq[:i]][seq[i]]) for i in range(3))
             for seq in itertools.product(range(vocab), repeat=3)}
    if proposer == "oracle":
        prop = OracleTrees(target, 3, children=lambda t: [(t + 1) % vocab, t])
    else:
        prop = None
        drafter = _drafter_for(target, block_size=4, top_k=3)
    g = torch.Generator().manual_seed(1234)
    counts, depth_hist = {}, [0, 0, 0, 0]
    n = 1500 if proposer == "oracle" else 1000
    for _ in range(n):
        p = prop if prop is not None else TreeProposer(drafter, target, 7, "lattice")
        res = tree_generate(target, p, prompt, 3, temperature=temperature, generator=g, block_size=4)
        counts[tuple(res.tokens)] = counts.get(tuple(res.tokens), 0) + 1
        depth_hist[res.accept_lengths[0] - 1] += 1
    assert sum(depth_hist[1:]) > 0.2 * n and depth_hist[0] > 0.05 * n  # accepts and rejects
    if proposer == "oracle":
        assert depth_hist[3] > 0.05 * n  # whole paths accepted
    pv, cells = _chi_square_p(counts, exact, n)
    assert cells > 20 and pv > 1e-3


def test_tree_proposer_checks_its_arguments(target, dspine):
    torch.manual_seed(0)
    dflash = DSpineDrafter(drafter_config_for(target, kind="dflash")).eval()
    with pytest.raises(ValueError, match="DSpine"):
        TreeProposer(dflash, target, 8, "lattice")
    with pytest.raises(ValueError, match="rule"):
        TreeProposer(dspine, target, 8, "beam")
    with pytest.raises(ValueError, match="budget"):
        TreeProposer(dspine, target, 0, "lattice")
    with pytest.raises(ValueError, match="parent"):
        DraftTree([1, 2], [1, -1], [2, 1], [0.0, 0.0])
