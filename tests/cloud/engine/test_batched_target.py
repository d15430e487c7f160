"""TargetModel.run: many sessions of different lengths and block sizes in ONE forward pass, each
equal to transformers running that session alone."""

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from specsplit.cloud.engine import target as target_mod
from specsplit.cloud.engine.target import (
    Close,
    Open,
    SessionNotFound,
    TargetModel,
    Verify,
)
from specsplit.shared.tiny import reference_greedy
from tests.cloud.engine.conftest import GREEDY


@pytest.fixture(scope="module")
def hf(target_dir):
    return AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()


@pytest.fixture
def target(target_dir):
    return TargetModel(target_dir, device="cpu", calibrate=False, weights="float")


def test_ragged_batch_is_one_pass_and_matches_each_session_alone(target, target_dir):
    """Sessions with prompts of 1..70 tokens and k in 0..6 (wrong drafts included) advance
    together, one pass per round; each ends equal to its own transformers greedy output."""
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 256, size=n).tolist() for n in (1, 3, 9, 17, 40, 70)]
    ks = [0, 1, 2, 4, 6, 3]
    n_new = 20
    committed = {sid: list(p) for sid, p in enumerate(prompts)}
    outcomes, info = target.run([Open(sid, p, GREEDY) for sid, p in enumerate(prompts)])
    assert outcomes == [None] * len(prompts)
    while any(len(committed[s]) - len(prompts[s]) < n_new for s in committed):
        live = [s for s in committed if len(committed[s]) - len(prompts[s]) < n_new]
        blocks = {s: rng.integers(0, 256, size=ks[s]).tolist() for s in live}
        before = target.forward_passes
        outcomes, info = target.run(
            [Verify(s, len(committed[s]), [committed[s][-1], *blocks[s]]) for s in live]
        )
        assert target.forward_passes == before + 1
        assert info.sessions == len(live)
        assert info.rows == sum(ks[s] + 1 for s in live)
        for s, out in zip(live, outcomes, strict=True):
            committed[s] += out.result.emitted(blocks[s])
            assert target.sessions[s].cache_len == len(committed[s]) - 1
    for sid, prompt in enumerate(prompts):
        got = committed[sid][len(prompt) : len(prompt) + n_new]
        assert got == reference_greedy(target_dir, prompt, n_new), sid


def test_logits_of_a_batched_pass_equal_a_full_forward(target, hf):
    seqs = [[5, 6, 7, 8, 9, 10], [200, 3, 4], list(range(20, 60))]
    target.run([Open(i, s[:-2], GREEDY) for i, s in enumerate(seqs)])
    slots = [target.sessions[i].slot for i in range(len(seqs))]
    from specsplit.cloud.engine.ragged import Segment

    logits = target.forward(
        [Segment(slot, s[-3:], True) for slot, s in zip(slots, seqs, strict=True)]
    )
    with torch.no_grad():
        for s, got in zip(seqs, logits, strict=True):
            ref = hf(torch.tensor([s])).logits[0, -3:]
            torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def test_long_prompt_is_chunked_without_full_logits(target, target_dir, monkeypatch):
    monkeypatch.setattr(target_mod, "PREFILL_CHUNK", 64)
    seen = []
    real = target.model.lm_head.forward
    monkeypatch.setattr(
        target.model.lm_head, "forward", lambda x: seen.append(x.shape[0]) or real(x)
    )
    prompt = np.random.default_rng(2).integers(0, 256, size=300).tolist()
    target.run([Open(1, prompt, GREEDY), Open(2, [4, 5, 6], GREEDY)])
    assert target.forward_passes == 5  # ceil(299 / 64) passes; the short prompt rides in the first
    assert seen == []  # prefill computes no logits at all
    out, info = target.run([Verify(1, 300, [prompt[-1]]), Verify(2, 3, [6, 9])])
    assert seen == [3] and info.rows == 3
    assert out[0].result.token == reference_greedy(target_dir, prompt, 1)[0]


def test_bad_request_fails_alone(target):
    target.run([Open(1, [1, 2, 3], GREEDY), Open(2, [4, 5], GREEDY)])
    out, info = target.run(
        [Verify(1, 9, [3]), Verify(2, 2, [5, 7]), Verify(3, 1, [1]), Verify(1, 3, [3, 999])]
    )
    assert isinstance(out[0], ValueError) and "base_len" in str(out[0])
    assert out[1].result.k == 1
    assert isinstance(out[2], SessionNotFound)
    assert isinstance(out[3], ValueError) and "vocabulary" in str(out[3])
    assert target.sessions[1].cache_len == 2  # untouched by both of its bad requests
    assert info.sessions == 1


def test_same_session_twice_in_one_batch_is_served_in_order(target):
    out, _ = target.run(
        [Open(1, [1, 2, 3], GREEDY), Verify(1, 3, [3]), Verify(1, 4, [0]), Close(1)]
    )
    assert out[0] is None and out[3] is None
    assert out[1].result.k == 0 and out[2].result.k == 0  # out[2]'s base_len follows out[1]
    assert 1 not in target.sessions


def test_block_hint_falls_under_load(target):
    """With passes that cost in proportion to rows, many speculative sessions get a short
    block; one session gets the largest."""
    for rows in (1, 2, 4, 8, 16, 32, 64, 128, 256):
        for _ in range(3):
            target.cost.observe(rows, 10.0 + rows)  # compute-bound past ~10 rows
    target.run([Open(s, [1, 2], GREEDY) for s in range(33)])
    _, one = target.run([Verify(0, 2, [2, 5, 6, 7, 8])])
    _, many = target.run([Verify(s, 2, [2, 5, 6, 7, 8]) for s in range(1, 33)])
    assert one.max_draft_tokens_hint > many.max_draft_tokens_hint
