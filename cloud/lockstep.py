"""Lock-step sessions on the cloud (DESIGN §2): one Draft in, one target step, one Verdict out.

A Draft with ``lead`` set (Started.accepts_lead) hands the stream over to cloud-led rounds
(cloud/cloud_led.py), as if Start.cloud_led had been set: that Draft is the first in their pool,
so the first cloud-led step verifies it. The edge asks for that when its measurements say the
round trip costs more than the extra target steps a cloud-led session spends after a rejected
block (edge/mode_switch.py).
"""

from __future__ import annotations

import time

from specsplit.cloud.cloud_led import PendingDraft, cloud_led_rounds
from specsplit.cloud.limits import next_message
from specsplit.cloud.session import Code, Finish, ProtocolError, Session
from specsplit.shared.acceptance import Mode


async def lockstep_rounds(service, session: Session, triton, it):
    """Verdicts of a lock-step session, one per Draft, until generation ends."""
    idle_s = service.limits.idle_timeout_s
    while (msg := await next_message(it, idle_s, "Draft or Finish")) is not None:
        kind = msg.WhichOneof("msg")
        if kind == "finish":
            session.finish = Finish.CANCELLED
            return
        if kind != "draft":
            raise ProtocolError(Code.FAILED_PRECONDITION, f"unexpected {kind} after Start")
        t0 = time.perf_counter()
        draft = msg.draft
        session.check_draft(draft.base_len, draft.tokens, len(draft.q), continues=draft.continues)
        q = service._parse_q(draft) if session.mode is Mode.REJECTION else None
        if draft.lead:
            first = PendingDraft(draft.round, draft.base_len, list(draft.tokens), q)
            async for verdict in cloud_led_rounds(service, session, triton, it, first):
                yield verdict
            return
        verdict = await service._round(session, triton, list(draft.tokens), q, t0)
        verdict.round, verdict.drafts_verified = draft.round, len(draft.tokens)
        yield verdict
        if session.finish is not Finish.NONE:
            return
