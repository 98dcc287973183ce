"""Tiny random Qwen3 targets and matching drafter configs, for tests and smoke runs (no hub needed)."""
from __future__ import annotations

import torch

from .config import DrafterConfig, DSpineSettings, new_drafter_config


def make_target(vocab: int = 64, hidden: int = 64, layers: int = 4, heads: int = 4, kv_heads: int = 2,
                head_dim: int = 16, inter: int = 128, seed: int = 0, tie: bool = False,
                init_std: float = 0.5):
    """A random transformers Qwen3ForCausalLM in float32. A large init_std gives peaked, tie-free logits."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        max_position_embeddings=4096, rope_theta=10000.0, tie_word_embeddings=tie,
        initializer_range=init_std, rms_norm_eps=1e-6,
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(cfg).float().eval()
    return model


def drafter_config_for(target, kind: str = "dspine", block_size: int = 4, layers: int = 2,
                       transfer_rank: int = 16, message_size: int = 8, top_k: int = 4,
                       mask_token_id: int | None = None, target_layer_ids: list[int] | None = None) -> DrafterConfig:
    """A small drafter config that fits `target` (a transformers Qwen3 model): new_drafter_config with
    small defaults (target layers 1 and n-2)."""
    n_target = target.config.num_hidden_layers
    settings = DSpineSettings(transfer_rank=transfer_rank, message_size=message_size, top_k=top_k)
    return new_drafter_config(target.config, kind, layers, block_size, target_layer_ids or [1, n_target - 2],
                              mask_token_id, settings if kind == "dspine" else None)


def tiny_drafter(target, kind: str = "dspine", seed: int | None = None, **config):
    """A drafter for `target` (drafter_config_for(target, kind, **config)), in eval mode, its parameters drawn
    after torch.manual_seed(seed) where a seed is given; a DSpine drafter gets its transfer codes from the
    target's head (init_dspine_transfer), as training starts one. Its injection writes stay zero (the DFlash
    computation) unless the caller randomises them."""
    from .checkpoint import init_dspine_transfer
    from .model import DSpineDrafter

    if seed is not None:
        torch.manual_seed(seed)
    d = DSpineDrafter(drafter_config_for(target, kind=kind, **config)).eval()
    if kind == "dspine":
        init_dspine_transfer(d, target.lm_head.weight.detach())
    return d
