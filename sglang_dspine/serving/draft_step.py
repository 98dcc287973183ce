"""DSpine's draft step inside SGLang, owned by one object.

DFlash's draft step is: backbone → final norm → target head → argmax. DSpine's is: backbone with the adjacent
injection after every layer → final norm → target head → top-K → transition scores → walk (docs/algorithm.md).
`DraftStep` holds everything that takes beyond SGLang's DFlash backbone: the injection weights, the transfer
codes, the per-token tables, top-K, the block size, the target head once the worker hands it over, and the
state of the block being drafted (its anchors and the last layer's terms). The model's forward calls `begin`
and `inject`; the worker's draft sampler calls `decode` right after it, inside the same CUDA graph, so that
state lives at fixed addresses for every captured batch size.

Two implementations of the same math, chosen once when the weights are in (whichever way they arrive: from
files or from SGLang's dummy loader) and logged: the Triton kernels of `sglang_dspine.kernels`, and the plain
PyTorch math of `injection.py`/`decoding.py` (`SGLANG_DSPINE_KERNELS=0`, or no CUDA and no Triton interpreter).
Under tensor parallelism the decoding runs on the PyTorch math across the head's vocabulary shards
(`sharding.py`): the per-token tables index the whole head.
"""
from __future__ import annotations

import logging

import torch

from ..drafter.decoding import decode_block
from ..drafter.sharding import FULL, VocabShard
from ..drafter.tree_batch import TreeBatch, lattice_trees
from ..env import ENV

logger = logging.getLogger(__name__)


class DraftStep:
    def __init__(self, model, kernels: bool):
        """model: the SGLang DSpineDraftModel, weights loaded (its injection, codes, final norm, block size)."""
        self.block_size, self.top_k = int(model.block_size), int(model.top_k)
        self.injection, self.norm, self.codes = model.injection, model.norm, model.transfer_codes
        self.num_layers = len(model.layers)
        self.kernels = kernels
        self.weights = self.tables = None
        if kernels:
            from ..kernels import InjectionWeights, TransitionTables

            self.weights = InjectionWeights.from_module(self.injection, dtype=self.codes.dtype)
            # Built now, before SGLang sizes the KV cache, so that their memory is counted.
            self.tables = TransitionTables.build(self.weights, self.codes)
        self.head: torch.Tensor | None = None
        self.shard: VocabShard = FULL
        # The block being drafted: set by the model's forward, read by `decode` right after it.
        self._anchors = self._anchor_codes = self._pre_last = self._recv = self._uh = None

    def describe(self) -> str:
        if not self.kernels:
            return "PyTorch math"
        return f"the Triton kernels (per-token tables {self.tables.nbytes / 2**20:.0f} MiB)"

    @property
    def decodes_on_kernels(self) -> bool:
        return self.kernels and self.shard.world == 1

    # ---------------------------------------------------------------------------- the model's forward
    def begin(self, anchors: torch.Tensor) -> None:
        """A new forward over whole blocks whose first tokens are `anchors` [bs]."""
        self._anchors = anchors
        if not self.kernels:
            self._anchor_codes = self.codes[anchors]

    def inject(self, state: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The injection after `layer` on the layer's full state [bs·B, H] (SGLang's deferred residual added),
        as (hidden, residual) for SGLang's next RMSNorm: their sum is the injected state (residual None: hidden
        is). The last layer's state is kept for the decoding (and never written in place)."""
        last = layer == self.num_layers - 1
        if last:
            self._pre_last = state
        if not self.kernels:
            b, h = self.block_size, state.shape[-1]
            return self.injection(layer, state.view(-1, b, h), self._anchor_codes).view_as(state), None
        from ..kernels import injection_delta

        recv = torch.empty(state.shape[0], self.weights.message_size, dtype=torch.float32, device=state.device) \
            if last else None
        delta, uh = injection_delta(state, layer, self.weights, self._anchors, self.tables.pred_proj,
                                    self.block_size, recv_out=recv)
        if last:
            self._recv, self._uh = recv, uh
            return state + delta, None  # a new tensor: a fused add-RMSNorm would overwrite `state` in place
        return delta, state

    # ----------------------------------------------------------------------------------- the decoding
    def attach_head(self, head: torch.Tensor, shard: VocabShard = FULL) -> None:
        """The target head (this rank's rows under tensor parallelism), once, outside any graph capture."""
        if self.head is not None:
            if head.data_ptr() != self.head.data_ptr():
                raise RuntimeError("DSPINE: the draft step was given two different target heads")
            return
        self.head, self.shard = head, shard
        if self.decodes_on_kernels:
            self.tables.fill_head(self.weights, head, self.norm.weight)
        elif self.kernels:
            logger.info("DSPINE candidate decoding on the PyTorch math across %d vocabulary shards (the kernels' "
                        "per-token tables index the whole head); the injection stays on the kernels", shard.world)

    def rows_after_anchor(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The states `decode` and `draft_tree` take, block positions 1..B-1 [bs·(B-1), H] with contiguous rows,
        from a draft forward's [bs·B, H]."""
        b, h = self.block_size, hidden_states.shape[-1]
        return hidden_states.reshape(-1, b, h)[:, 1:].reshape(-1, h)

    def decode(self, states: torch.Tensor) -> torch.Tensor:
        """Draft tokens [bs, B-1] from the final-normed states of block positions 1..B-1, [bs·(B-1), H] with
        contiguous rows, of the forward that just ran."""
        return self.lattice(states)[0]

    def draft_tree(self, states: torch.Tensor, budget: int) -> TreeBatch:
        """The best-first tree of `budget` nodes over each request's lattice (drafter/tree_batch.py): the
        candidates and transition table `decode` computes, each row log-softmaxed over the K candidates (the
        drafter's own scores; `tree.lattice_tree` at temperature 1). Fixed shapes: runs inside a CUDA graph."""
        return self.walk_and_tree(states, budget)[1]

    def walk_and_tree(self, states: torch.Tensor, budget: int, temperature: torch.Tensor | None = None,
                      log_mass: torch.Tensor | None = None) -> tuple[torch.Tensor, TreeBatch]:
        """(`decode`'s tokens [bs, B-1], `draft_tree`'s trees) from one pass over the lattice. With `temperature`
        and `log_mass` ([bs, B-1] each: a request's calibration per block position, docs/tree.md), position i's
        rows are log_softmax(row / temperature[:, i]) + log_mass[:, i] (`tree.table_log_scores`)."""
        tokens, candidates, scores = self.lattice(states)
        if temperature is not None:
            scores = scores.float() / temperature[:, :, None, None]
        log_scores = torch.log_softmax(scores.float(), dim=-1)
        if log_mass is not None:
            log_scores = log_scores + log_mass[:, :, None, None]
        if self.kernels:  # one kernel instead of ~8 small ones per depth; the same trees (tests/test_tree_batch.py)
            from ..kernels import lattice_trees_kernel

            return tokens, TreeBatch(*lattice_trees_kernel(candidates, log_scores, budget))
        return tokens, lattice_trees(candidates, log_scores, budget)

    def lattice(self, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(the walk's tokens [bs, P], the candidates [bs, P, K], the transition table [bs, P, K, K]) from the
        states `decode` takes."""
        if self.head is None:
            raise RuntimeError("DraftStep.lattice (decode, draft_tree) before attach_head")
        p, hidden = self.block_size - 1, states.shape[-1]
        bs = states.shape[0] // p
        if states.dtype != self.head.dtype:
            states = states.to(self.head.dtype)
        logits = torch.matmul(states, self.head.T)  # one [bs·(B-1), H] × [H, V] GEMM, as DFlash's argmax has
        pre = self._pre_last.view(bs, self.block_size, hidden)[:, 1:]
        if not self.decodes_on_kernels:
            draft = decode_block(logits.view(bs, p, -1), pre, self._anchors, self.top_k, self.refine_normed,
                                 self.codes, self.head, self.shard)
            return draft.tokens, draft.candidates, draft.scores
        from ..kernels import topk, transition_walk

        _, cand = topk(logits, self.top_k)
        m = self.weights.message_size
        cand = cand.view(bs, p, self.top_k)
        tokens, _, scores = transition_walk(
            pre, cand, self._anchors, self.weights, self.tables, self.head,
            self.norm.weight, self.norm.variance_epsilon,
            recv=self._recv.view(bs, self.block_size, m)[:, 1:], uh=self._uh.view(bs, self.block_size, m)[:, 1:])
        return tokens, cand, scores

    def refine_normed(self, pre_last: torch.Tensor, pred_codes: torch.Tensor) -> torch.Tensor:
        """norm(refine(h̃, a)): [..., H], [..., K, r] -> [..., K, H] (SGLang's RMSNorm wants 2-D input)."""
        out = self.injection.refine(pre_last, pred_codes)
        return self.norm(out.reshape(-1, out.shape[-1])).view(out.shape)


def choose(model, weights_from: str) -> DraftStep:
    """The draft step for a model whose weights just arrived (`weights_from`: 'files' or 'dummy'), logged."""
    if ENV.kernels:
        from ..kernels.runtime import runs_on

        kernels = runs_on(model.transfer_codes.device)
    else:
        kernels = False
    step = DraftStep(model, kernels)
    why = "" if kernels else (" (SGLANG_DSPINE_KERNELS=0)" if not ENV.kernels else " (no CUDA)")
    logger.info("DSPINE draft step on %s%s; drafter weights from %s", step.describe(), why, weights_from)
    return step
