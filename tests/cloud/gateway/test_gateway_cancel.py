"""Clients that cancel mid-flight on the real gateway + Triton: no KV cache is left behind."""

from __future__ import annotations

import asyncio
import random
import secrets
import time

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from specsplit.shared.protocol import PROTOCOL_VERSION, pb, pb_grpc

pytestmark = pytest.mark.slow


def held_kv_caches(triton_url: str) -> int:
    """KV caches the target holds, read from the SESSIONS output of a throwaway sequence."""
    client = grpcclient.InferenceServerClient(triton_url)
    try:
        sid = secrets.randbits(62) + 1

        def tokens(ids: list[int]) -> list[grpcclient.InferInput]:
            t = grpcclient.InferInput("TOKENS", [1, len(ids)], "INT64")
            t.set_data_from_numpy(np.asarray([ids], dtype=np.int64))
            return [t]

        client.infer("target", tokens([1]), sequence_id=sid, sequence_start=True)
        reply = client.infer("target", tokens([]), sequence_id=sid, sequence_end=True)
        return int(reply.as_numpy("SESSIONS").reshape(-1)[0])
    finally:
        client.close()


def wait_for_kv_caches(triton_url: str, expected: int, timeout_s: float = 15.0) -> int:
    deadline = time.monotonic() + timeout_s
    while (held := held_kv_caches(triton_url)) != expected and time.monotonic() < deadline:
        time.sleep(0.2)
    return held


START = pb.ClientMessage(
    start=pb.Start(
        protocol_version=PROTOCOL_VERSION,
        prompt_ids=list(range(1, 40)),
        sampling=pb.SamplingParams(max_new_tokens=64),
    )
)


async def cancel_during_start(stub, rng: random.Random) -> None:
    call = stub.Generate()
    await call.write(START)
    await asyncio.sleep(rng.uniform(0, 0.01))
    call.cancel()


async def cancel_after_draft(stub, rng: random.Random) -> None:
    call = stub.Generate()
    await call.write(START)
    started = (await call.read()).started
    draft = pb.Draft(round=1, base_len=started.committed_len, tokens=[5, 6, 7, 8])
    await call.write(pb.ClientMessage(draft=draft))
    await asyncio.sleep(rng.uniform(0, 0.005))
    call.cancel()


@pytest.mark.parametrize("scenario", [cancel_during_start, cancel_after_draft])
def test_cancel_mid_flight_frees_the_kv_cache(cloud, scenario):
    baseline = held_kv_caches(cloud.triton_url)
    rng = random.Random(0)

    async def run() -> None:
        async with grpc.aio.insecure_channel(cloud.address) as channel:
            stub = pb_grpc.SpeculativeDecodingStub(channel)
            for _ in range(40):
                await scenario(stub, rng)
            await asyncio.sleep(0.1)

    asyncio.run(run())
    assert wait_for_kv_caches(cloud.triton_url, baseline) == baseline
