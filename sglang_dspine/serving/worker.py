"""The DSPINE worker: SGLang's DFlashWorkerV2 with DSpine's draft decoding (and, where DFlash's worker refuses
them, log-probabilities).

Everything but the choice of draft tokens is DFlash's (prefill, context K/V, block preparation,
verification, overlap scheduling, CUDA-graph capture). The choice is the drafter's `DraftStep.decode`
(top-K of the backbone logits per block position -> transition scores -> walk). It runs inside the draft
CUDA graph as the graph's tail hook (the slot DFlash uses for its argmax) for every captured batch size,
and eagerly above them.

Log-probabilities: where DFlash's own verify step returns them, `DSpineWorker` leaves them to it. Where
DFlash's worker refuses them up front, `DSpineLogprobWorker` supplies them (the plugin picks the class):
the prefill is the target's own forward, so the target worker computes them exactly as without speculation;
after a verify step they come from the verify logits the tokens were accepted or sampled from (SGLang's
`compute_spec_v2_logprobs`, the function its EAGLE workers use), with the semantics of SGLang's sampler:
log-softmax of the logits after penalties, logit bias and grammar masks, divided by the request's
temperature (before top-k/top-p), or before the temperature with SGLANG_RETURN_ORIGINAL_LOGPROB. No extra
target forward. Both give the user the same numbers.
"""
from __future__ import annotations

import collections
import json
import logging
from typing import NamedTuple

import torch
from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2

from ..drafter.sharding import VocabShard
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


class DSpineWorker(DFlashWorkerV2):
    draft_sampler = DSpineDraftSampler  # the draft graph's tail (DSpineTreeWorker: TreeDraftSampler)

    def _maybe_build_draft_sampler(self):
        base = super()._maybe_build_draft_sampler()  # DFlash's checks: head present, unquantized, no added vocab
        if base is None:
            logger.info("DSPINE draft decoding kept eager (see the DFLASH reason above)")
            return None
        # DFlash's sampler already holds this rank's head rows and TP group (None on one rank)
        step = self.draft_model.draft_step
        step.attach_head(base.weight[: base.num_org], VocabShard(base.org_vocab_start, base.num_org, base.tp_group))
        max_bs = base.out.numel() // (self.block_size - 1)
        logger.info("DSPINE %s folded into the draft cuda graph (max bs %d, tp %d)", self.draft_sampler.what, max_bs,
                    step.shard.world)
        return self._new_draft_sampler(step, max_bs)

    def _new_draft_sampler(self, step, max_bs: int):
        return self.draft_sampler(step, max_bs)

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


class HostBound(NamedTuple):
    seq_lens_cpu: torch.Tensor  # [bs] int32, the draft step's buffer
    seq_lens_sum: int
    bounded: bool  # False: the committed lengths themselves (no host lengths, no reservation)


def host_bound(worker, batch, draft_input) -> HostBound:
    """A DFlash worker's host bound on the committed lengths for a step's draft and verify, as DFlash's
    non-windowed path makes it: the host's lengths (one step behind under overlap) + one block, else the reserved
    lengths, else the lengths themselves (then not a bound: the verify keeps the batch's own)."""
    bs, b = len(batch.seq_lens), int(worker.block_size)
    seq_lens_cpu, bounded = worker._draft_seq_lens_cpu_buf[:bs], True
    if batch.seq_lens_cpu is not None:
        seq_lens_cpu.copy_(batch.seq_lens_cpu)
        seq_lens_cpu.add_(b)
    elif draft_input.reserved_seq_lens_cpu is not None:
        seq_lens_cpu.copy_(draft_input.reserved_seq_lens_cpu)
    else:
        seq_lens_cpu.copy_(batch.seq_lens.to("cpu", dtype=torch.int32))
        bounded = False
    return HostBound(seq_lens_cpu, int(seq_lens_cpu.sum()), bounded)

def draft_forward(worker, batch, block_ids, positions, loc, host: HostBound):
    """The drafter's forward over each request's block [anchor, mask...] (`block_ids` [bs, B]) at `positions`
    and KV slots `loc` [bs·B], as DFlash's step runs it (its draft CUDA graphs, the sampler as their tail)."""
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    embed = worker.target_worker.model_runner.model.get_input_embeddings()(block_ids)
    draft_batch = ForwardBatch(
        forward_mode=ForwardMode.TARGET_VERIFY, batch_size=block_ids.shape[0], input_ids=block_ids.flatten(),
        req_pool_indices=batch.req_pool_indices, seq_lens=batch.seq_lens, out_cache_loc=loc,
        seq_lens_sum=host.seq_lens_sum, seq_lens_cpu=host.seq_lens_cpu, positions=positions,
        input_embeds=embed.view(-1, embed.shape[-1]), spec_algorithm=SpeculativeAlgorithm.DFLASH,
        spec_info=worker._draft_block_spec_info, capture_hidden_mode=CaptureHiddenMode.NULL)
    with torch.inference_mode():
        return worker.draft_model_runner.forward(draft_batch)

def prepare_verify(worker, verify_input, batch, host: HostBound):
    """SGLang's verify forward batch for `verify_input`, planned on the step's host bound where it is one (a
    copy: the buffer is the next step's); the batch's own lengths are back afterwards."""
    backup = batch.seq_lens_cpu, batch.seq_lens_sum
    if host.bounded:
        batch.seq_lens_cpu, batch.seq_lens_sum = host.seq_lens_cpu.clone(), host.seq_lens_sum
    try:
        return verify_input.prepare_for_verify(batch, worker.target_worker)[0]
    finally:
        batch.seq_lens_cpu, batch.seq_lens_sum = backup


class DSpineLogprobWorker(DSpineWorker):
    """DSPINE on an SGLang whose DFlash worker refuses log-prob requests: DFlash's code runs on a view of the
    batch that hides `return_logprob`, the target worker gets the real batch, and the verify step's log-probs
    are computed here."""

    _logprob_batch = None  # the batch asking for log-probs while DFlash's code runs on it

    @property
    def target_worker(self):
        return self._target_worker if self._logprob_batch is None else _TargetWorker(self._target_worker)

    def forward_batch_generation(self, batch, on_publish=None, grammar_barrier=None):
        if not getattr(batch, "return_logprob", False):
            return super().forward_batch_generation(batch, on_publish=on_publish, grammar_barrier=grammar_barrier)
        # Decided before DFlash's code runs: its verify step sets the batch's mode to TARGET_VERIFY, which
        # SGLang counts as an extend mode.
        verify = is_verify_step(batch)
        self._logprob_batch = batch
        try:
            result = super().forward_batch_generation(_LogprobsHidden(batch), on_publish=on_publish,
                                                      grammar_barrier=grammar_barrier)
        finally:
            self._logprob_batch = None
        if verify:
            verify_logprobs(batch, result)
        return result


def is_verify_step(batch) -> bool:
    """Whether DFlash's worker will run a draft + verify step on `batch` (not a prefill, not an idle batch)."""
    return not (batch.forward_mode.is_extend() or batch.is_extend_in_batch or batch.forward_mode.is_idle())


def verify_logprobs(batch, result) -> None:
    """Log-probs of every token a verify step emits, from its logits, into `result.logits_output`.

    With W = the step's verify rows per request (`result.speculative_num_draft_tokens`: the block, or a tree's
    N), row n·W + j of the verify logits is the target's distribution for request n's j-th emitted token (the
    accepted draft tokens, then the bonus token: DFlash's linear chain, or a tree step's path brought to the
    front), and `result.next_token_ids` holds those tokens at n·W + j; entries past a request's accept length
    are computed and not read."""
    from sglang.srt.layers.logprob_processor import compute_spec_v2_logprobs

    out, width = result.logits_output, int(result.speculative_num_draft_tokens)
    bs = out.next_token_logits.shape[0] // width
    rows = torch.arange(bs * width, device=out.next_token_logits.device).view(bs, width)
    compute_spec_v2_logprobs(batch, out, result.next_token_ids.view(-1), rows, width - 1)


class DSpineTreeWorker(DSpineWorker):
    """SGLANG_DSPINE_TREE=1 (SGLang 0.5.17): each decode step verifies a tree over the lattice of N - 1 nodes, N =
    --speculative-num-draft-tokens (tree_verify.py); prefill and idle steps are DFlash's. N = B (the drafter's
    block): sampled requests verify the tree, greedy ones their walk. N > B: every request verifies a tree,
    a greedy request's scored with the drafter's tree calibration (drafter/tree_calibration.py).

    N > B: DFlash's code takes its block from --speculative-num-draft-tokens, so it is given a copy of the server
    arguments saying B (its draft worker, block buffers and draft CUDA graphs are the block's); the target's
    verify graphs, SGLang's per-step KV reservation (2 N past the committed length) and the verify mask buffer
    keep N; SGLang is told the draft forward's width through the algorithm (`DSpineAlgo`, plugin.py)."""

    draft_sampler = TreeDraftSampler

    def __init__(self, server_args, *args, **kwargs):
        import copy

        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        from ..drafter.config import DrafterConfig
        from ..drafter.tree_calibration import TreeCalibration
        from .startup_checks import ALGORITHM

        path = server_args.speculative_draft_model_path
        block = DrafterConfig.from_file(path).block_size
        self.verify_rows = int(server_args.speculative_num_draft_tokens)  # N (check_server_args: N >= B)
        # refused at start without one (check_tree); loaded again here, in the scheduler's process
        self.calibration = TreeCalibration.load(path, block) if self.verify_rows > block else None
        SpeculativeAlgorithm.from_string(ALGORITHM).draft_rows_per_req = block
        if self.verify_rows != block:
            server_args = copy.deepcopy(server_args)
            server_args.override("sglang_dspine.tree_worker", speculative_num_draft_tokens=block)
        super().__init__(server_args, *args, **kwargs)
        if int(self.block_size) != block:
            raise RuntimeError(f"DSPINE tree verify: DFlash's worker took block size {self.block_size}, the "
                               f"drafter's is {block}")
        self._calibration = None if self.calibration is None else tuple(
            torch.tensor(v, dtype=torch.float32, device=self.device)
            for v in (self.calibration.temperature, self.calibration.log_mass))

    def _new_draft_sampler(self, step, max_bs: int):
        return self.draft_sampler(step, max_bs, nodes=self.verify_rows - 1, calibrated=self.calibration is not None,
                                  chains_for_greedy=self.verify_rows == step.block_size)

    def forward_batch_generation(self, batch, on_publish=None, grammar_barrier=None):
        if is_verify_step(batch):
            return self._forward_tree_decode(batch, on_publish=on_publish, grammar_barrier=grammar_barrier)
        return super().forward_batch_generation(batch, on_publish=on_publish, grammar_barrier=grammar_barrier)

    def _forward_tree_decode(self, batch, on_publish=None, grammar_barrier=None):
        """DFlash's decode step (SGLang 0.5.17's `DFlashWorkerV2.forward_batch_generation`, its eager block
        preparation) with a tree verified instead of the chain: tree_verify.py says what differs and why."""
        from sglang.kernels.ops.speculative.cache_locs import assign_extend_cache_locs_func
        from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
        from sglang.srt.speculative.dflash_info import DFlashVerifyInput
        from sglang.srt.speculative.dflash_info_v2 import DFlashDraftInputV2
        from sglang.srt.speculative.dflash_utils import (
            apply_dflash_verify_logits_adjustments,
            is_dflash_sampling_verify_available,
        )
        from sglang.srt.speculative.spec_utils import GrammarTree, build_grammar_vocab_mask

        if self.use_compact_draft_cache or self._need_mamba_verify_commit:  # refused at start (check_tree)
            raise RuntimeError("DSPINE tree verify: a draft sliding window or a hybrid (mamba) target is not built")
        self._validate_phase1_sampling_support(batch)
        draft_input = batch.spec_info
        if not isinstance(draft_input, DFlashDraftInputV2):
            raise RuntimeError(f"DSPINE tree verify: expected DFlashDraftInputV2 on the batch, found {draft_input!r}")
        batch.seq_lens.record_stream(torch.get_device_module(self.device).current_stream())
        bs, b, n, dev = len(batch.seq_lens), int(self.block_size), self.verify_rows, self.device
        req_to_token = self.model_runner.req_to_token_pool.req_to_token
        prefix_lens = batch.seq_lens
        sampling_info = batch.sampling_info  # greedy: top-k 1 (chains_where, calibration_rows say why it matters)
        greedy = torch.ones(bs, dtype=torch.bool, device=dev) if sampling_info is None or \
            sampling_info.is_all_greedy else sampling_info.top_ks.view(-1) <= 1
        calibration = None if self._calibration is None else calibration_rows(greedy, *self._calibration)
        if self._draft_sampler is not None and bs <= self._draft_sampler.max_bs:  # read by the draft graph's tail
            self._draft_sampler.prepare(prefix_lens, greedy, *(calibration or ()))

        # 1) the draft forward over [anchor, mask...], as DFlash's (eager block preparation); the verify's N
        # slots from the committed length on (SGLang reserved 2 N), the draft's the first B of them
        self._ensure_draft_block_buffers(bs)
        block_ids, positions_2d = self._draft_block_ids_buf[:bs], self._draft_block_positions_buf[:bs]
        loc_2d = self._draft_verify_out_cache_loc_buf[:bs]
        if n == b and self._use_triton_prepare_block:  # the chain's width: DFlash's one-kernel preparation
            from sglang.kernels.ops.speculative.dflash import _prepare_dflash_draft_block_unchecked

            _prepare_dflash_draft_block_unchecked(
                bonus_tokens=draft_input.bonus_tokens.view(-1), prefix_lens=prefix_lens.view(-1),
                req_pool_indices=batch.req_pool_indices.view(-1), req_to_token=req_to_token, block_ids_out=block_ids,
                positions_out=positions_2d, cache_loc_out=loc_2d, mask_token_id=int(self._mask_token_id))
            verify_loc_2d = loc_2d
        else:
            block_ids.fill_(int(self._mask_token_id))
            block_ids[:, 0].copy_(draft_input.bonus_tokens)
            torch.add(prefix_lens.unsqueeze(1), self._block_pos_offsets, out=positions_2d)
            verify_loc_2d = assign_extend_cache_locs_func(
                req_pool_indices=batch.req_pool_indices, req_to_token=req_to_token, start_offset=prefix_lens,
                end_offset=prefix_lens + n, batch_size=bs, draft_token_num=n, device=dev).view(bs, n)
            loc_2d.copy_(verify_loc_2d[:, :b])
        positions, loc = positions_2d.reshape(-1), loc_2d.reshape(-1)
        host = host_bound(self, batch, draft_input)
        draft_out = draft_forward(self, batch, block_ids, positions, loc, host)
        if self._draft_sampler is not None and draft_out.can_run_graph:
            trees, layout = self._draft_sampler.drafts(bs)
        else:  # above the captured batch sizes, or graphs off
            step = self._attached_step(self.target_worker.model_runner.model.lm_head)
            # at the block's size greedy requests verify their walk (chains_where says why)
            trees = served_trees(step, draft_out.logits_output.hidden_states, n - 1, greedy, n == b,
                                 *(calibration or (None, None)))
            layout = None

        # 2) the target's verify pass over [anchor, nodes...] under the tree mask, N rows a request
        cells = mask_cells_bound(host.seq_lens_cpu, n, getattr(self.target_worker.model_runner.attn_backend,
                                                          "verify_mask", None))
        verify = tree_verify_inputs(trees, block_ids[:, 0], prefix_lens, depth=b - 1, mask_cells=cells,
                                    layout=layout)
        grammar_tree = GrammarTree.from_device(verify.links.next_token, verify.links.next_sibling, verify.tokens) \
            if batch.has_grammar else None
        verify_input = DFlashVerifyInput(draft_token=verify.tokens.reshape(-1), positions=verify.positions,
                                         draft_token_num=n, custom_mask=verify.custom_mask,
                                         capture_hidden_mode=CaptureHiddenMode.FULL)
        batch.out_cache_loc = verify_loc_2d.reshape(-1)
        verify_batch = prepare_verify(self, verify_input, batch, host)
        target_out = self.target_worker.forward_batch_generation(batch=None, forward_batch=verify_batch,
                                                                 is_verify=True, skip_attn_backend_init=True)
        logits_output = target_out.logits_output
        grammar_mask = build_grammar_vocab_mask(reqs=batch.reqs, tree=grammar_tree, sampling_info=sampling_info,
                                                device=logits_output.next_token_logits.device,
                                                barrier=grammar_barrier) if batch.has_grammar else None
        if sampling_info is not None:
            apply_dflash_verify_logits_adjustments(next_token_logits=logits_output.next_token_logits,
                                                   sampling_info=sampling_info, draft_token_num=n)
        if grammar_mask is not None:
            grammar_mask.apply(logits_output.next_token_logits)

        # 3) the walk down the tree; the accepted path to the front of the block: from here on, a chain
        sample = sampling_info is not None and not sampling_info.is_all_greedy and is_dflash_sampling_verify_available()
        acc = accept_tree(verify, logits_output.next_token_logits, sampling_info if sample else None,
                          max_top_k=draft_input.max_top_k, uniform_top_k_value=draft_input.uniform_top_k_value)
        result = self._commit_tree_path(
            verify, acc, logits_output, loc_2d=verify_loc_2d, positions=positions, prefix_lens=prefix_lens,
            req_to_token=req_to_token, req_pool_indices=batch.req_pool_indices,
            logprobs=batch.return_logprob or self._logprobs_asked(), on_publish=on_publish)
        result.can_run_cuda_graph = target_out.can_run_cuda_graph
        return result

    def _commit_tree_path(self, verify, acc, logits_output, *, loc_2d, positions, prefix_lens, req_to_token,
                          req_pool_indices, logprobs: bool, on_publish=None):
        """A tree step after its acceptance: the accepted path brought to the front of each request's N verify
        slots `loc_2d` [bs, N] (its KV slots in `req_to_token`, its hidden states, with `logprobs` its logits),
        then DFlash's chain tail: the draft K/V of the committed rows (at most B: the path is at most B - 1 deep)
        at the chain's `positions` [bs·B], the next step's anchors and lengths. Returns the step's
        GenerationBatchResult, N tokens a request (`can_run_cuda_graph` False: the caller sets what its verify
        pass did)."""
        from sglang.srt.managers.scheduler import GenerationBatchResult

        rows, front = commit_path(verify, acc, loc_2d, req_to_token, req_pool_indices, prefix_lens,
                                  kernels=self.draft_model.draft_step.kernels)  # decided once, at load
        if logprobs:  # log-probs read rows n·N + j; the logits are [bs·N, V]: moved only then
            logits_output.next_token_logits = rows_to_front(logits_output.next_token_logits, rows.order)
        new_seq_lens = prefix_lens + rows.commit_lens.to(prefix_lens.dtype)
        if on_publish is not None:
            on_publish(new_seq_lens)
        hidden = logits_output.hidden_states
        if hidden is None:
            raise RuntimeError("DSPINE tree verify: the target returned no hidden states")
        b = int(self.block_size)
        front = front[:, :b].contiguous()
        self._append_target_hidden_to_draft_kv_by_loc(
            target_hidden=rows_to_front(hidden, rows.order[:, :b], verify.rows), cache_loc=front.reshape(-1),
            cache_loc_2d=front, positions=positions, commit_lens=rows.commit_lens)
        logits_output.hidden_states = None
        next_draft_input = self._make_next_draft_input_decode(bonus_tokens=acc.bonus, new_seq_lens=new_seq_lens)
        return GenerationBatchResult(
            logits_output=logits_output, next_token_ids=rows.out_tokens.reshape(-1), accept_lens=rows.commit_lens,
            can_run_cuda_graph=False, next_draft_input=next_draft_input,
            speculative_num_draft_tokens=verify.rows, new_seq_lens=new_seq_lens)

    def _logprobs_asked(self) -> bool:
        """Whether the batch being stepped asked for log-probs that this worker computes after the step
        (`DSpineLogprobWorker`, which hides them from DFlash's code)."""
        return getattr(self, "_logprob_batch", None) is not None


class DSpineAdaptiveWorker(DSpineWorker):
    """SGLANG_DSPINE_VERIFY=adaptive (SGLang 0.5.17, one rank): each decode step verifies the shape
    `verify_shapes.ShapePolicy` picks for the batch: the whole block (DFlash's own step, as the fixed server), a
    chain of the walk's first W tokens, or none (a plain decode step that still feeds the drafter's context).
    The drafter always drafts its block (its draft CUDA graphs are the fixed server's); a narrower shape
    verifies a prefix of it on the target's resources at that width (verify_widths.py), built at start-up.
    Each step is timed on the GPU (CUDA events) and its accept lengths copied to the host without a sync; the
    policy reads both when they are ready, a step or two later."""

    _log_every = 200  # decisions between the shape-share log lines (benchmarks read them)

    def __init__(self, server_args, *args, **kwargs):
        from ..env import ENV
        from .verify_shapes import parse_menu

        super().__init__(server_args, *args, **kwargs)
        self.menu = parse_menu(ENV.verify_shapes, int(self.block_size))
        self._pending: collections.deque = collections.deque()  # steps whose time and acceptance are not read yet
        self._shares: collections.Counter = collections.Counter()  # steps by shape name since start

    def init_cuda_graphs(self):
        from . import verify_widths
        from .verify_shapes import ShapePolicy

        super().init_cuda_graphs()
        mr, b = self.model_runner, int(self.block_size)
        self._base_width = verify_widths.current(mr, b)
        self._widths = {b: self._base_width}
        for shape in self.menu:
            if shape.rows != b:
                self._widths[shape.rows] = verify_widths.build(mr, shape.rows, self.device, self.gpu_id)
        runner = self._base_width.graph_runner
        buckets = list(getattr(runner, "capture_bs", None) or [])
        self.policy = ShapePolicy(self.menu, buckets, b)
        gib = sum(w.gib for w in self._widths.values())
        logger.info("DSPINE adaptive verify: shapes %s, %.2f GiB for the narrower widths' backends and graphs, "
                    "batch buckets %s", ", ".join(s.name for s in self.menu), gib, buckets)

    def forward_batch_generation(self, batch, on_publish=None, grammar_barrier=None):
        if not is_verify_step(batch):
            return super().forward_batch_generation(batch, on_publish=on_publish, grammar_barrier=grammar_barrier)
        self._read_finished_steps()
        bs = len(batch.seq_lens)
        shape = self.policy.choose(bs)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        if shape.rows == int(self.block_size):
            result = super().forward_batch_generation(batch, on_publish=on_publish, grammar_barrier=grammar_barrier)
        else:
            result = self._forward_prefix_decode(batch, shape.rows, on_publish=on_publish,
                                                 grammar_barrier=grammar_barrier)
        accepted = torch.empty(bs, dtype=torch.int32, pin_memory=True)
        accepted.copy_(result.accept_lens, non_blocking=True)
        end.record()
        self._pending.append((bs, shape, start, end, accepted))
        self._count(shape)
        return result

    def _read_finished_steps(self) -> None:
        """Feed the policy every step whose GPU work has finished (in order; no sync)."""
        while self._pending and self._pending[0][3].query():
            bs, shape, start, end, accepted = self._pending.popleft()
            # commit length = accepted drafts + the bonus token
            self.policy.observe(bs, shape, start.elapsed_time(end), [int(a) - 1 for a in accepted.tolist()])

    def _count(self, shape) -> None:
        self._shares[shape.name] += 1
        if self._shares.total() % self._log_every == 0:
            shares = ", ".join(f"{k} {v}" for k, v in sorted(self._shares.items()))
            logger.info("DSPINE adaptive verify: steps by shape since start: %s; policy %s", shares,
                        json.dumps(self.policy.summary()))

    def _forward_prefix_decode(self, batch, rows: int, on_publish=None, grammar_barrier=None):
        """DFlash's decode step (SGLang 0.5.17's `DFlashWorkerV2.forward_batch_generation`) verifying the
        first `rows` tokens of the block [anchor, walk...]: the drafter drafts its whole block (its CUDA graphs
        are the block's; rows = 1: no draft forward at all), the target verifies `rows` on its resources at
        that width, DFlash's own acceptance rules (greedy, and target-only sampling) run on the prefix, and the
        committed rows' target features go into the draft KV as after any DFlash step."""
        from sglang.kernels.ops.speculative.dflash import _prepare_dflash_draft_block_unchecked
        from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
        from sglang.srt.speculative.dflash_info import DFlashVerifyInput
        from sglang.srt.speculative.dflash_info_v2 import DFlashDraftInputV2
        from sglang.srt.speculative.spec_utils import GrammarTree, build_grammar_vocab_mask

        from . import verify_widths

        self._validate_phase1_sampling_support(batch)
        draft_input = batch.spec_info
        if not isinstance(draft_input, DFlashDraftInputV2):
            raise RuntimeError(f"DSPINE adaptive verify: expected DFlashDraftInputV2 on the batch, found "
                               f"{draft_input!r}")
        batch.seq_lens.record_stream(torch.get_device_module(self.device).current_stream())
        bs, b = len(batch.seq_lens), int(self.block_size)
        prefix_lens = batch.seq_lens
        # the block's B slots from the committed length on (SGLang reserved them: the server's width is B)
        self._ensure_draft_block_buffers(bs)
        block_ids, positions_2d = self._draft_block_ids_buf[:bs], self._draft_block_positions_buf[:bs]
        loc_2d = self._draft_verify_out_cache_loc_buf[:bs]
        _prepare_dflash_draft_block_unchecked(
            bonus_tokens=draft_input.bonus_tokens.view(-1), prefix_lens=prefix_lens.view(-1),
            req_pool_indices=batch.req_pool_indices.view(-1),
            req_to_token=self.model_runner.req_to_token_pool.req_to_token, block_ids_out=block_ids,
            positions_out=positions_2d, cache_loc_out=loc_2d, mask_token_id=int(self._mask_token_id))
        host = host_bound(self, batch, draft_input)
        candidates = torch.empty((bs, rows), dtype=block_ids.dtype, device=block_ids.device)
        candidates[:, 0].copy_(block_ids[:, 0])
        if rows > 1:  # 1) the drafter's block, as DFlash's step drafts it; its first rows - 1 tokens kept
            draft_out = draft_forward(self, batch, block_ids, positions_2d.reshape(-1), loc_2d.reshape(-1), host)
            if self._draft_sampler is not None and draft_out.can_run_graph:
                walk = self._draft_sampler.out[: bs * (b - 1)].view(bs, b - 1)
            else:
                step = self._attached_step(self.target_worker.model_runner.model.lm_head)
                walk = step.decode(step.rows_after_anchor(draft_out.logits_output.hidden_states))
            candidates[:, 1:].copy_(walk[:, : rows - 1])
        grammar_tree = GrammarTree.from_linear_chain(candidates) if batch.has_grammar else None

        # 2) the target verifies the prefix: rows slots and positions from the committed length on
        verify_loc_2d = loc_2d[:, :rows].contiguous()
        positions = positions_2d[:, :rows].reshape(-1)
        verify_input = DFlashVerifyInput(draft_token=candidates.reshape(-1), positions=positions,
                                         draft_token_num=rows, custom_mask=None,
                                         capture_hidden_mode=CaptureHiddenMode.FULL)
        batch.out_cache_loc = verify_loc_2d.reshape(-1)
        with verify_widths.verifying_at(self.model_runner, self._widths[rows], self._base_width):
            verify_batch = prepare_verify(self, verify_input, batch, host)
            target_out = self.target_worker.forward_batch_generation(batch=None, forward_batch=verify_batch,
                                                                     is_verify=True, skip_attn_backend_init=True)
        logits_output = target_out.logits_output
        grammar_mask = build_grammar_vocab_mask(reqs=batch.reqs, tree=grammar_tree, sampling_info=batch.sampling_info,
                                                device=logits_output.next_token_logits.device,
                                                barrier=grammar_barrier) if batch.has_grammar else None
        result = self._commit_prefix(candidates, logits_output, batch.sampling_info, draft_input, prefix_lens,
                                     verify_loc_2d, positions, grammar_mask=grammar_mask, on_publish=on_publish)
        result.can_run_cuda_graph = target_out.can_run_cuda_graph
        return result

    def _commit_prefix(self, candidates, logits_output, sampling_info, draft_input, prefix_lens, verify_loc_2d,
                       positions, grammar_mask=None, on_publish=None):
        """A prefix step after its verify pass: DFlash's acceptance over `candidates` [bs, W] (greedy, or
        target-only sampling), then the committed rows' target features (the verify's hidden states) written into
        the draft KV at their slots `verify_loc_2d` [bs, W] and `positions` [bs·W]: the drafter's context keeps up
        whatever W, W = 1 included. Returns the step's GenerationBatchResult (W tokens a request)."""
        from sglang.srt.managers.scheduler import GenerationBatchResult
        from sglang.srt.speculative.dflash_utils import (
            apply_dflash_verify_logits_adjustments,
            compute_dflash_correct_drafts_and_bonus,
            compute_dflash_sampling_correct_drafts_and_bonus,
            is_dflash_sampling_verify_available,
        )

        bs, rows = candidates.shape
        if sampling_info is not None:
            apply_dflash_verify_logits_adjustments(next_token_logits=logits_output.next_token_logits,
                                                   sampling_info=sampling_info, draft_token_num=rows)
        if grammar_mask is not None:
            grammar_mask.apply(logits_output.next_token_logits)
        if sampling_info is not None and not sampling_info.is_all_greedy and is_dflash_sampling_verify_available():
            accept_len, bonus = compute_dflash_sampling_correct_drafts_and_bonus(
                candidates=candidates, next_token_logits=logits_output.next_token_logits,
                sampling_info=sampling_info, max_top_k=draft_input.max_top_k,
                uniform_top_k_value=draft_input.uniform_top_k_value)
        else:
            target_predict = torch.argmax(logits_output.next_token_logits, dim=-1).view(bs, rows)
            accept_len, bonus = compute_dflash_correct_drafts_and_bonus(candidates=candidates,
                                                                        target_predict=target_predict)
        commit_lens, out_tokens = prefix_outputs(candidates, accept_len, bonus)
        new_seq_lens = prefix_lens + commit_lens.to(prefix_lens.dtype)
        if on_publish is not None:
            on_publish(new_seq_lens)
        hidden = logits_output.hidden_states
        if hidden is None:
            raise RuntimeError("DSPINE adaptive verify: the target returned no hidden states")
        self._append_target_hidden_to_draft_kv_by_loc(
            target_hidden=hidden.reshape(-1, hidden.shape[-1]), cache_loc=verify_loc_2d.reshape(-1),
            cache_loc_2d=verify_loc_2d, positions=positions, commit_lens=commit_lens)
        logits_output.hidden_states = None
        next_draft_input = self._make_next_draft_input_decode(bonus_tokens=bonus, new_seq_lens=new_seq_lens)
        return GenerationBatchResult(
            logits_output=logits_output, next_token_ids=out_tokens.reshape(-1), accept_lens=commit_lens,
            can_run_cuda_graph=False, next_draft_input=next_draft_input, speculative_num_draft_tokens=rows,
            new_seq_lens=new_seq_lens)


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


class DSpineAdaptiveLogprobWorker(DSpineLogprobWorker, DSpineAdaptiveWorker):
    """The adaptive worker where DFlash's worker refuses log-prob requests (0.5.17): DSpineLogprobWorker's step
    around the adaptive step; the log-probs read the step's own width (`verify_logprobs`)."""


class DSpineTreeLogprobWorker(DSpineLogprobWorker, DSpineTreeWorker):
    """The tree worker where DFlash's worker refuses log-prob requests (0.5.17): DSpineLogprobWorker's step
    around the tree step (its `super()` call reaches DSpineTreeWorker's)."""
