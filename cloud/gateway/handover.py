"""What a lock-step session hands cloud-led rounds when it switches (docs/design.md#handover).

The mode loops never call one another: ``lockstep_rounds`` ends by yielding a ``Handover``, and
the servicer's dispatcher (``cloud.gateway.service``), which owns the session's mode, goes on
with ``cloud_led_rounds`` from it. A ``PendingDraft`` is a Draft the gateway has read and checked
and holds for a step to verify: the lead Draft a handover carries, and every Draft in a
cloud-led session's pool.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from specsplit.cloud.capacity import Acceptance
from specsplit.shared.sampling import SparseDist

# A session's draft acceptance before any of its steps measured it, and the weight (in drafts)
# the prior keeps against them: even odds, so that a few measured steps decide. Cloud-led's wait
# after a correction reads it (cloud.gateway.cloud_led); a lock-step session measures it from
# its first block on and hands it over with the stream.
PRIOR_ACCEPTANCE, PRIOR_WEIGHT = 0.5, 2.0


def session_acceptance() -> Acceptance:
    """A session's acceptance estimate before any step measured it."""
    return Acceptance(prior=PRIOR_ACCEPTANCE, prior_weight=PRIOR_WEIGHT)


@dataclass(eq=False)  # compared by identity: two Drafts with equal fields are two Drafts
class PendingDraft:
    round: int
    base_len: int
    tokens: list[int]
    q: list[SparseDist] | None
    used: bool = False
    branch: bool = False  # Draft.branch: verified only where no other Draft is consistent

    @property
    def end(self) -> int:
        return self.base_len + len(self.tokens)

    def offset(self, committed: list[int]) -> int | None:
        """How many of its tokens are already committed, None when it is inconsistent."""
        off = len(committed) - self.base_len
        if not 0 <= off < len(self.tokens):
            return None
        return off if self.tokens[:off] == committed[self.base_len :] else None


@dataclass(frozen=True)
class Handover:
    """A lock-step session going on cloud-led. Either the edge asked (``lead``: its Draft.lead,
    checked, which the first cloud-led step verifies) or the server took the lead because no
    first Draft came in time (``reading``: the read of that Draft, still under way, which
    becomes the cloud-led reader's first read; the first cloud-led Verdict says Verdict.led)."""

    lead: PendingDraft | None = None
    reading: asyncio.Future | None = None
    # What the lock-step steps measured of the session's acceptance (session_acceptance() then
    # observed per Verdict): cloud-led rounds go on from it instead of from the prior alone.
    acceptance: Acceptance | None = None

    @property
    def server_led(self) -> bool:
        return self.reading is not None
