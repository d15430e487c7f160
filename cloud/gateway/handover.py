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

from specsplit.shared.sampling import SparseDist


@dataclass(eq=False)  # compared by identity: two Drafts with equal fields are two Drafts
class PendingDraft:
    round: int
    base_len: int
    tokens: list[int]
    q: list[SparseDist] | None
    used: bool = False

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

    @property
    def server_led(self) -> bool:
        return self.reading is not None
