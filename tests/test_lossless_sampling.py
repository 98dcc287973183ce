"""Lossless speculative sampling in the offline evaluator at T != 1, fed from cached logits.

A "target" here is a fixed table of random logits per prefix (no model: every verify call is a look-up, so the
test draws many samples in seconds). The draft proposes three tokens from the same table (sometimes the most
likely, sometimes the second: both accept and reject paths run); `verify` (sglang_dspine.training.generate)
accepts or rejects them and draws the next token. The first three emitted tokens must follow the target's own
joint distribution at temperature T, softmax(logits / T) one token at a time (chi-square). At T = 1 dividing by
the temperature is a no-op; T = 0.7 and 1.3 check that it is applied, once, everywhere it must be.
"""
import itertools

import pytest
import torch
from sampling_stats import chi_square_p

from sglang_dspine.training import generate

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: one intra-op thread (conftest.py)

VOCAB, DEPTH, BLOCK = 5, 3, 4  # tokens 0..4, the first 3 emitted tokens, blocks of 1 anchor + 3 drafts


class CachedTarget:
    """Random logits per prefix, drawn once (seeded by the prefix) and kept."""

    def __init__(self, seed: int):
        self.seed, self.rows, self.blocks = seed, {}, {}

    def logits(self, prefix: tuple) -> torch.Tensor:
        if prefix not in self.rows:
            code = sum((t + 1) * (VOCAB + 1) ** i for i, t in enumerate(prefix))
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + code)
            self.rows[prefix] = torch.randn(VOCAB, generator=g)
        return self.rows[prefix]

    def draft(self, prefix: tuple) -> list[int]:
        """Three draft tokens: at draft position i the target's (i % 2 + 1)-th most likely next token."""
        out = []
        for i in range(BLOCK - 1):
            out.append(int(self.logits(prefix + tuple(out)).argsort(descending=True)[i % 2]))
        return out

    def block(self, prefix: tuple) -> tuple[list[int], torch.Tensor]:
        """The draft after `prefix` and the target's logits at each of its positions (what one verify round
        reads), built once per prefix: the samples revisit the same few prefixes thousands of times."""
        if prefix not in self.blocks:
            draft = self.draft(prefix)
            self.blocks[prefix] = draft, torch.stack([self.logits(prefix + tuple(draft[:i])) for i in range(BLOCK)])
        return self.blocks[prefix]


def sample_tokens(target: CachedTarget, temperature: float, g: torch.Generator) -> tuple[tuple, list[int]]:
    """The first DEPTH tokens of speculative sampling from an empty prefix; and each verify round's number of
    accepted drafts."""
    seq, accepted = (), []
    while len(seq) < DEPTH:
        draft, rows = target.block(seq)
        n, nxt = generate.verify(rows, draft, temperature, g)
        assert 0 <= n <= len(draft) and 0 <= nxt < VOCAB
        seq += tuple(draft[:n]) + (int(nxt),)
        accepted.append(n)
    return seq[:DEPTH], accepted


def exact_joint(target: CachedTarget, temperature: float) -> dict:
    """P(x1, x2, x3) = prod_i softmax(logits(x_<i) / T)[x_i], in float64."""
    joint = {}
    for seq in itertools.product(range(VOCAB), repeat=DEPTH):
        p = 1.0
        for i in range(DEPTH):
            p *= float(torch.softmax(target.logits(seq[:i]).double() / temperature, -1)[seq[i]])
        joint[seq] = p
    return joint


@pytest.mark.parametrize("temperature", [0.7, 1.3])
def test_offline_speculative_sampling_keeps_the_target_distribution(temperature):
    target = CachedTarget(seed=int(temperature * 10))
    g = torch.Generator().manual_seed(7)
    n = 10000
    counts, rounds = {}, []
    for _ in range(n):
        seq, accepted = sample_tokens(target, temperature, g)
        counts[seq] = counts.get(seq, 0) + 1
        rounds += accepted
    rounds = torch.tensor(rounds)
    assert (rounds == 0).float().mean() > 0.1 and (rounds > 0).float().mean() > 0.1  # accept and reject paths
    exact = exact_joint(target, temperature)
    p, cells = chi_square_p(counts, exact)
    assert cells > 50  # most of the 125 sequences are tested
    assert p > 1e-3, (p, cells)
