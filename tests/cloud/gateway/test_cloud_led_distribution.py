"""Cloud-led verification is lossless: the gateway's own draft pool, fed drafts of random
staleness, with edge randomness keyed by position as edge/cloud_led.py keys it, emits tokens that
follow the target distribution, half of the two-token Drafts arriving as a Draft and its
continuation (Draft.continues) (same tables and chi-square check as
tests/shared/test_distribution.py, whose docstring states the statistics).

The edge draws its drafts with the session's shared numbers, one Exp(1) vector per position, and
the cloud draws every token no draft decides with the same numbers (shared/coupling.py); the
accept tests and corrections use the step's own stream. A rule that let the shared numbers into
an accept test must be caught."""

from __future__ import annotations

import numpy as np
import pytest

from specsplit.cloud.gateway.cloud_led import DraftPool, PendingDraft
from specsplit.shared.acceptance import RoundResult, verify_rejection, verify_token_only
from specsplit.shared.coupling import race
from specsplit.shared.sampling import SparseDist, sample
from tests.shared.test_distribution import V, chi2_check, make_tables

N = 100_000
K = 2  # tables hold prefixes up to 3 tokens: one committed + two drafts


def rejection(p, drafts, qs, rng, draw):
    return verify_rejection(p, drafts, qs, rng, draw)


def token_only(p, drafts, qs, rng, draw):
    return verify_token_only(p, drafts, rng, draw)


def wrong_shared_numbers_in_the_accept_test(p, drafts, qs, rng, draw, e):
    """Accepts d_i with u = 1 - exp(-E_i[d_i]), the very number the edge's draw favoured d_i
    with, instead of a number of the step's own."""
    for i, d in enumerate(drafts):
        if (1.0 - np.exp(-e[i][d])) * qs[i].prob_of(d) >= p[i, d]:
            r = p[i].copy()
            r[qs[i].ids] = np.maximum(0.0, p[i][qs[i].ids] - qs[i].probs)
            return RoundResult(i, sample(r / r.sum(), rng), len(drafts))
    return RoundResult(len(drafts), draw(len(drafts), p[-1]), len(drafts))


def _drafts_since_last_step(p_out, q_tab, e, rng, first_round, sent_q=lambda q: q):
    """0-2 Drafts the edge sent while the last step ran, each from a committed prefix it knew
    then (base_len <= committed_len: stale when smaller), continuing with its own speculation."""
    drafts = []
    for r in range(int(rng.integers(0, 3))):
        base = int(rng.integers(0, len(p_out) + 1))
        tokens, qs = [], []
        while len(tokens) < K and base + len(tokens) <= 2:
            q = q_tab[tuple(p_out[:base] + tokens)]
            pos = base + len(tokens)
            tokens.append(int(q.ids[race(q.probs, e[pos][q.ids])]))  # shared numbers of pos
            qs.append(sent_q(q))
        drafts.append(PendingDraft(first_round + r, base, tokens, qs))
    return drafts


def generate_two(p_tab, q_tab, rule, rng, sent_q=lambda q: q) -> tuple[int, int]:
    gen = int(rng.integers(2**62))  # this generation's seed
    e = rng.standard_exponential((4, V))  # the shared numbers, one vector per position
    pool, out, rounds = DraftPool(), [], 0
    while len(out) < 2:
        new = _drafts_since_last_step(out, q_tab, e, rng, rounds + 1, sent_q)
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
        here = e[len(out) :]  # the shared numbers from committed_len on

        def draw(i, probs, here=here):  # the cloud's own draws
            return race(probs, here[i])

        if rule is wrong_shared_numbers_in_the_accept_test:
            result = rule(p, drafts, qs, step_rng, draw, here)
        else:
            result = rule(p, drafts, qs, step_rng, draw)
        out += result.emitted(drafts)
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


@pytest.mark.slow
def test_the_test_catches_shared_numbers_in_the_accept_test():
    (s1, t1), (s2, t2) = run(wrong_shared_numbers_in_the_accept_test, seed=11)
    assert s1 >= t1 or s2 >= t2, f"a biased rule passed: {s1:.1f}/{t1:.1f}, {s2:.1f}/{t2:.1f}"
