"""edge.cloud_led from Started, against a fake stream whose far end is a greedy cloud stepping
without waiting for Drafts, and a fake proposer (tests.edge.fake_cloud): whatever Drafts reach
it, the tokens handed on are the target's, each once. From a Handover:
tests/edge/test_lockstep.py."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from specsplit.edge.cloud_led import cloud_led_rounds
from specsplit.shared.session_mode import SessionMode
from tests.edge.fake_cloud import (
    GREEDY,
    PROMPT,
    FakeCloudStream,
    FakeProposer,
    committed,
    expected,
    plan,
)

N = 31


async def _collect(stream, seq, plan_) -> list[list[int]]:
    rounds = cloud_led_rounds(stream, seq, FakeProposer(), GREEDY, plan_, stream.started_message())
    return [c async for c in rounds]


@pytest.mark.parametrize("adaptive", [False, True])
def test_cloud_led_hands_on_the_target_tokens(adaptive):
    stream, seq = FakeCloudStream(N, SessionMode.CLOUD_LED), committed()
    led = plan(SessionMode.CLOUD_LED, adaptive=adaptive)
    chunks = asyncio.run(_collect(stream, seq, led))
    assert sum(chunks, []) == expected(N)
    assert seq.tokens == PROMPT + expected(N) and seq.final == "LENGTH"
    stats = stream.stats
    assert stats.rounds == len(stream.verdicts) == len(chunks)
    assert stats.drafts_sent == len(stream.drafts)  # every Draft reached the stream
    assert stats.drafted == sum(v.drafts_verified for v in stream.verdicts)
    assert stats.mode_passes["cloud-led"][:2] == [len(chunks), N]
    assert not stats.cloud_took_lead and stats.lead_round == 0


def test_a_draft_the_stream_refuses_stops_drafting_and_is_not_counted_as_sent():
    class Refusing(FakeCloudStream):
        async def send(self, msg):
            await super().send(msg)
            if len(self.drafts) == 2:  # the second Draft: as if the call ended under it
                raise grpc.aio.AioRpcError(
                    grpc.StatusCode.CANCELLED, grpc.aio.Metadata(), grpc.aio.Metadata(), ""
                )

    stream, seq = Refusing(N, SessionMode.CLOUD_LED), committed()
    chunks = asyncio.run(_collect(stream, seq, plan(SessionMode.CLOUD_LED)))
    assert sum(chunks, []) == expected(N)  # the cloud streams on without Drafts
    assert len(stream.drafts) == 2 and stream.stats.drafts_sent == 1


def test_a_verdict_out_of_step_fails_the_stream_before_its_chunk_is_handed_on():
    stream, seq = FakeCloudStream(N, SessionMode.CLOUD_LED, fail_at=2), committed()
    chunks: list[list[int]] = []

    async def main():
        rounds = cloud_led_rounds(
            stream,
            seq,
            FakeProposer(),
            GREEDY,
            plan(SessionMode.CLOUD_LED),
            stream.started_message(),
        )
        async for c in rounds:
            chunks.append(c)

    with pytest.raises(grpc.aio.AioRpcError) as e:
        asyncio.run(main())
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert len(chunks) == 2 and stream.stats.rounds == 2


@pytest.mark.parametrize("steps_first", [0, 1, 2])
def test_a_block_drafted_during_the_prefill_starts_the_speculation(steps_first):
    """``early`` (edge.rounds: drafted after the prompt while the cloud prefilled): its first
    Draft holds what of that block the cloud did not commit while it drafted (``steps_first``
    cloud-led steps before the block was done), from the committed prefix, sent before any
    other drafting."""
    import threading

    from specsplit.edge.drafting import Block
    from specsplit.edge.worker import Worker

    drafted = [FakeProposer.draft(len(PROMPT) + i) for i in range(4)]  # wrong at PROMPT + 3
    gate = threading.Event()

    def block_after_the_prompt(stop):  # done once the cloud stepped ``steps_first`` times
        assert gate.wait(10)
        return Block(list(drafted), None), 1.0

    class Counting(FakeCloudStream):
        async def recv(self, kind):
            if len(self.verdicts) >= steps_first:
                gate.set()
                await asyncio.sleep(0.01)  # the block's thread goes first
            return await super().recv(kind)

    stream, seq = Counting(N, SessionMode.CLOUD_LED), committed()

    async def main():
        early = Worker(block_after_the_prompt)
        rounds = cloud_led_rounds(
            stream, seq, FakeProposer(), GREEDY, plan(SessionMode.CLOUD_LED),
            stream.started_message(), None, early,
        )  # fmt: skip
        return [c async for c in rounds]

    chunks = asyncio.run(main())
    assert sum(chunks, []) == expected(N)
    first = stream.drafts[0]
    # the loop may read the block before the Verdicts that came meanwhile: at most those
    j = first.base_len - len(PROMPT)
    assert 0 <= j <= steps_first and not first.continues
    assert list(first.tokens[: 4 - j]) == drafted[j:]
