"""Cloud-led sessions (session mode CLOUD_LED, docs/design.md#cloud-led): the target never waits for
the network.

The target steps continuously, as in cloud-only. A reader task takes Drafts as they arrive into
a small pool; before every step the most recently received Draft consistent with the committed
prefix lends its tokens beyond committed_len to that step's forward pass, which verifies them
with the session's rule. Stale Drafts are dropped and counted, never an error.

Why it is lossless: each step is one round of speculative sampling at committed_len c (k = 0
when no Draft fits), whose output follows p exactly for any k and any proposal, provided every
verified token was sampled from the q sent with it, with randomness independent of the step's.
The edge's randomness is its own stream (keyed by position, and a position is verified at most
once: afterwards it is committed); the step's randomness is keyed by (seed, c) as in lock-step,
and c grows strictly from step to step, so every step draws fresh numbers whether or not a Draft
came. Which Draft is picked depends only on timing and on tokens before c, never on the numbers
the step draws. The consistency check is what makes drafts worth verifying (tokens drafted after
another prefix are rarely accepted); correctness does not depend on it.

The tokens a step draws with no draft deciding them (k = 0, or the bonus) use the session's
shared numbers at their position (shared/coupling.py), the ones the edge drew its speculation
for that position with. Those numbers feed no accept test, and the history before a position
does not depend on them, so each such draw is still exactly p; but it often equals the edge's
token there, so the edge's Drafts after it stay consistent at T > 0 (with independent numbers
they agreed with probability sum p*q, below one half on prose at T = 0.7).

After a step that rejected a draft, every Draft in the pool continues the rejected token, so the
next step would verify nothing (a draftless pass) until the edge has heard of the correction and
sent drafts after it, a round trip plus a draft token later. Whether the next step waits for
them is a break-even. Stepping at once makes one token in a one-row step s_1 (Started.step_ms),
the cloud-only rate. Waiting w for a Draft of k tokens and verifying it makes, in expectation,
E(a, k) = (1 - a^(k+1)) / (1 - a) tokens in w + s_(k+1), a pass of k + 1 rows. Waiting pays when
it makes tokens faster than the draftless step, E(a, k) / (w + s_(k+1)) > 1 / s_1, that is

    w < w* = E(a, k) * s_1 - s_(k+1)

so the step waits while the Draft is measured due within min(w*, s_1) of the rejecting Verdict,
and at most until then: one step is the hard cap a lost Draft stalls the session, and a Draft
that comes when measured keeps the expected rate at or above cloud-only's. ``_Due`` holds the
measurements: a, the session's acceptance over its steps that verified drafts, the lock-step ones
before a handover included (cloud.capacity.Acceptance, cloud.gateway.handover.session_acceptance;
before any, the prior PRIOR_ACCEPTANCE: at k = 1 and free rows it waits up to half a step); k,
the tokens the first consistent Draft after a correction held (1 before any: the edge sends
each token as it drafts it, edge/cloud_led.py); s_(k+1) / s_1 from
the gateway's cost curve (cloud.capacity.CostModel, 1 until it has two sizes); the delay from
the rejecting Verdict to that Draft, an average over corrections (before any, one wait up to the
bound measures it). On a long link the Draft is due later than w*, and the cloud steps on at
once, as in cloud-only. The wait depends only on timing, never on the numbers a step draws, so
the output is unchanged (lossless as above). ``AfterRejection`` counts what the passes after a
correction found, the draftless ones split by whether the step had waited.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass

from specsplit.cloud.capacity import StepTime, expected_tokens
from specsplit.cloud.gateway.handover import Handover, PendingDraft, session_acceptance
from specsplit.cloud.gateway.messages import next_draft
from specsplit.cloud.gateway.round import Round
from specsplit.cloud.gateway.session import Code, Finish, ProtocolError
from specsplit.shared.protocol import pb

log = logging.getLogger(__name__)

# Drafts held at once: the edge sends its freshest speculation, older ones go stale; a greedy
# edge also sends branches, each followed by its speculation again (edge/cloud_led.py
# BRANCHES), which a branch must outlive for the few steps until the cloud reaches its position
POOL = 16
WAIT_CAP_STEPS = 1.0  # the longest wait after a rejection, in one-row steps


def reads_per_step(max_draft_tokens: int) -> int:
    """Drafts read between two target steps, at most. An edge sends one message per drafted
    token and may reach max_draft_tokens past committed_len (Draft.continues), plus a restart
    after a Verdict: twice that leaves it room. More cannot be verified before the next step,
    so they wait in the client under gRPC flow control instead of costing the gateway's loop a
    decode and a check each, at whatever rate a client can send."""
    return 2 * (max_draft_tokens + 1)


class DraftPool:
    def __init__(self) -> None:
        self.drafts: deque[PendingDraft] = deque()
        self.dropped = 0  # removed without ever being verified
        self.used = 0
        self.last: PendingDraft | None = None  # the Draft the previous message went into

    def add(self, draft: PendingDraft, continues: bool = False, committed_len: int = 0) -> None:
        """A new Draft; a continuation (Draft.continues) extends the previous Draft instead,
        while that one is still held, ends where the continuation starts and is no branch."""
        if continues:
            parent = self.last
            extends = parent is not None and not parent.branch and parent.end == draft.base_len
            if extends and parent in self.drafts:
                parent.tokens += draft.tokens
                if parent.q is not None and draft.q is not None:
                    parent.q += draft.q
                parent.round = draft.round
                return
            if draft.base_len > committed_len:  # its start is unknown here: nothing to verify
                self.dropped += 1
                self.last = None
                return
        self.last = draft
        self.drafts.append(draft)
        if len(self.drafts) > POOL:
            self._drop(self.drafts.popleft())

    def _drop(self, draft: PendingDraft) -> None:
        self.dropped += not draft.used

    @staticmethod
    def _best(consistent: Iterable[PendingDraft]) -> PendingDraft | None:
        """The freshest of ``consistent`` (oldest first) not a branch (Draft.branch), else
        the freshest branch: a branch is the edge's second choice, sent just before its
        speculation again, and must not win by arriving between the two."""
        main = branch = None
        for draft in consistent:
            if draft.branch:
                branch = draft
            else:
                main = draft
        return main or branch

    def ahead(self, committed: list[int]) -> int:
        """Tokens the Draft held here that a step at ``committed`` would verify has after it
        (0: none)."""
        best = self._best(d for d in self.drafts if d.offset(committed) is not None)
        return 0 if best is None else len(best.tokens) - best.offset(committed)

    def take(self, committed: list[int], limit: int) -> tuple[PendingDraft | None, list, list]:
        """The freshest consistent Draft (a branch only where no other is) and its next
        ``limit`` tokens (and q) after committed_len; stale Drafts leave the pool."""
        keep = deque()
        for draft in self.drafts:
            if draft.offset(committed) is None:
                self._drop(draft)
            else:
                keep.append(draft)
        self.drafts = keep
        best = self._best(keep)
        if best is None or limit <= 0:
            return None, [], []
        self.used += not best.used
        best.used = True
        off = best.offset(committed)
        tokens = best.tokens[off : off + limit]
        return best, tokens, [] if best.q is None else best.q[off : off + limit]


@dataclass
class AfterRejection:
    """Cloud-led passes right after a pass that rejected a draft, by what they found."""

    passes: int = 0
    waited: int = 0  # waited for a Draft consistent with the correction, and one came in time
    # Draftless: the step waited its bound out and nothing consistent had reached the cloud ...
    draftless_waited: int = 0
    # ... or it did not wait (the Draft measured due later than waiting pays, no step measured)
    draftless_unwaited: int = 0


class _Due:
    """When a Draft consistent with a step's correction arrives after the rejecting Verdict, and
    how long the next step waits for it (the break-even in the module docstring): the delay
    (ms, an average over corrections), the tokens that Draft held after committed_len, and
    whether one is awaited now."""

    def __init__(self) -> None:
        self.ms: float | None = None
        self.k: float | None = None
        self.since: float | None = None  # the rejecting Verdict, while none arrived yet
        self.arrived = asyncio.Event()

    def rejected(self, now: float) -> None:
        self.since = now
        self.arrived.clear()

    def observe(self, pool: DraftPool, committed: list[int], now: float) -> None:
        """After the reader added a Draft: is one consistent with the correction here now?"""
        if self.since is None or not (k := pool.ahead(committed)):
            return
        self._delay((now - self.since) * 1e3)
        self.k = k if self.k is None else 0.7 * self.k + 0.3 * k
        self.since = None
        self.arrived.set()

    def expired(self, now: float) -> None:
        """A wait ran its bound out with nothing measured before: the delay is at least that."""
        if self.since is not None and self.ms is None:
            self._delay((now - self.since) * 1e3)

    def _delay(self, ms: float) -> None:
        self.ms = ms if self.ms is None else 0.7 * self.ms + 0.3 * ms

    def bound_ms(self, steps: StepTime, acceptance: float, limit: int) -> float:
        """min(w*, WAIT_CAP_STEPS * s_1): the longest a step after a rejection waits (ms)."""
        s_1 = steps.ms
        if s_1 <= 0 or limit <= 0:
            return 0.0
        k = min(limit, max(1, round(self.k or 1)))
        costs = steps.costs
        rows = costs.cost(k + 1) / costs.cost(1) if len(costs.ms) >= 2 else 1.0
        w = expected_tokens(acceptance, k) * s_1 - rows * s_1
        return max(0.0, min(w, WAIT_CAP_STEPS * s_1))

    def wait_s(self, steps: StepTime, acceptance: float, limit: int, now: float) -> float:
        """How long the next step waits for a consistent Draft from ``now`` (s): 0 unless one is
        awaited and, as measured (or not measured yet), due within the bound."""
        if self.since is None or steps.ms <= 0:
            return 0.0
        bound = self.bound_ms(steps, acceptance, limit)
        if self.ms is not None and self.ms > bound:
            return 0.0
        return max(0.0, self.since + bound / 1e3 - now)


class ReadingTail:
    """Where a cloud-led loop that ran to its end leaves its reader, still reading (and
    dropping) the client's late Drafts until the half-close. The servicer's dispatcher hands
    one in; the servicer awaits ``reader`` (cloud.gateway.messages.until_half_close) once
    Finished is sent and the session is freed."""

    def __init__(self) -> None:
        self.reader: asyncio.Task | None = None  # None: nothing reads the stream any more


async def cloud_led_rounds(
    step: Round,
    messages,
    tail: ReadingTail,
    handover: Handover | None = None,
    after_rejection: AfterRejection | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> AsyncIterator[pb.Verdict]:
    """Verdicts of a cloud-led session, one per target step, until generation ends, its reader
    then left in ``tail``; from a lock-step session's ``handover`` (cloud.gateway.handover): its
    lead Draft is verified by the first step; where the server took the lead, the read of the
    first Draft still under way is the reader's first read, a lead Draft sent before the client
    heard of the switch is read as an ordinary one, and the first Verdict says Verdict.led.
    ``after_rejection`` counts the passes after a correction (logged at the end either way);
    ``clock`` (seconds) times the waits after them."""
    first = handover.lead if handover is not None else None
    reading = handover.reading if handover is not None else None
    session = step.session
    pool = DraftPool()
    if first is not None:
        pool.add(first)
    refused: list[ProtocolError] = []
    stop = asyncio.Event()
    budget = reads_per_step(session.limits.max_draft_tokens)
    credit = [budget]  # Drafts the reader may still read before the next step
    stepped = asyncio.Event()

    async def next_read():
        nonlocal reading
        if reading is None:
            return await next_draft(messages, None)
        pending, reading = reading, None
        return await pending

    took_lead = led_first = reading is not None
    due = _Due()
    measured = handover.acceptance if handover is not None else None
    acceptance = measured if measured is not None else session_acceptance()
    counts = after_rejection if after_rejection is not None else AfterRejection()
    rejected = False  # the previous step rejected a draft

    async def read() -> None:
        try:  # no idle timeout: the edge may stop drafting while the cloud streams on
            while (d := await next_read()) is not None:
                credit[0] -= 1
                if credit[0] <= 0:
                    stepped.clear()
                    await stepped.wait()
                if isinstance(d, pb.Finish):
                    break
                if session.finish is not Finish.NONE:
                    continue  # sent before the client heard the final verdict: not an error
                if d.lead and not took_lead:
                    raise ProtocolError(
                        Code.INVALID_ARGUMENT, "Draft.lead is only valid in a lock-step session"
                    )
                q = step.check(d, exact_base=False)
                draft = PendingDraft(d.round, d.base_len, list(d.tokens), q, branch=d.branch)
                pool.add(draft, d.continues, session.committed_len)
                due.observe(pool, session.committed, clock())
            else:
                return  # a half-close: the client only listens from now on
        except ProtocolError as e:
            refused.append(e)
        stop.set()

    reader = asyncio.create_task(read())
    limit = session.limits.max_draft_tokens
    try:
        while session.finish is Finish.NONE:
            if stop.is_set():
                if refused:
                    raise refused[0]
                session.finish = Finish.CANCELLED
                break
            draft, tokens, q = pool.take(session.committed, limit)
            wait_s = 0.0
            if draft is None:
                wait_s = due.wait_s(step.steps, acceptance.rate, limit, clock())
            if wait_s > 0:  # a Draft after the correction is due sooner than waiting costs
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(due.arrived.wait(), wait_s)
                draft, tokens, q = pool.take(session.committed, limit)
                if draft is None:
                    due.expired(clock())
            if rejected:
                counts.passes += 1
                counts.waited += wait_s > 0 and draft is not None
                counts.draftless_waited += wait_s > 0 and draft is None
                counts.draftless_unwaited += wait_s == 0 and draft is None
            t0 = time.perf_counter()
            round_no = draft.round if draft is not None else 0  # a continuation may come in
            verdict = await step.verdict(tokens, q, t0)
            credit[0] = budget
            stepped.set()
            verdict.round = round_no
            verdict.drafts_dropped = pool.dropped
            verdict.drafts_verified = len(tokens)
            verdict.led, led_first = led_first, False  # the server took the lead: say so once
            if tokens:
                acceptance.observe(verdict.accepted, len(tokens))
            rejected = verdict.has_token and verdict.accepted < len(tokens)  # a correction
            if rejected:
                due.rejected(clock())
            yield verdict  # its hint caps the edge's speculation; the edge obeys it there
    except BaseException:
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await reader
        raise
    else:
        # Never cancelled mid-read (that closes the request stream): it reads on, dropping
        # late Drafts, until the client half-closes (cloud/gateway/messages.py until_half_close),
        # with no step left to wait for.
        credit[0] = 1 << 62
        stepped.set()
        tail.reader = reader
    finally:
        session.drafts_dropped = pool.dropped + sum(not d.used for d in pool.drafts)
        session.drafts_used = pool.used
        log.debug("cloud-led passes after a rejection: %s", counts)
