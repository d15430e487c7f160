"""A steadily oversubscribed cloud on real parts (tritonserver + gateway at --max-sessions 4,
eight ONNX Runtime edges generating back to back): no generation fails, every greedy output is
the target's own, and the waits are reported. The same gateway counts KV bytes in the dtype the
target reports, whatever its flags guessed."""

from __future__ import annotations

import asyncio
import statistics
import time

import pytest

from specsplit.cloud.supervision.process import CloudProcess
from specsplit.cloud.supervision.triton import free_port
from specsplit.edge.client import GenerationConfig, SplitClient
from specsplit.edge.onnx_drafter import OnnxDrafter
from specsplit.shared.tiny import reference_greedy
from tests.cloud.gateway.test_metrics import samples, scrape, value

pytestmark = pytest.mark.slow
MAX_SESSIONS = 4
EDGES = 2 * MAX_SESSIONS
STEADY_S = 3.0  # each edge generates back to back this long: twice the places, all along
N_NEW = 16
PROMPTS = [[1, 2, 3, 4, 5, 6 + i] for i in range(4)]
TINY_FLOAT32_KV = 2 * 2 * 2 * 16 * 4  # layers x (K, V) x kv heads x head dim x 4 bytes


@pytest.fixture(scope="module")
def small_cloud(cloud, tiny, tmp_path_factory):
    """A gateway with four places in front of the shared (float32) Triton. Its flags say
    bfloat16, so until the target reports its own KV dtype the gateway counts half the bytes."""
    port = free_port()
    args = ["--triton-url", cloud.triton_url, "--target", str(tiny.target)]
    args += ["--max-sessions", str(MAX_SESSIONS), "--dtype", "bfloat16"]
    args += ["--metrics-port", str(port)]
    with CloudProcess(*args, log_dir=tmp_path_factory.mktemp("oversubscribed")) as c:
        yield c, f"http://127.0.0.1:{port}/metrics"


async def _edge(address: str, drafter: OnnxDrafter, prompt: list[int]) -> list[tuple]:
    """Generations one after the other for STEADY_S: (tokens, time to first token, retries)."""
    cfg = GenerationConfig(max_new_tokens=N_NEW, retry_window_s=60.0)
    done = []
    until = time.monotonic() + STEADY_S
    async with SplitClient(address, drafter) as client:
        while not done or time.monotonic() < until:
            gen = client.generate(prompt, cfg)
            await asyncio.wait_for(gen.collect(), 90)
            done.append((gen.token_ids, gen.stats.ttft_s, gen.stats.retries))
    return done


def test_twice_as_many_edges_as_places_all_finish_with_the_targets_output(
    small_cloud, tiny, record_property
):
    (cloud, _), expected = small_cloud, {}
    for prompt in PROMPTS:
        expected[tuple(prompt)] = reference_greedy(tiny.target, prompt, N_NEW)
    drafters = [OnnxDrafter(tiny.draft_onnx) for _ in range(EDGES)]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(EDGES)]

    async def run():
        edges = (_edge(cloud.address, d, p) for d, p in zip(drafters, prompts, strict=True))
        return await asyncio.gather(*edges, return_exceptions=True)

    t0 = time.monotonic()
    results = asyncio.run(run())
    wall = time.monotonic() - t0
    failed = [r for r in results if isinstance(r, BaseException)]
    assert not failed, failed
    waits = sorted(ttft for edge in results for _, ttft, _ in edge)
    retries = sum(n for edge in results for _, _, n in edge)
    slowest = max((g for edge in results for g in edge), key=lambda g: g[1])
    lost = sum(
        N_NEW - len(tokens) for edge in results for tokens, _, _ in edge
    )  # every generation asked for N_NEW (no EOS in the tiny model)
    report = (
        f"{EDGES} edges on {MAX_SESSIONS} places, {len(waits)} generations in "
        f"{wall:.1f} s: time to first token p50 {statistics.median(waits):.2f} s, "
        f"p90 {waits[int(0.9 * (len(waits) - 1))]:.2f} s, "
        f"max {waits[-1]:.2f} s (refused {slowest[2]}x); {retries} refusals waited out; "
        f"{lost} tokens lost"
    )
    print(report)
    record_property("oversubscription", report)
    for prompt, edge in zip(prompts, results, strict=True):
        for tokens, _, _ in edge:
            assert tokens == expected[tuple(prompt)]
    assert lost == 0


def test_kv_is_counted_in_the_dtype_the_target_reports(small_cloud, tiny):
    cloud, metrics_url = small_cloud

    async def one():
        async with SplitClient(cloud.address, OnnxDrafter(tiny.draft_onnx)) as client:
            await client.generate(PROMPTS[0], GenerationConfig(max_new_tokens=4)).collect()

    asyncio.run(one())
    found = samples(scrape(metrics_url))
    assert value(found, "specsplit_kv_bytes_per_token") == TINY_FLOAT32_KV  # not bfloat16's
    deadline = time.monotonic() + 10  # reservations end once Triton has freed each session
    while value(found, "specsplit_kv_reserved_bytes") and time.monotonic() < deadline:
        time.sleep(0.1)
        found = samples(scrape(metrics_url))
    assert value(found, "specsplit_kv_reserved_bytes") == 0
