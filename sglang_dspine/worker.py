"""The DSPINE worker: SGLang's DFlashWorkerV2 with DSpine's draft decoding.

Everything but the choice of draft tokens is DFlash's (prefill, context K/V, block preparation,
verification, overlap scheduling, CUDA-graph capture). The choice becomes candidate decoding: top-K of the
backbone logits per block position -> transition scores from the last-write refinement -> the walk. It runs
inside the draft CUDA graph as the graph's tail hook (the slot DFlash uses for its argmax) for every
captured batch size, and eagerly above them.
"""
from __future__ import annotations

import logging

import torch
from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2

from .cache import TransitionCache
from .decoding import decode_block
from .sharding import FULL, VocabShard

logger = logging.getLogger(__name__)


def draft_tokens(model, h: torch.Tensor, head: torch.Tensor, cache: TransitionCache | None = None,
                 shard: VocabShard = FULL) -> torch.Tensor:
    """[bs, B-1, H] final draft states of positions 1..B-1 (the model's last forward) -> [bs, B-1] tokens.
    Under tensor parallelism `head` is this rank's rows of the target head and `shard` says which."""
    bs, b = h.shape[0], model.block_size
    if h.dtype != head.dtype:
        h = h.to(head.dtype)
    logits = torch.matmul(h, head.T)
    pre = model.last_pre_injection.view(bs, b, -1)[:, 1:]
    kp = model.kernel_path
    if kp is not None and kp.tables is not None and shard.world == 1:
        draft = kp.decode(logits, pre, model.last_anchors, model.top_k, model.transfer_codes, head,
                          model.norm.weight, model.norm.variance_epsilon)
    else:
        draft = decode_block(logits, pre, model.last_anchors, model.top_k, model.refine_normed,
                             model.transfer_codes, head, shard)
    if cache is not None:
        cache.store(draft)
    return draft.tokens


def prepare_decoding(model, head: torch.Tensor, shard: VocabShard = FULL) -> None:
    """Build the kernels' transition tables for this head, outside any graph capture (whole heads only: the
    tables index the head by token)."""
    if model.kernel_path is not None and shard.world == 1:
        model.kernel_path.build_tables(model.transfer_codes, head, model.norm.weight)


class DSpineDraftSampler:
    """Capture-safe DSpine decoding with the DFlash sampler's contract: `__call__(hidden, input_ids)` writes
    the bs*(B-1) draft tokens into the static buffer `out`."""

    def __init__(self, model, head: torch.Tensor, max_bs: int, shard: VocabShard = FULL):
        self.model, self.head, self.shard = model, head, shard
        b = model.block_size
        self.out = torch.empty(max_bs * (b - 1), dtype=torch.int64, device=head.device)
        self.cache = TransitionCache(max_bs, b - 1, model.top_k, head.device)

    def __call__(self, hidden_states, input_ids=None):
        b = self.model.block_size
        states = hidden_states.view(-1, b, hidden_states.shape[-1])[:, 1:]
        tokens = draft_tokens(self.model, states, self.head, self.cache, self.shard)
        self.out[: tokens.numel()].copy_(tokens.reshape(-1))


class DSpineWorker(DFlashWorkerV2):
    def _maybe_build_draft_sampler(self):
        base = super()._maybe_build_draft_sampler()  # DFlash's checks: head present, unquantized, no added vocab
        if base is None:
            logger.info("DSPINE draft decoding kept eager (see the DFLASH reason above)")
            return None
        # DFlash's sampler already holds this rank's head rows and TP group (None on one rank)
        shard = VocabShard(base.org_vocab_start, base.num_org, base.tp_group)
        head = base.weight[: base.num_org]
        prepare_decoding(self.draft_model, head, shard)
        max_bs = base.out.numel() // (self.block_size - 1)
        logger.info("DSPINE candidate decoding folded into the draft cuda graph (max bs %d, tp %d)", max_bs, shard.world)
        return DSpineDraftSampler(self.draft_model, head, max_bs, shard)

    def _greedy_sample_from_vocab_parallel_head(self, *, hidden_states, lm_head, chunk_size: int = 256):
        """Eager path (above the captured batch sizes, or graphs off). DFlash hands over positions 1..B-1 only;
        the decoding also needs the model's last pre-injection states and anchors, kept by its forward."""
        model = self.draft_model
        states = hidden_states.view(-1, model.block_size - 1, hidden_states.shape[-1])
        shard = self._vocab_shard(lm_head)
        head = lm_head.weight[: shard.size]
        prepare_decoding(model, head, shard)  # once; a no-op after
        return draft_tokens(model, states, head, shard=shard).reshape(-1)

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
