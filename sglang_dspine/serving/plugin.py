"""SGLang plugin: registers the DSPINE speculative algorithm and the DSpineDraftModel architecture.

Loaded through the `sglang.srt.plugins` entry point in the server process and in every scheduler process.
SGLang only logs a plugin's exception and later fails with "Unknown speculative algorithm name", so
`register()` prints the real cause loudly before re-raising.

DSPINE is a DFlash-family algorithm: it answers every `is_*()`/`supports_*()` like DFLASH so the scheduler,
model runner and CUDA-graph runners take the DFlash paths (hidden-state capture, draft KV sizing, overlap,
graphs, mixed chunks). `CustomSpecAlgo` lacks some of the methods the scheduler calls or answers them for a
generic algorithm; those, and the server-argument handling, are taken from SGLang's own `SpeculativeAlgorithm`
implementations applied to this object (no copies).

Registration also applies `sglang_patches.apply_at_registration`: the drafter is checked before SGLang reads
it (a DSpine drafter under DFLASH is refused), and a refusal ends the launcher with one line and exit code 2.

Which SGLang is installed, and what differs between the supported releases, is `versions`; the checks a server
must pass to start are `startup_checks`. Both sit below this module and `sglang_patches`: the imports go one way,
plugin -> sglang_patches -> startup_checks, versions.
"""
from __future__ import annotations

import logging
import sys

# The start-up checks and the version facts live in their own modules (the patches use them too); the names
# not used here stay importable from the plugin, where callers have always found them.
from . import sglang_patches
from .startup_checks import (  # noqa: F401
    ALGORITHM,
    StartupRefusal,
    check_adaptive,
    check_drafter_folder,
    check_not_a_dspine_drafter,
    check_placement,
    check_server_args,
    check_split_kv_verify,
    check_tree,
    dflash_refusal_as_dspine,
)
from .versions import SUPPORTED_SGLANG, check_sglang_version, dflash_returns_logprobs, sglang_version  # noqa: F401

logger = logging.getLogger(__name__)

ARCHITECTURE = "DSpineDraftModel"
_registered = False

# SpeculativeAlgorithm's own functions whose bodies only ask self.is_*(): run on DSPINE's object they answer
# what they answer for DFLASH. Taken where the installed SGLang has them.
_TAKEN_FROM_SPECULATIVE_ALGORITHM = (
    "need_topk", "carries_draft_hidden_states", "create_future_map", "supports_prefill_shared_read_done",
    "build_disagg_draft_input", "resolve_max_speculative_num_draft_tokens",
)


def _dspine_algo_class():
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang.srt.speculative.spec_registry import CustomSpecAlgo

    class DSpineAlgo(CustomSpecAlgo):
        is_dflash = is_dflash_family = lambda self: True
        supports_target_verify_for_draft = supports_grammar_overlap = lambda self: True
        # SpeculativeAlgorithm's answer is a membership test of its own members (DFLASH among them), so it
        # cannot be run on this object; DFLASH's answer is True (DSPINE runs DFlash's worker, mixed steps
        # included). SGLang versions without the method never call it.
        supports_mixed_chunk = lambda self: True
        # The draft forward's rows per request where they differ from the verify's (a tree wider than the
        # block, SGLANG_DSPINE_TREE=1): set by the worker before its draft worker is built.
        draft_rows_per_req: int | None = None

        def get_num_tokens_per_req_for_target_verify(self, num_draft_tokens: int, is_draft_worker: bool) -> int:
            # SGLang sizes a runner's TARGET_VERIFY CUDA graphs from this (the hook DSpark uses for its narrower
            # draft forward): the target verifies N rows, the drafter drafts its block.
            if is_draft_worker and self.draft_rows_per_req is not None:
                return self.draft_rows_per_req
            return num_draft_tokens

        def handle_server_args(self, server_args) -> None:
            # `server_args` is the record on 0.5.17 and, on 0.5.23, a stand-in that reads resolved values and
            # records writes; both read the same here. check_drafter_folder has run already, before SGLang's own
            # code read the drafter's config (sglang_patches.check_drafters_first). What DSPINE cannot serve on this
            # release is refused first, in DSPINE's name; a refusal of DFlash's own checks is reworded to it.
            check_placement(server_args)
            check_tree(server_args)
            check_adaptive(server_args)
            check_split_kv_verify(server_args)
            try:
                SpeculativeAlgorithm.handle_server_args(self, server_args)
            except ValueError as e:
                refusal = dflash_refusal_as_dspine(e)
                if refusal is None:
                    raise
                raise refusal from None
            sglang_patches.check_dflash_hooks()  # the DFlash hooks DSPINE's decoding needs (one line if not)
            check_server_args(server_args)

    for name in _TAKEN_FROM_SPECULATIVE_ALGORITHM:
        if hasattr(SpeculativeAlgorithm, name):
            setattr(DSpineAlgo, name, getattr(SpeculativeAlgorithm, name))
    return DSpineAlgo


def _worker_factory(server_args):
    from .worker import DSpineWorker

    sglang_patches.check_dflash_hooks()  # checked in the launcher already; this process's SGLang too
    sglang_patches.apply()
    # One worker: it reads its verify shapes (fixed block, SGLANG_DSPINE_TREE=1, SGLANG_DSPINE_VERIFY=adaptive;
    # refused at start where not built) and whether it supplies log-probs (where DFlash's worker refuses them).
    return DSpineWorker


def register() -> None:
    """Entry point: idempotent; loud on failure."""
    global _registered
    if _registered:
        return
    from ..env import ENV

    if ENV.stacks_on_sigusr1:
        # Diagnosis of a stuck server: `kill -USR1 <scheduler pid>` prints every thread's stack to its log.
        import faulthandler
        import signal

        faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        check_sglang_version()
        from sglang.srt.models.registry import ModelRegistry
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        try:
            SpeculativeAlgorithm.from_string(ALGORITHM)
        except ValueError:
            SpeculativeAlgorithm.register(ALGORITHM, supports_overlap=True,
                                          spec_class=_dspine_algo_class())(_worker_factory)
        from .sglang_model import DSpineDraftModel

        ModelRegistry.models[ARCHITECTURE] = DSpineDraftModel
        sglang_patches.apply_at_registration()
    except Exception:
        msg = f"sglang-dspine: registering {ALGORITHM} failed; SGLang will report 'Unknown speculative algorithm'"
        logger.exception(msg)
        print(msg, file=sys.stderr, flush=True)
        raise
    _registered = True
