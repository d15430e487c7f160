"""The split path on real parts: tritonserver + gateway (`specsplit-cloud serve`) + ONNX Runtime.

Every expected output comes from `transformers` running the same tiny models, never from our code.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from specsplit.edge.client import GenerationConfig, SplitClient
from specsplit.edge.onnx_drafter import OnnxDrafter
from specsplit.shared.acceptance import VerificationRule
from specsplit.shared.sampling import SamplingConfig
from specsplit.shared.tiny import reference_greedy

pytestmark = pytest.mark.slow

PROMPTS = [[1, 2, 3, 4, 5], [42], [7, 7, 7, 100, 200, 13, 9, 250]]
N_NEW = 24


def run(coro):
    return asyncio.run(coro)


async def generate(address, drafter, prompt, route="split", **cfg):
    async with SplitClient(address, drafter) as client:
        gen = client.generate(prompt, GenerationConfig(**cfg), route=route)
        await gen.collect()
        return gen


@pytest.fixture(scope="module")
def references(tiny):
    return {
        "target": {tuple(p): reference_greedy(tiny.target, p, N_NEW) for p in PROMPTS},
        "draft": {tuple(p): reference_greedy(tiny.draft, p, N_NEW) for p in PROMPTS},
    }


@pytest.mark.parametrize("k", [1, 3, 8])
@pytest.mark.parametrize("draft", ["same", "unrelated"])
def test_greedy_split_equals_target_greedy(cloud, tiny, references, k, draft):
    drafter = OnnxDrafter(tiny.target_onnx if draft == "same" else tiny.draft_onnx)
    for prompt in PROMPTS:
        # k fixed (no hint, so lock-step): the invariants below are about blocks of exactly k
        cfg = dict(max_new_tokens=N_NEW, max_draft_tokens=k, follow_hint=False)
        gen = run(generate(cloud.address, drafter, prompt, **cfg))
        s = gen.stats
        assert gen.token_ids == references["target"][tuple(prompt)], (prompt, k, draft)
        # Each round emits its accepted drafts plus one token (no stop truncates: k is clamped).
        assert s.new_tokens == N_NEW == s.accepted + s.rounds
        assert 0 <= s.accepted <= s.drafted <= k * s.rounds
        assert s.target_forward_passes == s.rounds
        if draft == "same":
            assert s.accepted == s.drafted, "a draft identical to the target must be fully accepted"
            # every verdict matches the guess, so blocks drafted during verification get used
            assert s.ahead_hits >= 1 or s.rounds <= 2
        else:
            assert s.acceptance_rate < 0.5


def test_cloud_only_equals_target_greedy(cloud, references):
    for prompt in PROMPTS:
        gen = run(generate(cloud.address, None, prompt, "cloud-only", max_new_tokens=N_NEW))
        assert gen.token_ids == references["target"][tuple(prompt)]
        assert gen.stats.target_forward_passes == N_NEW


def test_edge_only_equals_draft_greedy(tiny, references):
    drafter = OnnxDrafter(tiny.draft_onnx)
    for prompt in PROMPTS:
        gen = run(generate(None, drafter, prompt, "edge-only", max_new_tokens=N_NEW))
        assert gen.token_ids == references["draft"][tuple(prompt)]
        assert gen.stats.finish == "LENGTH"


@pytest.mark.parametrize("verification", [VerificationRule.REJECTION, VerificationRule.TOKEN_ONLY])
def test_sampling_same_seed_same_output(cloud, tiny, verification):
    drafter = OnnxDrafter(tiny.draft_onnx)
    cfg = dict(
        max_new_tokens=N_NEW,
        max_draft_tokens=3,
        sampling=SamplingConfig(temperature=0.9),
        verification=verification,
        follow_hint=False,  # the same blocks every run, whatever the cloud's measured load
    )
    a = run(generate(cloud.address, drafter, PROMPTS[0], seed=5, **cfg)).token_ids
    b = run(generate(cloud.address, drafter, PROMPTS[0], seed=5, **cfg)).token_ids
    c = run(generate(cloud.address, drafter, PROMPTS[0], seed=6, **cfg)).token_ids
    plain = run(generate(cloud.address, drafter, PROMPTS[0], seed=5, draft_ahead=False, **cfg))
    assert a == b == plain.token_ids  # drafting ahead never changes the output
    assert a != c
    assert len(a) == N_NEW


@pytest.mark.parametrize("mode", ["split", "cloud-only", "edge-only"])
def test_sampling_without_seed_differs_and_reports_its_seed(cloud, tiny, mode):
    """No seed: a fresh one per request (the edge's pick on a split route, the server's on
    cloud-only), so sampled requests differ, reported; sending it back reproduces the output."""
    drafter = OnnxDrafter(tiny.draft_onnx)
    cfg = dict(
        max_new_tokens=N_NEW,
        max_draft_tokens=3,
        sampling=SamplingConfig(temperature=1.0),
        follow_hint=False,  # a seed reproduces a run given the same blocks
    )
    a = run(generate(cloud.address, drafter, PROMPTS[0], mode, **cfg))
    b = run(generate(cloud.address, drafter, PROMPTS[0], mode, **cfg))
    assert a.token_ids != b.token_ids
    assert a.stats.seed is not None and a.stats.seed != b.stats.seed
    again = run(generate(cloud.address, drafter, PROMPTS[0], mode, seed=a.stats.seed, **cfg))
    assert again.token_ids == a.token_ids and again.stats.seed == a.stats.seed


def test_concurrent_sessions_do_not_mix(cloud, tiny, references):
    # One drafter per generation: a drafter's KV cache belongs to one sequence.
    async def three():
        drafters = [OnnxDrafter(d) for d in (tiny.draft_onnx, tiny.target_onnx, tiny.draft_onnx)]
        return await asyncio.gather(
            *(
                generate(cloud.address, d, p, max_new_tokens=N_NEW, max_draft_tokens=3)
                for d, p in zip(drafters, PROMPTS, strict=True)
            )
        )

    for gen, prompt in zip(run(three()), PROMPTS, strict=True):
        assert gen.token_ids == references["target"][tuple(prompt)]


def triton_sessions(triton_url: str) -> int:
    """Opens and closes a probe sequence directly on Triton; returns the caches held meanwhile."""
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(triton_url)
    try:
        tokens = grpcclient.InferInput("TOKENS", [1, 1], "INT64")
        tokens.set_data_from_numpy(np.array([[1]], dtype=np.int64))
        r = client.infer("target", [tokens], sequence_id=2**63 - 7, sequence_start=True)
        held = int(r.as_numpy("SESSIONS")[0, 0])
        end = grpcclient.InferInput("TOKENS", [1, 0], "INT64")
        end.set_data_from_numpy(np.zeros((1, 0), dtype=np.int64))
        client.infer("target", [end], sequence_id=2**63 - 7, sequence_end=True)
        return held - 1  # not counting the probe
    finally:
        client.close()


def test_session_closed_early_frees_its_cache(cloud, tiny):
    async def start_and_abandon():
        async with SplitClient(cloud.address, OnnxDrafter(tiny.draft_onnx)) as client:
            gen = client.generate(
                PROMPTS[0], GenerationConfig(max_new_tokens=500, max_draft_tokens=2)
            )
            async for _ in gen:
                break  # the client goes away mid-generation
        return gen

    # the gateway frees a session's cache asynchronously after its stream ends, an earlier
    # test's included: none may be left once that has had time
    _until_no_sessions(cloud)
    assert triton_sessions(cloud.triton_url) == 0
    gen = run(start_and_abandon())
    assert 0 < len(gen.token_ids) < 500
    _until_no_sessions(cloud)
    assert triton_sessions(cloud.triton_url) == 0


def _until_no_sessions(cloud) -> None:
    for _ in range(50):
        if triton_sessions(cloud.triton_url) == 0:
            return
        asyncio.run(asyncio.sleep(0.1))
