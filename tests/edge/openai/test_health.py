"""The cloud's health as /health reports it, probed against the real grpc.health.v1 servicer the
gateway runs: serving, not serving, unreachable, silent, and the cached answer."""

from __future__ import annotations

import asyncio
import socket
import time
from contextlib import asynccontextmanager

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from specsplit.edge.openai.health import CHECK, TTL_S, HealthProbe
from specsplit.shared.protocol import SERVICE_NAME

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class CountChecks(grpc.aio.ServerInterceptor):
    def __init__(self):
        self.checks = 0

    async def intercept_service(self, continuation, details):
        self.checks += details.method == CHECK
        return await continuation(details)


@asynccontextmanager
async def gateway_health(status=SERVING):
    """A gRPC server with only the gateway's health service; always stopped."""
    counter = CountChecks()
    server = grpc.aio.server(interceptors=[counter])
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        await servicer.set(SERVICE_NAME, status)
        yield f"127.0.0.1:{port}", servicer, counter
    finally:
        await server.stop(None)


async def check_once(address: str, **kw):
    probe = HealthProbe(address, **kw)
    try:
        return await probe.check()
    finally:
        await probe.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serving_cloud_is_healthy():
    async def run():
        async with gateway_health(SERVING) as (address, _, _):
            return await check_once(address)

    h = asyncio.run(run())
    assert h.ok and h.body() == {"status": "ok", "cloud": "SERVING"}


def test_not_serving_cloud_is_unhealthy_naming_the_status():
    async def run():
        async with gateway_health(NOT_SERVING) as (address, _, _):
            return address, await check_once(address)

    address, h = asyncio.run(run())
    assert not h.ok and h.cloud == "NOT_SERVING"
    assert h.body()["status"] == "unavailable"
    assert address in h.reason and "NOT_SERVING" in h.reason and "Triton" in h.reason


def test_unreachable_cloud_is_unhealthy_at_once():
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    start = time.monotonic()
    h = asyncio.run(check_once(address))
    assert time.monotonic() - start < 2
    assert not h.ok and h.cloud == "UNAVAILABLE" and address in h.reason


def test_silent_cloud_is_unhealthy_after_the_short_timeout():
    with socket.socket() as s:  # accepts TCP connections, never speaks HTTP/2
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        address = f"127.0.0.1:{s.getsockname()[1]}"
        start = time.monotonic()
        h = asyncio.run(check_once(address, timeout_s=0.3))
        elapsed = time.monotonic() - start
    assert 0.25 < elapsed < 2
    # gRPC ends the connection attempt with the call's deadline: either code, in that time
    assert not h.ok and h.cloud in ("DEADLINE_EXCEEDED", "UNAVAILABLE") and address in h.reason


def test_one_probe_answers_every_check_for_ttl():
    """A balancer polling /health, however often, costs the gateway one check per TTL."""

    async def run():
        now = [0.0]
        async with gateway_health(SERVING) as (address, servicer, counter):
            probe = HealthProbe(address, clock=lambda: now[0])
            try:
                at_once = await asyncio.gather(*(probe.check() for _ in range(8)))
                await servicer.set(SERVICE_NAME, NOT_SERVING)
                now[0] = TTL_S * 0.9
                cached = await probe.check()
                now[0] = TTL_S * 1.1
                fresh = await probe.check()
            finally:
                await probe.close()
            return at_once, cached, fresh, counter.checks

    at_once, cached, fresh, checks = asyncio.run(run())
    assert all(h.ok for h in at_once) and cached.ok
    assert not fresh.ok and fresh.cloud == "NOT_SERVING"
    assert checks == 2
