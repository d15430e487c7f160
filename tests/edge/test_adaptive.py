"""Adaptive draft length picks the k that maximises expected tokens per second of a round."""

import numpy as np

from specsplit.edge.adaptive import DraftLength


def _trained(
    alpha: float, draft_ms: float, verify_ms: float, fixed_ms: float, max_draft_tokens=8, n=400
):
    chooser = DraftLength(max_draft_tokens)
    rng = np.random.default_rng(0)
    for i in range(n):
        k = 1 + i % max_draft_tokens  # every block size seen, as a session would over time
        accepted = 0
        while accepted < k and rng.random() < alpha:
            accepted += 1
        chooser.observe(k, accepted, verify_ms + 0.1 * k, verify_ms + fixed_ms, draft_ms * k)
    return chooser


def test_before_any_timing_drafts_the_cap():
    assert DraftLength(8).choose(cap=8) == 8
    assert DraftLength(8).choose(cap=3) == 3


def test_expected_tokens_follow_per_position_acceptance():
    chooser = DraftLength(3)
    for _ in range(1000):
        chooser.observe(3, 3, 10.0)  # everything accepted
    e = chooser.expected_tokens()
    assert e[0] == 1.0 and np.all(np.diff(e) > 0.99)


def test_expensive_verify_and_good_draft_draft_long():
    # CPU target: a pass costs far more than drafting; acceptance 0.8
    assert _trained(0.8, draft_ms=25, verify_ms=290, fixed_ms=2).choose(cap=8) >= 6


def test_poor_acceptance_and_cheap_verify_draft_short():
    # GPU target, slow draft, poor acceptance: long blocks only waste draft time
    assert _trained(0.2, draft_ms=25, verify_ms=20, fixed_ms=2).choose(cap=8) <= 1


def test_long_round_trip_favours_longer_blocks():
    short = _trained(0.6, draft_ms=10, verify_ms=20, fixed_ms=0).choose(cap=8)
    long = _trained(0.6, draft_ms=10, verify_ms=20, fixed_ms=500).choose(cap=8)
    assert long > short


def test_the_cloud_hint_caps_k():
    assert _trained(0.9, draft_ms=5, verify_ms=290, fixed_ms=2).choose(cap=2) <= 2


def test_cloud_led_reach_covers_the_lag_plus_useful_positions():
    from specsplit.edge.cloud_led import _Reach

    reach = _Reach(max_draft_tokens=4, limit=16)
    assert reach.want(hint=4) == 4  # before anything is measured: max_draft_tokens
    for _ in range(50):
        reach.observe(offset=3, verified=4, accepted=4)  # the cloud is 3 ahead; all accepted
    assert reach.want(hint=4) == 3 + 2 * 4
    assert reach.want(hint=2) == 3 + 2 * 2  # the cloud's hint caps what is verified per step
    assert _Reach(max_draft_tokens=8, limit=16).want(hint=8) == 8
    poor = _Reach(max_draft_tokens=8, limit=16)
    for _ in range(50):
        poor.observe(offset=0, verified=4, accepted=0)  # nothing ever accepted
    assert poor.want(hint=8) == 2


def test_cloud_led_reach_after_a_lead_block_extends_past_it():
    """A lock-step session's Draft.lead already holds a block the cloud is verifying: the
    speculation must reach past it meanwhile, not wait for its verdict."""
    from specsplit.edge.adaptive import DraftLength
    from specsplit.edge.cloud_led import _Reach

    assert _Reach(max_draft_tokens=8, limit=16, sent=8).want(hint=8) == 16  # nothing measured yet
    assert (
        _Reach(max_draft_tokens=8, limit=12, sent=8).want(hint=8) == 12
    )  # never past the server's limit
    measured = DraftLength(8)
    for _ in range(3):
        measured.observe(8, 8, 300.0)  # lock-step rounds: every draft accepted
    assert _Reach(max_draft_tokens=8, limit=16, acceptance=measured, sent=8).want(hint=8) == 16
    reach = _Reach(max_draft_tokens=8, limit=16, sent=8)
    reach.observe(offset=0, verified=0, accepted=0)  # a verdict came: the usual rule from now
    assert reach.want(hint=8) == 8


def test_a_bad_first_round_does_not_end_drafting_for_good():
    """A compute-bound target (rows cost time) and one fully rejected first block make k = 0
    look best; the chooser still drafts now and then, and good drafts bring k back."""
    from specsplit.edge.adaptive import PROBE_AFTER

    chooser = DraftLength(4)
    chooser.observe(4, 0, verify_ms=330.0, round_ms=340.0, draft_ms=100.0)
    chooser.observe(0, 0, verify_ms=160.0, round_ms=170.0)
    ks = []
    for _ in range(40):
        k = chooser.choose(cap=4)
        ks.append(k)
        if k:  # the draft is in fact good: every drafted token accepted
            chooser.observe(k, k, 160.0 + 42.0 * k, 170.0 + 42.0 * k, 25.0 * k)
        else:
            chooser.observe(0, 0, 160.0, 170.0)
    assert ks[0] == 0  # the bad round is believed at first ...
    assert 0 < ks.index(next(k for k in ks if k)) <= PROBE_AFTER + 1  # ... but probed
    assert all(k >= 2 for k in ks[-10:])  # and drafting is back once drafts are accepted
