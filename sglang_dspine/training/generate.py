"""Offline speculative generation: a transformers target (Qwen3) verifies the drafter's blocks.

This is the offline evaluator of training and the lab, and runs on CPU. Each round drafts one block
[anchor, mask × (B-1)] from the context the target has verified, verifies it in one target pass, and keeps
the longest accepted prefix plus one token from the target. Greedy (T=0) accepts exact matches; at T>0 the
draft is deterministic, so target-only rejection sampling (accept d with probability p(d), else sample from
p with d removed) gives exactly the target's own distribution.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..drafter.decoding import BlockDraft
from ..drafter.model import DSpineDrafter
from ..drafter.tree import chain_tree, expected_accepted


@dataclass
class SpecResult:
    tokens: list[int]  # generated tokens (prompt excluded)
    accept_lengths: list[int] = field(default_factory=list)  # per round: accepted drafts + 1
    block_size: int = 0
    # per round: 1 + the expected accepted drafts given the round's context (drafter/tree.py expected_accepted)
    expected_lengths: list[float] = field(default_factory=list)

    @property
    def tau(self) -> float:
        """Mean acceptance length: tokens produced per verify round, over every round this result holds."""
        return sum(self.accept_lengths) / max(len(self.accept_lengths), 1)

    @property
    def tau_expected(self) -> float | None:
        """τ with each round's accepted count replaced by its expectation given the round's context (the same
        mean; at T > 0 without the acceptance draws' noise; at T = 0 equal to `tau`). None: not recorded."""
        if len(self.expected_lengths) != len(self.accept_lengths) or not self.expected_lengths:
            return None
        return sum(self.expected_lengths) / len(self.expected_lengths)

    @classmethod
    def pooled(cls, results: list[SpecResult], block_size: int) -> SpecResult:
        """Every round of several generations as one result. Its `tau` is THE τ of a set of prompts used
        everywhere in this package: tokens produced ÷ verify rounds over all of them (token-weighted), what
        SGLang's servers report (output tokens ÷ verify steps). The mean of per-prompt τ is not used: it weighs
        a prompt that ended after 3 rounds like one that ran 300, and can rank two drafters the other way."""
        return cls([], [a for r in results for a in r.accept_lengths], block_size,
                   [e for r in results for e in r.expected_lengths])

    def emit(self, tokens: list[int], eos: set[int], max_new_tokens: int) -> None:
        """A round's output (the accepted drafts, then the target's own token), up to an end token or the limit."""
        for t in tokens:
            self.tokens.append(t)
            if t in eos or len(self.tokens) >= max_new_tokens:
                break

    def position_acceptance(self) -> list[float]:
        """Fraction of rounds whose draft was accepted at least up to block position i (i = 1..B-1)."""
        n = max(len(self.accept_lengths), 1)
        return [sum(a - 1 >= i for a in self.accept_lengths) / n for i in range(1, self.block_size)]


def target_parts(target) -> tuple[torch.nn.Module, torch.Tensor]:
    """(embedding module, LM head weight [V, H]) of a transformers causal LM."""
    return target.get_input_embeddings(), target.get_output_embeddings().weight


def target_features(hidden_states: tuple[torch.Tensor, ...], layer_ids: list[int]) -> torch.Tensor:
    """Concatenate the outputs of target layers `layer_ids` (hidden_states[0] is the embedding output)."""
    return torch.cat([hidden_states[i + 1] for i in layer_ids], dim=-1)


def _pick(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> int:
    if temperature == 0:
        return int(logits.argmax())
    p = torch.softmax(logits.float() / temperature, dim=-1)
    return int(torch.multinomial(p, 1, generator=generator))


def verify(
    logits: torch.Tensor, draft: list[int], temperature: float, generator: torch.Generator | None
) -> tuple[int, int]:
    """Verify `draft` (positions 1..B-1) against target logits [B, V] of [anchor, draft...].

    Returns (number of accepted draft tokens, the target's next token). The rows' argmax (T=0) or the draft
    tokens' probabilities (T>0) reach the host in one copy, not one per position.
    """
    n = len(draft)
    if temperature == 0:
        best = logits[: n + 1].argmax(-1).tolist()
        for i, d in enumerate(draft):
            if best[i] != d:
                return i, best[i]
        return n, best[n]
    p = torch.softmax(logits[: n + 1].float() / temperature, dim=-1)
    p_draft = p[torch.arange(n, device=p.device), torch.tensor(draft, device=p.device)].tolist() if n else []
    for i, d in enumerate(draft):
        u = torch.rand((), generator=generator)
        if u < p_draft[i]:
            continue
        residual = p[i].clone()
        residual[d] = 0
        return i, int(torch.multinomial(residual / residual.sum(), 1, generator=generator))
    return n, int(torch.multinomial(p[n], 1, generator=generator))


class DrafterProposer:
    """Drafts blocks with a drafter, keeping its context keys/values as the target verifies tokens."""

    def __init__(self, drafter: DSpineDrafter, target, decoding: str = "walk"):
        """decoding: "walk" (DSpine's candidate decoding; DFlash drafters always take the argmax) or "argmax"
        (the backbone's own argmax, an ablation of the transition table)."""
        if decoding not in ("walk", "argmax"):
            raise ValueError(f"decoding: expected 'walk' or 'argmax', found {decoding!r}")
        self.drafter, self.decoding = drafter, decoding
        self.embed, self.head = target_parts(target)
        self.ctx_kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    def extend(self, hidden_states: tuple[torch.Tensor, ...], start: int, count: int) -> None:
        """Add the first `count` verified tokens of a target pass (positions start..) to the context."""
        feats = target_features(hidden_states, self.drafter.cfg.target_layer_ids)[:, :count].to(self.head.dtype)
        kv = self.drafter.context_kv(feats, (start + torch.arange(count, device=feats.device))[None])
        if self.ctx_kv is None:
            self.ctx_kv = kv
        else:
            self.ctx_kv = [(torch.cat([k, nk], 1), torch.cat([v, nv], 1)) for (k, v), (nk, nv) in zip(self.ctx_kv, kv)]

    def propose(self, sequence: list[int]) -> list[int]:
        """Draft positions 1..B-1 of the block whose anchor is the last token of `sequence`."""
        cfg, device = self.drafter.cfg, self.head.device
        anchor, s = sequence[-1], len(sequence) - 1
        b = cfg.block_size
        block = torch.tensor([[anchor] + [cfg.mask_token_id] * (b - 1)], device=device)
        positions = (s + torch.arange(b, device=device)).view(1, 1, b)
        visible = torch.ones(1, 1, s, dtype=torch.bool, device=device)
        anchors = torch.tensor([[anchor]], device=device)
        out = self.drafter.forward_blocks(self.embed(block).view(1, 1, b, -1), positions, self.ctx_kv, visible, anchors)
        if self.decoding == "argmax":
            return self.drafter.block_logits(out, self.head)[0].argmax(-1).tolist()
        drafted = self.drafter.draft(out, self.head, anchors.view(1))
        return (drafted.tokens if isinstance(drafted, BlockDraft) else drafted)[0].tolist()


def prefill(target, proposer, prompt_ids: list[int], temperature: float, generator: torch.Generator | None):
    """The prompt through `target` into a fresh KV cache, its hidden states handed to the proposer, and the first
    token (the first block's anchor) drawn: (cache, anchor)."""
    from transformers import DynamicCache

    device = target.get_output_embeddings().weight.device
    cache = DynamicCache()
    out = target(input_ids=torch.tensor([prompt_ids], device=device), past_key_values=cache, use_cache=True,
                 output_hidden_states=True)
    proposer.extend(out.hidden_states, 0, len(prompt_ids))
    return cache, _pick(out.logits[0, -1], temperature, generator)


@torch.no_grad()
def speculative_generate(
    target,
    drafter: DSpineDrafter | DrafterProposer,
    prompt_ids: list[int],
    max_new_tokens: int,
    temperature: float = 0.0,
    eos_token_ids: set[int] | None = None,
    generator: torch.Generator | None = None,
    block_size: int | None = None,
) -> SpecResult:
    """Generate with block drafts verified by `target` (a transformers causal LM, batch of one).

    `drafter` is a DSpineDrafter or any object with `extend(hidden_states, start, count)` and
    `propose(sequence) -> list[int]` (block_size then says the block length).
    """

    proposer = DrafterProposer(drafter, target) if isinstance(drafter, DSpineDrafter) else drafter
    b = block_size or proposer.drafter.cfg.block_size
    device = target.get_output_embeddings().weight.device
    eos = eos_token_ids or set()

    cache, anchor = prefill(target, proposer, prompt_ids, temperature, generator)
    result = SpecResult(tokens=[anchor], block_size=b)

    while len(result.tokens) < max_new_tokens and anchor not in eos:
        s = len(prompt_ids) + len(result.tokens) - 1  # position of the anchor
        draft = proposer.propose(list(prompt_ids) + result.tokens)
        positions = (s + torch.arange(b, device=device)).view(1, b)
        out = target(input_ids=torch.tensor([[anchor] + draft], device=device), past_key_values=cache,
                     use_cache=True, output_hidden_states=True, position_ids=positions)
        accepted, nxt = verify(out.logits[0], draft, temperature, generator)
        result.accept_lengths.append(accepted + 1)
        result.expected_lengths.append(1.0 + expected_accepted(out.logits[0], chain_tree(draft), temperature))
        # Keep the target's cache and the drafter's context up to the last verified token (anchor + accepted).
        cache.crop(s + accepted + 1)
        proposer.extend(out.hidden_states, s, accepted + 1)
        result.emit(draft[:accepted] + [nxt], eos, max_new_tokens)
        anchor = result.tokens[-1]
    result.tokens = result.tokens[:max_new_tokens]
    return result


@torch.no_grad()
def evaluate(target, drafter: DSpineDrafter, prompts: list[tuple[str, list[int]]], max_new_tokens: int,
             temperature: float = 0.0, eos_token_ids: set[int] | None = None, decoding: str = "walk",
             seed: int = 0, reference=None, generate=None, progress=None) -> dict:
    """τ of a drafter over prompts [(id, prompt ids)], as `sglang-dspine eval` reports it: tokens ÷ verify
    rounds over all of them (SpecResult.pooled), acceptance per block position, and one row per prompt.
    reference: an HFGenerator at T=0, whose greedy output each prompt's is compared with (`matches_target`).
    generate(ids, generator) -> SpecResult: another way to draft and verify one prompt (tree_generate's), in
    place of the chain with `decoding`; progress: called with each prompt's result."""
    import time

    if not prompts:
        raise ValueError("evaluate: no prompts")
    device = target.get_output_embeddings().weight.device
    # the acceptance uniforms are drawn on the CPU: a CUDA generator cannot serve them, so on a GPU sampling
    # is seeded globally instead
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed) if temperature > 0 and device.type == "cpu" else None
    per, results = [], []
    t0 = time.time()
    for rid, ids in prompts:
        if generate is not None:
            res = generate(ids, gen)
        else:  # a fresh proposer per prompt: it holds that prompt's drafter context
            res = speculative_generate(target, DrafterProposer(drafter, target, decoding), ids, max_new_tokens,
                                       temperature, eos_token_ids, gen)
        if progress is not None:
            progress(res)
        row = {"id": rid, "tau": res.tau, "tau_expected": res.tau_expected, "tokens": len(res.tokens),
               "rounds": len(res.accept_lengths)}
        if reference is not None:
            row["matches_target"] = reference.generate([ids])[0].output_ids == res.tokens
        per.append(row)
        results.append(res)
    b = drafter.cfg.block_size
    overall = SpecResult.pooled(results, b)
    out: dict = {"tau": overall.tau, "tau_expected": overall.tau_expected,
           "position_acceptance": overall.position_acceptance(), "rounds": len(overall.accept_lengths),
           "tokens": sum(r["tokens"] for r in per), "prompts": len(per),
           "kind": drafter.cfg.kind, "decoding": decoding if drafter.cfg.is_dspine else "argmax", "block_size": b,
           "temperature": temperature, "seconds": time.time() - t0, "per_prompt": per}
    if reference is not None:
        out["all_match_target"] = all(r["matches_target"] for r in per)
    return out
