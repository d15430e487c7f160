"""What lock-step rounds hand cloud-led rounds when a stream switches (docs/design.md#handover).

The mode loops never call one another: ``lockstep_rounds`` (edge.lockstep) ends by yielding a
``Handover``, and the stream's dispatcher (edge.rounds), which owns the mode, goes on with
``cloud_led_rounds`` (edge.cloud_led) from it.
"""

from __future__ import annotations

from dataclasses import dataclass

from specsplit.edge.adaptive import DraftLength
from specsplit.edge.drafting import Block
from specsplit.shared.protocol import pb


@dataclass(frozen=True)
class Handover:
    """A lock-step stream going on cloud-led: its Draft.lead, or the Draft the cloud was
    waiting for when it took the lead itself (``led``); or a cloud-led stream's first block,
    sent before Started came (``with_start``, edge.rounds)."""

    round: int  # the lead Draft's round
    block: Block  # its drafts, sent from the committed prefix
    remaining: int  # tokens to go when it was sent
    acceptance: DraftLength  # what the lock-step rounds measured, per position
    # The cloud's first cloud-led Verdict, when the cloud took the lead itself (Verdict.led),
    # read by the lock-step loop: the first the cloud-led rounds commit.
    led: pb.Verdict | None = None
    # Sent right behind Start, from the prompt: the cloud's progress while it travelled (one
    # prefill) says nothing of the round trip, so its Verdict measures no lag (edge.cloud_led)
    with_start: bool = False
