"""Candidate decoding with a transition table (docs/algorithm.md).

For block positions 1..B-1 take the top-K tokens of the backbone logits; score every adjacent pair by
refining the later position's last-layer state with the earlier candidate as known predecessor (the anchor
for position 1) and dotting with the later candidate's head row; then walk left to right, each step picking
the best candidate in the row of the token picked before. Scoring is parallel; the walk is look-ups.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .sharding import FULL, VocabShard


@dataclass
class BlockDraft:
    tokens: torch.Tensor  # [N, B-1] the draft for positions 1..B-1
    candidates: torch.Tensor  # [N, B-1, K] top-K token ids of the backbone logits
    scores: torch.Tensor  # [N, B-1, K, K] transition table: [i, k, j] = score of cand_i[j] after cand_{i-1}[k]
    choice: torch.Tensor  # [N, B-1] index into candidates picked by the walk


def predecessor_tokens(candidates: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
    """[N, P, K] predecessor token of row k at each position: the anchor (all rows) for position 1."""
    first = anchors.view(-1, 1, 1).expand(-1, 1, candidates.shape[-1])
    return torch.cat([first, candidates[:, :-1]], dim=1)


def transition_scores(
    refined_normed: torch.Tensor, candidate_rows: torch.Tensor
) -> torch.Tensor:
    """S[n, i, k, j] = refined_normed[n, i, k] · candidate_rows[n, i, j].

    refined_normed: [N, P, K, H] final-normed refined states (row k = predecessor candidate k);
    candidate_rows: [N, P, K, H] head rows of the candidates of each position.
    """
    return torch.einsum("npkh,npjh->npkj", refined_normed.float(), candidate_rows.float())


def walk(scores: torch.Tensor) -> torch.Tensor:
    """Left-to-right walk through [N, P, K, K]: start in row 0 (the anchor), then the row of the pick."""
    n, p, k, _ = scores.shape
    rows = torch.arange(n, device=scores.device)
    prev = torch.zeros(n, dtype=torch.long, device=scores.device)
    picks = []
    for i in range(p):
        prev = scores[rows, i, prev].argmax(-1)
        picks.append(prev)
    return torch.stack(picks, dim=1)


def decode_block(
    logits: torch.Tensor,
    pre_last: torch.Tensor,
    anchors: torch.Tensor,
    top_k: int,
    refine: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    codes: torch.Tensor,
    head: torch.Tensor,
    shard: VocabShard = FULL,
) -> BlockDraft:
    """Candidate decoding of one block per request.

    logits: [N, B-1, V] backbone logits of positions 1..B-1; pre_last: [N, B-1, H] their last-layer
    pre-injection states; anchors: [N]; refine(pre_last [N,P,H], pred_codes [N,P,K,r]) -> normed [N,P,K,H];
    codes: [V, r] transfer codes; head: [V, H] target LM head. Under tensor parallelism `logits` and `head`
    are this rank's vocabulary shard and `shard` says which (the codes stay whole).
    """
    candidates = shard.topk(logits, top_k)  # [N, P, K] global ids
    preds = predecessor_tokens(candidates, anchors)
    refined = refine(pre_last, codes[preds])
    scores = transition_scores(refined, shard.rows(head, candidates))
    choice = walk(scores)
    tokens = candidates.gather(-1, choice.unsqueeze(-1)).squeeze(-1)
    return BlockDraft(tokens=tokens, candidates=candidates, scores=scores, choice=choice)
