"""The SGLang plugin with SGLang imported for real (CPU): registration, server arguments, weight loading."""
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from sglang_dspine.checkpoint import init_dspine_transfer, save_drafter
from sglang_dspine.model import DSpineDrafter
from sglang_dspine.tiny import drafter_config_for, make_target

pytest.importorskip("sglang")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    target = make_target()
    target.save_pretrained(root / "target")
    torch.manual_seed(0)
    d = DSpineDrafter(drafter_config_for(target))
    init_dspine_transfer(d, target.lm_head.weight)
    save_drafter(d, root / "dspine")
    f = DSpineDrafter(drafter_config_for(target, kind="dflash"))
    save_drafter(f, root / "dflash")
    return root, d


def test_entry_point_registers_in_a_fresh_interpreter():
    code = (
        "from sglang.srt.plugins import load_plugins; load_plugins();"
        "from sglang.srt.speculative.spec_info import SpeculativeAlgorithm as S;"
        "a = S.from_string('dspine'); assert a is S.from_string('DSPINE');"
        "assert a.is_dflash_family() and a.is_dflash() and a.supports_target_verify_for_draft();"
        "assert not a.need_topk() and not a.carries_draft_hidden_states() and not a.is_eagle();"
        "from sglang.srt.models.registry import ModelRegistry as R;"
        "from sglang_dspine.sglang_model import DSpineDraftModel;"
        "assert R.models['DSpineDraftModel'] is DSpineDraftModel;"
        "import sglang_dspine.plugin as p; p.register(); p.register();"  # idempotent
        "print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok")


def _args(root, draft, *extra):
    from sglang.srt.server_args import prepare_server_args
    import sglang_dspine.plugin as p

    p.register()
    return prepare_server_args(["--model-path", str(root / "target"), "--speculative-algorithm", extra[0] if extra else "DSPINE",
                                "--speculative-draft-model-path", str(draft), "--device", "cuda", *extra[1:]])


def test_server_args_match_dflash(dirs):
    root, _ = dirs
    dsp = _args(root, root / "dspine", "DSPINE")
    dfl = _args(root, root / "dspine", "DFLASH")
    assert dsp.speculative_algorithm == "DSPINE"
    for key in ("speculative_num_draft_tokens", "speculative_num_steps", "speculative_eagle_topk",
                "speculative_draft_attention_backend", "max_running_requests", "enable_mixed_chunk"):
        assert getattr(dsp, key) == getattr(dfl, key), key
    assert dsp.speculative_num_draft_tokens == 4


def _variant(root, name, edit_config=None, edit_tensors=None):
    import shutil

    dst = root / name
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(root / "dspine", dst)
    if edit_config:
        cfg = json.loads((dst / "config.json").read_text())
        edit_config(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    if edit_tensors:
        t = load_file(dst / "model.safetensors")
        edit_tensors(t)
        save_file(t, dst / "model.safetensors")
    return dst


@pytest.mark.parametrize("case,msg", [
    ("no codes", "no transfer codes"),
    ("wrong vocab", "vocab_size: expected 64 \\(the target's\\), found 80"),
    ("block size mismatch", "block_size 4 but --speculative-num-draft-tokens"),
    ("dflash drafter", "is a dflash drafter"),
    ("block size 1", "block_size: expected >= 2"),
    ("tensor parallel", "--tp-size 2 is not supported"),
])
def test_bad_drafters_are_refused_at_start(dirs, case, msg):
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
    else:
        draft, extra = root / "dspine", ["DSPINE", "--tp-size", "2"]
    with pytest.raises(ValueError, match=msg):
        _args(root, draft, *extra)


@pytest.fixture(scope="module")
def sglang_cpu(dirs):
    """What building SGLang modules on CPU needs: a published config, a one-rank gloo group, CPU RoPE."""
    from sglang.srt.distributed import init_distributed_environment, initialize_model_parallel
    from sglang.srt.runtime_context import publish
    import sglang.srt.layers.rotary_embedding.base as rope_base

    root, _ = dirs
    publish(_args(root, root / "dspine"), role="test")
    init_distributed_environment(backend="gloo", world_size=1, rank=0, local_rank=0,
                                 distributed_init_method="tcp://127.0.0.1:29517")
    initialize_model_parallel(tensor_model_parallel_size=1)
    rope_base._is_cpu, rope_base._is_cpu_amx_available = True, False
    return root


def _sglang_model(path):
    from sglang.srt.utils.hf_transformers_utils import get_config
    from sglang_dspine.sglang_model import DSpineDraftModel

    return DSpineDraftModel(get_config(str(path), trust_remote_code=False))


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
    from sglang_dspine.config import DrafterConfigError

    root, _ = dirs
    model = _sglang_model(root / "dspine")
    weights = load_file(root / "dspine" / "model.safetensors")
    weights.pop(drop)
    with pytest.raises(DrafterConfigError, match=msg):
        model.load_weights(iter(weights.items()))


def test_stack_dump_on_sigusr1_when_asked():
    code = ("import os, signal, sglang_dspine.plugin as p; p.register();"
            "os.kill(os.getpid(), signal.SIGUSR1); print('alive')")
    env = {**os.environ, "SGLANG_DSPINE_STACKS_ON_SIGUSR1": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0 and "alive" in out.stdout, out.stderr[-2000:]
    assert "Current thread" in out.stderr or "Thread 0x" in out.stderr
