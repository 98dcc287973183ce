"""What must hold before a DSPINE (or DFLASH) server starts: the drafter folder, the drafter against the target,
the server arguments and where the server runs (data-parallel attention, disaggregated prefill and decode). A
failure is a `StartupRefusal`, one line naming what is wrong.

Called by the plugin (DSPINE's server-argument handling) and by `sglang_patches` (the drafter checked before
SGLang reads it); this module imports neither.
"""
from __future__ import annotations

import os

ALGORITHM = "DSPINE"


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
        check_verify_width(int(server_args.speculative_num_draft_tokens), cfg.block_size, draft_path)
        if server_args.speculative_draft_load_format != "dummy":
            _check_codes_present(draft_path)
    except DrafterConfigError as e:
        raise StartupRefusal(f"{ALGORITHM}: refusing drafter {draft_path}: {e}") from None


def check_verify_width(n: int, block: int, draft_path: str) -> None:
    """--speculative-num-draft-tokens N (the rows a request verifies) against the drafter's block B: equal, or,
    verifying trees (SGLANG_DSPINE_TREE=1), larger, with the drafter's tree calibration beside it (a greedy
    request's wide tree is scored with it; drafter/tree_calibration.py)."""
    from ..drafter.config import DrafterConfigError
    from ..drafter.tree_calibration import TreeCalibration
    from ..env import ENV

    flags = "--speculative-num-draft-tokens/--speculative-dflash-block-size"
    if n == block:
        return
    if not ENV.tree:
        raise DrafterConfigError(f"drafter block_size {block} but {flags} is {n}; they must be equal (or, with "
                                 "SGLANG_DSPINE_TREE=1, larger: a tree of N - 1 nodes)")
    if n < block:
        raise DrafterConfigError(f"{flags} {n} is below the drafter's block_size {block}: a tree verifies at least "
                                 "the block's rows")
    TreeCalibration.load(draft_path, block)  # DrafterConfigError naming the file and how to make it


def check_placement(server_args) -> None:
    """What SGLang's DFlash code, which DSPINE runs, cannot serve on the installed release, refused in one line each
    (flag, why, the release that serves it), before SGLang's own DFlash checks refuse it in DFLASH's name or,
    for disaggregation, nothing refuses it and the decode server fails at its first step (`versions`):
    data-parallel attention on 0.5.17; on 0.5.23 without `--enable-dp-lm-head`; `--disaggregation-mode prefill`
    or `decode` on 0.5.17."""
    from .versions import (
        argument_view,
        dflash_hands_off_to_decode,
        dflash_runs_dp_attention,
        disagg_decode_release,
        dp_attention_enabled,
        dp_attention_release,
        release_name,
    )

    view = argument_view(server_args)
    here = release_name()
    if dp_attention_enabled(view):
        if not dflash_runs_dp_attention():
            raise StartupRefusal(
                f"{ALGORITHM}: refusing --enable-dp-attention: SGLang {here}'s DFlash code, which DSPINE runs, does "
                f"not support data-parallel attention; SGLang {dp_attention_release()} does (with --enable-dp-lm-head)"
            )
        if not view.enable_dp_lm_head:
            raise StartupRefusal(
                f"{ALGORITHM}: data-parallel attention needs --enable-dp-lm-head: the draft runs on each DP group's "
                "own ranks and decodes from the target head, which without it is split over all tensor-parallel "
                "ranks (SGLang's DFlash code, which DSPINE runs, asks the same)"
            )
    mode = view.disaggregation_mode
    if mode in ("prefill", "decode") and not dflash_hands_off_to_decode():
        raise StartupRefusal(
            f"{ALGORITHM}: refusing --disaggregation-mode {mode}: SGLang {here} gives a disaggregated decode server "
            "no DFlash draft input (its first decode step would start from an empty one, without the prefill's "
            f"tokens), so DSPINE cannot serve disaggregated there; SGLang {disagg_decode_release()} does"
        )


def _not_on_triton(view) -> str | None:
    """What to pass where the target's verify does not run on the triton attention backend (None: it does)."""
    if view.attention_backend == "triton" and (view.decode_attention_backend or "triton") == "triton":
        return None
    return (f"pass --attention-backend triton (found --attention-backend {view.attention_backend}, "
            f"--decode-attention-backend {view.decode_attention_backend})")


def check_tree(server_args) -> None:
    """SGLANG_DSPINE_TREE=1 (tree verification, tree_verify.py; its width: `check_verify_width`) is built on SGLang
    0.5.17's DFlash decode step, for one rank, the triton attention backend (it reads the tree mask in the
    target's verify pass; FA3 reads one only for EAGLE's top-k trees), page size 1 (the accepted path's slots are
    reordered token by token) and the whole draft cache (no sliding window). Anything else is refused in one
    line, never run untried."""
    from ..env import ENV
    from .versions import argument_view, dp_attention_enabled, sglang_version

    if not ENV.tree:
        return
    view = argument_view(server_args)
    why = None
    if sglang_version() >= (0, 5, 23):
        why = "it is built on SGLang 0.5.17's DFlash decode step; install sglang==0.5.17 or unset it"
    elif missing := dflash_step_missing():
        why = missing
    elif off_triton := _not_on_triton(view):
        why = f"the target's verify pass must read the tree mask: {off_triton}"
    elif int(view.page_size or 1) != 1:
        why = f"the accepted path's KV slots are reordered token by token: pass --page-size 1 (found {view.page_size})"
    elif int(view.tp_size) != 1 or dp_attention_enabled(view) or view.disaggregation_mode not in (None, "null"):
        why = "it runs on one rank, without data-parallel attention or disaggregation, so far"
    elif getattr(view, "speculative_draft_window_size", None):
        why = "the draft cache must be whole: drop --speculative-draft-window-size"
    if why:
        raise StartupRefusal(f"{ALGORITHM}: refusing SGLANG_DSPINE_TREE=1: {why}")


def check_split_kv_verify(server_args) -> None:
    """SGLANG_DSPINE_SPLITKV_VERIFY, when set (sglang_patches' patches 8 and 10), switches a kernel of SGLang's
    triton attention backend: refused in one line on another backend (it would do nothing), on a fixed tree
    server but for grouped (a tree's verify needs its mask, which only the grouped kernel reads; an adaptive tree
    server's chains get SGLang's kernel), and below-block on a fixed server (it verifies only the block, which
    below-block leaves on the extend kernel). Unset, the default (grouped) applies where it can and the worker's
    log says where it does not (a tree's too: the grouped kernel reads its mask)."""
    import os

    from ..env import ENV
    from .versions import argument_view

    mode = ENV.split_kv_verify
    if not mode or not ENV.split_kv_verify_set:  # unset: grouped where the backend is triton, said in the log
        return
    view = argument_view(server_args)
    why = None
    if off_triton := _not_on_triton(view):
        why = f"it switches a kernel of the triton attention backend: {off_triton}"
    elif ENV.tree and not ENV.adaptive and mode != "grouped":  # the grouped kernel reads a tree's mask
        why = ("a tree's verify needs its mask, which the split-KV kernel does not read, and a fixed tree server "
               "verifies nothing else: unset one of them (with SGLANG_DSPINE_VERIFY=adaptive its chains get it; "
               "grouped reads the mask)")
    elif mode == "below-block" and not ENV.adaptive:
        why = ("a fixed server verifies only the block, which below-block leaves on the extend kernel: set "
               "SGLANG_DSPINE_VERIFY=adaptive (its narrower shapes get the split-KV kernel) or use 1")
    if why:
        raw = os.environ["SGLANG_DSPINE_SPLITKV_VERIFY"]
        raise StartupRefusal(f"{ALGORITHM}: refusing SGLANG_DSPINE_SPLITKV_VERIFY={raw}: {why}")


def dflash_step_missing() -> str | None:
    """Why this SGLang lacks what DSPINE's own decode steps (a prefix, none, a tree) read of DFlash's step
    (dflash_step.dflash_step_names()), or None."""
    from .dflash_step import missing_dflash_step_names

    missing = missing_dflash_step_names()
    return f"SGLang's DFlash decode step lacks what it is built on: {', '.join(missing)}" if missing else None


ADAPTIVE_MAX_RUNNING_REQUESTS = 128


def check_adaptive(server_args) -> None:
    """SGLANG_DSPINE_VERIFY=adaptive (verify_shapes.py, the worker's policy) is built on SGLang's DFlash decode step
    (0.5.17 and 0.5.23: dflash_step.py) and SGLang's per-width verify graphs (verify_widths.py), for one rank (each
    rank would time its own steps and could choose differently) and a whole draft cache; with SGLANG_DSPINE_TREE=1
    (check_tree's conditions: 0.5.17 only) the server's tree is one more shape of the menu.
    Anything else is refused in one line; a malformed SGLANG_DSPINE_SHAPES too. Unless --max-running-requests is
    given, the DFLASH family's cap of 48 becomes 128: the narrow shapes serve the requests plain decoding would."""
    from ..drafter.config import DrafterConfig, DrafterConfigError
    from ..env import ENV
    from .verify_shapes import parse_menu
    from .verify_widths import check_verify_width_hooks
    from .versions import argument_view, dp_attention_enabled

    try:
        adaptive = ENV.adaptive
    except ValueError as e:
        raise StartupRefusal(f"{ALGORITHM}: {e}") from None
    if not adaptive:
        return
    view = argument_view(server_args)
    why = None
    if missing := dflash_step_missing():
        why = missing
    elif int(view.tp_size) != 1 or dp_attention_enabled(view) or view.disaggregation_mode not in (None, "null"):
        why = "it runs on one rank, without data-parallel attention or disaggregation, so far"
    elif getattr(view, "speculative_draft_window_size", None):
        why = "the draft cache must be whole: drop --speculative-draft-window-size"
    else:
        why = check_verify_width_hooks()
    if why:
        raise StartupRefusal(f"{ALGORITHM}: refusing SGLANG_DSPINE_VERIFY=adaptive: {why}")
    try:
        block = DrafterConfig.from_file(server_args.speculative_draft_model_path).block_size
        parse_menu(ENV.verify_shapes, block)
    except (ValueError, DrafterConfigError) as e:
        raise StartupRefusal(f"{ALGORITHM}: {e}") from None
    if server_args.max_running_requests is None:
        server_args.max_running_requests = ADAPTIVE_MAX_RUNNING_REQUESTS


def dflash_refusal_as_dspine(error: ValueError) -> StartupRefusal | None:
    """A refusal of SGLang's DFlash argument checks (which a DSPINE server runs), worded in DFLASH's name: the same
    refusal as one DSPINE line, SGLang's words kept; None for any other error."""
    message = " ".join(str(error).split())
    if isinstance(error, StartupRefusal) or "DFLASH" not in message:
        return None
    return StartupRefusal(f"{ALGORITHM}: refused by SGLang's DFlash checks, which DSPINE runs: {message}")


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
