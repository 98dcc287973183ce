"""Draft trees: best-first trees over a drafter's block lattice, the tree attention mask, path extraction.

A draft tree hangs under the block's anchor (the root). A node at depth i (block position i, 1..B-1) holds one
token; its children are candidate tokens of position i+1. Every node is a distinct path from the root, so two
nodes may hold the same token at the same depth under different parents (docs/tree.md).

Best-first rule (`best_first`): depth i offers slots 0..K_i-1 (tokens) and a transition log-score table
logp_i [R_i, K_i]: row r scores the slots of depth i after slot r of depth i-1 (R_i == 1: one row shared by every
parent). A node's path score is its parent's plus logp_i[parent slot, slot]; the root's is 0. The tree keeps the
`budget` best nodes over all paths of depth ≤ P. Every log-score is ≤ 0 (log-softmax rows), so a child never
scores above its parent, and the `budget` best nodes are closed under taking parents: they are a tree, and the
best-first expansion below finds exactly them.

Three lattices:
- DSpine (`lattice_tree`): slots = the K backbone candidates per position (BlockDraft.candidates), logp_i =
  log-softmax over the K candidates of each row of the transition table (BlockDraft.scores; position 1 uses row
  0, the anchor's), i.e. the probability the table gives cand_i[j] after cand_{i-1}[k], within the candidates.
- DDTree (`marginal_tree`): slots = the top-M tokens of each position's backbone logits, logp_i = the
  position's full-vocabulary log-softmax, one row for every parent (independent marginals).
- DSpine extended (`extended_lattice_tree`): the table on the candidates, the backbone's marginals beyond them,
  so a node may have more than K children.
A temperature divides the scores before each log-softmax (1: the drafter's own; docs/tree.md on calibrating it).
Anchored (`lattice_tree(anchored=True)`): the walk's own chain taken first, the rest of the budget best-first.
"""
from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .decoding import BlockDraft


@dataclass
class DraftTree:
    """Nodes in verification order (a parent before its children; best-first order where built so).

    tokens[n]: the node's token; parents[n]: its parent's node index, -1 for the root (the anchor);
    depths[n]: its block position (1..B-1); scores[n]: its path log-score (0.0 where the tree has none)."""

    tokens: list[int]
    parents: list[int]
    depths: list[int]
    scores: list[float]

    def __len__(self) -> int:
        return len(self.tokens)

    def __post_init__(self):
        if not (len(self.tokens) == len(self.parents) == len(self.depths) == len(self.scores)):
            raise ValueError("DraftTree: tokens, parents, depths and scores differ in length")
        for n, p in enumerate(self.parents):
            if not -1 <= p < n:
                raise ValueError(f"DraftTree: node {n}'s parent {p} is not an earlier node")
            if self.depths[n] != (1 if p < 0 else self.depths[p] + 1):
                raise ValueError(f"DraftTree: node {n} at depth {self.depths[n]} under parent {p}")

    def children(self) -> list[list[int]]:
        """children()[n + 1]: the child node indices of node n in node order; children()[0]: the root's."""
        out: list[list[int]] = [[] for _ in range(len(self) + 1)]
        for n, p in enumerate(self.parents):
            out[p + 1].append(n)
        return out

    def path(self, node: int) -> list[int]:
        """Node indices from the root's child down to `node` (empty for node -1, the root)."""
        out = []
        while node >= 0:
            out.append(node)
            node = self.parents[node]
        return out[::-1]

    def path_tokens(self, node: int) -> list[int]:
        return [self.tokens[n] for n in self.path(node)]

    def max_depth(self) -> int:
        return max(self.depths, default=0)

    @classmethod
    def from_paths(cls, paths: list[list[int]]) -> DraftTree:
        """The trie of token paths under the root: nodes in first-seen order, shared prefixes merged."""
        tokens, parents, depths, index = [], [], [], {}
        for path in paths:
            parent = -1
            for d, t in enumerate(path):
                key = (parent, int(t))
                if key not in index:
                    index[key] = len(tokens)
                    tokens.append(int(t))
                    parents.append(parent)
                    depths.append(d + 1)
                parent = index[key]
        return cls(tokens, parents, depths, [0.0] * len(tokens))


def ancestor_mask(tree: DraftTree) -> torch.Tensor:
    """[n+1, n+1] bool, row/column 0 the root (anchor), row/column m+1 node m: True where the row's token may
    attend to the column's, i.e. the column is the row's ancestor or itself (the root is everyone's). One tree
    through `tree_batch.ancestor_masks`."""
    from .tree_batch import TreeBatch, ancestor_masks

    return ancestor_masks(TreeBatch.stack([tree]), tree.max_depth())[0]


def tree_attention_mask(tree: DraftTree, past: int, dtype: torch.dtype, device=None) -> torch.Tensor:
    """The 4D additive mask [1, 1, n+1, past+n+1] of a verify pass over [anchor, nodes...] after `past` cached
    tokens: every cached token and the row's ancestors (and itself) are visible (0), the rest are not (the dtype's
    minimum, as transformers' own masks)."""
    anc = ancestor_mask(tree).to(device)
    visible = torch.cat([torch.ones(len(tree) + 1, past, dtype=torch.bool, device=device), anc], dim=1)
    mask = torch.zeros(visible.shape, dtype=dtype, device=device)
    mask.masked_fill_(~visible, torch.finfo(dtype).min)
    return mask[None, None]


def tree_positions(tree: DraftTree, start: int) -> list[int]:
    """Position ids of [anchor, nodes...] when the anchor sits at `start`: start + depth."""
    return [start] + [start + d for d in tree.depths]


def best_first(logp: list[torch.Tensor], tokens: list[torch.Tensor], budget: int,
               forced: Sequence[int] | None = None) -> DraftTree:
    """The `budget` best nodes (module docstring): logp[i] [R_i, K_i] transition log-scores of depth i+1 (every
    entry ≤ 0; R_0 == 1, the root; R_i is 1 or K_{i-1}), tokens[i] [K_i] the slots' token ids. Nodes come out in
    best-first order (non-increasing path score; ties: first pushed first).

    forced: one slot per depth, a path from the root (a drafter's own chain) taken first, as far as the budget
    goes; the rest of the budget is then the best nodes outside it, in best-first order after the path. The tree
    then holds the chain, so at T = 0 it accepts at least what the chain accepts.

    Lazy expansion: popping a node pushes its best child and its next-best sibling, so each pop costs O(log N)
    and a row is sorted once."""
    if len(logp) != len(tokens):
        raise ValueError("best_first: logp and tokens differ in depth")
    if logp and logp[0].shape[0] != 1:
        raise ValueError("best_first: depth 1 has one parent (the root): logp[0] must have one row")
    for i, (lp, tk) in enumerate(zip(logp, tokens)):
        if lp.dim() != 2 or lp.shape[1] != tk.shape[0]:
            raise ValueError(f"best_first: depth {i + 1}: logp {tuple(lp.shape)} against {tuple(tk.shape)} tokens")
        if i and lp.shape[0] not in (1, logp[i - 1].shape[1]):
            raise ValueError(f"best_first: depth {i + 1} has {lp.shape[0]} rows for {logp[i - 1].shape[1]} slots")
        if bool((lp > 0).any()):
            raise ValueError(f"best_first: depth {i + 1} has positive log-scores (expected log-probabilities)")
    vals, order, toks, shared = [], [], [], []
    for lp, tk in zip(logp, tokens):
        v, o = lp.double().sort(dim=-1, descending=True, stable=True)
        vals.append(v.tolist())
        order.append(o.tolist())
        toks.append(tk.tolist())
        shared.append(lp.shape[0] == 1)
    tree = DraftTree([], [], [], [])
    heap: list[tuple] = []
    count = 0

    def push(depth: int, parent: int, base: float, row: int, rank: int) -> None:
        nonlocal count
        if depth < len(vals) and rank < len(vals[depth][row]):
            heapq.heappush(heap, (-(base + vals[depth][row][rank]), count, depth, parent, base, row, rank))
            count += 1

    chain = list(forced or [])[: min(budget, len(vals))]
    if forced is not None and (len(forced) != len(vals) or any(not 0 <= c < len(t) for c, t in zip(forced, toks))):
        raise ValueError(f"best_first: forced {list(forced)} is not one slot per depth of {len(vals)}")
    base, row = 0.0, 0
    for depth, slot in enumerate(chain):  # the forced path: node `depth` at depth + 1, under node depth - 1
        row = 0 if shared[depth] else row
        base += vals[depth][row][order[depth][row].index(slot)]
        tree.tokens.append(int(toks[depth][slot]))
        tree.parents.append(depth - 1)
        tree.depths.append(depth + 1)
        tree.scores.append(base)
        row = slot
    for parent in range(-1, len(chain)):  # the children of the root and of every forced node (forced ones skipped)
        if parent + 1 < len(vals):
            push(parent + 1, parent, tree.scores[parent] if parent >= 0 else 0.0,
                 0 if parent < 0 or shared[parent + 1] else chain[parent], 0)
    while heap and len(tree) < budget:
        neg, _, depth, parent, base, row, rank = heapq.heappop(heap)
        slot = order[depth][row][rank]
        if parent == depth - 1 and depth < len(chain) and slot == chain[depth]:  # a forced node: taken already
            push(depth, parent, base, row, rank + 1)
            continue
        node = len(tree)
        tree.tokens.append(int(toks[depth][slot]))
        tree.parents.append(parent)
        tree.depths.append(depth + 1)
        tree.scores.append(-neg)
        push(depth, parent, base, row, rank + 1)  # the next sibling
        if depth + 1 < len(vals):
            push(depth + 1, node, -neg, 0 if shared[depth + 1] else slot, 0)  # the best child
    return tree


def table_log_scores(scores: torch.Tensor, temperature: float | Sequence[float] = 1.0,
                     log_mass: Sequence[float] | None = None) -> list[torch.Tensor]:
    """DSpine's transition log-scores from one request's table [P, K, K]: log-softmax over the K candidates of
    each row divided by `temperature` (one, or one per block position), in float32, plus `log_mass[i]` at block
    position i (the log of the target's mass on that position's candidates, ≤ 0: what a node's acceptance
    chance loses to tokens outside them; none: 0); depth 1 keeps row 0 (the anchor's; its other rows repeat
    it)."""
    p = scores.shape[0]
    t = torch.as_tensor(temperature, dtype=torch.float32)
    if t.dim() == 1:
        if len(t) != p:
            raise ValueError(f"table_log_scores: {len(t)} temperatures for {p} block positions")
        t = t.view(p, 1, 1)
    lp = torch.log_softmax(scores.float() / t, dim=-1)
    if log_mass is not None:
        m = torch.as_tensor(log_mass, dtype=torch.float32)
        if m.shape != (p,) or bool((m > 0).any()):
            raise ValueError(f"table_log_scores: log_mass must be {p} values ≤ 0, found {m.tolist()}")
        lp = lp + m.view(p, 1, 1)
    return [lp[0, :1]] + [lp[i] for i in range(1, lp.shape[0])]


def lattice_tree(draft: BlockDraft, budget: int, index: int = 0, temperature: float | Sequence[float] = 1.0,
                 log_mass: Sequence[float] | None = None, anchored: bool = False) -> DraftTree:
    """DSpine's tree for request `index` of a BlockDraft: best-first over the candidates with
    `table_log_scores` of the transition table; `anchored`: the walk's chain (BlockDraft.choice) first, the rest
    of the budget best-first around it (best_first's `forced`)."""
    cand = draft.candidates[index].cpu()
    forced = draft.choice[index].tolist() if anchored else None
    return best_first(table_log_scores(draft.scores[index].cpu(), temperature, log_mass), list(cand), budget,
                      forced=forced)


def extended_lattice_tree(draft: BlockDraft, logits: torch.Tensor, budget: int, index: int = 0,
                          row_temperature: float = 1.0, marginal_temperature: float = 1.0) -> DraftTree:
    """DSpine's table where it has a row, the backbone's marginals elsewhere. Position i's slots are its K
    candidates and the best tokens of its backbone marginal q_i = softmax(logits[i] / marginal_temperature)
    outside them (up to `budget`). After a candidate predecessor k (or the anchor), a candidate j scores
    log m_i + log-softmax_K(row k / row_temperature)[j], m_i = q_i's mass on the candidates, and a non-candidate v
    scores log q_i(v): one distribution over the vocabulary that the table reshapes on the candidates. After a
    non-candidate predecessor (the table has no row for it) every slot scores log q_i. logits: [P, V] backbone
    logits of request `index`."""
    cand = draft.candidates[index].cpu()
    lq = torch.log_softmax(logits.float().cpu() / marginal_temperature, dim=-1)
    rows = torch.log_softmax(draft.scores[index].float().cpu() / row_temperature, dim=-1)  # [P, K, K]
    p, k = cand.shape
    mass = lq.gather(-1, cand).logsumexp(-1).clamp_max(0.0)  # [P]
    top = lq.topk(min(k + budget, lq.shape[-1]), dim=-1).indices
    logp, tokens = [], []
    for i in range(p):
        extra = top[i][~torch.isin(top[i], cand[i])][:budget]
        slots = torch.cat([cand[i], extra])
        after_candidate = torch.cat([rows[i] + mass[i], lq[i, extra].expand(k, -1)], dim=1)  # [K, slots]
        if i == 0:
            logp.append(after_candidate[:1])
        else:
            after_other = lq[i, slots].expand(len(tokens[-1]) - k, -1)
            logp.append(torch.cat([after_candidate, after_other], dim=0))
        tokens.append(slots)
    return best_first(logp, tokens, budget)


def marginal_tree(logits: torch.Tensor, budget: int, temperature: float = 1.0) -> DraftTree:
    """DDTree's tree from independent per-position logits [P, V]: best-first over each position's top
    min(budget, V) tokens with the full-vocabulary log-softmax as every parent's row (a node's score is the sum
    of its path's marginal log-probabilities; no predecessor conditioning)."""
    lp = torch.log_softmax(logits.float() / temperature, dim=-1).cpu()
    vals, ids = lp.topk(min(budget, lp.shape[-1]), dim=-1)
    return best_first([v[None] for v in vals], list(ids), budget)


def expected_accepted(logits: torch.Tensor, tree: DraftTree, temperature: float) -> float:
    """The expected number of draft nodes one verify round accepts, given its context: logits [n+1, V] of
    [anchor, nodes...] as the target scored them. Under the lossless rule (training/tree_generate.py; the
    chain's is its one-child case) the token emitted at a node is distributed as the target's p there, and the
    walk enters the child holding it, so a node is reached with the product of p(its token | its prefix) along
    its path (siblings hold distinct tokens). Σ over nodes of that product; at T = 0, p is the argmax's one-hot
    and this is the accepted count itself. Its mean over rounds estimates τ - 1 as the accepted counts do, with
    the acceptance's own sampling noise taken out (a Rao-Blackwellised τ)."""
    n = len(tree)
    if n == 0:
        return 0.0
    parent_rows = torch.tensor([p + 1 for p in tree.parents], device=logits.device)
    tokens = torch.tensor(tree.tokens, device=logits.device)
    if temperature == 0:
        p_tok = (logits[: n + 1].argmax(-1)[parent_rows] == tokens).double()
    else:
        p_tok = torch.softmax(logits[: n + 1].double() / temperature, dim=-1)[parent_rows, tokens]
    reach: list[float] = []
    for p, q in zip(tree.parents, p_tok.tolist()):
        reach.append(q * (reach[p] if p >= 0 else 1.0))
    return float(sum(reach))


def chain_tree(tokens: list[int]) -> DraftTree:
    """A chain (the walk's or the argmax's draft) as a tree: one node per position."""
    return DraftTree.from_paths([list(tokens)])
