"""300 clients that cancel during prefill or right after a Draft, against a real serve: every KV
cache comes back within seconds and no process of the tree (gateway, tritonserver, its Python
stub) keeps the memory.

The serve here runs the target without oneDNN-packed Linear layers: oneDNN keeps state per
distinct batch shape (rows), so the stub grows by up to a few hundred MiB while new shapes keep
appearing, then levels off (`make soak` plots the curve in docs/soak.png). That is bounded and
has nothing to do with cancels; without it, any growth here is what cancels left behind.
"""

from __future__ import annotations

import asyncio
import os
import random
from unittest import mock

import grpc
import pytest

from bench.rss import tree_rss
from specsplit.cloud.supervision.process import CloudProcess
from specsplit.shared.protocol import PROTOCOL_VERSION, pb, pb_grpc
from tests.cloud.gateway.test_gateway_cancel import held_kv_caches, wait_for_kv_caches

pytestmark = pytest.mark.slow
CANCELS = 300
WARMUP = 40  # the allocators' pools reach their working size before the baseline is taken
CONCURRENCY = 12
MAX_GROWTH = 50 * 2**20


@pytest.fixture(scope="module")
def unpacked(tiny, tmp_path_factory):
    with mock.patch.dict(os.environ, {"SPECSPLIT_PACKED_LINEAR": "0"}):
        process = CloudProcess("--target", str(tiny.target), log_dir=tmp_path_factory.mktemp("c"))
        process.start()  # the environment is copied into serve (and its Triton) here
    try:
        yield process
    finally:
        process.stop()


def start(rng: random.Random) -> pb.ClientMessage:
    # Long prompts: a prefill of several chunks (PREFILL_CHUNK = 256) is in flight for a while.
    prompt = [rng.randrange(256) for _ in range(rng.choice((40, 300, 700)))]
    sampling = pb.SamplingParams(max_new_tokens=64, temperature=rng.choice((0.0, 0.8)))
    return pb.ClientMessage(
        start=pb.Start(protocol_version=PROTOCOL_VERSION, prompt_ids=prompt, sampling=sampling)
    )


async def cancel_during_prefill(stub, rng: random.Random) -> None:
    call = stub.Generate()
    await call.write(start(rng))
    await asyncio.sleep(rng.uniform(0, 0.02))
    call.cancel()


async def cancel_after_draft(stub, rng: random.Random) -> None:
    call = stub.Generate()
    await call.write(start(rng))
    started = (await call.read()).started
    tokens = [rng.randrange(256) for _ in range(rng.randrange(1, 9))]
    draft = pb.Draft(round=1, base_len=started.committed_len, tokens=tokens)
    await call.write(pb.ClientMessage(draft=draft))
    await asyncio.sleep(rng.uniform(0, 0.005))
    call.cancel()


async def storm(address: str, n: int, seed: int) -> None:
    rng = random.Random(seed)
    scenarios = [cancel_during_prefill, cancel_after_draft] * (n // 2)
    rng.shuffle(scenarios)
    gate = asyncio.Semaphore(CONCURRENCY)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.SpeculativeDecodingStub(channel)

        async def one(scenario) -> None:
            async with gate:
                await scenario(stub, random.Random(rng.random()))

        await asyncio.gather(*(one(s) for s in scenarios))


def test_cancel_storm_frees_every_kv_cache_and_memory(unpacked):
    cloud = unpacked
    baseline = held_kv_caches(cloud.triton_url)
    asyncio.run(storm(cloud.address, WARMUP, seed=1))
    assert wait_for_kv_caches(cloud.triton_url, baseline) == baseline
    before = tree_rss(cloud.proc.pid)

    asyncio.run(storm(cloud.address, CANCELS, seed=2))
    held = wait_for_kv_caches(cloud.triton_url, baseline)
    after = tree_rss(cloud.proc.pid)

    growth = {role: after.get(role, 0) - rss for role, rss in before.items()}
    print(f"KV caches {held} (baseline {baseline}); RSS growth MiB:", end=" ")
    print({role: round(b / 2**20, 1) for role, b in growth.items()})
    assert held == baseline
    assert {"gateway", "tritonserver", "stub"} <= set(before), before
    assert all(b < MAX_GROWTH for b in growth.values()), growth
