"""Lossless acceptance rules for one verification round (docs/design.md#lossless).

Vocabulary, used everywhere in specsplit:
- draft tokens ``d_1..d_k``: what the edge proposes after the committed prefix.
- ``p_i``: the target distribution at draft position i (after the request's temperature, top-k,
  top-p); ``p`` has k + 1 rows, the last one being the distribution after all k drafts.
- ``q_i``: the draft distribution d_i was sampled from (sparse, see ``SparseDist``).
- accepted ``n``: the number of leading draft tokens kept, 0 <= n <= k.
- correction token: the target's token at position n + 1 when n < k (the first rejection).
- bonus token: the target's token after all k drafts were accepted (n == k).
Every round therefore emits ``d_1..d_n`` and exactly one more token.

The cloud verifier calls these unchanged. Randomness comes only from the ``rng`` argument, so a
seeded generator reproduces a run. A ``draw`` argument, where given, takes over the draws from p
that no draft decides (the bonus; every token of the token-only rule): ``draw(i, p[i])`` returns the
token at draft position i. The cloud passes one that shares its numbers with the edge's drafting
(shared/coupling.py); the accept tests and the corrections always use ``rng``.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from specsplit.shared.sampling import SparseDist, sample

Draw = Callable[[int, np.ndarray], int]  # (row i, p[i]) -> a token drawn from p[i]


class VerificationRule(enum.IntEnum):
    """Verification rule; values match the proto's VerificationRule."""

    GREEDY = 1
    REJECTION = 2
    TOKEN_ONLY = 3


@dataclass(frozen=True)
class RoundResult:
    """Outcome of verifying one block: ``accepted`` drafts kept, then ``token``."""

    accepted: int
    token: int  # correction when accepted < k, else bonus
    k: int  # block size the round verified

    @property
    def is_bonus(self) -> bool:
        return self.accepted == self.k

    def emitted(self, drafts: Sequence[int]) -> list[int]:
        return [int(t) for t in drafts[: self.accepted]] + [self.token]


def verify_greedy(
    target_argmax: np.ndarray,  # [k + 1] argmax of the target logits at each position
    drafts: Sequence[int],  # [k]
) -> RoundResult:
    """Accept d_i while argmax p_i == d_i; the token is the argmax at the first mismatch."""
    k = len(drafts)
    assert target_argmax.shape == (k + 1,), (target_argmax.shape, k)
    matches = target_argmax[:k] == np.asarray(drafts, dtype=np.int64)
    n = k if matches.all() else int(np.argmin(matches))
    return RoundResult(accepted=n, token=int(target_argmax[n]), k=k)


def _residual(p: np.ndarray, q: SparseDist) -> np.ndarray:
    # norm(max(0, p - q)); q is zero outside its support, so only the support changes.
    r = p.copy()
    r[q.ids] = np.maximum(0.0, p[q.ids] - q.probs)
    total = r.sum()
    # total == 0 only when p == q, where the acceptance probability is 1 and no rejection occurs;
    # floating-point ties land here, and then p itself is the exact correction distribution.
    return r / total if total > 0 else p


def verify_rejection(
    p: np.ndarray,  # [k + 1, V] target distributions
    drafts: Sequence[int],  # [k]
    q: Sequence[SparseDist],  # [k] draft distributions the drafts were sampled from
    rng: np.random.Generator,
    draw: Draw | None = None,
) -> RoundResult:
    """Speculative sampling (Leviathan et al. 2023, Chen et al. 2023).

    Accept d_i with probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection sample the
    correction from norm(max(0, p_i - q_i)); if all are accepted, sample the bonus from p_{k+1}.
    """
    k = len(drafts)
    assert p.shape[0] == k + 1 and len(q) == k, (p.shape, k, len(q))
    for i, d in enumerate(drafts):
        q_d = q[i].prob_of(int(d))
        assert q_d > 0, f"draft token {d} is outside q_{i}'s support"
        # q >= p: accept with probability p/q; q < p: always accept (u < 1 <= p/q).
        if rng.random() * q_d < p[i, d]:
            continue
        return RoundResult(accepted=i, token=sample(_residual(p[i], q[i]), rng), k=k)
    return RoundResult(accepted=k, token=_plain(p, k, rng, draw), k=k)


def _plain(p: np.ndarray, i: int, rng: np.random.Generator, draw: Draw | None) -> int:
    return sample(p[i], rng) if draw is None else int(draw(i, p[i]))


def verify_token_only(
    p: np.ndarray,  # [k + 1, V] target distributions
    drafts: Sequence[int],  # [k]
    rng: np.random.Generator,
    draw: Draw | None = None,
) -> RoundResult:
    """Sample x_i ~ p_i; accept while x_i == d_i; the token is the first x_i that differs.

    Exact for any draft: each emitted token is a fresh draw from p given the tokens before it.
    """
    k = len(drafts)
    assert p.shape[0] == k + 1, (p.shape, k)
    for i, d in enumerate(drafts):
        x = _plain(p, i, rng, draw)
        if x != d:
            return RoundResult(accepted=i, token=x, k=k)
    return RoundResult(accepted=k, token=_plain(p, k, rng, draw), k=k)


def resolve_verification(
    requested: VerificationRule | None, temperature: float, has_q: bool
) -> VerificationRule:
    """The rule a session uses: greedy at temperature 0, else the requested sampled rule."""
    if temperature == 0.0:
        # A sampled rule at temperature 0 is still exact (p is one-hot), but greedy is cheaper and
        # needs no randomness, so it always wins.
        return VerificationRule.GREEDY
    if requested == VerificationRule.GREEDY:
        raise ValueError("greedy verification needs temperature 0")
    if requested is None:
        return VerificationRule.REJECTION if has_q else VerificationRule.TOKEN_ONLY
    return requested
