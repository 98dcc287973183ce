"""Tree verification in the server: a DSPINE decode step that verifies a best-first tree over the drafter's
transition lattice instead of the walk's one path (docs/tree.md, "Verifying the tree in SGLang").

A request verifies N rows, N = --speculative-num-draft-tokens: the anchor and a tree of N - 1 nodes. The draft
forward stays the drafter's block of B rows, and no node is deeper than B - 1, so at most B tokens come out a
step. At N = B every shape of the chain's step stays (the verify pass over the B KV slots DFlash's worker
reserves for the block); at N > B the verify pass covers N slots (SGLang reserves 2 N past the committed
length). What differs from the chain:
- the draft graph's tail writes the walk and the tree (`TreeDraftSampler`, `DraftStep.walk_and_tree`). At N = B
  greedy requests verify their walk as a chain-shaped tree, sampled ones the tree (`chains_where` says why); at
  N > B every request verifies a tree, a greedy one's scored with the drafter's calibration
  (`calibration_rows`);
- the verify pass reads a tree mask and puts each node at position seq_len + its depth (`tree_verify_inputs`);
- acceptance walks the tree with SGLang's own tree kernels (`accept_tree`: `verify_tree_greedy` at T = 0,
  `tree_speculative_sampling_target_only` at T > 0, the rule EAGLE's trees use);
- the accepted path is brought to the front of the verify rows (`committed_rows`, `bring_to_front`): its KV
  slots by reordering the request's slots in `req_to_token` within them (no KV is copied, no slot changes
  owner: they stay the request's, those past the path are rewritten by the next step as the chain's are), its
  hidden states and logits by a gather. After that the rows read as a chain whose first `commit_lens` rows were
  accepted, and DFlash's chain code applies unchanged: the draft KV written from the target's hidden states
  at the chain's positions (the first B rows hold the path), log-probs from rows n·N + j, the next step's
  anchor.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..drafter.tree_batch import (
    RetrieveLinks,
    TreeBatch,
    ancestor_masks,
    full_tree_mask,
    retrieve_links,
    tree_mask_index,
    verify_positions,
)


class TreeDraftSampler:
    """The draft CUDA graph's tail for trees (the slot of DFlash's argmax, `DSpineDraftSampler`'s for the
    chain): `__call__(hidden, input_ids)` builds each request's tree of `nodes` nodes (N - 1 for N verify rows;
    B - 1 by default) and what the verify pass needs of it apart from the anchor (`tree_layout`: positions, the
    tree mask's cells and where they go, the links SGLang's tree kernels walk), into static buffers read after
    the graph by `drafts(bs)`. Done in the graph, not after it: dozens of small kernels a step that would
    otherwise be launched one by one from Python.

    Per request, from static buffers the step fills before the draft forward (`prepare`): its committed length
    and whether it is greedy; with `chains_for_greedy` (N = B) a greedy request verifies its walk as a chain
    (`chains_where`); with `calibrated` its tree's scores read its calibration per block position
    (`temperature`, `log_mass` [max_bs, B-1]), otherwise they are the drafter's own."""

    what = "tree building"

    def __init__(self, step, max_bs: int, nodes: int | None = None, calibrated: bool = False,
                 chains_for_greedy: bool = False):
        self.step, self.max_bs, self.chains_for_greedy = step, max_bs, chains_for_greedy
        self.nodes = step.block_size - 1 if nodes is None else int(nodes)
        dev = step.head.device
        shape, rows = (max_bs, self.nodes), self.nodes + 1
        self.tokens, self.parents, self.depths = (torch.empty(shape, dtype=torch.int64, device=dev) for _ in range(3))
        self.scores = torch.empty(shape, dtype=torch.float32, device=dev)
        self.positions = torch.empty(max_bs, rows, dtype=torch.int64, device=dev)
        self.masks = torch.empty(max_bs, rows, rows, dtype=torch.bool, device=dev)
        self.mask_index = torch.empty(max_bs, rows, rows, dtype=torch.int64, device=dev)
        self.next_token, self.next_sibling = (torch.empty(max_bs, rows, dtype=torch.int64, device=dev)
                                              for _ in range(2))
        self.row_index = torch.arange(max_bs * rows, dtype=torch.int64, device=dev)  # links.index, any bs
        self.walk = torch.empty(max_bs, step.block_size - 1, dtype=torch.int64, device=dev)  # an adaptive chain's
        self.seq_lens = torch.zeros(max_bs, dtype=torch.int64, device=dev)
        self.greedy = torch.zeros(max_bs, dtype=torch.bool, device=dev)
        self.temperature = self.log_mass = None  # calibrated: [max_bs, B-1] each
        if calibrated:
            self.temperature = torch.ones(max_bs, step.block_size - 1, dtype=torch.float32, device=dev)
            self.log_mass = torch.zeros(max_bs, step.block_size - 1, dtype=torch.float32, device=dev)

    def __call__(self, hidden_states, input_ids=None):
        bs = hidden_states.shape[0] // self.step.block_size
        cal = (None, None) if self.temperature is None else (self.temperature[:bs], self.log_mass[:bs])
        walk, trees = served_trees(self.step, hidden_states, self.nodes, self.greedy[:bs], self.chains_for_greedy,
                                   *cal)
        self.walk[:bs].copy_(walk)
        layout = tree_layout(trees, self.seq_lens[:bs], depth=self.step.block_size - 1)
        for buf, src in zip((self.tokens, self.parents, self.depths, self.scores, self.positions, self.masks,
                             self.mask_index, self.next_token, self.next_sibling),
                            (trees.tokens, trees.parents, trees.depths, trees.scores, layout.positions, layout.masks,
                             layout.mask_index, layout.links.next_token, layout.links.next_sibling)):
            buf[:bs].copy_(src)

    def prepare(self, seq_lens: torch.Tensor, greedy: torch.Tensor, temperature: torch.Tensor | None = None,
                log_mass: torch.Tensor | None = None) -> None:
        """Set the next draft's per-request inputs: committed lengths [bs], greedy flags [bs] (bool) and, when
        calibrated, the calibration rows [bs, B-1] each (`calibration_rows`)."""
        bs = seq_lens.shape[0]
        self.seq_lens[:bs].copy_(seq_lens)
        self.greedy[:bs].copy_(greedy)
        if self.temperature is not None:
            self.temperature[:bs].copy_(temperature)
            self.log_mass[:bs].copy_(log_mass)

    def walk_rows(self, bs: int) -> torch.Tensor:
        """[bs, B-1] the walk the graph's tail decoded this step (what a chain step of an adaptive server verifies
        a prefix of; the trees' inputs `prepare` set are then not read)."""
        return self.walk[:bs]

    def drafts(self, bs: int) -> tuple[TreeBatch, TreeLayout]:
        rows = self.nodes + 1
        links = RetrieveLinks(index=self.row_index[: bs * rows].view(bs, rows),
                              next_token=self.next_token[:bs], next_sibling=self.next_sibling[:bs])
        return (TreeBatch(self.tokens[:bs], self.parents[:bs], self.depths[:bs], self.scores[:bs]),
                TreeLayout(self.positions[:bs], self.masks[:bs], self.mask_index[:bs], links))


def served_trees(step, hidden_states: torch.Tensor, nodes: int, greedy: torch.Tensor, chains_for_greedy: bool,
                 temperature: torch.Tensor | None = None,
                 log_mass: torch.Tensor | None = None) -> tuple[torch.Tensor, TreeBatch]:
    """(the walk [bs, B-1], the trees a tree step verifies) from the draft forward's final-normed states
    [bs·B, H]: each request's tree of `nodes` nodes, or with `chains_for_greedy` (N = B) its walk as a chain where
    `greedy` [bs] is True (`chains_where`); temperature, log_mass: `DraftStep.walk_and_tree`'s."""
    walk, trees = step.walk_and_tree(step.rows_after_anchor(hidden_states), nodes, temperature, log_mass)
    return walk, chains_where(greedy, walk, trees) if chains_for_greedy else trees


def calibration_rows(greedy: torch.Tensor, temperature: torch.Tensor,
                     log_mass: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per request, the scores' calibration [bs, B-1] (temperature, log mass): a greedy request's the drafter's
    calibration (`TreeCalibration`, [B-1] each, on the device), a sampled one's the drafter's own rows (1, 0).
    Why: at T = 0 only the argmax path counts, and the calibration makes a node's score its chance of being on
    it; where the target samples, the raw rows did as well as any fit offline (docs/tree.md)."""
    g = greedy.view(-1, 1)
    return torch.where(g, temperature.view(1, -1), 1.0), torch.where(g, log_mass.view(1, -1), 0.0)


def chains_where(greedy: torch.Tensor, walk: torch.Tensor, trees: TreeBatch) -> TreeBatch:
    """The trees, with each request where `greedy` [bs] (bool) is True verifying its walk instead: a chain
    of the same size (node i the walk's token i, under node i - 1).

    Why: at B - 1 nodes the lattice tree gains where the target samples (a child is accepted with the target's
    probability of its token, and siblings are further chances) and loses at T = 0, where only the argmax
    path counts and the walk already is the drafter's best guess of it (docs/tree.md)."""
    n, dev = walk.shape[1], walk.device
    chain_parents = torch.arange(-1, n - 1, device=dev).expand_as(walk)
    chain_depths = torch.arange(1, n + 1, device=dev).expand_as(walk)
    g = greedy.view(-1, 1)
    return TreeBatch(tokens=torch.where(g, walk, trees.tokens), parents=torch.where(g, chain_parents, trees.parents),
                     depths=torch.where(g, chain_depths, trees.depths),
                     scores=torch.where(g, torch.zeros_like(trees.scores), trees.scores))


@dataclass
class TreeVerify:
    """A verify pass over a batch of trees, N rows per request [anchor, nodes...]: tokens [bs, N];
    positions [bs·N]; custom_mask (SGLang's flattened tree mask, FULL_MASK layout); links (what SGLang's tree
    kernels walk); depth (P, the deepest a node can be)."""

    tokens: torch.Tensor
    positions: torch.Tensor
    custom_mask: torch.Tensor
    links: RetrieveLinks
    depth: int

    @property
    def rows(self) -> int:
        return self.tokens.shape[1]


@dataclass
class TreeLayout:
    """What a verify pass needs of a batch of trees apart from the anchors, all [bs, ...] over the rows [anchor,
    nodes...]: positions [bs, R]; masks [bs, R, R] (`ancestor_masks`); mask_index [bs, R, R] (where those cells
    go in SGLang's flattened mask, `tree_mask_index`); links (what SGLang's tree kernels walk). Static shapes,
    no host read: a draft CUDA graph computes it (`TreeDraftSampler`)."""

    positions: torch.Tensor
    masks: torch.Tensor
    mask_index: torch.Tensor
    links: RetrieveLinks


def tree_layout(trees: TreeBatch, seq_lens: torch.Tensor, depth: int) -> TreeLayout:
    """`trees` after the requests' committed lengths `seq_lens` [bs] (device); `depth` ≥ the deepest node (P)."""
    rows = trees.size + 1
    return TreeLayout(positions=verify_positions(trees, seq_lens).view(-1, rows), masks=ancestor_masks(trees, depth),
                      mask_index=tree_mask_index(seq_lens, rows), links=retrieve_links(trees))


def tree_verify_inputs(trees: TreeBatch, anchors: torch.Tensor, seq_lens: torch.Tensor, depth: int,
                       mask_cells: int | None = None, layout: TreeLayout | None = None) -> TreeVerify:
    """The verify pass's inputs for `trees` after `anchors` [bs], the requests' committed lengths `seq_lens`;
    mask_cells: the tree mask's length where the caller has a host bound (`full_tree_mask`); layout: the
    trees' `tree_layout` where a draft graph built it already."""
    layout = tree_layout(trees, seq_lens, depth) if layout is None else layout
    tokens = torch.cat([anchors.view(-1, 1).to(trees.tokens.dtype), trees.tokens], dim=1)
    return TreeVerify(tokens=tokens, positions=layout.positions.reshape(-1),
                      custom_mask=full_tree_mask(layout.masks, seq_lens, cells=mask_cells, index=layout.mask_index),
                      links=layout.links, depth=depth)


def mask_cells_bound(host_seq_lens: torch.Tensor, rows: int, verify_mask=None) -> int:
    """A length for the tree mask from host-side lengths, with no read from the device: `host_seq_lens` [bs]
    (CPU) bound each request's committed length from above (DFlash's host bound: the lagging committed length
    plus one block, or the reservation), so the layout fits. Where the attention backend keeps a mask buffer
    for its CUDA graphs (`verify_mask`, which a replay copies the mask into) and the batch fits it, no longer
    than that buffer: the real layout always fits there (a committed length is below the context length)."""
    bs = host_seq_lens.numel()
    cells = int(host_seq_lens.sum()) * rows + bs * rows * rows
    if verify_mask is not None and verify_mask.fits(bs):
        cells = min(cells, verify_mask.buffer.numel())
    return cells


@dataclass
class TreeAcceptance:
    """SGLang's tree kernels' outcome: accept_index [bs, P+1] (the flat verify row of the anchor, then of each
    accepted node; -1 past them); accepted [bs] (accepted draft nodes); bonus [bs] (the target's token after
    the last accepted row)."""

    accept_index: torch.Tensor
    accepted: torch.Tensor
    bonus: torch.Tensor


def accept_tree(verify: TreeVerify, logits: torch.Tensor, sampling_info=None, max_top_k=None,
                uniform_top_k_value=None, thresholds: tuple[float, float] | None = None) -> TreeAcceptance:
    """Walk the trees against the verify logits [bs·rows, V] (penalties, bias and grammar masks applied): greedy
    when `sampling_info` is None or all greedy, else SGLang's lossless tree sampling with each request's
    temperature, top-k and top-p (the target probabilities DFlash's chain sampling builds). `thresholds`: the
    kernel's (single, accumulated) acceptance thresholds, by default the server's (1, 1: lossless)."""
    from sglang.srt.speculative.eagle_utils import verify_tree_greedy_triton

    bs, rows = verify.tokens.shape
    dev = logits.device
    accept_index = torch.full((bs, verify.depth + 1), -1, dtype=torch.int32, device=dev)
    accepted = torch.zeros(bs, dtype=torch.int32, device=dev)
    predicts = torch.zeros(bs * rows, dtype=torch.int32, device=dev)
    links = verify.links
    if sampling_info is None or sampling_info.is_all_greedy:
        target = logits.argmax(-1).view(bs, rows)
        # SGLang's Triton walk (EAGLE's CUDA op has the same contract): one code path on every device
        verify_tree_greedy_triton(predicts, accept_index, accepted, verify.tokens, links.index, links.next_token,
                                  links.next_sibling, target)
        bonus = target.view(-1)[accept_index.gather(1, accepted.long()[:, None]).squeeze(1).long()]
        return TreeAcceptance(accept_index, accepted, bonus.to(torch.int64))
    from sglang.srt.speculative.dflash_utils import (
        build_dflash_verify_target_probs,
        tree_speculative_sampling_target_only,
    )

    if thresholds is None:
        from sglang.srt.runtime_context import get_spec

        spec = get_spec()
        thresholds = spec.speculative_accept_threshold_single, spec.speculative_accept_threshold_acc

    probs = build_dflash_verify_target_probs(next_token_logits=logits, sampling_info=sampling_info,
                                             draft_token_num=rows, bs=bs, max_top_k=max_top_k,
                                             uniform_top_k_value=uniform_top_k_value).reshape(bs, rows, -1)
    tree_speculative_sampling_target_only(
        predicts=predicts, accept_index=accept_index, accept_token_num=accepted, candidates=verify.tokens,
        retrive_index=links.index, retrive_next_token=links.next_token, retrive_next_sibling=links.next_sibling,
        uniform_samples=torch.rand(bs, rows, device=dev), uniform_samples_for_final_sampling=torch.rand(bs, device=dev),
        target_probs=probs, draft_probs=torch.zeros_like(probs),
        threshold_single=float(thresholds[0]), threshold_acc=max(float(thresholds[1]), 1e-9), deterministic=True)
    bonus = predicts[accept_index.gather(1, accepted.long()[:, None]).squeeze(1).long()]
    return TreeAcceptance(accept_index, accepted, bonus.to(torch.int64))


@dataclass
class CommittedRows:
    """A verify step's outcome in the chain's layout: order [bs, N] (the verify rows, the committed ones first:
    the anchor, then the accepted nodes root's child first, then the others ascending); commit_lens [bs]
    (anchor + accepted nodes); out_tokens [bs, N] (the accepted nodes' tokens, then the bonus, 0 past it)."""

    order: torch.Tensor
    commit_lens: torch.Tensor
    out_tokens: torch.Tensor


def committed_rows(verify: TreeVerify, acc: TreeAcceptance) -> CommittedRows:
    bs, rows = verify.tokens.shape
    width = acc.accept_index.shape[1]  # P + 1: the anchor and at most P accepted nodes
    dev = verify.tokens.device
    if width > rows:
        raise ValueError(f"committed_rows: accept_index {tuple(acc.accept_index.shape)} for {rows} verify rows")
    local = acc.accept_index.long() - torch.arange(bs, device=dev)[:, None] * rows  # the request's own rows
    step = torch.arange(width, device=dev).expand(bs, width)
    accepted = acc.accepted.long()[:, None]
    on_path = step <= accepted
    # sort key: a committed row's place on the path; any other row after them, in its own order (entries past
    # the path go to a spare column)
    key = torch.cat([rows + torch.arange(rows, device=dev), torch.zeros(1, dtype=torch.long, device=dev)])
    key = key.expand(bs, rows + 1).clone()
    key.scatter_(1, torch.where(on_path, local, rows), torch.where(on_path, step, 0))
    order = key[:, :rows].argsort(dim=1)
    path_tokens = verify.tokens.gather(1, order[:, 1:width])  # the accepted nodes' tokens, root's child first
    out = torch.zeros(bs, rows, dtype=torch.int64, device=dev)
    out[:, : width - 1] = torch.where(step[:, : width - 1] < accepted, path_tokens, 0)
    out.scatter_(1, accepted, acc.bonus.view(-1, 1).to(torch.int64))
    return CommittedRows(order=order, commit_lens=acc.accepted.to(torch.int32) + 1, out_tokens=out)


def commit_path(verify: TreeVerify, acc: TreeAcceptance, loc_2d: torch.Tensor, req_to_token: torch.Tensor,
                req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, kernels: bool
                ) -> tuple[CommittedRows, torch.Tensor]:
    """`committed_rows` then `bring_to_front` (returns both's outcome, `req_to_token` rewritten): with `kernels`
    in one Triton kernel (kernels/tree_commit.py), else on this PyTorch reference."""
    if kernels:
        from ..kernels.tree_commit import commit_path_kernel

        order, commit_lens, out, front = commit_path_kernel(acc.accept_index, acc.accepted, acc.bonus, verify.tokens,
                                                            loc_2d, req_to_token, req_pool_indices, seq_lens)
        return CommittedRows(order=order, commit_lens=commit_lens, out_tokens=out), front
    rows = committed_rows(verify, acc)
    return rows, bring_to_front(rows.order, loc_2d, req_to_token, req_pool_indices, seq_lens)


def bring_to_front(order: torch.Tensor, cache_loc_2d: torch.Tensor, req_to_token: torch.Tensor,
                   req_pool_indices: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
    """Reorder each request's N verify slots `cache_loc_2d` [bs, N] in `req_to_token` (from its committed length
    on) by `order`, so position seq_len + j holds the slot of the j-th committed row, whose K/V was written for
    that position (a node's position is seq_len + its depth). Returns the slots in the new order [bs, N]."""
    slots = cache_loc_2d.gather(1, order)
    cols = seq_lens.view(-1, 1).long() + torch.arange(order.shape[1], device=order.device)
    req_to_token[req_pool_indices.view(-1, 1).long(), cols] = slots.to(req_to_token.dtype)
    return slots


def rows_to_front(x: torch.Tensor, order: torch.Tensor, rows: int | None = None) -> torch.Tensor:
    """x [bs·rows, ...] (a verify pass's rows) with each request's rows in `order` [bs, W] (W ≤ rows; the
    verify's row count by default)."""
    bs = order.shape[0]
    rows = order.shape[1] if rows is None else rows
    flat = (order + torch.arange(bs, device=order.device)[:, None] * rows).reshape(-1)
    return x.index_select(0, flat)
