"""Triton kernels of the DSpine draft step and of the training objective, installed as `sglang_dspine.kernels`
(never import `kernels`).

Each kernel has a plain PyTorch reference with the same signature next to it (`*_torch`).
  injection.py        fused adjacent injection on flat [bs·B, H] states (gate_message, injection_delta)
  transition.py       transition scoring + walk from per-token tables (TransitionTables, transition_walk)
  top_k.py            top-K of the draft logits in one streaming pass (topk)
  tree_build.py       every request's draft tree in one kernel (lattice_trees_kernel; reference: drafter/tree_batch.py)
  tree_commit.py      a tree step's accepted path to the front (commit_path_kernel; reference: serving/tree_verify.py)
  verify_attention.py the target's chain verify attention, grouped by KV head (grouped_verify_attention; reference:
                      grouped_verify_attention_torch; served through serving/sglang_patches.py's patch 10)
  vocab_objective.py  the training objective's per-row CE, argmax, L1 to the teacher and their gradient (vocab_loss)
  runtime.py          where the kernels run: CUDA, or the CPU under Triton's interpreter (runs_on)
"""
from .injection import InjectionWeights, gate_message, gate_message_torch, injection_delta
from .top_k import topk, topk_torch
from .transition import TransitionTables, transition_scores_walk, transition_scores_walk_torch, transition_walk
from .tree_build import lattice_trees_kernel
from .tree_commit import commit_path_kernel
from .vocab_objective import vocab_loss, vocab_loss_torch

__all__ = [
    "InjectionWeights", "gate_message", "gate_message_torch", "injection_delta",
    "topk", "topk_torch",
    "lattice_trees_kernel", "commit_path_kernel",
    "TransitionTables", "transition_scores_walk", "transition_scores_walk_torch", "transition_walk",
    "vocab_loss", "vocab_loss_torch",
]
