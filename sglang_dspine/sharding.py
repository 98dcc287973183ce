"""Vocabulary sharding for candidate decoding under tensor parallelism.

With `--tp-size N` SGLang splits the target's LM head by rows: rank i holds tokens [start_i, start_i + size_i).
Candidate decoding needs two things from the head: the global top-K of the logits, and the head rows of the
chosen candidates. Each rank computes its local top-K, all ranks gather them and take the top-K of the union
(the same set a full-vocabulary top-K gives); candidate rows come from the rank that owns them (every other
rank contributes zeros to an all-reduce). Everything else (injection weights, transfer codes) is replicated.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


class VocabShard:
    """Rows [start, start + size) of a [V, ...] table live here; `group` holds the other shards (None: all here)."""

    def __init__(self, start: int = 0, size: int | None = None, group=None):
        self.start, self.size, self.group = start, size, group

    @property
    def world(self) -> int:
        return 1 if self.group is None else dist.get_world_size(self.group)

    def topk(self, local_logits: torch.Tensor, k: int) -> torch.Tensor:
        """Global ids of the top-k over the whole vocabulary, best first: [..., k]."""
        vals, ids = local_logits.topk(min(k, local_logits.shape[-1]), dim=-1)
        ids = ids + self.start
        if self.world == 1:
            return ids
        all_vals = [torch.empty_like(vals) for _ in range(self.world)]
        all_ids = [torch.empty_like(ids) for _ in range(self.world)]
        dist.all_gather(all_vals, vals.contiguous(), group=self.group)
        dist.all_gather(all_ids, ids.contiguous(), group=self.group)
        vals, ids = torch.cat(all_vals, -1), torch.cat(all_ids, -1)
        best = vals.topk(k, dim=-1).indices
        return ids.gather(-1, best)

    def rows(self, local_table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Rows of the global ids `ids` [...] from a row-sharded table: [..., D]."""
        if self.world == 1:
            return local_table[ids - self.start]
        size = local_table.shape[0] if self.size is None else self.size
        local = ids - self.start
        mine = (local >= 0) & (local < size)
        out = local_table[local.clamp(0, size - 1)] * mine.unsqueeze(-1).to(local_table.dtype)
        dist.all_reduce(out, group=self.group)
        return out


FULL = VocabShard()
