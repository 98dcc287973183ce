"""Transition cache: static, CUDA-graph-safe storage of each request's candidates, K×K transition table and
walk, indexed by batch slot and block position.

What it holds is written inside the draft graph on every draft step and never feeds back into what is
verified. DESIGN.md §2 also asks to reuse rows across verify rounds "where the accepted prefix keeps a row
valid"; no such row exists: every row depends on the block's backbone states, which attend to the context,
and each verify round appends the accepted tokens to that context (and moves the block). A row could only
be reused for an identical context and anchor, which a live request never presents twice. So rows are
recomputed every step rather than served stale; what the cache offers is the table itself, for diagnostics
(`departure_rate`: how often the walk overrode the backbone's argmax).
"""
from __future__ import annotations

import torch

from .decoding import BlockDraft


class TransitionCache:
    def __init__(self, max_bs: int, positions: int, top_k: int, device):
        self.candidates = torch.zeros(max_bs, positions, top_k, dtype=torch.int64, device=device)
        self.scores = torch.zeros(max_bs, positions, top_k, top_k, dtype=torch.float32, device=device)
        self.choice = torch.zeros(max_bs, positions, dtype=torch.int64, device=device)

    def store(self, draft: BlockDraft) -> None:
        bs = draft.tokens.shape[0]
        self.candidates[:bs].copy_(draft.candidates)
        self.scores[:bs].copy_(draft.scores)
        self.choice[:bs].copy_(draft.choice)

    def departure_rate(self, bs: int) -> float:
        """Fraction of positions where the walk left the backbone's argmax (host sync: for diagnostics)."""
        return float((self.choice[:bs] != 0).float().mean())
