"""Every decoder family end to end on real parts: `specsplit-cloud serve` (tritonserver with our
model repository, the gateway on a real port) with a tiny target of the family, and ONNX Runtime
drafts of the same family: the target itself (everything accepted) and another checkpoint of
the family (mostly rejected). Split output equals the served target's own greedy output
(cloud-only, same server) and transformers' one-token greedy steps of the target.
"""

from __future__ import annotations

import asyncio

import pytest

from specsplit.cloud.supervision.process import CloudProcess
from specsplit.edge.client import GenerationConfig, SplitClient
from specsplit.edge.export.exporter import export_onnx
from specsplit.edge.onnx_drafter import OnnxDrafter
from specsplit.shared.tiny_families import FAMILIES, make_tiny, stepwise_greedy

pytestmark = pytest.mark.slow

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]
N_NEW = 20


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    target = make_tiny(request.param, root / "target", seed=21)
    other = make_tiny(request.param, root / "other", seed=22)
    drafts = {
        "itself": export_onnx(target, root / "target-onnx"),
        "another": export_onnx(other, root / "other-onnx"),
    }
    with CloudProcess("--target", str(target), log_dir=root) as cloud:
        yield request.param, target, drafts, cloud


async def generate(address: str, drafter, mode: str) -> tuple[list[int], int, int]:
    config = GenerationConfig(max_new_tokens=N_NEW, session_mode="lock-step", adaptive=False)
    async with SplitClient(address, drafter) as client:
        gen = client.generate(PROMPT, config, route=mode)
        await gen.collect()
        return gen.token_ids, gen.stats.drafted, gen.stats.accepted


def test_split_equals_the_targets_own_greedy_output(family):
    from transformers import AutoModelForCausalLM

    name, target, drafts, cloud = family
    model = AutoModelForCausalLM.from_pretrained(target).float().eval()
    expected = stepwise_greedy(model, PROMPT, N_NEW)[len(PROMPT) :]
    cloud_only, _, _ = asyncio.run(generate(cloud.address, None, "cloud-only"))
    assert cloud_only == expected, name
    for kind, onnx in drafts.items():
        tokens, drafted, accepted = asyncio.run(generate(cloud.address, OnnxDrafter(onnx), "split"))
        assert tokens == expected, (name, kind)
        assert drafted > 0
        if kind == "itself":
            assert accepted > drafted // 2, (name, accepted, drafted)
