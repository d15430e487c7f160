"""Link emulation: a TCP proxy between the edge and the gateway (the kernel's netem is not here).

Each direction is a link with
- propagation delay RTT/2: a chunk is forwarded ``delay_s`` after it left the sender, and chunks
  keep their order, so back-to-back chunks are not delayed twice (a pipe, not a queue of sleeps);
- an optional bandwidth (bits/s): a chunk occupies the link for ``8 * len / bps`` seconds, queued
  behind the chunks before it (serialisation delay, as on a phone's uplink);
- optional jitter: each chunk's propagation delay varies by up to ``± jitter_ms / 2`` (so RTT
  varies by ± jitter_ms), clamped so that bytes never overtake each other (TCP delivers in order);
- an outage on command (``proxy.outage(seconds)``): what a phone sees in a tunnel or a handover.
  By default the connections stall: nothing moves in either direction until the outage ends,
  then everything queued flows (TCP retransmits; a 1–2 s gap is far below any TCP or gRPC
  keepalive timeout, so the connection survives). ``outage(seconds, reset=True)`` instead resets
  every open connection (a radio that drops its bearer); new connections stall until the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time

log = logging.getLogger(__name__)

_CHUNK = 1 << 14  # read size: bandwidth is applied per chunk, so keep chunks packet-train sized


class _Link:
    """One direction's timing state, shared by every connection through the proxy."""

    def __init__(self, delay_s: float, bps: float | None, jitter_s: float, rng: random.Random):
        self.delay_s = delay_s
        self.bps = bps
        self.jitter_s = jitter_s
        self.rng = rng
        self.free_at = 0.0  # when the link finishes serialising what is queued on it

    def due(self, now: float, size: int, after: float) -> float:
        """When ``size`` bytes read at ``now`` reach the other end (never before ``after``)."""
        start = max(now, self.free_at)
        sent = start + (8.0 * size / self.bps if self.bps else 0.0)
        self.free_at = sent
        jitter = self.rng.uniform(-self.jitter_s, self.jitter_s) if self.jitter_s else 0.0
        return max(sent + max(0.0, self.delay_s + jitter), after)


class DelayProxy:
    """``async with DelayProxy(upstream_port, rtt_ms=50) as proxy: connect to proxy.port``.

    ``up_bps`` limits client → upstream (the edge's uplink), ``down_bps`` upstream → client.
    """

    def __init__(
        self,
        upstream_port: int,
        rtt_ms: float,
        upstream_host: str = "127.0.0.1",
        *,
        up_bps: float | None = None,
        down_bps: float | None = None,
        jitter_ms: float = 0.0,
        seed: int = 0,
    ):
        self.upstream = (upstream_host, upstream_port)
        self.delay_s = rtt_ms / 2000.0
        rng = random.Random(seed)
        jitter_s = jitter_ms / 2000.0
        self.up = _Link(self.delay_s, up_bps, jitter_s, rng)
        self.down = _Link(self.delay_s, down_bps, jitter_s, rng)
        self.server: asyncio.base_events.Server | None = None
        self.port = 0
        self._conns: set[asyncio.Task] = set()
        self._writers: set[asyncio.StreamWriter] = set()
        self._outage_until = 0.0

    def outage(self, seconds: float, reset: bool = False) -> None:
        """Cut the link for ``seconds`` from now: stall every connection (or reset them)."""
        self._outage_until = max(self._outage_until, time.monotonic() + seconds)
        log.info("link outage for %.2f s (%s)", seconds, "reset" if reset else "stall")
        if reset:
            for w in list(self._writers):
                with contextlib.suppress(Exception):
                    w.transport.abort()

    async def _while_out(self) -> None:
        while (wait := self._outage_until - time.monotonic()) > 0:
            await asyncio.sleep(wait)

    async def _pump(self, reader, writer, link: _Link) -> None:
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
        last_due = 0.0

        async def deliver() -> None:
            while True:
                due, data = await queue.get()
                if not data:
                    break
                wait = due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                await self._while_out()
                writer.write(data)
                await writer.drain()
            with contextlib.suppress(Exception):
                writer.write_eof()

        sender = asyncio.create_task(deliver())
        try:
            while data := await reader.read(_CHUNK):
                last_due = link.due(time.monotonic(), len(data), last_due)
                queue.put_nowait((last_due, data))
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            queue.put_nowait((last_due, b""))
            with contextlib.suppress(Exception):
                await sender

    async def _handle(self, client_r, client_w) -> None:
        await self._while_out()  # a SYN during an outage is retried until the link is back
        try:
            up_r, up_w = await asyncio.open_connection(*self.upstream)
        except OSError:
            client_w.close()
            return
        self._writers.update((client_w, up_w))
        try:
            await asyncio.gather(
                self._pump(client_r, up_w, self.up),
                self._pump(up_r, client_w, self.down),
                return_exceptions=True,
            )
        finally:
            self._writers.difference_update((client_w, up_w))
            for w in (client_w, up_w):
                w.close()

    async def __aenter__(self) -> DelayProxy:
        self.server = await asyncio.start_server(self._track, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def _track(self, r, w) -> None:
        task = asyncio.current_task()
        self._conns.add(task)
        try:
            await self._handle(r, w)
        except asyncio.CancelledError:
            w.close()  # the proxy is closing: drop the connection quietly
        finally:
            self._conns.discard(task)

    async def __aexit__(self, *exc) -> None:
        self.server.close()
        for task in list(self._conns):
            task.cancel()
        await asyncio.gather(*self._conns, return_exceptions=True)
        await self.server.wait_closed()
