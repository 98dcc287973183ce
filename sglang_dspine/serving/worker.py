"""The DSPINE worker: SGLang's DFlashWorkerV2 with DSpine's draft decoding (and, where DFlash's worker refuses
them, log-probabilities).

Everything but the choice of draft tokens is DFlash's (prefill, context K/V, block preparation,
verification, overlap scheduling, CUDA-graph capture). The choice is the drafter's `DraftStep.decode`
(top-K of the backbone logits per block position -> transition scores -> walk). It runs inside the draft
CUDA graph as the graph's tail hook (the slot DFlash uses for its argmax) for every captured batch size,
and eagerly above them.

Log-probabilities: where DFlash's own verify step returns them, `DSpineWorker` leaves them to it. Where
DFlash's worker refuses them up front, `DSpineLogprobWorker` supplies them (the plugin picks the class):
the prefill is the target's own forward, so the target worker computes them exactly as without speculation;
after a verify step they come from the verify logits the tokens were accepted or sampled from (SGLang's
`compute_spec_v2_logprobs`, the function its EAGLE workers use), with the semantics of SGLang's sampler:
log-softmax of the logits after penalties, logit bias and grammar masks, divided by the request's
temperature (before top-k/top-p), or before the temperature with SGLANG_RETURN_ORIGINAL_LOGPROB. No extra
target forward. Both give the user the same numbers.
"""
from __future__ import annotations

import logging

import torch
from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2

from ..drafter.sharding import VocabShard

logger = logging.getLogger(__name__)


class _LogprobsHidden:
    """A batch as DFlash's worker code sees it when log-probs were asked for: `return_logprob` reads False, so
    its up-front refusal passes and its verify step builds no log-prob work; every other attribute is the
    batch's own (reads and writes go through). The target worker is handed the batch itself (`_TargetWorker`)."""

    return_logprob = False

    def __init__(self, batch):
        object.__setattr__(self, "_batch", batch)

    def __getattr__(self, name):
        return getattr(self._batch, name)

    def __setattr__(self, name, value):
        setattr(self._batch, name, value)


class _TargetWorker:
    """The target worker, given back the real batch: a prefill asked for log-probs computes them as it would
    without speculation."""

    def __init__(self, worker):
        self._worker = worker

    def __getattr__(self, name):
        return getattr(self._worker, name)

    def forward_batch_generation(self, batch=None, *args, **kwargs):
        if isinstance(batch, _LogprobsHidden):
            batch = batch._batch
        return self._worker.forward_batch_generation(batch, *args, **kwargs)


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


class DSpineLogprobWorker(DSpineWorker):
    """DSPINE on an SGLang whose DFlash worker refuses log-prob requests: DFlash's code runs on a view of the
    batch that hides `return_logprob`, the target worker gets the real batch, and the verify step's log-probs
    are computed here."""

    _logprob_batch = None  # the batch asking for log-probs while DFlash's code runs on it

    @property
    def target_worker(self):
        return self._target_worker if self._logprob_batch is None else _TargetWorker(self._target_worker)

    def forward_batch_generation(self, batch, on_publish=None, grammar_barrier=None):
        if not getattr(batch, "return_logprob", False):
            return super().forward_batch_generation(batch, on_publish=on_publish, grammar_barrier=grammar_barrier)
        # Decided before DFlash's code runs: its verify step sets the batch's mode to TARGET_VERIFY, which
        # SGLang counts as an extend mode.
        verify = is_verify_step(batch)
        self._logprob_batch = batch
        try:
            result = super().forward_batch_generation(_LogprobsHidden(batch), on_publish=on_publish,
                                                      grammar_barrier=grammar_barrier)
        finally:
            self._logprob_batch = None
        if verify:
            verify_logprobs(batch, result, self.block_size)
        return result


def is_verify_step(batch) -> bool:
    """Whether DFlash's worker will run a draft + verify step on `batch` (not a prefill, not an idle batch)."""
    return not (batch.forward_mode.is_extend() or batch.is_extend_in_batch or batch.forward_mode.is_idle())


def verify_logprobs(batch, result, block_size: int) -> None:
    """Log-probs of every token a verify step emits, from its logits, into `result.logits_output`.

    Row n·B + j of the verify logits is the target's distribution for request n's j-th emitted token (the
    accepted draft tokens, then the bonus token: DFlash's linear chain), and `result.next_token_ids` holds
    those tokens at n·B + j; entries past a request's accept length are computed and not read."""
    from sglang.srt.layers.logprob_processor import compute_spec_v2_logprobs

    out = result.logits_output
    bs = out.next_token_logits.shape[0] // block_size
    rows = torch.arange(bs * block_size, device=out.next_token_logits.device).view(bs, block_size)
    compute_spec_v2_logprobs(batch, out, result.next_token_ids.view(-1), rows, block_size - 1)
