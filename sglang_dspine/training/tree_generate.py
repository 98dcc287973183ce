"""Offline tree speculative generation: a transformers target verifies a draft tree in one forward.

Each round drafts one block as a tree (`drafter/tree.py`) under the anchor, the last verified token. The target
runs [anchor, nodes...] once, with position ids start + depth and a 4D mask in which each node sees the cached
context, its ancestors and itself (`tree_attention_mask`), so a node's logits are those of its own path. The
verifier walks down from the root (`verify_tree`) and keeps the accepted path plus one token from the target.
Then the target's KV cache keeps the context, the anchor and the accepted path's entries only (an index select
on every layer: the keys were rotated at their path positions start + depth, which are the positions they
keep), and the drafter's context is extended with the target hidden states of [anchor, accepted path] only.

Sampling rule at T > 0 (lossless for a draft that is a function of the verified sequence): at a node with target
distribution p, the residual r starts as p. Its children are tried in node order; child c is accepted with
probability r(c), else r(c) is set to 0 and r renormalised. Accepting moves to the child (and its own p); when
every child is rejected, or the node has none, the next token is sampled from r. By induction over the tried
children, "accept c" has probability P(x = c | x not among the rejected) under x ~ p, and the final sample draws
from p conditioned on x not being any rejected child: the emitted token is distributed exactly as p (sequential
sampling without replacement from a deterministic draft; SpecInfer's multi-draft rule with point-mass drafts).
Siblings hold distinct tokens; a repeated one would have r = 0 and never be accepted. With one child per node
this is the chain's rule in `generate.verify`, drawing the same random numbers in the same order.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..drafter.decoding import BlockDraft
from ..drafter.model import DSpineDrafter
from ..drafter.tree import (
    DraftTree,
    chain_tree,
    expected_accepted,
    extended_lattice_tree,
    lattice_tree,
    marginal_tree,
    tree_attention_mask,
    tree_positions,
)
from .generate import DrafterProposer, SpecResult, prefill

RULES = ("lattice", "anchored", "extended", "marginal", "chain")


@dataclass
class TreeResult(SpecResult):
    tree_sizes: list[int] = field(default_factory=list)  # per round: draft nodes verified (the anchor excluded)
    tree_depths: list[int] = field(default_factory=list)  # per round: the tree's deepest node


def verify_tree(logits: torch.Tensor, tree: DraftTree, temperature: float,
                generator: torch.Generator | None) -> tuple[list[int], int]:
    """Walk `tree` against the target's logits [n+1, V] of [anchor, nodes...] (module docstring).

    Returns (the accepted path's node indices, root's child first; the target's next token)."""
    children = tree.children()
    path: list[int] = []
    row = 0  # logits row of the current node: 0 the anchor, m + 1 node m
    if temperature == 0:
        best = logits[: len(tree) + 1].argmax(-1).tolist()
        while True:
            nxt = next((c for c in children[row] if tree.tokens[c] == best[row]), None)
            if nxt is None:
                return path, best[row]
            path.append(nxt)
            row = nxt + 1
    p = torch.softmax(logits[: len(tree) + 1].float() / temperature, dim=-1)
    while True:
        r = p[row]
        for c in children[row]:
            u = torch.rand((), generator=generator)
            if u < r[tree.tokens[c]]:
                path.append(c)
                row = c + 1
                break
            r = r.clone()
            r[tree.tokens[c]] = 0
            r = r / r.sum()
        else:
            return path, int(torch.multinomial(r, 1, generator=generator))


def keep_cache_positions(cache, keep: torch.Tensor) -> None:
    """Keep the entries `keep` (ascending indices along the sequence) of every layer of a DynamicCache."""
    for layer in cache.layers:
        if getattr(layer, "is_sliding", False):
            raise ValueError("keep_cache_positions: sliding-window layers are not supported")
        idx = keep.to(layer.keys.device)
        layer.keys = layer.keys.index_select(-2, idx)
        layer.values = layer.values.index_select(-2, idx)


class TreeProposer(DrafterProposer):
    """Drafts a tree per block. rule: "lattice" (DSpine: best-first over the transition table, rows at
    `row_temperature`, one or one per block position, plus `row_log_mass` per position where given:
    fit_depth_calibration), "anchored" (the same around the walk's chain, taken first), "extended" (DSpine:
    the table on the candidates, the backbone's marginals at `marginal_temperature` beyond them), "marginal"
    (DDTree: best-first over the backbone's independent marginals at `marginal_temperature`; any drafter),
    "chain" (the drafter's own chain, `DrafterProposer.propose`, as a tree). budget: draft nodes per tree (the
    target verifies budget + 1 tokens, the anchor included)."""

    def __init__(self, drafter: DSpineDrafter, target, budget: int, rule: str = "lattice",
                 row_temperature: float | list[float] = 1.0, marginal_temperature: float = 1.0,
                 row_log_mass: list[float] | None = None):
        if rule not in RULES:
            raise ValueError(f"rule: expected one of {RULES}, found {rule!r}")
        if rule in ("lattice", "anchored", "extended") and not drafter.cfg.is_dspine:
            raise ValueError(f"rule {rule!r} needs a DSpine drafter (a DFlash drafter has no transition table)")
        if budget < 1:
            raise ValueError(f"budget: expected at least 1 draft node, found {budget}")
        row_ts = row_temperature if isinstance(row_temperature, list) else [row_temperature]
        if min(row_ts) <= 0 or marginal_temperature <= 0:
            raise ValueError("row_temperature and marginal_temperature must be positive")
        if (row_log_mass is not None or isinstance(row_temperature, list)) and rule not in ("lattice", "anchored"):
            raise ValueError(f"per-position row temperatures and row_log_mass: only the lattice rules take them, "
                             f"not {rule!r}")
        super().__init__(drafter, target)
        self.budget, self.rule = budget, rule
        self.row_temperature, self.marginal_temperature = row_temperature, marginal_temperature
        self.row_log_mass = row_log_mass

    def block(self, sequence: list[int]):
        """The drafter's output for the block whose anchor is the last token of `sequence` (as `propose`)."""
        cfg, device = self.drafter.cfg, self.head.device
        anchor, s, b = sequence[-1], len(sequence) - 1, cfg.block_size
        block = torch.tensor([[anchor] + [cfg.mask_token_id] * (b - 1)], device=device)
        positions = (s + torch.arange(b, device=device)).view(1, 1, b)
        visible = torch.ones(1, 1, s, dtype=torch.bool, device=device)
        anchors = torch.tensor([[anchor]], device=device)
        out = self.drafter.forward_blocks(self.embed(block).view(1, 1, b, -1), positions, self.ctx_kv, visible, anchors)
        return out, anchors

    def propose_tree(self, sequence: list[int]) -> DraftTree:
        if self.rule == "chain":
            return chain_tree(self.propose(sequence)[: self.budget])
        out, anchors = self.block(sequence)
        if self.rule == "marginal":
            return marginal_tree(self.drafter.block_logits(out, self.head)[0], self.budget, self.marginal_temperature)
        drafted = self.drafter.draft(out, self.head, anchors.view(1))
        assert isinstance(drafted, BlockDraft)
        if self.rule == "extended":
            return extended_lattice_tree(drafted, self.drafter.block_logits(out, self.head)[0], self.budget,
                                         row_temperature=self.row_temperature,
                                         marginal_temperature=self.marginal_temperature)
        return lattice_tree(drafted, self.budget, temperature=self.row_temperature, log_mass=self.row_log_mass,
                            anchored=self.rule == "anchored")


@torch.no_grad()
def tree_generate(target, proposer, prompt_ids: list[int], max_new_tokens: int, temperature: float = 0.0,
                  eos_token_ids: set[int] | None = None, generator: torch.Generator | None = None,
                  block_size: int | None = None) -> TreeResult:
    """Generate with draft trees verified by `target` (a transformers causal LM, batch of one).

    `proposer`: a TreeProposer, or any object with `extend(hidden_states, start, count)` (hidden states of the
    tokens to add, in order, at positions start..start+count-1) and `propose_tree(sequence) -> DraftTree`."""

    b = block_size or proposer.drafter.cfg.block_size
    device = target.get_output_embeddings().weight.device
    dtype = target.get_output_embeddings().weight.dtype
    eos = eos_token_ids or set()

    cache, anchor = prefill(target, proposer, prompt_ids, temperature, generator)
    result = TreeResult(tokens=[anchor], block_size=b)

    while len(result.tokens) < max_new_tokens and anchor not in eos:
        s = len(prompt_ids) + len(result.tokens) - 1  # position of the anchor = tokens in the cache
        tree = proposer.propose_tree(list(prompt_ids) + result.tokens)
        ids = torch.tensor([[anchor] + tree.tokens], device=device)
        positions = torch.tensor([tree_positions(tree, s)], device=device)
        out = target(input_ids=ids, past_key_values=cache, use_cache=True, output_hidden_states=True,
                     position_ids=positions, attention_mask=tree_attention_mask(tree, s, dtype, device))
        path, nxt = verify_tree(out.logits[0], tree, temperature, generator)
        result.accept_lengths.append(len(path) + 1)
        result.expected_lengths.append(1.0 + expected_accepted(out.logits[0], tree, temperature))
        result.tree_sizes.append(len(tree))
        result.tree_depths.append(tree.max_depth())
        rows = torch.tensor([0] + [m + 1 for m in path], device=device)  # anchor + accepted path, in this pass
        keep_cache_positions(cache, torch.cat([torch.arange(s, device=device), s + rows]))
        proposer.extend(tuple(h.index_select(1, rows) for h in out.hidden_states), s, len(rows))
        result.emit([tree.tokens[m] for m in path] + [nxt], eos, max_new_tokens)
        anchor = result.tokens[-1]
    result.tokens = result.tokens[:max_new_tokens]
    return result


@torch.no_grad()
def evaluate_tree(target, drafter: DSpineDrafter, prompts: list[tuple[str, list[int]]], max_new_tokens: int,
                  budget: int, rule: str, temperature: float = 0.0, eos_token_ids: set[int] | None = None,
                  seed: int = 0, row_temperature: float | list[float] = 1.0, marginal_temperature: float = 1.0,
                  progress=None, row_log_mass: list[float] | None = None) -> dict:
    """τ of tree drafting over prompts [(id, prompt ids)], as `generate.evaluate` reports a chain's: tokens ÷
    verify rounds over all prompts (SpecResult.pooled), with the trees' mean size and depth. progress: called
    with each finished prompt's TreeResult (a progress bar). Seeded as `generate.evaluate`."""
    from .generate import evaluate

    def one(ids, gen):
        proposer = TreeProposer(drafter, target, budget, rule, row_temperature, marginal_temperature, row_log_mass)
        res = tree_generate(target, proposer, ids, max_new_tokens, temperature, eos_token_ids, gen)
        trees.append(res)
        return res

    trees: list[TreeResult] = []
    out = evaluate(target, drafter, prompts, max_new_tokens, temperature, eos_token_ids, seed=seed, generate=one,
                   progress=progress)
    sizes = [n for r in trees for n in r.tree_sizes]
    depths = [d for r in trees for d in r.tree_depths]
    out.pop("decoding")
    out.update({"rule": rule, "budget": budget, "verify_tokens": budget + 1, "row_temperature": row_temperature,
                "row_log_mass": row_log_mass,
                "marginal_temperature": marginal_temperature, "mean_tree_nodes": sum(sizes) / max(len(sizes), 1),
                "mean_tree_depth": sum(depths) / max(len(depths), 1)})
    return out


# ------------------------------------------------------------------------------------ score calibration
@dataclass
class CalibrationSet:
    """Teacher-forced drafter scores along the target's own greedy continuations, with what verification would
    accept there. marginal: backbone logits rows [M, V] with labels [M, V] (one-hot of the target's greedy token
    at T = 0, the target's softmax(logits / T) at T > 0); rows: table rows [R, K] at the true predecessor with
    labels [R, K] (the same, restricted to the candidates and renormalised; positions whose predecessor or
    token is not a candidate are left out).

    For a calibration per depth (`fit_depth_calibration`): row_depths [R], each row's block position - 1;
    row_reached [R], whether the true tokens of every earlier block position are candidates (a tree over the
    lattice can reach the row's node); reach_depths and reach_mass [Q], at every such reachable position
    (whether or not its own token is a candidate), its depth and the target's mass on its candidates."""

    marginal: torch.Tensor
    marginal_labels: torch.Tensor
    rows: torch.Tensor | None
    row_labels: torch.Tensor | None
    row_depths: torch.Tensor | None = None
    row_reached: torch.Tensor | None = None
    reach_depths: torch.Tensor | None = None
    reach_mass: torch.Tensor | None = None


@torch.no_grad()
def calibration_set(target, drafter: DSpineDrafter, prompts: list[list[int]], new_tokens: int, temperature: float,
                    stride: int = 4, eos_token_ids: set[int] | None = None) -> CalibrationSet:
    """Drafter scores at every `stride`-th anchor of the target's greedy continuation of each prompt."""
    from ..drafter.decoding import BlockDraft as _BlockDraft

    eos = eos_token_ids or set()
    b = drafter.cfg.block_size
    marg, marg_lab, rows, row_lab = [], [], [], []
    row_depth, row_reached, reach_depth, reach_mass = [], [], [], []
    for prompt in prompts:
        seq = list(prompt)
        for _ in range(new_tokens):
            seq.append(int(target(input_ids=torch.tensor([seq], device=target.device)).logits[0, -1].argmax()))
            if seq[-1] in eos:
                break
        out = target(input_ids=torch.tensor([seq], device=target.device), output_hidden_states=True)
        logits = out.logits[0].float()
        probs = (torch.softmax(logits / temperature, -1) if temperature > 0
                 else torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float())
        for a in range(len(prompt), len(seq) - b + 1, stride):  # anchor at a: the block predicts a+1..a+b-1
            prop = TreeProposer(drafter, target, 1, "marginal")
            prop.extend(out.hidden_states, 0, a)
            bo, anchors = prop.block(seq[: a + 1])
            bl = drafter.block_logits(bo, prop.head)[0]
            lab = probs[a : a + b - 1]  # the target's distribution of tokens a+1..a+b-1 given the true prefix
            marg.append(bl.cpu())
            marg_lab.append(lab.cpu())
            if not drafter.cfg.is_dspine:
                continue
            d = drafter.draft(bo, prop.head, anchors.view(1))
            assert isinstance(d, _BlockDraft)
            cand, sc = d.candidates[0].cpu(), d.scores[0].float().cpu()
            reached = True  # every earlier true token is a candidate of its position
            for i in range(b - 1):
                if i == 0:
                    k = 0
                else:
                    hit = (cand[i - 1] == seq[a + i]).nonzero()
                    if len(hit) == 0:
                        reached = False
                        continue
                    k = int(hit[0])
                on = lab[i].cpu()[cand[i]]
                if reached:
                    reach_depth.append(i)
                    reach_mass.append(float(on.sum()))
                if float(on.sum()) <= 0:
                    continue
                rows.append(sc[i, k])
                row_lab.append(on / on.sum())
                row_depth.append(i)
                row_reached.append(reached)
    if not marg:
        raise ValueError(f"calibration_set: no anchor with a whole block of {b} tokens after it in the target's "
                         f"continuations ({new_tokens} new tokens a prompt, fewer where an EOS came first)")
    cat = lambda xs: torch.stack(xs) if xs else None
    vec = lambda xs, dtype: torch.tensor(xs, dtype=dtype) if xs else None
    return CalibrationSet(torch.cat(marg), torch.cat(marg_lab), cat(rows), cat(row_lab), vec(row_depth, torch.long),
                          vec(row_reached, torch.bool), vec(reach_depth, torch.long),
                          vec(reach_mass, torch.float64))


def fit_depth_calibration(cal: CalibrationSet, depths: int, min_rows: int = 30) -> tuple[list[float], list[float]]:
    """Per block position (depth 1..`depths`) of DSpine's table, on the reachable rows only (those a tree can
    reach: every earlier true token a candidate): a temperature (`fit_temperature`), and the log of the target's
    mean mass on the position's candidates (a tree over the candidates never holds the rest, so a node's
    chance of acceptance is the row's probability times that mass). A depth with fewer than `min_rows` rows
    takes the fit over all reachable rows (and mass). Returns (temperatures, log masses), one per depth."""
    import math

    if cal.rows is None or cal.row_depths is None or cal.reach_depths is None:
        raise ValueError("fit_depth_calibration: the calibration set has no table rows (a DFlash drafter?)")
    reached = cal.row_reached
    if not bool(reached.any()):
        raise ValueError("fit_depth_calibration: no reachable table rows")
    pooled_t, _ = fit_temperature(cal.rows[reached], cal.row_labels[reached])
    pooled_mass = float(cal.reach_mass.mean())
    temps, log_mass = [], []
    for i in range(depths):
        sel = reached & (cal.row_depths == i)
        temps.append(fit_temperature(cal.rows[sel], cal.row_labels[sel])[0] if int(sel.sum()) >= min_rows
                     else pooled_t)
        at = cal.reach_depths == i
        mass = float(cal.reach_mass[at].mean()) if int(at.sum()) >= min_rows else pooled_mass
        log_mass.append(math.log(max(mass, 1e-6)))
    return temps, log_mass


def fit_temperature(logits: torch.Tensor, labels: torch.Tensor,
                    grid: torch.Tensor | None = None) -> tuple[float, dict[float, float]]:
    """Temperature scaling: the t of `grid` (default 0.05..4, log-spaced) minimising the cross-entropy
    -Σ labels · log_softmax(logits / t) per row. Returns (t, {t: mean cross-entropy})."""
    grid = grid if grid is not None else torch.logspace(-1.3, 0.6, 39)
    logits, labels = logits.double(), labels.double()
    ce = {}
    for t in grid.tolist():
        lp = torch.log_softmax(logits / t, dim=-1)
        ce[round(t, 4)] = float(-(labels * lp.clamp_min(-1e4)).sum(-1).mean())
    best = min(ce, key=ce.get)
    return best, ce
