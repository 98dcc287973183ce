"""Training schedules: the position weights of a block, the alignment warm-up β, the predecessor replacement
probability and the learning rate (SpecForge's reference schedules, `DSpineConfig.schedule`)."""
from __future__ import annotations

import math

import torch

from ..drafter.config import DSpineSettings


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


def alignment_beta(step: int, s: DSpineSettings, total_steps: int | None = None, decay: str = "none") -> float:
    """β = alignment_weight · min(step / alignment_warmup_steps, 1), times ½(1 + cos(π · step / total_steps))
    with decay "cosine" (the alignment fades out as the learning rate does)."""
    warm = 1.0 if s.alignment_warmup_steps <= 0 else min(step / s.alignment_warmup_steps, 1.0)
    fade = 1.0
    if decay == "cosine":
        if not total_steps or total_steps <= 0:
            raise ValueError("alignment decay 'cosine' needs the run's total steps")
        fade = 0.5 * (1.0 + math.cos(math.pi * min(step / total_steps, 1.0)))
    elif decay != "none":
        raise ValueError(f"alignment decay {decay!r}: expected 'none' or 'cosine'")
    return float(s.alignment_weight) * warm * fade


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
