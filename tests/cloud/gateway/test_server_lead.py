"""The server takes the lead itself (Start.follows_lead, Started.lead_after_ms, Verdict.led):
the gateway in-process with a fake Triton."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from specsplit.cloud.gateway.lockstep import LEAD_AFTER_STEPS, lead_after_ms
from specsplit.cloud.gateway.triton_client import StepReply
from specsplit.edge.mode_switch import LEAD_AT_START
from specsplit.shared.protocol import PROTOCOL_VERSION, pb, pb_grpc
from specsplit.shared.session_mode import SessionMode
from tests.fakes import FakeTriton, gateway

PROMPT = [1, 2, 3]


class SlowSteps(FakeTriton):
    """Reports every step as ``step_ms`` long (Started.step_ms of the next session); each pass
    takes 2 ms, so a stream lasts long enough for late Drafts to reach a running session."""

    step_ms = 20.0

    async def step(self, base_len, tokens, q=None) -> StepReply:
        await asyncio.sleep(0.002)
        return StepReply(accepted=0, token=7, verify_ms=self.step_ms, roundtrip_ms=self.step_ms)


class EndlessSteps(SlowSteps):
    step_ms = 600_000.0  # a bound no test waits out


def start(follows_lead: bool, n: int = 6, mode=pb.SESSION_MODE_LOCK_STEP) -> pb.ClientMessage:
    params = pb.SamplingParams(max_new_tokens=n)
    return pb.ClientMessage(
        start=pb.Start(
            protocol_version=PROTOCOL_VERSION,
            prompt_ids=PROMPT,
            sampling=params,
            session_mode=mode,
            follows_lead=follows_lead,
        )
    )


async def _warm(call) -> None:
    """One lock-step round, so that the gateway has measured a step (Started.step_ms)."""
    await call.write(start(False, n=1))
    assert (await call.read()).WhichOneof("msg") == "started"
    await call.write(pb.ClientMessage(draft=pb.Draft(round=1, base_len=len(PROMPT))))
    while (await call.read()).WhichOneof("msg") != "finished":
        pass
    await call.done_writing()


async def _stream(
    factory, follows_lead: bool, late_draft: pb.Draft | None, n: int = 6, drafts: bool = False
):
    """A stream that sends Start, then waits for the first Verdict before it drafts (a client
    whose first Draft is late), unless it ``drafts`` at once (or the server waits for it);
    ``late_draft`` is sent once that Verdict came, when it says the server led. Returns
    (Started, Verdicts, status)."""
    async with gateway(factory) as address, grpc.aio.insecure_channel(address) as ch:
        stub = pb_grpc.SpeculativeDecodingStub(ch)
        await _warm(stub.Generate())
        call = stub.Generate()
        await call.write(start(follows_lead, n))
        started = (await call.read()).started
        verdicts = []
        if drafts or not started.lead_after_ms:  # as a lock-step client
            await call.write(pb.ClientMessage(draft=pb.Draft(round=1, base_len=len(PROMPT))))
        while (msg := await call.read()).WhichOneof("msg") == "verdict":
            verdicts.append(msg.verdict)
            if len(verdicts) == 1 and msg.verdict.led and late_draft is not None:
                await call.write(pb.ClientMessage(draft=late_draft))
        assert msg.WhichOneof("msg") == "finished"
        await call.done_writing()
        return started, verdicts, await call.code()


def test_the_bound_is_1_5_measured_steps_for_a_lock_step_session_that_follows():
    assert LEAD_AFTER_STEPS == LEAD_AT_START  # one rule, measured at either end
    assert lead_after_ms(True, SessionMode.LOCK_STEP, 80.0) == pytest.approx(120.0)
    assert lead_after_ms(False, SessionMode.LOCK_STEP, 80.0) == 0.0
    assert lead_after_ms(True, SessionMode.CLOUD_LED, 80.0) == 0.0
    assert lead_after_ms(True, SessionMode.CLOUD_ONLY, 80.0) == 0.0
    assert lead_after_ms(True, SessionMode.LOCK_STEP, 0.0) == 0.0  # no step measured yet


def test_no_first_draft_in_time_the_server_steps_on_its_own():
    started, verdicts, code = asyncio.run(_stream(SlowSteps, True, None))
    assert started.lead_after_ms == pytest.approx(LEAD_AFTER_STEPS * SlowSteps.step_ms)
    assert code == grpc.StatusCode.OK
    assert [v.led for v in verdicts] == [True] + [False] * 5  # said once, on the first
    # cloud-led steps with no Draft: one target token each, round 0
    assert [(v.round, v.accepted, v.token) for v in verdicts] == [(0, 0, 7)] * 6
    assert [v.committed_len for v in verdicts] == list(range(4, 10))
    assert verdicts[-1].finished


def test_a_lead_draft_sent_before_the_client_heard_of_the_switch_is_an_ordinary_draft():
    """An edge that chose to lead with its first Draft sends Draft.lead; the server, which led
    first, reads it as a cloud-led Draft instead of refusing it (INVALID_ARGUMENT)."""
    late = pb.Draft(round=1, base_len=len(PROMPT), tokens=[7, 7, 7], lead=True)
    _, verdicts, code = asyncio.run(_stream(SlowSteps, True, late, n=40))
    assert code == grpc.StatusCode.OK
    assert verdicts[0].led and len(verdicts) <= 40


def test_a_client_that_does_not_follow_is_waited_for():
    started, verdicts, code = asyncio.run(_stream(SlowSteps, False, None, n=1))
    assert started.lead_after_ms == 0
    assert code == grpc.StatusCode.OK
    assert not any(v.led for v in verdicts) and verdicts[0].round == 1


def test_a_first_draft_within_the_bound_is_answered_lock_step():
    started, verdicts, code = asyncio.run(_stream(EndlessSteps, True, None, n=1, drafts=True))
    assert started.lead_after_ms == pytest.approx(LEAD_AFTER_STEPS * EndlessSteps.step_ms)
    assert code == grpc.StatusCode.OK
    assert [(v.led, v.round) for v in verdicts] == [(False, 1)]
