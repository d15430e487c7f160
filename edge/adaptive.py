"""Adaptive draft length: per round, the k that maximises expected tokens per second
(docs/design.md#performance).

A round of k drafts emits E(k) = 1 + sum_{j=1..k} prod_{i<=j} alpha_i tokens, where alpha_i is
the measured acceptance at position i given d_1..d_{i-1} were accepted, and takes
T(k) = k * t_draft + t_fixed + t_verify(k + 1): drafting on the edge, the round trip and the
server's overheads (measured as round time minus verify time), and the target pass over k + 1
rows (the cloud reports it per verdict; sizes not seen yet are interpolated linearly). The cloud's
max_draft_tokens_hint caps k. Unseen positions start from the session's overall acceptance, and
that from a prior, so a few rounds suffice.

Where extra rows cost target time (a compute-bound CPU target) one unlucky first round can make
k = 0 look best, and a session that drafts nothing learns nothing more: while the best k is 0,
every PROBE_AFTER-th round drafts the best k >= 1 anyway, whose verdict corrects the estimate
(the cloud's hints probe the same way, capacity.CostModel.probe).
"""

from __future__ import annotations

import numpy as np

PRIOR_ALPHA = 0.6  # before any verdict: a typical draft of the same family
PRIOR_WEIGHT = 2.0  # pseudo-observations behind each prior
EMA = 0.3  # weight of the newest timing
PROBE_AFTER = 4  # rounds at k = 0 before one round drafts again to re-measure acceptance


def ema(old: float | None, new: float) -> float:
    return new if old is None else (1 - EMA) * old + EMA * new


class DraftLength:
    """Chooses k in [0, max_draft_tokens] from what past rounds measured; ``observe`` after every
    verdict."""

    def __init__(self, max_draft_tokens: int):
        self.max_draft_tokens = max_draft_tokens
        # [max_draft_tokens + 1]: rounds that verified draft position i
        self.tried = np.zeros(max_draft_tokens + 1)
        self.kept = np.zeros(max_draft_tokens + 1)  # [max_draft_tokens + 1]: ... and accepted it
        self.draft_ms: float | None = None  # per drafted token, on the critical path
        self.fixed_ms: float | None = None  # round trip + server overheads, per round
        self.verify_ms: dict[int, float] = {}  # target pass by rows (k + 1)
        self.idle = 0  # rounds in a row chosen at k = 0

    def observe(
        self,
        k: int,
        accepted: int,
        verify_ms: float,
        round_ms: float | None = None,
        draft_ms: float | None = None,
    ) -> None:
        """One verdict on k drafts; ``draft_ms`` only for blocks drafted on the critical path."""
        seen = min(accepted + 1, k)  # positions the target judged: accepted ones + first rejected
        self.tried[:seen] += 1
        self.kept[:accepted] += 1
        self.verify_ms[k + 1] = ema(self.verify_ms.get(k + 1), verify_ms)
        if round_ms is not None:
            self.fixed_ms = ema(self.fixed_ms, max(0.0, round_ms - verify_ms))
        if draft_ms is not None and k > 0:
            self.draft_ms = ema(self.draft_ms, draft_ms / k)

    def alphas(self) -> np.ndarray:
        """[max_draft_tokens] acceptance per position, each shrunk towards the overall rate."""
        overall = (self.kept.sum() + PRIOR_ALPHA * PRIOR_WEIGHT) / (self.tried.sum() + PRIOR_WEIGHT)
        alpha = (self.kept + overall * PRIOR_WEIGHT) / (self.tried + PRIOR_WEIGHT)
        return alpha[: self.max_draft_tokens]

    def expected_tokens(self) -> np.ndarray:
        """[max_draft_tokens + 1] E(k) for k = 0..max_draft_tokens."""
        return 1.0 + np.concatenate(([0.0], np.cumsum(np.cumprod(self.alphas()))))

    def verify_cost(self, rows: int) -> float:
        if rows in self.verify_ms:
            return self.verify_ms[rows]
        if not self.verify_ms:
            return 0.0
        xs = np.array(sorted(self.verify_ms))
        ys = np.array([self.verify_ms[x] for x in xs])
        if len(xs) == 1:
            return float(ys[0])  # one size seen: assume rows are nearly free (memory-bound pass)
        slope, intercept = np.polyfit(xs, ys, 1)
        return float(max(0.0, intercept + max(0.0, slope) * rows))

    def round_ms(self, k: int) -> float:
        return k * (self.draft_ms or 0.0) + (self.fixed_ms or 0.0) + self.verify_cost(k + 1)

    def choose(self, cap: int) -> int:
        """The best k <= min(max_draft_tokens, cap); max_draft_tokens (capped) until timings were
        measured."""
        cap = max(0, min(self.max_draft_tokens, cap))
        if self.draft_ms is None or not self.verify_ms:
            return cap
        gain = self.expected_tokens()[: cap + 1]
        cost = np.array([max(self.round_ms(k), 1e-3) for k in range(cap + 1)])
        rate = gain / cost
        best = int(np.argmax(rate))
        self.idle = self.idle + 1 if best == 0 else 0
        if best == 0 and cap >= 1 and self.idle > PROBE_AFTER:
            self.idle = 0
            return 1 + int(np.argmax(rate[1:]))  # a probe: see DraftLength's module docstring
        return best
