"""Latency emulation: a TCP proxy that holds every chunk RTT/2 in each direction.

The kernel's netem is not available here, so this stands between the edge and the gateway.
It emulates propagation delay only, without bandwidth limits, loss or jitter: each chunk is
forwarded ``delay_s`` after it was read, and chunks keep their order, so back-to-back chunks are
not delayed twice (a pipe, not a queue of sleeps).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

log = logging.getLogger(__name__)


async def _pump(reader, writer, delay_s: float) -> None:
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def deliver() -> None:
        while True:
            due, data = await queue.get()
            if not data:
                break
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            writer.write(data)
            await writer.drain()
        with contextlib.suppress(Exception):
            writer.write_eof()

    sender = asyncio.create_task(deliver())
    try:
        while data := await reader.read(1 << 16):
            queue.put_nowait((time.monotonic() + delay_s, data))
    except (ConnectionError, asyncio.IncompleteReadError):
        pass
    finally:
        queue.put_nowait((time.monotonic() + delay_s, b""))
        with contextlib.suppress(Exception):
            await sender


class DelayProxy:
    """``async with DelayProxy(upstream_port, rtt_ms=50) as proxy: connect to proxy.port``."""

    def __init__(self, upstream_port: int, rtt_ms: float, upstream_host: str = "127.0.0.1"):
        self.upstream = (upstream_host, upstream_port)
        self.delay_s = rtt_ms / 2000.0
        self.server: asyncio.base_events.Server | None = None
        self.port = 0
        self._conns: set[asyncio.Task] = set()

    async def _handle(self, client_r, client_w) -> None:
        try:
            up_r, up_w = await asyncio.open_connection(*self.upstream)
        except OSError:
            client_w.close()
            return
        await asyncio.gather(
            _pump(client_r, up_w, self.delay_s),
            _pump(up_r, client_w, self.delay_s),
            return_exceptions=True,
        )
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
