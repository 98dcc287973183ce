"""Offline speculative generation: T=0 reproduces the target's greedy tokens; T>0 keeps its distribution."""
import itertools

import pytest
import torch
from scipy.stats import chi2

from sglang_dspine.drafter.model import DSpineDrafter
from sglang_dspine.drafter.tiny import drafter_config_for, make_target
from sglang_dspine.training.generate import speculative_generate, verify

pytestmark = pytest.mark.usefixtures("no_grad")  # conftest.py



class GreedyOracle:
    """A deterministic proposer that is often right: the target's own greedy continuation, with one position
    corrupted. It drives the verifier through accepts and rejects; the drafter itself is tested elsewhere."""

    def __init__(self, target, block_size, corrupt_at=2):
        self.target, self.b, self.corrupt_at = target, block_size, corrupt_at
        self.drafts = {}  # the proposal is a function of the sequence: each is computed once

    def extend(self, hidden_states, start, count):
        pass

    def propose(self, sequence):
        key = tuple(sequence)
        if key not in self.drafts:
            seq = list(sequence)
            for _ in range(self.b - 1):
                seq.append(int(self.target(input_ids=torch.tensor([seq])).logits[0, -1].argmax()))
            draft = seq[len(sequence):]
            v = self.target.config.vocab_size
            draft[self.corrupt_at] = (draft[self.corrupt_at] + 1) % v
            self.drafts[key] = draft
        return list(self.drafts[key])


def greedy_reference(target, prompt, n):
    return target.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                           pad_token_id=0)[0, len(prompt):].tolist()


PROMPTS = [[1, 2, 3, 4, 5], [7], [9, 9, 9, 9, 9, 9, 9, 9, 30, 31], [60, 2, 44]]


@pytest.mark.parametrize("kind", ["dspine", "dflash"])
def test_greedy_equals_target_greedy(target, dspine, kind):
    drafter = dspine
    if kind == "dflash":
        torch.manual_seed(0)
        drafter = DSpineDrafter(drafter_config_for(target, kind="dflash")).eval()
    for prompt in PROMPTS:
        res = speculative_generate(target, drafter, prompt, 30)
        assert res.tokens == greedy_reference(target, prompt, 30)
        assert len(res.accept_lengths) >= 30 // drafter.cfg.block_size


def test_greedy_with_accepted_drafts_equals_target_greedy(target):
    oracle = GreedyOracle(target, block_size=4)
    for prompt in PROMPTS:
        res = speculative_generate(target, oracle, prompt, 25, block_size=4)
        assert res.tokens == greedy_reference(target, prompt, 25)
        assert res.tau > 2.5  # drafts really were accepted (positions 1 and 2 of each block are right)
        acc = res.position_acceptance()
        assert acc[0] == 1.0 and acc[1] == 1.0 and acc[2] == 0.0


def test_eos_stops_generation(target):
    prompt = PROMPTS[0]
    ref = greedy_reference(target, prompt, 20)
    eos = ref[7]
    res = speculative_generate(target, GreedyOracle(target, 4), prompt, 20, eos_token_ids={eos}, block_size=4)
    assert res.tokens == ref[: ref.index(eos) + 1]


def test_verify_greedy_rule():
    logits = torch.zeros(4, 5)
    logits[0, 2] = logits[1, 3] = logits[2, 1] = logits[3, 4] = 1
    assert verify(logits, [2, 3, 0], 0.0, None) == (2, 1)
    assert verify(logits, [2, 3, 1], 0.0, None) == (3, 4)
    assert verify(logits, [4, 3, 1], 0.0, None) == (0, 2)


def test_sampling_keeps_the_target_distribution():
    """At T=1 the first three tokens of speculative sampling follow the target's own joint distribution
    (chi-square against the exact probabilities), through both accept and reject paths."""
    vocab, temp = 6, 1.0
    target = make_target(vocab=vocab, hidden=32, layers=2, heads=2, kv_heads=1, head_dim=16, inter=64, seed=3, init_std=0.15)
    prompt = [1, 2]
    # exact joint of (x1, x2, x3) by the chain rule, in float64 (one target pass per distinct prefix)
    cond = {prefix: torch.softmax(target(input_ids=torch.tensor([prompt + list(prefix)])).logits[0, -1].double()
                                  / temp, -1)
            for i in range(3) for prefix in itertools.product(range(vocab), repeat=i)}
    exact = {}
    for seq in itertools.product(range(vocab), repeat=3):
        p = 1.0
        for i in range(3):
            p *= float(cond[seq[:i]][seq[i]])
        exact[seq] = p
    oracle = GreedyOracle(target, block_size=4, corrupt_at=1)
    g = torch.Generator().manual_seed(1234)
    counts = dict.fromkeys(exact, 0)
    accepted_total = 0
    n = 3000
    for _ in range(n):
        res = speculative_generate(target, oracle, prompt, 3, temperature=temp, generator=g, block_size=4)
        counts[tuple(res.tokens)] += 1
        accepted_total += res.accept_lengths[0] - 1
    assert sum(counts.values()) == n
    assert 0.2 * n < accepted_total < 2 * n  # both branches are exercised
    total_p = sum(exact.values())
    assert abs(total_p - 1) < 1e-6  # the chain rule covers every sequence
    cells = sorted(exact, key=exact.get, reverse=True)
    big = [c for c in cells if exact[c] / total_p * n >= 5]
    assert len(big) > 30
    obs = [counts[c] for c in big] + [n - sum(counts[c] for c in big)]
    exp = [exact[c] / total_p * n for c in big]
    exp.append(n - sum(exp))  # the pooled small cells take the remainder: expected counts sum to n by construction
    assert exp[-1] > 0
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp))
    assert chi2.sf(stat, len(obs) - 1) > 1e-3


def test_argmax_decoding_is_the_backbones_first_candidate(target, dspine):
    """The ablation proposer ("argmax") drafts the backbone's top candidate at every position; the walk
    ("walk") may leave it. Both see the same context."""
    from sglang_dspine.training.generate import DrafterProposer

    prompt = PROMPTS[0]
    out = target(input_ids=torch.tensor([prompt]), output_hidden_states=True)
    walk, argmax = DrafterProposer(dspine, target), DrafterProposer(dspine, target, decoding="argmax")
    for p in (walk, argmax):
        p.extend(out.hidden_states, 0, len(prompt))
    seq = prompt + [int(out.logits[0, -1].argmax())]
    b = dspine.cfg.block_size
    block = torch.tensor([[seq[-1]] + [dspine.cfg.mask_token_id] * (b - 1)])
    bo = dspine.forward_blocks(target.get_input_embeddings()(block).view(1, 1, b, -1),
                               (len(seq) - 1 + torch.arange(b)).view(1, 1, b), walk.ctx_kv,
                               torch.ones(1, 1, len(seq) - 1, dtype=torch.bool), torch.tensor([[seq[-1]]]))
    draft = dspine.draft(bo, target.lm_head.weight, torch.tensor([seq[-1]]))
    assert argmax.propose(seq) == draft.candidates[0, :, 0].tolist()
    assert walk.propose(seq) == draft.tokens[0].tolist()
    with pytest.raises(ValueError, match="decoding"):
        DrafterProposer(dspine, target, decoding="beam")


def test_pooled_tau_weighs_every_round_once():
    from sglang_dspine.training.generate import SpecResult

    short, long = SpecResult([0] * 8, [4, 4], 4), SpecResult([0] * 30, [1] * 30, 4)
    pooled = SpecResult.pooled([short, long], 4)
    assert pooled.accept_lengths == [4, 4] + [1] * 30
    assert pooled.tau == 38 / 32  # not (4 + 1) / 2, the mean of the two prompts' τ
    assert pooled.position_acceptance() == [2 / 32] * 3
