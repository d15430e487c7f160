"""Admission that fits real requests: a session reserves the KV slot it holds (its committed
length plus one verification block, in the target's size classes) and grows the reservation as
it generates; bytes are counted in the dtype the target reports for its own KV slots.

A growth that cannot be reserved ends the stream with RESOURCE_EXHAUSTED and a retry hint (after
trying the reclaim policy); the edge re-opens from its committed sequence, nothing lost."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest

from specsplit.cloud.gateway.admission import (
    RETRY_AFTER_KEY,
    Admission,
    KVShape,
    Reclaiming,
    Refused,
)
from specsplit.edge.client import GenerationConfig, SpecsplitError, SplitClient
from specsplit.shared.protocol import PROTOCOL_VERSION, pb, pb_grpc
from tests.cloud.gateway.fakes import FakeControl
from tests.fakes import SlowDrafter, gateway

KV = KVShape(layers=2, kv_heads=2, head_dim=16, dtype_bytes=4)  # the tiny test model: 512 B
B = KV.bytes_per_token
UNLIMITED = 1 << 30  # an OpenAI request without max_tokens (edge.openai.schema.UNLIMITED)


def test_the_reservation_grows_with_the_committed_length_one_size_class_at_a_time():
    admission = Admission(KV, budget_bytes=10_000 * B)
    ticket = admission.enter(None)
    seen = []
    for committed_len in (3, 48, 49, 112, 113, 240, 241, 100):  # 100: never shrinks
        ticket.reserve(committed_len)
        seen.append(admission.reserved_bytes // B)
    assert seen == [64, 64, 128, 128, 256, 256, 512, 512]
    assert ticket.kv_bytes == 512 * B and admission.live == [ticket]
    ticket.free()
    assert admission.reserved_bytes == 0 and not admission.live


def test_a_growth_that_does_not_fit_reclaims_idle_sessions_first_then_names_a_retry():
    admission = Admission(KV, budget_bytes=320 * B, reclaim_after_s=1.0)
    ended: list = []
    idle = admission.enter(None)
    idle.reserve(100)  # 128 positions
    idle.started = True
    idle.attach(FakeControl(ended, idle))
    busy = admission.enter(None)
    busy.reserve(100)  # 128 positions, at work: never reclaimed
    busy.attach(FakeControl(ended, busy))
    growing = admission.enter(None)
    growing.reserve(3)  # 64 positions: the budget is full
    idle.active -= 5  # idle beyond its grace
    with busy.working(), growing.working(), pytest.raises(Reclaiming):
        growing.reserve(49)  # 128 positions: only the idle session's memory makes room
    assert ended == [idle]
    idle.leave()
    idle.free()
    growing.reserve(49)
    assert admission.reserved_bytes == 256 * B
    other = admission.enter(None)
    other.reserve(10)  # 64 positions: full again, nobody idle
    with growing.working(), pytest.raises(Refused) as refused:
        growing.reserve(113)  # 256 positions
    assert not isinstance(refused.value, Reclaiming)
    assert "committed sequence" in refused.value.message
    assert int(dict(refused.value.trailing_metadata())[RETRY_AFTER_KEY]) >= 100
    assert growing.kv_bytes == 128 * B  # a refused growth keeps what the session held


def test_a_session_larger_than_the_whole_budget_is_refused_without_a_hint():
    admission = Admission(KV, budget_bytes=256 * B)
    with pytest.raises(Refused) as refused:
        admission.enter(None).reserve(300)  # 512 positions: never, however long one waits
    assert "whole KV budget" in refused.value.message
    assert refused.value.trailing_metadata() == ()
    assert admission.reserved_bytes == 0 and not admission.live


def test_bytes_are_counted_in_the_dtype_the_target_reports():
    admission = Admission(KV, budget_bytes=1024 * B)  # flags guessed float32 (512 B)
    ticket = admission.enter(None)
    ticket.reserve(100)
    assert admission.reserved_bytes == 128 * 512
    admission.observe_kv("replica-a", 256)  # the target's slots are bfloat16
    assert admission.bytes_per_token == 256 and admission.reserved_bytes == 128 * 256
    admission.observe_kv("replica-b", 512)  # another replica in float32: the larger counts
    assert admission.bytes_per_token == 512
    admission.observe_kv("replica-b", 256)  # restarted in bfloat16
    assert admission.bytes_per_token == 256
    admission.observe_kv("replica-a", None)  # a target that does not say: no change
    assert admission.bytes_per_token == 256


# -- the gateway and the edge ------------------------------------------------------------------


@contextlib.asynccontextmanager
async def connected(**gateway_kw):
    async with gateway(**gateway_kw) as address, grpc.aio.insecure_channel(address) as channel:
        yield address, pb_grpc.SpeculativeDecodingStub(channel)


def _start(prompt: list[int], max_new_tokens: int, cloud_only: bool = False) -> pb.ClientMessage:
    sampling = pb.SamplingParams(max_new_tokens=max_new_tokens)
    start = pb.Start(
        protocol_version=PROTOCOL_VERSION,
        prompt_ids=prompt,
        sampling=sampling,
        session_mode=pb.SESSION_MODE_CLOUD_ONLY if cloud_only else pb.SESSION_MODE_UNSPECIFIED,
    )
    return pb.ClientMessage(start=start)


async def _hold(stub, prompt_len: int):
    """A session holding ``slot_positions(prompt_len + 16)`` positions, silent after Started."""
    call = stub.Generate(timeout=30)
    await call.write(_start([1] * prompt_len, 8))
    assert (await call.read()).WhichOneof("msg") == "started"
    return call


def test_requests_without_max_tokens_are_admitted_like_any_other():
    """Two "as many as fit" requests (max_context 512) fit a budget of two small slots."""
    admission = Admission(KV, budget_bytes=2 * 64 * B, reclaim_after_s=None)

    async def run():
        async with connected(admission=admission) as (_, stub):
            calls = [stub.Generate(timeout=20) for _ in range(2)]
            try:
                for call in calls:
                    await call.write(_start([1, 2, 3], UNLIMITED))
                return [(await call.read()).WhichOneof("msg") for call in calls]
            finally:
                for call in calls:
                    call.cancel()

    assert asyncio.run(run()) == ["started", "started"]


def test_a_growth_beyond_the_budget_ends_the_stream_with_a_retry_hint():
    admission = Admission(KV, budget_bytes=192 * B, reclaim_after_s=None)

    async def run():
        async with connected(admission=admission) as (_, stub):
            held = await _hold(stub, 100)  # 128 positions
            try:
                call = stub.Generate(timeout=20)
                await call.write(_start([1, 2, 3], 100, cloud_only=True))
                await call.done_writing()
                committed = []
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    async for msg in call:
                        if msg.WhichOneof("msg") == "verdict":
                            committed.append(msg.verdict.committed_len)
                return committed, refused.value
            finally:
                held.cancel()

    committed, refused = asyncio.run(run())
    # 64 positions hold the prompt and every step up to committed_len 48 (+ a block of 16).
    assert committed[-1] == 49 and committed == list(range(4, 50))
    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "committed sequence" in refused.details()
    assert int(dict(refused.trailing_metadata())[RETRY_AFTER_KEY]) >= 100


@pytest.mark.parametrize("session_mode", ["lock-step", "cloud-led", "cloud-only"])
def test_the_edge_resumes_after_a_refused_growth_without_losing_a_token(session_mode):
    """The edge's session cannot grow while another holds the memory; it is refused with a
    hint, waits, re-opens from its committed sequence once the other ends, and its output is
    the uninterrupted run's (the fake target answers 7 at every position)."""
    admission = Admission(KV, budget_bytes=192 * B, reclaim_after_s=None)
    n_new = 80
    mode = "cloud-only" if session_mode == "cloud-only" else "split"
    cfg = GenerationConfig(
        max_new_tokens=n_new,
        retry_window_s=20.0,
        session_mode="auto" if mode == "cloud-only" else session_mode,
        max_draft_tokens=4,
    )

    async def run():
        async with connected(admission=admission) as (address, stub):
            held = await _hold(stub, 100)
            try:
                async with SplitClient(address, SlowDrafter(delay_s=0.0)) as client:
                    gen = client.generate([1, 2, 3], cfg, mode)
                    tokens: list[int] = []

                    async def consume() -> None:
                        async for chunk in gen:
                            tokens.extend(chunk)

                    collecting = asyncio.create_task(consume())
                    await asyncio.sleep(0.5)  # refused at 49 tokens, waiting out the hint
                    assert not collecting.done()
                    before = len(tokens)
                    held.cancel()
                    await asyncio.wait_for(collecting, 20)
                    return gen, before, tokens
            finally:
                held.cancel()

    gen, before, tokens = asyncio.run(run())
    assert before == 46  # generated up to the growth the budget could not hold, then waited
    assert gen.stats.retries >= 1
    assert tokens == gen.token_ids == [7] * n_new
    assert admission.reserved_bytes == 0 and not admission.live


def test_without_a_retry_window_the_refused_growth_is_reported():
    admission = Admission(KV, budget_bytes=192 * B, reclaim_after_s=None)
    cfg = GenerationConfig(max_new_tokens=80, retry_window_s=0.0, session_mode="lock-step")

    async def run():
        async with connected(admission=admission) as (address, stub):
            held = await _hold(stub, 100)
            try:
                async with SplitClient(address, SlowDrafter(delay_s=0.0)) as client:
                    gen = client.generate([1, 2, 3], cfg)
                    with pytest.raises(SpecsplitError) as e:
                        await asyncio.wait_for(gen.collect(), 10)
                    return gen, e.value
            finally:
                held.cancel()

    gen, error = asyncio.run(run())
    assert error.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert len(gen.token_ids) == 46  # every committed token was delivered before the refusal


def test_a_prompt_the_whole_budget_cannot_hold_is_refused_at_once():
    """Near max_context (512 here), a prompt's slot may be larger than the whole budget: no hint,
    so the edge reports it at once instead of retrying for its window."""
    admission = Admission(KV, budget_bytes=256 * B)
    cfg = GenerationConfig(max_new_tokens=8, retry_window_s=30.0, session_mode="lock-step")

    async def run():
        async with (
            connected(admission=admission) as (address, _),
            SplitClient(address, SlowDrafter(delay_s=0.0)) as client,
        ):
            gen = client.generate([1] * 500, cfg)
            with pytest.raises(SpecsplitError) as e:
                await asyncio.wait_for(gen.collect(), 5)
            return gen, e.value

    gen, error = asyncio.run(run())
    assert error.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "whole KV budget" in error.details
    assert gen.stats.retries == 0
