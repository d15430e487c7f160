"""When a lock-step session should hand over to cloud-led (Draft.lead, DESIGN §7).

The two modes waste time in different places, and which wastes less depends on the link, the
cloud's step time and how well the draft predicts the target, so ``auto`` starts lock-step and
measures all three:

- Lock-step idles the target for a round trip, the server's overheads and whatever drafting is
  left on the critical path, once per block: a cycle takes V + I for E tokens (V: the target pass
  over k + 1 rows, I: the measured rest of the round, E: the expected tokens of a block of k).
- Cloud-led never idles the target, but after a rejected block (probability 1 - P, P = every
  draft accepted) the edge hears of the correction only a round trip later, so the steps that
  start meanwhile verify nothing and make one token each: ceil(I / V1) of them (V1: a one-row
  pass), more when the edge's guess of those tokens is wrong (each holds with the acceptance of a
  first draft position, alpha_1). A cycle takes V + (1 - P) * n * V1 for E + (1 - P) * n tokens.

The session switches once the cloud-led rate beats the lock-step rate by MARGIN (the switch is one
way: a stream never goes back). Both rates come from the same measurements the adaptive draft
length uses (edge/adaptive.py), plus the idle and the server's per-step overhead, so a GPU cloud
(a 20 ms step) behind a mobile link switches after its first round, and a CPU cloud on a LAN
stays lock-step. With a draft that predicts nothing (alpha near 0) lock-step is a slow cloud-only
and the cloud-led rate is the cloud-only rate (its drafting pauses), so it switches too.
"""

from __future__ import annotations

import math

import numpy as np

from specsplit.edge.adaptive import DraftLength

MARGIN = 1.05  # the switch cannot be undone: only for a clear gain
EMA = 0.3


def _ema(old: float | None, new: float) -> float:
    return new if old is None else (1 - EMA) * old + EMA * new


class LeadChoice:
    """Measures lock-step rounds; ``should_lead`` says when cloud-led would be faster."""

    def __init__(self, k_max: int) -> None:
        self.lengths = DraftLength(k_max)  # acceptance per position, pass cost by rows
        self.idle_ms: float | None = None  # per round: verdict to verdict, minus the pass
        self.overhead_ms: float = 0.0  # per step: at the gateway, minus the pass

    def observe(
        self, k: int, accepted: int, cycle_ms: float, verify_ms: float, server_ms: float
    ) -> None:
        """One lock-step round of k drafts: ``cycle_ms`` from the previous verdict (or Started)
        to this one, ``verify_ms`` its target pass and ``server_ms`` its time at the gateway."""
        self.lengths.observe(k, accepted, verify_ms)
        self.idle_ms = _ema(self.idle_ms, max(0.0, cycle_ms - verify_ms))
        self.overhead_ms = _ema(self.overhead_ms, max(0.0, server_ms - verify_ms))

    def rates(self, k: int) -> tuple[float, float] | None:
        """(lock-step, cloud-led) expected tokens per ms at block size k; None before a round."""
        lengths = self.lengths
        if self.idle_ms is None or not lengths.verify_ms:
            return None
        alphas = lengths.alphas()
        expected = float(lengths.expected_tokens()[k])
        all_kept = float(np.prod(alphas[:k]))
        verify = lengths.verify_cost(k + 1)
        lock_step = expected / max(verify + self.idle_ms, 1e-3)
        step = verify + self.overhead_ms
        one_row = lengths.verify_cost(1) + self.overhead_ms
        started = max(1, math.ceil(self.idle_ms / max(one_row, 1e-3)))
        idle_steps = (1 - all_kept) * started / max(float(alphas[0]), 1e-3)
        cloud_led = (expected + idle_steps) / max(step + idle_steps * one_row, 1e-3)
        return lock_step, cloud_led

    def should_lead(self, k: int) -> bool:
        rates = self.rates(k)
        return rates is not None and rates[1] >= MARGIN * rates[0]
