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


async def _send_through(proxy_kwargs: dict, payload: list[bytes], during=None):
    """Writes ``payload`` through a proxy to an echo server; returns (elapsed, echoed bytes)."""
    server, port = await _echo_server()
    async with server, DelayProxy(port, **proxy_kwargs) as proxy:
        r, w = await asyncio.open_connection("127.0.0.1", proxy.port)
        t0 = time.perf_counter()
        if during is not None:
            during(proxy)
        for chunk in payload:
            w.write(chunk)
            await w.drain()
        want = sum(len(c) for c in payload)
        got = b""
        while len(got) < want and (data := await r.read(1 << 16)):
            got += data
        elapsed = time.perf_counter() - t0
        w.close()
    return elapsed, got


def test_uplink_bandwidth_serialises_bytes():
    # 40 kB at 800 kbit/s up takes at least 0.4 s whatever else the machine does
    payload = [bytes([i % 251]) * 1000 for i in range(40)]
    elapsed, got = asyncio.run(_send_through({"rtt_ms": 0, "up_bps": 800_000}, payload))
    assert got == b"".join(payload)
    assert elapsed >= 0.4


def test_downlink_bandwidth_is_separate():
    payload = [b"x" * 20_000]
    elapsed, got = asyncio.run(
        _send_through({"rtt_ms": 0, "up_bps": None, "down_bps": 400_000}, payload)
    )
    assert got == payload[0]
    assert elapsed >= 0.4


def test_jitter_keeps_byte_order():
    # jitter far larger than the gap between chunks would reorder them if delays were independent
    payload = [b"%04d," % i for i in range(200)]
    _, got = asyncio.run(_send_through({"rtt_ms": 20, "jitter_ms": 18, "seed": 3}, payload))
    assert got == b"".join(payload)


def test_outage_stalls_then_flows():
    payload = [b"%d;" % i for i in range(10)]
    elapsed, got = asyncio.run(
        _send_through({"rtt_ms": 10}, payload, during=lambda proxy: proxy.outage(0.5))
    )
    assert got == b"".join(payload)  # nothing lost: the connection only stalled
    assert elapsed >= 0.5


def test_outage_with_reset_drops_the_connection():
    async def run() -> bool:
        server, port = await _echo_server()
        async with server, DelayProxy(port, rtt_ms=10) as proxy:
            r, w = await asyncio.open_connection("127.0.0.1", proxy.port)
            w.write(b"hello")
            await w.drain()
            assert await r.readexactly(5) == b"hello"
            proxy.outage(0.2, reset=True)
            try:
                data = await r.read(10)
            except ConnectionError:
                return True
            w.close()
            return data == b""  # reset or EOF: the connection is gone either way

    assert asyncio.run(run())
