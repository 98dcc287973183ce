"""Every change this plugin makes to SGLang 0.5.17's behaviour, in one place.

Patches 1 and 2 change DSPINE servers only: `apply`, from `plugin._worker_factory`, runs in the scheduler process
when the DSPINE worker is created.

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

Patches 3 and 4 are applied at plugin registration, in every SGLang process (`apply_at_registration`):

3. Drafters are checked before SGLang reads them.
   SGLang's speculative argument handling (`speculative_hook.handle_speculative_decoding`, run in the launcher
   process while the server arguments are built, before any other process starts) reads the drafter's
   config.json with transformers before any algorithm's own checks run, so a missing folder, a malformed
   config.json or a truncated weight file surfaced as a traceback from transformers or the weight loader. It is
   wrapped so that first, under DSPINE, the drafter folder is checked whole (`plugin.check_drafter_folder`),
   and under DFLASH a DSpine drafter is refused (`plugin.check_not_a_dspine_drafter`): DFLASH would decode it
   with its argmax, ignoring the injection and walk it was trained for. Servers of other algorithms, and
   DFLASH servers of DFlash drafters, are untouched.
4. A start-up refusal ends the launcher with one line.
   An uncaught `plugin.StartupRefusal` (raised only by the checks above and DSPINE's own argument checks)
   prints `sglang-dspine: error: MESSAGE` on stderr and exits with code 2, as argparse does for a bad flag,
   instead of a traceback through SGLang's argument code. Code that builds the arguments itself (`sglang.Engine`)
   can catch it as a ValueError. Any other exception reaches the previous hook unchanged.
"""
from __future__ import annotations

import functools
import logging
import sys

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


def check_drafters_first() -> None:
    """Patch 3 (see the module docstring). Idempotent."""
    from sglang.srt.arg_groups import speculative_hook

    from . import plugin

    stock = getattr(speculative_hook, "handle_speculative_decoding", None)
    if stock is None:  # the patch would silently do nothing on another SGLang
        raise RuntimeError("sglang-dspine: sglang.srt.arg_groups.speculative_hook.handle_speculative_decoding not "
                           "found; this plugin is written against sglang==0.5.17")
    if getattr(stock, "_dspine_checks_drafters", False):
        return

    @functools.wraps(stock)
    def handle_speculative_decoding(server_args) -> None:
        algo = (server_args.speculative_algorithm or "").upper()
        if algo == plugin.ALGORITHM:
            plugin.check_drafter_folder(server_args.speculative_draft_model_path)
        elif algo == "DFLASH":
            plugin.check_not_a_dspine_drafter(server_args.speculative_draft_model_path)
        return stock(server_args)

    handle_speculative_decoding._dspine_checks_drafters = True
    speculative_hook.handle_speculative_decoding = handle_speculative_decoding


def refusals_end_the_launcher_in_one_line() -> None:
    """Patch 4 (see the module docstring). Idempotent."""
    from .plugin import StartupRefusal

    previous = sys.excepthook
    if getattr(previous, "_dspine_refusals", False):
        return

    def excepthook(etype, value, tb):
        if isinstance(value, StartupRefusal):
            print(f"sglang-dspine: error: {' '.join(str(value).split())}", file=sys.stderr, flush=True)
            sys.exit(2)
        previous(etype, value, tb)

    excepthook._dspine_refusals = True
    sys.excepthook = excepthook


def apply_at_registration() -> None:
    check_drafters_first()
    refusals_end_the_launcher_in_one_line()
