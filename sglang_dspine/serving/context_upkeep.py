"""The drafter's context upkeep after a prefix step (`none`, `chainW`), replayed from CUDA graphs.

After a step that verified W rows a request, each request's committed rows' target features go into the draft
KV at their slots (DFlash's `_append_target_hidden_to_draft_kv_by_loc`: the features' projection, every draft
layer's K/V with its norm and RoPE, the prefix-valid writes). Eager, that is ~10 kernels launched one at a time
and their Python every step. At Qwen3-8B geometry (H200, 981bdc8, benchmarks/results/profile_h200_981bdc8.json)
it was most of the ~100-120 us of GPU work and launch gaps a `none` step has beyond plain decoding's; on the
small pair, whose steps are host-bound, its Python was among the step's largest parts.

`ContextUpkeepGraphs` captures that writer (on DFlash's per-layer path: the same K/V, and no workspace shared
with eager calls) once per (width W, batch bucket) over static buffers. A step copies its features, slots,
positions and commit lengths in and replays; a bucket's padded requests commit 0 rows, so the writer writes
nothing for them. Batches above the largest bucket, or widths not captured, run the writer eagerly, as SGLang
runs a batch above its largest captured size.
"""
from __future__ import annotations

import logging
import time

import torch

from . import dflash_step

logger = logging.getLogger(__name__)


class ContextUpkeepGraphs:
    """The context writer of `worker` (a DSpineWorker) for verify widths `widths` and batch buckets `buckets`.
    `capture()` records a CUDA graph per (width, bucket); on a CPU (tests) a replay runs the same body eagerly
    over the same padded buffers."""

    def __init__(self, worker, widths, buckets, feature_dim: int, dtype: torch.dtype, device):
        self.worker = worker
        self.widths = tuple(sorted(set(int(w) for w in widths)))
        self.buckets = tuple(sorted(set(int(b) for b in buckets)))
        if not self.widths or not self.buckets or min(self.widths) < 1 or min(self.buckets) < 1:
            raise ValueError(f"context upkeep graphs need widths and buckets >= 1, got {widths}, {buckets}")
        rows = max(self.widths) * max(self.buckets)
        # zeros: a padded row's position and slot are always valid ones (a real row's, or 0), never written.
        # Normal tensors, not inference ones: SGLang's event loop may run without inference mode
        # (DynamicGradMode), where an inference tensor refuses in-place writes.
        with torch.inference_mode(False):
            self.hidden = torch.zeros(rows, feature_dim, dtype=dtype, device=device)
            self.loc = torch.zeros(rows, dtype=torch.int64, device=device)
            self.positions = torch.zeros(rows, dtype=torch.int64, device=device)
            self.commit_lens = torch.zeros(max(self.buckets), dtype=torch.int32, device=device)
        self._replays: dict[tuple[int, int], object] = {}
        self.gib = 0.0

    def bucket(self, bs: int) -> int | None:
        """The smallest bucket that holds `bs` requests (None: above them all)."""
        return next((b for b in self.buckets if b >= bs), None)

    def _body(self, rows: int, bucket: int) -> None:
        n = rows * bucket
        dflash_step.write_context(self.worker, hidden=self.hidden[:n], loc_2d=self.loc[:n].view(bucket, rows),
                                  positions=self.positions[:n], commit_lens=self.commit_lens[:bucket])

    def capture(self) -> None:
        """A graph per (width, bucket), largest first, all in one memory pool, of DFlash's writer on its per-layer
        path (`dflash_step.per_layer_writer`: its fused path's workspace is reallocated by larger calls). One
        eager call on the server's own path first (it extends the RoPE cache that path needs, as the first
        prefill would), and each graph warmed up eagerly before its capture. Every warm-up writes nothing: the
        buffers' commit lengths are 0. On a CPU: the eager body instead."""
        if self.hidden.device.type != "cuda":
            self._replays = {(w, b): (lambda w=w, b=b: self._body(w, b)) for w in self.widths for b in self.buckets}
            return
        device = self.hidden.device
        tic, free = time.perf_counter(), torch.cuda.mem_get_info(device)[0]
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        try:
            with torch.cuda.stream(stream):
                self._body(max(self.widths), max(self.buckets))
                with dflash_step.per_layer_writer(self.worker):
                    for w in sorted(self.widths, reverse=True):
                        for b in sorted(self.buckets, reverse=True):
                            self._body(w, b)
                            stream.synchronize()
                            graph = torch.cuda.CUDAGraph()
                            with torch.cuda.graph(graph, pool=pool, stream=stream):
                                self._body(w, b)
                            self._replays[(w, b)] = graph.replay
        except Exception as e:
            raise RuntimeError(f"DSPINE: capturing the context upkeep's CUDA graphs failed ({e}); "
                               "SGLANG_DSPINE_UPKEEP_GRAPHS=0 runs DFlash's eager writer instead") from e
        torch.cuda.current_stream(device).wait_stream(stream)
        self.gib = (free - torch.cuda.mem_get_info(device)[0]) / 2**30
        logger.info("DSPINE context upkeep graphs: widths %s x batch buckets %s, %.3f GiB, %.1f s",
                    list(self.widths), list(self.buckets), self.gib, time.perf_counter() - tic)

    def write(self, *, hidden: torch.Tensor, loc_2d: torch.Tensor, positions: torch.Tensor,
              commit_lens: torch.Tensor) -> bool:
        """`dflash_step.write_context`'s effect for `hidden` [bs·W, F], `loc_2d` [bs, W], `positions` [bs·W],
        `commit_lens` [bs], by a replay. False (nothing done): no graph for this width and batch."""
        bs, rows = loc_2d.shape
        bucket = self.bucket(bs)
        replay = self._replays.get((rows, bucket)) if bucket is not None else None
        if replay is None:
            return False
        n = bs * rows
        self.hidden[:n].copy_(hidden)
        self.loc[:n].copy_(loc_2d.reshape(-1))
        self.positions[:n].copy_(positions.reshape(-1))
        self.commit_lens[:bs].copy_(commit_lens)
        if bucket > bs:
            self.commit_lens[bs:bucket].zero_()  # padded requests write nothing
        replay()
        return True
