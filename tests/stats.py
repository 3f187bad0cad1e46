"""Goodness-of-fit helper shared by the sampling, engine and runtime distribution tests."""
from __future__ import annotations

import numpy as np
from scipy import stats

MIN_EXPECTED = 5.0   # the usual validity rule for the chi-square approximation


def chi_square_pvalue(observed_counts, expected_probs) -> float:
    """p-value of a chi-square goodness-of-fit test of counts against a distribution.

    observed_counts: counts per category (any array-like, any shape; flattened); expected_probs: the
    probabilities of the same categories (normalised here). A category with zero probability that was
    observed gives p = 0. Categories with an expected count below MIN_EXPECTED are pooled, smallest first,
    until every bin reaches it."""
    obs = np.asarray(observed_counts, dtype=np.float64).ravel()
    probs = np.asarray(expected_probs, dtype=np.float64).ravel()
    assert obs.shape == probs.shape, (obs.shape, probs.shape)
    assert (probs >= 0).all() and probs.sum() > 0
    n = obs.sum()
    assert n > 0
    expected = probs / probs.sum() * n
    impossible = expected == 0
    if obs[impossible].sum() > 0:
        return 0.0
    obs, expected = obs[~impossible], expected[~impossible]

    order = np.argsort(expected)
    obs, expected = obs[order], expected[order]
    cut = int((expected < MIN_EXPECTED).sum())     # the small bins come first; pool them ...
    while 0 < cut < len(expected) and expected[:cut].sum() < MIN_EXPECTED:
        cut += 1                                       # ... with larger ones until the pool is big enough
    if cut > 1:
        obs = np.concatenate([[obs[:cut].sum()], obs[cut:]])
        expected = np.concatenate([[expected[:cut].sum()], expected[cut:]])
    if len(expected) < 2:
        return 1.0            # one category: nothing to test
    return float(stats.chisquare(obs, expected).pvalue)


def assert_first_three_tokens_follow_target(outs, model, prompt, params) -> None:
    """The first three tokens of `outs` (requests of `prompt` sampled with `params`) follow the target model's
    exact distribution: nothing outside its support, and a chi-square fit."""
    from test_engine import _exact_three_token_distribution

    counts = {}
    for o in outs:
        counts[tuple(o.token_ids)] = counts.get(tuple(o.token_ids), 0) + 1
    exact = _exact_three_token_distribution(model, prompt, params)
    assert set(counts) <= set(exact)
    keys = sorted(exact)
    assert chi_square_pvalue([counts.get(k, 0) for k in keys], [exact[k] for k in keys]) > 1e-3
