"""Training sequences in memory, and which of them each (step, micro-batch, rank) takes."""
from __future__ import annotations

import random
from typing import Any

import torch

from .blocks import valid_anchors
from .data import DataError, iter_token_data


class TokenData:
    """Training sequences (token records, or conversations tokenised with the chat template), truncated to
    max_length, kept only if they hold a valid anchor."""

    def __init__(self, path: str, max_length: int, tokenizer=None, chat_template: str | None = None,
                 enable_thinking: bool | None = None, last_turn_only: bool = False, vocab_size: int | None = None,
                 progress: bool = False):
        import numpy as np
        from tqdm import tqdm

        self.items: list[tuple[Any, Any]] = []  # (int32 ids, uint8 mask): compact for large sets
        self.dropped = 0
        records = tqdm(iter_token_data(path, tokenizer, chat_template, enable_thinking, last_turn_only),
                       desc="read data", unit="seq", disable=not progress,
                       dynamic_ncols=True, leave=False)
        for n, rec in enumerate(records, 1):
            ids = np.asarray(rec["input_ids"][:max_length], dtype=np.int64)
            if vocab_size is not None and len(ids) and not 0 <= int(ids.min()) <= int(ids.max()) < vocab_size:
                raise DataError(f"training data {path}: record {rec.get('id', n - 1)!r} holds token ids outside "
                                f"[0, {vocab_size}) (the target's vocabulary): data made for another tokenizer?")
            mask = np.asarray(rec["loss_mask"][:max_length], dtype=np.float32) > 0.5
            if valid_anchors(torch.from_numpy(mask)[None]).any():
                self.items.append((ids.astype(np.int32), mask.astype(np.uint8)))
            else:
                self.dropped += 1
        if not self.items:
            raise DataError(f"training data {path}: no sequence has two consecutive response tokens "
                            f"within max_length={max_length}")

    def __len__(self) -> int:
        return len(self.items)

    def batch(self, indices: list[int], device) -> tuple[torch.Tensor, torch.Tensor]:
        seqs = [self.items[i] for i in indices]
        s = max(len(ids) for ids, _ in seqs)
        ids = torch.zeros(len(seqs), s, dtype=torch.long)
        mask = torch.zeros(len(seqs), s, dtype=torch.float32)
        for j, (t, m) in enumerate(seqs):
            ids[j, : len(t)] = torch.from_numpy(t.astype("int64"))
            mask[j, : len(m)] = torch.from_numpy(m.astype("float32"))
        return ids.to(device), mask.to(device)


class Schedule:
    """Which sequences each (step, micro-batch, rank) takes: a fresh permutation per epoch, ranks strided."""

    def __init__(self, n: int, batch_size: int, grad_accum: int, world: int, seed: int):
        self.n, self.bs, self.accum, self.world, self.seed = n, batch_size, grad_accum, world, seed
        self.per_epoch = max(1, n // (batch_size * world))  # micro-batches per rank per epoch
        self._perm: dict[int, list[int]] = {}

    def steps_per_epoch(self) -> float:
        return self.per_epoch / self.accum

    def indices(self, step: int, micro: int, rank: int) -> list[int]:
        m = step * self.accum + micro
        epoch, j = divmod(m, self.per_epoch)
        if epoch not in self._perm:
            self._perm = {epoch: random.Random(self.seed * 1000003 + epoch).sample(range(self.n), self.n)}
        perm = self._perm[epoch]
        start = (j * self.world + rank) * self.bs
        return [perm[(start + t) % self.n] for t in range(self.bs)]
