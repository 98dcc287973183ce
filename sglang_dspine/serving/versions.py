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
