"""Limits on a real `specsplit-cloud serve`: idle streams cannot lock new clients out."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from specsplit.cloud.supervision.process import CloudProcess
from specsplit.shared.protocol import PROTOCOL_VERSION, pb, pb_grpc
from tests.cloud.gateway.test_gateway_cancel import held_kv_caches, wait_for_kv_caches
from tests.fakes import stream_end

pytestmark = pytest.mark.slow
MAX_SESSIONS = 4
DEADLINE_S = 2.0

START = pb.ClientMessage(
    start=pb.Start(
        protocol_version=PROTOCOL_VERSION,
        prompt_ids=[1, 2, 3],
        sampling=pb.SamplingParams(max_new_tokens=4),
    )
)


@pytest.fixture(scope="module")
def strict(cloud, tiny, tmp_path_factory):
    """A gateway with few slots and short deadlines, in front of the shared test Triton."""
    args = ["--triton-url", cloud.triton_url, "--target", str(tiny.target)]
    args += ["--max-sessions", str(MAX_SESSIONS)]
    args += ["--start-deadline", str(DEADLINE_S), "--idle-timeout", str(DEADLINE_S)]
    with CloudProcess(*args, log_dir=tmp_path_factory.mktemp("strict")) as c:
        yield c


async def idle(stub, send_start: bool) -> grpc.StatusCode:
    """Holds a stream open, sending nothing (or only Start), until the server ends it."""
    call = stub.Generate(timeout=60)
    if send_start:
        await call.write(START)
    return (await stream_end(call))[0]


async def served(stub, patience_s: float) -> float:
    """Generates once, retrying RESOURCE_EXHAUSTED; returns how long until it was served."""
    t0 = time.monotonic()
    while True:
        try:
            replies = [r async for r in stub.Generate(iter([START]), timeout=30)]
            assert replies[-1].WhichOneof("msg") == "finished"
            return time.monotonic() - t0
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or time.monotonic() - t0 > patience_s:
                raise
            await asyncio.sleep(0.2)


def test_idle_streams_time_out_and_a_fresh_client_is_served(strict, cloud):
    baseline = held_kv_caches(cloud.triton_url)

    async def run():
        async with grpc.aio.insecure_channel(strict.address) as channel:
            stub = pb_grpc.SpeculativeDecodingStub(channel)
            hogs = [asyncio.create_task(idle(stub, i % 2 == 1)) for i in range(MAX_SESSIONS)]
            await asyncio.sleep(0.5)  # every slot taken
            try:
                waited = await served(stub, patience_s=5 * DEADLINE_S)
            finally:
                codes = await asyncio.wait_for(asyncio.gather(*hogs), 30)
            return waited, codes

    waited, codes = asyncio.run(run())
    assert codes == [grpc.StatusCode.DEADLINE_EXCEEDED] * MAX_SESSIONS
    assert waited < 5 * DEADLINE_S
    assert wait_for_kv_caches(cloud.triton_url, baseline) == baseline
