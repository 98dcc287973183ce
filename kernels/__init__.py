"""Triton kernels of the DSpine draft step, installed as `sglang_dspine.kernels` (never import `kernels`).

Each kernel has a plain PyTorch reference with the same signature next to it (`*_torch`).
  injection.py   fused adjacent injection on flat [bs·B, H] states (gate_message, inject_flat)
  transition.py  fused K×K transition scoring + walk (transition_scores_walk, transition_walk)
  top_k.py       top-K of the draft logits in one streaming pass (topk)
"""
from .injection import InjectionWeights, anchor_projections, gate_message, gate_message_torch, inject_flat
from .top_k import topk, topk_torch
from .transition import (
    TransitionTables,
    transition_scores_walk,
    transition_scores_walk_torch,
    transition_walk,
)

__all__ = [
    "InjectionWeights", "anchor_projections", "gate_message", "gate_message_torch", "inject_flat",
    "topk", "topk_torch",
    "TransitionTables", "transition_scores_walk", "transition_scores_walk_torch", "transition_walk",
]
