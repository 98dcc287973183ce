"""Where the Triton kernels run: on CUDA, and on the CPU only under Triton's interpreter (TRITON_INTERPRET=1,
what the tests use without a GPU). The one place that asks."""
from __future__ import annotations

import torch
import triton


def interpreting() -> bool:
    """Whether Triton runs kernels through its interpreter."""
    return bool(triton.knobs.runtime.interpret)


def runs_on(device: torch.device) -> bool:
    """Whether the Triton kernels can run on tensors of `device`."""
    return device.type == "cuda" or interpreting()
