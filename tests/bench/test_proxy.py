"""The delay proxy adds RTT to a request/response exchange, and does not serialise delays."""

import asyncio
import time

from bench.proxy import DelayProxy


async def _echo_server():
    async def echo(r, w):
        while data := await r.read(1024):
            w.write(data)
            await w.drain()
        w.close()

    server = await asyncio.start_server(echo, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def _exchange_times(rtt_ms: float, n: int, pipelined: bool) -> tuple[float, bytes]:
    server, port = await _echo_server()
    async with server, DelayProxy(port, rtt_ms) as proxy:
        r, w = await asyncio.open_connection("127.0.0.1", proxy.port)
        t0 = time.perf_counter()
        got = b""
        for i in range(n):
            w.write(b"%d;" % i)
            await w.drain()
            if not pipelined:
                got += await r.readexactly(len(b"%d;" % i))
        while len(got) < sum(len(b"%d;" % i) for i in range(n)):
            got += await r.read(1024)
        elapsed = time.perf_counter() - t0
        w.close()
    return elapsed, got


def test_round_trips_take_rtt():
    elapsed, got = asyncio.run(_exchange_times(rtt_ms=40, n=5, pipelined=False))
    assert got == b"0;1;2;3;4;"
    assert elapsed >= 5 * 0.040  # each lock-step exchange pays the full RTT


def test_pipelined_chunks_are_not_delayed_twice():
    # Five chunks sent back to back arrive about one RTT later; a proxy that queued its sleeps
    # would need at least 5 x 100 ms (a design property, with wide margin, not a speed claim).
    elapsed, got = asyncio.run(_exchange_times(rtt_ms=100, n=5, pipelined=True))
    assert got == b"0;1;2;3;4;"
    assert 0.1 <= elapsed < 0.5
