"""The lock-step loop and the servicer's mode switch, against fakes (docs/design.md#handover).

``lockstep_rounds`` never runs cloud-led rounds itself: a handover ends it with a ``Handover``,
and the servicer's ``_rounds`` dispatcher goes on with ``cloud_led_rounds`` from it, once.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from specsplit.cloud.gateway import service
from specsplit.cloud.gateway.cloud_led import ReadingTail
from specsplit.cloud.gateway.handover import Handover, PendingDraft, session_acceptance
from specsplit.cloud.gateway.lockstep import lockstep_rounds
from specsplit.cloud.gateway.session import Code, Finish, ProtocolError
from specsplit.shared.protocol import pb
from specsplit.shared.session_mode import SessionMode
from tests.cloud.gateway.fakes import FakeClient, FakeRound


async def _messages(*drafts: pb.Draft, hold: asyncio.Event | None = None):
    for d in drafts:
        yield pb.ClientMessage(draft=d)
    if hold is not None:  # the client goes silent
        await hold.wait()


async def _all(gen) -> list:
    return [x async for x in gen]


def test_lead_draft_ends_the_loop_with_a_handover_carrying_it():
    async def main():
        step = FakeRound()
        drafts = (
            pb.Draft(round=1, base_len=3, tokens=[1, 2]),
            pb.Draft(round=2, base_len=6, tokens=[4, 5, 6], lead=True),
            pb.Draft(round=3, base_len=9, tokens=[9]),  # for cloud-led rounds: not read here
        )
        messages = _messages(*drafts)
        out = await _all(lockstep_rounds(step, messages, idle_s=5.0))
        assert [type(x) for x in out] == [pb.Verdict, Handover]
        handover = out[-1]
        assert not handover.server_led and handover.reading is None
        lead = handover.lead
        assert (lead.round, lead.base_len, lead.tokens) == (2, 6, [4, 5, 6])
        assert step.verified == [[1, 2]]  # the lead Draft is the cloud-led step's to verify
        # the Draft after the lead is still unread, for the cloud-led reader
        assert (await anext(messages)).draft.round == 3

    asyncio.run(main())


def test_a_handover_carries_the_acceptance_the_lock_step_verdicts_measured():
    async def main():
        step = FakeRound()  # accepts every draft token
        drafts = [pb.Draft(round=i, base_len=3 + 5 * (i - 1), tokens=[1, 2, 3, 4]) for i in (1, 2)]
        drafts.append(pb.Draft(round=3, base_len=13, tokens=[5], lead=True))
        out = await _all(lockstep_rounds(step, _messages(*drafts), idle_s=5.0))
        handover = out[-1]
        expected = session_acceptance()
        for _ in range(2):
            expected.observe(4, 4)
        assert handover.acceptance.rate == expected.rate > session_acceptance().rate

    asyncio.run(main())


def test_no_first_draft_in_time_hands_the_pending_read_over():
    async def main():
        step = FakeRound()
        hold = asyncio.Event()
        messages = _messages(hold=hold)
        out = await _all(lockstep_rounds(step, messages, idle_s=5.0, lead_after_s=0.05))
        assert len(out) == 1 and isinstance(out[0], Handover)
        handover = out[0]
        assert handover.server_led and handover.lead is None
        assert not handover.reading.done()  # the read goes on, the cloud-led reader's first
        assert step.verified == []
        handover.reading.cancel()
        hold.set()

    asyncio.run(main())


def test_first_draft_in_time_stays_lock_step():
    async def main():
        step = FakeRound(finish_after=2)
        drafts = (pb.Draft(round=1, base_len=3, tokens=[1]), pb.Draft(round=2, base_len=5))
        out = await _all(lockstep_rounds(step, _messages(*drafts), 5.0, lead_after_s=5.0))
        assert [type(x) for x in out] == [pb.Verdict, pb.Verdict]
        assert [v.round for v in out] == [1, 2]

    asyncio.run(main())


@pytest.mark.parametrize(
    ("mode", "ends_in_handover", "loops"),
    [
        (SessionMode.LOCK_STEP, True, ["lockstep", "cloud_led"]),
        (SessionMode.LOCK_STEP, False, ["lockstep"]),
        (SessionMode.CLOUD_LED, False, ["cloud_led"]),
        (SessionMode.CLOUD_ONLY, False, ["cloud_only"]),
    ],
)
def test_the_dispatcher_switches_once_on_a_handover(monkeypatch, mode, ends_in_handover, loops):
    """Fakes of the three loops: the dispatcher yields every Verdict, runs cloud-led rounds
    from the lock-step loop's Handover (and only then), and never switches back."""
    ran: list[str] = []
    handover = Handover(lead=PendingDraft(4, 10, [1, 2], None))
    received: list = []
    handed_tail = ReadingTail()

    async def lockstep(step, messages, idle_s, lead_after_s):
        ran.append("lockstep")
        yield pb.Verdict(round=1)
        if ends_in_handover:
            yield handover

    async def cloud_led(step, messages, tail, given=None):
        assert tail is handed_tail  # the servicer's: where the loop leaves its reader
        ran.append("cloud_led")
        received.append(given)
        yield pb.Verdict(round=2, led=given is not None and given.server_led)

    async def cloud_only(step, messages):
        ran.append("cloud_only")
        yield pb.Verdict(round=0)

    monkeypatch.setattr(service, "lockstep_rounds", lockstep)
    monkeypatch.setattr(service, "cloud_led_rounds", cloud_led)
    monkeypatch.setattr(service, "cloud_only_rounds", cloud_only)
    servicer = SimpleNamespace(policy=SimpleNamespace(idle_timeout_s=5.0))

    async def main():
        rounds = service.SpeculativeService._rounds(servicer, mode, None, None, 0.0, handed_tail)
        return await _all(rounds)

    out = asyncio.run(main())
    assert ran == loops
    assert all(isinstance(v, pb.Verdict) for v in out)
    assert len(out) == len(loops)
    if "cloud_led" in ran:
        assert received == [handover if mode is SessionMode.LOCK_STEP else None]


def test_a_finish_or_a_half_close_ends_lock_step_rounds():
    async def main():
        finished, client = FakeRound(), FakeClient()
        client.send(pb.Draft(round=1, base_len=3, tokens=[1]), pb.Finish())
        out = await _all(lockstep_rounds(finished, client, 5.0))
        assert len(out) == 1 and finished.session.finish is Finish.CANCELLED
        closed, client = FakeRound(), FakeClient()
        client.send(pb.Draft(round=1, base_len=3, tokens=[1]))
        client.close()
        out = await _all(lockstep_rounds(closed, client, 5.0))
        assert len(out) == 1 and closed.session.finish is Finish.NONE

    asyncio.run(main())


def test_a_client_silent_past_the_idle_timeout_is_ended():
    async def main():
        step, client = FakeRound(), FakeClient()
        client.send(pb.Draft(round=1, base_len=3, tokens=[1]))  # then nothing
        with pytest.raises(ProtocolError) as refused:
            await _all(lockstep_rounds(step, client, idle_s=0.01))
        assert refused.value.code is Code.DEADLINE_EXCEEDED
        assert step.verified == [[1]]

    asyncio.run(main())
