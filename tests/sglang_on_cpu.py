"""What the tests that build SGLang's own modules on the CPU share (a helper, not a test module).

`server_args(...)`: a launch's server arguments, settled and checked as the server does it.
`setup(server_args)`: what a scheduler process has before it builds models: the published configuration, a
one-rank gloo process group (once per process: SGLang's parallel state is global) and CPU RoPE.
`draft_forward`: the SGLang DSpineDraftModel's forward over whole blocks, with the context K/V written into a real
draft KV pool the way SGLang's DFlash worker writes it, and the plain drafter's forward on the same inputs.
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


@torch.no_grad()
def draft_forward(model, plain, target, requests, seed: int = 3):
    """One draft forward of the SGLang model over one block per request, `requests` = [(context length, anchor)]:
    the context K/V written into a draft KV pool (SGLang's MHATokenToKVPool, torch-native attention) by the
    model's own projections as the DFlash worker does, the block [anchor, mask...] embedded by the target.

    Returns (out, forward_batch, refs): SGLang's LogitsProcessorOutput (hidden states [n·B, H]), the ForwardBatch
    it ran on, and per request the plain drafter's BlockOutput on the same context and block."""
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

    dc, b, n = plain.cfg, plain.cfg.block_size, len(requests)
    pool = MHATokenToKVPool(size=256, page_size=1, dtype=torch.float32, head_num=dc.num_key_value_heads,
                            head_dim=dc.head_dim, layer_num=dc.num_hidden_layers, device="cpu",
                            enable_memory_saver=False, enable_alt_stream=False)
    req_to_token = ReqToTokenPool(size=max(4, n), max_context_len=128, device="cpu", enable_memory_saver=False)
    backend = TorchNativeAttnBackend(SimpleNamespace(device="cpu", req_to_token_pool=req_to_token,
                                                     token_to_kv_pool=pool))
    g = torch.Generator().manual_seed(seed)
    feats, block_locs, next_loc = [], [], 1
    for r, (s, _) in enumerate(requests):
        f = torch.randn(s, len(dc.target_layer_ids) * dc.hidden_size, generator=g)
        feats.append(f)
        locs = torch.arange(next_loc, next_loc + s + b)
        req_to_token.req_to_token[r, : s + b] = locs.to(req_to_token.req_to_token.dtype)
        ctx = model.project_target_hidden(f)  # the DFlash worker's per-layer context K/V write
        for layer in model.layers:
            attn = layer.self_attn
            k, v = attn.kv_proj_only(model.prepare_context_hidden_for_kv(layer, ctx))
            k = attn.apply_k_rope(torch.arange(s), attn.apply_k_norm(k))
            pool.set_kv_buffer(attn.attn, locs[:s], k.view(s, -1, dc.head_dim), v.view(s, -1, dc.head_dim), 1.0, 1.0)
        block_locs.append(locs[s:])
        next_loc += s + b
    ids = torch.tensor([[a] + [dc.mask_token_id] * (b - 1) for _, a in requests]).view(-1)
    emb = target.get_input_embeddings()(ids)
    positions = torch.cat([s + torch.arange(b) for s, _ in requests])
    fb = ForwardBatch(forward_mode=ForwardMode.EXTEND, batch_size=n, input_ids=ids,
                      req_pool_indices=torch.arange(n), seq_lens=torch.tensor([s + b for s, _ in requests]),
                      out_cache_loc=torch.cat(block_locs), seq_lens_sum=sum(s + b for s, _ in requests),
                      positions=positions, extend_prefix_lens=torch.tensor([s for s, _ in requests]),
                      extend_seq_lens=torch.tensor([b] * n))
    backend.init_forward_metadata(fb)
    with forward_context(ForwardContext(attn_backend=backend)):
        out = model.forward(ids, positions, fb, input_embeds=emb)
    refs = []
    for r, (s, a) in enumerate(requests):
        kv = plain.context_kv(feats[r][None], torch.arange(s)[None])
        refs.append(plain.forward_blocks(emb.view(n, b, -1)[r].view(1, 1, b, -1), (s + torch.arange(b)).view(1, 1, b),
                                         kv, torch.ones(1, 1, s, dtype=torch.bool), torch.tensor([[a]])))
    return out, fb, refs


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class TargetModel(torch.nn.Module):
    """What DFlash's worker reads from the target model: its `lm_head`."""

    def __init__(self, lm_head):
        super().__init__()
        self.lm_head = lm_head


def worker_shell(model, lm_head, block_size):
    """A DSpineWorker as DFlash's own draft-decoding methods see it: its block size, its draft model, the target
    worker's model (rank 0 of SGLang's TP group: the logging rank). Nothing else of a worker is built (no model
    runners on a CPU)."""
    from sglang_dspine.serving.worker import DSpineWorker

    worker = DSpineWorker.__new__(DSpineWorker)
    runner = SimpleNamespace(model=TargetModel(lm_head))
    attrs = dict(block_size=block_size, draft_model=model, _target_worker=SimpleNamespace(model_runner=runner),
                 ps=SimpleNamespace(tp_rank=0), _target_tp_rank=0)
    if on_0_5_23():  # read from the draft model and its config as DFlashWorkerV2.__init__ reads them
        from sglang.srt.speculative.dflash_utils import parse_dflash_draft_config

        attrs.update(selector=model.candidate_selector, lilicorr=model.lilicorr,
                     _is_domino=parse_dflash_draft_config(draft_hf_config=model.config).is_domino)
    for k, v in attrs.items():
        object.__setattr__(worker, k, v)
    return worker


def padded_head(head: torch.Tensor, poison: bool = True):
    """SGLang's ParallelLMHead for `head` [V, H] on this rank, loaded by its own weight loader (the vocabulary
    padded to a multiple of 64 and split over the TP ranks), the padded rows poisoned with huge logits."""
    from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead

    lm_head = ParallelLMHead(head.shape[0], head.shape[1], params_dtype=torch.float32)
    lm_head.weight.data.fill_(float("nan"))
    lm_head.weight_loader(lm_head.weight, head)
    if poison:
        n = int(lm_head.shard_indices.num_org_elements)
        lm_head.weight.data[n:] = 50 * head.abs().max()
    return lm_head


def tp_main(root: str, world: int, inputs_file: str, out_dir: str) -> None:
    """A tensor-parallel DSPINE draft decoding over `world` ranks, run in a fresh interpreter: SGLang imported and
    the launch's server arguments (`--tp-size world`) settled once, then one forked process a rank (`tp_rank`);
    each writes what it found to out_dir/rank{r}.json."""
    import multiprocessing

    os.environ.setdefault("TRITON_INTERPRET", "1")
    from pathlib import Path

    import sglang.srt.distributed.parallel_state  # noqa: F401  (imported once, before the ranks fork)

    import sglang_dspine.serving.worker  # noqa: F401

    root_path = Path(root)
    args = server_args(root_path / "target", root_path / "dspine", "DSPINE", "--tp-size", str(world))
    inputs = torch.load(inputs_file)
    port, ctx = free_port(), multiprocessing.get_context("fork")
    ranks = [ctx.Process(target=tp_rank, args=(r, world, port, root, args, inputs, out_dir)) for r in range(world)]
    for p in ranks:
        p.start()
    for p in ranks:
        p.join(timeout=300)
    codes = [p.exitcode for p in ranks]
    if codes != [0] * world:
        raise SystemExit(f"tensor-parallel ranks ended with exit codes {codes}")


def tp_rank(rank: int, world: int, port: int, root: str, args, inputs: dict, out_dir: str) -> None:
    """One rank: SGLang's TP group over gloo, the SGLang draft model loaded with its weights sharded, SGLang's
    ParallelLMHead holding this rank's rows of the padded head, and DFlash's eager hook
    (`_greedy_sample_from_vocab_parallel_head`, overridden by DSPINE) decoding the block from the model-forward
    state in `inputs`."""
    import json
    from pathlib import Path

    import sglang.srt.distributed.parallel_state as parallel_state
    import sglang.srt.layers.rotary_embedding.base as rope_base
    from safetensors.torch import load_file
    from sglang.srt.distributed import init_distributed_environment, initialize_model_parallel
    from sglang.srt.runtime_context import publish

    # No NCCL on a CPU: SGLang's groups of several ranks without their PyNccl communicator and custom all-reduce
    # (collectives then run on the gloo device group).
    build_group = parallel_state.init_model_parallel_group
    parallel_state.init_model_parallel_group = lambda *a, **k: build_group(*a, **{**k, "use_pynccl": False})
    parallel_state.set_custom_all_reduce(False)
    # SGLang's all-gather goes through a custom op (`reg_all_gather_into_tensor`) registered for accelerators only;
    # its body is the group's own `_all_gather_into_tensor` (gloo on a CPU), called here directly.
    parallel_state.GroupCoordinator.all_gather_into_tensor = parallel_state.GroupCoordinator._all_gather_into_tensor
    torch.set_num_threads(1)
    publish(args, role="test")
    init_distributed_environment(backend="gloo", world_size=world, rank=rank, local_rank=rank,
                                 distributed_init_method=f"tcp://127.0.0.1:{port}")
    if on_0_5_23():
        from sglang.srt.runtime_context import get_parallel

        initialize_model_parallel()
        get_parallel().override_permanently(tp_rank=rank)
    else:
        initialize_model_parallel(tensor_model_parallel_size=world)
    rope_base._is_cpu, rope_base._is_cpu_amx_available = True, False
    root = Path(root)
    model = sglang_model(root / "dspine").float()
    model.load_weights(iter(load_file(root / "dspine" / "model.safetensors").items()))
    lm_head = padded_head(inputs["head"])
    info = lm_head.shard_indices
    worker = worker_shell(model, lm_head, model.draft_step.block_size)
    step = model.draft_step
    with torch.no_grad():
        step.begin(inputs["anchors"])  # what the draft model's forward hands the step
        step.inject(inputs["pre_last"], step.num_layers - 1)
        tokens = worker._greedy_sample_from_vocab_parallel_head(hidden_states=inputs["states"], lm_head=lm_head)
    found = dict(tokens=tokens.tolist(), start=step.shard.start, size=step.shard.size, world=step.shard.world,
                 rows=int(lm_head.weight.shape[0]), org_start=int(info.org_vocab_start_index),
                 org_size=int(info.num_org_elements), kernels=step.kernels, on_kernels=step.decodes_on_kernels)
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(found))
