"""Checkpoint layouts round-trip, and every broken checkpoint is refused with a message naming the field."""
import json
from pathlib import Path

import pytest
import torch
from conftest import edit_drafter_dir
from safetensors.torch import load_file

from sglang_dspine.drafter.checkpoint import load_drafter, save_drafter
from sglang_dspine.drafter.config import DrafterConfig, DrafterConfigError
from sglang_dspine.drafter.model import DSpineDrafter
from sglang_dspine.drafter.tiny import drafter_config_for


def outputs(drafter, target, s=6, anchor=3):
    b = drafter.cfg.block_size
    feats = torch.randn(1, s, len(drafter.cfg.target_layer_ids) * drafter.cfg.hidden_size,
                        generator=torch.Generator().manual_seed(0))
    kv = drafter.context_kv(feats, torch.arange(s)[None])
    ids = torch.tensor([[anchor] + [drafter.cfg.mask_token_id] * (b - 1)])
    emb = target.get_input_embeddings()(ids).view(1, 1, b, -1)
    with torch.no_grad():
        return drafter.forward_blocks(emb, (s + torch.arange(b)).view(1, 1, b), kv,
                                      torch.ones(1, 1, s, dtype=torch.bool), torch.tensor([[anchor]])).hidden


@pytest.mark.parametrize("layout", ["specforge", "release"])
def test_dspine_round_trip(tmp_path, dspine, target, layout):
    save_drafter(dspine, tmp_path, layout=layout)
    names = set(load_file(tmp_path / "model.safetensors"))
    if layout == "release":
        assert "transfer_codes" not in names and set(load_file(tmp_path / "transfer.safetensors")) == {"codes"}
    else:
        assert {"transfer_codes", "transfer_ready", "injection.readouts.0.weight", "injection.bias"} <= names
    back = load_drafter(str(tmp_path), target_head=target.lm_head.weight)
    for k, v in dspine.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
    assert torch.equal(outputs(back, target), outputs(dspine, target))


def test_reference_release_config_without_dspine_config(tmp_path, dspine, target):
    """The reference release ships a plain config (possibly wrapped in {"config": ...}); its converter's rules apply."""
    save_drafter(dspine, tmp_path, layout="release")
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.pop("dspine_config")
    cfg["architectures"] = ["DFlashDraftModel"]
    (tmp_path / "config.json").write_text(json.dumps({"config": cfg}))
    back = load_drafter(str(tmp_path))
    assert back.cfg.is_dspine and back.cfg.block_size == 16 and back.cfg.dspine.top_k == 16
    assert back.cfg.dspine.transfer_rank == dspine.cfg.dspine.transfer_rank
    assert torch.equal(back.transfer_codes, dspine.transfer_codes)


def test_dflash_round_trip_and_warm_start(tmp_path, target):
    torch.manual_seed(3)
    dflash = DSpineDrafter(drafter_config_for(target, kind="dflash")).eval()
    save_drafter(dflash, tmp_path)
    back = load_drafter(str(tmp_path))
    assert back.cfg.kind == "dflash" and back.injection is None
    assert torch.equal(outputs(back, target), outputs(dflash, target))
    warm = load_drafter(str(tmp_path), as_dspine=True, target_head=target.lm_head.weight)
    assert warm.cfg.is_dspine and warm.cfg.is_causal and bool(warm.transfer_ready)
    # zero injection: the warm start computes what the DFlash backbone computes under the causal mask
    causal = DSpineDrafter(DrafterConfig.from_dict({**dflash.cfg.to_dict(), "is_causal": True})).eval()
    causal.load_state_dict(dflash.state_dict())
    assert torch.equal(outputs(warm, target), outputs(causal, target))
    with pytest.raises(DrafterConfigError, match="LM head"):
        load_drafter(str(tmp_path), as_dspine=True)


def _corrupt(tmp_path, dspine, tensors=None, config=None):
    save_drafter(dspine, tmp_path)
    return str(edit_drafter_dir(tmp_path, tensors, config))


def _set(d, path, value):
    *keys, last = path.split(".")
    for k in keys:
        d = d[k]
    d[last] = value


CASES = {
    "codes missing": (lambda s: s.pop("transfer_codes"), None, "transfer_codes` missing"),
    "codes all zero": (lambda s: s["transfer_codes"].zero_(), None, "all zeros"),
    "codes non-finite": (lambda s: s["transfer_codes"].__setitem__((0, 0), float("inf")), None, "NaN or inf"),
    "transfer_ready false": (lambda s: s.__setitem__("transfer_ready", torch.tensor(False)), None, "transfer_ready` is false"),
    "fc width": (lambda s: s.__setitem__("fc.weight", torch.zeros(64, 64 * 3)), None, "fc.weight` width expected 128"),
    "unexpected tensor": (lambda s: s.__setitem__("extra.weight", torch.zeros(2)), None, "unexpected tensors"),
    "mis-shaped tensor": (lambda s: s.__setitem__("injection.bias", torch.zeros(3)), None, "injection.bias` expected shape"),
    "mask id": (None, lambda c: _set(c, "dflash_config.mask_token_id", 64), "mask_token_id: expected in \\[0, 64\\)"),
    "block size": (None, lambda c: c.__setitem__("block_size", 1), "block_size: expected >= 2"),
    "top_k zero": (None, lambda c: _set(c, "dspine_config.top_k", 0), "top_k: expected in \\[1, 64\\]"),
    "top_k above vocab": (None, lambda c: _set(c, "dspine_config.top_k", 65), "top_k: expected in \\[1, 64\\]"),
    "bidirectional dspine": (None, lambda c: c.__setitem__("is_causal", False), "is_causal"),
    "unknown architecture": (None, lambda c: c.__setitem__("architectures", ["LlamaForCausalLM"]), "architectures"),
    "sliding layers": (None, lambda c: c.__setitem__("layer_types", ["sliding_attention", "full_attention"]), "layer_types"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_refused_checkpoints(tmp_path, dspine, case):
    tensors, config, msg = CASES[case]
    path = _corrupt(tmp_path, dspine, tensors, config)
    with pytest.raises(DrafterConfigError, match=msg):
        load_drafter(path)


def test_refuses_a_drafter_for_another_target(tmp_path, dspine, target):
    save_drafter(dspine, tmp_path)
    head = target.lm_head.weight
    with pytest.raises(DrafterConfigError, match="vocab_size: expected 80 \\(the target's\\), found 64"):
        load_drafter(str(tmp_path), target_head=torch.randn(80, head.shape[1]))
    with pytest.raises(DrafterConfigError, match="hidden_size: expected 32 \\(the target's\\), found 64"):
        load_drafter(str(tmp_path), target_head=torch.randn(head.shape[0], 32))


# ------------------------------------------------------------------------------- SpecForge's own layout
# tests/fixtures/specforge/qwen3-8b-dspine.json is SpecForge's configs/qwen3-8b-dspine.json verbatim
# (sgl-project/SpecForge at 211b87fc7d707e3a628cb95de5c73340af863c04).
SPECFORGE_CONFIG = Path(__file__).parent / "fixtures" / "specforge" / "qwen3-8b-dspine.json"


def specforge_tensors(cfg: dict) -> dict[str, tuple[int, ...]]:
    """SpecForge's DSpineDraftModel state dict, name -> shape, written out from its module definitions
    (specforge/modeling/draft/dflash.py: DFlashDraftModel, Qwen3DFlashDecoderLayer, Qwen3DFlashAttention in GQA
    mode; dspine.py: AdjacentInjection and the transfer buffers), not from this package's model."""
    h, inter, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    s, n = cfg["dspine_config"], cfg["num_hidden_layers"]
    r, m = s["transfer_rank"], s["message_size"]
    out = {"fc.weight": (h, len(cfg["dflash_config"]["target_layer_ids"]) * h), "hidden_norm.weight": (h,),
           "norm.weight": (h,), "transfer_codes": (cfg["vocab_size"], r), "transfer_ready": (),
           "injection.message.weight": (m, r), "injection.receiver_gate.weight": (m, r),
           "injection.predecessor_gate.weight": (m, r), "injection.bias": (m,)}
    for i in range(n):
        p = f"layers.{i}."
        out.update({p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                    p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                    p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
                    p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                    p + "mlp.down_proj.weight": (h, inter), p + "input_layernorm.weight": (h,),
                    p + "post_attention_layernorm.weight": (h,),
                    f"injection.readouts.{i}.weight": (r, h), f"injection.writes.{i}.weight": (h, m)})
    return out


def test_specforge_release_config_and_tensor_names():
    """SpecForge's own Qwen3-8B DSpine config parses to what it says, and the drafter built from it has exactly
    SpecForge's tensor names and shapes (a rename on either side would break loading its checkpoints)."""
    raw = json.loads(SPECFORGE_CONFIG.read_text())
    cfg = DrafterConfig.from_dict(raw)
    assert cfg.is_dspine and cfg.is_causal and cfg.block_size == 16 and cfg.num_hidden_layers == 5
    assert (cfg.hidden_size, cfg.vocab_size, cfg.mask_token_id) == (4096, 151936, 151669)
    assert cfg.target_layer_ids == [1, 9, 17, 25, 33]
    s = cfg.dspine
    assert (s.transfer_rank, s.message_size, s.top_k) == (1024, 512, 16)
    with torch.device("meta"):
        state = DSpineDrafter(cfg).state_dict()
    assert {k: tuple(v.shape) for k, v in state.items()} == specforge_tensors(raw)


def write_specforge_checkpoint(path, seed=0):
    """A tiny drafter in SpecForge's layout: SpecForge's config fields with small sizes, a bf16 model.safetensors
    with SpecForge's tensor names (random values, unit-norm transfer codes). Returns (config, tensors)."""
    from safetensors.torch import save_file

    cfg = json.loads(SPECFORGE_CONFIG.read_text())
    cfg.update(hidden_size=64, intermediate_size=128, head_dim=16, num_attention_heads=4, num_key_value_heads=2,
               num_hidden_layers=2, max_window_layers=2, layer_types=["full_attention"] * 2, num_target_layers=4,
               vocab_size=64, block_size=4, bos_token_id=1, eos_token_id=2)
    cfg["dflash_config"] = {"mask_token_id": 63, "target_layer_ids": [1, 2]}
    cfg["dspine_config"].update(transfer_rank=16, message_size=8, top_k=4)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in specforge_tensors(cfg).items():
        tensors[name] = (torch.randn(shape, generator=g) * 0.1).to(torch.bfloat16)
    tensors["transfer_codes"] = torch.nn.functional.normalize(
        torch.randn(64, 16, generator=g), dim=-1).to(torch.bfloat16)
    tensors["transfer_ready"] = torch.tensor(True)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    save_file(tensors, path / "model.safetensors")
    return cfg, tensors


def test_specforge_layout_checkpoint_loads_by_name(tmp_path):
    """A checkpoint written with SpecForge's names and config fields (not by this package) loads: every tensor
    of the drafter is the file's tensor of the same name, the settings are the file's."""
    cfg, tensors = write_specforge_checkpoint(tmp_path)
    d = load_drafter(str(tmp_path), target_head=torch.randn(64, 64))
    assert d.cfg.block_size == 4 and d.cfg.dspine.top_k == 4 and d.cfg.target_layer_ids == [1, 2]
    state = d.state_dict()
    assert set(state) == set(tensors)
    for name, t in tensors.items():
        assert torch.equal(state[name], t.to(state[name].dtype)), name
