"""A busy cloud on real parts (tritonserver + gateway at --max-sessions 1, ONNX Runtime): the
edge waits out the cloud's retry hint and then generates exactly what the target would; with no
retry window it reports the refusal at once, hint included."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from specsplit.cloud.supervision.process import CloudProcess
from specsplit.edge.client import GenerationConfig, SpecsplitError, SplitClient
from specsplit.edge.onnx_drafter import OnnxDrafter
from specsplit.shared.protocol import PROTOCOL_VERSION, RETRY_AFTER_KEY, pb, pb_grpc
from specsplit.shared.tiny import reference_greedy

pytestmark = pytest.mark.slow

PROMPT = [1, 2, 3, 4, 5]
N_NEW = 12


@pytest.fixture(scope="module")
def one_session_cloud(tiny, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("busy")
    with CloudProcess("--target", str(tiny.target), "--max-sessions", "1", log_dir=log_dir) as c:
        yield c


async def _hold(stub) -> grpc.aio.StreamStreamCall:
    """The cloud's one session, held open (Started read, no Draft sent)."""
    call = stub.Generate()
    sampling = pb.SamplingParams(max_new_tokens=200)
    start = pb.Start(protocol_version=PROTOCOL_VERSION, prompt_ids=[9, 9, 9], sampling=sampling)
    await call.write(pb.ClientMessage(start=start))
    assert (await call.read()).WhichOneof("msg") == "started"
    return call


def test_the_edge_waits_until_the_session_limit_frees_a_place(one_session_cloud, tiny):
    drafter = OnnxDrafter(tiny.draft_onnx)
    cfg = GenerationConfig(max_new_tokens=N_NEW, retry_window_s=30.0)

    async def run():
        async with grpc.aio.insecure_channel(one_session_cloud.address) as channel:
            held = await _hold(pb_grpc.SpeculativeDecodingStub(channel))
            try:
                async with SplitClient(one_session_cloud.address, drafter) as client:
                    gen = client.generate(PROMPT, cfg)
                    waiting = asyncio.create_task(gen.collect())
                    await asyncio.sleep(1.5)  # refused, and waiting out the hint meanwhile
                    assert not waiting.done()
                    held.cancel()  # the place frees once the gateway sees the cancel
                    await asyncio.wait_for(waiting, 30)
                    return gen
            finally:
                held.cancel()

    gen = asyncio.run(run())
    assert gen.stats.retries >= 1
    assert gen.token_ids == reference_greedy(tiny.target, PROMPT, N_NEW)


def test_without_a_retry_window_the_refusal_comes_at_once_with_its_hint(one_session_cloud, tiny):
    drafter = OnnxDrafter(tiny.draft_onnx)
    cfg = GenerationConfig(max_new_tokens=N_NEW, retry_window_s=0.0)

    async def run():
        async with grpc.aio.insecure_channel(one_session_cloud.address) as channel:
            stub = pb_grpc.SpeculativeDecodingStub(channel)
            held = await _hold(stub)
            try:
                refused = stub.Generate()
                start = pb.Start(protocol_version=PROTOCOL_VERSION, prompt_ids=PROMPT)
                await refused.write(pb.ClientMessage(start=start))
                with pytest.raises(grpc.aio.AioRpcError) as raw:
                    await refused.read()
                async with SplitClient(one_session_cloud.address, drafter) as client:
                    gen = client.generate(PROMPT, cfg)
                    with pytest.raises(SpecsplitError) as e:
                        await asyncio.wait_for(gen.collect(), 10)
                return raw.value, e.value, gen
            finally:
                held.cancel()

    raw, error, gen = asyncio.run(run())
    assert raw.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    hint = dict(raw.trailing_metadata())
    assert int(hint[RETRY_AFTER_KEY]) >= 100 and "retry in" in raw.details()
    assert error.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "limit of 1 sessions" in str(error)
    assert gen.stats.retries == 0


async def _status_after_first_draft(stub, start: pb.Start) -> tuple[bool, grpc.aio.AioRpcError]:
    """Writes ``start`` (announcing its first Draft), then that Draft 0.3 s later, as a cloud-led
    edge whose first block takes that long: whether the stream was still open when the Draft
    went, and the status it then ended with."""
    call = stub.Generate()
    await call.write(pb.ClientMessage(start=start))
    reading = asyncio.ensure_future(call.read())
    await asyncio.sleep(0.3)
    open_then = not reading.done()
    draft = pb.Draft(round=1, base_len=len(start.prompt_ids), tokens=[7, 8, 9, 10])
    await call.write(pb.ClientMessage(draft=draft))
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await asyncio.wait_for(reading, 10)
    return open_then, e.value


async def _once_admitted(stub, start: pb.Start) -> tuple[bool, grpc.aio.AioRpcError]:
    """``_status_after_first_draft`` once the one place is free: a session an earlier test held
    frees only when the gateway sees its cancel, so a refusal here is waited out by its hint,
    as a client would (for at most 10 s)."""
    deadline = asyncio.get_running_loop().time() + 10.0
    while True:
        open_then, status = await _status_after_first_draft(stub, start)
        if status.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
            return open_then, status
        assert asyncio.get_running_loop().time() < deadline, status.details()
        await asyncio.sleep(int(dict(status.trailing_metadata())[RETRY_AFTER_KEY]) / 1000)


def _cloud_led_start(prompt_ids) -> pb.Start:
    return pb.Start(
        protocol_version=PROTOCOL_VERSION,
        prompt_ids=prompt_ids,
        session_mode=pb.SESSION_MODE_CLOUD_LED,
        first_draft=True,
    )


def test_a_refusal_waits_for_the_first_draft_its_start_announced(one_session_cloud):
    """Start.first_draft: the cloud-led edge writes its first block right after Start. Ending
    the stream while that write is in flight would show the client INTERNAL instead of our
    status (grpc/grpc#36066), so the refusal comes once the Draft is read: still open 0.3 s on,
    and then RESOURCE_EXHAUSTED with its hint."""

    async def run():
        async with grpc.aio.insecure_channel(one_session_cloud.address) as channel:
            stub = pb_grpc.SpeculativeDecodingStub(channel)
            held = await _hold(stub)
            try:
                return await _status_after_first_draft(stub, _cloud_led_start(PROMPT))
            finally:
                held.cancel()

    open_then, status = asyncio.run(run())
    assert open_then
    assert status.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, status.details()
    assert int(dict(status.trailing_metadata())[RETRY_AFTER_KEY]) >= 100


def test_an_invalid_start_waits_for_the_first_draft_it_announced(one_session_cloud):
    """Likewise for a Start the cloud rejects (a prompt id past the vocabulary): its precise
    status, once the announced Draft is read."""

    async def run():
        async with grpc.aio.insecure_channel(one_session_cloud.address) as channel:
            stub = pb_grpc.SpeculativeDecodingStub(channel)
            return await _once_admitted(stub, _cloud_led_start([1, 2, 10**7]))

    open_then, status = asyncio.run(run())
    assert open_then
    assert status.code() == grpc.StatusCode.INVALID_ARGUMENT, status.details()
