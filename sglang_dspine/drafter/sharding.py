"""Vocabulary sharding for candidate decoding under tensor parallelism.

With `--tp-size N` SGLang splits the target's LM head by rows: rank i holds tokens [start_i, start_i + size_i).
Candidate decoding needs two things from the head: the global top-K of the logits, and the head rows of the
chosen candidates. Each rank computes its local top-K, all ranks gather them and take the top-K of the union
(the same set a full-vocabulary top-K gives); candidate rows come from the rank that owns them (every other
rank contributes zeros to an all-reduce). Everything else (injection weights, transfer codes) is replicated.

`group` is anything with SGLang's GroupCoordinator methods `all_gather_into_tensor(out, inp)` and
`all_reduce(t) -> t` (SGLang's TP group: graph-safe collectives), or a torch.distributed group wrapped in
`TorchGroup`.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


class TorchGroup:
    """A torch.distributed process group with the two GroupCoordinator methods VocabShard uses."""

    def __init__(self, group=None):
        self.group = group
        self.world_size = dist.get_world_size(group)

    def all_gather_into_tensor(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        dist.all_gather_into_tensor(out, inp, group=self.group)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t, group=self.group)
        return t


class VocabShard:
    """Rows [start, start + size) of a [V, ...] table live here; `group` holds the other shards (None: all here)."""

    def __init__(self, start: int = 0, size: int | None = None, group=None):
        self.start, self.size, self.group = start, size, group

    @property
    def world(self) -> int:
        return 1 if self.group is None else int(self.group.world_size)

    def _gather(self, t: torch.Tensor) -> torch.Tensor:
        """[..., k] from every rank -> [..., world·k], rank-major along the last axis."""
        out = torch.empty((self.world,) + tuple(t.shape), dtype=t.dtype, device=t.device)
        self.group.all_gather_into_tensor(out.view(-1), t.contiguous().view(-1))
        return out.movedim(0, -2).reshape(*t.shape[:-1], -1)

    def topk(self, local_logits: torch.Tensor, k: int) -> torch.Tensor:
        """Global ids of the top-k over the whole vocabulary, best first: [..., k]."""
        vals, ids = local_logits.topk(min(k, local_logits.shape[-1]), dim=-1)
        ids = ids + self.start
        if self.world == 1:
            return ids
        vals, ids = self._gather(vals), self._gather(ids)
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
        return self.group.all_reduce(out)


FULL = VocabShard()
