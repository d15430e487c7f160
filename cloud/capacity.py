"""What a forward pass costs by rows, and the block size the cloud wants from edges now.

A target forward pass reads every weight once whatever its rows, so on any hardware its time is
nearly flat in rows until the pass turns compute-bound, then grows with them. Long drafts are
free in the flat part and waste target compute past it (vLLM measured speculative decoding
1.4-1.8x slower than plain serving at high load). The cloud therefore measures the cost curve
(calibrated at load, refined by every pass) and, per Verdict, hints the block size k that
maximises tokens per second of the whole batch:

    tokens(k) = other_tokens + S * E(k),    E(k) = (1 - a^(k+1)) / (1 - a)
    time(k)   = cost(other_rows + S * (k + 1))

with S speculative sessions in the batch, acceptance a measured over recent rounds, and the
other rows (cloud-only steps) fixed; a prefill's rows are left out, as the next pass will not
have them. Edges draft min(their own k, the hint).
"""

from __future__ import annotations

import bisect
import itertools
import math
import statistics
from collections import deque
from collections.abc import Callable

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
CALIBRATION_ROWS = (1, 4, 16, 64, 128)


class CostModel:
    """Forward-pass milliseconds as a function of rows: the median of the recent passes per
    bucket of rows (powers of two; a pass's time is scaled to its bucket along the current
    curve), interpolated linearly between buckets. Medians, because one pass stalled by the OS
    must not swing the hints of every edge."""

    def __init__(self, window: int = 15, stale_after: int = 200):
        self.window = window
        self.stale_after = stale_after  # passes without a sample of a bucket: re-measure it
        self.samples: dict[int, deque[float]] = {}
        self.ms: dict[int, float] = {}
        self.passes = 0
        self._seen: dict[int, int] = {}  # bucket -> the pass that last measured (or probed) it

    def observe(self, rows: int, ms: float) -> None:
        if rows < 1 or not math.isfinite(ms) or ms <= 0:
            return
        self.passes += 1
        bucket = _bucket(rows)
        self._seen[bucket] = self.passes
        if bucket != rows and len(self.ms) >= 2:
            ms *= self.cost(bucket) / max(self.cost(rows), 1e-9)
        window = self.samples.setdefault(bucket, deque(maxlen=self.window))
        window.append(ms)
        self.ms[bucket] = statistics.median(window)

    def probe(self, rows: int) -> bool:
        """True (once per ``stale_after`` passes) when the bucket of ``rows`` was measured but
        not lately. A pass stalled by contention can make large blocks look costly; the hint
        then asks for none, no pass of that size runs, and the stale median would forbid
        drafting for good. A probe asks for one such pass, whose time corrects the curve."""
        bucket = _bucket(rows)
        if bucket not in self._seen or self.passes - self._seen[bucket] < self.stale_after:
            return False
        self._seen[bucket] = self.passes
        return True

    def cost(self, rows: float) -> float:
        """Estimated ms for a pass of ``rows`` rows (0 when nothing was measured yet)."""
        if not self.ms:
            return 0.0
        xs = sorted(self.ms)
        ys = list(itertools.accumulate((self.ms[x] for x in xs), max))  # more rows never cost less
        if len(xs) == 1 or rows <= xs[0]:
            return ys[0] if rows <= xs[0] else ys[0] * rows / xs[0]
        i = min(bisect.bisect_left(xs, rows), len(xs) - 1)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        slope = max((y1 - y0) / (x1 - x0), 0.0)  # extrapolates past the last bucket too
        return y0 + slope * (rows - x0)

    def calibrate(
        self,
        run: Callable[[int], float],
        rows: tuple[int, ...] = CALIBRATION_ROWS,
        repeats: int = 3,
    ):
        """Times ``run(rows)`` (which returns ms) a few times per size, after one warm-up."""
        run(1)
        for _ in range(repeats):
            for n in rows:
                self.observe(n, run(n))


class StepTime:
    """Started.step_ms: what one target step costs a session that verifies no draft, lately.

    Each pass's time is scaled along the measured cost curve from its rows to the rows it would
    have had with this session's part cut to one row (the other sessions' rows stay: under load
    a step is the batch's pass), and the median of the recent passes is reported. Where rows cost
    time (a CPU target: a pass over 9 rows took ~1.8x one over 1 here) the plain median of
    lock-step passes overstated the step a lead would take; where they are nearly free (a GPU
    target) the two agree. Until the curve has two sizes the scale is 1 (errs towards lock-step).
    """

    def __init__(self, kept: int = 64):
        self.costs = CostModel()
        self.recent: deque[float] = deque(maxlen=kept)

    def observe(self, rows: int, batch_rows: int, ms: float) -> None:
        """A pass that verified ``rows`` rows of one session within ``batch_rows`` in all (0:
        not batched)."""
        batch = max(rows, batch_rows)
        self.costs.observe(batch, ms)
        scale = 1.0
        if len(self.costs.ms) >= 2:  # one size seen says nothing about what rows cost
            scale = min(1.0, self.costs.cost(batch - rows + 1) / self.costs.cost(batch))
        self.recent.append(ms * scale)

    @property
    def ms(self) -> float:
        return statistics.median(self.recent) if self.recent else 0.0


def _bucket(rows: float) -> int:
    return min(BUCKETS, key=lambda b: abs(math.log2(b) - math.log2(rows)))


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens a round of k drafts commits on average (accepted drafts + the correction/bonus)."""
    alpha = min(max(alpha, 0.0), 0.999)
    return (1 - alpha ** (k + 1)) / (1 - alpha)


def max_draft_tokens_hint(
    cost: CostModel,
    spec_sessions: int,
    other_rows: int,
    other_tokens: float,
    alpha: float,
    max_draft_tokens: int,
    tolerance: float = 0.05,
) -> int:
    """The largest k in [0, max_draft_tokens] whose batch throughput (tokens per ms) is within
    ``tolerance`` of the best k's: while passes cost about the same whatever their rows, that is
    max_draft_tokens, and measurement noise never shortens drafts. Now and then max_draft_tokens
    instead, when the pass that would take is stale in ``cost`` (CostModel.probe)."""
    if spec_sessions < 1 or not cost.ms:
        return max_draft_tokens
    rates = []
    for k in range(max_draft_tokens + 1):
        tokens = other_tokens + spec_sessions * expected_tokens(alpha, k)
        ms = cost.cost(other_rows + spec_sessions * (k + 1))
        rates.append(tokens / ms if ms > 0 else math.inf)
    best = max(rates)
    hint = max(k for k, rate in enumerate(rates) if rate >= (1 - tolerance) * best)
    if hint < max_draft_tokens and cost.probe(other_rows + spec_sessions * (max_draft_tokens + 1)):
        return max_draft_tokens  # one pass re-measures what the curve forbids
    return hint


class Acceptance:
    """Per-draft acceptance a over recent speculative rounds: the maximum-likelihood estimate
    accepted / (accepted + rejections) under the i.i.d. model behind E(k), with older rounds
    decaying so the estimate follows the traffic.

    Where extra rows cost time (a compute-bound CPU target), a few early rejections can make the
    hint ask for no drafts; then no round brings evidence, and the low estimate would forbid
    drafting for good. So every pass that carried no draft because the last hint forbade them
    (``idle``) pulls the estimate back towards the prior, quickly: a few such passes and the hint
    asks for drafts again, whose verdicts then say whether they pay (as ``CostModel.probe``
    does for costs). Passes without drafts for other reasons (a cloud-led step whose drafts
    are still on their way) say nothing about acceptance and leave it alone."""

    def __init__(
        self,
        decay: float = 0.98,
        prior: float = 0.8,
        prior_weight: float = 5.0,
        idle_decay: float = 0.7,
    ):
        self.decay, self.idle_decay = decay, idle_decay
        self.prior_accepted, self.prior_rejected = prior * prior_weight, (1 - prior) * prior_weight
        self.accepted, self.rejected = self.prior_accepted, self.prior_rejected

    def observe(self, accepted: int, drafted: int) -> None:
        if drafted > 0:
            self.accepted = self.decay * self.accepted + accepted
            self.rejected = self.decay * self.rejected + (1 if accepted < drafted else 0)

    def idle(self) -> None:
        """A pass of speculative sessions without a draft after a hint of 0: back towards the
        prior."""
        keep = self.idle_decay
        self.accepted = keep * self.accepted + (1 - keep) * self.prior_accepted
        self.rejected = keep * self.rejected + (1 - keep) * self.prior_rejected

    @property
    def rate(self) -> float:
        return self.accepted / (self.accepted + self.rejected)
