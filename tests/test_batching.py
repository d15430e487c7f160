"""Batched verification across sessions on real parts (tritonserver + gateway + ONNX Runtime).

Many sessions with different prompt lengths, block sizes and modes share Triton execute() calls;
the batch sizes Triton actually formed come back in every Verdict (Timings.batch_sessions) and
must show sharing. Expected greedy outputs come from transformers running each session alone.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from scipy import stats

from specsplit.edge.client import GenerationConfig, SplitClient
from specsplit.edge.onnx_drafter import OnnxDrafter
from specsplit.shared.acceptance import VerificationRule
from specsplit.shared.sampling import SamplingConfig, logits_to_probs
from specsplit.shared.tiny import reference_greedy

pytestmark = pytest.mark.slow

N_NEW = 32


def _sessions():
    """(prompt, mode, GenerationConfig kwargs): 12 sessions, four kinds, ragged everything."""
    rng = np.random.default_rng(7)
    lengths = [1, 4, 9, 16, 30, 57, 3, 12, 25, 6, 40, 2]
    kinds = ["greedy", "greedy", "greedy", "cloud-only", "greedy", "rejection"] * 2
    out = []
    for i, (n, kind) in enumerate(zip(lengths, kinds, strict=True)):
        prompt = rng.integers(0, 256, size=n).tolist()
        cfg = dict(max_new_tokens=N_NEW, max_draft_tokens=1 + i % 6, seed=i)
        mode = "cloud-only" if kind == "cloud-only" else "split"
        if kind == "rejection":
            cfg |= dict(
                sampling=SamplingConfig(temperature=0.9), verification=VerificationRule.REJECTION
            )
        if i == 11:
            kind = "token-only"
            cfg |= dict(
                sampling=SamplingConfig(temperature=0.9), verification=VerificationRule.TOKEN_ONLY
            )
        out.append((prompt, mode, kind, cfg))
    return out


async def _generate(address, drafter, prompt, mode, cfg):
    async with SplitClient(address, drafter) as client:
        gen = client.generate(prompt, GenerationConfig(**cfg), route=mode)
        await gen.collect()
        return gen


def test_mixed_sessions_share_passes_and_stay_exact(cloud, tiny):
    sessions = _sessions()

    async def all_at_once():
        drafters = [OnnxDrafter(tiny.draft_onnx if i % 2 else tiny.target_onnx) for i in range(12)]
        return await asyncio.gather(
            *(
                _generate(cloud.address, d, prompt, mode, cfg)
                for d, (prompt, mode, _, cfg) in zip(drafters, sessions, strict=True)
            )
        )

    gens = asyncio.run(all_at_once())
    shared = [b for g in gens for b in g.stats.batch_sessions]
    assert max(shared) > 1, "Triton never put two sessions into one execute()"
    assert all(b >= 1 for b in shared)
    for (prompt, _, kind, _), gen in zip(sessions, gens, strict=True):
        assert len(gen.token_ids) == N_NEW
        if kind in ("greedy", "cloud-only"):
            assert gen.token_ids == reference_greedy(tiny.target, prompt, N_NEW), kind
        else:
            assert all(0 <= t < 256 for t in gen.token_ids)


def target_probs(tiny, prompt, cfg: SamplingConfig) -> np.ndarray:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny.target, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, -1].numpy()
    return logits_to_probs(logits, cfg)


@pytest.mark.parametrize("verification", [VerificationRule.REJECTION, VerificationRule.TOKEN_ONLY])
def test_first_token_follows_target_distribution_under_batching(cloud, tiny, verification):
    """N sessions with seeds 0..N-1 through the whole stack, 8 in flight at a time so their
    rounds are verified inside shared forward passes (asserted); chi-square of the first token.

    The unrelated draft proposes one token per session (max_new_tokens=2 clamps k to 1), so the
    first token is an accepted draft or a correction: both paths are exercised. top_k=6 keeps six
    cells; every cell expects >= 5 draws (asserted). The threshold is chi2.isf(1e-6, df=5): a
    correct stack fails with probability < 1e-6; draws outside the support fail outright.
    """
    n, width = 1200, 8
    cfg = SamplingConfig(temperature=1.5, top_k=6)
    p = target_probs(tiny, [1, 2, 3, 4, 5], cfg)

    async def first_tokens():
        drafters = [OnnxDrafter(tiny.draft_onnx) for _ in range(width)]
        firsts, shared = [], []
        for base in range(0, n, width):
            gens = await asyncio.gather(
                *(
                    _generate(
                        cloud.address,
                        drafters[j],
                        [1, 2, 3, 4, 5],
                        "split",
                        dict(
                            max_new_tokens=2,
                            max_draft_tokens=1,
                            sampling=cfg,
                            seed=base + j,
                            verification=verification,
                        ),
                    )
                    for j in range(width)
                )
            )
            firsts += [g.token_ids[0] for g in gens]
            shared += [b for g in gens for b in g.stats.batch_sessions]
        return firsts, shared

    firsts, shared = asyncio.run(first_tokens())
    assert max(shared) > 1
    counts = np.bincount(firsts, minlength=p.size)
    support = p > 0
    assert counts[~support].sum() == 0, "first token outside the target's top-k support"
    expected = p[support] * n
    assert expected.min() >= 5
    stat = ((counts[support] - expected) ** 2 / expected).sum()
    assert stat < stats.chi2.isf(1e-6, df=support.sum() - 1), (counts[support], expected)
