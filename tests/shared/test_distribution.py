"""The sampled rules are lossless: emitted tokens follow the target distribution p.

Set-up: a tiny "language model" given by tables. For every prefix of length <= 3 over a vocabulary
of V = 5 tokens, the target p(. | prefix) comes from random logits through temperature 0.8 and
top-k 4 (so p has zeros), and the draft q(. | prefix) from other random logits truncated to its 3
most likely tokens (a sparse q whose support misses tokens that p allows). Speculative rounds with
k drafts are run until two tokens are emitted; the joint law of (x_1, x_2) must be
p(x_1 | ()) * p(x_2 | (x_1,)).

Statistics. N = 200_000 independent generations, Pearson's chi-square over the cells with positive
expected count (every such cell expects >= 5 draws; asserted). Under a correct rule the statistic
is asymptotically chi2(df = cells - 1). Each test checks two statistics (the first-token marginal
and the joint), each at tail probability ALPHA = 4e-7, so by the union bound a correct rule fails a
test with probability < 8e-7 < 1e-6. Cells with zero expected count must stay empty (any draw
there fails outright). Seeds are fixed, so the outcome is also reproducible.

Tests of the test: three classic mistakes run through the same check and must be caught.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import numpy as np
import pytest
from scipy import stats

from specsplit.shared.acceptance import RoundResult, verify_rejection, verify_token_only
from specsplit.shared.sampling import (
    SamplingConfig,
    SparseDist,
    logits_to_probs,
    quantise,
    sample,
    truncate,
)

V = 5
N = 200_000
ALPHA = 4e-7
Q_ENTRIES = 3
TARGET_CFG = SamplingConfig(temperature=0.8, top_k=4)

Prefix = tuple[int, ...]
Rule = Callable[[np.ndarray, list[int], list[SparseDist], np.random.Generator], RoundResult]


def make_tables(
    seed: int, q_levels: int = 0
) -> tuple[dict[Prefix, np.ndarray], dict[Prefix, SparseDist]]:
    """q_levels > 0: the draft samples from q quantised as the edge sends it (one byte/entry)."""
    rng = np.random.default_rng(seed)
    p: dict[Prefix, np.ndarray] = {}
    q: dict[Prefix, SparseDist] = {}
    for n in range(4):
        for prefix in itertools.product(range(V), repeat=n):
            p[prefix] = logits_to_probs(rng.normal(size=V), TARGET_CFG)
            q[prefix] = truncate(
                logits_to_probs(rng.normal(size=V) * 1.5, SamplingConfig(1.0)), Q_ENTRIES
            )
            if q_levels:
                q[prefix] = quantise(q[prefix], q_levels)
    return p, q


def generate_two(p_tab, q_tab, rule: Rule, k: int, rng: np.random.Generator) -> tuple[int, int]:
    """Speculative rounds of k drafts from the empty prefix until two tokens are emitted."""
    out: list[int] = []
    while len(out) < 2:
        drafts: list[int] = []
        qs: list[SparseDist] = []
        for _ in range(k):
            qi = q_tab[tuple(out + drafts)]
            drafts.append(int(qi.ids[sample(qi.probs, rng)]))
            qs.append(qi)
        p = np.stack([p_tab[tuple(out + drafts[:i])] for i in range(k + 1)])  # [k + 1, V]
        out += rule(p, drafts, qs, rng).emitted(drafts)
    return out[0], out[1]


def chi2_check(counts: np.ndarray, expected_p: np.ndarray) -> tuple[float, float]:
    """(statistic, threshold) over cells with positive expectation.

    A draw in a cell the target gives probability 0 is an outright failure: statistic = inf.
    """
    counts, expected_p = counts.ravel(), expected_p.ravel()
    zero = expected_p == 0
    expected = expected_p[~zero] * counts.sum()
    assert expected.min() >= 5, "chi-square approximation needs >= 5 expected per cell"
    threshold = float(stats.chi2.isf(ALPHA, df=(~zero).sum() - 1))
    if counts[zero].sum() > 0:
        return float("inf"), threshold
    return float(((counts[~zero] - expected) ** 2 / expected).sum()), threshold


def run(
    rule: Rule, k: int, seed: int, q_levels: int = 0
) -> tuple[tuple[float, float], tuple[float, float]]:
    p_tab, q_tab = make_tables(seed, q_levels)
    rng = np.random.default_rng(seed + 1)
    joint = np.zeros((V, V), dtype=np.int64)
    for _ in range(N):
        a, b = generate_two(p_tab, q_tab, rule, k, rng)
        joint[a, b] += 1
    p_joint = p_tab[()][:, None] * np.stack([p_tab[(a,)] for a in range(V)])  # [V, V]
    return chi2_check(joint.sum(axis=1), p_tab[()]), chi2_check(joint, p_joint)


def rejection(p, drafts, qs, rng):
    return verify_rejection(p, drafts, qs, rng)


def token_only(p, drafts, qs, rng):
    return verify_token_only(p, drafts, rng)


# --- deliberately wrong rules (tests of the test) ---------------------------------------------


def wrong_correction_from_p(p, drafts, qs, rng):
    """Accepts correctly but samples the correction from p instead of norm(max(0, p - q))."""
    for i, d in enumerate(drafts):
        if rng.random() * qs[i].prob_of(d) >= p[i, d]:
            return RoundResult(i, sample(p[i], rng), len(drafts))
    return RoundResult(len(drafts), sample(p[-1], rng), len(drafts))


def wrong_unnormalised_residual(p, drafts, qs, rng):
    """Forgets to normalise the residual before inverse-CDF sampling."""
    for i, d in enumerate(drafts):
        if rng.random() * qs[i].prob_of(d) >= p[i, d]:
            r = p[i].copy()
            r[qs[i].ids] = np.maximum(0.0, p[i][qs[i].ids] - qs[i].probs)
            t = min(int(np.searchsorted(np.cumsum(r), rng.random(), side="right")), V - 1)
            return RoundResult(i, t, len(drafts))
    return RoundResult(len(drafts), sample(p[-1], rng), len(drafts))


def wrong_accept_on_equality(p, drafts, qs, rng):
    """Ignores q at temperature > 0: accepts d_i iff it is the target's most likely token."""
    for i, d in enumerate(drafts):
        if d != int(np.argmax(p[i])):
            return RoundResult(i, sample(p[i], rng), len(drafts))
    return RoundResult(len(drafts), sample(p[-1], rng), len(drafts))


@pytest.mark.slow
@pytest.mark.parametrize("rule", [rejection, token_only], ids=["rejection", "token_only"])
def test_first_two_tokens_follow_target_k2(rule):
    (s1, t1), (s2, t2) = run(rule, k=2, seed=11)
    assert s1 < t1, f"first-token marginal: chi2 {s1:.1f} >= {t1:.1f}"
    assert s2 < t2, f"joint of first two tokens: chi2 {s2:.1f} >= {t2:.1f}"


@pytest.mark.slow
@pytest.mark.parametrize("rule", [rejection, token_only], ids=["rejection", "token_only"])
def test_first_token_follows_target_k1(rule):
    # k = 1 makes the first token come from a single round (bonus or correction) more often.
    (s1, t1), (s2, t2) = run(rule, k=1, seed=23)
    assert s1 < t1 and s2 < t2, (s1, t1, s2, t2)


@pytest.mark.slow
def test_quantised_q_follows_target():
    # coarse steps (1/7) so quantisation really moves q; the draft samples from that q
    (s1, t1), (s2, t2) = run(rejection, k=2, seed=31, q_levels=7)
    assert s1 < t1 and s2 < t2, (s1, t1, s2, t2)


@pytest.mark.slow
@pytest.mark.parametrize(
    "rule",
    [wrong_correction_from_p, wrong_unnormalised_residual, wrong_accept_on_equality],
    ids=["correction_from_p", "unnormalised_residual", "accept_on_equality"],
)
def test_the_test_catches_a_biased_rule(rule):
    (s1, t1), (s2, t2) = run(rule, k=2, seed=11)
    assert s1 >= t1 or s2 >= t2, f"a biased rule passed: chi2 {s1:.1f}/{t1:.1f}, {s2:.1f}/{t2:.1f}"
