"""Named regions of the training step for torch.profiler (benchmarks/train_scale.py --profile reads them).

`region(name)` is a `record_function` while a profiler runs and a shared no-op context otherwise, so the
regions inside the drafter's layers cost one flag check per call outside a profile.
"""
from __future__ import annotations

import contextlib

import torch

_NOOP = contextlib.nullcontext()


def region(name: str):
    if torch.autograd._profiler_enabled():
        return torch.profiler.record_function(name)
    return _NOOP
