"""Chi-square goodness of fit for the lossless-sampling tests (a helper, not a test module; torch only, so it runs
in every test environment)."""
from __future__ import annotations

import torch


def chi2_sf(stat: float, dof: int) -> float:
    """P(X >= stat) for X ~ chi-square(dof): the regularised upper incomplete gamma Q(dof/2, stat/2)."""
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def chi_square_p(counts: dict, exact: dict, min_expected: float = 5.0) -> tuple[float, int]:
    """p-value of observed `counts` (cell -> count) against `exact` probabilities (cell -> p, summing to 1 over
    every cell that can occur). Cells expected fewer than `min_expected` times are pooled into one. Returns
    (p, number of cells tested). A count in a cell of probability 0 gives p = 0."""
    n = sum(counts.values())
    total = sum(exact.values())
    assert abs(total - 1) < 1e-9, total
    if any(c and exact.get(cell, 0.0) == 0.0 for cell, c in counts.items()):
        return 0.0, 0
    big = sorted((c for c in exact if exact[c] * n >= min_expected), key=exact.get, reverse=True)
    obs = [counts.get(c, 0) for c in big]
    exp = [exact[c] * n for c in big]
    rest_obs, rest_exp = n - sum(obs), n - sum(exp)  # the pooled small cells
    if rest_exp >= min_expected:
        obs.append(rest_obs)
        exp.append(rest_exp)
    else:  # too small to stand alone: joined to the smallest cell
        obs[-1] += rest_obs
        exp[-1] += rest_exp
    if len(obs) == 1:  # one possible outcome, and every sample had it
        return 1.0, 1
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp))
    return chi2_sf(stat, len(obs) - 1), len(obs)


def tree_walk_law(tree, p: list, v: int) -> dict:
    """The exact law of what one verify walk of a draft tree emits (its accepted path, then the next token), when
    the target's distribution at verify row r is p[r] over a vocabulary of v: a token that is a child of the current
    node moves the walk into that child, any other ends it. `tree`: a drafter.tree.DraftTree."""
    kids, exact = tree.children(), {}

    def walk(row, prefix, prob):
        child_of = {tree.tokens[c]: c for c in kids[row]}
        for x in range(v):
            if x in child_of:
                walk(child_of[x] + 1, prefix + (x,), prob * p[row][x])
            else:
                exact[prefix + (x,)] = prob * p[row][x]

    walk(0, (), 1.0)
    return exact
