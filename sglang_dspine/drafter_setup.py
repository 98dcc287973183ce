"""The drafter a training run starts from: its config for a target (the one drafter-config factory), its
initial weights, or a checkpoint to start from (a DFlash checkpoint becomes a DSpine warm start)."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .checkpoint import init_dspine_transfer, load_drafter
from .config import DrafterConfig, DrafterConfigError, DSpineSettings, default_target_layer_ids
from .model import DSpineDrafter
from .teacher import TargetTeacher
from .train_config import TrainConfig


def new_drafter_config(target_config, kind: str = "dspine", num_layers: int = 5, block_size: int = 16,
                       target_layer_ids: list[int] | None = None, mask_token_id: int | None = None,
                       settings: DSpineSettings | None = None) -> DrafterConfig:
    """The config of a fresh drafter for a transformers (Qwen3-style) target config."""
    t = target_config
    n_target = int(t.num_hidden_layers)
    rope = getattr(t, "rope_parameters", None) or {}
    theta = getattr(t, "rope_theta", None) or rope.get("rope_theta")
    heads = int(t.num_attention_heads)
    d = {
        "architectures": ["DSpineDraftModel" if kind == "dspine" else "DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": int(t.hidden_size),
        "intermediate_size": int(t.intermediate_size),
        "num_hidden_layers": num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": int(getattr(t, "num_key_value_heads", None) or heads),
        "head_dim": int(getattr(t, "head_dim", None) or t.hidden_size // heads),
        "vocab_size": int(t.vocab_size),
        "rms_norm_eps": float(t.rms_norm_eps),
        "rope_theta": float(theta if theta is not None else 10000.0),
        "max_position_embeddings": int(getattr(t, "max_position_embeddings", 40960)),
        "tie_word_embeddings": False,
        "attention_bias": bool(getattr(t, "attention_bias", False)),
        "hidden_act": "silu",
        "initializer_range": float(getattr(t, "initializer_range", 0.02)),
        "block_size": block_size,
        "is_causal": kind == "dspine",
        "num_target_layers": n_target,
        "dflash_config": {
            "mask_token_id": int(t.vocab_size) - 1 if mask_token_id is None else int(mask_token_id),
            "target_layer_ids": list(target_layer_ids or default_target_layer_ids(n_target, num_layers)),
        },
    }
    if kind == "dspine":
        d["dspine_config"] = (settings or DSpineSettings()).to_dict()
    return DrafterConfig.from_dict(d)


def init_backbone(model: DSpineDrafter, std: float) -> None:
    """Normal(0, std) for the backbone's linear weights (as transformers' post_init); norms stay at 1."""
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, nn.Linear) and not name.startswith("injection"):
                module.weight.normal_(0.0, std)
                if module.bias is not None:
                    module.bias.zero_()


def settings_with(base: DSpineSettings | None, overrides: dict[str, Any]) -> DSpineSettings:
    d = (base or DSpineSettings()).to_dict()
    d.update(overrides)
    return DSpineSettings.from_dict(d)


def build_drafter(tc: TrainConfig, teacher: TargetTeacher) -> DSpineDrafter:
    """A fresh drafter, or one from `tc.init` (a DFlash checkpoint becomes a DSpine warm start)."""
    head = teacher.head.detach().float().cpu()
    if tc.init:
        src = DrafterConfig.from_file(tc.init)
        if src.kind == "dspine" and tc.kind == "dflash":
            raise DrafterConfigError(f"--init {tc.init} is a DSpine drafter; it cannot be trained as a DFlash drafter")
        if src.kind == "dflash" and tc.kind == "dspine":
            model = load_drafter(tc.init, as_dspine=True, target_head=head,
                                 dspine_settings=settings_with(None, tc.dspine))
        else:
            model = load_drafter(tc.init, target_head=head)
            if model.cfg.is_dspine and tc.dspine:
                arch = {k: v for k, v in tc.dspine.items() if k in ("transfer_rank", "message_size")
                        and v != getattr(model.cfg.dspine, k)}
                if arch:
                    raise DrafterConfigError(f"--init {tc.init}: its {sorted(arch)} cannot change "
                                             f"(checkpoint: {model.cfg.dspine.to_dict()})")
                model.cfg.dspine = settings_with(model.cfg.dspine, tc.dspine)
    else:
        cfg = new_drafter_config(teacher.config, tc.kind, tc.num_draft_layers, tc.block_size, tc.target_layer_ids,
                                 tc.mask_token_id, settings_with(None, tc.dspine) if tc.kind == "dspine" else None)
        model = DSpineDrafter(cfg)
        init_backbone(model, tc.init_std)
        if cfg.is_dspine:
            init_dspine_transfer(model, head)
    t = teacher.config
    model.cfg.check_target(int(t.hidden_size), int(t.vocab_size), int(t.num_hidden_layers))
    return model


def trainable_parameters(model: DSpineDrafter, freeze_backbone: bool) -> list[nn.Parameter]:
    for name, p in model.named_parameters():
        p.requires_grad_(not freeze_backbone or name.startswith("injection."))
    return [p for p in model.parameters() if p.requires_grad]
