"""The DSPINE worker: SGLang's DFlashWorkerV2 with DSpine's draft decoding.

Everything but the choice of draft tokens is DFlash's (prefill, context K/V, block preparation,
verification, overlap scheduling, CUDA-graph capture). The choice is the drafter's `DraftStep.decode`
(top-K of the backbone logits per block position -> transition scores -> walk). It runs inside the draft
CUDA graph as the graph's tail hook (the slot DFlash uses for its argmax) for every captured batch size,
and eagerly above them.
"""
from __future__ import annotations

import logging

import torch
from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2

from .sharding import VocabShard

logger = logging.getLogger(__name__)


class DSpineDraftSampler:
    """Capture-safe DSpine decoding with the DFlash sampler's contract: `__call__(hidden, input_ids)` writes
    the bs*(B-1) draft tokens into the static buffer `out`."""

    def __init__(self, step, max_bs: int):
        self.step = step
        b = step.block_size
        self.out = torch.empty(max_bs * (b - 1), dtype=torch.int64, device=step.head.device)

    def __call__(self, hidden_states, input_ids=None):
        b, h = self.step.block_size, hidden_states.shape[-1]
        states = hidden_states.view(-1, b, h)[:, 1:].reshape(-1, h)  # positions 1..B-1, rows contiguous
        tokens = self.step.decode(states)
        self.out[: tokens.numel()].copy_(tokens.reshape(-1))


class DSpineWorker(DFlashWorkerV2):
    def _maybe_build_draft_sampler(self):
        base = super()._maybe_build_draft_sampler()  # DFlash's checks: head present, unquantized, no added vocab
        if base is None:
            logger.info("DSPINE draft decoding kept eager (see the DFLASH reason above)")
            return None
        # DFlash's sampler already holds this rank's head rows and TP group (None on one rank)
        step = self.draft_model.draft_step
        step.attach_head(base.weight[: base.num_org], VocabShard(base.org_vocab_start, base.num_org, base.tp_group))
        max_bs = base.out.numel() // (self.block_size - 1)
        logger.info("DSPINE candidate decoding folded into the draft cuda graph (max bs %d, tp %d)", max_bs,
                    step.shard.world)
        return DSpineDraftSampler(step, max_bs)

    def _greedy_sample_from_vocab_parallel_head(self, *, hidden_states, lm_head, chunk_size: int = 256):
        """Eager path (above the captured batch sizes, or graphs off): DFlash hands over positions 1..B-1."""
        step = self.draft_model.draft_step
        shard = self._vocab_shard(lm_head)
        step.attach_head(lm_head.weight[: shard.size], shard)  # once; a no-op after
        return step.decode(hidden_states.contiguous()).reshape(-1)

    @staticmethod
    def _vocab_shard(lm_head) -> VocabShard:
        """This rank's rows of the target head (SGLang's `shard_indices`; the whole head without them), with
        SGLang's TP group (graph-safe collectives) when there are other ranks."""
        from sglang.srt.distributed import get_tp_group

        info = getattr(lm_head, "shard_indices", None)
        if info is None:
            return VocabShard(0, int(lm_head.weight.shape[0]))
        if int(info.num_added_elements):
            raise ValueError("DSPINE: target heads with added vocabulary are not supported")
        group = get_tp_group()
        return VocabShard(int(info.org_vocab_start_index), int(info.num_org_elements),
                          group if group.world_size > 1 else None)
