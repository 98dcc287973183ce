"""The target's verify resources at other widths than the server's: SGLang's own EAGLE-adaptive machinery
(`EAGLEWorkerV2.build_adaptive_runtime_state` / `apply_runtime_state`, SGLang 0.5.17) applied to DFlash's target.

A verify pass of W rows a request needs an attention backend planned for W and TARGET_VERIFY CUDA graphs
captured at W for every captured batch size. SGLang builds both from the published configuration's
`speculative_num_draft_tokens`; EAGLE's adaptive worker builds extra ones by overriding that value while it
constructs them, then swaps `model_runner.attn_backend` / `decode_cuda_graph_runner` per step. So do we: this
module is the one place DSPINE's adaptive verification touches those SGLang names (checked by
`check_verify_width_hooks` at start).
"""
from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass

logger = logging.getLogger(__name__)


_building_chain = False  # while a chain width's graphs are captured (sglang_patches' patch 6 reads it)


def building_chain_graphs() -> bool:
    """Whether the verify graphs being captured now are a chain width's (captured without a tree's mask)."""
    return _building_chain


def reads_context_split_kv(mode: str | None, rows: int, block: int) -> bool:
    """Whether a chain verify pass of `rows` rows a request runs SGLang's split-KV kernel (patch 8) under
    SGLANG_DSPINE_SPLITKV_VERIFY's `mode` (env.ENV.split_kv_verify): every chain ("all", or "grouped" on DSPINE's
    kernel, patch 10), or the shapes narrower than the `block` ("below-block": at Qwen3-8B geometry on an H100
    SGLang's kernel made `none` 0.83x / 0.48x the extend kernel's step at 1 / 48 requests and the block 1.29x /
    1.11x, docs/results.md)."""
    return mode in ("all", "grouped") or (mode == "below-block" and rows < block)


@dataclass
class VerifyWidth:
    rows: int
    attn_backend: object
    graph_runner: object | None  # None: graphs off (eager verify)
    gib: float  # GPU memory its backend and graphs took


def check_verify_width_hooks() -> str | None:
    """Why this SGLang cannot build verify resources at other widths (None: it can)."""
    try:
        from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner
        from sglang.srt.runtime_context import get_context  # noqa: F401
    except ImportError as e:
        return f"SGLang lacks what adaptive verification builds on ({e})"
    import inspect

    params = inspect.signature(DecodeCudaGraphRunner.__init__).parameters
    if "speculative_num_draft_tokens" not in params or "attn_backend" not in params:
        return "SGLang's DecodeCudaGraphRunner takes no per-width attn_backend / speculative_num_draft_tokens"
    return None


def build(model_runner, rows: int, device, gpu_id: int, prepare=None) -> VerifyWidth:
    """The target's attention backend and verify CUDA graphs at `rows` rows a request; `prepare(backend)`, where
    given, runs on the new backend before its graphs are captured (the worker's patch 8)."""
    from sglang.srt.model_executor.cuda_graph_config import Backend, Phase, check_cuda_graph_backend
    from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner
    from sglang.srt.runtime_context import get_context, get_spec
    from sglang.srt.utils import get_available_gpu_memory

    global _building_chain
    tic, before = time.perf_counter(), get_available_gpu_memory(device, gpu_id)
    saved = get_spec().speculative_num_draft_tokens
    get_context().override("sglang_dspine.verify_width", speculative_num_draft_tokens=rows)
    init_new_workspace = model_runner.init_new_workspace
    try:
        backend = model_runner._get_attention_backend(init_new_workspace=True)
        if prepare is not None:
            prepare(backend)
        runner = None
        if not check_cuda_graph_backend(Phase.DECODE, Backend.DISABLED):
            _building_chain = True  # every width built here is a chain's: no tree mask in its graphs
            runner = DecodeCudaGraphRunner(model_runner, attn_backend=backend, speculative_num_draft_tokens=rows)
    finally:
        _building_chain = False
        model_runner.init_new_workspace = init_new_workspace
        get_context().override("sglang_dspine.verify_width", speculative_num_draft_tokens=saved)
    gib = before - get_available_gpu_memory(device, gpu_id)
    logger.info("DSPINE verify width %d built: %.2f GiB, %.1f s (attention backend%s)", rows, gib,
                time.perf_counter() - tic, " and CUDA graphs" if runner is not None else ", graphs off")
    return VerifyWidth(rows, backend, runner, gib)


def current(model_runner, rows: int) -> VerifyWidth:
    """What the target was built with (the server's width)."""
    return VerifyWidth(rows, model_runner.attn_backend, model_runner.decode_cuda_graph_runner, 0.0)


@contextlib.contextmanager
def verifying_at(model_runner, width: VerifyWidth, base: VerifyWidth):
    """The target's verify pass runs on `width`'s resources inside; everything else (prefill, the next step's
    default) on the server's own."""
    if width is base:
        yield
        return
    model_runner.attn_backend, model_runner.decode_cuda_graph_runner = width.attn_backend, width.graph_runner
    try:
        yield
    finally:
        model_runner.attn_backend, model_runner.decode_cuda_graph_runner = base.attn_backend, base.graph_runner
