"""DFlash's decode step (SGLang's `DFlashWorkerV2.forward_batch_generation`, 0.5.17 and 0.5.23) in parts, for the
DSPINE worker's steps that verify another shape than DFlash's block: a prefix of the block (`chainW`, `none`) or a
tree (0.5.17 only). The block step itself is DFlash's own method, called whole.

This module is the one place those steps read DFlash's private worker members and SGLang's speculative
internals. `dflash_step_names()` lists every one of them for the installed release; `missing_dflash_step_names`
checks the installed SGLang still has them when a server that runs such a step starts (`startup_checks.check_tree`,
`check_adaptive`), so a changed SGLang refuses the server in one line instead of failing mid-step.
tests/test_serving_glue.py holds the list to what the functions below really read.

Each part keeps DFlash's semantics: the block's slots and positions from the committed length on (SGLang
reserved 2 × the server's width past it), the host bound on the committed lengths for the draft and verify
planning, DFlash's draft forward (its draft CUDA graphs, the draft sampler as their tail), its verify logits
adjustments and acceptance rules, and its context upkeep (the committed rows' target features into the draft
KV, the next step's anchors and lengths).

Where the releases differ, each part follows the installed one (`versions.dflash_plans_kv_locs`). 0.5.23 plans an
iteration's KV ids once (`KVLocPlan`, over the window the step writes: the block's B slots a request, or a `none`
step's one) and hands the plan to the draft forward (the whole window), to the verify (its first W columns,
`kv_loc_cols`) and to the context writer (the ids the draft pool indexes, as DFlash's `_draft_write_ids` gives
them); its host bound falls back on the allocator's lengths (`nxt_kv_lens_cpu`); its greedy acceptance rule lives
in SGLang's kernels package; and its verify step returns log-probs and sampling masks itself (`request_outputs`).
0.5.17 passes the slots themselves.
"""
from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch

_WORKER = ("sglang.srt.speculative.dflash_worker_v2", "DFlashWorkerV2")

# (module, class or None, name, what): "method" of the class; "member": an attribute the class's own code sets or
# reads on its instances (buffers, flags, sub-objects); "function" (or class) of the module.
_COMMON_NAMES = (
    *((*_WORKER, n, "method") for n in (
        "_validate_phase1_sampling_support", "_ensure_draft_block_buffers", "_append_target_hidden_to_draft_kv_by_loc",
        "_make_next_draft_input_decode")),
    *((*_WORKER, n, "member") for n in (
        "_draft_block_ids_buf", "_draft_block_positions_buf", "_draft_verify_out_cache_loc_buf",
        "_draft_seq_lens_cpu_buf", "_block_pos_offsets", "_mask_token_id", "_draft_block_spec_info",
        "_use_triton_prepare_block", "_draft_sampler", "draft_model_runner", "use_compact_draft_cache",
        "_use_fused_kv_materialize",
        "_need_mamba_verify_commit", "block_size")),
    *((m, None, n, "function") for m, n in (
        ("sglang.kernels.ops.speculative.dflash", "_prepare_dflash_draft_block_unchecked"),
        ("sglang.kernels.ops.speculative.cache_locs", "assign_extend_cache_locs_func"),
        ("sglang.srt.speculative.dflash_info", "DFlashVerifyInput"),
        ("sglang.srt.speculative.dflash_info_v2", "DFlashDraftInputV2"),
        ("sglang.srt.speculative.dflash_utils", "apply_dflash_verify_logits_adjustments"),
        ("sglang.srt.speculative.dflash_utils", "compute_dflash_sampling_correct_drafts_and_bonus"),
        ("sglang.srt.speculative.dflash_utils", "is_dflash_sampling_verify_available"),
        ("sglang.srt.speculative.spec_utils", "GrammarTree"),
        ("sglang.srt.speculative.spec_utils", "build_grammar_vocab_mask"),
        ("sglang.srt.managers.scheduler", "GenerationBatchResult"))),
)
_NAMES_0_5_17 = (("sglang.srt.speculative.dflash_utils", None, "compute_dflash_correct_drafts_and_bonus", "function"),)
_NAMES_0_5_23 = (
    *((*_WORKER, n, "member") for n in (
        "_target_logits_processor", "_full_embed_gpu", "_noise_embed_scale", "draft_parallel_layout")),
    *((m, None, n, "function") for m, n in (
        ("sglang.kernels.ops.speculative.dflash", "compute_dflash_correct_drafts_and_bonus"),
        ("sglang.srt.speculative.dflash_worker_v2", "_resolve_dflash_embedding_module"),
        ("sglang.srt.speculative.spec_utils", "draft_tp_context"),
        ("sglang.srt.lora.layers", "unwrap_lora_layer"),
        ("sglang.srt.model_executor.forward_batch_info", "enable_num_token_non_padded"),
        ("sglang.srt.layers.logprob_processor", "compute_spec_logprobs"),
        ("sglang.srt.speculative.spec_sampling_mask", "SpeculativeSamplingMaskCapture"))),
)


def dflash_step_names() -> tuple:
    """What this module reads of the installed SGLang: (module, class or None, name, what) each."""
    from .versions import dflash_plans_kv_locs

    return _COMMON_NAMES + (_NAMES_0_5_23 if dflash_plans_kv_locs() else _NAMES_0_5_17)


def missing_dflash_step_names() -> list[str]:
    """The `dflash_step_names()` the installed SGLang lacks ([] when it has them all)."""
    import importlib

    from .versions import class_names

    missing = []
    for module_name, class_name, name, what in dflash_step_names():
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            missing.append(f"{module_name} (module)")
            continue
        owner = getattr(module, class_name, None) if class_name else module
        found = owner is not None and (callable(getattr(owner, name, None)) if what == "method" else
                                       name in class_names(owner) if what == "member" else hasattr(owner, name))
        if not found:
            missing.append(f"{module_name}.{class_name + '.' if class_name else ''}{name}")
    return missing


class BlockSlots(NamedTuple):
    block_ids: torch.Tensor  # [bs, B] the draft forward's input: the anchor (bonus token), then mask tokens
    positions_2d: torch.Tensor  # [bs, B] committed length + j
    loc_2d: torch.Tensor  # [bs, B] the draft forward's KV slots
    verify_loc_2d: torch.Tensor  # [bs, W] the verify's slots (W rows a request: a prefix of loc_2d, or N > B)
    plan: object = None  # 0.5.23: the iteration's KVLocPlan over loc_2d (`kv_plan`); None on 0.5.17


class OneRowSlots(NamedTuple):
    anchors: torch.Tensor  # [bs, 1] the bonus tokens
    loc_2d: torch.Tensor  # [bs, 1] each request's slot at its committed length
    positions: torch.Tensor  # [bs] the committed lengths
    plan: object = None  # 0.5.23: the iteration's KVLocPlan over loc_2d; None on 0.5.17


class HostBound(NamedTuple):
    seq_lens_cpu: torch.Tensor  # [bs] int32, the draft step's buffer
    seq_lens_sum: int
    bounded: bool  # False: the committed lengths themselves (no host lengths, no reservation)


def kv_plan(worker, batch, draft_input, window_2d: torch.Tensor):
    """SGLang 0.5.23: the iteration's KV plan, as DFlash's step makes it, over the window `window_2d` [bs, width]
    the step writes (the draft block's slots, or a `none` step's one a request), its reads reaching `width` past
    the committed lengths. None on 0.5.17, which passes the slots themselves."""
    from .versions import dflash_plans_kv_locs

    if not dflash_plans_kv_locs():
        return None
    host_lens = batch.seq_lens_cpu if batch.seq_lens_cpu is not None else draft_input.nxt_kv_lens_cpu
    return worker.target_worker.model_runner.kv_index_translator.plan(
        req_pool_indices=batch.req_pool_indices, seq_lens=batch.seq_lens, seq_lens_cpu=host_lens,
        write_virtual=window_2d.reshape(-1), read_extent=int(window_2d.shape[1]))


def _plan_cols(plan, bs: int, rows: int):
    """The part of `plan`'s [bs, width] window a forward of `rows` rows a request writes: None (all of it) or its
    first `rows` columns."""
    width = int(plan.write_virtual.numel()) // max(bs, 1)
    return None if rows == width else slice(0, rows)


def draft_write_loc(worker, plan, loc_2d: torch.Tensor) -> torch.Tensor:
    """The slots `loc_2d` [bs, W] (the first W columns of the step's window) as the draft KV pool indexes them, for
    the context writer: on 0.5.17 the slots themselves; on 0.5.23 the plan's write ids in the draft runner's id
    space (DFlash's `_draft_write_ids`, for those columns)."""
    if plan is None:
        return loc_2d
    bs, rows = loc_2d.shape
    ids = plan.write_ids(worker.draft_model_runner.kv_index_translator, cols=_plan_cols(plan, bs, rows))
    return ids.view(bs, rows)


def draft_input_of(worker, batch):
    """The batch's DFlash decode state, after DFlash's own checks of the batch's sampling."""
    from sglang.srt.speculative.dflash_info_v2 import DFlashDraftInputV2

    if worker.use_compact_draft_cache or worker._need_mamba_verify_commit:  # refused at start
        raise RuntimeError("DSPINE: a draft sliding window or a hybrid (mamba) target is not built for this step")
    worker._validate_phase1_sampling_support(batch)
    draft_input = batch.spec_info
    if not isinstance(draft_input, DFlashDraftInputV2):
        raise RuntimeError(f"DSPINE: expected DFlashDraftInputV2 on the batch, found {draft_input!r}")
    # carried over from the previous overlap iteration, maybe produced on another stream
    batch.seq_lens.record_stream(torch.get_device_module(worker.device).current_stream())
    return draft_input


def block_slots(worker, batch, draft_input, rows: int) -> BlockSlots:
    """The draft block and the slots of a verify of `rows` rows a request, from the committed lengths on, as
    DFlash prepares its block: its one Triton kernel where rows <= B and it uses it, else the eager operations
    over max(B, rows) slots."""
    from sglang.kernels.ops.speculative.cache_locs import assign_extend_cache_locs_func
    from sglang.kernels.ops.speculative.dflash import _prepare_dflash_draft_block_unchecked

    bs, b = len(batch.seq_lens), int(worker.block_size)
    req_to_token, prefix_lens = worker.model_runner.req_to_token_pool.req_to_token, batch.seq_lens
    worker._ensure_draft_block_buffers(bs)
    block_ids, positions_2d = worker._draft_block_ids_buf[:bs], worker._draft_block_positions_buf[:bs]
    loc_2d = worker._draft_verify_out_cache_loc_buf[:bs]
    if rows <= b and worker._use_triton_prepare_block:
        _prepare_dflash_draft_block_unchecked(
            bonus_tokens=draft_input.bonus_tokens.view(-1), prefix_lens=prefix_lens.view(-1),
            req_pool_indices=batch.req_pool_indices.view(-1), req_to_token=req_to_token, block_ids_out=block_ids,
            positions_out=positions_2d, cache_loc_out=loc_2d, mask_token_id=int(worker._mask_token_id))
        return BlockSlots(block_ids, positions_2d, loc_2d, loc_2d[:, :rows],
                          kv_plan(worker, batch, draft_input, loc_2d))
    width = max(b, rows)
    block_ids.fill_(int(worker._mask_token_id))
    block_ids[:, 0].copy_(draft_input.bonus_tokens)
    torch.add(prefix_lens.unsqueeze(1), worker._block_pos_offsets, out=positions_2d)
    locs = assign_extend_cache_locs_func(
        req_pool_indices=batch.req_pool_indices, req_to_token=req_to_token, start_offset=prefix_lens,
        end_offset=prefix_lens + width, batch_size=bs, draft_token_num=width, device=worker.device).view(bs, width)
    loc_2d.copy_(locs[:, :b])
    # a tree's N > B slots: 0.5.17 only (check_tree), which plans nothing
    return BlockSlots(block_ids, positions_2d, loc_2d, locs[:, :rows],
                      kv_plan(worker, batch, draft_input, loc_2d) if rows <= b else None)


def one_row_slots(worker, batch, draft_input) -> OneRowSlots:
    """A `none` step's verify inputs, without the draft block (no draft forward reads it): the anchors, i.e. the
    bonus tokens [bs, 1]; their slots [bs, 1]: each request's slot at its committed length, `block_slots`' first
    column; their positions [bs]: the committed lengths; each a fresh int64 tensor. On 0.5.23 the plan of that
    one-slot window."""
    req_to_token, prefix = worker.model_runner.req_to_token_pool.req_to_token, batch.seq_lens
    loc = req_to_token[batch.req_pool_indices, prefix].to(torch.int64).view(-1, 1)
    return OneRowSlots(draft_input.bonus_tokens.to(torch.int64, copy=True).view(-1, 1), loc,
                       prefix.to(torch.int64, copy=True), kv_plan(worker, batch, draft_input, loc))


def host_bound(worker, batch, draft_input) -> HostBound:
    """A DFlash worker's host bound on the committed lengths for a step's draft and verify, as DFlash's
    non-windowed path makes it: the host's lengths (one step behind under overlap) + one block, else the reserved
    lengths (0.5.17 `reserved_seq_lens_cpu`, 0.5.23 `nxt_kv_lens_cpu`), else on 0.5.17 the lengths themselves,
    on 0.5.23 each request's allocated KV length for the draft (either way not `bounded`: the verify keeps the
    batch's own, as DFlash's does)."""
    from .versions import dflash_plans_kv_locs

    bs, b, planned = len(batch.seq_lens), int(worker.block_size), dflash_plans_kv_locs()
    worker._ensure_draft_block_buffers(bs)  # a `none` step prepares no block (`one_row_slots`) to size them
    seq_lens_cpu, bounded = worker._draft_seq_lens_cpu_buf[:bs], True
    reserved = draft_input.nxt_kv_lens_cpu if planned else draft_input.reserved_seq_lens_cpu
    if batch.seq_lens_cpu is not None:
        seq_lens_cpu.copy_(batch.seq_lens_cpu)
        seq_lens_cpu.add_(b)
    elif reserved is not None:
        seq_lens_cpu.copy_(reserved)
    elif planned:
        for i, req in enumerate(batch.reqs):
            seq_lens_cpu[i] = req.kv.kv_allocated_len
        bounded = False
    else:
        seq_lens_cpu.copy_(batch.seq_lens.to("cpu", dtype=torch.int32))
        bounded = False
    return HostBound(seq_lens_cpu, int(seq_lens_cpu.sum()), bounded)


def _draft_embeddings(worker, block_ids: torch.Tensor) -> torch.Tensor:
    """The draft block's input embeddings, as DFlash's step takes them: the target's embedding (0.5.23: its
    gathered copy where DFlash keeps one, the module DFlash resolves for the drafter, times its noise scale)."""
    from .versions import dflash_plans_kv_locs

    target_model = worker.target_worker.model_runner.model
    if not dflash_plans_kv_locs():
        return target_model.get_input_embeddings()(block_ids)
    from sglang.srt.lora.layers import unwrap_lora_layer
    from sglang.srt.speculative.dflash_worker_v2 import _resolve_dflash_embedding_module

    if worker._full_embed_gpu is not None:
        embed = torch.nn.functional.embedding(block_ids, worker._full_embed_gpu)
    else:
        embed = unwrap_lora_layer(_resolve_dflash_embedding_module(worker.draft_model, target_model))(block_ids)
    return embed * worker._noise_embed_scale if worker._noise_embed_scale != 1.0 else embed


def draft_forward(worker, batch, slots: BlockSlots, host: HostBound):
    """The drafter's forward over each request's block [anchor, mask...] at its positions and KV slots, as
    DFlash's step runs it (its draft CUDA graphs, the draft sampler as their tail; 0.5.23: the plan bound to it,
    under the drafter's TP placement)."""
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    block_ids = slots.block_ids
    bs, b = block_ids.shape
    embed = _draft_embeddings(worker, block_ids)
    fields = dict(
        forward_mode=ForwardMode.TARGET_VERIFY, batch_size=bs, input_ids=block_ids.flatten(),
        req_pool_indices=batch.req_pool_indices, seq_lens=batch.seq_lens, out_cache_loc=slots.loc_2d.reshape(-1),
        seq_lens_sum=host.seq_lens_sum, seq_lens_cpu=host.seq_lens_cpu, positions=slots.positions_2d.reshape(-1),
        input_embeds=embed.view(-1, embed.shape[-1]), spec_algorithm=SpeculativeAlgorithm.DFLASH,
        spec_info=worker._draft_block_spec_info, capture_hidden_mode=CaptureHiddenMode.NULL)
    placement = contextlib.nullcontext()
    if slots.plan is not None:
        from sglang.srt.model_executor.forward_batch_info import enable_num_token_non_padded
        from sglang.srt.speculative.spec_utils import draft_tp_context

        fields.update(num_token_non_padded=torch.full((), bs * b, dtype=torch.int32, device=block_ids.device)
                      if enable_num_token_non_padded() else None,
                      global_num_token_non_padded_cpu=bs * b, can_run_decode_cuda_graph=batch.can_run_decode_cuda_graph)
        placement = draft_tp_context(worker.draft_parallel_layout)
    draft_batch = ForwardBatch(**fields)
    if slots.plan is not None:
        slots.plan.bind(draft_batch, worker.draft_model_runner.kv_index_translator)
    with torch.inference_mode(), placement:
        return worker.draft_model_runner.forward(draft_batch)


def graph_sampler(worker, draft_out):
    """The draft sampler whose buffers the draft CUDA graph's tail filled this step, or None (eager draft)."""
    return worker._draft_sampler if worker._draft_sampler is not None and draft_out.can_run_graph else None


def verify(worker, batch, tokens: torch.Tensor, positions: torch.Tensor, rows: int, loc_2d: torch.Tensor,
           host: HostBound, custom_mask=None, plan=None):
    """The target's verify pass over `tokens` [bs·rows] at `positions` and slots `loc_2d` [bs, rows] (causal
    within a request's rows, or under `custom_mask`), planned on the step's host bound where it is one (a copy:
    the buffer is the next step's); the batch's own lengths are back afterwards. On 0.5.23 the pass writes the
    first `rows` columns of `plan`'s window, and a vocabulary-sharded logits output is gathered whole (the
    acceptance reads every row). Returns the target's output."""
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
    from sglang.srt.speculative.dflash_info import DFlashVerifyInput

    planned = {} if plan is None else dict(kv_loc_plan=plan, kv_loc_cols=_plan_cols(plan, loc_2d.shape[0], rows))
    verify_input = DFlashVerifyInput(draft_token=tokens, positions=positions, draft_token_num=rows,
                                     custom_mask=custom_mask, capture_hidden_mode=CaptureHiddenMode.FULL, **planned)
    batch.out_cache_loc = loc_2d.reshape(-1)
    backup = batch.seq_lens_cpu, batch.seq_lens_sum
    if host.bounded:
        batch.seq_lens_cpu, batch.seq_lens_sum = host.seq_lens_cpu.clone(), host.seq_lens_sum
    try:
        verify_batch = verify_input.prepare_for_verify(batch, worker.target_worker)[0]
    finally:
        batch.seq_lens_cpu, batch.seq_lens_sum = backup
    out = worker.target_worker.forward_batch_generation(batch=None, forward_batch=verify_batch, is_verify=True,
                                                        skip_attn_backend_init=True)
    gather = worker._target_logits_processor if plan is not None else None  # 0.5.23's member (None: no sharding)
    if gather is not None and gather.is_deferred_shard(out.logits_output.next_token_logits):
        out.logits_output.next_token_logits = gather.finish_deferred_gather(out.logits_output.next_token_logits)
    return out


def grammar_tree_of_chain(batch, candidates: torch.Tensor):
    """The grammar's view of a chain verify (None without a grammar); made before the verify launch, as DFlash's."""
    from sglang.srt.speculative.spec_utils import GrammarTree

    return GrammarTree.from_linear_chain(candidates) if batch.has_grammar else None


def grammar_tree_of_links(batch, next_token: torch.Tensor, next_sibling: torch.Tensor, tokens: torch.Tensor):
    """The grammar's view of a tree verify (None without a grammar)."""
    from sglang.srt.speculative.spec_utils import GrammarTree

    return GrammarTree.from_device(next_token, next_sibling, tokens) if batch.has_grammar else None


def adjust_logits(batch, logits: torch.Tensor, rows: int, grammar_tree, grammar_barrier) -> None:
    """DFlash's verify logits adjustments (penalties, bias) and the grammar's masks, in place, on [bs·rows, V]."""
    from sglang.srt.speculative.dflash_utils import apply_dflash_verify_logits_adjustments
    from sglang.srt.speculative.spec_utils import build_grammar_vocab_mask

    grammar_mask = build_grammar_vocab_mask(reqs=batch.reqs, tree=grammar_tree, sampling_info=batch.sampling_info,
                                            device=logits.device, barrier=grammar_barrier) \
        if batch.has_grammar else None
    if batch.sampling_info is not None:
        apply_dflash_verify_logits_adjustments(next_token_logits=logits, sampling_info=batch.sampling_info,
                                               draft_token_num=rows)
    if grammar_mask is not None:
        grammar_mask.apply(logits)


def samples(sampling_info) -> bool:
    """Whether a verify accepts by DFlash's target-only sampling rule (else greedily)."""
    from sglang.srt.speculative.dflash_utils import is_dflash_sampling_verify_available

    return sampling_info is not None and not sampling_info.is_all_greedy and is_dflash_sampling_verify_available()


def accept_chain(candidates: torch.Tensor, logits: torch.Tensor, sampling_info, draft_input):
    """DFlash's acceptance over `candidates` [bs, W] (the anchor, then W - 1 drafts): (drafts accepted [bs],
    the bonus token [bs])."""
    from sglang.srt.speculative.dflash_utils import compute_dflash_sampling_correct_drafts_and_bonus

    bs, rows = candidates.shape
    if samples(sampling_info):
        return compute_dflash_sampling_correct_drafts_and_bonus(
            candidates=candidates, next_token_logits=logits, sampling_info=sampling_info,
            max_top_k=draft_input.max_top_k, uniform_top_k_value=draft_input.uniform_top_k_value)
    return greedy_accept(candidates, torch.argmax(logits, dim=-1).view(bs, rows))


def greedy_accept(candidates: torch.Tensor, target_predict: torch.Tensor):
    """DFlash's greedy rule (the installed release's `compute_dflash_correct_drafts_and_bonus`: 0.5.17 keeps it in
    dflash_utils, 0.5.23 in SGLang's kernels package) over `candidates` [bs, W] and the target's argmax per row
    `target_predict` [bs, W]: (drafts accepted [bs], the bonus token [bs])."""
    from .versions import dflash_plans_kv_locs

    if dflash_plans_kv_locs():
        from sglang.kernels.ops.speculative.dflash import compute_dflash_correct_drafts_and_bonus
    else:
        from sglang.srt.speculative.dflash_utils import compute_dflash_correct_drafts_and_bonus
    return compute_dflash_correct_drafts_and_bonus(candidates=candidates, target_predict=target_predict)


def write_context(worker, *, hidden: torch.Tensor, loc_2d: torch.Tensor, positions: torch.Tensor,
                  commit_lens: torch.Tensor) -> None:
    """DFlash's context writer: each request's first `commit_lens` rows of target features `hidden` [bs·W, F]
    into the draft KV at slots `loc_2d` [bs, W], positions `positions` [bs·W]."""
    worker._append_target_hidden_to_draft_kv_by_loc(target_hidden=hidden, cache_loc=loc_2d.reshape(-1),
                                                    cache_loc_2d=loc_2d, positions=positions,
                                                    commit_lens=commit_lens)


@contextlib.contextmanager
def per_layer_writer(worker):
    """DFlash's context writer on its per-layer path inside (its own fallback; same K/V). Its fused path keeps a
    workspace that a larger call (a prefill) reallocates: a CUDA graph that captured it would then write into
    freed memory. The per-layer path's intermediates are the graph's own."""
    fused = worker._use_fused_kv_materialize
    worker._use_fused_kv_materialize = False
    try:
        yield
    finally:
        worker._use_fused_kv_materialize = fused


def commit(worker, logits_output, *, hidden: torch.Tensor, loc_2d: torch.Tensor, positions: torch.Tensor,
           commit_lens: torch.Tensor, bonus: torch.Tensor, prefix_lens: torch.Tensor, out_tokens: torch.Tensor,
           rows: int, on_publish=None):
    """DFlash's chain tail: the committed rows' target features `hidden` [bs·W', H'] into the draft KV at their
    slots `loc_2d` [bs, W'] and `positions` [bs·W'] (only each request's first `commit_lens` rows are written; by
    a replay of the worker's context upkeep graphs where it has one for this width and batch),
    the next step's anchors (`bonus`) and lengths. Returns the step's GenerationBatchResult: `out_tokens`
    [bs, rows] emitted, `rows` verify rows a request (`can_run_cuda_graph` False: the caller sets what its
    verify pass did)."""
    from sglang.srt.managers.scheduler import GenerationBatchResult

    new_seq_lens = prefix_lens + commit_lens.to(prefix_lens.dtype)
    if on_publish is not None:
        on_publish(new_seq_lens)
    upkeep = worker._upkeep_graphs
    if upkeep is None or not upkeep.write(hidden=hidden, loc_2d=loc_2d, positions=positions, commit_lens=commit_lens):
        write_context(worker, hidden=hidden, loc_2d=loc_2d, positions=positions, commit_lens=commit_lens)
    logits_output.hidden_states = None
    next_draft_input = worker._make_next_draft_input_decode(bonus_tokens=bonus, new_seq_lens=new_seq_lens)
    return GenerationBatchResult(
        logits_output=logits_output, next_token_ids=out_tokens.reshape(-1), accept_lens=commit_lens,
        can_run_cuda_graph=False, next_draft_input=next_draft_input, speculative_num_draft_tokens=rows,
        new_seq_lens=new_seq_lens)


def request_outputs(batch, result, draft_input) -> None:
    """SGLang 0.5.23: what its DFlash verify step adds to the result for the requests that ask (after the
    acceptance, from the same logits), for a step of W = `result.speculative_num_draft_tokens` rows a request:
    the sampling masks (`SpeculativeSamplingMaskCapture`) and the log-probs of the emitted tokens
    (`compute_spec_logprobs`, row n·W + j for request n's j-th token). Nothing on 0.5.17, whose DFlash returns
    neither (the worker supplies the log-probs there: `supplies_logprobs`)."""
    from .versions import dflash_returns_logprobs

    if not dflash_returns_logprobs():
        return
    from sglang.srt.layers.logprob_processor import compute_spec_logprobs
    from sglang.srt.speculative.spec_sampling_mask import SpeculativeSamplingMaskCapture

    out, rows, bs = result.logits_output, int(result.speculative_num_draft_tokens), len(batch.seq_lens)
    out_tokens = result.next_token_ids.view(bs, rows)
    capture = SpeculativeSamplingMaskCapture.from_logits(batch.sampling_info, next_token_logits=out.next_token_logits,
                                                        draft_input=draft_input, draft_token_num=rows, bs=bs)
    if capture is not None:
        out.sampling_mask_output = capture.build_output(out_tokens=out_tokens, commit_lens=result.accept_lens)
    if batch.return_logprob:
        compute_spec_logprobs(batch, out, result.next_token_ids, chain_stride=rows)
