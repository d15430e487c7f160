"""Properties of the rules over random inputs (hypothesis)."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from specsplit.shared.acceptance import verify_greedy, verify_rejection, verify_token_only
from specsplit.shared.sampling import SamplingConfig, logits_to_probs, sample, truncate


@st.composite
def rounds(draw):
    """A random round: target p [k + 1, V], sparse q [k], drafts sampled from q, a seed."""
    v = draw(st.integers(2, 24))
    k = draw(st.integers(0, 6))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    cfg = SamplingConfig(
        temperature=draw(st.sampled_from([0.3, 0.7, 1.0, 1.5])),
        top_k=draw(st.integers(0, v)),
        top_p=draw(st.sampled_from([0.5, 0.9, 1.0])),
    )
    p = logits_to_probs(rng.normal(size=(k + 1, v)) * 3, cfg)
    entries = draw(st.integers(1, v))
    q = [
        truncate(logits_to_probs(rng.normal(size=v) * 3, SamplingConfig(1.0)), entries)
        for _ in range(k)
    ]
    drafts = [int(qi.ids[sample(qi.probs, rng)]) for qi in q]
    return p, drafts, q, seed


@settings(max_examples=300, deadline=None)
@given(rounds())
def test_rejection_result_in_range_and_reproducible(r):
    p, drafts, q, seed = r
    a = verify_rejection(p, drafts, q, np.random.default_rng(seed))
    b = verify_rejection(p, drafts, q, np.random.default_rng(seed))
    assert a == b  # same seed -> same result
    assert 0 <= a.accepted <= len(drafts)
    assert 0 <= a.token < p.shape[1]
    # the emitted token always has positive target probability at its position
    assert p[a.accepted, a.token] > 0
    if a.accepted < len(drafts):
        # a correction comes from norm(max(0, p - q)): strictly more target than draft mass,
        # which includes tokens outside q's truncated support
        assert p[a.accepted, a.token] > q[a.accepted].prob_of(a.token) or np.allclose(
            p[a.accepted], q[a.accepted].dense(p.shape[1])
        )


@settings(max_examples=300, deadline=None)
@given(rounds())
def test_token_only_result_in_range_and_reproducible(r):
    p, drafts, _, seed = r
    a = verify_token_only(p, drafts, np.random.default_rng(seed))
    assert a == verify_token_only(p, drafts, np.random.default_rng(seed))
    assert 0 <= a.accepted <= len(drafts)
    assert 0 <= a.token < p.shape[1]
    assert p[a.accepted, a.token] > 0
    if a.accepted < len(drafts):
        assert a.token != drafts[a.accepted]


@settings(max_examples=300, deadline=None)
@given(rounds())
def test_greedy_accepts_exactly_the_matching_prefix(r):
    p, drafts, _, _ = r
    argmax = p.argmax(axis=-1)
    a = verify_greedy(argmax, drafts)
    assert 0 <= a.accepted <= len(drafts)
    assert list(argmax[: a.accepted]) == drafts[: a.accepted]
    assert a.token == argmax[a.accepted]
    if a.accepted < len(drafts):
        assert drafts[a.accepted] != a.token


@settings(max_examples=200, deadline=None)
@given(rounds())
def test_draft_outside_support_of_p_is_never_accepted(r):
    # A token the target forbids (p = 0, e.g. cut by top-k) is rejected with certainty.
    p, drafts, q, seed = r
    a = verify_rejection(p, drafts, q, np.random.default_rng(seed))
    for i in range(a.accepted):
        assert p[i, drafts[i]] > 0
