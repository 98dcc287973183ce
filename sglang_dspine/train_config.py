"""The trainer's settings (`sglang-dspine train`'s flags, one field each)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from .config import DSpineSettings


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
