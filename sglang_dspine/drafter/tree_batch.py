"""Draft trees for a batch, in fixed shapes: the tree builder, mask and acceptance a server's verify step needs.

`tree.py` builds one request's tree with a heap (Python lists, offline). A server drafts a batch inside a CUDA
graph, where every shape must be known before the data: here the same trees come out of a fixed sequence of
tensor operations whose shapes depend only on (batch, block positions P, candidates K, budget N).

Why a per-depth beam finds the best-first tree: every transition log-score is ≤ 0, so a node never scores above
its parent, and the `budget` best nodes of the whole lattice are closed under taking parents (tree.py). Of
depth d's nodes at most N are among them, and those have their parents among the N best of depth d-1. So it is
enough to keep, at each depth, the N best children of the previous depth's kept nodes (a beam of width
min(N, K^d)), then take the N best of all kept nodes. Ties are broken by a stable sort over the kept nodes
listed depth by depth, so a child that ties its parent still ranks after it: the nodes come out in best-first
order, every parent before its children, the order the verify pass and `tree.py`'s `DraftTree` use.

The acceptance walk (`accept`) is the rule of training/tree_generate.py, for a batch: at T = 0 the path whose
tokens are the target's argmax; at T > 0 the lossless rule (a node's children are tried in node order, child c
accepted with probability r(c) where r is the target's p with the children tried before removed and
renormalised; when none is accepted the next token is drawn from that r), with one uniform number per node (a
node is tried at most once) drawn up front.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TreeBatch:
    """Trees of a batch, nodes in best-first order (every parent before its children). All [bs, N]:
    tokens; parents (the parent's node index, -1 for the root, the block's anchor); depths (block position,
    1..P); scores (path log-scores, non-increasing along a row)."""

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    scores: torch.Tensor

    @property
    def size(self) -> int:
        return self.tokens.shape[1]

    @classmethod
    def stack(cls, trees: list, device=None) -> TreeBatch:
        """A batch of `tree.DraftTree`s of one size (every parent before its children, as DraftTree has it)."""
        sizes = {len(t) for t in trees}
        if len(sizes) != 1:
            raise ValueError(f"TreeBatch.stack: trees of sizes {sorted(sizes)}; a batch holds one size")
        as_tensor = lambda name, dtype: torch.tensor([getattr(t, name) for t in trees], dtype=dtype,  # noqa: E731
                                                     device=device)
        return cls(as_tensor("tokens", torch.long), as_tensor("parents", torch.long), as_tensor("depths", torch.long),
                   as_tensor("scores", torch.float32))

    def parent_rows(self) -> torch.Tensor:
        """[bs, N] row of each node's parent in the verify pass over [anchor, nodes...] (0: the anchor)."""
        return self.parents + 1


def tree_size(positions: int, top_k: int, budget: int) -> int:
    """How many nodes `lattice_trees` returns: the budget, or every node of the lattice where it has fewer."""
    total, width = 0, 1
    for _ in range(positions):
        width = min(budget, width * top_k)
        total += width
    return min(budget, total)


def check_lattice(who: str, candidates: torch.Tensor, log_scores: torch.Tensor, budget: int) -> tuple[int, int, int]:
    """(bs, P, K) of a lattice a tree builder is given, or a ValueError naming `who`."""
    bs, p, k = candidates.shape
    if log_scores.shape != (bs, p, k, k):
        raise ValueError(f"{who}: log_scores {tuple(log_scores.shape)} for candidates {tuple(candidates.shape)}")
    if budget < 1:
        raise ValueError(f"{who}: budget {budget} < 1")
    return bs, p, k


def lattice_trees(candidates: torch.Tensor, log_scores: torch.Tensor, budget: int) -> TreeBatch:
    """The `budget` best nodes of each request's lattice (module docstring).

    candidates [bs, P, K]: the K token ids of each block position; log_scores [bs, P, K, K]: [n, i, k, j] the
    log-score (≤ 0) of candidate j of position i after candidate k of position i-1 (position 0 reads row 0, the
    anchor's). The per-request rule of `tree.lattice_tree` with `table_log_scores`, whose output equals this
    one's for the same log-scores (tests/test_tree_batch.py)."""
    bs, p, k = check_lattice("lattice_trees", candidates, log_scores, budget)
    dev = candidates.device
    dtype = torch.promote_types(log_scores.dtype, torch.float32)
    score = log_scores[:, 0, 0].to(dtype)  # depth 1: the anchor's row
    kept_scores, kept_slots, kept_parents, kept_depths = [], [], [], []
    start = 0  # where the previous depth's kept nodes start in the concatenation
    for d in range(p):
        if d:  # children of the kept nodes, listed parent by parent: flat index = parent's place · K + slot
            rows = log_scores[:, d].to(dtype).gather(1, kept_slots[-1][..., None].expand(-1, -1, k))  # [bs, w, K]
            score = (score[..., None] + rows).reshape(bs, -1)
        width = min(budget, score.shape[1])
        score, order = score.sort(dim=1, descending=True, stable=True)
        score, order = score[:, :width], order[:, :width]
        if d:
            slot, parent = order % k, order // k + start
            start += kept_scores[-1].shape[1]
        else:
            slot, parent = order, torch.full_like(order, -1)
        kept_scores.append(score)
        kept_slots.append(slot)
        kept_parents.append(parent)
        kept_depths.append(torch.full((bs, width), d + 1, dtype=torch.long, device=dev))
    all_scores = torch.cat(kept_scores, dim=1)
    n = min(budget, all_scores.shape[1])
    scores, order = all_scores.sort(dim=1, descending=True, stable=True)
    scores, order = scores[:, :n], order[:, :n]
    # node index of each kept node (n where not taken), to turn parents' kept indices into node indices
    node_of = torch.full_like(all_scores, n, dtype=torch.long)
    node_of.scatter_(1, order, torch.arange(n, device=dev).expand(bs, n))
    kept_parent = torch.cat(kept_parents, dim=1).gather(1, order)
    parents = torch.where(kept_parent < 0, kept_parent, node_of.gather(1, kept_parent.clamp_min(0)))
    depths = torch.cat(kept_depths, dim=1).gather(1, order)
    slots = torch.cat(kept_slots, dim=1).gather(1, order)
    tokens = candidates.reshape(bs, p * k).gather(1, (depths - 1) * k + slots)
    return TreeBatch(tokens, parents, depths, scores)


def ancestor_masks(trees: TreeBatch, depth: int) -> torch.Tensor:
    """[bs, N+1, N+1] bool over [anchor, nodes...]: row m+1 sees the anchor, node m's ancestors and node m
    (`tree.ancestor_mask` is one tree of it); `depth` ≥ the trees' deepest node (P)."""
    bs, n = trees.tokens.shape
    dev = trees.tokens.device
    up = torch.cat([torch.zeros(bs, 1, dtype=torch.long, device=dev), trees.parent_rows()], dim=1)  # row -> parent row
    mask = torch.zeros(bs, n + 1, n + 1, dtype=torch.bool, device=dev)
    mask[:, :, 0] = True
    cur = torch.arange(1, n + 1, device=dev).expand(bs, n).clone()  # the row itself, then its ancestors
    for _ in range(depth):
        mask[:, 1:].scatter_(2, cur[..., None], True)
        cur = up.gather(1, cur)
    return mask


def tree_mask_index(seq_lens: torch.Tensor, rows: int) -> torch.Tensor:
    """[bs, R, R] where each request's tree-mask cell (row i over the tree's column j) lies in SGLang's flattened
    tree mask for a verify pass (`full_tree_mask`) of R rows a request after `seq_lens` [bs] cached tokens. Static
    shapes, no host read: it can run inside a CUDA graph."""
    bs, r, dev = seq_lens.shape[0], rows, seq_lens.device
    seq_lens = seq_lens.to(torch.long)
    start = (torch.cumsum(seq_lens, 0) - seq_lens) * r + torch.arange(bs, device=dev) * r * r  # each request's
    width = (seq_lens + r)[:, None, None]
    ar = torch.arange(r, device=dev)
    return start[:, None, None] + ar[None, :, None] * width + seq_lens[:, None, None] + ar[None, None, :]


def full_tree_mask(masks: torch.Tensor, seq_lens: torch.Tensor, cells: int | None = None,
                   index: torch.Tensor | None = None) -> torch.Tensor:
    """SGLang's flattened tree mask for a verify pass (its FULL_MASK layout, what `build_tree_kernel_efficient`
    writes for EAGLE): per request, rows [anchor, nodes...] over columns [its seq_len cached tokens, anchor,
    nodes...], row-major, requests one after another; True where the row may attend (every cached token, and
    `ancestor_masks` over the tree). masks [bs, N+1, N+1], seq_lens [bs] (tokens before the anchor).

    cells: the mask's length, at least the layout's (Σ seq_len·(N+1) + bs·(N+1)²; True past it), when the caller
    knows a bound on the host; by default the layout's own, which reads seq_lens' sum from the device.
    index: `tree_mask_index(seq_lens, N+1)` where the caller has it already (a draft graph computed it)."""
    bs, r, _ = masks.shape
    dev = masks.device
    seq_lens = seq_lens.to(device=dev, dtype=torch.long)
    where = tree_mask_index(seq_lens, r) if index is None else index
    if cells is None:
        cells = int(seq_lens.sum()) * r + bs * r * r
    out = torch.ones(cells, dtype=torch.bool, device=dev)
    return out.scatter_(0, where.reshape(-1), masks.reshape(-1))


def verify_positions(trees: TreeBatch, seq_lens: torch.Tensor) -> torch.Tensor:
    """[bs·(N+1)] position ids of the verify rows [anchor, nodes...]: the anchor at seq_len, a node at
    seq_len + its depth (a node's keys are rotated where its path puts it)."""
    depth = torch.cat([torch.zeros_like(trees.depths[:, :1]), trees.depths], dim=1)
    return (seq_lens.to(depth.device, torch.long)[:, None] + depth).reshape(-1)


@dataclass
class RetrieveLinks:
    """A batch of trees as SGLang's tree verification walks them (its EAGLE and DFlash verify kernels:
    `verify_tree_greedy`, `tree_speculative_sampling_target_only`), over the verify rows [anchor, nodes...] of
    each request, all [bs, N+1]: index (the row's place in the flattened batch, b·(N+1) + row), next_token (the
    row of its first child, -1 where none) and next_sibling (the row of the next node under the same parent,
    in node order, -1 where none; the anchor has none)."""

    index: torch.Tensor
    next_token: torch.Tensor
    next_sibling: torch.Tensor


def retrieve_links(trees: TreeBatch) -> RetrieveLinks:
    bs, n = trees.tokens.shape
    dev = trees.tokens.device
    rows = torch.arange(1, n + 1, device=dev).expand(bs, n)
    first_child = torch.full((bs, n + 1), n + 1, dtype=torch.long, device=dev)
    first_child.scatter_reduce_(1, trees.parent_rows(), rows, reduce="amin")
    same_parent = trees.parents[:, :, None] == trees.parents[:, None, :]  # [bs, node, later node]
    later = torch.arange(n, device=dev)[None, :] > torch.arange(n, device=dev)[:, None]
    sibling = torch.where(same_parent & later, rows[:, None, :], n + 1).amin(2)  # [bs, N]
    none = lambda t: torch.where(t > n, -1, t)  # noqa: E731
    return RetrieveLinks(
        index=torch.arange(bs * (n + 1), device=dev).view(bs, n + 1),
        next_token=none(first_child),
        next_sibling=torch.cat([torch.full((bs, 1), -1, dtype=torch.long, device=dev), none(sibling)], dim=1))


@dataclass
class Acceptance:
    """One verify step's outcome per request: accepted [bs] (accepted draft nodes, 0..P); path [bs, P] their
    node indices root's child first, -1 past `accepted`; next_token [bs] the target's token after them."""

    accepted: torch.Tensor
    path: torch.Tensor
    next_token: torch.Tensor

    def emitted(self, trees: TreeBatch) -> torch.Tensor:
        """[bs, P+1] the tokens the step emits (accepted tokens, then next_token), -1 past them."""
        toks = torch.where(self.path >= 0, trees.tokens.gather(1, self.path.clamp_min(0)), -1)
        out = torch.cat([toks, torch.full_like(toks[:, :1], -1)], dim=1)
        out.scatter_(1, self.accepted[:, None], self.next_token[:, None])
        return out


def accept(trees: TreeBatch, logits: torch.Tensor, temperature: float, depth: int,
           generator: torch.Generator | None = None) -> Acceptance:
    """Walk each tree against the target's logits [bs, N+1, V] of [anchor, nodes...] (module docstring); `depth`
    ≥ the trees' deepest node."""
    bs, n = trees.tokens.shape
    dev = logits.device
    rows = trees.parent_rows()
    batch = torch.arange(bs, device=dev)
    if temperature == 0:
        best = logits.argmax(-1)  # [bs, N+1]
        match = trees.tokens == best.gather(1, rows)
        reached = match
        for _ in range(depth - 1):  # a node is accepted when it matches and its parent was accepted
            reached = match & torch.cat([torch.ones_like(match[:, :1]), reached], dim=1).gather(1, rows)
        # siblings hold distinct tokens: at most one child of a node matches, so the accepted nodes are a path
        reached_depths = reached * trees.depths
        accepted = reached_depths.amax(1)
        last = torch.where(accepted > 0, reached_depths.argmax(1), -1)
        next_token = best[batch, last + 1]
    else:
        probs = torch.softmax(logits.float() / temperature, dim=-1)
        v = probs.shape[-1]  # p(node's token | its parent's path) [bs, N], read in place (no [bs, N, V] copy)
        p_node = probs.reshape(bs, -1).gather(1, rows * v + trees.tokens)
        u = torch.rand(bs, n, generator=generator, device=dev)
        idx = torch.arange(n, device=dev)
        current = torch.full((bs,), -1, dtype=torch.long, device=dev)  # node whose children are tried (-1: root)
        done = torch.zeros(bs, dtype=torch.bool, device=dev)
        accepted = torch.zeros(bs, dtype=torch.long, device=dev)
        tried = torch.zeros(bs, n, dtype=torch.bool, device=dev)  # children of the last node, all tried
        for _ in range(depth + 1):
            kids = (trees.parents == current[:, None]) & ~done[:, None]
            q = torch.where(kids, p_node, 0.0)
            removed = q.cumsum(1) - q  # mass of the children tried before, in node order
            chance = q / (1 - removed).clamp_min(1e-30)
            hit = kids & (u < chance)
            first = torch.where(hit, idx, n).amin(1)  # the first child accepted
            step = first < n
            # children tried and rejected at this node: those before the accepted one, or all of them
            tried = torch.where(done[:, None], tried, kids & (idx < first[:, None]))
            current = torch.where(step, first, current)
            accepted = accepted + step.long()
            done = done | ~step
        # the last node's p with its children tried removed (a count, not a scatter of values: other nodes may
        # hold the same tokens, and scattered writes to one index have no order)
        removed_tokens = torch.zeros_like(probs[:, 0]).scatter_add_(1, trees.tokens, tried.float())
        residual = torch.where(removed_tokens > 0, 0.0, probs[batch, current + 1])
        next_token = torch.multinomial(residual / residual.sum(-1, keepdim=True), 1, generator=generator).squeeze(1)
        last = current
    path = _path_to(trees, last, depth)
    return Acceptance(accepted, path, next_token)


def _path_to(trees: TreeBatch, last: torch.Tensor, depth: int) -> torch.Tensor:
    """[bs, depth] node indices from the root's child down to `last` [bs] (-1: the root, an empty path)."""
    bs = last.shape[0]
    path = torch.full((bs, depth + 1), -1, dtype=torch.long, device=last.device)
    cur = last.clone()
    for _ in range(depth):
        at = torch.where(cur >= 0, trees.depths.gather(1, cur.clamp_min(0)[:, None]).squeeze(1) - 1, depth)
        path.scatter_(1, at[:, None], cur[:, None])
        cur = torch.where(cur >= 0, trees.parents.gather(1, cur.clamp_min(0)[:, None]).squeeze(1), cur)
    return path[:, :depth]
