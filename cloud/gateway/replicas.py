"""The Triton replicas behind one gateway (docs/design.md#operations): placement, health, failover.

A session is placed on the up replica with the fewest sessions of this gateway and stays there
(its KV cache lives there). A replica that fails a call is marked down at once; the health watch
marks it up again when its model is ready. A session whose replica failed re-opens on whichever
replica is up first, from its committed prefix (cloud/gateway/lease.py). With no replica known
to be up a new session still tries one: a call is the quickest health check.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import tritonclient.grpc.aio as aioclient
from tritonclient.grpc._client import MAX_GRPC_MESSAGE_SIZE

from specsplit.cloud.gateway.triton_client import MODEL_NAME, TritonUnavailable

log = logging.getLogger(__name__)

# A restarted Triton is found within a second, not after grpc's default reconnect backoff
# (which grows to two minutes while the server is down). Triton must accept our pings: its
# --grpc-http2-min-recv-ping-interval-without-data (cloud/supervision/triton.py) is at most
# KEEPALIVE_MS.
KEEPALIVE_MS = 10_000
CHANNEL_ARGS = [
    ("grpc.max_send_message_length", MAX_GRPC_MESSAGE_SIZE),
    ("grpc.max_receive_message_length", MAX_GRPC_MESSAGE_SIZE),
    ("grpc.keepalive_time_ms", KEEPALIVE_MS),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1_000),
]
HEALTH_TIMEOUT_S = 2.0


def parse_urls(text: str) -> list[str]:
    """``host:port[,host:port...]`` → the list; ValueError on an empty or malformed entry."""
    urls = [u.strip() for u in text.split(",")]
    for url in urls:
        host, _, port = url.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"--triton-url: {url!r} is not host:port")
    if len(set(urls)) != len(urls):
        raise ValueError("--triton-url lists a replica twice")
    return urls


@dataclass(eq=False)
class Replica:
    url: str
    make_client: Callable[[str], aioclient.InferenceServerClient] = field(repr=False)
    up: bool = False
    sessions: int = 0  # this gateway's sessions placed here now
    failures: int = 0  # times it was marked down
    _client: aioclient.InferenceServerClient | None = field(default=None, repr=False)

    @property
    def client(self) -> aioclient.InferenceServerClient:
        if self._client is None:  # created lazily, inside the server's event loop
            self._client = self.make_client(self.url)
        return self._client

    async def check(self) -> bool:
        try:
            ready = await asyncio.wait_for(self.client.is_model_ready(MODEL_NAME), HEALTH_TIMEOUT_S)
        except Exception:
            ready = False
        if ready != self.up:
            log.warning("triton replica %s is %s", self.url, "up" if ready else "down")
        self.up = bool(ready)
        return self.up

    async def close(self) -> None:
        if self._client is not None:
            with contextlib.suppress(Exception):
                await self._client.close()


def _client(url: str) -> aioclient.InferenceServerClient:
    return aioclient.InferenceServerClient(url, channel_args=CHANNEL_ARGS)


class ReplicaSet:
    def __init__(self, urls: list[str], make_client=_client, failover_wait_s: float = 60.0):
        if not urls:
            raise ValueError("at least one Triton replica is needed")
        self.replicas = [Replica(url, make_client) for url in urls]
        self.failover_wait_s = failover_wait_s

    @property
    def up(self) -> int:
        return sum(r.up for r in self.replicas)

    def place(self, avoid: Replica | None = None) -> Replica:
        """The least-loaded up replica (preferring one other than ``avoid``); any replica when
        none is known up."""
        candidates = [r for r in self.replicas if r.up] or self.replicas
        others = [r for r in candidates if r is not avoid] or candidates
        chosen = min(others, key=lambda r: r.sessions)
        chosen.sessions += 1
        return chosen

    def leave(self, replica: Replica) -> None:
        replica.sessions -= 1

    def failed(self, replica: Replica) -> None:
        if replica.up:
            log.warning("triton replica %s failed a call: marked down", replica.url)
        replica.up = False
        replica.failures += 1

    async def wait_up(self, deadline: float) -> None:
        """Returns once some replica is up; TritonUnavailable at ``deadline`` (monotonic)."""
        while True:
            if any(await asyncio.gather(*(r.check() for r in self.replicas))):
                return
            if time.monotonic() >= deadline:
                raise TritonUnavailable(
                    f"no Triton replica ready within {self.failover_wait_s:.0f} s"
                )
            await asyncio.sleep(0.5)

    async def refresh(self) -> bool:
        """Checks every replica; True when at least one is up."""
        return any(await asyncio.gather(*(r.check() for r in self.replicas)))

    async def close(self) -> None:
        await asyncio.gather(*(r.close() for r in self.replicas))
