"""When a lock-step session should hand over to cloud-led (Draft.lead, docs/design.md#handover).

The two modes waste time in different places, and which wastes less depends on the link, the
cloud's step time and how well the draft predicts the target, so ``auto`` (where it does not
start cloud-led: edge.session_plan) starts lock-step and measures all three:

- Lock-step idles the target for a round trip, the server's overheads and whatever drafting is
  left on the critical path, once per block: a cycle takes V + I for E tokens (V: the target pass
  over k + 1 rows, I: the measured rest of the round, E: the expected tokens of a block of k).
- Cloud-led never idles the target, but after a rejected block (probability 1 - P, P = every
  draft accepted) the edge hears of the correction only a round trip later, so the steps that
  start meanwhile verify nothing and make one token each: ceil(I / V1) of them (V1: a one-row
  pass), more when the edge's guess of those tokens is wrong. A guess holds with the acceptance
  of a first draft position, alpha_1, when greedy; when sampling, the cloud draws those tokens
  with the shared numbers (shared/coupling.py), which agree with the edge's draws with
  probability about (1 - TV) / (1 + TV) = alpha_1 / (2 - alpha_1), below alpha_1. With n such
  steps per rejected block, a cycle takes V + (1 - P) * n * V1 for E + (1 - P) * n tokens.

The session switches once the cloud-led rate beats the lock-step rate by MARGIN, measured over
MIN_ROUNDS rounds (the switch is one way: a stream never goes back). Both rates come from the
same measurements the adaptive draft length uses (edge/adaptive.py), plus the idle and the
server's per-step overhead. So a CPU cloud on a LAN stays lock-step, and a draft that predicts
nothing (alpha near 0) switches: lock-step is then a slow cloud-only, and the cloud-led rate is
the cloud-only rate (its drafting pauses).

Where the round trip measured at Start is already LEAD_AT_START target steps (Started.step_ms),
the first Draft leads: every lock-step round there idles the target for longer than it computes
(a GPU cloud, a 20 ms step, behind any mobile link), and the rounds it would take to measure
that cost more than a wrong guess of cloud-led could. A client's next generation need not
measure it again: ``SplitClient`` keeps the round trip and step of its last Started and, where
``lead_at_start`` holds for them, starts the stream cloud-led (edge.session_plan), so the
target steps straight after prefill instead of a round trip later, when the lead Draft arrives.

Below that round trip the model above can be wrong where the edge drafts slower than the cloud
steps: cloud-led steps then verify few drafts (at RTT 0 on the 2-core CPU a warm client that
started cloud-led made 1.3 tokens a pass on prose, slower than lock-step, and 2.2 on code,
faster: docs/benchmarks-rtt0-500-1000-t0-cloud-only-auto-auto-warm.md). So a client also
remembers what each mode really yielded in its last auto generation that ran it (``Yield``:
tokens per target pass and the time per pass, from GenerationStats.mode_passes), and starts the
next one cloud-led, or lets the cloud take the lead, or hands over, only where cloud-led's
measured rate beat lock-step's (``Link.led_pays``; with no lock-step measured, where it beat the
cloud-only pace, one token per Started.step_ms, by MARGIN). Tokens per pass alone are no
measure across modes on a CPU target, where a lock-step pass over k + 1 rows costs up to three
one-row steps: in the full bench at 0-50 ms, prose, cloud-led's ~1.3 tokens a pass ran
0.93-1.04x cloud-only and lock-step adaptive's ~4 ran 0.72-1.03x (docs/benchmarks.md, make
bench at 865d6b5; 0.95-1.03x and 0.80-0.88x in the run at ff4ab90).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from specsplit.edge.adaptive import DraftLength, ema

MARGIN = 1.05  # the switch cannot be undone: only for a clear gain ...
MIN_ROUNDS = 2  # ... measured over more than one round (the first leans on the prior)
# Lead with the first Draft when the round trip measured at Start is this many one-row target
# steps (Started.step_ms): lock-step then idles the target longer per block than a step takes.
# Over three full bench runs cloud-led beat lock-step adaptive in 11 of 12 cells at RTT / step
# 1.75-1.88 (1.12-1.29x, the 12th 0.99x) and was mixed at 0.70-0.76 (0.84-1.26x).
LEAD_AT_START = 1.5
# Cloud-led passes that made fewer tokens than this on average (most verified no draft, or one
# rejected at once), with no lock-step rounds measured beside them and no step of the server's
# to compare their rate with: the next generation starts lock-step and measures.
LED_MIN_TOKENS_PER_PASS = 1.5
LOCK_STEP, CLOUD_LED = "lock-step", "cloud-led"  # GenerationStats.mode_passes' keys


class Yield(NamedTuple):
    """What a session mode made of the target's passes in the last auto generation that ran it:
    tokens committed per pass, and the edge's time per pass, Verdict to Verdict (a lock-step
    round's idle included)."""

    tokens_per_pass: float
    ms_per_pass: float

    @property
    def tokens_per_ms(self) -> float:
        return self.tokens_per_pass / max(self.ms_per_pass, 1e-3)

    @classmethod
    def of(cls, passes: float, tokens: float, ms: float) -> Yield | None:
        """From GenerationStats.mode_passes' counts; None below MIN_ROUNDS passes."""
        return cls(tokens / passes, ms / passes) if passes >= MIN_ROUNDS else None


class Link(NamedTuple):
    """What a Started told a client about its link (``SplitClient.link``): the round trip in ms
    (Start to Started, Started.setup_ms taken out; None when it could not be measured) and the
    server's recent one-row step in ms (Started.step_ms, 0: unknown); whether the client's
    last auto generation, having measured its rounds, ran cloud-led (handed over, or started
    so): the next one then starts cloud-led instead of measuring lock-step rounds again, where
    cloud-led paid (``led_pays``); and what each mode yielded in the last auto generation that
    ran it (None: not measured)."""

    rtt_ms: float | None
    step_ms: float
    led: bool = False
    lock_step: Yield | None = None
    cloud_led: Yield | None = None

    def starts_led(self) -> bool:
        if LeadChoice.lead_at_start(self.rtt_ms, self.step_ms):
            return True
        return self.led and self.led_pays()

    def led_pays(self) -> bool:
        """Whether cloud-led, as measured on this link, was worth running: faster than
        lock-step where both were measured, else faster than the cloud-only pace (one token per
        step_ms) by MARGIN, else (no step known) LED_MIN_TOKENS_PER_PASS tokens a pass; True
        while cloud-led is unmeasured."""
        led, lock = self.cloud_led, self.lock_step
        if led is None:
            return True
        if lock is not None:
            return led.tokens_per_ms >= lock.tokens_per_ms
        if self.step_ms > 0:
            return led.tokens_per_ms >= MARGIN / self.step_ms
        return led.tokens_per_pass >= LED_MIN_TOKENS_PER_PASS

    def measured(self, stats, before: Link | None) -> Link:
        """This link with the yields ``stats`` (GenerationStats) measured, each mode not run
        keeping what ``before`` (the client's link before the generation) remembered."""
        counts = stats.mode_passes
        kept = before if before is not None else Link(None, 0.0)
        lock = Yield.of(*counts[LOCK_STEP]) if LOCK_STEP in counts else None
        led = Yield.of(*counts[CLOUD_LED]) if CLOUD_LED in counts else None
        return self._replace(lock_step=lock or kept.lock_step, cloud_led=led or kept.cloud_led)


class LeadChoice:
    """Measures lock-step rounds; ``should_lead`` says when cloud-led would be faster."""

    def __init__(self, max_draft_tokens: int, greedy: bool, led: Yield | None = None) -> None:
        self.lengths = DraftLength(max_draft_tokens)  # acceptance per position, pass cost by rows
        self.greedy = greedy
        self.led = led  # what cloud-led yielded on this link last (Link.cloud_led), if known
        self.idle_ms: float | None = None  # per round: verdict to verdict, minus the pass
        # ... minus the drafting on the critical path: the link and the edge's own overheads
        self.link_ms: float | None = None
        # per drafted token, whether on the critical path or drafted ahead: the draft's speed
        # (``lengths.draft_ms`` counts the critical path only, for the block size's choice)
        self.draft_token_ms: float | None = None
        self.overhead_ms: float = 0.0  # per step: at the gateway, minus the pass
        self.rounds = 0

    def observe(
        self,
        k: int,
        accepted: int,
        cycle_ms: float,
        verify_ms: float,
        server_ms: float,
        draft_ms: float | None = None,
        critical_ms: float | None = None,
    ) -> None:
        """One lock-step round of k drafts: ``cycle_ms`` from the previous verdict (or Started)
        to this one, ``verify_ms`` its target pass and ``server_ms`` its time at the gateway;
        ``draft_ms`` what drafting the block took, ``critical_ms`` the part of it inside the
        cycle (None: drafted ahead, hidden)."""
        self.lengths.observe(k, accepted, verify_ms)
        if draft_ms is not None and k > 0:
            self.draft_token_ms = ema(self.draft_token_ms, draft_ms / k)
        self.rounds += 1
        idle = max(0.0, cycle_ms - verify_ms)
        self.idle_ms = ema(self.idle_ms, idle)
        self.link_ms = ema(self.link_ms, max(0.0, idle - (critical_ms or 0.0)))
        self.overhead_ms = ema(self.overhead_ms, max(0.0, server_ms - verify_ms))

    def _led_block(self, k: int, one_row: float) -> tuple[int, float]:
        """(drafts a cloud-led step verifies, ms from a correction to a Draft after it).

        A cloud-led edge sends each token as it drafts it, so a step finds about what it drafted
        during the step before (a step's worth of draft steps, at most k), and after a
        correction the edge's next Draft needs the link and one draft step, not a lock-step
        block's k: the lock-step idle counted the block's drafting where it was on the critical
        path, which at RTT 0 on a CPU made cloud-led look three to five steps behind after every
        rejection instead of one. Before the edge's draft step was measured: k and the idle."""
        per_token = self.draft_token_ms
        if per_token is None or self.link_ms is None:
            return k, self.idle_ms or 0.0
        supplied = max(1, round(one_row / max(per_token, 1e-3)))
        return min(k, supplied), self.link_ms + per_token

    def rates(self, k: int) -> tuple[float, float] | None:
        """(lock-step, cloud-led) expected tokens per ms at block size k; None before
        MIN_ROUNDS rounds."""
        lengths = self.lengths
        if self.rounds < MIN_ROUNDS or self.idle_ms is None:  # idle_ms: set by every round
            return None
        alphas = lengths.alphas()
        expected = lengths.expected_tokens()
        lock_step = float(expected[k]) / max(lengths.verify_cost(k + 1) + self.idle_ms, 1e-3)
        one_row = lengths.verify_cost(1) + self.overhead_ms
        led_k, delay = self._led_block(k, one_row)
        all_kept = float(np.prod(alphas[:led_k]))
        step = lengths.verify_cost(led_k + 1) + self.overhead_ms
        started = max(1, math.ceil(delay / max(one_row, 1e-3)))
        first = float(alphas[0])
        guessed = first if self.greedy else first / (2 - first)  # the edge's guess holds
        idle_steps = (1 - all_kept) * started / max(guessed, 1e-3)
        cloud_led = (float(expected[led_k]) + idle_steps) / max(step + idle_steps * one_row, 1e-3)
        return lock_step, cloud_led

    @staticmethod
    def lead_at_start(rtt_ms: float | None, step_ms: float) -> bool:
        """Before any round: Start's round trip (Started.setup_ms taken out; on a cold channel
        it also holds the connection's setup, which errs towards cloud-led, never slower than
        cloud-only) against the server's recent step (Started.step_ms, 0: unknown)."""
        return rtt_ms is not None and step_ms > 0 and rtt_ms >= LEAD_AT_START * step_ms

    def should_lead(self, k: int) -> bool:
        """Cloud-led's rate, as measured on this link where it was (``led``), else as modelled,
        beats lock-step's by MARGIN."""
        rates = self.rates(k)
        if rates is None:
            return False
        cloud_led = self.led.tokens_per_ms if self.led is not None else rates[1]
        return cloud_led >= MARGIN * rates[0]
