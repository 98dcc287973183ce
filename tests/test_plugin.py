"""The SGLang plugin with SGLang imported for real (CPU): registration, server arguments, weight loading."""
import logging
import os
import re
import subprocess
import sys

import pytest
import sglang  # noqa: F401  (SGLang imported for real: a broken install fails these tests, never skips them)
import sglang_on_cpu
import torch
from safetensors.torch import load_file

from sglang_dspine.drafter.checkpoint import save_drafter
from sglang_dspine.drafter.tiny import make_target, tiny_drafter
from sglang_dspine.serving.plugin import sglang_version


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    target = make_target()
    target.save_pretrained(root / "target")
    d = tiny_drafter(target, seed=0)
    save_drafter(d, root / "dspine")
    save_drafter(tiny_drafter(target, "dflash"), root / "dflash")
    return root, d


def test_entry_point_registers_in_a_fresh_interpreter():
    code = (
        "from sglang.srt.plugins import load_plugins; load_plugins();"
        "from sglang.srt.speculative.spec_info import SpeculativeAlgorithm as S;"
        "a = S.from_string('dspine'); assert a is S.from_string('DSPINE');"
        "assert a.is_dflash_family() and a.is_dflash() and a.supports_target_verify_for_draft();"
        "assert not a.need_topk() and not a.carries_draft_hidden_states() and not a.is_eagle();"
        "from sglang.srt.models.registry import ModelRegistry as R;"
        "from sglang_dspine.serving.sglang_model import DSpineDraftModel;"
        "assert R.models['DSpineDraftModel'] is DSpineDraftModel;"
        "import sglang_dspine.serving.plugin as p; p.register(); p.register();"  # idempotent
        "print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok")


def test_baseline_servers_load_sglang_without_this_plugin():
    """serving_scale's DFlash2 server runs SGLang as a user without this package does: its SGLANG_PLUGINS
    whitelist leaves DSPINE unregistered, where the same interpreter without it registers DSPINE."""
    from benchmarks import serving_scale as scale

    code = ("from sglang.srt.plugins import load_plugins; load_plugins();"
            "from sglang.srt.speculative.spec_info import SpeculativeAlgorithm as S\n"
            "try:\n    S.from_string('DSPINE'); print('registered')\nexcept ValueError:\n    print('absent')")
    for env, want in (({"SGLANG_PLUGINS": scale.plugins_but_ours()}, "absent"), ({}, "registered")):
        e = {k: v for k, v in os.environ.items() if k != "SGLANG_PLUGINS"}
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env={**e, **env})
        assert out.returncode == 0, out.stderr[-3000:]
        assert out.stdout.strip().splitlines()[-1] == want, (env, out.stdout[-500:])


# What the harness does differently on SGLang 0.5.23: server arguments are a record settled after parsing
# (`resolve_once()`), whose resolved values are read through a view (0.5.17 settles them while parsing, into the
# fields); model-parallel widths come from the published configuration; the loaders' post-load hook is public.
ON_0_5_23 = sglang_version() >= (0, 5, 23)


def _args(root, draft, *extra):
    """The server arguments of a launch with this command line, settled and checked as the server does it."""
    return sglang_on_cpu.server_args(root / "target", draft, *(extra or ["DSPINE"]))


_resolved = sglang_on_cpu.resolved


@pytest.mark.parametrize("extra", [[], ["--enable-mixed-chunk"]], ids=["defaults", "mixed-chunk"])
def test_server_args_match_dflash(dirs, extra):
    root, _ = dirs
    dsp = _resolved(_args(root, root / "dspine", "DSPINE", *extra))
    # the DFlash drafter of the same shape: DFLASH refuses a DSpine one
    dfl = _resolved(_args(root, root / "dflash", "DFLASH", *extra))
    assert dsp.speculative_algorithm == "DSPINE"
    for key in ("speculative_num_draft_tokens", "speculative_num_steps", "speculative_eagle_topk",
                "speculative_draft_attention_backend", "max_running_requests", "enable_mixed_chunk",
                "sampling_backend", "disable_overlap_schedule"):
        assert getattr(dsp, key) == getattr(dfl, key), key
    assert dsp.speculative_num_draft_tokens == 4


def test_dspine_answers_like_dflash():
    """Every question SGLang asks a speculative algorithm (is_*, supports_*, has_*, need_*, carries_*, and the
    target-verify width) gets DFLASH's answer from DSPINE (it says it is DFLASH, so SGLang takes DFlash's paths)."""
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm as S

    import sglang_dspine.serving.plugin as p

    p.register()
    dsp, dfl = S.from_string("DSPINE"), S.DFLASH
    asked = sorted(n for n in vars(S) if n.startswith(("is_", "supports_", "has_", "need_", "carries_")))
    assert "is_dflash_family" in asked
    if ON_0_5_23:
        assert {"supports_mixed_chunk", "supports_prefill_shared_read_done"} <= set(asked)
    for name in asked:
        assert getattr(dsp, name)() == getattr(dfl, name)(), name
    for drafting in (True, False):
        assert dsp.get_num_tokens_per_req_for_target_verify(16, drafting) == \
            dfl.get_num_tokens_per_req_for_target_verify(16, drafting)
    # the questions that need a batch or a configuration to answer are SpeculativeAlgorithm's own code, which asks
    # only is_*(): disaggregated decode's draft input, the draft-width bound, the future map
    for name in p._TAKEN_FROM_SPECULATIVE_ALGORITHM:
        if hasattr(S, name):
            assert getattr(type(dsp), name) is getattr(S, name), name
    if ON_0_5_23:
        assert hasattr(S, "build_disagg_draft_input") and hasattr(S, "resolve_max_speculative_num_draft_tokens")


@pytest.mark.parametrize("release,refused", [("0.5.20", True), ("0.5.24", True), ("0.5.17.post1", False),
                                              ("0.5.23", False)])
def test_only_supported_sglang_releases_register(monkeypatch, release, refused):
    """The plugin reads the running SGLang's own version and refuses releases it was not tested on, naming them."""
    import sglang.version

    import sglang_dspine.serving.plugin as p

    monkeypatch.setattr(sglang.version, "__version__", release)
    p.sglang_version.cache_clear()
    try:
        if refused:
            with pytest.raises(RuntimeError, match=rf"^sglang-dspine supports SGLang 0\.5\.17 and 0\.5\.23; the installed "
                                                   rf"SGLang is {re.escape(release)} \(install one of them"):
                p.check_sglang_version()
        else:
            p.check_sglang_version()
    finally:
        p.sglang_version.cache_clear()


def test_gpu_scripts_server_flags_parse(dirs):
    """The server flags the GPU benchmarks pass are flags of this SGLang (0.5.23 dropped `--cuda-graph-max-bs`,
    which then is an ambiguous prefix of its -decode and -prefill flags)."""
    from benchmarks.servers import ADAPTIVE_PAIR_ARGS, BASE_ARGS
    from benchmarks.serving_features import FLAGS

    root, _ = dirs
    args = _resolved(_args(root, root / "dspine", "DSPINE", *BASE_ARGS[2:], *FLAGS))  # BASE_ARGS[:2]: --host
    assert args.sampling_backend == "pytorch"
    args = _resolved(_args(root, root / "dspine", "DSPINE", *BASE_ARGS[2:], *ADAPTIVE_PAIR_ARGS))
    assert args.grammar_backend == "none" and args.mem_fraction_static == 0.3


def test_tensor_parallel_args_pass_dspine_checks(dirs):
    root, _ = dirs
    args = _resolved(_args(root, root / "dspine", "DSPINE", "--tp-size", "2"))
    assert args.tp_size == 2 and args.speculative_algorithm == "DSPINE"


# Where a DSPINE server runs: what SGLang's DFlash code (which DSPINE runs) serves on each release, refused at start
# in one line where it does not (startup_checks.check_placement), or refused by SGLang's own DFlash checks and
# reworded in DSPINE's name. Per case: the flags, then the refusal on 0.5.17 and on 0.5.23 (None: the server starts).
DP = ["--tp-size", "2", "--dp-size", "2", "--enable-dp-attention"]
NO_DP_0517 = ("DSPINE: refusing --enable-dp-attention: SGLang 0.5.17's DFlash code, which DSPINE runs, does not support "
              "data-parallel attention; SGLang 0.5.23 does (with --enable-dp-lm-head)")
NO_LM_HEAD = ("DSPINE: data-parallel attention needs --enable-dp-lm-head: the draft runs on each DP group's own ranks "
              "and decodes from the target head, which without it is split over all tensor-parallel ranks (SGLang's "
              "DFlash code, which DSPINE runs, asks the same)")


def _no_disagg_0517(mode):
    return (f"DSPINE: refusing --disaggregation-mode {mode}: SGLang 0.5.17 gives a disaggregated decode server no "
            "DFlash draft input (its first decode step would start from an empty one, without the prefill's tokens), "
            "so DSPINE cannot serve disaggregated there; SGLang 0.5.23 does")


def _reworded(sglang_words):
    return f"DSPINE: refused by SGLang's DFlash checks, which DSPINE runs: {sglang_words}"


PP_WORDS = "Currently DFLASH speculative decoding only supports pp_size == 1."
CP_WORDS = "DFLASH with dp attention does not support context parallel."
PLACEMENTS = [
    ("dp attention", DP, NO_DP_0517, NO_LM_HEAD),
    ("dp attention and dp lm head", [*DP, "--enable-dp-lm-head"], NO_DP_0517, None),
    ("prefill server", ["--disaggregation-mode", "prefill"], _no_disagg_0517("prefill"), None),
    ("decode server", ["--disaggregation-mode", "decode"], _no_disagg_0517("decode"), None),
    ("pipeline parallel", ["--pp-size", "2"], _reworded(PP_WORDS), _reworded(PP_WORDS)),
] + ([  # flags of 0.5.23 only (--enable-dp-attention there is a deprecated spelling of --attn-dp-size)
    ("attn dp size", ["--tp-size", "4", "--attn-dp-size", "2"], None, NO_LM_HEAD),
    ("attn dp size and dp lm head", ["--tp-size", "4", "--attn-dp-size", "2", "--enable-dp-lm-head"], None, None),
    ("dp attention and context parallel",
     ["--tp-size", "4", "--attn-dp-size", "2", "--enable-dp-lm-head", "--attn-cp-size", "2"], None, _reworded(CP_WORDS)),
] if ON_0_5_23 else [])


@pytest.mark.parametrize("flags,refusal", [(flags, r23 if ON_0_5_23 else r17) for _, flags, r17, r23 in PLACEMENTS],
                         ids=[case[0] for case in PLACEMENTS])
def test_what_dspine_cannot_serve_here_is_refused(dirs, flags, refusal):
    """Data-parallel attention and disaggregated prefill/decode servers start where the installed SGLang's DFlash
    code serves them, and are refused in one line where it does not, naming the flag, why and the release that
    serves it; SGLang's own DFlash refusals reach a DSPINE user as one DSPINE line with SGLang's words (stock
    DFLASH keeps them as they are)."""
    from sglang_dspine.serving.plugin import StartupRefusal

    root, _ = dirs
    if refusal is None:
        args = _resolved(_args(root, root / "dspine", "DSPINE", *flags))
        assert args.speculative_algorithm == "DSPINE"
        if "--disaggregation-mode" in flags:
            assert args.disaggregation_mode == flags[-1]
        else:
            assert args.enable_dp_lm_head and (args.attn_dp_size if ON_0_5_23 else args.dp_size) == 2
        return
    with pytest.raises(StartupRefusal) as refused:
        _args(root, root / "dspine", "DSPINE", *flags)
    assert str(refused.value) == refusal
    sglang_words = refusal.partition("which DSPINE runs: ")[2]
    if sglang_words:  # SGLang's own refusal: DFLASH gets it as SGLang words it
        with pytest.raises(ValueError, match=f"^{re.escape(sglang_words)}$") as stock:
            _args(root, root / "dflash", "DFLASH", *flags)
        assert not isinstance(stock.value, StartupRefusal)


SPLIT_KV_REFUSED = "DSPINE: refusing SGLANG_DSPINE_SPLITKV_VERIFY=1: "


@pytest.mark.parametrize("flags,tree,refusal", [
    (["--attention-backend", "triton"], False, None),
    (["--attention-backend", "fa3"], False, "it switches a kernel of the triton attention backend: pass "
     "--attention-backend triton (found --attention-backend fa3"),
    (["--attention-backend", "triton", "--decode-attention-backend", "flashinfer"], False,
     "it switches a kernel of the triton attention backend"),
    (["--attention-backend", "triton"], True, "a tree's verify needs its mask"),
], ids=["triton", "fa3", "flashinfer-decode", "tree"])
def test_split_kv_verify_starts_only_on_the_triton_backend(dirs, monkeypatch, flags, tree, refusal):
    """SGLANG_DSPINE_SPLITKV_VERIFY=1 (patch 8) starts a DSPINE server whose target verifies on SGLang's triton
    backend, and is refused in one line elsewhere (it would do nothing) and beside a tree (whose mask the kernel
    does not read). Both releases."""
    from sglang_dspine.serving.plugin import StartupRefusal

    root, _ = dirs
    monkeypatch.setenv("SGLANG_DSPINE_SPLITKV_VERIFY", "1")
    if tree:
        monkeypatch.setenv("SGLANG_DSPINE_TREE", "1")
        if ON_0_5_23:  # the tree is refused there first, whatever else
            refusal = None
    if refusal is None and not (tree and ON_0_5_23):
        _args(root, root / "dspine", "DSPINE", *flags)
    elif refusal is None:
        with pytest.raises(StartupRefusal, match="SGLANG_DSPINE_TREE=1"):
            _args(root, root / "dspine", "DSPINE", *flags)
    else:
        with pytest.raises(StartupRefusal) as refused:
            _args(root, root / "dspine", "DSPINE", *flags)
        assert str(refused.value).startswith(SPLIT_KV_REFUSED + refusal)


def test_split_kv_verify_switches_sglangs_own_dispatch():
    """Patch 8 sets the flag SGLang's triton backend dispatches its verify on (checked to be still read by its
    extend path, else refused: it would silently do nothing), and refuses any other backend in one line."""
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

    from sglang_dspine.serving import sglang_patches
    from sglang_dspine.serving.plugin import StartupRefusal

    backend = TritonAttnBackend.__new__(TritonAttnBackend)  # SGLang's class; its constructor needs a model runner
    stock = lambda *a, **k: True  # noqa: E731 (SGLang's kernel handle; test_serving_glue runs the real one)
    backend.verify_splitkv_fwd, backend.use_verify_splitkv, backend.max_context_len = stock, False, 4096
    sglang_patches.split_kv_verify(backend)
    assert backend.use_verify_splitkv is True
    wrapped = backend.verify_splitkv_fwd  # its split count for graphs (patch 8), once however often applied
    assert wrapped is not stock and getattr(wrapped, "_dspine_graph_splits", False)
    sglang_patches.split_kv_verify(backend)
    assert backend.verify_splitkv_fwd is wrapped
    with pytest.raises(StartupRefusal, match="needs the triton attention backend"):
        sglang_patches.split_kv_verify(object())


@pytest.mark.parametrize("flags", [["--attention-backend", "fa3"], ["--attention-backend", "triton"]],
                         ids=["fa3", "triton"])
def test_the_default_verify_kernel_never_refuses_a_server(dirs, monkeypatch, flags):
    """SGLANG_DSPINE_SPLITKV_VERIFY unset (grouped where the backend is triton) starts a DSPINE server on any
    attention backend and beside a tree (0.5.17 on triton; 0.5.23 refuses the tree itself): the default applies where it
    can and the worker logs where it does not. Set to grouped, the same server on fa3 is refused in one line, and
    on triton a fixed tree server starts (the kernel reads the tree's mask)."""
    from sglang_dspine.serving.plugin import StartupRefusal

    root, _ = dirs
    monkeypatch.delenv("SGLANG_DSPINE_SPLITKV_VERIFY", raising=False)
    _args(root, root / "dspine", "DSPINE", *flags)
    if not ON_0_5_23 and flags[1] == "triton":  # a tree needs triton itself
        monkeypatch.setenv("SGLANG_DSPINE_TREE", "1")
        _args(root, root / "dspine", "DSPINE", *flags)
        monkeypatch.delenv("SGLANG_DSPINE_TREE")
    monkeypatch.setenv("SGLANG_DSPINE_SPLITKV_VERIFY", "grouped")
    if flags[1] == "fa3":
        with pytest.raises(StartupRefusal, match="^DSPINE: refusing SGLANG_DSPINE_SPLITKV_VERIFY=grouped: it "
                                                 "switches a kernel of the triton attention backend"):
            _args(root, root / "dspine", "DSPINE", *flags)
    else:
        _args(root, root / "dspine", "DSPINE", *flags)
        if not ON_0_5_23:  # set, grouped also serves a fixed tree server (it reads the tree's mask)
            monkeypatch.setenv("SGLANG_DSPINE_TREE", "1")
            _args(root, root / "dspine", "DSPINE", *flags)


@pytest.mark.parametrize("raw,mode", [("", "grouped"), ("0", None), ("1", "all"), ("below-block", "below-block"),
                                      ("grouped", "grouped"), ("yes", ValueError)])
def test_split_kv_verify_names_which_chain_widths_read_the_context_split(monkeypatch, raw, mode):
    """SGLANG_DSPINE_SPLITKV_VERIFY: 0 no chain (the extend kernel), 1 every chain width, below-block the widths
    narrower than the block (the block keeps the extend kernel), grouped (and unset, the default) every chain width
    on DSPINE's kernel; a malformed value is an error naming the variable."""
    from sglang_dspine.env import ENV
    from sglang_dspine.serving.verify_widths import reads_context_split_kv

    monkeypatch.setenv("SGLANG_DSPINE_SPLITKV_VERIFY", raw)
    if mode is ValueError:
        with pytest.raises(ValueError, match="^SGLANG_DSPINE_SPLITKV_VERIFY: expected 0, 1, below-block or grouped"):
            _ = ENV.split_kv_verify
        return
    assert ENV.split_kv_verify == mode
    block = 16
    split = {rows: reads_context_split_kv(ENV.split_kv_verify, rows, block) for rows in (1, 4, 8, 16)}
    expected = {None: set(), "all": {1, 4, 8, 16}, "below-block": {1, 4, 8}, "grouped": {1, 4, 8, 16}}[mode]
    assert {rows for rows, on in split.items() if on} == expected


@pytest.mark.parametrize("verify", ["fixed", "adaptive"])
def test_split_kv_below_the_block_needs_the_adaptive_server(dirs, monkeypatch, verify):
    """SGLANG_DSPINE_SPLITKV_VERIFY=below-block leaves the block on the extend kernel, so a fixed server (which
    verifies only the block) is refused in one line instead of silently changing nothing; an adaptive server on
    the triton backend starts (SGLang 0.5.17 and 0.5.23)."""
    from sglang_dspine.serving.plugin import StartupRefusal

    root, _ = dirs
    monkeypatch.setenv("SGLANG_DSPINE_SPLITKV_VERIFY", "below-block")
    monkeypatch.setenv("SGLANG_DSPINE_VERIFY", verify)
    if verify == "fixed":
        with pytest.raises(StartupRefusal) as refused:
            _args(root, root / "dspine", "DSPINE", "--attention-backend", "triton")
        assert str(refused.value).startswith("DSPINE: refusing SGLANG_DSPINE_SPLITKV_VERIFY=below-block: a fixed "
                                             "server verifies only the block")
    else:
        _args(root, root / "dspine", "DSPINE", "--attention-backend", "triton")


TREE_REFUSED = "DSPINE: refusing SGLANG_DSPINE_TREE=1: "
TREE_CASES = [  # flags; the refusal's reason on 0.5.17 (None: the server starts)
    ("triton", ["--attention-backend", "triton"], None),
    ("fa3", ["--attention-backend", "fa3"], "the target's verify pass must read the tree mask: pass "
     "--attention-backend triton (found --attention-backend fa3"),
    ("flashinfer", ["--attention-backend", "flashinfer"], "the target's verify pass must read the tree mask"),
    ("triton, fa3 decode", ["--attention-backend", "triton", "--decode-attention-backend", "fa3"],
     "the target's verify pass must read the tree mask"),
    ("pages", ["--attention-backend", "triton", "--page-size", "16"],
     "the accepted path's KV slots are reordered token by token: pass --page-size 1 (found 16)"),
    ("two ranks", ["--attention-backend", "triton", "--tp-size", "2"],
     "it runs on one rank, without data-parallel attention or disaggregation, so far"),
]


@pytest.mark.parametrize("flags,reason", [case[1:] for case in TREE_CASES], ids=[case[0] for case in TREE_CASES])
def test_tree_verification_starts_only_where_it_is_built(dirs, monkeypatch, flags, reason):
    """SGLANG_DSPINE_TREE=1 starts a DSPINE server on SGLang 0.5.17, one rank, the triton attention backend and
    page size 1 (what the tree step is built for), and refuses anything else in one line naming the flag to pass;
    on 0.5.23 it is refused whatever the flags (its DFlash decode step differs). Without the variable the same
    flags are not its business."""
    from sglang_dspine.serving.plugin import StartupRefusal

    root, _ = dirs
    monkeypatch.setenv("SGLANG_DSPINE_TREE", "1")
    if ON_0_5_23:
        reason = "it is built on SGLang 0.5.17's DFlash decode step; install sglang==0.5.17 or unset it"
    if reason is None:
        from sglang.srt.runtime_context import publish
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        from sglang_dspine.serving.worker import DSpineWorker

        args = _args(root, root / "dspine", "DSPINE", *flags)
        assert _resolved(args).attention_backend == "triton"
        publish(args, role="test")  # what a scheduler process does before it creates the worker
        assert SpeculativeAlgorithm.from_string("DSPINE").create_worker(args) is DSpineWorker
    else:
        with pytest.raises(StartupRefusal) as refused:
            _args(root, root / "dspine", "DSPINE", *flags)
        assert str(refused.value).startswith(TREE_REFUSED + reason)
    monkeypatch.setenv("SGLANG_DSPINE_TREE", "0")
    if "--page-size" in flags:  # refused above only for the tree
        assert _resolved(_args(root, root / "dspine", "DSPINE", *flags)).speculative_algorithm == "DSPINE"


ADAPTIVE_REFUSED = "DSPINE: refusing SGLANG_DSPINE_VERIFY=adaptive: "
ADAPTIVE_CASES = [  # env, flags; the refusal (None: the server starts; the tree's cases differ on 0.5.23, below)
    ("default", {}, [], None),
    ("fa3", {}, ["--attention-backend", "fa3"], None),
    ("shapes", {"SGLANG_DSPINE_SHAPES": "none,2"}, [], None),
    ("bad shape", {"SGLANG_DSPINE_SHAPES": "none,9"}, [], "DSPINE: SGLANG_DSPINE_SHAPES: width 9 outside 2..4"),
    ("bad value", {"SGLANG_DSPINE_VERIFY": "sometimes"}, [], "DSPINE: SGLANG_DSPINE_VERIFY: expected fixed or "
     "adaptive, found 'sometimes'"),
    ("tree", {"SGLANG_DSPINE_TREE": "1"}, ["--attention-backend", "triton", "--speculative-num-draft-tokens", "4"],
     None),
    ("tree on fa3", {"SGLANG_DSPINE_TREE": "1"}, ["--attention-backend", "fa3"],
     TREE_REFUSED + "the target's verify pass must read the tree mask"),
    ("two ranks", {}, ["--tp-size", "2"],
     ADAPTIVE_REFUSED + "it runs on one rank, without data-parallel attention or disaggregation, so far"),
]


@pytest.mark.parametrize("env,flags,refusal", [c[1:] for c in ADAPTIVE_CASES], ids=[c[0] for c in ADAPTIVE_CASES])
def test_adaptive_verification_starts_only_where_it_is_built(dirs, monkeypatch, env, flags, refusal):
    """SGLANG_DSPINE_VERIFY=adaptive starts a DSPINE server on SGLang 0.5.17 and 0.5.23, one rank, any attention
    backend, with the adaptive worker and a cap of 128 running requests instead of the DFLASH family's 48 (the
    narrow shapes serve what plain decoding would); a malformed value or shape menu or more ranks are refused in
    one line, and a tree (SGLANG_DSPINE_TREE=1) joins the menu under its own checks (on 0.5.23 the tree is refused
    whatever the flags). An explicit --max-running-requests is kept."""
    from sglang_dspine.serving.plugin import StartupRefusal

    root, _ = dirs
    monkeypatch.setenv("SGLANG_DSPINE_VERIFY", "adaptive")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    if ON_0_5_23 and "SGLANG_DSPINE_TREE" in env:  # the tree is built on 0.5.17's step, checked first
        refusal = TREE_REFUSED + "it is built on SGLang 0.5.17's DFlash decode step"
    if refusal is None:
        from sglang.srt.runtime_context import publish
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        from sglang_dspine.serving.worker import DSpineWorker

        args = _args(root, root / "dspine", "DSPINE", *flags)
        assert _resolved(args).max_running_requests == 128
        publish(args, role="test")
        assert SpeculativeAlgorithm.from_string("DSPINE").create_worker(args) is DSpineWorker
        assert _resolved(_args(root, root / "dspine", "DSPINE", *flags, "--max-running-requests", "20")
                         ).max_running_requests == 20
    else:
        with pytest.raises(StartupRefusal) as refused:
            _args(root, root / "dspine", "DSPINE", *flags)
        assert str(refused.value).startswith(refusal)
    monkeypatch.setenv("SGLANG_DSPINE_VERIFY", "fixed")
    monkeypatch.delenv("SGLANG_DSPINE_TREE", raising=False)
    if "--tp-size" not in flags:
        assert _resolved(_args(root, root / "dspine", "DSPINE", *flags)).max_running_requests == 48


def _calibrated(root, name):
    from sglang_dspine.drafter.tree_calibration import FILE_NAME, TreeCalibration

    draft = _variant(root, name)
    TreeCalibration(4, [0.3, 0.2, 0.1], [-0.2, -0.1, 0.0], {"by": "test_plugin"}).save(str(draft / FILE_NAME))
    return draft


def test_a_tree_wider_than_the_block_starts_only_with_a_calibration(dirs, monkeypatch):
    """--speculative-num-draft-tokens N above the drafter's block B = 4: with SGLANG_DSPINE_TREE=1 on 0.5.17 and
    the drafter's tree calibration beside it, the server starts verifying N = 8 rows; without the calibration,
    below the block, or without the variable it is refused in one line saying why (on 0.5.23 the variable is
    refused whatever N)."""
    from sglang_dspine.drafter.tree_calibration import FILE_NAME
    from sglang_dspine.serving.plugin import StartupRefusal

    root, _ = dirs
    calibrated = _calibrated(root, "calibrated")
    wide = ["DSPINE", "--attention-backend", "triton", "--speculative-num-draft-tokens"]
    monkeypatch.setenv("SGLANG_DSPINE_TREE", "1")
    if ON_0_5_23:
        with pytest.raises(StartupRefusal, match="^" + re.escape(TREE_REFUSED + "it is built on SGLang 0.5.17")):
            _args(root, calibrated, *wide, "8")
    else:
        assert _resolved(_args(root, calibrated, *wide, "8")).speculative_num_draft_tokens == 8
        plain = root / "dspine"
        with pytest.raises(StartupRefusal, match="^" + re.escape(
                f"DSPINE: refusing drafter {plain}: no tree calibration {plain / FILE_NAME}: fit one with "
                f"`sglang-dspine tree-calibrate --drafter {plain} --target TARGET --prompts PROMPTS.jsonl`")):
            _args(root, plain, *wide, "8")
        with pytest.raises(StartupRefusal, match="^" + re.escape(
                f"DSPINE: refusing drafter {calibrated}: --speculative-num-draft-tokens/--speculative-dflash-block-size "
                "2 is below the drafter's block_size 4")):
            _args(root, calibrated, *wide, "2")
    monkeypatch.setenv("SGLANG_DSPINE_TREE", "0")
    with pytest.raises(StartupRefusal, match=re.escape(
            "drafter block_size 4 but --speculative-num-draft-tokens/--speculative-dflash-block-size is 8; they must "
            "be equal (or, with SGLANG_DSPINE_TREE=1, larger")):
        _args(root, calibrated, *wide, "8")


def test_the_draft_forward_is_the_blocks_width_in_sglang(dirs, monkeypatch):
    """What SGLang sizes a runner's TARGET_VERIFY CUDA graphs from (`resolve_num_tokens_per_req`, the hook DSpark
    uses): N for the target, the block for the draft worker once the tree worker has said it
    (`draft_rows_per_req`), N for both before."""
    from sglang.srt.runtime_context import publish
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang.srt.speculative.spec_utils import resolve_num_tokens_per_req

    root, _ = dirs
    args = _args(root, root / "dspine", "DSPINE")
    publish(args, role="test")  # what a scheduler process does before its model runners size their graphs
    algo = SpeculativeAlgorithm.from_string("DSPINE")

    def width(draft):  # 0.5.23 reads its settled arguments itself
        known = {} if ON_0_5_23 else {"server_args": args}
        return resolve_num_tokens_per_req(phase="target_verify", spec_algorithm=algo, is_draft_worker=draft,
                                          num_draft_tokens=8, **known)

    assert (width(False), width(True)) == (8, 8)
    monkeypatch.setattr(algo, "draft_rows_per_req", 4)
    assert (width(False), width(True)) == (8, 4)


def test_the_tree_worker_hands_dflash_the_blocks_arguments(dirs, monkeypatch):
    """DSPINE's worker under SGLANG_DSPINE_TREE=1 with N = 8 > B = 4 (0.5.17): DFlash's constructor (which builds the draft worker, its CUDA
    graphs and block buffers from --speculative-num-draft-tokens, and needs a GPU) is handed a copy of the server
    arguments saying B (through ServerArgs.override, SGLang's one mutation point), the server's own arguments keep
    N, SGLang is told the draft forward's width, and the drafter's calibration is loaded. Recorded here in place
    of DFlash's constructor, which cannot run on a CPU. On 0.5.23 the settled arguments have no such mutation point
    (one reason SGLANG_DSPINE_TREE=1 is refused there at start)."""
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    from sglang_dspine.serving.verify_shapes import Shape
    from sglang_dspine.serving.worker import DSpineWorker

    if ON_0_5_23:
        assert not hasattr(ServerArgs, "override")
        return
    root, _ = dirs
    monkeypatch.setenv("SGLANG_DSPINE_TREE", "1")
    args = _args(root, _calibrated(root, "calibrated_worker"), "DSPINE", "--attention-backend", "triton",
                 "--speculative-num-draft-tokens", "8")
    handed = []

    def dflash_init(self, server_args, gpu_id, ps, nccl_port, target_worker):
        handed.append(server_args)
        self.block_size, self.device = int(server_args.speculative_num_draft_tokens), "cpu"

    monkeypatch.setattr(DFlashWorkerV2, "__init__", dflash_init)
    algo = SpeculativeAlgorithm.from_string("DSPINE")
    monkeypatch.setattr(algo, "draft_rows_per_req", None)
    worker = DSpineWorker(server_args=args, gpu_id=0, ps=None, nccl_port=0, target_worker=None)
    assert [a.speculative_num_draft_tokens for a in handed] == [4] and handed[0] is not args
    assert args.speculative_num_draft_tokens == 8 and worker.tree_rows == 8 and worker.block_size == 4
    assert worker.shapes == (Shape(8, tree=True),) and worker.policy is None  # a fixed server of the tree
    assert algo.draft_rows_per_req == 4
    assert worker.calibration.temperature == [0.3, 0.2, 0.1]
    assert [t.tolist() for t in worker._calibration] == [pytest.approx([0.3, 0.2, 0.1]), pytest.approx([-0.2, -0.1, 0])]


@pytest.mark.parametrize("verify", ["fixed", "adaptive"])
def test_the_worker_reads_its_shapes_and_log_prob_duty_from_the_configuration(dirs, monkeypatch, caplog, verify):
    """The one worker, constructed as SGLang constructs it (DFlash's constructor, which needs a GPU, recorded in
    its place): a fixed server verifies the block every step and has no policy; an adaptive one holds the menu
    (its policy is built with the graphs; on 0.5.23 its log says it is CPU-tested only); it supplies log-probs
    exactly where DFlash's worker refuses them; on both releases the arguments reach DFlash's constructor as they came (no drafter read before it)."""
    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2

    from sglang_dspine.serving.verify_shapes import Shape
    from sglang_dspine.serving.versions import dflash_returns_logprobs
    from sglang_dspine.serving.worker import DSpineWorker

    root, _ = dirs
    monkeypatch.setenv("SGLANG_DSPINE_VERIFY", verify)
    args = _args(root, root / "dspine", "DSPINE")
    handed = []

    def dflash_init(self, server_args, *a, **k):
        handed.append(server_args)
        self.block_size, self.device = 4, "cpu"

    monkeypatch.setattr(DFlashWorkerV2, "__init__", dflash_init)
    worker_log = logging.getLogger("sglang_dspine.serving.worker")  # SGLang's logging may not propagate to root
    worker_log.addHandler(caplog.handler)
    try:
        worker = DSpineWorker(args, gpu_id=0, ps=None, nccl_port=0, target_worker=None)
    finally:
        worker_log.removeHandler(caplog.handler)
    assert handed == [args] and worker.supplies_logprobs == (not dflash_returns_logprobs())
    assert worker.policy is None and worker.tree_rows is None
    if verify == "fixed":
        assert worker.shapes == (Shape(4),)
    else:  # B = 4: the default menu's widths below the block (none), and the block
        assert worker.shapes == (Shape(1), Shape(4))
    # on 0.5.23 an adaptive worker says in its log that it has run on the CPU only
    assert ("tested on the CPU only so far" in caplog.text) == (verify == "adaptive" and ON_0_5_23)


def test_version_facts_are_what_the_installed_sglang_does(dirs):
    """The release facts the refusals above follow (`versions`), against what the installed SGLang's DFlash code
    does: stock DFLASH's argument handling accepts data-parallel attention (with the DP LM head) exactly where
    `dflash_runs_dp_attention()`, and SGLang builds a disaggregated decode server's first draft input, for DFLASH and
    for DSPINE alike, exactly where `dflash_hands_off_to_decode()`."""
    from types import SimpleNamespace

    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm as S

    from sglang_dspine.serving import versions

    root, _ = dirs
    try:
        _args(root, root / "dflash", "DFLASH", *DP, "--enable-dp-lm-head")
        accepted = True
    except ValueError as e:
        assert "DFLASH" in str(e) and "dp attention" in str(e), e
        accepted = False
    assert accepted == versions.dflash_runs_dp_attention()
    # a decode batch's two requests, as the decode server's `process_prebuilt` hands them over (no overlap)
    batch = SimpleNamespace(seq_lens=torch.tensor([7, 4]), req_pool_indices=torch.tensor([1, 2]), enable_overlap=False)
    first = torch.tensor([5, 11])
    args = _args(root, root / "dspine", "DSPINE")
    for algorithm in (S.DFLASH, S.from_string("DSPINE")):
        built = algorithm.build_disagg_draft_input(batch, first, None) if ON_0_5_23 else \
            algorithm.build_disagg_draft_input(batch, args, first, None)
        assert (built is not None) == versions.dflash_hands_off_to_decode(), algorithm
        if built is not None:
            assert built.bonus_tokens.tolist() == [5, 11] and built.new_seq_lens.tolist() == [7, 4]


@pytest.mark.parametrize("flags,patched", [
    (["--sampling-backend", "pytorch"], True),
    (["--sampling-backend", "flashinfer"], False),
    (["--enable-deterministic-inference"], True),  # SGLang picks PyTorch sampling itself
])
def test_worker_factory_patches_verify_renorm_only_for_pytorch_sampling(dirs, flags, patched):
    """The DSPINE worker factory routes DFlash's verify renormalisation to SGLang's Triton kernels when the
    server samples in PyTorch (no FlashInfer JIT build in the middle of serving), whether the user or SGLang
    chose it, and leaves it alone otherwise. It returns the worker that leaves log-probs to DFlash's verify
    step where that returns them and supplies them elsewhere (one class: test_logprobs says how it decides)."""
    import importlib

    from sglang.kernels.ops.sampling import renorm_triton
    from sglang.srt.runtime_context import publish
    from sglang.srt.speculative import dflash_utils
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    from sglang_dspine.serving.worker import DSpineWorker

    dflash_utils = importlib.reload(dflash_utils)  # undo an earlier case's patch
    stock = dflash_utils.top_k_renorm_prob, dflash_utils.top_p_renorm_prob
    root, _ = dirs
    args = _args(root, root / "dspine", "DSPINE", *flags)
    assert _resolved(args).sampling_backend == ("pytorch" if patched else "flashinfer")
    publish(args, role="test")  # what a scheduler process does before it creates the worker
    worker = SpeculativeAlgorithm.from_string("DSPINE").create_worker(args)
    assert worker is DSpineWorker
    now = dflash_utils.top_k_renorm_prob, dflash_utils.top_p_renorm_prob
    if patched:
        assert now == (renorm_triton.top_k_renorm_probs_triton, renorm_triton.top_p_renorm_probs_triton)
        assert stock != now
    else:
        assert now == stock


def _variant(root, name, edit_config=None, edit_tensors=None):
    import shutil

    from conftest import edit_drafter_dir

    dst = root / name
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(root / "dspine", dst)
    return edit_drafter_dir(dst, tensors=edit_tensors, config=edit_config)


def _truncate(path):
    f = path / "model.safetensors"
    os.truncate(f, f.stat().st_size // 2)
    return path


def _no_weight_map(path):
    (path / "model.safetensors").rename(path / "model-00001-of-00001.safetensors")
    (path / "model.safetensors.index.json").write_text('{"metadata": {}}')
    return path


@pytest.mark.parametrize("case,msg", [
    # found after SGLang's DFlash argument handling (they need the target and the resolved block size)
    ("no codes", "DSPINE: refusing drafter {d}: no transfer codes"),
    ("wrong vocab", "DSPINE: refusing drafter {d}: drafter vocab_size: expected 64 (the target's), found 80"),
    ("block size mismatch", "DSPINE: refusing drafter {d}: drafter block_size 4 but --speculative-num-draft-tokens"),
    # found before SGLang reads the drafter's files (sglang_patches.check_drafters_first)
    ("dflash drafter", "DSPINE: refusing drafter {d}: it is a dflash drafter"),
    ("block size 1", "DSPINE: refusing the drafter: drafter {d}: config.json block_size: expected >= 2, found 1"),
    ("truncated weights", "DSPINE: refusing the drafter: {d}/model.safetensors: not a readable safetensors file ("),
    ("invalid config.json", "DSPINE: refusing the drafter: {d}/config.json: not valid JSON ("),
    ("index without weight_map",
     "DSPINE: refusing the drafter: {d}/model.safetensors.index.json: expected a `weight_map` object"),
    ("empty path", "DSPINE: --speculative-draft-model-path must be a local directory, found ''"),
    ("missing", "DSPINE: --speculative-draft-model-path must be a local directory, found '{d}'"),
    ("DSpine drafter under DFLASH", "DFLASH: refusing drafter {d}: it is a DSpine drafter (architectures "
     "['DSpineDraftModel']); serve it with --speculative-algorithm DSPINE"),
])
def test_bad_drafters_are_refused_at_start(dirs, case, msg):
    import re

    from sglang_dspine.serving.plugin import StartupRefusal

    root, _ = dirs
    extra = ["DSPINE"]
    if case == "no codes":
        draft = _variant(root, "nocodes", edit_tensors=lambda t: t.pop("transfer_codes"))
    elif case == "wrong vocab":
        draft = _variant(root, "vocab", edit_config=lambda c: c.update(vocab_size=80))
    elif case == "block size mismatch":
        draft, extra = root / "dspine", ["DSPINE", "--speculative-num-draft-tokens", "8"]
    elif case == "dflash drafter":
        draft = root / "dflash"
    elif case == "block size 1":
        draft = _variant(root, "block1", edit_config=lambda c: c.update(block_size=1))
    elif case == "truncated weights":
        draft = _truncate(_variant(root, "truncated"))
    elif case == "invalid config.json":
        draft = _variant(root, "badjson")
        (draft / "config.json").write_text('{"architectures": [')
    elif case == "index without weight_map":
        draft = _no_weight_map(_variant(root, "noweightmap"))
    elif case == "empty path":
        draft = ""
    elif case == "missing":
        draft = root / "missing"
    else:
        draft, extra = root / "dspine", ["DFLASH"]
    with pytest.raises(StartupRefusal, match="^" + re.escape(msg.format(d=draft))):
        _args(root, draft, *extra)


@pytest.mark.parametrize("algorithm,variant", [("DFLASH", None), ("DSPINE", "truncated"), ("DSPINE", "dp attention")])
def test_refused_server_exits_2_with_one_line(dirs, tmp_path, algorithm, variant):
    """`python -m sglang.launch_server` as a user runs it: a refused drafter, or data-parallel attention where DSPINE
    cannot serve it so, ends the launcher with exit code 2 and `sglang-dspine: error: ...` as the last line on
    stderr, without a traceback (the lines before it are SGLang's own start-up log)."""
    root, _ = dirs
    draft = _truncate(_variant(root, "launch_truncated")) if variant == "truncated" else root / "dspine"
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(root / "target"), "--device", "cuda",
           "--speculative-algorithm", algorithm, "--speculative-draft-model-path", str(draft),
           *(DP if variant == "dp attention" else [])]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)  # not the repo root
    assert out.returncode == 2, out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    last = out.stderr.strip().splitlines()[-1]
    if algorithm == "DFLASH":
        assert last == (f"sglang-dspine: error: DFLASH: refusing drafter {draft}: it is a DSpine drafter "
                        "(architectures ['DSpineDraftModel']); serve it with --speculative-algorithm DSPINE (DFLASH "
                        "would ignore its injection and transition walk)")
    elif variant == "dp attention":
        assert last == f"sglang-dspine: error: {NO_LM_HEAD if ON_0_5_23 else NO_DP_0517}"
    else:
        assert last.startswith(f"sglang-dspine: error: DSPINE: refusing the drafter: {draft}/model.safetensors: "
                               "not a readable safetensors file (")


def test_unconverted_reference_release_is_refused_then_served_after_export(dirs):
    """The release's own config (no `dspine_config`) is refused at start with the command that converts it; the
    converted folder passes the start-up checks."""
    import json

    from sglang_dspine.cli import main as cli_main

    root, plain = dirs
    release = root / "release_raw"
    save_drafter(plain, release, layout="release")
    cfg = json.loads((release / "config.json").read_text())
    cfg.pop("dspine_config")
    cfg["architectures"] = ["DFlashDraftModel"]
    (release / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="reference release's own layout.*sglang-dspine export --checkpoint"):
        _args(root, release, "DSPINE", "--speculative-num-draft-tokens", "16")
    wrapped = root / "release_wrapped"  # refused by the same check, before SGLang's own config read fails on it
    save_drafter(plain, wrapped, layout="release")
    (wrapped / "config.json").write_text(json.dumps({"config": cfg}))
    with pytest.raises(ValueError, match="reference release's own layout.*sglang-dspine export --checkpoint"):
        _args(root, wrapped, "DSPINE", "--speculative-num-draft-tokens", "16")
    converted = root / "release_converted"
    assert cli_main(["export", "--checkpoint", str(release), "--output", str(converted), "--dtype", "fp32"]) == 0
    args = _resolved(_args(root, converted, "DSPINE", "--speculative-num-draft-tokens", "16"))
    assert args.speculative_draft_model_path == str(converted)


@pytest.fixture(scope="module")
def sglang_cpu(dirs):
    """What building SGLang modules on CPU needs: a published config, a one-rank gloo group, CPU RoPE."""
    root, _ = dirs
    sglang_on_cpu.setup(_args(root, root / "dspine"))
    return root


_sglang_model = sglang_on_cpu.sglang_model


@pytest.mark.parametrize("layout", ["specforge", "release"])
def test_checkpoint_loads_into_the_sglang_model(sglang_cpu, dirs, layout, tmp_path):
    root, plain = dirs
    save_drafter(plain, tmp_path, layout=layout)
    model = _sglang_model(tmp_path)
    weights = {}
    for f in os.listdir(tmp_path):
        if f.endswith(".safetensors"):
            weights.update(load_file(tmp_path / f))
    model.load_weights(iter(weights.items()))
    assert torch.equal(model.transfer_codes, plain.transfer_codes) and bool(model.transfer_ready)
    for name, p in plain.injection.state_dict().items():
        assert torch.equal(model.injection.state_dict()[name], p), name
    q = plain.layers[1].self_attn.q_proj.weight
    assert torch.equal(model.layers[1].self_attn.qkv_proj.weight[: q.shape[0]], q)
    assert torch.equal(model.fc.weight, plain.fc.weight)


@pytest.mark.parametrize("drop,msg", [
    ("transfer_codes", "transfer_codes` missing"),
    ("injection.writes.1.weight", "missing tensors \\['injection.writes.1.weight'\\]"),
    ("layers.0.mlp.up_proj.weight", "missing tensors \\['layers.0.mlp.up_proj.weight'\\]"),
])
def test_sglang_loader_refuses_incomplete_checkpoints(sglang_cpu, dirs, drop, msg):
    from sglang_dspine.drafter.config import DrafterConfigError

    root, _ = dirs
    model = _sglang_model(root / "dspine")
    weights = load_file(root / "dspine" / "model.safetensors")
    weights.pop(drop)
    with pytest.raises(DrafterConfigError, match=msg):
        model.load_weights(iter(weights.items()))


def test_stack_dump_on_sigusr1_when_asked():
    code = ("import os, signal, sglang_dspine.serving.plugin as p; p.register();"
            "os.kill(os.getpid(), signal.SIGUSR1); print('alive')")
    env = {**os.environ, "SGLANG_DSPINE_STACKS_ON_SIGUSR1": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0 and "alive" in out.stdout, out.stderr[-2000:]
    assert "Current thread" in out.stderr or "Thread 0x" in out.stderr


@pytest.mark.parametrize("path", ["pytorch", "kernels"])
def test_sglang_model_forward_equals_the_reference(sglang_cpu, tmp_path, path, target, dspine, monkeypatch):
    """The SGLang DSpineDraftModel (SGLang's DFlash layers, RadixAttention over the draft KV pool written the
    way the DFlash worker writes it; torch-native attention on CPU) against the plain drafter: two requests
    with different contexts in one flat batch, then its draft step's decoding, as the worker calls it. On the
    kernel path the injection and the decoding run on the Triton kernels (interpreter on CPU)."""
    plain = dspine  # conftest: seed 1, transfer space from the head, random injection
    save_drafter(plain, tmp_path)
    model = _sglang_model(tmp_path).float()
    monkeypatch.setenv("SGLANG_DSPINE_KERNELS", "1" if path == "kernels" else "0")
    model.load_weights(iter(load_file(tmp_path / "model.safetensors").items()))
    step = model.draft_step
    assert step.kernels == (path == "kernels")
    b = plain.cfg.block_size
    head = target.lm_head.weight.detach()
    step.attach_head(head)
    requests = [(7, 5), (4, 11)]  # (context length, anchor)
    with torch.no_grad():
        out, _, refs = sglang_on_cpu.draft_forward(model, plain, target, requests)
        hidden = out.hidden_states.view(2, b, -1)
        served = step.decode(hidden[:, 1:].reshape(-1, hidden.shape[-1]))
        for r, (s, a) in enumerate(requests):
            ref = refs[r]
            torch.testing.assert_close(hidden[r], ref.hidden[0, 0], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(step._pre_last.view(2, b, -1)[r], ref.pre_last[0, 0], atol=1e-5, rtol=1e-5)
            assert served[r].tolist() == plain.draft(ref, head, torch.tensor([a])).tokens[0].tolist()


@pytest.mark.parametrize("kernels", ["0", "1"])
def test_dummy_weights_run_the_same_draft_step_as_loaded_ones(sglang_cpu, dirs, kernels, monkeypatch, caplog):
    """SGLang's dummy loader (`--load-format dummy`, what benchmarks use) bypasses load_weights and calls
    post_load_weights: the draft step (kernels and per-token tables, or the PyTorch math) is set up all the
    same, and the log says which path runs."""
    import logging

    from sglang.srt.model_loader import loader
    from sglang.srt.model_loader.weight_utils import initialize_dummy_weights

    _post_load_weights = loader.post_load_weights if ON_0_5_23 else loader._post_load_weights
    root, _ = dirs
    monkeypatch.setenv("SGLANG_DSPINE_KERNELS", kernels)
    loaded = _sglang_model(root / "dspine")
    loaded.load_weights(iter(load_file(root / "dspine" / "model.safetensors").items()))
    dummy = _sglang_model(root / "dspine")
    with caplog.at_level(logging.INFO, logger="sglang_dspine.serving.draft_step"):
        initialize_dummy_weights(dummy)
        _post_load_weights(dummy)
    assert dummy.draft_step is not None and dummy.draft_step.kernels == loaded.draft_step.kernels == (kernels == "1")
    if kernels == "1":
        assert dummy.draft_step.tables.pred_proj.shape == loaded.draft_step.tables.pred_proj.shape
    want = "the Triton kernels" if kernels == "1" else "PyTorch math (SGLANG_DSPINE_KERNELS=0)"
    assert any(f"DSPINE draft step on {want}" in r.getMessage() and "from dummy" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]
    _post_load_weights(loaded)  # a loader calling both: the step is set up once
    assert loaded.draft_step is not None


@pytest.mark.parametrize("algorithm,tree", [("DSPINE", "1"), ("DSPINE", "0"), ("DFLASH", "1")])
def test_tree_verify_graphs_are_captured_reading_the_mask(dirs, monkeypatch, algorithm, tree):
    """Patch 6: where the target's verify CUDA graphs are captured (the decode graph runner imports SGLang's mask
    policy when it captures), a DSPINE server verifying trees is told to build the custom mask on the triton
    backend, which SGLang skips for the DFlash family's chains; DSPINE chains (an adaptive tree server's chain
    widths among them) and DFLASH keep SGLang's answer."""
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend
    from sglang.srt.runtime_context import publish
    from sglang.srt.speculative import dflash_utils

    if ON_0_5_23:  # the tree is refused at start there (test above), and SGLang's policy is left alone
        assert not hasattr(dflash_utils.resolve_dflash_verify_mask_policy, "_dspine_trees")
        return
    root, _ = dirs
    monkeypatch.setenv("SGLANG_DSPINE_TREE", tree)
    args = _args(root, root / ("dspine" if algorithm == "DSPINE" else "dflash"), algorithm,
                 *(["--attention-backend", "triton"] if algorithm == "DSPINE" else []))
    publish(args, role="test")
    from sglang_dspine.serving import sglang_patches

    # registration applies it (in every SGLang process); again here: an earlier test reloads dflash_utils
    assert "tree_verify_graphs_read_the_mask" in sglang_patches.apply_at_registration.__code__.co_names
    sglang_patches.tree_verify_graphs_read_the_mask()
    from sglang.srt.speculative.dflash_utils import resolve_dflash_verify_mask_policy  # as the graph runner does

    backend = TritonAttnBackend.__new__(TritonAttnBackend)  # the policy reads the backend's class only
    stock = resolve_dflash_verify_mask_policy.__wrapped__(backend)
    assert stock == ("TritonAttnBackend", False)
    assert resolve_dflash_verify_mask_policy(backend) == ("TritonAttnBackend", algorithm == "DSPINE" and tree == "1")
    # an adaptive tree server's chain widths (verify_widths.build captures them) keep SGLang's answer: their
    # passes bring no mask, and graphs reading the buffer would see the last tree step's
    from sglang_dspine.serving import verify_widths

    monkeypatch.setattr(verify_widths, "_building_chain", True)
    assert resolve_dflash_verify_mask_policy(backend) == stock


@pytest.mark.parametrize("algorithm", ["DSPINE", "DFLASH"])
def test_request_rows_hold_the_decode_reservation(dirs, algorithm):
    """Patch 5: a DSPINE server's req_to_token rows reach past the context length by at least DFlash's decode
    reservation (2 × block slots), through the caller that sizes them; stock DFLASH keeps SGLang's width, which
    is narrower (the reason for the patch: a request near the context length writes into the next row)."""
    from sglang.srt.mem_cache import allocation_sizing, kv_cache_configurator
    from sglang.srt.runtime_context import publish

    from sglang_dspine.serving import sglang_patches
    from sglang_dspine.serving.versions import sglang_version

    root, _ = dirs
    # a block of 16, as served: the fixtures' block of 4 fits SGLang's rows (4 + 4 = 2 × 4)
    draft = _variant(root, "block16", edit_config=lambda c: c.update(block_size=16)) if algorithm == "DSPINE" \
        else root / "dflash"
    args = _args(root, draft, algorithm)
    publish(args, role="test")
    sglang_patches.rows_hold_the_decode_reservation()  # registration applied it already; idempotent
    call = (lambda f: f(args)) if sglang_version() < (0, 5, 23) else (lambda f: f())
    width = call(kv_cache_configurator.get_req_to_token_extra_context_len)
    stock = call(allocation_sizing.get_req_to_token_extra_context_len.__wrapped__)
    block = _resolved(args).speculative_num_draft_tokens
    assert stock == 4 + block  # SGLang's own (page size 1)
    if algorithm == "DSPINE":
        assert block == 16 and stock == 20 and width == 2 * block  # 32: what DFlash's decode step reserves
    else:
        assert width == stock
