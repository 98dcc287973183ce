"""The frozen target as the trainer's teacher."""
from __future__ import annotations

import torch

from .generate import target_features, target_parts


class TargetTeacher:
    """The frozen target: features of the drafter's target layers, last hidden states, embedding and head."""

    def __init__(self, target):
        self.model = target.eval()
        for p in target.parameters():
            p.requires_grad_(False)
        self.embed, self.head = target_parts(target)
        self.base = target.get_decoder() if hasattr(target, "get_decoder") else target.model

    @property
    def config(self):
        return self.model.config

    @torch.no_grad()
    def run(self, input_ids: torch.Tensor, layer_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(features [N, S, len(ids)·H], last hidden states [N, S, H]) of right-padded input_ids."""
        out = self.base(input_ids=input_ids, output_hidden_states=True, use_cache=False)
        return target_features(out.hidden_states, layer_ids), out.last_hidden_state
