"""The drafter a training run starts from: its config for a target (`drafter.config.new_drafter_config`, the one
drafter-config factory), its initial weights, or a checkpoint to start from (a DFlash checkpoint becomes a DSpine
warm start).

Defaults fit the target they are given:
- drafter layers: 5 (the reference's for Qwen3-8B), at most half the target's layers;
- target layer ids: DFlash's spread from layer 1 to n-3 where the target has room for distinct ids, else
  spread over 1..n-2 (a 4-layer target: 1, 2);
- DSpine's transfer rank r = H/4 capped at 1024 (1024 at H = 4096, the reference's) and message size r/2
  capped at 512 (DSpineSettings.scaled_for);
- the mask token: the drafter's (--init), else the tokenizer's mask token, else `<|MASK|>` where the
  vocabulary has it, else the id adding `<|MASK|>` to the tokenizer gives (len(tokenizer), as SpecForge does:
  151669 for Qwen3), when the target's embedding has that row; always checked against the vocabulary.
A value the target cannot take is refused naming the flag that sets it.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..drafter.checkpoint import init_dspine_transfer, load_drafter
from ..drafter.config import (
    DrafterConfig,
    DrafterConfigError,
    DSpineSettings,
    fit_target_layer_ids,
    fresh_settings,
    new_drafter_config,
)
from ..drafter.model import DSpineDrafter
from .teacher import TargetTeacher
from .train_config import DEFAULT_RECIPE, TrainConfig, alignment_decay_of, flag

MASK_TOKEN = "<|MASK|>"
RECIPE_KEY = "training_recipe"


# ---------------------------------------------------------------------------------- defaults for a target
def default_num_draft_layers(num_target_layers: int) -> int:
    """5 drafter layers (the reference's), at most half the target's."""
    return max(1, min(5, num_target_layers // 2))


def default_mask_token(tokenizer, vocab_size: int) -> tuple[int, str]:
    """(mask token id, where it comes from) for a target whose embedding has `vocab_size` rows."""
    if tokenizer is None:
        return vocab_size - 1, "no tokenizer to ask: the last embedding row"
    if getattr(tokenizer, "mask_token_id", None) is not None:
        return int(tokenizer.mask_token_id), f"the tokenizer's mask token {tokenizer.mask_token!r}"
    vocab = tokenizer.get_vocab()
    if MASK_TOKEN in vocab:
        return int(vocab[MASK_TOKEN]), f"{MASK_TOKEN} in the tokenizer's vocabulary"
    n = len(tokenizer)
    if n < vocab_size:
        return n, (f"the id {MASK_TOKEN} takes when added to the tokenizer "
                   f"({n} tokens; the embedding has {vocab_size} rows)")
    raise DrafterConfigError(f"{flag('mask_token_id')}: needed: the tokenizer has no mask token and its {n} tokens "
                             f"fill the target's {vocab_size} embedding rows")


def check_fits_target(tc: TrainConfig, target_config, mask_token_id: int | None = None) -> None:
    """Refuse settings the target cannot take, naming the flag (a fresh drafter, or --init's overrides)."""
    t = target_config
    hidden, vocab, n_layers = int(t.hidden_size), int(t.vocab_size), int(t.num_hidden_layers)
    if tc.target_layer_ids is not None:
        out = [i for i in tc.target_layer_ids if not 0 <= i < n_layers]
        if out:
            raise DrafterConfigError(f"{flag('target_layer_ids')} {','.join(map(str, tc.target_layer_ids))}: "
                                     f"expected ids in [0, {n_layers}) (the target has {n_layers} layers)")
    mask = tc.mask_token_id if tc.mask_token_id is not None else mask_token_id
    if mask is not None and not 0 <= mask < vocab:
        raise DrafterConfigError(f"{flag('mask_token_id')} {mask}: expected in [0, {vocab}) (the target's vocab_size)")
    rank = tc.dspine.get("transfer_rank")
    if rank is not None and rank > min(hidden, vocab - 1):
        raise DrafterConfigError(f"{flag('transfer_rank')} {rank}: expected at most {min(hidden, vocab - 1)} for this "
                                 f"target (min(hidden_size {hidden}, vocab_size - 1))")
    top_k = tc.dspine.get("top_k")
    if top_k is not None and top_k > vocab:
        raise DrafterConfigError(f"{flag('top_k')} {top_k}: expected at most {vocab} (the target's vocab_size)")


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


def build_drafter(tc: TrainConfig, teacher: TargetTeacher, tokenizer=None) -> tuple[DSpineDrafter, str]:
    """A fresh drafter fitted to the target, or one from `tc.init` (a DFlash checkpoint becomes a DSpine
    warm start); and where its mask token came from."""
    t = teacher.config
    hidden, vocab, n_layers = int(t.hidden_size), int(t.vocab_size), int(t.num_hidden_layers)
    head = teacher.head.detach().float().cpu()
    dspine_init = False  # a DSpine --init: its own recipe stays unless another is given
    if tc.init:
        check_fits_target(tc, t)
        src = DrafterConfig.from_file(tc.init)
        if src.kind == "dspine" and tc.kind == "dflash":
            raise DrafterConfigError(f"--init {tc.init} is a DSpine drafter; it cannot be trained as a DFlash drafter")
        if tc.mask_token_id is not None and tc.mask_token_id != src.mask_token_id:
            raise DrafterConfigError(f"{flag('mask_token_id')} {tc.mask_token_id}: the --init drafter was trained "
                                     f"with mask token {src.mask_token_id}")
        if src.kind == "dflash" and tc.kind == "dspine":
            model = load_drafter(tc.init, as_dspine=True, target_head=head,
                                 dspine_settings=fresh_settings(hidden, vocab, tc.recipe_settings()))
        else:
            model = load_drafter(tc.init, target_head=head)
            dspine_init = model.cfg.is_dspine
            # a DSpine --init keeps its own settings unless a recipe or flags are given
            overrides = tc.recipe_settings() if tc.recipe else tc.dspine
            if model.cfg.is_dspine and overrides:
                arch = {k: v for k, v in overrides.items() if k in ("transfer_rank", "message_size")
                        and v != getattr(model.cfg.dspine, k)}
                if arch:
                    raise DrafterConfigError(f"--init {tc.init}: its {sorted(arch)} cannot change "
                                             f"(checkpoint: {model.cfg.dspine.to_dict()})")
                model.cfg.dspine = settings_with(model.cfg.dspine, overrides)
        mask_source = f"the --init drafter's ({tc.init})"
    else:
        if tc.mask_token_id is not None:
            mask, mask_source = tc.mask_token_id, flag("mask_token_id")
        else:
            mask, mask_source = default_mask_token(tokenizer, vocab)
        check_fits_target(tc, t, mask)
        layers = tc.num_draft_layers or default_num_draft_layers(n_layers)
        ids = tc.target_layer_ids or fit_target_layer_ids(n_layers, layers)
        settings = fresh_settings(hidden, vocab, tc.recipe_settings()) if tc.kind == "dspine" else None
        cfg = new_drafter_config(t, tc.kind, layers, tc.block_size, ids, mask, settings)
        model = DSpineDrafter(cfg)
        init_backbone(model, tc.init_std)
        if cfg.is_dspine:
            init_dspine_transfer(model, head)
    model.cfg.check_target(hidden, vocab, n_layers)
    if model.cfg.is_dspine:
        record_recipe(model.cfg, tc, dspine_init)
    return model, mask_source


def record_recipe(cfg: DrafterConfig, tc: TrainConfig, dspine_init: bool = False) -> None:
    """The recipe a DSpine drafter is trained with, kept in its config.json (`training_recipe`: the name, the
    flags given over it, the alignment schedule; dspine_config holds the resulting values) through checkpoints
    and export. A DSpine --init trained on without --recipe keeps its record (its name is "unrecorded" where it
    had none), with the flags given now added."""
    old = cfg.raw.get(RECIPE_KEY) if dspine_init and not tc.recipe else None
    old = old if isinstance(old, dict) else {}
    if dspine_init and not tc.recipe:
        name, before = old.get("name", "unrecorded"), old.get("overrides", {})
    else:
        name, before = tc.recipe or DEFAULT_RECIPE, {}
    decay = tc.alignment_decay or old.get("alignment_decay") or alignment_decay_of(tc, name)
    cfg.raw[RECIPE_KEY] = {"name": name, "overrides": {**before, **tc.dspine}, "alignment_decay": decay}


def recipe_alignment_decay(cfg: DrafterConfig) -> str:
    """The alignment schedule recorded for a DSpine drafter's training (record_recipe)."""
    return (cfg.raw.get(RECIPE_KEY) or {}).get("alignment_decay", "none")


def recipe_line(cfg: DrafterConfig) -> str:
    """The recipe a DSpine drafter trains with, in words (the trainer prints it)."""
    rec = cfg.raw.get(RECIPE_KEY) or {}
    name = rec.get("name", "unrecorded")
    why = {DEFAULT_RECIPE: " (the default: chosen on the lab's validation prompts)",
           "specforge": " (SpecForge's reference values)"}.get(name, "")
    s = cfg.dspine
    over = f", flags over it: {rec['overrides']}" if rec.get("overrides") else ""
    fade = ", faded out by a cosine over the run" if recipe_alignment_decay(cfg) == "cosine" else ""
    return (f"recipe {name}{why}{over}: ce_weight {s.ce_weight}, alignment {s.alignment_weight} over "
            f"{s.alignment_warmup_steps} warm-up steps{fade}, replacement in {s.replacement_layers} layers")


def trainable_parameters(model: DSpineDrafter, freeze_backbone: bool) -> list[nn.Parameter]:
    for name, p in model.named_parameters():
        p.requires_grad_(not freeze_backbone or name.startswith("injection."))
    return [p for p in model.parameters() if p.requires_grad]
