"""Which SGLang is installed, and what differs between the releases this plugin supports.

The one place that asks which SGLang runs (`sglang_version()`); the plugin and its patches read the release-dependent
facts from here.
"""
from __future__ import annotations

import functools

# The SGLang releases this plugin runs on (setup.py allows exactly these): 0.5.17 is verified on the GPU;
# 0.5.23 needs torch 2.14, so it is tested on the CPU only.
SUPPORTED_SGLANG = ((0, 5, 17), (0, 5, 23))


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


# The first supported release whose DFlash decode step plans its KV ids once per iteration (`KVLocPlan`, from the
# target runner's `kv_index_translator`) and hands that plan to the draft forward, the verify and the context writer.
_DFLASH_KV_LOC_PLAN = (0, 5, 23)


def dflash_plans_kv_locs() -> bool:
    """Whether SGLang's DFlash decode step plans the iteration's KV ids (0.5.23: `kv_index_translator.plan`, bound to
    the draft and verify forwards, the writes' ids from it) rather than passing the slots themselves (0.5.17)."""
    return sglang_version() >= _DFLASH_KV_LOC_PLAN


def release_name(version: tuple[int, int, int] | None = None) -> str:
    """A release as written, e.g. '0.5.23'; without an argument, the installed SGLang's."""
    return ".".join(map(str, sglang_version() if version is None else version))


# The first supported release where SGLang's DFlash code (which DSPINE runs) serves with data-parallel attention,
# and where it hands a disaggregated decode server a draft input (both 0.5.23).
_DFLASH_DP_ATTENTION = (0, 5, 23)
_DFLASH_DISAGG_DECODE = (0, 5, 23)


def dflash_runs_dp_attention() -> bool:
    """Whether SGLang's DFlash code serves with data-parallel attention. 0.5.17 refuses it in its DFlash argument
    handling (`speculative_hook._handle_dflash`: "Currently DFLASH speculative decoding does not support dp
    attention."). 0.5.23 admits it with `--enable-dp-lm-head` (the draft decoding reads the target head) and runs
    the draft on each DP group's attention-TP ranks (`draft_tp_context`), eagerly: the draft CUDA graph is off
    under dp attention (`DFlashWorkerV2.init_cuda_graphs`)."""
    return sglang_version() >= _DFLASH_DP_ATTENTION


def dflash_hands_off_to_decode() -> bool:
    """Whether a disaggregated decode server gets a DFlash draft input from SGLang for the requests a prefill server
    hands it. 0.5.23's `SpeculativeAlgorithm.build_disagg_draft_input` builds one for DFLASH
    (`dflash_disaggregation.build_dflash_disagg_draft_input`: the prefill's sampled token as the first block's
    anchor, the committed lengths); 0.5.17's returns None for DFLASH, and its decode step then starts from an empty
    (idle) DFlash draft input."""
    return sglang_version() >= _DFLASH_DISAGG_DECODE


def dp_attention_release() -> str:
    """The first supported release that serves DSPINE with data-parallel attention, e.g. '0.5.23'."""
    return release_name(_DFLASH_DP_ATTENTION)


def disagg_decode_release() -> str:
    """The first supported release that serves DSPINE on disaggregated prefill and decode servers."""
    return release_name(_DFLASH_DISAGG_DECODE)


def argument_view(server_args):
    """The server arguments as the installed SGLang's own DFlash argument handling reads them while they settle
    (0.5.17 `resolved_view`, 0.5.23 `resolving_view`; either also reads settled arguments)."""
    if sglang_version() >= (0, 5, 23):
        from sglang.srt.arg_groups.overrides import resolving_view

        return resolving_view(server_args)
    from sglang.srt.arg_groups.overrides import resolved_view

    return resolved_view(server_args)


def dp_attention_enabled(view) -> bool:
    """Whether server arguments (an `argument_view`) run attention data-parallel, as the installed SGLang's DFlash
    argument handling decides it: 0.5.17 `enable_dp_attention` (`--enable-dp-attention`); 0.5.23
    `attn_dp_enabled_of` (`--attn-dp-size N`, or the deprecated `--dp-size N --enable-dp-attention`, which 0.5.23
    turns into it)."""
    if sglang_version() >= (0, 5, 23):
        from sglang.srt.runtime_context import attn_dp_enabled_of

        return bool(attn_dp_enabled_of(view))
    return bool(view.enable_dp_attention)


def names_used(code) -> set[str]:
    """Every global or attribute name a code object (and the functions defined inside it) refers to."""
    names = set(code.co_names)
    for c in code.co_consts:
        if hasattr(c, "co_names"):
            names |= names_used(c)
    return names


def class_names(cls) -> set[str]:
    """Every name the methods of `cls` (its own, not its bases') store or read as attributes or globals: the
    members its code sets on an instance (buffers, flags) as well as those it calls."""
    return set().union(*(names_used(f.__code__) for f in vars(cls).values() if hasattr(f, "__code__")))
