"""The serving glue with SGLang imported for real (CPU): every DFlash hook DSPINE overrides and every SGLang name it
patches, called the way SGLang's DFlash code calls it and compared by value with an independent reference.

- the names exist in the installed SGLang, and a DSPINE server whose SGLang lacks a hook (or no longer calls it)
  is refused at start in one line, instead of serving DFlash's argmax drafting under the DSPINE name;
- the draft sampler that DFlash's own `_maybe_build_draft_sampler` builds for DSPINE, run through DFlash's
  capture hook on the SGLang draft model's output, and the eager `_greedy_sample_from_vocab_parallel_head`, draft
  the plain drafter's tokens from a real `ParallelLMHead` whose vocabulary SGLang pads (the padded rows are
  poisoned: a sampler that read them would pick them);
- the verify renormalisation patch: the functions DFlash's verify calls after the patch, called as it calls them
  (and through its own caller), against an explicit sort-and-renormalise reference with FlashInfer's semantics;
- lossless sampling through DFlash's verify as DSPINE drives it (T = 0.7 and 1.3, top-k, top-p, a logit bias, a
  greedy request in the batch): what it emits over many samples against the target's exact distribution;
- a checkpoint in SpecForge's own layout loaded by SGLang's DSpineDraftModel;
- the random DFlash2 drafter the step-cost benchmark serves beside DSPINE, built and loaded by SGLang 0.5.23's own
  DFlash2DraftModel (0.5.17, which has none, is refused in one line);
- tensor parallelism: two ranks under gloo, SGLang's TP group and padded ParallelLMHead, each rank's shard.
Tests marked `gpu` run the verify with SGLang's CUDA acceptance kernel itself (scripts/device/gpu_tests.sh).
"""
import importlib
import json
import math
import os
import subprocess
import sys
import types

import pytest
import sglang  # noqa: F401  (SGLang imported for real: a broken install fails these tests, never skips them)
import sglang_on_cpu
import torch
from conftest import randomize_injection
from safetensors.torch import load_file

from sglang_dspine.drafter.checkpoint import save_drafter
from sglang_dspine.drafter.tiny import make_target, tiny_drafter
from sglang_dspine.serving import sglang_patches, versions
from sglang_dspine.serving.plugin import StartupRefusal

VOCAB = 50  # SGLang pads a head's vocabulary to a multiple of 64: rows 50..63 are padding


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    return served_pair(tmp_path_factory.mktemp("glue"))


def served_pair(root):
    """A target with a vocabulary SGLang pads, a DSpine drafter for it (random injection: its walk leaves the
    backbone's argmax), the launch's server arguments published, SGLang's parallel state on one rank."""
    target = make_target(vocab=VOCAB, seed=5)
    target.save_pretrained(root / "target")
    plain = randomize_injection(tiny_drafter(target, seed=2), seed=4, std=0.4)
    save_drafter(plain, root / "dspine")
    args = sglang_on_cpu.server_args(root / "target", root / "dspine", "DSPINE", "--sampling-backend", "pytorch")
    sglang_on_cpu.setup(args)
    return types.SimpleNamespace(root=root, target=target, plain=plain, args=args)


# ------------------------------------------------------------------------------------ hooks exist, or refusal
def test_every_dflash_name_dspine_overrides_or_patches_exists(served):
    """Every method DSPINE's worker and draft model override is a method of SGLang's DFlash classes, the worker's
    draft-decoding overrides are exactly the hooks the start-up check covers, and every SGLang name the patches
    replace or call is in the installed SGLang."""
    from sglang.srt.models.dflash import DFlashDraftModel
    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2

    from sglang_dspine.serving.sglang_model import DSpineDraftModel
    from sglang_dspine.serving.worker import DSpineWorker

    own = {DSpineWorker: {"_vocab_shard", "_attached_step", "_new_draft_sampler", "_tree_server_args", "_step",
                          "_verify_shape", "_read_finished_steps", "_count", "_logprobs_asked", "_prefix_step",
                          "_commit_prefix", "_tree_step", "_commit_tree_path", "_log_every", "_logprob_batch",
                          "tree_rows", "policy", "_width_kernels", "_split_kv_kernel", "_upkeep_graphs",
                          "_capture_upkeep"},
           DSpineDraftModel: {"_check_names", "_set_up_draft_step", "post_load_weights"}}
    parent = {DSpineWorker: DFlashWorkerV2, DSpineDraftModel: DFlashDraftModel}
    def members(cls):  # what the class body defines (not Python's own entries: dunders, the ABC cache)
        return {n for n in vars(cls) if not n.startswith("__") and n != "_abc_impl"}

    for cls, names in own.items():
        overridden = members(cls) - names
        assert overridden, cls
        for name in overridden:
            assert hasattr(parent[cls], name), f"{parent[cls].__name__}.{name}"
    # the worker overrides the hooks inside DFlash's step that the start-up check covers, and beside them only
    # the entry points SGLang itself calls (its decode steps run DFlash's step whole, or dflash_step's parts)
    checked = {name for module, owner, name, _ in sglang_patches.DFLASH_HOOKS if owner == "DFlashWorkerV2"}
    assert members(DSpineWorker) - own[DSpineWorker] == checked | {"init_attention_backends", "init_cuda_graphs",
                                                                   "forward_batch_generation", "target_worker"}
    # SGLang's loaders call post_load_weights (how a dummy-loaded drafter sets up its draft step)
    from sglang.srt.model_loader import loader

    post = loader.post_load_weights if sglang_on_cpu.on_0_5_23() else loader._post_load_weights
    assert "post_load_weights" in post.__code__.co_names
    patched = [("sglang.srt.speculative.dflash_utils", "top_k_renorm_prob"),
               ("sglang.srt.speculative.dflash_utils", "top_p_renorm_prob"),
               ("sglang.kernels.ops.sampling.renorm_triton", "top_k_renorm_probs_triton"),
               ("sglang.kernels.ops.sampling.renorm_triton", "top_p_renorm_probs_triton"),
               ("sglang.srt.runtime_context", "get_exec"),
               ("sglang.srt.managers.scheduler", "validate_dflash_request"),
               ("sglang.srt.speculative.spec_info", "SpeculativeAlgorithm")]
    if sglang_on_cpu.on_0_5_23():
        patched += [("sglang.srt.arg_groups.resolution_hooks", "register_resolution_hook"),
                    ("sglang.srt.arg_groups.overrides", "resolving_view"),
                    ("sglang.srt.layers.logprob_processor", "compute_spec_logprobs")]
    else:
        patched += [("sglang.srt.arg_groups.speculative_hook", "handle_speculative_decoding"),
                    ("sglang.srt.layers.logprob_processor", "compute_spec_v2_logprobs")]
    for module, name in patched:
        assert hasattr(importlib.import_module(module), name), f"{module}.{name}"
    assert sglang_patches.missing_dflash_hooks() == []


def test_the_tree_steps_block_preparation_at_the_chains_width_is_dflashs_kernels(tmp_path):
    """At N = B the tree step prepares the draft block with DFlash's one Triton kernel (Triton's interpreter
    here), at N > B with the eager operations over N verify slots: the kernel gives what those give at N = B (the
    anchor then mask tokens; positions seq_len + j; the slots req_to_token holds from seq_len on)."""
    bs, b, mask = 3, 4, 99
    r2t = torch.randint(0, 1000, (5, 40), dtype=torch.int32, generator=torch.Generator().manual_seed(5))
    prefix, pool, bonus = torch.tensor([3, 9, 0]), torch.tensor([4, 0, 2]), torch.tensor([7, 8, 9])
    ids, pos, loc = sglang_on_cpu.prepared_block(r2t, prefix, pool, bonus, b, mask)
    want_ids = torch.full((bs, b), mask)
    want_ids[:, 0] = bonus
    assert torch.equal(ids, want_ids) and torch.equal(pos, prefix[:, None] + torch.arange(b))
    # what assign_extend_cache_locs_func (a CUDA-only kernel) gives the eager path: req_to_token from seq_len on
    assert torch.equal(loc, r2t[pool[:, None], prefix[:, None] + torch.arange(b)].long())


def test_what_dspines_steps_read_from_dflashs_step_is_listed_and_checked_at_start(served, monkeypatch):
    """DSPINE's own decode steps (a prefix of the block, none, a tree) run DFlash's decode step in parts
    (dflash_step.py). Every DFlash worker member they read (there, or in the worker's step methods) and every
    SGLang function they call is in `dflash_step_names()` (0.5.17's list, or 0.5.23's where that is installed: its
    step plans KV ids), the installed release has them all, and a server needing them (trees, adaptive
    verification) is refused at start in one line where one is missing. The tree, built on 0.5.17's step only,
    is refused outright on 0.5.23."""
    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2

    from sglang_dspine.serving import dflash_step, startup_checks, worker
    from sglang_dspine.serving.versions import class_names, names_used

    if sglang_on_cpu.on_0_5_23():
        with monkeypatch.context() as env:
            env.setenv("SGLANG_DSPINE_TREE", "1")
            with pytest.raises(startup_checks.StartupRefusal, match="built on SGLang 0.5.17's DFlash decode step"):
                startup_checks.check_tree(served.args)
    assert dflash_step.missing_dflash_step_names() == []
    names = dflash_step.dflash_step_names()
    listed = {name for _, owner, name, _ in names if owner == "DFlashWorkerV2"}
    functions = {name for _, owner, name, _ in names if owner is None}
    dflash = set(dir(DFlashWorkerV2)) | class_names(DFlashWorkerV2)
    hooks = {name for _, owner, name, _ in sglang_patches.DFLASH_HOOKS if owner == "DFlashWorkerV2"}
    steps = [f for f in vars(dflash_step).values() if getattr(f, "__module__", None) == dflash_step.__name__
             and hasattr(f, "__code__")]
    steps += [f for n, f in vars(worker.DSpineWorker).items() if n in ("_prefix_step", "_commit_prefix", "_tree_step",
                                                                      "_commit_tree_path")]
    read = set().union(*(names_used(f.__code__) for f in steps))
    private = {n for n in read & dflash if n.startswith("_") and not n.startswith("__")} - hooks - functions
    assert private <= listed, private - listed
    assert functions <= read, functions - read  # the list names nothing the steps do not use
    # a listed member gone: a server that runs DSPINE's own steps is refused when its arguments are handled
    monkeypatch.delattr(DFlashWorkerV2, "_make_next_draft_input_decode")
    monkeypatch.setenv("SGLANG_DSPINE_VERIFY", "adaptive")
    with pytest.raises(startup_checks.StartupRefusal, match="DFlashWorkerV2._make_next_draft_input_decode"):
        startup_checks.check_adaptive(served.args)


def _break(monkeypatch, module_name, owner_name, name, how):
    """Make the installed SGLang lack a hook ("removed") or keep it but stop calling it ("not called": every
    function of DFlash's that calls it replaced by one that does not)."""
    module = importlib.import_module(module_name)
    owner = getattr(module, owner_name) if owner_name else module
    if how == "removed":
        monkeypatch.delattr(owner, name)
        return
    users = sglang_patches._used_by(vars(owner), name, module_name)
    assert users, name
    for user in users:
        monkeypatch.setattr(owner, user, lambda *a, **k: None)


@pytest.mark.parametrize("how", ["removed", "not called"])
@pytest.mark.parametrize("hook", [h[:3] for h in sglang_patches.DFLASH_HOOKS], ids=lambda h: h[2])
def test_a_missing_dflash_hook_refuses_the_server_in_one_line(served, monkeypatch, hook, how):
    """With a hook gone (or no longer called) a DSPINE server is refused when its arguments are handled (in the
    launcher: one line, exit code 2, test_plugin.test_refused_server_exits_2_with_one_line) and the worker factory
    refuses too; a DFLASH server of a DFlash drafter is not DSPINE's business."""
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    module_name, owner, name = hook
    where = f"{module_name}.{owner + '.' if owner else ''}{name}"
    _break(monkeypatch, module_name, owner, name, how)
    with pytest.raises(StartupRefusal) as refusal:
        sglang_on_cpu.server_args(served.root / "target", served.root / "dspine")
    message = str(refusal.value)
    assert "\n" not in message
    assert message.startswith("DSPINE: the installed SGLang ")
    assert where + (" not found" if how == "removed" else " is no longer called by SGLang's DFlash code") in message
    assert message.endswith("refusing to start rather than serve DFlash's decoding under the DSPINE name")
    with pytest.raises(StartupRefusal, match=f"^DSPINE: the installed SGLang .*{name}"):
        SpeculativeAlgorithm.from_string("DSPINE").create_worker(served.args)


# ---------------------------------------------------------------------------- the draft sampler, on DFlash's path
def _padded_head(served):
    """SGLang's ParallelLMHead of the target's head on one rank (rows 50..63: padding, poisoned)."""
    w = served.target.lm_head.weight.detach()
    head = sglang_on_cpu.padded_head(w)
    info = head.shard_indices
    assert head.weight.shape[0] == 64 and int(info.num_org_elements) == VOCAB
    assert int(info.org_vocab_start_index) == 0 and int(info.num_added_elements) == 0
    assert torch.equal(head.weight[:VOCAB], w)
    return head


REQUESTS = [(7, 5), (4, 11), (9, 30)]  # (context length, anchor)


@pytest.mark.parametrize("kernels", ["0", "1"])
@pytest.mark.parametrize("path", ["graph", "eager"])
def test_dspine_drafts_through_dflash_hooks_from_a_padded_head(served, monkeypatch, path, kernels):
    """The sampler DFlash's `_maybe_build_draft_sampler` builds for DSPINE, called by DFlash's capture hook on the
    SGLang draft model's output (`graph`), and DFlash's eager `_greedy_sample_from_vocab_parallel_head` as DFlash's
    forward calls it (`eager`), draft the plain drafter's tokens from the unpadded head rows; DFlash's argmax
    would draft other tokens."""
    from sglang.srt.speculative.draft_worker_common import make_draft_sampler_capture_hook

    from sglang_dspine.serving.worker import DSpineDraftSampler

    monkeypatch.setenv("SGLANG_DSPINE_KERNELS", kernels)
    model = sglang_on_cpu.sglang_model(served.root / "dspine").float()
    model.load_weights(iter(load_file(served.root / "dspine" / "model.safetensors").items()))
    assert model.draft_step.kernels == (kernels == "1")
    plain, b = served.plain, served.plain.cfg.block_size
    lm_head = _padded_head(served)
    worker = sglang_on_cpu.worker_shell(model, lm_head, b)
    head = served.target.lm_head.weight.detach()
    with torch.no_grad():
        out, fb, refs = sglang_on_cpu.draft_forward(model, plain, served.target, REQUESTS)
        n = len(REQUESTS)
        if path == "graph":
            sampler = worker._maybe_build_draft_sampler()
            assert isinstance(sampler, DSpineDraftSampler)
            make_draft_sampler_capture_hook(sampler)(None, out, fb, n * b)  # as the draft graph's tail runs it
            tokens = sampler.out[: n * (b - 1)].view(n, b - 1)
        else:
            hidden = out.hidden_states.view(n, b, -1)
            tokens = worker._greedy_sample_from_vocab_parallel_head(
                hidden_states=hidden[:, 1:, :].reshape(-1, hidden.shape[-1]), lm_head=lm_head).view(n, b - 1)
    assert model.draft_step.head.shape[0] == VOCAB and model.draft_step.shard.start == 0
    want = torch.cat([plain.draft(ref, head, torch.tensor([a])).tokens for ref, (_, a) in zip(refs, REQUESTS)])
    argmax = torch.cat([(ref.hidden[0, 0, 1:] @ head.T).argmax(-1)[None] for ref in refs])
    assert tokens.tolist() == want.tolist()
    assert (want != argmax).any()  # the walk left the argmax: DFlash's own sampler would not pass


def _served_draft_model(served):
    """The SGLang draft model with the pair's drafter weights, given the target head: (model, the plain drafter,
    its block size, the head)."""
    model = sglang_on_cpu.sglang_model(served.root / "dspine").float()
    model.load_weights(iter(load_file(served.root / "dspine" / "model.safetensors").items()))
    head = served.target.lm_head.weight.detach()
    model.draft_step.attach_head(head)
    return model, served.plain, served.plain.cfg.block_size, head


@pytest.mark.parametrize("kernels", ["0", "1"])
def test_dspine_draft_tree_is_the_offline_lattice_tree(served, monkeypatch, kernels):
    """DraftStep.draft_tree on the SGLang draft model's output (the batched builder, on the candidates and table
    the served decoding computes, kernels or PyTorch math) gives, per request, tree.lattice_tree of the plain
    drafter's BlockDraft on the same context: the same paths in the same best-first order. The tree step's
    draft-graph tail (`TreeDraftSampler`, B - 1 nodes, handed the forward's whole hidden states) writes those
    trees, or at N = B a greedy request's walk as a chain, and the verify pass's inputs for them: the same as
    those computed after the graph."""
    from sglang_dspine.drafter.tree import lattice_tree
    from sglang_dspine.serving.tree_verify import TreeDraftSampler, tree_verify_inputs

    monkeypatch.setenv("SGLANG_DSPINE_KERNELS", kernels)
    model, plain, b, head = _served_draft_model(served)
    budget = 12
    with torch.no_grad():
        out, _, refs = sglang_on_cpu.draft_forward(model, plain, served.target, REQUESTS)
        hidden = out.hidden_states.view(len(REQUESTS), b, -1)
        trees = model.draft_step.draft_tree(hidden[:, 1:].reshape(-1, hidden.shape[-1]), budget)
        for r, (ref, (_, a)) in enumerate(zip(refs, REQUESTS)):
            want = lattice_tree(plain.draft(ref, head, torch.tensor([a])), budget)
            assert trees.tokens[r].tolist() == want.tokens and trees.parents[r].tolist() == want.parents
            torch.testing.assert_close(trees.scores[r], torch.tensor(want.scores), atol=1e-4, rtol=1e-4)
        n = len(REQUESTS)
        greedy = torch.arange(n) % 2 == 0
        seq_lens = torch.tensor([5 + 3 * r for r in range(n)])
        full = model.draft_step.draft_tree(hidden[:, 1:].reshape(-1, hidden.shape[-1]), b - 1)
        for chains in (False, True):  # N > B: every request a tree; N = B: greedy ones their walk
            sampler = TreeDraftSampler(model.draft_step, max_bs=n + 2, chains_for_greedy=chains)  # spare rows
            sampler.prepare(seq_lens, greedy)
            sampler(out.hidden_states)
            served_trees, layout = sampler.drafts(n)
            for r, (ref, (_, a)) in enumerate(zip(refs, REQUESTS)):  # and the walk, for an adaptive chain step
                assert sampler.walk_rows(n)[r].tolist() == plain.draft(ref, head, torch.tensor([a])).tokens[0].tolist()
            for r, (ref, (_, a)) in enumerate(zip(refs, REQUESTS)):
                want = plain.draft(ref, head, torch.tensor([a]))
                if chains and greedy[r]:
                    assert served_trees.tokens[r].tolist() == want.tokens[0].tolist()  # the walk, as a chain
                    assert served_trees.parents[r].tolist() == list(range(-1, b - 2))
                    assert served_trees.depths[r].tolist() == list(range(1, b))
                else:
                    assert served_trees.tokens[r].tolist() == lattice_tree(want, b - 1).tokens
                    assert torch.equal(served_trees.parents[r], full.parents[r])
            # what the graph built for the verify = the same computed after it (tree_verify_inputs' own)
            anchors = torch.tensor([a for _, a in REQUESTS])
            graph = tree_verify_inputs(served_trees, anchors, seq_lens, depth=b - 1, layout=layout)
            eager = tree_verify_inputs(served_trees, anchors, seq_lens, depth=b - 1)
            for x, y in ((graph.positions, eager.positions), (graph.custom_mask, eager.custom_mask),
                         (graph.links.index, eager.links.index), (graph.links.next_token, eager.links.next_token),
                         (graph.links.next_sibling, eager.links.next_sibling)):
                assert torch.equal(x, y)
    assert trees.depths.amax().item() > 1  # the trees branch and go deep


@pytest.mark.parametrize("kernels", ["0", "1"])
def test_a_wide_calibrated_tree_is_the_offline_calibrated_lattice_tree(served, monkeypatch, kernels):
    """A tree wider than the block (N - 1 = 13 nodes after a block of B = 4): the draft-graph tail
    (`TreeDraftSampler`, calibrated) scores a greedy request's tree with the drafter's calibration per block
    position and a sampled request's with its own rows (`calibration_rows`). Per request, its tree is
    `tree.lattice_tree` of the plain drafter's BlockDraft with those temperatures and log masses (the offline
    tree), node for node; the calibrated trees differ from the raw ones (the calibration changes the tree)."""
    from sglang_dspine.drafter.tree import lattice_tree
    from sglang_dspine.serving.tree_verify import TreeDraftSampler, calibration_rows

    monkeypatch.setenv("SGLANG_DSPINE_KERNELS", kernels)
    model, plain, b, head = _served_draft_model(served)
    temps, log_mass = [0.3, 2.0, 0.7][: b - 1], [-0.9, -0.05, -0.4][: b - 1]
    n, nodes = len(REQUESTS), 13
    greedy = torch.arange(n) % 2 == 0
    with torch.no_grad():
        out, _, refs = sglang_on_cpu.draft_forward(model, plain, served.target, REQUESTS)
        sampler = TreeDraftSampler(model.draft_step, max_bs=n + 2, nodes=nodes, calibrated=True)
        t, m = calibration_rows(greedy, torch.tensor(temps), torch.tensor(log_mass))
        assert t.shape == m.shape == (n, b - 1)
        sampler.prepare(torch.full((n,), 7), greedy, t, m)
        sampler(out.hidden_states)
        trees, _ = sampler.drafts(n)
    changed = 0
    for r, (ref, (_, a)) in enumerate(zip(refs, REQUESTS)):
        draft = plain.draft(ref, head, torch.tensor([a]))
        raw = lattice_tree(draft, nodes)
        want = lattice_tree(draft, nodes, temperature=temps, log_mass=log_mass) if greedy[r] else raw
        assert trees.tokens[r].tolist() == want.tokens and trees.parents[r].tolist() == want.parents
        torch.testing.assert_close(trees.scores[r], torch.tensor(want.scores), atol=1e-4, rtol=1e-4)
        changed += bool(greedy[r]) and (want.tokens != raw.tokens or want.parents != raw.parents)
    assert changed >= 1


# ------------------------------------------------------------------------------ verify renormalisation patch
def _probs_with_ties(rows, vocab, g):
    """Random distributions whose k-th largest entries tie (k = 3), for the pivot semantics."""
    logits = torch.randn(rows, vocab, generator=g, dtype=torch.float64) * 2
    for r in range(rows):
        order = logits[r].argsort(descending=True)
        logits[r, order[3]] = logits[r, order[2]]  # ranks 3 and 4 (1-based) tie
    return torch.softmax(logits, -1).float()


def reference_top_k(probs, k):
    """Keep the entries at least as large as the k-th largest (ties at the pivot kept), renormalise (float64)."""
    p = probs.double()
    k = torch.as_tensor(k).expand(p.shape[0]).clamp(1, p.shape[1])
    pivot = p.sort(-1, descending=True).values.gather(1, (k - 1).view(-1, 1).long())
    kept = torch.where(p >= pivot, p, 0.0)
    return kept / kept.sum(-1, keepdim=True)


def reference_top_p(probs, top_p):
    """Keep the smallest set of largest entries whose mass reaches top_p (ties at its smallest kept), renormalise."""
    p = probs.double()
    top_p = torch.as_tensor(top_p, dtype=torch.float64).expand(p.shape[0])
    out = torch.zeros_like(p)
    for r in range(p.shape[0]):
        values = sorted(p[r].tolist(), reverse=True)
        total, pivot = 0.0, values[-1]
        for v in values:
            total += v
            if total >= top_p[r].item():
                pivot = v
                break
        out[r] = torch.where(p[r] >= pivot, p[r], 0.0)
    return out / out.sum(-1, keepdim=True)


@pytest.fixture
def renorm_patched(served, monkeypatch):
    """DFlash's verify module as a PyTorch-sampling DSPINE server has it: `sglang_patches.apply`'s patch 1 on a
    fresh copy. SGLang's Triton renormalisations refuse CPU tensors up front; here they run on Triton's
    interpreter (conftest), with that device check lifted and nothing else changed."""
    from sglang.kernels.ops.sampling import renorm_triton
    from sglang.srt.runtime_context import publish
    from sglang.srt.speculative import dflash_utils

    publish(served.args, role="test")
    dflash_utils = importlib.reload(dflash_utils)  # the stock module, whatever an earlier test patched
    assert sglang_patches.verify_renorm_follows_sampling_backend()

    def prepare(probs):
        if probs.ndim != 2:
            raise ValueError(f"probs must be 2D, got shape={tuple(probs.shape)}")
        return probs.float().contiguous()

    monkeypatch.setattr(renorm_triton, "_prepare_probs", prepare)
    yield dflash_utils
    importlib.reload(dflash_utils)


def test_verify_renormalisation_patch_by_value(renorm_patched):
    """The two functions DFlash's verify calls after the patch, called with top-k as an int and as one value per
    row, top-p as a float and per row: the sort-and-renormalise reference with ties at the pivot kept
    (FlashInfer's semantics, which the patch promises); the result is returned, the input left as it was (DFlash
    uses the returned tensor)."""
    dflash_utils = renorm_patched
    g = torch.Generator().manual_seed(0)
    probs = _probs_with_ties(6, VOCAB, g)
    before = probs.clone()
    for k in (3, torch.tensor([3, 1, 7, 3, VOCAB, 2], dtype=torch.int32)):
        got = dflash_utils.top_k_renorm_prob(probs, k)
        torch.testing.assert_close(got.double(), reference_top_k(probs, k), atol=1e-6, rtol=0)
        assert torch.equal(probs, before)
    kept = (reference_top_k(probs, 3) > 0).sum(-1)
    assert (kept == 4).all()  # the tie at the pivot is kept: a plain torch.topk renormalisation keeps 3
    for p in (0.6, torch.tensor([0.3, 0.95, 0.5, 1.0, 0.75, 0.1])):
        got = dflash_utils.top_p_renorm_prob(probs, p)
        torch.testing.assert_close(got.double(), reference_top_p(probs, p), atol=1e-6, rtol=0)
        assert torch.equal(probs, before)


def _sampling_info(params, vocab, device="cpu"):
    """SGLang's SamplingBatchInfo for requests with these SamplingParams, built by SGLang
    (`from_schedule_batch`)."""
    from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo

    class Batch:  # what from_schedule_batch reads of a ScheduleBatch (the penalizers keep a weak reference)
        pass

    batch = Batch()
    batch.device = device
    batch.reqs = [types.SimpleNamespace(sampling_params=p, custom_logit_processor=None, return_sampling_mask=False,
                                        origin_input_ids=[1, 2], output_ids=[]) for p in params]
    return SamplingBatchInfo.from_schedule_batch(batch, vocab)


def reference_target_probs(logits, params):
    """The distribution each request samples its token from without speculation: softmax(logits / T), top-k (ties
    kept), then top-p, each renormalised; greedy requests: the argmax."""
    rows = []
    for row, p in zip(logits, params):
        if p.top_k == 1:
            q = torch.zeros(logits.shape[-1], dtype=torch.float64)
            q[row.argmax()] = 1
        else:
            q = torch.softmax(row.double() / p.temperature, -1)[None]
            q = reference_top_p(reference_top_k(q, min(p.top_k, logits.shape[-1])), p.top_p)[0]
        rows.append(q)
    return torch.stack(rows)


def served_verify_probs(dflash_utils, logits, info, block):
    """DFlash's verify distribution, as its worker computes it: `build_*_verify_target_probs` on the verify logits
    (one row per block position)."""
    build = getattr(dflash_utils, "build_dflash_verify_target_probs", None) or \
        dflash_utils.build_speculative_verify_target_probs
    bs = logits.shape[0] // block
    return build(next_token_logits=logits, sampling_info=info, draft_token_num=block, bs=bs).view(bs * block, -1)


@pytest.mark.parametrize("batch", ["mixed", "all-top-k"])
def test_dflash_verify_distribution_after_the_patch(renorm_patched, batch):
    """Through DFlash's own caller: a batch mixing a greedy request, whole-vocabulary requests at T = 0.7 and
    1.3 and top-k/top-p ones takes the dense path (the patched functions renormalise every row); a batch where
    every request has a top-k takes the sparse one (top-p renormalised by the patch). Each row is the
    distribution the request samples from without speculation; ties at a top-k pivot are kept (the stock
    PyTorch fallback of 0.5.23 would cut them: the patched function is the one DFlash calls)."""
    from sglang.srt.sampling.sampling_params import SamplingParams

    dflash_utils = renorm_patched
    if batch == "mixed":
        params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7),
                  SamplingParams(temperature=1.3, top_k=3), SamplingParams(temperature=0.7, top_p=0.8),
                  SamplingParams(temperature=1.3, top_k=6, top_p=0.7)]
    else:
        params = [SamplingParams(temperature=0.7, top_k=8), SamplingParams(temperature=1.3, top_k=5, top_p=0.6),
                  SamplingParams(temperature=1.0, top_k=20, top_p=0.9)]
    block = 4
    info = _sampling_info(params, VOCAB)
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(len(params) * block, VOCAB, generator=g) * 3
    if batch == "mixed":  # ties at request 2's top-k pivot (its ranks 3 and 4) in every position
        for r in range(2 * block, 3 * block):
            order = logits[r].argsort(descending=True)
            logits[r, order[3]] = logits[r, order[2]]
    got = served_verify_probs(dflash_utils, logits.clone(), info, block)
    want = reference_target_probs(logits, [p for p in params for _ in range(block)])
    torch.testing.assert_close(got.double(), want, atol=1e-6, rtol=0)
    if batch == "mixed":
        assert ((want[2 * block: 3 * block] > 0).sum(-1) == 4).all()
    assert math.isclose(float(got.sum()), len(params) * block, rel_tol=1e-5)


# ------------------------------------------------------------------------- lossless through the served verify
def chain_target_only(predicts, accept_index, accept_token_num, candidates, retrive_index, retrive_next_token,
                      retrive_next_sibling, uniform_samples, uniform_samples_for_final_sampling, target_probs,
                      draft_probs, threshold_single, threshold_acc, deterministic=True):
    """SGLang's `tree_speculative_sampling_target_only` for a chain, for the CPU: it is a CUDA kernel in both
    releases (sgl_kernel; a JIT-built one on 0.5.23), so here it is transcribed from its source
    (sgl_kernel/speculative/sampling.cuh, TreeSpeculativeSamplingTargetOnly), vectorised over requests. The `gpu`
    test runs the kernel itself. Level j tests draft j against the row of the last accepted token with that
    token's coin; a rejected token's target mass becomes draft mass; the bonus is drawn from relu(q - p) at the
    last accepted row (p = 0 after a full acceptance) with the final coin (inverse CDF)."""
    bs, d = candidates.shape
    assert (retrive_next_sibling == -1).all() and (retrive_next_token[:, -1] == -1).all()
    assert torch.equal(retrive_next_token[:, :-1], torch.arange(1, d).expand(bs, -1))  # a chain
    rows = torch.arange(bs)
    alive = torch.ones(bs, dtype=torch.bool)
    n_acc = torch.zeros(bs, dtype=torch.long)
    cur = torch.zeros(bs, dtype=torch.long)
    coin = uniform_samples[:, 0].clone()
    last = retrive_index[:, 0].clone()
    accept_index[:, 0] = last.to(accept_index.dtype)
    for j in range(1, d):
        tok = candidates[:, j]
        q = target_probs[rows, cur, tok]
        acc = alive & (q > 0) & ((coin < q / threshold_acc) | (q >= threshold_single))
        rej = alive & ~acc
        draft_probs[rows[rej], cur[rej], tok[rej]] = q[rej]
        predicts[last[acc]] = tok[acc].to(predicts.dtype)
        n_acc[acc] += 1
        accept_index[rows[acc], n_acc[acc]] = retrive_index[acc, j].to(accept_index.dtype)
        last[acc] = retrive_index[acc, j]
        cur[acc] = j
        coin[acc] = uniform_samples[acc, j]
        alive = acc
    accept_token_num.copy_(n_acc)
    q = target_probs[rows, cur]
    p = draft_probs[rows, cur] * (n_acc != d - 1).unsqueeze(-1)
    relu = (q - p).clamp_min(0)
    u = uniform_samples_for_final_sampling * relu.sum(-1)
    sampled = (relu.cumsum(-1) <= u.unsqueeze(-1)).sum(-1).clamp_max(q.shape[-1] - 1)
    predicts[last] = sampled.to(predicts.dtype)


def _draft_input_top_k(params):
    """DFlashDraftInputV2's max_top_k and uniform_top_k_value for a batch (what DFlash's worker passes its verify)."""
    ks = [int(p.top_k) for p in params]
    return max(max(ks), 1), (ks[0] if len(set(ks)) == 1 else None)


LOSSLESS_PARAMS = [dict(temperature=0.0), dict(temperature=0.7), dict(temperature=1.3),
                   dict(temperature=0.7, top_k=5), dict(temperature=1.3, top_k=5),
                   dict(temperature=0.7, top_p=0.8), dict(temperature=1.3, top_p=0.8),
                   dict(temperature=1.3, top_k=8, top_p=0.7), dict(temperature=0.7, logit_bias={"7": 2.5})]


def _lossless_case(device):
    """Fixed verify logits for each request of LOSSLESS_PARAMS (B = 4 rows: the target's distribution after the
    anchor and after each draft token) and a draft chain that is accepted sometimes: at row i the draft is the
    target's (i % 2 + 1)-th most likely token."""
    from sglang.srt.sampling.sampling_params import SamplingParams

    params = [SamplingParams(**p) for p in LOSSLESS_PARAMS]
    g = torch.Generator().manual_seed(11)
    block, bs = 4, len(params)
    logits = torch.randn(bs, block, VOCAB, generator=g, dtype=torch.float64) * 1.2
    biased = logits.clone()
    for n, p in enumerate(params):
        for tok, v in (p.logit_bias or {}).items():
            biased[n, :, int(tok)] += v
    exact_rows = reference_target_probs(biased.view(-1, VOCAB), [p for p in params for _ in range(block)])
    exact_rows = exact_rows.view(bs, block, VOCAB)
    # the draft: never the greedy request's argmax; for the others a token of positive target mass
    order = torch.softmax(biased / torch.tensor([p.temperature for p in params]).view(-1, 1, 1), -1).argsort(
        -1, descending=True)
    draft = order[:, :-1, :].gather(-1, (torch.arange(block - 1) % 2 + 1).expand(bs, -1).unsqueeze(-1)).squeeze(-1)
    anchors = torch.randint(0, VOCAB, (bs, 1), generator=g)
    candidates = torch.cat([anchors, draft], 1)
    return params, logits.float().to(device), candidates.to(device), exact_rows


def exact_emissions(exact_rows, candidates):
    """Per request, the exact probability of each (accepted drafts a, bonus y): the target's own sampling one
    token at a time, P = prod_{i<a} q_i(d_{i+1}) * q_a(y), y != d_{a+1} unless every draft was accepted."""
    out = []
    for q, c in zip(exact_rows, candidates.tolist()):
        block, cells, prefix = q.shape[0], {}, 1.0
        for a in range(block):
            for y in range(q.shape[1]):
                if a < block - 1 and y == c[a + 1]:
                    continue
                if prefix * q[a, y] > 0:
                    cells[(a, y)] = prefix * float(q[a, y])
            if a < block - 1:
                prefix *= float(q[a, c[a + 1]])
        out.append(cells)
    return out


def _served_verify_many(dflash_utils, params, logits, candidates, n, monkeypatch):
    """DFlash's verify as its worker runs it on a non-greedy batch: logit adjustments in place, then
    `compute_dflash_sampling_correct_drafts_and_bonus` (target distribution, acceptance, bonus), on n copies of
    the batch at once. On the CPU the distribution is built once by DFlash's own function on the batch (the
    patched renormalisation runs on Triton's interpreter, milliseconds a row) and handed to the copies, and the
    acceptance kernel runs as its transcription."""
    bs, block = candidates.shape
    info = _sampling_info(params, VOCAB, logits.device.type)
    flat = logits.reshape(bs * block, VOCAB).clone()
    dflash_utils.apply_dflash_verify_logits_adjustments(next_token_logits=flat, sampling_info=info,
                                                        draft_token_num=block)
    max_top_k, uniform = _draft_input_top_k(params)
    if flat.device.type == "cpu":
        build_name = "build_dflash_verify_target_probs" if hasattr(dflash_utils, "build_dflash_verify_target_probs") \
            else "build_speculative_verify_target_probs"
        probs = getattr(dflash_utils, build_name)(next_token_logits=flat, sampling_info=info, draft_token_num=block,
                                                  bs=bs, max_top_k=max_top_k, uniform_top_k_value=uniform)
        monkeypatch.setattr(dflash_utils, build_name, lambda **kw: probs.repeat(n, 1, 1))
        monkeypatch.setattr(dflash_utils, "tree_speculative_sampling_target_only", chain_target_only)
        monkeypatch.setattr(dflash_utils, "_DFLASH_SAMPLING_VERIFY_AVAILABLE", True)
        many_info = info  # read by the distribution's builder only
    else:
        many_info = _sampling_info(params * n, VOCAB, "cuda")
    accept_len, bonus = dflash_utils.compute_dflash_sampling_correct_drafts_and_bonus(
        candidates=candidates.repeat(n, 1), next_token_logits=flat.view(bs, block, VOCAB).repeat(n, 1, 1).view(-1, VOCAB),
        sampling_info=many_info, max_top_k=max_top_k, uniform_top_k_value=uniform)
    return accept_len.view(n, bs).cpu(), bonus.view(n, bs).cpu()


def _check_lossless(dflash_utils, monkeypatch, device, n):
    from sampling_stats import chi_square_p

    params, logits, candidates, exact_rows = _lossless_case(device)
    torch.manual_seed(0)
    if device == "cuda":
        torch.cuda.manual_seed(0)
    accept_len, bonus = _served_verify_many(dflash_utils, params, logits, candidates, n, monkeypatch)
    exact = exact_emissions(exact_rows, candidates.cpu())
    results = []
    for r, p in enumerate(LOSSLESS_PARAMS):
        counts = {}
        for a, y in zip(accept_len[:, r].tolist(), bonus[:, r].tolist()):
            counts[(a, y)] = counts.get((a, y), 0) + 1
        pval, cells = chi_square_p(counts, exact[r])
        results.append((p, round(pval, 4), cells))
    assert all(pval > 1e-3 for _, pval, _ in results), results
    assert sum(cells for _, _, cells in results) > 60  # most requests have many cells: the test has power
    assert (accept_len > 0).any() and (accept_len == 0).any()  # both branches ran


def test_served_verify_keeps_the_target_distribution(renorm_patched, monkeypatch):
    """Lossless through the served verify path, as DSPINE drives DFlash's (PyTorch sampling, patched
    renormalisation): at T = 0.7 and 1.3, with and without top-k / top-p (and a logit bias, and a greedy request
    in the same batch), what a verify step emits (accepted drafts, then the bonus) over many samples follows the
    target's own sampling one token at a time, computed independently from the raw logits (chi-square)."""
    _check_lossless(renorm_patched, monkeypatch, "cpu", n=6000)


@pytest.mark.gpu
def test_gpu_served_verify_keeps_the_target_distribution(renorm_patched, monkeypatch):
    """The same on the GPU with DFlash's own acceptance kernel and the Triton renormalisation on CUDA, nothing
    replaced (scripts/device/gpu_tests.sh)."""
    from sglang.kernels.ops.sampling import renorm_triton

    monkeypatch.undo()  # the real device check of the Triton renormalisation: CUDA tensors pass it
    assert renorm_triton._prepare_probs.__module__ == renorm_triton.__name__
    _check_lossless(renorm_patched, monkeypatch, "cuda", n=50000)


@pytest.mark.gpu
def test_gpu_chain_transcription_equals_sglang_kernel(renorm_patched):
    """The CPU tests' transcription of SGLang's acceptance kernel (`chain_target_only`) decides exactly as the
    kernel does on the same target distributions, drafts and coins: accept lengths, accepted tokens, bonus."""
    dflash_utils = renorm_patched
    g = torch.Generator().manual_seed(5)
    bs, d = 8192, 4
    probs = torch.softmax(torch.randn(bs, d, VOCAB, generator=g) * 2, -1)
    probs = torch.where(probs < 0.01, 0.0, probs)  # zero mass too (as top-k/top-p leave it)
    probs = probs / probs.sum(-1, keepdim=True)
    drafts = torch.where(torch.rand(bs, d, generator=g) < 0.7, probs.argmax(-1),
                         torch.randint(0, VOCAB, (bs, d), generator=g))
    candidates = torch.cat([torch.randint(0, VOCAB, (bs, 1), generator=g), drafts[:, :-1]], 1)
    coins, final = torch.rand(bs, d, generator=g), torch.rand(bs, generator=g)
    results = []
    for device, fn in (("cuda:0", dflash_utils.tree_speculative_sampling_target_only), ("cpu", chain_target_only)):
        index, next_token, sibling, predicts, accept_index, accept_num = \
            dflash_utils._get_or_create_chain_verify_buffers(bs=bs, draft_token_num=d, device=torch.device(device))
        fn(predicts=predicts, accept_index=accept_index, accept_token_num=accept_num,
           candidates=candidates.to(device), retrive_index=index, retrive_next_token=next_token,
           retrive_next_sibling=sibling, uniform_samples=coins.to(device), uniform_samples_for_final_sampling=final.to(
               device), target_probs=probs.to(device), draft_probs=torch.zeros_like(probs, device=device),
           threshold_single=1.0, threshold_acc=1.0, deterministic=True)
        n, rows, chosen = accept_num.long().cpu(), accept_index.long().cpu(), predicts.long().cpu()
        # the token chosen after each accepted position (entries past the accept length are undefined)
        results.append((n, [chosen[rows[i, : int(n[i]) + 1]].tolist() for i in range(bs)]))
    (n_gpu, tokens_gpu), (n_cpu, tokens_cpu) = results
    assert torch.equal(n_gpu, n_cpu)
    assert (n_gpu > 0).any() and (n_gpu == 0).any() and (n_gpu == d - 1).any()
    same = sum(a == b for a, b in zip(tokens_gpu, tokens_cpu))
    assert same >= bs - 2, bs - same  # the bonus draw may differ only where a coin falls on a CDF step's edge


# ------------------------------------------------------------------------------- SpecForge's layout, served
def test_sglang_model_loads_a_specforge_layout_checkpoint(served, tmp_path):
    """SGLang's DSpineDraftModel built from SpecForge's own config fields and loaded from SpecForge's tensor names
    (test_checkpoint.write_specforge_checkpoint: not written by this package) holds the file's tensors, and
    serves the same draft as the plain drafter loaded from it."""
    from test_checkpoint import write_specforge_checkpoint

    from sglang_dspine.drafter.checkpoint import load_drafter

    _, tensors = write_specforge_checkpoint(tmp_path)
    model = sglang_on_cpu.sglang_model(tmp_path).float()
    model.load_weights(iter(load_file(tmp_path / "model.safetensors").items()))
    f32 = {k: v.float() for k, v in tensors.items()}
    assert torch.equal(model.transfer_codes, f32["transfer_codes"]) and bool(model.transfer_ready)
    for name, p in model.injection.state_dict().items():
        assert torch.equal(p, f32["injection." + name]), name
    q = f32["layers.1.self_attn.q_proj.weight"]
    qkv = model.layers[1].self_attn.qkv_proj.weight
    assert torch.equal(qkv[: q.shape[0]], q)
    assert torch.equal(qkv[q.shape[0]:], torch.cat([f32["layers.1.self_attn.k_proj.weight"],
                                                    f32["layers.1.self_attn.v_proj.weight"]]))
    assert torch.equal(model.fc.weight, f32["fc.weight"])
    plain = load_drafter(str(tmp_path)).eval()
    target = make_target(vocab=64)
    head = target.lm_head.weight.detach()
    model.draft_step.attach_head(head)
    with torch.no_grad():
        out, _, refs = sglang_on_cpu.draft_forward(model, plain, target, [(6, 3), (5, 40)])
        b = plain.cfg.block_size
        hidden = out.hidden_states.view(2, b, -1)
        served_tokens = model.draft_step.decode(hidden[:, 1:].reshape(-1, hidden.shape[-1]))
    for r, (ref, (_, a)) in enumerate(zip(refs, [(6, 3), (5, 40)])):
        torch.testing.assert_close(hidden[r], ref.hidden[0, 0], atol=1e-5, rtol=1e-5)
        assert served_tokens[r].tolist() == plain.draft(ref, head, torch.tensor([a])).tokens[0].tolist()


# ------------------------------------------------------------------ DFlash2, the step-cost benchmark's peer
def test_step_cost_benchmarks_dflash2_drafter_is_sglangs_own(served, tmp_path):
    """benchmarks/serving_scale.py's DFlash2 drafter (a DFlash backbone, DFlash 2's convolutions and selector, random)
    is what SGLang 0.5.23's DFlash2DraftModel builds from its config: every parameter of the model comes from the
    file, equal, and no tensor of the file is left unused; on 0.5.17 the benchmark refuses --servers dflash2."""
    from benchmarks import serving_scale as ss
    from sglang_dspine.serving.versions import sglang_version

    geometry, shape = dict(ss.GEOMETRIES["tiny"], vocab_size=VOCAB), ss.TINY_DRAFTER
    paths = ss.write_drafters(str(tmp_path), geometry, dict(shape, mask_token_id=VOCAB - 1), "cpu", ss.TINY_DFLASH2)
    cfg = json.load(open(os.path.join(paths["dflash2"], "config.json")))
    assert cfg["architectures"] == ["DFlash2DraftModel"] and cfg["dflash_config"]["selector_top_k"] == 4
    tensors = load_file(os.path.join(paths["dflash2"], "model.safetensors"))
    backbone = load_file(os.path.join(paths["dflash"], "model.safetensors"))
    assert all(torch.equal(tensors[k], v) for k, v in backbone.items())  # the DFlash drafter's backbone, as is
    if sglang_version() < (0, 5, 23):
        with pytest.raises(SystemExit, match="--servers dflash2: DFlash2 ships in SGLang 0.5.23; this is SGLang 0.5.17"):
            ss.check_servers(["dflash", "dflash2", "dspine"])
        return
    ss.check_servers(["dflash", "dflash2", "dspine"])
    from sglang.srt.models.dflash import DFlash2DraftModel
    from sglang.srt.utils.hf_transformers_utils import get_config

    model = DFlash2DraftModel(get_config(paths["dflash2"], trust_remote_code=False)).float()
    model.load_weights(iter(tensors.items()))
    params = dict(model.named_parameters())
    f32 = {k: v.float() for k, v in tensors.items()}
    assert torch.equal(params["candidate_selector.successor_codebook"], f32["candidate_selector.successor_codebook"])
    assert torch.equal(params["candidate_selector.hidden_projection.weight"],
                       f32["candidate_selector.hidden_projection.weight"])
    for i in range(shape["layers"]):
        for conv in ("attention_conv", "mlp_conv"):
            for name in ("base_kernel", "kernel_projection.weight"):
                key = f"layers.{i}.{conv}.{name}"
                assert torch.equal(params[key], f32[key]), key
    assert torch.equal(params["fc.weight"], f32["fc.weight"])
    # SGLang fuses q/k/v and gate/up: the rest of the file is in the fused parameters, and nothing is left over
    fused = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
             "up_proj": "gate_up_proj"}
    unused = [k for k in tensors if k not in params and not any(f".{a}." in k and k.replace(a, b) in params
                                                                  for a, b in fused.items())]
    assert unused == []


# --------------------------------------------------------------------------------------- tensor parallelism
def _block_to_decode(served, bs: int, seed: int):
    """What the draft model's forward leaves DSPINE's draft step for a batch of `bs` blocks (random: anchors, the
    last layer's state, the final states of positions 1..B-1), and the plain decoding of it over the whole head."""
    from sglang_dspine.drafter.decoding import decode_block

    plain, head = served.plain, served.target.lm_head.weight.detach()
    b, hidden = plain.cfg.block_size, plain.cfg.hidden_size
    g = torch.Generator().manual_seed(seed)
    batch = dict(anchors=torch.randint(0, VOCAB, (bs,), generator=g), pre_last=torch.randn(bs * b, hidden, generator=g),
                 states=torch.randn(bs * (b - 1), hidden, generator=g))
    with torch.no_grad():
        want = decode_block((batch["states"] @ head.T).view(bs, b - 1, -1), batch["pre_last"].view(bs, b, -1)[:, 1:],
                            batch["anchors"], plain.cfg.dspine.top_k, plain.refine_normed, plain.transfer_codes, head)
    assert (want.candidates < 32).any() and (want.candidates >= 32).any()  # candidates from both halves of the head
    assert (want.choice != 0).any()  # the walk left the argmax
    return batch, want


def _run_ranks(served, tmp_path, rank_fn: str, flags: list, inputs: dict, world: int) -> list:
    """A DSPINE launch with `flags` as `world` ranks under gloo (`sglang_on_cpu.ranks_main`, a fresh interpreter),
    each running `sglang_on_cpu.<rank_fn>` on `inputs`; what each rank found."""
    torch.save(inputs, tmp_path / "inputs.pt")
    tests = os.path.dirname(os.path.abspath(__file__))
    code = (f"import sys; sys.path.insert(0, {tests!r}); import sglang_on_cpu; "
            f"sglang_on_cpu.ranks_main({rank_fn!r}, {str(served.root)!r}, {flags!r}, {str(tmp_path / 'inputs.pt')!r}, "
            f"{str(tmp_path)!r})")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]


def test_two_rank_tensor_parallel_decoding_from_a_padded_head(served, tmp_path):
    """With --tp-size 2 (two ranks under gloo, SGLang's own TP group and ParallelLMHead: the vocabulary of 50
    padded to 64, 32 rows a rank, rank 1's last 14 rows padding and poisoned), each rank's shard comes from SGLang's
    `shard_indices` (rows 0..31 and 32..49), the draft step leaves the kernels for the PyTorch math across the
    shards, and both ranks draft what the whole head drafts in one process (the plain reference)."""
    batch, want = _block_to_decode(served, bs=3, seed=8)
    inputs = dict(head=served.target.lm_head.weight.detach(), **batch)
    ranks = _run_ranks(served, tmp_path, "tp_rank", ["--tp-size", "2"], inputs, world=2)
    assert [(r["org_start"], r["org_size"], r["rows"]) for r in ranks] == [(0, 32, 32), (32, 18, 32)]
    assert [(r["start"], r["size"], r["world"]) for r in ranks] == [(0, 32, 2), (32, 18, 2)]
    assert all(r["kernels"] and not r["on_kernels"] for r in ranks)
    for r in ranks:
        assert r["tokens"] == want.tokens.reshape(-1).tolist()


# ------------------------------------------ data-parallel attention and disaggregation, where SGLang serves them
# Collected where the installed SGLang's DFlash code serves them (sglang_dspine.serving.versions: 0.5.23); where it
# does not, DSPINE refuses them at start in one line (test_plugin.test_what_dspine_cannot_serve_here_is_refused).
if versions.dflash_runs_dp_attention():

    def test_data_parallel_attention_drafts_on_each_dp_groups_own_ranks(served, tmp_path):
        """--tp-size 4 --attn-dp-size 2 --enable-dp-lm-head: four ranks under gloo, two DP groups of two. The draft's
        placement, resolved by SGLang as DFlash's worker resolves it for the DSpine drafter, is each DP group's
        attention-TP group (ranks 0-1 and 2-3); the target head is split over that group (32 rows a rank of the
        vocabulary of 50 padded to 64, the padding poisoned); inside the draft's scope DSPINE's eager decoding
        takes its shard and its gather group from it. Each group drafts its own batch (3 and 2 requests) exactly
        as the whole head does in one process, and a group drafts alone while the other is idle (DFlash's worker
        runs no draft on an idle batch): a gather over all four ranks would never complete."""
        head = served.target.lm_head.weight.detach()
        (a, want_a), (b, want_b), (c, want_c) = (_block_to_decode(served, bs, seed)
                                                 for bs, seed in ((3, 8), (2, 9), (1, 10)))
        inputs = dict(head=head, steps=[[a, b], [c, None]])  # per step, DP group 0's batch and group 1's (None: idle)
        ranks = _run_ranks(served, tmp_path, "dp_rank", ["--tp-size", "4", "--attn-dp-size", "2",
                                                         "--enable-dp-lm-head"], inputs, world=4)
        assert [(r["dp_rank"], r["attn_tp_rank"], r["group"]) for r in ranks] == \
            [(0, 0, [0, 1]), (0, 1, [0, 1]), (1, 0, [2, 3]), (1, 1, [2, 3])]
        assert [(r["org_start"], r["org_size"], r["rows"]) for r in ranks] == [(0, 32, 32), (32, 18, 32)] * 2
        assert [(r["start"], r["size"], r["world"]) for r in ranks] == [(0, 32, 2), (32, 18, 2)] * 2
        assert all(r["kernels"] and not r["on_kernels"] for r in ranks)
        flat = [w.tokens.reshape(-1).tolist() for w in (want_a, want_b, want_c)]
        assert [r["steps"] for r in ranks] == [[flat[0], flat[2]]] * 2 + [[flat[1], None]] * 2


if versions.dflash_hands_off_to_decode():

    def _transfer(src, dst, src_items, dst_items) -> None:
        """What a transfer backend does with the buffers two servers registered for disaggregation ((pointers,
        lengths, item lengths), as SGLang lists them): item i of each source buffer copied into item j of the same
        destination buffer, for each (i, j) pair. Both servers live in this process here: a memory copy."""
        import ctypes

        (src_ptrs, _, item_lens), (dst_ptrs, _, dst_item_lens) = src, dst
        assert item_lens == dst_item_lens and len(src_ptrs) == len(dst_ptrs)
        for s, d, n in zip(src_ptrs, dst_ptrs, item_lens):
            for i, j in zip(src_items, dst_items):
                ctypes.memmove(d + int(j) * n, s + int(i) * n, n)

    @pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
    def test_disaggregated_decode_drafts_from_the_prefills_dspine_state(served, overlap):
        """A DSPINE prefill server hands three requests to a DSPINE decode server, with SGLang 0.5.23's own code on
        both sides: the prefill writes the prompts' draft K/V by DFlash's context writer (run on the DSpine draft
        model) and makes its draft input; its registered buffers (the draft KV pool, the metadata buffers holding
        each request's first token) are copied to the decode server's own slots and rows, as a transfer backend
        copies them; the decode server's ScheduleBatch builds the first decode step's draft input from them
        (`process_prebuilt`: DSPINE's `build_disagg_draft_input`; with overlap, through the FutureMap relay).
        DSpine's per-request state survives: the anchors (the prefill's sampled tokens), the committed lengths and
        the context, so the decode server's first DSpine draft equals the one the prefill server would have made,
        and the plain drafter's; other anchors on the same context draft otherwise."""
        from array import array

        from sglang.srt.configs.model_config import ModelConfig
        from sglang.srt.disaggregation.utils import MetadataBuffers
        from sglang.srt.managers.overlap_utils import FutureMap, resolve_forward_inputs
        from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.radix_cache import RadixCache
        from sglang.srt.sampling.sampling_params import SamplingParams
        from sglang.srt.speculative.dflash_info_v2 import DFlashDraftInputV2
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        plain, head = served.plain, served.target.lm_head.weight.detach()
        dc, b = plain.cfg, plain.cfg.block_size
        prompts, first = [7, 4, 9], [5, 11, 30]  # prompt lengths; the token the prefill sampled after each
        g = torch.Generator().manual_seed(6)
        feats = [torch.randn(s, len(dc.target_layer_ids) * dc.hidden_size, generator=g) for s in prompts]

        def server(rows, start):
            """A server's draft model, worker and draft KV pool; the requests in `rows`, their slots from `start`."""
            model = sglang_on_cpu.sglang_model(served.root / "dspine").float()
            model.load_weights(iter(load_file(served.root / "dspine" / "model.safetensors").items()))
            pool, req_to_token = sglang_on_cpu.draft_kv(dc)
            slots, nxt = [], start
            for r, s in zip(rows, prompts):
                req_to_token.req_to_token[r, : s + b] = torch.arange(nxt, nxt + s + b).to(torch.int32)
                slots.append(torch.arange(nxt, nxt + s))
                nxt += s + b
            return sglang_on_cpu.worker_shell(model, _padded_head(served), b, draft_pool=pool), req_to_token, \
                torch.cat(slots)

        def request(i, s):
            params = SamplingParams()
            params.normalize(None)  # as SGLang's tokenizer manager hands it over
            return Req(f"r{i}", "", array("q", range(1, s + 1)), params)

        def metadata():
            return MetadataBuffers(size=4, hidden_size=dc.hidden_size, hidden_states_dtype=torch.float32,
                                   max_sampling_mask_tokens=1)

        def draft(worker, req_to_token, rows, seq_lens, anchors):
            """The first decode step's draft: the SGLang draft model over [anchor, mask...] after each context,
            then DSPINE's decoding through DFlash's eager hook."""
            out, _, emb = sglang_on_cpu.draft_block(worker.draft_model, served.target,
                                                    worker.draft_model_runner.token_to_kv_pool, req_to_token, rows,
                                                    seq_lens, anchors, dc.mask_token_id)
            states = out.hidden_states.view(len(rows), b, -1)[:, 1:].reshape(-1, dc.hidden_size)
            with torch.no_grad():
                tokens = worker._greedy_sample_from_vocab_parallel_head(
                    hidden_states=states, lm_head=worker._target_worker.model_runner.model.lm_head)
            return tokens.view(len(rows), b - 1).tolist(), emb

        # the prefill server: the target's prefill gave `feats` and sampled `first`
        prefill_rows = [0, 1, 2]
        prefill, prefill_rtt, prefill_slots = server(prefill_rows, start=1)
        with torch.no_grad():
            prefill._append_target_hidden_to_draft_kv_by_loc(
                target_hidden=torch.cat(feats), cache_loc=prefill_slots,
                positions=torch.cat([torch.arange(s) for s in prompts]), extend_lens=torch.tensor(prompts))
        kept = prefill._make_next_draft_input_prefill(bonus_tokens=torch.tensor(first), seq_lens=torch.tensor(prompts))
        prefill_meta = metadata()
        for i, (s, tok) in enumerate(zip(prompts, first)):
            req = request(i, s)
            req.metadata_buffer_index, req.output_ids = i, array("q", [tok])
            prefill_meta.set_buf(req)

        # the hand-off: the decode server's own rows, slots and metadata entries
        decode_rows, decode_meta_items = [3, 1, 2], [2, 0, 1]
        decode, decode_rtt, decode_slots = server(decode_rows, start=40)
        decode_meta = metadata()
        _transfer(prefill.draft_model_runner.token_to_kv_pool.get_contiguous_buf_infos(),
                  decode.draft_model_runner.token_to_kv_pool.get_contiguous_buf_infos(), prefill_slots, decode_slots)
        _transfer(prefill_meta.get_buf_infos(), decode_meta.get_buf_infos(), range(3), decode_meta_items)

        # the decode server: the requests as its transfer queue commits them, then its first (prebuilt) batch
        reqs = []
        for i, (s, row, item) in enumerate(zip(prompts, decode_rows, decode_meta_items)):
            req = request(i, s)
            req.kv.req_pool_idx, req.extend_end, req.prefix_len = row, s, 0
            req.output_ids.append(int(decode_meta.get_buf(item)[0][0]))  # the first token, from the metadata
            reqs.append(req)
        tree = RadixCache(CacheInitParams(disable=True, req_to_token_pool=decode_rtt, token_to_kv_pool_allocator=None,
                                          page_size=1))  # a decode server's cache: no prefix sharing
        batch = ScheduleBatch.init_new(reqs, decode_rtt, None, tree, ModelConfig.from_server_args(served.args),
                                       overlap, SpeculativeAlgorithm.from_string("DSPINE"))
        future_map = FutureMap(torch.device("cpu"), batch.spec_algorithm, decode_rtt)
        batch.prepare_for_prebuilt()
        batch.process_prebuilt(future_map)
        handed = batch.spec_info
        assert isinstance(handed, DFlashDraftInputV2)
        if overlap:  # the first decode step reads the anchors and lengths from the relay
            resolve_forward_inputs(batch, future_map)
            future_map.resolve_seq_lens_cpu(batch)
        assert handed.bonus_tokens.tolist() == first and batch.seq_lens.tolist() == prompts
        assert batch.req_pool_indices.tolist() == decode_rows

        at_prefill, emb = draft(prefill, prefill_rtt, prefill_rows, kept.new_seq_lens, kept.bonus_tokens)
        at_decode, _ = draft(decode, decode_rtt, batch.req_pool_indices, batch.seq_lens, handed.bonus_tokens)
        refs = sglang_on_cpu.plain_refs(plain, emb, feats, first)
        want = [plain.draft(ref, head, torch.tensor([a])).tokens[0].tolist() for ref, a in zip(refs, first)]
        argmax = [(ref.hidden[0, 0, 1:] @ head.T).argmax(-1).tolist() for ref in refs]
        assert at_decode == at_prefill == want
        assert want != argmax  # the transition walk left the backbone's argmax: DSpine's own decoding ran
        other, _ = draft(decode, decode_rtt, batch.req_pool_indices, batch.seq_lens, handed.bonus_tokens.roll(1))
        assert other != want  # the anchors are DSpine state: others on the same context draft otherwise


def test_an_adaptive_servers_decode_log_line_names_its_verify_shapes(caplog):
    """Patch 7: SGLang's decode log line (its metrics reporter's logger, which still writes it) ends with the
    steps by verify shape since the previous line, then counting starts anew; other lines, and a decode line with
    no steps since, are untouched. Installing it twice leaves one filter."""
    import collections
    import logging

    steps = collections.Counter()
    sglang_patches.show_verify_shapes_in_decode_log(steps)
    sglang_patches.show_verify_shapes_in_decode_log(steps)
    reporter = importlib.import_module(sglang_patches.DECODE_LOG).logger
    try:
        assert sum(isinstance(f, sglang_patches._VerifyShapesInDecodeLog) for f in reporter.filters) == 1
        steps.update({"none": 3, "chain4": 1})
        with caplog.at_level(logging.INFO, logger=reporter.name):
            reporter.info("Decode batch, #running-req: 4, cuda graph: True, #queue-req: 0")
            steps.update({"chain16": 2})
            reporter.info("Prefill batch, #new-seq: 1")
            reporter.info("Decode batch, #running-req: 5, #queue-req: 0")
            reporter.info("Decode batch, #running-req: 5, #queue-req: 1")
        lines = [r for r in caplog.records if r.name == reporter.name]  # not a first import's own log lines
        assert [r.getMessage() for r in lines] == [
            "Decode batch, #running-req: 4, cuda graph: True, #queue-req: 0, verify shapes: chain4 1, none 3",
            "Prefill batch, #new-seq: 1",
            "Decode batch, #running-req: 5, #queue-req: 0, verify shapes: chain16 2",
            "Decode batch, #running-req: 5, #queue-req: 1"]
        assert not steps
        # what benchmarks read back from a server log of such lines (SGLang's format: a timestamp before each)
        log = "\n".join(f"[2026-12-06 01:00:0{k}] {r.getMessage()}" for k, r in enumerate(lines))
        assert sglang_patches.verify_shapes_in_log(log) == {"chain4": 1, "none": 3, "chain16": 2}
        assert sglang_patches.verify_shapes_in_log(log.splitlines()[-1]) == {}
    finally:
        for f in [f for f in reporter.filters if isinstance(f, sglang_patches._VerifyShapesInDecodeLog)]:
            reporter.removeFilter(f)


@pytest.mark.parametrize("rows", [1, 4, 16])
def test_the_split_kv_verify_kernel_is_causal_attention_over_context_and_chain(rows, monkeypatch):
    """What patch 8 switches a chain verify to: SGLang's split-KV verify kernel (Triton's interpreter here) on
    DFlash's verify shape (W = `rows` rows a request, GQA, contexts of different lengths in scattered KV slots)
    gives what its extend kernel gives and what plain causal attention over [context, chain] gives, also where its
    scratch was allocated over NaN bit patterns (simulated here): the patch zeroes it; without, NaN comes out."""
    from sglang.kernels.ops.attention import verify_splitkv
    from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd
    from sglang.kernels.ops.attention.verify_splitkv import verify_splitkv_fwd

    stock = verify_splitkv.VerifySplitKV._alloc

    def over_nan(self, max_bs):  # an allocator handing back memory that holds NaN
        stock(self, max_bs)
        self.att_out.fill_(float("nan"))

    monkeypatch.setattr(verify_splitkv.VerifySplitKV, "_alloc", over_nan)

    q, k, v, k_pool, v_pool, qo_indptr, kv_indptr, kv_indices = _verify_inputs(3, rows, [5, 40, 17], seed=rows)
    args = (kv_indptr, kv_indices, None, True, None, rows, 1.0, 1.0)
    split, extend = torch.empty_like(q), torch.empty_like(q)
    monkeypatch.setattr(verify_splitkv, "_VK_CACHE", {})
    assert verify_splitkv_fwd(q, k, v, split, k_pool, v_pool, qo_indptr, *args)  # it served the case
    assert split.isnan().any()  # a context shorter than the splits leaves some unrun: 0 × NaN
    monkeypatch.setattr(verify_splitkv, "_VK_CACHE", {})
    sglang_patches.zero_split_kv_scratch()
    assert verify_splitkv_fwd(q, k, v, split, k_pool, v_pool, qo_indptr, *args)
    extend_attention_fwd(q, k, v, extend, k_pool, v_pool, qo_indptr, *args)
    want = _chain_attention(q, k, v, k_pool, v_pool, kv_indptr, kv_indices, rows)
    torch.testing.assert_close(split, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(extend, want, atol=1e-5, rtol=1e-5)


def _verify_inputs(bs: int, rows: int, context: list[int], seed: int, hq: int = 4, hkv: int = 2, d: int = 64):
    """A verify pass's attention inputs as the triton backend hands them: queries and the chain's own K/V
    [bs·W, heads, d], KV pools with each request's context in scattered slots, and the index arrays."""
    g = torch.Generator().manual_seed(seed)
    k_pool, v_pool = torch.randn(200, hkv, d, generator=g), torch.randn(200, hkv, d, generator=g)
    kv_indptr = torch.zeros(bs + 1, dtype=torch.int32)
    kv_indptr[1:] = torch.cumsum(torch.tensor(context), 0)
    kv_indices = torch.randperm(200, generator=g)[: sum(context)].to(torch.int32)
    qo_indptr = torch.arange(0, (bs + 1) * rows, rows, dtype=torch.int32)
    q = torch.randn(bs * rows, hq, d, generator=g)
    k, v = torch.randn(bs * rows, hkv, d, generator=g), torch.randn(bs * rows, hkv, d, generator=g)
    return q, k, v, k_pool, v_pool, qo_indptr, kv_indptr, kv_indices


def _chain_attention(q, k, v, k_pool, v_pool, kv_indptr, kv_indices, rows):
    """Plain causal attention of each verify row over its request's context, then the chain up to and with it."""
    hq, hkv, d = q.shape[1], k.shape[1], q.shape[2]
    want = torch.empty_like(q)
    for b in range(len(kv_indptr) - 1):
        slots = kv_indices[kv_indptr[b]: kv_indptr[b + 1]].long()
        keys = torch.cat([k_pool[slots], k[b * rows: (b + 1) * rows]])
        values = torch.cat([v_pool[slots], v[b * rows: (b + 1) * rows]])
        for j in range(rows):
            seen = len(slots) + j + 1  # the context, then the chain up to and with row j
            for h in range(hq):
                p = torch.softmax(keys[:seen, h // (hq // hkv)] @ q[b * rows + j, h] / d ** 0.5, 0)
                want[b * rows + j, h] = p @ values[:seen, h // (hq // hkv)]
    return want


@pytest.mark.parametrize("bs,rows,graph_splits", [(3, 1, 16), (1, 4, 16), (3, 4, 4)])
def test_a_verify_graphs_split_kv_attention_runs_the_split_count_of_its_batch(bs, rows, graph_splits, monkeypatch):
    """Patch 8's split count (`with_graph_split_count`, Triton's interpreter): where the index array is a CUDA
    graph's capture buffer (longer than requests × the model's context; the batch's indices at its head), the
    kernel runs graph_split_count(requests, W) KV splits, not the 16 the buffer's length would make it run, and
    an exact array keeps SGLang's own count (4 for these contexts). Both give plain causal attention's output."""
    from sglang.kernels.ops.attention import verify_splitkv
    from sglang.kernels.ops.attention.verify_splitkv import verify_splitkv_fwd

    sglang_patches.zero_split_kv_scratch()
    context = [5, 40, 17][:bs]
    q, k, v, k_pool, v_pool, qo_indptr, kv_indptr, kv_indices = _verify_inputs(bs, rows, context, seed=bs * rows)
    max_context = 1024  # long enough that the capture buffer alone makes the kernel run its 16 splits
    fwd = sglang_patches.with_graph_split_count(verify_splitkv_fwd, max_context)
    assert sglang_patches.with_graph_split_count(fwd, max_context) is fwd  # idempotent
    capture = torch.zeros(4 * max_context * 16, dtype=torch.int64)  # max bs 4 x 16 rows x the context
    capture[: kv_indices.numel()] = kv_indices
    assert verify_splitkv.choose_n_splits(capture.numel() / bs) == 16  # what the buffer alone makes it run
    want = _chain_attention(q, k, v, k_pool, v_pool, kv_indptr, kv_indices, rows)
    for indices, splits in ((capture, graph_splits), (kv_indices, 4)):
        monkeypatch.setattr(verify_splitkv, "_VK_CACHE", {})
        out = torch.empty_like(q)
        assert fwd(q, k, v, out, k_pool, v_pool, qo_indptr, kv_indptr, indices, None, True, None, rows, 1.0, 1.0)
        assert [key[-1] for key in verify_splitkv._VK_CACHE] == [splits]  # the kernel's scratch, by split count
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    assert sglang_patches._graph_splits is None  # only during a graph-buffer call


@pytest.mark.gpu
@pytest.mark.parametrize("indices", ["exact", "graph", "graph_dspine"])
@pytest.mark.parametrize("rows", [1, 4, 16])
def test_gpu_split_kv_verify_equals_the_extend_kernel_at_qwen3_8b_heads(rows, indices):
    """Patch 8 on CUDA (compiled Triton, bf16, Qwen3-8B's 32 query and 8 KV heads of 128, 48 requests of 200 to
    900 context tokens in scattered KV slots): SGLang's split-KV verify kernel, its scratch zeroed by the patch,
    gives the extend kernel's output up to bf16 rounding. Also with the index array as the server's verify
    graphs hold it (`graph`: the capture buffer, int64, Qwen3-8B's context × 64 × 16 slots), where the kernel
    runs 16 KV splits instead of the 4 the exact array gives, and through patch 8's split count for graphs
    (`graph_dspine`: 4 at 48 requests)."""
    from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd
    from sglang.kernels.ops.attention.verify_splitkv import verify_splitkv_fwd

    sglang_patches.zero_split_kv_scratch()
    g = torch.Generator(device="cuda").manual_seed(rows)
    bs, hq, hkv, d, dev, dt = 48, 32, 8, 128, "cuda", torch.bfloat16
    context = torch.randint(200, 900, (bs,), generator=g, device=dev)
    pool = int(context.sum()) + 1000
    k_pool, v_pool = (torch.randn(pool, hkv, d, generator=g, device=dev, dtype=dt) for _ in range(2))
    kv_indptr = torch.zeros(bs + 1, dtype=torch.int32, device=dev)
    kv_indptr[1:] = torch.cumsum(context, 0)
    kv_indices = torch.randperm(pool, generator=g, device=dev)[: int(context.sum())].to(torch.int32)
    qo_indptr = torch.arange(0, (bs + 1) * rows, rows, dtype=torch.int32, device=dev)
    q = torch.randn(bs * rows, hq, d, generator=g, device=dev, dtype=dt)
    k, v = (torch.randn(bs * rows, hkv, d, generator=g, device=dev, dtype=dt) for _ in range(2))
    args = (kv_indptr, kv_indices, None, True, None, rows, 1.0, 1.0)
    split_indices = kv_indices
    if indices.startswith("graph"):
        split_indices = torch.zeros(64 * 16 * 40960, dtype=torch.int64, device=dev)
        split_indices[: kv_indices.numel()] = kv_indices
    fwd = verify_splitkv_fwd
    if indices == "graph_dspine":
        fwd = sglang_patches.with_graph_split_count(verify_splitkv_fwd, 40960)
    split, extend = torch.empty_like(q), torch.empty_like(q)
    assert fwd(q, k, v, split, k_pool, v_pool, qo_indptr, kv_indptr, split_indices, *args[2:], max_bs=64)
    extend_attention_fwd(q, k, v, extend, k_pool, v_pool, qo_indptr, *args)
    assert not split.isnan().any()
    torch.testing.assert_close(split.float(), extend.float(), atol=2e-2, rtol=2e-2)


# ------------------------------------------------------------------ patch 9: the none shape on the decode kernel
def _triton_backend(rows: int, pool, req_to_token, hq: int, hkv: int, d: int, device: str = "cpu"):
    """SGLang's TritonAttnBackend as a width-`rows` verify backend of the target builds it (verify_widths.build),
    over a real KV pool and request-to-token table; the model runner around it reduced to what the backend's
    constructor reads."""
    from types import SimpleNamespace

    from sglang.srt.configs.model_config import AttentionArch
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend
    from sglang.srt.runtime_context import get_context, get_spec
    from transformers import Qwen3Config

    saved = get_spec().speculative_num_draft_tokens
    get_context().override("test", speculative_num_draft_tokens=rows)
    try:
        config = SimpleNamespace(attention_arch=AttentionArch.MHA, get_max_num_attention_heads=lambda: hq,
                                 get_num_kv_heads=lambda *tp: hkv, v_head_dim=d, head_dim=d, swa_v_head_dim=None,
                                 context_len=req_to_token.req_to_token.shape[1], is_encoder_decoder=False,
                                 hf_config=Qwen3Config(num_attention_heads=hq, num_key_value_heads=hkv, head_dim=d),
                                 linear_attn_registry_result=None)
        runner = SimpleNamespace(req_to_token_pool=req_to_token, token_to_kv_pool=pool, sliding_window_size=None,
                                 token_to_kv_pool_allocator=SimpleNamespace(), page_size=1, model_config=config, is_draft_worker=False,
                                 # what 0.5.23's constructor reads besides
                                 kv_index_translator=_kv_index_translator(req_to_token, pool, device),
                                 kv_cache_dtype=pool.dtype,
                                 decode_num_tokens_per_req=lambda: rows,
                                 spec_algorithm=SimpleNamespace(is_dspark=lambda: False),
                                 device=device, gpu_id=0, server_args=SimpleNamespace(
                                     triton_attention_num_kv_splits=8, enable_deterministic_inference=False,
                                     triton_attention_split_tile_size=None, chunked_prefill_size=64))
        return TritonAttnBackend(runner)
    finally:
        get_context().override("test", speculative_num_draft_tokens=saved)


def _scattered_kv(hq: int, hkv: int, d: int, size: int, context: int, device: str, seed: int):
    """One layer's real KV pool (random K/V, float32) and a request-to-token table of 4 rows of `context` slots
    each, scattered over the pool; the layer's RadixAttention. (pool, req_to_token, k_pool, v_pool, layer)"""
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

    pool = MHATokenToKVPool(size=size, page_size=1, dtype=torch.float32, head_num=hkv, head_dim=d, layer_num=1,
                            device=device, enable_memory_saver=False, enable_alt_stream=False)
    req_to_token = ReqToTokenPool(size=4, max_context_len=context, device=device, enable_memory_saver=False)
    g = torch.Generator().manual_seed(seed)
    for r in range(4):
        req_to_token.req_to_token[r] = (torch.randperm(size - 1, generator=g)[:context] + 1).to(torch.int32)
    k_pool, v_pool = pool.get_key_buffer(0), pool.get_value_buffer(0)
    k_pool.copy_(torch.randn(k_pool.shape, generator=g).to(device))
    v_pool.copy_(torch.randn(v_pool.shape, generator=g).to(device))
    layer = RadixAttention(num_heads=hq, head_dim=d, scaling=d ** -0.5, num_kv_heads=hkv, layer_id=0)
    return pool, req_to_token, k_pool, v_pool, layer


def _kv_index_translator(req_to_token, pool, device: str):
    """0.5.23's one converter of KV ids for a model runner (None before 0.5.23, which has none)."""
    try:
        from sglang.srt.mem_cache.kv_index_translator import KVIndexTranslator
    except ImportError:
        return None
    from types import SimpleNamespace

    return KVIndexTranslator(req_to_token=req_to_token.req_to_token, token_to_kv_pool_allocator=SimpleNamespace(),
                             token_to_kv_pool=pool, page_size=1, device=device)


def _one_row_verify_batch(req_to_token, prefix: torch.Tensor, rows_of: torch.Tensor, rows: int = 1,
                          custom_mask: torch.Tensor | None = None):
    """A DFlash TARGET_VERIFY batch of `rows` rows a request (one by default): their slots the next in the
    request's request-to-token row (where DFlash's step takes the verify's slots from), the committed lengths as
    the batch's lengths; a tree's `custom_mask` (SGLang's layout) where given."""
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode
    from sglang.srt.speculative.dflash_info import DFlashVerifyInput

    bs, dev = len(prefix), prefix.device
    places = prefix[:, None] + torch.arange(rows, device=dev)[None, :]
    loc = req_to_token.req_to_token[rows_of[:, None], places].to(torch.int64).reshape(-1)
    positions = places.reshape(-1)
    spec = DFlashVerifyInput(draft_token=torch.zeros(bs * rows, dtype=torch.int64, device=dev),
                             positions=positions, draft_token_num=rows, custom_mask=custom_mask,
                             capture_hidden_mode=CaptureHiddenMode.FULL)
    return ForwardBatch(forward_mode=ForwardMode.TARGET_VERIFY, batch_size=bs, input_ids=torch.zeros(
                        bs * rows, dtype=torch.int64, device=dev), req_pool_indices=rows_of, seq_lens=prefix.clone(),
                        out_cache_loc=loc, seq_lens_sum=int(prefix.sum()), seq_lens_cpu=prefix.cpu(),
                        positions=positions, spec_info=spec)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_one_row_verify_reads_its_context_with_the_decode_kernel_eager_and_as_its_graphs_replay(served, device,
                                                                                                 monkeypatch):
    """Patch 9: a width-1 verify backend (the `none` shape's) runs SGLang's decode kernel (Triton's interpreter
    on the CPU; compiled on a GPU, where the KV split counts are chosen per request), planned as a decode of each request's committed length + 1, eager and through the graph path's
    metadata (captured once, then replayed at other lengths): each row's output is plain attention over its
    context and itself, as the stock backend's extend kernel gives it, and the extend kernel never runs. On 0.5.23,
    whose backends read a pass's KV ids through the iteration's plan, the patch is not applied and says why (the
    `none` shape then verifies on its backend's verify kernel, as the worker's log says)."""
    from types import SimpleNamespace

    if sglang_on_cpu.on_0_5_23():
        from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

        backend = TritonAttnBackend.__new__(TritonAttnBackend)
        backend.num_draft_tokens = 1
        why = sglang_patches.decode_one_row_verify(backend)
        assert why is not None and "0.5.23" in why and not getattr(backend, "_dspine_decode_one_row", False)
        return

    hq, hkv, d = 4, 2, 64
    pool, req_to_token, k_pool, v_pool, layer = _scattered_kv(hq, hkv, d, 256, 96, device, seed=9)
    tol = dict(atol=1e-5, rtol=1e-5) if device == "cpu" else dict(atol=3e-3, rtol=3e-3)  # TF32 dots on a GPU
    stock = _triton_backend(1, pool, req_to_token, hq, hkv, d, device)
    patched = _triton_backend(1, pool, req_to_token, hq, hkv, d, device)
    assert sglang_patches.decode_one_row_verify(patched) is None
    assert sglang_patches.decode_one_row_verify(patched) is None  # idempotent
    ran = []
    for name in ("decode_attention_fwd", "extend_attention_fwd"):
        fwd = getattr(patched, name)
        setattr(patched, name, lambda *a, _f=fwd, _n=name, **k: (ran.append(_n), _f(*a, **k))[1])

    def step(backend, prefix, rows_of, graph=None):
        prefix, rows_of = prefix.to(device), rows_of.to(device)
        fb = _one_row_verify_batch(req_to_token, prefix, rows_of)
        q = torch.randn(len(prefix), hq * d, generator=torch.Generator().manual_seed(int(prefix.sum()))).to(device)
        k, v = (torch.randn(len(prefix), hkv, d, generator=torch.Generator().manual_seed(int(prefix.sum()) + i))
                .to(device) for i in (1, 2))
        if graph is None:
            backend.init_forward_metadata(fb)
        else:
            backend.init_forward_metadata_out_graph(fb, in_capture=graph == "capture")
        out = backend.forward(q, k, v, layer, fb).view(-1, hq, d)
        slots = req_to_token.req_to_token[rows_of, :].long()
        indptr = torch.zeros(len(prefix) + 1, dtype=torch.int32, device=device)
        indptr[1:] = torch.cumsum(prefix, 0)
        indices = torch.cat([slots[i, : prefix[i]] for i in range(len(prefix))])
        want = _chain_attention(q.view(-1, hq, d), k, v, k_pool, v_pool, indptr, indices, 1)
        return out, want

    rows_of = torch.tensor([2, 0, 3])
    for prefix in (torch.tensor([5, 40, 17]), torch.tensor([63, 1, 30])):
        out, want = step(stock, prefix, rows_of)
        torch.testing.assert_close(out, want, **tol)
        out, want = step(patched, prefix, rows_of)
        torch.testing.assert_close(out, want, **tol)
    assert set(ran) == {"decode_attention_fwd"}
    # the graph path: buffers of a runner capturing 4 requests, captured at one set of lengths, replayed at others
    patched.init_cuda_graph_state(4, 4)
    ran.clear()
    out, want = step(patched, torch.tensor([7, 7, 7]), rows_of, graph="capture")
    torch.testing.assert_close(out, want, **tol)
    captured = patched.forward_metadata
    for prefix in (torch.tensor([50, 3, 21]), torch.tensor([90, 12, 44])):
        out, want = step(patched, prefix, rows_of, graph="replay")
        assert patched.forward_metadata is captured  # the replay refills the captured buffers only
        torch.testing.assert_close(out, want, **tol)
    assert set(ran) == {"decode_attention_fwd"}
    # refused, with the reason, where it does not apply
    wide = _triton_backend(4, pool, req_to_token, hq, hkv, d, device)
    with pytest.raises(ValueError, match="4 verify rows"):
        sglang_patches.decode_one_row_verify(wide)
    assert "not SGLang's triton backend" in sglang_patches.decode_one_row_verify(SimpleNamespace())


# ------------------------------------------------------------------ patch 10: chains on the grouped kernel
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("rows", [4, 16])
def test_a_chain_verify_reads_its_context_with_the_grouped_kernel(served, device, rows):
    """Patch 10: a width-W verify backend (SGLang's triton backend as verify_widths.build makes it, on a real KV
    pool) with `grouped_verify` runs DSPINE's grouped kernel through SGLang's own forward_extend dispatch (Triton's
    interpreter on the CPU), at 1 and 3 requests (several context splits, then fewer): each row's output is plain
    causal attention over its context and the chain up to it, as the stock backend's extend kernel gives it, and
    the extend kernel never runs. Refused on another backend, idempotent, and a pass of another width raises.
    SGLang 0.5.17 and 0.5.23 (`served`: the launch's configuration published, as in a scheduler process)."""
    from types import SimpleNamespace

    hq, hkv, d = 8, 2, 32
    pool, req_to_token, k_pool, v_pool, layer = _scattered_kv(hq, hkv, d, 512, 160, device, seed=10)
    tol = dict(atol=2e-5, rtol=1e-4) if device == "cpu" else dict(atol=3e-3, rtol=3e-3)  # TF32 dots on a GPU
    stock = _triton_backend(rows, pool, req_to_token, hq, hkv, d, device)
    patched = _triton_backend(rows, pool, req_to_token, hq, hkv, d, device)
    sglang_patches.grouped_verify(patched, programs=16)
    sglang_patches.grouped_verify(patched, programs=16)  # idempotent
    ran = []
    for name in ("extend_attention_fwd", "verify_splitkv_fwd"):
        fwd = getattr(patched, name)
        setattr(patched, name, lambda *a, _f=fwd, _n=name, **k: (ran.append(_n), _f(*a, **k))[1])

    def step(backend, prefix, rows_of):
        prefix, rows_of = prefix.to(device), rows_of.to(device)
        fb = _one_row_verify_batch(req_to_token, prefix, rows_of, rows)
        seed = int(prefix.sum())
        q = torch.randn(len(prefix) * rows, hq * d, generator=torch.Generator().manual_seed(seed)).to(device)
        k, v = (torch.randn(len(prefix) * rows, hkv, d, generator=torch.Generator().manual_seed(seed + i))
                .to(device) for i in (1, 2))
        backend.init_forward_metadata(fb)
        out = backend.forward(q, k, v, layer, fb).view(-1, hq, d)
        slots = req_to_token.req_to_token[rows_of, :].long()
        indptr = torch.zeros(len(prefix) + 1, dtype=torch.int32, device=device)
        indptr[1:] = torch.cumsum(prefix, 0)
        indices = torch.cat([slots[i, : prefix[i]] for i in range(len(prefix))])
        return out, _chain_attention(q.view(-1, hq, d), k, v, k_pool, v_pool, indptr, indices, rows)

    for prefix, rows_of in ((torch.tensor([70]), torch.tensor([1])), (torch.tensor([5, 130, 17]),
                                                                     torch.tensor([2, 0, 3]))):
        out, want = step(stock, prefix, rows_of)
        torch.testing.assert_close(out, want, **tol)
        out, want = step(patched, prefix, rows_of)
        torch.testing.assert_close(out, want, **tol)
    assert set(ran) == {"verify_splitkv_fwd"}
    # a pass of another width than the backend's is not served silently
    fb = _one_row_verify_batch(req_to_token, torch.tensor([9]).to(device), torch.tensor([1]).to(device), rows + 1)
    patched.init_forward_metadata(fb)
    q = torch.zeros((rows + 1), hq * d, device=device)
    kv = torch.zeros(rows + 1, hkv, d, device=device)
    with pytest.raises(RuntimeError, match=f"{rows + 1} rows for 1 requests of {rows}"):
        patched.forward(q, kv, kv, layer, fb)
    with pytest.raises(StartupRefusal, match="needs the triton attention backend"):
        sglang_patches.grouped_verify(SimpleNamespace())
    # unset (the default), another backend keeps its kernel and the worker logs why
    assert "not triton" in sglang_patches.grouped_verify(SimpleNamespace(), required=False)
    # a tree's backend (SGLANG_DSPINE_SPLITKV_VERIFY=grouped on a tree server): the pass's mask, as the stock
    # backend's extend kernel reads it
    from tree_masks import tree_mask

    tree = _triton_backend(rows, pool, req_to_token, hq, hkv, d, device)
    sglang_patches.grouped_verify(tree, programs=16, tree=True)
    prefix, rows_of = torch.tensor([5, 130, 17]).to(device), torch.tensor([2, 0, 3]).to(device)
    mask, _ = tree_mask(rows, prefix.tolist(), seed=rows, device=device)
    q = torch.randn(3 * rows, hq * d, generator=torch.Generator().manual_seed(1)).to(device)
    k, v = (torch.randn(3 * rows, hkv, d, generator=torch.Generator().manual_seed(i)).to(device) for i in (2, 3))
    outs = []
    for backend in (stock, tree):
        fb = _one_row_verify_batch(req_to_token, prefix, rows_of, rows, custom_mask=mask)
        backend.init_forward_metadata(fb)
        outs.append(backend.forward(q, k, v, layer, fb).view(-1, hq, d))
    torch.testing.assert_close(outs[1], outs[0], **tol)
    fb = _one_row_verify_batch(req_to_token, prefix, rows_of, rows)  # a chain's pass: causal, not the tree's
    stock.init_forward_metadata(fb)
    assert not torch.allclose(stock.forward(q, k, v, layer, fb).view(-1, hq, d), outs[0], atol=1e-3)


@pytest.mark.parametrize("env, grouped", [(None, True), ("grouped", True), ("0", False)])
def test_a_tree_servers_verify_backend_gets_the_grouped_kernel_by_default(served, monkeypatch, env, grouped):
    """The worker's kernel choice for a fixed tree server (N = 8 > B = 4): unset or grouped, the target's own
    backend (the tree's, with its mask) verifies on DSPINE's grouped kernel (the default since the lease at 671b819
    measured it faster than the extend kernel); SGLANG_DSPINE_SPLITKV_VERIFY=0 leaves SGLang's extend kernel.
    DFlash's own backend set-up (a GPU's) is skipped; the backend is SGLang's real triton backend."""
    from types import SimpleNamespace

    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2

    from sglang_dspine.serving.worker import DSpineWorker

    if env is None:
        monkeypatch.delenv("SGLANG_DSPINE_SPLITKV_VERIFY", raising=False)
    else:
        monkeypatch.setenv("SGLANG_DSPINE_SPLITKV_VERIFY", env)
    pool, req_to_token, *_ = _scattered_kv(8, 2, 32, 256, 64, "cpu", seed=3)
    backend = _triton_backend(8, pool, req_to_token, 8, 2, 32)
    stock_fwd = backend.verify_splitkv_fwd
    monkeypatch.setattr(DFlashWorkerV2, "init_attention_backends", lambda self: None)
    worker = DSpineWorker.__new__(DSpineWorker)
    worker.block_size, worker.tree_rows = 4, 8
    worker.model_runner = SimpleNamespace(attn_backend=backend)
    worker.init_attention_backends()
    assert getattr(backend, "_dspine_grouped", False) is grouped
    assert (backend.verify_splitkv_fwd is not stock_fwd) is grouped
    assert bool(backend.use_verify_splitkv) is grouped
