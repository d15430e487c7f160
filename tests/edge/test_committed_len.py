"""The edge checks the proto's invariant that both sides agree on committed_len: a Verdict whose
committed_len differs from the edge's fails the stream as a retryable error before its tokens
are handed on (the generation re-opens from the last agreed prefix), and a Finished that differs
fails the generation. The liar is a proxy in front of an in-process gateway (tests.fakes) that
rewrites one message."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc
import pytest

from specsplit.edge.client import GenerationConfig, SpecsplitError, SplitClient
from specsplit.shared.protocol import pb, pb_grpc
from tests.fakes import SlowDrafter, gateway, generate_server

PROMPT = [1, 2, 3]
N = 6


class LyingProxy:
    """Forwards Generate to ``upstream``; ``lie`` may rewrite each ServerMessage of the first
    call (by its index in that call). Later calls (re-opens) pass unchanged."""

    def __init__(self, upstream: str, lie: Callable[[int, pb.ServerMessage], None]) -> None:
        self.channel = grpc.aio.insecure_channel(upstream)
        self.stub = pb_grpc.SpeculativeDecodingStub(self.channel)
        self.lie, self.calls = lie, 0

    async def generate(self, request_iterator, context):
        self.calls += 1
        call = self.stub.Generate()

        async def forward() -> None:
            async for msg in request_iterator:
                await call.write(msg)
            await call.done_writing()

        pump = asyncio.create_task(forward())
        try:
            i = 0
            while (msg := await call.read()) is not grpc.aio.EOF:
                if self.calls == 1:
                    self.lie(i, msg)
                i += 1
                yield msg
        finally:
            pump.cancel()
            call.cancel()


async def _generate(lie, mode: str, window_s: float) -> tuple[list[int], object, int]:
    """``mode``: the client's route, or split's session mode (lock-step, cloud-led)."""
    session_mode = {"lock-step": "lock-step", "cloud-led": "cloud-led"}.get(mode)
    mode = "split" if session_mode else mode
    async with gateway() as upstream:
        proxy = LyingProxy(upstream, lie)
        try:
            async with (
                generate_server(proxy.generate) as address,
                SplitClient(address, SlowDrafter(0.0)) as client,
            ):
                cfg = GenerationConfig(
                    max_new_tokens=N, max_draft_tokens=2, retry_window_s=window_s,
                    **({"session_mode": session_mode} if session_mode else {}),
                )  # fmt: skip
                gen = client.generate(PROMPT, cfg, route=mode)
                try:
                    return await gen.collect(), gen.stats, proxy.calls
                except SpecsplitError as e:
                    return e, gen.stats, proxy.calls
        finally:
            await proxy.channel.close()


def second_verdict_one_ahead(i: int, msg: pb.ServerMessage) -> None:
    # message 0 is Started, 1 the first Verdict
    if i == 2 and msg.WhichOneof("msg") == "verdict":
        msg.verdict.committed_len += 1


MODES = ["lock-step", "cloud-led", "cloud-only"]


@pytest.mark.parametrize("mode", MODES)
def test_an_honest_gateway_is_not_retried(mode):
    tokens, stats, calls = asyncio.run(_generate(lambda i, m: None, mode, 5.0))
    assert tokens == [7] * N and calls == 1 and stats.retries == 0


@pytest.mark.parametrize("mode", MODES)
def test_a_verdict_with_another_committed_len_reopens_from_the_agreed_prefix(mode):
    tokens, stats, calls = asyncio.run(_generate(second_verdict_one_ahead, mode, 5.0))
    assert tokens == [7] * N  # nothing of the disputed verdict was handed on twice or lost
    assert calls == 2 and stats.retries == 1


@pytest.mark.parametrize("mode", MODES)
def test_a_verdict_mismatch_names_both_lengths(mode):
    error, _, calls = asyncio.run(_generate(second_verdict_one_ahead, mode, 0.0))
    assert isinstance(error, SpecsplitError) and error.code == grpc.StatusCode.UNAVAILABLE
    n = len(PROMPT) + 2  # the first two verdicts commit one token each (none accepted)
    assert f"committed_len {n + 1}, the edge committed {n}" in str(error)
    assert calls == 1


def test_a_finished_with_another_committed_len_fails_the_generation():
    def lie(i: int, msg: pb.ServerMessage) -> None:
        if msg.WhichOneof("msg") == "finished":
            msg.finished.committed_len -= 1

    error, _, calls = asyncio.run(_generate(lie, "split", 5.0))
    assert isinstance(error, SpecsplitError) and error.code == grpc.StatusCode.INTERNAL
    n = len(PROMPT) + N
    assert f"Finished says committed_len {n - 1}, the edge committed {n}" in str(error)
    assert calls == 1  # a finished generation is never re-opened
