"""The serving draft step on the Triton kernels (`sglang_dspine.kernels`).

The SGLang model and the worker compute exactly the math of `injection.py` / `decoding.py`; on a GPU they
do it with the fused kernels instead (H200, Qwen3-8B shapes, bs 48: draft step 5444 µs against 8215 µs
with the PyTorch math; `benchmarks/results/kernels_summary.json`). This object holds what the kernels need,
laid out once after the weights are loaded: the injection weights as one contiguous set, and the
transition tables built from the target's head (per-token projections, built when the head is known).

`SGLANG_DSPINE_KERNELS=0` selects the PyTorch math instead (an explicit switch, logged; never a silent
fallback). Off CUDA the kernels only run under Triton's interpreter, which the tests use.
"""
from __future__ import annotations

import logging
import os

import torch

from .decoding import BlockDraft
from .injection import AdjacentInjection

logger = logging.getLogger(__name__)


def kernels_enabled() -> bool:
    flag = os.environ.get("SGLANG_DSPINE_KERNELS", "1")
    if flag not in ("0", "1"):
        raise ValueError(f"SGLANG_DSPINE_KERNELS: expected 0 or 1, found {flag!r}")
    return flag == "1"


def _batch_invariant_mode() -> bool:
    """SGLang's --enable-deterministic-inference swaps aten's GEMMs for batch-invariant ones whose addmm takes
    only a 1-D bias; the injection's fused residual epilogue then has to be a GEMM and an add."""
    from sglang.srt.batch_invariant_ops import is_batch_invariant_mode_enabled

    return is_batch_invariant_mode_enabled()


class KernelPath:
    def __init__(self, injection: AdjacentInjection, dtype: torch.dtype):
        from .kernels import InjectionWeights

        self.weights = InjectionWeights.from_module(injection, dtype=dtype)
        self.tables = None

    def anchor_projections(self, codes: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        from .kernels import anchor_projections

        return anchor_projections(self.weights, codes, anchors)

    def inject(self, x: torch.Tensor, layer: int, anchor_proj: torch.Tensor, block_size: int) -> torch.Tensor:
        """Injection after `layer` on flat [bs·B, H] states (a new tensor; x is left as it is)."""
        from .kernels import inject_flat

        return inject_flat(x, layer, self.weights, anchor_proj, block_size, fused_residual=not _batch_invariant_mode())

    @torch.no_grad()
    def build_tables(self, codes: torch.Tensor, head: torch.Tensor, norm_weight: torch.Tensor) -> None:
        """Per-token transition tables from the codes and the target head (once, outside any graph capture)."""
        from .kernels import TransitionTables

        if self.tables is None:
            self.tables = TransitionTables.build(self.weights, codes, head, norm_weight)

    def decode(self, logits: torch.Tensor, pre_last: torch.Tensor, anchors: torch.Tensor, top_k: int,
               codes: torch.Tensor, head: torch.Tensor, norm_weight: torch.Tensor, norm_eps: float) -> BlockDraft:
        """`decoding.decode_block` on the kernels: logits [bs, P, V], pre_last [bs, P, H], anchors [bs]."""
        from .kernels import topk, transition_walk

        if self.tables is None:
            raise RuntimeError("KernelPath.decode before build_tables")
        bs, npos, vocab = logits.shape
        _, cand = topk(logits.reshape(bs * npos, vocab).contiguous(), top_k)
        cand = cand.view(bs, npos, top_k)
        tokens, choice, scores = transition_walk(pre_last.contiguous(), cand, anchors, self.weights, self.tables,
                                                 codes, head, norm_weight, norm_eps)
        return BlockDraft(tokens=tokens, candidates=cand, scores=scores, choice=choice)
