"""Who may open a session now: the one owner of how many sessions and how much memory
(DESIGN §8): a cap on streams at once, per-token quotas and the target's KV memory budget.

A bare session count admits 64 one-token prompts and 64 max_context ones alike, though the
second set holds orders of magnitude more KV memory in Triton. So every admitted session
reserves the KV bytes it can grow to, computed exactly as the target allocates them
(``cloud.kv_growth``): a slot starts at 64 positions and doubles, each position holding keys and
values of every layer. A session needs at most prompt + max_new_tokens committed positions
(capped at max_context) plus one verification block in flight. The budget is the sum the
target may hold; a Start that would exceed it is refused with RESOURCE_EXHAUSTED and a retry
hint, and its reservation is released exactly once, however the session ends.

The cap counts every open stream, admitted or still waiting for its Start. A quota caps the
streams one client holds at once: one bearer token when the port requires
tokens, else one peer address. The token itself is never stored or logged, only a digest.

Idle sessions yield under pressure: a session owns nothing its edge cannot rebuild (DESIGN §2),
so before a stream or a Start is refused for want of places or KV memory, streams idle for
longer than ``reclaim_after_s`` are reclaimed: those that never sent a Start first, then
sessions by least recent activity (a message received, a step or a send ended). A ticket with
work in flight (its Start or a verification in Triton, a message being sent) is never
reclaimed. A reclaimed ticket's ``end`` ends its stream (UNAVAILABLE: the edge re-opens from
its committed sequence); its place and KV bytes come back through ``leave``/``free`` like any
other end's, and the refused caller is told to wait (``Reclaiming``) until they do.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from specsplit.cloud.kv_growth import MAX_BLOCK, slot_positions
from specsplit.shared.protocol import RETRY_AFTER_KEY, RETRY_PUSHBACK_KEY

log = logging.getLogger(__name__)

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
RECLAIM_AFTER_S = 5.0  # default grace: a working edge is silent for one draft + one round trip
RECLAIM_WAIT_S = 2.0  # how long a reclaimed ticket's place and KV are awaited, at most


@dataclass(frozen=True)
class KVShape:
    """What one position of a session's KV slot costs: layers x 2 (K, V) x kv heads x head dim."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int

    @property
    def bytes_per_token(self) -> int:
        return self.layers * 2 * self.kv_heads * self.head_dim * self.dtype_bytes

    @classmethod
    def from_dir(cls, model_dir: str | Path, dtype: str = "auto") -> KVShape:
        """From a Hugging Face config.json. ``auto`` counts float32 (the target's choice on CPU;
        on GPU it picks bfloat16, so the reservation is then twice what is held: conservative)."""
        config = json.loads((Path(model_dir) / "config.json").read_text())
        text = config.get("text_config", config)  # multimodal configs nest the LM's
        heads = int(text["num_attention_heads"])
        head_dim = text.get("head_dim") or int(text["hidden_size"]) // heads
        return cls(
            layers=int(text["num_hidden_layers"]),
            kv_heads=int(text.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            dtype_bytes=DTYPE_BYTES.get(dtype, 4),
        )


class Refused(Exception):
    """A stream refused with RESOURCE_EXHAUSTED; ``retry_after_ms`` None: no point retrying
    here soon (the quota is the client's own streams)."""

    def __init__(self, message: str, retry_after_ms: int | None = None):
        super().__init__(message)
        self.message = message
        self.retry_after_ms = retry_after_ms

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


@dataclass(eq=False)  # tickets are told apart by identity, never by their fields
class Ticket:
    """One stream's claim: its quota place and, once its Start is admitted, its KV bytes.
    Each is given back once, whatever calls ``leave``/``free`` and however often.

    What the reclaim policy reads: ``active`` (the last message received or work ended),
    ``busy`` (work in flight), ``started`` (a Start was read); ``end`` (set by the stream's
    handler; None: never reclaimed) ends the stream."""

    admission: Admission
    client: str | None
    kv_bytes: int = 0
    opened: float = field(default_factory=time.monotonic)
    active: float = field(default_factory=time.monotonic)
    busy: int = 0
    started: bool = False
    end: Callable[[], None] | None = None
    reclaimed_at: float | None = None  # when the policy ended this stream
    _left: bool = False

    @property
    def reclaimed(self) -> bool:
        return self.reclaimed_at is not None

    def touch(self) -> None:
        """A message arrived on the stream."""
        self.active = time.monotonic()

    @contextlib.contextmanager
    def working(self) -> Iterator[None]:
        """Work in flight (a Start, a verification, a send): not idle, whatever it waits on."""
        if self.reclaimed:
            raise Reclaimed()
        self.busy += 1
        try:
            yield
        finally:
            self.busy -= 1
            self.active = time.monotonic()

    def reserve(self, tokens: int) -> None:
        """Reserves the KV memory of a session that can grow to ``tokens`` positions."""
        self.admission._reserve(self, tokens)

    def leave(self) -> None:
        """The stream ended: its quota place is free."""
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
        max_block: int = MAX_BLOCK,
        max_sessions: int = 64,
        reclaim_after_s: float | None = RECLAIM_AFTER_S,  # None: idle streams never yield
    ):
        if max_sessions < 1:
            raise ValueError("max_sessions must be >= 1")
        if reclaim_after_s is not None and not reclaim_after_s >= 0:
            raise ValueError("the reclaim grace must be >= 0 seconds")
        if budget_bytes is not None and kv is None:
            raise ValueError("a KV budget needs the model's KV shape")
        if per_client is not None and per_client < 1:
            raise ValueError("sessions per token must be >= 1")
        self.kv, self.budget_bytes, self.per_client = kv, budget_bytes, per_client
        self.max_block = max_block  # a verification block in flight also takes positions
        self.max_sessions = max_sessions  # streams at once, admitted or waiting for their Start
        self.reclaim_after_s = reclaim_after_s
        self.reserved_bytes = 0
        self.tickets: dict[Ticket, None] = {}  # streams entered and not left, oldest first
        self.streams: Counter[str] = Counter()  # per client: its open streams
        self.live: list[Ticket] = []  # admitted sessions, oldest first
        self.mean_session_s = 1.0  # learnt from sessions that ended; seeds the retry hint
        self.reclaims = 0  # streams ended by the reclaim policy

    @property
    def open(self) -> int:
        """Streams entered and not left."""
        return len(self.tickets)

    def kv_bytes(self, tokens: int) -> int:
        if self.kv is None:
            return 0
        return slot_positions(tokens + self.max_block) * self.kv.bytes_per_token

    def enter(self, client: str | None) -> Ticket:
        """A new stream from ``client`` (a digest or an address; None: no quota applies).
        Raises Refused, or Reclaiming while idle streams make room for it."""
        counted = client if self.per_client is not None else None
        if counted is not None and self.streams[counted] >= self.per_client:
            raise Refused(
                f"this client already holds {self.streams[counted]} sessions, its quota of "
                f"{self.per_client}; finish one before opening another"
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

    def _reserve(self, ticket: Ticket, tokens: int) -> None:
        need = self.kv_bytes(tokens)
        if self.budget_bytes is not None and self.reserved_bytes + need > self.budget_bytes:
            self._make_room(
                ticket, places=False, short=self.reserved_bytes + need - self.budget_bytes
            )
            wait_ms = self.retry_after_ms()
            free = max(self.budget_bytes - self.reserved_bytes, 0)
            raise Refused(
                f"KV memory budget full: this session needs {need / 2**20:.1f} MiB "
                f"({tokens} tokens), {free / 2**20:.1f} of {self.budget_bytes / 2**20:.1f} MiB "
                f"free; retry in {wait_ms} ms, with a shorter max_new_tokens, or on another "
                "replica",
                retry_after_ms=wait_ms,
            )
        ticket.kv_bytes = need
        ticket.opened = time.monotonic()
        self.reserved_bytes += need
        self.live.append(ticket)

    def _free(self, ticket: Ticket) -> None:
        if ticket not in self.live:  # never admitted, or freed already (tickets: by identity)
            return
        self.reserved_bytes -= ticket.kv_bytes
        ticket.kv_bytes = 0
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
            and t.end is not None
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
        if have >= enough:
            raise Reclaiming("idle sessions are ending to make room", RECLAIM_WAIT_S * 1000)
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
        raise Reclaiming("idle sessions are ending to make room", RECLAIM_WAIT_S * 1000)

    def _reclaim(self, ticket: Ticket) -> None:
        idle_s = time.monotonic() - ticket.active
        log.info(
            "reclaiming a stream idle for %.1f s (%s) to make room",
            idle_s,
            "admitted" if ticket.started else "no Start",
        )
        ticket.reclaimed_at = time.monotonic()
        self.reclaims += 1
        ticket.end()

    def retry_after_ms(self, floor_ms: int = 100, ceiling_ms: int = 30_000) -> int:
        """When a reservation is likely to end: the oldest live session's expected end, by the
        mean length of recent sessions, or sooner, when an idle stream's grace runs out (it can
        then be reclaimed)."""
        now = time.monotonic()
        due = []
        if self.live:
            due.append(self.live[0].opened + self.mean_session_s - now)
        if self.reclaim_after_s is not None:
            idle = [t.active for t in self.tickets if t.end is not None and not t.busy]
            if idle:
                due.append(min(idle) + self.reclaim_after_s - now)
        if not due:
            return floor_ms
        return int(min(max(min(due) * 1e3, floor_ms), ceiling_ms))


LOOPBACK = ("ipv4:127.", "ipv6:[::1]", "ipv6:[::ffff:127.")


def client_key(token: bytes | None, peer: str | None, by_token: bool) -> str | None:
    """Whom a quota counts: a digest of the bearer token when the port requires tokens, else
    the peer's address without its port (``ipv4:1.2.3.4:5678`` -> ``ipv4:1.2.3.4``); None (no
    quota) for a loopback or unix-socket peer."""
    if by_token:
        return None if token is None else "token:" + hashlib.sha256(token).hexdigest()[:16]
    if not peer or not peer.startswith(("ipv4:", "ipv6:")):
        return None
    address = peer.rsplit(":", 1)[0]
    # Loopback: this host's own clients, or a local proxy whose clients all share its address.
    return None if address.startswith(LOOPBACK) else address


def default_budget_bytes(fraction: float = 0.5) -> int:
    """Half of this host's available memory: the target's KV on CPU lives in host memory next
    to its weights, which are loaded before the gateway starts."""
    pages = _meminfo_kib("MemAvailable")
    return int(pages * 1024 * fraction) if pages else 8 << 30


def _meminfo_kib(key: str) -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0
