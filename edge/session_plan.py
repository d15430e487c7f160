"""The session plan: the mode a stream asks for at Start and what its rounds may do, decided once.

``SessionPlan.of`` reads the GenerationConfig and, in session mode ``auto``, the link the client's
previous Started measured (edge.mode_switch: a long round trip starts cloud-led) and what
cloud-led yielded on it (a cloud-led run that verified few drafts starts lock-step instead); a
stream with nothing measured on its link starts cloud-led.
``settled`` adds what this stream's Started says: the mode the server runs
(Started.session_mode: what it was asked, or lock-step where cloud-led was asked), whether
lock-step rounds may still hand over to cloud-led (the server accepts Draft.lead), and whether
the first Draft leads. The loops only read the plan.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from specsplit.edge.generation import AUTO, SESSION_MODES, GenerationConfig
from specsplit.edge.mode_switch import LeadChoice, Link, Yield
from specsplit.edge.stream import SpecsplitError
from specsplit.shared.protocol import PB_TO_SESSION_MODE, pb
from specsplit.shared.session_mode import SessionMode


@dataclass(frozen=True)
class SessionPlan:
    mode: SessionMode  # asked at Start; once settled, the mode the server runs
    auto: bool  # session mode auto: the edge chose the mode itself
    may_lead: bool  # lock-step rounds may hand over to cloud-led (Draft.lead)
    max_draft_tokens: int  # the largest k
    adaptive: bool  # k chosen per round (edge.adaptive), else max_draft_tokens
    obeys_hint: bool  # lock-step blocks shrink to the cloud's hint
    follow_hint: bool  # a cloud-led speculation reaches no further than the hint
    draft_ahead: bool  # lock-step drafts the next block while a verdict is in flight
    lead_first: bool = False  # settled: the first lock-step Draft leads
    led: Yield | None = None  # what cloud-led yielded on this link last (Link.cloud_led)
    led_pays: bool = True  # cloud-led, as measured on this link, was worth it (Link.led_pays)

    @classmethod
    def of(
        cls, cfg: GenerationConfig, cloud_only: bool = False, link: Link | None = None
    ) -> SessionPlan:
        """The plan of a stream of ``cfg`` (the target alone when ``cloud_only``); ``link``:
        what the client's previous Started measured."""
        may_lead = not cloud_only and cfg.may_lead
        if cloud_only:
            mode = SessionMode.CLOUD_ONLY
        elif cfg.session_mode not in SESSION_MODES:
            raise ValueError(f"session_mode must be one of {SESSION_MODES}")
        elif cfg.session_mode != AUTO:
            mode = SessionMode(cfg.session_mode)
        elif may_lead and _leads_from_start(link):
            mode = SessionMode.CLOUD_LED
        else:
            mode = SessionMode.LOCK_STEP
        return cls(
            mode=mode,
            auto=not cloud_only and cfg.session_mode == AUTO,
            may_lead=may_lead,
            max_draft_tokens=cfg.max_draft_tokens,
            adaptive=cfg.adapts,
            obeys_hint=cfg.obeys_hint,
            follow_hint=cfg.follow_hint,
            draft_ahead=cfg.draft_ahead,
            led=link.cloud_led if link is not None else None,
            led_pays=link is None or link.led_pays(),
        )

    @property
    def follows_lead(self) -> bool:
        """Start.follows_lead: lock-step rounds that may hand over also follow a handover the
        cloud starts (Verdict.led) when their first Draft is late, unless cloud-led, as measured
        on this link, did not pay (a late first Draft there is the edge's drafting, which
        cloud-led steps outrun as well)."""
        return self.may_lead and self.mode is SessionMode.LOCK_STEP and self.led_pays

    def settled(self, started: pb.Started, rtt_ms: float | None) -> SessionPlan:
        """The plan as ``started`` settles it; ``rtt_ms``: Start's round trip."""
        mode = self._mode_run(started)
        may_lead = self.may_lead and mode is SessionMode.LOCK_STEP and started.accepts_lead
        # A round trip of LEAD_AT_START target steps already: lead with the first Draft.
        lead_first = may_lead and LeadChoice.lead_at_start(rtt_ms, started.step_ms)
        return dataclasses.replace(self, mode=mode, may_lead=may_lead, lead_first=lead_first)

    def _mode_run(self, started: pb.Started) -> SessionMode:
        asked = self.mode
        mode = PB_TO_SESSION_MODE.get(started.session_mode)
        if mode is None:
            raise SpecsplitError(
                None, f"the server's Started has no known session_mode ({started.session_mode})"
            )
        # Lock-step where cloud-led was asked is a server's right; else the edge could not go
        # on: it drafts for the mode it asked for, or has no draft at all.
        if mode is not asked and (asked, mode) != (SessionMode.CLOUD_LED, SessionMode.LOCK_STEP):
            raise SpecsplitError(None, f"asked for session mode {asked}, the server runs {mode}")
        return mode


def _leads_from_start(link: Link | None) -> bool:
    """An auto stream is cloud-led from Start where the remembered link says so
    (``Link.starts_led``), and also where no auto generation has measured either mode on the
    link yet (a cold client): cloud-led from Start beat lock-step rounds that hand over, greedy
    in every cell measured at RTT 0-200 ms, sampled (T 0.7, the edge picking the seed so that
    both draft their first block while Start travels) at RTT 0 and 50 ms, level at 100 ms (2-core
    EPYC, 48 tokens, a new client each run: docs/design.md#auto)."""
    if link is not None and link.starts_led():
        return True
    return link is None or (link.lock_step is None and link.cloud_led is None)
