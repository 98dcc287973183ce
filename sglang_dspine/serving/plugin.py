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

This module is the one place that knows which SGLang is installed (`sglang_version()`): the supported
releases are `SUPPORTED_SGLANG`, and what differs between them is decided here and in `sglang_patches`.
"""
from __future__ import annotations

import functools
import logging
import os
import sys

logger = logging.getLogger(__name__)

ALGORITHM = "DSPINE"
ARCHITECTURE = "DSpineDraftModel"
# The SGLang releases this plugin runs on (setup.py allows exactly these): 0.5.17 is verified on the GPU;
# 0.5.23 needs torch 2.14, so it is tested on the CPU only.
SUPPORTED_SGLANG = ((0, 5, 17), (0, 5, 23))
_registered = False

# SpeculativeAlgorithm's own functions whose bodies only ask self.is_*(): run on DSPINE's object they answer
# what they answer for DFLASH. Taken where the installed SGLang has them.
_TAKEN_FROM_SPECULATIVE_ALGORITHM = (
    "need_topk", "carries_draft_hidden_states", "create_future_map", "supports_prefill_shared_read_done",
    "build_disagg_draft_input", "resolve_max_speculative_num_draft_tokens",
)


@functools.cache
def sglang_version() -> tuple[int, int, int]:
    """The imported SGLang's release, e.g. (0, 5, 23) for 0.5.23 or 0.5.23.post1 (its own version module: the
    package that runs, even where several are installed)."""
    from packaging.version import Version
    from sglang.version import __version__

    return tuple(Version(__version__).release[:3])


def check_sglang_version() -> None:
    found = sglang_version()
    if found not in SUPPORTED_SGLANG:
        names = [".".join(map(str, v)) for v in SUPPORTED_SGLANG]
        raise RuntimeError(f"sglang-dspine supports SGLang {' and '.join(names)}; the installed SGLang is "
                           f"{'.'.join(map(str, found))} (install one of them, e.g. pip install 'sglang=={names[-1]}')")


def dflash_returns_logprobs() -> bool:
    """Whether SGLang's own DFlash worker returns log-probabilities (and its scheduler admits such requests):
    0.5.23 computes them in the verify step (`compute_spec_logprobs(..., chain_stride=block_size)`), 0.5.17
    refuses them up front, and DSPINE's worker supplies them there."""
    return sglang_version() >= (0, 5, 23)


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

        def handle_server_args(self, server_args) -> None:
            # `server_args` is the record on 0.5.17 and, on 0.5.23, a stand-in that reads resolved values and
            # records writes; both read the same here. check_drafter_folder has run already, before SGLang's own
            # code read the drafter's config (sglang_patches.check_drafters_first).
            SpeculativeAlgorithm.handle_server_args(self, server_args)
            from . import sglang_patches

            sglang_patches.check_dflash_hooks()  # the DFlash hooks DSPINE's decoding needs (one line if not)
            check_server_args(server_args)

    for name in _TAKEN_FROM_SPECULATIVE_ALGORITHM:
        if hasattr(SpeculativeAlgorithm, name):
            setattr(DSpineAlgo, name, getattr(SpeculativeAlgorithm, name))
    return DSpineAlgo


class StartupRefusal(ValueError):
    """A server that must not start as asked. In the launcher process it ends the process with one line on
    stderr and exit code 2 (sglang_patches.refusals_end_the_launcher_in_one_line)."""


def check_drafter_folder(draft_path) -> None:
    """What must hold before SGLang reads the drafter's files: a local folder holding a DSpine drafter whose
    config.json parses and validates and whose weight files are complete, and not the reference release's own
    config (wrapped, or without `dspine_config`), which SGLang would build the wrong model from."""
    from ..drafter.checkpoint import check_drafter_dir, is_unconverted_release
    from ..drafter.config import DrafterConfigError

    if not draft_path or not os.path.isdir(draft_path):
        raise StartupRefusal(f"{ALGORITHM}: --speculative-draft-model-path must be a local directory, "
                             f"found {draft_path!r}")
    try:
        unconverted = is_unconverted_release(draft_path)
    except DrafterConfigError as e:  # no config.json, or not JSON: the message names the file
        raise StartupRefusal(f"{ALGORITHM}: refusing the drafter: {e}") from None
    if unconverted:
        raise StartupRefusal(
            f"{ALGORITHM}: refusing drafter {draft_path}: this is the reference release's own layout (config.json "
            f"without `dspine_config`), which SGLang cannot build a DSpine drafter from; convert it once with "
            f"`sglang-dspine export --checkpoint {draft_path} --output NEW_DIR` and serve NEW_DIR"
        )
    try:
        cfg = check_drafter_dir(draft_path)
    except DrafterConfigError as e:  # the message names the folder or file
        raise StartupRefusal(f"{ALGORITHM}: refusing the drafter: {e}") from None
    if not cfg.is_dspine:
        raise StartupRefusal(
            f"{ALGORITHM}: refusing drafter {draft_path}: it is a {cfg.kind} drafter (architectures "
            f"{cfg.raw.get('architectures')}); serve it with --speculative-algorithm DFLASH, or start a DSpine drafter "
            f"from it with `sglang-dspine train --init {draft_path} --kind dspine ...`"
        )


def check_not_a_dspine_drafter(draft_path) -> None:
    """A DFLASH server given a DSpine drafter would decode it with DFlash's argmax, ignoring the injection
    and the transition walk it was trained for: refused. Anything else is left to SGLang's own checks."""
    from ..drafter.checkpoint import raw_config
    from ..drafter.config import DSPINE_ARCH, DrafterConfigError

    try:
        raw, _, _ = raw_config(draft_path)
    except DrafterConfigError:  # not a folder, or no usable config.json: SGLang's own checks say so
        return
    archs = raw.get("architectures") or []
    if DSPINE_ARCH in archs or "dspine_config" in raw:
        raise StartupRefusal(
            f"DFLASH: refusing drafter {draft_path}: it is a DSpine drafter (architectures {archs}); serve it with "
            f"--speculative-algorithm {ALGORITHM} (DFLASH would ignore its injection and transition walk)"
        )


def check_server_args(server_args) -> None:
    """DSpine's own start-up checks, after DFlash's: the drafter must fit this target and these arguments."""
    from ..drafter.config import DrafterConfig, DrafterConfigError

    draft_path = server_args.speculative_draft_model_path  # check_drafter_folder has passed
    try:
        cfg = DrafterConfig.from_file(draft_path)
        target = _target_text_config(server_args)
        cfg.check_target(target_hidden_size=int(target.hidden_size), target_vocab_size=int(target.vocab_size),
                         target_num_layers=int(target.num_hidden_layers))
        block = int(server_args.speculative_num_draft_tokens)
        if block != cfg.block_size:
            raise DrafterConfigError(
                f"drafter block_size {cfg.block_size} but "
                "--speculative-num-draft-tokens/--speculative-dflash-block-size "
                f"is {block}; they must be equal"
            )
        if server_args.speculative_draft_load_format != "dummy":
            _check_codes_present(draft_path)
    except DrafterConfigError as e:
        raise StartupRefusal(f"{ALGORITHM}: refusing drafter {draft_path}: {e}") from None


def _target_text_config(server_args):
    from sglang.srt.utils.hf_transformers_utils import get_config

    cfg = get_config(server_args.model_path, trust_remote_code=server_args.trust_remote_code,
                     revision=server_args.revision)
    return getattr(cfg, "text_config", None) or cfg


def _check_codes_present(draft_path: str) -> None:
    """Cheap start-up check (file headers only) that the transfer codes exist; values are checked at load."""
    from ..drafter.checkpoint import CODES_KEY, RELEASE_CODES, TRANSFER_FILE, has_transfer_codes
    from ..drafter.config import DrafterConfigError

    if not has_transfer_codes(draft_path):
        raise DrafterConfigError(
            f"no transfer codes: expected tensor `{CODES_KEY}` in the model files "
            f"or `{RELEASE_CODES}` in {TRANSFER_FILE}"
        )


def _worker_factory(server_args):
    from . import sglang_patches
    from .worker import DSpineLogprobWorker, DSpineWorker

    sglang_patches.check_dflash_hooks()  # checked in the launcher already; this process's SGLang too
    sglang_patches.apply()
    # Where DFlash's own verify step returns log-probs, DSPINE's worker leaves them to it (computing them twice,
    # or hiding the request from it, would be wrong); elsewhere it supplies them.
    return DSpineWorker if dflash_returns_logprobs() else DSpineLogprobWorker


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
        from . import sglang_patches

        sglang_patches.apply_at_registration()
    except Exception:
        msg = f"sglang-dspine: registering {ALGORITHM} failed; SGLang will report 'Unknown speculative algorithm'"
        logger.exception(msg)
        print(msg, file=sys.stderr, flush=True)
        raise
    _registered = True
