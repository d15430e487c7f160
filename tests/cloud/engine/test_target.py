"""TargetModel without Triton: one forward per round, exact cache cropping, sessions isolated."""

from dataclasses import replace

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from specsplit.cloud.engine.target import SessionNotFound, SessionParams, TargetModel
from specsplit.shared.acceptance import VerificationRule
from specsplit.shared.sampling import SamplingConfig, SparseDist
from specsplit.shared.tiny import reference_greedy
from tests.cloud.engine.conftest import GREEDY


@pytest.fixture
def target(target_dir):
    return TargetModel(target_dir, device="cpu", weights="float")


def greedy_rounds(target, sid, prompt, drafts_per_round, n_new):
    """Drives verify() with given draft blocks (wrong ones included) until n_new tokens."""
    committed = list(prompt)
    target.start(sid, prompt, GREEDY)
    rng = np.random.default_rng(0)
    while len(committed) - len(prompt) < n_new:
        drafts = rng.integers(0, 256, size=drafts_per_round).tolist()
        r = target.verify(sid, len(committed), [committed[-1], *drafts])
        committed += r.emitted(drafts)
        assert target.sessions[sid].cache_len == len(committed) - 1  # the cache invariant
    return committed[len(prompt) : len(prompt) + n_new]


@pytest.mark.parametrize("k", [0, 1, 4])
def test_crop_keeps_output_equal_to_reference(target, target_dir, k):
    # Random drafts are mostly rejected: every round crops the cache back.
    prompt = [3, 1, 4, 1, 5]
    assert greedy_rounds(target, 1, prompt, k, 16) == reference_greedy(target_dir, prompt, 16)


def test_verify_is_one_forward_pass(target):
    target.start(1, [1, 2, 3], GREEDY)
    before = target.forward_passes
    target.verify(1, 3, [3, 10, 11, 12])
    assert target.forward_passes == before + 1


def test_bad_base_len_leaves_session_intact(target, target_dir):
    target.start(1, [1, 2, 3], GREEDY)
    with pytest.raises(ValueError, match="base_len"):
        target.verify(1, 5, [3])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        target.verify(1, 3, [3, 9999])
    r = target.verify(1, 3, [3])
    assert r.token == reference_greedy(target_dir, [1, 2, 3], 1)[0]


def test_sessions_are_isolated_and_end_frees(target):
    target.start(1, [1, 2, 3], GREEDY)
    target.start(2, [9, 9], GREEDY)
    a = target.verify(1, 3, [3])
    target.verify(2, 2, [9])
    assert target.verify(1, 4, [a.token]).accepted == 0
    assert target.end(1) and not target.end(1)
    with pytest.raises(SessionNotFound):
        target.verify(1, 5, [0])


def test_idle_sessions_are_evicted(target):
    target.start(1, [1, 2], GREEDY)
    assert target.evict_idle(3600) == []
    assert target.evict_idle(-1) == [1]
    assert not target.sessions


def test_sampled_round_is_reproducible_by_position(target):
    params = SessionParams(SamplingConfig(temperature=1.0), VerificationRule.REJECTION, seed=7)
    q = [SparseDist(np.array([10, 11]), np.array([0.5, 0.5]))]
    results = []
    for sid in (1, 2):
        target.start(sid, [1, 2, 3], params)
        results.append(target.verify(sid, 3, [3, 10], q))
    assert results[0] == results[1]


def test_logits_match_transformers(target, target_dir):
    # The verify forward with a cache equals a fresh full forward (what generate() does).
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    seq = [5, 6, 7, 8, 9, 10]
    with torch.no_grad():
        full = model(torch.tensor([seq])).logits[0].argmax(-1).tolist()
    target.start(1, seq[:3], GREEDY)
    r = target.verify(1, 3, [seq[2], *seq[3:]])
    expect_n = next((i for i in range(3) if full[2 + i] != seq[3 + i]), 3)
    assert r.accepted == expect_n
    assert r.token == full[2 + expect_n]


def test_steps_without_drafts_after_a_hint_of_none_revive_the_acceptance_estimate(target):
    """Early rejections made the hint 0, so the session's rounds carry no drafts and bring no
    evidence: those passes pull the estimate back until the hint asks for drafts again. Steps
    without drafts under a hint that allowed them say nothing and leave it alone."""
    target.start(1, [5, 9, 2], GREEDY)
    for _ in range(15):
        target.acceptance.observe(0, 4)
    low = target.acceptance.rate
    target.verify(
        1, 3, [2]
    )  # the hint (MAX_DRAFT_TOKENS so far) allowed drafts: none came, by choice
    assert target.acceptance.rate == low
    target.last_pass = replace(target.last_pass, max_draft_tokens_hint=0)
    target.verify(1, 4, [7])
    assert target.acceptance.rate > low


def test_a_prefill_in_the_pass_does_not_inflate_the_block_hint(target):
    """The hint is for the next pass, which will not carry this pass's prefill. Where rows
    cost time (a compute-bound target, the curve below), counting 45 prompt rows as fixed made
    drafts look nearly free: the hint jumped from 1 to 7 for 8 sessions at acceptance 0.8."""
    from specsplit.cloud.capacity import CostModel
    from specsplit.cloud.engine.target import Open, Verify

    cost = CostModel()
    for rows, ms in {1: 93, 4: 200, 16: 630, 64: 2360, 128: 4660}.items():
        for _ in range(3):
            cost.observe(rows, ms)
    target.acceptance.accepted, target.acceptance.rejected = 8.0, 2.0  # a = 0.8
    for sid in range(8):
        target.start(sid, [5, 9, 2], GREEDY)
    hints = []
    for with_prefill in (False, True):
        target.cost = CostModel()
        target.cost.ms, target.cost.samples = dict(cost.ms), {}  # fixed: passes leave it be
        target.cost.observe = lambda rows, ms: None
        requests = [Verify(sid, target.sessions[sid].cache_len + 1, [2]) for sid in range(8)]
        if with_prefill:
            requests.append(Open(99, list(range(45)), GREEDY))
        target.run(requests)
        hints.append(target.last_pass.max_draft_tokens_hint)
    assert hints[0] == hints[1] == 1
