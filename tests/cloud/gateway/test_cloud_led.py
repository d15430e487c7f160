"""The cloud-led loop (cloud.gateway.cloud_led.cloud_led_rounds) against fakes: a FakeRound for
the target's steps and a FakeClient for the stream, no gRPC, no Triton. Started on its own and
from a lock-step session's Handover (cloud.gateway.handover): the edge's lead Draft, or the
server's lead with the first Draft's read still under way."""

from __future__ import annotations

import asyncio

import pytest

from specsplit.cloud.gateway.cloud_led import ReadingTail, cloud_led_rounds
from specsplit.cloud.gateway.handover import Handover, PendingDraft
from specsplit.cloud.gateway.messages import next_draft, until_half_close
from specsplit.cloud.gateway.session import Code, Finish, ProtocolError
from specsplit.shared.protocol import pb
from tests.cloud.gateway.fakes import FakeClient, FakeRound, until


async def _stop(tail: ReadingTail) -> None:
    """Ends a reader the loop left running (the servicer's until_half_close does it there)."""
    if tail.reader is not None:
        tail.reader.cancel()
        await asyncio.gather(tail.reader, return_exceptions=True)


def test_each_step_verifies_the_freshest_draft_consistent_with_the_committed_prefix():
    async def main():
        step, client, tail = FakeRound(finish_after=2), FakeClient(), ReadingTail()
        step.stepping.clear()  # the first step waits until both Drafts are read
        rounds = cloud_led_rounds(step, client, tail)
        first = asyncio.ensure_future(anext(rounds))
        # Both continue the first step's token 7 (committed [1, 2, 3] then 7)
        client.send(pb.Draft(round=1, base_len=3, tokens=[7, 4]))
        client.send(pb.Draft(round=2, base_len=3, tokens=[7, 5, 6]))
        await until(lambda: len(step.checked) == 2)
        step.stepping.set()
        v1 = await first
        assert step.verified[0] == [] and v1.drafts_verified == 0  # taken before they came
        v2 = await anext(rounds)
        assert step.verified[1] == [5, 6]  # the freshest, past what is committed
        assert (v2.round, v2.drafts_verified, v2.led) == (2, 2, False)
        assert step.checked == [(1, False), (2, False)]  # any base_len up to committed_len
        with pytest.raises(StopAsyncIteration):
            await anext(rounds)
        session = step.session
        assert session.finish is Finish.LENGTH
        assert (session.drafts_used, session.drafts_dropped) == (1, 1)  # round 1: never verified
        assert not tail.reader.done()  # still reading until the client half-closes
        await _stop(tail)

    asyncio.run(main())


def test_a_handover_lead_draft_is_verified_by_the_first_step():
    async def main():
        step, client, tail = FakeRound(finish_after=2), FakeClient(), ReadingTail()
        lead = PendingDraft(round=4, base_len=3, tokens=[5, 6], q=None)  # checked by lock-step
        out = [v async for v in cloud_led_rounds(step, client, tail, Handover(lead=lead))]
        assert step.verified == [[5, 6], []]
        assert [(v.round, v.drafts_verified, v.led) for v in out] == [(4, 2, False), (0, 0, False)]
        assert step.checked == []  # the lead Draft is not checked again
        assert step.session.drafts_used == 1
        await _stop(tail)

    asyncio.run(main())


def test_where_the_server_led_the_pending_read_is_the_readers_first_and_a_lead_draft_ordinary():
    async def main():
        step, client, tail = FakeRound(finish_after=2), FakeClient(), ReadingTail()
        reading = asyncio.ensure_future(next_draft(client, None))  # lock-step's, still waiting
        rounds = cloud_led_rounds(step, client, tail, Handover(reading=reading))
        v1 = await anext(rounds)
        assert v1.led and step.verified == [[]]  # the server stepped on its own, and says so
        # The client's first Draft, sent before it heard of the switch: lead set, base at the
        # prompt; read by the pending read, it is an ordinary cloud-led Draft.
        client.send(pb.Draft(round=1, base_len=3, tokens=[7, 8, 9], lead=True))
        await until(lambda: step.checked)
        assert reading.done()
        v2 = await anext(rounds)
        assert step.verified[1] == [8, 9] and not v2.led  # led is said once
        assert v2.round == 1
        client.close()
        with pytest.raises(StopAsyncIteration):
            await anext(rounds)
        await until_half_close(client, 5.0, tail.reader)  # the reader ends at the half-close
        assert tail.reader.done() and not tail.reader.cancelled()

    asyncio.run(main())


def test_a_lead_draft_in_a_session_that_started_cloud_led_is_refused():
    async def main():
        step, client, tail = FakeRound(), FakeClient(), ReadingTail()
        client.send(pb.Draft(round=1, base_len=3, tokens=[7], lead=True))
        with pytest.raises(ProtocolError) as refused:
            async for _ in cloud_led_rounds(step, client, tail):
                pass
        assert refused.value.code is Code.INVALID_ARGUMENT
        assert "lock-step" in refused.value.message
        assert tail.reader is None  # a loop that fails leaves no reader behind

    asyncio.run(main())


def test_a_draft_the_round_refuses_ends_the_loop_with_its_error():
    async def main():
        step, client, tail = FakeRound(), FakeClient(), ReadingTail()
        step.refuse = ProtocolError(Code.INVALID_ARGUMENT, "draft: token id outside")
        client.send(pb.Draft(round=1, base_len=3, tokens=[7]))
        with pytest.raises(ProtocolError, match="token id outside"):
            async for _ in cloud_led_rounds(step, client, tail):
                pass
        assert len(step.verified) < step.finish_after

    asyncio.run(main())


def test_a_finish_from_the_client_cancels_before_the_next_step():
    async def main():
        step, client, tail = FakeRound(), FakeClient(), ReadingTail()
        client.send(pb.Finish())
        out = [v async for v in cloud_led_rounds(step, client, tail)]
        assert step.session.finish is Finish.CANCELLED
        assert 1 <= len(out) < step.finish_after
        assert tail.reader.done()  # it stopped at the Finish

    asyncio.run(main())


def test_a_half_close_leaves_the_cloud_streaming_to_the_end():
    async def main():
        step, client, tail = FakeRound(finish_after=4), FakeClient(), ReadingTail()
        client.close()  # the client only listens from now on
        out = [v async for v in cloud_led_rounds(step, client, tail)]
        assert len(out) == 4 and step.session.finish is Finish.LENGTH
        assert out[-1].finished

    asyncio.run(main())


def test_drafts_after_the_final_verdict_are_dropped_until_the_half_close():
    async def main():
        step, client, tail = FakeRound(finish_after=1), FakeClient(), ReadingTail()
        out = [v async for v in cloud_led_rounds(step, client, tail)]
        assert out[-1].finished and not tail.reader.done()
        # Sent before the client read the final Verdict: neither verified nor an error
        client.send(pb.Draft(round=5, base_len=4, tokens=[1, 2]))
        client.close()
        await until_half_close(client, 5.0, tail.reader)
        assert tail.reader.done() and tail.reader.exception() is None
        assert step.checked == [] and step.verified == [[]]

    asyncio.run(main())


def test_a_loop_closed_mid_generation_stops_its_reader():
    async def main():
        step, client, tail = FakeRound(), FakeClient(), ReadingTail()
        rounds = cloud_led_rounds(step, client, tail)
        await anext(rounds)
        tasks = asyncio.all_tasks() - {asyncio.current_task()}
        assert len(tasks) == 1  # the reader, waiting for the client
        await rounds.aclose()  # the stream ended under it (the dispatcher's aclosing)
        assert all(t.done() for t in tasks) and tail.reader is None

    asyncio.run(main())
