"""Who may open a session now: the one owner of how many sessions and how much memory
(docs/design.md#admission): a cap on streams at once, per-token quotas and the target's KV memory
budget.

A bare session count admits 64 one-token prompts and 64 max_context ones alike, though the
second set holds orders of magnitude more KV memory in Triton. So every admitted session
reserves the KV slot the target holds for it, computed exactly as the target allocates it
(``cloud.kv_growth``): a slot starts at 64 positions and doubles, each position holding keys and
values of every layer. A session at committed length c holds at most c + one verification block
positions, so it reserves that slot's size class: at its Start for its prompt, and again before
each step, growing (never shrinking) when c crosses into the next class. What a session could
grow to (max_new_tokens, "as many as fit" for an OpenAI request without max_tokens) costs
nothing until it is generated. Bytes are counted at the target's own bytes per position (its
KV dtype, reported with every session's start; the serve flags' guess until then).

The budget is the sum the target may hold: what the targets can still hold for this gateway as
they report with every session's start (``observe_capacity``: a target's KV capacity less what
other gateways' sessions hold there), so gateways sharing a target share its capacity; and
``budget_bytes`` (the serve flags'; None: none of its own) caps it further. The target
enforces its capacity itself (a growth beyond it is refused, retryably); the gateway's count
only keeps refusals early and cheap. A Start or a growth that would exceed the budget is refused
with RESOURCE_EXHAUSTED and a retry hint (after trying the reclaim policy below); a refused
growth ends its stream, and the edge re-opens from its committed sequence when the hint says
(nothing the edge holds is lost). A slot larger than the whole budget is refused without a
hint: waiting cannot help. A reservation is released exactly once, however the session ends.

The cap counts every open stream, admitted or still waiting for its Start. Two quotas cap what
one client holds at once: its streams, and the KV bytes its sessions reserve (so a few
max-context streams of one client cannot fill the budget, whatever their count): a fixed
``kv_per_client``, or ``kv_per_client_share`` of the capacity the targets report. A client is one
bearer token when the port requires tokens, else one peer address
(``cloud.gateway.security.client_key``; only a digest of the token is kept). A Start or a growth
over the client's KV quota is refused like one over the budget, with a retry hint while the
client's other sessions hold the bytes (their end makes room), without one when this session
alone needs more than the quota.

Idle sessions yield under pressure: a session owns nothing its edge cannot rebuild
(docs/design.md#failure), so before a stream, a Start or a growth is refused for want of places or
KV memory, streams idle for longer than ``reclaim_after_s`` are reclaimed: those that never sent a
Start first, then sessions by least recent activity (a message received, a step or a send ended). A
ticket with work in flight (its Start or a verification in Triton) is never reclaimed; a message the
client has not read for that long is no work of ours (``sending``). Admission reaches a stream
only through the ``StreamControl`` its handler attached to the ticket: a reclaimed ticket's
``StreamControl.reclaim`` ends its stream (UNAVAILABLE: the edge re-opens from its committed
sequence); its place and KV bytes come back through ``leave``/``free`` like any other end's, and
the refused caller is told to wait (``Reclaiming``) until they do.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

from specsplit.cloud.kv_growth import (  # noqa: F401 (KVShape re-exported: its users' import)
    MAX_DRAFT_TOKENS,
    KVShape,
    slot_positions,
)
from specsplit.shared.protocol import RETRY_AFTER_KEY, RETRY_PUSHBACK_KEY

log = logging.getLogger(__name__)

RECLAIM_AFTER_S = 5.0  # default grace: a working edge is silent for one draft + one round trip
RECLAIM_WAIT_S = 2.0  # how long a reclaimed ticket's place and KV are awaited, at most


# Refused.reason: what a stream was refused for (the refused-streams metric's label)
SESSIONS, CLIENT_SESSIONS = "sessions", "client_sessions"  # the server's places, the client's
KV_BUDGET, CLIENT_KV = "kv_budget", "client_kv"  # the KV budget, the client's KV quota
TARGET_KV = "target_kv"  # the target's own KV capacity (KV_CAPACITY_EXCEEDED)


class Refused(Exception):
    """A stream refused with RESOURCE_EXHAUSTED; ``retry_after_ms`` None: no point retrying
    here soon (the quota is the client's own streams); ``reason``: what ran out."""

    def __init__(self, message: str, retry_after_ms: int | None = None, reason: str = SESSIONS):
        super().__init__(message)
        self.message = message
        self.retry_after_ms = retry_after_ms
        self.reason = reason

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        if self.retry_after_ms is None:
            return ()
        ms = str(self.retry_after_ms)
        return ((RETRY_PUSHBACK_KEY, ms), (RETRY_AFTER_KEY, ms))


class Reclaimed(Exception):
    """Work began on a stream the reclaim policy ended (it raced the handler's cancellation)."""


class Reclaiming(Refused):
    """Not yet: idle streams were reclaimed to make room and are ending. Ask again shortly;
    after ``RECLAIM_WAIT_S`` the refusal stands, with its retry hint."""


class StreamControl(Protocol):
    """How a stream is ended from outside its handler: by the reclaim policy (``reclaim``), the
    one way admission reaches a stream it counts, and by the servicer's timer on a send that
    stalled (``end``). ``cloud.gateway.service.StreamHandle`` implements it; tests use fakes."""

    def end(self, code: object, details: str) -> None:
        """Ends the stream with the status (``code``: a grpc.StatusCode, ``details``)."""

    def reclaim(self) -> None:
        """Ends the stream for the reclaim policy (UNAVAILABLE: retry from the committed
        sequence)."""


@dataclass(eq=False)  # tickets are told apart by identity, never by their fields
class Ticket:
    """One stream's claim: its quota place and, once its Start is admitted, its KV bytes.
    Each is given back once, whatever calls ``leave``/``free`` and however often.

    What the reclaim policy reads: ``active`` (the last message received or work ended),
    ``busy`` (work in flight), ``started`` (a Start was read); ``control`` (attached once by the
    stream's handler, dropped when the stream leaves; None: never reclaimed) ends the stream."""

    admission: Admission
    client: str | None
    positions: int = 0  # the KV slot reserved: the size class the target holds for it
    admitted: bool = False  # its Start was admitted (it is in Admission.live until freed)
    opened: float = field(default_factory=time.monotonic)
    active: float = field(default_factory=time.monotonic)
    busy: int = 0
    started: bool = False
    control: StreamControl | None = None
    in_send: bool = False  # a message of ours is on its way (sending)
    reclaimed_at: float | None = None  # when the policy ended this stream
    _left: bool = False

    @property
    def reclaimed(self) -> bool:
        return self.reclaimed_at is not None

    @property
    def kv_bytes(self) -> int:
        return self.positions * self.admission.bytes_per_token

    def attach(self, control: StreamControl) -> None:
        """The stream's handler hands over how its stream is ended, once, before any work."""
        assert self.control is None and not self._left, "a ticket's control is attached once"
        self.control = control

    def touch(self) -> None:
        """A message arrived on the stream."""
        self.active = time.monotonic()

    @contextlib.contextmanager
    def sending(self) -> Iterator[None]:
        """A message being sent: activity once it is out, but no work of ours while it waits
        (a client that does not read holds it in gRPC flow control), so a send stuck for
        longer than the grace leaves the stream as idle as one waiting for the client's Draft."""
        if self.reclaimed:
            raise Reclaimed()
        self.in_send = True
        try:
            yield
        finally:
            self.in_send = False
            self.active = time.monotonic()

    @contextlib.contextmanager
    def working(self) -> Iterator[None]:
        """Work in flight (a Start, a verification): not idle, whatever it waits on."""
        if self.reclaimed:
            raise Reclaimed()
        self.busy += 1
        try:
            yield
        finally:
            self.busy -= 1
            self.active = time.monotonic()

    def reserve(self, committed_len: int) -> None:
        """Reserves the KV slot of a session at ``committed_len`` with a verification block in
        flight (at its Start, then before each step): a no-op until c crosses into the next
        size class. Raises Refused (the session keeps what it had), or Reclaiming."""
        self.admission._reserve(self, committed_len)

    def leave(self) -> None:
        """The stream ended: its quota place is free, and nothing may end it any more."""
        self.control = None
        if not self._left:
            self._left = True
            self.admission._leave(self)

    def free(self) -> None:
        """Triton freed the session: its KV bytes are free."""
        self.admission._free(self)


class Admission:
    """Accounting only (no I/O, no gRPC): the gateway asks, Refused says no."""

    def __init__(
        self,
        kv: KVShape | None = None,
        budget_bytes: int | None = None,
        per_client: int | None = None,
        max_draft_tokens: int = MAX_DRAFT_TOKENS,
        max_sessions: int = 64,
        reclaim_after_s: float | None = RECLAIM_AFTER_S,  # None: idle streams never yield
        kv_per_client: int | None = None,  # KV bytes one client's sessions may reserve
        # Without kv_per_client: that quota as this share of the targets' reported capacity
        kv_per_client_share: float | None = None,
    ):
        if max_sessions < 1:
            raise ValueError("max_sessions must be >= 1")
        if reclaim_after_s is not None and not reclaim_after_s >= 0:
            raise ValueError("the reclaim grace must be >= 0 seconds")
        if budget_bytes is not None and kv is None:
            raise ValueError("a KV budget needs the model's KV shape")
        if per_client is not None and per_client < 1:
            raise ValueError("sessions per token must be >= 1")
        if kv_per_client is not None and (kv is None or kv_per_client < 1):
            raise ValueError("a per-client KV quota needs the model's KV shape and > 0 bytes")
        if kv_per_client_share is not None and (kv is None or not 0 < kv_per_client_share <= 1):
            raise ValueError("a per-client KV share needs the model's KV shape and is in (0, 1]")
        self.kv_per_client = kv_per_client
        self.kv_per_client_share = None if kv_per_client is not None else kv_per_client_share
        self.client_positions: Counter[str] = Counter()  # per client: its sessions' slots
        self.kv, self.budget_bytes, self.per_client = kv, budget_bytes, per_client
        # What a KV position costs: the flags' guess, then what the targets report (observe_kv)
        self.bytes_per_token = kv.bytes_per_token if kv is not None else 0
        self._reported: dict[str, int] = {}
        # Per replica, from its last start: (KV capacity, bytes other gateways hold there)
        self._capacity: dict[str, tuple[int, int]] = {}
        # Per replica, as it reported them: (KV capacity, KV bytes every gateway's sessions held)
        self.reported_kv: dict[str, tuple[int, int]] = {}
        # a verification block in flight also takes positions
        self.max_draft_tokens = max_draft_tokens
        self.max_sessions = max_sessions  # streams at once, admitted or waiting for their Start
        self.reclaim_after_s = reclaim_after_s
        self.reserved_positions = 0  # the admitted sessions' slots, together
        self.tickets: dict[Ticket, None] = {}  # streams entered and not left, oldest first
        self.streams: Counter[str] = Counter()  # per client: its open streams
        self.live: list[Ticket] = []  # admitted sessions, oldest first
        self.mean_session_s = 1.0  # learnt from sessions that ended; seeds the retry hint
        self.reclaims = 0  # streams ended by the reclaim policy

    @property
    def open(self) -> int:
        """Streams entered and not left."""
        return len(self.tickets)

    @property
    def reserved_bytes(self) -> int:
        return self.reserved_positions * self.bytes_per_token

    def slot_for(self, committed_len: int) -> int:
        """Positions of the slot the target holds for a session at ``committed_len`` once a
        verification block (at most ``max_draft_tokens`` drafts after the last committed token) is
        in."""
        if self.kv is None:
            return 0
        return slot_positions(committed_len + self.max_draft_tokens)

    def observe_kv(self, source: str, bytes_per_token: int | None) -> None:
        """A target's own bytes per KV position (its real dtype), as ``source`` (a replica)
        reported it with a session's start; None: it did not say. The largest current report
        counts: replicas may differ (calibration on another CPU), and one that restarts in
        another dtype reports again with its next start."""
        if not bytes_per_token or self.kv is None or self._reported.get(source) == bytes_per_token:
            return
        self._reported[source] = bytes_per_token
        counted = max(self._reported.values())
        if counted != self.bytes_per_token:
            log.info("KV counted at %d bytes a position, as the target reports", counted)
            self.bytes_per_token = counted

    def observe_capacity(self, source: str, capacity: int | None, held: int | None) -> None:
        """A target's KV capacity and the KV bytes it held (every gateway's sessions), as
        ``source`` (a replica) reported them with a session's start; None: it did not say.
        Others hold what it held less this gateway's reservation (which bounds what its own
        sessions hold). With several replicas the whole reservation is subtracted from each:
        an estimate that errs towards admitting, as the target refuses what it cannot hold."""
        if capacity is None or held is None or capacity <= 0 or self.kv is None:
            return
        self._capacity[source] = (capacity, max(held - self.reserved_bytes, 0))
        self.reported_kv[source] = (capacity, held)

    @property
    def capacity_bytes(self) -> int | None:
        """What the targets reported they may hold, together; None until one did."""
        return sum(c for c, _ in self._capacity.values()) if self._capacity else None

    @property
    def limit_bytes(self) -> int | None:
        """The KV bytes this gateway's sessions may reserve now: its budget, or less where the
        targets have less room for it; None: no limit."""
        room = sum(c - o for c, o in self._capacity.values()) if self._capacity else None
        limits = [b for b in (self.budget_bytes, room) if b is not None]
        return min(limits) if limits else None

    @property
    def client_kv_quota(self) -> int | None:
        """The KV bytes one client's sessions may reserve: ``kv_per_client``, else its share of
        what the targets reported they may hold; None: no quota (yet)."""
        if self.kv_per_client is not None:
            return self.kv_per_client
        if self.kv_per_client_share is None or self.capacity_bytes is None:
            return None
        return max(1, int(self.capacity_bytes * self.kv_per_client_share))

    def enter(self, client: str | None) -> Ticket:
        """A new stream from ``client`` (a digest or an address; None: no quota applies).
        Raises Refused, or Reclaiming while idle streams make room for it."""
        quotas = self.per_client is not None or self.kv_per_client is not None
        quotas |= self.kv_per_client_share is not None
        counted = client if quotas else None
        if counted is not None and self.per_client and self.streams[counted] >= self.per_client:
            raise Refused(
                f"this client already holds {self.streams[counted]} sessions, its quota of "
                f"{self.per_client}; finish one before opening another",
                reason=CLIENT_SESSIONS,
            )
        if self.open >= self.max_sessions:
            self._make_room(None, places=True, short=0)
            wait_ms = self.retry_after_ms()
            raise Refused(
                f"server at its limit of {self.max_sessions} sessions; retry in {wait_ms} ms, "
                "or on another replica",
                retry_after_ms=wait_ms,
            )
        ticket = Ticket(self, counted)
        if counted is not None:
            self.streams[counted] += 1
        self.tickets[ticket] = None
        return ticket

    def _reserve(self, ticket: Ticket, committed_len: int) -> None:
        slot = self.slot_for(committed_len)
        grow = slot - ticket.positions
        quota = self.client_kv_quota if grow > 0 and ticket.client is not None else None
        if quota is not None:
            self._check_client_quota(ticket, committed_len, slot, grow, quota)
        if grow > 0 and self.limit_bytes is not None:
            self._check_budget(ticket, committed_len, slot, grow)
        if grow > 0:
            ticket.positions = slot
            self.reserved_positions += grow
            if ticket.client is not None:
                self.client_positions[ticket.client] += grow
        if not ticket.admitted:
            ticket.admitted = True
            ticket.opened = time.monotonic()
            self.live.append(ticket)

    def _check_budget(self, ticket: Ticket, committed_len: int, slot: int, grow: int) -> None:
        """Raises Refused (Reclaiming while idle streams make room) unless ``grow`` more
        positions fit the budget."""
        bpt, mib, limit = self.bytes_per_token, 2**20, self.limit_bytes
        need = slot * bpt
        what = "this session" if not ticket.admitted else "the session's next KV slot"
        whole = min(b for b in (self.budget_bytes, self.capacity_bytes) if b is not None)
        if need > whole:  # no hint: waiting cannot help
            raise Refused(
                f"{what} needs {need / mib:.1f} MiB of KV memory ({committed_len} tokens and a "
                f"block of {self.max_draft_tokens}), more than the whole KV budget of "
                f"{whole / mib:.1f} MiB; use a shorter prompt or another server",
                reason=KV_BUDGET,
            )
        short = self.reserved_bytes + grow * bpt - limit
        if short <= 0:
            return
        self._make_room(ticket, places=False, short=short)
        wait_ms = self.retry_after_ms()
        free = max(limit - self.reserved_bytes, 0)
        then = "" if not ticket.admitted else ", with the committed sequence as the prompt"
        raise Refused(
            f"KV memory budget full: {what} needs {need / mib:.1f} MiB ({committed_len} "
            f"tokens), {(free + ticket.kv_bytes) / mib:.1f} of {limit / mib:.1f} "
            f"MiB free for it; retry in {wait_ms} ms{then}, or on another replica",
            retry_after_ms=wait_ms,
            reason=KV_BUDGET,
        )

    def _check_client_quota(
        self, ticket: Ticket, committed_len: int, slot: int, grow: int, quota: int
    ) -> None:
        """Raises Refused unless ``grow`` more positions fit the client's KV ``quota``."""
        bpt, mib = self.bytes_per_token, 2**20
        held = self.client_positions[ticket.client] * bpt
        if held + grow * bpt <= quota:
            return
        what = "this session" if not ticket.admitted else "the session's next KV slot"
        need = slot * bpt
        if need > quota:  # no hint: this session alone needs more
            raise Refused(
                f"{what} needs {need / mib:.1f} MiB of KV memory ({committed_len} tokens), more "
                f"than this client's KV quota of {quota / mib:.1f} MiB; use a shorter prompt",
                reason=CLIENT_KV,
            )
        wait_ms = self.retry_after_ms()
        raise Refused(
            f"this client's sessions hold {held / mib:.1f} MiB of KV memory, and {what} needs "
            f"{need / mib:.1f} MiB: over its KV quota of {quota / mib:.1f} MiB; finish a "
            f"session, or retry in {wait_ms} ms",
            retry_after_ms=wait_ms,
            reason=CLIENT_KV,
        )

    def _free(self, ticket: Ticket) -> None:
        if ticket not in self.live:  # never admitted, or freed already (tickets: by identity)
            return
        if ticket.client is not None:
            self.client_positions[ticket.client] -= ticket.positions
            if self.client_positions[ticket.client] <= 0:
                del self.client_positions[ticket.client]
        self.reserved_positions -= ticket.positions
        ticket.positions = 0
        self.live.remove(ticket)
        lasted = time.monotonic() - ticket.opened
        self.mean_session_s = 0.9 * self.mean_session_s + 0.1 * lasted

    def _leave(self, ticket: Ticket) -> None:
        del self.tickets[ticket]
        if ticket.client is not None:
            self.streams[ticket.client] -= 1
            if self.streams[ticket.client] <= 0:
                del self.streams[ticket.client]

    # -- reclaim policy ---------------------------------------------------------------------

    def reclaimable(self, exclude: Ticket | None = None) -> list[Ticket]:
        """Streams the policy may end now, in the order it ends them: those that never sent a
        Start, then sessions by least recent activity; only those idle beyond the grace, with
        no work in flight and a way to end them."""
        if self.reclaim_after_s is None:
            return []
        idle_since = time.monotonic() - self.reclaim_after_s
        idle = [
            t
            for t in self.tickets
            if t is not exclude
            and t.control is not None
            and not t.reclaimed
            and t.busy == 0
            and t.active < idle_since
        ]
        return sorted(idle, key=lambda t: (t.started, t.active))

    def _ending(self) -> list[Ticket]:
        """Reclaimed tickets whose place or KV bytes are still coming back (a stream that does
        not end within RECLAIM_WAIT_S is waited for no longer)."""
        recent = time.monotonic() - RECLAIM_WAIT_S
        ending = [t for t in self.tickets if t.reclaimed and t.reclaimed_at > recent]
        return ending + [
            t for t in self.live if t.reclaimed and t.reclaimed_at > recent and t._left
        ]

    def _make_room(self, ticket: Ticket | None, places: bool, short: int) -> None:
        """Raises Reclaiming when reclaimed streams will make room (a place, or ``short`` KV
        bytes): ones reclaimed before, else the fewest idle ones that suffice, ended now.
        Returns (nothing reclaimed) when even every idle stream would not."""
        ending = self._ending()
        if places:
            have = sum(not t._left for t in ending)
            victims = self.reclaimable()[:1]
            enough = 1
        else:
            have = sum(t.kv_bytes for t in ending)
            victims = [t for t in self.reclaimable(ticket) if t.kv_bytes]
            enough = short
        reason = SESSIONS if places else KV_BUDGET
        if have >= enough:
            raise Reclaiming("idle sessions are ending to make room", RECLAIM_WAIT_S * 1000, reason)
        chosen = []
        for victim in victims:
            if have >= enough:
                break
            chosen.append(victim)
            have += 1 if places else victim.kv_bytes
        if have < enough:
            return
        for victim in chosen:
            self._reclaim(victim)
        raise Reclaiming("idle sessions are ending to make room", RECLAIM_WAIT_S * 1000, reason)

    def _reclaim(self, ticket: Ticket) -> None:
        idle_s = time.monotonic() - ticket.active
        log.info(
            "reclaiming a stream idle for %.1f s (%s) to make room",
            idle_s,
            "admitted" if ticket.started else "no Start",
        )
        ticket.reclaimed_at = time.monotonic()
        self.reclaims += 1
        ticket.control.reclaim()

    def retry_after_ms(self, floor_ms: int = 100, ceiling_ms: int = 30_000) -> int:
        """When a reservation is likely to end: the oldest session's expected end, by the mean
        length of recent sessions, or sooner, when an idle stream's grace runs out (it can then
        be reclaimed). Streams whose Start is not admitted yet count from their opening: in a
        burst they hold every place before any session is live."""
        now = time.monotonic()
        due = []
        opened = [t.opened for t in self.live] + [t.opened for t in self.tickets if not t.admitted]
        if opened:
            due.append(min(opened) + self.mean_session_s - now)
        if self.reclaim_after_s is not None:
            idle = [t.active for t in self.tickets if t.control is not None and not t.busy]
            if idle:
                due.append(min(idle) + self.reclaim_after_s - now)
        if not due:
            return floor_ms
        return int(min(max(min(due) * 1e3, floor_ms), ceiling_ms))
