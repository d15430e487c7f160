"""The cloud-only loop (cloud.gateway.cloud_only.cloud_only_rounds) against fakes: a FakeRound
for the target's steps and a FakeClient for the stream, no gRPC, no Triton."""

from __future__ import annotations

import asyncio

import pytest

from specsplit.cloud.gateway.cloud_only import cloud_only_rounds
from specsplit.cloud.gateway.session import Code, Finish, ProtocolError
from specsplit.shared.protocol import pb
from tests.cloud.gateway.fakes import FakeClient, FakeRound


def _run(step: FakeRound, client: FakeClient) -> list[pb.Verdict]:
    async def main():
        out = [v async for v in cloud_only_rounds(step, client)]
        assert asyncio.all_tasks() == {asyncio.current_task()}  # its watcher is stopped
        return out

    return asyncio.run(main())


def test_a_silent_client_gets_one_draftless_verdict_per_step_until_the_end():
    step = FakeRound(finish_after=5)
    out = _run(step, FakeClient())
    assert step.verified == [[]] * 5 and len(out) == 5
    assert step.session.finish is Finish.LENGTH and out[-1].finished


def test_a_half_close_is_fine_the_client_only_listens():
    step, client = FakeRound(finish_after=3), FakeClient()
    client.close()
    assert len(_run(step, client)) == 3 and step.session.finish is Finish.LENGTH


def test_a_finish_from_the_client_cancels_before_the_next_step():
    step, client = FakeRound(), FakeClient()
    client.send(pb.Finish())
    out = _run(step, client)
    assert step.session.finish is Finish.CANCELLED
    assert 1 <= len(out) < step.finish_after  # the step in flight commits, no step after it


def test_a_draft_is_refused():
    step, client = FakeRound(), FakeClient()
    client.send(pb.Draft(round=1, base_len=3, tokens=[7]))
    with pytest.raises(ProtocolError) as refused:
        _run(step, client)
    assert refused.value.code is Code.FAILED_PRECONDITION
    assert "cloud-only" in refused.value.message
    assert step.checked == [] and len(step.verified) < step.finish_after


def test_a_message_other_than_a_draft_or_finish_is_refused():
    step, client = FakeRound(), FakeClient()
    client.send(pb.ClientMessage(start=pb.Start()))
    with pytest.raises(ProtocolError) as refused:
        _run(step, client)
    assert refused.value.code is Code.FAILED_PRECONDITION
    assert "unexpected start" in refused.value.message
