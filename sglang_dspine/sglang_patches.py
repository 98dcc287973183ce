"""Every change this plugin makes to SGLang 0.5.17's own code, in one place. Applied in the scheduler process
when the DSPINE worker is created (`plugin._worker_factory`), so servers of other algorithms are untouched.

1. Verify renormalisation follows `--sampling-backend`.
   DFlash's non-greedy verification (which DSPINE reuses) renormalises the target's probabilities with
   `sgl_kernel.top_k_renorm_prob` / `top_p_renorm_prob`, which call FlashInfer whatever the sampling backend.
   The dense path that needs them runs when a batch mixes top-k values, e.g. greedy requests (top_k 1)
   beside T=1 requests (whole vocabulary): the first such batch then JIT-builds FlashInfer's sampling module,
   which stalled a server for 112-139 s on the H200 (benchmarks/results/serving_logs/*), every request in the
   batch waiting. With `--sampling-backend pytorch` the user asked for no FlashInfer sampling; SGLang ships
   Triton versions of the same two renormalisations with FlashInfer's semantics (exact top-k/top-p
   thresholds, ties at the pivot kept; what it uses on ROCm), so they are used instead.

2. Requests that ask for log-probabilities are admitted.
   The scheduler refuses them for the whole DFlash family (`validate_dflash_request`: "DFLASH speculative
   decoding does not support return_logprob yet."). DSPINE returns them (`worker.DSpineWorker`), so in a
   DSPINE server the scheduler's check keeps only DFlash's other refusal (hidden states under overlap
   scheduling), worded for DSPINE.
"""
from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

def verify_renorm_follows_sampling_backend(server_args) -> bool:
    """Patch 1 (see the module docstring). Returns whether the Triton renormalisations are now in use."""
    if getattr(server_args, "sampling_backend", None) != "pytorch":
        return False
    from sglang.kernels.ops.sampling.renorm_triton import top_k_renorm_probs_triton, top_p_renorm_probs_triton
    from sglang.srt.speculative import dflash_utils

    for name in ("top_k_renorm_prob", "top_p_renorm_prob"):
        if not hasattr(dflash_utils, name):  # the patch would silently do nothing on another SGLang
            raise RuntimeError(f"sglang-dspine: sglang.srt.speculative.dflash_utils.{name} not found; "
                               "this plugin is written against sglang==0.5.17")
    if dflash_utils.top_k_renorm_prob is not top_k_renorm_probs_triton:  # once per process
        logger.info("DSPINE: verify renormalisation on SGLang's Triton kernels (--sampling-backend pytorch)")
    dflash_utils.top_k_renorm_prob = top_k_renorm_probs_triton
    dflash_utils.top_p_renorm_prob = top_p_renorm_probs_triton
    return True


def validate_dspine_request(req, enable_overlap: bool):
    """The scheduler's admission check for a DSPINE server: None, or why the request is refused."""
    if enable_overlap and req.return_hidden_states:
        return "DSPINE speculative decoding does not support return_hidden_states yet."
    return None


def admit_logprob_requests() -> None:
    """Patch 2 (see the module docstring)."""
    from sglang.srt.managers import scheduler

    if not hasattr(scheduler, "validate_dflash_request"):  # the patch would silently do nothing on another SGLang
        raise RuntimeError("sglang-dspine: sglang.srt.managers.scheduler.validate_dflash_request not found; "
                           "this plugin is written against sglang==0.5.17")
    scheduler.validate_dflash_request = validate_dspine_request


def apply(server_args) -> None:
    verify_renorm_follows_sampling_backend(server_args)
    admit_logprob_requests()
