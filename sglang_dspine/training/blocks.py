"""Training blocks: anchors sampled inside the responses, and the blocks [anchor, mask × (B-1)] built at them
with their labels, supervision, position weights and teacher positions."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .schedules import position_weights


@dataclass
class Blocks:
    """Training blocks of a micro-batch: N sequences × nb blocks × B positions."""

    anchors: torch.Tensor  # [N, nb] anchor positions (0 for padding blocks)
    keep: torch.Tensor  # [N, nb] bool, real blocks
    labels: torch.Tensor  # [N, nb, B] token at anchor + i (slot 0: the anchor token)
    supervised: torch.Tensor  # [N, nb, B-1] bool, positions 1..B-1
    weights: torch.Tensor  # [N, nb, B-1] float, supervised · exp(-(i-1)/γ)
    block_ids: torch.Tensor  # [N, nb, B] [anchor, mask...] (all mask for padding blocks)
    positions: torch.Tensor  # [N, nb, B]
    ctx_visible: torch.Tensor  # [N, nb, S] bool, context positions < anchor
    teacher_index: torch.Tensor  # [N, nb, B-1] position whose target distribution predicts the label
    replace: torch.Tensor | None = None  # [N, nb] bool, blocks with predecessor replacement

    @property
    def denominator(self) -> torch.Tensor:
        return self.weights.sum()


def valid_anchors(loss_mask: torch.Tensor) -> torch.Tensor:
    """[N, S] bool: positions a with loss_mask[a] and loss_mask[a+1] (the anchor and its first label)."""
    m = loss_mask > 0.5
    out = torch.zeros_like(m)
    out[:, :-1] = m[:, :-1] & m[:, 1:]
    return out


def sample_anchors(loss_mask: torch.Tensor, num_anchors: int, generator: torch.Generator | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to num_anchors valid anchors per sequence, uniformly without replacement, sorted ascending.

    Returns (anchors [N, nb], keep [N, nb]) with nb = min(num_anchors, most valid anchors of a sequence);
    padding entries have anchor 0 and keep False."""
    valid = valid_anchors(loss_mask).cpu()
    n, s = valid.shape
    nb = max(1, min(num_anchors, int(valid.sum(1).max())))
    score = torch.rand(n, s, generator=generator)
    score = torch.where(valid, score, torch.full_like(score, 2.0))
    picked = score.argsort(dim=1)[:, :nb]
    keep = valid.gather(1, picked)
    anchors = torch.where(keep, picked, torch.zeros_like(picked))
    # sort real anchors ascending, padding last
    key = torch.where(keep, anchors, torch.full_like(anchors, s + 1))
    order = key.argsort(dim=1)
    return anchors.gather(1, order).to(loss_mask.device), keep.gather(1, order).to(loss_mask.device)


def make_blocks(input_ids: torch.Tensor, loss_mask: torch.Tensor, anchors: torch.Tensor, keep: torch.Tensor,
                block_size: int, mask_token_id: int, gamma: float) -> Blocks:
    n, s = input_ids.shape
    b = block_size
    offsets = torch.arange(b, device=input_ids.device)
    index = anchors.unsqueeze(-1) + offsets  # [N, nb, B]
    safe = index.clamp(max=s - 1)
    labels = torch.gather(input_ids.unsqueeze(1).expand(-1, anchors.shape[1], -1), 2, safe)
    in_resp = torch.gather((loss_mask > 0.5).unsqueeze(1).expand(-1, anchors.shape[1], -1), 2, safe)
    sup = (index < s) & in_resp & keep.unsqueeze(-1)
    sup = sup[..., 1:].long().cumprod(-1).bool()
    weights = sup.float() * position_weights(b, gamma, input_ids.device)
    block_ids = torch.full_like(labels, mask_token_id)
    block_ids[..., 0] = torch.where(keep, labels[..., 0], torch.full_like(labels[..., 0], mask_token_id))
    ctx_visible = (torch.arange(s, device=input_ids.device).view(1, 1, s) < anchors.unsqueeze(-1)) & keep.unsqueeze(-1)
    teacher_index = (safe[..., 1:] - 1).clamp(min=0)
    return Blocks(anchors=anchors, keep=keep, labels=labels, supervised=sup, weights=weights, block_ids=block_ids,
                  positions=index, ctx_visible=ctx_visible, teacher_index=teacher_index)
