"""What the tests that build SGLang's own modules on the CPU share (a helper, not a test module).

`server_args(...)`: a launch's server arguments, settled and checked as the server does it.
`setup(server_args)`: what a scheduler process has before it builds models: the published configuration, a
one-rank gloo process group (once per process: SGLang's parallel state is global) and CPU RoPE.
`draft_kv`, `write_context`, `draft_block`: a draft KV pool as DFlash's worker keeps it, the context K/V written
into it the way the worker writes it, and the SGLang DSpineDraftModel's forward over one block a request reading
it; `draft_forward`: the three together, and the plain drafter's forward on the same inputs.
`ranks_main`: a launch's ranks (tensor parallelism, data-parallel attention) as forked processes over gloo.
"""
from __future__ import annotations

import os
import socket
from types import SimpleNamespace

import torch

_distributed = False


def on_0_5_23() -> bool:
    from sglang_dspine.serving.plugin import sglang_version

    return sglang_version() >= (0, 5, 23)


def server_args(target, draft, algorithm: str = "DSPINE", *extra):
    """The server arguments of a launch with this command line, settled and checked as the server does it
    (0.5.23 settles the record after parsing: `resolve_once()`; 0.5.17 while parsing)."""
    from sglang.srt.server_args import prepare_server_args

    import sglang_dspine.serving.plugin as p

    p.register()
    args = prepare_server_args(["--model-path", str(target), "--speculative-algorithm", algorithm,
                                "--speculative-draft-model-path", str(draft), "--device", "cuda", *extra])
    if on_0_5_23():
        args.resolve_once()
    args.check_server_args()
    return args


def resolved(args):
    """What the server reads from settled arguments (0.5.23: through a view of the record)."""
    if not on_0_5_23():
        return args
    from sglang.srt.arg_groups.overrides import resolving_view

    return resolving_view(args)


def setup(server_args) -> None:
    global _distributed
    import sglang.srt.layers.rotary_embedding.base as rope_base
    from sglang.srt.runtime_context import publish

    publish(server_args, role="test")
    if not _distributed:
        from sglang.srt.distributed import init_distributed_environment, initialize_model_parallel

        with socket.socket() as s:  # a free port: other test runs may share the machine
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        init_distributed_environment(backend="gloo", world_size=1, rank=0, local_rank=0,
                                     distributed_init_method=f"tcp://127.0.0.1:{port}")
        if on_0_5_23():
            initialize_model_parallel()  # 0.5.23 reads the widths from the published configuration
        else:
            initialize_model_parallel(tensor_model_parallel_size=1)
        _distributed = True
    if on_0_5_23():  # this process's place in the (one-rank) tensor-parallel group, as a rank bundle states it
        from sglang.srt.runtime_context import get_parallel

        get_parallel().override_permanently(tp_rank=0)
    rope_base._is_cpu, rope_base._is_cpu_amx_available = True, False


def sglang_model(path):
    from sglang.srt.utils.hf_transformers_utils import get_config

    from sglang_dspine.serving.sglang_model import DSpineDraftModel

    return DSpineDraftModel(get_config(str(path), trust_remote_code=False))


def prepared_block(r2t, prefix, pool, bonus, block: int, mask_token_id: int):
    """What DFlash's block-preparation kernel (`_prepare_dflash_draft_block_unchecked`, Triton's interpreter on the
    CPU) gives requests in rows `pool` of `r2t` at committed lengths `prefix` with anchors `bonus`: (block ids,
    positions, KV slots), each [bs, block] int64."""
    from sglang.kernels.ops.speculative.dflash import _prepare_dflash_draft_block_unchecked

    ids, pos, loc = (torch.empty(len(prefix), block, dtype=torch.long) for _ in range(3))
    _prepare_dflash_draft_block_unchecked(bonus_tokens=bonus, prefix_lens=prefix, req_pool_indices=pool,
                                          req_to_token=r2t, block_ids_out=ids, positions_out=pos, cache_loc_out=loc,
                                          mask_token_id=mask_token_id)
    return ids, pos, loc


def draft_kv(dc, rows: int = 4, size: int = 256, device: str = "cpu"):
    """A draft KV pool for drafter config `dc` (SGLang's MHATokenToKVPool, page size 1, float32) and its
    request-to-token rows (ReqToTokenPool), on the CPU (or `device`)."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

    pool = MHATokenToKVPool(size=size, page_size=1, dtype=torch.float32, head_num=dc.num_key_value_heads,
                            head_dim=dc.head_dim, layer_num=dc.num_hidden_layers, device=device,
                            enable_memory_saver=False, enable_alt_stream=False)
    return pool, ReqToTokenPool(size=rows, max_context_len=128, device=device, enable_memory_saver=False)


def write_context(model, pool, locs, feats) -> None:
    """The context K/V of one request (target features `feats` [s, L·H] at positions 0..s-1) written into `pool` at
    slots `locs` by the model's own projections, as DFlash's worker writes it per layer."""
    s, dim = feats.shape[0], pool.head_dim
    ctx = model.project_target_hidden(feats)
    for layer in model.layers:
        attn = layer.self_attn
        k, v = attn.kv_proj_only(model.prepare_context_hidden_for_kv(layer, ctx))
        k = attn.apply_k_rope(torch.arange(s, device=feats.device), attn.apply_k_norm(k))
        pool.set_kv_buffer(attn.attn, locs[:s], k.view(s, -1, dim), v.view(s, -1, dim), 1.0, 1.0)


@torch.no_grad()
def draft_block(model, target, pool, req_to_token, rows, seq_lens, anchors, mask_token_id: int):
    """One draft forward of the SGLang model over a block [anchor, mask...] per request, as DFlash's decode step
    builds it: request n in row `rows[n]` of `req_to_token`, its context the first `seq_lens[n]` slots of the row
    (read from `pool`, torch-native attention), the block at positions seq_len.. written to the row's next slots,
    embedded by the target. Returns SGLang's LogitsProcessorOutput (hidden states [n·B, H]), the ForwardBatch and
    the block embeddings [n, B, H]."""
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

    b, n = int(model.block_size), len(rows)
    rows, seq_lens, anchors = (torch.as_tensor(x, dtype=torch.int64) for x in (rows, seq_lens, anchors))
    backend = TorchNativeAttnBackend(SimpleNamespace(device="cpu", req_to_token_pool=req_to_token,
                                                     token_to_kv_pool=pool))
    ids = torch.cat([anchors.view(n, 1), torch.full((n, b - 1), mask_token_id)], 1).view(-1)
    emb = target.get_input_embeddings()(ids)
    positions = (seq_lens.view(n, 1) + torch.arange(b)).view(-1)
    block_locs = req_to_token.req_to_token[rows.view(n, 1), positions.view(n, b)].reshape(-1).to(torch.int64)
    fb = ForwardBatch(forward_mode=ForwardMode.EXTEND, batch_size=n, input_ids=ids, req_pool_indices=rows,
                      seq_lens=seq_lens + b, out_cache_loc=block_locs, seq_lens_sum=int((seq_lens + b).sum()),
                      positions=positions, extend_prefix_lens=seq_lens, extend_seq_lens=torch.full((n,), b))
    backend.init_forward_metadata(fb)
    with forward_context(ForwardContext(attn_backend=backend)):
        out = model.forward(ids, positions, fb, input_embeds=emb)
    return out, fb, emb.view(n, b, -1)


@torch.no_grad()
def draft_forward(model, plain, target, requests, seed: int = 3):
    """One draft forward of the SGLang model over one block per request, `requests` = [(context length, anchor)]:
    the context K/V written into a draft KV pool (SGLang's MHATokenToKVPool, torch-native attention) by the
    model's own projections as the DFlash worker does, the block [anchor, mask...] embedded by the target.

    Returns (out, forward_batch, refs): SGLang's LogitsProcessorOutput (hidden states [n·B, H]), the ForwardBatch
    it ran on, and per request the plain drafter's BlockOutput on the same context and block."""
    dc, b, n = plain.cfg, plain.cfg.block_size, len(requests)
    pool, req_to_token = draft_kv(dc, rows=max(4, n))
    g = torch.Generator().manual_seed(seed)
    feats, next_loc = [], 1
    for r, (s, _) in enumerate(requests):
        feats.append(torch.randn(s, len(dc.target_layer_ids) * dc.hidden_size, generator=g))
        locs = torch.arange(next_loc, next_loc + s + b)
        req_to_token.req_to_token[r, : s + b] = locs.to(req_to_token.req_to_token.dtype)
        write_context(model, pool, locs, feats[r])
        next_loc += s + b
    out, fb, emb = draft_block(model, target, pool, req_to_token, range(n), [s for s, _ in requests],
                               [a for _, a in requests], dc.mask_token_id)
    return out, fb, plain_refs(plain, emb, feats, [a for _, a in requests])


def plain_refs(plain, emb, feats, anchors):
    """Per request, the plain drafter's BlockOutput on context features `feats[n]` and block embeddings `emb[n]`."""
    b = plain.cfg.block_size
    refs = []
    for r, a in enumerate(anchors):
        s = feats[r].shape[0]
        kv = plain.context_kv(feats[r][None], torch.arange(s)[None])
        refs.append(plain.forward_blocks(emb[r].view(1, 1, b, -1), (s + torch.arange(b)).view(1, 1, b), kv,
                                         torch.ones(1, 1, s, dtype=torch.bool), torch.tensor([[int(a)]])))
    return refs


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class TargetModel(torch.nn.Module):
    """What DFlash's worker reads from the target model: its `lm_head`."""

    def __init__(self, lm_head):
        super().__init__()
        self.lm_head = lm_head


def worker_shell(model, lm_head, block_size, draft_pool=None, cls=None, device: str = "cpu"):
    """A DSpineWorker as DFlash's own draft-decoding methods see it: its block size, its draft model, the target
    worker's model (rank 0 of SGLang's TP group: the logging rank); with `draft_pool`, what DFlash's context writer
    (`_append_target_hidden_to_draft_kv_by_loc`) reads too: the draft KV pool, the device, the draft's placement
    and no fused writer. Nothing else of a worker is built (no model runners on a CPU)."""
    from sglang_dspine.serving.worker import DSpineWorker

    cls = cls or DSpineWorker
    worker = cls.__new__(cls)
    runner = SimpleNamespace(model=TargetModel(lm_head))
    attrs = dict(block_size=block_size, draft_model=model, _target_worker=SimpleNamespace(model_runner=runner),
                 ps=SimpleNamespace(tp_rank=0), _target_tp_rank=0)
    if on_0_5_23():  # read from the draft model and its config as DFlashWorkerV2.__init__ reads them
        from sglang.srt.speculative.dflash_utils import parse_dflash_draft_config

        attrs.update(selector=model.candidate_selector, lilicorr=model.lilicorr,
                     _is_domino=parse_dflash_draft_config(draft_hf_config=model.config).is_domino)
    if draft_pool is not None:
        attrs.update(model_runner=SimpleNamespace(device=torch.device(device)), device=torch.device(device),
                     draft_model_runner=SimpleNamespace(token_to_kv_pool=draft_pool),
                     _use_fused_kv_materialize=False, _fused_kv_helper=None)
        if on_0_5_23():  # as DFlashWorkerV2.__init__ resolves it for the drafter's class
            from sglang.srt.speculative.draft_parallel import resolve_draft_parallel_layout

            attrs.update(draft_parallel_layout=resolve_draft_parallel_layout(type(model).draft_parallel_spec,
                                                                             collapse_cp=True))
    for k, v in attrs.items():
        object.__setattr__(worker, k, v)
    return worker


def step_shell(served, cls, reserve: int, seed: int, device: str = "cpu"):
    """What a decode step's tail runs on, on the CPU (or `device`): test_serving_glue's pair (`served`, B = 4), the
    SGLang draft model with its weights, a draft KV pool and a shell of worker class `cls` (`worker_shell`), and
    three requests with random context features already written into the draft KV, each with `reserve` slots past
    its committed length (SGLang reserves 2 N). Returns a namespace: model, pool, req_to_token, worker, g (the
    generator, for the test's own draws), width (feature size), seq_lens, anchors, req (pool rows), ctx_feats."""
    from safetensors.torch import load_file
    from test_serving_glue import _padded_head

    dc = served.plain.cfg
    assert dc.block_size == 4
    model = sglang_model(served.root / "dspine").float()
    model.load_weights(iter(load_file(served.root / "dspine" / "model.safetensors").items()))
    model = model.to(device)
    if device != "cpu":  # SGLang's ops (norms, RoPE) on their PyTorch path: sgl_kernel's rmsnorm takes no float32
        from sglang.srt.layers.utils.multi_platform import MultiPlatformOp

        for op in model.modules():
            if isinstance(op, MultiPlatformOp):
                op._forward_method = op.forward_native
    pool, req_to_token = draft_kv(dc, device=device)
    worker = worker_shell(model, _padded_head(served), dc.block_size, draft_pool=pool, cls=cls, device=device)
    g = torch.Generator().manual_seed(seed)
    width = len(dc.target_layer_ids) * dc.hidden_size
    seq_lens, anchors, req = (torch.tensor(x, device=device) for x in ([6, 3, 8], [5, 11, 30], [2, 0, 1]))
    ctx_feats = [torch.randn(s, width, generator=g).to(device) for s in seq_lens.tolist()]
    nxt = 1
    for r, s, feats in zip(req.tolist(), seq_lens.tolist(), ctx_feats):
        req_to_token.req_to_token[r, : s + reserve] = torch.arange(nxt, nxt + s + reserve, dtype=torch.int32)
        write_context(model, pool, torch.arange(nxt, nxt + s, device=device), feats)
        nxt += s + reserve
    return SimpleNamespace(model=model, pool=pool, req_to_token=req_to_token, worker=worker, g=g, width=width,
                           seq_lens=seq_lens, anchors=anchors, req=req, ctx_feats=ctx_feats)


def assert_chain_state(served, shell, committed_feats, next_draft_input) -> None:
    """After a step whose committed rows had target features `committed_feats[i]` for request i: at every
    committed position the draft K/V is what DFlash's writer makes from those features, and the next step's
    draft (from `next_draft_input`'s bonus tokens and lengths) is the plain drafter's on the context extended by
    them: the per-request state a chain step leaves."""
    plain, dc, b = served.plain, served.plain.cfg, served.plain.cfg.block_size
    ref_pool, _ = draft_kv(dc)
    full_feats = []
    for i, (r, s, feats) in enumerate(zip(shell.req.tolist(), shell.seq_lens.tolist(), committed_feats)):
        f = torch.cat([shell.ctx_feats[i], feats])
        full_feats.append(f)
        slots = shell.req_to_token.req_to_token[r, : s + len(feats)].long()
        with torch.no_grad():
            write_context(shell.model, ref_pool, slots, f)
        for layer in range(dc.num_hidden_layers):
            for got, want in ((shell.pool.get_key_buffer(layer), ref_pool.get_key_buffer(layer)),
                              (shell.pool.get_value_buffer(layer), ref_pool.get_value_buffer(layer))):
                torch.testing.assert_close(got[slots], want[slots], atol=1e-5, rtol=1e-5)
    nd, worker = next_draft_input, shell.worker
    blk, _, emb = draft_block(worker.draft_model, served.target, shell.pool, shell.req_to_token, shell.req,
                              nd.new_seq_lens, nd.bonus_tokens, dc.mask_token_id)
    states = blk.hidden_states.view(len(shell.req), b, -1)[:, 1:].reshape(-1, dc.hidden_size)
    with torch.no_grad():
        drafted = worker._greedy_sample_from_vocab_parallel_head(
            hidden_states=states, lm_head=worker._target_worker.model_runner.model.lm_head).view(-1, b - 1)
    refs = plain_refs(plain, emb, full_feats, nd.bonus_tokens.tolist())
    head = served.target.lm_head.weight.detach()
    want = [plain.draft(ref, head, torch.tensor([a])).tokens[0].tolist() for ref, a in zip(refs, nd.bonus_tokens)]
    assert drafted.tolist() == want


def padded_head(head: torch.Tensor, poison: bool = True, use_attn_tp_group: bool = False):
    """SGLang's ParallelLMHead for `head` [V, H] on this rank, loaded by its own weight loader (the vocabulary
    padded to a multiple of 64 and split over the TP ranks, or with `use_attn_tp_group` over this rank's
    attention-TP group, as a Qwen3 target builds it under --enable-dp-lm-head), the padded rows poisoned with
    huge logits."""
    from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead

    group = dict(use_attn_tp_group=True) if use_attn_tp_group else {}
    lm_head = ParallelLMHead(head.shape[0], head.shape[1], params_dtype=torch.float32, **group)
    lm_head.weight.data.fill_(float("nan"))
    lm_head.weight_loader(lm_head.weight, head)
    if poison:
        n = int(lm_head.shard_indices.num_org_elements)
        lm_head.weight.data[n:] = 50 * head.abs().max()
    return lm_head


def ranks_main(rank_fn: str, root: str, flags: list, inputs_file: str, out_dir: str, timeout: float = 300) -> None:
    """A DSPINE launch's ranks, run in a fresh interpreter: SGLang imported and the launch's server arguments (the
    test pair under `root` with `flags`, e.g. `--tp-size 2`) settled once, then one forked process a rank of SGLang's
    world (its TP width) running `rank_fn` (`tp_rank`, `dp_rank`) on the inputs in `inputs_file`; each writes what
    it found to out_dir/rank{r}.json. A rank still running after `timeout` seconds (a collective some rank never
    joined) is ended, and the launch fails."""
    import multiprocessing
    import time

    os.environ.setdefault("TRITON_INTERPRET", "1")
    from pathlib import Path

    import sglang.srt.distributed.parallel_state  # noqa: F401  (imported once, before the ranks fork)

    import sglang_dspine.serving.worker  # noqa: F401

    root_path = Path(root)
    args = server_args(root_path / "target", root_path / "dspine", "DSPINE", *flags)
    world = int(resolved(args).tp_size)
    inputs = torch.load(inputs_file)
    port, ctx = free_port(), multiprocessing.get_context("fork")
    fn = globals()[rank_fn]
    ranks = [ctx.Process(target=fn, args=(r, world, port, root, args, inputs, out_dir)) for r in range(world)]
    for p in ranks:
        p.start()
    deadline = time.monotonic() + timeout
    for p in ranks:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in ranks:
        if p.is_alive():
            p.kill()
            p.join()
    codes = [p.exitcode for p in ranks]
    if codes != [0] * world:
        raise SystemExit(f"ranks ended with exit codes {codes} (negative: ended by a signal, e.g. after {timeout} s)")


def join_gloo(rank: int, world: int, port: int, args) -> None:
    """What a scheduler process of a `world`-rank launch has before it builds models: the published configuration
    with this process's place in it (0.5.23: SGLang's own placement from the world rank: TP, attention-TP and
    attention-DP ranks), SGLang's process groups over gloo, CPU RoPE.

    No NCCL on a CPU: SGLang's groups of several ranks are built without their PyNccl communicator and custom
    all-reduce (collectives then run on the gloo device group)."""
    import sglang.srt.distributed.parallel_state as parallel_state
    import sglang.srt.layers.rotary_embedding.base as rope_base
    from sglang.srt.distributed import init_distributed_environment, initialize_model_parallel
    from sglang.srt.runtime_context import publish

    build_group = parallel_state.init_model_parallel_group
    parallel_state.init_model_parallel_group = lambda *a, **k: build_group(*a, **{**k, "use_pynccl": False})
    parallel_state.set_custom_all_reduce(False)
    # SGLang's all-gather goes through a custom op (`reg_all_gather_into_tensor`) registered for accelerators only;
    # its body is the group's own `_all_gather_into_tensor` (gloo on a CPU), called here directly.
    parallel_state.GroupCoordinator.all_gather_into_tensor = parallel_state.GroupCoordinator._all_gather_into_tensor
    torch.set_num_threads(1)
    if on_0_5_23():
        from sglang.srt.runtime_context import SpawnRanks

        publish(args, role="test", ranks=SpawnRanks(world_rank=rank))
    else:
        publish(args, role="test")
    init_distributed_environment(backend="gloo", world_size=world, rank=rank, local_rank=rank,
                                 distributed_init_method=f"tcp://127.0.0.1:{port}")
    if on_0_5_23():
        initialize_model_parallel()  # the widths from the published configuration
    else:
        initialize_model_parallel(tensor_model_parallel_size=world)
    rope_base._is_cpu, rope_base._is_cpu_amx_available = True, False


def _loaded_model(root, lm_head):
    """The SGLang draft model of the pair under `root`, loaded with its weights (sharded as this rank's group
    asks), and a worker shell over it and `lm_head`."""
    from pathlib import Path

    from safetensors.torch import load_file

    root = Path(root)
    model = sglang_model(root / "dspine").float()
    model.load_weights(iter(load_file(root / "dspine" / "model.safetensors").items()))
    return model, worker_shell(model, lm_head, model.draft_step.block_size)


def _draft(worker, lm_head, batch):
    """DFlash's eager hook (`_greedy_sample_from_vocab_parallel_head`, overridden by DSPINE) decoding the block of
    `batch` (what the draft model's forward left: anchors, the last layer's state, the final states)."""
    step = worker.draft_model.draft_step
    with torch.no_grad():
        step.begin(batch["anchors"])  # what the draft model's forward hands the step
        step.inject(batch["pre_last"], step.num_layers - 1)
        return worker._greedy_sample_from_vocab_parallel_head(hidden_states=batch["states"], lm_head=lm_head)


def _shard_found(worker, lm_head) -> dict:
    step, info = worker.draft_model.draft_step, lm_head.shard_indices
    return dict(start=step.shard.start, size=step.shard.size, world=step.shard.world,
                rows=int(lm_head.weight.shape[0]), org_start=int(info.org_vocab_start_index),
                org_size=int(info.num_org_elements), kernels=step.kernels, on_kernels=step.decodes_on_kernels)


def tp_rank(rank: int, world: int, port: int, root: str, args, inputs: dict, out_dir: str) -> None:
    """One rank of a tensor-parallel launch: SGLang's TP group over gloo, the SGLang draft model loaded with its
    weights sharded, SGLang's ParallelLMHead holding this rank's rows of the padded head, and DFlash's eager hook
    decoding the block from the model-forward state in `inputs`."""
    import json
    from pathlib import Path

    join_gloo(rank, world, port, args)
    lm_head = padded_head(inputs["head"])
    _, worker = _loaded_model(root, lm_head)
    tokens = _draft(worker, lm_head, inputs)
    found = dict(tokens=tokens.tolist(), **_shard_found(worker, lm_head))
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(found))


def dp_rank(rank: int, world: int, port: int, root: str, args, inputs: dict, out_dir: str) -> None:
    """One rank of a launch with data-parallel attention (SGLang 0.5.23, --enable-dp-lm-head): SGLang's groups over
    gloo, the draft's placement resolved as DFlash's worker resolves it (`model_draft_parallel_spec` of the
    drafter's architecture under DSPINE, `resolve_draft_parallel_layout`), the target head split over this rank's
    attention-TP group as the target builds it, the draft model built and loaded inside the draft's scope
    (`draft_tp_context`), and for each step in `inputs["steps"]` this DP group's block decoded by DFlash's eager hook
    inside that scope, as DFlash's worker calls it, or nothing where the group is idle (DFlash's worker drafts
    nothing for an idle batch)."""
    import json
    from pathlib import Path

    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.runtime_context import get_parallel
    from sglang.srt.speculative.draft_parallel import model_draft_parallel_spec, resolve_draft_parallel_layout
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang.srt.speculative.spec_utils import draft_tp_context

    join_gloo(rank, world, port, args)
    parallel = get_parallel()
    draft_config = ModelConfig.from_server_args(args, model_path=str(Path(root) / "dspine"), is_draft_model=True)
    layout = resolve_draft_parallel_layout(
        model_draft_parallel_spec(draft_config, spec_algorithm=SpeculativeAlgorithm.from_string("DSPINE")),
        collapse_cp=True)
    lm_head = padded_head(inputs["head"], use_attn_tp_group=bool(parallel.enable_dp_lm_head))
    with draft_tp_context(layout):
        _, worker = _loaded_model(root, lm_head)
    dp = int(parallel.attn_dp_rank)
    found = dict(dp_rank=dp, attn_tp_rank=int(parallel.attn_tp_rank),
                 group=None if layout.tp_group is None else list(layout.tp_group.ranks), steps=[])
    for batches in inputs["steps"]:
        batch = batches[dp]
        if batch is None:
            found["steps"].append(None)
            continue
        with draft_tp_context(layout):
            found["steps"].append(_draft(worker, lm_head, batch).tolist())
    found.update(_shard_found(worker, lm_head))
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(found))
