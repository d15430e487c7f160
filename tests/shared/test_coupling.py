"""Shared numbers (shared/coupling.py): each side's draw is an exact sample of its own
distribution, and the two sides' draws agree far more often than independent draws would."""

from __future__ import annotations

import numpy as np

from specsplit.shared.coupling import SharedNoise, exponentials
from specsplit.shared.sampling import SparseDist
from tests.shared.test_distribution import chi2_check

P = np.array([0.5, 0.25, 0.15, 0.1, 0.0])
Q = np.array([0.3, 0.3, 0.2, 0.0, 0.2])  # TV 0.3: the coupling agrees >= 0.54, chance 0.26


def test_a_shorter_vocabulary_gets_a_prefix_of_the_same_numbers():
    assert np.array_equal(exponentials(3, 17, 10), exponentials(3, 17, 1000)[:10])
    assert not np.array_equal(exponentials(3, 17, 10), exponentials(3, 18, 10))
    assert not np.array_equal(exponentials(3, 17, 10), exponentials(4, 17, 10))


def test_draws_follow_their_distribution_and_never_hit_a_zero():
    noise = SharedNoise(seed=5, vocab_size=P.size)
    counts = np.bincount([noise.draw(pos, P) for pos in range(40_000)], minlength=P.size)
    stat, threshold = chi2_check(counts, P)  # inf when the zero-probability token was drawn
    assert stat < threshold, (counts, stat, threshold)


def test_sparse_and_dense_draws_agree():
    noise = SharedNoise(seed=9, vocab_size=100)
    q = SparseDist(ids=np.array([3, 40, 77]), probs=np.array([0.5, 0.3, 0.2]))
    for pos in range(500):
        assert noise.draw_sparse(pos, q) == noise.draw(pos, q.dense(100))


def test_equal_distributions_always_draw_the_same_token():
    edge, cloud = SharedNoise(seed=1, vocab_size=P.size), SharedNoise(seed=1, vocab_size=P.size)
    assert all(edge.draw(pos, P) == cloud.draw(pos, P) for pos in range(2000))


def test_coupled_draws_agree_at_least_as_often_as_the_bound():
    # P(agree) >= (1 - TV) / (1 + TV) for the exponential-race coupling; independent draws
    # agree with probability sum(P * Q) only.
    tv = 0.5 * np.abs(P - Q).sum()
    bound, independent = (1 - tv) / (1 + tv), float((P * Q).sum())
    n = 20_000
    noise = SharedNoise(seed=2, vocab_size=P.size)
    agree = np.mean([noise.draw(pos, P) == noise.draw(pos, Q) for pos in range(n)])
    four_sigma = 4 * np.sqrt(bound * (1 - bound) / n)
    assert agree >= bound - four_sigma, (agree, bound)
    assert bound > independent + 2 * four_sigma  # the test separates coupling from chance
