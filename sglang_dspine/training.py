"""Training DSpine and DFlash drafters: the objective (DESIGN §1) and the loop.

One step, per sequence of a regenerated response (`data.py`):
- the frozen target runs once (no grad) and gives the features of `target_layer_ids` (`hidden_states[i+1]`)
  and its last (final-normed) hidden states, from which the teacher distributions are read;
- anchors are sampled inside the response: a position a is valid when a and a+1 are response tokens;
  up to `num_anchors` of them per sequence, sorted. The block at anchor a is [token a, mask × (B-1)] at
  positions a..a+B-1; it sees the context positions < a and itself (causally for DSpine, whole for DFlash);
  block position i is labelled with token a+i and supervised while a+i is still in the response
  (supervision stops at the first position that is not);
- each supervised position i (1..B-1) is weighted exp(-(i-1)/γ), and the loss is
      [ce_weight·CE + (1-ce_weight)·L1]                       backbone (the DFlash objective uses only this)
    + [ce_weight·CE_K + (1-ce_weight)·L1_K]                     refinement over the K backbone candidates
    + β(step) · mean_CE · Σ_l (1 - cos(φ_l(h_i^l), C[y_i]))      layer-wise alignment
  summed over positions and divided by the sum of the weights (over the whole optimizer step: all
  micro-batches, all ranks). The teacher of position i is the target's distribution at position a+i-1.
  Early in training the predecessors of the first `replacement_layers` layers are, per block with a
  probability that holds then decays to 0, the true tokens' codes.

Every term can be switched off; the DFlash objective is the backbone term alone on a bidirectional drafter.
Schedules and defaults follow SpecForge's reference (`OnlineDSpineModel`, `DSpineConfig.schedule`).
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import random
import re
import shutil
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from .checkpoint import init_dspine_transfer, load_drafter, save_drafter
from .config import DrafterConfig, DrafterConfigError, DSpineSettings, default_target_layer_ids
from .data import DataError, iter_token_data
from .generate import target_features, target_parts
from .model import DSpineDrafter

# ============================================================================================ schedules


def default_gamma(block_size: int) -> float:
    """Position-decay γ for a block size: DFlash's recommendation (B=8: 4, B=10: 5, B=16: 7), linear between
    those points and extended linearly past them (never below 1)."""
    points = [(8, 4.0), (10, 5.0), (16, 7.0)]
    b = float(block_size)
    if b <= points[0][0]:
        (x0, y0), (x1, y1) = points[0], points[1]
    elif b >= points[-1][0]:
        (x0, y0), (x1, y1) = points[-2], points[-1]
    else:
        (x0, y0), (x1, y1) = next((p, q) for p, q in zip(points, points[1:]) if p[0] <= b <= q[0])
    return max(1.0, y0 + (b - x0) * (y1 - y0) / (x1 - x0))


def position_weights(block_size: int, gamma: float, device=None) -> torch.Tensor:
    """exp(-(i-1)/γ) for block positions i = 1..B-1 (γ <= 0: uniform)."""
    k = torch.arange(block_size - 1, device=device, dtype=torch.float32)
    return torch.exp(-k / gamma) if gamma and gamma > 0 else torch.ones_like(k)


def alignment_beta(step: int, s: DSpineSettings) -> float:
    """β = alignment_weight · min(step / alignment_warmup_steps, 1)."""
    if s.alignment_warmup_steps <= 0:
        return float(s.alignment_weight)
    return float(s.alignment_weight) * min(step / s.alignment_warmup_steps, 1.0)


def replacement_probability(step: int, total_steps: int | None, s: DSpineSettings) -> float:
    """p(progress): replacement_probability until hold_ratio, linear to 0 at end_ratio, then 0."""
    if not total_steps or total_steps <= 0:
        return 0.0
    progress = step / total_steps
    hold, end = s.replacement_hold_ratio, s.replacement_end_ratio
    ramp = (end - progress) / (end - hold) if end > hold else float(progress < end)
    return float(s.replacement_probability) * min(max(ramp, 0.0), 1.0)


def lr_factor(step: int, warmup_steps: int, total_steps: int, min_ratio: float = 0.0) -> float:
    """Linear warm-up to 1 over `warmup_steps`, then cosine decay to `min_ratio` at `total_steps`."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    span = max(total_steps - warmup_steps, 1)
    progress = min(max((step - warmup_steps) / span, 0.0), 1.0)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


# ============================================================================================== config


@dataclass
class TrainConfig:
    data: str = ""  # regenerated JSONL (`sglang-dspine data`)
    output_dir: str = "runs/drafter"
    target: str | None = None  # transformers target path (or pass the model to `train`)
    init: str | None = None  # start from this drafter checkpoint (DSpine, or DFlash as a warm start)
    kind: str = "dspine"  # "dspine" or "dflash"
    # a fresh drafter
    num_draft_layers: int = 5
    block_size: int = 16
    target_layer_ids: list[int] | None = None
    mask_token_id: int | None = None
    dspine: dict[str, Any] = field(default_factory=dict)  # DSpineSettings overrides
    # objective
    num_anchors: int = 512
    gamma: float | None = None  # None: default_gamma(block_size)
    backbone_loss: bool = True
    refinement_loss: bool = True
    alignment_loss: bool = True
    replacement: bool = True
    dflash_ce_weight: float = 1.0  # the DFlash objective: CE (1.0) or CE/L1 mix
    coverage_k: int = 16  # candidate coverage metric for DFlash drafters (DSpine uses top_k)
    objective_chunk_blocks: int = 128  # 0: no chunking (logits of all blocks at once)
    init_std: float = 0.02  # normal init of a fresh backbone's linear weights
    freeze_backbone: bool = False  # train only the DSpine parts (injection weights)
    # optimisation
    lr: float = 6e-4
    min_lr_ratio: float = 0.0
    warmup_ratio: float = 0.04
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    max_grad_norm: float = 1.0
    batch_size: int = 1  # sequences per micro-batch per rank
    grad_accum: int = 1
    epochs: float = 1.0
    max_steps: int | None = None
    max_length: int = 3072
    # runtime
    precision: str = "auto"  # auto (bf16 on GPU, fp32 on CPU), bf16, fp32
    device: str | None = None
    seed: int = 0
    log_every: int = 10
    save_every: int = 0  # 0: save at the end only
    keep_checkpoints: int = 2
    resume: bool = True
    progress: bool = True

    def validate(self) -> None:
        def bad(name, want):
            raise ValueError(f"train config {name}: expected {want}, found {getattr(self, name)!r}")

        if self.kind not in ("dspine", "dflash"):
            bad("kind", "'dspine' or 'dflash'")
        for name in ("num_anchors", "batch_size", "grad_accum", "max_length", "num_draft_layers", "log_every"):
            if int(getattr(self, name)) < 1:
                bad(name, ">= 1")
        if self.block_size < 2:
            bad("block_size", ">= 2")
        if self.lr <= 0:
            bad("lr", "> 0")
        if not 0 <= self.warmup_ratio < 1:
            bad("warmup_ratio", "in [0, 1)")
        if not 0 <= self.dflash_ce_weight <= 1:
            bad("dflash_ce_weight", "in [0, 1]")
        if self.precision not in ("auto", "bf16", "fp32"):
            bad("precision", "'auto', 'bf16' or 'fp32'")
        if self.freeze_backbone and self.kind != "dspine":
            bad("freeze_backbone", "false for a DFlash drafter (it has nothing but a backbone)")
        if self.max_steps is None and self.epochs <= 0:
            bad("epochs", "> 0 (or give max_steps)")
        unknown = set(self.dspine) - {f.name for f in fields(DSpineSettings)}
        if unknown:
            raise ValueError(f"train config dspine: unknown DSpine settings {sorted(unknown)}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ================================================================================================ target


class TargetTeacher:
    """The frozen target: features of the drafter's target layers, last hidden states, embedding and head."""

    def __init__(self, target):
        self.model = target.eval()
        for p in target.parameters():
            p.requires_grad_(False)
        self.embed, self.head = target_parts(target)
        self.base = target.get_decoder() if hasattr(target, "get_decoder") else target.model

    @property
    def config(self):
        return self.model.config

    @torch.no_grad()
    def run(self, input_ids: torch.Tensor, layer_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(features [N, S, len(ids)·H], last hidden states [N, S, H]) of right-padded input_ids."""
        out = self.base(input_ids=input_ids, output_hidden_states=True, use_cache=False)
        return target_features(out.hidden_states, layer_ids), out.last_hidden_state


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


# ================================================================================================ blocks


@dataclass
class Blocks:
    """Training blocks of a micro-batch: N sequences × nb blocks × B positions."""

    anchors: torch.Tensor  # [N, nb] anchor positions (0 for padding blocks)
    keep: torch.Tensor  # [N, nb] bool, real blocks
    labels: torch.Tensor  # [N, nb, B] token at anchor + i (slot 0: the anchor token)
    supervised: torch.Tensor  # [N, nb, B-1] bool, positions 1..B-1
    weights: torch.Tensor  # [N, nb, B-1] float, supervised · exp(-(i-1)/γ)
    block_ids: torch.Tensor  # [N, nb, B] [anchor, mask...] (all mask for padding blocks)
    positions: torch.Tensor  # [N, nb, B]
    ctx_visible: torch.Tensor  # [N, nb, S] bool, context positions < anchor
    teacher_index: torch.Tensor  # [N, nb, B-1] position whose target distribution predicts the label
    replace: torch.Tensor | None = None  # [N, nb] bool, blocks with predecessor replacement

    @property
    def denominator(self) -> torch.Tensor:
        return self.weights.sum()


def valid_anchors(loss_mask: torch.Tensor) -> torch.Tensor:
    """[N, S] bool: positions a with loss_mask[a] and loss_mask[a+1] (the anchor and its first label)."""
    m = loss_mask > 0.5
    out = torch.zeros_like(m)
    out[:, :-1] = m[:, :-1] & m[:, 1:]
    return out


def sample_anchors(loss_mask: torch.Tensor, num_anchors: int, generator: torch.Generator | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to num_anchors valid anchors per sequence, uniformly without replacement, sorted ascending.

    Returns (anchors [N, nb], keep [N, nb]) with nb = min(num_anchors, most valid anchors of a sequence);
    padding entries have anchor 0 and keep False."""
    valid = valid_anchors(loss_mask).cpu()
    n, s = valid.shape
    nb = max(1, min(num_anchors, int(valid.sum(1).max())))
    score = torch.rand(n, s, generator=generator)
    score = torch.where(valid, score, torch.full_like(score, 2.0))
    picked = score.argsort(dim=1)[:, :nb]
    keep = valid.gather(1, picked)
    anchors = torch.where(keep, picked, torch.zeros_like(picked))
    # sort real anchors ascending, padding last
    key = torch.where(keep, anchors, torch.full_like(anchors, s + 1))
    order = key.argsort(dim=1)
    return anchors.gather(1, order).to(loss_mask.device), keep.gather(1, order).to(loss_mask.device)


def make_blocks(input_ids: torch.Tensor, loss_mask: torch.Tensor, anchors: torch.Tensor, keep: torch.Tensor,
                block_size: int, mask_token_id: int, gamma: float) -> Blocks:
    n, s = input_ids.shape
    b = block_size
    offsets = torch.arange(b, device=input_ids.device)
    index = anchors.unsqueeze(-1) + offsets  # [N, nb, B]
    safe = index.clamp(max=s - 1)
    labels = torch.gather(input_ids.unsqueeze(1).expand(-1, anchors.shape[1], -1), 2, safe)
    in_resp = torch.gather((loss_mask > 0.5).unsqueeze(1).expand(-1, anchors.shape[1], -1), 2, safe)
    sup = (index < s) & in_resp & keep.unsqueeze(-1)
    sup = sup[..., 1:].long().cumprod(-1).bool()
    weights = sup.float() * position_weights(b, gamma, input_ids.device)
    block_ids = torch.full_like(labels, mask_token_id)
    block_ids[..., 0] = torch.where(keep, labels[..., 0], torch.full_like(labels[..., 0], mask_token_id))
    ctx_visible = (torch.arange(s, device=input_ids.device).view(1, 1, s) < anchors.unsqueeze(-1)) & keep.unsqueeze(-1)
    teacher_index = (safe[..., 1:] - 1).clamp(min=0)
    return Blocks(anchors=anchors, keep=keep, labels=labels, supervised=sup, weights=weights, block_ids=block_ids,
                  positions=index, ctx_visible=ctx_visible, teacher_index=teacher_index)


# ============================================================================================= objective

TERM_NAMES = ("ce", "l1", "refinement", "alignment")


@dataclass
class ObjectiveSwitches:
    backbone: bool = True
    refinement: bool = True
    alignment: bool = True
    replacement: bool = True


class DrafterObjective(nn.Module):
    """The drafter plus the objective, as one module (what DDP wraps). The target's embedding and head are
    held outside the module's parameters (frozen, never synchronised)."""

    def __init__(self, drafter: DSpineDrafter, teacher: TargetTeacher, switches: ObjectiveSwitches,
                 dflash_ce_weight: float = 1.0, coverage_k: int = 16, chunk_blocks: int = 128):
        super().__init__()
        self.drafter = drafter
        self._teacher = [teacher]  # a list keeps it out of the module tree
        self.switches = switches
        self.dflash_ce_weight = dflash_ce_weight
        self.coverage_k = coverage_k
        self.chunk_blocks = chunk_blocks

    @property
    def teacher(self) -> TargetTeacher:
        return self._teacher[0]

    @property
    def ce_weight(self) -> float:
        s = self.drafter.cfg.dspine
        return float(s.ce_weight) if s is not None else float(self.dflash_ce_weight)

    @property
    def is_dspine(self) -> bool:
        return self.drafter.cfg.is_dspine

    def replacement_override(self, blocks: Blocks, dtype) -> list[torch.Tensor | None] | None:
        if blocks.replace is None or not self.is_dspine or not bool(blocks.replace.any()):
            return None
        s = self.drafter.cfg.dspine
        codes = math.sqrt(s.transfer_rank) * self.drafter.transfer_codes[blocks.labels[..., :-1]].to(dtype)
        return [codes if l < s.replacement_layers else None for l in range(self.drafter.cfg.num_hidden_layers)]

    def forward(self, features: torch.Tensor, last_hidden: torch.Tensor, blocks: Blocks,
                ce_only: bool = False) -> dict[str, torch.Tensor]:
        """Weighted sums of the terms (and metric counts) of one micro-batch."""
        d = self.drafter
        n, s = features.shape[:2]
        pos = torch.arange(s, device=features.device).expand(n, s)
        ctx_kv = d.context_kv(features, pos)
        embeds = self.teacher.embed(blocks.block_ids).to(torch.float32)
        # the CE prepass sees the same replacement as the graded pass: it must compute the same CE
        override = self.replacement_override(blocks, embeds.dtype)
        anchor_tokens = blocks.labels[..., 0]
        out = d.forward_blocks(embeds, blocks.positions, ctx_kv, blocks.ctx_visible, anchor_tokens,
                               predecessor_override=override, override_blocks=blocks.replace if override else None)
        b = d.cfg.block_size
        m = n * blocks.anchors.shape[1]
        flat = lambda t: t[..., 1:, :].reshape(m, b - 1, t.shape[-1])  # noqa: E731
        hidden = flat(out.hidden)
        labels = blocks.labels[..., 1:].reshape(m, b - 1)
        prev = blocks.labels[..., :-1].reshape(m, b - 1)
        weights = blocks.weights.reshape(m, b - 1)
        sup = blocks.supervised.reshape(m, b - 1)
        tidx = blocks.teacher_index.reshape(n, -1)
        t_hidden = torch.gather(last_hidden, 1, tidx.unsqueeze(-1).expand(-1, -1, last_hidden.shape[-1]))
        t_hidden = t_hidden.reshape(m, b - 1, -1)
        extras: list[torch.Tensor] = []
        if self.is_dspine and not ce_only:
            extras = [flat(out.pre_last)] + [flat(x) for x in out.layer_states]
        # blocks without supervision cost nothing: drop them before the vocabulary-sized work
        live = sup[:, 0].nonzero().squeeze(-1)
        args = [hidden, labels, prev, weights, sup, t_hidden] + extras
        args = [a.index_select(0, live) for a in args]
        total: dict[str, torch.Tensor] = {}
        step = self.chunk_blocks if self.chunk_blocks and self.chunk_blocks > 0 else max(len(live), 1)
        for start in range(0, len(live), step):
            part = [a[start:start + step] for a in args]
            fn = lambda *xs: self._terms(*xs, ce_only=ce_only)  # noqa: E731
            if torch.is_grad_enabled() and self.chunk_blocks and len(live) > step:
                res = checkpoint(fn, *part, use_reentrant=False)
            else:
                res = fn(*part)
            for k, v in res.items():
                total[k] = total[k] + v if k in total else v
        if not total:  # no supervised block at all (the data loader never lets this happen)
            zero = hidden.sum() * 0.0
            zeros = torch.zeros(b - 1, device=hidden.device)
            total = {**{k: zero for k in TERM_NAMES}, "correct_pos": zeros, "count_pos": zeros.clone(),
                     "lead_correct": zero.detach(), "full_blocks": zero.detach(), "coverage": zero.detach()}
        total["denominator"] = blocks.denominator
        return total

    def _terms(self, hidden, labels, prev, weights, sup, t_hidden, *extras, ce_only: bool = False):
        head = self.teacher.head
        sw = self.switches
        logits = _head_logits(hidden, head).float()
        logp = logits.log_softmax(-1)
        ce = -logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
        res = {"ce": (ce * weights).sum()}
        with torch.no_grad():
            correct = (logits.argmax(-1) == labels) & sup
            res["correct_pos"] = correct.sum(0).float()
            res["count_pos"] = sup.sum(0).float()
            full = sup.all(-1)
            lead = correct.long().cumprod(-1).sum(-1)
            res["lead_correct"] = (lead * full).sum().float()
            res["full_blocks"] = full.sum().float()
        if ce_only:
            return res
        cw = self.ce_weight
        need_teacher = (sw.backbone and cw < 1) or (self.is_dspine and sw.refinement)
        teacher = None
        if need_teacher:
            with torch.no_grad():
                teacher = _head_logits(t_hidden, head).float().softmax(-1)
        if sw.backbone and cw < 1:
            l1 = (logp.exp() - teacher).abs().sum(-1)
            res["l1"] = (l1 * weights).sum()
        k = self.drafter.cfg.dspine.top_k if self.is_dspine else self.coverage_k
        cand = logits.detach().topk(min(k, logits.shape[-1]), dim=-1).indices
        covered = cand == labels.unsqueeze(-1)
        with torch.no_grad():
            res["coverage"] = (covered.any(-1) & sup).sum().float()
        if self.is_dspine and sw.refinement:
            d = self.drafter
            pre_last = extras[0]
            refined = d.refine_normed(pre_last, d.transfer_codes[prev].unsqueeze(-2)).squeeze(-2)
            rows = F.embedding(cand, head)  # [M, P, K, H]
            if not torch.is_autocast_enabled():
                refined = refined.to(rows.dtype)
            scores = torch.matmul(rows, refined.unsqueeze(-1)).squeeze(-1).float()
            q = scores.log_softmax(-1)
            rce = -(q * covered).sum(-1)
            t_cand = teacher.gather(-1, cand)
            mass = t_cand.sum(-1)
            t_cand = t_cand / mass.unsqueeze(-1).clamp_min(1e-30)
            rl1 = (q.exp() - t_cand).abs().sum(-1) * (mass > d.cfg.dspine.candidate_mass_threshold)
            res["refinement"] = ((cw * rce + (1 - cw) * rl1) * weights).sum()
        if self.is_dspine and sw.alignment:
            d = self.drafter
            target_codes = d.transfer_codes[labels].float()
            align = 0.0
            for l, state in enumerate(extras[1:]):
                feat = d.injection.feature(l, state).float()
                align = align + (1 - F.cosine_similarity(feat, target_codes, dim=-1))
            res["alignment"] = (align * weights).sum()
        return res


def _head_logits(x: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
    """x @ headᵀ; under autocast the cast is autocast's, else x takes the head's dtype (never a copy of the head)."""
    return F.linear(x if torch.is_autocast_enabled() else x.to(head.dtype), head)


def assemble_loss(terms: dict[str, torch.Tensor], ce_weight: float, switches: ObjectiveSwitches, is_dspine: bool,
                  beta: float, mean_ce: torch.Tensor | float) -> torch.Tensor:
    """The numerator of the loss (divide by the global weight sum)."""
    zero = terms["ce"] * 0.0
    num = zero
    if switches.backbone:
        num = num + ce_weight * terms["ce"]
        if ce_weight < 1:
            num = num + (1 - ce_weight) * terms.get("l1", zero)
    if is_dspine and switches.refinement:
        num = num + terms.get("refinement", zero)
    if is_dspine and switches.alignment and beta > 0:
        num = num + beta * mean_ce * terms.get("alignment", zero)
    return num


# ================================================================================================= loop


def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def _all_reduce(t: torch.Tensor) -> torch.Tensor:
    d = _dist()
    if d is not None:
        d.all_reduce(t)
    return t


def local_rank() -> int:
    """This process's GPU index on its host: LOCAL_RANK under torchrun (WORLD_SIZE > 1), else 0."""
    return int(os.environ.get("LOCAL_RANK", "0")) if int(os.environ.get("WORLD_SIZE", "1")) > 1 else 0


def setup_distributed() -> tuple[int, int, int]:
    """(rank, world size, local rank); initialises the process group under torchrun (WORLD_SIZE > 1)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 0, 1, 0
    import torch.distributed as dist

    local = local_rank()
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(local)
        dist.init_process_group(backend=backend)
    return dist.get_rank(), dist.get_world_size(), local


class TokenData:
    """Regenerated sequences, truncated to max_length, kept only if they hold a valid anchor."""

    def __init__(self, path: str, max_length: int):
        import numpy as np

        self.items: list[tuple[Any, Any]] = []  # (int32 ids, uint8 mask): compact for large sets
        self.dropped = 0
        for rec in iter_token_data(path):
            ids = np.asarray(rec["input_ids"][:max_length], dtype=np.int64)
            mask = np.asarray(rec["loss_mask"][:max_length], dtype=np.float32) > 0.5
            if valid_anchors(torch.from_numpy(mask)[None]).any():
                self.items.append((ids.astype(np.int32), mask.astype(np.uint8)))
            else:
                self.dropped += 1
        if not self.items:
            raise DataError(f"training data {path}: no sequence has two consecutive response tokens "
                            f"within max_length={max_length}")

    def __len__(self) -> int:
        return len(self.items)

    def batch(self, indices: list[int], device) -> tuple[torch.Tensor, torch.Tensor]:
        seqs = [self.items[i] for i in indices]
        s = max(len(ids) for ids, _ in seqs)
        ids = torch.zeros(len(seqs), s, dtype=torch.long)
        mask = torch.zeros(len(seqs), s, dtype=torch.float32)
        for j, (t, m) in enumerate(seqs):
            ids[j, : len(t)] = torch.from_numpy(t.astype("int64"))
            mask[j, : len(m)] = torch.from_numpy(m.astype("float32"))
        return ids.to(device), mask.to(device)


class Schedule:
    """Which sequences each (step, micro-batch, rank) takes: a fresh permutation per epoch, ranks strided."""

    def __init__(self, n: int, batch_size: int, grad_accum: int, world: int, seed: int):
        self.n, self.bs, self.accum, self.world, self.seed = n, batch_size, grad_accum, world, seed
        self.per_epoch = max(1, n // (batch_size * world))  # micro-batches per rank per epoch
        self._perm: dict[int, list[int]] = {}

    def steps_per_epoch(self) -> float:
        return self.per_epoch / self.accum

    def indices(self, step: int, micro: int, rank: int) -> list[int]:
        m = step * self.accum + micro
        epoch, j = divmod(m, self.per_epoch)
        if epoch not in self._perm:
            self._perm = {epoch: random.Random(self.seed * 1000003 + epoch).sample(range(self.n), self.n)}
        perm = self._perm[epoch]
        start = (j * self.world + rank) * self.bs
        return [perm[(start + t) % self.n] for t in range(self.bs)]


def _checkpoints(output_dir: str) -> list[tuple[int, str]]:
    """(step, folder name) of the `checkpoint-N` folders in a training output, oldest first."""
    if not os.path.isdir(output_dir):
        return []
    return sorted((int(m.group(1)), d) for d in os.listdir(output_dir) if (m := re.fullmatch(r"checkpoint-(\d+)", d)))


def _latest_checkpoint(output_dir: str) -> str | None:
    steps = [(n, d) for n, d in _checkpoints(output_dir) if os.path.isfile(os.path.join(output_dir, d, "trainer_state.pt"))]
    return os.path.join(output_dir, steps[-1][1]) if steps else None


def resolve_checkpoint(path: str) -> str:
    """A drafter directory: `path` itself, or the latest `checkpoint-N` (or `final`) of a training output."""
    if not path:  # "" would otherwise mean the working directory
        raise FileNotFoundError("an empty path; expected a drafter directory")
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path}: {'a file' if os.path.exists(path) else 'no such directory'}; "
                                "expected a drafter directory")
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    latest = _latest_checkpoint(path)
    if latest:
        return latest
    final = os.path.join(path, "final")
    if os.path.isfile(os.path.join(final, "config.json")):
        return final
    raise FileNotFoundError(f"{path}: neither a drafter checkpoint (config.json) nor a training output with checkpoints")


class MetricsLog:
    def __init__(self, path: str | None):
        self.path = path

    def write(self, rec: dict[str, Any]) -> None:
        if self.path:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(json.dumps(rec) + "\n")


def _autocast(device: torch.device, bf16: bool):
    if bf16:
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def train(tc: TrainConfig, target=None, on_step=None) -> dict[str, Any]:
    """Train a drafter; returns a summary (steps, last metrics, output paths). `on_step(step)` is called after
    every optimizer step (a profiler's `step`, in benchmarks/train_step.py)."""
    with torch.enable_grad():  # whatever the caller's grad mode
        return _train(tc, target, on_step)


def train_device(tc: TrainConfig) -> tuple[torch.device, bool]:
    """Where training runs, and whether in bf16: `tc.device`, else this rank's GPU (cuda:LOCAL_RANK under
    torchrun), else the CPU; bf16 when `precision` says so, or on 'auto' on a GPU. The CLI loads the target
    by the same rule before training starts."""
    if tc.device:
        device = torch.device(tc.device)
    elif torch.cuda.is_available():
        device = torch.device("cuda", local_rank())
    else:
        device = torch.device("cpu")
    return device, tc.precision == "bf16" or (tc.precision == "auto" and device.type == "cuda")


def _train(tc: TrainConfig, target=None, on_step=None) -> dict[str, Any]:
    tc.validate()
    rank, world, local = setup_distributed()
    device, bf16 = train_device(tc)
    torch.manual_seed(tc.seed)

    if target is None:
        if not tc.target:
            raise ValueError("train: give a target (--target PATH)")
        from transformers import AutoModelForCausalLM

        target = AutoModelForCausalLM.from_pretrained(tc.target, dtype=torch.bfloat16 if bf16 else torch.float32)
    target = target.to(device)
    teacher = TargetTeacher(target)

    os.makedirs(tc.output_dir, exist_ok=True)
    resume_from = _latest_checkpoint(tc.output_dir) if tc.resume else None
    if resume_from:
        drafter = load_drafter(resume_from, target_head=teacher.head.detach().float().cpu())
    else:
        drafter = build_drafter(tc, teacher)
    drafter = drafter.to(device=device, dtype=torch.float32)
    cfg = drafter.cfg
    if cfg.kind != tc.kind:
        raise DrafterConfigError(f"train: kind {tc.kind!r} but the drafter in use is a {cfg.kind} drafter")
    params = trainable_parameters(drafter, tc.freeze_backbone)
    gamma = tc.gamma if tc.gamma is not None else default_gamma(cfg.block_size)
    switches = ObjectiveSwitches(tc.backbone_loss, tc.refinement_loss, tc.alignment_loss, tc.replacement)
    objective = DrafterObjective(drafter, teacher, switches, tc.dflash_ce_weight, tc.coverage_k,
                                 tc.objective_chunk_blocks).to(device)
    model: nn.Module = objective
    if world > 1:
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(objective, device_ids=[local] if device.type == "cuda" else None, broadcast_buffers=False)

    data = TokenData(tc.data, tc.max_length)
    sched = Schedule(len(data), tc.batch_size, tc.grad_accum, world, tc.seed)
    total_steps = tc.max_steps or max(1, math.ceil(tc.epochs * sched.steps_per_epoch()))
    warmup = int(tc.warmup_ratio * total_steps)
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": tc.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=tc.lr, betas=(tc.adam_beta1, tc.adam_beta2), fused=device.type == "cuda")
    lr_sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, warmup, total_steps, tc.min_lr_ratio))

    step = 0
    if resume_from:
        state = torch.load(os.path.join(resume_from, "trainer_state.pt"), map_location="cpu", weights_only=False)
        opt.load_state_dict(state["optimizer"])
        lr_sched.load_state_dict(state["scheduler"])
        step = int(state["step"])
        if state.get("total_steps") != total_steps:
            raise ValueError(f"resume {resume_from}: total_steps changed ({state.get('total_steps')} -> {total_steps}); "
                             "the schedules would not continue; use the same data/epochs/batch settings or a new output dir")
    if rank == 0:
        with open(os.path.join(tc.output_dir, "train_config.json"), "w", encoding="utf-8") as f:
            json.dump({**tc.to_dict(), "gamma_used": gamma, "total_steps": total_steps, "world_size": world}, f, indent=2)
    log = MetricsLog(os.path.join(tc.output_dir, "metrics.jsonl") if rank == 0 else None)

    from tqdm import tqdm

    bar = tqdm(total=total_steps, initial=step, desc=f"train {cfg.kind}", disable=not tc.progress or rank != 0,
               dynamic_ncols=True)
    acc: dict[str, torch.Tensor] = {}
    acc_steps, t0, tokens = 0, time.time(), 0
    last: dict[str, Any] = {}
    region = torch.profiler.record_function  # named parts of a step in a profile; nothing otherwise
    while step < total_steps:
        s_settings = cfg.dspine
        beta = alignment_beta(step, s_settings) if cfg.is_dspine and switches.alignment else 0.0
        p_rep = replacement_probability(step, total_steps, s_settings) if cfg.is_dspine and switches.replacement else 0.0
        # 1. inputs of every micro-batch of this step: target outputs and blocks (anchors, replacement)
        micro = []
        for j in range(tc.grad_accum):
            g = torch.Generator().manual_seed((tc.seed * 1_000_003 + step * 7919 + j * 131 + rank) % (2**63))
            with region("train.data"):
                ids, mask = data.batch(sched.indices(step, j, rank), device)
            with region("train.target"):
                feats, last_hidden = teacher.run(ids, cfg.target_layer_ids)
            with region("train.blocks"):
                anchors, keep = sample_anchors(mask, tc.num_anchors, g)
                blocks = make_blocks(ids, mask, anchors, keep, cfg.block_size, cfg.mask_token_id, gamma)
                if p_rep > 0:
                    blocks.replace = (torch.rand(keep.shape, generator=g) < p_rep).to(device) & keep
            micro.append((feats, last_hidden, blocks))
            tokens += int(mask.sum())
        denom = _all_reduce(torch.stack([b.denominator for *_, b in micro]).sum().detach().clone())
        scale = world / denom.clamp_min(1.0)
        # 2. the global mean CE that scales the alignment term (a no-grad prepass when accumulating)
        mean_ce: torch.Tensor | float = 0.0
        if beta > 0 and tc.grad_accum > 1:
            with torch.no_grad(), _autocast(device, bf16):
                ce_sum = sum(objective(f, h, b, ce_only=True)["ce"] for f, h, b in micro)
            mean_ce = _all_reduce(ce_sum.detach().float().clone()) / denom.clamp_min(1.0)
        # 3. graded passes
        model.train()
        for j, (feats, last_hidden, blocks) in enumerate(micro):
            sync = j == len(micro) - 1 or world == 1
            ctx = model.no_sync() if (world > 1 and not sync) else contextlib.nullcontext()
            with ctx:
                with _autocast(device, bf16), region("train.forward"):
                    terms = model(feats, last_hidden, blocks)
                if beta > 0 and tc.grad_accum == 1:
                    mean_ce = _all_reduce(terms["ce"].detach().float().clone()) / denom.clamp_min(1.0)
                num = assemble_loss(terms, objective.ce_weight, switches, cfg.is_dspine, beta, mean_ce)
                with region("train.backward"):
                    (num * scale).backward()
            for k, v in terms.items():
                v = v.detach().float()
                acc[k] = acc[k] + v if k in acc else v.clone()
            acc["loss_num"] = acc.get("loss_num", 0.0) + num.detach().float()
        with region("train.optimizer"):
            grad_norm = torch.nn.utils.clip_grad_norm_(params, tc.max_grad_norm) if tc.max_grad_norm > 0 else None
            lr_now = opt.param_groups[0]["lr"]
            opt.step()
            lr_sched.step()
            opt.zero_grad(set_to_none=True)
        step += 1
        acc_steps += 1
        bar.update(1)
        if step % tc.log_every == 0 or step == total_steps:
            red = {k: _all_reduce(v) for k, v in acc.items()}  # acc is rebuilt after logging: reduce in place
            d = red["denominator"].clamp_min(1e-9)
            rec: dict[str, Any] = {"step": step, "lr": lr_now, "beta": beta, "replacement_p": p_rep,
                                   "loss": float(red["loss_num"] / d)}
            for k in TERM_NAMES:
                if k in red:
                    rec[k] = float(red[k] / d)
            cnt = red["count_pos"]
            rec["accuracy"] = float(red["correct_pos"].sum() / cnt.sum().clamp_min(1))
            rec["accuracy_per_position"] = [round(float(c / max(float(n), 1.0)), 4)
                                            for c, n in zip(red["correct_pos"], cnt)]
            rec["candidate_coverage"] = float(red["coverage"] / cnt.sum().clamp_min(1))
            rec["backbone_accept_len"] = float(1 + red["lead_correct"] / red["full_blocks"].clamp_min(1))
            if grad_norm is not None:
                rec["grad_norm"] = float(grad_norm)
            dt = time.time() - t0
            rec["tokens_per_s"] = tokens * world / max(dt, 1e-9)
            rec["interval_steps"], rec["interval_seconds"] = acc_steps, round(dt, 4)
            log.write(rec)
            bar.set_postfix(loss=f"{rec['loss']:.3f}", acc=f"{rec['accuracy']:.3f}")
            last = rec
            acc, acc_steps, t0, tokens = {}, 0, time.time(), 0
        if tc.save_every and step % tc.save_every == 0 and step < total_steps:
            _save_checkpoint(tc, drafter, opt, lr_sched, step, total_steps, rank)
        if on_step is not None:
            on_step(step)
    bar.close()
    ckpt = _save_checkpoint(tc, drafter, opt, lr_sched, step, total_steps, rank)
    final = os.path.join(tc.output_dir, "final")
    if rank == 0:
        save_drafter(drafter, final)
    if _dist() is not None:
        _dist().barrier()
    return {"steps": step, "total_steps": total_steps, "final": final, "checkpoint": ckpt, "last_metrics": last,
            "gamma": gamma, "dropped_sequences": data.dropped}


def _save_checkpoint(tc: TrainConfig, drafter: DSpineDrafter, opt, lr_sched, step: int, total_steps: int,
                     rank: int) -> str:
    path = os.path.join(tc.output_dir, f"checkpoint-{step}")
    if rank == 0:
        tmp = path + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        save_drafter(drafter, tmp)
        torch.save({"optimizer": opt.state_dict(), "scheduler": lr_sched.state_dict(), "step": step,
                    "total_steps": total_steps, "train_config": tc.to_dict()}, os.path.join(tmp, "trainer_state.pt"))
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)
        if tc.keep_checkpoints > 0:
            for _, d in _checkpoints(tc.output_dir)[: -tc.keep_checkpoints]:
                shutil.rmtree(os.path.join(tc.output_dir, d), ignore_errors=True)
    if _dist() is not None:
        _dist().barrier()
    return path
