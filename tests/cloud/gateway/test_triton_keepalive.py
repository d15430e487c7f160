"""The gateway's channel to Triton keeps a session's stream across a quiet spell: Triton accepts
the gateway's keepalive pings (at its default policy it cut such a stream after 30 s with
"Too many pings", and the gateway took the replica for dead)."""

from __future__ import annotations

import asyncio

import pytest

from specsplit.cloud.gateway.replicas import KEEPALIVE_MS, _client
from specsplit.cloud.gateway.triton_client import TritonSequence
from specsplit.cloud.supervision.triton import MIN_PING_INTERVAL_MS
from specsplit.shared.acceptance import VerificationRule
from specsplit.shared.sampling import SamplingConfig

pytestmark = pytest.mark.slow

# Three pings at the gateway's period: enough strikes for a GOAWAY at Triton's default policy.
QUIET_S = 3.5 * KEEPALIVE_MS / 1e3


def test_triton_accepts_the_gateways_ping_period():
    assert MIN_PING_INTERVAL_MS <= KEEPALIVE_MS


def test_a_session_stream_survives_a_quiet_spell(cloud):
    """After the quiet spell the session still answers, with the token the same session
    gives without one (greedy: one right answer)."""

    async def run(quiet_s: float) -> tuple[int, int]:
        client = _client(cloud.triton_url)  # the gateway's own channel settings
        session = TritonSequence(client)
        try:
            await session.start(
                [1, 2, 3], SamplingConfig(temperature=0.0), VerificationRule.TOKEN_ONLY, 0
            )
            await asyncio.sleep(quiet_s)
            reply = await session.step(3, [3])
            return reply.accepted, reply.token
        finally:
            await session.close()
            await client.close()

    assert asyncio.run(run(QUIET_S)) == asyncio.run(run(0.0))
