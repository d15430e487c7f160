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
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

from specsplit.cloud.gateway.handover import Handover, PendingDraft
from specsplit.cloud.gateway.messages import next_draft
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
    Draft.lead, or ``lead_after_s`` > 0 passed with no first Draft (the server leads)."""
    session = step.session
    if lead_after_s > 0:
        reading = asyncio.ensure_future(next_draft(messages, None))
        try:
            done, _ = await asyncio.wait({reading}, timeout=lead_after_s)
        except BaseException:
            reading.cancel()
            with contextlib.suppress(BaseException):
                await reading
            raise
        if not done:  # the target would idle: it leads, the read goes on in cloud-led's reader
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
            yield Handover(lead=PendingDraft(draft.round, draft.base_len, list(draft.tokens), q))
            return
        verdict = await step.verdict(list(draft.tokens), q, t0)
        verdict.round, verdict.drafts_verified = draft.round, len(draft.tokens)
        yield verdict
        if session.finish is not Finish.NONE:
            return
        draft = await next_draft(messages, idle_s)
