"""Every change this plugin makes to SGLang's behaviour, in one place (SGLang 0.5.17 and 0.5.23; where they
differ, it says so).

Patches 1 and 2 change DSPINE servers only: `apply`, from `plugin._worker_factory`, runs in the scheduler process
when the DSPINE worker is created.

1. Verify renormalisation follows the sampling backend (SGLang 0.5.17 and 0.5.23).
   DFlash's non-greedy verification (which DSPINE reuses) renormalises the target's probabilities with
   `dflash_utils.top_k_renorm_prob` / `top_p_renorm_prob`, which call FlashInfer whatever the sampling
   backend. The dense path that needs them runs when a batch mixes top-k values, e.g. greedy requests (top_k 1)
   beside T=1 requests (whole vocabulary): the first such batch then JIT-builds FlashInfer's sampling module,
   which stalled a 0.5.17 server for 112-139 s on the H200 (benchmarks/results/serving_logs/*), every request
   in the batch waiting. Where the server samples in PyTorch (`--sampling-backend pytorch`, or SGLang's own
   choice: deterministic inference, no FlashInfer) no FlashInfer sampling is wanted; SGLang ships Triton
   versions of the same two renormalisations with FlashInfer's semantics (exact top-k/top-p thresholds, ties
   at the pivot kept; what it uses on ROCm), so they are used instead. The backend is the resolved one, as
   SGLang's sampler reads it (`get_exec().kernel.sampling_backend`): on 0.5.23 `server_args.sampling_backend`
   stays the raw command-line value, None when SGLang picks.

2. Requests that ask for log-probabilities are admitted (SGLang 0.5.17 only).
   0.5.17's scheduler refuses them for the whole DFlash family (`validate_dflash_request`: "DFLASH speculative
   decoding does not support return_logprob yet."). DSPINE returns them (`worker.DSpineWorker.supplies_logprobs`),
   so in a DSPINE server the scheduler's check keeps only DFlash's other refusal (hidden states under overlap
   scheduling), worded for DSPINE. 0.5.23's scheduler admits them itself (its DFlash worker returns them) and
   is left alone.

Patches 3 to 6 are applied at plugin registration, in every SGLang process (`apply_at_registration`):

3. Drafters are checked before SGLang reads them.
   SGLang's speculative argument handling (the resolution step `handle_speculative_decoding`, run in the
   launcher process while the server arguments are built, before any other process starts) reads the
   drafter's config.json with transformers before any algorithm's own checks run, so a missing folder, a
   malformed config.json or a truncated weight file surfaced as a traceback from transformers or the weight
   loader. The step is wrapped (0.5.23: through SGLang's `register_resolution_hook`, made for this; 0.5.17 has
   none, so the module attribute its caller imports is replaced) so that first, under DSPINE, the drafter
   folder is checked whole (`startup_checks.check_drafter_folder`), and under DFLASH a DSpine drafter is
   refused (`startup_checks.check_not_a_dspine_drafter`): DFLASH would decode it with its argmax, ignoring
   the injection and walk it was trained for. Servers of other algorithms, and DFLASH servers of DFlash
   drafters, are untouched.
4. A start-up refusal ends the launcher with one line.
   An uncaught `startup_checks.StartupRefusal` (raised only by the checks above and DSPINE's own argument checks)
   prints `sglang-dspine: error: MESSAGE` on stderr and exits with code 2, as argparse does for a bad flag,
   instead of a traceback through SGLang's argument code. Code that builds the arguments itself (`sglang.Engine`)
   can catch it as a ValueError. Any other exception reaches the previous hook unchanged.
5. A DSPINE server's request-to-token rows hold DFlash's decode reservation (SGLang 0.5.17 and 0.5.23).
   DFlash's decode step (which DSPINE reuses) reserves KV slots up to `committed + 2 × block` for every request
   (`DFlashDraftInputV2.prepare_for_decode`), but a row of `req_to_token` is only the context length plus
   `4 + block` wide (`allocation_sizing.get_req_to_token_extra_context_len`; at page size 1). A request within
   `block - 4` tokens of the context length then writes its reservation past its row, into the next row (another
   request's slot table), and frees only what fits in its row when it finishes: on the H200 a stock DFLASH and a
   DSPINE server (built-in pair, 4,096-token context, a prompt of 4,046 tokens + 48 new) both lost 10-16 KV slots
   and SGLang's idle check ended the server ("pool memory leak detected"). The row width's one caller
   (`kv_cache_configurator`) gets, for DSPINE servers only, at least `2 × block + page_size - 1`: 12 more int32
   per request row. Stock DFLASH keeps SGLang's width (the baseline is SGLang's own).
6. A DSPINE server verifying trees captures the target's verify CUDA graphs with the tree mask (SGLang 0.5.17
   only: 0.5.23 refuses the tree at start).
   For the DFlash family, SGLang captures the target's verify graphs without a custom mask on the backends that
   verify a chain with their causal path (`dflash_utils.resolve_dflash_verify_mask_policy`; triton among them),
   and a replay then ignores whatever mask the step brings. Under `SGLANG_DSPINE_TREE=1` (tree_verify.py) every
   verify row must see only its own path, so for DSPINE servers the policy says "build the mask": the graphs
   read the backend's mask buffer, which each replay fills with the step's tree mask (the triton backend copies
   `spec_info.custom_mask` into it). The function's one caller imports it when it captures, so the module
   attribute is replaced. DFLASH servers, DSPINE servers verifying chains, and an adaptive tree server's chain
   widths (verify_widths.py: their passes bring no mask, so a graph reading the buffer would see the last tree's)
   keep SGLang's answer.

Patch 7 is applied by an adaptive worker (SGLANG_DSPINE_VERIFY=adaptive) in its scheduler process when it
builds its shapes (`show_verify_shapes_in_decode_log`):

7. SGLang's decode log line names the verify shapes the steps since the previous line ran (SGLang 0.5.17 and 0.5.23).
   Every decode log line ("Decode batch, #running-req: ...") of an adaptive server gets ", verify shapes: none 31,
   chain4 9" at its end: steps by shape since the line before, what the policy chose under that load. A filter on
   the scheduler's metrics-reporter logger, the line's one emitter; SGLang's code is not changed. The same counts
   go to Prometheus as `sglang:dspine_verify_steps_total{shape}` when the server has --enable-metrics.

Patch 8 is applied by a DSPINE worker under SGLANG_DSPINE_SPLITKV_VERIFY=1, to the target's attention backends that
verify chains (the server's, before its CUDA graphs are captured, and the adaptive worker's other widths), not to a
tree server's nor to the drafter's (`split_kv_verify`):

8. Chain verify passes read the committed context with SGLang's split-KV verify kernel (SGLang 0.5.17 and 0.5.23).
   On the triton backend a TARGET_VERIFY pass runs `extend_attention_fwd`, which walks each request's whole
   committed context serially per (request, head) with a query tile of 64-128 rows of which a verify fills W: at
   high load that attention, not the verify's width, dominates the step (docs/verify_shapes.md). SGLang ships a
   split-KV (flash-decode) verify kernel for exactly this shape (`verify_splitkv_fwd`: a causal chain of a constant
   W rows a request; it returns False and the extend kernel runs for anything else) and turns it on only on AMD's
   MI350 (`use_verify_splitkv`). The flag is set on the backend object; SGLang's own dispatch does the rest. A
   tree's verify needs its mask, so a tree server never gets it. One more change, to that kernel's scratch: its
   combine step weighs every split's partial output, also the splits a short context leaves unrun (weight 0, their
   partials never written), and 0 × NaN is NaN, so an uninitialised scratch holding a NaN bit pattern would make
   the output NaN (seen under Triton's interpreter: tests/test_serving_glue.py). `VerifySplitKV._alloc` is wrapped
   to zero the partials once when they are allocated; a run split only ever writes finite values there after.
   And one to its number of KV splits in CUDA graphs: the kernel picks it from len(kv_indices) ÷ requests (a
   shape, so that capture needs no sync), but in a verify graph that array is the capture buffer (the backend's
   `cuda_graph_kv_indices`, max tokens × the model's context), so every graph ran the maximum, 16 splits, whatever
   the requests' contexts. Measured at Qwen3-8B heads and 576-token contexts (H100, c615dca,
   benchmarks/verify_attention.py), 16 splits cost 2.0-2.1x the 4 that SGLang's own rule gives these contexts at
   W = 16 and lost to the extend kernel (2.52 against 1.47 ms at 1 request, 18.15 against 14.13 at 48), while
   with a batch of at most 4 verify rows in all they beat 4 (0.36 against 0.56 ms for one row). So the backend's
   `verify_splitkv_fwd` is wrapped (`with_graph_split_count`): a call whose index array is longer than the batch
   could hold (requests × the model's context: only a capture buffer is) runs `graph_split_count(requests, W)`
   splits, by the module's `choose_n_splits`, which is wrapped to answer that count during such a call and
   SGLang's own rule otherwise (eager passes keep their exact arrays and SGLang's choice).

Patch 9 is applied by an adaptive worker to the target's verify backend of width 1 (the `none` shape), on SGLang's
triton backend (`decode_one_row_verify`):

9. A verify pass of one row a request reads its context with SGLang's decode kernel (SGLang 0.5.17 only).
   One row a request, causal, is a decode step: its row attends to the committed context and to itself, whose K/V
   the pass writes to its slot first. A TARGET_VERIFY pass of W = 1 ran the extend kernel (13.9 ms of attention
   a step at 48 requests of 576 tokens, Qwen3-8B heads, H100, c615dca) or, under patch 8, the split-KV verify
   kernel (3.3 ms), where a plain decode step's kernel takes 1.8 ms: at 39171fe that difference was all `none` cost
   over plain decoding (1.06 / 1.14 / 1.20x its step at 16 / 48 / 64 requests). So that backend plans every
   TARGET_VERIFY pass as the decode pass it is (the mode DECODE, each request's length + 1: its slot is the one
   after its committed context in SGLang's request-to-token row, where DFlash takes the verify's slots from) and
   runs `forward_decode` for it, eager and in its CUDA graphs, whose replay then computes the KV split counts per
   request as plain decoding's graphs do. The backend object is changed, not its class: the other widths and the
   server's own keep theirs. Not applied (and said in the log) on another attention backend or a layout the
   decode path reads differently (sliding window, DCP, MLA, a virtual-to-physical KV pool), nor on SGLang 0.5.23,
   whose backends read a pass's KV ids through the iteration's `KVLocPlan` (there `none` verifies on the chains'
   kernel: patch 10 by default).

Patch 10 is applied by a DSPINE worker under SGLANG_DSPINE_SPLITKV_VERIFY=grouped or unset (the default since
a69f10b), to the same backends as patch 8 (`grouped_verify`):

10. Chain verify passes read the committed context with DSPINE's GQA-grouped kernel (SGLang 0.5.17 and 0.5.23).
   Patch 8's kernel, like the extend kernel, reads a KV head's context once per query head, in tiles of W rows,
   and combines its splits in one warp per (request, head): at Qwen3-8B heads and 576-token contexts (H100,
   33f82f8) 16 rows a request cost 1.26 ms of attention a step at 1 request and 8.6 at 48, against 0.41 and 1.8 for
   a decode step reading the same context. `kernels/verify_attention.py` holds all W x G (row, query head) pairs
   of a KV head in one tile, so each K/V block is read once, and splits the context only where requests x KV
   heads leave the GPU's multiprocessors idle (a count from the batch size alone: graphs replay it). The backend's
   `verify_splitkv_fwd` is replaced by it and `use_verify_splitkv` set, the dispatch SGLang's own forward_extend
   already has (it runs the kernel for TARGET_VERIFY passes). A pass it cannot serve (not causal, sinks, a logit
   cap, a sliding window, W varying by request) raises instead of silently taking the extend kernel; the start-up
   checks refuse the servers whose passes would be such. A tree server's own backend gets it too (since the lease at
   671b819, where a tree of 32's step at Qwen3-8B geometry ran 0.80-0.93x the extend kernel's at 1-16 requests): the
   kernel then reads the pass's tree mask (SGLang's layout) for the rows' own block. Served at Qwen3-8B geometry
   (H100, a69f10b) fixed DSPINE ran 1.10-1.38x faster with it from 1 to 64 clients; on another attention backend
   the default leaves the backend's own kernel and says so in the log.

What DSPINE relies on in SGLang's DFlash code is checked when a DSPINE server starts (`check_dflash_hooks`, from
the algorithm's server-argument handling in the launcher, and again when the worker is created): the DFlash
worker methods `worker.DSpineWorker` overrides (its draft decoding: DFlash's argmax sampler builder and eager
argmax) and the names patch 1 replaces must exist and still be called by DFlash's own code. Otherwise DSPINE
would run with DFlash's argmax drafting (outputs right, the speedup gone, nothing said), or verify with
FlashInfer's renormalisation: the server is refused in one line instead (patch 4).
"""
from __future__ import annotations

import functools
import logging
import sys

from .startup_checks import ALGORITHM, StartupRefusal, check_drafter_folder, check_not_a_dspine_drafter
from .versions import dflash_plans_kv_locs, dflash_returns_logprobs, sglang_version
from .versions import names_used as _names_used

logger = logging.getLogger(__name__)


def _not_found(name: str) -> RuntimeError:
    """A patch whose target is missing would silently do nothing: refuse instead."""
    return RuntimeError(f"sglang-dspine: {name} not found in the installed SGLang "
                        f"{'.'.join(map(str, sglang_version()))}; the plugin cannot apply its change there")


def _wrap_once(module, name: str, mark: str, wrap):
    """Replace `module.<name>` by `wrap(stock)` (given the stock function's name and docstring, and marked `mark`),
    unless an earlier call did (the patches are idempotent). Returns (stock, wrapper), or None where it was
    already replaced; a missing function is refused (`_not_found`)."""
    stock = getattr(module, name, None)
    if stock is None:
        raise _not_found(f"{module.__name__}.{name}")
    if getattr(stock, mark, False):
        return None
    wrapper = functools.wraps(stock)(wrap(stock))
    setattr(wrapper, mark, True)
    setattr(module, name, wrapper)
    return stock, wrapper


def _used_by(namespace: dict, name: str, module: str) -> list[str]:
    """The functions of `namespace` (a class's or a module's own, defined in `module`) other than `name` that
    refer to `name`: where DFlash's code still reaches a hook or a patched name."""
    users = []
    for key, value in namespace.items():
        fn = getattr(value, "__func__", value)
        code = getattr(fn, "__code__", None)
        if key != name and code is not None and getattr(fn, "__module__", None) == module and \
                name in _names_used(code):
            users.append(key)
    return users


# (module, class or None, name, what DSPINE does with it): DFlash's names DSPINE overrides or patches.
DFLASH_HOOKS = (
    ("sglang.srt.speculative.dflash_worker_v2", "DFlashWorkerV2", "_maybe_build_draft_sampler",
     "DSPINE's worker overrides it to fold its candidate decoding into the draft CUDA graph"),
    ("sglang.srt.speculative.dflash_worker_v2", "DFlashWorkerV2", "_greedy_sample_from_vocab_parallel_head",
     "DSPINE's worker overrides it to decode eagerly with its transition walk"),
    ("sglang.srt.speculative.dflash_utils", None, "top_k_renorm_prob",
     "DSPINE replaces it with SGLang's Triton renormalisation under PyTorch sampling"),
    ("sglang.srt.speculative.dflash_utils", None, "top_p_renorm_prob",
     "DSPINE replaces it with SGLang's Triton renormalisation under PyTorch sampling"),
)


def missing_dflash_hooks() -> list[str]:
    """The DFLASH_HOOKS the installed SGLang lacks, or defines but no longer calls from its own code, one line
    each ([] when all are in place)."""
    import importlib

    missing = []
    for module_name, class_name, name, why in DFLASH_HOOKS:
        module = importlib.import_module(module_name)
        owner = getattr(module, class_name) if class_name else module
        where = f"{module_name}.{class_name + '.' if class_name else ''}{name}"
        if not hasattr(owner, name):
            missing.append(f"{where} not found ({why})")
        elif not _used_by(vars(owner), name, module_name):
            missing.append(f"{where} is no longer called by SGLang's DFlash code ({why})")
    return missing


def check_dflash_hooks() -> None:
    """Refuse a DSPINE server whose SGLang lacks a DFlash hook DSPINE needs (a `StartupRefusal`: one line)."""
    missing = missing_dflash_hooks()
    if missing:
        raise StartupRefusal(
            f"{ALGORITHM}: the installed SGLang {'.'.join(map(str, sglang_version()))} does not have what DSPINE "
            f"needs from DFlash's code: {'; '.join(missing)}; refusing to start rather than serve DFlash's "
            "decoding under the DSPINE name"
        )


def resolved_sampling_backend() -> str:
    """The sampling backend this process's SGLang samples with (its published configuration)."""
    from sglang.srt.runtime_context import get_exec

    return get_exec().kernel.sampling_backend


def verify_renorm_follows_sampling_backend() -> bool:
    """Patch 1 (see the module docstring). Returns whether the Triton renormalisations are now in use."""
    if resolved_sampling_backend() != "pytorch":
        return False
    from sglang.kernels.ops.sampling.renorm_triton import top_k_renorm_probs_triton, top_p_renorm_probs_triton
    from sglang.srt.speculative import dflash_utils

    for name in ("top_k_renorm_prob", "top_p_renorm_prob"):
        if not hasattr(dflash_utils, name):
            raise _not_found(f"sglang.srt.speculative.dflash_utils.{name}")
    if dflash_utils.top_k_renorm_prob is not top_k_renorm_probs_triton:  # once per process
        logger.info("DSPINE: verify renormalisation on SGLang's Triton kernels (sampling backend pytorch)")
    dflash_utils.top_k_renorm_prob = top_k_renorm_probs_triton
    dflash_utils.top_p_renorm_prob = top_p_renorm_probs_triton
    return True


def validate_dspine_request(req, enable_overlap: bool):
    """The scheduler's admission check for a DSPINE server: None, or why the request is refused."""
    if enable_overlap and req.return_hidden_states:
        return "DSPINE speculative decoding does not support return_hidden_states yet."
    return None


def admit_logprob_requests() -> bool:
    """Patch 2 (see the module docstring). Returns whether the scheduler's check was replaced."""
    if dflash_returns_logprobs():
        return False
    from sglang.srt.managers import scheduler

    if not hasattr(scheduler, "validate_dflash_request"):
        raise _not_found("sglang.srt.managers.scheduler.validate_dflash_request")
    scheduler.validate_dflash_request = validate_dspine_request
    return True


def apply() -> None:
    """Both patches, in a scheduler process (SGLang has published its configuration there)."""
    verify_renorm_follows_sampling_backend()
    admit_logprob_requests()


VERIFY_DISPATCH = "TritonAttnBackend's split-KV verify dispatch (use_verify_splitkv)"


def _dispatches_verify_split_kv(backend) -> bool:
    """Whether SGLang's triton backend still runs `backend.verify_splitkv_fwd` for TARGET_VERIFY passes when
    `use_verify_splitkv` is set: the hook patches 8 and 10 switch (without it they would silently do nothing)."""
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

    return "use_verify_splitkv" in _names_used(TritonAttnBackend.forward_extend.__code__) and \
        hasattr(backend, "verify_splitkv_fwd")


def split_kv_verify(backend) -> None:
    """Patch 8 (see the module docstring): `backend` (SGLang's triton attention backend of the target) verifies
    chains with SGLang's split-KV verify kernel. Refused where the backend is another, or SGLang's triton backend no
    longer dispatches on the flag (it would silently do nothing)."""
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

    if not isinstance(backend, TritonAttnBackend):
        raise StartupRefusal(f"{ALGORITHM}: SGLANG_DSPINE_SPLITKV_VERIFY=1 needs the triton attention backend for the "
                             f"target's verify (found {type(backend).__name__}): pass --attention-backend triton or "
                             "unset it")
    if not _dispatches_verify_split_kv(backend):
        raise _not_found(VERIFY_DISPATCH)
    zero_split_kv_scratch()
    backend.verify_splitkv_fwd = with_graph_split_count(backend.verify_splitkv_fwd, int(backend.max_context_len))
    backend.use_verify_splitkv = True


def grouped_verify(backend, programs: int | None = None, required: bool = True, tree: bool = False) -> str | None:
    """Patch 10 (see the module docstring): `backend` (SGLang's triton attention backend of a chain verify of
    `backend.num_draft_tokens` rows) verifies with kernels/verify_attention.py's grouped kernel. `programs`: the
    most programs a split pass launches (two per multiprocessor of the backend's GPU unless given). Returns None
    where applied (idempotent); where it cannot apply (another backend, a layout it does not read, an SGLang
    without the dispatch) raises when `required` (SGLANG_DSPINE_SPLITKV_VERIFY set), else returns why not (the
    default: the backend keeps its own kernel and the worker logs the reason). `tree`: the backend verifies trees,
    whose rows see what the pass's mask says (a tree server's own backend)."""
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

    why = None
    if not isinstance(backend, TritonAttnBackend):
        why = (f"the target's attention backend is {type(backend).__name__}, not triton: pass --attention-backend "
               "triton or unset SGLANG_DSPINE_SPLITKV_VERIFY")
    elif getattr(backend, "_dspine_grouped", False):
        return None
    elif not _dispatches_verify_split_kv(backend):
        if required:
            raise _not_found(VERIFY_DISPATCH)
        why = f"this SGLang lacks {VERIFY_DISPATCH}"
    elif backend.sliding_window_size or backend.dcp_size > 1 or backend.use_mla:
        why = ("it reads a full-attention context of one rank: this model has a sliding window, MLA or decode "
               "context parallelism; unset it")
    if why is not None:
        if required:
            raise StartupRefusal(f"{ALGORITHM}: SGLANG_DSPINE_SPLITKV_VERIFY=grouped needs the triton attention "
                                 f"backend for the target's verify: {why}")
        return why
    backend.verify_splitkv_fwd = grouped_verify_dispatch(int(backend.num_draft_tokens), int(backend.num_head),
                                                         int(backend.num_kv_head), int(backend.v_head_dim),
                                                         backend.device, programs, tree)
    backend.use_verify_splitkv = True
    backend._dspine_grouped = True
    return None


def grouped_verify_dispatch(rows: int, h_q: int, h_kv: int, v_head_dim: int, device, programs: int | None = None,
                            tree: bool = False):
    """Patch 10's kernel with the signature of SGLang's `verify_splitkv_fwd` (what the triton backend's dispatch
    calls), for verify passes of `rows` rows a request; its split scratch allocated here, once. `programs`: the
    most programs a split pass launches (two per multiprocessor of a CUDA `device` unless given). `tree`: the
    passes bring a tree's mask (SGLang's layout, with its mask_indptr), which the rows' own block follows."""
    import torch

    from ..kernels import verify_attention

    device = torch.device(device)
    if programs is None:
        programs = 2 * torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" \
            else 64
    scratch = verify_attention.SplitScratch(programs, verify_attention.tile_rows(rows, h_q // h_kv), v_head_dim,
                                            device)

    def grouped_verify_fwd(q, k, v, o, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices, custom_mask,
                           is_causal, mask_indptr, max_len_extend, k_scale=1.0, v_scale=1.0, sm_scale=None,
                           logit_cap=0.0, sliding_window_size=-1, sinks=None, xai_temperature_len=-1, **_):
        requests = qo_indptr.shape[0] - 1
        unserved = [why for why, bad in (
            ("not causal", not is_causal), ("attention sinks", sinks is not None),
            ("a logit cap", (logit_cap or 0) > 0), ("a sliding window", (sliding_window_size or -1) > 0),
            ("xai temperature", (xai_temperature_len or -1) > 0),
            (f"{q.shape[0]} rows for {requests} requests of {rows}", q.shape[0] != requests * rows),
            ("a tree's pass without its mask", tree and (custom_mask is None or mask_indptr is None))) if bad]
        if unserved:
            raise RuntimeError(f"DSPINE grouped verify attention (SGLANG_DSPINE_SPLITKV_VERIFY=grouped) cannot "
                               f"serve this pass: {', '.join(unserved)}")
        splits = verify_attention.split_count(requests, k_buffer.shape[1], scratch.programs)
        verify_attention.grouped_verify_attention(
            q, k, v, k_buffer, v_buffer, kv_indptr, kv_indices, rows,
            q.shape[-1] ** -0.5 if sm_scale is None else float(sm_scale), o, scratch, splits,
            k_scale=float(k_scale), v_scale=float(v_scale), mask=custom_mask if tree else None,
            mask_indptr=mask_indptr if tree else None)
        return True

    return grouped_verify_fwd


def zero_split_kv_scratch() -> None:
    """Patch 8's scratch change (see the module docstring). Idempotent."""
    from sglang.kernels.ops.attention import verify_splitkv

    def zeroed(stock):
        def _alloc(self, max_bs):
            stock(self, max_bs)
            self.att_out.zero_()

        return _alloc

    _wrap_once(verify_splitkv.VerifySplitKV, "_alloc", "_dspine_zeroed", zeroed)


def graph_split_count(requests: int, rows: int) -> int:
    """KV splits for a verify graph's split-KV attention (patch 8): 16 for a batch of at most 4 verify rows in all
    (too few programs to fill the GPU otherwise), else 4, what SGLang's own rule gives contexts under 4k tokens. A
    graph is replayed at any context, so the count cannot follow it; from the c615dca measurements (docstring)."""
    return 16 if requests * rows <= 4 else 4


def decode_one_row_verify(backend) -> str | None:
    """Patch 9 (see the module docstring): `backend`, the target's attention backend of a width-1 verify, runs its
    TARGET_VERIFY passes as decode passes (SGLang's decode kernel and metadata). Returns None where applied, else
    why not (another backend, or a layout the decode path reads differently)."""
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

    if type(backend) is not TritonAttnBackend:
        return f"the attention backend is {type(backend).__name__}, not SGLang's triton backend"
    if getattr(backend, "_dspine_decode_one_row", False):
        return None
    if int(backend.num_draft_tokens) != 1:
        raise ValueError(f"decode_one_row_verify: a backend of {backend.num_draft_tokens} verify rows, not 1")
    if dflash_plans_kv_locs():  # its decode metadata reads KV ids through the iteration's plan
        return "built on SGLang 0.5.17's triton backend (0.5.23 reads a pass's KV ids through its KVLocPlan)"
    if backend.sliding_window_size or backend.dcp_size > 1 or backend.use_mla or backend._translate_kv_loc:
        return "a sliding window, DCP, MLA or a virtual KV pool reads the decode path differently"
    for name in ("init_forward_metadata", "init_forward_metadata_out_graph", "forward_decode", "forward_extend"):
        if not callable(getattr(backend, name, None)):
            raise _not_found(f"TritonAttnBackend.{name}")
    init, init_out_graph, extend = (backend.init_forward_metadata, backend.init_forward_metadata_out_graph,
                                    backend.forward_extend)

    def init_forward_metadata(forward_batch):
        return init(_as_decode(forward_batch))

    def init_forward_metadata_out_graph(forward_batch, in_capture: bool = False):
        return init_out_graph(_as_decode(forward_batch), in_capture=in_capture)

    def forward_extend(q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        if forward_batch.forward_mode.is_target_verify():
            return backend.forward_decode(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
        return extend(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)

    backend.init_forward_metadata = init_forward_metadata
    backend.init_forward_metadata_out_graph = init_forward_metadata_out_graph
    backend.forward_extend = forward_extend
    backend._dspine_decode_one_row = True
    return None


def _as_decode(forward_batch):
    """A TARGET_VERIFY batch of one row a request as the decode batch it is, for the attention metadata: the mode
    DECODE, each length + 1 (the row's own slot, next in its request-to-token row), no speculative input. Other
    batches as they are. A shallow copy: a ForwardBatch, or the graph runner's replay view of one."""
    import copy

    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    if not forward_batch.forward_mode.is_target_verify():
        return forward_batch
    view = copy.copy(forward_batch)
    view.forward_mode, view.spec_info = ForwardMode.DECODE, None
    view.seq_lens = forward_batch.seq_lens + 1
    if getattr(forward_batch, "seq_lens_sum", None) is not None:
        view.seq_lens_sum = forward_batch.seq_lens_sum + len(forward_batch.seq_lens)
    if getattr(forward_batch, "seq_lens_cpu", None) is not None:
        view.seq_lens_cpu = forward_batch.seq_lens_cpu + 1
    return view


_graph_splits: int | None = None  # set during a graph-buffer call of the wrapped verify_splitkv_fwd


def with_graph_split_count(fwd, max_context_len: int):
    """`fwd` (SGLang's verify_splitkv_fwd, or the backend's handle on it) running `graph_split_count` KV splits
    where its index array is a CUDA graph's capture buffer (longer than requests × `max_context_len`), and as it
    is otherwise (patch 8). Idempotent."""
    if getattr(fwd, "_dspine_graph_splits", False):
        return fwd
    from sglang.kernels.ops.attention import verify_splitkv

    if "choose_n_splits" not in _names_used(verify_splitkv.verify_splitkv_fwd.__code__):
        raise _not_found("verify_splitkv_fwd's split count (choose_n_splits)")

    def choosing(stock):
        def choose_n_splits(avg_seqlen):
            return stock(avg_seqlen) if _graph_splits is None else _graph_splits

        return choose_n_splits

    _wrap_once(verify_splitkv, "choose_n_splits", "_dspine_graph_splits", choosing)

    @functools.wraps(fwd)
    def graph_split_fwd(q, k, v, o, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices, *args, **kwargs):
        global _graph_splits
        requests = max(1, qo_indptr.shape[0] - 1)
        if kv_indices.shape[0] <= requests * max_context_len:  # an exact array: SGLang's own choice
            return fwd(q, k, v, o, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices, *args, **kwargs)
        _graph_splits = graph_split_count(requests, q.shape[0] // requests)
        try:
            return fwd(q, k, v, o, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices, *args, **kwargs)
        finally:
            _graph_splits = None

    graph_split_fwd._dspine_graph_splits = True
    return graph_split_fwd


DECODE_LOG = "sglang.srt.managers.scheduler_components.metrics_reporter"  # the module whose logger writes the line


VERIFY_SHAPES_SUFFIX = ", verify shapes: "  # then "<shape> <steps>" items joined by ", ", to the line's end


class _VerifyShapesInDecodeLog(logging.Filter):
    """Appends the steps by shape since the previous decode line to each one (then starts counting anew)."""

    def __init__(self, steps):
        super().__init__()
        self.steps = steps  # a collections.Counter the worker adds each step's shape name to

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str) and record.msg.startswith("Decode batch") and self.steps:
            shares = ", ".join(f"{k} {v}" for k, v in sorted(self.steps.items()))
            record.msg = f"{record.msg}{VERIFY_SHAPES_SUFFIX}{shares}"
            self.steps.clear()
        return True


def verify_shapes_in_log(text: str) -> dict[str, int]:
    """Steps by verify shape summed over the decode lines of a server log `text` that patch 7 extended (the
    reader of the suffix above, for benchmarks reading a server's log)."""
    import collections

    total = collections.Counter()
    for line in text.splitlines():
        if "Decode batch" not in line or VERIFY_SHAPES_SUFFIX not in line:
            continue
        for item in line.rsplit(VERIFY_SHAPES_SUFFIX, 1)[1].strip().split(", "):
            name, steps = item.rsplit(" ", 1)
            total[name] += int(steps)
    return dict(total)


def show_verify_shapes_in_decode_log(steps) -> None:
    """Patch 7 (see the module docstring): `steps` is a Counter of shape names the worker adds to each step.
    Refused where SGLang's decode log line has moved (a changed SGLang would otherwise drop it silently)."""
    import importlib
    import inspect

    module = importlib.import_module(DECODE_LOG)
    reporter = getattr(module, "logger", None)
    if reporter is None or 'f"Decode batch' not in inspect.getsource(module):
        raise _not_found(f"{DECODE_LOG}'s decode log line")
    for f in list(reporter.filters):
        if isinstance(f, _VerifyShapesInDecodeLog):
            reporter.removeFilter(f)
    reporter.addFilter(_VerifyShapesInDecodeLog(steps))


def _check_drafter_first(algorithm, draft_path) -> None:
    algo = (algorithm or "").upper()
    if algo == ALGORITHM:
        check_drafter_folder(draft_path)
    elif algo == "DFLASH":
        check_not_a_dspine_drafter(draft_path)


_resolution_hook_registered = False


def check_drafters_first() -> None:
    """Patch 3 (see the module docstring). Idempotent."""
    global _resolution_hook_registered
    if sglang_version() >= (0, 5, 23):
        if _resolution_hook_registered:
            return
        from sglang.srt.arg_groups.overrides import resolving_view
        from sglang.srt.arg_groups.resolution_hooks import register_resolution_hook

        @register_resolution_hook("handle_speculative_decoding")
        def check_drafters_then(server_args, previous) -> None:
            cfg = resolving_view(server_args)  # the values as resolved so far (the record keeps the raw input)
            _check_drafter_first(cfg.speculative_algorithm, cfg.speculative_draft_model_path)
            previous(server_args)

        _resolution_hook_registered = True
        return

    from sglang.srt.arg_groups import speculative_hook

    def wrap(stock):
        def handle_speculative_decoding(server_args) -> None:
            _check_drafter_first(server_args.speculative_algorithm, server_args.speculative_draft_model_path)
            return stock(server_args)

        return handle_speculative_decoding

    _wrap_once(speculative_hook, "handle_speculative_decoding", "_dspine_checks_drafters", wrap)


def refusals_end_the_launcher_in_one_line() -> None:
    """Patch 4 (see the module docstring). Idempotent."""
    previous = sys.excepthook
    if getattr(previous, "_dspine_refusals", False):
        return

    def excepthook(etype, value, tb):
        if isinstance(value, StartupRefusal):
            print(f"sglang-dspine: error: {' '.join(str(value).split())}", file=sys.stderr, flush=True)
            sys.exit(2)
        previous(etype, value, tb)

    excepthook._dspine_refusals = True
    sys.excepthook = excepthook


def dspine_row_headroom(stock_headroom: int, block: int, page_size: int) -> int:
    """Patch 5's width: a row's headroom beyond the context length that holds DFlash's decode reservation
    (2 × block, rounded up to whole pages)."""
    return max(stock_headroom, 2 * block + page_size - 1)


def rows_hold_the_decode_reservation() -> None:
    """Patch 5 (see the module docstring). Idempotent. The row width is read through the module attribute its one
    caller imported; a caller imported later takes the wrapped function from `allocation_sizing`."""
    from sglang.srt.mem_cache import allocation_sizing

    def wrap(stock):
        def get_req_to_token_extra_context_len(*args, **kwargs) -> int:
            from sglang.srt.runtime_context import get_spec

            headroom = stock(*args, **kwargs)
            spec = get_spec()
            if (spec.speculative_algorithm or "").upper() != ALGORITHM:
                return headroom
            # 0.5.17 passes the server arguments; 0.5.23 reads the published configuration
            page_size = args[0].page_size if args else allocation_sizing.get_alloc_page_size()
            return dspine_row_headroom(headroom, int(spec.speculative_num_draft_tokens), int(page_size or 1))

        return get_req_to_token_extra_context_len

    replaced = _wrap_once(allocation_sizing, "get_req_to_token_extra_context_len", "_dspine_rows", wrap)
    if replaced is None:
        return
    stock, get_req_to_token_extra_context_len = replaced
    configurator = sys.modules.get("sglang.srt.mem_cache.kv_cache_configurator")
    if configurator is not None:
        if getattr(configurator, "get_req_to_token_extra_context_len", None) is not stock:
            raise _not_found("sglang.srt.mem_cache.kv_cache_configurator.get_req_to_token_extra_context_len")
        configurator.get_req_to_token_extra_context_len = get_req_to_token_extra_context_len


def tree_verify_graphs_read_the_mask() -> None:
    """Patch 6 (see the module docstring). Idempotent. Not on 0.5.23, where the tree is refused at start."""
    if sglang_version() >= (0, 5, 23):
        return
    from sglang.srt.speculative import dflash_utils

    def wrap(stock):
        def resolve_dflash_verify_mask_policy(attn_backend):
            from sglang.srt.runtime_context import get_spec

            from ..env import ENV
            from .verify_widths import building_chain_graphs

            name, build_custom_mask = stock(attn_backend)
            if ENV.tree and (get_spec().speculative_algorithm or "").upper() == ALGORITHM and \
                    not building_chain_graphs():
                return name, True
            return name, build_custom_mask

        return resolve_dflash_verify_mask_policy

    _wrap_once(dflash_utils, "resolve_dflash_verify_mask_policy", "_dspine_trees", wrap)


def apply_at_registration() -> None:
    check_drafters_first()
    refusals_end_the_launcher_in_one_line()
    rows_hold_the_decode_reservation()
    tree_verify_graphs_read_the_mask()
