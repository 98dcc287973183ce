"""Adjacent causal injection and the last-write refinement (docs/algorithm.md).

After every drafter layer l, each block position i >= 1 receives a gated message built from its
predecessor: the anchor's transfer code for position 1, the feature of position i-1's state for i >= 2.
All positions update in parallel from the states as they were before this layer's injection.
The same write, applied once more to the last layer's pre-injection state with a *known* predecessor token,
is the refinement that scores candidate transitions.

Shapes follow the blocks: states are [..., B, H] with the block on the second-to-last axis, so the plain
PyTorch drafter ([N, B, H]) and the serving layout (flat [bs*B, H] viewed as [bs, B, H]) share this code.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

# F.normalize's default epsilon; kept explicit because the Triton kernels must use the same one.
NORMALIZE_EPS = 1e-12


def rms(h: torch.Tensor) -> torch.Tensor:
    """‖h‖ / √H over the last axis (no epsilon, accumulated in float32 like the reference), as a broadcastable
    singleton. The norm reads h as it is: no float32 copy of h is made, nor kept for the backward."""
    return (torch.linalg.vector_norm(h, dim=-1, keepdim=True, dtype=torch.float32) / math.sqrt(h.shape[-1])).to(h.dtype)


class AdjacentInjection(nn.Module):
    """The DSpine injection weights. Names match the checkpoint: `injection.readouts.{l}.weight`, ..."""

    def __init__(self, hidden_size: int, transfer_rank: int, message_size: int, num_layers: int):
        super().__init__()
        self.hidden_size, self.rank, self.message_size = hidden_size, transfer_rank, message_size
        self.readouts = nn.ModuleList(nn.Linear(hidden_size, transfer_rank, bias=False) for _ in range(num_layers))
        self.writes = nn.ModuleList(nn.Linear(message_size, hidden_size, bias=False) for _ in range(num_layers))
        self.message = nn.Linear(transfer_rank, message_size, bias=False)
        self.receiver_gate = nn.Linear(transfer_rank, message_size, bias=False)
        self.predecessor_gate = nn.Linear(transfer_rank, message_size, bias=False)
        self.bias = nn.Parameter(torch.zeros(message_size))
        self.reset_zero()

    @torch.no_grad()
    def reset_zero(self) -> None:
        """The zero inits that make a fresh DSpine drafter compute exactly its DFlash backbone."""
        for w in self.writes:
            w.weight.zero_()
        self.predecessor_gate.weight.zero_()
        self.bias.zero_()

    @torch.no_grad()
    def init_readouts(self, directions: torch.Tensor) -> None:
        """R_l = Dᵀ for every layer (D: [H, r] principal directions of the head)."""
        for r in self.readouts:
            r.weight.copy_(directions.T.to(r.weight.dtype))

    @property
    def num_layers(self) -> int:
        return len(self.readouts)

    def feature(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        """φ_l(h) = √r · normalize(R_l h)."""
        z = self.readouts[layer](h)
        return (math.sqrt(self.rank) * F.normalize(z.float(), dim=-1, eps=NORMALIZE_EPS)).to(h.dtype)

    def delta(self, layer: int, h: torch.Tensor, feat: torch.Tensor, pred: torch.Tensor) -> torch.Tensor:
        """rms(h) · U_l(σ(G_r feat + G_p pred + b) ⊙ M pred): what the write adds to h. The row scalar rms(h) is
        applied to the message (width m) before U_l rather than to its output (width H), as the kernels do."""
        gate = torch.sigmoid(self.receiver_gate(feat) + self.predecessor_gate(pred) + self.bias)
        return self.writes[layer](rms(h) * (gate * self.message(pred)))

    def predecessors(self, feat: torch.Tensor, anchor_codes: torch.Tensor) -> torch.Tensor:
        """Predecessor of each block position 1..B-1: [..., B-1, r] (position 0 has none)."""
        first = math.sqrt(self.rank) * anchor_codes.to(feat.dtype).unsqueeze(-2)
        return torch.cat([first, feat[..., 1:-1, :]], dim=-2)

    def forward(self, layer: int, h: torch.Tensor, anchor_codes: torch.Tensor,
                replacement: torch.Tensor | None = None, replaced: torch.Tensor | None = None) -> torch.Tensor:
        """Inject after layer `layer`. h: [..., B, H]; anchor_codes: [..., r] (unit codes of the anchors).

        Training's predecessor replacement: `replacement` [..., B-1, r] are used as predecessors instead of
        the features, in the blocks where `replaced` (bool, h's leading shape) is true (everywhere if None).
        """
        feat = self.feature(layer, h)
        pred = self.predecessors(feat, anchor_codes)
        if replacement is not None:
            replacement = replacement.to(pred.dtype)
            pred = replacement if replaced is None else torch.where(replaced[..., None, None], replacement, pred)
        # Position 0 has no predecessor: a zero row there gives it a zero message (M and U_l have no bias),
        # so the write leaves it exactly as it was, and h is updated in one add (no slice and concatenation).
        pred = F.pad(pred, (0, 0, 1, 0))
        return h + self.delta(layer, h, feat, pred)

    def refine(self, pre_last: torch.Tensor, pred_codes: torch.Tensor) -> torch.Tensor:
        """Last-layer write with known predecessors, before the final norm.

        pre_last: [..., H] pre-injection states of the last layer; pred_codes: [..., K, r] unit codes of K
        candidate predecessors of each state. Returns [..., K, H].
        """
        layer = self.num_layers - 1
        feat = self.feature(layer, pre_last).unsqueeze(-2)
        h = pre_last.unsqueeze(-2)
        pred = math.sqrt(self.rank) * pred_codes.to(pre_last.dtype)
        return h + self.delta(layer, h, feat, pred)
