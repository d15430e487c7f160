"""The gateway in-process with fakes for Triton: paths a real server rarely takes."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import grpc
import pytest

from specsplit.cloud.gateway.stream_policy import StreamPolicy
from specsplit.cloud.gateway.triton_client import SessionLost, StepReply
from specsplit.shared.protocol import PROTOCOL_VERSION, pb, pb_grpc
from tests.fakes import FakeTriton, gateway


class AlwaysLost(FakeTriton):
    """Loses the session on every verify, the re-opened one too."""

    async def step(self, base_len, tokens, q=None) -> StepReply:
        raise SessionLost("SESSION_NOT_FOUND: gone")


def start_msg(**sampling) -> pb.ClientMessage:
    params = pb.SamplingParams(max_new_tokens=8, **sampling)
    return pb.ClientMessage(
        start=pb.Start(protocol_version=PROTOCOL_VERSION, prompt_ids=[1, 2, 3], sampling=params)
    )


def draft_msg(base_len: int, tokens: Sequence[int]) -> pb.ClientMessage:
    return pb.ClientMessage(draft=pb.Draft(round=1, base_len=base_len, tokens=list(tokens)))


async def exchange(factory, messages, **gateway_kw) -> tuple[list, grpc.StatusCode, str]:
    """Runs one stream against an in-process gateway; returns (replies, status, details)."""
    replies: list[pb.ServerMessage] = []
    async with gateway(factory, **gateway_kw) as address, grpc.aio.insecure_channel(address) as ch:
        call = pb_grpc.SpeculativeDecodingStub(ch).Generate(iter(messages), timeout=20)
        try:
            async for msg in call:
                replies.append(msg)
        except grpc.aio.AioRpcError as e:
            return replies, e.code(), e.details()
        return replies, grpc.StatusCode.OK, ""


def test_session_lost_twice_in_a_round_is_unavailable():
    _, code, details = asyncio.run(exchange(AlwaysLost, [start_msg(), draft_msg(3, [5])]))
    assert code == grpc.StatusCode.UNAVAILABLE, details
    assert "lost" in details


def test_fake_round_trip():
    replies, code, _ = asyncio.run(exchange(FakeTriton, [start_msg(), draft_msg(3, [5])]))
    assert code == grpc.StatusCode.OK
    assert [m.WhichOneof("msg") for m in replies] == ["started", "verdict", "finished"]


def test_started_reports_the_seed_in_force():
    given, _, _ = asyncio.run(exchange(FakeTriton, [start_msg(seed=12345)]))
    picked = [asyncio.run(exchange(FakeTriton, [start_msg()]))[0] for _ in range(2)]
    assert given[0].started.seed == 12345
    assert picked[0][0].started.seed != picked[1][0].started.seed


GENERATE = "/specsplit.v1.SpeculativeDecoding/Generate"


async def raw_exchange(payloads: list[bytes], **gateway_kw) -> tuple[grpc.StatusCode, str]:
    """Sends raw payloads (bytes as they are) on one stream; returns the final status."""
    async with (
        gateway(FakeTriton, **gateway_kw) as address,
        grpc.aio.insecure_channel(address) as channel,
    ):
        generate = channel.stream_stream(
            GENERATE, request_serializer=None, response_deserializer=pb.ServerMessage.FromString
        )
        call = generate(iter(payloads), timeout=20)
        try:
            async for _ in call:
                pass
        except grpc.aio.AioRpcError as e:
            return e.code(), e.details()
        return grpc.StatusCode.OK, ""


@pytest.mark.parametrize(
    "payloads",
    [[b"\xff"], [start_msg().SerializeToString(), b"\xff"], [b"\x0a\x05\x08"]],
    ids=["first", "after start", "truncated"],
)
def test_undecodable_payload_is_invalid_argument(payloads):
    code, details = asyncio.run(raw_exchange(payloads))
    assert code == grpc.StatusCode.INVALID_ARGUMENT, details
    assert "undecodable" in details


class SlowTriton(FakeTriton):
    async def step(self, base_len, tokens, q=None) -> StepReply:
        await asyncio.sleep(0.05)
        return await super().step(base_len, tokens, q)


async def silent_stream(messages: list[pb.ClientMessage], factory=FakeTriton, **policy_kw):
    """Sends ``messages`` and then nothing (without half-closing); returns the final status."""
    async with (
        gateway(factory, policy=StreamPolicy(**policy_kw)) as address,
        grpc.aio.insecure_channel(address) as channel,
    ):
        call = pb_grpc.SpeculativeDecodingStub(channel).Generate(timeout=20)
        for msg in messages:
            await call.write(msg)
        replies = []
        try:
            while (reply := await call.read()) is not grpc.aio.EOF:
                replies.append(reply)
        except grpc.aio.AioRpcError as e:
            return replies, e.code(), e.details()
        return replies, await call.code(), ""


def test_no_start_within_the_deadline():
    _, code, details = asyncio.run(silent_stream([], start_timeout_s=0.3))
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED and "Start" in details


def test_idle_split_stream_times_out():
    _, code, details = asyncio.run(silent_stream([start_msg()], idle_timeout_s=0.3))
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED and "Draft" in details


def test_silent_cloud_only_client_is_not_idle():
    msg = start_msg()
    msg.start.session_mode = pb.SESSION_MODE_CLOUD_ONLY
    msg.start.sampling.max_new_tokens = 20  # 20 rounds of 50 ms: longer than the idle timeout
    replies, code, _ = asyncio.run(silent_stream([msg], SlowTriton, idle_timeout_s=0.3))
    assert code == grpc.StatusCode.OK
    assert replies[-1].finished.reason == pb.FINISH_REASON_LENGTH
