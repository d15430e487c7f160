"""Lock-step sessions on the cloud (docs/design.md#lock-step): one Draft in, one target step, one
Verdict out.

A Draft with ``lead`` set (Started.accepts_lead) hands the stream over to cloud-led rounds
(cloud/gateway/cloud_led.py), as if Start had asked for them: that Draft is the first in their pool,
so the first cloud-led step verifies it. The edge asks for that when its measurements say the
round trip costs more than the extra target steps a cloud-led session spends after a rejected
block (edge/mode_switch.py).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from specsplit.cloud.gateway.cloud_led import PendingDraft, cloud_led_rounds
from specsplit.cloud.gateway.messages import next_draft
from specsplit.cloud.gateway.round import Round
from specsplit.cloud.gateway.session import Finish
from specsplit.shared.protocol import pb


async def lockstep_rounds(step: Round, messages, idle_s: float) -> AsyncIterator[pb.Verdict]:
    """Verdicts of a lock-step session, one per Draft, until generation ends (or the client
    half-closes, or stays silent ``idle_s`` after a Verdict)."""
    session = step.session
    while (draft := await next_draft(messages, idle_s)) is not None:
        if isinstance(draft, pb.Finish):
            session.finish = Finish.CANCELLED
            return
        t0 = time.perf_counter()
        q = step.check(draft)
        if draft.lead:
            first = PendingDraft(draft.round, draft.base_len, list(draft.tokens), q)
            async for verdict in cloud_led_rounds(step, messages, first):
                yield verdict
            return
        verdict = await step.verify(list(draft.tokens), q, t0)
        verdict.round, verdict.drafts_verified = draft.round, len(draft.tokens)
        yield verdict
        if session.finish is not Finish.NONE:
            return
