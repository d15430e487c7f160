"""Cloud-led verification is lossless: the gateway's own draft pool, fed drafts of random
staleness, with edge randomness keyed by position as edge/cloud_led.py keys it, emits tokens that
follow the target distribution, half of the two-token Drafts arriving as a Draft and its
continuation (Draft.continues) (same tables and chi-square check as
tests/shared/test_distribution.py, whose docstring states the statistics)."""

from __future__ import annotations

import numpy as np
import pytest

from specsplit.cloud.cloud_led import DraftPool, PendingDraft
from specsplit.shared.sampling import SparseDist
from tests.shared.test_distribution import V, chi2_check, make_tables, rejection, token_only

N = 100_000
K = 2  # tables hold prefixes up to 3 tokens: one committed + two drafts


def _draw(probs: np.ndarray, u: float) -> int:
    cdf = np.cumsum(probs)
    return min(int(np.searchsorted(cdf, u * cdf[-1], side="right")), len(probs) - 1)


def _drafts_since_last_step(p_out, q_tab, u, rng, first_round, sent_q=lambda q: q):
    """0-2 Drafts the edge sent while the last step ran, each from a committed prefix it knew
    then (base_len <= committed_len: stale when smaller), continuing with its own speculation."""
    drafts = []
    for r in range(int(rng.integers(0, 3))):
        base = int(rng.integers(0, len(p_out) + 1))
        tokens, qs = [], []
        while len(tokens) < K and base + len(tokens) <= 2:
            q = q_tab[tuple(p_out[:base] + tokens)]
            tokens.append(int(q.ids[_draw(q.probs, u[base + len(tokens)])]))  # keyed by position
            qs.append(sent_q(q))
        drafts.append(PendingDraft(first_round + r, base, tokens, qs))
    return drafts


def generate_two(p_tab, q_tab, rule, rng, sent_q=lambda q: q) -> tuple[int, int]:
    gen = int(rng.integers(2**62))  # this generation's seed
    u = rng.random(4)  # the edge's draft numbers, one per position, for this generation
    pool, out, rounds = DraftPool(), [], 0
    while len(out) < 2:
        new = _drafts_since_last_step(out, q_tab, u, rng, rounds + 1, sent_q)
        rounds += len(new)
        for d in new:
            if len(d.tokens) == 2 and rng.random() < 0.5:  # sent as a Draft + a continuation
                pool.add(PendingDraft(d.round, d.base_len, d.tokens[:1], d.q[:1]))
                cont = PendingDraft(d.round, d.base_len + 1, d.tokens[1:], d.q[1:])
                pool.add(cont, continues=True, committed_len=len(out))
            else:
                pool.add(d)
        d, drafts, qs = pool.take(out, K)
        step_rng = np.random.default_rng([gen, len(out)])  # round_rng(seed, "verify", c)
        p = np.stack([p_tab[tuple(out + drafts[:i])] for i in range(len(drafts) + 1)])
        out += rule(p, drafts, qs, step_rng).emitted(drafts)
    return out[0], out[1]


def run(rule, seed: int, sent_q=lambda q: q):
    p_tab, q_tab = make_tables(seed)
    rng = np.random.default_rng(seed + 1)
    joint = np.zeros((V, V), dtype=np.int64)
    for _ in range(N):
        a, b = generate_two(p_tab, q_tab, rule, rng, sent_q)
        joint[a, b] += 1
    p_joint = p_tab[()][:, None] * np.stack([p_tab[(a,)] for a in range(V)])  # [V, V]
    return chi2_check(joint.sum(axis=1), p_tab[()]), chi2_check(joint, p_joint)


@pytest.mark.slow
@pytest.mark.parametrize("rule", [rejection, token_only], ids=["rejection", "token_only"])
def test_cloud_led_tokens_follow_target(rule):
    (s1, t1), (s2, t2) = run(rule, seed=11)
    assert s1 < t1, f"first-token marginal: chi2 {s1:.1f} >= {t1:.1f}"
    assert s2 < t2, f"joint of first two tokens: chi2 {s2:.1f} >= {t2:.1f}"


@pytest.mark.slow
def test_the_test_catches_a_q_other_than_the_sampled_one():
    # The mistake quantised q invites: sample from one q, send another (here: flattened)
    def flat(q: SparseDist) -> SparseDist:
        return SparseDist(q.ids, np.full(q.ids.size, 1.0 / q.ids.size))

    (s1, t1), (s2, t2) = run(rejection, seed=11, sent_q=flat)
    assert s1 >= t1 or s2 >= t2, f"a wrong q passed: {s1:.1f}/{t1:.1f}, {s2:.1f}/{t2:.1f}"
