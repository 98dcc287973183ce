"""The benchmarks' one model builder: model folders a server or a benchmark loads, made from the geometry table
(benchmarks/geometry.py) or tiny and random.

- `write_target`, `write_drafters` (`write_dflash2`): a config-only target at a geometry (served with
  `--load-format dummy`) and random DSpine / DFlash (/ DFlash2) drafters of a drafter shape, saved by this package.
- `random_target`, `on_device`: a random Qwen3 target in memory at a geometry (`geometry.short`'s names), and any
  module made on its device in its dtype (never on the CPU first).
- `make_tiny_models`: a tiny Qwen3 target with real random weights and a trained BPE tokenizer, and its drafters.
- `model_layout`, `drafter_variant`: the target/dspine/dflash/suites layout over a lab run, and edited copies of a
  drafter (the refusal tests' broken ones).
"""
from __future__ import annotations

import json
import os
import shutil

import torch


def on_device(make, device, dtype: torch.dtype):
    """make()'s module, its parameters created on `device` in `dtype` (never on the CPU first)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return make()
    finally:
        torch.set_default_dtype(old)


def random_target(geom: dict, device, dtype: torch.dtype, seed: int = 0):
    """A random Qwen3ForCausalLM of `geom` (geometry.short's names), made on `device` in `dtype`."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=geom["vocab"], hidden_size=geom["hidden"], intermediate_size=geom["intermediate"],
                      num_hidden_layers=geom["layers"], num_attention_heads=geom["heads"],
                      num_key_value_heads=geom["kv_heads"], head_dim=geom["head_dim"], rope_theta=geom["rope_theta"],
                      max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=False)
    torch.manual_seed(seed)
    return on_device(lambda: Qwen3ForCausalLM(cfg), device, dtype).eval()


def write_target(root: str, geometry: dict) -> str:
    """A Qwen3 target folder holding only config.json (served with --load-format dummy)."""
    path = os.path.join(root, "target")
    os.makedirs(path, exist_ok=True)
    cfg = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_act": "silu",
           "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "attention_bias": False, "attention_dropout": 0.0,
           "bos_token_id": 151643, "eos_token_id": 151645, "torch_dtype": "bfloat16", "use_cache": True,
           **geometry}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    return path


def write_drafters(root: str, geometry: dict, shape: dict, device: str, dflash2: dict | None = None) -> dict[str, str]:
    """A DSpine drafter and a DFlash drafter with the same random backbone, saved by this package; with `dflash2`
    (its shape, DFLASH2), also a DFlash2 drafter on that backbone (write_dflash2)."""
    from transformers import Qwen3Config

    from sglang_dspine.drafter.checkpoint import save_drafter
    from sglang_dspine.drafter.config import default_target_layer_ids
    from sglang_dspine.drafter.model import DSpineDrafter
    from sglang_dspine.drafter.tiny import drafter_config_for
    from sglang_dspine.drafter.tree_calibration import FILE_NAME as CALIBRATION_FILE
    from sglang_dspine.drafter.tree_calibration import TreeCalibration

    target = Qwen3Config(**{k: v for k, v in geometry.items()})
    holder = type("Target", (), {"config": target})
    layer_ids = default_target_layer_ids(target.num_hidden_layers, shape["layers"])
    out = {}
    gen = torch.Generator(device=device).manual_seed(0)
    for kind in ("dspine", "dflash"):
        cfg = drafter_config_for(holder, kind=kind, block_size=shape["block_size"], layers=shape["layers"],
                                 transfer_rank=shape["transfer_rank"], message_size=shape["message_size"],
                                 top_k=shape["top_k"], mask_token_id=shape["mask_token_id"],
                                 target_layer_ids=layer_ids)
        with torch.device(device):
            model = DSpineDrafter(cfg).to(torch.bfloat16)
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 2:
                    p.normal_(0.0, 0.02, generator=gen)
            if kind == "dspine":
                codes = torch.randn(model.transfer_codes.shape, device=device, generator=gen)
                model.transfer_codes.copy_(torch.nn.functional.normalize(codes, dim=-1))
                model.transfer_ready.fill_(True)
        path = os.path.join(root, kind)
        save_drafter(model, path)
        out[kind] = path
        del model
    # what a DSPINE server verifying trees wider than the block reads (random weights: the drafter's own scores;
    # the step's cost does not depend on the values)
    p = shape["block_size"] - 1
    TreeCalibration(shape["block_size"], [1.0] * p, [0.0] * p,
                    {"what": "placeholder for random weights (serving_scale.py)"}).save(
        os.path.join(out["dspine"], CALIBRATION_FILE))
    if dflash2 is not None:
        out["dflash2"] = write_dflash2(out["dflash"], os.path.join(root, "dflash2"), dflash2, gen)
    return out


def write_dflash2(dflash: str, path: str, shape: dict, gen: torch.Generator) -> str:
    """A DFlash2 drafter (SGLang 0.5.23's DFlash2DraftModel) from a DFlash one: the same backbone, random
    convolution corrections around every sublayer (base kernel the identity, as a fresh DFlash 2) and a random
    selector. The tensor names are DFlash 2's: `layers.{i}.{attention,mlp}_conv.{base_kernel,
    kernel_projection.weight}`, `candidate_selector.{predecessor,successor}_codebook`,
    `candidate_selector.hidden_projection.weight`."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(dflash, path, dirs_exist_ok=True)
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    hidden, vocab, layers = int(cfg["hidden_size"]), int(cfg["vocab_size"]), int(cfg["num_hidden_layers"])
    taps, group = int(shape["conv_kernel_size"]), int(shape["conv_group_size"])
    rank = int(shape["selector_rank"])
    if hidden % group:
        raise ValueError(f"DFlash2 conv_group_size {group} must divide the hidden size {hidden}")
    cfg["architectures"] = ["DFlash2DraftModel"]
    cfg["dflash_config"] = {**cfg.get("dflash_config", {}), **shape}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    files = [f for f in os.listdir(path) if f.endswith(".safetensors")]
    if files != ["model.safetensors"]:
        raise ValueError(f"{dflash}: expected one model.safetensors, found {files}")
    tensors = load_file(os.path.join(path, "model.safetensors"))
    dtype, device = tensors["fc.weight"].dtype, gen.device

    def normal(*size, std=0.02):
        return torch.randn(*size, generator=gen, device=device).mul_(std).to(dtype).cpu()

    for i in range(layers):
        for conv in ("attention_conv", "mlp_conv"):
            base = torch.zeros(2, taps, hidden)
            base[:, 0] = 1.0
            tensors[f"layers.{i}.{conv}.base_kernel"] = base.to(dtype)
            tensors[f"layers.{i}.{conv}.kernel_projection.weight"] = normal(2 * taps * (hidden // group), hidden)
    tensors["candidate_selector.predecessor_codebook"] = normal(vocab, rank)
    tensors["candidate_selector.successor_codebook"] = normal(vocab, rank)
    tensors["candidate_selector.hidden_projection.weight"] = normal(rank, hidden)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return path


def make_tiny_models(root: str) -> None:
    """A tiny Qwen3 target (BPE tokenizer trained on local sources), a DSpine drafter with codes from its head
    and random injection, and a random DFlash drafter. Logit gaps are widened (head × 8) so bf16 near-ties
    are rarer; the result is labelled as such."""
    import glob

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    from sglang_dspine.drafter.checkpoint import init_dspine_transfer, save_drafter
    from sglang_dspine.drafter.model import DSpineDrafter
    from sglang_dspine.drafter.tiny import drafter_config_for

    site = os.path.dirname(os.path.dirname(torch.__file__))
    files = sorted(glob.glob(os.path.join(site, "torch", "nn", "**", "*.py"), recursive=True))[:300]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|MASK|>"]
    tok.train_from_iterator((open(f, errors="ignore").read() for f in files),
                            trainers.BpeTrainer(vocab_size=4096, special_tokens=special,
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                   mask_token="<|MASK|>")
    tdir = os.path.join(root, "target")
    fast.save_pretrained(tdir)
    cfg = Qwen3Config(vocab_size=len(fast), hidden_size=256, intermediate_size=768, num_hidden_layers=6,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096,
                      tie_word_embeddings=False, eos_token_id=fast.eos_token_id, bos_token_id=fast.eos_token_id)
    torch.manual_seed(0)
    target = Qwen3ForCausalLM(cfg)
    with torch.no_grad():
        target.lm_head.weight.mul_(8.0)
    target.to(torch.bfloat16).save_pretrained(tdir)
    target = target.float()
    for kind in ("dspine", "dflash"):
        dcfg = drafter_config_for(target, kind=kind, block_size=16, layers=2, transfer_rank=64, message_size=32,
                                  top_k=8, mask_token_id=fast.mask_token_id, target_layer_ids=[1, 3])
        torch.manual_seed(1)
        d = DSpineDrafter(dcfg)
        for p in d.parameters():
            if p.dim() == 2:
                torch.nn.init.normal_(p, std=0.02)
        if kind == "dspine":
            init_dspine_transfer(d, target.lm_head.weight)
            with torch.no_grad():
                for w in d.injection.writes:
                    w.weight.normal_(0, 0.02)
        save_drafter(d.to(torch.bfloat16), os.path.join(root, kind))
        fast.save_pretrained(os.path.join(root, kind))


def model_layout(models: str) -> str:
    """The serving scripts read target/, dspine/, dflash/ and suites/ under `models`. A lab run's --out folder
    (drafters/KIND, corpus/prompts) or its unpacked pack (drafters/KIND, suites/) gets links to that layout."""
    links = {"dspine": "drafters/dspine", "dflash": "drafters/dflash", "suites": "corpus/prompts"}
    for name, src in links.items():
        link, src = os.path.join(models, name), os.path.join(models, src)
        if not os.path.exists(link) and os.path.isdir(src):
            os.symlink(src, link)
    missing = [d for d in ("target", "dspine", "dflash") if not os.path.isdir(os.path.join(models, d))]
    if missing:
        raise SystemExit(f"{models}: no {', '.join(missing)} (want target/, dspine/, dflash/ or a lab's drafters/)")
    return os.path.abspath(models)


def drafter_variant(src: str, dst: str, edit_cfg=None, edit_tensors=None) -> str:
    """A copy of drafter folder `src` at `dst` (replaced), its config.json and/or model.safetensors edited in place
    by the given functions."""
    from safetensors.torch import load_file, save_file

    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    if edit_cfg:
        p = os.path.join(dst, "config.json")
        c = json.load(open(p))
        edit_cfg(c)
        json.dump(c, open(p, "w"))
    if edit_tensors:
        p = os.path.join(dst, "model.safetensors")
        t = load_file(p)
        edit_tensors(t)
        save_file(t, p)
    return dst


