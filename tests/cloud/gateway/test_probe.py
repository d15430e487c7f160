"""The round trip measured in band (Start.probe, Probe, Echo; docs/design.md#probe): the server
leads a session whose first Draft cannot come within the bound at once, instead of idling the
bound out; waits for it where the round trip is short; and an older client sees nothing new.
The gateway in-process with a fake Triton, and the lock-step loop against a fake stream."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from specsplit.cloud.gateway.handover import Handover
from specsplit.cloud.gateway.lockstep import lockstep_rounds
from specsplit.cloud.gateway.messages import Echoes
from specsplit.cloud.gateway.session import Code, ProtocolError
from specsplit.cloud.gateway.triton_client import StepReply, TargetFull
from specsplit.edge.generation import GenerationConfig, GenerationStats
from specsplit.edge.retry import retry_after_s
from specsplit.edge.stream import Stream
from specsplit.shared.protocol import PROTOCOL_VERSION, pb, pb_grpc
from specsplit.shared.session_mode import SessionMode
from tests.cloud.gateway.fakes import FakeClient, FakeRound
from tests.fakes import FakeTriton, gateway, stream_end

PROMPT = [1, 2, 3]
ECHO = pb.ClientMessage(echo=pb.Echo())
PREFILL_S = 0.2  # the fake target's prefill: the time an unanswered Probe has at Started
GUARD_S = 30.0  # a loop that idles the bound (600 s here) out fails instead of hanging


class Steps(FakeTriton):
    """Prefills in PREFILL_S; reports every step as ``step_ms`` (the bound of the next session:
    1.5 of them); each pass takes 2 ms, so late Drafts reach a running session."""

    step_ms = 20.0  # a bound of 30 ms

    async def start(self, prompt, sampling, verification, seed, speculative=True) -> None:
        await super().start(prompt, sampling, verification, seed, speculative)
        await asyncio.sleep(PREFILL_S)

    async def step(self, base_len, tokens, q=None) -> StepReply:
        await asyncio.sleep(0.002)
        return StepReply(accepted=0, token=7, verify_ms=self.step_ms, roundtrip_ms=self.step_ms)


class EndlessSteps(Steps):
    step_ms = 400_000.0  # a bound of 600 s, which no test waits out


def start(probe: bool = True, n: int = 6, mode=pb.SESSION_MODE_LOCK_STEP) -> pb.ClientMessage:
    return pb.ClientMessage(
        start=pb.Start(
            protocol_version=PROTOCOL_VERSION,
            prompt_ids=PROMPT,
            sampling=pb.SamplingParams(max_new_tokens=n),
            session_mode=mode,
            follows_lead=True,
            probe=probe,
        )
    )


def draft(tokens=(7,)) -> pb.ClientMessage:
    return pb.ClientMessage(draft=pb.Draft(round=1, base_len=len(PROMPT), tokens=list(tokens)))


async def _warm(stub) -> None:
    """One lock-step round, so that the gateway has measured a step (Started.step_ms)."""
    call = stub.Generate()
    await call.write(start(probe=False, n=1))
    assert (await call.read()).WhichOneof("msg") == "started"
    await call.write(draft(()))
    while (await call.read()).WhichOneof("msg") != "finished":
        pass
    await call.done_writing()


async def _session(factory, script):
    """A warmed gateway and one stream driven by ``script(call)``; returns what it returns."""
    async with gateway(factory) as address, grpc.aio.insecure_channel(address) as ch:
        stub = pb_grpc.SpeculativeDecodingStub(ch)
        await _warm(stub)
        return await asyncio.wait_for(script(stub.Generate()), GUARD_S)


async def _verdicts(call) -> tuple[list[pb.Verdict], grpc.StatusCode]:
    verdicts = []
    while (msg := await call.read()).WhichOneof("msg") == "verdict":
        verdicts.append(msg.verdict)
    assert msg.WhichOneof("msg") == "finished"
    await call.done_writing()
    return verdicts, await call.code()


def test_an_echo_that_shows_a_long_round_trip_makes_the_server_lead_at_once():
    """The Echo comes 100 ms after the Probe (a 100 ms round trip, past the 30 ms bound): the
    server leads as it sends Started, although this client's first Draft is right behind it
    (a lock-step server waiting the bound out would have answered that Draft)."""

    async def script(call):
        await call.write(start())
        assert (await call.read()).WhichOneof("msg") == "probe"
        await asyncio.sleep(0.1)
        await call.write(ECHO)
        started = (await call.read()).started
        await call.write(draft())
        return started, *await _verdicts(call)

    started, verdicts, code = asyncio.run(_session(Steps, script))
    assert started.lead_after_ms == pytest.approx(1.5 * Steps.step_ms)
    assert code == grpc.StatusCode.OK
    assert verdicts[0].led and not any(v.led for v in verdicts[1:])
    assert [v.committed_len for v in verdicts] == list(range(4, 10))


def test_an_unanswered_probe_past_the_bound_leads_and_a_late_echo_is_skipped():
    """No Echo during the 200 ms prefill: the round trip is longer than that, past the bound;
    the server leads at once. The Echo, sent after Started, reaches the read the lock-step
    loop handed over, which skips it: the Draft behind it is verified as a cloud-led Draft."""

    async def script(call):
        await call.write(start(n=40))
        assert (await call.read()).WhichOneof("msg") == "probe"
        started = (await call.read()).started
        await call.write(ECHO)
        await call.write(draft([7] * 8))
        return started, *await _verdicts(call)

    _, verdicts, code = asyncio.run(_session(Steps, script))
    assert code == grpc.StatusCode.OK
    assert verdicts[0].led
    assert any(v.round == 1 and v.drafts_verified for v in verdicts)  # the Draft was read


def test_a_short_round_trip_waits_for_the_first_draft():
    """The Echo comes at once (a round trip far below the bound): lock-step as before, the
    first Draft answered by the first Verdict."""

    async def script(call):
        await call.write(start(n=1))
        assert (await call.read()).WhichOneof("msg") == "probe"
        await call.write(ECHO)
        started = (await call.read()).started
        await call.write(draft())
        return started, *await _verdicts(call)

    started, verdicts, code = asyncio.run(_session(EndlessSteps, script))
    assert started.lead_after_ms > 0 and code == grpc.StatusCode.OK
    assert [(v.led, v.round) for v in verdicts] == [(False, 1)]


@pytest.mark.parametrize(
    "first",
    [
        start(probe=False),  # an older client: follows the lead, never asked
        start(mode=pb.SESSION_MODE_CLOUD_LED),  # no lead to take: no Probe
        start(mode=pb.SESSION_MODE_CLOUD_ONLY),
    ],
)
def test_no_probe_where_none_was_asked_or_none_would_help(first):
    async def script(call):
        await call.write(first)
        msg = await call.read()
        await call.done_writing()
        return msg.WhichOneof("msg"), await stream_end(call)

    kind, (code, _) = asyncio.run(_session(Steps, script))
    assert kind == "started" and code == grpc.StatusCode.OK


def test_an_older_client_is_led_after_the_bound_as_before():
    """No Start.probe: Started first, and a first Draft that never comes is led after the bound."""

    async def script(call):
        await call.write(start(probe=False))
        assert (await call.read()).WhichOneof("msg") == "started"
        return await _verdicts(call)

    verdicts, code = asyncio.run(_session(Steps, script))
    assert code == grpc.StatusCode.OK and verdicts[0].led


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ([ECHO], "this stream was sent none"),  # before Start
        ([start(probe=False), ECHO], "this stream was sent none"),  # a client that did not ask
        ([start(mode=pb.SESSION_MODE_CLOUD_ONLY), ECHO], "this stream was sent none"),
        ([start(mode=pb.SESSION_MODE_CLOUD_LED), ECHO], "this stream was sent none"),
        ([start(), ECHO, ECHO], "a second Echo"),
        ([start(n=40), ECHO, draft(), ECHO], "a second Echo"),  # after a Draft
    ],
)
def test_an_echo_that_answers_no_probe_is_invalid_argument(messages, match):
    async def script(call):
        for m in messages:
            await call.write(m)
        return await stream_end(call)

    code, details = asyncio.run(_session(Steps, script))
    assert code == grpc.StatusCode.INVALID_ARGUMENT, details
    assert match in details


# The lock-step loop alone, its Probe's times set by hand: no clock in the assertions.


def _probed(client: FakeClient, sent_s_ago: float, rtt_s: float | None) -> Echoes:
    """Echoes of ``client`` whose Probe went out ``sent_s_ago``; its Echo came ``rtt_s`` after
    it (None: not yet)."""
    echoes = Echoes(client)
    echoes.probe_sent()
    echoes.sent_at = time.perf_counter() - sent_s_ago
    if rtt_s is not None:
        echoes.echo_at = echoes.sent_at + rtt_s
        echoes.echoed.set()
    return echoes


async def _first(rounds):
    out = await asyncio.wait_for(anext(rounds), GUARD_S)
    await rounds.aclose()
    return out


@pytest.mark.parametrize(("sent_s_ago", "rtt_s"), [(700.0, 650.0), (700.0, None)])
def test_a_round_trip_at_the_bound_hands_over_at_once(sent_s_ago, rtt_s):
    """An Echo 650 s after its Probe, or none 700 s after it, against a 600 s bound: the loop
    hands over at once (it would otherwise idle 600 s), the pending read handed on."""

    async def main():
        client = FakeClient()
        echoes = _probed(client, sent_s_ago, rtt_s)
        out = await _first(lockstep_rounds(FakeRound(), echoes, 5.0, lead_after_s=600.0))
        assert isinstance(out, Handover) and out.server_led
        client.send(ECHO if rtt_s is None else draft(), draft())
        first = await out.reading  # an Echo not read yet is skipped here
        assert isinstance(first, pb.Draft)

    asyncio.run(main())


def test_a_round_trip_below_the_bound_waits_for_the_first_draft():
    async def main():
        client = FakeClient()
        echoes = _probed(client, sent_s_ago=1.0, rtt_s=0.001)
        rounds = lockstep_rounds(FakeRound(), echoes, 5.0, lead_after_s=600.0)
        first = asyncio.ensure_future(_first(rounds))
        for _ in range(100):  # the loop waits: nothing came
            await asyncio.sleep(0)
        assert not first.done()
        client.send(draft())
        out = await first
        assert isinstance(out, pb.Verdict) and out.round == 1 and not out.led

    asyncio.run(main())


def test_echoes_refuse_an_echo_without_a_probe_and_a_second_one():
    async def main():
        client = FakeClient()
        client.send(ECHO)
        with pytest.raises(ProtocolError) as unasked:
            await anext(Echoes(client))
        assert unasked.value.code is Code.INVALID_ARGUMENT
        client = FakeClient()
        echoes = Echoes(client)
        echoes.probe_sent()
        client.send(ECHO, ECHO)
        with pytest.raises(ProtocolError) as second:
            await anext(echoes)
        assert second.value.code is Code.INVALID_ARGUMENT
        assert "second" in second.value.message

    asyncio.run(main())


class FullTarget(Steps):
    """Refuses every session's KV at once after the first (the warm-up, which measures a step):
    the Echo is still on its way then."""

    opened = 0

    async def start(self, prompt, sampling, verification, seed, speculative=True) -> None:
        FullTarget.opened += 1
        if FullTarget.opened > 1:
            raise TargetFull("KV_CAPACITY_EXCEEDED: 0 of 0 bytes free")
        await super().start(prompt, sampling, verification, seed, speculative)


def test_a_refusal_after_the_probe_reaches_the_edge_with_its_retry_hint(monkeypatch):
    """The edge writes its Echo as it reads the Probe; a refusal at once (the target's KV full)
    still reaches it as RESOURCE_EXHAUSTED with its hint: the gateway receives the Echo before
    it ends the stream (Echoes.settle), so no write of the edge's is in flight."""

    echoed: list[bool] = []
    timed = Echoes._echo
    monkeypatch.setattr(Echoes, "_echo", lambda self: echoed.append(True) or timed(self))

    async def main():
        async with gateway(FullTarget) as address, grpc.aio.insecure_channel(address) as ch:
            stub = pb_grpc.SpeculativeDecodingStub(ch)
            await _warm(stub)
            stream = Stream(stub, None, GenerationConfig(), GenerationStats("split"), 8, 1)
            await stream.start(PROMPT, SessionMode.LOCK_STEP, follows_lead=True)
            try:
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await asyncio.wait_for(stream.started(), GUARD_S)
            finally:
                await stream.close()
            return refused.value

    error = asyncio.run(main())
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error.details()
    assert retry_after_s(error) is not None
    assert echoed == [True]  # the Probe went out, and its Echo came before the refusal
