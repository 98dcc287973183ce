"""SGLang plugin: registers the DSPINE speculative algorithm and the DSpineDraftModel architecture.

Loaded through the `sglang.srt.plugins` entry point in the server process and in every scheduler process.
SGLang only logs a plugin's exception and later fails with "Unknown speculative algorithm name", so
`register()` prints the real cause loudly before re-raising.

DSPINE is a DFlash-family algorithm: it answers every `is_*()` like DFLASH so the scheduler, model runner
and CUDA-graph runners take the DFlash paths (hidden-state capture, draft KV sizing, overlap, graphs).
SGLang 0.5.17's `CustomSpecAlgo` lacks three methods the scheduler calls (`need_topk`,
`carries_draft_hidden_states`, `create_future_map`); they, and the server-argument handling, are taken
from SGLang's own `SpeculativeAlgorithm` implementations applied to this object (no copies).

Registration also applies `sglang_patches.apply_at_registration`: the drafter is checked before SGLang reads
it (a DSpine drafter under DFLASH is refused), and a refusal ends the launcher with one line and exit code 2.
"""
from __future__ import annotations

import logging
import os
import sys

logger = logging.getLogger(__name__)

ALGORITHM = "DSPINE"
ARCHITECTURE = "DSpineDraftModel"
_registered = False


def _dspine_algo_class():
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang.srt.speculative.spec_registry import CustomSpecAlgo

    class DSpineAlgo(CustomSpecAlgo):
        is_dflash = is_dflash_family = lambda self: True
        supports_target_verify_for_draft = supports_grammar_overlap = lambda self: True
        # SpeculativeAlgorithm's own functions, run on this object: their bodies only ask self.is_*()
        need_topk = SpeculativeAlgorithm.need_topk
        carries_draft_hidden_states = SpeculativeAlgorithm.carries_draft_hidden_states
        create_future_map = SpeculativeAlgorithm.create_future_map

        def handle_server_args(self, server_args) -> None:
            # check_drafter_folder has run already, before SGLang's own code read the drafter's config
            # (sglang_patches.check_drafters_first)
            SpeculativeAlgorithm.handle_server_args(self, server_args)
            check_server_args(server_args)

    return DSpineAlgo


class StartupRefusal(ValueError):
    """A server that must not start as asked. In the launcher process it ends the process with one line on
    stderr and exit code 2 (sglang_patches.refusals_end_the_launcher_in_one_line)."""


def check_drafter_folder(draft_path) -> None:
    """What must hold before SGLang reads the drafter's files: a local folder holding a DSpine drafter whose
    config.json parses and validates and whose weight files are complete, and not the reference release's own
    config (wrapped, or without `dspine_config`), which SGLang would build the wrong model from."""
    from .checkpoint import check_drafter_dir, is_unconverted_release
    from .config import DrafterConfigError

    if not draft_path or not os.path.isdir(draft_path):
        raise StartupRefusal(f"{ALGORITHM}: --speculative-draft-model-path must be a local directory, found {draft_path!r}")
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
    from .config import DSPINE_ARCH, DrafterConfigError, read_json

    if not draft_path or not os.path.isdir(draft_path):
        return
    try:
        raw = read_json(os.path.join(draft_path, "config.json"))
    except DrafterConfigError:
        return
    raw = raw["config"] if set(raw) == {"config"} and isinstance(raw["config"], dict) else raw  # release wrapper
    archs = raw.get("architectures") or []
    if DSPINE_ARCH in archs or "dspine_config" in raw:
        raise StartupRefusal(
            f"DFLASH: refusing drafter {draft_path}: it is a DSpine drafter (architectures {archs}); serve it with "
            f"--speculative-algorithm {ALGORITHM} (DFLASH would ignore its injection and transition walk)"
        )


def check_server_args(server_args) -> None:
    """DSpine's own start-up checks, after DFlash's: the drafter must fit this target and these arguments."""
    from .config import DrafterConfig, DrafterConfigError

    draft_path = server_args.speculative_draft_model_path  # check_drafter_folder has passed
    try:
        cfg = DrafterConfig.from_file(draft_path)
        target = _target_text_config(server_args)
        cfg.check_target(target_hidden_size=int(target.hidden_size), target_vocab_size=int(target.vocab_size),
                         target_num_layers=int(target.num_hidden_layers))
        block = int(server_args.speculative_num_draft_tokens)
        if block != cfg.block_size:
            raise DrafterConfigError(
                f"drafter block_size {cfg.block_size} but --speculative-num-draft-tokens/--speculative-dflash-block-size "
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
    from safetensors import safe_open

    from .checkpoint import CODES_KEY, RELEASE_CODES, TRANSFER_FILE, tensor_shapes
    from .config import DrafterConfigError

    if CODES_KEY in tensor_shapes(draft_path):
        return
    side = os.path.join(draft_path, TRANSFER_FILE)
    if os.path.isfile(side):
        with safe_open(side, framework="pt") as st:
            if RELEASE_CODES in st.keys():
                return
    raise DrafterConfigError(
        f"no transfer codes: expected tensor `{CODES_KEY}` in the model files or `{RELEASE_CODES}` in {TRANSFER_FILE}"
    )


def _worker_factory(server_args):
    from . import sglang_patches
    from .worker import DSpineWorker

    sglang_patches.apply(server_args)

    return DSpineWorker


def register() -> None:
    """Entry point: idempotent; loud on failure."""
    global _registered
    if _registered:
        return
    from .env import ENV

    if ENV.stacks_on_sigusr1:
        # Diagnosis of a stuck server: `kill -USR1 <scheduler pid>` prints every thread's stack to its log.
        import faulthandler
        import signal

        faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        from sglang.srt.models.registry import ModelRegistry
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        try:
            SpeculativeAlgorithm.from_string(ALGORITHM)
        except ValueError:
            SpeculativeAlgorithm.register(ALGORITHM, supports_overlap=True, spec_class=_dspine_algo_class())(_worker_factory)
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
