"""The DSpine drafter in plain PyTorch (training, offline evaluation, the reference for serving).

Backbone = the DFlash drafter: Qwen3-style decoder layers with no embedding and no LM head of their own.
Target hidden states of `target_layer_ids` are concatenated per context token, projected by `fc` and
`hidden_norm`, and enter every layer as extra keys/values (that layer's k_proj/v_proj on the projected
context, then k_norm and RoPE at context positions 0..S-1). A block [anchor, mask × (B-1)] sits at positions
S..S+B-1; DSpine attends causally inside the block, DFlash bidirectionally. DSpine adds the adjacent
injection after every layer (`injection.py`) and decodes blocks with the transition table (`decoding.py`).

Layout: a batch holds N sequences, each with `nb` blocks (one in generation, many in training). Every block
sees the context positions its mask allows and, inside the block, itself.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..profiling import region
from .config import DrafterConfig
from .decoding import BlockDraft, decode_block
from .injection import AdjacentInjection


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding (half-split convention of Qwen3). x: [..., T, heads, d]; positions: [..., T]."""
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    freqs = positions.to(torch.float32).unsqueeze(-1) * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1).unsqueeze(-2)  # [..., T, 1, d]
    cos, sin = emb.cos(), emb.sin()
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


class DraftAttention(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim, self.theta = d, cfg.rope_theta
        self.q_proj = nn.Linear(h, self.heads * d, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(h, self.kv_heads * d, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(h, self.kv_heads * d, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.heads * d, h, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def keys_values(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k (normed, rotated) and v of x [..., T, H] at positions [..., T] -> [..., T, kv_heads, d]."""
        k = self.k_norm(self.k_proj(x).unflatten(-1, (self.kv_heads, self.head_dim)))
        v = self.v_proj(x).unflatten(-1, (self.kv_heads, self.head_dim))
        return rope(k, positions, self.theta), v

    def forward(self, x: torch.Tensor, positions: torch.Tensor, ctx_kv: tuple[torch.Tensor, torch.Tensor],
                mask: torch.Tensor) -> torch.Tensor:
        """x: [N, T, H] block tokens (all blocks of a sequence, flattened); ctx_kv: [N, S, kvh, d] each;
        mask: [N, T, S+T] bool, True where the query may attend."""
        q = self.q_norm(self.q_proj(x).unflatten(-1, (self.heads, self.head_dim)))
        q = rope(q, positions, self.theta)
        k, v = self.keys_values(x, positions)
        k = torch.cat([ctx_kv[0], k], dim=1)
        v = torch.cat([ctx_kv[1], v], dim=1)
        rep = self.heads // self.kv_heads
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [N, heads, T, d]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.unsqueeze(1))
        return self.o_proj(out.transpose(1, 2).flatten(-2))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.self_attn = DraftAttention(cfg)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, positions, ctx_kv, mask):
        with region("drafter.attention"):
            x = x + self.self_attn(self.input_layernorm(x), positions, ctx_kv, mask)
        with region("drafter.mlp"):
            return x + self.mlp(self.post_attention_layernorm(x))


@dataclass
class BlockOutput:
    hidden: torch.Tensor  # [N, nb, B, H] final-normed states (logits = hidden @ headᵀ)
    pre_last: torch.Tensor  # [N, nb, B, H] last layer's state before its injection (refinement input)
    layer_states: list[torch.Tensor]  # per layer, [N, nb, B, H] after that layer's injection (alignment)


class DSpineDrafter(nn.Module):
    """DSpine (or, with cfg.kind == 'dflash', the plain DFlash) drafter."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.fc = nn.Linear(len(cfg.target_layer_ids) * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        if cfg.is_dspine:
            s = cfg.dspine
            self.injection = AdjacentInjection(h, s.transfer_rank, s.message_size, cfg.num_hidden_layers)
            self.register_buffer("transfer_codes", torch.zeros(cfg.vocab_size, s.transfer_rank))
            self.register_buffer("transfer_ready", torch.tensor(False))
        else:
            self.injection = None

    # ----------------------------------------------------------------- context
    def project_context(self, target_features: torch.Tensor) -> torch.Tensor:
        """[..., len(ids)·H] concatenated target hidden states -> [..., H]."""
        return self.hidden_norm(self.fc(target_features))

    def context_kv(self, target_features: torch.Tensor,
                   positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer context keys/values: [N, S, kvh, d]. Cacheable: they do not depend on the block."""
        ctx = self.project_context(target_features)
        return [layer.self_attn.keys_values(ctx, positions) for layer in self.layers]

    # ------------------------------------------------------------------- block
    def block_mask(self, ctx_visible: torch.Tensor) -> torch.Tensor:
        """[N, nb·B, S + nb·B] attention mask from ctx_visible [N, nb, S]: a block sees its visible context
        and itself (causally for DSpine, whole for DFlash), never another block."""
        n, nb, s = ctx_visible.shape
        b = self.cfg.block_size
        ctx = ctx_visible.unsqueeze(2).expand(n, nb, b, s).reshape(n, nb * b, s)
        blk = torch.arange(nb * b, device=ctx_visible.device)
        same = (blk[:, None] // b) == (blk[None, :] // b)
        if self.cfg.is_causal:
            same = same & (blk[None, :] <= blk[:, None])
        return torch.cat([ctx, same.expand(n, -1, -1)], dim=-1)

    def forward_blocks(
        self,
        block_embeds: torch.Tensor,
        block_positions: torch.Tensor,
        ctx_kv: list[tuple[torch.Tensor, torch.Tensor]],
        ctx_visible: torch.Tensor,
        anchors: torch.Tensor,
        predecessor_override: list[torch.Tensor | None] | None = None,
        override_blocks: torch.Tensor | None = None,
    ) -> BlockOutput:
        """block_embeds: [N, nb, B, H] target embeddings of [anchor, mask...]; block_positions: [N, nb, B];
        ctx_visible: [N, nb, S] bool; anchors: [N, nb] token ids.
        predecessor_override[l]: [N, nb, B-1, r] predecessors to use at layer l instead of features
        (training's predecessor replacement); override_blocks: [N, nb] bool, the blocks the override applies
        to (default: all); the others keep their feature predecessors."""
        n, nb, b, h = block_embeds.shape
        with region("drafter.mask"):
            mask = self.block_mask(ctx_visible)
        x = block_embeds.reshape(n, nb * b, h)
        pos = block_positions.reshape(n, nb * b)
        anchor_codes = self.transfer_codes[anchors] if self.injection is not None else None
        states, pre_last = [], None
        for l, layer in enumerate(self.layers):
            x = layer(x, pos, ctx_kv[l], mask)
            if l == len(self.layers) - 1:
                pre_last = x.view(n, nb, b, h)
            if self.injection is not None:
                override = predecessor_override[l] if predecessor_override is not None else None
                with region("drafter.injection"):
                    x = self.injection(l, x.view(n, nb, b, h), anchor_codes, override,
                                       override_blocks).view(n, nb * b, h)
            states.append(x.view(n, nb, b, h))
        with region("drafter.norm"):
            hidden = self.norm(x).view(n, nb, b, h)
        return BlockOutput(hidden=hidden, pre_last=pre_last, layer_states=states)

    def refine_normed(self, pre_last: torch.Tensor, pred_codes: torch.Tensor) -> torch.Tensor:
        """norm(refine(h̃, a)) for K predecessor codes: [..., H], [..., K, r] -> [..., K, H]."""
        return self.norm(self.injection.refine(pre_last, pred_codes))

    # --------------------------------------------------------------- drafting
    @staticmethod
    def block_logits(out: BlockOutput, head: torch.Tensor) -> torch.Tensor:
        """Backbone logits of positions 1..B-1 of single-block output: [N, B-1, V] in float32."""
        return out.hidden[:, 0, 1:].float() @ head.float().T

    @torch.no_grad()
    def draft(self, out: BlockOutput, head: torch.Tensor, anchors: torch.Tensor) -> BlockDraft | torch.Tensor:
        """Draft tokens of positions 1..B-1 for single-block output (nb == 1).

        DSpine: candidate decoding with the transition table; DFlash: argmax of the backbone logits.
        Returns a BlockDraft for DSpine, [N, B-1] tokens for DFlash.
        """
        logits = self.block_logits(out, head)
        if self.injection is None:
            return logits.argmax(-1)
        return decode_block(
            logits, out.pre_last[:, 0, 1:], anchors.view(-1), self.cfg.dspine.top_k,
            self.refine_normed, self.transfer_codes, head,
        )
