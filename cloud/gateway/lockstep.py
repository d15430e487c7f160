"""Lock-step sessions on the cloud (docs/design.md#lock-step): one Draft in, one target step, one
Verdict out.

A Draft with ``lead`` set (Started.accepts_lead) hands the stream over to cloud-led rounds, as if
Start had asked for them: the loop ends by yielding a ``Handover`` (cloud.gateway.handover) that
carries that Draft, and the servicer's dispatcher goes on with cloud-led rounds, whose first
step verifies it. The edge asks for that when its measurements say the
round trip costs more than the extra target steps a cloud-led session spends after a rejected
block (edge/mode_switch.py).

The server takes that lead itself in a session whose client follows it (Start.follows_lead):
when no first Draft has come ``lead_after_ms`` after Started (LEAD_AFTER_STEPS one-row steps,
the proto's Started.lead_after_ms), the target would idle for longer than lock-step can win
back, so it steps on its own from then on and says so in its first Verdict (Verdict.led). The
read of the first Draft still under way goes with the Handover and becomes the cloud-led
reader's first read: the client's Draft, whenever it comes, is then an ordinary cloud-led Draft.

Where the client answers a Probe (Start.probe, docs/design.md#probe), the server need not wait
the bound out to learn that the first Draft is late: that Draft leaves the edge after Started
arrives there, so it comes a round trip after Started at the earliest. The round trip the
Probe measured during prefill (``Echoes.rtt_s``: exact once the Echo came, else a lower bound
that grows) reaching the bound is the same evidence, earlier: the server leads at once, or the
moment the unanswered Probe's age reaches the bound. Only when the server leads changes, never
what a step computes: lossless as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

from specsplit.cloud.gateway.handover import Handover, PendingDraft, session_acceptance
from specsplit.cloud.gateway.messages import Echoes, next_draft
from specsplit.cloud.gateway.round import Round
from specsplit.cloud.gateway.session import Finish
from specsplit.shared.protocol import pb
from specsplit.shared.session_mode import SessionMode

# Equal to edge.mode_switch.LEAD_AT_START (tests/cloud/gateway/test_server_lead.py keeps them
# equal): the round trip, in one-row steps, past which lock-step idles the target longer per
# block than a step takes. A first Draft later than this many steps after Started is the same
# evidence, measured at the server: the round trip plus the edge's drafting.
LEAD_AFTER_STEPS = 1.5


def lead_after_ms(follows_lead: bool, mode: SessionMode, step_ms: float) -> float:
    """Started.lead_after_ms for a session: LEAD_AFTER_STEPS times the server's recent one-row
    step (Started.step_ms) where the client follows a lead in a lock-step session, else 0 (no
    lead: also while no step has been measured, when the bound would be a guess)."""
    if not follows_lead or mode is not SessionMode.LOCK_STEP or step_ms <= 0:
        return 0.0
    return LEAD_AFTER_STEPS * step_ms


async def lockstep_rounds(
    step: Round, messages, idle_s: float, lead_after_s: float = 0.0
) -> AsyncIterator[pb.Verdict | Handover]:
    """Verdicts of a lock-step session, one per Draft, until generation ends (or the client
    half-closes, or stays silent ``idle_s`` after a Verdict); or, last, a Handover: the edge's
    Draft.lead, or ``lead_after_s`` > 0 passed with no first Draft (the server leads), or
    sooner where ``messages`` are Echoes whose Probe measured a round trip that long."""
    session = step.session
    acceptance = session_acceptance()  # handed over with the stream: cloud-led goes on from it
    if lead_after_s > 0:
        probed = isinstance(messages, Echoes) and messages.sent_at is not None
        probe = messages if probed else None
        reading = asyncio.ensure_future(next_draft(messages, None))
        try:
            came = await _in_time(reading, lead_after_s, probe)
        except BaseException:
            reading.cancel()
            with contextlib.suppress(BaseException):
                await reading
            raise
        if not came:  # the target would idle: it leads, the read goes on in cloud-led's reader
            yield Handover(reading=reading)
            return
        draft = reading.result()
    else:
        draft = await next_draft(messages, idle_s)
    while draft is not None:
        if isinstance(draft, pb.Finish):
            session.finish = Finish.CANCELLED
            return
        t0 = time.perf_counter()
        q = step.check(draft)
        if draft.lead:
            lead = PendingDraft(draft.round, draft.base_len, list(draft.tokens), q)
            yield Handover(lead=lead, acceptance=acceptance)
            return
        verdict = await step.verdict(list(draft.tokens), q, t0)
        verdict.round, verdict.drafts_verified = draft.round, len(draft.tokens)
        acceptance.observe(verdict.accepted, len(draft.tokens))
        yield verdict
        if session.finish is not Finish.NONE:
            return
        draft = await next_draft(messages, idle_s)


async def _in_time(reading: asyncio.Future, bound_s: float, probe: Echoes | None) -> bool:
    """Whether the first Draft (``reading``) came before the server leads: within ``bound_s``
    of Started (now), and only while the round trip ``probe`` measured may be shorter than
    ``bound_s`` (a first Draft comes a round trip after Started at the earliest)."""
    deadline = time.perf_counter() + bound_s
    echoed = None if probe is None else asyncio.ensure_future(probe.echoed.wait())
    try:
        while True:
            now = time.perf_counter()
            rtt_s = probe.rtt_s(now) if probe is not None else None
            if now >= deadline or (rtt_s is not None and rtt_s >= bound_s):
                return False
            wake, waits = deadline, {reading}
            if probe is not None and probe.echo_at is None:  # the lower bound grows until then
                wake = min(wake, probe.sent_at + bound_s)
                waits.add(echoed)
            done, _ = await asyncio.wait(waits, timeout=wake - now)
            if reading in done:
                return True
    finally:
        if echoed is not None:
            echoed.cancel()
