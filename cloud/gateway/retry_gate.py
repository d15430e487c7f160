"""Holding a client to its retry hint (docs/operations.md, "What one client may hold").

A stream refused with RESOURCE_EXHAUSTED and a retry hint (``cloud.gateway.admission.Refused``)
tells its client when to try again, and the gateway remembers it (``RetryGate.told``). A stream
that client opens before then is held, unread, until the hint runs out (``RetryGate.hold``): none
of its messages is read or decoded meanwhile (its Start stays in gRPC's flow-control window), it
holds no admission place, and it costs a sleeping task. Then the streams it held go on one at a
time, ``PACE_S`` apart, each to be admitted or refused like any other: a refusal's new hint holds
the rest again. So a client that re-sends before its hint, however fast, is answered no sooner
than the hint, and is read and refused about once a hint, not once a stream; an edge that
honours its hints never meets the gate (``edge/retry.py`` waits at least the hint).

Refusing such a stream at once instead, from its metadata, would not make its client wait: a
client that ignores the hint re-sends as soon as it is answered, and gRPC's own work per stream
(a good part of what reading, decoding and refusing its Start costs) would be spent again and
again. Past ``max_held`` streams held for one client, a further
one is refused at once all the same (memory is bounded): RESOURCE_EXHAUSTED with the time left as
its hint, its messages unread (a grpc.aio client still writing its Start may then report INTERNAL
instead, ``cloud.gateway.messages.before_refusing``).

A client is keyed as the quotas key it (``cloud.gateway.security.client_key``: its bearer token
where the port requires tokens, else its peer address); None (a loopback or unix-socket peer: no
quota applies) is never held. A refusal without a hint (a client over its own stream quota, a
prompt larger than the budget) sets no gate: the client may open a stream as soon as one of its
own ends.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter

from specsplit.cloud.gateway.admission import Refused

RETRY_EARLY = "retry_early"  # Refused.reason of the gate's refusals
PACE_S = 0.05  # between held streams let go once the hint ran out
MAX_HELD = 64  # streams held at once for one client; beyond, refused at once
MAX_HOLD_S = 60.0  # the longest one stream is held, however often its client is refused
HOLD_POLL_S = 0.25  # a held stream looks at its client's gate at least this often
PRUNE_AT = 4096  # clients remembered before expired ones are dropped (hints last <= 30 s)


class RetryGate:
    """Per client, when it may open a stream again, and the streams it holds until then."""

    def __init__(self, max_held: int = MAX_HELD, clock=time.monotonic):
        if max_held < 0:
            raise ValueError("streams held per client must be >= 0")
        self.max_held, self.clock = max_held, clock
        self.not_before: dict[str, float] = {}
        self.held: Counter[str] = Counter()  # per client: its streams held now
        self.holds = 0  # streams held, ever
        self.refused = 0  # streams refused at once, past max_held

    def told(self, client: str | None, retry_after_ms: int | None) -> None:
        """``client`` (None: no quota applies, never held) was refused with a retry hint
        of ``retry_after_ms`` (None: no hint, no gate)."""
        if client is None or retry_after_ms is None:
            return
        now = self.clock()
        until = now + retry_after_ms / 1e3
        if until > self.not_before.get(client, 0.0):
            self.not_before[client] = until
        if len(self.not_before) > PRUNE_AT:
            self.not_before = {c: t for c, t in self.not_before.items() if t > now}

    def wait_s(self, client: str | None) -> float | None:
        """The seconds ``client`` was told to wait still left; None: it may open a stream now."""
        until = self.not_before.get(client) if client is not None else None
        if until is None:
            return None
        left = until - self.clock()
        if left <= 0:
            del self.not_before[client]
            return None
        return left

    async def hold(self, client: str | None) -> Refused | None:
        """Returns (None) once ``client`` may open a stream: at once unless it was told to wait.
        Returns the refusal to send at once, without waiting, when ``max_held`` of its streams
        are held already."""
        left = self.wait_s(client)
        if left is None:
            return None
        if self.held[client] >= self.max_held:
            self.refused += 1
            wait_ms = math.ceil(left * 1e3 - 1e-6)  # never a hint that ends before the gate does
            return Refused(
                f"this client re-sent before its retry hint, with {self.held[client]} streams "
                f"already waiting for it; retry in {wait_ms} ms",
                retry_after_ms=wait_ms,
                reason=RETRY_EARLY,
            )
        self.held[client] += 1
        self.holds += 1
        give_up = self.clock() + MAX_HOLD_S
        try:
            while left is not None and self.clock() < give_up:
                await asyncio.sleep(min(left, HOLD_POLL_S))
                left = self.wait_s(client)
        finally:
            self.held[client] -= 1
            if self.held[client] <= 0:
                del self.held[client]
        # The next held stream follows once this one is admitted or refused (a new hint).
        self.told(client, int(PACE_S * 1e3))
        return None
