"""The gateway in-process with fakes for Triton: paths a real server rarely takes."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import grpc

from specsplit.cloud.gateway import ModelIdentity, start_gateway
from specsplit.cloud.session import ModelLimits
from specsplit.cloud.triton_client import SessionLost, VerifyReply
from specsplit.shared.protocol import PROTOCOL_VERSION, pb, pb_grpc

MODEL = ModelIdentity("tiny", "qwen2", ModelLimits(vocab_size=256, max_context=512), "")
NOWHERE = "127.0.0.1:1"  # no Triton: the fakes answer instead


class FakeTriton:
    """Accepts nothing, answers token 7; subclasses break it."""

    def __init__(self, client) -> None:
        self.sequence_id = 1

    async def start(self, prompt, sampling, mode, seed) -> None:
        pass

    async def reopen(self, prompt, sampling, mode, seed) -> None:
        pass

    async def verify(self, base_len: int, tokens: Sequence[int], q=None) -> VerifyReply:
        return VerifyReply(accepted=0, token=7, verify_ms=1.0, roundtrip_ms=1.0)

    async def close(self) -> None:
        pass


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
    server, port, service = await start_gateway(
        NOWHERE, MODEL, session_factory=factory, **gateway_kw
    )
    replies: list[pb.ServerMessage] = []
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = pb_grpc.SpeculativeDecodingStub(channel).Generate(iter(messages), timeout=20)
            try:
                async for msg in call:
                    replies.append(msg)
            except grpc.aio.AioRpcError as e:
                return replies, e.code(), e.details()
            return replies, grpc.StatusCode.OK, ""
    finally:
        await server.stop(grace=None)
        await service.close()


def test_session_lost_twice_in_a_round_is_unavailable():
    _, code, details = asyncio.run(exchange(AlwaysLost, [start_msg(), draft_msg(3, [5])]))
    assert code == grpc.StatusCode.UNAVAILABLE, details
    assert "lost" in details


def test_fake_round_trip():
    replies, code, _ = asyncio.run(exchange(FakeTriton, [start_msg(), draft_msg(3, [5])]))
    assert code == grpc.StatusCode.OK
    assert [m.WhichOneof("msg") for m in replies] == ["started", "verdict", "finished"]
