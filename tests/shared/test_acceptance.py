"""Constructed cases for the acceptance rules: exact accept counts and tokens."""

import numpy as np
import pytest

from specsplit.shared.acceptance import (
    VerificationRule,
    resolve_verification,
    verify_greedy,
    verify_rejection,
    verify_token_only,
)
from specsplit.shared.sampling import SparseDist


@pytest.mark.parametrize(
    ("argmax", "drafts", "accepted", "token"),
    [
        ([5, 6, 7, 8], [5, 6, 7], 3, 8),  # all accepted: bonus is argmax after the block
        ([5, 6, 7, 8], [5, 9, 7], 1, 6),  # mismatch at 2: correction is the target's argmax there
        ([5, 6, 7, 8], [4, 6, 7], 0, 5),  # first draft rejected
        ([5, 6, 7, 8], [5, 6, 0], 2, 7),  # last draft rejected
        ([3], [], 0, 3),  # k = 0: one target token
    ],
)
def test_greedy_exact_counts(argmax, drafts, accepted, token):
    r = verify_greedy(np.array(argmax), drafts)
    assert (r.accepted, r.token) == (accepted, token)
    assert r.is_bonus == (accepted == len(drafts))
    assert r.emitted(drafts) == list(drafts[:accepted]) + [token]


def test_greedy_does_not_accept_after_first_mismatch():
    # d_3 matches again, but acceptance stops at the first mismatch.
    r = verify_greedy(np.array([1, 2, 3, 4]), [1, 0, 3])
    assert (r.accepted, r.token) == (1, 2)


def _onehot(rows, v=6):
    p = np.zeros((len(rows), v))
    p[np.arange(len(rows)), rows] = 1.0
    return p


def test_rejection_with_one_hot_target_matches_greedy():
    # temperature -> 0 limit: p one-hot makes rejection sampling deterministic and equal to greedy.
    p = _onehot([2, 4, 1])
    q = [SparseDist(np.array([2, 3]), np.array([0.5, 0.5])), SparseDist(np.array([5]), np.ones(1))]
    r = verify_rejection(p, [2, 5], q, np.random.default_rng(0))
    assert (r.accepted, r.token) == (1, 4)


def test_rejection_accepts_when_q_below_p():
    # q(d) <= p(d) means acceptance probability 1, whatever the random draw.
    p = np.array([[0.1, 0.9], [0.5, 0.5]])
    q = [SparseDist(np.array([1]), np.ones(1))]  # q(1) = 1 > p(1) = 0.9: accepted w.p. 0.9
    q_low = [SparseDist(np.array([0, 1]), np.array([0.5, 0.5]))]  # q(1) = 0.5 < 0.9: always
    for seed in range(200):
        assert verify_rejection(p, [1], q_low, np.random.default_rng(seed)).accepted == 1
    accepted = [verify_rejection(p, [1], q, np.random.default_rng(s)).accepted for s in range(2000)]
    assert 0.85 < np.mean(accepted) < 0.95


def test_rejection_correction_never_the_rejected_token_when_q_covers_it():
    # After rejecting d, the residual max(0, p - q) is 0 at d whenever q(d) >= p(d).
    p = np.array([[0.3, 0.3, 0.4], [1 / 3, 1 / 3, 1 / 3]])
    q = [SparseDist(np.array([0]), np.ones(1))]
    for seed in range(300):
        r = verify_rejection(p, [0], q, np.random.default_rng(seed))
        if r.accepted == 0:
            assert r.token in (1, 2)


def test_rejection_refuses_draft_outside_q_support():
    p = np.full((2, 3), 1 / 3)
    with pytest.raises(AssertionError, match="outside"):
        verify_rejection(p, [2], [SparseDist(np.array([0]), np.ones(1))], np.random.default_rng(0))


def test_token_only_with_one_hot_target_matches_greedy():
    p = _onehot([2, 4, 1])
    r = verify_token_only(p, [2, 5], np.random.default_rng(0))
    assert (r.accepted, r.token) == (1, 4)


def test_resolve_verification():
    assert resolve_verification(None, 0.0, has_q=True) is VerificationRule.GREEDY
    assert (
        resolve_verification(VerificationRule.REJECTION, 0.0, has_q=True) is VerificationRule.GREEDY
    )
    assert resolve_verification(None, 0.7, has_q=True) is VerificationRule.REJECTION
    assert resolve_verification(None, 0.7, has_q=False) is VerificationRule.TOKEN_ONLY
    assert (
        resolve_verification(VerificationRule.TOKEN_ONLY, 0.7, has_q=True)
        is VerificationRule.TOKEN_ONLY
    )
    with pytest.raises(ValueError, match="temperature 0"):
        resolve_verification(VerificationRule.GREEDY, 0.7, has_q=False)
