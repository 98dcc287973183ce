"""The drafter training objective (docs/algorithm.md, "Training objective"), as one module DDP can wrap.

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
  micro-batches, all ranks); `LossAssembly` is the one place that weighs and adds the terms. The teacher of
  position i is the target's distribution at position a+i-1.
  Early in training the predecessors of the first `replacement_layers` layers are, per block with a
  probability that holds then decays to 0, the true tokens' codes.

Every term can be switched off; the DFlash objective is the backbone term alone on a bidirectional drafter.
Schedules and defaults follow SpecForge's reference (`OnlineDSpineModel`, `DSpineConfig.schedule`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..drafter.model import DSpineDrafter
from ..env import ENV
from ..profiling import region
from .blocks import Blocks
from .teacher import TargetTeacher

# The objective's terms, each Σ over supervised positions of the position weight times the position's value;
# LossAssembly weighs them.
TERM_NAMES = ("ce", "l1", "refinement_ce", "refinement_l1", "alignment")
L1_TERMS = ("l1", "refinement_l1")


@dataclass
class ObjectiveSwitches:
    backbone: bool = True
    refinement: bool = True
    alignment: bool = True
    replacement: bool = True


@dataclass(frozen=True)
class LossAssembly:
    """The loss of an optimizer step, assembled here and nowhere else:

        numerator = Σ_t weights[t] · term_t      (the alignment's weight also times the step CE)
        loss      = numerator / Σ position weights   (both over all micro-batches and ranks)

    weights: ce ce_weight and l1 1-ce_weight (the backbone), refinement_ce ce_weight and refinement_l1
    1-ce_weight, alignment β; a term whose switch is off has none. The step CE is the step's mean CE (Σ ce /
    Σ position weights, no gradient)."""
    ce_weight: float
    switches: ObjectiveSwitches
    is_dspine: bool
    beta: float = 0.0

    @property
    def weights(self) -> dict[str, float]:
        cw, sw = self.ce_weight, self.switches
        w: dict[str, float] = {}
        if sw.backbone:
            w.update(ce=cw, l1=1 - cw)
        if self.is_dspine and sw.refinement:
            w.update(refinement_ce=cw, refinement_l1=1 - cw)
        if self.is_dspine and sw.alignment:
            w["alignment"] = self.beta
        return w

    @property
    def computed(self) -> frozenset[str]:
        """The terms the objective computes: the CE always (metrics, the step CE) and every switched-on term,
        but an L1 half only where it weighs (the L1 halves need the teacher's logits)."""
        return frozenset({"ce"} | {t for t, w in self.weights.items() if w or t not in L1_TERMS})

    @property
    def needs_step_ce(self) -> bool:
        return bool(self.weights.get("alignment"))

    def step_ce(self, ce_terms: list[torch.Tensor], denominator: torch.Tensor, reduce=None) -> torch.Tensor:
        """The step CE from the micro-batches' ce terms, added in micro-batch order (as one sum over the step
        adds them); reduce: the sum over ranks (in place)."""
        total = ce_terms[0].detach().float()
        for c in ce_terms[1:]:
            total = total + c.detach().float()
        total = total.clone()  # may still be ce_terms[0] itself, which an in-place reduce would change
        if reduce is not None:
            total = reduce(total)
        return total / denominator.clamp_min(1.0)

    def numerator(self, terms: dict[str, torch.Tensor], step_ce: torch.Tensor | float | None = None
                  ) -> torch.Tensor:
        """The loss numerator of one micro-batch's terms (add the micro-batches', divide by the step's weight
        sum). step_ce: needed when `needs_step_ce`."""
        num = terms["ce"] * 0.0
        for name, w in self.weights.items():
            if not w:  # a weightless term may not have been computed (L1 halves)
                continue
            if name == "alignment":
                if step_ce is None:
                    raise ValueError("the alignment term weighs beta times the step CE: give step_ce")
                w = w * step_ce
            num = num + w * terms[name]
        return num

    def logged(self, summed: dict[str, torch.Tensor]) -> dict[str, float]:
        """What metrics.jsonl logs of a log interval's summed terms, each per unit of position weight (over the
        summed `denominator`): the loss (the summed numerators, `loss_num`), ce, l1, refinement (its two halves
        mixed as the loss mixes them) and alignment, those computed."""
        d = summed["denominator"].clamp_min(1e-9)
        out = {k: summed[k] for k in ("loss_num", "ce", "l1") if k in summed}
        if "refinement_ce" in summed:
            ref = self.ce_weight * summed["refinement_ce"]
            if "refinement_l1" in summed and self.ce_weight < 1:
                ref = ref + (1 - self.ce_weight) * summed["refinement_l1"]
            out["refinement"] = ref
        if "alignment" in summed:
            out["alignment"] = summed["alignment"]
        return {"loss" if k == "loss_num" else k: float(v / d) for k, v in out.items()}


class DrafterObjective(nn.Module):
    """The drafter plus the objective, as one module (what DDP wraps). The target's embedding and head are
    held outside the module's parameters (frozen, never synchronised)."""

    def __init__(self, drafter: DSpineDrafter, teacher: TargetTeacher, switches: ObjectiveSwitches,
                 dflash_ce_weight: float = 1.0, coverage_k: int = 16, chunk_blocks: int = 128,
                 vocab_kernel: bool | None = None):
        super().__init__()
        self.drafter = drafter
        self._teacher = [teacher]  # a list keeps it out of the module tree
        self.switches = switches
        self.dflash_ce_weight = dflash_ce_weight
        self.coverage_k = coverage_k
        self.chunk_blocks = chunk_blocks
        self.vocab_kernel = vocab_kernel  # None: by device (`vocab_on_kernel`)

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

    def assembly(self, beta: float = 0.0) -> LossAssembly:
        """The loss assembly of this objective's weights and switches, at alignment weight β."""
        return LossAssembly(self.ce_weight, self.switches, self.is_dspine, beta)

    def computed_terms(self, ce_only: bool) -> frozenset[str]:
        return frozenset({"ce"}) if ce_only else self.assembly().computed

    def replacement_override(self, blocks: Blocks, dtype) -> list[torch.Tensor | None] | None:
        if blocks.replace is None or not self.is_dspine or not bool(blocks.replace.any()):
            return None
        s = self.drafter.cfg.dspine
        codes = math.sqrt(s.transfer_rank) * self.drafter.transfer_codes[blocks.labels[..., :-1]].to(dtype)
        return [codes if l < s.replacement_layers else None for l in range(self.drafter.cfg.num_hidden_layers)]

    def forward(self, features: torch.Tensor, last_hidden: torch.Tensor, blocks: Blocks,
                ce_only: bool = False) -> dict[str, torch.Tensor]:
        """The terms (TERM_NAMES, the computed ones) and metric counts of one micro-batch."""
        d = self.drafter
        want = self.computed_terms(ce_only)
        n, s = features.shape[:2]
        pos = torch.arange(s, device=features.device).expand(n, s)
        with region("obj.context_kv"):
            ctx_kv = d.context_kv(features, pos)
        with region("obj.embed"):
            embeds = self.teacher.embed(blocks.block_ids).to(torch.float32)
            # the CE prepass sees the same replacement as the graded pass: it must compute the same CE
            override = self.replacement_override(blocks, embeds.dtype)
        anchor_tokens = blocks.labels[..., 0]
        with region("obj.drafter"):
            out = d.forward_blocks(embeds, blocks.positions, ctx_kv, blocks.ctx_visible, anchor_tokens,
                                   predecessor_override=override,
                                   override_blocks=blocks.replace if override else None)
        b = d.cfg.block_size
        m = n * blocks.anchors.shape[1]
        flat = lambda t: t[..., 1:, :].reshape(m, b - 1, t.shape[-1])  # noqa: E731
        hidden = flat(out.hidden)
        labels = blocks.labels[..., 1:].reshape(m, b - 1)
        prev = blocks.labels[..., :-1].reshape(m, b - 1)
        weights = blocks.weights.reshape(m, b - 1)
        sup = blocks.supervised.reshape(m, b - 1)
        # each position's teacher: its row among the micro-batch's n·s target positions
        tidx = blocks.teacher_index.reshape(n, -1)
        t_pos = (tidx + s * torch.arange(n, device=tidx.device).unsqueeze(-1)).reshape(m, b - 1)
        extras = [flat(out.pre_last)] if "refinement_ce" in want else []
        states = [flat(x) for x in out.layer_states] if "alignment" in want else []
        # blocks without supervision cost nothing: drop them before the vocabulary-sized work
        with region("obj.select"):
            live = sup[:, 0].nonzero().squeeze(-1)
            args = select_rows([hidden, labels, prev, weights, sup, t_pos] + extras, live)
            states = select_rows(states, live) if states else []
        t_logits = None
        if want & set(L1_TERMS) and len(live):  # only the L1 halves read the teacher
            # The teacher's logits once per distinct position (overlapping blocks share them: 512 anchors × 15
            # positions in 2048 tokens read each ~4 times) and outside the checkpoint (no gradient: nothing
            # to recompute); args[5] becomes each position's row in them.
            with region("obj.teacher_logits"):
                t_logits, args[5] = teacher_logits(last_hidden.reshape(n * s, -1), args[5], self.teacher.head)
        total: dict[str, torch.Tensor] = {}
        step = self.chunk_blocks if self.chunk_blocks and self.chunk_blocks > 0 else max(len(live), 1)
        recompute = torch.is_grad_enabled() and bool(self.chunk_blocks) and len(live) > step
        if extras and len(live):
            # The refined states read no vocabulary-sized tensor either: once over every live block (as the
            # alignment below), the chunks get them in place of the pre-injection states.
            args[6] = _maybe_checkpoint(recompute, self._refined, args[6], args[2])
        for start in range(0, len(live), step):
            part = [a[start:start + step] for a in args]
            fn = lambda *xs: self._terms(*xs, want=want, ce_only=ce_only, t_logits=t_logits)  # noqa: E731
            res = _maybe_checkpoint(recompute, fn, *part)
            for k, v in res.items():
                total[k] = total[k] + v if k in total else v
        if states and len(live):
            # Not per chunk: it reads no vocabulary-sized tensor, and per chunk its few dozen small kernels
            # left the GPU idle waiting for launches (35f24d8 on the H200: 215 ms of idle per step for 36 ms of
            # work). One checkpoint over every live block keeps the memory of the chunked form.
            total["alignment"] = _maybe_checkpoint(recompute, self._alignment, args[1], args[3], *states)
        if not total:  # no supervised block at all (the data loader never lets this happen)
            zero = hidden.sum() * 0.0
            zeros = torch.zeros(b - 1, device=hidden.device)
            total = {**{k: zero for k in TERM_NAMES}, "correct_pos": zeros, "count_pos": zeros.clone(),
                     "lead_correct": zero.detach(), "full_blocks": zero.detach(), "coverage": zero.detach()}
        total["denominator"] = blocks.denominator
        return total

    def vocab_on_kernel(self, device: torch.device) -> bool:
        """Whether the vocabulary-sized terms run on the Triton kernel: on CUDA unless SGLANG_DSPINE_KERNELS=0,
        the PyTorch math elsewhere (`vocab_kernel` forces either; the tests run the kernel interpreted)."""
        if self.vocab_kernel is not None:
            return self.vocab_kernel
        return ENV.kernels and device.type == "cuda"

    def vocab_path(self, device: torch.device) -> str:
        """Which path the vocabulary-sized terms take on device, in words (the trainer logs it)."""
        if self.vocab_on_kernel(device):
            return "the Triton kernel (sglang_dspine.kernels.vocab_objective)"
        if self.vocab_kernel is False:
            why = "asked for"
        else:
            why = "SGLANG_DSPINE_KERNELS=0" if not ENV.kernels else f"no CUDA: {device}"
        return f"the PyTorch math ({why})"

    def _terms(self, hidden, labels, prev, weights, sup, t_rows, *extras, want: frozenset[str],
               ce_only: bool = False, t_logits: torch.Tensor | None = None):
        """The terms in `want` of one chunk, unweighted but for the position weights; t_logits: the teacher's
        logits of the distinct positions, t_rows: each position's row in them (None when no term needs the
        teacher); extras: DSpine's refined states (`_refined`)."""
        head = self.teacher.head
        want_l1 = "l1" in want
        k = None if ce_only else (self.drafter.cfg.dspine.top_k if self.is_dspine else self.coverage_k)
        with region("obj.vocab"):
            v = vocab_terms(hidden, head, labels, k, want_l1, kernel=self.vocab_on_kernel(hidden.device),
                            t_logits=t_logits, t_rows=t_rows if t_logits is not None else None)
            res = {"ce": (v.ce * weights).sum()}
        with torch.no_grad(), region("obj.metrics"):
            correct = (v.argmax == labels) & sup
            res["correct_pos"] = correct.sum(0).float()
            res["count_pos"] = sup.sum(0).float()
            full = sup.all(-1)
            lead = correct.long().cumprod(-1).sum(-1)
            res["lead_correct"] = (lead * full).sum().float()
            res["full_blocks"] = full.sum().float()
        if ce_only:
            return res
        if want_l1:
            res["l1"] = (v.l1 * weights).sum()
        cand = v.cand
        covered = cand == labels.unsqueeze(-1)
        with torch.no_grad():
            res["coverage"] = (covered.any(-1) & sup).sum().float()
        if "refinement_ce" in want:
            with region("obj.refinement"):
                d = self.drafter
                refined = extras[0]  # _refined's, by forward
                rows = F.embedding(cand, head)  # [M, P, K, H]
                if not torch.is_autocast_enabled():
                    refined = refined.to(rows.dtype)
                scores = torch.matmul(rows, refined.unsqueeze(-1)).squeeze(-1).float()
                q = scores.log_softmax(-1)
                rce = -(q * covered).sum(-1)
                res["refinement_ce"] = (rce * weights).sum()
                if "refinement_l1" in want:
                    t_cand = v.teacher_cand
                    mass = t_cand.sum(-1)
                    t_cand = t_cand / mass.unsqueeze(-1).clamp_min(1e-30)
                    rl1 = (q.exp() - t_cand).abs().sum(-1) * (mass > d.cfg.dspine.candidate_mass_threshold)
                    res["refinement_l1"] = (rl1 * weights).sum()
        return res

    def _refined(self, pre_last: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """The last layer's state with each position's true predecessor written in, normed: [M, P, H]."""
        with region("obj.refinement"):
            d = self.drafter
            return d.refine_normed(pre_last, d.transfer_codes[prev].unsqueeze(-2)).squeeze(-2)

    def _alignment(self, labels: torch.Tensor, weights: torch.Tensor, *states: torch.Tensor) -> torch.Tensor:
        """Σ_i w_i Σ_l (1 - cos(φ_l(h_i^l), C[y_i])) over the given positions; states: per layer, after its
        injection."""
        with region("obj.alignment"):
            d = self.drafter
            target_codes = d.transfer_codes[labels].float()
            align = 0.0
            for l, state in enumerate(states):
                feat = d.injection.feature(l, state).float()
                align = align + (1 - F.cosine_similarity(feat, target_codes, dim=-1))
            return (align * weights).sum()


@dataclass
class VocabTerms:
    """Per position [..., P]: ce, l1 (None unless asked), argmax; cand [..., P, K] (the top-K of the drafter's
    logits, None without K) and teacher_cand (the teacher's probabilities of cand, None without a teacher)."""
    ce: torch.Tensor
    l1: torch.Tensor | None
    argmax: torch.Tensor
    cand: torch.Tensor | None
    teacher_cand: torch.Tensor | None


def vocab_terms(hidden: torch.Tensor, head: torch.Tensor, labels: torch.Tensor, k: int | None, l1: bool,
                kernel: bool, t_logits: torch.Tensor | None = None, t_rows: torch.Tensor | None = None) -> VocabTerms:
    """The vocabulary-sized work of the objective on hidden [..., H]: the drafter's logits z = hidden @ headᵀ
    stay in the GEMM's dtype, and so do the teacher's (t_logits [R, V], position p's teacher is row t_rows[p]);
    CE, argmax, L1 = Σ|softmax(z) - softmax(y)| and the teacher's log-normaliser come per row from `vocab_loss`
    (kernel: the Triton kernel, else the same math in PyTorch), and the teacher's probabilities are read at the
    K candidates only, exp(y - lse_y)."""
    from ..kernels.vocab_objective import vocab_loss

    z = _head_logits(hidden, head)
    rows, vsize = z.shape[:-1], z.shape[-1]
    z2 = z.reshape(-1, vsize)
    y_index = t_rows.reshape(-1) if t_logits is not None else None
    ce, l1v, lse_y, amax = vocab_loss(z2, labels.reshape(-1), t_logits, y_index, l1=l1, kernel=kernel)
    cand = t_cand = None
    if k is not None:
        kk = min(k, vsize)
        with torch.no_grad():
            if kernel:
                from ..kernels.top_k import topk
                cand = topk(z2.detach(), kk)[1]
            else:
                cand = z2.detach().topk(kk, dim=-1).indices
            if t_logits is not None:
                t_cand = (t_logits[y_index.unsqueeze(-1), cand].float() - lse_y.unsqueeze(-1)).exp().view(*rows, kk)
        cand = cand.view(*rows, kk)
    return VocabTerms(ce.view(rows), l1v.view(rows) if l1v is not None else None, amax.view(rows), cand, t_cand)


def _maybe_checkpoint(recompute: bool, fn, *xs):
    """fn(*xs); with `recompute`, under a checkpoint (its activations recomputed in the backward)."""
    return checkpoint(fn, *xs, use_reentrant=False) if recompute else fn(*xs)


def select_rows(tensors: list[torch.Tensor], rows: torch.Tensor) -> list[torch.Tensor]:
    """tensors[rows] along the first axis; when rows are all of them (every block live, the usual case) the
    tensors themselves: the selection would copy each and its backward scatter each gradient back."""
    if len(rows) == len(tensors[0]):  # rows come sorted (nonzero): all of them is 0..n-1
        return list(tensors)
    return [t.index_select(0, rows) for t in tensors]


def teacher_logits(positions_hidden: torch.Tensor, t_pos: torch.Tensor, head: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(the teacher's logits [R, V] of the R distinct positions in t_pos, each entry of t_pos's row in them):
    positions_hidden [P, H] are the target's last hidden states, t_pos indexes them."""
    uniq, rows = torch.unique(t_pos, return_inverse=True)
    with torch.no_grad():
        return _head_logits(positions_hidden.index_select(0, uniq), head), rows


def _head_logits(x: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
    """x @ headᵀ; under autocast the cast is autocast's, else x takes the head's dtype (never a copy of the head)."""
    return F.linear(x if torch.is_autocast_enabled() else x.to(head.dtype), head)
