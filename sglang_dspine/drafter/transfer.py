"""Transfer space: fixed token codes computed once from the target's LM head (docs/algorithm.md).

Rows of the head W (V×H) are normalised to unit length, centred on their mean, and projected on the top
`rank` principal directions, each whitened by the square root of its eigenvalue; the code of a token is
that projection normalised to unit length. Codes stand for known tokens; the drafter's features stand for
predicted ones, in the same space.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import DrafterConfigError


@dataclass
class TransferSpace:
    codes: torch.Tensor  # [V, r] float32, unit rows
    directions: torch.Tensor  # [H, r] float32, principal directions D (columns), ascending eigenvalue (as eigh)
    eigenvalues: torch.Tensor  # [r] float32, ascending


def _unit_rows(w: torch.Tensor) -> torch.Tensor:
    w = w.to(torch.float64)
    norms = w.norm(dim=1, keepdim=True)
    if bool((norms == 0).any()):
        raise DrafterConfigError("lm_head: a row of the target head is all zeros; its token has no direction")
    return w / norms


def compute_transfer_space(
    lm_head: torch.Tensor, rank: int, chunk_rows: int = 16384, min_relative_eigenvalue: float = 1e-9
) -> TransferSpace:
    """Codes from the head `lm_head` [V, H]. Chunked over rows, deterministic, float32 result.

    Matches the reference (SpecForge `initialize_transfer_space`): the top `rank` eigenpairs of the scatter
    matrix kept in eigh's ascending order. Two deliberate differences, neither changing what a code means:
    statistics accumulate in float64 (a 151k-row scatter in float32 loses digits the small eigenvalues
    need), and each direction's sign is fixed (largest-magnitude entry positive) so the result does not
    depend on the solver's arbitrary sign choice. A direction counts as present when its eigenvalue exceeds
    `min_relative_eigenvalue` times the largest one (exact zeros come out as round-off).

    Computed on the head's device (a 151k-row head stays where it is); the result lives there too.
    """
    lm_head = lm_head.detach()
    if lm_head.dim() != 2:
        raise DrafterConfigError(f"lm_head: expected a 2-D [vocab, hidden] matrix, found shape {tuple(lm_head.shape)}")
    vocab, hidden = lm_head.shape
    if not 1 <= rank <= hidden:
        raise DrafterConfigError(f"transfer_rank: expected in [1, {hidden}] (hidden size), found {rank}")
    if not bool(torch.isfinite(lm_head).all()):
        raise DrafterConfigError("lm_head: the target head has non-finite entries")

    # Pass 1: mean of unit rows. Pass 2: covariance of the centred unit rows. Both in float64 chunks so a
    # 151k×4096 head never needs a float64 copy of itself.
    dev = lm_head.device
    total = torch.zeros(hidden, dtype=torch.float64, device=dev)
    for s in range(0, vocab, chunk_rows):
        total += _unit_rows(lm_head[s : s + chunk_rows]).sum(0)
    mean = total / vocab
    cov = torch.zeros(hidden, hidden, dtype=torch.float64, device=dev)
    for s in range(0, vocab, chunk_rows):
        x = _unit_rows(lm_head[s : s + chunk_rows]) - mean
        cov += x.T @ x
    cov /= vocab

    evals, evecs = torch.linalg.eigh(cov)  # ascending
    floor = min_relative_eigenvalue * float(evals[-1].clamp_min(0))
    positive = int((evals > floor).sum()) if floor > 0 else 0
    if positive < rank:
        raise DrafterConfigError(
            f"transfer_rank: the head has only {positive} principal directions with positive eigenvalue, "
            f"expected at least {rank} (the rank); lower transfer_rank"
        )
    evals, evecs = evals[-rank:], evecs[:, -rank:]
    pivot = evecs.abs().argmax(0)
    signs = torch.sign(evecs[pivot, torch.arange(rank, device=dev)])
    evecs = evecs * signs

    codes = torch.empty(vocab, rank, dtype=torch.float32, device=dev)
    whiten = evecs / evals.sqrt()
    for s in range(0, vocab, chunk_rows):
        z = (_unit_rows(lm_head[s : s + chunk_rows]) - mean) @ whiten
        codes[s : s + chunk_rows] = torch.nn.functional.normalize(z, dim=1).to(torch.float32)
    return TransferSpace(codes=codes, directions=evecs.to(torch.float32), eigenvalues=evals.to(torch.float32))


def check_codes(codes: torch.Tensor | None, vocab_size: int, rank: int, name: str = "transfer_codes") -> None:
    """Refuse codes that are missing, mis-shaped, all zero or non-finite."""
    if codes is None:
        raise DrafterConfigError(
            f"checkpoint: `{name}` missing; a DSpine drafter needs its transfer codes "
            "(in the model file or in transfer.safetensors as `codes`)"
        )
    if tuple(codes.shape) != (vocab_size, rank):
        raise DrafterConfigError(
            f"checkpoint `{name}`: expected shape ({vocab_size}, {rank}) (vocab_size, transfer_rank), "
            f"found {tuple(codes.shape)}"
        )
    if not bool(torch.isfinite(codes).all()):
        raise DrafterConfigError(f"checkpoint `{name}`: expected finite values, found NaN or inf")
    if not bool((codes != 0).any()):
        raise DrafterConfigError(f"checkpoint `{name}`: all zeros; the transfer space was never computed")
