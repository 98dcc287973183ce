"""The trainer's settings (`sglang-dspine train`'s flags, one field each; errors name the flag)."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from ..drafter.config import DSpineSettings

# DSpine training recipes: the DSpine settings a fresh drafter is trained with, under any --FLAG given. All
# keep the reference's architecture, alignment, refinement and replacement; they differ in how the backbone
# and the refinement are fitted and in how long the alignment term lasts (docs/training_recipe.md has the
# measurements):
#   ce_anneal  CE on the true next token (ce_weight 1), as DFlash's own objective, with the alignment term faded
#              out over the run (β times a cosine from 1 to 0, as the learning rate): the default, chosen on the
#              lab's validation prompts at 1,800 steps over `ce` (mean τ 4.15 vs 4.07, seeds 0 and 1; on the
#              held-out suites the two are level)
#   ce         CE with the alignment term constant after its warm-up: the default before; on the lab's objective
#              cross SpecForge's mix lost to it in DSpine and in DFlash alike
#   specforge  SpecForge's reference values exactly (`DSpineConfig`): 0.1·CE + 0.9·L1 to the target's
#              distribution, the weights it tuned for ~66k-step runs
RECIPES: dict[str, dict[str, Any]] = {"ce": {"ce_weight": 1.0}, "ce_anneal": {"ce_weight": 1.0}, "specforge": {}}
# The alignment schedule of each recipe (`--alignment-decay` overrides it): a training setting, not part of
# dspine_config (SpecForge's format); the exported config records it in `training_recipe`.
ALIGNMENT_DECAYS = ("none", "cosine")
RECIPE_ALIGNMENT_DECAY: dict[str, str] = {"ce_anneal": "cosine"}
DEFAULT_RECIPE = "ce_anneal"


@dataclass
class TrainConfig:
    data: str = ""  # JSONL: token records (`sglang-dspine data`) and/or conversations (SpecForge's format)
    output_dir: str = "runs/drafter"
    target: str | None = None  # transformers target path (or pass the model to `train`)
    init: str | None = None  # start from this drafter checkpoint (DSpine, or DFlash as a warm start)
    kind: str = "dspine"  # "dspine" or "dflash"
    # conversations (records with `conversations` or `messages`)
    tokenizer: str | None = None  # None: the target's folder
    chat_template: str | None = None  # None: the tokenizer's own; else a Jinja file, a named or built-in one
    enable_thinking: bool | None = None  # for templates that read it (Qwen3's); None: the template's default
    last_turn_only: bool = False  # loss on the last assistant turn only (default: on every assistant turn)
    # a fresh drafter (None: fitted to the target, drafter_setup.py)
    num_draft_layers: int | None = None  # 5, fewer for a target under 10 layers
    block_size: int = 16
    target_layer_ids: list[int] | None = None  # DFlash's spread over the target's layers
    mask_token_id: int | None = None  # the drafter's, else the tokenizer's mask token (or <|MASK|>'s id)
    dspine: dict[str, Any] = field(default_factory=dict)  # DSpineSettings overrides (given flags)
    recipe: str | None = None  # RECIPES; None: DEFAULT_RECIPE for a fresh drafter, a DSpine --init's own settings
    # objective
    num_anchors: int = 512
    gamma: float | None = None  # None: default_gamma(block_size)
    backbone_loss: bool = True
    refinement_loss: bool = True
    alignment_loss: bool = True
    replacement: bool = True
    dflash_ce_weight: float = 1.0  # the DFlash objective: CE (1.0) or CE/L1 mix
    alignment_decay: str | None = None  # ALIGNMENT_DECAYS; None: the recipe's (alignment_decay_of)
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
    save_every: int = 0  # checkpoint every this many optimizer steps (0: by save_minutes only)
    # a checkpoint every this many minutes (0: off): by time, not steps, because a step's cost runs from
    # milliseconds (the built-in pair on a CPU) to seconds (an 8B target), and a crash or a kill -9 should cost
    # at most this much work whatever the size
    save_minutes: float = 30.0
    keep_checkpoints: int = 2
    save: bool = True  # False: metrics only, no checkpoint or final drafter (throughput trials)
    resume: bool = True
    progress: bool = True
    tensorboard: bool = True  # TensorBoard event files in output_dir/tensorboard (when the package is installed)
    wandb_project: str | None = None  # also log to Weights & Biases (needs the wandb package)
    run_name: str | None = None

    def validate(self) -> None:
        def bad(name, want, value=None):
            value = getattr(self, name) if value is None else value
            raise ValueError(f"{flag(name)} {value}: expected {want}")

        if self.kind not in ("dspine", "dflash"):
            bad("kind", "'dspine' or 'dflash'")
        for name, value in [*((f.name, getattr(self, f.name)) for f in fields(self)), *self.dspine.items()]:
            if isinstance(value, float) and not math.isfinite(value):  # NaN and inf pass the bounds below
                raise ValueError(f"{flag(name)} {value}: expected a finite number")
        if self.recipe is not None and self.recipe not in RECIPES:
            bad("recipe", " or ".join(repr(r) for r in RECIPES))
        for name in ("num_anchors", "batch_size", "grad_accum", "max_length", "log_every"):
            if int(getattr(self, name)) < 1:
                bad(name, ">= 1")
        if self.num_draft_layers is not None and self.num_draft_layers < 1:
            bad("num_draft_layers", ">= 1")
        if self.block_size < 2:
            bad("block_size", ">= 2")
        if not self.lr > 0:  # NaN too
            bad("lr", "> 0")
        for name, ok, want in BOUNDS:
            if getattr(self, name) is not None and not ok(getattr(self, name)):
                bad(name, want)
        if not 0 <= self.warmup_ratio < 1:
            bad("warmup_ratio", "in [0, 1)")
        if not 0 <= self.dflash_ce_weight <= 1:
            bad("dflash_ce_weight", "in [0, 1]")
        if self.alignment_decay is not None and self.alignment_decay not in ALIGNMENT_DECAYS:
            bad("alignment_decay", " or ".join(repr(d) for d in ALIGNMENT_DECAYS))
        if self.alignment_decay is not None and self.kind == "dflash":
            raise ValueError("--alignment-decay: a DFlash drafter has no alignment term (its objective is "
                             "--dflash-ce-weight)")
        if self.precision not in ("auto", "bf16", "fp32"):
            bad("precision", "'auto', 'bf16' or 'fp32'")
        if self.freeze_backbone and self.kind != "dspine":
            raise ValueError("--freeze-backbone: a DFlash drafter has nothing but a backbone to train")
        if self.max_steps is not None and self.max_steps < 1:
            bad("max_steps", ">= 1 (leave it out to train --epochs)")
        if self.max_steps is None and not self.epochs > 0:
            bad("epochs", "> 0 (or give --max-steps)")
        if self.target_layer_ids is not None and (not self.target_layer_ids or min(self.target_layer_ids) < 0):
            bad("target_layer_ids", "a non-empty list of layer indices >= 0", ",".join(map(str, self.target_layer_ids)))
        if self.mask_token_id is not None and self.mask_token_id < 0:
            bad("mask_token_id", ">= 0")
        unknown = set(self.dspine) - {f.name for f in fields(DSpineSettings)}
        if unknown:
            raise ValueError(f"train config dspine: unknown DSpine settings {sorted(unknown)}")
        for name, value in self.dspine.items():
            rule = DSPINE_RULES.get(name)
            if rule is not None and not rule[0](value):
                raise ValueError(f"{flag(name)} {value}: expected {rule[1]}")
        hold = self.dspine.get("replacement_hold_ratio", DSpineSettings.replacement_hold_ratio)
        end = self.dspine.get("replacement_end_ratio", DSpineSettings.replacement_end_ratio)
        if not hold < end:
            raise ValueError(f"--replacement-hold-ratio {hold} / --replacement-end-ratio {end}: the hold ratio "
                             "must be below the end ratio")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def recipe_settings(self) -> dict[str, Any]:
        """The DSpine settings the recipe sets, with the given flags over them."""
        return {**RECIPES[self.recipe or DEFAULT_RECIPE], **self.dspine}


def alignment_decay_of(tc: TrainConfig, recipe: str | None) -> str:
    """The alignment schedule a run uses: --alignment-decay where given, else the recipe's (the recorded one of a
    DSpine --init trained on without --recipe), else none."""
    return tc.alignment_decay or RECIPE_ALIGNMENT_DECAY.get(recipe or "", "none")


def flag(name: str) -> str:
    """The command-line flag of a TrainConfig field or DSpine setting."""
    return "--" + name.replace("_", "-")


# Bounds of the numeric settings validate() does not check on their own above (a value outside would train
# something else than asked, or fail later with a traceback).
BOUNDS = [
    ("min_lr_ratio", lambda v: 0 <= v <= 1, "in [0, 1]"),
    ("weight_decay", lambda v: v >= 0, ">= 0"),
    ("adam_beta1", lambda v: 0 <= v < 1, "in [0, 1)"),
    ("adam_beta2", lambda v: 0 <= v < 1, "in [0, 1)"),
    ("max_grad_norm", lambda v: v >= 0, ">= 0 (0: no clipping)"),
    ("init_std", lambda v: v > 0, "> 0"),
    ("gamma", lambda v: v > 0, "> 0"),
    ("objective_chunk_blocks", lambda v: v >= 0, ">= 0 (0: one chunk)"),
    ("coverage_k", lambda v: v >= 1, ">= 1"),
    ("seed", lambda v: v >= 0, ">= 0"),
    ("save_every", lambda v: v >= 0, ">= 0 (0: by --save-minutes only)"),
    ("save_minutes", lambda v: v >= 0, ">= 0 (0: off)"),
    ("keep_checkpoints", lambda v: v >= 0, ">= 0 (0: keep all)"),
]

# Target-independent bounds of the DSpine settings (the target bounds transfer_rank and top_k as well:
# drafter_setup.check_fits_target).
DSPINE_RULES = {
    "transfer_rank": (lambda v: v >= 1, ">= 1"),
    "message_size": (lambda v: v >= 1, ">= 1"),
    "top_k": (lambda v: v >= 1, ">= 1"),
    "ce_weight": (lambda v: 0 <= v <= 1, "in [0, 1]"),
    "alignment_weight": (lambda v: v >= 0, ">= 0"),
    "alignment_warmup_steps": (lambda v: v >= 0, ">= 0"),
    "replacement_layers": (lambda v: v >= 0, ">= 0"),
    "replacement_probability": (lambda v: 0 <= v <= 1, "in [0, 1]"),
    "replacement_hold_ratio": (lambda v: 0 <= v <= 1, "in [0, 1]"),
    "replacement_end_ratio": (lambda v: 0 <= v <= 1, "in [0, 1]"),
    "candidate_mass_threshold": (lambda v: 0 <= v < 1, "in [0, 1)"),
}
