"""A new connection over a slow link (real gateway and tritonserver, through bench.proxy's delay):
made once, never timed out and retried. gRPC core gives a connection attempt at least
``grpc.min_reconnect_backoff_ms`` (edge/channel.py): at 250 ms an HTTP/2 handshake over a
1 s round trip always timed out, and every first generation retried (UNAVAILABLE) 1-3 times."""

from __future__ import annotations

import asyncio

import pytest

from bench.proxy import DelayProxy
from specsplit.edge.client import GenerationConfig, SplitClient
from specsplit.shared.tiny import reference_greedy

pytestmark = pytest.mark.slow

RTT_MS = 1000.0
PROMPT = [1, 2, 3, 4, 5]


def test_a_first_generation_over_a_1s_link_connects_without_a_retry(cloud, tiny):
    async def run():
        port = int(cloud.address.rsplit(":", 1)[1])
        async with (
            DelayProxy(port, RTT_MS) as proxy,
            SplitClient(f"127.0.0.1:{proxy.port}", None) as client,
        ):
            gen = client.generate(PROMPT, GenerationConfig(max_new_tokens=3), "cloud-only")
            await gen.collect()
            return gen

    gen = asyncio.run(asyncio.wait_for(run(), 60))
    assert gen.token_ids == reference_greedy(tiny.target, PROMPT, 3)
    assert gen.stats.retries == 0
