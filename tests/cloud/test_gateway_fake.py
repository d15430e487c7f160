"""The gateway in-process with fakes for Triton: paths a real server rarely takes."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import grpc

from specsplit.cloud.triton_client import SessionLost, VerifyReply
from specsplit.shared.protocol import PROTOCOL_VERSION, pb, pb_grpc
from tests.fakes import FakeTriton, gateway


class AlwaysLost(FakeTriton):
    """Loses the session on every verify, the re-opened one too."""

    async def verify(self, base_len, tokens, q=None) -> VerifyReply:
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
