"""The DSPINE worker: SGLang's DFlashWorkerV2 with DSpine's draft decoding, a verify shape per decode step, and
(where DFlash's worker refuses them) log-probabilities. One class for every configuration.

Draft decoding: everything but the choice of draft tokens is DFlash's (prefill, context K/V, block
preparation, verification, overlap scheduling, CUDA-graph capture). The choice is the drafter's
`DraftStep.decode` (top-K of the backbone logits per block position -> transition scores -> walk). It runs inside
the draft CUDA graph as the graph's tail hook (the slot DFlash uses for its argmax) for every captured batch
size, and eagerly above them; a tree server's tail builds its trees there too (`TreeDraftSampler`).

Verify shapes (verify_shapes.Shape): each decode step verifies one shape for the whole batch.
  - the block (`chainB`): DFlash's own step, called whole: the fixed server's (the default);
  - `chainW`, W < B, and `none` (W = 1: no draft forward): a prefix of the block, on the target's resources at
    that width (verify_widths.py), with DFlash's acceptance rules and context upkeep;
  - `treeN`: a tree of N - 1 nodes over the lattice (tree_verify.py), SGLANG_DSPINE_TREE=1.
A fixed server runs one shape every step; SGLANG_DSPINE_VERIFY=adaptive runs the shape `ShapePolicy` picks, weighing
each step's cost: the larger of its wall time (`StepClock`: launch to the next decode step's launch) and its GPU time
(CUDA events, read with its accept lengths a step or two later, without a sync).
The non-block steps are DFlash's decode step in parts (dflash_step.py: the one place they read DFlash's private
members, checked at start-up).

Log-probabilities: where DFlash's own verify step returns them, the worker leaves them to it. Where DFlash's
worker refuses them up front (SGLang 0.5.17), the worker supplies them: the prefill is the target's own forward,
so the target worker computes them exactly as without speculation; after a verify step they come from the verify
logits the tokens were accepted or sampled from (SGLang's `compute_spec_v2_logprobs`, the function its EAGLE
workers use), with the semantics of SGLang's sampler: log-softmax of the logits after penalties, logit bias and
grammar masks, divided by the request's temperature (before top-k/top-p), or before the temperature with
SGLANG_RETURN_ORIGINAL_LOGPROB. No extra target forward. Both give the user the same numbers.
"""
from __future__ import annotations

import collections
import json
import logging
import time

import torch
from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2

from ..drafter.sharding import VocabShard
from . import dflash_step, sglang_patches
from .tree_verify import (
    TreeDraftSampler,
    accept_tree,
    calibration_rows,
    commit_path,
    mask_cells_bound,
    rows_to_front,
    served_trees,
    tree_verify_inputs,
)
from .verify_shapes import Shape, StepClock

logger = logging.getLogger(__name__)


class _LogprobsHidden:
    """A batch as DFlash's worker code sees it when log-probs were asked for: `return_logprob` reads False, so
    its up-front refusal passes and its verify step builds no log-prob work; every other attribute is the
    batch's own (reads and writes go through). The target worker is handed the batch itself (`_TargetWorker`)."""

    return_logprob = False

    def __init__(self, batch):
        object.__setattr__(self, "_batch", batch)

    def __getattr__(self, name):
        return getattr(self._batch, name)

    def __setattr__(self, name, value):
        setattr(self._batch, name, value)


class _TargetWorker:
    """The target worker, given back the real batch: a prefill asked for log-probs computes them as it would
    without speculation."""

    def __init__(self, worker):
        self._worker = worker

    def __getattr__(self, name):
        return getattr(self._worker, name)

    def forward_batch_generation(self, batch=None, *args, **kwargs):
        if isinstance(batch, _LogprobsHidden):
            batch = batch._batch
        return self._worker.forward_batch_generation(batch, *args, **kwargs)


class DSpineDraftSampler:
    """Capture-safe DSpine decoding with the DFlash sampler's contract: `__call__(hidden, input_ids)` writes
    the bs*(B-1) draft tokens into the static buffer `out`."""

    what = "candidate decoding"

    def __init__(self, step, max_bs: int):
        self.step = step
        b = step.block_size
        self.out = torch.empty(max_bs * (b - 1), dtype=torch.int64, device=step.head.device)

    def __call__(self, hidden_states, input_ids=None):
        tokens = self.step.decode(self.step.rows_after_anchor(hidden_states))
        self.out[: tokens.numel()].copy_(tokens.reshape(-1))

    def walk_rows(self, bs: int) -> torch.Tensor:
        """[bs, B-1] the walk the graph's tail decoded this step."""
        return self.out[: bs * (self.step.block_size - 1)].view(bs, -1)


class DSpineWorker(DFlashWorkerV2):
    """DSPINE's worker (the module docstring says what it adds to DFlash's). Its attributes beside DFlash's:
    `shapes` (the menu), `policy` (None on a fixed server), `tree_rows` (N of a tree server, else None)."""

    _log_every = 200  # adaptive: decisions between the shape-share log lines (benchmarks read them)
    _logprob_batch = None  # the batch asking for log-probs while DFlash's code runs on it (supplied here)
    tree_rows = None
    policy = None
    _upkeep_graphs = None  # the context upkeep's graphs (adaptive, graphs on: context_upkeep.py)

    def __init__(self, server_args, *args, **kwargs):
        from ..drafter.config import DrafterConfig
        from ..env import ENV
        from .verify_shapes import parse_menu
        from .versions import dflash_plans_kv_locs, dflash_returns_logprobs

        self.supplies_logprobs = not dflash_returns_logprobs()
        if ENV.tree:  # 0.5.17 (check_tree has refused it elsewhere), whose record holds the resolved drafter path
            block = DrafterConfig.from_file(server_args.speculative_draft_model_path).block_size
            server_args = self._tree_server_args(server_args, block)
        super().__init__(server_args, *args, **kwargs)
        if ENV.tree and int(self.block_size) != block:
            raise RuntimeError(f"DSPINE: DFlash's worker took block size {self.block_size}, the drafter's is {block}")
        block = int(self.block_size)
        tree = () if self.tree_rows is None else (Shape(self.tree_rows, tree=True),)
        if tree:
            self._calibration = None if self.calibration is None else tuple(
                torch.tensor(v, dtype=torch.float32, device=self.device)
                for v in (self.calibration.temperature, self.calibration.log_mass))
        if ENV.adaptive:  # check_adaptive has refused it where it is not built
            if dflash_plans_kv_locs():
                logger.warning("DSPINE adaptive verification on SGLang 0.5.23 is tested on the CPU only so far: its "
                               "steps narrower than the block follow 0.5.23's DFlash step but have not run on a GPU "
                               "(docs/verify_shapes.md)")
            self.shapes = (*parse_menu(ENV.verify_shapes, block), *tree)
            self._pending: collections.deque = collections.deque()  # steps whose GPU time and acceptance are unread
            self._clock = StepClock()  # each decode step's wall time, half of what the policy weighs
            self._shares: collections.Counter = collections.Counter()  # steps by shape name since start
            self._since_log: collections.Counter = collections.Counter()  # since SGLang's last decode log line
            self._metrics_on = bool(getattr(server_args, "enable_metrics", False))
        else:
            self.shapes = tree or (Shape(block),)

    def _tree_server_args(self, server_args, block: int):
        """SGLANG_DSPINE_TREE=1: each decode step verifies a tree over the lattice of N - 1 nodes, N =
        --speculative-num-draft-tokens. N = B (the drafter's block): sampled requests verify the tree, greedy ones
        their walk. N > B: every request verifies a tree, a greedy request's scored with the drafter's tree
        calibration (drafter/tree_calibration.py).

        N > B: DFlash's code takes its block from --speculative-num-draft-tokens, so it is given a copy of the
        server arguments saying B (its draft worker, block buffers and draft CUDA graphs are the block's); the
        target's verify graphs, SGLang's per-step KV reservation (2 N past the committed length) and the verify
        mask buffer keep N; SGLang is told the draft forward's width through the algorithm (`DSpineAlgo`,
        plugin.py)."""
        import copy

        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        from ..drafter.tree_calibration import TreeCalibration
        from .startup_checks import ALGORITHM

        path = server_args.speculative_draft_model_path
        self.tree_rows = int(server_args.speculative_num_draft_tokens)  # N (check_server_args: N >= B)
        # refused at start without one (check_tree); loaded again here, in the scheduler's process
        self.calibration = TreeCalibration.load(path, block) if self.tree_rows > block else None
        SpeculativeAlgorithm.from_string(ALGORITHM).draft_rows_per_req = block
        if self.tree_rows != block:
            server_args = copy.deepcopy(server_args)
            server_args.override("sglang_dspine.tree_worker", speculative_num_draft_tokens=block)
        return server_args

    def init_attention_backends(self):
        from ..env import ENV

        super().init_attention_backends()
        # the target's backend exists now (SGLang built it just before), its verify graphs are captured next; a
        # tree server's is the tree's (its mask), an adaptive one's chain widths are built later with their own
        from . import verify_widths

        self._split_kv = ENV.split_kv_verify  # None, "all", "below-block" or "grouped" (unset)
        block = int(self.block_size)  # the server's own width (a chain server's)
        if self.tree_rows is None and verify_widths.reads_context_split_kv(self._split_kv, block, block):
            self._split_kv_kernel(self.model_runner.attn_backend)
        elif self.tree_rows is not None and self._split_kv == "grouped":  # the kernel reads the tree's mask
            # (default since the lease at 671b819: a tree32 step 0.80-0.93x the extend kernel's at Qwen3-8B geometry)
            self._split_kv_kernel(self.model_runner.attn_backend, tree=True)
        if self._split_kv and self._split_kv != "grouped":
            logger.info("DSPINE: the target's chain verify passes (%s) read the context with SGLang's split-KV "
                        "kernel", "every width" if self._split_kv == "all" else "those narrower than the block")

    def _split_kv_kernel(self, backend, tree: bool = False):
        """Patch 10 (DSPINE's grouped kernel) under SGLANG_DSPINE_SPLITKV_VERIFY=grouped or unset, else patch 8.
        Says in the log which kernel the backend's verify passes (chains, or with `tree` trees) run."""
        from ..env import ENV

        if self._split_kv != "grouped":
            sglang_patches.split_kv_verify(backend)
            return
        why_not = sglang_patches.grouped_verify(backend, required=ENV.split_kv_verify_set, tree=tree)
        rows = int(backend.num_draft_tokens) if hasattr(backend, "num_draft_tokens") else "?"
        what = "tree" if tree else "chain"
        if why_not is None:
            logger.info("DSPINE: %s verify passes of %s rows read the context with DSPINE's grouped kernel", what,
                        rows)
        else:
            logger.info("DSPINE: %s verify passes of %s rows keep the backend's verify kernel: %s", what, rows,
                        why_not)

    def init_cuda_graphs(self):
        from . import verify_widths
        from .verify_shapes import ShapePolicy

        super().init_cuda_graphs()
        if len(self.shapes) == 1:
            return
        mr, b = self.model_runner, int(self.block_size)
        # the server's own width: the tree's N (its graphs read the tree mask), else the block's
        self._base_width = verify_widths.current(mr, self.tree_rows or b)
        self._widths = {}
        for shape in self.shapes:
            if shape.tree or (shape.rows == b and self.tree_rows is None):
                self._widths[shape] = self._base_width
            else:  # a chain's width, captured without the tree mask even where N = B
                self._widths[shape] = verify_widths.build(mr, shape.rows, self.device, self.gpu_id,
                                                          prepare=self._width_kernels(shape.rows))
        buckets = list(getattr(self._base_width.graph_runner, "capture_bs", None) or [])
        self._upkeep_graphs = self._capture_upkeep(buckets)
        self.policy = ShapePolicy(self.shapes, buckets, b)
        sglang_patches.show_verify_shapes_in_decode_log(self._since_log)
        self._shape_metric = None
        if self._metrics_on:  # SGLang's metrics are prometheus_client's (multiprocess mode): /metrics shows it
            from prometheus_client import Counter

            self._shape_metric = Counter("sglang:dspine_verify_steps", "DSPINE decode steps by the verify shape "
                                         "the adaptive policy chose", labelnames=["shape"])
        gib = sum(w.gib for w in self._widths.values()) + (self._upkeep_graphs.gib if self._upkeep_graphs else 0)
        logger.info("DSPINE adaptive verify: shapes %s, %.2f GiB for the other widths' backends and graphs and the "
                    "context upkeep's graphs, "
                    "batch buckets %s", ", ".join(s.name for s in self.shapes), gib, buckets)

    def _capture_upkeep(self, buckets):
        """The context upkeep's CUDA graphs for the chain widths below the block (context_upkeep.py), at the
        target's captured batch sizes; None with graphs off or SGLANG_DSPINE_UPKEEP_GRAPHS=0."""
        from ..env import ENV
        from .context_upkeep import ContextUpkeepGraphs

        widths = [s.rows for s in self.shapes if not s.tree and s.rows < int(self.block_size)]
        why_not = ("SGLANG_DSPINE_UPKEEP_GRAPHS=0" if not ENV.upkeep_graphs else
                   "no shape narrower than the block" if not widths else
                   "CUDA graphs off" if not buckets or self._base_width.graph_runner is None else None)
        if why_not is not None:
            logger.info("DSPINE: the context upkeep runs DFlash's eager writer (%s)", why_not)
            return None
        fc = self.draft_model.fc  # the projection of the target's features: their width and the writer's dtype
        upkeep = ContextUpkeepGraphs(self, widths, buckets, int(fc.in_features), fc.weight.dtype, self.device)
        upkeep.capture()
        return upkeep

    def _width_kernels(self, rows: int):
        """What a chain width's attention backend gets before its graphs are captured: one row a request (`none`)
        reads its context with SGLang's decode kernel (patch 9) where the backend allows it; otherwise patch 8 or
        10 where SGLANG_DSPINE_SPLITKV_VERIFY asks for it at this width."""
        from . import verify_widths

        split_kv = verify_widths.reads_context_split_kv(self._split_kv, rows, int(self.block_size))

        def prepare(backend):
            if rows == 1:
                why_not = sglang_patches.decode_one_row_verify(backend)
                if why_not is None:
                    logger.info("DSPINE: the none shape's verify pass runs SGLang's decode attention kernel")
                    return
                logger.info("DSPINE: the none shape's verify pass keeps its backend's verify kernel: %s", why_not)
            if split_kv:
                self._split_kv_kernel(backend)

        return prepare

    # ---------------------------------------------------------------------------------------- draft decoding
    def _maybe_build_draft_sampler(self):
        base = super()._maybe_build_draft_sampler()  # DFlash's checks: head present, unquantized, no added vocab
        if base is None:
            logger.info("DSPINE draft decoding kept eager (see the DFLASH reason above)")
            return None
        # DFlash's sampler already holds this rank's head rows and TP group (None on one rank)
        step = self.draft_model.draft_step
        step.attach_head(base.weight[: base.num_org], VocabShard(base.org_vocab_start, base.num_org, base.tp_group))
        max_bs = base.out.numel() // (self.block_size - 1)
        sampler = self._new_draft_sampler(step, max_bs)
        logger.info("DSPINE %s folded into the draft cuda graph (max bs %d, tp %d)", sampler.what, max_bs,
                    step.shard.world)
        return sampler

    def _new_draft_sampler(self, step, max_bs: int):
        """The draft graph's tail: the walk (`DSpineDraftSampler`), or on a tree server its trees."""
        if self.tree_rows is None:
            return DSpineDraftSampler(step, max_bs)
        return TreeDraftSampler(step, max_bs, nodes=self.tree_rows - 1, calibrated=self.calibration is not None,
                                chains_for_greedy=self.tree_rows == step.block_size)

    def _greedy_sample_from_vocab_parallel_head(self, *, hidden_states, lm_head, chunk_size: int = 256):
        """Eager path (above the captured batch sizes, or graphs off): DFlash hands over positions 1..B-1."""
        return self._attached_step(lm_head).decode(hidden_states.contiguous()).reshape(-1)

    def _attached_step(self, lm_head):
        """The draft step, given this rank's rows of the target head `lm_head` (once; a no-op after): where the
        draft graph's tail did not run, which would have been given them when it was built."""
        step = self.draft_model.draft_step
        shard = self._vocab_shard(lm_head)
        step.attach_head(lm_head.weight[: shard.size], shard)
        return step

    @staticmethod
    def _vocab_shard(lm_head) -> VocabShard:
        """This rank's rows of the target head (SGLang's `shard_indices`; the whole head without them), with
        SGLang's TP group (graph-safe collectives) when there are other ranks."""
        from sglang.srt.distributed import get_tp_group

        info = getattr(lm_head, "shard_indices", None)
        if info is None:
            return VocabShard(0, int(lm_head.weight.shape[0]))
        if int(info.num_added_elements):
            raise ValueError("DSPINE: target heads with added vocabulary are not supported")
        group = get_tp_group()
        return VocabShard(int(info.org_vocab_start_index), int(info.num_org_elements),
                          group if group.world_size > 1 else None)

    # ----------------------------------------------------------------------------------------- the step
    @property
    def target_worker(self):
        return self._target_worker if self._logprob_batch is None else _TargetWorker(self._target_worker)

    def forward_batch_generation(self, batch, on_publish=None, grammar_barrier=None):
        if not (self.supplies_logprobs and getattr(batch, "return_logprob", False)):
            return self._step(batch, on_publish, grammar_barrier)
        # DFlash's code runs on a view of the batch that hides `return_logprob` (its up-front refusal passes,
        # its verify builds no log-prob work); the target worker gets the real batch. Decided before DFlash's
        # code runs: its verify step sets the batch's mode to TARGET_VERIFY, which SGLang counts as an extend.
        verify = is_verify_step(batch)
        self._logprob_batch = batch
        try:
            result = self._step(_LogprobsHidden(batch), on_publish, grammar_barrier)
        finally:
            self._logprob_batch = None
        if verify:
            verify_logprobs(batch, result)
        return result

    def _step(self, batch, on_publish, grammar_barrier):
        """A prefill or idle step is DFlash's; a decode step verifies the shape the server runs (fixed) or the
        policy picks (adaptive: timed, its time and accept lengths read back when ready)."""
        if not is_verify_step(batch):
            if self.policy is not None:
                self._clock.interrupt()
            return DFlashWorkerV2.forward_batch_generation(self, batch, on_publish=on_publish,
                                                           grammar_barrier=grammar_barrier)
        if self.policy is None:
            return self._verify_shape(self.shapes[-1], batch, on_publish, grammar_barrier)  # the widest
        launched = time.perf_counter()  # this decode step's launch (StepClock); a fixed server reads no clock
        self._read_finished_steps()
        bs = len(batch.seq_lens)
        shape = self.policy.choose(bs)
        closed = self._clock.start(bs, shape, launched)
        if closed is not None:  # the decode step before this one: its wall time (settled intervals only)
            self.policy.observe(*closed, accepted=None)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        result = self._verify_shape(shape, batch, on_publish, grammar_barrier)
        accepted = torch.empty(bs, dtype=torch.int32, pin_memory=True)
        accepted.copy_(result.accept_lens, non_blocking=True)
        end.record()
        self._pending.append((bs, shape, start, end, accepted))
        self._count(shape)
        return result

    def _verify_shape(self, shape: Shape, batch, on_publish, grammar_barrier):
        if shape.tree:
            return self._tree_step(batch, on_publish, grammar_barrier)
        if shape.rows == int(self.block_size) and self.tree_rows is None:
            return DFlashWorkerV2.forward_batch_generation(self, batch, on_publish=on_publish,
                                                           grammar_barrier=grammar_barrier)
        # a prefix, none, or beside a tree the whole block (DFlash's own step reads the chain sampler's buffer)
        return self._prefix_step(batch, shape.rows, on_publish, grammar_barrier)

    def _read_finished_steps(self) -> None:
        """Feed the policy the acceptance and GPU time of every step whose GPU work has finished (in order; no
        sync). Its wall time comes from `StepClock` when the next decode step launches."""
        while self._pending and self._pending[0][3].query():
            bs, shape, start, end, accepted = self._pending.popleft()
            # commit length = accepted drafts + the bonus token
            self.policy.observe(bs, shape, None, [int(a) - 1 for a in accepted.tolist()],
                                gpu_ms=start.elapsed_time(end))

    def _count(self, shape) -> None:
        self._shares[shape.name] += 1
        self._since_log[shape.name] += 1
        if self._shape_metric is not None:
            self._shape_metric.labels(shape=shape.name).inc()
        if self._shares.total() % self._log_every == 0:
            shares = ", ".join(f"{k} {v}" for k, v in sorted(self._shares.items()))
            logger.info("DSPINE adaptive verify: steps by shape since start: %s; policy %s", shares,
                        json.dumps(self.policy.summary()))

    def _logprobs_asked(self) -> bool:
        """Whether the batch being stepped asked for log-probs that this worker computes after the step."""
        return self._logprob_batch is not None

    # ------------------------------------------------------------------------- a prefix of the block, or none
    def _prefix_step(self, batch, rows: int, on_publish=None, grammar_barrier=None):
        """DFlash's decode step verifying the first `rows` tokens of the block [anchor, walk...]: the drafter drafts
        its whole block (its CUDA graphs are the block's; rows = 1: no draft forward at all), the target verifies
        `rows` on its resources at that width, DFlash's own acceptance rules (greedy, and target-only sampling)
        run on the prefix, and the committed rows' target features go into the draft KV as after any DFlash
        step."""
        from . import verify_widths

        draft_input = dflash_step.draft_input_of(self, batch)
        bs = len(batch.seq_lens)
        host = dflash_step.host_bound(self, batch, draft_input)
        if rows == 1:  # no draft forward: the anchor's slot and position, not the whole block's (one Triton launch)
            candidates, verify_loc_2d, positions, plan = dflash_step.one_row_slots(self, batch, draft_input)
        else:
            slots = dflash_step.block_slots(self, batch, draft_input, rows)
            verify_loc_2d, plan = slots.verify_loc_2d.contiguous(), slots.plan
            positions = slots.positions_2d[:, :rows].reshape(-1)
            candidates = torch.empty((bs, rows), dtype=slots.block_ids.dtype, device=slots.block_ids.device)
            candidates[:, 0].copy_(slots.block_ids[:, 0])
            # 1) the drafter's block, as DFlash's step drafts it; its first rows - 1 tokens kept
            draft_out = dflash_step.draft_forward(self, batch, slots, host)
            sampler = dflash_step.graph_sampler(self, draft_out)
            if sampler is not None:
                walk = sampler.walk_rows(bs)
            else:
                step = self._attached_step(self.target_worker.model_runner.model.lm_head)
                walk = step.decode(step.rows_after_anchor(draft_out.logits_output.hidden_states))
            candidates[:, 1:].copy_(walk[:, : rows - 1])
        grammar_tree = dflash_step.grammar_tree_of_chain(batch, candidates)

        # 2) the target verifies the prefix: rows slots and positions from the committed length on
        with verify_widths.verifying_at(self.model_runner, self._widths[Shape(rows)], self._base_width):
            target_out = dflash_step.verify(self, batch, candidates.reshape(-1), positions, rows, verify_loc_2d, host,
                                            plan=plan)
        logits_output = target_out.logits_output
        dflash_step.adjust_logits(batch, logits_output.next_token_logits, rows, grammar_tree, grammar_barrier)
        # 3) acceptance, then the committed rows into the draft KV (at the slots as the draft pool names them)
        result = self._commit_prefix(candidates, logits_output, batch.sampling_info, draft_input, batch.seq_lens,
                                     dflash_step.draft_write_loc(self, plan, verify_loc_2d), positions,
                                     on_publish=on_publish)
        result.can_run_cuda_graph = target_out.can_run_cuda_graph
        dflash_step.request_outputs(batch, result, draft_input)  # 0.5.23: log-probs, sampling masks
        return result

    def _commit_prefix(self, candidates, logits_output, sampling_info, draft_input, prefix_lens, verify_loc_2d,
                       positions, on_publish=None):
        """A prefix step after its verify pass and logits adjustments: DFlash's acceptance over `candidates`
        [bs, W] (greedy, or target-only sampling), then the committed rows' target features (the verify's hidden
        states) written into the draft KV at their slots `verify_loc_2d` [bs, W] and `positions` [bs·W]: the
        drafter's context keeps up whatever W, W = 1 included. Returns the step's GenerationBatchResult (W tokens
        a request)."""
        if candidates.shape[1] == 1 and not dflash_step.samples(sampling_info):
            # `none`, greedy: the bonus is the target's argmax; 3 kernels where the general rule launches ~11
            commit_lens, out_tokens, bonus = none_outputs(logits_output.next_token_logits)
        else:
            accept_len, bonus = dflash_step.accept_chain(candidates, logits_output.next_token_logits,
                                                         sampling_info, draft_input)
            commit_lens, out_tokens = prefix_outputs(candidates, accept_len, bonus)
        hidden = logits_output.hidden_states
        if hidden is None:
            raise RuntimeError("DSPINE verify: the target returned no hidden states")
        return dflash_step.commit(self, logits_output, hidden=hidden.reshape(-1, hidden.shape[-1]),
                                  loc_2d=verify_loc_2d, positions=positions, commit_lens=commit_lens, bonus=bonus,
                                  prefix_lens=prefix_lens, out_tokens=out_tokens, rows=candidates.shape[1],
                                  on_publish=on_publish)

    # ------------------------------------------------------------------------------------------- a tree
    def _tree_step(self, batch, on_publish=None, grammar_barrier=None):
        """DFlash's decode step with a tree verified instead of the chain: tree_verify.py says what differs and
        why."""
        draft_input = dflash_step.draft_input_of(self, batch)
        bs, b, n, dev = len(batch.seq_lens), int(self.block_size), self.tree_rows, self.device
        prefix_lens = batch.seq_lens
        sampling_info = batch.sampling_info  # greedy: top-k 1 (chains_where, calibration_rows say why it matters)
        greedy = torch.ones(bs, dtype=torch.bool, device=dev) if sampling_info is None or \
            sampling_info.is_all_greedy else sampling_info.top_ks.view(-1) <= 1
        calibration = None if self._calibration is None else calibration_rows(greedy, *self._calibration)
        if self._draft_sampler is not None and bs <= self._draft_sampler.max_bs:  # read by the draft graph's tail
            self._draft_sampler.prepare(prefix_lens, greedy, *(calibration or ()))

        # 1) the draft forward over [anchor, mask...], as DFlash's; the verify's N slots from the committed
        # length on (SGLang reserved 2 N), the draft's the first B of them
        slots = dflash_step.block_slots(self, batch, draft_input, n)
        host = dflash_step.host_bound(self, batch, draft_input)
        draft_out = dflash_step.draft_forward(self, batch, slots, host)
        sampler = dflash_step.graph_sampler(self, draft_out)
        if sampler is not None:
            trees, layout = sampler.drafts(bs)
        else:  # above the captured batch sizes, or graphs off
            step = self._attached_step(self.target_worker.model_runner.model.lm_head)
            # at the block's size greedy requests verify their walk (chains_where says why)
            _, trees = served_trees(step, draft_out.logits_output.hidden_states, n - 1, greedy, n == b,
                                    *(calibration or (None, None)))
            layout = None

        # 2) the target's verify pass over [anchor, nodes...] under the tree mask, N rows a request
        cells = mask_cells_bound(host.seq_lens_cpu, n, getattr(self.target_worker.model_runner.attn_backend,
                                                          "verify_mask", None))
        verify = tree_verify_inputs(trees, slots.block_ids[:, 0], prefix_lens, depth=b - 1, mask_cells=cells,
                                    layout=layout)
        grammar_tree = dflash_step.grammar_tree_of_links(batch, verify.links.next_token, verify.links.next_sibling,
                                                         verify.tokens)
        target_out = dflash_step.verify(self, batch, verify.tokens.reshape(-1), verify.positions, n,
                                        slots.verify_loc_2d, host, custom_mask=verify.custom_mask)
        logits_output = target_out.logits_output
        dflash_step.adjust_logits(batch, logits_output.next_token_logits, n, grammar_tree, grammar_barrier)

        # 3) the walk down the tree; the accepted path to the front of the block: from here on, a chain
        sample = dflash_step.samples(sampling_info)
        acc = accept_tree(verify, logits_output.next_token_logits, sampling_info if sample else None,
                          max_top_k=draft_input.max_top_k, uniform_top_k_value=draft_input.uniform_top_k_value)
        result = self._commit_tree_path(
            verify, acc, logits_output, loc_2d=slots.verify_loc_2d, positions=slots.positions_2d.reshape(-1),
            prefix_lens=prefix_lens, req_to_token=self.model_runner.req_to_token_pool.req_to_token,
            req_pool_indices=batch.req_pool_indices, logprobs=batch.return_logprob or self._logprobs_asked(),
            on_publish=on_publish)
        result.can_run_cuda_graph = target_out.can_run_cuda_graph
        return result

    def _commit_tree_path(self, verify, acc, logits_output, *, loc_2d, positions, prefix_lens, req_to_token,
                          req_pool_indices, logprobs: bool, on_publish=None):
        """A tree step after its acceptance: the accepted path brought to the front of each request's N verify
        slots `loc_2d` [bs, N] (its KV slots in `req_to_token`, its hidden states, with `logprobs` its logits),
        then DFlash's chain tail (`dflash_step.commit`): the draft K/V of the committed rows (at most B: the path
        is at most B - 1 deep) at the chain's `positions` [bs·B], the next step's anchors and lengths. Returns
        the step's GenerationBatchResult, N tokens a request."""
        rows, front = commit_path(verify, acc, loc_2d, req_to_token, req_pool_indices, prefix_lens,
                                  kernels=self.draft_model.draft_step.kernels)  # decided once, at load
        if logprobs:  # log-probs read rows n·N + j; the logits are [bs·N, V]: moved only then
            logits_output.next_token_logits = rows_to_front(logits_output.next_token_logits, rows.order)
        hidden = logits_output.hidden_states
        if hidden is None:
            raise RuntimeError("DSPINE tree verify: the target returned no hidden states")
        b = int(self.block_size)
        return dflash_step.commit(self, logits_output, hidden=rows_to_front(hidden, rows.order[:, :b], verify.rows),
                                  loc_2d=front[:, :b].contiguous(), positions=positions,
                                  commit_lens=rows.commit_lens, bonus=acc.bonus, prefix_lens=prefix_lens,
                                  out_tokens=rows.out_tokens, rows=verify.rows, on_publish=on_publish)


def is_verify_step(batch) -> bool:
    """Whether DFlash's worker will run a draft + verify step on `batch` (not a prefill, not an idle batch)."""
    return not (batch.forward_mode.is_extend() or batch.is_extend_in_batch or batch.forward_mode.is_idle())


def verify_logprobs(batch, result) -> None:
    """Log-probs of every token a verify step emits, from its logits, into `result.logits_output`.

    With W = the step's verify rows per request (`result.speculative_num_draft_tokens`: the block, a prefix of
    it, or a tree's N), row n·W + j of the verify logits is the target's distribution for request n's j-th
    emitted token (the accepted draft tokens, then the bonus token: DFlash's linear chain, or a tree step's path
    brought to the front), and `result.next_token_ids` holds those tokens at n·W + j; entries past a request's
    accept length are computed and not read."""
    from sglang.srt.layers.logprob_processor import compute_spec_v2_logprobs

    out, width = result.logits_output, int(result.speculative_num_draft_tokens)
    bs = out.next_token_logits.shape[0] // width
    rows = torch.arange(bs * width, device=out.next_token_logits.device).view(bs, width)
    compute_spec_v2_logprobs(batch, out, result.next_token_ids.view(-1), rows, width - 1)


def prefix_outputs(candidates: torch.Tensor, accept_len: torch.Tensor, bonus: torch.Tensor):
    """(commit lengths [bs] int32, emitted tokens [bs, W]) of a chain step over `candidates` [bs, W] (the anchor,
    then W - 1 drafts) with `accept_len` [bs] drafts accepted and the `bonus` [bs] token: row n emits its first
    accept_len drafts, then the bonus; the entries after it are never read (0)."""
    rows = candidates.shape[1]
    out = torch.zeros_like(candidates)
    if rows > 1:
        out[:, : rows - 1].copy_(candidates[:, 1:])
    out.scatter_(1, accept_len.to(torch.int64)[:, None], bonus.to(out.dtype)[:, None])
    return accept_len.to(torch.int32) + 1, out


def none_outputs(logits: torch.Tensor):
    """(commit lengths [bs] int32, emitted tokens [bs, 1], bonus [bs]) of a greedy `none` step from its verify
    logits [bs, V]: what DFlash's greedy rule and `prefix_outputs` give at W = 1 (no drafts: the bonus, the
    target's argmax, alone), without their kernels for the empty draft part."""
    bonus = torch.argmax(logits, dim=-1)
    return torch.ones_like(bonus, dtype=torch.int32), bonus.view(-1, 1), bonus
