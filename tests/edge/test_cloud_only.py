"""edge.cloud_only against a fake stream whose far end is a greedy cloud in memory
(tests.edge.fake_cloud): a Verdict per token, each committed as it comes, no Draft sent."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from specsplit.edge.cloud_only import cloud_only_rounds
from specsplit.shared.session_mode import SessionMode
from tests.edge.fake_cloud import PROMPT, FakeCloudStream, committed, expected

N = 9


def test_cloud_only_hands_on_the_target_tokens_one_a_verdict():
    stream, seq = FakeCloudStream(N, SessionMode.CLOUD_ONLY), committed()

    async def main():
        return [c async for c in cloud_only_rounds(stream, seq)]

    chunks = asyncio.run(main())
    assert chunks == [[t] for t in expected(N)]  # FakeCloudStream.send refuses any Draft
    assert seq.tokens == PROMPT + expected(N) and seq.final == "LENGTH"
    stats = stream.stats
    assert stats.rounds == N and stats.drafted == 0 and stats.mode_passes == {}
    assert len(stats.round_ms) == len(stats.verify_ms) == N
    assert stats.draft_ms == [] and stats.server_ms == []  # cloud-only keeps fewer timings


def test_a_verdict_out_of_step_fails_the_stream_before_its_chunk_is_handed_on():
    stream, seq = FakeCloudStream(N, SessionMode.CLOUD_ONLY, fail_at=3), committed()
    chunks: list[list[int]] = []

    async def main():
        async for c in cloud_only_rounds(stream, seq):
            chunks.append(c)

    with pytest.raises(grpc.aio.AioRpcError) as e:
        asyncio.run(main())
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "committed_len 9, the edge committed 8" in e.value.details()
    assert chunks == [[t] for t in expected(3)] and stream.stats.rounds == 3
    assert seq.final == ""
