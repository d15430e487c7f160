"""Is the cloud there? The OpenAI endpoint's ``/health`` asks the gateway's gRPC health service
(grpc.health.v1: SERVING while one of its Triton replicas is ready), so that a load balancer stops
routing to an edge whose cloud is down instead of sending it requests that can only fail.

A balancer polls often, so the probe is cheap: one unary call with a short deadline, on a channel
of its own, and its answer kept for ``ttl_s`` (the gateway refreshes its own status every 2 s);
the checks that arrive meanwhile, however many at once, share that one answer.

The ``edge`` extra does not install grpcio-health-checking, so the two one-field messages are
encoded here: HealthCheckRequest{string service = 1}, HealthCheckResponse{ServingStatus status = 1}.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from specsplit.edge.channel import open_channel
from specsplit.edge.client import check_token_transport
from specsplit.shared.protocol import SERVICE_NAME

CHECK = "/grpc.health.v1.Health/Check"
SERVING = 1
STATUS_NAMES = {0: "UNKNOWN", 1: "SERVING", 2: "NOT_SERVING", 3: "SERVICE_UNKNOWN"}
TTL_S = 2.0
TIMEOUT_S = 1.0  # a gateway that takes longer to say it serves is not one to route to
HINTS = {"NOT_SERVING": " (none of its Triton replicas is ready)"}


@dataclass(frozen=True)
class CloudHealth:
    ok: bool
    cloud: str  # the gateway's ServingStatus, or the gRPC code of a probe that failed
    reason: str = ""  # why not ok, for people reading a balancer's log

    def body(self) -> dict:
        if self.ok:
            return {"status": "ok", "cloud": self.cloud}
        return {"status": "unavailable", "cloud": self.cloud, "reason": self.reason}


def _encode_request(service: str) -> bytes:
    name = service.encode()
    assert len(name) < 128  # its length fits one varint byte
    return b"\x0a" + bytes([len(name)]) + name


def _decode_status(data: bytes) -> int:
    """Field 1 (varint) of a HealthCheckResponse; absent means 0, UNKNOWN (proto3 default)."""
    if not data or data[0] != 0x08:
        return 0
    status, shift = 0, 0
    for byte in data[1:]:
        status |= (byte & 0x7F) << shift
        if byte < 0x80:
            break
        shift += 7
    return status


class HealthProbe:
    """The cloud's health at ``address``, asked at most once per ``ttl_s``. ``token``,
    ``insecure`` and ``tls`` are SplitClient's keywords; the channel opens on the first check
    (in its loop)."""

    def __init__(
        self,
        address: str,
        *,
        ttl_s: float = TTL_S,
        timeout_s: float = TIMEOUT_S,
        clock: Callable[[], float] = time.monotonic,
        token: str | None = None,
        insecure: bool = False,
        **tls,
    ):
        # SplitClient's own check (edge.client.check_token_transport) refuses a plaintext token
        # before any generation; the probe sends the same token the same way
        check_token_transport(address, token, any(tls.values()), insecure)
        self.address, self.ttl_s, self.timeout_s = address, ttl_s, timeout_s
        self._clock, self._tls = clock, tls
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None
        self._channel: grpc.aio.Channel | None = None
        self._lock: asyncio.Lock | None = None
        self._last: tuple[float, CloudHealth] | None = None  # (when, answer)

    async def check(self) -> CloudHealth:
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:  # checks that wait here get the answer of the one ahead
            if self._last is not None and self._clock() - self._last[0] < self.ttl_s:
                return self._last[1]
            health = await self._probe()
            self._last = (self._clock(), health)
            return health

    async def _probe(self) -> CloudHealth:
        if self._channel is None:
            self._channel = open_channel(self.address, **self._tls)
        call = self._channel.unary_unary(
            CHECK, request_serializer=_encode_request, response_deserializer=_decode_status
        )
        try:
            status = await call(SERVICE_NAME, timeout=self.timeout_s, metadata=self._metadata)
        except grpc.aio.AioRpcError as e:
            reason = f"the cloud at {self.address} did not answer its health check: {e.details()}"
            return CloudHealth(False, e.code().name, reason)
        name = STATUS_NAMES.get(status, str(status))
        if status == SERVING:
            return CloudHealth(True, name)
        reason = f"the cloud at {self.address} reports {name}{HINTS.get(name, '')}"
        return CloudHealth(False, name, reason)

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = None
