"""After a rejection, a cloud-led step waits a bounded, measured moment for the edge's Draft
after the correction instead of verifying nothing: the gateway in-process with a fake Triton
that verifies by a fixed rule, and a client that answers every correction at once."""

from __future__ import annotations

import asyncio

import grpc

from specsplit.cloud.gateway.cloud_led import WAIT_SHARE, _Due
from specsplit.cloud.gateway.triton_client import StepReply
from specsplit.shared.protocol import PROTOCOL_VERSION, pb, pb_grpc
from tests.fakes import VOCAB, FakeTriton, gateway

PROMPT = [1, 2, 3]
N_NEW = 40
STEP_MS = 80.0  # reported (Started.step_ms): waits up to 40 ms; each pass really takes 10 ms


def target(prev: int) -> int:
    return (3 * prev + 1) % VOCAB


def sequence(n: int) -> list[int]:
    out = list(PROMPT)
    while len(out) < n:
        out.append(target(out[-1]))
    return out


class RuleTarget(FakeTriton):
    async def step(self, base_len, tokens, q=None) -> StepReply:
        await asyncio.sleep(0.01)
        accepted = 0
        while accepted + 1 < len(tokens) and tokens[accepted + 1] == target(tokens[accepted]):
            accepted += 1
        nxt = target(tokens[accepted])
        return StepReply(accepted=accepted, token=nxt, verify_ms=STEP_MS, roundtrip_ms=STEP_MS)


def _draft(base_len: int) -> pb.ClientMessage:
    """Four tokens after base_len, the third one wrong: a rejection two tokens in."""
    tokens = sequence(base_len + 4)[base_len:]
    tokens[2] = (tokens[2] + 1) % VOCAB
    return pb.ClientMessage(draft=pb.Draft(round=base_len, base_len=base_len, tokens=tokens))


async def _stream() -> list[pb.Verdict]:
    async with gateway(RuleTarget) as address, grpc.aio.insecure_channel(address) as ch:
        stub = pb_grpc.SpeculativeDecodingStub(ch)
        warm = stub.Generate()  # one step measured: Started.step_ms
        params = pb.SamplingParams(max_new_tokens=1)
        await warm.write(
            pb.ClientMessage(
                start=pb.Start(
                    protocol_version=PROTOCOL_VERSION, prompt_ids=PROMPT, sampling=params
                )
            )
        )
        await warm.read()
        await warm.write(pb.ClientMessage(draft=pb.Draft(round=1, base_len=len(PROMPT))))
        while (await warm.read()).WhichOneof("msg") != "finished":
            pass
        await warm.done_writing()

        call = stub.Generate()
        params = pb.SamplingParams(max_new_tokens=N_NEW)
        start = pb.Start(
            protocol_version=PROTOCOL_VERSION,
            prompt_ids=PROMPT,
            sampling=params,
            session_mode=pb.SESSION_MODE_CLOUD_LED,
        )
        await call.write(pb.ClientMessage(start=start))
        await call.read()
        await call.write(_draft(len(PROMPT)))
        verdicts = []
        while (msg := await call.read()).WhichOneof("msg") == "verdict":
            v = msg.verdict
            verdicts.append(v)
            if not v.finished and v.accepted < v.drafts_verified:  # corrected: draft after it
                await call.write(_draft(v.committed_len))
        await call.done_writing()
        assert await call.code() == grpc.StatusCode.OK
        return verdicts


def test_the_pass_after_a_correction_verifies_the_drafts_sent_after_it():
    verdicts = asyncio.run(_stream())
    rejected = [i for i, v in enumerate(verdicts[:-1]) if v.accepted < v.drafts_verified]
    assert len(rejected) >= 3
    # The first correction measures the delay (its next pass is draftless); from then on the
    # Draft after a correction is due well within half a step, and the next pass waits for it.
    draftless = [i for i in rejected[1:] if verdicts[i + 1].drafts_verified == 0]
    assert draftless == [], [(v.accepted, v.drafts_verified) for v in verdicts]
    assert verdicts[-1].finished and verdicts[-1].committed_len == len(PROMPT) + N_NEW


def test_no_wait_without_a_measured_delay_or_when_it_is_due_later_than_half_a_step():
    due = _Due()
    due.rejected(now=10.0)
    assert due.wait_s(step_ms=80.0, now=10.0) == 0.0  # nothing measured yet
    due.ms = 50.0  # due later than half of an 80 ms step
    assert due.wait_s(step_ms=80.0, now=10.0) == 0.0
    due.ms = 5.0
    assert abs(due.wait_s(step_ms=80.0, now=10.01) - (WAIT_SHARE * 0.08 - 0.01)) < 1e-9
    assert due.wait_s(step_ms=0.0, now=10.01) == 0.0  # no step measured
    assert due.wait_s(step_ms=80.0, now=11.0) == 0.0  # past the bound
