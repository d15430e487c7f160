"""edge.lockstep against a fake stream whose far end is a greedy cloud in memory, and a fake
proposer (tests.edge.fake_cloud): the tokens handed on are the target's, each Draft continues
the committed prefix, and a loop that hands over ends with a Handover from which cloud-led
rounds (edge.cloud_led) go on with no token lost or handed on twice."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from specsplit.edge.cloud_led import cloud_led_rounds
from specsplit.edge.handover import Handover
from specsplit.edge.lockstep import lockstep_rounds
from specsplit.edge.mode_switch import LeadChoice
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

N = 23


async def _rounds(stream, seq, plan_, handover_plan=None):
    """The lock-step loop's chunks, then, after a Handover, the cloud-led loop's (as the
    dispatcher, edge.rounds, runs them); returns the chunks and the Handover, if any."""
    started = stream.started_message()
    chunks, handover = [], None
    async for out in lockstep_rounds(stream, seq, FakeProposer(), GREEDY, plan_, started, None):
        if isinstance(out, Handover):
            handover = out
        else:
            chunks.append(out)
    if handover is not None:
        led_plan = handover_plan or plan(SessionMode.CLOUD_LED)
        rounds = cloud_led_rounds(stream, seq, FakeProposer(), GREEDY, led_plan, started, handover)
        chunks += [c async for c in rounds]
    return chunks, handover


@pytest.mark.parametrize("k", [0, 1, 4])
@pytest.mark.parametrize("draft_ahead", [True, False])
def test_lockstep_hands_on_the_target_tokens(k, draft_ahead):
    stream, seq = FakeCloudStream(N, max_draft_tokens=max(k, 1)), committed()
    chunks, handover = asyncio.run(
        _rounds(stream, seq, plan(max_draft_tokens=k, draft_ahead=draft_ahead))
    )
    assert handover is None
    assert sum(chunks, []) == expected(N)
    assert seq.tokens == PROMPT + expected(N) and seq.final == "LENGTH"
    assert all(len(d.tokens) <= k for d in stream.drafts)
    stats = stream.stats
    assert stats.rounds == len(stream.verdicts) == len(chunks)
    assert stats.drafted == sum(len(d.tokens) for d in stream.drafts)
    assert stats.accepted == sum(v.accepted for v in stream.verdicts)
    assert stats.mode_passes["lock-step"][:2] == [len(chunks), N]
    if k == 1 and draft_ahead:  # blocks of 1 often miss nothing (of 4, none does: MISS 3)
        assert stats.ahead_hits > 0  # the next block, drafted while the verdict travelled
    if not draft_ahead:
        assert stats.ahead_hits == 0


def test_adaptive_rounds_record_each_k():
    stream, seq = FakeCloudStream(N), committed()
    chunks, _ = asyncio.run(_rounds(stream, seq, plan(adaptive=True)))
    assert sum(chunks, []) == expected(N)
    assert stream.stats.k_chosen == [len(d.tokens) for d in stream.drafts]


def test_a_lead_draft_hands_over_and_cloud_led_rounds_go_on_from_it(monkeypatch):
    asked = []

    def should_lead(choice, k):
        asked.append(k)
        return len(asked) == 3  # the third round's Draft leads

    monkeypatch.setattr(LeadChoice, "should_lead", should_lead)
    stream, seq = FakeCloudStream(N), committed()
    chunks, handover = asyncio.run(_rounds(stream, seq, plan(may_lead=True)))
    assert handover is not None and handover.round == 3 and handover.led is None
    lead = stream.drafts[2]
    assert lead.lead and lead.round == 3 and list(lead.tokens) == handover.block.tokens
    assert handover.remaining == N - sum(v.accepted + 1 for v in stream.verdicts[:2])
    assert sum(chunks, []) == expected(N)  # neither lost nor handed on twice
    assert seq.tokens == PROMPT + expected(N)
    # the cloud's first cloud-led step verified the lead Draft
    first_led = stream.verdicts[2]
    assert first_led.round == 3 and first_led.drafts_verified == len(lead.tokens)
    stats = stream.stats
    assert stats.lead_round == 3 and not stats.cloud_took_lead
    assert stats.mode_passes["lock-step"][0] == 2
    assert stats.mode_passes["cloud-led"][0] == len(stream.verdicts) - 2
    assert stats.rounds == len(stream.verdicts)


def test_the_cloud_taking_the_lead_hands_over_with_its_first_verdict():
    stream, seq = FakeCloudStream(N, cloud_leads=True), committed()
    chunks, handover = asyncio.run(_rounds(stream, seq, plan()))
    assert handover is not None and handover.round == 1
    assert handover.led is stream.verdicts[0] and handover.led.led
    assert sum(chunks, []) == expected(N)  # the led Verdict's chunk is committed once
    assert seq.tokens == PROMPT + expected(N)
    stats = stream.stats
    assert stats.lead_round == 1 and stats.cloud_took_lead
    assert "lock-step" not in stats.mode_passes  # no lock-step Verdict came
    assert stats.rounds == len(stream.verdicts)


def test_a_verdict_out_of_step_fails_the_stream_before_its_chunk_is_handed_on():
    stream, seq = FakeCloudStream(N, fail_at=1), committed()
    chunks = []

    async def main():
        rounds = lockstep_rounds(
            stream, seq, FakeProposer(), GREEDY, plan(), stream.started_message(), None
        )
        async for out in rounds:
            chunks.append(out)

    with pytest.raises(grpc.aio.AioRpcError) as e:
        asyncio.run(main())
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert len(chunks) == 1  # the first Verdict's; the second's never reached the caller
    assert stream.stats.rounds == 1  # nor its statistics
